//! Picking the backend that runs the model: `--device auto|cpu|cuda|wgpu`, and the CUDA backend's
//! flags (`CudaArgs`, flattened into serve, generate, bench and score).

use std::path::Path;
use std::sync::Arc;

use anyhow::Result;
use clap::{Arg, ArgAction, ArgMatches, ValueEnum};
use lily_core::backend::Backend;
use lily_core::checkpoint::{load, LoadOptions};
use lily_core::cpu::CpuBackend;
use lily_cuda::options::{KNOBS, SWITCHES};
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

/// How the CUDA backend runs (ignored on the CPU): the flags of lily-cuda's option table
/// (`lily_cuda::options::SWITCHES` and `KNOBS`, each with its help and environment override),
/// added to the command by `augment_args` and read back into the options they set, with no code
/// per switch here. The defaults are the configuration that ships; the environment overrides
/// apply on top, in lily-cuda (`CudaOptions::with_env_overrides`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CudaArgs {
    /// The switches whose flag was given (each flag sets the side its switch does not ship with).
    pub switches: Vec<&'static str>,
    /// The knobs whose flag was given, with their values.
    pub knobs: Vec<(&'static str, usize)>,
}

impl CudaArgs {
    /// The options these flags ask for (environment overrides apply later, in lily-cuda).
    pub fn options(&self) -> CudaOptions {
        let mut o = CudaOptions::default();
        for s in SWITCHES.iter().filter(|s| self.switches.contains(&s.field)) {
            if let Some(v) = o.switch_mut(s.field) {
                *v = !s.default;
            }
        }
        for (field, n) in &self.knobs {
            if let Some(v) = o.knob_mut(field) {
                *v = *n;
            }
        }
        o
    }
}

impl clap::Args for CudaArgs {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        let mut cmd = cmd.next_help_heading("CUDA backend");
        for s in SWITCHES {
            if let Some(flag) = s.flag {
                cmd = cmd.arg(
                    Arg::new(s.field)
                        .long(flag)
                        .action(ArgAction::SetTrue)
                        .help(s.flag_help()),
                );
            }
        }
        for k in KNOBS {
            if let Some(flag) = k.flag {
                let (accepts, accepted) = (k.accepts, k.accepted);
                let parse = move |v: &str| -> Result<usize, String> {
                    match v.parse::<usize>() {
                        Ok(n) if accepts(n) => Ok(n),
                        _ => Err(format!("expected a whole number, {accepted}")),
                    }
                };
                cmd = cmd.arg(
                    Arg::new(k.field)
                        .long(flag)
                        .value_name("N")
                        .value_parser(parse)
                        .help(k.flag_help()),
                );
            }
        }
        cmd
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_args(cmd)
    }
}

impl clap::FromArgMatches for CudaArgs {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        let switches = SWITCHES
            .iter()
            .filter(|s| s.flag.is_some() && m.get_flag(s.field))
            .map(|s| s.field)
            .collect();
        let knobs = KNOBS
            .iter()
            .filter(|k| k.flag.is_some())
            .filter_map(|k| m.get_one::<usize>(k.field).map(|n| (k.field, *n)))
            .collect();
        Ok(CudaArgs { switches, knobs })
    }

    fn update_from_arg_matches(&mut self, m: &ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(m)?;
        Ok(())
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
    fn each_flag_sets_the_side_its_switch_does_not_ship_with() {
        // Every flag of the table at once, spelled out here (not from the table), and the
        // options written out field by field.
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
            "--no-device-logprobs",
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
                wgmma_min_tok: lily_cuda::options::WGMMA_MIN_TOK,
                wgmma_group_tile: 128,
                wgmma_small_tiles: false,
                router_split_k: false,
                wgmma_attention: false,
                pipelined_decode: false,
                device_logprobs: false,
                sync_each: false,
                profile: false,
                step_timing: false,
            }
        );
    }

    #[test]
    fn a_knob_refuses_a_value_it_does_not_take() {
        let err = Cli::try_parse_from(["lily-engine", "--prefill-chunk", "0"])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("at least 1"), "{err}");
        assert!(Cli::try_parse_from(["lily-engine", "--prefill-chunk", "x"]).is_err());
        // Environment-only switches have no flag.
        assert!(Cli::try_parse_from(["lily-engine", "--sync-each"]).is_err());
    }
}
