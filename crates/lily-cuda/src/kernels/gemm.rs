//! gemm.cu: linears of prefill chunks on tensor cores (bf16 mma, fp32 accumulation), 64 (or 32)
//! tokens × GEMM_BN output rows per block, two shared-memory stages.

use anyhow::{bail, Result};

use super::{blocks, check_x, config, Grouped, KernelFile, Project, Rows, Store};
use crate::gpu::{Gpu, Kernel, Module};
use crate::weights::LinearShape;

/// Output rows per block.
pub const GEMM_BN: usize = 128;
/// Weight columns per k-step.
pub const GEMM_BK: usize = 64;
/// bf16 per shared-memory row: 144 bytes, ldmatrix without bank conflicts.
pub const GEMM_LDS: usize = GEMM_BK + 8;
pub const GEMM_THREADS: usize = 256;
/// Tokens per block of gemm_dense / gemm_dense_exact.
pub const DENSE_BM: usize = 64;
/// gemm_dense_wgb(256) / gemm_grouped_wgb32/64/128 (wgmma, sm_90a): weight rows per block
/// (WG_ROWS in gemm.cu), the fewest tokens a block of the dense kernels has (128; 256 for
/// gemm_dense_wgb256, the plan's `wgb_tok`; items: the tile for the grouped ones), k-steps of 64
/// columns in the ring.
pub const WG_ROWS: usize = 128;
pub const WG_TOK: usize = 128;
/// The fewest tokens of a chunk whose dense projections take gemm_dense_wgb256 when the plan's
/// `wgb_tok` is 256 (it loses to gemm_dense_wgb at 512 tokens: 19.3 against 13.0 µs, 2048×512).
pub const WGB256_MIN_TOK: usize = 2048;
pub const WGB_STAGES: usize = 5;
/// gemm_grouped_wgb32's ring: a stage holds 4 KB of activations beside 4 KB of weights, so seven
/// stages (six k-steps ahead; 73 KB a block with 32 groups a row) and three blocks a
/// multiprocessor (228 KB) keep 3 × 6 k-steps of weights in flight on an SM where
/// gemm_grouped_wgb64 keeps 2 × 4.
pub const WGB32_STAGES: usize = 7;
/// The most items experts average in a staged chunk whose routed experts take gemm_grouped_wgb32
/// under the plan's `wgmma_narrow_tiles` (chunks up to 768 tokens at Qwen3.6's 8 of 256): at 24
/// a tile of 32 holds most experts' items, at 32 a quarter of them would need a second tile.
pub const NARROW_MAX_AVG: usize = 24;
/// The most groups a row of the wgmma kernels' weights may have (its scales and biases are held
/// in shared memory: 128 rows × groups × 4 bytes).
pub const WG_MAX_GROUPS: usize = 64;

pub const FILE: KernelFile = KernelFile {
    name: "gemm",
    source: include_str!("../../../../shaders/cuda/gemm.cu"),
    defines: &[
        ("GEMM_BN", GEMM_BN as i64),
        ("GEMM_BK", GEMM_BK as i64),
        ("GEMM_LDS", GEMM_LDS as i64),
        ("GEMM_THREADS", GEMM_THREADS as i64),
        ("WGB_STAGES", WGB_STAGES as i64),
        ("WGB32_STAGES", WGB32_STAGES as i64),
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

/// The wgmma kernels' dynamic shared memory for `tok` tokens a block and `groups` groups a row:
/// 1 KB of alignment slack, the ring (`wgb_stages(tok)` × (tok × 128 + WG_ROWS × 32 bytes)), the
/// (scale, bias) pairs (WG_ROWS × groups × 4).
pub const fn wgb_smem(tok: usize, groups: usize) -> usize {
    1024 + wgb_stages(tok) * (tok * 128 + WG_ROWS * 32) + WG_ROWS * groups * 4
}

/// The ring's k-steps of the wgmma kernel with `tok` tokens a block (WGB32_STAGES for 32).
pub const fn wgb_stages(tok: usize) -> usize {
    if tok == 32 {
        WGB32_STAGES
    } else {
        WGB_STAGES
    }
}

/// Whether the device runs the wgmma kernels (sm_90a; elsewhere they are compiled as traps).
pub fn runs_wgmma(gpu: &Gpu) -> bool {
    gpu.caps().wgmma
}

/// Whether the wgmma kernels take this weight: 4-bit, an even number of 64-column k-steps,
/// groups of a power of two ≥ 16 columns (a 16-column slice in one group, found by a shift), at
/// most WG_MAX_GROUPS groups a row.
pub fn wg_fits(w: &LinearShape) -> bool {
    w.bits == 4
        && w.cols.is_multiple_of(2 * GEMM_BK)
        && w.group >= 16
        && w.group.is_power_of_two()
        && w.cols / w.group <= WG_MAX_GROUPS
}

/// Blocks of gemm_dense_exact's grid for a `rows`-row weight and `n_tok` tokens, before any split
/// of its columns.
pub fn exact_blocks(rows: usize, n_tok: usize) -> usize {
    rows.div_ceil(GEMM_BN) * n_tok.div_ceil(DENSE_BM)
}

/// Parts the router's columns are split into (the plan's `router` under `router_split_k`): the
/// largest power of two up to EXACT_MAX_PARTS that keeps `base` blocks × parts within two a
/// multiprocessor, divides the `steps` k-steps, and keeps parts × `out` floats within
/// EXACT_PART_FLOATS; 1 where the unsplit grid already fills the device.
pub fn exact_parts(base: usize, sm_count: usize, steps: usize, out: usize) -> usize {
    let mut parts = 1;
    while parts < EXACT_MAX_PARTS
        && base * parts * 2 <= 2 * sm_count
        && steps.is_multiple_of(parts * 2)
        && out * parts * 2 <= EXACT_PART_FLOATS
    {
        parts *= 2;
    }
    parts
}

/// Dynamic shared memory of the largest tile (64 tokens).
const GEMM_SMEM_MAX: usize = gemm_smem(64);

/// Whether these kernels take this weight's layout: whole k-steps, 4/8-bit groups that do not
/// straddle a 32-column fragment, or bf16.
pub fn fits(w: &LinearShape) -> bool {
    w.cols.is_multiple_of(GEMM_BK)
        && matches!(w.bits, 4 | 8 | 16)
        && (w.bits == 16 || w.group.is_multiple_of(32))
}

/// The router's split-K partial sums (`Gemm::dense_exact`): at most this many floats (parts ×
/// tokens × rows; 8 MB), fewer parts where a chunk would need more.
pub const EXACT_PART_FLOATS: usize = 2 << 20;
/// The most parts `Gemm::dense_exact` splits the router's columns into.
pub const EXACT_MAX_PARTS: usize = 8;

/// The dense (one weight) tensor-core kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DenseGemm {
    /// `gemm_dense`: mma.sync, DENSE_BM tokens a block, reads the f32 input.
    Mma,
    /// `gemm_dense_wgb`: wgmma (sm_90a), WG_TOK tokens a block, reads the input staged as bf16.
    Wgb,
    /// `gemm_dense_wgb256`: the same with 256 tokens a block.
    Wgb256,
    /// `gemm_dense_wgb_lean` / `gemm_dense_wgb256_lean`: the same with the lean dequantisation
    /// (the plan's `wgmma_lean_dequant`, `lean_fits` weights): bit-identical outputs.
    WgbLean,
    Wgb256Lean,
}

impl DenseGemm {
    /// The kernel's variant with the lean dequantisation (the wgmma ones; others as they are).
    pub fn lean(self) -> DenseGemm {
        match self {
            DenseGemm::Wgb => DenseGemm::WgbLean,
            DenseGemm::Wgb256 => DenseGemm::Wgb256Lean,
            k => k,
        }
    }
}

/// Whether the wgmma kernels' lean dequantisation (`_lean`) takes weight `w`: groups of at
/// least 64 columns, so a k-step (64 columns) is one group a row.
pub fn lean_fits(w: &LinearShape) -> bool {
    w.group >= 64
}

/// The routed experts' tensor-core kernels, each over tiles of its own size (`tile`), the tiles
/// moe_group built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupedGemm {
    /// `gemm_grouped32` / `gemm_grouped64`: mma.sync, reads the f32 input.
    Mma32,
    Mma64,
    /// `gemm_grouped_wgb32` / `gemm_grouped_wgb64` / `gemm_grouped_wgb128`: wgmma (sm_90a),
    /// reads the input staged as bf16 (32: a deeper ring, three blocks a multiprocessor).
    Wgb32,
    Wgb64,
    Wgb128,
    /// `gemm_grouped_wgb32_lean` / `_wgb64_lean` / `_wgb128_lean`: the same with the lean
    /// dequantisation (the plan's `wgmma_lean_dequant`, `lean_fits` weights): bit-identical.
    Wgb32Lean,
    Wgb64Lean,
    Wgb128Lean,
    /// `gemm_grouped_wgb32_hoist` / `_wgb64_hoist` / `_wgb128_hoist`: the _lean kernels with a
    /// k-step's addresses held in registers (the plan's `wgmma_hoisted_addrs`): bit-identical.
    Wgb32Hoist,
    Wgb64Hoist,
    Wgb128Hoist,
}

impl GroupedGemm {
    /// Items a tile.
    pub fn tile(self) -> usize {
        match self {
            GroupedGemm::Mma32
            | GroupedGemm::Wgb32
            | GroupedGemm::Wgb32Lean
            | GroupedGemm::Wgb32Hoist => 32,
            GroupedGemm::Mma64
            | GroupedGemm::Wgb64
            | GroupedGemm::Wgb64Lean
            | GroupedGemm::Wgb64Hoist => 64,
            GroupedGemm::Wgb128 | GroupedGemm::Wgb128Lean | GroupedGemm::Wgb128Hoist => 128,
        }
    }

    /// The kernel's variant with the lean dequantisation (the wgmma ones; others as they are).
    pub fn lean(self) -> GroupedGemm {
        match self {
            GroupedGemm::Wgb32 => GroupedGemm::Wgb32Lean,
            GroupedGemm::Wgb64 => GroupedGemm::Wgb64Lean,
            GroupedGemm::Wgb128 => GroupedGemm::Wgb128Lean,
            k => k,
        }
    }

    /// The _lean kernel's variant with its addresses held in registers (`_hoist`; others as
    /// they are).
    pub fn hoist(self) -> GroupedGemm {
        match self {
            GroupedGemm::Wgb32Lean => GroupedGemm::Wgb32Hoist,
            GroupedGemm::Wgb64Lean => GroupedGemm::Wgb64Hoist,
            GroupedGemm::Wgb128Lean => GroupedGemm::Wgb128Hoist,
            k => k,
        }
    }

    /// Whether the kernel reads the input staged as bf16.
    pub fn staged(self) -> bool {
        !matches!(self, GroupedGemm::Mma32 | GroupedGemm::Mma64)
    }
}

pub struct Gemm {
    dense: Kernel,
    sum_parts: Kernel,
    /// The router's split-K partial sums (EXACT_PART_FLOATS floats).
    exact_parts: crate::gpu::DevBuf,
    dense_wgb: Kernel,
    dense_wgb256: Kernel,
    grouped_wgb32: Kernel,
    grouped_wgb64: Kernel,
    grouped_wgb128: Kernel,
    dense_wgb_lean: Kernel,
    dense_wgb256_lean: Kernel,
    grouped_wgb32_lean: Kernel,
    grouped_wgb64_lean: Kernel,
    grouped_wgb128_lean: Kernel,
    grouped_wgb32_hoist: Kernel,
    grouped_wgb64_hoist: Kernel,
    grouped_wgb128_hoist: Kernel,
    to_bf16: Kernel,
    dense_exact: Kernel,
    grouped64: Kernel,
    grouped32: Kernel,
}

impl Gemm {
    /// `hopper`: the device is sm_90a, where the wgmma kernels run and get their (large) shared
    /// memory; elsewhere they are compiled as traps, never launched, and left at the default.
    pub fn load(gpu: &Gpu, m: &Module, hopper: bool) -> Result<Gemm> {
        let wg = |name: &'static str, bytes: usize| -> Result<Kernel> {
            let k = m.kernel(name)?;
            if hopper {
                k.allow_shared_memory(bytes)
            } else {
                Ok(k)
            }
        };
        Ok(Gemm {
            dense: m.kernel("gemm_dense")?.allow_shared_memory(GEMM_SMEM_MAX)?,
            sum_parts: m.kernel("gemm_sum_parts")?,
            exact_parts: gpu.alloc(EXACT_PART_FLOATS * 4)?,
            dense_wgb: wg("gemm_dense_wgb", wgb_smem(WG_TOK, WG_MAX_GROUPS))?,
            dense_wgb256: wg("gemm_dense_wgb256", wgb_smem(256, WG_MAX_GROUPS))?,
            grouped_wgb32: wg("gemm_grouped_wgb32", wgb_smem(32, WG_MAX_GROUPS))?,
            grouped_wgb64: wg("gemm_grouped_wgb64", wgb_smem(64, WG_MAX_GROUPS))?,
            grouped_wgb128: wg("gemm_grouped_wgb128", wgb_smem(128, WG_MAX_GROUPS))?,
            dense_wgb_lean: wg("gemm_dense_wgb_lean", wgb_smem(WG_TOK, WG_MAX_GROUPS))?,
            dense_wgb256_lean: wg("gemm_dense_wgb256_lean", wgb_smem(256, WG_MAX_GROUPS))?,
            grouped_wgb32_lean: wg("gemm_grouped_wgb32_lean", wgb_smem(32, WG_MAX_GROUPS))?,
            grouped_wgb64_lean: wg("gemm_grouped_wgb64_lean", wgb_smem(64, WG_MAX_GROUPS))?,
            grouped_wgb128_lean: wg("gemm_grouped_wgb128_lean", wgb_smem(128, WG_MAX_GROUPS))?,
            grouped_wgb32_hoist: wg("gemm_grouped_wgb32_hoist", wgb_smem(32, WG_MAX_GROUPS))?,
            grouped_wgb64_hoist: wg("gemm_grouped_wgb64_hoist", wgb_smem(64, WG_MAX_GROUPS))?,
            grouped_wgb128_hoist: wg("gemm_grouped_wgb128_hoist", wgb_smem(128, WG_MAX_GROUPS))?,
            to_bf16: m.kernel("to_bf16")?,
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

    /// out[r, c] = bf16(x[r, c]) for `rows` rows of `cols` (a multiple of 8) columns; out's rows
    /// are `cols` long.
    pub fn to_bf16(&self, gpu: &Gpu, x: Rows, rows: usize, cols: usize, out: u64) -> Result<()> {
        check_x("to_bf16", x)?;
        if !cols.is_multiple_of(8) {
            bail!("to_bf16: {cols} columns (expected a multiple of 8)");
        }
        let n = rows * cols / 8;
        let cfg = config((blocks(n, 256), 1, 1), 256, 0);
        let (x_stride, cols, rows) = (x.stride as i32, cols as i32, rows as i32);
        gpu.launch(&self.to_bf16, cfg, |l| {
            l.arg(&x.ptr).arg(&x_stride).arg(&out).arg(&cols).arg(&rows);
        })
    }

    /// y (+)= W x on tensor cores (weights and activations as bf16, fp32 sums) by `kernel`; the
    /// wgmma kernels read the input staged as bf16 (`a.xb`) and need sm_90a and a weight they
    /// take (`wg_fits`).
    pub fn dense(&self, gpu: &Gpu, kernel: DenseGemm, a: &Project, store: Store) -> Result<()> {
        check_x("gemm_dense", a.x)?;
        let w = a.w.arg();
        let (y_stride, n_tok) = (a.y.stride as i32, a.n_tok as i32);
        let accumulate: i32 = match store {
            Store::Overwrite => 0,
            Store::AddToResidual => 1,
        };
        let (kernel, cfg, x) = match kernel {
            DenseGemm::Mma => {
                let grid = (blocks(a.w.rows, GEMM_BN), blocks(a.n_tok, DENSE_BM), 1);
                let cfg = config(grid, GEMM_THREADS as u32, gemm_smem(DENSE_BM));
                (&self.dense, cfg, a.x)
            }
            _ => {
                let (k, tok) = match kernel {
                    DenseGemm::Wgb256 => (&self.dense_wgb256, 256),
                    DenseGemm::Wgb256Lean => (&self.dense_wgb256_lean, 256),
                    DenseGemm::WgbLean => (&self.dense_wgb_lean, WG_TOK),
                    _ => (&self.dense_wgb, WG_TOK),
                };
                let lean = matches!(kernel, DenseGemm::WgbLean | DenseGemm::Wgb256Lean);
                let xb = Self::wgmma_input(gpu, k, &a.w.shape(), a.xb, lean)?;
                let grid = (blocks(a.w.rows, WG_ROWS), blocks(a.n_tok, tok), 1);
                let smem = wgb_smem(tok, a.w.cols / a.w.group);
                (k, config(grid, 256, smem), xb)
            }
        };
        let x_stride = x.stride as i32;
        gpu.launch(kernel, cfg, |l| {
            l.arg(&w)
                .arg(&x.ptr)
                .arg(&x_stride)
                .arg(&a.y.ptr)
                .arg(&y_stride)
                .arg(&n_tok)
                .arg(&accumulate);
        })
    }

    /// The wgmma kernel `k`'s input: the staged rows, on a device and for a weight it takes
    /// (`lean`: a _lean variant, which needs `lean_fits` too).
    fn wgmma_input(
        gpu: &Gpu,
        k: &Kernel,
        w: &LinearShape,
        xb: Option<Rows>,
        lean: bool,
    ) -> Result<Rows> {
        if !runs_wgmma(gpu) || !wg_fits(w) || (lean && !lean_fits(w)) {
            bail!(
                "{}: needs sm_90a and a 4-bit weight it takes ({}x{}, {}-bit, groups of {}, arch {})",
                k.name,
                w.rows,
                w.cols,
                w.bits,
                w.group,
                gpu.arch
            );
        }
        xb.ok_or_else(|| anyhow::anyhow!("{}: the input must be staged as bf16", k.name))
    }

    /// y = W x in split precision (each weight as bf16 hi + lo, two mma, sums unrounded): the
    /// MoE router's logits with fp32 weights' precision; x is bf16-valued in bf16 mode. The
    /// columns run in `parts` parts (1: one pass; more: partial sums added in order by
    /// gemm_sum_parts): a power of two up to EXACT_MAX_PARTS that divides the k-steps, with the
    /// partial sums within EXACT_PART_FLOATS.
    pub fn dense_exact(&self, gpu: &Gpu, parts: usize, a: &Project) -> Result<()> {
        check_x("linear_router", a.x)?;
        let w = a.w.arg();
        let (rows, n) = (a.w.rows, a.n_tok);
        let steps = a.w.cols / GEMM_BK;
        if !(parts.is_power_of_two()
            && parts <= EXACT_MAX_PARTS
            && steps.is_multiple_of(parts)
            && (parts == 1 || n * rows * parts <= EXACT_PART_FLOATS))
        {
            bail!("gemm_dense_exact: {parts} parts of {steps} k-steps for {n} x {rows} outputs");
        }
        let grid = (blocks(rows, GEMM_BN), blocks(n, DENSE_BM), parts as u32);
        let cfg = config(grid, GEMM_THREADS as u32, gemm_smem_exact(DENSE_BM));
        // One part: straight into y; more: into exact_parts (rows of `rows`), then summed.
        let (y, y_stride, part_stride) = if parts == 1 {
            (a.y.ptr, a.y.stride as i32, 0i64)
        } else {
            (self.exact_parts.ptr, rows as i32, (n * rows) as i64)
        };
        let (x_stride, n_tok) = (a.x.stride as i32, n as i32);
        gpu.launch(&self.dense_exact, cfg, |l| {
            l.arg(&w)
                .arg(&a.x.ptr)
                .arg(&x_stride)
                .arg(&y)
                .arg(&y_stride)
                .arg(&n_tok)
                .arg(&part_stride);
        })?;
        if parts == 1 {
            return Ok(());
        }
        let (n_parts, out_stride, cols) = (parts as i32, a.y.stride as i32, rows as i32);
        let cfg = config((blocks(n * rows, 256), 1, 1), 256, 0);
        gpu.launch(&self.sum_parts, cfg, |l| {
            l.arg(&self.exact_parts.ptr)
                .arg(&n_parts)
                .arg(&part_stride)
                .arg(&a.y.ptr)
                .arg(&out_stride)
                .arg(&cols)
                .arg(&n_tok);
        })
    }

    /// The routed experts on tensor cores by `kernel`, over the tiles moe_group built, whose
    /// size (`a.groups.tile`) must be the kernel's; the wgmma kernels read the input staged as
    /// bf16 (`a.xb`).
    pub fn grouped(&self, gpu: &Gpu, kernel: GroupedGemm, a: &Grouped) -> Result<()> {
        check_x("gemm_grouped", a.x)?;
        let g = a.groups;
        let w = a.w.arg();
        let (x_div, y_stride) = (a.x_div as i32, a.y.stride as i32);
        if g.tile != kernel.tile() {
            bail!(
                "gemm_grouped: tiles of {} items for a kernel of {}-item tiles",
                g.tile,
                kernel.tile()
            );
        }
        let (kernel, cfg, x) = match kernel {
            GroupedGemm::Mma32 | GroupedGemm::Mma64 => {
                let k = if kernel == GroupedGemm::Mma64 {
                    &self.grouped64
                } else {
                    &self.grouped32
                };
                let grid = (blocks(a.w.rows, GEMM_BN), g.max_tiles as u32, 1);
                (k, config(grid, GEMM_THREADS as u32, gemm_smem(g.tile)), a.x)
            }
            _ => {
                let k = match kernel {
                    GroupedGemm::Wgb32 => &self.grouped_wgb32,
                    GroupedGemm::Wgb64 => &self.grouped_wgb64,
                    GroupedGemm::Wgb32Lean => &self.grouped_wgb32_lean,
                    GroupedGemm::Wgb64Lean => &self.grouped_wgb64_lean,
                    GroupedGemm::Wgb128Lean => &self.grouped_wgb128_lean,
                    GroupedGemm::Wgb32Hoist => &self.grouped_wgb32_hoist,
                    GroupedGemm::Wgb64Hoist => &self.grouped_wgb64_hoist,
                    GroupedGemm::Wgb128Hoist => &self.grouped_wgb128_hoist,
                    _ => &self.grouped_wgb128,
                };
                let lean = matches!(
                    kernel,
                    GroupedGemm::Wgb32Lean
                        | GroupedGemm::Wgb64Lean
                        | GroupedGemm::Wgb128Lean
                        | GroupedGemm::Wgb32Hoist
                        | GroupedGemm::Wgb64Hoist
                        | GroupedGemm::Wgb128Hoist
                );
                let xb = Self::wgmma_input(gpu, k, &a.w.shape(), a.xb, lean)?;
                let grid = (blocks(a.w.rows, WG_ROWS), g.max_tiles as u32, 1);
                let smem = wgb_smem(g.tile, a.w.cols / a.w.group);
                (k, config(grid, 256, smem), xb)
            }
        };
        let x_stride = x.stride as i32;
        gpu.launch(kernel, cfg, |l| {
            l.arg(&w)
                .arg(&g.perm)
                .arg(&g.tiles)
                .arg(&g.n_tiles)
                .arg(&x.ptr)
                .arg(&x_stride)
                .arg(&x_div)
                .arg(&a.y.ptr)
                .arg(&y_stride);
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_router_splits_its_columns_only_where_the_grid_is_shallow() {
        // Qwen3.6's router (256 experts × 2,048 columns: 2 row blocks, 32 k-steps) on 132 SMs.
        let parts = |n: usize| exact_parts(2 * n.div_ceil(64), 132, 32, n * 256);
        // Blocks before → after: 16 → 128, 32 → 256, 64 → 256, 128 → 256; at 8K, 256 blocks fill
        // the device (and 8 MB would not hold two parts).
        assert_eq!(parts(512), 8);
        assert_eq!(parts(1024), 8);
        assert_eq!(parts(2048), 4);
        assert_eq!(parts(4096), 2);
        assert_eq!(parts(8192), 1);
        // Never more parts than k-steps, nor parts that do not divide them.
        assert_eq!(exact_parts(1, 132, 2, 100), 2);
        assert_eq!(exact_parts(1, 132, 3, 100), 1);
        // The partial sums' buffer bounds the parts.
        assert_eq!(exact_parts(1, 132, 32, EXACT_PART_FLOATS / 2), 2);
        assert_eq!(exact_parts(1, 132, 32, EXACT_PART_FLOATS), 1);
    }
}
