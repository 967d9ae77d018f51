//! GPU tests: every kernel against the CPU backend's same step (lily_core::cpu::ops) on random,
//! never-zero inputs, outputs poisoned with NaN before each run; then the whole model, CUDA vs
//! CPU, on the tiny and small synthetic checkpoints. They need an NVIDIA GPU and NVRTC, so they
//! are ignored by default; scripts/gpu_check.sh runs them with `--ignored` on the GPU machine.
//!
//! Tolerances (relative L2 error, ‖gpu − cpu‖ / ‖cpu‖) are stated per test: fp32 kernels differ
//! from the CPU only in summation order, so 1e-5 for single matmuls and norms, 1e-4 for blocks
//! that chain several steps; the whole model in fp32-activation mode must be under 1e-3.
//!
//! One module per kernel file (`X.rs` tests `shaders/cuda/X.cu` through `kernels/X.rs`), then the
//! whole model (`model.rs`), pipelined decode (`pipeline.rs`) and the batched decode step (`batch.rs`); `common.rs` holds what several
//! share. Test names keep the words scripts/gpu_check.sh filters on (`model_`, `decode_`).

mod attention;
mod batch;
mod common;
mod decode;
mod deltanet;
mod embed;
mod gemm;
mod linear;
mod model;
mod moe;
mod norm;
mod pipeline;
mod sample;
