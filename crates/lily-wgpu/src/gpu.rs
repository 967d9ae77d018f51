//! The wgpu runtime: adapter choice, device, buffers, reads back to the host, and the recorder
//! that batches a forward pass's dispatches into one submission.

use std::collections::HashMap;
use std::num::NonZeroU64;
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, bail, Context, Result};

use crate::shaders::Spec;

/// Bytes reserved per dispatch in the parameter buffer: every uniform offset must be a multiple
/// of the device's alignment (256 on every adapter wgpu supports), and no kernel's parameters
/// are larger.
const PARAM_STRIDE: u64 = 256;

pub struct Gpu {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: wgpu::AdapterInfo,
    pub limits: wgpu::Limits,
    /// Whether GPU timestamps were enabled (for `LILY_PROFILE=1`, where the adapter has them).
    pub timestamps: bool,
    /// Whether passes are profiled (`WgpuOptions::profile`).
    pub profiled: bool,
    /// Whether subgroup operations were enabled (wgpu's SUBGROUP feature) for the reductions
    /// (shaders/wgsl/reduce_subgroup.wgsl).
    pub subgroups: bool,
    /// Whether f16 in shaders was enabled (wgpu's SHADER_F16) for the KV cache, the prefill
    /// products' tiles or the activations between kernels.
    pub f16: bool,
    /// The cooperative matrices enabled (wgpu's experimental cooperative-matrix feature) for
    /// linear_q4_coop.wgsl: their size (`coop_size`), or 0 where not asked for or not there.
    pub coop: u32,
    /// The first validation or out-of-memory error wgpu reported asynchronously, if any.
    error: Arc<Mutex<Option<String>>>,
    /// The parameter buffer and the bind groups made for it (see `Binder`).
    binder: Mutex<Binder>,
}

/// Bind groups kept between submissions: a decode step repeats the same dispatches (kernel,
/// buffers, place in the parameter buffer) every token, so after the first step no bind group
/// is made. Every submission writes its parameters at the start of one persistent uniform
/// buffer (`queue.write_buffer` is ordered after the work already submitted).
#[derive(Default)]
struct Binder {
    params: Option<wgpu::Buffer>,
    groups: HashMap<BindKey, wgpu::BindGroup>,
}

/// Most bind groups kept; past it the cache starts again.
const MAX_BIND_GROUPS: usize = 32_768;

#[derive(PartialEq, Eq, Hash)]
struct BindKey {
    /// The kernel's pipeline.
    kernel: usize,
    param_off: u64,
    bufs: Vec<wgpu::Buffer>,
}

/// How an adapter ranks for us: a real GPU before a software one.
fn rank(t: wgpu::DeviceType) -> u32 {
    match t {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Other => 3,
        wgpu::DeviceType::Cpu => 4,
    }
}

/// One line per adapter wgpu finds (Vulkan, Metal): for logs and error messages.
pub fn adapters_found() -> Vec<wgpu::AdapterInfo> {
    let instance = instance();
    pollster::block_on(instance.enumerate_adapters(backends()))
        .iter()
        .map(|a| a.get_info())
        .collect()
}

fn backends() -> wgpu::Backends {
    wgpu::Backends::VULKAN | wgpu::Backends::METAL
}

fn instance() -> wgpu::Instance {
    wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: backends(),
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    })
}

pub fn describe_adapter(info: &wgpu::AdapterInfo) -> String {
    format!(
        "{} ({:?}, {:?}, driver {} {})",
        info.name, info.backend, info.device_type, info.driver, info.driver_info
    )
}

/// The limits the device is created with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceLimits {
    /// The adapter's own.
    Adapter,
    /// The adapter's, each capped at an Apple GPU's through wgpu's Metal backend
    /// (`apple_limits`): the contract the kernels are tested against without a Mac.
    Apple,
}

/// An Apple GPU's limits through wgpu 30's Metal backend (wgpu-hal 30.0.2 src/metal/adapter.rs,
/// Apple families 4+ / macOS family 1, read 2026-12-04): 32 KiB of threadgroup memory, 1,024
/// threads a threadgroup, 31 buffer slots a stage less the two wgpu keeps (immediates and the
/// buffer-sizes buffer), `maxBufferLength` per device (1 GiB is the least on a Mac: wgpu's
/// fallback before macOS 10.14) for buffers and bindings alike, 65,535 workgroups a dimension,
/// uniform offsets aligned to 256 and storage offsets to 32.
pub fn apple_limits() -> wgpu::Limits {
    wgpu::Limits {
        max_compute_workgroup_storage_size: 32 << 10,
        max_compute_invocations_per_workgroup: 1024,
        max_compute_workgroup_size_x: 1024,
        max_compute_workgroup_size_y: 1024,
        max_compute_workgroup_size_z: 1024,
        max_storage_buffers_per_shader_stage: 29,
        max_buffer_size: 1 << 30,
        max_storage_buffer_binding_size: 1 << 30,
        max_compute_workgroups_per_dimension: 0xFFFF,
        min_uniform_buffer_offset_alignment: 256,
        min_storage_buffer_offset_alignment: 32,
        ..wgpu::Limits::default()
    }
}

/// `adapter` with each limit `apple_limits` sets taken at the lower (the alignments at the
/// stricter).
pub fn capped_at_apple(adapter: &wgpu::Limits) -> wgpu::Limits {
    let a = apple_limits();
    let mut l = adapter.clone();
    macro_rules! lower {
        ($($f:ident),*) => { $(l.$f = l.$f.min(a.$f);)* };
    }
    lower!(
        max_compute_workgroup_storage_size,
        max_compute_invocations_per_workgroup,
        max_compute_workgroup_size_x,
        max_compute_workgroup_size_y,
        max_compute_workgroup_size_z,
        max_storage_buffers_per_shader_stage,
        max_buffer_size,
        max_storage_buffer_binding_size,
        max_compute_workgroups_per_dimension
    );
    l.min_uniform_buffer_offset_alignment = l
        .min_uniform_buffer_offset_alignment
        .max(a.min_uniform_buffer_offset_alignment);
    l.min_storage_buffer_offset_alignment = l
        .min_storage_buffer_offset_alignment
        .max(a.min_storage_buffer_offset_alignment);
    l
}

/// The size of the square f16 × f16 → f32 cooperative matrices linear_q4_coop.wgsl takes on
/// `adapter`: 16 where the adapter reports that configuration (NVIDIA through Vulkan), else 8
/// (Apple's simdgroup matrices through Metal), else 0; 0 too without the experimental feature or
/// with subgroups other than 32 wide (the kernel's four subgroups of 32; wgpu reports 4–64 on
/// Metal, whose simdgroups are 32 on every Apple GPU: docs/WGPU.md).
pub fn coop_size(adapter: &wgpu::Adapter) -> u32 {
    if !adapter
        .features()
        .contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX)
    {
        return 0;
    }
    let info = adapter.get_info();
    let width_32 = (info.subgroup_min_size == 32 && info.subgroup_max_size == 32)
        || info.backend == wgpu::Backend::Metal;
    if !width_32 {
        return 0;
    }
    let props = adapter.cooperative_matrix_properties();
    let fits = |n: u32| {
        props.iter().any(|p| {
            p.m_size == n
                && p.n_size == n
                && p.k_size == n
                && p.ab_type == wgpu::CooperativeScalarType::F16
                && p.cr_type == wgpu::CooperativeScalarType::F32
        })
    };
    [16, 8].into_iter().find(|&n| fits(n)).unwrap_or(0)
}

impl Gpu {
    /// The best adapter (discrete, integrated, virtual, then software such as lavapipe), or the
    /// first whose name contains `adapter`; `allow_software`: whether a CPU adapter (lavapipe,
    /// SwiftShader) may be chosen; the device created with the adapter's limits or those capped
    /// at Apple's (`limits`); GPU timestamps where `profiled` and the adapter has them; subgroup
    /// operations where `subgroups`, f16 in shaders where `f16`, cooperative matrices where
    /// `coop` (`coop_size`), each where the adapter has it.
    pub fn open(
        allow_software: bool,
        adapter: Option<&str>,
        profiled: bool,
        limits: DeviceLimits,
        subgroups: bool,
        f16: bool,
        coop: bool,
    ) -> Result<Gpu> {
        let instance = instance();
        let mut adapters = pollster::block_on(instance.enumerate_adapters(backends()));
        if adapters.is_empty() {
            bail!("wgpu found no Vulkan or Metal adapter (on Linux: is a Vulkan driver and libvulkan1 installed?)");
        }
        adapters.sort_by_key(|a| rank(a.get_info().device_type));
        let wanted = adapter;
        let adapter = match wanted {
            Some(name) => adapters
                .into_iter()
                .find(|a| a.get_info().name.contains(name))
                .with_context(|| {
                    format!("no wgpu adapter's name contains LILY_WGPU_ADAPTER={name:?}")
                })?,
            None => adapters.into_iter().next().expect("checked non-empty"),
        };
        let info = adapter.get_info();
        if info.device_type == wgpu::DeviceType::Cpu && !allow_software && wanted.is_none() {
            bail!(
                "the only wgpu adapter is a software renderer, {} (slower than the CPU backend)",
                describe_adapter(&info)
            );
        }
        let limits = match limits {
            DeviceLimits::Adapter => adapter.limits(),
            DeviceLimits::Apple => capped_at_apple(&adapter.limits()),
        };
        profile::set_enabled(profiled);
        let timestamps = profiled && adapter.features().contains(wgpu::Features::TIMESTAMP_QUERY);
        profile::set_source(if timestamps {
            "GPU timestamps, one compute pass per dispatch"
        } else {
            "no timestamp queries here: host wall time, one submission per dispatch"
        });
        let mut required_features = if timestamps {
            wgpu::Features::TIMESTAMP_QUERY
        } else {
            wgpu::Features::empty()
        };
        let subgroups = subgroups && adapter.features().contains(wgpu::Features::SUBGROUP);
        if subgroups {
            required_features |= wgpu::Features::SUBGROUP;
        }
        let f16 = f16 && adapter.features().contains(wgpu::Features::SHADER_F16);
        if f16 {
            required_features |= wgpu::Features::SHADER_F16;
        }
        let coop = if coop && f16 { coop_size(&adapter) } else { 0 };
        let mut experimental_features = wgpu::ExperimentalFeatures::disabled();
        if coop > 0 {
            required_features |= wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX;
            // SAFETY: wgpu 30 marks the feature experimental (its validation of cooperative
            // matrices is incomplete); linear_q4_coop.wgsl uses only the configuration the
            // adapter reported (`coop_size`) and is checked against the host at load
            // (backend.rs) before any product runs on it.
            experimental_features = unsafe { wgpu::ExperimentalFeatures::enabled() };
        }
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("lily"),
            required_features,
            required_limits: limits.clone(),
            experimental_features,
            ..Default::default()
        }))
        .with_context(|| format!("opening {}", describe_adapter(&info)))?;
        let error = Arc::new(Mutex::new(None));
        let sink = error.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            let mut slot = sink.lock().unwrap_or_else(|p| p.into_inner());
            if slot.is_none() {
                *slot = Some(e.to_string());
            }
        }));
        Ok(Gpu {
            device,
            queue,
            info,
            limits,
            timestamps,
            profiled,
            subgroups,
            f16,
            coop,
            error,
            binder: Mutex::new(Binder::default()),
        })
    }

    /// The largest storage binding (a weight slice, an activation, a KV cache) this device takes.
    pub fn max_binding(&self) -> u64 {
        self.limits
            .max_storage_buffer_binding_size
            .min(self.limits.max_buffer_size)
    }

    /// Fails with the first error wgpu reported since the device opened.
    pub fn check(&self) -> Result<()> {
        let slot = self.error.lock().unwrap_or_else(|p| p.into_inner());
        match &*slot {
            Some(e) => Err(anyhow!("wgpu: {e}")),
            None => Ok(()),
        }
    }

    /// A zero-filled storage buffer of at least `bytes` (rounded up to 16, at least 16: kernels
    /// read some buffers as vec4).
    pub fn storage(&self, label: &str, bytes: u64) -> Result<wgpu::Buffer> {
        let size = bytes.max(16).div_ceil(16) * 16;
        if size > self.max_binding() {
            bail!(
                "{label}: {size} bytes exceed the device's largest storage binding ({} bytes)",
                self.max_binding()
            );
        }
        Ok(self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        }))
    }

    /// `storage` that dispatches may also read their workgroup counts from.
    pub fn storage_indirect(&self, label: &str, bytes: u64) -> Result<wgpu::Buffer> {
        let size = bytes.max(16).div_ceil(16) * 16;
        if size > self.max_binding() {
            bail!("{label}: {size} bytes exceed the device's largest storage binding");
        }
        Ok(self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::INDIRECT
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        }))
    }

    /// A storage buffer holding `data` (padded with zeros to a multiple of 4 bytes).
    pub fn upload(&self, label: &str, data: &[u8]) -> Result<wgpu::Buffer> {
        let buf = self.storage(label, data.len() as u64)?;
        let whole = data.len() / 4 * 4;
        if whole > 0 {
            self.queue.write_buffer(&buf, 0, &data[..whole]);
        }
        if whole < data.len() {
            let mut tail = [0u8; 4];
            tail[..data.len() - whole].copy_from_slice(&data[whole..]);
            self.queue.write_buffer(&buf, whole as u64, &tail);
        }
        Ok(buf)
    }

    pub fn upload_f32(&self, label: &str, data: &[f32]) -> Result<wgpu::Buffer> {
        self.upload(label, bytemuck::cast_slice(data))
    }

    /// A small buffer the host maps to read results (`read_mapped`), e.g. a decode step's token.
    pub fn readback(&self, label: &str, bytes: u64) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size: bytes.max(16).div_ceil(16) * 16,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    /// The first `n` u32 of a `readback` buffer once the submitted work that writes it is done.
    pub fn read_mapped_u32(&self, buf: &wgpu::Buffer, n: usize) -> Result<Vec<u32>> {
        let (tx, rx) = std::sync::mpsc::channel();
        buf.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        self.wait()?;
        rx.recv()
            .context("wgpu dropped a buffer mapping")?
            .context("mapping a buffer for reading")?;
        let words: Vec<u32> = {
            let view = buf
                .get_mapped_range(..)
                .map_err(|e| anyhow!("reading a mapped buffer: {e:?}"))?;
            bytemuck::cast_slice(&view[..n * 4]).to_vec()
        };
        buf.unmap();
        Ok(words)
    }

    /// Bytes `offset..offset + len` of `buf` (both multiples of 4), after all submitted work.
    pub fn read(&self, buf: &wgpu::Buffer, offset: u64, len: u64) -> Result<Vec<u8>> {
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size: len.max(4),
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut enc = self
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        enc.copy_buffer_to_buffer(buf, offset, &staging, 0, len);
        self.queue.submit([enc.finish()]);
        let (tx, rx) = std::sync::mpsc::channel();
        staging.map_async(wgpu::MapMode::Read, .., move |r| {
            let _ = tx.send(r);
        });
        self.wait()?;
        rx.recv()
            .context("wgpu dropped a buffer mapping")?
            .context("mapping a buffer for reading")?;
        let bytes = staging
            .get_mapped_range(..)
            .map_err(|e| anyhow!("reading a mapped buffer: {e:?}"))?
            .to_vec();
        staging.unmap();
        Ok(bytes[..len as usize].to_vec())
    }

    pub fn read_f32(&self, buf: &wgpu::Buffer, offset_f32: usize, n: usize) -> Result<Vec<f32>> {
        let bytes = self.read(buf, offset_f32 as u64 * 4, n as u64 * 4)?;
        Ok(bytemuck::cast_slice(&bytes).to_vec())
    }

    pub fn read_u32(&self, buf: &wgpu::Buffer, n: usize) -> Result<Vec<u32>> {
        let bytes = self.read(buf, 0, n as u64 * 4)?;
        Ok(bytemuck::cast_slice(&bytes).to_vec())
    }

    /// Drops the kept bind groups (and so their hold on buffers): after a sequence or snapshot
    /// is freed, so its buffers go.
    pub fn forget_bind_groups(&self) {
        self.binder
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .groups
            .clear();
    }

    /// Blocks until the queue is idle, then reports any error wgpu raised meanwhile.
    pub fn wait(&self) -> Result<()> {
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map_err(|e| anyhow!("waiting for the GPU: {e}"))?;
        self.check()
    }
}

/// A compiled kernel: its pipeline and the bind group layout wgpu derived from the WGSL.
pub struct Kernel {
    pub name: &'static str,
    /// A tile product's rows a workgroup (`Spec::mm_rows`: its launches' row blocks).
    pub rows: usize,
    pipeline: wgpu::ComputePipeline,
    layout: wgpu::BindGroupLayout,
}

impl Kernel {
    /// Compiles `spec` (plan.rs; its file with common.wgsl in front, its `override` constants:
    /// shapes fixed per model, so that loops over them have constant bounds the driver can
    /// unroll), after checking that it fits the device's limits (`shaders::Needs`: wgpu does not
    /// check workgroup memory). `checked`: keep wgpu's bounds checks in the generated shader
    /// (slower; for debugging).
    pub fn new(gpu: &Gpu, spec: &Spec, checked: bool) -> Result<Kernel> {
        let name = spec.name;
        if let Some(why) = spec.needs()?.exceeds(&gpu.limits) {
            bail!(
                "WGSL kernel {name} ({:?}) does not fit this device: {why}",
                spec.constants
            );
        }
        let code = spec.code()?;
        let scope = gpu.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let desc = wgpu::ShaderModuleDescriptor {
            label: Some(name),
            source: wgpu::ShaderSource::Wgsl(code.into()),
        };
        let module = if checked {
            gpu.device.create_shader_module(desc)
        } else {
            // SAFETY: every index a kernel computes is bounded by the shapes checked at load
            // (weights.rs, plan.rs); the design asks for unchecked modules for speed.
            unsafe {
                gpu.device
                    .create_shader_module_trusted(desc, wgpu::ShaderRuntimeChecks::unchecked())
            }
        };
        let pipeline = gpu
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(name),
                layout: None,
                module: &module,
                entry_point: Some(name),
                // Every kernel writes its workgroup memory before reading it.
                compilation_options: wgpu::PipelineCompilationOptions {
                    constants: &spec.constants,
                    zero_initialize_workgroup_memory: false,
                },
                cache: None,
            });
        if let Some(e) = pollster::block_on(scope.pop()) {
            bail!("compiling WGSL kernel {name}: {e}");
        }
        let layout = pipeline.get_bind_group_layout(0);
        Ok(Kernel {
            name,
            rows: spec.mm_rows(),
            pipeline,
            layout,
        })
    }
}

/// A dispatch's workgroup counts: given, or read by the GPU from a buffer (3 u32 at an offset)
/// that earlier work wrote.
#[derive(Clone, Copy)]
pub enum Grid<'a> {
    Direct([u32; 3]),
    Indirect(&'a wgpu::Buffer, u64),
}

enum Op<'a> {
    Dispatch {
        kernel: &'a Kernel,
        /// What the profile calls it (the kernel's name, or a finer label such as "linear.experts").
        label: &'static str,
        bufs: Vec<&'a wgpu::Buffer>,
        param_off: u64,
        groups: Grid<'a>,
    },
    Copy {
        src: &'a wgpu::Buffer,
        src_off: u64,
        dst: &'a wgpu::Buffer,
        dst_off: u64,
        size: u64,
    },
}

/// Work encoded ahead of its submission (`Recorder::prepare`), and where in its parameters a
/// uniform is set at submission (`submit_with_uniform`).
pub struct Prepared<'a> {
    work: PreparedWork<'a>,
    uniform_at: Option<u64>,
}

enum PreparedWork<'a> {
    Encoded(&'a Gpu, wgpu::CommandBuffer),
    Later(Recorder<'a>),
}

impl Prepared<'_> {
    /// Byte `at` of the parameters takes the two words of `submit_with_uniform`.
    pub fn set_uniform_at(&mut self, at: u64) {
        self.uniform_at = Some(at);
    }

    pub fn submit(self) -> Result<()> {
        match self.work {
            PreparedWork::Encoded(gpu, cb) => {
                gpu.queue.submit([cb]);
                gpu.check()
            }
            PreparedWork::Later(r) => r.submit(),
        }
    }

    /// `submit` with `words` written at the place `set_uniform_at` named (the parameter
    /// buffer's write is queued after the one made when the work was encoded).
    pub fn submit_with_uniform(mut self, words: [u32; 2]) -> Result<()> {
        if let Some(at) = self.uniform_at {
            match &mut self.work {
                PreparedWork::Encoded(gpu, _) => {
                    let binder = gpu.binder.lock().unwrap_or_else(|p| p.into_inner());
                    let buf = binder.params.as_ref().context("no parameter buffer")?;
                    gpu.queue
                        .write_buffer(buf, at, bytemuck::cast_slice(&words));
                }
                PreparedWork::Later(r) => {
                    let at = at as usize;
                    r.params[at..at + 8].copy_from_slice(bytemuck::cast_slice(&words));
                }
            }
        }
        self.submit()
    }
}

/// Collects dispatches (kernel, parameters, storage buffers in binding order 1..) and copies,
/// then submits them in one command buffer with one parameter upload: wgpu cannot replay
/// recorded work, so recording is the per-step cost to keep small.
pub struct Recorder<'a> {
    gpu: &'a Gpu,
    ops: Vec<Op<'a>>,
    params: Vec<u8>,
    /// The profile's grouping of this submission ("decode", "prefill", ...) and its tokens.
    phase: &'static str,
    tokens: usize,
}

impl<'a> Recorder<'a> {
    pub fn new(gpu: &'a Gpu) -> Self {
        Recorder {
            gpu,
            ops: Vec::new(),
            params: Vec::new(),
            phase: "other",
            tokens: 0,
        }
    }

    /// Names the submission for the profile: `phase` and the tokens it advances.
    pub fn set_phase(&mut self, phase: &'static str, tokens: usize) {
        self.phase = phase;
        self.tokens = tokens;
    }

    /// `params`: the kernel's uniform struct as 32-bit words (f32 fields as their bits).
    pub fn dispatch(
        &mut self,
        kernel: &'a Kernel,
        params: &[u32],
        bufs: &[&'a wgpu::Buffer],
        groups: [u32; 3],
    ) {
        self.dispatch_as(kernel.name, kernel, params, bufs, groups);
    }

    /// `dispatch`, shown as `label` in the profile.
    pub fn dispatch_as(
        &mut self,
        label: &'static str,
        kernel: &'a Kernel,
        params: &[u32],
        bufs: &[&'a wgpu::Buffer],
        groups: [u32; 3],
    ) {
        if groups.contains(&0) {
            return;
        }
        self.push_dispatch(label, kernel, params, bufs, Grid::Direct(groups));
    }

    /// A dispatch whose workgroup counts the GPU reads from `args` at byte `offset` (written by
    /// earlier work of the submission; the buffer needs `Gpu::storage_indirect`).
    pub fn dispatch_indirect(
        &mut self,
        label: &'static str,
        kernel: &'a Kernel,
        params: &[u32],
        bufs: &[&'a wgpu::Buffer],
        args: &'a wgpu::Buffer,
        offset: u64,
    ) {
        self.push_dispatch(label, kernel, params, bufs, Grid::Indirect(args, offset));
    }

    fn push_dispatch(
        &mut self,
        label: &'static str,
        kernel: &'a Kernel,
        params: &[u32],
        bufs: &[&'a wgpu::Buffer],
        groups: Grid<'a>,
    ) {
        debug_assert!(params.len() * 4 <= PARAM_STRIDE as usize);
        let param_off = self.params.len() as u64;
        self.params.extend_from_slice(bytemuck::cast_slice(params));
        self.params
            .resize(param_off as usize + PARAM_STRIDE as usize, 0);
        self.ops.push(Op::Dispatch {
            kernel,
            label,
            bufs: bufs.to_vec(),
            param_off,
            groups,
        });
    }

    pub fn copy(
        &mut self,
        src: &'a wgpu::Buffer,
        src_off: u64,
        dst: &'a wgpu::Buffer,
        dst_off: u64,
        size: u64,
    ) {
        if size > 0 {
            self.ops.push(Op::Copy {
                src,
                src_off,
                dst,
                dst_off,
                size,
            });
        }
    }

    /// Encodes the work now (its parameters are written to the queue now, applied at the next
    /// submission), to be submitted later with `Prepared::submit` or dropped. Under the profile
    /// the recording itself is kept and submitted as usual.
    pub fn prepare(self) -> Result<Prepared<'a>> {
        let work = if self.gpu.profiled || self.ops.is_empty() {
            PreparedWork::Later(self)
        } else {
            let cb = self.encode(None)?;
            PreparedWork::Encoded(self.gpu, cb)
        };
        Ok(Prepared {
            work,
            uniform_at: None,
        })
    }

    /// Byte offset in the parameters of the last dispatch recorded.
    pub fn last_param_offset(&self) -> Option<u64> {
        self.ops.iter().rev().find_map(|op| match op {
            Op::Dispatch { param_off, .. } => Some(*param_off),
            Op::Copy { .. } => None,
        })
    }

    pub fn submit(self) -> Result<()> {
        if self.ops.is_empty() {
            return Ok(());
        }
        if self.gpu.profiled {
            return self.submit_profiled();
        }
        let cb = self.encode(None)?;
        self.gpu.queue.submit([cb]);
        self.gpu.check()
    }

    fn bind_group(
        g: &Gpu,
        kernel: &Kernel,
        bufs: &[&wgpu::Buffer],
        pbuf: &wgpu::Buffer,
        param_off: u64,
    ) -> wgpu::BindGroup {
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                buffer: pbuf,
                offset: param_off,
                size: NonZeroU64::new(PARAM_STRIDE),
            }),
        }];
        for (b, buf) in bufs.iter().enumerate() {
            entries.push(wgpu::BindGroupEntry {
                binding: b as u32 + 1,
                resource: buf.as_entire_binding(),
            });
        }
        g.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: Some(kernel.name),
            layout: &kernel.layout,
            entries: &entries,
        })
    }

    /// The command buffer of every op, consecutive dispatches in one compute pass; with
    /// `timestamps`, each dispatch in a pass of its own whose start and end land at queries
    /// 2i and 2i + 1 (i: the dispatch's index).
    fn encode(&self, timestamps: Option<&wgpu::QuerySet>) -> Result<wgpu::CommandBuffer> {
        let g = self.gpu;
        let mut binder = g.binder.lock().unwrap_or_else(|p| p.into_inner());
        let need = (self.params.len() as u64).max(PARAM_STRIDE);
        if binder.params.as_ref().is_none_or(|b| b.size() < need) {
            binder.groups.clear();
            binder.params = Some(g.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("params"),
                size: need.next_power_of_two(),
                usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }));
        }
        if binder.groups.len() > MAX_BIND_GROUPS {
            binder.groups.clear();
        }
        let pbuf = binder.params.clone().expect("made above");
        if !self.params.is_empty() {
            g.queue.write_buffer(&pbuf, 0, &self.params);
        }
        let mut enc = g
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        let mut i = 0;
        let mut nd = 0u32;
        while i < self.ops.len() {
            match &self.ops[i] {
                Op::Copy {
                    src,
                    src_off,
                    dst,
                    dst_off,
                    size,
                } => {
                    enc.copy_buffer_to_buffer(src, *src_off, dst, *dst_off, *size);
                    i += 1;
                }
                Op::Dispatch { .. } => {
                    let desc = wgpu::ComputePassDescriptor {
                        label: None,
                        timestamp_writes: timestamps.map(|qs| wgpu::ComputePassTimestampWrites {
                            query_set: qs,
                            beginning_of_pass_write_index: Some(2 * nd),
                            end_of_pass_write_index: Some(2 * nd + 1),
                        }),
                    };
                    let mut pass = enc.begin_compute_pass(&desc);
                    while let Some(Op::Dispatch {
                        kernel,
                        bufs,
                        param_off,
                        groups,
                        ..
                    }) = self.ops.get(i)
                    {
                        let key = BindKey {
                            kernel: &kernel.pipeline as *const _ as usize,
                            param_off: *param_off,
                            bufs: bufs.iter().map(|b| (*b).clone()).collect(),
                        };
                        let bg = binder.groups.entry(key).or_insert_with(|| {
                            Self::bind_group(g, kernel, bufs, &pbuf, *param_off)
                        });
                        pass.set_pipeline(&kernel.pipeline);
                        pass.set_bind_group(0, &*bg, &[]);
                        match groups {
                            Grid::Direct(n) => pass.dispatch_workgroups(n[0], n[1], n[2]),
                            Grid::Indirect(buf, off) => {
                                pass.dispatch_workgroups_indirect(buf, *off)
                            }
                        }
                        i += 1;
                        nd += 1;
                        if timestamps.is_some() {
                            break;
                        }
                    }
                }
            }
        }
        Ok(enc.finish())
    }
}

impl Recorder<'_> {
    /// `LILY_PROFILE=1`: the host time of encoding the submission as usual (encoded, then
    /// dropped), then the work itself with a GPU timestamp around each dispatch where the adapter
    /// has timestamp queries, else each dispatch submitted alone and timed on the host to
    /// completion (so including one submission each).
    fn submit_profiled(self) -> Result<()> {
        let gpu = self.gpu;
        gpu.wait()?;
        if profile::plain_turn(self.phase) {
            // Every other pass runs as without the profile, timed on the host to completion.
            let t0 = std::time::Instant::now();
            let cb = self.encode(None)?;
            gpu.queue.submit([cb]);
            gpu.wait()?;
            profile::add_wall(self.phase, self.tokens, t0.elapsed());
            return Ok(());
        }
        let t0 = std::time::Instant::now();
        let cb = self.encode(None)?;
        let host = t0.elapsed();
        drop(cb);
        profile::add_pass(self.phase, self.tokens, host);
        if gpu.timestamps {
            return self.submit_timestamped();
        }
        let Recorder {
            gpu,
            ops,
            params,
            phase,
            ..
        } = self;
        for op in ops {
            let (label, mut one) = match op {
                Op::Dispatch {
                    kernel,
                    label,
                    bufs,
                    param_off,
                    groups,
                } => {
                    let start = param_off as usize;
                    let mut one = Recorder::new(gpu);
                    let words: &[u32] =
                        bytemuck::cast_slice(&params[start..start + PARAM_STRIDE as usize]);
                    one.push_dispatch(label, kernel, words, &bufs, groups);
                    (label, one)
                }
                Op::Copy {
                    src,
                    src_off,
                    dst,
                    dst_off,
                    size,
                } => {
                    let mut one = Recorder::new(gpu);
                    one.copy(src, src_off, dst, dst_off, size);
                    ("copy", one)
                }
            };
            one.phase = phase;
            let t0 = std::time::Instant::now();
            let cb = one.encode(None)?;
            gpu.queue.submit([cb]);
            gpu.wait()?;
            profile::add_kernel(phase, label, t0.elapsed().as_secs_f64() * 1e9);
        }
        Ok(())
    }

    /// Submits in batches of at most 1,024 dispatches (2,048 timestamps), each read back.
    fn submit_timestamped(self) -> Result<()> {
        const BATCH: usize = 1024;
        let Recorder {
            gpu,
            ops,
            params,
            phase,
            tokens,
        } = self;
        let mut ops = ops.into_iter().peekable();
        let mut span_ns = 0.0;
        while ops.peek().is_some() {
            let mut batch = Recorder {
                gpu,
                ops: Vec::new(),
                params: params.clone(),
                phase,
                tokens,
            };
            let mut labels = Vec::new();
            while let Some(op) = ops.peek() {
                if let Op::Dispatch { label, .. } = op {
                    if labels.len() == BATCH {
                        break;
                    }
                    labels.push(*label);
                }
                batch.ops.push(ops.next().expect("peeked"));
            }
            if labels.is_empty() {
                let cb = batch.encode(None)?;
                gpu.queue.submit([cb]);
                continue;
            }
            let n = 2 * labels.len() as u32;
            let qs = gpu.device.create_query_set(&wgpu::QuerySetDescriptor {
                label: Some("profile"),
                ty: wgpu::QueryType::Timestamp,
                count: n,
            });
            let resolve = gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("profile.resolve"),
                size: n as u64 * 8,
                usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            });
            let cb = batch.encode(Some(&qs))?;
            let mut enc = gpu
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
            enc.resolve_query_set(&qs, 0..n, &resolve, 0);
            gpu.queue.submit([cb, enc.finish()]);
            let ticks: Vec<u64> =
                bytemuck::cast_slice(&gpu.read(&resolve, 0, n as u64 * 8)?).to_vec();
            let period = gpu.queue.get_timestamp_period() as f64;
            let (mut first, mut last) = (u64::MAX, 0u64);
            for (i, label) in labels.iter().enumerate() {
                let (a, b) = (ticks[2 * i], ticks[2 * i + 1]);
                first = first.min(a);
                last = last.max(b);
                profile::add_kernel(phase, label, b.saturating_sub(a) as f64 * period);
            }
            span_ns += last.saturating_sub(first) as f64 * period;
        }
        profile::add_span(phase, span_ns);
        Ok(())
    }
}

/// `LILY_PROFILE=1` (or `LILY_WGPU_PROFILE=1`): GPU time per kernel label, grouped by phase
/// (a decode step, a prefill chunk), per token of that phase. Passes alternate: one runs as
/// without the profile (encoded, submitted, waited for: its wall time per token), the next is
/// timed per dispatch. With timestamp queries (Vulkan, Metal on most GPUs) the times are the
/// GPU's own, each dispatch then in a compute pass of its own; without, each dispatch is
/// submitted alone and timed on the host. Every submission is waited for, so tok/s measured
/// meanwhile are lower than without the profile. `lily-engine bench` prints the table at its end.
pub mod profile {
    use std::collections::BTreeMap;
    use std::sync::Mutex;
    use std::time::Duration;

    #[derive(Default)]
    struct Phase {
        /// Passes (and their tokens) timed per dispatch.
        passes: u64,
        tokens: u64,
        host: Duration,
        /// Passes (and their tokens) run as without the profile, and their wall time.
        plain_passes: u64,
        plain_tokens: u64,
        wall: Duration,
        span_ns: f64,
        kernels: BTreeMap<&'static str, (u64, f64)>,
    }

    static TABLE: Mutex<BTreeMap<&'static str, Phase>> = Mutex::new(BTreeMap::new());
    static SOURCE: Mutex<&'static str> = Mutex::new("");
    static ENABLED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

    /// Whether a device was opened with profiling (`WgpuOptions::profile`).
    pub fn enabled() -> bool {
        ENABLED.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Set when a device opens.
    pub fn set_enabled(on: bool) {
        ENABLED.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// How the times are taken (set when the device opens).
    pub fn set_source(s: &'static str) {
        *SOURCE.lock().unwrap_or_else(|p| p.into_inner()) = s;
    }

    fn with<R>(phase: &'static str, f: impl FnOnce(&mut Phase) -> R) -> R {
        let mut t = TABLE.lock().unwrap_or_else(|p| p.into_inner());
        f(t.entry(phase).or_default())
    }

    /// Whether this pass of `phase` runs unprofiled (every other one does).
    pub fn plain_turn(phase: &'static str) -> bool {
        with(phase, |p| p.passes > p.plain_passes)
    }

    pub fn add_wall(phase: &'static str, tokens: usize, wall: Duration) {
        with(phase, |p| {
            p.plain_passes += 1;
            p.plain_tokens += tokens as u64;
            p.wall += wall;
        });
    }

    pub fn add_pass(phase: &'static str, tokens: usize, host: Duration) {
        with(phase, |p| {
            p.passes += 1;
            p.tokens += tokens as u64;
            p.host += host;
        });
    }

    pub fn add_kernel(phase: &'static str, label: &'static str, ns: f64) {
        with(phase, |p| {
            let e = p.kernels.entry(label).or_default();
            e.0 += 1;
            e.1 += ns;
        });
    }

    pub fn add_span(phase: &'static str, ns: f64) {
        with(phase, |p| p.span_ns += ns);
    }

    /// The report, then forgets it (`None` when profiling is off or nothing ran).
    pub fn take_report() -> Option<String> {
        let r = report();
        reset();
        r
    }

    /// Forgets what was measured so far (after a warm-up).
    pub fn reset() {
        TABLE.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }

    /// Per phase: passes, tokens, host encoding time and GPU span per token, then one line per
    /// label, slowest first: µs per token, calls per token, µs per call, share of the phase.
    /// `None` when profiling is off or nothing ran.
    pub fn report() -> Option<String> {
        if !enabled() {
            return None;
        }
        let t = TABLE.lock().unwrap_or_else(|p| p.into_inner());
        if t.is_empty() {
            return None;
        }
        let source = *SOURCE.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = format!("wgpu profile ({source}):\n");
        // Decode last: a log's tail keeps it.
        let order = |name: &str| match name {
            "prefill" => 0,
            "pick" => 1,
            "decode" => 3,
            _ => 2,
        };
        let mut phases: Vec<_> = t.iter().collect();
        phases.sort_by_key(|(name, _)| order(name));
        for (name, p) in phases {
            let tok = p.tokens.max(1) as f64;
            let total: f64 = p.kernels.values().map(|k| k.1).sum();
            out += &format!(
                "[{name}] per token: kernels {:.1} µs, GPU span {:.1} µs, host encoding {:.1} µs ({} passes, {} tokens timed per dispatch); wall {:.1} µs ({} passes, {} tokens run as without the profile)\n",
                total / 1e3 / tok,
                p.span_ns / 1e3 / tok,
                p.host.as_secs_f64() * 1e6 / tok,
                p.passes,
                p.tokens,
                p.wall.as_secs_f64() * 1e6 / p.plain_tokens.max(1) as f64,
                p.plain_passes,
                p.plain_tokens,
            );
            out += &format!(
                "  {:<22} {:>11} {:>10} {:>10} {:>6}\n",
                "kernel", "µs/token", "calls/tok", "µs/call", "%"
            );
            let mut rows: Vec<_> = p.kernels.iter().collect();
            rows.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
            for (label, (n, ns)) in rows {
                out += &format!(
                    "  {label:<22} {:>11.1} {:>10.2} {:>10.2} {:>6.1}\n",
                    ns / 1e3 / tok,
                    *n as f64 / tok,
                    ns / 1e3 / *n as f64,
                    100.0 * ns / total.max(1e-9)
                );
            }
        }
        Some(out)
    }
}

/// Workgroups for `n` units along x, spilling into y past the per-dimension limit:
/// (x, y) with x ≤ 65,535; a kernel recovers the unit as `wid.x + wid.y · x`.
pub fn grid_2d(n: usize) -> (u32, u32) {
    const MAX: usize = 65_535;
    if n <= MAX {
        (n as u32, 1)
    } else {
        (MAX as u32, n.div_ceil(MAX) as u32)
    }
}
