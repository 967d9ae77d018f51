//! Picking the backend that runs the model: `--device auto|cpu|cuda|wgpu`, and the CUDA backend's
//! path switches (`CudaArgs`, flattened into serve, generate, bench and score).

use std::path::Path;
use std::sync::Arc;

use anyhow::Result;
use clap::{Args, ValueEnum};
use lily_core::backend::Backend;
use lily_core::checkpoint::{load, LoadOptions};
use lily_core::cpu::CpuBackend;
use lily_cuda::{cuda_backend, CudaOptions};
use lily_wgpu::{WgpuBackend, WgpuOptions};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Device {
    /// CUDA when a usable GPU and NVRTC are present, else wgpu on a hardware GPU (Metal on macOS,
    /// Vulkan elsewhere), else the CPU; one log line says what was chosen and why.
    Auto,
    Cpu,
    Cuda,
    /// The wgpu backend on the best adapter, a software one (lavapipe) included; the adapter
    /// whose name contains $LILY_WGPU_ADAPTER when set.
    Wgpu,
}

/// How the CUDA backend runs (ignored on the CPU). Every switch turns one optimisation off so its
/// effect can be measured; the defaults are the configuration that ships. The environment
/// variable named in each help text overrides the flag (lily-cuda/src/plan.rs).
#[derive(Args, Clone, Debug, Default)]
#[command(next_help_heading = "CUDA backend")]
pub struct CudaArgs {
    /// Largest prefill chunk in tokens (activation scratch is sized for it) [default: 4096;
    /// env LILY_PREFILL_CHUNK].
    #[arg(long, value_name = "N")]
    pub prefill_chunk: Option<usize>,
    /// Keep activations and the KV cache in fp32 (parity with the CPU backend) instead of
    /// bf16; also turns off the tensor-core paths [env LILY_CUDA_FP32=1].
    #[arg(long)]
    pub fp32_activations: bool,
    /// Decode with plain kernel launches instead of replaying a captured CUDA graph per step
    /// [env LILY_CUDA_GRAPH=0].
    #[arg(long)]
    pub no_cuda_graphs: bool,
    /// Decode attention with one block per query head instead of split-KV (flash-decoding)
    /// [env LILY_SPLIT_KV=0].
    #[arg(long)]
    pub no_split_kv: bool,
    /// Sample non-greedy settings on the host from downloaded logits instead of on the device
    /// (greedy always picks on the device) [env LILY_DEVICE_SAMPLING=0].
    #[arg(long)]
    pub no_device_sampling: bool,
    /// Run the linears of prefill chunks on CUDA cores instead of tensor cores
    /// [env LILY_TENSOR_CORES=0].
    #[arg(long)]
    pub no_tensor_cores: bool,
    /// Prefill attention with one block per (token, query head) instead of flash attention on
    /// tensor cores [env LILY_ATTN_PREFILL=0].
    #[arg(long)]
    pub no_flash_prefill: bool,
    /// Run prefill's routed experts one item at a time (gathered) instead of grouped by expert
    /// [env LILY_MOE_GROUPED=0].
    #[arg(long)]
    pub no_moe_grouping: bool,
    /// Compute the MoE router of prefill chunks on CUDA cores instead of on tensor cores in
    /// split precision (the same fp32 precision either way) [env LILY_EXACT_ROUTER_TC=0].
    #[arg(long)]
    pub router_on_cuda_cores: bool,
    /// Decode with the per-kernel launches of a prefill chunk instead of the fused one-token
    /// kernels (norms folded into the projections, the MoE in two launches)
    /// [env LILY_FUSED_DECODE=0].
    #[arg(long)]
    pub no_fused_decode: bool,
    /// Launch the decode kernels one after another instead of as programmatic dependents
    /// (sm_90+: a kernel starts while its predecessor finishes and loads its weights early)
    /// [env LILY_PDL=0].
    #[arg(long)]
    pub no_dependent_launch: bool,
    /// Let each decode kernel start the next one only after its last rows instead of as soon as
    /// its early weight loads are issued (sm_90+) [env LILY_EARLY_TRIGGER=0].
    #[arg(long)]
    pub no_early_trigger: bool,
    /// Run a sampled pick in one block instead of a many-block first pass
    /// [env LILY_SAMPLE_PARTS=0].
    #[arg(long)]
    pub one_block_sampling: bool,
    /// Find a sampled pick's radix-select bins with one thread walking them instead of one
    /// warp's scan [env LILY_WARP_SCAN=0].
    #[arg(long)]
    pub no_warp_scan_sampling: bool,
    /// One-token attention on CUDA cores instead of the tensor cores [env LILY_MMA_ATTENTION=0].
    #[arg(long)]
    pub no_mma_attention: bool,
    /// One-token tensor-core attention with a launch for the q/k norms, RoPE and cache write
    /// before it instead of inside its own blocks [env LILY_FUSED_ATTN_PREP=0].
    #[arg(long)]
    pub no_fused_attn_prep: bool,
    /// Prefill's 4-bit projections with mma.sync instead of Hopper's warpgroup MMA (sm_90a)
    /// [env LILY_WGMMA_GEMM=0].
    #[arg(long)]
    pub no_wgmma_gemm: bool,
    /// Prefill chunks' attention with mma.sync (attn_prefill) instead of Hopper's warpgroup MMA
    /// (attn_prefill_wg, sm_90a, head dim 256) [env LILY_WGMMA_ATTENTION=0].
    #[arg(long)]
    pub no_wgmma_attention: bool,
    /// Routed experts with few items a chunk on mma.sync's tiles of 32 instead of the wgmma
    /// kernel's tiles of 64 [env LILY_WGMMA_SMALL_TILES=0].
    #[arg(long)]
    pub no_wgmma_small_tiles: bool,
    /// The router's tensor-core GEMM over all its columns in each block instead of split into
    /// parts where its grid is shallow [env LILY_ROUTER_SPLIT_K=0].
    #[arg(long)]
    pub no_router_split_k: bool,
    /// Decode one step at a time (the host reads each token before queueing the next step)
    /// instead of pipelined [env LILY_PIPELINED_DECODE=0].
    #[arg(long)]
    pub no_pipelined_decode: bool,
}

impl CudaArgs {
    /// The options these flags ask for (environment overrides apply later, in lily-cuda).
    pub fn options(&self) -> CudaOptions {
        let d = CudaOptions::default();
        CudaOptions {
            chunk: self.prefill_chunk.unwrap_or(d.chunk),
            bf16_activations: !self.fp32_activations,
            graphs: !self.no_cuda_graphs,
            split_kv: !self.no_split_kv,
            device_sampling: !self.no_device_sampling,
            tensor_cores: !self.no_tensor_cores,
            flash_prefill: !self.no_flash_prefill,
            moe_grouped: !self.no_moe_grouping,
            exact_router_on_tensor_cores: !self.router_on_cuda_cores,
            fused_decode: !self.no_fused_decode,
            dependent_launch: !self.no_dependent_launch,
            early_trigger: !self.no_early_trigger,
            multi_block_sampling: !self.one_block_sampling,
            warp_scan_sampling: !self.no_warp_scan_sampling,
            mma_attention: !self.no_mma_attention,
            fused_attn_prep: !self.no_fused_attn_prep,
            wgmma_gemm: !self.no_wgmma_gemm,
            wgmma_attention: !self.no_wgmma_attention,
            wgmma_small_tiles: !self.no_wgmma_small_tiles,
            router_split_k: !self.no_router_split_k,
            pipelined_decode: !self.no_pipelined_decode,
            ..d
        }
    }
}

/// Loads the checkpoint and builds the backend.
pub fn open_backend(
    model: &Path,
    device: Device,
    quantize: bool,
    cuda: &CudaArgs,
) -> Result<Box<dyn Backend>> {
    Ok(open_backend_with_weights(model, device, quantize, cuda)?.0)
}

/// `open_backend`, also handing back the weights (the bench counts the bytes a step moves).
pub fn open_backend_with_weights(
    model: &Path,
    device: Device,
    quantize: bool,
    cuda: &CudaArgs,
) -> Result<(Box<dyn Backend>, Arc<lily_core::weights::ModelWeights>)> {
    let weights = Arc::new(load(
        model,
        &LoadOptions {
            quantize_bits: quantize.then_some(4),
        },
    )?);
    let cpu = || -> Box<dyn Backend> { Box::new(CpuBackend::new(weights.clone())) };
    let wgpu = |allow_software: bool| -> Result<Box<dyn Backend>> {
        let opts = WgpuOptions {
            allow_software,
            ..WgpuOptions::default()
        };
        Ok(Box::new(WgpuBackend::new(&weights, opts)?))
    };
    let backend = match device {
        Device::Cpu => cpu(),
        Device::Cuda => cuda_backend(&weights, &cuda.options())?,
        Device::Wgpu => wgpu(true)?,
        // Auto: the first of CUDA, wgpu on a hardware adapter, the CPU that starts here. A
        // software Vulkan (lavapipe) is never picked: the CPU backend is faster.
        Device::Auto => match cuda_backend(&weights, &cuda.options()) {
            Ok(b) => {
                tracing::info!("device auto: using CUDA, the first choice");
                b
            }
            Err(cuda_err) => match wgpu(false) {
                Ok(b) => {
                    tracing::info!(
                        "device auto: using wgpu ({}) because CUDA is unavailable: {}",
                        b.describe(),
                        one_line(&cuda_err)
                    );
                    b
                }
                Err(wgpu_err) => {
                    tracing::info!(
                        "device auto: using the CPU because CUDA is unavailable ({}) and wgpu has no GPU ({})",
                        one_line(&cuda_err),
                        one_line(&wgpu_err)
                    );
                    cpu()
                }
            },
        },
    };
    Ok((backend, weights))
}

fn one_line(e: &anyhow::Error) -> String {
    format!("{e:#}")
        .lines()
        .map(str::trim)
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        cuda: CudaArgs,
    }

    #[test]
    fn no_flags_ask_for_the_configuration_that_ships() {
        let cli = Cli::parse_from(["lily-engine"]);
        assert_eq!(cli.cuda.options(), CudaOptions::default());
    }

    #[test]
    fn each_flag_turns_its_path_off() {
        let cli = Cli::parse_from([
            "lily-engine",
            "--prefill-chunk",
            "512",
            "--fp32-activations",
            "--no-cuda-graphs",
            "--no-split-kv",
            "--no-device-sampling",
            "--no-tensor-cores",
            "--no-flash-prefill",
            "--no-moe-grouping",
            "--router-on-cuda-cores",
            "--no-fused-decode",
            "--no-dependent-launch",
            "--no-early-trigger",
            "--one-block-sampling",
            "--no-warp-scan-sampling",
            "--no-mma-attention",
            "--no-fused-attn-prep",
            "--no-wgmma-gemm",
            "--no-wgmma-attention",
            "--no-wgmma-small-tiles",
            "--no-router-split-k",
            "--no-pipelined-decode",
        ]);
        let o = cli.cuda.options();
        assert_eq!(
            o,
            CudaOptions {
                ordinal: 0,
                bf16_activations: false,
                chunk: 512,
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
                split_long_keys: lily_cuda::kernels::attention::SPLIT_LONG_KEYS,
                wgmma_gemm: false,
                wgb_tok: 256,
                wgmma_min_tok: lily_cuda::plan::WGMMA_MIN_TOK,
                wgmma_group_tile: 128,
                wgmma_small_tiles: false,
                router_split_k: false,
                wgmma_attention: false,
                pipelined_decode: false,
                sync_each: false,
                profile: false,
                step_timing: false,
            }
        );
    }
}
