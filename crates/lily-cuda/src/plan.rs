//! The plan: which kernel runs, decided in one place. `Plan::resolve` takes the options as asked
//! for (options.rs: the flags, with the environment overrides applied by `Plan::new`) and what the
//! device can run (`gpu::DeviceCaps`), and answers, for a step's shape, with the concrete kernel
//! of each launcher: `dense` (`Dense`), `router` (`Router`), `experts` (`Experts`), `attention`
//! (`AttentionKernels`), the one-token paths (`DecodePath`), `sampling`, `logprobs`
//! (`LogprobsPath`), and the compile-time
//! variants of the kernel files (`build`). The kernel enums live beside their launchers
//! (kernels/gemm.rs `DenseGemm`, `GroupedGemm`; kernels/attention.rs `SplitKernel`,
//! `PrefillKernel`); launchers take them as arguments and test no switch, and forward.rs and
//! backend.rs `match` on the plan's answers. Why each switch stays (the A/B its "on" side won, or
//! the fallback its "off" side is) is its `why` in options.rs's table.
//!
//! What runs, shipping configuration, Qwen3.6's full shape (MLX 4-bit, 8-bit router and shared
//! gate) on an H200 (sm_90a), by step length `n` and keys `k` (the unit test
//! `the_full_shape_takes_the_kernels_the_table_names` checks every row):
//!
//! | step | projections | router | routed experts | attention | DeltaNet scan |
//! |---|---|---|---|---|---|
//! | n = 1 (decode) | decode.cu fused: `dec_gemv4` (≤ 2,048 columns), `dec_gemv4w` (4,096), `dec_gemv8` (8-bit router and shared gate); lm_head `dec_gemv4`; the 4-bit ones as `dec_gemv4_x8x2` / `dec_gemv4w_x8x2` (x as int8 pairs and dp4a, `gemv_products`; `gemv_int8`, on; `--no-gemv-int8` or fp32 mode: f32 products; `dec_gemv4w_x8x2` on one block an SM, two tiles a block, under `gemv4w_sm_grid`, on: `gemv_grid`) | in `dec_gemv8`, exact | `dec_glu4_x8x2` + `dec_down_combine_x8x2` (x as int8 pairs and dp4a, `moe_products`; `moe_int8_pairs`, on; the down kernel as `dec_down_combine_x8x2_r96`, at most 96 registers, under `down_96_regs`, on: `down_regs`; the gate/up kernel as `dec_glu4_x8x2_bulk`, its tiles bulk-copied into shared memory (sm_90a), under `moe_bulk`, on: `glu_loads`; `--no-moe-int8-pairs`: `dec_glu4_q8` + `dec_down_combine_q8`, single int8; `--no-moe-int8 --no-moe-int8-pairs` or fp32 mode: `dec_glu4` + `dec_down_combine`) | `attn_split_mma_prep` (k ≤ 4,096 with the int8 KV cache that ships on compute capability 9 and later, `kv_cache int8`, k ≤ 65,536 with a bf16 cache; past it `attn_split_mma_prep_long`) + `attn_split_combine` | `dec_dn_conv` + `dec_dn_step` between in_proj's `dec_gemv4` and out_proj's `dec_gemv4w` |
//! | batched decode (`batched_decode`): B sequences, one token each (2 ≤ B, `Forward::run_batch`) | `dec_gemv_rows` over the B rows, the projections of one input in one launch (`batch_projections`: q/k/v; DeltaNet's four; the router with the shared-expert gate; o_proj, out_proj, lm_head alone; B ≤ 8 a launch, 4,096-wide inputs 5; the 4-bit ones on the tensor cores in `dec_mma_rows_deep`, weights through shared-memory stages (`mma_rows` and `mma_rows_deep`, on; `--mma-stage-rounds`, off: `dec_mma_rows_deep_rounds`, the input rows staged four items a thread a round, the same bits; `--no-mma-rows-deep`: `dec_mma_rows`, weights into registers; `--no-mma-rows`: `dec_gemv_rows` for all)), normed rows from `rms_norm_rows` (`batch_lean_glue`, on; `--no-batch-lean-glue`: `rms_norm`); `--no-fused-batch`: `linear` / `linear_wide` | with the shared-expert gate in one `dec_gemv_rows_split_async`, a warp a weight row, its rows staged (`router_rows_split` and `batch_lean_glue`, on; by cp.async in one round under `router_async_stage`, on: `dec_gemv_rows_split_async`; `--no-router-async-stage`: `dec_gemv_rows_split_lean`, the same bits; `--no-batch-lean-glue`: `dec_gemv_rows_split`; `--no-router-rows-split`: `dec_gemv_rows`), exact (`--no-fused-batch`: `linear` exact) | the MoE grouped by expert (`batch_moe`, `moe_rows`: 2–8 rows of int8-pair products under `moe_grouped_rows`, on): `dec_glu4_x8x2_grouped_ring` + `dec_down_combine_x8x2_grouped_ring` (`grouped_moe_stream` and `grouped_down_wide`, on; `--no-grouped-moe-stream`: `dec_glu4_x8x2_grouped` + `dec_down_combine_x8x2_grouped_wide`; `--no-grouped-down-wide`: the 12-warp `dec_down_combine_x8x2_grouped`), each picked expert's weights read once a step for every row that picked it (`--no-moe-grouped-rows`: one-token decode's MoE with the token in grid.y) — `dec_glu4_x8x2_rows` + `dec_down_combine_x8x2_rows` (routing, experts' and shared expert's gate/up/SiLU, then the down projections and combine; int8 pairs of x, `moe_products`; `--no-moe-int8-pairs`: `dec_glu4_q8_rows` + `dec_down_combine_q8_rows`; neither int8 form or fp32 mode: `dec_glu4_rows` + `dec_down_combine_rows`); `--no-fused-batch`: shared expert over the rows, `moe_route` + `linear_grouped` over the B × top_k picks + `moe_combine` | every sequence in one `attn_split_mma_prep_rows` (`_long_rows` when all are past 65,536 keys) + one `attn_split_combine_rows` (`batch_attention`, B ≤ 8; `--no-fused-batch`: per sequence as n = 1) | `dec_dn_conv_rows` + `dec_dn_step_rows`: every sequence in one launch each (`batch_scan`; `--no-fused-batch`: per sequence `dec_dn_conv` + `dec_dn_step`); `dn_gated_norm` over the B rows |
//! | 2 ≤ n ≤ 4 | `linear` / `linear_wide` | `linear` exact | `linear_grouped` | `attn_qk_prep` + `attn_split` + `attn_split_combine` | `dn_conv` + `dn_prep` + `dn_recurrent` |
//! | 5 ≤ n < 16 | `linear` / `linear_wide` | `linear` exact | `linear_grouped` | `attn_qk_prep` + `attn_decode` | as above |
//! | 16 ≤ n < 512 | `gemm_dense` | `gemm_dense_exact`, columns split where the grid is shallow (+ `gemm_sum_parts`) | `gemm_grouped32` (`gemm_grouped64` once experts average 48 items) | `attn_qk_prep` + `attn_prefill` | as above below 64 tokens; from 64 `dn_conv` + `dn_prep` + `dn_wy_prep` + `dn_wy_scan` |
//! | 512 ≤ n < 1,024 | `to_bf16` + `gemm_dense_wgb` | as above | `to_bf16` + `gemm_grouped_wgb32` up to 768 tokens (`wgmma_narrow_tiles`, on; off: `gemm_grouped_wgb64`), then `gemm_grouped_wgb64` | `attn_qk_prep` + `attn_prefill` | `dn_conv` + `dn_prep` + `dn_wy_prep` + `dn_wy_scan` |
//! | 1,024 ≤ n < 2,048 | `to_bf16` + `gemm_dense_wgb` | as above | `gemm_grouped_wgb64` | `attn_qk_prep` + `attn_prefill_wg` | as above |
//! | 2,048 ≤ n (chunks of 4,096 and 8,192) | `to_bf16` + `gemm_dense_wgb256` | as above (4,096: 2 parts) | `gemm_grouped_wgb64`, `gemm_grouped_wgb128` from 3,072 tokens, each expert's last ≤ 32 items then in a second launch of `gemm_grouped_wgb32` (`wgmma_tail_tiles`, on) | `attn_qk_prep` + `attn_prefill_wg` | as above |
//!
//! The grouped launches' grid follows the chunk's items (`tile_grid_by_items`, on: `Plan::tile_rows`);
//! the narrow and tail tiles are chosen by `Plan::experts` (`Experts::Gemm::tail`; the test
//! `narrow_and_tail_tiles_take_the_chunks_their_switches_name`).
//! `wgmma_lean_dequant` (on; `--no-wgmma-lean-dequant`) puts every wgmma GEMM above on its `_lean` variant (the same bits from
//! fewer instructions; weights in groups of ≥ 64: `plan.lean_dequant`; the test
//! `lean_dequant_names_the_wgmma_kernels_lean_variants`). `wgmma_hoisted_addrs` (on;
//! `--no-wgmma-hoisted-addrs`) puts the grouped `_lean` kernels on their `_hoist` variants (the same
//! bits, a k-step's addresses held in registers; the test `hoisted_addrs_names_the_grouped_hoist_variants`).
//! `wgmma_attention_pipelined` (on; `--no-wgmma-attention-pipelined`) puts `attn_prefill_wg` on
//! `attn_prefill_wg_pipe` (the same bits, a tile's softmax run under the previous tile's P·V;
//! the test `pipelined_attention_names_attn_prefill_wg_pipe`).
//!
//! The DeltaNet scan of steps of at least `TC_SCAN_MIN_TOK` (64) tokens is the chunked form on
//! the tensor cores, `dn_prep` + `dn_wy_prep` + `dn_wy_scan` (`tc_scan`, on; it needs bf16 mode
//! and a device granting 150 KB of shared memory a block, e.g. sm_80 or sm_90a, not sm_86 / 89 / 120);
//! shorter steps, fp32 mode, such devices and `--no-tc-scan` take `dn_prep` + `dn_recurrent`
//! (`deltanet_scan`; the test `the_tensor_core_scan_runs_where_its_switch_and_the_device_allow`).
//!
//! A prompt runs in chunks of at most `prefill_chunk` (8,192; `interleaved_chunk`, 4,096, while
//! other sequences decode) tokens, so a 32K or 128K prompt is 8,192-token chunks at growing
//! context; the context changes only the one-token attention
//! (`long_keys`). Head of every step: `embed`, `rms_norm`, `advance_pos`; the MoE's glue:
//! `moe_route`, `moe_group`, `silu_mul`, `moe_combine` (a batched step: `embed_rows` and
//! `advance_pos_rows` for all sequences, `batch_head`; `--no-fused-batch`: one `embed` and one
//! `advance_pos` per sequence; its rows' logits copied into each sequence's); picks: `argmax_part` + `argmax_final`
//! (greedy), `sample_adjust` + `sample_part` + `sample_pick_parts` (sampled), `sample_mask`;
//! top log-probabilities (`logprobs`: 1..=20 of them with a device pick): `logprob_part` +
//! `logprob_final` after the pick.
//! The fp32 mode (`--fp32-activations`) takes the CUDA-core rows' kernels at every length, with
//! `attn_decode` for chunks and `attn_split` for one token.

use anyhow::Result;
use lily_core::config::ModelConfig;
use lily_core::sampling::SamplingParams;

use crate::gpu::{DeviceCaps, Gpu, LaunchChecks};
use crate::kernels::attention::{self, AttnShape, PrefillKernel, SplitKernel};
use crate::kernels::decode::{
    self, Decode, DownRegs, GemvGrid, GemvProducts, GluLoads, GroupedDown, GroupedGlu, MoeProducts,
    RowsKernel,
};
use crate::kernels::deltanet::{self, DnScan, DnShape};
use crate::kernels::gemm::{self, DenseGemm, GroupedGemm};
use crate::kernels::moe::{self, MoeShape};
use crate::kernels::norm;
use crate::kernels::KernelBuild;
pub use crate::options::{CudaOptions, KvCacheKind, DEFAULT_PREFILL_CHUNK, WGMMA_MIN_TOK};
use crate::sampler;
use crate::weights::{DevAttention, DevDeltaNet, DevMoe, LinearShape};

/// Fewest tokens of a step that take the tensor-core kernels (gemm.cu, `attn_prefill`): one
/// warp's 16 mma rows; shorter steps (decode) keep the CUDA-core kernels.
pub const TENSOR_CORE_MIN_TOK: usize = 16;

/// Fewest tokens of a step whose DeltaNet scan takes the tensor-core chunked form under `tc_scan`:
/// one whole chunk (deltanet::DN_WY_C). Shorter steps walk at most 63 tokens in order; the A/B
/// measured 512 tokens and up (+10 % prefill at 512, perf-notes session 13), not where between 64
/// and 512 the two forms cross.
pub const TC_SCAN_MIN_TOK: usize = deltanet::DN_WY_C;

/// Which kernel computes y (+)= W x for a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dense {
    /// linear.cu `linear` / `linear_wide` (by width): CUDA cores, fp32 from the packed weights.
    Linear,
    /// gemm.cu: tensor cores, the kernel named.
    Gemm(DenseGemm),
}

/// Which kernel computes the MoE router's logits (always unrounded fp32 precision).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Router {
    /// linear.cu `linear` / `linear_wide` storing exact sums.
    LinearExact,
    /// gemm.cu `gemm_dense_exact` (weights split into bf16 hi + lo, two mma), its columns split
    /// into `parts` (1: none; more: the parts added by `gemm_sum_parts`).
    GemmExact { parts: usize },
}

/// How the routed experts of a step run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Experts {
    /// `linear_gather`: one expert per item.
    Gather,
    /// `moe_group` into tiles of linear::GROUP_TILE items, then `linear_grouped`.
    LinearGrouped,
    /// `moe_group` into tiles of `tile` items, then each projection's tensor-core kernel (the
    /// wgmma ones read their input staged as bf16); with `tail` (`wgmma_tail_tiles`) each
    /// expert's last ≤ tail.tile() items go to a second list that this kernel runs in a second
    /// launch after each projection's.
    Gemm {
        tile: usize,
        gate: GroupedGemm,
        up: GroupedGemm,
        down: GroupedGemm,
        tail: Option<GroupedGemm>,
    },
}

/// Which attention kernels run between the q/k/v projections and o_proj (all write the same
/// output from the same inputs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionKernels {
    /// `attn_qk_prep`, then `attn_decode`: one block per (token, query head).
    OneBlockPerHead,
    /// `attn_qk_prep`, then flash attention on the tensor cores (`attn_prefill`,
    /// `attn_prefill_wg` or `attn_prefill_wg_pipe`).
    Prefill(PrefillKernel),
    /// Split-KV (flash-decoding): `attn_qk_prep` then the split kernel, or, `prep_fused`, the
    /// split kernel's prep form alone (`attn_split_mma_prep`, `_long`); then
    /// `attn_split_combine`.
    Split {
        kernel: SplitKernel,
        prep_fused: bool,
    },
}

/// How a block of a one-token step (decode) runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodePath {
    /// decode.cu: the block's norm folded into its projections, the projections of one input in
    /// one launch, the glue fused (see kernels/decode.rs; the GEMV kernel follows the weights'
    /// width and bits).
    Fused,
    /// The same launches as a prefill chunk's, for one token.
    PerKernel,
}

/// How a batched decode step runs the projections of one input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchProjections {
    /// decode.cu's batched projection in one launch, in the kernel named
    /// (`Decode::project_rows`).
    Rows(RowsKernel),
    /// Each weight's kernel for a B-token step, one launch a weight.
    PerKernel,
}

/// Which kernel a batched decode step's RMS norm of its rows takes (`Plan::batch_norm`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchNorm {
    /// `rms_norm`: a loop trip a load, x read twice.
    Plain,
    /// `rms_norm_rows` (`batch_lean_glue`): the same bits, each thread's columns in registers.
    Rows,
}

/// How a batched decode step runs each sequence's DeltaNet conv and recurrence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchScan {
    /// decode.cu's `dec_dn_conv_rows` + `dec_dn_step_rows`: every sequence in one launch each
    /// (the sequence in a grid dimension, its states through a pointer table).
    Rows,
    /// Per sequence, decode.cu's `dec_dn_conv` + `dec_dn_step`.
    OneToken,
    /// Per sequence, a one-token chunk's `dn_conv` + `dn_prep` + `dn_recurrent`.
    Chunk,
}

/// How a batched decode step runs the attention of its sequences (one token each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchAttention {
    /// Every sequence in one `attn_split_mma_prep_rows` (this kernel's body: `Mma` or
    /// `MmaLong`) and one `attn_split_combine_rows`, the sequence in a grid dimension.
    Rows(SplitKernel),
    /// Each sequence as its one-token step (`attention` of one token).
    PerSequence,
}

/// How a batched decode step embeds its tokens and advances its positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchHead {
    /// `embed_rows` and `advance_pos_rows`: every sequence in one launch each (its token and
    /// position through the pointer table).
    Rows,
    /// `embed` and `advance_pos` per sequence.
    PerSequence,
}

/// How a batched decode step runs its MoE blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BatchMoe {
    /// The router and the shared-expert gate in one `dec_gemv_rows`, then each token's routing,
    /// experts' gate/up/SiLU and shared expert in one `dec_glu4_rows`, and every down
    /// projection, the combine and the residual add in one `dec_down_combine_rows`: one-token
    /// decode's MoE with the token in a grid dimension.
    Rows,
    /// The shared expert's projections over the rows (`batch_projections`), `moe_route`, the
    /// routed experts grouped over the rows' picks (`experts`), `moe_combine`.
    Grouped,
}

/// How `BatchMoe::Rows` runs its gate/up and down kernels for a step of B rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoeRows {
    /// One-token decode's kernels with the token in grid.y (`dec_glu4_x8x2_rows` +
    /// `dec_down_combine_x8x2_rows`, or their single-int8 / f32 forms as `moe_products` says):
    /// each row streams its own experts and the shared expert.
    PerRow,
    /// `dec_glu4_x8x2_grouped` + `dec_down_combine_x8x2_grouped` (`moe_grouped_rows`): each
    /// picked expert's weights (and the shared expert's) read once a step and dotted with every
    /// row that picked it, each row's outputs bit for bit the one-token pair kernels'; the down
    /// kernel's block of 12 warps, or of 16 (`dec_down_combine_x8x2_grouped_wide`) under
    /// `grouped_down_wide`; the rings of `dec_glu4_x8x2_grouped_ring` and, with 16 warps,
    /// `dec_down_combine_x8x2_grouped_ring` under `grouped_moe_stream`.
    ByExpert(GroupedGlu, GroupedDown),
}

/// Where the next token is picked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SamplingPath {
    /// `argmax_part` + `argmax_final` (greedy settings).
    DeviceGreedy,
    /// `sample_adjust` + the pick with the host-drawn uniform (`sample_part` +
    /// `sample_pick_parts` with many-block sampling, else `sample_pick`).
    Device,
    /// The host sampler on downloaded logits.
    Host,
}

/// Where a decode step's top log-probabilities are computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogprobsPath {
    /// None asked for.
    None,
    /// `logprob_part` + `logprob_final` after the pick; the host reads 2k words.
    Device,
    /// lily_core::logprob on the downloaded logits.
    Host,
}

/// Every kernel decision, resolved (see the module comment).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub ordinal: usize,
    pub bf16_activations: bool,
    /// Largest prefill chunk: prefill runs in chunks of at most this many tokens.
    pub prefill_chunk: usize,
    /// Largest piece of a prompt fed while other sequences decode (≤ `prefill_chunk`).
    pub interleaved_chunk: usize,
    /// `CudaOptions::step_timing`.
    pub step_timing: bool,
    /// The options as resolved against each other and the device: a switch that needs bf16
    /// activations, another switch or a device capability is off where that is missing.
    o: CudaOptions,
    device: DeviceCaps,
}

impl Plan {
    /// `opts` with the environment overrides, resolved for `device`.
    pub fn new(opts: &CudaOptions, device: DeviceCaps) -> Plan {
        Plan::resolve(&opts.clone().with_env_overrides(), device)
    }

    /// The GPU `o.ordinal` opened with `o`'s debug checks, and `o` exactly as given (no
    /// environment) resolved for it.
    pub fn open(o: &CudaOptions) -> Result<(Gpu, Plan)> {
        let checks = LaunchChecks {
            sync_each: o.sync_each,
            profile: o.profile,
        };
        let gpu = Gpu::open(o.ordinal, checks)?;
        let plan = Plan::resolve(o, gpu.caps());
        Ok((gpu, plan))
    }

    /// `o` exactly as given (no environment), resolved for `device`: tensor cores, flash
    /// prefill, tensor-core decode attention and the tensor-core DeltaNet scan need bf16
    /// activations (the scan also the device's shared memory); the wgmma kernels need
    /// what they build on and an sm_90a device; programmatic dependent launch a device that has
    /// it; graphs no debug check.
    pub fn resolve(o: &CudaOptions, device: DeviceCaps) -> Plan {
        let bf16 = o.bf16_activations;
        let tensor_cores = o.tensor_cores && bf16;
        let flash_prefill = o.flash_prefill && bf16;
        let mma_attention = o.mma_attention && bf16;
        // The int8 cache needs bf16 activations, and compute capability 9 or later (sm_90,
        // sm_120: measured on sm_90; its row kernels spill registers on sm_86 / sm_89, which
        // kernels_compile forbids), as `dependent_launch` marks it.
        let kv_int8 = o.kv_cache == KvCacheKind::Int8 && bf16 && device.dependent_launch;
        let effective = CudaOptions {
            mma_rows: o.mma_rows && bf16,
            mma_rows_deep: o.mma_rows_deep && o.mma_rows && bf16,
            mma_stage_rounds: o.mma_stage_rounds && o.mma_rows_deep && o.mma_rows && bf16,
            moe_int8: o.moe_int8 && bf16,
            gemv_int8: o.gemv_int8 && bf16,
            moe_int8_pairs: o.moe_int8_pairs && bf16,
            tensor_cores,
            exact_router_on_tensor_cores: o.exact_router_on_tensor_cores && tensor_cores,
            flash_prefill,
            mma_attention,
            fused_attn_prep: o.fused_attn_prep && mma_attention,
            wgmma_gemm: o.wgmma_gemm && tensor_cores && device.wgmma,
            wgmma_attention: o.wgmma_attention && flash_prefill && device.wgmma,
            wgmma_attention_pipelined: o.wgmma_attention_pipelined
                && o.wgmma_attention
                && flash_prefill
                && device.wgmma,
            tc_scan: o.tc_scan && bf16 && device.max_shared_memory >= deltanet::DN_WY_SMEM,
            moe_bulk: o.moe_bulk && device.wgmma,
            dependent_launch: o.dependent_launch && device.dependent_launch,
            graphs: o.graphs && !o.sync_each && !o.profile,
            kv_cache: if kv_int8 {
                KvCacheKind::Int8
            } else {
                KvCacheKind::Bf16
            },
            // An int8 cache runs the long bodies from SPLIT_LONG_KEYS_INT8 keys (or fewer).
            split_long_keys: if kv_int8 {
                o.split_long_keys.min(attention::SPLIT_LONG_KEYS_INT8)
            } else {
                o.split_long_keys
            },
            ..o.clone()
        };
        Plan {
            ordinal: o.ordinal,
            bf16_activations: bf16,
            prefill_chunk: o.chunk,
            interleaved_chunk: o.interleaved_chunk.min(o.chunk),
            step_timing: o.step_timing,
            o: effective,
            device,
        }
    }

    /// The kernel files' compile-time variants.
    pub fn build(&self) -> KernelBuild {
        KernelBuild {
            bf16_activations: self.bf16_activations,
            early_trigger: self.o.early_trigger,
            warp_scan_sampling: self.o.warp_scan_sampling,
            kv_int8: self.kv_int8(),
        }
    }

    /// Whether the KV caches hold int8 rows (`kv_cache int8`, with bf16 activations): the
    /// tensor-core split kernels (one token, `SplitKernel::Mma` / `MmaLong`) read them in place,
    /// every other attention kernel reads them dequantised into `Scratch::kv_deq`.
    pub fn kv_int8(&self) -> bool {
        self.o.kv_cache == KvCacheKind::Int8
    }

    /// Bytes one position takes in one layer's K (or V) cache (attention::kv_pos_bytes).
    pub fn kv_pos_bytes(&self, cfg: &ModelConfig) -> usize {
        attention::kv_pos_bytes(
            cfg.n_kv_heads,
            cfg.head_dim,
            self.kv_bytes(),
            self.kv_int8(),
        )
    }

    /// Bytes of one KV-cache element.
    fn kv_bytes(&self) -> usize {
        if self.bf16_activations {
            2
        } else {
            4
        }
    }

    fn on_tensor_cores(&self, w: &LinearShape) -> bool {
        self.o.tensor_cores && gemm::fits(w)
    }

    fn on_wgmma(&self, w: &LinearShape) -> bool {
        self.o.wgmma_gemm && gemm::wg_fits(w)
    }

    /// Whether an n-token chunk stages its projections' inputs as bf16 (`to_bf16`) for the
    /// wgmma kernels: `wgmma_gemm` and at least `wgmma_min_tok` tokens.
    pub fn stages(&self, n_tok: usize) -> bool {
        self.o.wgmma_gemm && n_tok >= gemm::WG_TOK.max(self.o.wgmma_min_tok)
    }

    /// y (+)= W x for an n-token step whose input is staged as bf16 when `staged`: the wgmma
    /// kernels for weights they take (256 tokens a block from gemm::WGB256_MIN_TOK tokens when
    /// `wgb_tok` is 256), else gemm_dense, for chunks of at least TENSOR_CORE_MIN_TOK tokens
    /// whose weight the tensor-core kernels take; else the CUDA cores.
    pub fn dense(&self, w: &LinearShape, n_tok: usize, staged: bool) -> Dense {
        if n_tok < TENSOR_CORE_MIN_TOK || !self.on_tensor_cores(w) {
            return Dense::Linear;
        }
        if !(staged && self.on_wgmma(w) && self.stages(n_tok)) {
            return Dense::Gemm(DenseGemm::Mma);
        }
        let k = if self.o.wgb_tok == 256 && n_tok >= gemm::WGB256_MIN_TOK {
            DenseGemm::Wgb256
        } else {
            DenseGemm::Wgb
        };
        Dense::Gemm(if self.lean_dequant(&[w]) { k.lean() } else { k })
    }

    /// Whether the wgmma kernels for weights `w` take their _lean variants (`wgmma_lean_dequant`:
    /// the same bf16 fragments from fewer instructions; weights in groups of ≥ 64 columns).
    pub fn lean_dequant(&self, w: &[&LinearShape]) -> bool {
        self.o.wgmma_lean_dequant && w.iter().all(|w| gemm::lean_fits(w))
    }

    /// The MoE router: split precision on the tensor cores where `dense` would take them (and
    /// `exact_router_on_tensor_cores`), its columns split where its grid is shallow
    /// (`router_split_k`, gemm::exact_parts); else exact sums on the CUDA cores.
    pub fn router(&self, w: &LinearShape, n_tok: usize) -> Router {
        if n_tok < TENSOR_CORE_MIN_TOK
            || !self.on_tensor_cores(w)
            || !self.o.exact_router_on_tensor_cores
        {
            return Router::LinearExact;
        }
        let parts = if self.o.router_split_k {
            gemm::exact_parts(
                gemm::exact_blocks(w.rows, n_tok),
                self.device.sm_count,
                w.cols / gemm::GEMM_BK,
                n_tok * w.rows,
            )
        } else {
            1
        };
        Router::GemmExact { parts }
    }

    /// The routed experts (`w`: gate, up, down): grouped on the tensor cores for chunks of at
    /// least TENSOR_CORE_MIN_TOK tokens (tiles of 64 items once experts average 48, else 32;
    /// on a staged chunk whose three weights the wgmma kernels take, `wgmma_group_tile` (128)
    /// once experts average three quarters of it, its remainders of ≤ 32 items in
    /// gemm_grouped_wgb32 under `wgmma_tail_tiles`; else, under `wgmma_small_tiles`,
    /// gemm_grouped_wgb32's tiles of 32 where they average at most gemm::NARROW_MAX_AVG under
    /// `wgmma_narrow_tiles` and tiles of at least 64 otherwise), grouped on the CUDA cores for
    /// other multi-token steps, gathered for one token.
    pub fn experts(&self, w: [&LinearShape; 3], shape: MoeShape, n_tok: usize) -> Experts {
        let grouped = self.o.moe_grouped;
        if !(grouped && n_tok >= TENSOR_CORE_MIN_TOK && w.iter().all(|w| self.on_tensor_cores(w))) {
            return if grouped && n_tok > 1 {
                Experts::LinearGrouped
            } else {
                Experts::Gather
            };
        }
        let items = n_tok * shape.top_k;
        let mut tile = if items >= 48 * shape.n_experts {
            64
        } else {
            32
        };
        let staged = self.stages(n_tok);
        let mut narrow = false;
        if staged && w.iter().all(|w| self.on_wgmma(w)) {
            let big = self.o.wgmma_group_tile;
            if big > tile && 4 * items >= 3 * big * shape.n_experts {
                tile = big;
            } else if self.o.wgmma_small_tiles {
                if self.o.wgmma_narrow_tiles && items <= gemm::NARROW_MAX_AVG * shape.n_experts {
                    (tile, narrow) = (32, true);
                } else {
                    tile = tile.max(64);
                }
            }
        }
        let kernel = |w: &LinearShape| match tile {
            128 => GroupedGemm::Wgb128,
            64 if staged && self.on_wgmma(w) => GroupedGemm::Wgb64,
            64 => GroupedGemm::Mma64,
            32 if narrow => GroupedGemm::Wgb32,
            _ => GroupedGemm::Mma32,
        };
        let lean = |k: GroupedGemm, w: &[&LinearShape]| {
            if !self.lean_dequant(w) {
                k
            } else if self.o.wgmma_hoisted_addrs {
                k.lean().hoist()
            } else {
                k.lean()
            }
        };
        Experts::Gemm {
            tile,
            gate: lean(kernel(w[0]), &[w[0]]),
            up: lean(kernel(w[1]), &[w[1]]),
            down: lean(kernel(w[2]), &[w[2]]),
            tail: (tile == 128 && self.o.wgmma_tail_tiles).then_some(lean(GroupedGemm::Wgb32, &w)),
        }
    }

    /// Rows of tile blocks a grouped launch over `n_items` items in tiles of `tile` has (grid.y;
    /// blocks past the tiles moe_group made exit): under `tile_grid_by_items` the most it can
    /// make for these items (moe::group_tiles_bound), else `max_tiles`, the scratch's bound for
    /// a whole chunk in tiles of linear::GROUP_TILE.
    pub fn tile_rows(
        &self,
        n_items: usize,
        n_experts: usize,
        tile: usize,
        max_tiles: usize,
    ) -> usize {
        if self.o.tile_grid_by_items {
            moe::group_tiles_bound(n_items, n_experts, tile).min(max_tiles)
        } else {
            max_tiles
        }
    }

    /// The attention of an n-token step over `keys` keys (the sequence's length after it, as
    /// the host knows it): split-KV for steps of at most attention::SPLIT_MAX_TOK tokens (on the
    /// tensor cores for one token, `mma_attention`, with the prep inside under
    /// `fused_attn_prep`, the long-context body past `split_long_keys` keys), flash prefill for
    /// chunks of at least TENSOR_CORE_MIN_TOK tokens (wgmma for chunks of at least
    /// attention::WGA_MIN_TOK, `wgmma_attention`; its pipelined kernel under
    /// `wgmma_attention_pipelined`), else one block per (token, query head).
    pub fn attention(&self, shape: AttnShape, n_tok: usize, keys: usize) -> AttentionKernels {
        let kv_bytes = self.kv_bytes();
        if self.o.split_kv && attention::split_kv_fits(shape, n_tok) {
            let mma = self.o.mma_attention && attention::split_mma_fits(shape, n_tok, kv_bytes);
            let kernel = match (mma, self.long_keys(shape, keys)) {
                (false, _) => SplitKernel::Cuda,
                (true, false) => SplitKernel::Mma,
                (true, true) => SplitKernel::MmaLong,
            };
            let prep_fused = mma && self.o.fused_attn_prep && attention::prep_fits(shape);
            AttentionKernels::Split { kernel, prep_fused }
        } else if self.o.flash_prefill
            && n_tok >= TENSOR_CORE_MIN_TOK
            && attention::prefill_fits(shape)
        {
            let wg = self.o.wgmma_attention
                && kv_bytes == 2
                && attention::prefill_wg_fits(shape)
                && n_tok >= attention::WGA_MIN_TOK;
            AttentionKernels::Prefill(match (wg, self.o.wgmma_attention_pipelined) {
                (false, _) => PrefillKernel::Mma,
                (true, false) => PrefillKernel::Wgmma,
                (true, true) => PrefillKernel::WgmmaPipelined,
            })
        } else {
            AttentionKernels::OneBlockPerHead
        }
    }

    /// The DeltaNet recurrence of an n-token step: the chunked form on the tensor cores
    /// (`DnScan::Chunked`: dn_wy_prep + dn_wy_scan) under `tc_scan` for steps of at least
    /// TC_SCAN_MIN_TOK tokens whose heads it takes, else token by token (dn_recurrent).
    pub fn deltanet_scan(&self, shape: DnShape, n_tok: usize) -> DnScan {
        if self.o.tc_scan && n_tok >= TC_SCAN_MIN_TOK && deltanet::wy_fits(shape) {
            DnScan::Chunked
        } else {
            DnScan::Recurrent
        }
    }

    /// Whether one-token tensor-core attention over `keys` keys takes the _long split kernels:
    /// head dim 256 and more than `split_long_keys` keys. A decode graph holds one choice, so
    /// the backend keeps a graph for each side (`SeqState::decode_graphs`).
    pub fn long_keys(&self, shape: AttnShape, keys: usize) -> bool {
        self.o.mma_attention && shape.d == 256 && keys > self.o.split_long_keys
    }

    /// One-token steps of an attention layer: fused when its weights are what decode.cu reads.
    pub fn decode_attention(&self, a: &DevAttention, n_tok: usize) -> DecodePath {
        let fits = [&a.q_proj, &a.k_proj, &a.v_proj]
            .iter()
            .all(|w| decode::serves(&w.shape()) && w.cols == a.q_proj.cols)
            && decode::serves(&a.o_proj.shape());
        self.fused_if(n_tok, fits)
    }

    /// One-token steps of a DeltaNet layer: fused when its weights and head shapes fit.
    pub fn decode_deltanet(&self, d: &DevDeltaNet, cfg: &ModelConfig, n_tok: usize) -> DecodePath {
        let fits = [&d.in_qkv, &d.in_z, &d.in_b, &d.in_a]
            .iter()
            .all(|w| decode::serves(&w.shape()) && w.cols == d.in_qkv.cols)
            && decode::serves(&d.out_proj.shape())
            && Decode::dn_serves(
                cfg.dn_k_heads,
                cfg.dn_v_heads,
                cfg.dn_k_dim,
                cfg.dn_v_dim,
                cfg.conv_kernel,
            );
        self.fused_if(n_tok, fits)
    }

    /// The DeltaNet conv and recurrence of the sequences of a batched decode step (one token
    /// each, `Forward::run_batch`): where the one-token step fuses them (`fused_decode` and the
    /// head shapes fit) decode.cu's kernels, all sequences in one launch each under
    /// `fused_batch` (`Rows`), else one sequence at a time (`OneToken`); otherwise a one-token
    /// chunk's `dn_conv` + `dn_prep` + `dn_recurrent` per sequence (`Chunk`).
    pub fn batch_scan(&self, cfg: &ModelConfig) -> BatchScan {
        let fits = Decode::dn_serves(
            cfg.dn_k_heads,
            cfg.dn_v_heads,
            cfg.dn_k_dim,
            cfg.dn_v_dim,
            cfg.conv_kernel,
        );
        match self.fused_if(1, fits) {
            DecodePath::Fused if self.o.fused_batch => BatchScan::Rows,
            DecodePath::Fused => BatchScan::OneToken,
            DecodePath::PerKernel => BatchScan::Chunk,
        }
    }

    /// The projections of one input in a batched decode step (`Forward::run_batch`, one token
    /// of each of B sequences): decode.cu's `dec_gemv_rows` in one launch (each weight read once
    /// and dotted with the B rows) where the one-token step fuses (`fused_decode`), under
    /// `fused_batch`, when every weight is one decode.cu reads, all of one input width and at
    /// most decode::MAX_SEGS of them — on the tensor cores (`dec_mma_rows`) under `mma_rows`
    /// (bf16 mode) where `decode::mma_rows_serves` them (all 4-bit; `dec_mma_rows_deep`, its
    /// weights through shared-memory stages, under `mma_rows_deep` too; its inputs staged in
    /// rounds, `dec_mma_rows_deep_rounds`, under `mma_stage_rounds` too), else one weight row a warp
    /// (`dec_gemv_rows_split`) under `router_rows_split` where the launch has few weight rows
    /// (`decode::split_rows_serves`: the router with the shared-expert gate; its lean staging
    /// under `batch_lean_glue`, and with it its staging by cp.async under `router_async_stage`:
    /// the same bits each); else `dense`'s
    /// kernel for a B-token step (`router` for the router), one launch a weight.
    pub fn batch_projections(&self, ws: &[LinearShape]) -> BatchProjections {
        let fits = !ws.is_empty()
            && ws.len() <= decode::MAX_SEGS
            && ws
                .iter()
                .all(|w| decode::serves(w) && w.experts == 1 && w.cols == ws[0].cols);
        if !self.o.fused_batch {
            return BatchProjections::PerKernel;
        }
        match self.fused_if(1, fits) {
            DecodePath::Fused if self.o.mma_rows && decode::mma_rows_serves(ws) => {
                BatchProjections::Rows(if self.o.mma_stage_rounds {
                    RowsKernel::MmaDeepRounds
                } else if self.o.mma_rows_deep {
                    RowsKernel::MmaDeep
                } else {
                    RowsKernel::Mma
                })
            }
            DecodePath::Fused if self.o.router_rows_split && decode::split_rows_serves(ws) => {
                BatchProjections::Rows(if !self.o.batch_lean_glue {
                    RowsKernel::GemvSplit
                } else if self.o.router_async_stage {
                    RowsKernel::GemvSplitAsync
                } else {
                    RowsKernel::GemvSplitLean
                })
            }
            DecodePath::Fused => BatchProjections::Rows(RowsKernel::Gemv),
            DecodePath::PerKernel => BatchProjections::PerKernel,
        }
    }

    /// The kernel of a batched decode step's RMS norm of rows of `cols` columns: under
    /// `batch_lean_glue` `rms_norm_rows` (rms_norm's bits, each thread's columns loaded at once)
    /// where `norm::rms_rows_serves` the width, else `rms_norm`.
    pub fn batch_norm(&self, cols: usize) -> BatchNorm {
        if self.o.batch_lean_glue && norm::rms_rows_serves(cols) {
            BatchNorm::Rows
        } else {
            BatchNorm::Plain
        }
    }

    /// The attention of a batched decode step whose sequences hold `keys` keys each after it:
    /// `BatchAttention::Rows` under `fused_batch` where every sequence's one-token attention is
    /// the tensor-core split kernel with the prep inside and there are at most
    /// attention::SPLIT_ROWS of them (the _long body when every sequence takes it, else the
    /// general one, which serves any length); else each sequence as one token.
    pub fn batch_attention(&self, shape: AttnShape, keys: &[usize]) -> BatchAttention {
        if !self.o.fused_batch || keys.is_empty() || keys.len() > attention::SPLIT_ROWS {
            return BatchAttention::PerSequence;
        }
        let mut all_long = true;
        for &k in keys {
            match self.attention(shape, 1, k) {
                AttentionKernels::Split {
                    kernel: kernel @ (SplitKernel::Mma | SplitKernel::MmaLong),
                    prep_fused: true,
                } => all_long &= kernel == SplitKernel::MmaLong,
                _ => return BatchAttention::PerSequence,
            }
        }
        BatchAttention::Rows(if all_long {
            SplitKernel::MmaLong
        } else {
            SplitKernel::Mma
        })
    }

    /// The embedding and position update of a batched decode step: one launch each for all
    /// sequences under `fused_batch`, else one a sequence.
    pub fn batch_head(&self) -> BatchHead {
        if self.o.fused_batch {
            BatchHead::Rows
        } else {
            BatchHead::PerSequence
        }
    }

    /// The MoE of a batched decode step: `BatchMoe::Rows` under `fused_batch` where one-token
    /// steps fuse the block (`decode_moe`) on the pipelined `dec_glu4`; else `Grouped`.
    pub fn batch_moe(&self, m: &DevMoe, shape: MoeShape) -> BatchMoe {
        self.batch_moe_for(self.decode_moe(m, shape, 1), &glu_shapes(m))
    }

    /// `batch_moe` for a block whose one-token path is `one_token`, with these gate, up, shared
    /// gate and shared up weights.
    fn batch_moe_for(&self, one_token: DecodePath, glu: &[LinearShape; 4]) -> BatchMoe {
        let [gate, up, sgate, sup] = glu;
        if self.o.fused_batch
            && one_token == DecodePath::Fused
            && decode::glu_rows_serves(gate, up, sgate, sup)
        {
            BatchMoe::Rows
        } else {
            BatchMoe::Grouped
        }
    }

    /// How a batched step of `rows` rows runs its MoE where `batch_moe` says `Rows`: grouped by
    /// expert (`MoeRows::ByExpert`) under `moe_grouped_rows` where the products are int8 pairs
    /// (`moe_products`) and `decode::grouped_serves` the block for that many rows (2 to 8 rows of
    /// at most 64 picks, at most 256 experts, the down kernel's pairs in 92 KB), its down kernel
    /// 16 warps a block under `grouped_down_wide`, both kernels' rings deeper under
    /// `grouped_moe_stream` (the down kernel's with `grouped_down_wide` only); else per row (a
    /// batch of one always).
    pub fn moe_rows(&self, m: &DevMoe, n_experts: usize, top_k: usize, rows: usize) -> MoeRows {
        let (down, sdown) = (m.down.shape(), m.shared_down.shape());
        self.moe_rows_for(&glu_shapes(m), &down, &sdown, n_experts, top_k, rows)
    }

    fn moe_rows_for(
        &self,
        glu: &[LinearShape; 4],
        down: &LinearShape,
        sdown: &LinearShape,
        n_experts: usize,
        top_k: usize,
        rows: usize,
    ) -> MoeRows {
        let [gate, up, sgate, sup] = glu;
        if self.o.moe_grouped_rows
            && self.moe_products_for(glu, down, sdown, top_k) == MoeProducts::Int8Pairs
            && decode::grouped_serves([gate, up, sgate, sup], down, sdown, n_experts, top_k, rows)
        {
            let stream = self.o.grouped_moe_stream;
            let down = match (self.o.grouped_down_wide, stream) {
                (true, true) => GroupedDown::Warps16Ring,
                (true, false) => GroupedDown::Warps16,
                (false, _) => GroupedDown::Warps12,
            };
            let glu = if stream {
                GroupedGlu::Ring
            } else {
                GroupedGlu::Pairs
            };
            MoeRows::ByExpert(glu, down)
        } else {
            MoeRows::PerRow
        }
    }

    /// How the fused MoE's kernels (`dec_glu4` + `dec_down_combine`, or their rows forms) take
    /// their 4-bit products: in int8 pairs (`dec_glu4_x8x2`, `dec_down_combine_x8x2` and their
    /// `_rows` forms) under `moe_int8_pairs`, else in int8 (`dec_glu4_q8`, `dec_down_combine_q8`
    /// and their `_rows` forms) under `moe_int8` (bf16 mode both) where `decode::q8_serves` the
    /// block (all 4-bit, one 64-column group a lane, the rows' shared memory), else in f32.
    pub fn moe_products(&self, m: &DevMoe, top_k: usize) -> MoeProducts {
        let (down, sdown) = (m.down.shape(), m.shared_down.shape());
        self.moe_products_for(&glu_shapes(m), &down, &sdown, top_k)
    }

    fn moe_products_for(
        &self,
        glu: &[LinearShape; 4],
        down: &LinearShape,
        sdown: &LinearShape,
        top_k: usize,
    ) -> MoeProducts {
        let [gate, up, sgate, sup] = glu;
        let serves = |p| decode::q8_serves([gate, up, sgate, sup], down, sdown, top_k, p);
        if self.o.moe_int8_pairs && serves(MoeProducts::Int8Pairs) {
            MoeProducts::Int8Pairs
        } else if self.o.moe_int8 && serves(MoeProducts::Int8) {
            MoeProducts::Int8
        } else {
            MoeProducts::Float
        }
    }

    /// How a one-token projection launch (`Decode::project`) of these weights takes its
    /// products: in int8 pairs (`dec_gemv4_x8x2`, `dec_gemv4w_x8x2`) under `gemv_int8` (bf16
    /// mode) where `decode::x8x2_serves` them (all 4-bit, a pipelined kernel's width: DeltaNet's
    /// in_proj and out_proj, attention's q/k/v and o_proj, lm_head), else in f32 (also the 8-bit
    /// router and shared-expert gate, which stay on `dec_gemv8`).
    pub fn gemv_products(&self, ws: &[LinearShape]) -> GemvProducts {
        if self.o.gemv_int8 && decode::x8x2_serves(ws) {
            GemvProducts::Int8Pairs
        } else {
            GemvProducts::Float
        }
    }

    /// How many blocks a one-token projection launch of these weights takes: under
    /// `gemv4w_sm_grid`, the 4096-column int8-pair launches (`dec_gemv4w_x8x2`: out_proj,
    /// o_proj) two tiles a block (`GemvGrid::TwoTilesABlock`, where the tiles fit so on one
    /// block an SM); everything else the persistent grid of two blocks an SM.
    pub fn gemv_grid(&self, ws: &[LinearShape]) -> GemvGrid {
        let wide = ws.first().is_some_and(|w| w.cols / 64 == 64);
        if self.o.gemv4w_sm_grid && wide && self.gemv_products(ws) == GemvProducts::Int8Pairs {
            GemvGrid::TwoTilesABlock
        } else {
            GemvGrid::Persistent
        }
    }

    /// Which block a one-token MoE down launch on `products` runs: under `down_96_regs` the
    /// int8-pair kernel held to 96 registers (`dec_down_combine_x8x2_r96`), else as compiled.
    pub fn down_regs(&self, products: MoeProducts) -> DownRegs {
        if self.o.down_96_regs && products == MoeProducts::Int8Pairs {
            DownRegs::Next96
        } else {
            DownRegs::Unbounded
        }
    }

    /// Where a one-token MoE gate/up launch on `products` holds its weight tiles: under
    /// `moe_bulk` (an sm_90a device) the int8-pair kernel's tiles bulk-copied into shared memory
    /// (`dec_glu4_x8x2_bulk`, where `decode::glu_bulk_serves` the block's weights), else in
    /// registers (`dec_glu4_x8x2` and every other form).
    pub fn glu_loads(&self, m: &DevMoe, products: MoeProducts) -> GluLoads {
        let [gate, up, sgate, sup] = glu_shapes(m);
        if self.o.moe_bulk
            && products == MoeProducts::Int8Pairs
            && decode::glu_bulk_serves(&gate, &up, &sgate, &sup)
        {
            GluLoads::Bulk
        } else {
            GluLoads::Registers
        }
    }

    /// One-token steps of a MoE block: fused when every expert weight fits.
    pub fn decode_moe(&self, m: &DevMoe, shape: MoeShape, n_tok: usize) -> DecodePath {
        let fits = [&m.router, &m.shared_expert_gate]
            .iter()
            .all(|w| decode::serves(&w.shape()) && w.cols == m.router.cols)
            && decode::glu_serves(
                &m.gate.shape(),
                &m.up.shape(),
                &m.shared_gate.shape(),
                &m.shared_up.shape(),
            )
            && decode::down_serves(&m.down.shape(), &m.shared_down.shape(), shape.top_k);
        self.fused_if(n_tok, fits)
    }

    /// A single row through one weight (the lm_head of the last token): decode.cu's GEMV when
    /// the weight fits, else as `dense` says.
    pub fn one_row(&self, w: &LinearShape) -> DecodePath {
        self.fused_if(1, decode::serves(w))
    }

    fn fused_if(&self, n_tok: usize, fits: bool) -> DecodePath {
        if self.o.fused_decode && n_tok == 1 && fits {
            DecodePath::Fused
        } else {
            DecodePath::PerKernel
        }
    }

    /// Greedy settings pick on the device (`argmax_logprob`); other settings the device sampler
    /// covers pick there when device sampling is on; the rest (top_k off or above 256) use the
    /// host sampler on downloaded logits.
    pub fn sampling(&self, p: &SamplingParams) -> SamplingPath {
        if p.is_plain_greedy() {
            SamplingPath::DeviceGreedy
        } else if self.o.device_sampling && sampler::supports(p) {
            SamplingPath::Device
        } else {
            SamplingPath::Host
        }
    }

    /// Whether a sampled pick's first pass runs over many blocks (`sample_part` +
    /// `sample_pick_parts`) instead of one (`sample_pick`).
    pub fn many_block_sampling(&self) -> bool {
        self.o.multi_block_sampling
    }

    /// Whether decode steps replay a captured CUDA graph (never with the debug checks on).
    pub fn decode_graphs(&self) -> bool {
        self.o.graphs
    }

    /// Whether a decode step of several sequences feeds them in one batched forward pass
    /// (backend/batch.rs, `Forward::run_batch`) instead of one sequence after another
    /// (`lily_core::backend::decode_step_one_by_one`): `batched_decode`.
    pub fn batched_decode(&self) -> bool {
        self.o.batched_decode
    }

    /// Decode without graphs from now on (capture failed).
    pub fn give_up_graphs(&mut self) {
        self.o.graphs = false;
    }

    /// Whether a decode call queues each next forward pass before the host reads the token it
    /// feeds (`CudaOptions::pipelined_decode`): only where the host reads nothing but what the
    /// device wrote beside the token, i.e. the pick and any top log-probabilities are on the
    /// device (the host paths read the step's logits, which the next pass overwrites).
    pub fn pipelined_decode(&self, sampling: SamplingPath, logprobs: LogprobsPath) -> bool {
        self.o.pipelined_decode && sampling != SamplingPath::Host && logprobs != LogprobsPath::Host
    }

    /// Whether a batched step queues its rows' forward pass before the host reads their picks
    /// (`CudaOptions::pipelined_batch`): as `pipelined_decode` for each row's pick paths, and
    /// only with the batched switch on.
    pub fn pipelined_batch(&self, sampling: SamplingPath, logprobs: LogprobsPath) -> bool {
        self.o.pipelined_batch && self.pipelined_decode(sampling, logprobs)
    }

    /// Where `top_logprobs` alternatives are computed: on the device with device picks (and
    /// `device_logprobs` on) for 1..=LOGPROB_MAX_K of them within the vocabulary, else on the
    /// host from the downloaded logits (which host sampling downloads anyway).
    pub fn logprobs(
        &self,
        sampling: SamplingPath,
        top_logprobs: usize,
        vocab: usize,
    ) -> LogprobsPath {
        if top_logprobs == 0 {
            LogprobsPath::None
        } else if self.o.device_logprobs
            && sampling != SamplingPath::Host
            && top_logprobs <= crate::kernels::sample::LOGPROB_MAX_K
            && top_logprobs <= vocab
        {
            LogprobsPath::Device
        } else {
            LogprobsPath::Host
        }
    }

    /// Whether kernels that wait for their predecessor are launched as programmatic dependents.
    pub fn dependent_launch(&self) -> bool {
        self.o.dependent_launch
    }

    /// The debug checks every launch gets.
    pub fn launch_checks(&self) -> LaunchChecks {
        LaunchChecks {
            sync_each: self.o.sync_each,
            profile: self.o.profile,
        }
    }

    /// One line for logs: every switch and knob as resolved (`CudaOptions::describe`).
    pub fn describe(&self) -> String {
        self.o.describe()
    }
}

/// A MoE block's gate, up, shared gate and shared up shapes (what its first fused kernel reads).
fn glu_shapes(m: &DevMoe) -> [LinearShape; 4] {
    [
        m.gate.shape(),
        m.up.shape(),
        m.shared_gate.shape(),
        m.shared_up.shape(),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use lily_core::synth::{preset_text_config, Preset};

    /// Qwen3.6's attention shape (16 query heads, 2 KV heads of 256, rotary 64), as the full
    /// preset's config gives it.
    fn qwen_attention() -> AttnShape {
        AttnShape::of(&full_config())
    }

    /// The real model's config (the full synthetic preset).
    fn full_config() -> ModelConfig {
        ModelConfig::from_json(&preset_text_config(Preset::Full)).unwrap()
    }

    const H200: DeviceCaps = DeviceCaps {
        wgmma: true,
        dependent_launch: true,
        sm_count: 132,
        max_shared_memory: 232_448,
    };

    /// An A100's: 108 SMs, 163 KB of shared memory a block, no wgmma, no dependent launch.
    const A100: DeviceCaps = DeviceCaps {
        wgmma: false,
        dependent_launch: false,
        sm_count: 108,
        max_shared_memory: 166_912,
    };

    fn mlx(rows: usize, cols: usize, bits: u32, experts: usize) -> LinearShape {
        LinearShape {
            experts,
            rows,
            cols,
            bits,
            group: 64,
        }
    }

    #[test]
    fn an_int8_kv_cache_needs_bf16_activations_and_sizes_records_of_528_bytes() {
        let cfg = full_config();
        let int8 = |bf16_activations| {
            Plan::resolve(
                &CudaOptions {
                    bf16_activations,
                    kv_cache: KvCacheKind::Int8,
                    ..CudaOptions::default()
                },
                H200,
            )
        };
        let on = int8(true);
        assert!(on.kv_int8() && on.build().kv_int8);
        // 2 heads × 256 int8 values, then 2 f32 scales padded to 16 bytes.
        assert_eq!(on.kv_pos_bytes(&cfg), 528);
        assert!(on.describe().contains("KV cache int8"), "{}", on.describe());
        let fp32 = int8(false);
        assert!(!fp32.kv_int8() && !fp32.build().kv_int8);
        // Before compute capability 9 the cache stays bf16.
        let a100 = Plan::resolve(
            &CudaOptions {
                kv_cache: KvCacheKind::Int8,
                ..CudaOptions::default()
            },
            A100,
        );
        assert!(!a100.kv_int8() && !a100.build().kv_int8);
        assert_eq!(a100.o.split_long_keys, attention::SPLIT_LONG_KEYS);
        assert_eq!(fp32.kv_pos_bytes(&cfg), 2 * 256 * 4);
        // What ships: int8 rows on compute capability 9 and later, bf16 before it.
        assert_eq!(Plan::resolve(&CudaOptions::default(), H200), on);
        let a100_default = Plan::resolve(&CudaOptions::default(), A100);
        assert!(!a100_default.kv_int8());
        assert_eq!(a100_default.kv_pos_bytes(&cfg), 2 * 256 * 2);
        let bf16 = Plan::resolve(
            &CudaOptions {
                kv_cache: KvCacheKind::Bf16,
                ..CudaOptions::default()
            },
            H200,
        );
        assert!(!bf16.kv_int8());
        assert_eq!(bf16.kv_pos_bytes(&cfg), 2 * 256 * 2);
        // The one-token kernels stay the tensor-core split ones (they read int8 in place).
        let s = qwen_attention();
        assert_eq!(on.attention(s, 1, 4096), bf16.attention(s, 1, 4096));
        // The long bodies from SPLIT_LONG_KEYS_INT8 keys with int8 rows (measured, session 31),
        // from SPLIT_LONG_KEYS with bf16 ones; a smaller setting stays.
        let k8 = attention::SPLIT_LONG_KEYS_INT8;
        assert!(on.long_keys(s, k8 + 1) && !on.long_keys(s, k8));
        assert!(!bf16.long_keys(s, k8 + 1) && bf16.long_keys(s, attention::SPLIT_LONG_KEYS + 1));
        let low = Plan::resolve(
            &CudaOptions {
                kv_cache: KvCacheKind::Int8,
                split_long_keys: 1024,
                ..CudaOptions::default()
            },
            H200,
        );
        assert!(low.long_keys(s, 1025));
        assert!(!fp32.long_keys(s, k8 + 1));
    }

    #[test]
    fn tensor_cores_and_flash_prefill_need_bf16_activations() {
        let fp32 = Plan::resolve(
            &CudaOptions {
                bf16_activations: false,
                ..CudaOptions::default()
            },
            H200,
        );
        let shape = qwen_attention();
        let w = mlx(2048, 2048, 4, 1);
        assert_eq!(fp32.dense(&w, 4096, true), Dense::Linear);
        assert_eq!(
            fp32.attention(shape, 512, 512),
            AttentionKernels::OneBlockPerHead
        );
        assert_eq!(
            fp32.attention(shape, 1, 100),
            AttentionKernels::Split {
                kernel: SplitKernel::Cuda,
                prep_fused: false
            }
        );
        let bf16 = Plan::resolve(&CudaOptions::default(), H200);
        assert_eq!(
            bf16.attention(shape, 512, 512),
            AttentionKernels::Prefill(PrefillKernel::Mma)
        );
        assert_eq!(
            bf16.attention(shape, 15, 15),
            AttentionKernels::OneBlockPerHead
        );
        assert_eq!(
            bf16.attention(shape, 4, 4),
            AttentionKernels::Split {
                kernel: SplitKernel::Cuda,
                prep_fused: false
            }
        );
        assert!(fp32.describe().contains("tensor cores off"));
    }

    #[test]
    fn the_wgmma_kernels_need_an_sm_90a_device() {
        let ampere = DeviceCaps {
            wgmma: false,
            dependent_launch: false,
            sm_count: 108,
            max_shared_memory: 166_912,
        };
        let p = Plan::resolve(&CudaOptions::default(), ampere);
        let w = mlx(8192, 2048, 4, 1);
        assert!(!p.stages(4096));
        assert_eq!(p.dense(&w, 4096, false), Dense::Gemm(DenseGemm::Mma));
        assert!(!p.dependent_launch());
        let shape = qwen_attention();
        assert_eq!(
            p.attention(shape, 4096, 4096),
            AttentionKernels::Prefill(PrefillKernel::Mma)
        );
        assert!(p.describe().contains("wgmma prefill GEMM off"));
    }

    #[test]
    fn batch_lean_glue_takes_the_lean_norm_and_router_staging_only_when_on() {
        let w = |rows, cols, bits| mlx(rows, cols, bits, 1);
        let router = [w(256, 2048, 8), w(1, 2048, 8)];
        let qkv = [w(8192, 2048, 4), w(512, 2048, 4), w(512, 2048, 4)];
        // On by default (won its A/B, session 27): rms_norm_rows and dec_gemv_rows_split_lean.
        let on = Plan::resolve(&CudaOptions::default(), H200);
        assert!(on
            .describe()
            .contains("batched step's norms and router staging lean on"));
        assert_eq!(on.batch_norm(2048), BatchNorm::Rows);
        assert_eq!(on.batch_norm(4096), BatchNorm::Rows);
        // Past RMS_ROWS_THREADS · RMS_ROWS_REG columns a thread cannot hold its columns.
        assert_eq!(on.batch_norm(4097), BatchNorm::Plain);
        assert_eq!(
            on.batch_projections(&router),
            BatchProjections::Rows(RowsKernel::GemvSplitAsync)
        );
        // The 4-bit projections keep the tensor cores; without router_rows_split the router keeps
        // dec_gemv_rows.
        assert_eq!(
            on.batch_projections(&qkv),
            BatchProjections::Rows(RowsKernel::MmaDeep)
        );
        let no_split = Plan::resolve(
            &CudaOptions {
                router_rows_split: false,
                ..CudaOptions::default()
            },
            H200,
        );
        assert_eq!(
            no_split.batch_projections(&router),
            BatchProjections::Rows(RowsKernel::Gemv)
        );
        // Off (`--no-batch-lean-glue`): rms_norm and dec_gemv_rows_split.
        let off = Plan::resolve(
            &CudaOptions {
                batch_lean_glue: false,
                ..CudaOptions::default()
            },
            H200,
        );
        assert_eq!(off.batch_norm(2048), BatchNorm::Plain);
        assert_eq!(
            off.batch_projections(&router),
            BatchProjections::Rows(RowsKernel::GemvSplit)
        );
        assert!(off
            .describe()
            .contains("batched step's norms and router staging lean off"));
    }

    #[test]
    fn mma_stage_rounds_takes_the_rounds_kernel_only_when_on_with_the_deep_kernel() {
        let w = |rows, cols, bits| mlx(rows, cols, bits, 1);
        let qkv = [w(8192, 2048, 4), w(512, 2048, 4), w(512, 2048, 4)];
        let router = [w(256, 2048, 8), w(1, 2048, 8)];
        // Off by default (not yet measured): dec_mma_rows_deep.
        let off = Plan::resolve(&CudaOptions::default(), H200);
        assert_eq!(
            off.batch_projections(&qkv),
            BatchProjections::Rows(RowsKernel::MmaDeep)
        );
        assert!(off
            .describe()
            .contains("batched tensor-core projections' inputs staged in rounds off"));
        let opts = CudaOptions {
            mma_stage_rounds: true,
            ..CudaOptions::default()
        };
        let on = Plan::resolve(&opts, H200);
        assert_eq!(
            on.batch_projections(&qkv),
            BatchProjections::Rows(RowsKernel::MmaDeepRounds)
        );
        assert!(on
            .describe()
            .contains("batched tensor-core projections' inputs staged in rounds on"));
        // The 8-bit router keeps its own kernel; without mma_rows_deep, dec_mma_rows.
        assert_eq!(
            on.batch_projections(&router),
            BatchProjections::Rows(RowsKernel::GemvSplitAsync)
        );
        let shallow = CudaOptions {
            mma_rows_deep: false,
            ..opts
        };
        assert_eq!(
            Plan::resolve(&shallow, H200).batch_projections(&qkv),
            BatchProjections::Rows(RowsKernel::Mma)
        );
    }

    #[test]
    fn router_async_stage_takes_the_cp_async_router_only_when_on_with_the_lean_glue() {
        let w = |rows, cols, bits| mlx(rows, cols, bits, 1);
        let router = [w(256, 2048, 8), w(1, 2048, 8)];
        let qkv = [w(8192, 2048, 4), w(512, 2048, 4), w(512, 2048, 4)];
        // On by default (won its A/B, session 33): the cp.async router.
        let opts = CudaOptions::default();
        let on = Plan::resolve(&opts, H200);
        assert_eq!(
            on.batch_projections(&router),
            BatchProjections::Rows(RowsKernel::GemvSplitAsync)
        );
        assert!(on
            .describe()
            .contains("batched router staged by cp.async on"));
        let off = Plan::resolve(
            &CudaOptions {
                router_async_stage: false,
                ..CudaOptions::default()
            },
            H200,
        );
        assert_eq!(
            off.batch_projections(&router),
            BatchProjections::Rows(RowsKernel::GemvSplitLean)
        );
        assert!(off
            .describe()
            .contains("batched router staged by cp.async off"));
        // The 4-bit projections keep the tensor cores.
        assert_eq!(
            on.batch_projections(&qkv),
            BatchProjections::Rows(RowsKernel::MmaDeep)
        );
        // It is a form of the lean staging: without batch_lean_glue the plain split kernel,
        // without router_rows_split dec_gemv_rows.
        let plain = CudaOptions {
            batch_lean_glue: false,
            ..opts.clone()
        };
        assert_eq!(
            Plan::resolve(&plain, H200).batch_projections(&router),
            BatchProjections::Rows(RowsKernel::GemvSplit)
        );
        let no_split = CudaOptions {
            router_rows_split: false,
            ..opts
        };
        assert_eq!(
            Plan::resolve(&no_split, H200).batch_projections(&router),
            BatchProjections::Rows(RowsKernel::Gemv)
        );
    }

    #[test]
    fn the_batched_router_takes_the_split_kernel_under_its_switch() {
        let w = |rows, cols, bits| mlx(rows, cols, bits, 1);
        let rows = BatchProjections::Rows;
        let router = [w(256, 2048, 8), w(1, 2048, 8)];
        let qkv = [w(8192, 2048, 4), w(512, 2048, 4), w(512, 2048, 4)];
        // On by default: the router's 257 rows on dec_gemv_rows_split (its lean staging under
        // `batch_lean_glue`, by cp.async under `router_async_stage`, both on), the 4-bit
        // projections on the tensor cores.
        let defaults = Plan::resolve(&CudaOptions::default(), H200);
        assert_eq!(
            defaults.batch_projections(&router),
            rows(RowsKernel::GemvSplitAsync)
        );
        assert_eq!(defaults.batch_projections(&qkv), rows(RowsKernel::MmaDeep));
        let d = defaults.describe();
        assert!(d.contains("batched router split over lanes on"), "{d}");
        let off = Plan::resolve(
            &CudaOptions {
                router_rows_split: false,
                ..CudaOptions::default()
            },
            H200,
        );
        assert_eq!(off.batch_projections(&router), rows(RowsKernel::Gemv));
        assert!(off
            .describe()
            .contains("batched router split over lanes off"));
        // Without the tensor cores: split up to SPLIT_ROWS_MAX weight rows a launch, wider
        // launches keep dec_gemv_rows' tiles.
        let gemv = Plan::resolve(
            &CudaOptions {
                mma_rows: false,
                ..CudaOptions::default()
            },
            H200,
        );
        let max = decode::SPLIT_ROWS_MAX;
        assert_eq!(
            gemv.batch_projections(&[w(max - 24, 2048, 4), w(24, 2048, 4)]),
            rows(RowsKernel::GemvSplitAsync)
        );
        assert_eq!(
            gemv.batch_projections(&[w(max - 24, 2048, 4), w(25, 2048, 4)]),
            rows(RowsKernel::Gemv)
        );
        assert_eq!(gemv.batch_projections(&qkv), rows(RowsKernel::Gemv));
        let unfused = Plan::resolve(
            &CudaOptions {
                fused_batch: false,
                ..CudaOptions::default()
            },
            H200,
        );
        assert_eq!(
            unfused.batch_projections(&router),
            BatchProjections::PerKernel
        );
    }

    #[test]
    fn batched_projections_fuse_what_decode_cu_reads_under_their_switches() {
        let w = |rows, cols, bits| mlx(rows, cols, bits, 1);
        // `--no-mma-rows`: dec_gemv_rows for every fused input.
        let on = Plan::resolve(
            &CudaOptions {
                mma_rows: false,
                ..CudaOptions::default()
            },
            H200,
        );
        let fused = [w(4096, 2048, 4), w(256, 2048, 8), w(1, 2048, 8)];
        assert_eq!(
            on.batch_projections(&fused),
            BatchProjections::Rows(RowsKernel::Gemv)
        );
        assert_eq!(
            on.batch_projections(&[w(2048, 4096, 4)]),
            BatchProjections::Rows(RowsKernel::Gemv)
        );
        // mma_rows (the default): the tensor cores for all-4-bit weights in bf16 mode; the
        // 8-bit router keeps dec_gemv_rows, fp32 mode never takes it (`--no-mma-rows-deep`:
        // dec_mma_rows itself; the default's deep form below).
        let mma = Plan::resolve(
            &CudaOptions {
                mma_rows_deep: false,
                ..CudaOptions::default()
            },
            H200,
        );
        assert!(mma
            .describe()
            .contains("batched projections on tensor cores on"));
        assert!(on
            .describe()
            .contains("batched projections on tensor cores off"));
        let tc = BatchProjections::Rows(RowsKernel::Mma);
        for ws in [
            &[w(4096, 2048, 4), w(32, 2048, 4)][..],
            &[w(2048, 4096, 4)],
            &[w(2048, 512, 4)],
            &[w(248_320, 2048, 4)],
        ] {
            assert_eq!(mma.batch_projections(ws), tc, "{ws:?}");
        }
        assert_eq!(
            mma.batch_projections(&fused),
            BatchProjections::Rows(RowsKernel::Gemv)
        );
        let fp32_mma = Plan::resolve(
            &CudaOptions {
                mma_rows: true,
                bf16_activations: false,
                ..CudaOptions::default()
            },
            H200,
        );
        assert_eq!(
            fp32_mma.batch_projections(&[w(2048, 4096, 4)]),
            BatchProjections::Rows(RowsKernel::Gemv)
        );
        // mma_rows_deep (on by default): dec_mma_rows_deep where dec_mma_rows would run, only
        // with mma_rows and in bf16 mode.
        assert!(mma
            .describe()
            .contains("batched tensor-core projections streamed through shared memory off"));
        assert!(Plan::resolve(&CudaOptions::default(), H200)
            .describe()
            .contains("batched tensor-core projections streamed through shared memory on"));
        let deep = |o: CudaOptions| {
            Plan::resolve(
                &CudaOptions {
                    mma_rows_deep: true,
                    ..o
                },
                H200,
            )
        };
        let deep_on = deep(CudaOptions::default());
        for ws in [
            &[w(4096, 2048, 4), w(32, 2048, 4)][..],
            &[w(2048, 4096, 4)],
            &[w(248_320, 2048, 4)],
        ] {
            assert_eq!(
                deep_on.batch_projections(ws),
                BatchProjections::Rows(RowsKernel::MmaDeep),
                "{ws:?}"
            );
        }
        assert_eq!(
            deep_on.batch_projections(&fused),
            BatchProjections::Rows(RowsKernel::Gemv)
        );
        for o in [
            CudaOptions {
                mma_rows: false,
                ..CudaOptions::default()
            },
            CudaOptions {
                bf16_activations: false,
                ..CudaOptions::default()
            },
        ] {
            let p = deep(o);
            assert!(!p.o.mma_rows_deep);
            assert_eq!(
                p.batch_projections(&[w(2048, 4096, 4)]),
                BatchProjections::Rows(RowsKernel::Gemv)
            );
        }
        // Not what decode.cu reads, inputs of two widths, more than MAX_SEGS weights, none, an
        // expert stack: each weight's B-token kernel.
        let per_kernel: [&[LinearShape]; 6] = [
            &[w(2048, 2048, 3)],
            &[w(2048, 8192, 4)],
            &[w(2048, 2048, 4), w(2048, 1024, 4)],
            &[w(64, 2048, 4); decode::MAX_SEGS + 1],
            &[],
            &[mlx(512, 2048, 4, 8)],
        ];
        for ws in per_kernel {
            assert_eq!(
                on.batch_projections(ws),
                BatchProjections::PerKernel,
                "{ws:?}"
            );
        }
        let mut group = w(2048, 2048, 4);
        group.group = 32;
        assert_eq!(on.batch_projections(&[group]), BatchProjections::PerKernel);
        // Off under either switch.
        for o in [
            CudaOptions {
                fused_batch: false,
                ..CudaOptions::default()
            },
            CudaOptions {
                fused_decode: false,
                ..CudaOptions::default()
            },
        ] {
            let p = Plan::resolve(&o, H200);
            assert_eq!(p.batch_projections(&fused), BatchProjections::PerKernel);
            assert_eq!(
                p.batch_projections(&[w(64, 2048, 4)]),
                BatchProjections::PerKernel
            );
        }
        // Attention: every sequence in one launch where each takes the fused-prep tensor-core
        // split kernel, the _long body only when all do; per sequence past SPLIT_ROWS
        // sequences, without fused_batch, or where a sequence's one-token attention is another.
        let a256 = qwen_attention();
        let long = on.o.split_long_keys + 1;
        assert_eq!(
            on.batch_attention(a256, &[10, 4096, 3]),
            BatchAttention::Rows(SplitKernel::Mma)
        );
        assert_eq!(
            on.batch_attention(a256, &[10, long]),
            BatchAttention::Rows(SplitKernel::Mma)
        );
        assert_eq!(
            on.batch_attention(a256, &[long, long + 5]),
            BatchAttention::Rows(SplitKernel::MmaLong)
        );
        let too_many = vec![10; attention::SPLIT_ROWS + 1];
        assert_eq!(
            on.batch_attention(a256, &too_many),
            BatchAttention::PerSequence
        );
        assert_eq!(on.batch_attention(a256, &[]), BatchAttention::PerSequence);
        let fp32 = CudaOptions {
            bf16_activations: false,
            ..CudaOptions::default()
        };
        let fp32 = Plan::resolve(&fp32, H200);
        assert_eq!(
            fp32.batch_attention(a256, &[10, 20]),
            BatchAttention::PerSequence
        );
        let no_prep = CudaOptions {
            fused_attn_prep: false,
            ..CudaOptions::default()
        };
        let no_prep = Plan::resolve(&no_prep, H200);
        assert_eq!(
            no_prep.batch_attention(a256, &[10, 20]),
            BatchAttention::PerSequence
        );
        // The MoE: one-token decode's kernels with the token in a grid dimension where the
        // one-token step fuses the block on dec_glu4 (4-bit gate/up, ≤ 2,048 columns).
        let glu = [
            w(512, 2048, 4),
            w(512, 2048, 4),
            w(512, 2048, 4),
            w(512, 2048, 4),
        ];
        assert_eq!(on.batch_moe_for(DecodePath::Fused, &glu), BatchMoe::Rows);
        assert_eq!(
            on.batch_moe_for(DecodePath::PerKernel, &glu),
            BatchMoe::Grouped
        );
        let glu8 = [
            w(512, 2048, 8),
            w(512, 2048, 8),
            w(512, 2048, 4),
            w(512, 2048, 4),
        ];
        assert_eq!(
            on.batch_moe_for(DecodePath::Fused, &glu8),
            BatchMoe::Grouped
        );
        let wide = [
            w(512, 4096, 4),
            w(512, 4096, 4),
            w(512, 4096, 4),
            w(512, 4096, 4),
        ];
        assert_eq!(
            on.batch_moe_for(DecodePath::Fused, &wide),
            BatchMoe::Grouped
        );
        // moe_int8 (on by default; `--no-moe-int8`): the int8 kernels where dec_glu4 and
        // dec_down_combine's one-group-a-lane path serve, bf16 mode; by default their pair
        // forms (moe_int8_pairs, below) stand before them.
        let (down, top_k) = (w(2048, 512, 4), 8);
        assert_eq!(
            on.moe_products_for(&glu, &down, &down, top_k),
            MoeProducts::Int8Pairs
        );
        let int8 = |bf16_activations| {
            let o = CudaOptions {
                bf16_activations,
                moe_int8_pairs: false,
                ..CudaOptions::default()
            };
            Plan::resolve(&o, H200)
        };
        let off = Plan::resolve(
            &CudaOptions {
                moe_int8: false,
                moe_int8_pairs: false,
                ..CudaOptions::default()
            },
            H200,
        );
        assert_eq!(
            int8(true).moe_products_for(&glu, &down, &down, top_k),
            MoeProducts::Int8
        );
        assert_eq!(
            off.moe_products_for(&glu, &down, &down, top_k),
            MoeProducts::Float
        );
        assert!(int8(true).describe().contains("int8 MoE products on"));
        assert!(off.describe().contains("int8 MoE products off"));
        assert_eq!(
            int8(false).moe_products_for(&glu, &down, &down, top_k),
            MoeProducts::Float
        );
        for other in [&glu8, &wide] {
            assert_eq!(
                int8(true).moe_products_for(other, &down, &down, top_k),
                MoeProducts::Float
            );
        }
        let down8 = w(2048, 512, 8);
        assert_eq!(
            int8(true).moe_products_for(&glu, &down8, &down, top_k),
            MoeProducts::Float
        );
        // gemv_int8 (on by default; `--no-gemv-int8`): the one-token 4-bit projections on
        // dec_gemv4_x8x2 / dec_gemv4w_x8x2, bf16 mode; the 8-bit router and mixed launches stay.
        let pairs = |bf16_activations| {
            let o = CudaOptions {
                bf16_activations,
                gemv_int8: true,
                ..CudaOptions::default()
            };
            Plan::resolve(&o, H200)
        };
        let in_proj = [
            w(8192, 2048, 4),
            w(4096, 2048, 4),
            w(32, 2048, 4),
            w(32, 2048, 4),
        ];
        let (o_proj, lm_head) = ([w(2048, 4096, 4)], [w(248_320, 2048, 4)]);
        for ws in [&in_proj[..], &o_proj, &lm_head, &[w(2048, 512, 4)]] {
            assert_eq!(
                pairs(true).gemv_products(ws),
                GemvProducts::Int8Pairs,
                "{ws:?}"
            );
            assert_eq!(
                pairs(false).gemv_products(ws),
                GemvProducts::Float,
                "{ws:?}"
            );
            assert_eq!(on.gemv_products(ws), GemvProducts::Int8Pairs, "{ws:?}");
        }
        assert!(pairs(true)
            .describe()
            .contains("int8-pair one-token projections on"));
        // gemv4w_sm_grid (on by default; `--no-gemv4w-sm-grid`): the 4096-column int8-pair
        // launches (out_proj, o_proj) two tiles a block, where that is one block an SM at most.
        let sm_grid = |gemv_int8| {
            let o = CudaOptions {
                gemv4w_sm_grid: true,
                gemv_int8,
                ..CudaOptions::default()
            };
            Plan::resolve(&o, H200)
        };
        assert_eq!(sm_grid(true).gemv_grid(&o_proj), GemvGrid::TwoTilesABlock);
        assert_eq!(on.gemv_grid(&o_proj), GemvGrid::TwoTilesABlock);
        let grid_off = Plan::resolve(
            &CudaOptions {
                gemv4w_sm_grid: false,
                ..CudaOptions::default()
            },
            H200,
        );
        assert_eq!(grid_off.gemv_grid(&o_proj), GemvGrid::Persistent);
        assert_eq!(sm_grid(false).gemv_grid(&o_proj), GemvGrid::Persistent);
        for ws in [&in_proj[..], &lm_head, &[w(2048, 512, 4)]] {
            assert_eq!(sm_grid(true).gemv_grid(ws), GemvGrid::Persistent, "{ws:?}");
        }
        // 2,048 rows of 4,096 columns: 256 tiles of 8 rows, 128 blocks on 132 SMs; where the
        // pairs would not fit one block an SM, the persistent grid.
        assert_eq!(decode::gemv_blocks(256, 132, GemvGrid::TwoTilesABlock), 128);
        assert_eq!(decode::gemv_blocks(256, 132, GemvGrid::Persistent), 256);
        assert_eq!(decode::gemv_blocks(3, 132, GemvGrid::TwoTilesABlock), 2);
        assert_eq!(decode::gemv_blocks(512, 132, GemvGrid::TwoTilesABlock), 264);
        assert!(on
            .describe()
            .contains("4096-column projections one block an SM on"));
        // down_96_regs (on by default; `--no-down-96-regs`): the one-token int8-pair down kernel
        // held to 96 registers; the other products keep their kernels.
        let r96 = Plan::resolve(
            &CudaOptions {
                down_96_regs: false,
                ..CudaOptions::default()
            },
            H200,
        );
        assert_eq!(r96.down_regs(MoeProducts::Int8Pairs), DownRegs::Unbounded);
        assert_eq!(on.down_regs(MoeProducts::Int8Pairs), DownRegs::Next96);
        for p in [MoeProducts::Int8, MoeProducts::Float] {
            assert_eq!(on.down_regs(p), DownRegs::Unbounded, "{p:?}");
        }
        // moe_int8_pairs (on by default; `--no-moe-int8-pairs`): the MoE's pairs kernels where the int8 ones serve, before them.
        let moe_pairs = |bf16_activations, moe_int8| {
            let o = CudaOptions {
                bf16_activations,
                moe_int8,
                moe_int8_pairs: true,
                ..CudaOptions::default()
            };
            Plan::resolve(&o, H200)
        };
        for moe_int8 in [true, false] {
            assert_eq!(
                moe_pairs(true, moe_int8).moe_products_for(&glu, &down, &down, top_k),
                MoeProducts::Int8Pairs
            );
            assert_eq!(
                moe_pairs(false, moe_int8).moe_products_for(&glu, &down, &down, top_k),
                MoeProducts::Float
            );
            assert_eq!(
                moe_pairs(true, moe_int8).moe_products_for(&glu, &down8, &down, top_k),
                MoeProducts::Float
            );
        }
        assert!(moe_pairs(true, true)
            .describe()
            .contains("int8-pair MoE products on"));
        assert!(on.describe().contains("int8-pair MoE products on"));
        // moe_grouped_rows (on by default; `--no-moe-grouped-rows`): a batched step's MoE grouped
        // by expert for 2 to 8 rows of int8-pair products; a batch of one, the switch off, the
        // other products, more picks than the tables hold and more experts than the routing holds
        // in registers stay per row.
        let grouped = |moe_int8_pairs| {
            let o = CudaOptions {
                moe_grouped_rows: true,
                moe_int8_pairs,
                ..CudaOptions::default()
            };
            Plan::resolve(&o, H200)
        };
        let per_row = Plan::resolve(
            &CudaOptions {
                moe_grouped_rows: false,
                ..CudaOptions::default()
            },
            H200,
        );
        // grouped_down_wide (on by default): the grouped down kernel at 16 warps a block;
        // `--no-grouped-down-wide` the 12-warp one.
        let wide = Plan::resolve(&CudaOptions::default(), H200);
        let narrow_down = Plan::resolve(
            &CudaOptions {
                grouped_down_wide: false,
                ..CudaOptions::default()
            },
            H200,
        );
        // grouped_moe_stream (on by default; `--no-grouped-moe-stream`: the two-buffer gate/up and
        // the three-item down kernels): both grouped kernels' deeper rings; the down kernel's only
        // on its 16-warp block.
        let stream = |grouped_down_wide| {
            let o = CudaOptions {
                grouped_moe_stream: true,
                grouped_down_wide,
                ..CudaOptions::default()
            };
            Plan::resolve(&o, H200)
        };
        for rows in 2..=8 {
            assert_eq!(
                stream(true).moe_rows_for(&glu, &down, &down, 256, top_k, rows),
                MoeRows::ByExpert(GroupedGlu::Ring, GroupedDown::Warps16Ring)
            );
            assert_eq!(
                stream(false).moe_rows_for(&glu, &down, &down, 256, top_k, rows),
                MoeRows::ByExpert(GroupedGlu::Ring, GroupedDown::Warps12)
            );
            let no_stream = Plan::resolve(
                &CudaOptions {
                    grouped_moe_stream: false,
                    ..CudaOptions::default()
                },
                H200,
            );
            assert_eq!(
                no_stream.moe_rows_for(&glu, &down, &down, 256, top_k, rows),
                MoeRows::ByExpert(GroupedGlu::Pairs, GroupedDown::Warps16)
            );
            assert_eq!(
                grouped(true).moe_rows_for(&glu, &down, &down, 256, top_k, rows),
                MoeRows::ByExpert(GroupedGlu::Ring, GroupedDown::Warps16Ring),
                "{rows} rows"
            );
            assert_eq!(
                on.moe_rows_for(&glu, &down, &down, 256, top_k, rows),
                MoeRows::ByExpert(GroupedGlu::Ring, GroupedDown::Warps16Ring)
            );
            assert_eq!(
                narrow_down.moe_rows_for(&glu, &down, &down, 256, top_k, rows),
                MoeRows::ByExpert(GroupedGlu::Ring, GroupedDown::Warps12)
            );
            assert_eq!(
                wide.moe_rows_for(&glu, &down, &down, 256, top_k, rows),
                MoeRows::ByExpert(GroupedGlu::Ring, GroupedDown::Warps16Ring)
            );
            assert_eq!(
                per_row.moe_rows_for(&glu, &down, &down, 256, top_k, rows),
                MoeRows::PerRow
            );
            assert_eq!(
                grouped(false).moe_rows_for(&glu, &down, &down, 256, top_k, rows),
                MoeRows::PerRow
            );
        }
        for (n_experts, top_k, rows) in [(256, 8, 1), (256, 8, 9), (256, 9, 8), (512, 8, 4)] {
            assert_eq!(
                grouped(true).moe_rows_for(&glu, &down, &down, n_experts, top_k, rows),
                MoeRows::PerRow,
                "{n_experts} experts, top {top_k}, {rows} rows"
            );
        }
        assert_eq!(
            grouped(true).moe_rows_for(&glu, &down8, &down, 256, top_k, 8),
            MoeRows::PerRow
        );
        assert!(grouped(true)
            .describe()
            .contains("batched MoE grouped by expert on"));
        assert!(on.describe().contains("batched MoE grouped by expert on"));
        assert!(per_row
            .describe()
            .contains("batched MoE grouped by expert off"));
        assert!(wide
            .describe()
            .contains("grouped MoE down kernel at 16 warps on"));
        assert!(narrow_down
            .describe()
            .contains("grouped MoE down kernel at 16 warps off"));
        assert!(stream(true)
            .describe()
            .contains("grouped MoE weights streamed deeper on"));
        assert!(wide
            .describe()
            .contains("grouped MoE weights streamed deeper on"));
        assert!(Plan::resolve(
            &CudaOptions {
                grouped_moe_stream: false,
                ..CudaOptions::default()
            },
            H200
        )
        .describe()
        .contains("grouped MoE weights streamed deeper off"));
        assert!(on.describe().contains("int8-pair one-token projections on"));
        assert!(off.describe().contains("int8-pair MoE products off"));
        for ws in [
            &[w(256, 2048, 8), w(1, 2048, 8)][..],
            &[w(8192, 2048, 4), w(32, 2048, 8)],
            &[w(2048, 2048, 4), w(2048, 1024, 4)],
            &[w(1024, 3072, 4)],
            &[],
        ] {
            assert_eq!(pairs(true).gemv_products(ws), GemvProducts::Float, "{ws:?}");
        }
        let first = CudaOptions {
            fused_batch: false,
            ..CudaOptions::default()
        };
        let first = Plan::resolve(&first, H200);
        assert_eq!(
            first.batch_moe_for(DecodePath::Fused, &glu),
            BatchMoe::Grouped
        );
        assert_eq!(
            first.batch_attention(a256, &[10, 20]),
            BatchAttention::PerSequence
        );
        assert_eq!(first.batch_head(), BatchHead::PerSequence);
        assert_eq!(on.batch_head(), BatchHead::Rows);
        // The DeltaNet scans: one launch for all sequences, one a sequence without
        // fused_batch, a chunk's kernels without fused_decode.
        let cfg = full_config();
        assert_eq!(on.batch_scan(&cfg), BatchScan::Rows);
        let first = CudaOptions {
            fused_batch: false,
            ..CudaOptions::default()
        };
        assert_eq!(
            Plan::resolve(&first, H200).batch_scan(&cfg),
            BatchScan::OneToken
        );
        let unfused = CudaOptions {
            fused_decode: false,
            ..CudaOptions::default()
        };
        assert_eq!(
            Plan::resolve(&unfused, H200).batch_scan(&cfg),
            BatchScan::Chunk
        );
        // The batched step itself is on unless turned off.
        assert!(on.batched_decode());
        let queued = CudaOptions {
            batched_decode: false,
            ..CudaOptions::default()
        };
        assert!(!Plan::resolve(&queued, H200).batched_decode());
    }

    /// The module comment's table, row by row, for the full shape at 1, 512, 4K, 32K and 128K
    /// tokens of context (each prompt in chunks of 4,096; the last chunk of a 32K or 128K prompt
    /// is a full one at that context), from the shapes of the shipped MLX checkpoint.
    #[test]
    fn the_full_shape_takes_the_kernels_the_table_names() {
        let cfg = full_config();
        let p = Plan::resolve(&CudaOptions::default(), H200);
        let (h, e) = (cfg.hidden, cfg.n_experts);
        let shape = AttnShape::of(&cfg);
        let moe = MoeShape::of(&cfg);
        let q = mlx(2 * cfg.n_heads * cfg.head_dim, h, 4, 1);
        let o = mlx(h, cfg.n_heads * cfg.head_dim, 4, 1);
        let in_qkv = mlx(cfg.conv_dim(), h, 4, 1);
        let router = mlx(e, h, 8, 1);
        let gate = mlx(cfg.expert_inter, h, 4, e);
        let down = mlx(h, cfg.expert_inter, 4, e);
        let lm_head = mlx(cfg.vocab, h, 4, 1);
        assert_eq!(p.prefill_chunk, 8192);
        assert_eq!(p.interleaved_chunk, 4096);
        // Decode (n = 1): the fused kernels, split attention with the prep inside; the 4-bit
        // projections on int8 pairs of x (`dec_gemv4_x8x2`, `dec_gemv4w_x8x2`: `gemv_int8`, on
        // by default), in f32 (`dec_gemv4`, `dec_gemv4w`) under `--no-gemv-int8`.
        assert_eq!(p.one_row(&lm_head), DecodePath::Fused);
        assert!(decode::serves(&router) && decode::serves(&o) && decode::serves(&in_qkv));
        let floats = Plan::resolve(
            &CudaOptions {
                gemv_int8: false,
                ..CudaOptions::default()
            },
            H200,
        );
        let dn_in = mlx(cfg.dn_v_heads, h, 4, 1);
        let dn_out = mlx(h, cfg.dn_value_dim(), 4, 1);
        let kv = mlx(cfg.n_kv_heads * cfg.head_dim, h, 4, 1);
        for ws in [
            &[q, kv, kv][..],
            &[in_qkv, dn_in, dn_in],
            &[o],
            &[dn_out],
            &[lm_head],
        ] {
            assert_eq!(p.gemv_products(ws), GemvProducts::Int8Pairs, "{ws:?}");
            assert_eq!(floats.gemv_products(ws), GemvProducts::Float, "{ws:?}");
        }
        assert_eq!(
            p.gemv_products(&[router, mlx(1, h, 8, 1)]),
            GemvProducts::Float
        );
        // The int8 cache that ships takes the long bodies past SPLIT_LONG_KEYS_INT8 keys.
        for (keys, kernel) in [
            (512, SplitKernel::Mma),
            (4096, SplitKernel::Mma),
            (4097, SplitKernel::MmaLong),
            (32_768, SplitKernel::MmaLong),
            (65_537, SplitKernel::MmaLong),
            (131_072, SplitKernel::MmaLong),
        ] {
            assert_eq!(
                p.attention(shape, 1, keys),
                AttentionKernels::Split {
                    kernel,
                    prep_fused: true
                },
                "{keys} keys"
            );
        }
        assert_eq!(p.experts([&gate, &gate, &down], moe, 1), Experts::Gather);
        // A batched decode step: the projections of each input in one dec_gemv_rows launch
        // (q/k/v; DeltaNet's four; the router with the shared-expert gate; o_proj, out_proj
        // and lm_head alone), the MoE as one token's with the token in grid.y, each sequence's
        // attention as one token's, the DeltaNet scans in one launch each.
        let k = mlx(cfg.n_kv_heads * cfg.head_dim, h, 4, 1);
        let dn_b = mlx(cfg.dn_v_heads, h, 4, 1);
        let out_proj = mlx(h, cfg.dn_value_dim(), 4, 1);
        let s_gate = mlx(1, h, 8, 1);
        let s_up = mlx(cfg.shared_inter, h, 4, 1);
        let s_down = mlx(h, cfg.shared_inter, 4, 1);
        let z = mlx(cfg.dn_value_dim(), h, 4, 1);
        let gemv = Plan::resolve(
            &CudaOptions {
                mma_rows: false,
                ..CudaOptions::default()
            },
            H200,
        );
        for ws in [
            &[q, k, k][..],
            &[in_qkv, z, dn_b, dn_b],
            &[o],
            &[out_proj],
            &[lm_head],
        ] {
            assert_eq!(
                gemv.batch_projections(ws),
                BatchProjections::Rows(RowsKernel::Gemv),
                "{ws:?}"
            );
        }
        // By default (`mma_rows`): dec_mma_rows for every 4-bit input; the 8-bit router (257
        // rows) takes dec_gemv_rows_split_async (`router_rows_split`, `batch_lean_glue`,
        // `router_async_stage`), with or without `--no-mma-rows`.
        assert_eq!(
            gemv.batch_projections(&[router, s_gate]),
            BatchProjections::Rows(RowsKernel::GemvSplitAsync)
        );
        let mma = &p;
        for (ws, kernel) in [
            (&[q, k, k][..], RowsKernel::MmaDeep),
            (&[in_qkv, z, dn_b, dn_b], RowsKernel::MmaDeep),
            (&[lm_head], RowsKernel::MmaDeep),
            (&[o], RowsKernel::MmaDeep),
            (&[out_proj], RowsKernel::MmaDeep),
            (&[router, s_gate], RowsKernel::GemvSplitAsync),
        ] {
            assert_eq!(
                mma.batch_projections(ws),
                BatchProjections::Rows(kernel),
                "{ws:?}"
            );
        }
        assert!(decode::down_serves(&down, &s_down, moe.top_k));
        assert_eq!(
            p.batch_moe_for(DecodePath::Fused, &[gate, gate, s_up, s_up]),
            BatchMoe::Rows
        );
        for (rows, want) in [
            (1, MoeRows::PerRow),
            (
                4,
                MoeRows::ByExpert(GroupedGlu::Ring, GroupedDown::Warps16Ring),
            ),
            (
                8,
                MoeRows::ByExpert(GroupedGlu::Ring, GroupedDown::Warps16Ring),
            ),
        ] {
            assert_eq!(
                p.moe_rows_for(
                    &[gate, gate, s_up, s_up],
                    &down,
                    &s_down,
                    e,
                    moe.top_k,
                    rows
                ),
                want,
                "{rows} rows"
            );
        }
        assert_eq!(p.batch_scan(&cfg), BatchScan::Rows);
        assert_eq!(
            p.batch_attention(shape, &[512, 4096, 65_537]),
            BatchAttention::Rows(SplitKernel::Mma)
        );
        assert_eq!(
            p.batch_attention(shape, &[65_537, 131_072]),
            BatchAttention::Rows(SplitKernel::MmaLong)
        );
        // Short multi-token steps: CUDA cores.
        for n in [2, 4, 8, 15] {
            assert_eq!(p.dense(&q, n, p.stages(n)), Dense::Linear);
            assert_eq!(p.router(&router, n), Router::LinearExact);
            assert_eq!(
                p.experts([&gate, &gate, &down], moe, n),
                Experts::LinearGrouped
            );
        }
        assert!(matches!(
            p.attention(shape, 4, 4),
            AttentionKernels::Split {
                kernel: SplitKernel::Cuda,
                ..
            }
        ));
        assert_eq!(p.attention(shape, 5, 5), AttentionKernels::OneBlockPerHead);
        // Chunks: (tokens, dense kernel, router parts, experts' tile and kernel, attention).
        let mma = |tile| match tile {
            32 => GroupedGemm::Mma32,
            _ => GroupedGemm::Mma64,
        };
        for (n, dense, parts, tile, grouped, attn) in [
            (16, DenseGemm::Mma, 8, 32, mma(32), PrefillKernel::Mma),
            (256, DenseGemm::Mma, 8, 32, mma(32), PrefillKernel::Mma),
            (511, DenseGemm::Mma, 8, 32, mma(32), PrefillKernel::Mma),
            (
                512,
                DenseGemm::Wgb,
                8,
                32,
                GroupedGemm::Wgb32,
                PrefillKernel::Mma,
            ),
            (
                1024,
                DenseGemm::Wgb,
                8,
                64,
                GroupedGemm::Wgb64,
                PrefillKernel::Wgmma,
            ),
            (
                2048,
                DenseGemm::Wgb256,
                4,
                64,
                GroupedGemm::Wgb64,
                PrefillKernel::Wgmma,
            ),
            (
                3072,
                DenseGemm::Wgb256,
                2,
                128,
                GroupedGemm::Wgb128,
                PrefillKernel::Wgmma,
            ),
            (
                4096,
                DenseGemm::Wgb256,
                2,
                128,
                GroupedGemm::Wgb128,
                PrefillKernel::Wgmma,
            ),
        ] {
            let staged = p.stages(n);
            assert_eq!(staged, n >= 512, "{n}");
            // Shipping: the wgmma kernels on their _lean variants (`wgmma_lean_dequant`), the
            // grouped ones on their _hoist variants (`wgmma_hoisted_addrs`), attn_prefill_wg on
            // its pipelined kernel (`wgmma_attention_pipelined`).
            let (dense, grouped) = (dense.lean(), grouped.lean().hoist());
            let attn = match attn {
                PrefillKernel::Wgmma => PrefillKernel::WgmmaPipelined,
                other => other,
            };
            for w in [&q, &o, &in_qkv] {
                assert_eq!(p.dense(w, n, staged), Dense::Gemm(dense), "{n}");
            }
            assert_eq!(p.router(&router, n), Router::GemmExact { parts }, "{n}");
            assert_eq!(
                p.experts([&gate, &gate, &down], moe, n),
                Experts::Gemm {
                    tile,
                    gate: grouped,
                    up: grouped,
                    down: grouped,
                    tail: (tile == 128).then_some(GroupedGemm::Wgb32Hoist)
                },
                "{n}"
            );
            assert_eq!(
                p.attention(shape, n, n),
                AttentionKernels::Prefill(attn),
                "{n}"
            );
            // The DeltaNet scan: on the tensor cores from one whole chunk (`tc_scan`).
            assert_eq!(
                p.deltanet_scan(DnShape::of(&cfg), n),
                if n >= 64 {
                    DnScan::Chunked
                } else {
                    DnScan::Recurrent
                },
                "{n}"
            );
            // The context does not change a chunk's kernels (a 128K prompt's last chunk).
            assert_eq!(
                p.attention(shape, n, 131_072),
                AttentionKernels::Prefill(attn)
            );
        }
        // 8-bit weights (the router, the shared expert's gate) never take the wgmma kernels.
        assert_eq!(
            p.dense(&mlx(1, h, 8, 1), 4096, true),
            Dense::Gemm(DenseGemm::Mma)
        );
    }

    #[test]
    fn switches_off_take_the_kernels_they_name() {
        let cfg = full_config();
        let (shape, moe) = (AttnShape::of(&cfg), MoeShape::of(&cfg));
        let gate = mlx(cfg.expert_inter, cfg.hidden, 4, cfg.n_experts);
        let down = mlx(cfg.hidden, cfg.expert_inter, 4, cfg.n_experts);
        let router = mlx(cfg.n_experts, cfg.hidden, 8, 1);
        let off = |f: fn(&mut CudaOptions)| {
            let mut o = CudaOptions::default();
            f(&mut o);
            Plan::resolve(&o, H200)
        };
        let p = off(|o| o.wgmma_small_tiles = false);
        assert_eq!(
            p.experts([&gate, &gate, &down], moe, 512),
            Experts::Gemm {
                tile: 32,
                gate: GroupedGemm::Mma32,
                up: GroupedGemm::Mma32,
                down: GroupedGemm::Mma32,
                tail: None
            }
        );
        let p = off(|o| o.wgmma_group_tile = 64);
        assert!(matches!(
            p.experts([&gate, &gate, &down], moe, 4096),
            Experts::Gemm { tile: 64, .. }
        ));
        let p = off(|o| o.router_split_k = false);
        assert_eq!(p.router(&router, 512), Router::GemmExact { parts: 1 });
        let p = off(|o| o.exact_router_on_tensor_cores = false);
        assert_eq!(p.router(&router, 512), Router::LinearExact);
        let p = off(|o| o.wgb_tok = 128);
        assert_eq!(p.dense(&gate, 4096, true), Dense::Gemm(DenseGemm::WgbLean));
        let p = off(|o| o.wgmma_attention = false);
        assert_eq!(
            p.attention(shape, 4096, 4096),
            AttentionKernels::Prefill(PrefillKernel::Mma)
        );
        let p = off(|o| o.fused_attn_prep = false);
        assert_eq!(
            p.attention(shape, 1, 4096),
            AttentionKernels::Split {
                kernel: SplitKernel::Mma,
                prep_fused: false
            }
        );
        let p = off(|o| o.mma_attention = false);
        assert_eq!(
            p.attention(shape, 1, 131_072),
            AttentionKernels::Split {
                kernel: SplitKernel::Cuda,
                prep_fused: false
            }
        );
        let p = off(|o| o.split_kv = false);
        assert_eq!(
            p.attention(shape, 1, 4096),
            AttentionKernels::OneBlockPerHead
        );
        let p = off(|o| o.moe_grouped = false);
        assert_eq!(p.experts([&gate, &gate, &down], moe, 4096), Experts::Gather);
        let p = off(|o| o.wgmma_gemm = false);
        assert!(!p.stages(4096));
        assert_eq!(p.dense(&gate, 4096, false), Dense::Gemm(DenseGemm::Mma));
        let p = off(|o| o.tensor_cores = false);
        assert_eq!(p.dense(&gate, 4096, false), Dense::Linear);
        assert_eq!(p.router(&router, 4096), Router::LinearExact);
    }

    /// The full shape's MoE and its routed experts' gate (= up) and down stacks.
    fn experts_full() -> (MoeShape, LinearShape, LinearShape) {
        let cfg = full_config();
        let gate = mlx(cfg.expert_inter, cfg.hidden, 4, cfg.n_experts);
        let down = mlx(cfg.hidden, cfg.expert_inter, 4, cfg.n_experts);
        (MoeShape::of(&cfg), gate, down)
    }

    /// The H200's plan under the default options changed by `f`.
    fn plan_with(f: fn(&mut CudaOptions)) -> Plan {
        let mut o = CudaOptions::default();
        f(&mut o);
        Plan::resolve(&o, H200)
    }

    /// The routed experts on one grouped kernel `k` for all three projections.
    fn experts_gemm(tile: usize, k: GroupedGemm, tail: Option<GroupedGemm>) -> Experts {
        Experts::Gemm {
            tile,
            gate: k,
            up: k,
            down: k,
            tail,
        }
    }

    #[test]
    fn the_interleaved_chunk_is_at_most_the_prefill_chunk() {
        let with = |chunk, interleaved_chunk| {
            let p = Plan::resolve(
                &CudaOptions {
                    chunk,
                    interleaved_chunk,
                    ..CudaOptions::default()
                },
                H200,
            );
            (p.prefill_chunk, p.interleaved_chunk)
        };
        assert_eq!(with(8192, 4096), (8192, 4096));
        assert_eq!(with(4096, 4096), (4096, 4096));
        assert_eq!(with(1024, 4096), (1024, 1024));
        assert_eq!(with(16384, 512), (16384, 512));
    }

    #[test]
    fn narrow_and_tail_tiles_take_the_chunks_their_switches_name() {
        // Qwen3.6 routes 8 of 256 experts a token: a staged chunk of n tokens averages n / 32
        // items an expert, so `wgmma_narrow_tiles` takes chunks up to 24 × 32 = 768 tokens and
        // `wgmma_tail_tiles` those on tiles of 128 (3,072 tokens and up).
        let (moe, gate, down) = experts_full();
        let w = [&gate, &gate, &down];
        let with = plan_with;
        let gemm = experts_gemm;
        // The shipping plan's grouped kernels are the _hoist variants (`wgmma_lean_dequant`,
        // `wgmma_hoisted_addrs`).
        let (wgb32, wgb64, wgb128) = (
            GroupedGemm::Wgb32Hoist,
            GroupedGemm::Wgb64Hoist,
            GroupedGemm::Wgb128Hoist,
        );
        // Shipping: both on.
        let on = Plan::resolve(&CudaOptions::default(), H200);
        for (n, want) in [
            (511, gemm(32, GroupedGemm::Mma32, None)),
            (512, gemm(32, wgb32, None)),
            (768, gemm(32, wgb32, None)),
            (769, gemm(64, wgb64, None)),
            (2048, gemm(64, wgb64, None)),
            (3072, gemm(128, wgb128, Some(wgb32))),
            (4096, gemm(128, wgb128, Some(wgb32))),
        ] {
            assert_eq!(on.experts(w, moe, n), want, "{n}");
        }
        // Each switch alone changes only its own chunks.
        let narrow = with(|o| o.wgmma_tail_tiles = false);
        assert_eq!(narrow.experts(w, moe, 512), gemm(32, wgb32, None));
        assert_eq!(narrow.experts(w, moe, 4096), gemm(128, wgb128, None));
        let tail = with(|o| o.wgmma_narrow_tiles = false);
        assert_eq!(tail.experts(w, moe, 512), gemm(64, wgb64, None));
        assert_eq!(tail.experts(w, moe, 4096), gemm(128, wgb128, Some(wgb32)));
        // Both off: the fixed tiles.
        let off = with(|o| {
            o.wgmma_narrow_tiles = false;
            o.wgmma_tail_tiles = false;
        });
        assert_eq!(off.experts(w, moe, 512), gemm(64, wgb64, None));
        assert_eq!(off.experts(w, moe, 4096), gemm(128, wgb128, None));
        // Narrow tiles refine the wgmma small tiles: without them, mma.sync's tiles of 32.
        let small_off = with(|o| o.wgmma_small_tiles = false);
        assert_eq!(
            small_off.experts(w, moe, 512),
            gemm(32, GroupedGemm::Mma32, None)
        );
        // Without the wgmma kernels neither applies.
        let mma = with(|o| {
            o.wgmma_gemm = false;
            o.wgmma_narrow_tiles = true;
            o.wgmma_tail_tiles = true;
        });
        assert_eq!(mma.experts(w, moe, 512), gemm(32, GroupedGemm::Mma32, None));
        assert_eq!(
            mma.experts(w, moe, 4096),
            gemm(64, GroupedGemm::Mma64, None)
        );
    }

    #[test]
    fn lean_dequant_names_the_wgmma_kernels_lean_variants() {
        let (moe, gate, down) = experts_full();
        let w = [&gate, &gate, &down];
        let with = plan_with;
        let gemm = experts_gemm;
        let lean = with(|o| {
            o.wgmma_lean_dequant = true;
            o.wgmma_hoisted_addrs = false;
            o.wgmma_tail_tiles = true;
            o.wgb_tok = 256;
        });
        assert_eq!(
            lean.dense(&gate, 512, true),
            Dense::Gemm(DenseGemm::WgbLean)
        );
        assert_eq!(
            lean.dense(&gate, 4096, true),
            Dense::Gemm(DenseGemm::Wgb256Lean)
        );
        assert_eq!(
            lean.experts(w, moe, 512),
            gemm(32, GroupedGemm::Wgb32Lean, None)
        );
        assert_eq!(
            lean.experts(w, moe, 1024),
            gemm(64, GroupedGemm::Wgb64Lean, None)
        );
        assert_eq!(
            lean.experts(w, moe, 4096),
            gemm(128, GroupedGemm::Wgb128Lean, Some(GroupedGemm::Wgb32Lean))
        );
        // mma.sync kernels have no lean variant; groups of 32 keep the wgmma kernels' old path.
        assert_eq!(lean.dense(&gate, 4096, false), Dense::Gemm(DenseGemm::Mma));
        let g32 = LinearShape { group: 32, ..gate };
        assert_eq!(lean.dense(&g32, 512, true), Dense::Gemm(DenseGemm::Wgb));
        // Off: the old kernels.
        let off = with(|o| {
            o.wgmma_lean_dequant = false;
            o.wgb_tok = 256;
        });
        assert_eq!(off.dense(&gate, 4096, true), Dense::Gemm(DenseGemm::Wgb256));
        assert_eq!(off.experts(w, moe, 512), gemm(32, GroupedGemm::Wgb32, None));
        assert_eq!(
            off.experts(w, moe, 1024),
            gemm(64, GroupedGemm::Wgb64, None)
        );
    }

    /// `wgmma_attention_pipelined`: chunks of 1K and more name attn_prefill_wg_pipe (off:
    /// attn_prefill_wg), chunks too short for the wgmma kernels keep attn_prefill, one-token steps
    /// split-KV; without wgmma_attention or on a device without wgmma the switch names nothing;
    /// describe() says so.
    #[test]
    fn pipelined_attention_names_attn_prefill_wg_pipe() {
        let shape = qwen_attention();
        let on = plan_with(|o| o.wgmma_attention_pipelined = true);
        for (n_tok, keys) in [(1024, 1024), (4096, 4096), (4096, 131_072)] {
            assert_eq!(
                on.attention(shape, n_tok, keys),
                AttentionKernels::Prefill(PrefillKernel::WgmmaPipelined)
            );
        }
        assert_eq!(
            on.attention(shape, 512, 4096),
            AttentionKernels::Prefill(PrefillKernel::Mma)
        );
        assert!(matches!(
            on.attention(shape, 1, 4096),
            AttentionKernels::Split { .. }
        ));
        let off = plan_with(|o| o.wgmma_attention_pipelined = false);
        assert_eq!(
            off.attention(shape, 4096, 4096),
            AttentionKernels::Prefill(PrefillKernel::Wgmma)
        );
        let no_wg = plan_with(|o| {
            o.wgmma_attention_pipelined = true;
            o.wgmma_attention = false;
        });
        let ampere = Plan::resolve(
            &CudaOptions {
                wgmma_attention_pipelined: true,
                ..CudaOptions::default()
            },
            A100,
        );
        for plan in [no_wg, ampere] {
            assert_eq!(
                plan.attention(shape, 4096, 4096),
                AttentionKernels::Prefill(PrefillKernel::Mma)
            );
        }
        assert!(on
            .describe()
            .contains("pipelined wgmma prefill attention on"));
        assert!(off
            .describe()
            .contains("pipelined wgmma prefill attention off"));
    }

    #[test]
    fn hoisted_addrs_names_the_grouped_hoist_variants() {
        let (moe, gate, down) = experts_full();
        let w = [&gate, &gate, &down];
        let gemm = experts_gemm;
        let hoist = plan_with(|o| {
            o.wgmma_lean_dequant = true;
            o.wgmma_hoisted_addrs = true;
            o.wgmma_tail_tiles = true;
            o.wgb_tok = 256;
        });
        assert_eq!(
            hoist.experts(w, moe, 512),
            gemm(32, GroupedGemm::Wgb32Hoist, None)
        );
        assert_eq!(
            hoist.experts(w, moe, 1024),
            gemm(64, GroupedGemm::Wgb64Hoist, None)
        );
        assert_eq!(
            hoist.experts(w, moe, 4096),
            gemm(128, GroupedGemm::Wgb128Hoist, Some(GroupedGemm::Wgb32Hoist))
        );
        // The dense kernels keep their _lean variants; groups of 32 keep the plain kernels.
        assert_eq!(
            hoist.dense(&gate, 4096, true),
            Dense::Gemm(DenseGemm::Wgb256Lean)
        );
        let g32 = LinearShape { group: 32, ..gate };
        assert_eq!(
            hoist.experts([&g32, &g32, &g32], moe, 512),
            gemm(32, GroupedGemm::Wgb32, None)
        );
        // Without the lean dequantisation the switch names nothing.
        let plain = plan_with(|o| {
            o.wgmma_lean_dequant = false;
            o.wgmma_hoisted_addrs = true;
        });
        assert_eq!(
            plain.experts(w, moe, 512),
            gemm(32, GroupedGemm::Wgb32, None)
        );
    }

    #[test]
    fn the_experts_grid_follows_their_items_where_its_switch_asks() {
        // Scratch of a 4,096-token chunk: 32,768 items / 16 + 256 = 2,304 rows of tile blocks.
        let max = moe::max_group_tiles(4096 * 8, 256);
        assert_eq!(max, 2304);
        let off = Plan::resolve(
            &CudaOptions {
                tile_grid_by_items: false,
                ..CudaOptions::default()
            },
            H200,
        );
        assert_eq!(off.tile_rows(512 * 8, 256, 64, max), max);
        // Shipping: on.
        let on = Plan::resolve(&CudaOptions::default(), H200);
        // 512 tokens in tiles of 64 (or 32): 64 (128) + 256; 4,096 in tiles of 128: 256 + 256.
        assert_eq!(on.tile_rows(512 * 8, 256, 64, max), 320);
        assert_eq!(on.tile_rows(512 * 8, 256, 32, max), 384);
        assert_eq!(on.tile_rows(4096 * 8, 256, 128, max), 512);
        // Few items: at most one partial tile an item; never past the scratch's bound.
        assert_eq!(on.tile_rows(20, 256, 16, max), 22);
        assert_eq!(on.tile_rows(4096 * 8, 256, 16, max), max);
        // The bound holds for every split of the items over the experts (random small cases,
        // each expert's tiles ⌈count / tile⌉ as moe_group makes them).
        let mut rng = 12345u64;
        for _ in 0..2000 {
            rng = rng
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let e = 1 + (rng >> 33) as usize % 12;
            let tile = [16, 32, 64, 128][(rng >> 20) as usize % 4];
            let counts: Vec<usize> = (0..e).map(|i| ((rng >> (i % 50)) as usize) % 300).collect();
            let items: usize = counts.iter().sum();
            let made: usize = counts.iter().map(|c| c.div_ceil(tile)).sum();
            assert!(
                made <= moe::group_tiles_bound(items, e, tile),
                "{counts:?} / {tile}"
            );
        }
    }

    #[test]
    fn pipelined_decode_only_where_the_host_reads_just_the_token() {
        let on = Plan::resolve(&CudaOptions::default(), H200);
        let none = LogprobsPath::None;
        assert!(on.pipelined_decode(SamplingPath::DeviceGreedy, none));
        assert!(on.pipelined_decode(SamplingPath::Device, none));
        assert!(!on.pipelined_decode(SamplingPath::Host, none));
        assert!(on.pipelined_decode(SamplingPath::DeviceGreedy, LogprobsPath::Device));
        assert!(!on.pipelined_decode(SamplingPath::DeviceGreedy, LogprobsPath::Host));
        let off = Plan::resolve(
            &CudaOptions {
                pipelined_decode: false,
                ..CudaOptions::default()
            },
            H200,
        );
        assert!(!off.pipelined_decode(SamplingPath::DeviceGreedy, none));
        assert!(on.describe().contains("pipelined decode on"));
        assert!(off.describe().contains("pipelined decode off"));
    }

    #[test]
    fn top_logprobs_on_the_device_with_device_picks_up_to_twenty() {
        let on = Plan::resolve(&CudaOptions::default(), H200);
        let v = 248_320;
        assert_eq!(
            on.logprobs(SamplingPath::DeviceGreedy, 0, v),
            LogprobsPath::None
        );
        for k in [1, 5, 20] {
            assert_eq!(
                on.logprobs(SamplingPath::DeviceGreedy, k, v),
                LogprobsPath::Device
            );
            assert_eq!(
                on.logprobs(SamplingPath::Device, k, v),
                LogprobsPath::Device
            );
            assert_eq!(on.logprobs(SamplingPath::Host, k, v), LogprobsPath::Host);
        }
        assert_eq!(on.logprobs(SamplingPath::Device, 21, v), LogprobsPath::Host);
        assert_eq!(on.logprobs(SamplingPath::Device, 5, 4), LogprobsPath::Host);
        let off = Plan::resolve(
            &CudaOptions {
                device_logprobs: false,
                ..CudaOptions::default()
            },
            H200,
        );
        assert_eq!(
            off.logprobs(SamplingPath::DeviceGreedy, 5, v),
            LogprobsPath::Host
        );
    }

    #[test]
    fn the_tensor_core_scan_runs_where_its_switch_and_the_device_allow() {
        let cfg = full_config();
        let full = DnShape::of(&cfg);
        let tiny = DnShape::of(&ModelConfig::from_json(&preset_text_config(Preset::Tiny)).unwrap());
        // Off (`--no-tc-scan`): token by token at every length.
        let off = Plan::resolve(
            &CudaOptions {
                tc_scan: false,
                ..CudaOptions::default()
            },
            H200,
        );
        for n in [1, 63, 64, 512, 4096] {
            assert_eq!(off.deltanet_scan(full, n), DnScan::Recurrent, "{n}");
        }
        assert!(off.describe().contains("tensor-core DeltaNet scan off"));
        // Shipping (on): chunked from one whole chunk, for the full heads and the tiny preset's
        // (32 × 32).
        let on = CudaOptions::default();
        assert!(on.tc_scan);
        let p = Plan::resolve(&on, H200);
        assert!(p.describe().contains("tensor-core DeltaNet scan on"));
        for (n, want) in [
            (1, DnScan::Recurrent),
            (63, DnScan::Recurrent),
            (64, DnScan::Chunked),
            (65, DnScan::Chunked),
            (4096, DnScan::Chunked),
        ] {
            assert_eq!(p.deltanet_scan(full, n), want, "{n}");
            assert_eq!(p.deltanet_scan(tiny, n), want, "tiny {n}");
        }
        // Heads it does not take: dv not a multiple of 32, dk past 128.
        for s in [DnShape { dv: 48, ..full }, DnShape { dk: 256, ..full }] {
            assert_eq!(p.deltanet_scan(s, 4096), DnScan::Recurrent, "{s:?}");
        }
        // fp32 mode, and a device that cannot grant dn_wy_scan's shared memory (sm_86 / 89 / 120:
        // 99 KB), keep the recurrence; an A100's 163 KB suffices.
        let fp32 = CudaOptions {
            bf16_activations: false,
            ..on.clone()
        };
        assert_eq!(
            Plan::resolve(&fp32, H200).deltanet_scan(full, 4096),
            DnScan::Recurrent
        );
        let small_smem = DeviceCaps {
            max_shared_memory: 101_376,
            ..H200
        };
        assert_eq!(
            Plan::resolve(&on, small_smem).deltanet_scan(full, 4096),
            DnScan::Recurrent
        );
        assert_eq!(
            Plan::resolve(&on, A100).deltanet_scan(full, 4096),
            DnScan::Chunked
        );
    }

    #[test]
    fn debug_checks_turn_graphs_off() {
        let p = Plan::resolve(
            &CudaOptions {
                profile: true,
                ..CudaOptions::default()
            },
            H200,
        );
        assert!(!p.decode_graphs());
        assert!(Plan::resolve(&CudaOptions::default(), H200).decode_graphs());
    }
}
