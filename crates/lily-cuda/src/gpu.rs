//! The GPU runtime: context, the one stream, device buffers, module loading (NVRTC + the disk
//! cache) and kernel launches. Nothing here knows any particular kernel: the launchers live in
//! `kernels/`, one module per kernel file, and load their modules through `Gpu::load_module`.
//!
//! Buffers are raw device allocations (no per-use event tracking), and kernels are launched with
//! cudarc's launch builder on one non-default stream, so a decode step can be captured into a
//! CUDA graph as is (PERFORMANCE.md §5).

use std::sync::{Arc, Mutex};

use anyhow::{anyhow, bail, Context, Result};
use cudarc::driver::{
    result, sys, CudaContext, CudaFunction, CudaModule, CudaStream, DeviceRepr, LaunchConfig,
};
use cudarc::nvrtc::Ptx;

use crate::cache::{self, KernelCache};
use crate::nvrtc::Nvrtc;

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

/// Debug checks around every launch (the plan's debug knobs, `Plan::launch_checks`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LaunchChecks {
    /// Synchronise and check after every launch: slow, names the failing kernel.
    pub sync_each: bool,
    /// Per-kernel device time: each launch is bracketed by events and waited for, and the table
    /// is printed to stderr when the GPU is dropped. Slow; graphs are off with it.
    pub profile: bool,
}

/// What the device can run, as the plan needs it (`Gpu::caps`; `plan::Plan::resolve`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceCaps {
    /// sm_90a: Hopper's warpgroup MMA (wgmma) kernels run; elsewhere they are compiled as traps.
    pub wgmma: bool,
    /// Kernels can be launched as programmatic dependents (compute capability 9 and later).
    pub dependent_launch: bool,
    /// Streaming multiprocessors.
    pub sm_count: usize,
    /// Bytes of shared memory a block can be granted (the opt-in limit: 227 KB on sm_90, 163 KB
    /// on sm_80, 99 KB on sm_86 / 89 / 120).
    pub max_shared_memory: usize,
}

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub name: String,
    pub arch: String,
    /// Streaming multiprocessors: persistent (grid-stride) kernels size their grids by it.
    pub sm_count: usize,
    /// `DeviceCaps::max_shared_memory`.
    pub max_shared_memory: usize,
    /// Debug checks around every launch (synchronise, profile).
    pub checks: LaunchChecks,
    /// Kernels marked `Kernel::waits_for_predecessor` are launched as programmatic dependents
    /// (sm_90+): they may start while the kernel before them runs, do their independent prologue
    /// (weight loads) and wait for it with `griddepcontrol.wait` (the plan's `dependent_launch`).
    pub dependent_launch: bool,
    /// Whether the device can launch programmatic dependents at all (compute capability >= 9).
    pub can_launch_dependents: bool,
    profile: Option<Mutex<Profile>>,
    nvrtc: Nvrtc,
    cache: KernelCache,
}

/// Accumulated device time per kernel, by the part of the model that launched it (the scope,
/// e.g. "deltanet", set by `Gpu::profile_scope`) and the kernel's name.
#[derive(Default)]
pub struct Profile {
    rows: Vec<(&'static str, &'static str, f64, u64)>,
    scope: &'static str,
    /// The `reset_profiles` count this table was started after.
    epoch: u64,
}

/// How many times `reset_profiles` was called: a profile started before the latest call forgets
/// its rows at its next launch.
static PROFILE_EPOCH: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Forgets what every GPU's profile (`LILY_PROFILE=1`) measured so far, e.g. after a bench's
/// warm-up, so that the report at exit covers only the measured runs.
pub fn reset_profiles() {
    PROFILE_EPOCH.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

impl Profile {
    fn add(&mut self, name: &'static str, ms: f64) {
        let epoch = PROFILE_EPOCH.load(std::sync::atomic::Ordering::Relaxed);
        if epoch != self.epoch {
            self.rows.clear();
            self.epoch = epoch;
        }
        let scope = self.scope;
        match self.rows.iter_mut().find(|r| r.0 == scope && r.1 == name) {
            Some(r) => {
                r.2 += ms;
                r.3 += 1;
            }
            None => self.rows.push((scope, name, ms, 1)),
        }
    }

    /// The table, largest total first.
    pub fn report(&self) -> String {
        let mut rows = self.rows.clone();
        rows.sort_by(|a, b| b.2.total_cmp(&a.2));
        let total: f64 = rows.iter().map(|r| r.2).sum();
        let mut out = format!("kernel profile (device time, {total:.1} ms in all)\n");
        for (scope, name, ms, n) in rows {
            let label = if scope.is_empty() {
                name.to_string()
            } else {
                format!("{scope}: {name}")
            };
            out += &format!(
                "  {label:<34} {ms:>10.2} ms {:>5.1} % {n:>8} launches {:>9.1} us each\n",
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
    /// Opens GPU `ordinal` and finds NVRTC (kernels are loaded by `kernels::Kernels::load`).
    pub fn open(ordinal: usize, checks: LaunchChecks) -> Result<Gpu> {
        let ctx = open_context(ordinal)?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| anyhow!("compute capability: {e}"))?;
        if major < 8 {
            bail!("GPU compute capability {major}.{minor} is below 8.0 (Ampere), the oldest Lily supports");
        }
        let arch = arch_for(major, minor);
        let name = ctx.name().unwrap_or_else(|_| "unknown NVIDIA GPU".into());
        let sm_count = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(|e| anyhow!("multiprocessor count: {e}"))?
            .max(1) as usize;
        let max_shared_memory = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .map_err(|e| anyhow!("shared memory per block: {e}"))?
            .max(0) as usize;
        let stream = ctx
            .new_stream()
            .map_err(|e| anyhow!("cannot create a CUDA stream: {e}"))?;
        let nvrtc = Nvrtc::load()?;
        let cache = KernelCache::new(cache::default_dir());
        Ok(Gpu {
            ctx,
            stream,
            name,
            arch,
            sm_count,
            max_shared_memory,
            checks,
            dependent_launch: false,
            can_launch_dependents: major >= 9,
            profile: checks.profile.then(|| Mutex::new(Profile::default())),
            nvrtc,
            cache,
        })
    }

    /// What this device can run (the plan resolves its options against it).
    pub fn caps(&self) -> DeviceCaps {
        DeviceCaps {
            wgmma: self.arch == "sm_90a",
            dependent_launch: self.can_launch_dependents,
            sm_count: self.sm_count,
            max_shared_memory: self.max_shared_memory,
        }
    }

    /// One kernel file's module for this GPU's architecture: from the disk cache when an intact
    /// entry for exactly this source, these defines and this NVRTC exists, else compiled by NVRTC
    /// (and cached). `source` is the complete text (shared header included), `defines` the
    /// `NAME=VALUE` pairs passed as `-D`.
    pub fn load_module(
        &self,
        name: &'static str,
        source: &str,
        defines: &[String],
    ) -> Result<Module> {
        let arch = &self.arch;
        let (key, cache_file) = KernelCache::key(name, source, defines, arch, self.nvrtc.version());
        let module = match self
            .cache
            .get(&key, &cache_file)
            .and_then(|cubin| self.ctx.load_module(Ptx::from_binary(cubin)).ok())
        {
            Some(m) => m,
            None => {
                let compiled = self.nvrtc.compile(name, source, arch, defines)?;
                let m = self
                    .ctx
                    .load_module(Ptx::from_binary(compiled.cubin.clone()))
                    .map_err(|e| {
                        anyhow!("the driver refused NVRTC's {arch} cubin for {name}.cu: {e}")
                    })?;
                self.cache.put(&key, &cache_file, &compiled.cubin);
                m
            }
        };
        Ok(Module { name, module })
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

    /// With profiling on, the part of the model the next launches belong to (their rows in the
    /// report read "scope: kernel"); nothing otherwise.
    pub fn profile_scope(&self, scope: &'static str) {
        if let Some(p) = &self.profile {
            if let Ok(mut p) = p.lock() {
                p.scope = scope;
            }
        }
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

    /// Launches `k` with `cfg` on the stream; `args` pushes the kernel's arguments in the order
    /// of its C signature (`.arg(&value)` each; the values must outlive this call, which the
    /// lifetimes of `Args` enforce). A kernel marked `waits_for_predecessor` is launched as a
    /// programmatic dependent when `dependent_launch` is on. With profiling on, the launch is
    /// bracketed by events and waited for; with `sync_each`, the stream is synchronised after it.
    pub fn launch<'a>(
        &'a self,
        k: &'a Kernel,
        cfg: LaunchConfig,
        args: impl FnOnce(&mut Args<'a>),
    ) -> Result<()> {
        let mut a = Args {
            ptrs: Vec::with_capacity(16),
            _values: std::marker::PhantomData,
        };
        args(&mut a);
        self.ctx
            .bind_to_thread()
            .map_err(|e| anyhow!("launching {}: binding the CUDA context: {e}", k.name))?;
        let events = match &self.profile {
            Some(_) => {
                let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
                let start = self.stream.record_event(flags);
                Some(start.map_err(|e| anyhow!("profiling event: {e}"))?)
            }
            None => None,
        };
        let stream = self.stream.cu_stream();
        let dependent = self.dependent_launch && self.can_launch_dependents && k.dependent;
        // SAFETY: every call site is a typed launcher in kernels/ that pushes values whose types
        // match the kernel's C signature, in its order; device pointers among them are live
        // allocations; `a.ptrs` points at values borrowed for 'a, alive during the call.
        let launched = unsafe {
            if dependent {
                let mut attr: sys::CUlaunchAttribute = std::mem::zeroed();
                attr.id =
                    sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
                attr.value.programmaticStreamSerializationAllowed = 1;
                let lc = sys::CUlaunchConfig {
                    gridDimX: cfg.grid_dim.0,
                    gridDimY: cfg.grid_dim.1,
                    gridDimZ: cfg.grid_dim.2,
                    blockDimX: cfg.block_dim.0,
                    blockDimY: cfg.block_dim.1,
                    blockDimZ: cfg.block_dim.2,
                    sharedMemBytes: cfg.shared_mem_bytes,
                    hStream: stream,
                    attrs: &mut attr,
                    numAttrs: 1,
                };
                sys::cuLaunchKernelEx(
                    &lc,
                    k.func.cu_function(),
                    a.ptrs.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
                .result()
            } else {
                result::launch_kernel(
                    k.func.cu_function(),
                    cfg.grid_dim,
                    cfg.block_dim,
                    cfg.shared_mem_bytes,
                    stream,
                    &mut a.ptrs,
                )
            }
        };
        launched.map_err(|e| anyhow!("launching {}: {e}", k.name))?;
        if let (Some(start), Some(p)) = (events, &self.profile) {
            let end = self
                .stream
                .record_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| anyhow!("profiling event: {e}"))?;
            // elapsed_ms waits for both events.
            let ms = start
                .elapsed_ms(&end)
                .map_err(|e| anyhow!("after kernel {} (profiling): {e}", k.name))?;
            if let Ok(mut p) = p.lock() {
                p.add(k.name, ms as f64);
            }
        }
        if self.checks.sync_each {
            self.sync()
                .with_context(|| format!("after kernel {}", k.name))?;
        }
        Ok(())
    }
}

/// A launch's kernel arguments: the address of each value, in the kernel's parameter order.
pub struct Args<'a> {
    ptrs: Vec<*mut std::ffi::c_void>,
    _values: std::marker::PhantomData<&'a ()>,
}

impl<'a> Args<'a> {
    /// The next argument (plain data the kernel takes by value; borrowed until the launch).
    pub fn arg<T: DeviceRepr>(&mut self, v: &'a T) -> &mut Self {
        self.ptrs.push(v as *const T as *mut std::ffi::c_void);
        self
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

/// One kernel file's loaded module.
pub struct Module {
    name: &'static str,
    module: Arc<CudaModule>,
}

impl Module {
    /// The entry point `name` of this module.
    pub fn kernel(&self, name: &'static str) -> Result<Kernel> {
        let func = self
            .module
            .load_function(name)
            .map_err(|e| anyhow!("kernel {name} missing from {}.cu: {e}", self.name))?;
        Ok(Kernel {
            name,
            func,
            dependent: false,
        })
    }
}

/// One loaded kernel entry point (it keeps its module loaded).
pub struct Kernel {
    pub name: &'static str,
    func: CudaFunction,
    dependent: bool,
}

impl Kernel {
    /// Marks a kernel whose every block calls `pdl_wait()` (common.cuh) before it reads or
    /// writes anything an earlier kernel touches (only weights, which never change, may be read
    /// before it), so it may be launched as a programmatic dependent of the kernel before it.
    pub fn waits_for_predecessor(mut self) -> Kernel {
        self.dependent = true;
        self
    }

    /// The most threads a block of this kernel may have on this device: its `__launch_bounds__`,
    /// or fewer where its registers allow fewer.
    pub fn max_threads(&self) -> Result<usize> {
        let n = self
            .func
            .max_threads_per_block()
            .map_err(|e| anyhow!("kernel {}: its largest block: {e}", self.name))?;
        Ok(usize::try_from(n).unwrap_or(0))
    }

    /// Lets the kernel use up to `bytes` of dynamic shared memory: above the default 48 KB a
    /// kernel must be allowed it explicitly, once, before its first launch.
    pub fn allow_shared_memory(self, bytes: usize) -> Result<Kernel> {
        self.func
            .set_attribute(
                sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
            .map_err(|e| {
                anyhow!(
                    "kernel {}: {bytes} bytes of shared memory refused: {e}",
                    self.name
                )
            })?;
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::{arch_for, Profile};

    #[test]
    fn the_profile_sums_per_kernel_and_lists_the_largest_first() {
        let mut p = Profile::default();
        p.add("linear", 1.0);
        p.scope = "moe";
        p.add("gemm_dense", 6.0);
        p.scope = "";
        p.add("linear", 2.0);
        let r = p.report();
        let lines: Vec<&str> = r.lines().collect();
        assert!(lines[0].contains("9.0 ms in all"), "{r}");
        assert!(lines[1].trim_start().starts_with("moe: gemm_dense"), "{r}");
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
        // After a reset (a bench's warm-up is over) the table starts again at the next launch.
        // In this test, not its own: a second test's reset would race with the sums above.
        super::reset_profiles();
        p.add("linear", 4.0);
        let r = p.report();
        assert!(
            r.lines()
                .next()
                .is_some_and(|l| l.contains("4.0 ms in all")),
            "{r}"
        );
        assert_eq!(r.lines().count(), 2, "{r}");
    }

    #[test]
    fn hopper_gets_its_architecture_specific_target() {
        assert_eq!(arch_for(9, 0), "sm_90a");
        assert_eq!(arch_for(8, 0), "sm_80");
        assert_eq!(arch_for(8, 9), "sm_89");
        assert_eq!(arch_for(12, 0), "sm_120");
    }
}
