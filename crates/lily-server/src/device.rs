//! Picking the backend that runs the model: `--device auto|cpu|cuda`.

use std::path::Path;
use std::sync::Arc;

use anyhow::Result;
use clap::ValueEnum;
use lily_core::backend::Backend;
use lily_core::checkpoint::{load, LoadOptions};
use lily_core::cpu::CpuBackend;
use lily_cuda::{select_backend, DeviceChoice};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Device {
    /// CUDA when a usable GPU and NVRTC are present, else the CPU (with one log line saying why).
    Auto,
    Cpu,
    Cuda,
}

/// Loads the checkpoint and builds the backend.
pub fn open_backend(model: &Path, device: Device, quantize: bool) -> Result<Box<dyn Backend>> {
    let weights = Arc::new(load(
        model,
        &LoadOptions {
            quantize_bits: quantize.then_some(4),
        },
    )?);
    let choice = match device {
        Device::Auto => DeviceChoice::Auto,
        Device::Cpu => DeviceChoice::Cpu,
        Device::Cuda => DeviceChoice::Cuda,
    };
    // Auto: CUDA if it starts here, else the CPU with one log line saying why (lily-cuda/select.rs).
    select_backend(choice, &weights, || Ok(Box::new(CpuBackend::new(weights.clone()))))
}
