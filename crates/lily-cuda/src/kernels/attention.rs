//! attention.cu: gated full attention (MODEL.md §2.4) between the q/k/v projections and o_proj:
//! q/k prep and the KV-cache write, then one of three kinds of kernel with the same inputs and
//! output (the plan picks, `plan::AttentionKernels`): split-KV decode (`SplitKernel`), flash
//! prefill on tensor cores (`PrefillKernel`), or one block per (token, query head).

use anyhow::{bail, Result};
use lily_core::config::ModelConfig;

use super::{blocks, config, KernelFile};
use crate::gpu::{Gpu, Kernel, Module};

/// Largest head dim (attn_decode and attn_split keep a head's row in shared memory).
pub const ATTN_MAX_D: usize = 256;
/// Warps of an attn_decode block.
pub const ATTN_WARPS: usize = 4;
/// Split-KV decode: partial slots per (token, query head), i.e. the most splits of the cache.
/// 128: at 4K of context 128 splits of 32 keys per kv head (256 blocks of 4 warps, about two per
/// SM); at 128K 128 splits of 1,024 keys, 32 tiles streamed per block, and partials small enough
/// that combining them costs little.
pub const SPLIT_MAX_SPLITS: usize = 128;
/// Past this many keys, one-token tensor-core attention with head dim 256 runs the _long kernels
/// (attn_split_mma_long, attn_split_mma_prep_long: the dimension fixed at compile time, whole
/// tiles copied without per-chunk tests, on sm_90 and later; before sm_90 they are the general
/// body, which spills less): on the H200 that body ran 128K contexts 3.9–5.8 %
/// faster and 256…32K 1–3 % slower (docs/perf-notes.md, session 7). The plan's `split_long_keys`
/// carries it (tests move it); a decode graph is captured for each side.
pub const SPLIT_LONG_KEYS: usize = 65536;
/// With the int8 KV cache (`kv_cache int8`) the _long kernels run from this many keys: the short
/// body's int8 tiles cost it more arithmetic than the bytes they save (H100, session 31: 32K
/// 437 tok/s on the short body against 453 on the long one, bf16 cache 450; 4K 499 against 505).
pub const SPLIT_LONG_KEYS_INT8: usize = 4096;
/// Fewest keys per split (a multiple of the 32-key tile).
pub const SPLIT_MIN_KEYS: usize = 32;
/// Keys per shared-memory tile of attn_split (SPLIT_TILE in attention.cu).
const SPLIT_TILE: usize = 32;
/// Warps of an attn_split block: each serves SPLIT_MAX_G / SPLIT_WARPS of the block's query
/// heads over every key of the split, from tiles the whole block streams into shared memory.
pub const SPLIT_WARPS: usize = 4;
/// Query heads (of one kv head) per attn_split block.
pub const SPLIT_MAX_G: usize = 8;
/// Most tokens one split-KV launch serves (its partials are sized for this many).
pub const SPLIT_MAX_TOK: usize = 4;
/// Queries per attn_prefill block (16 per warp).
pub const PF_Q: usize = 64;
/// Warps of an attn_prefill block.
pub const PF_WARPS: usize = 4;
/// bf16 elements of padding per attn_prefill shared-memory row.
pub const PF_PAD: usize = 8;
/// Keys per attn_prefill tile for head dims 64 and 128.
pub const PF_KEYS_SMALL: usize = 64;
/// Keys per attn_prefill tile for head dim 256.
pub const PF_KEYS_256: usize = 32;
/// Tiles in flight per attn_split_mma block (two land while one is used).
pub const SPLIT_MMA_STAGES: usize = 3;
/// attn_prefill_wg (wgmma, sm_90a, head dim 256): queries a block (one m64 tile per warpgroup).
pub const WGA_Q: usize = 64;
/// attn_prefill_wg: keys a K / V tile (S is 64 × WGA_KEYS a warpgroup).
pub const WGA_KEYS: usize = 64;
/// attn_prefill_wg: the head dim it serves.
pub const WGA_D: usize = 256;
/// attn_prefill_wg: query heads a block, one warpgroup (128 threads) each (fixed by the kernel).
pub const WGA_HEADS: usize = 2;
/// attn_prefill_wg: stages of the K/V ring (fixed by the kernel).
const WGA_STAGES: usize = 2;
/// attn_prefill_wg's dynamic shared memory: 1 KB of alignment slack, Q of the block's heads, the
/// ring's stages of a K and a V tile (bf16, 128-byte swizzled rows): 193 KB, one block an SM.
/// attn_prefill_wg_pipe's is the same: its K and V rings of two stages each.
pub const WGA_SMEM: usize =
    1024 + WGA_HEADS * WGA_Q * WGA_D * 2 + WGA_STAGES * 2 * WGA_KEYS * WGA_D * 2;
// Within sm_90's 227 KB of shared memory a block.
const _: () = assert!(WGA_SMEM <= 232_448);
/// The fewest tokens of a chunk whose attention takes attn_prefill_wg under the plan's
/// `wgmma_attention`: its blocks hold 64 queries of two heads, so a chunk of T tokens has T / 8
/// of them (attn_prefill: T / 4 of a quarter the size); below 1,024 tokens they would leave SMs idle.
pub const WGA_MIN_TOK: usize = 1024;

pub const FILE: KernelFile = KernelFile {
    name: "attention",
    source: include_str!("../../../../shaders/cuda/attention.cu"),
    defines: &[
        ("ATTN_MAX_D", ATTN_MAX_D as i64),
        ("ATTN_WARPS", ATTN_WARPS as i64),
        ("SPLIT_MAX_SPLITS", SPLIT_MAX_SPLITS as i64),
        ("SPLIT_WARPS", SPLIT_WARPS as i64),
        ("SPLIT_MIN_KEYS", SPLIT_MIN_KEYS as i64),
        ("SPLIT_MAX_G", SPLIT_MAX_G as i64),
        ("PF_Q", PF_Q as i64),
        ("PF_WARPS", PF_WARPS as i64),
        ("PF_PAD", PF_PAD as i64),
        ("PF_KEYS_SMALL", PF_KEYS_SMALL as i64),
        ("PF_KEYS_256", PF_KEYS_256 as i64),
        ("SPLIT_MMA_STAGES", SPLIT_MMA_STAGES as i64),
        ("WGA_Q", WGA_Q as i64),
        ("WGA_KEYS", WGA_KEYS as i64),
    ],
};

/// The model's head dim against the kernels' limit.
pub fn check_limits(cfg: &ModelConfig) -> Result<()> {
    if cfg.head_dim > ATTN_MAX_D {
        bail!(
            "head_dim {} exceeds the CUDA attention kernel's limit {ATTN_MAX_D}",
            cfg.head_dim
        );
    }
    Ok(())
}

/// Shapes of the gated attention of one model.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    pub n_q: usize,
    pub n_kv: usize,
    pub d: usize,
    pub rotary: usize,
    pub theta: f32,
    pub eps: f32,
}

impl AttnShape {
    pub fn of(cfg: &ModelConfig) -> AttnShape {
        AttnShape {
            n_q: cfg.n_heads,
            n_kv: cfg.n_kv_heads,
            d: cfg.head_dim,
            rotary: cfg.rotary_dim,
            theta: cfg.rope_theta as f32,
            eps: cfg.rms_eps,
        }
    }
}

/// attn_qk_prep's buffers: q/gate from q_proj, k and v in, q out, the caches, the norms and the
/// device-side position.
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

/// The inputs and output every attention kernel shares: q [T, Hq, D], the gate half of q_proj's
/// output `qg`, the caches, `out` [T, Hq·D] and the device-side position.
#[derive(Clone, Copy, Debug)]
pub struct Attend {
    pub shape: AttnShape,
    pub q: u64,
    pub qg: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub out: u64,
    pub pos: u64,
    pub n_tok: usize,
}

/// Split-KV scratch: f32 partial outputs and (max, sum) per split (`split_kv_scratch` sizes).
#[derive(Clone, Copy, Debug)]
pub struct SplitPartials {
    pub part_o: u64,
    pub part_ml: u64,
}

/// Sequences one `attn_split_mma_prep_rows` launch serves (a batched decode step's rows, each in
/// a token's slot of the split-KV scratch): as many as a `dec_gemv_rows` launch.
pub const SPLIT_ROWS: usize = crate::kernels::decode::BATCH_MAX;

/// One token of each of `rows` sequences of a batched decode step for `split_kv_prepped_rows`:
/// row b of qg [rows, 2 n_q d], k and v [rows, n_kv d], out [rows, n_q d]; `caches`: a device
/// table of 2 · rows cache pointers (the key caches, then the value caches), `positions` one of
/// `rows` position pointers (i32), both in the rows' order.
pub struct RowsAttend {
    pub qg: u64,
    pub k: u64,
    pub v: u64,
    pub q_norm: u64,
    pub k_norm: u64,
    pub caches: u64,
    pub positions: u64,
    pub out: u64,
    pub parts: SplitPartials,
    pub rows: usize,
}

/// Split-KV scratch: f32 elements of (part_o, part_ml), for the larger of SPLIT_MAX_TOK tokens
/// and SPLIT_ROWS sequences.
pub fn split_kv_scratch(n_q: usize, d: usize) -> (usize, usize) {
    let slots = SPLIT_MAX_TOK.max(SPLIT_ROWS) * n_q * SPLIT_MAX_SPLITS;
    (slots * d, slots * 2)
}

/// Whether the split-KV kernels serve this shape and step.
pub fn split_kv_fits(s: AttnShape, n_tok: usize) -> bool {
    n_tok <= SPLIT_MAX_TOK && s.d <= ATTN_MAX_D && s.d.is_multiple_of(8)
}

/// Keys per `attn_prefill` tile for head dim `d`, `None` for a head dim it does not serve.
fn prefill_keys(d: usize) -> Option<usize> {
    match d {
        64 | 128 => Some(PF_KEYS_SMALL),
        256 => Some(PF_KEYS_256),
        _ => None,
    }
}

/// Dynamic shared memory of an `attn_prefill` block for head dim `d`: the Q tile and one K and
/// one V tile, bf16, rows padded by PF_PAD elements.
pub fn attn_prefill_smem(d: usize) -> Option<usize> {
    prefill_keys(d).map(|keys| (PF_Q + 2 * keys) * (d + PF_PAD) * 2)
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

/// Whether `attn_prefill` serves this shape (head dims 64, 128, 256; whole GQA groups).
pub fn prefill_fits(s: AttnShape) -> bool {
    prefill_keys(s.d).is_some() && s.n_kv > 0 && s.n_q.is_multiple_of(s.n_kv)
}

/// Whether `attn_prefill_wg` serves this shape: head dim 256 and an even number of query heads a
/// kv head (a block's two heads share their K and V tiles).
pub fn prefill_wg_fits(s: AttnShape) -> bool {
    s.d == WGA_D
        && s.n_kv > 0
        && s.n_q.is_multiple_of(s.n_kv)
        && (s.n_q / s.n_kv).is_multiple_of(WGA_HEADS)
}

/// Dynamic shared memory of an attn_split block for head dim `d` and cache elements of
/// `kv_bytes`: q [SPLIT_MAX_G][d] f32, K [2][SPLIT_TILE][d + 16 bytes], V [2][SPLIT_TILE][d],
/// p [SPLIT_MAX_G][SPLIT_TILE] f32.
/// Dynamic shared memory of an attn_split_mma block (attention.cu): Q [16][d+8], K and V
/// [SPLIT_MMA_STAGES][SPLIT_TILE][d+8], P [16][SPLIT_TILE+8] bf16, the warps' maxima and sums
/// [2][2][4][8] f32 (109 KB for d = 256: two blocks an SM). With an int8 cache (`int8`: the
/// module built with LILY_KV_INT8) one bf16 K and one V tile, and STAGES of int8 K and V tiles
/// [SPLIT_TILE][d] with each key's 16-byte chunk of scales (94 KB for d = 256).
fn split_mma_smem_bytes(d: usize, int8: bool) -> usize {
    let common = 16 * (d + 8) * 2 + 16 * (SPLIT_TILE + 8) * 2 + 2 * 2 * SPLIT_WARPS * 8 * 4;
    if int8 {
        common + 2 * SPLIT_TILE * (d + 8) * 2 + 2 * SPLIT_MMA_STAGES * SPLIT_TILE * (d + 16)
    } else {
        common + 2 * SPLIT_MMA_STAGES * SPLIT_TILE * (d + 8) * 2
    }
}

/// Bytes one position takes in one layer's K cache (the V cache's the same): `n_kv · d` values
/// of `elem_bytes`, or with an int8 cache (`int8`) the n_kv int8 rows of d, then their f32
/// scales padded to 16 bytes (attention.cu's kv8_rec_bytes: a record and each row in it start
/// 16-byte aligned, and a prefix of positions is one contiguous range).
pub fn kv_pos_bytes(n_kv: usize, d: usize, elem_bytes: usize, int8: bool) -> usize {
    if int8 {
        n_kv * d + (4 * n_kv).div_ceil(16) * 16
    } else {
        n_kv * d * elem_bytes
    }
}

/// Whether attn_split_mma takes this step: bf16 cache, one token, head dim a multiple of 64 (four
/// warps of output columns, two n-tiles at a time).
pub fn split_mma_fits(s: AttnShape, n_tok: usize, kv_bytes: usize) -> bool {
    kv_bytes == 2 && n_tok == 1 && s.d.is_multiple_of(64) && s.d <= ATTN_MAX_D && SPLIT_WARPS == 4
}

/// Whether attn_split_mma_prep can do attn_qk_prep's work for this shape (with `split_mma_fits`):
/// RoPE's half a whole number of a lane's eight columns.
pub fn prep_fits(s: AttnShape) -> bool {
    s.rotary.is_multiple_of(16) && s.rotary <= s.d
}

/// The split-KV kernels (then attn_split_combine).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SplitKernel {
    /// `attn_split`: CUDA-core FMAs, any activation mode, up to SPLIT_MAX_TOK tokens.
    Cuda,
    /// `attn_split_mma` (`attn_split_mma_prep` with the prep inside): one token on the tensor
    /// cores, bf16 cache (`split_mma_fits`).
    Mma,
    /// `attn_split_mma_long` / `attn_split_mma_prep_long`: the same, head dim 256 fixed at
    /// compile time (long contexts, SPLIT_LONG_KEYS).
    MmaLong,
}

/// The flash-attention prefill kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillKernel {
    /// `attn_prefill`: mma.sync, head dims 64, 128 and 256.
    Mma,
    /// `attn_prefill_wg`: wgmma (sm_90a), head dim 256, bf16 cache (`prefill_wg_fits`).
    Wgmma,
    /// `attn_prefill_wg_pipe`: attn_prefill_wg's arithmetic in the same order (bit-identical), a
    /// key tile's softmax run while the tensor cores do the previous tile's P·V (the plan's
    /// `wgmma_attention_pipelined`).
    WgmmaPipelined,
}

fn split_smem_bytes(d: usize, kv_bytes: usize) -> usize {
    SPLIT_MAX_G * d * 4
        + 2 * SPLIT_TILE * (d * kv_bytes + 16)
        + 2 * SPLIT_TILE * d * kv_bytes
        + SPLIT_MAX_G * SPLIT_TILE * 4
}

pub struct Attention {
    qk_prep: Kernel,
    decode: Kernel,
    prefill: Kernel,
    prefill_wg: Kernel,
    prefill_wg_pipe: Kernel,
    split: Kernel,
    split_mma: Kernel,
    split_mma_prep: Kernel,
    split_mma_long: Kernel,
    split_mma_prep_long: Kernel,
    split_combine: Kernel,
    split_mma_prep_rows: Kernel,
    split_mma_prep_long_rows: Kernel,
    split_combine_rows: Kernel,
    /// kv_int8_dequant, where the module is built with LILY_KV_INT8 (`kv_cache int8`).
    kv_int8_dequant: Option<Kernel>,
    /// Bytes of one cache element (2 with bf16 activations, else 4) as every kernel but the
    /// attn_split_mma family and attn_qk_prep reads it (with an int8 cache: the bf16 scratch).
    kv_bytes: usize,
    /// The module's attn_qk_prep and attn_split_mma family read and write int8 rows.
    int8: bool,
}

impl Attention {
    /// `hopper`: the device is sm_90a, where attn_prefill_wg and attn_prefill_wg_pipe run and
    /// get their (large) shared memory; elsewhere they are compiled as traps, never launched,
    /// and left at the default.
    /// `int8`: the module is built with LILY_KV_INT8 (`KernelBuild::kv_int8`).
    pub fn load(m: &Module, bf16_activations: bool, hopper: bool, int8: bool) -> Result<Attention> {
        let kv_bytes = if bf16_activations { 2 } else { 4 };
        let mma_smem = split_mma_smem_bytes(ATTN_MAX_D, int8);
        let wg = |name: &'static str| -> Result<Kernel> {
            let k = m.kernel(name)?;
            if hopper {
                k.allow_shared_memory(WGA_SMEM)
            } else {
                Ok(k)
            }
        };
        Ok(Attention {
            prefill_wg: wg("attn_prefill_wg")?,
            prefill_wg_pipe: wg("attn_prefill_wg_pipe")?,
            kv_bytes,
            int8,
            kv_int8_dequant: if int8 {
                Some(m.kernel("kv_int8_dequant")?.waits_for_predecessor())
            } else {
                None
            },
            qk_prep: m.kernel("attn_qk_prep")?.waits_for_predecessor(),
            decode: m.kernel("attn_decode")?,
            prefill: m
                .kernel("attn_prefill")?
                .allow_shared_memory(attn_prefill_max_smem())?,
            split: m
                .kernel("attn_split")?
                .allow_shared_memory(split_smem_bytes(ATTN_MAX_D, kv_bytes))?
                .waits_for_predecessor(),
            split_mma: m
                .kernel("attn_split_mma")?
                .allow_shared_memory(mma_smem)?
                .waits_for_predecessor(),
            split_mma_prep: m
                .kernel("attn_split_mma_prep")?
                .allow_shared_memory(mma_smem)?
                .waits_for_predecessor(),
            split_mma_long: m
                .kernel("attn_split_mma_long")?
                .allow_shared_memory(mma_smem)?
                .waits_for_predecessor(),
            split_mma_prep_long: m
                .kernel("attn_split_mma_prep_long")?
                .allow_shared_memory(mma_smem)?
                .waits_for_predecessor(),
            split_combine: m.kernel("attn_split_combine")?.waits_for_predecessor(),
            split_mma_prep_rows: m
                .kernel("attn_split_mma_prep_rows")?
                .allow_shared_memory(mma_smem)?
                .waits_for_predecessor(),
            split_mma_prep_long_rows: m
                .kernel("attn_split_mma_prep_long_rows")?
                .allow_shared_memory(mma_smem)?
                .waits_for_predecessor(),
            split_combine_rows: m.kernel("attn_split_combine_rows")?.waits_for_predecessor(),
        })
    }

    /// Norms and RoPE of q and k, and the k/v write into the caches at the device position:
    /// one block of 128 threads per (token, head).
    pub fn qk_prep(&self, gpu: &Gpu, s: AttnShape, b: &QkPrep, n_tok: usize) -> Result<()> {
        let dims = [n_tok, s.n_q, s.n_kv, s.d, s.rotary].map(|v| v as i32);
        let cfg = config((n_tok as u32, (s.n_q + s.n_kv) as u32, 1), 128, 0);
        gpu.launch(&self.qk_prep, cfg, |l| {
            l.arg(&b.qg)
                .arg(&b.k)
                .arg(&b.v)
                .arg(&b.q_out)
                .arg(&b.k_cache)
                .arg(&b.v_cache)
                .arg(&b.q_norm)
                .arg(&b.k_norm)
                .arg(&b.pos);
            for d in &dims {
                l.arg(d);
            }
            l.arg(&s.theta).arg(&s.eps);
        })
    }

    /// kv_int8_dequant: rows 0 .. (device position) + n_tok − 1 of one layer's int8 caches as bf16
    /// into `k_out` / `v_out` ([rows][n_kv][d], a bf16 cache's layout) for the kernels that read
    /// bf16. The grid covers `max_rows` rows (threads past the device's count return), so a
    /// captured graph stays right at every position; `max_rows` is the scratch's capacity.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_int8_dequant(
        &self,
        gpu: &Gpu,
        s: AttnShape,
        caches: (u64, u64),
        out: (u64, u64),
        pos: u64,
        n_tok: usize,
        max_rows: usize,
    ) -> Result<()> {
        let Some(k) = &self.kv_int8_dequant else {
            bail!("kv_int8_dequant: the attention module was built without an int8 KV cache");
        };
        if !s.d.is_multiple_of(16) {
            bail!("kv_int8_dequant: head_dim {} (a multiple of 16)", s.d);
        }
        let threads = max_rows * s.n_kv * (s.d / 8);
        let cfg = config((threads.div_ceil(256) as u32, 1, 1), 256, 0);
        let dims = [n_tok, s.n_kv, s.d].map(|v| v as i32);
        gpu.launch(k, cfg, |l| {
            l.arg(&caches.0)
                .arg(&caches.1)
                .arg(&out.0)
                .arg(&out.1)
                .arg(&pos);
            for d in &dims {
                l.arg(d);
            }
        })
    }

    /// One block (ATTN_WARPS warps) per (token, query head).
    pub fn one_block_per_head(&self, gpu: &Gpu, a: &Attend) -> Result<()> {
        let cfg = config(
            (a.n_tok as u32, a.shape.n_q as u32, 1),
            (ATTN_WARPS * 32) as u32,
            0,
        );
        self.launch_attend(gpu, &self.decode, cfg, a)
    }

    /// Causal gated attention of a prefill chunk on tensor cores by `kernel` (bf16 mma, fp32
    /// softmax and accumulation): the same inputs and output as `one_block_per_head`. Any
    /// `n_tok` works; head dims 64, 128 and 256 only (attn_prefill_wg: `prefill_wg_fits`).
    pub fn flash_prefill(&self, gpu: &Gpu, kernel: PrefillKernel, a: &Attend) -> Result<()> {
        let s = a.shape;
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
        if [a.q, a.k_cache, a.v_cache]
            .iter()
            .any(|p| !p.is_multiple_of(16))
            || [a.qg, a.out].iter().any(|p| !p.is_multiple_of(8))
        {
            bail!("attn_prefill: q, the caches, qg or out are not aligned for vector loads");
        }
        if a.n_tok == 0 {
            return Ok(());
        }
        if kernel != PrefillKernel::Mma {
            return self.prefill_wg(gpu, kernel, a);
        }
        let cfg = config(
            (blocks(a.n_tok, PF_Q), s.n_q as u32, 1),
            (PF_WARPS * 32) as u32,
            smem,
        );
        self.launch_attend(gpu, &self.prefill, cfg, a)
    }

    /// attn_prefill_wg or attn_prefill_wg_pipe (`kernel`), whatever the chunk's length: sm_90a,
    /// bf16 cache and `prefill_wg_fits` only. `flash_prefill` checks the alignment first.
    fn prefill_wg(&self, gpu: &Gpu, kernel: PrefillKernel, a: &Attend) -> Result<()> {
        let s = a.shape;
        if !super::gemm::runs_wgmma(gpu) || self.kv_bytes != 2 || !prefill_wg_fits(s) {
            bail!(
                "attn_prefill_wg: needs sm_90a, a bf16 cache and head_dim {WGA_D} with an even number of query heads a kv head ({} / {}, head_dim {}, arch {})",
                s.n_q,
                s.n_kv,
                s.d,
                gpu.arch
            );
        }
        if a.n_tok == 0 {
            return Ok(());
        }
        let cfg = config(
            (blocks(a.n_tok, WGA_Q), (s.n_q / WGA_HEADS) as u32, 1),
            (WGA_HEADS * 128) as u32,
            WGA_SMEM,
        );
        let k = if kernel == PrefillKernel::WgmmaPipelined {
            &self.prefill_wg_pipe
        } else {
            &self.prefill_wg
        };
        self.launch_attend(gpu, k, cfg, a)
    }

    /// attn_decode and attn_prefill: the same arguments.
    fn launch_attend(
        &self,
        gpu: &Gpu,
        k: &Kernel,
        cfg: cudarc::driver::LaunchConfig,
        a: &Attend,
    ) -> Result<()> {
        let s = a.shape;
        let scale = 1.0 / (s.d as f32).sqrt();
        let dims = [a.n_tok, s.n_q, s.n_kv, s.d].map(|v| v as i32);
        gpu.launch(k, cfg, |l| {
            l.arg(&a.q)
                .arg(&a.qg)
                .arg(&a.k_cache)
                .arg(&a.v_cache)
                .arg(&a.out)
                .arg(&a.pos);
            for d in &dims {
                l.arg(d);
            }
            l.arg(&scale);
        })
    }

    /// Split-KV (flash-decoding) attention: `kernel` then `attn_split_combine`; the same inputs
    /// and output as `one_block_per_head`. The grid does not depend on the position (graph
    /// capture): blocks past the live splits exit at once.
    pub fn split_kv(
        &self,
        gpu: &Gpu,
        kernel: SplitKernel,
        a: &Attend,
        parts: SplitPartials,
    ) -> Result<()> {
        let s = a.shape;
        if !split_kv_fits(s, a.n_tok) {
            bail!(
                "split-KV attention: {} tokens with head_dim {} (limits: {SPLIT_MAX_TOK} tokens, head_dim a multiple of 8 up to {ATTN_MAX_D})",
                a.n_tok,
                s.d
            );
        }
        let scale = 1.0 / (s.d as f32).sqrt();
        let group = s.n_q / s.n_kv;
        let chunks = group.div_ceil(SPLIT_MAX_G);
        let dims = [a.n_tok, s.n_q, s.n_kv, s.d].map(|v| v as i32);
        if kernel != SplitKernel::Cuda && !split_mma_fits(s, a.n_tok, self.kv_bytes) {
            bail!(
                "attn_split_mma: {} tokens, head_dim {} (one token, bf16 cache, head_dim a multiple of 64 up to {ATTN_MAX_D})",
                a.n_tok,
                s.d
            );
        }
        let (kernel, smem) = match kernel {
            SplitKernel::Cuda => (&self.split, split_smem_bytes(s.d, self.kv_bytes)),
            SplitKernel::Mma => (&self.split_mma, split_mma_smem_bytes(s.d, self.int8)),
            SplitKernel::MmaLong => (&self.split_mma_long, split_mma_smem_bytes(s.d, self.int8)),
        };
        let cfg = config(
            (
                SPLIT_MAX_SPLITS as u32,
                (s.n_kv * chunks) as u32,
                a.n_tok as u32,
            ),
            (SPLIT_WARPS * 32) as u32,
            smem,
        );
        gpu.launch(kernel, cfg, |l| {
            l.arg(&a.q)
                .arg(&a.k_cache)
                .arg(&a.v_cache)
                .arg(&parts.part_o)
                .arg(&parts.part_ml)
                .arg(&a.pos);
            for d in &dims {
                l.arg(d);
            }
            l.arg(&scale);
        })?;
        self.split_combine(gpu, a, parts)
    }

    /// `qk_prep` and `split_kv` of one token in two launches instead of three: attn_split_mma_prep
    /// norms and rotates each block's query heads itself and writes the new key and value into the
    /// cache (the block whose split holds them), then attn_split_combine. `p.q_out` is not written.
    /// `kernel`: `Mma` (attn_split_mma_prep) or `MmaLong` (attn_split_mma_prep_long).
    pub fn split_kv_prepped(
        &self,
        gpu: &Gpu,
        kernel: SplitKernel,
        a: &Attend,
        parts: SplitPartials,
        p: &QkPrep,
    ) -> Result<()> {
        let s = a.shape;
        if kernel == SplitKernel::Cuda
            || !split_mma_fits(s, a.n_tok, self.kv_bytes)
            || !prep_fits(s)
        {
            bail!(
                "attn_split_mma_prep: {} tokens, head_dim {}, rotary {} (one token, bf16 cache, head_dim a multiple of 64 up to {ATTN_MAX_D}, rotary a multiple of 16)",
                a.n_tok,
                s.d,
                s.rotary
            );
        }
        let scale = 1.0 / (s.d as f32).sqrt();
        let chunks = (s.n_q / s.n_kv).div_ceil(SPLIT_MAX_G);
        let dims = [s.n_q, s.n_kv, s.d, s.rotary].map(|v| v as i32);
        let kernel = if kernel == SplitKernel::MmaLong {
            &self.split_mma_prep_long
        } else {
            &self.split_mma_prep
        };
        let cfg = config(
            (SPLIT_MAX_SPLITS as u32, (s.n_kv * chunks) as u32, 1),
            (SPLIT_WARPS * 32) as u32,
            split_mma_smem_bytes(s.d, self.int8),
        );
        gpu.launch(kernel, cfg, |l| {
            l.arg(&p.qg)
                .arg(&p.k)
                .arg(&p.v)
                .arg(&p.q_norm)
                .arg(&p.k_norm)
                .arg(&p.k_cache)
                .arg(&p.v_cache)
                .arg(&parts.part_o)
                .arg(&parts.part_ml)
                .arg(&p.pos);
            for d in &dims {
                l.arg(d);
            }
            l.arg(&s.theta).arg(&s.eps).arg(&scale);
        })?;
        self.split_combine(gpu, a, parts)
    }

    /// `split_kv_prepped` for one token of each of `a.rows` (≤ SPLIT_ROWS) sequences of a batched
    /// decode step in two launches (`attn_split_mma_prep_rows` or its _long form, then
    /// `attn_split_combine_rows`), the sequence in a grid dimension.
    pub fn split_kv_prepped_rows(
        &self,
        gpu: &Gpu,
        kernel: SplitKernel,
        s: AttnShape,
        a: &RowsAttend,
    ) -> Result<()> {
        if kernel == SplitKernel::Cuda || !split_mma_fits(s, 1, self.kv_bytes) || !prep_fits(s) {
            bail!(
                "attn_split_mma_prep_rows: head_dim {}, rotary {} (bf16 cache, head_dim a multiple of 64 up to {ATTN_MAX_D}, rotary a multiple of 16)",
                s.d,
                s.rotary
            );
        }
        if a.rows == 0 || a.rows > SPLIT_ROWS {
            bail!(
                "attn_split_mma_prep_rows: {} sequences (1..={SPLIT_ROWS})",
                a.rows
            );
        }
        let scale = 1.0 / (s.d as f32).sqrt();
        let chunks = (s.n_q / s.n_kv).div_ceil(SPLIT_MAX_G);
        let dims = [s.n_q, s.n_kv, s.d, s.rotary].map(|v| v as i32);
        let prep = if kernel == SplitKernel::MmaLong {
            &self.split_mma_prep_long_rows
        } else {
            &self.split_mma_prep_rows
        };
        let cfg = config(
            (
                SPLIT_MAX_SPLITS as u32,
                (s.n_kv * chunks) as u32,
                a.rows as u32,
            ),
            (SPLIT_WARPS * 32) as u32,
            split_mma_smem_bytes(s.d, self.int8),
        );
        gpu.launch(prep, cfg, |l| {
            l.arg(&a.qg)
                .arg(&a.k)
                .arg(&a.v)
                .arg(&a.q_norm)
                .arg(&a.k_norm)
                .arg(&a.caches)
                .arg(&a.parts.part_o)
                .arg(&a.parts.part_ml)
                .arg(&a.positions);
            for d in &dims {
                l.arg(d);
            }
            l.arg(&s.theta).arg(&s.eps).arg(&scale);
        })?;
        let (n_q, d) = (s.n_q as i32, s.d as i32);
        let cfg = config(
            (s.n_q as u32, a.rows as u32, s.d.div_ceil(64) as u32),
            256,
            0,
        );
        gpu.launch(&self.split_combine_rows, cfg, |l| {
            l.arg(&a.qg)
                .arg(&a.parts.part_o)
                .arg(&a.parts.part_ml)
                .arg(&a.out)
                .arg(&a.positions)
                .arg(&n_q)
                .arg(&d);
        })
    }

    /// attn_split_combine: blocks of 64 columns, 8 warps over the splits.
    fn split_combine(&self, gpu: &Gpu, a: &Attend, parts: SplitPartials) -> Result<()> {
        let s = a.shape;
        let dims = [a.n_tok, s.n_q, s.d].map(|v| v as i32);
        let cfg = config(
            (s.n_q as u32, a.n_tok as u32, s.d.div_ceil(64) as u32),
            256,
            0,
        );
        gpu.launch(&self.split_combine, cfg, |l| {
            l.arg(&a.qg)
                .arg(&parts.part_o)
                .arg(&parts.part_ml)
                .arg(&a.out)
                .arg(&a.pos);
            for d in &dims {
                l.arg(d);
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(n_q: usize, n_kv: usize, d: usize) -> AttnShape {
        AttnShape {
            n_q,
            n_kv,
            d,
            rotary: d,
            theta: 1e7,
            eps: 1e-6,
        }
    }

    #[test]
    fn int8_caches_take_528_byte_records_and_less_shared_memory() {
        // 2 heads × 256 int8 values, then 2 f32 scales padded to 16 bytes; 6 heads: 32 bytes.
        assert_eq!(kv_pos_bytes(2, 256, 2, true), 528);
        assert_eq!(kv_pos_bytes(6, 64, 2, true), 6 * 64 + 32);
        assert_eq!(kv_pos_bytes(2, 256, 2, false), 1024);
        assert_eq!(kv_pos_bytes(2, 256, 4, false), 2048);
        // attn_split_mma's blocks: 109 KB (bf16 tiles, 3 stages), 94 KB (int8 stages, one bf16
        // tile): two blocks an SM either way (227 KB on sm_90).
        assert_eq!(split_mma_smem_bytes(256, false), 111_616);
        assert_eq!(split_mma_smem_bytes(256, true), 96_256);
    }

    #[test]
    fn attn_prefill_wg_takes_head_dim_256_with_query_heads_in_pairs() {
        assert!(prefill_wg_fits(shape(16, 2, 256))); // Qwen3.6: 8 query heads a kv head
        assert!(prefill_wg_fits(shape(4, 2, 256)));
        assert!(!prefill_wg_fits(shape(6, 2, 256))); // 3 a kv head: a block's pair would straddle two
        assert!(!prefill_wg_fits(shape(2, 2, 256))); // 1 a kv head
        assert!(!prefill_wg_fits(shape(16, 2, 128)));
        assert!(!prefill_wg_fits(shape(16, 0, 256)));
        // Its shared memory: alignment, Q of two heads, two stages of K and V.
        assert_eq!(WGA_SMEM, 1024 + 65_536 + 131_072);
    }
}
