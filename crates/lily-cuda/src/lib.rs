//! lily-cuda: the CUDA backend. The driver API and NVRTC are loaded at run time (cudarc with
//! dynamic loading + our own NVRTC finder), so the one `lily-engine` binary builds with no CUDA
//! toolkit and picks CUDA only when a usable GPU and NVRTC are present.

//!
//! Modules, runtime first (each uses only those above it): `gpu` (context, stream, buffers,
//! module loading, launches) ← `pinned` (page-locked host memory for copies that overlap the
//! GPU's work) ← `weights` ← `kernels` (one launcher module per kernel file) ←
//! `options` (the switches and knobs, declared once) ← `plan` (every path decision) ← `forward` ← `backend`.

pub mod backend;
pub mod cache;
pub mod forward;
pub mod gpu;
pub mod graph;
pub mod kernels;
pub mod nvrtc;
pub mod options;
pub mod pinned;
pub mod plan;
pub mod sampler;
pub mod weights;

pub use backend::cuda_backend;
pub use backend::CudaBackend;
pub use plan::{CudaOptions, KvCacheKind, Plan};
