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
pub use crate::options::{CudaOptions, DEFAULT_PREFILL_CHUNK, WGMMA_MIN_TOK};
use crate::sampler;
use crate::weights::{DevAttention, DevDeltaNet, DevLinear, DevMoe};

/// Fewest tokens of a step that take the tensor-core kernels (gemm.cu, `attn_prefill`): one
/// warp's 16 mma rows; shorter steps (decode) keep the CUDA-core kernels.
pub const TENSOR_CORE_MIN_TOK: usize = 16;
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
    /// The options as resolved (a switch that needs another one off where that one is off).
    effective: CudaOptions,
}

impl Plan {
    /// `opts` with the environment overrides, resolved: tensor cores and flash prefill need bf16
    /// activations.
    pub fn new(opts: &CudaOptions) -> Plan {
        Plan::resolve(&opts.clone().with_env_overrides())
    }

    /// `opts` exactly as given (no environment), resolved.
    pub fn resolve(o: &CudaOptions) -> Plan {
        let bf16 = o.bf16_activations;
        let effective = CudaOptions {
            tensor_cores: o.tensor_cores && bf16,
            exact_router_on_tensor_cores: o.exact_router_on_tensor_cores && o.tensor_cores && bf16,
            flash_prefill: o.flash_prefill && bf16,
            mma_attention: o.mma_attention && bf16,
            fused_attn_prep: o.fused_attn_prep && o.mma_attention && bf16,
            wgmma_gemm: o.wgmma_gemm && o.tensor_cores && bf16,
            wgmma_attention: o.wgmma_attention && o.flash_prefill && bf16,
            graphs: o.graphs && !o.sync_each && !o.profile,
            ..o.clone()
        };
        Plan {
            effective,
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

    /// One line for logs: every switch and knob as resolved (`CudaOptions::describe`).
    pub fn describe(&self) -> String {
        self.effective.describe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
