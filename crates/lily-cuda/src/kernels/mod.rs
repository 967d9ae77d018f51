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
    /// attention.cu with LILY_KV_INT8 (`kv_cache int8`: int8-row KV caches).
    pub kv_int8: bool,
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
                &attention::FILE.load_with(
                    gpu,
                    bf16,
                    &(if build.kv_int8 {
                        vec!["LILY_KV_INT8=1".to_string()]
                    } else {
                        Vec::new()
                    }),
                )?,
                bf16,
                gemm::runs_wgmma(gpu),
                build.kv_int8,
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

/// The most blocks a launch may have in grid.y or grid.z (CUDA's limit; grid.x takes 2³¹ − 1).
pub const GRID_Y_MAX: usize = 65_535;

/// The largest prefill chunk (`CudaOptions::chunk`, `LILY_PREFILL_CHUNK`) the kernels take for
/// `cfg`: dn_conv (kernels/deltanet.rs) puts the chunk's tokens in grid.y, the grouped experts
/// kernels their tiles (moe::max_group_tiles of chunk × top_k items); linear_gather loops over
/// its items past GRID_Y_MAX. And every index into the chunk's scratch must stay an int: a
/// chunk's rows of the widest per-token activation (chunk × top_k × hidden for the routed
/// experts' outputs) below 2³¹. The scratch's bytes grow with the chunk too; that bound is the
/// device's memory (Scratch::new fails with the allocation's error).
pub fn max_chunk(cfg: &ModelConfig) -> usize {
    let qkvz = cfg.conv_dim() + cfg.dn_v_heads * (cfg.dn_v_dim + 2);
    let widest = [
        cfg.top_k * cfg.hidden.max(cfg.expert_inter),
        qkvz,
        2 * cfg.n_heads * cfg.head_dim,
        cfg.n_experts,
        cfg.shared_inter,
        cfg.hidden,
    ]
    .into_iter()
    .max()
    .unwrap_or(1)
    .max(1);
    let mut chunk = GRID_Y_MAX.min(i32::MAX as usize / widest);
    while chunk > 0 && moe::max_group_tiles(chunk * cfg.top_k, cfg.n_experts) > GRID_Y_MAX {
        chunk -= 1;
    }
    chunk
}

/// `chunk` as a prefill chunk for `cfg`: 1 ..= max_chunk(cfg) tokens.
pub fn check_chunk(cfg: &ModelConfig, chunk: usize) -> Result<()> {
    let max = max_chunk(cfg);
    if chunk == 0 || chunk > max {
        bail!(
            "prefill chunk {chunk} (CudaOptions::chunk, LILY_PREFILL_CHUNK) must be in 1..={max}: \
             dn_conv and the grouped experts kernels put the chunk's tokens and expert tiles in \
             grid.y (at most {GRID_Y_MAX}), and the chunk's scratch offsets must fit an int"
        );
    }
    Ok(())
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

#[cfg(test)]
mod chunk_tests {
    use super::*;
    use lily_core::synth::{preset_text_config, Preset};

    fn full_config() -> ModelConfig {
        ModelConfig::from_json(&preset_text_config(Preset::Full)).unwrap()
    }

    #[test]
    fn the_full_model_takes_chunks_up_to_the_grid_y_limit() {
        let cfg = full_config();
        // 65,535 tokens × 8 × 2,048 = 1.07e9 < 2³¹; 524,280 items in tiles of 16 + 256 = 33,024.
        assert_eq!(max_chunk(&cfg), GRID_Y_MAX);
        for chunk in [1, 4_096, 8_192, 16_384, 32_768, GRID_Y_MAX] {
            check_chunk(&cfg, chunk).unwrap();
        }
        // The old bound (chunk × top_k ≤ 65,535) refused these.
        assert!(8_192 * cfg.top_k > GRID_Y_MAX);
    }

    #[test]
    fn a_chunk_of_zero_or_past_the_bound_is_refused_naming_the_switch() {
        let cfg = full_config();
        for chunk in [0, GRID_Y_MAX + 1, 1 << 20] {
            let e = check_chunk(&cfg, chunk).unwrap_err().to_string();
            assert!(e.contains("LILY_PREFILL_CHUNK"), "{e}");
            assert!(e.contains(&format!("prefill chunk {chunk} ")), "{e}");
            assert!(e.contains("1..=65535"), "{e}");
        }
    }

    #[test]
    fn a_wider_model_is_bounded_by_its_int_offsets_and_tiles() {
        // 64 of 512 experts on a 8,192-wide model: chunk × 64 × 8,192 < 2³¹ gives 4,095.
        let mut cfg = full_config();
        cfg.hidden = 8_192;
        cfg.top_k = 64;
        cfg.n_experts = 512;
        let max = max_chunk(&cfg);
        assert_eq!(max, (i32::MAX as usize) / (64 * 8_192));
        assert!(max * 64 * 8_192 <= i32::MAX as usize);
        assert!((max + 1) * 64 * 8_192 > i32::MAX as usize);
        check_chunk(&cfg, max).unwrap();
        assert!(check_chunk(&cfg, max + 1).is_err());
    }
}
