//! Typed launchers, one per kernel in shaders/cuda/. They take raw device addresses (so callers
//! can point into the middle of a buffer) and compute grids; the kernels' shapes are documented
//! at the top of each .cu file. Every other module launches kernels only through these.

use std::ffi::c_void;

use anyhow::{bail, Result};

use crate::device::{DevBuf, Gpu, Kernel};

/// A kernel argument, held in memory the launch can point at.
pub enum Arg {
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
    F64(f64),
    Weight(QWeightArg),
}

fn go(
    gpu: &Gpu,
    k: &Kernel,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    args: Vec<Arg>,
) -> Result<()> {
    go_smem(gpu, k, grid, block, 0, args)
}

/// `go` with `smem` bytes of dynamic shared memory.
fn go_smem(
    gpu: &Gpu,
    k: &Kernel,
    grid: (u32, u32, u32),
    block: (u32, u32, u32),
    smem: u32,
    mut args: Vec<Arg>,
) -> Result<()> {
    let mut ptrs: Vec<*mut c_void> = args
        .iter_mut()
        .map(|a| match a {
            Arg::Ptr(v) => v as *mut u64 as *mut c_void,
            Arg::I32(v) => v as *mut i32 as *mut c_void,
            Arg::I64(v) => v as *mut i64 as *mut c_void,
            Arg::F32(v) => v as *mut f32 as *mut c_void,
            Arg::F64(v) => v as *mut f64 as *mut c_void,
            Arg::Weight(v) => v as *mut QWeightArg as *mut c_void,
        })
        .collect();
    gpu.launch(k, grid, block, smem, &mut ptrs)
}

fn i(v: usize) -> Arg {
    Arg::I32(v as i32)
}
fn p(v: u64) -> Arg {
    Arg::Ptr(v)
}
fn f(v: f32) -> Arg {
    Arg::F32(v)
}
/// linear.cu reads activations with 16-byte vector loads: rows must start 16-byte aligned.
fn check_x(kernel: &str, x: u64, x_stride: usize) -> Result<()> {
    if !x.is_multiple_of(16) || !x_stride.is_multiple_of(4) {
        bail!("{kernel}: activations at {x:#x} with row stride {x_stride} are not 16-byte aligned");
    }
    Ok(())
}

fn blocks(n: usize, per: usize) -> u32 {
    n.div_ceil(per) as u32
}

/// `struct QWeight` of common.cuh, passed by value.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct QWeightArg {
    pub q: u64,
    pub scales: u64,
    pub biases: u64,
    pub bits: i32,
    pub rows: i32,
    pub cols: i32,
    pub group: i32,
}

/// A weight matrix (or a stack of expert matrices) on the device, in the checkpoint's own packing.
pub struct DevLinear {
    pub experts: usize,
    pub rows: usize,
    pub cols: usize,
    /// 4 or 8 (MLX affine), 16 (bf16).
    pub bits: u32,
    pub group: usize,
    pub q: DevBuf,
    pub scales: Option<DevBuf>,
    pub biases: Option<DevBuf>,
}

impl DevLinear {
    pub fn arg(&self) -> QWeightArg {
        QWeightArg {
            q: self.q.ptr,
            scales: self.scales.as_ref().map_or(0, |b| b.ptr),
            biases: self.biases.as_ref().map_or(0, |b| b.ptr),
            bits: self.bits as i32,
            rows: self.rows as i32,
            cols: self.cols as i32,
            group: self.group as i32,
        }
    }
}

// Must match the #defines at the top of each kernel file.
const LINEAR_WARPS: usize = 4;
const LINEAR_TOK: usize = 4;
const LINEAR_WIDE_TOK: usize = 16;
/// Items per tile of linear_grouped (GROUP_TILE in linear.cu and moe.cu).
pub const GROUP_TILE: usize = 16;
const ATTN_MAX_D: usize = 256;
/// Split-KV decode (attention.cu): partial slots per (token, query head), and query heads per block.
pub const SPLIT_MAX_SPLITS: usize = 256;
/// Threads of an `attn_split` block: SPLIT_WARPS (2) warps.
const SPLIT_THREADS: usize = 2 * 32;
const SPLIT_MAX_G: usize = 8;
/// Most tokens one split-KV launch serves (its partials are sized for this many).
pub const SPLIT_MAX_TOK: usize = 4;
const DN_MAX_K: usize = 8;
const DN_MAX_DK: usize = 128;
/// Value columns per dn_recurrent block (DN_COLS_PER_BLOCK in deltanet.cu).
const DN_COLS_PER_BLOCK: usize = 16;
const MOE_MAX_E: usize = 1024;

/// Shape limits of the simple kernels, checked once when a model is loaded.
pub fn check_limits(cfg: &lily_core::config::ModelConfig) -> Result<()> {
    if cfg.head_dim > ATTN_MAX_D {
        bail!(
            "head_dim {} exceeds the CUDA attention kernel's limit {ATTN_MAX_D}",
            cfg.head_dim
        );
    }
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
    if cfg.n_experts > MOE_MAX_E || cfg.top_k > 32 {
        bail!(
            "{} experts / top {} exceed the CUDA router's limits ({MOE_MAX_E} / 32)",
            cfg.n_experts,
            cfg.top_k
        );
    }
    Ok(())
}

pub fn embed(gpu: &Gpu, w: &DevLinear, tokens: u64, x: u64, n_tok: usize) -> Result<()> {
    go(
        gpu,
        &gpu.kernels.embed,
        (n_tok as u32, 1, 1),
        (128, 1, 1),
        vec![Arg::Weight(w.arg()), p(tokens), p(x), i(n_tok)],
    )
}

#[allow(clippy::too_many_arguments)]
pub fn rms_norm(
    gpu: &Gpu,
    x: u64,
    x_stride: usize,
    w: u64,
    y: u64,
    y_stride: usize,
    cols: usize,
    eps: f32,
    rows: usize,
) -> Result<()> {
    let args = vec![
        p(x),
        i(x_stride),
        p(w),
        p(y),
        i(y_stride),
        i(cols),
        f(eps),
        i(rows),
    ];
    go(
        gpu,
        &gpu.kernels.rms_norm,
        (rows as u32, 1, 1),
        (256, 1, 1),
        args,
    )
}

/// y[n, :] (+)= W x[n, :] for n < n_tok.
#[allow(clippy::too_many_arguments)]
pub fn linear(
    gpu: &Gpu,
    w: &DevLinear,
    x: u64,
    x_stride: usize,
    y: u64,
    y_stride: usize,
    n_tok: usize,
    accumulate: bool,
) -> Result<()> {
    check_x("linear", x, x_stride)?;
    if n_tok >= TENSOR_CORE_MIN_TOK && gemm_fits(gpu, w) {
        return gemm_dense(gpu, w, x, x_stride, y, y_stride, n_tok, accumulate);
    }
    let mode = if accumulate { 1 } else { 0 };
    linear_cuda_cores(gpu, w, x, x_stride, y, y_stride, n_tok, mode)
}

/// The MoE router's logits: y = W x in fp32 from the stored weights (not rounded to bf16 on the
/// way in or out, also in bf16 mode), so top-k routing, which a rounding can flip, follows the
/// fp32 model wherever it can. Prefill chunks in bf16 mode run `gemm_dense_exact` (tensor cores,
/// weights split into bf16 hi + lo; x is bf16-valued there), the rest the CUDA-core kernels
/// (LILY_EXACT_ROUTER_TC=0 keeps those for prefill too).
#[allow(clippy::too_many_arguments)]
pub fn linear_router(
    gpu: &Gpu,
    w: &DevLinear,
    x: u64,
    x_stride: usize,
    y: u64,
    y_stride: usize,
    n_tok: usize,
) -> Result<()> {
    check_x("linear_router", x, x_stride)?;
    if n_tok >= TENSOR_CORE_MIN_TOK && gemm_fits(gpu, w) && gpu.exact_router_on_tensor_cores {
        let grid = (blocks(w.rows, GEMM_BN), blocks(n_tok, 64), 1);
        let args = vec![
            Arg::Weight(w.arg()),
            p(x),
            i(x_stride),
            p(y),
            i(y_stride),
            i(n_tok),
        ];
        let smem = gemm_smem_exact(64) as u32;
        let k = &gpu.kernels.gemm_dense_exact;
        return go_smem(gpu, k, grid, (GEMM_THREADS, 1, 1), smem, args);
    }
    linear_cuda_cores(gpu, w, x, x_stride, y, y_stride, n_tok, 2)
}

/// linear / linear_wide with the store mode of linear_rows (0 round, 1 accumulate, 2 exact).
#[allow(clippy::too_many_arguments)]
fn linear_cuda_cores(
    gpu: &Gpu,
    w: &DevLinear,
    x: u64,
    x_stride: usize,
    y: u64,
    y_stride: usize,
    n_tok: usize,
    mode: usize,
) -> Result<()> {
    // Prefill: reuse each dequantised weight word for 16 tokens; decode: 4 (less idle work).
    let (kernel, tok) = if n_tok >= LINEAR_WIDE_TOK {
        (&gpu.kernels.linear_wide, LINEAR_WIDE_TOK)
    } else {
        (&gpu.kernels.linear, LINEAR_TOK)
    };
    let grid = (blocks(w.rows, LINEAR_WARPS), blocks(n_tok, tok), 1);
    let args = vec![
        Arg::Weight(w.arg()),
        p(x),
        i(x_stride),
        p(y),
        i(y_stride),
        i(n_tok),
        i(mode),
    ];
    go(gpu, kernel, grid, ((LINEAR_WARPS * 32) as u32, 1, 1), args)
}

/// y[n, :] = W_{ids[n]} x[n / x_div, :] for n < n_items.
#[allow(clippy::too_many_arguments)]
pub fn linear_gather(
    gpu: &Gpu,
    w: &DevLinear,
    ids: u64,
    x: u64,
    x_stride: usize,
    x_div: usize,
    y: u64,
    y_stride: usize,
    n_items: usize,
) -> Result<()> {
    check_x("linear_gather", x, x_stride)?;
    let grid = (blocks(w.rows, LINEAR_WARPS), n_items as u32, 1);
    let args = vec![
        Arg::Weight(w.arg()),
        p(ids),
        p(x),
        i(x_stride),
        i(x_div),
        p(y),
        i(y_stride),
        i(n_items),
    ];
    go(
        gpu,
        &gpu.kernels.linear_gather,
        grid,
        ((LINEAR_WARPS * 32) as u32, 1, 1),
        args,
    )
}

// gemm.cu's tiles (must match its #defines).
const GEMM_BN: usize = 128;
const GEMM_BK: usize = 64;
const GEMM_LDS: usize = GEMM_BK + 8;
const GEMM_THREADS: u32 = 256;
/// Fewest tokens of a step that take the tensor-core kernels (gemm.cu, `attn_prefill`): one
/// warp's 16 mma rows; shorter steps (decode) keep the CUDA-core kernels.
pub const TENSOR_CORE_MIN_TOK: usize = 16;

/// Dynamic shared memory of a gemm.cu block with `bm` rows: two stages of A and B tiles in bf16.
pub const fn gemm_smem(bm: usize) -> usize {
    2 * (bm + GEMM_BN) * GEMM_LDS * 2
}

/// gemm_dense_exact's dynamic shared memory: gemm_smem plus two stages of residue tiles.
pub const fn gemm_smem_exact(bm: usize) -> usize {
    gemm_smem(bm) + 2 * GEMM_BN * GEMM_LDS * 2
}

/// Whether the tensor-core kernels serve this weight (else the CUDA-core kernels run).
pub fn gemm_fits(gpu: &Gpu, w: &DevLinear) -> bool {
    gpu.tensor_cores
        && w.cols.is_multiple_of(GEMM_BK)
        && matches!(w.bits, 4 | 8 | 16)
        && (w.bits == 16 || w.group.is_multiple_of(32))
}

/// y[n, :] (+)= W x[n, :] on tensor cores, 64 tokens × 128 rows per block.
#[allow(clippy::too_many_arguments)]
pub fn gemm_dense(
    gpu: &Gpu,
    w: &DevLinear,
    x: u64,
    x_stride: usize,
    y: u64,
    y_stride: usize,
    n_tok: usize,
    accumulate: bool,
) -> Result<()> {
    check_x("gemm_dense", x, x_stride)?;
    let grid = (blocks(w.rows, GEMM_BN), blocks(n_tok, 64), 1);
    let args = vec![
        Arg::Weight(w.arg()),
        p(x),
        i(x_stride),
        p(y),
        i(y_stride),
        i(n_tok),
        i(accumulate as usize),
    ];
    let smem = gemm_smem(64) as u32;
    go_smem(
        gpu,
        &gpu.kernels.gemm_dense,
        grid,
        (GEMM_THREADS, 1, 1),
        smem,
        args,
    )
}

/// The arguments linear_grouped and gemm_grouped share.
#[allow(clippy::too_many_arguments)]
fn grouped_args(
    w: &DevLinear,
    perm: u64,
    tiles: u64,
    n_tiles: u64,
    x: u64,
    x_stride: usize,
    x_div: usize,
    y: u64,
    y_stride: usize,
) -> Vec<Arg> {
    vec![
        Arg::Weight(w.arg()),
        p(perm),
        p(tiles),
        p(n_tiles),
        p(x),
        i(x_stride),
        i(x_div),
        p(y),
        i(y_stride),
    ]
}

/// linear_grouped on tensor cores, over tiles of up to `tile` (32 or 64) items that moe_group
/// built with the same tile size.
#[allow(clippy::too_many_arguments)]
pub fn gemm_grouped(
    gpu: &Gpu,
    w: &DevLinear,
    tile: usize,
    perm: u64,
    tiles: u64,
    n_tiles: u64,
    max_tiles: usize,
    x: u64,
    x_stride: usize,
    x_div: usize,
    y: u64,
    y_stride: usize,
) -> Result<()> {
    check_x("gemm_grouped", x, x_stride)?;
    let kernel = match tile {
        64 => &gpu.kernels.gemm_grouped64,
        32 => &gpu.kernels.gemm_grouped32,
        _ => bail!("gemm_grouped: tiles of {tile} items (expected 32 or 64)"),
    };
    let grid = (blocks(w.rows, GEMM_BN), max_tiles as u32, 1);
    let args = grouped_args(w, perm, tiles, n_tiles, x, x_stride, x_div, y, y_stride);
    go_smem(
        gpu,
        kernel,
        grid,
        (GEMM_THREADS, 1, 1),
        gemm_smem(tile) as u32,
        args,
    )
}

/// Shapes of the gated attention of one model.
#[derive(Clone, Copy)]
pub struct AttnShape {
    pub n_q: usize,
    pub n_kv: usize,
    pub d: usize,
    pub rotary: usize,
    pub theta: f32,
    pub eps: f32,
}

pub struct QkPrep {
    pub qg: u64,
    pub k: u64,
    pub v: u64,
    pub q_out: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub q_norm: u64,
    pub k_norm: u64,
    pub pos: u64,
}

pub fn attn_qk_prep(gpu: &Gpu, s: AttnShape, b: &QkPrep, n_tok: usize) -> Result<()> {
    let args = vec![
        p(b.qg),
        p(b.k),
        p(b.v),
        p(b.q_out),
        p(b.k_cache),
        p(b.v_cache),
        p(b.q_norm),
        p(b.k_norm),
        p(b.pos),
        i(n_tok),
        i(s.n_q),
        i(s.n_kv),
        i(s.d),
        i(s.rotary),
        f(s.theta),
        f(s.eps),
    ];
    go(
        gpu,
        &gpu.kernels.attn_qk_prep,
        (n_tok as u32, (s.n_q + s.n_kv) as u32, 1),
        (128, 1, 1),
        args,
    )
}

/// The arguments `attn_decode` and `attn_prefill` share (same inputs, same output).
#[allow(clippy::too_many_arguments)]
fn attn_args(
    s: AttnShape,
    q: u64,
    qg: u64,
    k_cache: u64,
    v_cache: u64,
    out: u64,
    pos: u64,
    n_tok: usize,
) -> Vec<Arg> {
    let scale = 1.0 / (s.d as f32).sqrt();
    vec![
        p(q),
        p(qg),
        p(k_cache),
        p(v_cache),
        p(out),
        p(pos),
        i(n_tok),
        i(s.n_q),
        i(s.n_kv),
        i(s.d),
        f(scale),
    ]
}

#[allow(clippy::too_many_arguments)]
pub fn attn_decode(
    gpu: &Gpu,
    s: AttnShape,
    q: u64,
    qg: u64,
    k_cache: u64,
    v_cache: u64,
    out: u64,
    pos: u64,
    n_tok: usize,
) -> Result<()> {
    let args = attn_args(s, q, qg, k_cache, v_cache, out, pos, n_tok);
    go(
        gpu,
        &gpu.kernels.attn_decode,
        (n_tok as u32, s.n_q as u32, 1),
        (128, 1, 1),
        args,
    )
}

/// Queries per `attn_prefill` block (PF_Q in attention.cu) and its threads (PF_THREADS).
const PREFILL_Q: usize = 64;
const PREFILL_THREADS: usize = 4 * 32;

/// Keys per `attn_prefill` tile for head dim `d` (PF_KEYS_SMALL / PF_KEYS_256 in attention.cu),
/// `None` for a head dim it does not serve.
fn prefill_keys(d: usize) -> Option<usize> {
    match d {
        64 | 128 => Some(64),
        256 => Some(32),
        _ => None,
    }
}

/// Dynamic shared memory of an `attn_prefill` block for head dim `d`: the Q tile and one K and
/// one V tile, bf16, rows padded by 8 elements.
pub fn attn_prefill_smem(d: usize) -> Option<usize> {
    prefill_keys(d).map(|keys| (PREFILL_Q + 2 * keys) * (d + 8) * 2)
}

/// The most dynamic shared memory `attn_prefill` asks for (any supported head dim); the kernel
/// is allowed this much once, when it is loaded.
pub fn attn_prefill_max_smem() -> usize {
    [64, 128, 256]
        .into_iter()
        .filter_map(attn_prefill_smem)
        .max()
        .unwrap_or(0)
}

/// Whether `attn_prefill` serves this shape and chunk (else `attn_decode` runs). Callers use it
/// only with bf16 activations: it rounds q, k, v and the softmax weights to bf16.
pub fn attn_prefill_fits(s: AttnShape, n_tok: usize) -> bool {
    n_tok >= TENSOR_CORE_MIN_TOK
        && prefill_keys(s.d).is_some()
        && s.n_kv > 0
        && s.n_q.is_multiple_of(s.n_kv)
}

/// Causal gated attention of a prefill chunk on tensor cores (bf16 mma, fp32 softmax and
/// accumulation): same inputs and output as `attn_decode`. Any `n_tok` works; head dims 64, 128
/// and 256 only.
#[allow(clippy::too_many_arguments)]
pub fn attn_prefill(
    gpu: &Gpu,
    s: AttnShape,
    q: u64,
    qg: u64,
    k_cache: u64,
    v_cache: u64,
    out: u64,
    pos: u64,
    n_tok: usize,
) -> Result<()> {
    let Some(smem) = attn_prefill_smem(s.d) else {
        bail!("attn_prefill: head_dim {} (supported: 64, 128, 256)", s.d);
    };
    if s.n_kv == 0 || !s.n_q.is_multiple_of(s.n_kv) {
        bail!(
            "attn_prefill: {} query heads over {} kv heads",
            s.n_q,
            s.n_kv
        );
    }
    // 16-byte loads of q and of the cache rows, 8-byte loads and stores of the gate and output.
    if [q, k_cache, v_cache].iter().any(|a| !a.is_multiple_of(16))
        || [qg, out].iter().any(|a| !a.is_multiple_of(8))
    {
        bail!("attn_prefill: q, the caches, qg or out are not aligned for vector loads");
    }
    if n_tok == 0 {
        return Ok(());
    }
    let args = attn_args(s, q, qg, k_cache, v_cache, out, pos, n_tok);
    go_smem(
        gpu,
        &gpu.kernels.attn_prefill,
        (blocks(n_tok, PREFILL_Q), s.n_q as u32, 1),
        (PREFILL_THREADS as u32, 1, 1),
        smem as u32,
        args,
    )
}

/// Whether the split-KV kernels serve this shape and step (else `attn_decode` runs).
pub fn split_kv_fits(s: AttnShape, n_tok: usize) -> bool {
    n_tok <= SPLIT_MAX_TOK && s.d <= ATTN_MAX_D && s.d.is_multiple_of(8)
}

/// Scratch for split-KV attention: f32 elements of (part_o, part_ml).
pub fn split_kv_scratch(n_q: usize, d: usize) -> (usize, usize) {
    let slots = SPLIT_MAX_TOK * n_q * SPLIT_MAX_SPLITS;
    (slots * d, slots * 2)
}

/// Split-KV (flash-decoding) attention: `attn_split` then `attn_split_combine`; same inputs and
/// output as `attn_decode`. The grid does not depend on the position (graph capture): blocks
/// past the live splits exit at once.
#[allow(clippy::too_many_arguments)]
pub fn attn_split(
    gpu: &Gpu,
    s: AttnShape,
    q: u64,
    qg: u64,
    k_cache: u64,
    v_cache: u64,
    part_o: u64,
    part_ml: u64,
    out: u64,
    pos: u64,
    n_tok: usize,
) -> Result<()> {
    if !split_kv_fits(s, n_tok) {
        bail!(
            "split-KV attention: {n_tok} tokens with head_dim {} (limits: {SPLIT_MAX_TOK} tokens, head_dim a multiple of 8 up to {ATTN_MAX_D})",
            s.d
        );
    }
    let scale = 1.0 / (s.d as f32).sqrt();
    let group = s.n_q / s.n_kv;
    let chunks = group.div_ceil(SPLIT_MAX_G);
    let args = vec![
        p(q),
        p(k_cache),
        p(v_cache),
        p(part_o),
        p(part_ml),
        p(pos),
        i(n_tok),
        i(s.n_q),
        i(s.n_kv),
        i(s.d),
        f(scale),
    ];
    go(
        gpu,
        &gpu.kernels.attn_split,
        (
            SPLIT_MAX_SPLITS as u32,
            (s.n_kv * chunks) as u32,
            n_tok as u32,
        ),
        (SPLIT_THREADS as u32, 1, 1),
        args,
    )?;
    let args = vec![
        p(qg),
        p(part_o),
        p(part_ml),
        p(out),
        p(pos),
        i(n_tok),
        i(s.n_q),
        i(s.d),
    ];
    go(
        gpu,
        &gpu.kernels.attn_split_combine,
        (s.n_q as u32, n_tok as u32, 1),
        (128, 1, 1),
        args,
    )
}

/// The causal conv over a chunk (one thread per channel and token), then the conv state update.
#[allow(clippy::too_many_arguments)]
pub fn dn_conv(
    gpu: &Gpu,
    m: u64,
    m_stride: usize,
    conv_state: u64,
    w: u64,
    c: u64,
    n_tok: usize,
    conv_dim: usize,
    k: usize,
) -> Result<()> {
    let args = vec![
        p(m),
        i(m_stride),
        p(conv_state),
        p(w),
        p(c),
        i(n_tok),
        i(conv_dim),
        i(k),
    ];
    go(
        gpu,
        &gpu.kernels.dn_conv,
        (blocks(conv_dim, 128), n_tok as u32, 1),
        (128, 1, 1),
        args,
    )?;
    let args = vec![
        p(m),
        i(m_stride),
        p(conv_state),
        i(n_tok),
        i(conv_dim),
        i(k),
    ];
    go(
        gpu,
        &gpu.kernels.dn_conv_state,
        (blocks(conv_dim, 128), 1, 1),
        (128, 1, 1),
        args,
    )
}

/// Shapes of the Gated DeltaNet of one model.
#[derive(Clone, Copy)]
pub struct DnShape {
    pub n_k: usize,
    pub n_v: usize,
    pub dk: usize,
    pub dv: usize,
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

/// dn_prep (norms and gates of every token, in parallel) then the recurrence.
pub fn dn_recurrent(gpu: &Gpu, s: DnShape, b: &DnRecurrent, n_tok: usize) -> Result<()> {
    let conv_dim = 2 * s.n_k * s.dk + s.n_v * s.dv;
    let args = vec![
        p(b.c),
        i(conv_dim),
        p(b.b),
        p(b.a),
        i(b.ba_stride),
        p(b.a_log),
        p(b.dt_bias),
        p(b.qk),
        p(b.ab),
        i(n_tok),
        i(s.n_k),
        i(s.n_v),
        i(s.dk),
        f(1e-6),
    ];
    go(
        gpu,
        &gpu.kernels.dn_prep,
        (n_tok as u32, s.n_k as u32, 1),
        (128, 1, 1),
        args,
    )?;
    let args = vec![
        p(b.c),
        p(b.qk),
        p(b.ab),
        p(b.state),
        p(b.o),
        i(n_tok),
        i(s.n_k),
        i(s.n_v),
        i(s.dk),
        i(s.dv),
    ];
    go(
        gpu,
        &gpu.kernels.dn_recurrent,
        (s.n_v as u32, (s.dv / DN_COLS_PER_BLOCK) as u32, 1),
        (128, 1, 1),
        args,
    )
}

#[allow(clippy::too_many_arguments)]
pub fn dn_gated_norm(
    gpu: &Gpu,
    s: DnShape,
    o: u64,
    z: u64,
    z_stride: usize,
    w: u64,
    y: u64,
    n_tok: usize,
    eps: f32,
) -> Result<()> {
    let args = vec![
        p(o),
        p(z),
        i(z_stride),
        p(w),
        p(y),
        i(n_tok),
        i(s.n_v),
        i(s.dv),
        f(eps),
    ];
    go(
        gpu,
        &gpu.kernels.dn_gated_norm,
        (n_tok as u32, s.n_v as u32, 1),
        (128, 1, 1),
        args,
    )
}

pub fn moe_route(
    gpu: &Gpu,
    logits: u64,
    ids: u64,
    weights: u64,
    n_tok: usize,
    n_experts: usize,
    top_k: usize,
) -> Result<()> {
    let args = vec![
        p(logits),
        p(ids),
        p(weights),
        i(n_tok),
        i(n_experts),
        i(top_k),
    ];
    go(
        gpu,
        &gpu.kernels.moe_route,
        (n_tok as u32, 1, 1),
        (32, 1, 1),
        args,
    )
}

/// Upper bound of the tiles moe_group can produce for `n_items` items over `n_experts`.
pub fn max_group_tiles(n_items: usize, n_experts: usize) -> usize {
    n_items.div_ceil(GROUP_TILE) + n_experts.min(n_items)
}

/// Groups routed items by expert into tiles of at most `tile` items (GROUP_TILE for
/// linear_grouped, 32 or 64 for gemm_grouped): `perm` [n_items], `tiles` [max_group_tiles][3],
/// `n_tiles` [1].
#[allow(clippy::too_many_arguments)]
pub fn moe_group(
    gpu: &Gpu,
    ids: u64,
    n_items: usize,
    n_experts: usize,
    tile: usize,
    perm: u64,
    tiles: u64,
    n_tiles: u64,
) -> Result<()> {
    if !(GROUP_TILE..=64).contains(&tile) {
        bail!("moe_group: tiles of {tile} items (expected {GROUP_TILE}..=64)");
    }
    let args = vec![
        p(ids),
        i(n_items),
        i(n_experts),
        i(tile),
        p(perm),
        p(tiles),
        p(n_tiles),
    ];
    go(gpu, &gpu.kernels.moe_group, (1, 1, 1), (1024, 1, 1), args)
}

/// y[item, :] = W_{expert} x[item / x_div, :] over the tiles moe_group built.
#[allow(clippy::too_many_arguments)]
pub fn linear_grouped(
    gpu: &Gpu,
    w: &DevLinear,
    perm: u64,
    tiles: u64,
    n_tiles: u64,
    max_tiles: usize,
    x: u64,
    x_stride: usize,
    x_div: usize,
    y: u64,
    y_stride: usize,
) -> Result<()> {
    check_x("linear_grouped", x, x_stride)?;
    let grid = (blocks(w.rows, LINEAR_WARPS), max_tiles as u32, 1);
    let args = grouped_args(w, perm, tiles, n_tiles, x, x_stride, x_div, y, y_stride);
    go(
        gpu,
        &gpu.kernels.linear_grouped,
        grid,
        ((LINEAR_WARPS * 32) as u32, 1, 1),
        args,
    )
}

pub fn silu_mul(gpu: &Gpu, g: u64, u: u64, h: u64, n: usize) -> Result<()> {
    go(
        gpu,
        &gpu.kernels.silu_mul,
        (blocks(n, 256), 1, 1),
        (256, 1, 1),
        vec![p(g), p(u), p(h), Arg::I64(n as i64)],
    )
}

#[allow(clippy::too_many_arguments)]
pub fn moe_combine(
    gpu: &Gpu,
    x: u64,
    y_experts: u64,
    weights: u64,
    y_shared: u64,
    shared_gate: u64,
    n_tok: usize,
    hidden: usize,
    top_k: usize,
) -> Result<()> {
    let args = vec![
        p(x),
        p(y_experts),
        p(weights),
        p(y_shared),
        p(shared_gate),
        i(n_tok),
        i(hidden),
        i(top_k),
    ];
    go(
        gpu,
        &gpu.kernels.moe_combine,
        (blocks(n_tok * hidden, 256), 1, 1),
        (256, 1, 1),
        args,
    )
}

pub fn argmax_logprob(
    gpu: &Gpu,
    logits: u64,
    vocab: usize,
    token_out: u64,
    logprob_out: u64,
) -> Result<()> {
    let args = vec![p(logits), i(vocab), p(token_out), p(logprob_out)];
    go(
        gpu,
        &gpu.kernels.argmax_logprob,
        (1, 1, 1),
        (1024, 1, 1),
        args,
    )
}

/// Largest top_k the device sampler takes (PICK_MAX_K in sample.cu).
pub const PICK_MAX_K: u32 = 256;

/// The sampler's knobs as sample.cu takes them (`SamplingParams`, with 1/temperature computed
/// in f32 exactly as the host sampler does).
#[derive(Clone, Copy, Debug)]
pub struct PickParams {
    pub inv_t: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition: f32,
    pub presence: f32,
    pub frequency: f32,
}

/// Buffers of one device sampling step (see sample.cu): `hist` [vocab] u32 history, `bias_ids`
/// (sorted stably) / `bias_vals` [n_bias], `scaled` [vocab] f32 scratch.
pub struct PickBuffers {
    pub hist: u64,
    pub bias_ids: u64,
    pub bias_vals: u64,
    pub n_bias: usize,
    pub scaled: u64,
}

/// Steps 1–6 of the host sampler on the device, with `u` the host-drawn uniform: writes the
/// token to `token_out`, its raw log-probability to `logprob_out`, and updates `b.hist`.
#[allow(clippy::too_many_arguments)]
pub fn sample_pick(
    gpu: &Gpu,
    logits: u64,
    vocab: usize,
    pp: &PickParams,
    b: &PickBuffers,
    u: f64,
    token_out: u64,
    logprob_out: u64,
) -> Result<()> {
    if pp.top_k == 0 || pp.top_k > PICK_MAX_K {
        bail!(
            "device sampling takes top_k in 1..={PICK_MAX_K}, got {}",
            pp.top_k
        );
    }
    go(
        gpu,
        &gpu.kernels.sample_adjust,
        (blocks(vocab, 256), 1, 1),
        (256, 1, 1),
        vec![
            p(logits),
            i(vocab),
            p(b.hist),
            p(b.bias_ids),
            p(b.bias_vals),
            i(b.n_bias),
            f(pp.repetition),
            f(pp.presence),
            f(pp.frequency),
            f(pp.inv_t),
            p(b.scaled),
        ],
    )?;
    let remember = pp.repetition != 1.0;
    go(
        gpu,
        &gpu.kernels.sample_pick,
        (1, 1, 1),
        (1024, 1, 1),
        vec![
            p(logits),
            p(b.scaled),
            i(vocab),
            i(pp.top_k as usize),
            f(pp.top_p),
            f(pp.min_p),
            Arg::F64(u),
            i(remember as usize),
            p(b.hist),
            p(token_out),
            p(logprob_out),
        ],
    )
}

pub fn advance_pos(gpu: &Gpu, pos: u64, n: usize) -> Result<()> {
    go(
        gpu,
        &gpu.kernels.advance_pos,
        (1, 1, 1),
        (32, 1, 1),
        vec![p(pos), i(n)],
    )
}
