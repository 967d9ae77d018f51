//! lily-wgpu: the wgpu backend, WGSL kernels on Metal (macOS), Vulkan (Linux, Windows, the
//! H200) and Mesa's lavapipe (CPU Vulkan, in CI). The whole model runs on the GPU with fp32
//! DeltaNet state, residual stream and sums, its activations and KV cache in f16 on Apple and
//! NVIDIA GPUs and in fp32 elsewhere (`plan::f16_rule`); weights stay in their checkpoint form
//! (MLX 4/8-bit or bf16) in slices under the device's largest storage binding.
//!
//! Modules, runtime first (each uses only those above it): `shaders` (the WGSL sources and what
//! each kernel needs from the device) ← `gpu` (adapter, device, buffers, the dispatch recorder)
//! ← `weights` ← `options` (each option declared once; the environment read in one function)
//! ← `plan` (the options resolved into the kernel each launch site runs) ← `kernels` (the
//! plan's kernels compiled) ← `forward` ← `probes` (kernels against the
//! host, at load and in tests) ← `backend`. Kernels use at most 7 storage bindings each and
//! never assume a subgroup width.

pub mod backend;
pub mod forward;
pub mod gpu;
pub mod kernels;
pub mod options;
pub mod plan;
pub mod probes;
pub mod shaders;
pub mod weights;

pub use backend::WgpuBackend;
pub use gpu::DeviceLimits;
pub use gpu::{adapters_found, describe_adapter, profile};
pub use options::{Choice, WgpuOptions};
pub use plan::Plan;
