//! Page-locked host memory for copies that overlap the GPU's work (pipelined decode, backend.rs):
//! a copy is queued on a stream, an event after it, and the host waits for that event alone,
//! not for the stream, so the work queued behind the copy keeps the device busy meanwhile.

use std::sync::Arc;

use anyhow::{anyhow, bail, Result};
use cudarc::driver::{result, CudaEvent, CudaStream, PinnedHostSlice};

use crate::gpu::{DevBuf, Gpu};

/// A page-locked host buffer of u32 words for copies queued behind the GPU's stream's work, with
/// an event after the last one queued: the host waits for exactly that copy, not for the whole
/// stream, so work queued after the copy keeps the device busy meanwhile (pipelined decode,
/// backend.rs). One copy is in flight at a time: every host access to the words waits for the
/// last one.
pub struct Pinned {
    host: PinnedHostSlice<u32>,
    /// Recorded after the last queued copy (no timing: the lightest event to record and wait
    /// for; waiting spins or yields as the context's scheduling says, as a stream sync does).
    done: CudaEvent,
    /// Whether `done` was recorded since the last wait, i.e. a copy may still be running.
    in_flight: bool,
    /// `with_side_stream`: reads run on this stream, after an event recorded on the GPU's
    /// stream, so a read does not hold up the kernels queued behind it there.
    side: Option<(Arc<CudaStream>, CudaEvent)>,
}

impl Pinned {
    /// Copies both ways queued on the GPU's stream, in its order.
    pub fn new(gpu: &Gpu, words: usize) -> Result<Pinned> {
        gpu.bind()?;
        // Flags 0: cacheable memory (the default `alloc_pinned` is write-combined, slow for the
        // host to read back).
        // SAFETY: every bit pattern is a valid u32, so the uninitialised words are valid values.
        let host =
            unsafe { gpu.ctx.alloc_pinned_with_flags::<u32>(words.max(1), 0) }.map_err(|e| {
                anyhow!("cannot allocate {words} words of page-locked host memory: {e}")
            })?;
        let done = gpu
            .ctx
            .new_event(None)
            .map_err(|e| anyhow!("cannot create a CUDA event: {e}"))?;
        Ok(Pinned {
            host,
            done,
            in_flight: false,
            side: None,
        })
    }

    /// Reads (`queue_read`) on a stream of their own, started once the GPU's stream has reached
    /// the read (an event), so the kernels queued behind it on the GPU's stream start without
    /// waiting for the copy (a few µs for a few bytes). The caller's side of the bargain: nothing
    /// queued on the GPU's stream between `queue_read` and `wait` writes the words being read,
    /// and `wait` comes before their buffer can be freed. Writes still go on the GPU's stream,
    /// in its order.
    pub fn with_side_stream(gpu: &Gpu, words: usize) -> Result<Pinned> {
        let mut p = Pinned::new(gpu, words)?;
        let stream = gpu
            .ctx
            .new_stream()
            .map_err(|e| anyhow!("cannot create a CUDA stream: {e}"))?;
        let reached = gpu
            .ctx
            .new_event(None)
            .map_err(|e| anyhow!("cannot create a CUDA event: {e}"))?;
        p.side = Some((stream, reached));
        Ok(p)
    }

    /// Waits for the last queued copy (if any): errors of the work before it surface here.
    fn settle(&mut self) -> Result<()> {
        if self.in_flight {
            self.done
                .synchronize()
                .map_err(|e| anyhow!("waiting for a device copy: {e}"))?;
            self.in_flight = false;
        }
        Ok(())
    }

    fn queued(&mut self, stream: &CudaStream) -> Result<()> {
        if let Err(e) = self.done.record(stream) {
            // Without the event nothing could tell when the copy ends: wait for it here.
            let _ = stream.synchronize();
            bail!("recording a copy's event: {e}");
        }
        self.in_flight = true;
        Ok(())
    }

    /// Queues a copy of `n` words of `buf` from byte `offset` into this buffer, behind the work
    /// queued on the GPU's stream so far, then the event; `wait` hands them over. Returns at once.
    pub fn queue_read(&mut self, gpu: &Gpu, buf: &DevBuf, offset: usize, n: usize) -> Result<()> {
        self.settle()?;
        if n > self.host.len() || offset + 4 * n > buf.bytes {
            bail!(
                "device read of {n} words at byte {offset} out of bounds ({} pinned words, a {}-byte buffer)",
                self.host.len(),
                buf.bytes
            );
        }
        let stream = match &self.side {
            Some((side, reached)) => {
                reached
                    .record(&gpu.stream)
                    .map_err(|e| anyhow!("recording a read's start: {e}"))?;
                side.wait(reached)
                    .map_err(|e| anyhow!("ordering a read after the stream: {e}"))?;
                side.clone()
            }
            None => gpu.stream.clone(),
        };
        let dst = &mut self
            .host
            .as_mut_slice()
            .map_err(|e| anyhow!("pinned buffer: {e}"))?[..n];
        // SAFETY: the source range lies inside the allocation, which outlives the copy (on the
        // GPU's stream, freeing waits for it; on a side stream the caller waits first, see
        // `with_side_stream`); the destination is page-locked memory owned by `self`, which
        // nothing reads or writes until `done` has completed (`settle`, before every access and
        // in `drop`).
        unsafe { result::memcpy_dtoh_async(dst, buf.ptr + offset as u64, stream.cu_stream()) }
            .map_err(|e| anyhow!("device to host copy: {e}"))?;
        self.queued(&stream)
    }

    /// The first `n` words, once the last queued copy has landed.
    pub fn wait(&mut self, n: usize) -> Result<&[u32]> {
        self.settle()?;
        let words = self
            .host
            .as_slice()
            .map_err(|e| anyhow!("pinned buffer: {e}"))?;
        words
            .get(..n)
            .ok_or_else(|| anyhow!("{n} words asked of a {}-word pinned buffer", words.len()))
    }

    /// Puts `data` here (after the last queued copy has finished with these words) and queues its
    /// copy to `buf` at byte `offset`. Returns at once: `data` may go away, the words stay.
    pub fn queue_write(
        &mut self,
        gpu: &Gpu,
        data: &[u32],
        buf: &DevBuf,
        offset: usize,
    ) -> Result<()> {
        self.settle()?;
        if data.len() > self.host.len() || offset + 4 * data.len() > buf.bytes {
            bail!(
                "device write of {} words at byte {offset} out of bounds ({} pinned words, a {}-byte buffer)",
                data.len(),
                self.host.len(),
                buf.bytes
            );
        }
        if data.is_empty() {
            return Ok(());
        }
        let src = &mut self
            .host
            .as_mut_slice()
            .map_err(|e| anyhow!("pinned buffer: {e}"))?[..data.len()];
        src.copy_from_slice(data);
        // SAFETY: the destination range lies inside the allocation; the source words stay
        // untouched until `done` has completed (`settle`).
        unsafe {
            result::memcpy_htod_async(buf.ptr + offset as u64, &*src, gpu.stream.cu_stream())
        }
        .map_err(|e| anyhow!("host to device copy: {e}"))?;
        self.queued(&gpu.stream)
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // The words must outlive a copy still running into or out of them.
        let _ = self.done.synchronize();
    }
}
