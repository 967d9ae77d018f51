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
    gated_norm: Kernel,
}

impl DeltaNet {
    pub fn load(m: &Module) -> Result<DeltaNet> {
        Ok(DeltaNet {
            conv: m.kernel("dn_conv")?,
            conv_state: m.kernel("dn_conv_state")?,
            prep: m.kernel("dn_prep")?,
            recurrent: m.kernel("dn_recurrent")?,
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

    /// dn_prep (norms and gates of every token, in parallel) then the recurrence, token by token
    /// (dn_recurrent). The chunked forms of the scan on the CUDA cores (dn_chunked, dn_chunk_wu +
    /// dn_chunk_scan) lost to it on the H200 and were removed (docs/perf-notes.md, sessions 7-8).
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
        let tail = [n, n_k, n_v, dk, dv];
        let cfg = config((s.n_v as u32, (s.dv / DN_COLS_PER_BLOCK) as u32, 1), 128, 0);
        gpu.launch(&self.recurrent, cfg, |l| {
            l.arg(&b.c).arg(&b.qk).arg(&b.ab).arg(&b.state).arg(&b.o);
            for v in &tail {
                l.arg(v);
            }
        })
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
