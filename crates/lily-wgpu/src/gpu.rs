//! The wgpu runtime: adapter choice, device, buffers, reads back to the host, and the recorder
//! that batches a forward pass's dispatches into one submission.

use std::num::NonZeroU64;
use std::sync::{Arc, Mutex};

use anyhow::{anyhow, bail, Context, Result};
use wgpu::util::DeviceExt;

/// Bytes reserved per dispatch in the parameter buffer: every uniform offset must be a multiple
/// of the device's alignment (256 on every adapter wgpu supports), and no kernel's parameters
/// are larger.
const PARAM_STRIDE: u64 = 256;

pub struct Gpu {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: wgpu::AdapterInfo,
    pub limits: wgpu::Limits,
    /// The first validation or out-of-memory error wgpu reported asynchronously, if any.
    error: Arc<Mutex<Option<String>>>,
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

impl Gpu {
    /// The best adapter (discrete, integrated, virtual, then software such as lavapipe), or the
    /// first whose name contains `$LILY_WGPU_ADAPTER`. `allow_software`: whether a CPU adapter
    /// (lavapipe, SwiftShader) may be chosen.
    pub fn open(allow_software: bool) -> Result<Gpu> {
        let instance = instance();
        let mut adapters = pollster::block_on(instance.enumerate_adapters(backends()));
        if adapters.is_empty() {
            bail!("wgpu found no Vulkan or Metal adapter (on Linux: is a Vulkan driver and libvulkan1 installed?)");
        }
        adapters.sort_by_key(|a| rank(a.get_info().device_type));
        let wanted = std::env::var("LILY_WGPU_ADAPTER").ok();
        let adapter = match &wanted {
            Some(name) => adapters
                .into_iter()
                .find(|a| a.get_info().name.contains(name.as_str()))
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
        let limits = adapter.limits();
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("lily"),
            required_features: wgpu::Features::empty(),
            required_limits: limits.clone(),
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
            error,
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

    /// A zero-filled storage buffer of at least `bytes` (rounded up to 4, at least 4).
    pub fn storage(&self, label: &str, bytes: u64) -> Result<wgpu::Buffer> {
        let size = bytes.max(4).div_ceil(4) * 4;
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
    pipeline: wgpu::ComputePipeline,
    layout: wgpu::BindGroupLayout,
}

impl Kernel {
    /// Compiles `source` (with the shared helpers in front); the entry point is named `name`.
    /// `checked`: keep wgpu's bounds checks in the generated shader (slower; for debugging).
    pub fn new(
        gpu: &Gpu,
        name: &'static str,
        common: &str,
        source: &str,
        checked: bool,
    ) -> Result<Kernel> {
        let code = format!("{common}\n{source}");
        let scope = gpu.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let desc = wgpu::ShaderModuleDescriptor {
            label: Some(name),
            source: wgpu::ShaderSource::Wgsl(code.into()),
        };
        let module = if checked {
            gpu.device.create_shader_module(desc)
        } else {
            // SAFETY: every index a kernel computes is bounded by the shapes checked at load
            // (weights.rs, forward.rs); the design asks for unchecked modules for speed.
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
                compilation_options: Default::default(),
                cache: None,
            });
        if let Some(e) = pollster::block_on(scope.pop()) {
            bail!("compiling WGSL kernel {name}: {e}");
        }
        let layout = pipeline.get_bind_group_layout(0);
        Ok(Kernel {
            name,
            pipeline,
            layout,
        })
    }
}

enum Op<'a> {
    Dispatch {
        kernel: &'a Kernel,
        bufs: Vec<&'a wgpu::Buffer>,
        param_off: u64,
        groups: [u32; 3],
    },
    Copy {
        src: &'a wgpu::Buffer,
        src_off: u64,
        dst: &'a wgpu::Buffer,
        dst_off: u64,
        size: u64,
    },
}

/// Collects dispatches (kernel, parameters, storage buffers in binding order 1..) and copies,
/// then submits them in one command buffer with one parameter upload: wgpu cannot replay
/// recorded work, so recording is the per-step cost to keep small.
pub struct Recorder<'a> {
    gpu: &'a Gpu,
    ops: Vec<Op<'a>>,
    params: Vec<u8>,
}

impl<'a> Recorder<'a> {
    pub fn new(gpu: &'a Gpu) -> Self {
        Recorder {
            gpu,
            ops: Vec::new(),
            params: Vec::new(),
        }
    }

    /// `params`: the kernel's uniform struct as 32-bit words (f32 fields as their bits).
    pub fn dispatch(
        &mut self,
        kernel: &'a Kernel,
        params: &[u32],
        bufs: &[&'a wgpu::Buffer],
        groups: [u32; 3],
    ) {
        debug_assert!(params.len() * 4 <= PARAM_STRIDE as usize);
        if groups.contains(&0) {
            return;
        }
        let param_off = self.params.len() as u64;
        self.params.extend_from_slice(bytemuck::cast_slice(params));
        self.params
            .resize(param_off as usize + PARAM_STRIDE as usize, 0);
        self.ops.push(Op::Dispatch {
            kernel,
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

    pub fn submit(self) -> Result<()> {
        if self.ops.is_empty() {
            return Ok(());
        }
        if profile::enabled() {
            return self.submit_profiled();
        }
        self.submit_plain()
    }

    fn submit_plain(self) -> Result<()> {
        let g = self.gpu;
        let pbuf = (!self.params.is_empty()).then(|| {
            g.device
                .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                    label: Some("params"),
                    contents: &self.params,
                    usage: wgpu::BufferUsages::UNIFORM,
                })
        });
        let mut enc = g
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: None });
        let mut i = 0;
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
                    let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor::default());
                    while let Some(Op::Dispatch {
                        kernel,
                        bufs,
                        param_off,
                        groups,
                    }) = self.ops.get(i)
                    {
                        let pbuf = pbuf.as_ref().expect("dispatches have parameters");
                        let mut entries = vec![wgpu::BindGroupEntry {
                            binding: 0,
                            resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                                buffer: pbuf,
                                offset: *param_off,
                                size: NonZeroU64::new(PARAM_STRIDE),
                            }),
                        }];
                        for (b, buf) in bufs.iter().enumerate() {
                            entries.push(wgpu::BindGroupEntry {
                                binding: b as u32 + 1,
                                resource: buf.as_entire_binding(),
                            });
                        }
                        let bg = g.device.create_bind_group(&wgpu::BindGroupDescriptor {
                            label: Some(kernel.name),
                            layout: &kernel.layout,
                            entries: &entries,
                        });
                        pass.set_pipeline(&kernel.pipeline);
                        pass.set_bind_group(0, &bg, &[]);
                        pass.dispatch_workgroups(groups[0], groups[1], groups[2]);
                        i += 1;
                    }
                }
            }
        }
        g.queue.submit([enc.finish()]);
        g.check()
    }
}

impl Recorder<'_> {
    /// Each dispatch in a submission of its own, timed to completion (`LILY_WGPU_PROFILE=1`).
    fn submit_profiled(self) -> Result<()> {
        let Recorder { gpu, ops, params } = self;
        for op in ops {
            let (name, one) = match op {
                Op::Dispatch {
                    kernel,
                    bufs,
                    param_off,
                    groups,
                } => {
                    let start = param_off as usize;
                    let mut one = Recorder::new(gpu);
                    let words: &[u32] =
                        bytemuck::cast_slice(&params[start..start + PARAM_STRIDE as usize]);
                    one.dispatch(kernel, words, &bufs, groups);
                    (kernel.name, one)
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
            let t0 = std::time::Instant::now();
            one.submit_plain()?;
            gpu.wait()?;
            profile::add(name, t0.elapsed());
        }
        Ok(())
    }
}

/// Per-kernel wall time when `LILY_WGPU_PROFILE=1`: each dispatch is submitted alone and
/// waited for (so the totals include one submission each); the table is logged when the
/// backend is dropped.
pub mod profile {
    use std::collections::BTreeMap;
    use std::sync::Mutex;
    use std::time::Duration;

    static TABLE: Mutex<BTreeMap<&'static str, (u64, Duration)>> = Mutex::new(BTreeMap::new());

    pub fn enabled() -> bool {
        std::env::var("LILY_WGPU_PROFILE").is_ok_and(|v| v == "1")
    }

    pub fn add(name: &'static str, d: Duration) {
        let mut t = TABLE.lock().unwrap_or_else(|p| p.into_inner());
        let e = t.entry(name).or_default();
        e.0 += 1;
        e.1 += d;
    }

    /// One line per kernel, slowest first: total ms, calls, µs per call.
    pub fn report() -> String {
        let t = TABLE.lock().unwrap_or_else(|p| p.into_inner());
        let mut rows: Vec<_> = t.iter().collect();
        rows.sort_by_key(|r| std::cmp::Reverse(r.1 .1));
        rows.iter()
            .map(|(name, (n, d))| {
                format!(
                    "{name:>12} {:>10.1} ms {n:>8} calls {:>9.1} µs/call",
                    d.as_secs_f64() * 1e3,
                    d.as_secs_f64() * 1e6 / *n as f64
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
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
