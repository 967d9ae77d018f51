//! gemm.cu: linears of prefill chunks on tensor cores (bf16 mma, fp32 accumulation), 64 (or 32)
//! tokens × GEMM_BN output rows per block, two shared-memory stages.

use anyhow::{bail, Result};

use super::{blocks, check_x, config, Grouped, KernelFile, Project, Store};
use crate::gpu::{Gpu, Kernel, Module};
use crate::weights::DevLinear;

/// Output rows per block.
pub const GEMM_BN: usize = 128;
/// Weight columns per k-step.
pub const GEMM_BK: usize = 64;
/// bf16 per shared-memory row: 144 bytes, ldmatrix without bank conflicts.
pub const GEMM_LDS: usize = GEMM_BK + 8;
pub const GEMM_THREADS: usize = 256;
/// Tokens per block of gemm_dense / gemm_dense_exact.
const DENSE_BM: usize = 64;

pub const FILE: KernelFile = KernelFile {
    name: "gemm",
    source: include_str!("../../../../shaders/cuda/gemm.cu"),
    defines: &[
        ("GEMM_BN", GEMM_BN as i64),
        ("GEMM_BK", GEMM_BK as i64),
        ("GEMM_LDS", GEMM_LDS as i64),
        ("GEMM_THREADS", GEMM_THREADS as i64),
    ],
};

/// Dynamic shared memory of a block with `bm` rows: two stages of A and B tiles in bf16.
pub const fn gemm_smem(bm: usize) -> usize {
    2 * (bm + GEMM_BN) * GEMM_LDS * 2
}

/// gemm_dense_exact's dynamic shared memory: gemm_smem plus two stages of residue tiles.
pub const fn gemm_smem_exact(bm: usize) -> usize {
    gemm_smem(bm) + 2 * GEMM_BN * GEMM_LDS * 2
}

/// Dynamic shared memory of the largest tile (64 tokens).
const GEMM_SMEM_MAX: usize = gemm_smem(64);

/// Whether these kernels take this weight's layout: whole k-steps, 4/8-bit groups that do not
/// straddle a 32-column fragment, or bf16.
pub fn fits(w: &DevLinear) -> bool {
    w.cols.is_multiple_of(GEMM_BK)
        && matches!(w.bits, 4 | 8 | 16)
        && (w.bits == 16 || w.group.is_multiple_of(32))
}

pub struct Gemm {
    dense: Kernel,
    dense_exact: Kernel,
    grouped64: Kernel,
    grouped32: Kernel,
}

impl Gemm {
    pub fn load(m: &Module) -> Result<Gemm> {
        Ok(Gemm {
            dense: m.kernel("gemm_dense")?.allow_shared_memory(GEMM_SMEM_MAX)?,
            dense_exact: m
                .kernel("gemm_dense_exact")?
                .allow_shared_memory(gemm_smem_exact(DENSE_BM))?,
            grouped64: m
                .kernel("gemm_grouped64")?
                .allow_shared_memory(GEMM_SMEM_MAX)?,
            grouped32: m
                .kernel("gemm_grouped32")?
                .allow_shared_memory(GEMM_SMEM_MAX)?,
        })
    }

    /// y (+)= W x on tensor cores (weights and activations as bf16, fp32 sums).
    pub fn dense(&self, gpu: &Gpu, a: &Project, store: Store) -> Result<()> {
        check_x("gemm_dense", a.x)?;
        let w = a.w.arg();
        let (x_stride, y_stride, n_tok) = (a.x.stride as i32, a.y.stride as i32, a.n_tok as i32);
        let accumulate: i32 = match store {
            Store::Overwrite => 0,
            Store::AddToResidual => 1,
        };
        let grid = (blocks(a.w.rows, GEMM_BN), blocks(a.n_tok, DENSE_BM), 1);
        let cfg = config(grid, GEMM_THREADS as u32, gemm_smem(DENSE_BM));
        gpu.launch(&self.dense, cfg, |l| {
            l.arg(&w)
                .arg(&a.x.ptr)
                .arg(&x_stride)
                .arg(&a.y.ptr)
                .arg(&y_stride)
                .arg(&n_tok)
                .arg(&accumulate);
        })
    }

    /// y = W x in split precision (each weight as bf16 hi + lo, two mma, sums unrounded): the
    /// MoE router's logits with fp32 weights' precision; x is bf16-valued in bf16 mode.
    pub fn dense_exact(&self, gpu: &Gpu, a: &Project) -> Result<()> {
        check_x("linear_router", a.x)?;
        let w = a.w.arg();
        let (x_stride, y_stride, n_tok) = (a.x.stride as i32, a.y.stride as i32, a.n_tok as i32);
        let grid = (blocks(a.w.rows, GEMM_BN), blocks(a.n_tok, DENSE_BM), 1);
        let cfg = config(grid, GEMM_THREADS as u32, gemm_smem_exact(DENSE_BM));
        gpu.launch(&self.dense_exact, cfg, |l| {
            l.arg(&w)
                .arg(&a.x.ptr)
                .arg(&x_stride)
                .arg(&a.y.ptr)
                .arg(&y_stride)
                .arg(&n_tok);
        })
    }

    /// The routed experts on tensor cores over tiles of 32 or 64 items (`a.groups.tile`, the
    /// tile moe_group built them with).
    pub fn grouped(&self, gpu: &Gpu, a: &Grouped) -> Result<()> {
        check_x("gemm_grouped", a.x)?;
        let g = a.groups;
        let kernel = match g.tile {
            64 => &self.grouped64,
            32 => &self.grouped32,
            t => bail!("gemm_grouped: tiles of {t} items (expected 32 or 64)"),
        };
        let w = a.w.arg();
        let (x_stride, x_div, y_stride) = (a.x.stride as i32, a.x_div as i32, a.y.stride as i32);
        let grid = (blocks(a.w.rows, GEMM_BN), g.max_tiles as u32, 1);
        let cfg = config(grid, GEMM_THREADS as u32, gemm_smem(g.tile));
        gpu.launch(kernel, cfg, |l| {
            l.arg(&w)
                .arg(&g.perm)
                .arg(&g.tiles)
                .arg(&g.n_tiles)
                .arg(&a.x.ptr)
                .arg(&x_stride)
                .arg(&x_div)
                .arg(&a.y.ptr)
                .arg(&y_stride);
        })
    }
}
