//! lily-cuda: the CUDA backend. The driver API and NVRTC are loaded at run time (cudarc with
//! dynamic loading + our own NVRTC finder), so the one `lily-engine` binary builds with no CUDA
//! toolkit and picks CUDA only when a usable GPU and NVRTC are present.

pub mod backend;
pub mod cache;
pub mod device;
pub mod forward;
pub mod graph;
pub mod nvrtc;
pub mod ops;
pub mod sampler;
pub mod select;
pub mod sources;
pub mod weights;

pub use backend::{CudaBackend, CudaOptions};
pub use select::{cuda_backend, select_backend, DeviceChoice};
