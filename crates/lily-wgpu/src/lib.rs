//! lily-wgpu: the wgpu backend, WGSL kernels on Metal (macOS), Vulkan (Linux, Windows, the
//! H200) and Mesa's lavapipe (CPU Vulkan, in CI). The whole model runs on the GPU with fp32
//! activations and fp32 DeltaNet state; weights stay in their checkpoint form (MLX 4/8-bit or
//! bf16) in slices under the device's largest storage binding.
//!
//! Modules, runtime first (each uses only those above it): `gpu` (adapter, device, buffers, the
//! dispatch recorder) ← `kernels` (shaders/wgsl/) ← `weights` ← `forward` ← `backend`.
//! Kernels use at most 7 storage bindings each and never assume a subgroup width.

pub mod backend;
pub mod forward;
pub mod gpu;
pub mod kernels;
pub mod weights;

pub use backend::{MmT32, WgpuBackend, WgpuOptions};
pub use gpu::{adapters_found, describe_adapter, profile};
