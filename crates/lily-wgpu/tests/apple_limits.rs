//! Apple's limits as a tested contract (issue 29): every test of tests/model.rs again, with the
//! device created under an Apple GPU's limits through wgpu's Metal backend
//! (`lily_wgpu::gpu::apple_limits`: 32 KiB of workgroup memory, 1,024 invocations, 29 storage
//! buffers a stage, 1 GiB buffers), so that the plan's choices for a Mac (attend_tile with blocks
//! of 16 keys) run on lavapipe in CI. support::limits() tells the two binaries apart.

#[path = "model.rs"]
mod model;
