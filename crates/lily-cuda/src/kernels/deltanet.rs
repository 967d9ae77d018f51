//! deltanet.cu: the Gated DeltaNet (MODEL.md §2.5) between the input projections and out_proj:
//! causal conv and conv-state update, per-token prep (norms, gates), the recurrence (token by
//! token, or in chunks on the tensor cores: `DnScan`), the gated norm.

use anyhow::{bail, Result};
use lily_core::config::ModelConfig;

use super::{blocks, config, KernelFile};
use crate::gpu::{Gpu, Kernel, Module};

/// Largest conv kernel width.
pub const DN_MAX_K: usize = 8;
/// Largest key head dim (a multiple of 32).
pub const DN_MAX_DK: usize = 128;
/// Value columns per dn_recurrent block (4 warps × 4 columns).
pub const DN_COLS_PER_BLOCK: usize = 16;
/// Tokens a chunk of the tensor-core scan (dn_wy_prep / dn_wy_scan; the kernels assign warps to
/// 64-token chunks).
pub const DN_WY_C: usize = 64;
/// Value columns a dn_wy_scan block (its state slice, [dk, 32] fp32, in registers).
pub const DN_WY_COLS: usize = 32;
/// Threads of a dn_wy_prep and of a dn_wy_scan block (8 warps).
pub const DN_WY_PREP_THREADS: usize = 256;
pub const DN_WY_SCAN_THREADS: usize = 256;
/// Row strides (f32) of deltanet.cu's shared tiles: [C][dk] (DN_WY_LD), [C][C] (DN_WY_LDC), the
/// scan's [·][32] B operands (DN_WY_LDV).
const WY_LD: usize = DN_MAX_DK + 4;
const WY_LDC: usize = DN_WY_C + 4;
const WY_LDV: usize = DN_WY_COLS + 8;
/// dn_wy_prep's dynamic shared memory: K and Q-then-V [C][LD], A and T [C][LDC], G, β, β e^G [C]
/// (103,168 bytes: two blocks an SM on sm_90).
pub const DN_WY_PREP_SMEM: usize = 4 * (2 * DN_WY_C * WY_LD + 2 * DN_WY_C * WY_LDC + 3 * DN_WY_C);
/// dn_wy_scan's: W, Q, K [C][LD], P [C][LDC], the state slice [DN_MAX_DK][LDV], Δ [C][LDV], G and
/// the decays [C] (150,016 bytes: sm_80 and sm_90 grant it, the 99 KB parts do not).
pub const DN_WY_SCAN_SMEM: usize = 4
    * (3 * DN_WY_C * WY_LD
        + DN_WY_C * WY_LDC
        + DN_MAX_DK * WY_LDV
        + DN_WY_C * WY_LDV
        + 2 * DN_WY_C);
/// Shared memory a block must be granted for the tensor-core scan (the larger of its two kernels).
pub const DN_WY_SMEM: usize = if DN_WY_SCAN_SMEM > DN_WY_PREP_SMEM {
    DN_WY_SCAN_SMEM
} else {
    DN_WY_PREP_SMEM
};

/// f32 of dn_wy_prep's records for an `n_tok`-token chunk: per 64-token chunk and value head, W
/// [C][dk], U [C][dv], P [C][C], G [C] (dn_wy_rec_floats in deltanet.cu).
pub fn wy_records(s: DnShape, n_tok: usize) -> usize {
    n_tok.div_ceil(DN_WY_C) * s.n_v * DN_WY_C * (s.dk + s.dv + DN_WY_C + 1)
}

/// Whether the tensor-core scan takes these heads: dk and dv multiples of 32 up to DN_MAX_DK
/// (dn_wy_scan's column slices, the tiles' rows).
pub fn wy_fits(s: DnShape) -> bool {
    s.dk.is_multiple_of(32)
        && s.dk <= DN_MAX_DK
        && s.dv.is_multiple_of(DN_WY_COLS)
        && s.dv <= DN_MAX_DK
        && s.n_k > 0
        && s.n_v.is_multiple_of(s.n_k)
}

/// Which kernels run prefill's DeltaNet recurrence (the plan's `deltanet_scan`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DnScan {
    /// dn_recurrent: token by token, fp32 on the CUDA cores.
    Recurrent,
    /// dn_wy_prep (every chunk's W, U, P at once) + dn_wy_scan (the chunks in order): the chunked
    /// form on the tensor cores (tf32 products, fp32 sums and state).
    Chunked,
}

pub const FILE: KernelFile = KernelFile {
    name: "deltanet",
    source: include_str!("../../../../shaders/cuda/deltanet.cu"),
    defines: &[
        ("DN_MAX_K", DN_MAX_K as i64),
        ("DN_MAX_DK", DN_MAX_DK as i64),
        ("DN_COLS_PER_BLOCK", DN_COLS_PER_BLOCK as i64),
        ("DN_WY_C", DN_WY_C as i64),
        ("DN_WY_COLS", DN_WY_COLS as i64),
        ("DN_WY_PREP_THREADS", DN_WY_PREP_THREADS as i64),
        ("DN_WY_SCAN_THREADS", DN_WY_SCAN_THREADS as i64),
    ],
};

/// The model's DeltaNet shapes against the kernels' limits.
pub fn check_limits(cfg: &ModelConfig) -> Result<()> {
    if cfg.conv_kernel > DN_MAX_K {
        bail!(
            "linear_conv_kernel_dim {} exceeds the CUDA conv kernel's limit {DN_MAX_K}",
            cfg.conv_kernel
        );
    }
    if cfg.dn_k_dim > DN_MAX_DK || !cfg.dn_k_dim.is_multiple_of(32) {
        bail!(
            "linear_key_head_dim {} is not what the CUDA DeltaNet kernel takes (a multiple of 32 up to {DN_MAX_DK})",
            cfg.dn_k_dim
        );
    }
    if !cfg.dn_v_dim.is_multiple_of(DN_COLS_PER_BLOCK) {
        bail!(
            "linear_value_head_dim {} is not a multiple of {DN_COLS_PER_BLOCK} (the CUDA DeltaNet kernel's column block)",
            cfg.dn_v_dim
        );
    }
    Ok(())
}

/// Shapes of the Gated DeltaNet of one model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DnShape {
    pub n_k: usize,
    pub n_v: usize,
    pub dk: usize,
    pub dv: usize,
}

impl DnShape {
    pub fn of(cfg: &ModelConfig) -> DnShape {
        DnShape {
            n_k: cfg.dn_k_heads,
            n_v: cfg.dn_v_heads,
            dk: cfg.dn_k_dim,
            dv: cfg.dn_v_dim,
        }
    }
}

/// The causal conv of a chunk: `m` [T, conv_dim] (row stride `m_stride`) through the conv
/// `weight` [conv_dim, k] with the carried `conv_state`, into `c` [T, conv_dim].
pub struct Conv {
    pub m: u64,
    pub m_stride: usize,
    pub conv_state: u64,
    pub weight: u64,
    pub c: u64,
    pub n_tok: usize,
    pub conv_dim: usize,
    pub k: usize,
}

pub struct DnRecurrent {
    pub c: u64,
    pub b: u64,
    pub a: u64,
    pub ba_stride: usize,
    pub a_log: u64,
    pub dt_bias: u64,
    pub state: u64,
    pub o: u64,
    /// Scratch: normalised q and k [T, Hk, 2, dk], and (g = ln α, β) [T, Hv, 2].
    pub qk: u64,
    pub ab: u64,
    /// Scratch for `DnScan::Chunked`: `wy_records(shape, n_tok)` f32 (0 where none was allocated).
    pub records: u64,
}

/// y = RMSNorm(o) · weight · silu(z) per value head.
pub struct GatedNorm {
    pub o: u64,
    pub z: u64,
    pub z_stride: usize,
    pub weight: u64,
    pub y: u64,
    pub n_tok: usize,
    pub eps: f32,
}

/// dn_prep's epsilon of the q/k L2 norms.
pub const PREP_EPS: f32 = 1e-6;

pub struct DeltaNet {
    conv: Kernel,
    conv_state: Kernel,
    prep: Kernel,
    recurrent: Kernel,
    /// dn_wy_prep and dn_wy_scan, where the device grants them DN_WY_SMEM of shared memory.
    wy: Option<(Kernel, Kernel)>,
    gated_norm: Kernel,
}

impl DeltaNet {
    pub fn load(m: &Module) -> Result<DeltaNet> {
        Ok(DeltaNet {
            conv: m.kernel("dn_conv")?,
            conv_state: m.kernel("dn_conv_state")?,
            prep: m.kernel("dn_prep")?,
            recurrent: m.kernel("dn_recurrent")?,
            // A refusal only means this device lacks the shared memory; the plan then never asks
            // for them (`DeviceCaps::max_shared_memory`).
            wy: match (
                m.kernel("dn_wy_prep")?.allow_shared_memory(DN_WY_PREP_SMEM),
                m.kernel("dn_wy_scan")?.allow_shared_memory(DN_WY_SCAN_SMEM),
            ) {
                (Ok(prep), Ok(scan)) => Some((prep, scan)),
                _ => None,
            },
            gated_norm: m.kernel("dn_gated_norm")?,
        })
    }

    /// The causal conv over a chunk (one thread per channel and token), then the conv state
    /// update.
    pub fn conv(&self, gpu: &Gpu, a: &Conv) -> Result<()> {
        let m_stride = a.m_stride as i32;
        let (n_tok, conv_dim, k) = (a.n_tok as i32, a.conv_dim as i32, a.k as i32);
        let cfg = config((blocks(a.conv_dim, 128), a.n_tok as u32, 1), 128, 0);
        gpu.launch(&self.conv, cfg, |l| {
            l.arg(&a.m)
                .arg(&m_stride)
                .arg(&a.conv_state)
                .arg(&a.weight)
                .arg(&a.c)
                .arg(&n_tok)
                .arg(&conv_dim)
                .arg(&k);
        })?;
        let cfg = config((blocks(a.conv_dim, 128), 1, 1), 128, 0);
        gpu.launch(&self.conv_state, cfg, |l| {
            l.arg(&a.m)
                .arg(&m_stride)
                .arg(&a.conv_state)
                .arg(&n_tok)
                .arg(&conv_dim)
                .arg(&k);
        })
    }

    /// dn_prep (norms and gates of every token, in parallel), then the recurrence by `kernel`:
    /// dn_recurrent, or dn_wy_prep + dn_wy_scan. (The chunked forms on the CUDA cores, dn_chunked
    /// and dn_chunk_wu + dn_chunk_scan, lost to dn_recurrent on the H200 and were removed:
    /// docs/perf-notes.md, sessions 7-8.)
    pub fn scan(
        &self,
        gpu: &Gpu,
        kernel: DnScan,
        s: DnShape,
        b: &DnRecurrent,
        n_tok: usize,
    ) -> Result<()> {
        let conv_dim = (2 * s.n_k * s.dk + s.n_v * s.dv) as i32;
        let ba_stride = b.ba_stride as i32;
        let (n, n_k, n_v) = (n_tok as i32, s.n_k as i32, s.n_v as i32);
        let (dk, dv) = (s.dk as i32, s.dv as i32);
        let cfg = config((n_tok as u32, s.n_k as u32, 1), 128, 0);
        gpu.launch(&self.prep, cfg, |l| {
            l.arg(&b.c)
                .arg(&conv_dim)
                .arg(&b.b)
                .arg(&b.a)
                .arg(&ba_stride)
                .arg(&b.a_log)
                .arg(&b.dt_bias)
                .arg(&b.qk)
                .arg(&b.ab)
                .arg(&n)
                .arg(&n_k)
                .arg(&n_v)
                .arg(&dk)
                .arg(&PREP_EPS);
        })?;
        let tail = [n, n_k, n_v, dk, dv];
        match kernel {
            DnScan::Recurrent => {
                let cfg = config((s.n_v as u32, (s.dv / DN_COLS_PER_BLOCK) as u32, 1), 128, 0);
                gpu.launch(&self.recurrent, cfg, |l| {
                    l.arg(&b.c).arg(&b.qk).arg(&b.ab).arg(&b.state).arg(&b.o);
                    for v in &tail {
                        l.arg(v);
                    }
                })
            }
            DnScan::Chunked => {
                let Some((prep, scan)) = &self.wy else {
                    bail!("dn_wy_prep / dn_wy_scan: this device did not grant their {DN_WY_SMEM} bytes of shared memory");
                };
                if b.records == 0 || !wy_fits(s) {
                    bail!("the chunked DeltaNet scan needs its records' scratch and heads it takes (dk, dv multiples of 32 up to {DN_MAX_DK}): {s:?}");
                }
                let grid = (n_tok.div_ceil(DN_WY_C) as u32, s.n_v as u32, 1);
                let cfg = config(grid, DN_WY_PREP_THREADS as u32, DN_WY_PREP_SMEM);
                gpu.launch(prep, cfg, |l| {
                    l.arg(&b.c).arg(&b.qk).arg(&b.ab).arg(&b.records);
                    for v in &tail {
                        l.arg(v);
                    }
                })?;
                let grid = (s.n_v as u32, (s.dv / DN_WY_COLS) as u32, 1);
                let cfg = config(grid, DN_WY_SCAN_THREADS as u32, DN_WY_SCAN_SMEM);
                gpu.launch(scan, cfg, |l| {
                    l.arg(&b.qk).arg(&b.records).arg(&b.state).arg(&b.o);
                    for v in &tail {
                        l.arg(v);
                    }
                })
            }
        }
    }

    /// One block of 128 threads per (token, value head).
    pub fn gated_norm(&self, gpu: &Gpu, s: DnShape, a: &GatedNorm) -> Result<()> {
        let z_stride = a.z_stride as i32;
        let (n_tok, n_v, dv) = (a.n_tok as i32, s.n_v as i32, s.dv as i32);
        let cfg = config((a.n_tok as u32, s.n_v as u32, 1), 128, 0);
        gpu.launch(&self.gated_norm, cfg, |l| {
            l.arg(&a.o)
                .arg(&a.z)
                .arg(&z_stride)
                .arg(&a.weight)
                .arg(&a.y)
                .arg(&n_tok)
                .arg(&n_v)
                .arg(&dv)
                .arg(&a.eps);
        })
    }
}
