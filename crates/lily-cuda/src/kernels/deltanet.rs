//! deltanet.cu: the Gated DeltaNet (MODEL.md §2.5) between the input projections and out_proj:
//! causal conv and conv-state update, per-token prep (norms, gates), the recurrence, the gated
//! norm.

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
/// dn_chunked: tokens per chunk and value columns per block (DNC_C, DNC_COLS in deltanet.cu).
pub const DNC_C: usize = 64;
pub const DNC_COLS: usize = 32;
/// dn_chunked's dynamic shared memory: K, Q and W [64][132], A and P [64][65], β ⊙ V / U / V'
/// [64][33], the state's slice [DN_MAX_DK][32], four vectors of 64 (f32).
pub const DNC_SMEM: usize = 4
    * (3 * DNC_C * 132
        + 2 * DNC_C * (DNC_C + 1)
        + DNC_C * (DNC_COLS + 1)
        + DN_MAX_DK * DNC_COLS
        + 4 * DNC_C);
/// dn_chunk_wu's dynamic shared memory (f32): K, Q and W [64][132], U [64][dv + 1], A and P
/// [64][65], Γ and β [64].
pub const fn dnc_wu_smem(dv: usize) -> usize {
    4 * (3 * DNC_C * 132 + DNC_C * (dv + 1) + 2 * DNC_C * (DNC_C + 1) + 2 * DNC_C)
}
/// dn_chunk_scan's dynamic shared memory (f32): K, Q and W [64][132], P [64][65], V' [64][33],
/// the state's slice [DN_MAX_DK][32], e^Γ and e^{Γ_last − Γ} [64].
pub const DNC_SCAN_SMEM: usize = 4
    * (3 * DNC_C * 132
        + DNC_C * (DNC_C + 1)
        + DNC_C * (DNC_COLS + 1)
        + DN_MAX_DK * DNC_COLS
        + 2 * DNC_C);
/// Largest value head dim of dn_chunk_wu (a thread per column of W and of U: dk + dv ≤ 256).
pub const DNC_WU_MAX_DV: usize = 128;

/// f32 elements of dn_chunk_wu's records for `n_tok` tokens: per value head and chunk of DNC_C,
/// W [DNC_C][dk], U [DNC_C][dv], P [DNC_C][DNC_C] and Γ [DNC_C] (dnc_rec_floats in deltanet.cu).
pub fn chunk_records(s: DnShape, n_tok: usize) -> usize {
    s.n_v * n_tok.div_ceil(DNC_C) * DNC_C * (s.dk + s.dv + DNC_C + 1)
}

pub const FILE: KernelFile = KernelFile {
    name: "deltanet",
    source: include_str!("../../../../shaders/cuda/deltanet.cu"),
    defines: &[
        ("DN_MAX_K", DN_MAX_K as i64),
        ("DN_MAX_DK", DN_MAX_DK as i64),
        ("DN_COLS_PER_BLOCK", DN_COLS_PER_BLOCK as i64),
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
#[derive(Clone, Copy, Debug)]
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
    /// Scratch: normalised q and k [T, Hk, 2, dk], and (α, β) [T, Hv, 2].
    pub qk: u64,
    pub ab: u64,
    /// Scratch for the two-launch chunked scan (`chunk_records` elements for the chunk), or 0:
    /// the chunked scan then runs as the one kernel dn_chunked.
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
    /// dn_chunked, where the device grants its shared memory (160 KB: sm_80, sm_90; not the
    /// 99 KB parts).
    chunked: Option<Kernel>,
    /// dn_chunk_wu + dn_chunk_scan (the chunked scan in two launches), likewise.
    chunked_split: Option<(Kernel, Kernel)>,
    gated_norm: Kernel,
}

impl DeltaNet {
    pub fn load(m: &Module) -> Result<DeltaNet> {
        Ok(DeltaNet {
            conv: m.kernel("dn_conv")?,
            conv_state: m.kernel("dn_conv_state")?,
            prep: m.kernel("dn_prep")?,
            recurrent: m.kernel("dn_recurrent")?,
            // A refusal only means this device lacks the shared memory: the sequential scan serves.
            chunked: m.kernel("dn_chunked")?.allow_shared_memory(DNC_SMEM).ok(),
            chunked_split: match (
                m.kernel("dn_chunk_wu")?
                    .allow_shared_memory(dnc_wu_smem(DNC_WU_MAX_DV)),
                m.kernel("dn_chunk_scan")?
                    .allow_shared_memory(DNC_SCAN_SMEM),
            ) {
                (Ok(wu), Ok(scan)) => Some((wu, scan)),
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

    /// dn_prep (norms and gates of every token, in parallel) then the recurrence: where
    /// `takes_chunked`, dn_chunk_wu + dn_chunk_scan when the caller gives the records' scratch,
    /// else dn_chunked; otherwise dn_recurrent.
    pub fn recurrent(&self, gpu: &Gpu, s: DnShape, b: &DnRecurrent, n_tok: usize) -> Result<()> {
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
        // Every scan kernel ends its arguments with the chunk's length and the heads' shape.
        let tail = [n, n_k, n_v, dk, dv];
        if let Some((wu, scan)) = self.chunked_split.as_ref().filter(|_| {
            b.records != 0 && s.dv <= DNC_WU_MAX_DV && self.takes_chunked(gpu, s, n_tok)
        }) {
            let grid = (n_tok.div_ceil(DNC_C) as u32, s.n_v as u32, 1);
            gpu.launch(wu, config(grid, 256, dnc_wu_smem(s.dv)), |l| {
                l.arg(&b.c).arg(&b.qk).arg(&b.ab).arg(&b.records);
                for v in &tail {
                    l.arg(v);
                }
            })?;
            let grid = (s.n_v as u32, (s.dv / DNC_COLS) as u32, 1);
            return gpu.launch(scan, config(grid, 256, DNC_SCAN_SMEM), |l| {
                l.arg(&b.qk).arg(&b.records).arg(&b.state).arg(&b.o);
                for v in &tail {
                    l.arg(v);
                }
            });
        }
        // dn_chunked and dn_recurrent take the same arguments.
        let chunked = self
            .chunked
            .as_ref()
            .filter(|_| self.takes_chunked(gpu, s, n_tok));
        let (kernel, cfg) = match chunked {
            Some(k) => (
                k,
                config((s.n_v as u32, (s.dv / DNC_COLS) as u32, 1), 256, DNC_SMEM),
            ),
            None => (
                &self.recurrent,
                config((s.n_v as u32, (s.dv / DN_COLS_PER_BLOCK) as u32, 1), 128, 0),
            ),
        };
        gpu.launch(kernel, cfg, |l| {
            l.arg(&b.c).arg(&b.qk).arg(&b.ab).arg(&b.state).arg(&b.o);
            for v in &tail {
                l.arg(v);
            }
        })
    }

    /// Whether `recurrent` runs dn_chunked for this chunk: the plan's `chunked_scan`, the device
    /// granted its shared memory, at least one whole chunk of tokens, dk a multiple of 4 up to
    /// DN_MAX_DK, dv a multiple of DNC_COLS.
    pub fn takes_chunked(&self, gpu: &Gpu, s: DnShape, n_tok: usize) -> bool {
        gpu.switches.chunked_scan
            && self.chunked.is_some()
            && n_tok >= DNC_C
            && s.dk <= DN_MAX_DK
            && s.dk.is_multiple_of(4)
            && s.dv.is_multiple_of(DNC_COLS)
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
