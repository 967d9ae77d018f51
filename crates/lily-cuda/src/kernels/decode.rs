//! decode.cu: the one-token step's linears as weight-streaming GEMVs with their glue fused in
//! (norm into the projection, several projections of one input in one launch, the MoE's
//! gate/up/SiLU and down/combine/residual each in one launch).

use anyhow::{bail, Result};
use cudarc::driver::DeviceRepr;

use super::{blocks, config, KernelFile};
use crate::gpu::{Gpu, Kernel, Module};
use crate::weights::{DevLinear, DevMoe, LinearShape, QWeightArg};

/// Warps of a `dec_gemv` / `dec_glu` block (256 threads: the fused norm sums in rms_norm's order).
pub const WARPS: usize = 8;
/// Warps of a `dec_down_combine` block.
pub const DOWN_WARPS: usize = 4;
/// Most experts and experts per token `dec_glu` routes (moe.cu's router limits).
pub const MAX_EXPERTS: usize = 1024;
pub const MAX_TOPK: usize = 32;
/// Blocks per SM of a persistent `dec_gemv` / `dec_glu` grid (256 threads at up to 128 registers
/// each). One a SM, so that the next kernel's blocks fit beside it, lost its A/B (−17 % at 4K on
/// the H200, docs/perf-notes.md, session 4).
pub const BLOCKS_PER_SM: usize = 2;
/// Item chunks of a `dec_down_combine` block: DOWN_WARPS row groups × DOWN_KSPLIT chunks of the
/// top_k + 1 experts, one warp each.
pub const DOWN_KSPLIT: usize = 3;
/// Items (experts) a `dec_down_combine` warp loads before using any.
pub const DOWN_BATCH: usize = 3;
/// Item columns of warps of a `dec_down_combine_x8x2_grouped_wide` block (`grouped_down_wide`):
/// DOWN_WARPS × 4 = 16 warps (at most 128 registers each, one block an SM) where
/// `dec_down_combine_x8x2_grouped` has DOWN_KSPLIT = 3 (12 warps), and the items a warp of it has
/// in flight (its ring).
pub const GROUPED_DOWN_KCOLS: usize = 4;
pub const GROUPED_DOWN_BATCH: usize = 3;
/// `grouped_moe_stream`: the register buffers a warp of `dec_glu4_x8x2_grouped_ring` rings its
/// items through (`dec_glu4_x8x2_grouped` holds two), and the items a warp of
/// `dec_down_combine_x8x2_grouped_ring` has in flight (`dec_down_combine_x8x2_grouped_wide`:
/// GROUPED_DOWN_BATCH).
pub const GROUPED_GLU_RING: usize = 3;
pub const GROUPED_DOWN_RING: usize = 4;
/// Registers a thread of `dec_down_combine_x8x2_r96` (`down_96_regs`) may take: its 12 warps
/// and the 8 of a `dec_gemv4_x8x2` block at 112 fill an SM's 65,536 exactly.
pub const DOWN_NEXT_REGS: usize = 96;
/// 16-byte loads per thread in flight while `dec_down_combine` stages its inputs.
pub const DOWN_STAGE: usize = 3;
/// Rows a sub-warp streams at once in `dec_gemv` and in `dec_glu` (two weights per row there).
pub const R: usize = 4;
pub const GLU_R: usize = 2;
/// Rows a sub-warp streams at once in `dec_gemv4` (two register buffers of them; `dec_gemv4w`
/// and `dec_gemv8` stream one, their rows being twice as many bytes per lane).
pub const R4: usize = 2;
/// Rows a sub-warp streams at once in `dec_gemv4_x8x2` (two register buffers; its lane's x in 34
/// registers instead of 65).
pub const R4_X8X2: usize = 2;
/// Rows of gate and of up a sub-warp streams at once in `dec_glu4` (two register buffers).
pub const GLU_R4: usize = 1;
/// Tiles a `dec_glu4_x8x2_bulk` block (`moe_bulk`) holds at once in shared memory, each in a slot
/// of GLU_BULK_SLOT bytes (gate's and up's q words, scales and biases for WARPS · 32 groups of 64
/// columns: WARPS rows of the model's 2,048 columns): the launcher's grid gives no block more
/// tiles. 3 slots (54 KB; what a block of the persistent grid takes at the model's shape on 114 to
/// 132 SMs) and the kernel's 26 KB of static tables: two blocks an SM on sm_90, and a kernel every
/// architecture's loader grants (sm_86 / 89 / 120: 99 KB a block).
pub const GLU_BULK_SLOTS: usize = 3;
pub const GLU_BULK_SLOT: usize = 18432;
const _: () = assert!(GLU_BULK_SLOT == WARPS * 32 * (2 * 32 + 4 * 2));
/// Blocks per SM of the int8 `dec_glu4_q8` / `dec_glu4_q8_rows` grid (their launch bound: a
/// lane's x in 18 registers instead of 65 leaves room for a third block).
pub const Q8_BLOCKS_PER_SM: usize = 3;
/// How the fused MoE's kernels (`dec_glu4`, `dec_down_combine` and their rows forms) take their
/// 4-bit products (the plan's choice: `Plan::moe_products`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeProducts {
    /// f32: each 4-bit weight turned into a float (a byte permute) and multiplied by x's f32 value.
    Float,
    /// `moe_int8`: the input rows rounded to int8 per 64-column group (scale max|x| / 127) once per
    /// block, each 4-bit word dotted with them by two dp4a (`dec_glu4_q8`, `dec_down_combine_q8`
    /// and their `_rows` forms); all-4-bit MoEs of one group a lane only (`q8_serves`).
    Int8,
    /// `moe_int8_pairs`: the same kernels on int8 pairs of the input rows (x ≈ scale · (x_hi +
    /// x_lo / 254), error ≤ max|x| / 64,516: `GemvProducts::Int8Pairs`' rounding), four dp4a a
    /// word (`dec_glu4_x8x2`, `dec_down_combine_x8x2` and their `_rows` forms; the gate/up kernel
    /// 2 blocks an SM, the down kernel one).
    Int8Pairs,
}
/// Which block the grouped MoE's down kernel runs (`Decode::down_combine_grouped`; the plan's
/// choice: `Plan::moe_rows`). Both give the same outputs bit for bit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupedDown {
    /// `dec_down_combine_x8x2_grouped`: DOWN_WARPS row groups × DOWN_KSPLIT item columns (12
    /// warps, 116 registers).
    Warps12,
    /// `grouped_down_wide`: `dec_down_combine_x8x2_grouped_wide`, DOWN_WARPS row groups ×
    /// GROUPED_DOWN_KCOLS item columns (16 warps), more weight loads in flight an SM.
    Warps16,
    /// `grouped_moe_stream` (with `grouped_down_wide`): `dec_down_combine_x8x2_grouped_ring`,
    /// `Warps16`'s block with a ring of GROUPED_DOWN_RING items a warp instead of
    /// GROUPED_DOWN_BATCH.
    Warps16Ring,
}

/// Which gate/up kernel the grouped MoE runs (`Decode::glu_grouped`; the plan's choice:
/// `Plan::moe_rows`). Both give the same outputs bit for bit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupedGlu {
    /// `dec_glu4_x8x2_grouped`: two register buffers of items a warp.
    Pairs,
    /// `grouped_moe_stream`: `dec_glu4_x8x2_grouped_ring`, a ring of GROUPED_GLU_RING.
    Ring,
}

/// How the one-token projections on the pipelined 4-bit kernels (`dec_gemv4`, `dec_gemv4w`) take
/// their products (the plan's choice: `Plan::gemv_products`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemvProducts {
    /// f32: each 4-bit weight turned into a float (a byte permute) and multiplied by x's f32 value
    /// (`dec_gemv4`, `dec_gemv4w`; and every other `project` launch).
    Float,
    /// `gemv_int8`: the staged input rounded to int8 pairs per 64-column group once per block
    /// (x ≈ scale · (x_hi + x_lo / 254), error ≤ max|x| / 64,516), each 4-bit word dotted with
    /// them by four dp4a (`dec_gemv4_x8x2`, `dec_gemv4w_x8x2`); all-4-bit launches of those
    /// kernels' widths only (`x8x2_serves`).
    Int8Pairs,
}
/// Which block the one-token MoE down kernel on int8 pairs runs (`Decode::down_combine`; the
/// plan's choice: `Plan::down_regs`). Both give the same outputs bit for bit (the same code).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DownRegs {
    /// `dec_down_combine_x8x2` as the compiler allocates it (100 registers a thread at sm_90a).
    Unbounded,
    /// `down_96_regs`: `dec_down_combine_x8x2_r96`, at most DOWN_NEXT_REGS registers a thread
    /// (91 at sm_90a, no spills), so that one block of the next projection (`dec_gemv4_x8x2`)
    /// fits beside each of its blocks and requests its first tiles while it runs.
    Next96,
}

/// Where the one-token MoE's gate/up kernel on int8 pairs holds its weight tiles
/// (`Decode::glu`; the plan's choice: `Plan::glu_loads`). Both give the same outputs bit for bit
/// (the same tiles, products and sums).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GluLoads {
    /// `dec_glu4_x8x2` (and every other form of `glu`): two tiles a block in registers, the next
    /// asked for as one is summed.
    Registers,
    /// `moe_bulk`: `dec_glu4_x8x2_bulk`, every tile of a block (at most GLU_BULK_SLOTS) bulk-copied
    /// into shared memory (cp.async.bulk and an mbarrier a tile, sm_90) before any is summed: the
    /// shared expert's before the dependency wait, the routed experts' right after the routing.
    Bulk,
}

/// The grid of a one-token projection launch (`Decode::project`; the plan's choice:
/// `Plan::gemv_grid`). Which tile a block takes and how each row is summed do not depend on it:
/// both grids give the same outputs bit for bit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemvGrid {
    /// BLOCKS_PER_SM blocks an SM (at most one a tile), each streaming its tiles through its two
    /// register buffers.
    Persistent,
    /// `gemv4w_sm_grid`: where the launch's tiles fit two a block on at most one block an SM
    /// (`dec_gemv4w_x8x2` at the full shape: 256 tiles of 8 rows, 128 blocks), ceil(tiles / 2)
    /// blocks, so that each block requests all its rows before its dependency wait, stages and
    /// norms its input once for 16 rows instead of 8 (half the L2 reads of the gated norm's o
    /// and z), and its 256 threads at 128 registers (half an SM's registers) fit beside the
    /// blocks of the kernel before it (`dec_dn_step`, attention's combine) and of the one after
    /// it (`dec_gemv8`, the router), where two blocks an SM fill the register file; elsewhere
    /// the persistent grid.
    TwoTilesABlock,
}

/// Most picks (rows × top_k) of a batched step the MoE kernels grouped by expert
/// (`dec_glu4_x8x2_grouped`, `dec_down_combine_x8x2_grouped`; `moe_grouped_rows`) take: 8 rows of
/// the model's top 8 (their tables of items are sized for it: DEC_GRP_PICKS).
pub const GROUPED_PICKS: usize = 64;
/// Most experts those kernels route: each block routes every row in registers (common.cuh's
/// `route_top_k`: 32 · ROUTE_REG), one warp a row.
pub const GROUPED_MAX_EXPERTS: usize = 256;
/// Widest input a block stages in shared memory, and most projections per `dec_gemv` launch.
pub const MAX_COLS: usize = 4096;
pub const MAX_SEGS: usize = 4;
/// DeltaNet limits of the one-token kernels (as deltanet.cu's): conv taps, key head dim, lanes
/// per value column and value columns per block.
pub const DN_MAX_K: usize = 8;
pub const DN_MAX_DK: usize = 128;
pub const DN_PARTS: usize = 8;
pub const DN_COLS: usize = 16;
/// Most rows (sequences of a batched decode step) one `dec_gemv_rows` launch dots each weight with
/// (DEC_B_MAX: the size of its per-lane sums); more rows, or rows whose staging would pass
/// BATCH_SMEM_MAX, take several launches of at most that many rows each.
pub const BATCH_MAX: usize = 8;
/// Which kernel a `project_rows` launch takes (the plan's choice: `Plan::batch_projections`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowsKernel {
    /// `dec_gemv_rows`: the CUDA cores, 8 lanes a weight row, every row's FMAs.
    Gemv,
    /// `dec_mma_rows` (`mma_rows`): the tensor cores, 16 weight rows × the B rows an mma.sync;
    /// 4-bit weights only (`mma_rows_serves`), inputs fed as bf16.
    Mma,
    /// `dec_mma_rows_deep` (`mma_rows_deep`): `dec_mma_rows`' sums, its weight nibbles streamed by
    /// cp.async through MMA_STAGES chunk stages a warp in shared memory (more bytes in flight).
    MmaDeep,
    /// `dec_mma_rows_deep_rounds` (`mma_stage_rounds`): `dec_mma_rows_deep`'s outputs bit for
    /// bit, its input rows staged MMA_STAGE_ROUND items a thread a round (a round's loads all
    /// requested before any is converted: 2 dependent trips to L2 at 8 rows instead of 8).
    MmaDeepRounds,
    /// `dec_gemv_rows_split` (`router_rows_split`): the CUDA cores, one weight row a warp and its
    /// groups one a lane, SPLIT_WARPS rows a block: for launches of few weight rows (the router,
    /// `split_rows_serves`), which `dec_gemv_rows`' tiles leave on a few SMs.
    GemvSplit,
    /// `dec_gemv_rows_split_lean` (`batch_lean_glue`): `dec_gemv_rows_split`'s outputs bit for
    /// bit, its rows staged in fewer dependent steps (each thread's loads requested together, each
    /// (row, group) sum one thread's in the shuffle tree's order).
    GemvSplitLean,
    /// `dec_gemv_rows_split_async` (`router_async_stage`): `dec_gemv_rows_split_lean`'s outputs
    /// bit for bit, its rows staged by cp.async (every copy in flight at once, one wait; each
    /// warp sums the (row, group)s it copied).
    GemvSplitAsync,
}
/// Warps (weight rows) of a `dec_gemv_rows_split` block.
pub const SPLIT_WARPS: usize = 4;
/// Most weight rows of a launch `dec_gemv_rows_split` takes (`split_rows_serves`): the router's
/// 256 + 1 fit; wider launches fill the device with `dec_gemv_rows`' or `dec_mma_rows`' tiles.
pub const SPLIT_ROWS_MAX: usize = 1024;
/// Warps of a `dec_mma_rows` block, and blocks an SM of its persistent grid (its launch bound).
pub const MMA_WARPS: usize = 4;
pub const MMA_BLOCKS_PER_SM: usize = 4;
/// (tile, group) items a `dec_mma_rows` warp requests at once (two such chunks in flight).
pub const MMA_CHUNK: usize = 4;
/// Chunk stages a `dec_mma_rows_deep` warp keeps in shared memory (MMA_STAGES − 1 in flight),
/// fewer where a launch's shared memory would not fit them (`mma_deep_stages`), at least 2.
pub const MMA_STAGES: usize = 3;
/// Items (16 input columns of a row each) a `dec_mma_rows_deep_rounds` thread loads before it
/// converts any (decode.cu's DEC_MMA_STAGE_ROUND): 16 floats a item, 64 registers a thread.
pub const MMA_STAGE_ROUND: usize = 4;
/// Bytes of a `dec_mma_rows_deep` stage: 16 rows of MMA_CHUNK groups' 32 bytes and 32 of pad.
const MMA_STAGE_BYTES: usize = 16 * (MMA_CHUNK * 32 + 32);
/// Weight rows of a `dec_mma_rows` tile (the mma's M).
const MMA_TILE: usize = 16;
/// Warps of a `dec_gemv_rows` block: as many as its launch bound lets (decode.cu's
/// DEC_ROWS_WARPS, chosen there by the arch: 6 on Hopper, so that two blocks of its 163 registers
/// a thread fit an SM, as its persistent grid of BLOCKS_PER_SM blocks an SM assumes; 8
/// elsewhere), at most WARPS.
fn rows_warps(kernel: &Kernel) -> Result<usize> {
    let warps = (kernel.max_threads()? / 32).min(WARPS);
    if warps == 0 {
        bail!("dec_gemv_rows: its registers allow no whole warp a block");
    }
    Ok(warps)
}
/// Dynamic shared memory a `dec_gemv_rows` block may take: what every supported architecture
/// lets a kernel opt in to (sm_86 / sm_89 / sm_120: 99 KB).
const BATCH_SMEM_MAX: usize = 96 * 1024;
/// Floats per 64-column group in shared memory (DEC_XPAD in decode.cu).
const XPAD: usize = 68;
/// Words per 64-column group of int8 x in shared memory (DEC_X8PAD in decode.cu), and of int8
/// pairs (DEC_X8X2PAD).
const X8PAD: usize = 20;
const X8X2PAD: usize = 36;
/// Dynamic shared memory a `dec_down_combine_x8x2_grouped` block may take: what sm_86 / 89 / 120
/// grant a block (99 KB) less its static tables (3.2 KB), rounded down; 8 rows of the model's top 8
/// take 90 KB.
const GROUPED_SMEM_MAX: usize = 92 * 1024;
/// Dynamic shared memory a `dec_down_combine` may take without opting in.
const DOWN_SMEM_MAX: usize = 48 * 1024;

pub const FILE: KernelFile = KernelFile {
    name: "decode",
    source: include_str!("../../../../shaders/cuda/decode.cu"),
    defines: &[
        ("DEC_WARPS", WARPS as i64),
        ("DEC_DOWN_WARPS", DOWN_WARPS as i64),
        ("DEC_R", R as i64),
        ("DEC_GLU_R", GLU_R as i64),
        ("DEC_R4", R4 as i64),
        ("DEC_R4_X8X2", R4_X8X2 as i64),
        ("DEC_MAX_COLS", MAX_COLS as i64),
        ("DEC_MAX_SEGS", MAX_SEGS as i64),
        ("DEC_MAX_EXPERTS", MAX_EXPERTS as i64),
        ("DEC_MAX_TOPK", MAX_TOPK as i64),
        ("DEC_DOWN_BATCH", DOWN_BATCH as i64),
        ("DEC_DOWN_STAGE", DOWN_STAGE as i64),
        ("DEC_DOWN_NEXT_REGS", DOWN_NEXT_REGS as i64),
        ("DEC_DOWN_KSPLIT", DOWN_KSPLIT as i64),
        ("DEC_GRP_DOWN_KCOLS", GROUPED_DOWN_KCOLS as i64),
        ("DEC_GRP_DOWN_BATCH", GROUPED_DOWN_BATCH as i64),
        ("DEC_GRP_GLU_RING", GROUPED_GLU_RING as i64),
        ("DEC_GRP_DOWN_RING", GROUPED_DOWN_RING as i64),
        ("DEC_GLU_R4", GLU_R4 as i64),
        ("DEC_DN_MAX_K", DN_MAX_K as i64),
        ("DEC_DN_MAX_DK", DN_MAX_DK as i64),
        ("DEC_DN_PARTS", DN_PARTS as i64),
        ("DEC_DN_COLS", DN_COLS as i64),
        ("DEC_B_MAX", BATCH_MAX as i64),
        ("DEC_BLOCKS_PER_SM", BLOCKS_PER_SM as i64),
        ("DEC_Q8_BLOCKS", Q8_BLOCKS_PER_SM as i64),
        ("DEC_MMA_WARPS", MMA_WARPS as i64),
        ("DEC_MMA_BLOCKS", MMA_BLOCKS_PER_SM as i64),
        ("DEC_MMA_CHUNK", MMA_CHUNK as i64),
        ("DEC_MMA_STAGE_ROUND", MMA_STAGE_ROUND as i64),
        ("DEC_SPLIT_WARPS", SPLIT_WARPS as i64),
        ("DEC_GRP_PICKS", GROUPED_PICKS as i64),
        ("DEC_BULK_SLOTS", GLU_BULK_SLOTS as i64),
        ("DEC_BULK_SLOT", GLU_BULK_SLOT as i64),
    ],
};

/// Whether the decode kernels read this weight: MLX affine 4/8-bit, groups of 64 columns, an
/// input width they stage whole, and lanes that split a row evenly (64-column groups a power of
/// two below 32, or a multiple of 32).
pub fn serves(w: &LinearShape) -> bool {
    let groups = w.cols / 64;
    matches!(w.bits, 4 | 8)
        && w.group == 64
        // (the kernels index a matrix's words in 32 bits)
        && w.rows * w.cols * w.bits as usize / 32 <= i32::MAX as usize
        && w.cols.is_multiple_of(64)
        && w.cols <= MAX_COLS
        && groups > 0
        && (groups.is_power_of_two() || groups.is_multiple_of(32))
}

/// Whether a `project` launch of these weights (one input width, each one `serves` accepts) can
/// take int8-pair products (`GemvProducts::Int8Pairs`): all 4-bit on a pipelined kernel's width
/// (`dec_gemv4`: up to 32 groups of 64 columns; `dec_gemv4w`: 64).
pub fn x8x2_serves(ws: &[LinearShape]) -> bool {
    ws.iter().all(|w| serves(w) && w.bits == 4)
        && ws.first().is_some_and(|w| {
            ws.iter().all(|o| o.cols == w.cols) && matches!(w.cols / 64, 1..=32 | 64)
        })
}

/// Blocks of a `project` launch of `tiles` tiles on `sms` SMs (`GemvGrid`).
pub fn gemv_blocks(tiles: usize, sms: usize, grid: GemvGrid) -> usize {
    let pairs = tiles.div_ceil(2);
    match grid {
        GemvGrid::TwoTilesABlock if pairs <= sms => pairs,
        _ => tiles.min(BLOCKS_PER_SM * sms),
    }
}

/// Whether `Decode::glu` reads these weights: all of one input width, gate and up alike.
pub fn glu_serves(
    gate: &LinearShape,
    up: &LinearShape,
    sgate: &LinearShape,
    sup: &LinearShape,
) -> bool {
    [gate, up, sgate, sup]
        .iter()
        .all(|w| serves(w) && w.cols == gate.cols)
        && gate.rows == up.rows
        && sgate.rows == sup.rows
}

/// Whether `Decode::glu_rows` reads these weights: what `glu` reads on its pipelined kernel
/// (`dec_glu4`: all four 4-bit, one 64-column group a lane).
pub fn glu_rows_serves(
    gate: &LinearShape,
    up: &LinearShape,
    sgate: &LinearShape,
    sup: &LinearShape,
) -> bool {
    glu_serves(gate, up, sgate, sup) && glu_pipelined(gate, up, sgate, sup)
}

/// Whether `glu` takes its pipelined kernel (`dec_glu4`): all four 4-bit, at most 32 groups of
/// 64 columns (one a lane).
fn glu_pipelined(
    gate: &LinearShape,
    up: &LinearShape,
    sgate: &LinearShape,
    sup: &LinearShape,
) -> bool {
    [gate, up, sgate, sup].iter().all(|w| w.bits == 4) && gate.cols / 64 <= 32
}

/// Whether `glu` with `GluLoads::Bulk` (`dec_glu4_x8x2_bulk`) reads these weights: what its
/// pipelined kernel reads, with groups a row a multiple of 8 (a tile's scales and biases are runs of
/// whole 16-byte units, as bulk copies move).
pub fn glu_bulk_serves(
    gate: &LinearShape,
    up: &LinearShape,
    sgate: &LinearShape,
    sup: &LinearShape,
) -> bool {
    glu_rows_serves(gate, up, sgate, sup) && (gate.cols / 64).is_multiple_of(8)
}

/// Blocks of a `dec_glu4_x8x2_bulk` launch of `tiles` tiles: the persistent grid of `persistent`
/// blocks (at most one a tile), or more where it would give a block more than GLU_BULK_SLOTS
/// tiles; and the slots (tiles) its busiest block holds.
pub fn glu_bulk_grid(tiles: usize, persistent: usize) -> (usize, usize) {
    let grid = tiles
        .min(persistent)
        .max(tiles.div_ceil(GLU_BULK_SLOTS))
        .max(1);
    (grid, tiles.div_ceil(grid))
}

/// Dynamic shared memory of a `dec_down_combine` block: the top_k + 1 input rows, padded, their
/// group sums, and the item chunks' partial sums per output row; with int8 products also the
/// rows as int8 (X8PAD words a group, from a 16-byte boundary; pairs X8X2PAD) and each group's
/// scale and sum.
fn down_smem(inter: usize, top_k: usize, products: MoeProducts) -> usize {
    let (_, spw) = lanes_per_row(inter);
    let groups = (top_k + 1) * (inter / 64);
    let f32_part = groups * (XPAD + 1) * 4 + (DOWN_KSPLIT + 1) * DOWN_WARPS * spw * 4;
    match products {
        MoeProducts::Float => f32_part,
        MoeProducts::Int8 => f32_part.next_multiple_of(16) + groups * (X8PAD * 4 + 8),
        MoeProducts::Int8Pairs => f32_part.next_multiple_of(16) + groups * (X8X2PAD * 4 + 8),
    }
}

/// Whether the MoE of these weights can take int8 `products` (`MoeProducts::Int8` or
/// `Int8Pairs`): gate/up on `dec_glu4` (all four 4-bit, one group a lane) and the down
/// projections on `dec_down_combine`'s fast path (4-bit, one group a lane) with room for the
/// int8 rows.
pub fn q8_serves(
    glu: [&LinearShape; 4],
    down: &LinearShape,
    sdown: &LinearShape,
    top_k: usize,
    products: MoeProducts,
) -> bool {
    let [gate, up, sgate, sup] = glu;
    glu_rows_serves(gate, up, sgate, sup)
        && down_serves(down, sdown, top_k)
        && [down, sdown]
            .iter()
            .all(|w| w.bits == 4 && w.cols / 64 <= 32)
        && down_smem(down.cols, top_k, products) <= DOWN_SMEM_MAX
}

/// Dynamic shared memory of a `dec_down_combine_x8x2_grouped` block for `rows` rows: every row's
/// top_k + 1 inputs as int8 pairs (X8X2PAD words a group) with each group's scale and sum, and
/// each (row, item, output row) product.
fn grouped_down_smem(inter: usize, top_k: usize, rows: usize) -> usize {
    let (_, spw) = lanes_per_row(inter);
    let inputs = rows * (top_k + 1);
    inputs * (inter / 64) * (X8X2PAD * 4 + 8) + inputs * DOWN_WARPS * spw * 4
}

/// Whether the MoE of these weights can run a batched step of `rows` rows grouped by expert
/// (`Decode::glu_grouped` + `Decode::down_combine_grouped`): what the int8-pair rows kernels read
/// (`q8_serves`), 2 to BATCH_MAX rows of at most GROUPED_PICKS picks, at most
/// GROUPED_MAX_EXPERTS experts, the down kernel's staged pairs within GROUPED_SMEM_MAX.
pub fn grouped_serves(
    glu: [&LinearShape; 4],
    down: &LinearShape,
    sdown: &LinearShape,
    n_experts: usize,
    top_k: usize,
    rows: usize,
) -> bool {
    q8_serves(glu, down, sdown, top_k, MoeProducts::Int8Pairs)
        && (2..=BATCH_MAX).contains(&rows)
        && top_k >= 1
        && rows * top_k <= GROUPED_PICKS
        && n_experts <= GROUPED_MAX_EXPERTS
        && glu[0].rows == down.cols
        && glu[2].rows == sdown.cols
        && grouped_down_smem(down.cols, top_k, rows) <= GROUPED_SMEM_MAX
}

/// Whether `Decode::down_combine` reads these weights for `top_k` experts.
pub fn down_serves(down: &LinearShape, sdown: &LinearShape, top_k: usize) -> bool {
    serves(down)
        && serves(sdown)
        && down.cols == sdown.cols
        && down.rows == sdown.rows
        && down_smem(down.cols, top_k, MoeProducts::Float) <= DOWN_SMEM_MAX
}

/// Dynamic shared memory of a `dec_gemv_rows` block staging `rows` inputs of `cols` columns:
/// the rows padded, and their group sums.
fn rows_smem(cols: usize, rows: usize) -> usize {
    rows * (cols / 64) * (XPAD + 1) * 4
}

/// Dynamic shared memory of a `dec_mma_rows` block staging `rows` inputs of `cols` columns
/// (decode.cu's layout): the rows as bf16 pairs, 32 words a group and 4 words of pad a row, their
/// group sums (BATCH_MAX a group, whatever `rows`), and the split's partial sums (two buffers of
/// MMA_WARPS × 32 lanes × 4).
fn mma_smem(cols: usize, rows: usize) -> usize {
    let g = cols / 64;
    (rows * (g * 32 + 4) + g * BATCH_MAX + 2 * MMA_WARPS * 128) * 4
}

/// Stages of a `dec_mma_rows_deep` block staging `rows` inputs of `cols` columns: MMA_STAGES
/// where they fit BATCH_SMEM_MAX with the inputs, else 2.
fn mma_deep_stages(cols: usize, rows: usize) -> usize {
    let fits = |s: usize| mma_smem(cols, rows) + MMA_WARPS * s * MMA_STAGE_BYTES <= BATCH_SMEM_MAX;
    (2..=MMA_STAGES).rev().find(|&s| fits(s)).unwrap_or(2)
}

/// Dynamic shared memory of a block of `kernel` staging `rows` inputs of `cols` columns.
fn launch_smem(kernel: RowsKernel, cols: usize, rows: usize) -> usize {
    match kernel {
        RowsKernel::Gemv
        | RowsKernel::GemvSplit
        | RowsKernel::GemvSplitLean
        | RowsKernel::GemvSplitAsync => rows_smem(cols, rows),
        RowsKernel::Mma => mma_smem(cols, rows),
        RowsKernel::MmaDeep | RowsKernel::MmaDeepRounds => {
            mma_smem(cols, rows) + MMA_WARPS * mma_deep_stages(cols, rows) * MMA_STAGE_BYTES
        }
    }
}

/// Blocks of `smem` bytes of dynamic shared memory that fit an SM (its opt-in maximum a block,
/// `max_smem`, and 1 KB the driver reserves a block), at most `bound` (the launch bound) and at
/// least 1: the persistent grid of `dec_mma_rows_deep` takes no more blocks than run at once.
fn blocks_by_smem(smem: usize, max_smem: usize, bound: usize) -> usize {
    ((max_smem + 1024) / (smem + 1024)).clamp(1, bound)
}

/// Rows one launch of `kernel` takes for inputs of `cols` columns (at least 1 for any width
/// `serves` accepts: 4,096 columns stage 17.7 KB a row in `dec_gemv_rows`, 8.2 KB in
/// `dec_mma_rows`).
pub fn rows_per_launch(kernel: RowsKernel, cols: usize) -> usize {
    (1..=BATCH_MAX)
        .rev()
        .find(|&r| launch_smem(kernel, cols, r) <= BATCH_SMEM_MAX)
        .unwrap_or(1)
}

/// Whether `dec_gemv_rows_split` is meant for these weights (each one `serves` accepts): at most
/// SPLIT_ROWS_MAX weight rows in all.
pub fn split_rows_serves(ws: &[LinearShape]) -> bool {
    ws.iter().all(serves) && ws.iter().map(|w| w.rows).sum::<usize>() <= SPLIT_ROWS_MAX
}

/// Whether `dec_mma_rows` reads these weights (all of one input width, each one `serves`
/// accepts): 4-bit only (its operands are nibbles ORed into bf16 128).
pub fn mma_rows_serves(ws: &[LinearShape]) -> bool {
    ws.iter().all(|w| serves(w) && w.bits == 4)
}

/// Whether a `dec_mma_rows` launch of `tiles` 16-row tiles splits each tile's groups over the
/// MMA_WARPS warps of a block: where whole tiles a warp would leave warps of the persistent grid
/// (`warps` of them) idle or with one tile each (o_proj / out_proj: 128 tiles; DeltaNet's
/// in_proj: 772), not where every warp gets several (lm_head: 15,520).
fn mma_split(tiles: usize, warps: usize) -> bool {
    tiles < 2 * warps
}

/// Lanes that share one row of `cols` columns in `dec_gemv_rows` (a power of two, at most 8),
/// and rows per warp step.
fn rows_lanes(cols: usize) -> (usize, usize) {
    let g = cols / 64;
    let l = [8, 4, 2, 1].into_iter().find(|&l| g >= l).unwrap_or(1);
    (l, 32 / l)
}

/// Lanes that share one row of `cols` columns, and rows per warp step.
fn lanes_per_row(cols: usize) -> (usize, usize) {
    let lpr = (cols / 64).min(32);
    (lpr, 32 / lpr)
}

/// How one projection's rows are written (decode.cu's DEC_STORE / DEC_RESIDUAL / DEC_EXACT).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Out {
    /// y = W x, rounded to the activation type.
    Store(u64),
    /// y = y + W x: the residual add fused into the projection.
    AddToResidual(u64),
    /// y = W x unrounded (the router's logits).
    Exact(u64),
}

impl Out {
    fn parts(self) -> (u64, i32) {
        match self {
            Out::Store(p) => (p, 0),
            Out::AddToResidual(p) => (p, 1),
            Out::Exact(p) => (p, 2),
        }
    }
}

/// What the kernel does to its input row before the projections.
#[derive(Clone, Copy, Debug)]
pub enum Prologue {
    /// Takes the row as it is.
    None,
    /// RMSNorm with this f32 weight [cols] (rms_norm's arithmetic): the norm folded into the
    /// projection.
    RmsNorm { weight: u64, eps: f32 },
    /// DeltaNet's gated norm per head (dn_gated_norm's arithmetic): w ⊙ rmsnorm(o_h) ⊙ silu(z_h),
    /// weight f32 [head_dim], z f32 [cols].
    GatedNorm {
        weight: u64,
        z: u64,
        head_dim: usize,
        eps: f32,
    },
}

/// The input of a fused projection: one row of `cols` f32 and its prologue; `staged_out`
/// receives the row the projections read (e.g. the normed row, for later kernels) when wanted.
#[derive(Clone, Copy, Debug)]
pub struct Input {
    pub x: u64,
    pub cols: usize,
    pub prologue: Prologue,
    pub staged_out: Option<u64>,
}

impl Input {
    /// A row taken as it is.
    pub fn row(x: u64, cols: usize) -> Input {
        Input {
            x,
            cols,
            prologue: Prologue::None,
            staged_out: None,
        }
    }
}

/// `struct DecSeg` of decode.cu.
#[repr(C)]
#[derive(Clone, Copy)]
struct DecSeg {
    w: QWeightArg,
    y: u64,
    mode: i32,
    tile0: i32,
}

/// `struct DecSegs` of decode.cu, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct DecSegs {
    s: [DecSeg; MAX_SEGS],
    n: i32,
    tiles: i32,
}

// SAFETY: plain #[repr(C)] data matching decode.cu's structs field for field.
unsafe impl DeviceRepr for DecSegs {}

/// The token's routing and the routed experts' and the shared expert's first half:
/// h_k = silu(gate_k xn) ⊙ up_k xn.
pub struct Glu<'a> {
    pub gate: &'a DevLinear,
    pub up: &'a DevLinear,
    /// f32 [n_experts]: the router's logits (unrounded).
    pub router_logits: u64,
    pub n_experts: usize,
    /// Written: i32 [top_k] the token's experts, f32 [top_k] their weights.
    pub ids: u64,
    pub route_w: u64,
    pub top_k: usize,
    pub shared_gate: &'a DevLinear,
    pub shared_up: &'a DevLinear,
    /// The normed input row [hidden].
    pub xn: u64,
    /// Routed outputs [top_k, inter] and the shared expert's [shared_inter].
    pub h: u64,
    pub h_shared: u64,
}

/// The buffers the MoE block writes, whether it runs as `project`, `glu` and `down_combine` or as
/// `project_rows`, `glu_rows` and `down_combine_rows`: f32 [n_experts]
/// the router's exact logits, f32 [1] the shared expert's gate logit, i32 / f32 [top_k] the
/// routing, f32 [top_k, inter] and [inter] the experts' and the shared expert's hidden rows (each
/// the first row of [rows, ...] for several rows).
#[derive(Clone, Copy)]
pub struct MoeOutputs {
    pub logits: u64,
    pub shared_gate_logit: u64,
    pub ids: u64,
    pub route_w: u64,
    pub h: u64,
    pub h_shared: u64,
}

impl MoeOutputs {
    /// The second of the three launches (`glu`, `glu_rows`) of `m` on the normed row(s) `xn`,
    /// writing the routing and the hidden rows.
    pub fn glu<'a>(&self, m: &'a DevMoe, xn: u64, n_experts: usize, top_k: usize) -> Glu<'a> {
        Glu {
            gate: &m.gate,
            up: &m.up,
            router_logits: self.logits,
            n_experts,
            ids: self.ids,
            route_w: self.route_w,
            top_k,
            shared_gate: &m.shared_gate,
            shared_up: &m.shared_up,
            xn,
            h: self.h,
            h_shared: self.h_shared,
        }
    }

    /// The third (`down_combine`, `down_combine_rows`): the residual row(s) `x` += the block's
    /// output.
    pub fn down_combine<'a>(&self, m: &'a DevMoe, x: u64, top_k: usize) -> DownCombine<'a> {
        DownCombine {
            down: &m.down,
            shared_down: &m.shared_down,
            ids: self.ids,
            weights: self.route_w,
            top_k,
            h: self.h,
            h_shared: self.h_shared,
            shared_gate: self.shared_gate_logit,
            x,
        }
    }
}

/// The MoE's second half: x += Σ_k w_k down_k h_k + sigmoid(g) down_s h_s.
pub struct DownCombine<'a> {
    pub down: &'a DevLinear,
    pub shared_down: &'a DevLinear,
    pub ids: u64,
    /// f32 [top_k]: routing weights.
    pub weights: u64,
    pub top_k: usize,
    pub h: u64,
    pub h_shared: u64,
    /// f32 [1]: the shared expert's gate logit.
    pub shared_gate: u64,
    /// The residual row [hidden], updated in place.
    pub x: u64,
}

/// DeltaNet's conv of one token: c = silu(conv(state, m)), and the conv state shifted by m.
pub struct DnConv {
    /// f32 [conv_dim]: the token's in_proj_qkv output.
    pub m: u64,
    /// f32 [K-1, conv_dim], updated.
    pub conv_state: u64,
    /// f32 [conv_dim, K].
    pub weight: u64,
    pub c: u64,
    pub conv_dim: usize,
    pub kernel: usize,
}

/// DeltaNet's q/k norms, gates and recurrent update of one token (dn_prep + dn_recurrent).
pub struct DnStep {
    pub c: u64,
    /// f32 [n_v]: the token's in_proj_b and in_proj_a outputs.
    pub b: u64,
    pub a: u64,
    pub a_log: u64,
    pub dt_bias: u64,
    /// f32 [n_v, dk, dv], updated.
    pub state: u64,
    /// f32 [n_v · dv].
    pub o: u64,
    pub n_k: usize,
    pub n_v: usize,
    pub dk: usize,
    pub dv: usize,
}

/// The segment table of a projection launch (`dec_gemv*`, `dec_gemv_rows`): each output's
/// weight, destination and store mode, and the first of its tiles of `rows_per_tile` rows;
/// `tiles` the total. `kernel` names the launcher in errors.
fn segments(
    kernel: &str,
    outs: &[(&DevLinear, Out)],
    cols: usize,
    rows_per_tile: usize,
) -> Result<DecSegs> {
    let empty = DecSeg {
        w: QWeightArg::default(),
        y: 0,
        mode: 0,
        tile0: i32::MAX,
    };
    let mut segs = DecSegs {
        s: [empty; MAX_SEGS],
        n: outs.len() as i32,
        tiles: 0,
    };
    let mut total = 0usize;
    for (i, (w, out)) in outs.iter().enumerate() {
        if !serves(&w.shape()) || w.cols != cols || w.experts != 1 {
            bail!(
                "{kernel}: a {}x{} {}-bit weight (group {}) on a {cols}-wide input",
                w.rows,
                w.cols,
                w.bits,
                w.group,
            );
        }
        let (y, mode) = out.parts();
        segs.s[i] = DecSeg {
            w: w.arg(),
            y,
            mode,
            tile0: total as i32,
        };
        total += w.rows.div_ceil(rows_per_tile);
    }
    segs.tiles = total as i32;
    Ok(segs)
}

pub struct Decode {
    gemv: Kernel,
    gemv_rows: Kernel,
    gemv_rows_split: Kernel,
    gemv_rows_split_lean: Kernel,
    gemv_rows_split_async: Kernel,
    /// Warps of a `dec_gemv_rows` block on this device (`rows_warps`).
    rows_warps: usize,
    mma_rows: Kernel,
    mma_rows_deep: Kernel,
    mma_rows_deep_rounds: Kernel,
    gemv4: Kernel,
    gemv4w: Kernel,
    gemv4_x8x2: Kernel,
    gemv4w_x8x2: Kernel,
    gemv8: Kernel,
    glu: Kernel,
    glu4: Kernel,
    glu4_rows: Kernel,
    glu4_q8: Kernel,
    glu4_q8_rows: Kernel,
    glu4_x8x2: Kernel,
    glu4_x8x2_rows: Kernel,
    glu4_x8x2_bulk: Kernel,
    glu4_x8x2_grouped: Kernel,
    glu4_x8x2_grouped_ring: Kernel,
    down_combine: Kernel,
    down_combine_rows: Kernel,
    down_combine_q8: Kernel,
    down_combine_q8_rows: Kernel,
    down_combine_x8x2: Kernel,
    down_combine_x8x2_r96: Kernel,
    down_combine_x8x2_rows: Kernel,
    down_combine_x8x2_grouped: Kernel,
    down_combine_x8x2_grouped_wide: Kernel,
    down_combine_x8x2_grouped_ring: Kernel,
    dn_conv: Kernel,
    dn_step: Kernel,
    dn_conv_rows: Kernel,
    dn_step_rows: Kernel,
}

impl Decode {
    pub fn load(m: &Module) -> Result<Decode> {
        // Every decode kernel waits for its predecessor before touching anything but weights.
        let k = |name| m.kernel(name).map(Kernel::waits_for_predecessor);
        let gemv_rows = k("dec_gemv_rows")?.allow_shared_memory(BATCH_SMEM_MAX)?;
        Ok(Decode {
            gemv: k("dec_gemv")?,
            rows_warps: rows_warps(&gemv_rows)?,
            gemv_rows,
            gemv_rows_split: k("dec_gemv_rows_split")?.allow_shared_memory(BATCH_SMEM_MAX)?,
            gemv_rows_split_lean: k("dec_gemv_rows_split_lean")?
                .allow_shared_memory(BATCH_SMEM_MAX)?,
            gemv_rows_split_async: k("dec_gemv_rows_split_async")?
                .allow_shared_memory(BATCH_SMEM_MAX)?,
            mma_rows: k("dec_mma_rows")?.allow_shared_memory(BATCH_SMEM_MAX)?,
            mma_rows_deep: k("dec_mma_rows_deep")?.allow_shared_memory(BATCH_SMEM_MAX)?,
            mma_rows_deep_rounds: k("dec_mma_rows_deep_rounds")?
                .allow_shared_memory(BATCH_SMEM_MAX)?,
            gemv4: k("dec_gemv4")?,
            gemv4w: k("dec_gemv4w")?,
            gemv4_x8x2: k("dec_gemv4_x8x2")?,
            gemv4w_x8x2: k("dec_gemv4w_x8x2")?,
            gemv8: k("dec_gemv8")?,
            glu: k("dec_glu")?,
            glu4: k("dec_glu4")?,
            glu4_rows: k("dec_glu4_rows")?,
            glu4_q8: k("dec_glu4_q8")?,
            glu4_q8_rows: k("dec_glu4_q8_rows")?,
            glu4_x8x2: k("dec_glu4_x8x2")?,
            glu4_x8x2_rows: k("dec_glu4_x8x2_rows")?,
            glu4_x8x2_bulk: k("dec_glu4_x8x2_bulk")?
                .allow_shared_memory(GLU_BULK_SLOTS * GLU_BULK_SLOT)?,
            glu4_x8x2_grouped: k("dec_glu4_x8x2_grouped")?,
            glu4_x8x2_grouped_ring: k("dec_glu4_x8x2_grouped_ring")?,
            down_combine: k("dec_down_combine")?,
            down_combine_rows: k("dec_down_combine_rows")?,
            down_combine_q8: k("dec_down_combine_q8")?,
            down_combine_q8_rows: k("dec_down_combine_q8_rows")?,
            down_combine_x8x2: k("dec_down_combine_x8x2")?,
            down_combine_x8x2_r96: k("dec_down_combine_x8x2_r96")?,
            down_combine_x8x2_rows: k("dec_down_combine_x8x2_rows")?,
            down_combine_x8x2_grouped: k("dec_down_combine_x8x2_grouped")?
                .allow_shared_memory(GROUPED_SMEM_MAX)?,
            down_combine_x8x2_grouped_wide: k("dec_down_combine_x8x2_grouped_wide")?
                .allow_shared_memory(GROUPED_SMEM_MAX)?,
            down_combine_x8x2_grouped_ring: k("dec_down_combine_x8x2_grouped_ring")?
                .allow_shared_memory(GROUPED_SMEM_MAX)?,
            dn_conv: k("dec_dn_conv")?,
            dn_step: k("dec_dn_step")?,
            dn_conv_rows: k("dec_dn_conv_rows")?,
            dn_step_rows: k("dec_dn_step_rows")?,
        })
    }

    /// Up to MAX_SEGS projections of one input row in one launch; `products` (the plan's
    /// `gemv_products`) picks the pipelined 4-bit kernels' f32 or int8-pair form, `grid` (the
    /// plan's `gemv_grid`) how many blocks share the tiles.
    pub fn project(
        &self,
        gpu: &Gpu,
        input: Input,
        outs: &[(&DevLinear, Out)],
        products: GemvProducts,
        grid: GemvGrid,
    ) -> Result<()> {
        if outs.is_empty() || outs.len() > MAX_SEGS {
            bail!("dec_gemv: {} projections (1..={MAX_SEGS})", outs.len());
        }
        if !input.x.is_multiple_of(4) {
            bail!("dec_gemv: input at {:#x} is not 4-byte aligned", input.x);
        }
        let (_, spw) = lanes_per_row(input.cols);
        // Every weight of one width, one or two 64-column groups per lane: a pipelined kernel.
        let groups = input.cols / 64;
        let all_bits = |b| outs.iter().all(|(w, _)| w.bits == b);
        let (kernel, rows) = match (all_bits(4), all_bits(8), groups, products) {
            (true, _, 1..=32, GemvProducts::Float) => (&self.gemv4, R4),
            (true, _, 1..=32, GemvProducts::Int8Pairs) => (&self.gemv4_x8x2, R4_X8X2),
            (true, _, 64, GemvProducts::Float) => (&self.gemv4w, 1),
            (true, _, 64, GemvProducts::Int8Pairs) => (&self.gemv4w_x8x2, 1),
            (_, _, _, GemvProducts::Int8Pairs) => {
                bail!("dec_gemv4_x8x2: weights it does not read (4-bit, 1-32 or 64 groups)")
            }
            (_, true, 1..=32, GemvProducts::Float) => (&self.gemv8, 1),
            _ => (&self.gemv, R),
        };
        let rows_per_block = WARPS * spw * rows;
        let segs = segments("dec_gemv", outs, input.cols, rows_per_block)?;
        let (norm_w, eps, gz, head_dim) = match input.prologue {
            Prologue::None => (0, 0.0, 0, 1),
            Prologue::RmsNorm { weight, eps } => (weight, eps, 0, 1),
            Prologue::GatedNorm {
                weight,
                z,
                head_dim,
                eps,
            } => {
                if head_dim == 0 || !input.cols.is_multiple_of(head_dim) {
                    bail!(
                        "dec_gemv: gated norm heads of {head_dim} over {} columns",
                        input.cols
                    );
                }
                (weight, eps, z, head_dim as i32)
            }
        };
        let staged_out = input.staged_out.unwrap_or(0);
        let cols = input.cols as i32;
        let grid = gemv_blocks(segs.tiles as usize, gpu.sm_count, grid);
        let cfg = config((grid as u32, 1, 1), (WARPS * 32) as u32, 0);
        gpu.launch(kernel, cfg, |l| {
            l.arg(&segs)
                .arg(&input.x)
                .arg(&norm_w)
                .arg(&eps)
                .arg(&gz)
                .arg(&head_dim)
                .arg(&staged_out)
                .arg(&cols);
        })
    }

    /// Up to MAX_SEGS projections of the same `rows` input rows (`x`: f32 [rows, cols], already
    /// normed), each weight read once for all of them, in `kernel` (`dec_gemv_rows`,
    /// `dec_gemv_rows_split` or `dec_mma_rows`; BATCH_MAX rows a launch at most): output row b of
    /// a weight of `r` rows goes to its pointer + b · r floats.
    #[allow(clippy::too_many_arguments)]
    pub fn project_rows(
        &self,
        gpu: &Gpu,
        kernel: RowsKernel,
        x: u64,
        cols: usize,
        rows: usize,
        outs: &[(&DevLinear, Out)],
    ) -> Result<()> {
        let name = match kernel {
            RowsKernel::Gemv => "dec_gemv_rows",
            RowsKernel::GemvSplit => "dec_gemv_rows_split",
            RowsKernel::GemvSplitLean => "dec_gemv_rows_split_lean",
            RowsKernel::GemvSplitAsync => "dec_gemv_rows_split_async",
            RowsKernel::Mma => "dec_mma_rows",
            RowsKernel::MmaDeep => "dec_mma_rows_deep",
            RowsKernel::MmaDeepRounds => "dec_mma_rows_deep_rounds",
        };
        if outs.is_empty() || outs.len() > MAX_SEGS {
            bail!("{name}: {} projections (1..={MAX_SEGS})", outs.len());
        }
        if rows == 0 {
            bail!("{name}: no input rows");
        }
        if !x.is_multiple_of(16) {
            bail!("{name}: input at {x:#x} is not 16-byte aligned");
        }
        let blocks_max = |per_sm: usize| per_sm * gpu.sm_count;
        let (function, warps, rows_per_tile) = match kernel {
            RowsKernel::Gemv => (
                &self.gemv_rows,
                self.rows_warps,
                self.rows_warps * rows_lanes(cols).1,
            ),
            RowsKernel::GemvSplit => (&self.gemv_rows_split, SPLIT_WARPS, SPLIT_WARPS),
            RowsKernel::GemvSplitLean => (&self.gemv_rows_split_lean, SPLIT_WARPS, SPLIT_WARPS),
            RowsKernel::GemvSplitAsync => (&self.gemv_rows_split_async, SPLIT_WARPS, SPLIT_WARPS),
            RowsKernel::Mma | RowsKernel::MmaDeep | RowsKernel::MmaDeepRounds => {
                if outs.iter().any(|(w, _)| w.bits != 4) {
                    bail!("{name}: 4-bit weights only");
                }
                let f = match kernel {
                    RowsKernel::Mma => &self.mma_rows,
                    RowsKernel::MmaDeep => &self.mma_rows_deep,
                    _ => &self.mma_rows_deep_rounds,
                };
                (f, MMA_WARPS, MMA_TILE)
            }
        };
        let segs = segments(name, outs, cols, rows_per_tile)?;
        let tiles = segs.tiles as usize;
        let (grid, split) = match kernel {
            RowsKernel::Gemv => (tiles.min(blocks_max(BLOCKS_PER_SM)), 0i32),
            // Up to SPLIT_ROWS_MAX rows: a block a tile for any device this runs on.
            RowsKernel::GemvSplit | RowsKernel::GemvSplitLean | RowsKernel::GemvSplitAsync => {
                (tiles.min(blocks_max(BLOCKS_PER_SM * 4)), 0i32)
            }
            RowsKernel::Mma | RowsKernel::MmaDeep | RowsKernel::MmaDeepRounds => {
                let per_sm = match kernel {
                    RowsKernel::MmaDeep | RowsKernel::MmaDeepRounds => blocks_by_smem(
                        launch_smem(kernel, cols, rows_per_launch(kernel, cols).min(rows)),
                        gpu.max_shared_memory,
                        MMA_BLOCKS_PER_SM,
                    ),
                    _ => MMA_BLOCKS_PER_SM,
                };
                let split = mma_split(tiles, blocks_max(per_sm) * MMA_WARPS);
                let per_block = if split { 1 } else { MMA_WARPS };
                (
                    tiles.div_ceil(per_block).min(blocks_max(per_sm)),
                    split as i32,
                )
            }
        };
        let per_launch = rows_per_launch(kernel, cols);
        let mut b0 = 0;
        while b0 < rows {
            let nb = per_launch.min(rows - b0);
            let mut at = segs;
            for (i, (w, _)) in outs.iter().enumerate() {
                at.s[i].y += (b0 * w.rows * 4) as u64;
            }
            let xb = x + (b0 * cols * 4) as u64;
            let (nb_arg, cols_arg) = (nb as i32, cols as i32);
            let smem = launch_smem(kernel, cols, nb);
            let stages = mma_deep_stages(cols, nb) as i32;
            let cfg = config((grid as u32, 1, 1), (warps * 32) as u32, smem);
            gpu.launch(function, cfg, |l| {
                l.arg(&at).arg(&xb).arg(&nb_arg).arg(&cols_arg);
                if kernel == RowsKernel::Mma {
                    l.arg(&split);
                }
                if matches!(kernel, RowsKernel::MmaDeep | RowsKernel::MmaDeepRounds) {
                    l.arg(&split).arg(&stages);
                }
            })?;
            b0 += nb;
        }
        Ok(())
    }

    /// The MoE's first half for one token; `products` (the plan's `moe_products`) picks the
    /// pipelined kernel's f32 or int8 form, `loads` (the plan's `glu_loads`) where the int8-pair
    /// kernel holds its tiles.
    pub fn glu(&self, gpu: &Gpu, a: &Glu, products: MoeProducts, loads: GluLoads) -> Result<()> {
        self.glu_launch(gpu, a, None, products, loads)
    }

    /// `glu` for each of the `rows` tokens of a batched decode step in one launch
    /// (`dec_glu4_rows`, weights `glu_rows_serves` accepts): `a`'s buffers are row 0 of
    /// router_logits [rows, n_experts], ids and route_w [rows, top_k], xn [rows, cols], h
    /// [rows, top_k, inter] and h_shared [rows, shared inter].
    pub fn glu_rows(&self, gpu: &Gpu, a: &Glu, rows: usize, products: MoeProducts) -> Result<()> {
        self.glu_launch(gpu, a, Some(rows), products, GluLoads::Registers)
    }

    fn glu_launch(
        &self,
        gpu: &Gpu,
        a: &Glu,
        token_rows: Option<usize>,
        products: MoeProducts,
        loads: GluLoads,
    ) -> Result<()> {
        let (gate, up) = (a.gate.shape(), a.up.shape());
        if !glu_serves(&gate, &up, &a.shared_gate.shape(), &a.shared_up.shape()) {
            bail!("dec_glu: expert weights it does not read");
        }
        if a.n_experts > MAX_EXPERTS || a.top_k == 0 || a.top_k > MAX_TOPK.min(a.n_experts) {
            bail!(
                "dec_glu: top {} of {} experts (limits {MAX_TOPK} of {MAX_EXPERTS})",
                a.top_k,
                a.n_experts
            );
        }
        let (_, spw) = lanes_per_row(a.gate.cols);
        let rows = a.gate.rows.max(a.shared_gate.rows);
        // All four 4-bit with one 64-column group per lane: the pipelined kernel.
        let (sgate, sup) = (a.shared_gate.shape(), a.shared_up.shape());
        let pipelined = glu_pipelined(&gate, &up, &sgate, &sup);
        let bulk = loads == GluLoads::Bulk;
        if bulk && (token_rows.is_some() || products != MoeProducts::Int8Pairs) {
            bail!("dec_glu4_x8x2_bulk: one token's int8-pair products only ({products:?})");
        }
        if bulk && !glu_bulk_serves(&gate, &up, &sgate, &sup) {
            bail!("dec_glu4_x8x2_bulk: expert weights it does not read");
        }
        let (kernel, rows_per_tile) = match (pipelined, token_rows, products) {
            _ if bulk => (&self.glu4_x8x2_bulk, WARPS * spw * GLU_R4),
            (true, None, MoeProducts::Float) => (&self.glu4, WARPS * spw * GLU_R4),
            (true, None, MoeProducts::Int8) => (&self.glu4_q8, WARPS * spw * GLU_R4),
            (true, None, MoeProducts::Int8Pairs) => (&self.glu4_x8x2, WARPS * spw * GLU_R4),
            (false, None, MoeProducts::Float) => (&self.glu, WARPS * spw * GLU_R),
            (true, Some(1..), MoeProducts::Float) => (&self.glu4_rows, WARPS * spw * GLU_R4),
            (true, Some(1..), MoeProducts::Int8) => (&self.glu4_q8_rows, WARPS * spw * GLU_R4),
            (true, Some(1..), MoeProducts::Int8Pairs) => {
                (&self.glu4_x8x2_rows, WARPS * spw * GLU_R4)
            }
            (false, _, MoeProducts::Int8 | MoeProducts::Int8Pairs) => {
                bail!("dec_glu4_q8: expert weights it does not read")
            }
            (false, Some(_), _) => bail!("dec_glu4_rows: expert weights it does not read"),
            (true, Some(_), _) => bail!("dec_glu4_rows: no rows"),
        };
        let tokens = token_rows.unwrap_or(1);
        let per_item = blocks(rows, rows_per_tile);
        let tiles = per_item as usize * (a.top_k + 1);
        // A persistent grid of as many blocks an SM as the kernel's launch bound fits, shared by
        // the tokens.
        let per_sm = match products {
            MoeProducts::Float | MoeProducts::Int8Pairs => BLOCKS_PER_SM,
            MoeProducts::Int8 => Q8_BLOCKS_PER_SM,
        };
        let per_token = (per_sm * gpu.sm_count).div_ceil(tokens);
        // moe_bulk: that grid widened where a block would hold more than GLU_BULK_SLOTS tiles,
        // each block's tiles in slots of dynamic shared memory.
        let (blocks_x, smem) = if bulk {
            let (grid, slots) = glu_bulk_grid(tiles, per_token);
            (grid, slots * GLU_BULK_SLOT)
        } else {
            (tiles.min(per_token), 0)
        };
        let (gate, up, sgate, sup) = (
            a.gate.arg(),
            a.up.arg(),
            a.shared_gate.arg(),
            a.shared_up.arg(),
        );
        let unaligned = [&gate, &up, &sgate, &sup]
            .iter()
            .any(|w| !(w.q | w.scales | w.biases).is_multiple_of(16));
        if bulk && unaligned {
            bail!("dec_glu4_x8x2_bulk: a weight not 16-byte aligned (bulk copies need it)");
        }
        let (top_k, h_stride, per_item) = (a.top_k as i32, a.gate.rows as i32, per_item as i32);
        let n_experts = a.n_experts as i32;
        let cfg = config(
            (blocks_x as u32, tokens as u32, 1),
            (WARPS * 32) as u32,
            smem,
        );
        gpu.launch(kernel, cfg, |l| {
            l.arg(&gate)
                .arg(&up)
                .arg(&a.router_logits)
                .arg(&n_experts)
                .arg(&top_k)
                .arg(&a.ids)
                .arg(&a.route_w)
                .arg(&sgate)
                .arg(&sup)
                .arg(&a.xn)
                .arg(&a.h)
                .arg(&h_stride)
                .arg(&a.h_shared)
                .arg(&per_item);
        })
    }

    /// `glu_rows` with int8-pair products grouped by expert (`dec_glu4_x8x2_grouped`, where
    /// `grouped_serves`): every block routes all `rows` rows and takes one tile of rows of every
    /// gridDim.y-th item of the union of their picks (item 0 the shared expert), each weight tile
    /// read once and dotted with every row that picked it; block (0, 0) writes the routing. The
    /// grid: the item's tiles × as many item chunks as fill BLOCKS_PER_SM blocks an SM (at least
    /// one, at most the step's items). `a`'s buffers as for `glu_rows`; `kernel` the two-buffer or
    /// the ring kernel (`grouped_moe_stream`; the same grid and outputs).
    pub fn glu_grouped(&self, gpu: &Gpu, a: &Glu, rows: usize, kernel: GroupedGlu) -> Result<()> {
        let shapes = [&a.gate, &a.up, &a.shared_gate, &a.shared_up].map(|w| w.shape());
        let [gate, up, sgate, sup] = &shapes;
        if !glu_rows_serves(gate, up, sgate, sup)
            || ![gate, up, sgate, sup].iter().all(|w| w.bits == 4)
        {
            bail!("dec_glu4_x8x2_grouped: expert weights it does not read");
        }
        if !(1..=BATCH_MAX).contains(&rows)
            || a.top_k == 0
            || rows * a.top_k > GROUPED_PICKS
            || a.top_k > a.n_experts
            || a.n_experts > GROUPED_MAX_EXPERTS
        {
            bail!(
                "dec_glu4_x8x2_grouped: {rows} rows of top {} of {} experts (limits {BATCH_MAX} rows, \
                 {GROUPED_PICKS} picks, {GROUPED_MAX_EXPERTS} experts)",
                a.top_k,
                a.n_experts
            );
        }
        if !a.xn.is_multiple_of(16) {
            bail!("dec_glu4_x8x2_grouped: the normed rows must be 16-byte aligned");
        }
        let (_, spw) = lanes_per_row(a.gate.cols);
        let per_item = blocks(a.gate.rows.max(a.shared_gate.rows), WARPS * spw * GLU_R4);
        let items = 1 + rows * a.top_k;
        let chunks = (BLOCKS_PER_SM * gpu.sm_count / per_item as usize).clamp(1, items);
        let (gate, up, sgate, sup) = (
            a.gate.arg(),
            a.up.arg(),
            a.shared_gate.arg(),
            a.shared_up.arg(),
        );
        let (n_experts, top_k, h_stride) = (a.n_experts as i32, a.top_k as i32, a.gate.rows as i32);
        let rows_arg = rows as i32;
        let cfg = config((per_item, chunks as u32, 1), (WARPS * 32) as u32, 0);
        let kernel = match kernel {
            GroupedGlu::Pairs => &self.glu4_x8x2_grouped,
            GroupedGlu::Ring => &self.glu4_x8x2_grouped_ring,
        };
        gpu.launch(kernel, cfg, |l| {
            l.arg(&gate)
                .arg(&up)
                .arg(&a.router_logits)
                .arg(&n_experts)
                .arg(&top_k)
                .arg(&a.ids)
                .arg(&a.route_w)
                .arg(&sgate)
                .arg(&sup)
                .arg(&a.xn)
                .arg(&a.h)
                .arg(&h_stride)
                .arg(&a.h_shared)
                .arg(&rows_arg);
        })
    }

    /// `down_combine_rows` with int8-pair products grouped by expert
    /// (`dec_down_combine_x8x2_grouped`, after `glu_grouped`): a block owns `dec_down_combine`'s
    /// output rows for all `rows` rows and loops over the union of their picks, each weight tile
    /// read once; each output combined in the one-token kernel's order. `a`'s buffers as for
    /// `down_combine_rows`; `block` the 12- or 16-warp kernel (the same outputs).
    pub fn down_combine_grouped(
        &self,
        gpu: &Gpu,
        a: &DownCombine,
        rows: usize,
        block: GroupedDown,
    ) -> Result<()> {
        let (down, sdown) = (a.down.shape(), a.shared_down.shape());
        let fast = [&down, &sdown]
            .iter()
            .all(|w| w.bits == 4 && w.cols / 64 <= 32);
        if !down_serves(&down, &sdown, a.top_k) || !fast {
            bail!("dec_down_combine_x8x2_grouped: expert weights it does not read");
        }
        let smem = grouped_down_smem(a.down.cols, a.top_k, rows);
        if !(1..=BATCH_MAX).contains(&rows)
            || a.top_k == 0
            || rows * a.top_k > GROUPED_PICKS
            || smem > GROUPED_SMEM_MAX
        {
            bail!(
                "dec_down_combine_x8x2_grouped: {rows} rows of top {} ({smem} bytes of shared \
                 memory; limits {BATCH_MAX} rows, {GROUPED_PICKS} picks, {GROUPED_SMEM_MAX} bytes)",
                a.top_k
            );
        }
        if ![a.h, a.h_shared].iter().all(|p| p.is_multiple_of(16)) {
            bail!("dec_down_combine_x8x2_grouped: expert inputs must be 16-byte aligned");
        }
        let (_, spw) = lanes_per_row(a.down.cols);
        let grid = blocks(a.down.rows, DOWN_WARPS * spw);
        let (down, sdown) = (a.down.arg(), a.shared_down.arg());
        let (top_k, h_stride, rows_arg) = (a.top_k as i32, a.down.cols as i32, rows as i32);
        let (kernel, columns) = match block {
            GroupedDown::Warps12 => (&self.down_combine_x8x2_grouped, DOWN_KSPLIT),
            GroupedDown::Warps16 => (&self.down_combine_x8x2_grouped_wide, GROUPED_DOWN_KCOLS),
            GroupedDown::Warps16Ring => (&self.down_combine_x8x2_grouped_ring, GROUPED_DOWN_KCOLS),
        };
        let cfg = config((grid, 1, 1), (DOWN_WARPS * columns * 32) as u32, smem);
        gpu.launch(kernel, cfg, |l| {
            l.arg(&down)
                .arg(&sdown)
                .arg(&a.ids)
                .arg(&a.weights)
                .arg(&top_k)
                .arg(&a.h)
                .arg(&h_stride)
                .arg(&a.h_shared)
                .arg(&a.shared_gate)
                .arg(&a.x)
                .arg(&rows_arg);
        })
    }

    /// The MoE's second half for one token; `products` as for `glu`; `regs` (the plan's
    /// `down_regs`) which block the int8-pair kernel runs.
    pub fn down_combine(
        &self,
        gpu: &Gpu,
        a: &DownCombine,
        products: MoeProducts,
        regs: DownRegs,
    ) -> Result<()> {
        let kernel = match (products, regs) {
            (MoeProducts::Float, _) => &self.down_combine,
            (MoeProducts::Int8, _) => &self.down_combine_q8,
            (MoeProducts::Int8Pairs, DownRegs::Unbounded) => &self.down_combine_x8x2,
            (MoeProducts::Int8Pairs, DownRegs::Next96) => &self.down_combine_x8x2_r96,
        };
        self.down_combine_launch(gpu, a, 1, kernel, products)
    }

    /// `down_combine` for each of the `rows` tokens of a batched decode step in one launch
    /// (`dec_down_combine_rows`): `a`'s buffers are row 0 of ids and weights [rows, top_k], h
    /// [rows, top_k, inter], h_shared [rows, shared inter], shared_gate [rows] and x [rows,
    /// hidden].
    pub fn down_combine_rows(
        &self,
        gpu: &Gpu,
        a: &DownCombine,
        rows: usize,
        products: MoeProducts,
    ) -> Result<()> {
        if rows == 0 {
            bail!("dec_down_combine_rows: no rows");
        }
        let kernel = match products {
            MoeProducts::Float => &self.down_combine_rows,
            MoeProducts::Int8 => &self.down_combine_q8_rows,
            MoeProducts::Int8Pairs => &self.down_combine_x8x2_rows,
        };
        self.down_combine_launch(gpu, a, rows, kernel, products)
    }

    fn down_combine_launch(
        &self,
        gpu: &Gpu,
        a: &DownCombine,
        rows: usize,
        kernel: &Kernel,
        products: MoeProducts,
    ) -> Result<()> {
        let (down, sdown) = (a.down.shape(), a.shared_down.shape());
        if !down_serves(&down, &sdown, a.top_k) {
            bail!("dec_down_combine: expert weights it does not read");
        }
        let fast = [&down, &sdown]
            .iter()
            .all(|w| w.bits == 4 && w.cols / 64 <= 32);
        if products != MoeProducts::Float
            && !(fast && down_smem(down.cols, a.top_k, products) <= DOWN_SMEM_MAX)
        {
            bail!("dec_down_combine_q8: expert weights it does not read");
        }
        if ![a.h, a.h_shared].iter().all(|p| p.is_multiple_of(16)) {
            bail!("dec_down_combine: expert inputs must be 16-byte aligned");
        }
        let (_, spw) = lanes_per_row(a.down.cols);
        let grid = blocks(a.down.rows, DOWN_WARPS * spw);
        let smem = down_smem(a.down.cols, a.top_k, products);
        let (down, sdown) = (a.down.arg(), a.shared_down.arg());
        let (top_k, h_stride) = (a.top_k as i32, a.down.cols as i32);
        let cfg = config(
            (grid, rows as u32, 1),
            (DOWN_WARPS * DOWN_KSPLIT * 32) as u32,
            smem,
        );
        gpu.launch(kernel, cfg, |l| {
            l.arg(&down)
                .arg(&sdown)
                .arg(&a.ids)
                .arg(&a.weights)
                .arg(&top_k)
                .arg(&a.h)
                .arg(&h_stride)
                .arg(&a.h_shared)
                .arg(&a.shared_gate)
                .arg(&a.x);
        })
    }

    /// Whether the one-token DeltaNet kernels serve this shape.
    pub fn dn_serves(n_k: usize, n_v: usize, dk: usize, dv: usize, kernel: usize) -> bool {
        (1..=DN_MAX_K).contains(&kernel)
            && dk.is_multiple_of(32)
            && dk <= DN_MAX_DK
            && dv.is_multiple_of(DN_COLS)
            && n_k > 0
            && n_v.is_multiple_of(n_k)
    }

    pub fn dn_conv(&self, gpu: &Gpu, a: &DnConv) -> Result<()> {
        self.dn_conv_launch(gpu, a, None)
    }

    /// `dn_conv` for the `rows` sequences of a batched decode step in one launch: `a.m` and `a.c`
    /// are row 0 of [rows, conv_dim], `a.conv_state` a device table of `rows` conv-state
    /// pointers (u64), row b's state at entry b.
    pub fn dn_conv_rows(&self, gpu: &Gpu, a: &DnConv, rows: usize) -> Result<()> {
        self.dn_conv_launch(gpu, a, Some(rows))
    }

    fn dn_conv_launch(&self, gpu: &Gpu, a: &DnConv, rows: Option<usize>) -> Result<()> {
        if !(1..=DN_MAX_K).contains(&a.kernel) {
            bail!("dec_dn_conv: {} conv taps (1..={DN_MAX_K})", a.kernel);
        }
        let (kernel, n) = match rows {
            None => (&self.dn_conv, 1),
            Some(0) => bail!("dec_dn_conv_rows: no rows"),
            Some(n) => (&self.dn_conv_rows, n as u32),
        };
        let (conv_dim, k) = (a.conv_dim as i32, a.kernel as i32);
        let cfg = config((blocks(a.conv_dim, 128), n, 1), 128, 0);
        gpu.launch(kernel, cfg, |l| {
            l.arg(&a.m)
                .arg(&a.conv_state)
                .arg(&a.weight)
                .arg(&a.c)
                .arg(&conv_dim)
                .arg(&k);
        })
    }

    pub fn dn_step(&self, gpu: &Gpu, a: &DnStep, eps: f32) -> Result<()> {
        self.dn_step_launch(gpu, a, eps, None)
    }

    /// `dn_step` for the `rows` sequences of a batched decode step in one launch: `a.c`, `a.b`,
    /// `a.a` and `a.o` are row 0 of their [rows, ...] buffers, `a.state` a device table of
    /// `rows` recurrent-state pointers (u64), row r's state at entry r.
    pub fn dn_step_rows(&self, gpu: &Gpu, a: &DnStep, eps: f32, rows: usize) -> Result<()> {
        self.dn_step_launch(gpu, a, eps, Some(rows))
    }

    fn dn_step_launch(&self, gpu: &Gpu, a: &DnStep, eps: f32, rows: Option<usize>) -> Result<()> {
        if !Self::dn_serves(a.n_k, a.n_v, a.dk, a.dv, 1) {
            bail!(
                "dec_dn_step: heads {}/{} of dims {}/{} (dk a multiple of 32 up to {DN_MAX_DK}, dv of {DN_COLS})",
                a.n_k,
                a.n_v,
                a.dk,
                a.dv
            );
        }
        let (kernel, n) = match rows {
            None => (&self.dn_step, 1),
            Some(0) => bail!("dec_dn_step_rows: no rows"),
            Some(n) => (&self.dn_step_rows, n as u32),
        };
        let grid = (a.n_v as u32, (a.dv / DN_COLS) as u32, n);
        let (n_k, n_v, dk, dv) = (a.n_k as i32, a.n_v as i32, a.dk as i32, a.dv as i32);
        gpu.launch(kernel, config(grid, 128, 0), |l| {
            l.arg(&a.c)
                .arg(&a.b)
                .arg(&a.a)
                .arg(&a.a_log)
                .arg(&a.dt_bias)
                .arg(&a.state)
                .arg(&a.o)
                .arg(&n_k)
                .arg(&n_v)
                .arg(&dk)
                .arg(&dv)
                .arg(&eps);
        })
    }
}
