//! Device selection for `--device auto|cpu|cuda` (the server and `generate` call this).

use anyhow::{bail, Result};
use lily_core::backend::Backend;
use lily_core::weights::ModelWeights;

use crate::backend::{CudaBackend, CudaOptions};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceChoice {
    Auto,
    Cpu,
    Cuda,
}

impl std::str::FromStr for DeviceChoice {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(DeviceChoice::Auto),
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" => Ok(DeviceChoice::Cuda),
            other => bail!("--device {other:?}: expected auto, cpu or cuda"),
        }
    }
}

/// The CUDA backend for `opts` (the environment overrides apply on top, plan.rs), or the reason
/// it cannot run here (no driver, no GPU, no NVRTC, ...).
pub fn cuda_backend(weights: &ModelWeights, opts: &CudaOptions) -> Result<Box<dyn Backend>> {
    Ok(Box::new(CudaBackend::new(weights, opts.clone())?))
}

/// `Cuda` → the CUDA backend or its error; `Cpu` → `cpu()`; `Auto` → CUDA if it starts, else
/// `cpu()` with one log line saying why.
pub fn select_backend(
    choice: DeviceChoice,
    weights: &ModelWeights,
    opts: &CudaOptions,
    cpu: impl FnOnce() -> Result<Box<dyn Backend>>,
) -> Result<Box<dyn Backend>> {
    match choice {
        DeviceChoice::Cpu => cpu(),
        DeviceChoice::Cuda => cuda_backend(weights, opts),
        DeviceChoice::Auto => match cuda_backend(weights, opts) {
            Ok(b) => Ok(b),
            Err(e) => {
                tracing::info!(
                    "device auto: using the CPU because CUDA is unavailable: {}",
                    one_line(&e)
                );
                cpu()
            }
        },
    }
}

fn one_line(e: &anyhow::Error) -> String {
    format!("{e:#}")
        .lines()
        .map(str::trim)
        .collect::<Vec<_>>()
        .join("; ")
}
