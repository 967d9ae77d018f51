//! The kernel catalogue: one launcher module per kernel file of `shaders/cuda/` (X.cu ↔ X.rs).
//! Each module owns its file (`FILE`: the source and the compile-time constants passed to NVRTC
//! as `-DNAME=VALUE`, so every constant is written once, in Rust), its kernel handles, their
//! launch geometry and shared-memory opt-in, its shape limits, and launch methods that take
//! typed argument structs. Which kernel runs for a given shape is the plan's decision (plan.rs):
//! a launcher that serves several kernels takes the plan's choice as an argument (an enum beside
//! it) and tests no switch.

pub mod attention;
pub mod decode;
pub mod deltanet;
pub mod embed;
pub mod gemm;
pub mod linear;
pub mod moe;
pub mod norm;
pub mod sample;

use anyhow::{bail, Result};
use cudarc::driver::LaunchConfig;
use lily_core::config::ModelConfig;

use crate::gpu::{Gpu, Module};
use crate::weights::DevLinear;

/// The shared header: bf16/fp32 helpers, warp reductions, the packed-weight reader. NVRTC 13 has
/// no CUDA headers to include, so it is prepended to every file.
pub const COMMON: &str = include_str!("../../../../shaders/cuda/common.cuh");

/// One kernel file: its module name, its source and the constants its launcher defines for it.
pub struct KernelFile {
    pub name: &'static str,
    pub source: &'static str,
    /// `-DNAME=VALUE` for NVRTC: the launcher module's `pub const`s the kernels are built with.
    pub defines: &'static [(&'static str, i64)],
}

impl KernelFile {
    /// The exact text NVRTC compiles: the shared header, then the file with its own line numbers.
    pub fn full_source(&self) -> String {
        format!("{COMMON}\n#line 1 \"{}.cu\"\n{}", self.name, self.source)
    }

    /// The preprocessor defines for an activation mode (see common.cuh) plus the file's constants.
    pub fn defines(&self, bf16_activations: bool) -> Vec<String> {
        let mut out = Vec::new();
        if bf16_activations {
            out.push("LILY_BF16_ACT=1".to_string());
        }
        out.extend(self.defines.iter().map(|(n, v)| format!("{n}={v}")));
        out
    }

    /// This file's module on `gpu` (compiled by NVRTC or from the kernel cache).
    pub fn load(&self, gpu: &Gpu, bf16_activations: bool) -> Result<Module> {
        self.load_with(gpu, bf16_activations, &[])
    }

    /// `load` with more `NAME=VALUE` defines (a plan's compile-time variant of the file).
    pub fn load_with(&self, gpu: &Gpu, bf16_activations: bool, extra: &[String]) -> Result<Module> {
        let mut defines = self.defines(bf16_activations);
        defines.extend(extra.iter().cloned());
        gpu.load_module(self.name, &self.full_source(), &defines)
    }
}

/// Every kernel file, in load order.
pub const FILES: &[&KernelFile] = &[
    &embed::FILE,
    &norm::FILE,
    &linear::FILE,
    &gemm::FILE,
    &attention::FILE,
    &deltanet::FILE,
    &moe::FILE,
    &sample::FILE,
    &decode::FILE,
];

/// The compile-time variants of the kernel files a plan asks for (`plan::Plan::build`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelBuild {
    /// Every file in its bf16-activation form (LILY_BF16_ACT), else fp32.
    pub bf16_activations: bool,
    /// decode.cu with DEC_EARLY_TRIGGER.
    pub early_trigger: bool,
    /// sample.cu with SAMPLE_WARP_SCAN.
    pub warp_scan_sampling: bool,
}

/// Every kernel Lily launches, by kernel file.
pub struct Kernels {
    pub embed: embed::Embed,
    pub norm: norm::Norm,
    pub linear: linear::Linear,
    pub gemm: gemm::Gemm,
    pub attention: attention::Attention,
    pub deltanet: deltanet::DeltaNet,
    pub moe: moe::Moe,
    pub sample: sample::Sample,
    pub decode: decode::Decode,
}

impl Kernels {
    /// Loads every kernel file for `gpu` in the variants `build` asks for.
    pub fn load(gpu: &Gpu, build: &KernelBuild) -> Result<Kernels> {
        let bf16 = build.bf16_activations;
        Ok(Kernels {
            embed: embed::Embed::load(&embed::FILE.load(gpu, bf16)?)?,
            norm: norm::Norm::load(&norm::FILE.load(gpu, bf16)?)?,
            linear: linear::Linear::load(&linear::FILE.load(gpu, bf16)?)?,
            gemm: gemm::Gemm::load(gpu, &gemm::FILE.load(gpu, bf16)?, gemm::runs_wgmma(gpu))?,
            attention: attention::Attention::load(
                &attention::FILE.load(gpu, bf16)?,
                bf16,
                gemm::runs_wgmma(gpu),
            )?,
            deltanet: deltanet::DeltaNet::load(&deltanet::FILE.load(gpu, bf16)?)?,
            moe: moe::Moe::load(&moe::FILE.load(gpu, bf16)?)?,
            sample: sample::Sample::load(&sample::FILE.load_with(
                gpu,
                bf16,
                &[format!(
                    "SAMPLE_WARP_SCAN={}",
                    build.warp_scan_sampling as i32
                )],
            )?)?,
            decode: decode::Decode::load(&decode::FILE.load_with(
                gpu,
                bf16,
                &[format!("DEC_EARLY_TRIGGER={}", build.early_trigger as i32)],
            )?)?,
        })
    }
}

/// Shape limits of the kernels, checked once when a model is loaded.
pub fn check_limits(cfg: &ModelConfig) -> Result<()> {
    attention::check_limits(cfg)?;
    deltanet::check_limits(cfg)?;
    moe::check_limits(cfg)
}

/// Device rows of f32 (activations): the first row's address and the distance between rows, in
/// elements. Kernels take raw addresses so callers can point into the middle of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rows {
    pub ptr: u64,
    pub stride: usize,
}

impl Rows {
    pub fn new(ptr: u64, stride: usize) -> Rows {
        Rows { ptr, stride }
    }
}

/// How a kernel writes its output rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Store {
    /// y = result (rounded to the activation type).
    Overwrite,
    /// y += result: the residual add fused into the projection.
    AddToResidual,
}

/// Blocks of `per` covering `n`.
pub(crate) fn blocks(n: usize, per: usize) -> u32 {
    n.div_ceil(per) as u32
}

/// A launch of `grid` blocks of `block` threads with `smem` bytes of dynamic shared memory.
pub(crate) fn config(grid: (u32, u32, u32), block: u32, smem: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: smem as u32,
    }
}

/// linear.cu and gemm.cu read activations with 16-byte vector loads: rows must start 16-byte
/// aligned.
pub(crate) fn check_x(kernel: &str, x: Rows) -> Result<()> {
    if !x.ptr.is_multiple_of(16) || !x.stride.is_multiple_of(4) {
        bail!(
            "{kernel}: activations at {:#x} with row stride {} are not 16-byte aligned",
            x.ptr,
            x.stride
        );
    }
    Ok(())
}

/// y = W x for one weight and n_tok rows of activations.
pub struct Project<'a> {
    pub w: &'a DevLinear,
    pub x: Rows,
    /// The same rows staged as bf16 (`gemm::Gemm::to_bf16`; stride in bf16 elements), for the
    /// kernels that read them so; None: only `x`.
    pub xb: Option<Rows>,
    pub y: Rows,
    pub n_tok: usize,
}

/// Routed items grouped by expert on the device (`moe::Moe::group` builds them): `perm`
/// [n_items] i32 lists items expert by expert, `tiles` [max_tiles][3] i32 holds (expert, start in
/// perm, count ≤ tile), `n_tiles` [1] i32 how many tiles were made. Launch grids cover
/// `max_tiles`; blocks past `n_tiles` exit. With `tail` > 0 (the plan's `Experts::Gemm::tail`)
/// each expert's last ≤ `tail` items are a second list: `tail_tiles` [n_experts][3] i32, its
/// count in n_tiles[1] (`n_tiles` then holds 2 i32), run by a second launch (`tail_groups`).
#[derive(Clone, Copy, Debug)]
pub struct ExpertGroups {
    pub perm: u64,
    pub tiles: u64,
    pub n_tiles: u64,
    pub max_tiles: usize,
    /// Most items per tile: linear::GROUP_TILE for linear_grouped, 32, 64 or 128 for
    /// gemm_grouped.
    pub tile: usize,
    /// Items of an expert's remainder run in the second list (0: none, one list).
    pub tail: usize,
    pub tail_tiles: u64,
}

impl ExpertGroups {
    /// The second list as groups of its own (tiles of `tail` items, at most one an expert, over
    /// the same `perm`) for the launch of the remainders.
    pub fn tail_groups(&self, n_experts: usize) -> ExpertGroups {
        ExpertGroups {
            tiles: self.tail_tiles,
            n_tiles: self.n_tiles + 4,
            max_tiles: n_experts,
            tile: self.tail,
            tail: 0,
            tail_tiles: 0,
            ..*self
        }
    }
}

/// y[item, :] = W_{expert(item)} x[item / x_div, :] over the tiles of `groups`.
pub struct Grouped<'a> {
    pub w: &'a DevLinear,
    pub groups: ExpertGroups,
    pub x: Rows,
    /// x staged as bf16, as `Project::xb`.
    pub xb: Option<Rows>,
    /// Items per activation row (top_k for the gate/up projections of routed tokens, 1 after).
    pub x_div: usize,
    pub y: Rows,
}
