//! The plan: every path decision of the CUDA backend in one place. Which kernel runs for a given
//! step is a function of the plan and the shape (`Plan::linear`, `router`, `attention`, `moe`,
//! `sampling`), and forward.rs / backend.rs only ever ask the plan, so reading them tells what
//! runs. The plan is filled once, when the backend is built, from `CudaOptions` (the
//! `lily-engine` flags, lily-server's `CudaArgs`), with environment variables as documented
//! overrides on top, read in one function (`CudaOptions::with_env_overrides`).
//!
//! Not here: `LILY_NVRTC` (nvrtc.rs) and `LILY_CACHE_DIR` (cache.rs), which say where to find
//! files, not what to run.

use lily_core::config::ModelConfig;
use lily_core::sampling::SamplingParams;

use crate::gpu::{KernelSwitches, LaunchChecks};
use crate::kernels::attention::{self, AttnShape};
use crate::kernels::decode::{self, Decode};
use crate::kernels::gemm;
use crate::kernels::moe::MoeShape;
use crate::sampler;
use crate::weights::{DevAttention, DevDeltaNet, DevLinear, DevMoe};

/// Fewest tokens of a step that take the tensor-core kernels (gemm.cu, `attn_prefill`): one
/// warp's 16 mma rows; shorter steps (decode) keep the CUDA-core kernels.
pub const TENSOR_CORE_MIN_TOK: usize = 16;
/// Default largest prefill chunk (tokens per forward pass; scratch is sized for it).
pub const DEFAULT_PREFILL_CHUNK: usize = 4096;

/// How the backend runs, as asked for (CLI flags; `Default` is the configuration that ships).
/// `Plan::new` applies the environment overrides on top and resolves what depends on what.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaOptions {
    /// GPU ordinal (`LILY_CUDA_DEVICE`).
    pub ordinal: usize,
    /// Round activations to bf16 where the reference model stores them (production). `false`
    /// keeps every activation and the KV cache in fp32 (parity with the CPU backend;
    /// `--fp32-activations`, `LILY_CUDA_FP32=1`).
    pub bf16_activations: bool,
    /// Largest prefill chunk (`--prefill-chunk`, `LILY_PREFILL_CHUNK`).
    pub chunk: usize,
    /// Replay each sequence's decode step as a captured CUDA graph (`--no-cuda-graphs`,
    /// `LILY_CUDA_GRAPH=0`).
    pub graphs: bool,
    /// Prefill chunks run the routed experts grouped by expert (moe_group + grouped linears), so
    /// each expert's weights are read once per tile instead of once per item; decode (one token)
    /// always gathers (`--no-moe-grouping`, `LILY_MOE_GROUPED=0`).
    pub moe_grouped: bool,
    /// Prefill chunks run `attn_prefill` (flash attention on tensor cores: bf16 mma, fp32
    /// softmax); bf16 activations only, since it rounds q, k, v and the softmax weights to bf16
    /// (`--no-flash-prefill`, `LILY_ATTN_PREFILL=0`).
    pub flash_prefill: bool,
    /// Steps of at most `attention::SPLIT_MAX_TOK` tokens (decode) run split-KV (flash-decoding)
    /// attention (`--no-split-kv`, `LILY_SPLIT_KV=0`).
    pub split_kv: bool,
    /// Sample on the device when the settings allow it (`sampler::supports`); `false` keeps
    /// non-greedy sampling on the host, on downloaded logits (`--no-device-sampling`,
    /// `LILY_DEVICE_SAMPLING=0`). Greedy always picks on the device.
    pub device_sampling: bool,
    /// Linears of prefill chunks on tensor cores (gemm.cu); bf16 activations only, since weights
    /// and activations enter the mma as bf16 (`--no-tensor-cores`, `LILY_TENSOR_CORES=0`).
    pub tensor_cores: bool,
    /// The MoE router of prefill chunks on tensor cores in split precision (gemm_dense_exact)
    /// when tensor cores are on, else on CUDA cores, same precision
    /// (`--router-on-cuda-cores`, `LILY_EXACT_ROUTER_TC=0`).
    pub exact_router_on_tensor_cores: bool,
    /// One-token steps (decode) run the fused kernels of decode.cu: the norms folded into the
    /// projections, one launch for the projections sharing an input, the MoE in two launches,
    /// DeltaNet's conv and recurrence in two (`--no-fused-decode`, `LILY_FUSED_DECODE=0`).
    pub fused_decode: bool,
    /// The decode kernels are launched as programmatic dependents on sm_90+ (PDL): each may start
    /// while the one before it finishes, loading its weights before it waits for its input
    /// (`--no-dependent-launch`, `LILY_PDL=0`).
    pub dependent_launch: bool,
    /// Every decode kernel lets the next one launch as soon as its own early weight loads are
    /// issued (griddepcontrol.launch_dependents before its wait), instead of after its last
    /// rows (`--no-early-trigger`, `LILY_EARLY_TRIGGER=0`): +6 % at 4K on the H200.
    pub early_trigger: bool,
    /// A sampled pick's first pass (top_k of the 248K scaled logits) runs over many blocks
    /// (`sample_part`), the rest in one; else all in one block (`--one-block-sampling`,
    /// `LILY_SAMPLE_PARTS=0`).
    pub multi_block_sampling: bool,
    /// The radix select of a sampled pick finds each pass's bin with one warp's shuffle scan
    /// instead of one thread walking the 256 bins (`--no-warp-scan-sampling` keeps the walk,
    /// `LILY_WARP_SCAN=0`). On: the sampler's share of a step at 4K fell from 3.2 % to 1.8 % on
    /// the H200 (docs/perf-notes.md).
    pub warp_scan_sampling: bool,
    /// One-token split-KV attention multiplies on the tensor cores (attn_split_mma: q, P and the
    /// cache in bf16, f32 sums) instead of CUDA-core FMAs (`--no-mma-attention`,
    /// `LILY_MMA_ATTENTION=0`). bf16 activations only.
    pub mma_attention: bool,
    /// One-token tensor-core attention does attn_qk_prep's work (q/k norms, RoPE, the cache
    /// write) in its own blocks, one launch fewer per attention layer (`--no-fused-attn-prep`,
    /// `LILY_FUSED_ATTN_PREP=0`). On: decode −24…−38 µs a token at 256 and 4K on the H200,
    /// +25 µs at 128K (docs/perf-notes.md, session 7).
    pub fused_attn_prep: bool,
    /// Past this many keys, one-token tensor-core attention with head dim 256 takes the _long
    /// split kernels (`attention::SPLIT_LONG_KEYS`, 65,536, by default; `LILY_SPLIT_LONG_KEYS=N`;
    /// 0: always, a number past the context: never).
    pub split_long_keys: usize,
    /// Prefill's 4-bit projections with Hopper's warpgroup MMA on sm_90a for chunks of at least
    /// `wgmma_min_tok` tokens: each projection's input staged once as bf16 (`to_bf16`), then
    /// gemm_dense_wgb / gemm_dense_wgb256 for dense projections and gemm_grouped_wgb64 / _wgb128
    /// for the experts' tiles, instead of mma.sync (`--no-wgmma-gemm`, `LILY_WGMMA_GEMM=0`). On
    /// the H200: 336 against gemm_dense's 118 TFLOP/s at 4,096 tokens; prefill 512 7,770 → 8,716,
    /// 4K 14,200 → 20,040 tok/s (docs/perf-notes.md, session 8).
    pub wgmma_gemm: bool,
    /// With `wgmma_gemm`: tokens a block of the dense wgmma GEMM for chunks of at least
    /// gemm::WGB256_MIN_TOK tokens, 256 (gemm_dense_wgb256: 336 TFLOP/s at 4,096 tokens on the
    /// H200) or 128 (gemm_dense_wgb: 253; `LILY_WGB_TOK=128`); smaller chunks take 128 (at 512
    /// tokens 13.0 against 19.3 µs).
    pub wgb_tok: usize,
    /// With `wgmma_gemm`: the fewest tokens of a chunk whose projections take the wgmma kernels
    /// (WGMMA_MIN_TOK; `LILY_WGMMA_MIN_TOK=N`, at least 128).
    pub wgmma_min_tok: usize,
    /// With `wgmma_gemm`: items a tile of the routed experts' wgmma GEMM once experts average
    /// three quarters of it, 128 (gemm_grouped_wgb128: prefill +0.8…1.3 % at 4K…128K on the H200)
    /// or 64 (gemm_grouped_wgb64; `LILY_WGMMA_GROUP_TILE=64`).
    pub wgmma_group_tile: usize,
    /// With `wgmma_gemm`: the routed experts of a staged chunk whose experts average fewer than
    /// 48 items (a 512-token chunk: 16) take gemm_grouped_wgb64's tiles of 64 instead of
    /// gemm_grouped32's (mma.sync) tiles of 32 (`--no-wgmma-small-tiles`,
    /// `LILY_WGMMA_SMALL_TILES=0`): such a chunk is bound by streaming the experts' weights.
    pub wgmma_small_tiles: bool,
    /// The router's split-precision GEMM on tensor cores splits its 2,048 columns into up to 8
    /// runs of k-steps where its grid is shallow (a 512-token chunk: 16 blocks of 64 tokens × 128
    /// experts, each walking all the columns in sequence), the parts added after in a fixed order
    /// (`--no-router-split-k`, `LILY_ROUTER_SPLIT_K=0`).
    pub router_split_k: bool,
    /// Prefill chunks of at least 1,024 tokens (attention::WGA_MIN_TOK) run their causal attention
    /// with Hopper's warpgroup MMA on sm_90a where the head dim is 256 (attn_prefill_wg: two
    /// query heads a block sharing the K/V tiles, S and P·V on wgmma) instead of mma.sync
    /// (attn_prefill; `--no-wgmma-attention`, `LILY_WGMMA_ATTENTION=0`). Needs `flash_prefill`.
    pub wgmma_attention: bool,
    /// Decode queues step N + 1's forward pass right after step N's pick, before the host has
    /// read token N (which comes back by an asynchronous copy into page-locked memory), so the
    /// device never waits for the host's read, callback and launch between tokens; a token that
    /// ends generation may then have been fed (`Backend::decode`). Never with top log-probabilities
    /// or host sampling, which read step N's logits (`--no-pipelined-decode`,
    /// `LILY_PIPELINED_DECODE=0`). On: the device's wait for the host fell from 27–33 to 3 µs a
    /// token on the H200 (docs/perf-notes.md, session 7).
    pub pipelined_decode: bool,
    /// Debug: synchronise after every launch so an error names its kernel (`LILY_CUDA_SYNC=1`).
    pub sync_each: bool,
    /// Debug: device time per kernel, printed at exit; graphs off (`LILY_PROFILE=1`).
    pub profile: bool,
    /// Diagnostic: each decode call logs the device's work per token (from the step's graph
    /// launch to the end of its pick, by events) beside the wall time per token, i.e. how long
    /// the device waits for the host between steps (`LILY_STEP_TIMING=1`).
    pub step_timing: bool,
}

impl Default for CudaOptions {
    fn default() -> CudaOptions {
        CudaOptions {
            ordinal: 0,
            bf16_activations: true,
            chunk: DEFAULT_PREFILL_CHUNK,
            graphs: true,
            moe_grouped: true,
            flash_prefill: true,
            split_kv: true,
            device_sampling: true,
            tensor_cores: true,
            exact_router_on_tensor_cores: true,
            fused_decode: true,
            dependent_launch: true,
            early_trigger: true,
            multi_block_sampling: true,
            warp_scan_sampling: true,
            mma_attention: true,
            fused_attn_prep: true,
            split_long_keys: crate::kernels::attention::SPLIT_LONG_KEYS,
            wgmma_gemm: true,
            wgb_tok: 256,
            wgmma_min_tok: WGMMA_MIN_TOK,
            wgmma_group_tile: 128,
            wgmma_small_tiles: true,
            router_split_k: true,
            wgmma_attention: true,
            pipelined_decode: true,
            sync_each: false,
            profile: false,
            step_timing: false,
        }
    }
}

/// The fewest tokens of a prefill chunk whose projections take the wgmma kernels under
/// `wgmma_gemm`: at 512 tokens gemm_dense_wgb runs 13.0 against gemm_dense's 17.3 µs (2048×512)
/// and a 512-token prefill 7,770 → 8,716 tok/s on the H200 (docs/perf-notes.md, session 8);
/// shorter chunks are not measured and keep mma.sync.
pub const WGMMA_MIN_TOK: usize = 512;

impl CudaOptions {
    /// The documented environment overrides, applied on top of these options. This is the one
    /// place the backend reads `LILY_*` variables. A switch set to `1` turns its path on, `0` off;
    /// any other value (or none) leaves the option as it is.
    ///
    /// | variable | option |
    /// |---|---|
    /// | `LILY_CUDA_DEVICE=N` | `ordinal` |
    /// | `LILY_CUDA_FP32=1` | fp32 activations (`bf16_activations = false`) |
    /// | `LILY_PREFILL_CHUNK=N` (N > 0) | `chunk` |
    /// | `LILY_CUDA_GRAPH=0` | `graphs` |
    /// | `LILY_MOE_GROUPED=0` | `moe_grouped` |
    /// | `LILY_ATTN_PREFILL=0` | `flash_prefill` |
    /// | `LILY_SPLIT_KV=0` | `split_kv` |
    /// | `LILY_DEVICE_SAMPLING=0` | `device_sampling` |
    /// | `LILY_TENSOR_CORES=0` | `tensor_cores` |
    /// | `LILY_EXACT_ROUTER_TC=0` | `exact_router_on_tensor_cores` |
    /// | `LILY_FUSED_DECODE=0` | `fused_decode` |
    /// | `LILY_PDL=0` | `dependent_launch` |
    /// | `LILY_EARLY_TRIGGER=0` | `early_trigger` |
    /// | `LILY_SAMPLE_PARTS=0` | `multi_block_sampling` |
    /// | `LILY_MMA_ATTENTION=0` | `mma_attention` |
    /// | `LILY_FUSED_ATTN_PREP=0` | `fused_attn_prep` |
    /// | `LILY_SPLIT_LONG_KEYS=N` | `split_long_keys` |
    /// | `LILY_WGMMA_GEMM=0` | `wgmma_gemm` |
    /// | `LILY_WGB_TOK=N` (128 or 256) | `wgb_tok` |
    /// | `LILY_WGMMA_MIN_TOK=N` (N ≥ 128) | `wgmma_min_tok` |
    /// | `LILY_WGMMA_GROUP_TILE=N` (64 or 128) | `wgmma_group_tile` |
    /// | `LILY_WGMMA_SMALL_TILES=0` | `wgmma_small_tiles` |
    /// | `LILY_ROUTER_SPLIT_K=0` | `router_split_k` |
    /// | `LILY_WGMMA_ATTENTION=0` | `wgmma_attention` |
    /// | `LILY_WARP_SCAN=0` | `warp_scan_sampling` |
    /// | `LILY_PIPELINED_DECODE=0` | `pipelined_decode` |
    /// | `LILY_CUDA_SYNC=1` | `sync_each` |
    /// | `LILY_PROFILE=1` | `profile` |
    /// | `LILY_STEP_TIMING=1` | `step_timing` |
    pub fn with_env_overrides(self) -> CudaOptions {
        self.with_overrides(|k| std::env::var(k).ok())
    }

    /// `with_env_overrides` with the variables looked up by `var` (tests).
    pub fn with_overrides(mut self, var: impl Fn(&str) -> Option<String>) -> CudaOptions {
        let switch = |k: &str| match var(k).as_deref() {
            Some("1") => Some(true),
            Some("0") => Some(false),
            _ => None,
        };
        let number = |k: &str| var(k).and_then(|v| v.parse::<usize>().ok());
        if let Some(n) = number("LILY_CUDA_DEVICE") {
            self.ordinal = n;
        }
        if let Some(fp32) = switch("LILY_CUDA_FP32") {
            self.bf16_activations = !fp32;
        }
        if let Some(n) = number("LILY_PREFILL_CHUNK").filter(|&c| c > 0) {
            self.chunk = n;
        }
        if let Some(n) = number("LILY_WGB_TOK").filter(|&t| t == 128 || t == 256) {
            self.wgb_tok = n;
        }
        if let Some(n) = number("LILY_WGMMA_GROUP_TILE").filter(|&t| t == 64 || t == 128) {
            self.wgmma_group_tile = n;
        }
        if let Some(n) = number("LILY_WGMMA_MIN_TOK").filter(|&t| t >= 128) {
            self.wgmma_min_tok = n;
        }
        if let Some(n) = number("LILY_SPLIT_LONG_KEYS") {
            self.split_long_keys = n;
        }
        let flags: [(&str, &mut bool); 22] = [
            ("LILY_CUDA_GRAPH", &mut self.graphs),
            ("LILY_MOE_GROUPED", &mut self.moe_grouped),
            ("LILY_ATTN_PREFILL", &mut self.flash_prefill),
            ("LILY_SPLIT_KV", &mut self.split_kv),
            ("LILY_DEVICE_SAMPLING", &mut self.device_sampling),
            ("LILY_TENSOR_CORES", &mut self.tensor_cores),
            (
                "LILY_EXACT_ROUTER_TC",
                &mut self.exact_router_on_tensor_cores,
            ),
            ("LILY_FUSED_DECODE", &mut self.fused_decode),
            ("LILY_PDL", &mut self.dependent_launch),
            ("LILY_EARLY_TRIGGER", &mut self.early_trigger),
            ("LILY_SAMPLE_PARTS", &mut self.multi_block_sampling),
            ("LILY_MMA_ATTENTION", &mut self.mma_attention),
            ("LILY_FUSED_ATTN_PREP", &mut self.fused_attn_prep),
            ("LILY_WGMMA_GEMM", &mut self.wgmma_gemm),
            ("LILY_WGMMA_SMALL_TILES", &mut self.wgmma_small_tiles),
            ("LILY_ROUTER_SPLIT_K", &mut self.router_split_k),
            ("LILY_WGMMA_ATTENTION", &mut self.wgmma_attention),
            ("LILY_WARP_SCAN", &mut self.warp_scan_sampling),
            ("LILY_PIPELINED_DECODE", &mut self.pipelined_decode),
            ("LILY_CUDA_SYNC", &mut self.sync_each),
            ("LILY_PROFILE", &mut self.profile),
            ("LILY_STEP_TIMING", &mut self.step_timing),
        ];
        for (k, flag) in flags {
            if let Some(on) = switch(k) {
                *flag = on;
            }
        }
        self
    }
}

/// How a linear (y = W x) runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinearPath {
    /// gemm.cu `gemm_dense`: bf16 mma, fp32 sums (prefill chunks, bf16 mode).
    TensorCores,
    /// linear.cu `linear` / `linear_wide`: fp32 from the packed weights.
    CudaCores,
}

/// How the MoE router's logits are computed (always unrounded fp32 precision).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RouterPath {
    /// gemm.cu `gemm_dense_exact`: weights split into bf16 hi + lo, two mma.
    TensorCoresSplitPrecision,
    /// linear.cu `linear` / `linear_wide` storing exact sums.
    CudaCoresExact,
}

/// Which attention kernel runs (all take the same inputs and write the same output).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionPath {
    /// `attn_split` + `attn_split_combine` (flash-decoding over slices of the cache).
    SplitKv,
    /// `attn_prefill` (flash attention on tensor cores).
    FlashPrefill,
    /// `attn_decode`: one block per (token, query head).
    OneBlockPerHead,
}

/// How the routed experts of a step run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MoePath {
    /// moe_group into tiles of `tile` (32 or 64) items, then `gemm_grouped{tile}`.
    TensorCoreGrouped { tile: usize },
    /// moe_group into tiles of linear::GROUP_TILE items, then `linear_grouped`.
    Grouped,
    /// `linear_gather`: one expert per item.
    Gather,
}

/// How a block of a one-token step (decode) runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodePath {
    /// decode.cu: the block's norm folded into its projections, the projections of one input in
    /// one launch, the glue fused (see kernels/decode.rs).
    Fused,
    /// The same launches as a prefill chunk's, for one token.
    PerKernel,
}

/// Where the next token is picked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SamplingPath {
    /// `argmax_logprob` (greedy settings).
    DeviceGreedy,
    /// `sample_adjust` + `sample_pick` with the host-drawn uniform.
    Device,
    /// The host sampler on downloaded logits.
    Host,
}

/// Every path decision, resolved (see the module comment).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Plan {
    pub ordinal: usize,
    pub bf16_activations: bool,
    /// Largest prefill chunk: prefill runs in chunks of at most this many tokens.
    pub prefill_chunk: usize,
    tensor_cores: bool,
    exact_router_on_tensor_cores: bool,
    flash_prefill: bool,
    split_kv: bool,
    moe_grouped: bool,
    device_sampling: bool,
    graphs: bool,
    fused_decode: bool,
    dependent_launch: bool,
    switches: KernelSwitches,
    checks: LaunchChecks,
    /// `CudaOptions::step_timing`.
    pub step_timing: bool,
    /// `CudaOptions::pipelined_decode` (where it applies: `Plan::pipelined_decode`).
    pipelined_decode: bool,
}

impl Plan {
    /// `opts` with the environment overrides, resolved: tensor cores and flash prefill need bf16
    /// activations.
    pub fn new(opts: &CudaOptions) -> Plan {
        Plan::resolve(&opts.clone().with_env_overrides())
    }

    /// `opts` exactly as given (no environment), resolved.
    pub fn resolve(o: &CudaOptions) -> Plan {
        Plan {
            ordinal: o.ordinal,
            bf16_activations: o.bf16_activations,
            prefill_chunk: o.chunk,
            tensor_cores: o.tensor_cores && o.bf16_activations,
            exact_router_on_tensor_cores: o.exact_router_on_tensor_cores,
            flash_prefill: o.flash_prefill && o.bf16_activations,
            split_kv: o.split_kv,
            moe_grouped: o.moe_grouped,
            device_sampling: o.device_sampling,
            graphs: o.graphs,
            fused_decode: o.fused_decode,
            dependent_launch: o.dependent_launch,
            switches: KernelSwitches {
                early_trigger: o.early_trigger,
                sample_parts: o.multi_block_sampling,
                sample_warp_scan: o.warp_scan_sampling,
                mma_attention: o.mma_attention && o.bf16_activations,
                fused_attn_prep: o.fused_attn_prep && o.mma_attention && o.bf16_activations,
                split_long_keys: o.split_long_keys,
                wgmma_gemm: o.wgmma_gemm && o.tensor_cores && o.bf16_activations,
                wgmma_min_tok: o.wgmma_min_tok,
                wgmma_group_tile: o.wgmma_group_tile,
                wgb_tok: o.wgb_tok,
                wgb256_min_tok: crate::kernels::gemm::WGB256_MIN_TOK,
                wgmma_small_tiles: o.wgmma_small_tiles,
                router_split_k: o.router_split_k,
                wgmma_attention: o.wgmma_attention && o.flash_prefill && o.bf16_activations,
            },
            checks: LaunchChecks {
                sync_each: o.sync_each,
                profile: o.profile,
            },
            step_timing: o.step_timing,
            pipelined_decode: o.pipelined_decode,
        }
    }

    /// Whether the tensor-core kernels serve this weight in this mode.
    fn on_tensor_cores(&self, w: &DevLinear) -> bool {
        self.tensor_cores && gemm::fits(w)
    }

    /// A step's linear: tensor cores for chunks of at least TENSOR_CORE_MIN_TOK tokens when the
    /// weight's layout fits, else CUDA cores.
    pub fn linear(&self, w: &DevLinear, n_tok: usize) -> LinearPath {
        if n_tok >= TENSOR_CORE_MIN_TOK && self.on_tensor_cores(w) {
            LinearPath::TensorCores
        } else {
            LinearPath::CudaCores
        }
    }

    /// The MoE router: like `linear`, and only if the split-precision kernel is wanted.
    pub fn router(&self, w: &DevLinear, n_tok: usize) -> RouterPath {
        if n_tok >= TENSOR_CORE_MIN_TOK
            && self.on_tensor_cores(w)
            && self.exact_router_on_tensor_cores
        {
            RouterPath::TensorCoresSplitPrecision
        } else {
            RouterPath::CudaCoresExact
        }
    }

    /// Split-KV for short steps (decode), flash attention for prefill chunks in bf16 mode,
    /// else one block per (token, query head).
    pub fn attention(&self, shape: AttnShape, n_tok: usize) -> AttentionPath {
        if self.split_kv && attention::split_kv_fits(shape, n_tok) {
            AttentionPath::SplitKv
        } else if self.flash_prefill
            && n_tok >= TENSOR_CORE_MIN_TOK
            && attention::prefill_fits(shape)
        {
            AttentionPath::FlashPrefill
        } else {
            AttentionPath::OneBlockPerHead
        }
    }

    /// The routed experts: grouped on tensor cores for chunks of at least TENSOR_CORE_MIN_TOK
    /// tokens (tiles of 64 items once experts average 48 or more, else 32: less padding),
    /// grouped on CUDA cores for other multi-token steps, gathered for one token.
    pub fn moe(&self, m: &DevMoe, shape: MoeShape, n_tok: usize) -> MoePath {
        let tensor_cores = [&m.gate, &m.up, &m.down]
            .iter()
            .all(|w| self.on_tensor_cores(w));
        if self.moe_grouped && n_tok >= TENSOR_CORE_MIN_TOK && tensor_cores {
            let items = n_tok * shape.top_k;
            let tile = if items >= 48 * shape.n_experts {
                64
            } else {
                32
            };
            MoePath::TensorCoreGrouped { tile }
        } else if self.moe_grouped && n_tok > 1 {
            MoePath::Grouped
        } else {
            MoePath::Gather
        }
    }

    /// One-token steps of an attention layer: fused when its weights are what decode.cu reads.
    pub fn decode_attention(&self, a: &DevAttention, n_tok: usize) -> DecodePath {
        let fits = [&a.q_proj, &a.k_proj, &a.v_proj]
            .iter()
            .all(|w| decode::serves(w) && w.cols == a.q_proj.cols)
            && decode::serves(&a.o_proj);
        self.fused_if(n_tok, fits)
    }

    /// One-token steps of a DeltaNet layer: fused when its weights and head shapes fit.
    pub fn decode_deltanet(&self, d: &DevDeltaNet, cfg: &ModelConfig, n_tok: usize) -> DecodePath {
        let fits = [&d.in_qkv, &d.in_z, &d.in_b, &d.in_a]
            .iter()
            .all(|w| decode::serves(w) && w.cols == d.in_qkv.cols)
            && decode::serves(&d.out_proj)
            && Decode::dn_serves(
                cfg.dn_k_heads,
                cfg.dn_v_heads,
                cfg.dn_k_dim,
                cfg.dn_v_dim,
                cfg.conv_kernel,
            );
        self.fused_if(n_tok, fits)
    }

    /// One-token steps of a MoE block: fused when every expert weight fits.
    pub fn decode_moe(&self, m: &DevMoe, shape: MoeShape, n_tok: usize) -> DecodePath {
        let fits = [&m.router, &m.shared_expert_gate]
            .iter()
            .all(|w| decode::serves(w) && w.cols == m.router.cols)
            && decode::glu_serves(&m.gate, &m.up, &m.shared_gate, &m.shared_up)
            && decode::down_serves(&m.down, &m.shared_down, shape.top_k);
        self.fused_if(n_tok, fits)
    }

    /// A single row through one weight (the lm_head of the last token): decode.cu's GEMV when
    /// the weight fits, else as `linear` says.
    pub fn one_row(&self, w: &DevLinear) -> DecodePath {
        self.fused_if(1, decode::serves(w))
    }

    fn fused_if(&self, n_tok: usize, fits: bool) -> DecodePath {
        if self.fused_decode && n_tok == 1 && fits {
            DecodePath::Fused
        } else {
            DecodePath::PerKernel
        }
    }

    /// Greedy settings pick on the device (`argmax_logprob`); other settings the device sampler
    /// covers pick there when device sampling is on; the rest (top_k off or above 256) use the
    /// host sampler on downloaded logits.
    pub fn sampling(&self, p: &SamplingParams) -> SamplingPath {
        let greedy = p.temperature <= 0.0
            && p.logit_bias.is_empty()
            && p.presence_penalty == 0.0
            && p.frequency_penalty == 0.0
            && p.repetition_penalty == 1.0;
        if greedy {
            SamplingPath::DeviceGreedy
        } else if self.device_sampling && sampler::supports(p) {
            SamplingPath::Device
        } else {
            SamplingPath::Host
        }
    }

    /// Whether decode steps replay a captured CUDA graph (never with the debug checks on).
    pub fn decode_graphs(&self) -> bool {
        self.graphs && !self.checks.sync_each && !self.checks.profile
    }

    /// Decode without graphs from now on (capture failed).
    pub fn give_up_graphs(&mut self) {
        self.graphs = false;
    }

    /// Whether a decode call queues each next forward pass before the host reads the token it
    /// feeds (`CudaOptions::pipelined_decode`): only where the host reads nothing but the token
    /// and its log-probability, i.e. the pick is on the device and no top log-probabilities are
    /// asked for (both read the step's logits, which the next pass overwrites).
    pub fn pipelined_decode(&self, sampling: SamplingPath, top_logprobs: usize) -> bool {
        self.pipelined_decode && sampling != SamplingPath::Host && top_logprobs == 0
    }

    /// Whether kernels that wait for their predecessor are launched as programmatic dependents
    /// (the GPU must also support it: `Gpu::can_launch_dependents`).
    pub fn dependent_launch(&self) -> bool {
        self.dependent_launch
    }

    /// The decode and sampler kernels this plan picks (a GPU's `switches`).
    pub fn kernel_switches(&self) -> KernelSwitches {
        self.switches
    }

    /// The debug checks every launch gets.
    pub fn launch_checks(&self) -> LaunchChecks {
        self.checks
    }

    /// One line for logs: the mode and every switch.
    pub fn describe(&self) -> String {
        let on = |b: bool| if b { "on" } else { "off" };
        let sw = self.switches;
        format!(
            "{} activations, prefill chunk {}, tensor cores {}, router on tensor cores {}, flash prefill {}, split-KV {}, MoE grouping {}, device sampling {}, CUDA graphs {}, fused decode {}, dependent launch {}, early trigger {}, many-block sampling {}, warp-scan sampling {}, router split over its columns {}, tensor-core decode attention {} (fused prep {}), wgmma prefill GEMM {} ({} tokens a block, experts' tiles of 64 for few items {}), wgmma prefill attention {}, pipelined decode {}{}{}",
            if self.bf16_activations { "bf16" } else { "fp32" },
            self.prefill_chunk,
            on(self.tensor_cores),
            on(self.tensor_cores && self.exact_router_on_tensor_cores),
            on(self.flash_prefill),
            on(self.split_kv),
            on(self.moe_grouped),
            on(self.device_sampling),
            on(self.decode_graphs()),
            on(self.fused_decode),
            on(self.dependent_launch),
            on(sw.early_trigger),
            on(sw.sample_parts),
            on(sw.sample_warp_scan),
            on(sw.router_split_k),
            on(sw.mma_attention),
            on(sw.fused_attn_prep),
            on(sw.wgmma_gemm),
            sw.wgb_tok,
            on(sw.wgmma_small_tiles),
            on(sw.wgmma_attention),
            on(self.pipelined_decode),
            if self.checks.sync_each { ", sync after each launch" } else { "" },
            if self.checks.profile { ", profiling" } else { "" },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        }
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
            ("LILY_PDL", "0"),
            ("LILY_EARLY_TRIGGER", "0"),
            ("LILY_SAMPLE_PARTS", "0"),
            ("LILY_MMA_ATTENTION", "0"),
            ("LILY_FUSED_ATTN_PREP", "0"),
            ("LILY_SPLIT_LONG_KEYS", "4096"),
            ("LILY_WGMMA_GEMM", "0"),
            ("LILY_WGB_TOK", "128"),
            ("LILY_WGMMA_MIN_TOK", "1024"),
            ("LILY_WGMMA_GROUP_TILE", "64"),
            ("LILY_WGMMA_SMALL_TILES", "0"),
            ("LILY_ROUTER_SPLIT_K", "0"),
            ("LILY_WGMMA_ATTENTION", "0"),
            ("LILY_WARP_SCAN", "0"),
            ("LILY_PIPELINED_DECODE", "0"),
            ("LILY_CUDA_SYNC", "1"),
            ("LILY_PROFILE", "1"),
            ("LILY_STEP_TIMING", "1"),
        ]));
        assert_eq!(
            o,
            CudaOptions {
                ordinal: 2,
                bf16_activations: false,
                chunk: 256,
                graphs: false,
                moe_grouped: false,
                flash_prefill: false,
                split_kv: false,
                device_sampling: false,
                tensor_cores: false,
                exact_router_on_tensor_cores: false,
                fused_decode: false,
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
                router_split_k: false,
                wgmma_attention: false,
                pipelined_decode: false,
                sync_each: true,
                profile: true,
                step_timing: true,
            }
        );
        // A zero or unparsable chunk, or a switch that is neither 0 nor 1, changes nothing.
        let o = CudaOptions::default().with_overrides(env(&[
            ("LILY_PREFILL_CHUNK", "0"),
            ("LILY_SPLIT_KV", "yes"),
        ]));
        assert_eq!(o, CudaOptions::default());
    }

    #[test]
    fn tensor_cores_and_flash_prefill_need_bf16_activations() {
        let fp32 = Plan::resolve(&CudaOptions {
            bf16_activations: false,
            ..CudaOptions::default()
        });
        assert!(!fp32.tensor_cores && !fp32.flash_prefill);
        assert!(
            !fp32.kernel_switches().mma_attention
                && Plan::resolve(&CudaOptions::default())
                    .kernel_switches()
                    .mma_attention
        );
        let shape = AttnShape {
            n_q: 16,
            n_kv: 2,
            d: 256,
            rotary: 64,
            theta: 1e7,
            eps: 1e-6,
        };
        assert_eq!(fp32.attention(shape, 512), AttentionPath::OneBlockPerHead);
        let bf16 = Plan::resolve(&CudaOptions::default());
        assert_eq!(bf16.attention(shape, 512), AttentionPath::FlashPrefill);
        assert_eq!(bf16.attention(shape, 15), AttentionPath::OneBlockPerHead);
        assert_eq!(bf16.attention(shape, 1), AttentionPath::SplitKv);
        assert_eq!(bf16.attention(shape, 4), AttentionPath::SplitKv);
    }

    #[test]
    fn pipelined_decode_only_where_the_host_reads_just_the_token() {
        let on = Plan::resolve(&CudaOptions::default());
        assert!(on.pipelined_decode(SamplingPath::DeviceGreedy, 0));
        assert!(on.pipelined_decode(SamplingPath::Device, 0));
        assert!(!on.pipelined_decode(SamplingPath::Host, 0));
        assert!(!on.pipelined_decode(SamplingPath::DeviceGreedy, 3));
        let off = Plan::resolve(&CudaOptions {
            pipelined_decode: false,
            ..CudaOptions::default()
        });
        assert!(!off.pipelined_decode(SamplingPath::DeviceGreedy, 0));
        assert!(on.describe().contains("pipelined decode on"));
        assert!(off.describe().contains("pipelined decode off"));
    }

    #[test]
    fn debug_checks_turn_graphs_off() {
        let p = Plan::resolve(&CudaOptions {
            profile: true,
            ..CudaOptions::default()
        });
        assert!(!p.decode_graphs());
        assert!(Plan::resolve(&CudaOptions::default()).decode_graphs());
    }
}
