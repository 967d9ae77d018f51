//! `CudaOptions`: how the CUDA backend is asked to run, declared once. Each switch and each
//! numeric knob is one row of the table below (`lily_core::backend_options!`, the macro lily-wgpu's
//! `WgpuOptions` is declared with too), which gives its field, the value that
//! ships, its `lily-engine` flag (lily-server builds its `CudaArgs` from `SWITCHES` and `KNOBS`,
//! no per-switch code there), its environment override, its label in `Plan::describe`, its help
//! text (the flag's help and the crate README's row: `readme_rows`) and, for a switch, why it
//! stays (the A/B it won, or the fallback it is). The plan (plan.rs) turns the options, resolved
//! against the device, into kernels.
//!
//! Environment overrides are read in one function (`CudaOptions::with_env_overrides`, i.e.
//! `lily_core::options::with_overrides`): a
//! switch's variable set to `1` or `0` sets it (`LILY_CUDA_FP32=1` turns `bf16_activations`
//! off), a knob's variable sets it when it is a number the knob accepts; anything else leaves
//! the option as it is. Not options, so read where they are used: `LILY_NVRTC` (nvrtc.rs) and
//! `LILY_CACHE_DIR` (cache.rs), which say where to find files, not what to run.

use crate::kernels::attention::SPLIT_LONG_KEYS;

/// Default largest prefill chunk (tokens per forward pass; scratch is sized for it): 8,192 won
/// its A/B against 4,096 (prefill 32K +8.5 %, 128K +5.0 %, an H100, session 26) once session 27
/// showed its logits equal 4,096's bit for bit with the router unsplit (docs/perf-notes.md).
pub const DEFAULT_PREFILL_CHUNK: usize = 8192;

/// Default largest piece of a prompt fed while other sequences decode (`Backend::interleaved_chunk`):
/// a 4,096-token chunk holds a running stream ≈ 0.15 s on an H100; the 8,192-token prefill
/// chunk is faster alone but would hold it twice as long.
pub const DEFAULT_INTERLEAVED_CHUNK: usize = 4096;

/// The fewest tokens of a prefill chunk whose projections take the wgmma kernels under
/// `wgmma_gemm`: at 512 tokens gemm_dense_wgb runs 13.0 against gemm_dense's 17.3 µs (2048×512)
/// and a 512-token prefill 7,770 → 8,716 tok/s on the H200 (docs/perf-notes.md, session 8);
/// shorter chunks are not measured and keep mma.sync.
pub const WGMMA_MIN_TOK: usize = 512;

pub use lily_core::options::{Knob, Switch};

use lily_core::options::TextValue;

/// The KV cache's format (`kv_cache`; MODEL.md §2.4 "The KV cache's formats").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvCacheKind {
    /// bf16 values (f32 in fp32 mode): 2 bytes a value.
    #[default]
    Bf16,
    /// Int8 rows, one f32 scale a (position, KV head) row (`kv_int8_encode`'s rule): 528 bytes a
    /// position and layer for 2 KV heads of 256 against bf16's 1,024. Needs bf16 activations.
    Int8,
}

impl TextValue for KvCacheKind {
    fn parse_text(text: &str) -> Option<Self> {
        match text {
            "bf16" => Some(KvCacheKind::Bf16),
            "int8" => Some(KvCacheKind::Int8),
            _ => None,
        }
    }

    fn show_text(&self) -> String {
        match self {
            KvCacheKind::Bf16 => "bf16",
            KvCacheKind::Int8 => "int8",
        }
        .to_string()
    }
}

lily_core::backend_options! {
    /// How the backend runs, as asked for (`Default`: the configuration that ships). Each
    /// field's meaning: its row of `SWITCHES` / `KNOBS` (`help`, `why`).
    pub struct CudaOptions, heading "CUDA backend", id "cuda";
    switches {
        bf16_activations = true, flag Some("fp32-activations"), env "LILY_CUDA_FP32" = false,
            label "bf16 activations",
            help "activations and the KV cache rounded to bf16 where the reference model stores them (accumulation and the DeltaNet state stay fp32); off keeps them in fp32 (parity with the CPU backend) and turns every tensor-core path off",
            why "the production precision; fp32 is the parity mode";
        tensor_cores = true, flag Some("no-tensor-cores"), env "LILY_TENSOR_CORES" = true,
            label "tensor cores",
            help "the linears of prefill chunks (≥ 16 tokens) on the tensor cores (gemm.cu, bf16 mode) instead of linear.cu's CUDA-core kernels",
            why "the fallback is the fp32 path";
        exact_router_on_tensor_cores = true, flag Some("router-on-cuda-cores"), env "LILY_EXACT_ROUTER_TC" = true,
            label "router on tensor cores",
            help "the MoE router of prefill chunks on the tensor cores in split precision (gemm_dense_exact, each weight as bf16 hi + lo) instead of the CUDA cores; the same fp32 precision either way",
            why "the CUDA-core router is the exact reference it is tested against";
        router_split_k = true, flag Some("no-router-split-k"), env "LILY_ROUTER_SPLIT_K" = true,
            label "router split over its columns",
            help "the router's split-precision GEMM splits its columns into up to 8 parts where its grid is shallow (gemm::exact_parts), the parts added in order by gemm_sum_parts",
            why "won its A/B: prefill 512 +4.3 % on the H200 (session 9)";
        wgmma_gemm = true, flag Some("no-wgmma-gemm"), env "LILY_WGMMA_GEMM" = true,
            label "wgmma prefill GEMM",
            help "prefill's 4-bit projections on Hopper's warpgroup MMA (sm_90a) for chunks of at least wgmma_min_tok tokens, inputs staged as bf16, instead of mma.sync",
            why "won its A/B: prefill 4K 14,200 → 20,040 tok/s on the H200 (session 8); elsewhere the device has no wgmma";
        wgmma_small_tiles = true, flag Some("no-wgmma-small-tiles"), env "LILY_WGMMA_SMALL_TILES" = true,
            label "experts' wgmma tiles of 64 for few items",
            help "the routed experts of a staged chunk whose experts average fewer than 48 items on gemm_grouped_wgb64's tiles of 64 instead of gemm_grouped32's (mma.sync) tiles of 32",
            why "won its A/B: prefill 512 +6 %, 1K +19 % on the H200 (session 9)";
        wgmma_narrow_tiles = true, flag Some("no-wgmma-narrow-tiles"), env "LILY_WGMMA_NARROW_TILES" = true,
            label "experts' wgmma tiles of 32 for few items",
            help "the routed experts of a staged chunk whose experts average at most gemm::NARROW_MAX_AVG (24) items (512-token chunks: 16) on gemm_grouped_wgb32's tiles of 32 (a deeper ring, three blocks a multiprocessor) instead of gemm_grouped_wgb64's tiles of 64",
            why "won its A/B: prefill 512 10,468 / 10,634 → 11,229 / 11,230 tok/s (+6.4 %, with wgmma_tail_tiles and tile_grid_by_items; two rounds, an H100, full size, session 22; predicted +10 %); the 512-token launches 175.5 → 158.1 µs (gate/up) and 186.9 → 156.0 µs (down), every output bit for bit the tiles of 64's; gemm_grouped_wgb64 serves 1K–3K-token chunks and is the reference";
        wgmma_tail_tiles = true, flag Some("no-wgmma-tail-tiles"), env "LILY_WGMMA_TAIL_TILES" = true,
            label "experts' last items in tiles of 32",
            help "where the routed experts run on tiles of 128 (gemm_grouped_wgb128), each expert's last ≤ 32 items past its tiles of 128 in a second launch on gemm_grouped_wgb32's tiles of 32 instead of a nearly empty tile of 128",
            why "won its A/B: prefill 4K 24,682 / 24,614 → 25,181 / 25,085 tok/s (+1.8 %), 32K 21,951 / 21,970 → 22,379 / 22,361 (+1.9 %) with the two other session-22 switches (two rounds, an H100, full size; predicted +5–6 %); at 4K the launches 398.4 → 364.8 µs (gate/up) and 525.6 → 475.7 µs (down) with the remainders, every output bit for bit the fixed tiles'";
        tile_grid_by_items = true, flag Some("no-tile-grid-by-items"), env "LILY_TILE_GRID_BY_ITEMS" = true,
            label "experts' grid by their items",
            help "the routed experts' grouped GEMMs launch ceil(items / tile) + min(experts, items) rows of tile blocks, the most moe_group can make for the chunk, instead of the scratch's bound for a whole chunk in tiles of 16 (2,304 rows at a 4,096-token chunk, of which 256–378 hold a tile and the rest exit at once)",
            why "won its A/B as one of the three session-22 switches (an H100: prefill +6.4 % / +1.8 % / +1.9 % at 512 / 4K / 32K together); the same tiles and outputs, fewer empty blocks";
        wgmma_lean_dequant = true, flag Some("no-wgmma-lean-dequant"), env "LILY_WGMMA_LEAN_DEQUANT" = true,
            label "wgmma GEMMs' lean dequantisation",
            help "the wgmma GEMMs (gemm_dense_wgb, _wgb256, gemm_grouped_wgb32/64/128) on their _lean variants where the weights' groups are ≥ 64 columns: the same bf16 weight fragments, bit for bit, from fewer instructions (a k-step's scale and bias read once a row, each nibble made a float in place by one LOP3 and one exact FFMA, the copies' addresses computed once a block): 265 against 390 instructions a thread a k-step in gemm_grouped_wgb64",
            why "won its A/B: prefill 11,384 / 11,368 → 13,682 / 13,688 tok/s at 512 (+20 %), 25,052 / 25,149 → 28,349 / 28,443 at 4K (+13 %), 22,367 / 22,359 → 24,830 / 24,903 at 32K (+11 %; two rounds, an H100, full size, session 23; predicted +11–13 %); every output bit for bit the kernels it replaces (GPU test wgmma_lean_dequant_gives_the_same_bits); the plain variants serve groups below 64 columns and are the reference";
        wgmma_hoisted_addrs = true, flag Some("no-wgmma-hoisted-addrs"), env "LILY_WGMMA_HOISTED_ADDRS" = true,
            label "wgmma grouped GEMMs' hoisted addresses",
            help "with wgmma_lean_dequant, the routed experts' grouped GEMMs (gemm_grouped_wgb32/64/128) on their _hoist variants: the same copies, MMAs and outputs, bit for bit, with a k-step's addresses held in registers (the copies' swizzled 32-bit shared destinations and the fragments' row computed once a block, the ring slots rotated by an add and a wrap instead of st % STAGES three times a step, the wgmma descriptors as the ring's plus an offset): 195 against 265 instructions a thread a k-step in gemm_grouped_wgb64",
            why "won its A/B: prefill 13,392 / 13,655 → 13,979 / 13,931 tok/s at 512 (+3.2 %), 28,364 / 28,386 → 28,898 / 28,914 at 4K (+1.9 %), 24,853 / 24,891 → 25,263 / 25,260 at 32K (+1.6 %; two rounds, an H100, full size, session 24; predicted +6–9 / +2–4 / +1.5–3.5 %); the launches at 4K 279.6 → 256.4 µs (gate/up) and 413.8 → 394.4 µs (down), every output bit for bit the _lean kernels' (GPU test wgmma_hoisted_addrs_gives_the_same_bits); the _lean grouped kernels are the reference";
        flash_prefill = true, flag Some("no-flash-prefill"), env "LILY_ATTN_PREFILL" = true,
            label "flash prefill",
            help "prefill chunks' attention as flash attention on the tensor cores (attn_prefill: bf16 mma, fp32 softmax; bf16 mode) instead of one block per (token, query head)",
            why "the fallback serves fp32 mode and head dims attn_prefill lacks";
        wgmma_attention = true, flag Some("no-wgmma-attention"), env "LILY_WGMMA_ATTENTION" = true,
            label "wgmma prefill attention",
            help "prefill chunks of at least 1,024 tokens run their attention on Hopper's warpgroup MMA (attn_prefill_wg: sm_90a, head dim 256) instead of mma.sync (attn_prefill)",
            why "won its A/B: prefill 128K 10,610 → 14,003 tok/s on the H200 (session 9); elsewhere the device has no wgmma";
        wgmma_attention_pipelined = true, flag Some("no-wgmma-attention-pipelined"), env "LILY_WGMMA_ATTENTION_PIPELINED" = true,
            label "pipelined wgmma prefill attention",
            help "with wgmma_attention, prefill chunks' attention on attn_prefill_wg_pipe: attn_prefill_wg's blocks, tiles and arithmetic in the same order (the same output, bit for bit) with the softmax of key tile j + 1 run while the tensor cores do tile j's P·V (FA3's intra-warpgroup pipelining: S_{j+1} = Q·K_{j+1}ᵀ and P_j·V_j issued together, the wait for P_j·V_j after the softmax; K and V in rings of their own, the same 193 KB of shared memory)",
            why "won its A/B: prefill 24,979 / 24,911 → 25,898 / 25,924 tok/s at 32K (+3.8 %), 17,520 / 17,478 → 19,060 / 19,044 at 128K (+8.9 %), 4K +0.6 % (two rounds, an H100, full size, session 24; predicted +2–4 / +6–12 %); the 32K and 128K prompts' last chunks 4.68 → 3.62 ms (441 → 570 TFLOP/s) and 18.56 → 14.21 ms (467 → 609 TFLOP/s), every output bit for bit attn_prefill_wg's (GPU test attn_prefill_wg_pipe_gives_attn_prefill_wg_bits); attn_prefill_wg is the reference";
        tc_scan = true, flag Some("no-tc-scan"), env "LILY_TC_SCAN" = true,
            label "tensor-core DeltaNet scan",
            help "prefill chunks of at least 64 tokens run the DeltaNet recurrence in its chunked form on the tensor cores (dn_wy_prep: every 64-token chunk's W, U and masked QKᵀ at once; dn_wy_scan: the chunks in order; tf32 products, fp32 sums and state; bf16 mode, devices granting 150 KB of shared memory a block) instead of token by token (dn_recurrent)",
            why "won its A/B: prefill 512 / 4K / 32K +10 / +25 / +22 % on the H200 (20,051 → 25,083 tok/s at 4K; perf-notes, session 13); the recurrence serves steps under 64 tokens, fp32 mode and devices without 150 KB of shared memory";
        moe_grouped = true, flag Some("no-moe-grouping"), env "LILY_MOE_GROUPED" = true,
            label "MoE grouping",
            help "prefill's routed experts grouped by expert (moe_group, then grouped linears), each expert's weights read once a tile, instead of one item at a time (gathered); decode always gathers",
            why "the gathered form is the reference of the grouped kernels";
        split_kv = true, flag Some("no-split-kv"), env "LILY_SPLIT_KV" = true,
            label "split-KV",
            help "steps of at most 4 tokens (decode) run split-KV (flash-decoding) attention instead of one block per (token, query head)",
            why "the one-block kernel is the reference the split kernels are tested against";
        mma_attention = true, flag Some("no-mma-attention"), env "LILY_MMA_ATTENTION" = true,
            label "tensor-core decode attention",
            help "one-token split-KV attention on the tensor cores (attn_split_mma: q, P and the cache in bf16, f32 sums; bf16 mode) instead of CUDA-core FMAs (attn_split)",
            why "won its A/B: decode 128K +26 % on the H200 (session 4); attn_split serves fp32 mode";
        fused_attn_prep = true, flag Some("no-fused-attn-prep"), env "LILY_FUSED_ATTN_PREP" = true,
            label "fused attention prep",
            help "one-token tensor-core attention does attn_qk_prep's work (q/k norms, RoPE, the cache write) in its own blocks (attn_split_mma_prep), one launch fewer per attention layer",
            why "won its A/B: decode −24…−38 µs a token at 256 and 4K on the H200 (session 7)";
        fused_decode = true, flag Some("no-fused-decode"), env "LILY_FUSED_DECODE" = true,
            label "fused decode",
            help "one-token steps (decode) run decode.cu's fused kernels (norms folded into the projections, the projections of one input in one launch, the MoE in two launches) instead of a prefill chunk's launches for one token",
            why "the per-kernel form serves weights decode.cu does not read";
        fused_batch = true, flag Some("no-fused-batch"), env "LILY_FUSED_BATCH" = true,
            label "fused batched decode",
            help "a batched decode step's projections of one input in one launch of decode.cu's dec_gemv_rows (each weight read once and dotted with the B staged rows) instead of linear.cu's kernels over the rows, one launch a weight",
            why "linear.cu over the rows (the batched step's first version) is the reference the fused kernel is tested against; not yet measured (perf-notes)";
        mma_rows = true, flag Some("no-mma-rows"), env "LILY_MMA_ROWS" = true,
            label "batched projections on tensor cores",
            help "a batched decode step's 4-bit projections (the fused batch's dec_gemv_rows: q/k/v, DeltaNet's four, o_proj, out_proj, lm_head) on the tensor cores (decode.cu's dec_mma_rows: 16 weight rows × the B ≤ 8 rows an mma.sync, nibbles ORed into bf16 128 + q, s·acc + (b − 128 s)·Σx per group; bf16 mode) instead of the CUDA cores",
            why "won its A/B: bench 4 / 8 rows 1.27× / 1.57× → 1.70× / 2.38× one row (8 layers), full size 595 → 745 / 725 → 998 tok/s at 1K (an H100, session 16); dec_gemv_rows serves fp32 mode and the router's 8-bit gate";
        mma_rows_deep = true, flag Some("no-mma-rows-deep"), env "LILY_MMA_ROWS_DEEP" = true,
            label "batched tensor-core projections streamed through shared memory",
            help "mma_rows' batched 4-bit projections in decode.cu's dec_mma_rows_deep: the same tiles and item sums (whole tiles a warp equal dec_mma_rows' bit for bit; a split tile's warps take its groups four at a time, another summation order), the weight nibbles streamed by 16-byte cp.async into three chunk stages a warp in shared memory (two chunks, 4.6 KB, in flight a warp all the time; two stages where the staged rows leave no room) instead of 8-byte loads into registers, one chunk ahead; the persistent grid as many blocks an SM as shared memory holds (≤ 4); with mma_rows",
            why "won its A/B, narrowly: full size at 1K, bench 8 rows 949.6 / 949.8 → 962.4 / 962.1 tok/s (+1.3 %), 4 rows 753.3 / 750.4 → 754.6 / 752.5 (+0.2 %), one row unchanged (two rounds, an H100, session 19; predicted +3–6 % at 4 rows: lm_head is issue-bound, not load-bound); dec_mma_rows serves where the stages do not fit";
        router_rows_split = true, flag Some("no-router-rows-split"), env "LILY_ROUTER_ROWS_SPLIT" = true,
            label "batched router split over lanes",
            help "a batched decode step's router launch (router + shared-expert gate: 257 rows) in decode.cu's dec_gemv_rows_split (one weight row a warp, its 64-column groups one a lane, the lanes' sums met by a fixed shuffle tree, 4 rows a block: 65 blocks) instead of dec_gemv_rows' tiles of 24-32 rows (11 blocks)",
            why "won its A/B: full size 4 rows 748.0 / 747.1 → 759.9 / 763.0 tok/s (+1.9 %), 1 and 8 rows unchanged; served 4 clients 751.2 → 766.3 (an H100, session 17); dec_gemv_rows serves wider launches";
        moe_int8 = true, flag Some("no-moe-int8"), env "LILY_MOE_INT8" = true,
            label "int8 MoE products",
            help "the fused MoE's 4-bit products (decode.cu's dec_glu4 and dec_down_combine and their rows forms: one-token and batched decode) with their input rows rounded to int8 per 64-column group (scale: the group's largest magnitude / 127; the bias term on the rounded rows' sum) and each 4-bit word dotted by two dp4a (dec_glu4_q8, dec_down_combine_q8 and their _rows forms; the gate/up kernel 3 blocks an SM) instead of f32 FMAs on unpacked weights; bf16 mode",
            why "won its A/B: decode 465.9 / 461.0 → 503.6 / 497.5 tok/s at 256 / 4K (+8 %), batched 4 / 8 rows +5–6 % / +1 % (an H100, full size); but over 1,024 one-token positions against CUDA fp32 0.251 rel. L2, past HF transformers bf16's 0.246 (an H200, session 19): moe_int8_pairs stands before it by default, single int8 where the pairs' shared memory does not fit; the f32 products serve fp32 mode and are the reference";
        moe_int8_pairs = true, flag Some("no-moe-int8-pairs"), env "LILY_MOE_INT8_PAIRS" = true,
            label "int8-pair MoE products",
            help "the fused MoE's 4-bit products (as moe_int8's: dec_glu4 and dec_down_combine and their rows forms) with their input rows rounded to two int8 per value per 64-column group (moe_int8's one int8 and the residual's, x ≈ scale · (x_hi + x_lo / 254): error ≤ max|x| / 64,516) and each 4-bit word dotted by four dp4a (dec_glu4_x8x2, dec_down_combine_x8x2 and their _rows forms; the gate/up kernel 2 blocks an SM, the down kernel one); taken before moe_int8's single int8 where both are on; bf16 mode",
            why "kept the agreement bar that single int8 missed: over 1,024 one-token positions against CUDA fp32 (full size, an H200, session 19) 0.216 rel. L2 / 55.6 % top-1 with gemv_int8 (single int8: 0.248 / 49.0 %; f32 products 0.216 / 56.3 %; HF transformers bf16's bar 0.246 / 48.8 %) 2 % below single int8's speed (with gemv_int8: pairs 533.4 / 525.8 and 531.4 / 524.8 tok/s at 256 / 4K, single int8 546.5 / 536.9 and 543.9 / 536.4, f32 MoE products 496.0 / 490.0); the f32 products serve fp32 mode and are the reference";
        moe_grouped_rows = true, flag Some("no-moe-grouped-rows"), env "LILY_MOE_GROUPED_ROWS" = true,
            label "batched MoE grouped by expert",
            help "a batched decode step's MoE (2 to 8 rows, int8-pair products) in decode.cu's dec_glu4_x8x2_grouped + dec_down_combine_x8x2_grouped: the rows routed in every block, the union of their picks (the shared expert, then each picked expert once, by id) looped over by blocks that own a tile of the intermediate (gate/up) or of the outputs (down), each expert's weight tile read once a step and dotted with every row that picked it (int8 pairs of all rows staged once a block), each row's products combined in the one-token kernels' order (bit for bit dec_glu4_x8x2 + dec_down_combine_x8x2 a row at a time), instead of one-token decode's kernels with the token in grid.y (each row streaming its own experts and the shared expert)",
            why "won its A/B: full size, 1K, bench --batch 4 / 8 757.4 / 969.5 → 822.3 / 1,103.0 tok/s (+8.6 % / +13.8 %, two rounds, an H100, session 20; predicted +17–27 % / +30–45 %); served 1 / 4 / 8 clients 500.7 / 824.3 / 1,106.1 tok/s; the batched step's agreement over 1,024 positions against CUDA fp32 unchanged (0.216 rel. L2, 55.5 % top-1: bit for bit the per-row kernels); the per-row kernels serve one row and other products and are the reference it is tested against";
        grouped_down_wide = true, flag Some("no-grouped-down-wide"), env "LILY_GROUPED_DOWN_WIDE" = true,
            label "grouped MoE down kernel at 16 warps",
            help "with moe_grouped_rows: the batched step's grouped down kernel in decode.cu's dec_down_combine_x8x2_grouped_wide, 16 warps a block (4 row groups × 4 item columns, a ring of 3 items a warp) instead of dec_down_combine_x8x2_grouped's 12 (3 item columns): one block an SM either way (its 92 KB of staged int8 pairs), a third more weight loads in flight an SM and the staging over 512 threads; the same outputs bit for bit (each (row, item) product whole in one warp, the combine in dec_down_combine_x8x2's order)",
            why "won its A/B: bench --batch 4 / 8 at 1K 819.6 / 1,099.1 and 822.3 / 1,099.6 → 826.6 / 1,121.5 and 824.2 / 1,121.5 tok/s (+0.5 % / +2.0 %; two rounds, an H100, full size, session 22; predicted +3–5 % / +4–7 %); GPU tests batched_decode_moe_grouped_matches_one_token_at_a_time and decode_batched_steps_grouped_by_expert_match_each_sequence_alone pass; the 12-warp kernel is the reference it is tested against";
        grouped_moe_stream = true, flag Some("no-grouped-moe-stream"), env "LILY_GROUPED_MOE_STREAM" = true,
            label "grouped MoE weights streamed deeper",
            help "with moe_grouped_rows: the batched step's grouped MoE with more weight bytes in flight a warp, the same blocks, items and outputs bit for bit: gate/up in decode.cu's dec_glu4_x8x2_grouped_ring (a ring of 3 register buffers of a warp's items instead of dec_glu4_x8x2_grouped's 2, and the shared expert's rows spread over the item chunks, so every block requests a tile before the dependency wait and chunk 0 no longer sums all its products) and, with grouped_down_wide, down in dec_down_combine_x8x2_grouped_ring (a ring of 4 items a warp instead of the wide kernel's 3)",
            why "won its A/B: bench --batch 4 / 8 at 1K 914.2 / 1,223.4 and 916.1 / 1,223.9 → 916.7 / 1,246.6 and 919.4 / 1,245.1 tok/s (+0.3 % / +1.8 %; two rounds, an H100, full size, session 28; predicted +4–8 % / +7–13 %: profiled alone the ring kernels are no faster, 46.7 / 35.2 µs against 45.1 / 35.3, so the step gains by the shared expert split over every block, which requests before the dependency wait); its GPU tests (both kernels the grouped pair's bits; the batched step against each sequence alone) pass; off, the two-buffer and three-item kernels";
        batch_lean_glue = true, flag Some("no-batch-lean-glue"), env "LILY_BATCH_LEAN_GLUE" = true,
            label "batched step's norms and router staging lean",
            help "a batched decode step's RMS norms in norm.cu's rms_norm_rows (rms_norm's block of 256 threads a row and its bits, each thread's columns loaded into registers at once and the norm weight before the dependency wait, the next kernel let launch after it) and its router launch in decode.cu's dec_gemv_rows_split_lean (dec_gemv_rows_split's bits, the rows staged with each thread's float4 loads requested together and each (row, group) sum one thread's in the shuffle tree's order) instead of rms_norm (a dependent load a loop trip, x read twice) and rows_stage (one load a trip; a warp and five shuffles a (row, group) sum)",
            why "won its A/B: bench --batch 4 / 8 at 1K 822.8 / 1,113.7 and 825.0 / 1,115.1 → 914.5 / 1,218.7 and 915.3 / 1,218.5 tok/s (+11 % / +9.3 %; two rounds, an H100, full size, session 27; predicted +5–10 %); profiled at 8 rows rms_norm 11.6 → 6.6 µs and the router 25.5 → 17.4 µs a launch; GPU tests batch_lean_glue_gives_the_plain_kernels_bits and decode_batched_steps_lean_glue_match_each_sequence_alone pass; rms_norm and dec_gemv_rows_split are the reference they are tested against";
        router_async_stage = true, flag Some("no-router-async-stage"), env "LILY_ROUTER_ASYNC_STAGE" = true,
            label "batched router staged by cp.async",
            help "with router_rows_split and batch_lean_glue: a batched decode step's router launch (router + shared-expert gate) in decode.cu's dec_gemv_rows_split_async, its input rows copied into shared memory by cp.async (every thread's 16-byte copies in flight at once, one wait: one round trip to L2 instead of dec_gemv_rows_split_lean's four at 8 rows) and each (row, group) sum taken by the warp that copied it after a warp barrier, one block barrier in all instead of two; the same outputs bit for bit",
            why "won its A/B: bench --batch 4 / 8 at 1K 917.6 / 1,236.4 and 919.3 / 1,236.8 → 956.5 / 1,296.5 and 953.2 / 1,295.1 tok/s (+4 % / +4.8 %; two rounds, an H100, full size, session 33; predicted +0.5–1.5 %: profiled at 8 rows the router 18.2 → 11.9 µs a launch, predicted 15–16.5); served 4 / 8 clients 925.7 / 1,239.4 → 957.2 / 1,298.0 tok/s; its GPU tests (the lean router's bits; the batched step against each sequence alone) pass; off, dec_gemv_rows_split_lean, the reference it is tested against";
        mma_stage_rounds = false, flag Some("mma-stage-rounds"), env "LILY_MMA_STAGE_ROUNDS" = true,
            label "batched tensor-core projections' inputs staged in rounds",
            help "with mma_rows_deep: a batched decode step's 4-bit projections in decode.cu's dec_mma_rows_deep_rounds, whose threads load MMA_STAGE_ROUND (4) items of the input rows (16 floats each) before converting any to bf16, so staging 8 rows of 2,048 columns costs 2 dependent trips to L2 instead of dec_mma_rows_deep's 8 (4 rows: 1 instead of 4); the same outputs bit for bit",
            why "not yet measured (perf-notes, session 33: predicted the 8-row DeltaNet and attention projections 24.6 / 23.6 → 21–23 µs profiled, bench --batch 8 +2–5 %, on an H100; the reasoning is router_async_stage's measured win on the same staging pattern); dec_mma_rows_deep is the reference it is tested against";
        gemv_int8 = true, flag Some("no-gemv-int8"), env "LILY_GEMV_INT8" = true,
            label "int8-pair one-token projections",
            help "one-token decode's 4-bit projections on decode.cu's pipelined kernels (DeltaNet's in_proj and out_proj, attention's q/k/v and o_proj, lm_head) with their staged input rounded to two int8 per value per 64-column group (x ≈ scale · (x_hi + x_lo / 254), scale the group's largest magnitude / 127: error ≤ max|x| / 64,516, finer than bf16) and each 4-bit word dotted by four dp4a (dec_gemv4_x8x2, dec_gemv4w_x8x2) instead of f32 FMAs on unpacked weights; bf16 mode",
            why "won its A/B: decode 532.3 / 526.2 / 464.5 → 546.5 / 536.9 / 476.0 tok/s at 256 / 4K / 32K (+2–3 %; two rounds, an H200, full size, session 19); agreement over 1,024 one-token positions against CUDA fp32 unchanged (0.251 → 0.248 rel. L2 with single-int8 MoE products); the f32 products serve fp32 mode and are the reference";
        gemv4w_sm_grid = true, flag Some("no-gemv4w-sm-grid"), env "LILY_GEMV4W_SM_GRID" = true,
            label "4096-column projections one block an SM",
            help "one-token decode's 4096-column projections on int8 pairs (dec_gemv4w_x8x2: DeltaNet's out_proj with its gated norm, attention's o_proj) on ceil(tiles / 2) blocks where that is at most one an SM (128 blocks of 16 rows at the full shape) instead of two blocks an SM of 8 rows each: every block requests both its tiles before its dependency wait, stages and norms its input once for 16 rows (half the L2 reads of o and z), and fits beside the kernels before and after it (dec_dn_step, the router's dec_gemv8), so all its weight loads start while they run; the same outputs bit for bit; with gemv_int8",
            why "won its A/B with down_96_regs (session 23, an H100, full size, two rounds, both on against both off): decode 497.2 / 498.3 → 502.0 / 502.8 tok/s at 4K (+0.9 %), 504.8 / 502.6 → 509.2 / 509.9 at 256 (+1.1 %), 438.6 / 437.3 → 442.1 / 443.1 at 32K (+1.0 %); predicted +5–9 % together; the GPU tests check the same bits as the two-blocks-an-SM grid";
        down_96_regs = true, flag Some("no-down-96-regs"), env "LILY_DOWN_96_REGS" = true,
            label "MoE down kernel at 96 registers",
            help "one-token decode's MoE down kernel on int8 pairs in dec_down_combine_x8x2_r96: its code held to 96 registers a thread (91 at sm_90a, no spills; 100 unbounded) so that its 12-warp block and one 8-warp block of the next layer's first projection (dec_gemv4_x8x2 at 112: in_proj, q/k/v, lm_head) fill an SM's 65,536 registers together, that block requesting its first tiles while the down kernel runs; the same outputs bit for bit; with moe_int8_pairs",
            why "won its A/B with gemv4w_sm_grid (session 23, an H100, full size, two rounds, both on against both off: decode +0.9 % at 4K, +1.1 % at 256, +1.0 % at 32K; predicted +5–9 % together); the GPU test checks dec_down_combine_x8x2's bits";
        moe_bulk = true, flag Some("no-moe-bulk"), env "LILY_MOE_BULK" = true,
            label "bulk-copied MoE gate/up tiles",
            help "one-token decode's MoE gate/up kernel on int8 pairs in dec_glu4_x8x2_bulk: dec_glu4_x8x2's tiles, grid and arithmetic (the same outputs bit for bit), each block's tiles (at most 3, 18 KB each at the full shape) bulk-copied into shared memory by the copy engine (cp.async.bulk, an mbarrier a tile; sm_90a) all before any is summed, the shared expert's before the dependency wait and the routed experts' right after the routing, where dec_glu4_x8x2 holds two in registers and asks for the next as one is summed (74 registers a thread instead of 117); with moe_int8_pairs",
            why "won its A/B: decode 502.6 / 502.1 → 505.8 / 505.7 tok/s at 4K (+0.7 %), 442.1 / 441.8 → 450.3 / 449.1 at 32K (+1.7 %), dec_glu4_x8x2 16.2 → 15.6 µs a launch (two rounds, an H100, full size, session 25; predicted +1.5–5 / +1–4 %); elsewhere the device has no bulk copies (sm_90a)";
        dependent_launch = true, flag Some("no-dependent-launch"), env "LILY_PDL" = true,
            label "dependent launch",
            help "the decode kernels launched as programmatic dependents (sm_90+): each may start while the one before it finishes, loading its weights before it waits for its input",
            why "won its A/B: decode +2–3 % on the H200 (session 2); before sm_90 the device cannot";
        early_trigger = true, flag Some("no-early-trigger"), env "LILY_EARLY_TRIGGER" = true,
            label "early trigger",
            help "every decode kernel lets the next one launch as soon as its own early weight loads are issued instead of after its last rows (decode.cu built with DEC_EARLY_TRIGGER)",
            why "won its A/B: decode 4K +6.1 % on the H200 (session 4)";
        graphs = true, flag Some("no-cuda-graphs"), env "LILY_CUDA_GRAPH" = true,
            label "CUDA graphs",
            help "each sequence's decode step replayed as a captured CUDA graph instead of plain launches (never with the debug checks)",
            why "plain launches are what a failed capture falls back to";
        pipelined_decode = true, flag Some("no-pipelined-decode"), env "LILY_PIPELINED_DECODE" = true,
            label "pipelined decode",
            help "decode queues step N + 1's forward pass right after step N's pick, before the host has read token N (never with host sampling or top log-probabilities on the host, which read step N's logits)",
            why "won its A/B: the device's wait for the host 27–33 → 3 µs a token on the H200 (session 7)";
        pipelined_batch = true, flag Some("no-pipelined-batch"), env "LILY_PIPELINED_BATCH" = true,
            label "pipelined batched step",
            help "the batched decode step (several sequences) queues its rows' forward pass right after their picks, before the host has read them, as pipelined decode does for one (with pipelined decode on; never with host sampling or host top log-probabilities; not while steps are timed)",
            why "won its served A/B: 4 / 8 clients 2,331 / 2,867 and 2,327 / 2,835 tok/s off against 2,359 / 2,899 and 2,368 / 2,908 on (+1.4 % / +1.8 %; an H100, 8 layers, session 16); its GPU tests pass";
        device_logprobs = true, flag Some("no-device-logprobs"), env "LILY_DEVICE_LOGPROBS" = true,
            label "device top log-probabilities",
            help "a decode step's top log-probabilities (1..=20) computed on the device after the pick (logprob_part + logprob_final: the log-sum-exp and the k best), the host reading 2 + 2k words instead of the 248K logits, pipelined decode kept on",
            why "the host path (lily_core::logprob on the downloaded row) is the reference and serves host sampling";
        device_sampling = true, flag Some("no-device-sampling"), env "LILY_DEVICE_SAMPLING" = true,
            label "device sampling",
            help "non-greedy settings the device sampler covers (top_k 1..=256) pick on the device instead of the host sampler on downloaded logits; greedy always picks on the device",
            why "the host sampler is the reference and serves what the device sampler does not";
        multi_block_sampling = true, flag Some("one-block-sampling"), env "LILY_SAMPLE_PARTS" = true,
            label "many-block sampling",
            help "a sampled pick's first pass (top_k of the 248K scaled logits) over many blocks (sample_part), the rest in one, instead of all in one block",
            why "won its A/B: the sampler 0.47 → 0.17 ms a token at 4K on the H200 (session 4)";
        warp_scan_sampling = true, flag Some("no-warp-scan-sampling"), env "LILY_WARP_SCAN" = true,
            label "warp-scan sampling",
            help "the radix select of a sampled pick finds each pass's bin with one warp's shuffle scan instead of one thread walking the 256 bins (sample.cu built with SAMPLE_WARP_SCAN)",
            why "won its A/B: the sampler's share of a step at 4K 3.2 → 1.8 % on the H200 (session 5)";
        batched_decode = true, flag Some("no-batched-decode"), env "LILY_BATCHED_DECODE" = true,
            label "batched decode",
            help "a decode step of several sequences feeds their tokens in one forward pass (backend/batch.rs: each weight read once for the batch) instead of one sequence after another, each its own one-token step; with it the server decodes up to 8 sequences together by default (`--max-batch`)",
            why "won its served A/B: 4 / 8 concurrent clients 2,360 / 2,904 tok/s against one client's 1,847 (1.28× / 1.57×; the bench's step 1.27× / 1.56×) on an H100, 8 layers (session 16); one after another, the batch gets one client's rate";
        sync_each = false, flag None, env "LILY_CUDA_SYNC" = true,
            label "sync after each launch",
            help "debug: synchronise after every launch so an error names its kernel (graphs off)",
            why "a debugging aid";
        profile = false, flag None, env "LILY_PROFILE" = true,
            label "profiling",
            help "debug: device time per kernel and part of the model, events around every launch (graphs off), printed to stderr at exit",
            why "a measuring aid";
        step_timing = false, flag None, env "LILY_STEP_TIMING" = true,
            label "step timing",
            help "each decode call, and every 64 batched decode steps, logs the device's work per token beside the wall time per token, i.e. how long the device waits for the host between steps",
            why "a measuring aid";
    }
    knobs {
        ordinal = 0, flag None, env "LILY_CUDA_DEVICE",
            accepts |_| true, "a GPU ordinal", label "GPU",
            help "the GPU the backend runs on";
        chunk = DEFAULT_PREFILL_CHUNK, flag Some("prefill-chunk"), env "LILY_PREFILL_CHUNK",
            accepts |n| n > 0, "at least 1", label "prefill chunk",
            help "largest prefill chunk in tokens, at most kernels::max_chunk (65,535 on the model: dn_conv's tokens in grid.y); activation scratch is sized for it (≈ 1.5 GiB at 4,096, 3.0 GiB at 8,192 on the model)";
        interleaved_chunk = DEFAULT_INTERLEAVED_CHUNK, flag Some("interleaved-chunk"), env "LILY_INTERLEAVED_CHUNK",
            accepts |n| n > 0, "at least 1", label "interleaved chunk",
            help "largest piece of a prompt fed while other sequences decode, at most the prefill chunk: a running stream waits at most one such piece between two of its tokens";
        wgmma_min_tok = WGMMA_MIN_TOK, flag None, env "LILY_WGMMA_MIN_TOK",
            accepts |n| n >= 128, "at least 128", label "wgmma GEMM from tokens",
            help "with wgmma_gemm: the fewest tokens of a chunk whose projections take the wgmma kernels";
        wgb_tok = 256, flag None, env "LILY_WGB_TOK",
            accepts |n| n == 128 || n == 256, "128 or 256", label "wgmma GEMM tokens a block",
            help "with wgmma_gemm: tokens a block of the dense wgmma GEMM for chunks of at least gemm::WGB256_MIN_TOK tokens (256: gemm_dense_wgb256, 128: gemm_dense_wgb); smaller chunks take 128";
        wgmma_group_tile = 128, flag None, env "LILY_WGMMA_GROUP_TILE",
            accepts |n| n == 64 || n == 128, "64 or 128", label "experts' wgmma tile",
            help "with wgmma_gemm: items a tile of the routed experts' wgmma GEMM once experts average three quarters of it (128: gemm_grouped_wgb128, 64: gemm_grouped_wgb64)";
        split_long_keys = SPLIT_LONG_KEYS, flag None, env "LILY_SPLIT_LONG_KEYS",
            accepts |_| true, "any number of keys", label "long decode attention past keys",
            help "past this many keys one-token tensor-core attention with head dim 256 takes the _long split kernels (0: always; a number past the context: never)";
    }
    texts {
        kv_cache: KvCacheKind = KvCacheKind::Int8, flag Some("kv-cache"), env "LILY_KV_CACHE",
            value "FORMAT", accepts "bf16 or int8", label "KV cache",
            help "the KV cache's format: bf16, or int8 rows (each position's row of a KV head as int8 with one f32 scale, max|x| / 127: 0.52× the bytes; with bf16 activations on compute capability 9 and later, else bf16): one-token decode's tensor-core split kernels read the int8 tiles and scale scores and probabilities by the rows' scales; prefill and other multi-token steps read the rows dequantised into a bf16 scratch of the model's context (kv_int8_dequant); the long split bodies from 4,096 keys with int8. Measured (H100, sessions 31–32): agreement with fp32 equal to bf16's over 1,024 positions; decode against bf16 in one call 128K +7…+9.5 %, 32K +0.6…+1.7 %, 4K −0.3…−1 %, 256 −1.9 %; served 4K equal; half the cache's memory; the shipping GPU tests pass with it (docs/perf-notes.md, session 32)";
    }
    fields {}
}

/// The crate README's table of switches and knobs (README.md holds exactly these rows; a unit
/// test checks it).
pub fn readme_rows() -> String {
    lily_core::options::readme_rows::<CudaOptions>()
}

#[cfg(test)]
mod tests {
    use super::*;

    use lily_core::options::env_of as env;

    #[test]
    fn kv_cache_takes_bf16_or_int8_and_nothing_else() {
        for (text, kind) in [("bf16", KvCacheKind::Bf16), ("int8", KvCacheKind::Int8)] {
            let o = CudaOptions::default().with_overrides(env(&[("LILY_KV_CACHE", text)]));
            assert_eq!(o.kv_cache, kind);
        }
        for text in ["int4", "1", "", "INT8"] {
            let o = CudaOptions {
                kv_cache: KvCacheKind::Int8,
                ..CudaOptions::default()
            }
            .with_overrides(env(&[("LILY_KV_CACHE", text)]));
            assert_eq!(o.kv_cache, KvCacheKind::Int8, "{text:?} leaves it as it is");
        }
        assert_eq!(
            CudaOptions::default().kv_cache,
            KvCacheKind::Int8,
            "int8 rows ship (bf16 where the plan cannot keep them)"
        );
    }

    #[test]
    fn no_environment_leaves_the_options_as_given() {
        let o = CudaOptions {
            split_kv: false,
            chunk: 512,
            ..CudaOptions::default()
        };
        assert_eq!(o.clone().with_overrides(|_| None), o);
    }

    #[test]
    fn environment_variables_override_the_options() {
        let o = CudaOptions::default().with_overrides(env(&[
            ("LILY_CUDA_FP32", "1"),
            ("LILY_CUDA_DEVICE", "2"),
            ("LILY_PREFILL_CHUNK", "256"),
            ("LILY_CUDA_GRAPH", "0"),
            ("LILY_MOE_GROUPED", "0"),
            ("LILY_ATTN_PREFILL", "0"),
            ("LILY_SPLIT_KV", "0"),
            ("LILY_DEVICE_SAMPLING", "0"),
            ("LILY_TENSOR_CORES", "0"),
            ("LILY_EXACT_ROUTER_TC", "0"),
            ("LILY_FUSED_DECODE", "0"),
            ("LILY_FUSED_BATCH", "0"),
            ("LILY_MMA_ROWS", "0"),
            ("LILY_PDL", "0"),
            ("LILY_EARLY_TRIGGER", "0"),
            ("LILY_SAMPLE_PARTS", "0"),
            ("LILY_MMA_ATTENTION", "0"),
            ("LILY_FUSED_ATTN_PREP", "0"),
            ("LILY_SPLIT_LONG_KEYS", "4096"),
            ("LILY_INTERLEAVED_CHUNK", "128"),
            ("LILY_WGMMA_GEMM", "0"),
            ("LILY_WGB_TOK", "128"),
            ("LILY_WGMMA_MIN_TOK", "1024"),
            ("LILY_WGMMA_GROUP_TILE", "64"),
            ("LILY_WGMMA_SMALL_TILES", "0"),
            ("LILY_WGMMA_NARROW_TILES", "0"),
            ("LILY_WGMMA_TAIL_TILES", "0"),
            ("LILY_TILE_GRID_BY_ITEMS", "0"),
            ("LILY_WGMMA_LEAN_DEQUANT", "0"),
            ("LILY_WGMMA_HOISTED_ADDRS", "0"),
            ("LILY_WGMMA_ATTENTION_PIPELINED", "0"),
            ("LILY_MOE_BULK", "0"),
            ("LILY_ROUTER_SPLIT_K", "0"),
            ("LILY_WGMMA_ATTENTION", "0"),
            ("LILY_WARP_SCAN", "0"),
            ("LILY_PIPELINED_DECODE", "0"),
            ("LILY_PIPELINED_BATCH", "0"),
            ("LILY_DEVICE_LOGPROBS", "0"),
            ("LILY_BATCHED_DECODE", "0"),
            ("LILY_TC_SCAN", "0"),
            ("LILY_MMA_ROWS_DEEP", "1"),
            ("LILY_ROUTER_ROWS_SPLIT", "0"),
            ("LILY_MOE_INT8", "0"),
            ("LILY_GEMV_INT8", "1"),
            ("LILY_GEMV4W_SM_GRID", "0"),
            ("LILY_DOWN_96_REGS", "0"),
            ("LILY_MOE_INT8_PAIRS", "1"),
            ("LILY_MOE_GROUPED_ROWS", "0"),
            ("LILY_GROUPED_DOWN_WIDE", "0"),
            ("LILY_GROUPED_MOE_STREAM", "0"),
            ("LILY_BATCH_LEAN_GLUE", "0"),
            ("LILY_ROUTER_ASYNC_STAGE", "0"),
            ("LILY_MMA_STAGE_ROUNDS", "1"),
            ("LILY_CUDA_SYNC", "1"),
            ("LILY_PROFILE", "1"),
            ("LILY_STEP_TIMING", "1"),
            ("LILY_KV_CACHE", "int8"),
        ]));
        // Written out field by field (not from the table) so the test checks the table.
        assert_eq!(
            o,
            CudaOptions {
                ordinal: 2,
                bf16_activations: false,
                chunk: 256,
                interleaved_chunk: 128,
                graphs: false,
                moe_grouped: false,
                flash_prefill: false,
                split_kv: false,
                device_sampling: false,
                tensor_cores: false,
                exact_router_on_tensor_cores: false,
                fused_decode: false,
                fused_batch: false,
                mma_rows: false,
                mma_rows_deep: true,
                router_rows_split: false,
                moe_int8: false,
                gemv_int8: true,
                gemv4w_sm_grid: false,
                down_96_regs: false,
                moe_bulk: false,
                moe_int8_pairs: true,
                moe_grouped_rows: false,
                grouped_down_wide: false,
                grouped_moe_stream: false,
                batch_lean_glue: false,
                router_async_stage: false,
                mma_stage_rounds: true,
                kv_cache: KvCacheKind::Int8,
                dependent_launch: false,
                early_trigger: false,
                multi_block_sampling: false,
                warp_scan_sampling: false,
                mma_attention: false,
                fused_attn_prep: false,
                split_long_keys: 4096,
                wgmma_gemm: false,
                wgb_tok: 128,
                wgmma_min_tok: 1024,
                wgmma_group_tile: 64,
                wgmma_small_tiles: false,
                wgmma_narrow_tiles: false,
                wgmma_tail_tiles: false,
                tile_grid_by_items: false,
                wgmma_lean_dequant: false,
                wgmma_hoisted_addrs: false,
                router_split_k: false,
                wgmma_attention: false,
                wgmma_attention_pipelined: false,
                pipelined_decode: false,
                pipelined_batch: false,
                device_logprobs: false,
                batched_decode: false,
                tc_scan: false,
                sync_each: true,
                profile: true,
                step_timing: true,
            }
        );
        // A value a knob does not take, or a switch that is neither 0 nor 1, changes nothing.
        let o = CudaOptions::default().with_overrides(env(&[
            ("LILY_PREFILL_CHUNK", "0"),
            ("LILY_WGB_TOK", "192"),
            ("LILY_WGMMA_MIN_TOK", "64"),
            ("LILY_SPLIT_KV", "yes"),
            ("LILY_CUDA_FP32", "0"),
        ]));
        assert_eq!(o, CudaOptions::default());
    }

    #[test]
    fn every_row_names_a_field_and_flags_and_variables_are_unique() {
        lily_core::options::check_table::<CudaOptions>();
    }

    #[test]
    fn describe_names_every_switch_and_knob() {
        let d = CudaOptions {
            pipelined_decode: false,
            chunk: 512,
            ..CudaOptions::default()
        }
        .describe();
        assert!(
            d.starts_with("bf16 activations on, tensor cores on,"),
            "{d}"
        );
        assert!(
            d.contains("pipelined decode off") && d.contains("prefill chunk 512"),
            "{d}"
        );
        assert_eq!(
            d.split(", ").count(),
            SWITCHES.len() + KNOBS.len() + TEXTS.len()
        );
    }

    #[test]
    fn the_readme_lists_every_switch_and_knob_as_the_table_says() {
        let readme = include_str!("../README.md");
        let rows = readme_rows();
        assert!(
            readme.contains(&rows),
            "crates/lily-cuda/README.md's option table differs from options::readme_rows():\n{rows}"
        );
    }
}
