//! A decode step captured once as a CUDA graph and replayed for every token (PERFORMANCE.md §3,
//! "whole decode step captured as a CUDA graph"). This works because the step is position-free:
//! it reads its position and input token from the sequence's device memory, and every buffer it
//! touches exists for the sequence's lifetime. Switch: LILY_CUDA_GRAPH=0.

use anyhow::{anyhow, Result};
use cudarc::driver::{result, sys};

use crate::device::Gpu;

pub struct DecodeGraph {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
}

// SAFETY: the handles are plain driver objects, used only with their context bound.
unsafe impl Send for DecodeGraph {}

impl DecodeGraph {
    /// Records everything `record` launches on the GPU's stream into a graph.
    pub fn capture(gpu: &Gpu, record: impl FnOnce() -> Result<()>) -> Result<DecodeGraph> {
        let stream = gpu.stream.cu_stream();
        // SAFETY: a valid stream of the bound context; capture ends below on every path.
        unsafe {
            result::stream::begin_capture(
                stream,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        }
        .map_err(|e| anyhow!("begin graph capture: {e}"))?;
        let recorded = record();
        // SAFETY: ends the capture begun above.
        let ended = unsafe { result::stream::end_capture(stream) };
        recorded?;
        let graph = ended.map_err(|e| anyhow!("end graph capture: {e}"))?;
        // SAFETY: `graph` is the valid graph just captured.
        let exec =
            match unsafe { result::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) } {
                Ok(x) => x,
                Err(e) => {
                    // SAFETY: destroyed once, not used after.
                    let _ = unsafe { result::graph::destroy(graph) };
                    return Err(anyhow!("instantiate decode graph: {e}"));
                }
            };
        Ok(DecodeGraph { graph, exec })
    }

    pub fn launch(&self, gpu: &Gpu) -> Result<()> {
        // SAFETY: `exec` is a live executable graph of this context.
        unsafe { result::graph::launch(self.exec, gpu.stream.cu_stream()) }
            .map_err(|e| anyhow!("decode graph launch: {e}"))
    }
}

impl Drop for DecodeGraph {
    fn drop(&mut self) {
        // SAFETY: both handles were created by `capture` and are destroyed once.
        unsafe {
            let _ = result::graph::exec_destroy(self.exec);
            let _ = result::graph::destroy(self.graph);
        }
    }
}
