//! Picking the backend that runs the model: `--device auto|cpu|cuda|wgpu`, and the GPU backends'
//! flags (`BackendArgs`: lily-cuda's and lily-wgpu's option tables, flattened into serve,
//! generate, bench and score).

use std::marker::PhantomData;
use std::path::Path;
use std::sync::Arc;

use anyhow::Result;
use clap::{Arg, ArgAction, ArgMatches, ValueEnum};
use lily_core::backend::Backend;
use lily_core::checkpoint::{load, LoadOptions};
use lily_core::cpu::CpuBackend;
use lily_core::options::Options;
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
    /// whose name contains `--wgpu-adapter` ($LILY_WGPU_ADAPTER) when given.
    Wgpu,
}

/// How the GPU backends run (each ignored by the others): the flags of lily-cuda's and
/// lily-wgpu's option tables.
#[derive(clap::Args, Clone, Debug, Default, PartialEq, Eq)]
pub struct BackendArgs {
    #[command(flatten)]
    pub cuda: CudaArgs,
    #[command(flatten)]
    pub wgpu: WgpuArgs,
}

/// The CUDA backend's flags (`lily_cuda::options`).
pub type CudaArgs = OptionArgs<CudaOptions>;
/// The wgpu backend's flags (`lily_wgpu::options`, all `--wgpu-*`).
pub type WgpuArgs = OptionArgs<WgpuOptions>;

/// A backend's flags: those of its option table (`Options::SWITCHES`, `KNOBS` and `TEXTS`, each
/// with its help and environment override), added to the command by `augment_args` and read
/// back into the options they set, with no code per option here. The defaults are the
/// configuration that ships; the environment overrides apply on top, in the backend
/// (`with_env_overrides`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OptionArgs<O> {
    /// The switches whose flag was given (each flag sets the side its switch does not ship with).
    pub switches: Vec<&'static str>,
    /// The knobs whose flag was given, with their values.
    pub knobs: Vec<(&'static str, usize)>,
    /// The text options whose flag was given, with their texts.
    pub texts: Vec<(&'static str, String)>,
    backend: PhantomData<O>,
}

impl<O> Default for OptionArgs<O> {
    fn default() -> Self {
        OptionArgs {
            switches: Vec::new(),
            knobs: Vec::new(),
            texts: Vec::new(),
            backend: PhantomData,
        }
    }
}

impl<O: Options> OptionArgs<O> {
    /// The options these flags ask for (environment overrides apply later, in the backend).
    pub fn options(&self) -> O {
        let mut o = O::default();
        for s in O::SWITCHES
            .iter()
            .filter(|s| self.switches.contains(&s.field))
        {
            if let Some(v) = o.switch_mut(s.field) {
                *v = !s.default;
            }
        }
        for (field, n) in &self.knobs {
            if let Some(v) = o.knob_mut(field) {
                *v = *n;
            }
        }
        for (field, text) in &self.texts {
            // Parsed already by the flag's value parser.
            o.set_text(field, text);
        }
        o
    }
}

impl<O: Options> clap::Args for OptionArgs<O> {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        let mut cmd = cmd.next_help_heading(O::HEADING);
        for s in O::SWITCHES {
            if let Some(flag) = s.flag {
                cmd = cmd.arg(
                    Arg::new(s.key)
                        .long(flag)
                        .action(ArgAction::SetTrue)
                        .help(s.flag_help()),
                );
            }
        }
        for k in O::KNOBS {
            if let Some(flag) = k.flag {
                let (accepts, accepted) = (k.accepts, k.accepted);
                let parse = move |v: &str| -> Result<usize, String> {
                    match v.parse::<usize>() {
                        Ok(n) if accepts(n) => Ok(n),
                        _ => Err(format!("expected a whole number, {accepted}")),
                    }
                };
                cmd = cmd.arg(
                    Arg::new(k.key)
                        .long(flag)
                        .value_name("N")
                        .value_parser(parse)
                        .help(k.flag_help()),
                );
            }
        }
        let defaults = O::default();
        for t in O::TEXTS {
            if let Some(flag) = t.flag {
                let (field, accepted) = (t.field, t.accepted);
                let parse = move |v: &str| -> Result<String, String> {
                    if O::default().set_text(field, v) {
                        Ok(v.to_string())
                    } else {
                        Err(format!("expected {accepted}"))
                    }
                };
                let default = defaults.text(t.field).unwrap_or_default();
                let mut arg = Arg::new(t.key)
                    .long(flag)
                    .value_name(t.value_name)
                    .value_parser(parse)
                    .help(t.flag_help(&default));
                if let Some(alone) = t.alone {
                    // The flag alone stands for this text (a switch's flag that became a text
                    // option keeps working).
                    arg = arg.num_args(0..=1).default_missing_value(alone);
                }
                cmd = cmd.arg(arg);
            }
        }
        cmd
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_args(cmd)
    }
}

impl<O: Options> clap::FromArgMatches for OptionArgs<O> {
    fn from_arg_matches(m: &ArgMatches) -> Result<Self, clap::Error> {
        let switches = O::SWITCHES
            .iter()
            .filter(|s| s.flag.is_some() && m.get_flag(s.key))
            .map(|s| s.field)
            .collect();
        let knobs = O::KNOBS
            .iter()
            .filter(|k| k.flag.is_some())
            .filter_map(|k| m.get_one::<usize>(k.key).map(|n| (k.field, *n)))
            .collect();
        let texts = O::TEXTS
            .iter()
            .filter(|t| t.flag.is_some())
            .filter_map(|t| m.get_one::<String>(t.key).map(|v| (t.field, v.clone())))
            .collect();
        Ok(OptionArgs {
            switches,
            knobs,
            texts,
            backend: PhantomData,
        })
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
    args: &BackendArgs,
) -> Result<Box<dyn Backend>> {
    Ok(open_backend_with_weights(model, device, quantize, args)?.0)
}

/// `open_backend`, also handing back the weights (the bench counts the bytes a step moves).
pub fn open_backend_with_weights(
    model: &Path,
    device: Device,
    quantize: bool,
    args: &BackendArgs,
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
            ..args.wgpu.options()
        };
        Ok(Box::new(WgpuBackend::new(&weights, opts)?))
    };
    let backend = match device {
        Device::Cpu => cpu(),
        Device::Cuda => cuda_backend(&weights, &args.cuda.options())?,
        Device::Wgpu => wgpu(true)?,
        // Auto: the first of CUDA, wgpu on a hardware adapter, the CPU that starts here. A
        // software Vulkan (lavapipe) is never picked: the CPU backend is faster.
        Device::Auto => match cuda_backend(&weights, &args.cuda.options()) {
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

    use lily_wgpu::{Choice, DeviceLimits};

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        backend: BackendArgs,
    }

    #[test]
    fn no_flags_ask_for_the_configuration_that_ships() {
        let cli = Cli::parse_from(["lily-engine"]);
        assert_eq!(cli.backend.cuda.options(), CudaOptions::default());
        assert_eq!(cli.backend.wgpu.options(), WgpuOptions::default());
    }

    #[test]
    fn each_wgpu_flag_sets_its_option() {
        // Every flag of lily-wgpu's table, spelled out here (not from the table).
        let cli = Cli::parse_from([
            "lily-engine",
            "--wgpu-prefill-chunk",
            "256",
            "--wgpu-no-attend-tile",
            "--wgpu-no-subgroups",
            "--wgpu-f16-kv",
            "--wgpu-f16-tiles",
            "--wgpu-f16-acts",
            "--wgpu-no-coop",
            "--wgpu-no-coop-big",
            "--wgpu-no-attn-flat",
            "--wgpu-no-attn-v-early",
            "--wgpu-no-attn-split",
            "--wgpu-no-rows-early",
            "--wgpu-no-glu-early",
            "--wgpu-no-moe-rounds",
            "--wgpu-no-down-item-lanes",
            "--wgpu-no-rows-one-word",
            "--wgpu-no-router-lean",
            "--wgpu-no-dn-one-sync",
            "--wgpu-out-rows",
            "8",
            "--wgpu-dense-tile",
            "64",
            "--wgpu-coop-rows",
            "64",
            "--wgpu-limits",
            "apple",
            "--wgpu-adapter",
            "llvmpipe",
            "--prefill-chunk",
            "1024",
        ]);
        assert_eq!(
            cli.backend.wgpu.options(),
            WgpuOptions {
                chunk: 256,
                attn_tile: false,
                subgroups: false,
                f16_kv: Choice::On,
                f16_tiles: true,
                f16_acts: Choice::On,
                coop: false,
                coop_big: false,
                attn_flat: false,
                attn_v_early: false,
                attn_split: false,
                rows_early: false,
                glu_early: false,
                moe_rounds: false,
                down_item_lanes: false,
                rows_one_word: false,
                router_lean: false,
                dn_one_sync: false,
                out_rows: 8,
                dense_tile: 64,
                coop_rows: 64,
                limits: DeviceLimits::Apple,
                adapter: Some("llvmpipe".into()),
                ..WgpuOptions::default()
            }
        );
        // CUDA's flags set CUDA's options only, and the other way round.
        assert_eq!(cli.backend.cuda.options().chunk, 1024);
        let o = Cli::parse_from(["lily-engine", "--no-split-kv"]).backend;
        assert_eq!(o.wgpu.options(), WgpuOptions::default());
        let err = Cli::try_parse_from(["lily-engine", "--wgpu-limits", "metal"])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("adapter or apple"), "{err}");
        // The f16 choices take a value too (alone: on).
        let o = Cli::parse_from([
            "lily-engine",
            "--wgpu-f16-acts",
            "off",
            "--wgpu-f16-kv=auto",
        ])
        .backend;
        assert_eq!(
            (o.wgpu.options().f16_acts, o.wgpu.options().f16_kv),
            (Choice::Off, Choice::Auto)
        );
        let o = Cli::parse_from(["lily-engine", "--wgpu-f16-kv", "on", "--wgpu-f16-acts"]).backend;
        assert_eq!(
            (o.wgpu.options().f16_acts, o.wgpu.options().f16_kv),
            (Choice::On, Choice::On)
        );
        let err = Cli::try_parse_from(["lily-engine", "--wgpu-f16-acts", "yes"])
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("auto, on or off"), "{err}");
        assert!(Cli::try_parse_from(["lily-engine", "--wgpu-prefill-chunk", "0"]).is_err());
        // Debugging and measuring aids are environment only.
        assert!(Cli::try_parse_from(["lily-engine", "--wgpu-checked"]).is_err());
    }

    #[test]
    fn each_flag_sets_the_side_its_switch_does_not_ship_with() {
        // Every flag of the table at once, spelled out here (not from the table), and the
        // options written out field by field.
        let cli = Cli::parse_from([
            "lily-engine",
            "--prefill-chunk",
            "512",
            "--interleaved-chunk",
            "256",
            "--fp32-activations",
            "--no-cuda-graphs",
            "--no-split-kv",
            "--no-device-sampling",
            "--no-tensor-cores",
            "--no-flash-prefill",
            "--no-moe-grouping",
            "--router-on-cuda-cores",
            "--no-fused-decode",
            "--no-fused-batch",
            "--no-mma-rows",
            "--no-mma-rows-deep",
            "--no-router-rows-split",
            "--no-moe-int8",
            "--no-gemv-int8",
            "--no-gemv4w-sm-grid",
            "--no-down-96-regs",
            "--no-moe-int8-pairs",
            "--no-moe-grouped-rows",
            "--no-grouped-down-wide",
            "--no-grouped-moe-stream",
            "--no-batch-lean-glue",
            "--no-router-async-stage",
            "--mma-stage-rounds",
            "--no-batched-decode",
            "--no-tc-scan",
            "--no-dependent-launch",
            "--no-early-trigger",
            "--one-block-sampling",
            "--no-warp-scan-sampling",
            "--no-mma-attention",
            "--no-fused-attn-prep",
            "--no-wgmma-gemm",
            "--no-wgmma-attention",
            "--no-wgmma-small-tiles",
            "--no-wgmma-narrow-tiles",
            "--no-wgmma-tail-tiles",
            "--no-tile-grid-by-items",
            "--no-wgmma-lean-dequant",
            "--no-wgmma-hoisted-addrs",
            "--no-wgmma-attention-pipelined",
            "--no-moe-bulk",
            "--no-router-split-k",
            "--no-pipelined-decode",
            "--no-pipelined-batch",
            "--no-device-logprobs",
            "--kv-cache",
            "bf16",
        ]);
        let o = cli.backend.cuda.options();
        assert_eq!(
            o,
            CudaOptions {
                ordinal: 0,
                bf16_activations: false,
                chunk: 512,
                interleaved_chunk: 256,
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
                mma_rows_deep: false,
                router_rows_split: false,
                moe_int8: false,
                gemv_int8: false,
                gemv4w_sm_grid: false,
                down_96_regs: false,
                moe_bulk: false,
                moe_int8_pairs: false,
                moe_grouped_rows: false,
                grouped_down_wide: false,
                grouped_moe_stream: false,
                batch_lean_glue: false,
                router_async_stage: false,
                mma_stage_rounds: true,
                kv_cache: lily_cuda::KvCacheKind::Bf16,
                batched_decode: false,
                tc_scan: false,
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
