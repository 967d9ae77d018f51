//! A decode step captured once as a CUDA graph and replayed for every token (PERFORMANCE.md §3,
//! "whole decode step captured as a CUDA graph"). This works because the step is position-free:
//! it reads its position and input token from the sequence's device memory, and every buffer it
//! touches exists for the sequence's lifetime. Switch: `--no-cuda-graphs` / LILY_CUDA_GRAPH=0
//! (plan.rs).

use anyhow::{anyhow, Result};
use cudarc::driver::{sys, CudaGraph};

use crate::gpu::Gpu;

pub struct DecodeGraph {
    graph: CudaGraph,
}

// SAFETY: the graph's handles are plain driver objects, used only by the backend that owns them,
// one call at a time, with their context bound (cudarc binds it in `launch`).
unsafe impl Send for DecodeGraph {}

impl DecodeGraph {
    /// Records everything `record` launches on the GPU's stream into a graph.
    pub fn capture(gpu: &Gpu, record: impl FnOnce() -> Result<()>) -> Result<DecodeGraph> {
        gpu.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| anyhow!("begin graph capture: {e}"))?;
        let recorded = record();
        // The capture ends on every path, also when recording failed (the stream would stay in
        // capture mode otherwise); a graph from a failed recording is dropped (destroyed).
        let ended = gpu.stream.end_capture(sys::CUgraphInstantiate_flags(0));
        recorded?;
        let graph = ended
            .map_err(|e| anyhow!("end graph capture / instantiate decode graph: {e}"))?
            .ok_or_else(|| anyhow!("graph capture recorded nothing"))?;
        Ok(DecodeGraph { graph })
    }

    pub fn launch(&self) -> Result<()> {
        self.graph
            .launch()
            .map_err(|e| anyhow!("decode graph launch: {e}"))
    }
}
