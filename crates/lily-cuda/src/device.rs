//! The GPU: context, one stream, device buffers and compiled kernels.
//!
//! Buffers are raw device allocations (no per-use event tracking), and kernels are launched with
//! plain `cuLaunchKernel` on one non-default stream, so a decode step can later be captured into a
//! CUDA graph as is (PERFORMANCE.md §5).

use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, bail, Context, Result};
use cudarc::driver::{result, sys, CudaContext, CudaFunction, CudaModule, CudaStream};
use cudarc::nvrtc::Ptx;

use crate::cache::{self, KernelCache};
use crate::nvrtc::Nvrtc;
use crate::sources::{defines, full_source, FILES};

/// The CUDA architecture NVRTC should build for: the device's exact one, with Hopper's
/// architecture-specific features (`sm_90a`: wgmma, setmaxnreg) enabled.
pub fn arch_for(major: i32, minor: i32) -> String {
    if (major, minor) == (9, 0) {
        "sm_90a".to_string()
    } else {
        format!("sm_{major}{minor}")
    }
}

/// Why CUDA cannot be used here, or the ordinal's context.
pub fn open_context(ordinal: usize) -> Result<Arc<CudaContext>> {
    // SAFETY: only probes whether the driver library can be loaded.
    if !unsafe { sys::is_culib_present() } {
        bail!("no NVIDIA driver library (libcuda.so) on this machine");
    }
    let count =
        CudaContext::device_count().map_err(|e| anyhow!("the CUDA driver does not start: {e}"))?;
    if count <= 0 {
        bail!("the CUDA driver sees no GPU");
    }
    if ordinal >= count as usize {
        bail!("GPU {ordinal} requested but the driver sees only {count}");
    }
    let ctx = CudaContext::new(ordinal)
        .map_err(|e| anyhow!("cannot create a CUDA context on GPU {ordinal}: {e}"))?;
    // We order all work on one stream ourselves; cudarc's per-buffer events would only add cost.
    // SAFETY: no cudarc-managed buffers exist on this context yet.
    unsafe { ctx.disable_event_tracking() };
    Ok(ctx)
}

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub name: String,
    pub arch: String,
    pub kernels: Kernels,
    /// Synchronise and check after every launch (LILY_CUDA_SYNC=1): slow, names the failing kernel.
    pub sync_each: bool,
    /// Per-kernel device time (LILY_PROFILE=1): each launch is bracketed by events and waited for,
    /// and the table is printed to stderr when the GPU is dropped. Slow; graphs are off with it.
    pub profile: Option<Mutex<Profile>>,
    /// Prefill linears on tensor cores (gemm.cu): bf16 activation mode only, since the weights
    /// and activations enter the mma as bf16 (LILY_TENSOR_CORES=0 keeps the CUDA-core kernels).
    pub tensor_cores: bool,
    /// The MoE router of prefill chunks on tensor cores in split precision (gemm_dense_exact);
    /// LILY_EXACT_ROUTER_TC=0 runs it on CUDA cores.
    pub exact_router_on_tensor_cores: bool,
}

/// Accumulated device time per kernel name.
#[derive(Default)]
pub struct Profile {
    rows: Vec<(&'static str, f64, u64)>,
}

impl Profile {
    fn add(&mut self, name: &'static str, ms: f64) {
        match self.rows.iter_mut().find(|r| r.0 == name) {
            Some(r) => {
                r.1 += ms;
                r.2 += 1;
            }
            None => self.rows.push((name, ms, 1)),
        }
    }

    /// The table, largest total first.
    pub fn report(&self) -> String {
        let mut rows = self.rows.clone();
        rows.sort_by(|a, b| b.1.total_cmp(&a.1));
        let total: f64 = rows.iter().map(|r| r.1).sum();
        let mut out = format!("kernel profile (device time, {total:.1} ms in all)\n");
        for (name, ms, n) in rows {
            out += &format!(
                "  {name:<22} {ms:>10.2} ms {:>5.1} % {n:>8} launches {:>9.1} us each\n",
                100.0 * ms / total.max(1e-9),
                1000.0 * ms / n as f64
            );
        }
        out
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        if let Some(p) = &self.profile {
            if let Ok(p) = p.lock() {
                eprint!("{}", p.report());
            }
        }
    }
}

impl Gpu {
    /// Opens GPU `ordinal` and loads every kernel for it (compiled by NVRTC or from the cache).
    pub fn open(ordinal: usize, bf16_activations: bool) -> Result<Gpu> {
        let ctx = open_context(ordinal)?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| anyhow!("compute capability: {e}"))?;
        if major < 8 {
            bail!("GPU compute capability {major}.{minor} is below 8.0 (Ampere), the oldest Lily supports");
        }
        let arch = arch_for(major, minor);
        let name = ctx.name().unwrap_or_else(|_| "unknown NVIDIA GPU".into());
        let stream = ctx
            .new_stream()
            .map_err(|e| anyhow!("cannot create a CUDA stream: {e}"))?;
        let nvrtc = Nvrtc::load()?;
        let cache = KernelCache::new(cache::default_dir());
        let kernels = Kernels::load(&ctx, &nvrtc, &cache, &arch, bf16_activations)?;
        let sync_each = std::env::var("LILY_CUDA_SYNC").is_ok_and(|v| v == "1");
        let profile = std::env::var("LILY_PROFILE")
            .is_ok_and(|v| v == "1")
            .then(|| Mutex::new(Profile::default()));
        let tensor_cores =
            bf16_activations && !std::env::var("LILY_TENSOR_CORES").is_ok_and(|v| v == "0");
        Ok(Gpu {
            ctx,
            stream,
            name,
            arch,
            kernels,
            sync_each,
            profile,
            tensor_cores,
            exact_router_on_tensor_cores: !std::env::var("LILY_EXACT_ROUTER_TC")
                .is_ok_and(|v| v == "0"),
        })
    }

    pub fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| anyhow!("binding the CUDA context: {e}"))
    }

    pub fn sync(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| anyhow!("CUDA stream synchronisation failed: {e}"))
    }

    pub fn alloc(&self, bytes: usize) -> Result<DevBuf> {
        DevBuf::alloc(&self.ctx, bytes)
    }

    /// A device copy of `data`.
    pub fn upload<T: bytemuck::Pod>(&self, data: &[T]) -> Result<DevBuf> {
        let buf = self.alloc(std::mem::size_of_val(data))?;
        self.write(&buf, 0, data)?;
        Ok(buf)
    }

    /// Copies `data` to `buf` at byte offset `offset` (synchronously, host memory may go away).
    pub fn write<T: bytemuck::Pod>(&self, buf: &DevBuf, offset: usize, data: &[T]) -> Result<()> {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        if offset + bytes.len() > buf.bytes {
            bail!(
                "device write of {} bytes at {offset} overflows a {}-byte buffer",
                bytes.len(),
                buf.bytes
            );
        }
        if bytes.is_empty() {
            return Ok(());
        }
        // SAFETY: the range lies inside the allocation; we synchronise before `data` can go away.
        unsafe {
            result::memcpy_htod_async(buf.ptr + offset as u64, bytes, self.stream.cu_stream())
        }
        .map_err(|e| anyhow!("host to device copy: {e}"))?;
        self.sync()
    }

    /// Reads `n` values of T from `buf` at byte offset `offset`.
    pub fn read<T: bytemuck::Pod + Default>(
        &self,
        buf: &DevBuf,
        offset: usize,
        n: usize,
    ) -> Result<Vec<T>> {
        let mut out = vec![T::default(); n];
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut out);
        if offset + bytes.len() > buf.bytes {
            bail!(
                "device read of {} bytes at {offset} overflows a {}-byte buffer",
                bytes.len(),
                buf.bytes
            );
        }
        if !bytes.is_empty() {
            // SAFETY: the range lies inside the allocation; synchronised before `out` is used.
            unsafe {
                result::memcpy_dtoh_async(bytes, buf.ptr + offset as u64, self.stream.cu_stream())
            }
            .map_err(|e| anyhow!("device to host copy: {e}"))?;
            self.sync()?;
        }
        Ok(out)
    }

    /// Device-to-device copy of `bytes` bytes, queued on the stream.
    pub fn copy(
        &self,
        dst: &DevBuf,
        dst_off: usize,
        src: &DevBuf,
        src_off: usize,
        bytes: usize,
    ) -> Result<()> {
        if dst_off + bytes > dst.bytes || src_off + bytes > src.bytes {
            bail!("device copy of {bytes} bytes out of bounds");
        }
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: both ranges lie inside their allocations.
        unsafe {
            result::memcpy_dtod_async(
                dst.ptr + dst_off as u64,
                src.ptr + src_off as u64,
                bytes,
                self.stream.cu_stream(),
            )
        }
        .map_err(|e| anyhow!("device to device copy: {e}"))
    }

    /// Device-to-device copy between raw addresses (callers derive them from live buffers).
    pub fn copy_raw(&self, dst: u64, src: u64, bytes: usize) -> Result<()> {
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: callers pass addresses inside live allocations (see forward.rs).
        unsafe { result::memcpy_dtod_async(dst, src, bytes, self.stream.cu_stream()) }
            .map_err(|e| anyhow!("device to device copy: {e}"))
    }

    /// Fills a buffer with one byte value, queued on the stream.
    pub fn fill(&self, buf: &DevBuf, byte: u8) -> Result<()> {
        if buf.bytes == 0 {
            return Ok(());
        }
        // SAFETY: the whole allocation.
        unsafe { result::memset_d8_async(buf.ptr, byte, buf.bytes, self.stream.cu_stream()) }
            .map_err(|e| anyhow!("device memset: {e}"))
    }

    /// Launches `f` with the given kernel parameters (pointers to each argument's value) and
    /// `smem` bytes of dynamic shared memory.
    pub fn launch(
        &self,
        f: &Kernel,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        let events = match &self.profile {
            Some(_) => {
                let make = || {
                    result::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT)
                        .map_err(|e| anyhow!("profiling event: {e}"))
                };
                let (a, b) = (make()?, make()?);
                // SAFETY: fresh events recorded on our stream.
                unsafe { result::event::record(a, self.stream.cu_stream()) }
                    .map_err(|e| anyhow!("profiling event: {e}"))?;
                Some((a, b))
            }
            None => None,
        };
        // SAFETY: `args` point at values whose types match the kernel's C signature (every call site
        // is a typed wrapper in ops.rs); device pointers among them are live allocations.
        unsafe {
            result::launch_kernel(
                f.func.cu_function(),
                grid,
                block,
                smem,
                self.stream.cu_stream(),
                args,
            )
        }
        .map_err(|e| anyhow!("launching {}: {e}", f.name))?;
        if let (Some((a, b)), Some(p)) = (events, &self.profile) {
            // SAFETY: both events were created above and are destroyed once, after the wait.
            let ms = unsafe {
                result::event::record(b, self.stream.cu_stream())
                    .and_then(|_| result::event::synchronize(b))
                    .and_then(|_| result::event::elapsed(a, b))
            }
            .map_err(|e| anyhow!("after kernel {} (profiling): {e}", f.name))?;
            // SAFETY: see above.
            unsafe {
                let _ = result::event::destroy(a);
                let _ = result::event::destroy(b);
            }
            if let Ok(mut p) = p.lock() {
                p.add(f.name, ms as f64);
            }
        }
        if self.sync_each {
            self.sync()
                .with_context(|| format!("after kernel {}", f.name))?;
        }
        Ok(())
    }
}

/// A raw device allocation, freed on drop.
pub struct DevBuf {
    pub ptr: u64,
    pub bytes: usize,
    ctx: Arc<CudaContext>,
}

impl DevBuf {
    pub fn alloc(ctx: &Arc<CudaContext>, bytes: usize) -> Result<DevBuf> {
        ctx.bind_to_thread().map_err(|e| anyhow!("{e}"))?;
        // cuMemAlloc refuses 0 bytes; keep a 1-byte allocation so every buffer has a real address.
        // SAFETY: plain device allocation.
        let ptr = unsafe { result::malloc_sync(bytes.max(1)) }
            .map_err(|e| anyhow!("cannot allocate {bytes} bytes of GPU memory: {e}"))?;
        Ok(DevBuf {
            ptr,
            bytes,
            ctx: ctx.clone(),
        })
    }
}

impl Drop for DevBuf {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by malloc_sync and freed once; cuMemFree waits for pending work.
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

/// Dynamic shared memory of the largest gemm.cu tile (ops::gemm_smem).
const GEMM_SMEM_MAX: usize = crate::ops::gemm_smem(64);

/// Lets `k` use up to `bytes` of dynamic shared memory (above the default 48 KB needs opting in).
fn big_smem(k: Kernel, bytes: usize) -> Result<Kernel> {
    // SAFETY: a live function of a loaded module; the attribute only raises a launch limit.
    unsafe {
        result::function::set_function_attribute(
            k.func.cu_function(),
            sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
    }
    .map_err(|e| {
        anyhow!(
            "kernel {}: {bytes} bytes of shared memory refused: {e}",
            k.name
        )
    })?;
    Ok(k)
}

/// One loaded kernel entry point.
pub struct Kernel {
    pub name: &'static str,
    func: CudaFunction,
}

/// Every kernel Lily launches, by name.
pub struct Kernels {
    pub embed: Kernel,
    pub rms_norm: Kernel,
    pub linear: Kernel,
    pub linear_wide: Kernel,
    pub linear_gather: Kernel,
    pub linear_grouped: Kernel,
    pub gemm_dense: Kernel,
    pub gemm_dense_exact: Kernel,
    pub gemm_grouped64: Kernel,
    pub gemm_grouped32: Kernel,
    pub attn_qk_prep: Kernel,
    pub attn_decode: Kernel,
    pub attn_prefill: Kernel,
    pub attn_split: Kernel,
    pub attn_split_combine: Kernel,
    pub dn_conv: Kernel,
    pub dn_conv_state: Kernel,
    pub dn_prep: Kernel,
    pub dn_recurrent: Kernel,
    pub dn_gated_norm: Kernel,
    pub moe_route: Kernel,
    pub moe_group: Kernel,
    pub silu_mul: Kernel,
    pub moe_combine: Kernel,
    pub argmax_logprob: Kernel,
    pub sample_adjust: Kernel,
    pub sample_pick: Kernel,
    pub advance_pos: Kernel,
    _modules: Vec<Arc<CudaModule>>,
}

impl Kernels {
    fn load(
        ctx: &Arc<CudaContext>,
        nvrtc: &Nvrtc,
        cache: &KernelCache,
        arch: &str,
        bf16: bool,
    ) -> Result<Kernels> {
        let mut modules: Vec<(&'static str, Arc<CudaModule>)> = Vec::new();
        let defs = defines(bf16);
        for file in FILES {
            let source = full_source(file);
            let (key, cache_file) =
                KernelCache::key(file.name, &source, &defs, arch, nvrtc.version());
            let module = match cache
                .get(&key, &cache_file)
                .and_then(|cubin| ctx.load_module(Ptx::from_binary(cubin)).ok())
            {
                Some(m) => m,
                None => {
                    let compiled = nvrtc.compile(file.name, &source, arch, &defs)?;
                    let m = ctx
                        .load_module(Ptx::from_binary(compiled.cubin.clone()))
                        .map_err(|e| {
                            anyhow!(
                                "the driver refused NVRTC's {arch} cubin for {}.cu: {e}",
                                file.name
                            )
                        })?;
                    cache.put(&key, &cache_file, &compiled.cubin);
                    m
                }
            };
            modules.push((file.name, module));
        }
        let get = |module: &str, name: &'static str| -> Result<Kernel> {
            let m = modules
                .iter()
                .find(|(n, _)| *n == module)
                .map(|(_, m)| m)
                .ok_or_else(|| anyhow!("no kernel module {module}"))?;
            let func = m
                .load_function(name)
                .map_err(|e| anyhow!("kernel {name} missing from {module}.cu: {e}"))?;
            Ok(Kernel { name, func })
        };
        let attn_prefill = get("attention", "attn_prefill")?;
        // Above 48 KB of dynamic shared memory a kernel must be allowed it explicitly.
        let smem = crate::ops::attn_prefill_max_smem();
        attn_prefill
            .func
            .set_attribute(
                sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .map_err(|e| anyhow!("allowing attn_prefill {smem} bytes of shared memory: {e}"))?;
        Ok(Kernels {
            embed: get("embed", "embed")?,
            rms_norm: get("norm", "rms_norm")?,
            linear: get("linear", "linear")?,
            linear_wide: get("linear", "linear_wide")?,
            linear_gather: get("linear", "linear_gather")?,
            linear_grouped: get("linear", "linear_grouped")?,
            gemm_dense: big_smem(get("gemm", "gemm_dense")?, GEMM_SMEM_MAX)?,
            gemm_dense_exact: big_smem(
                get("gemm", "gemm_dense_exact")?,
                crate::ops::gemm_smem_exact(64),
            )?,
            gemm_grouped64: big_smem(get("gemm", "gemm_grouped64")?, GEMM_SMEM_MAX)?,
            gemm_grouped32: big_smem(get("gemm", "gemm_grouped32")?, GEMM_SMEM_MAX)?,
            attn_qk_prep: get("attention", "attn_qk_prep")?,
            attn_decode: get("attention", "attn_decode")?,
            attn_prefill,
            attn_split: get("attention", "attn_split")?,
            attn_split_combine: get("attention", "attn_split_combine")?,
            dn_conv: get("deltanet", "dn_conv")?,
            dn_conv_state: get("deltanet", "dn_conv_state")?,
            dn_prep: get("deltanet", "dn_prep")?,
            dn_recurrent: get("deltanet", "dn_recurrent")?,
            dn_gated_norm: get("deltanet", "dn_gated_norm")?,
            moe_route: get("moe", "moe_route")?,
            moe_group: get("moe", "moe_group")?,
            silu_mul: get("moe", "silu_mul")?,
            moe_combine: get("moe", "moe_combine")?,
            argmax_logprob: get("sample", "argmax_logprob")?,
            sample_adjust: get("sample", "sample_adjust")?,
            sample_pick: get("sample", "sample_pick")?,
            advance_pos: get("sample", "advance_pos")?,
            _modules: modules.into_iter().map(|(_, m)| m).collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{arch_for, Profile};

    #[test]
    fn the_profile_sums_per_kernel_and_lists_the_largest_first() {
        let mut p = Profile::default();
        p.add("linear", 1.0);
        p.add("gemm_dense", 6.0);
        p.add("linear", 2.0);
        let r = p.report();
        let lines: Vec<&str> = r.lines().collect();
        assert!(lines[0].contains("9.0 ms in all"), "{r}");
        assert!(lines[1].trim_start().starts_with("gemm_dense"), "{r}");
        assert!(
            lines[1].contains("66.7 %") && lines[1].contains("1 launches"),
            "{r}"
        );
        assert!(lines[2].trim_start().starts_with("linear"), "{r}");
        assert!(
            lines[2].contains("3.00 ms") && lines[2].contains("2 launches"),
            "{r}"
        );
        assert!(lines[2].contains("1500.0 us each"), "{r}");
    }

    #[test]
    fn hopper_gets_its_architecture_specific_target() {
        assert_eq!(arch_for(9, 0), "sm_90a");
        assert_eq!(arch_for(8, 0), "sm_80");
        assert_eq!(arch_for(8, 9), "sm_89");
        assert_eq!(arch_for(12, 0), "sm_120");
    }
}
