//! What the wgpu backend runs, decided in one place: `WgpuOptions` (options.rs: each option
//! declared once, the environment overrides applied in one function) resolved
//! against the adapter's limits and the model's shapes into a `Plan` that names, for each
//! launch site of forward.rs, the concrete kernel (file and `override` constants) that runs.
//! forward.rs matches on the plan's answers; it tests no shape itself.
//!
//! The choices, and why each is the default (measurements: docs/perf-notes.md):
//! - prefill's 4-bit and 8-bit plain (dense) products: linear_q4_mm.wgsl with tiles of 32 items
//!   (DeltaNet in_proj 73.9 → 67.4 µs a token on the H200 against 16, session 7); the routed
//!   experts' tiles: 16 items (42.5 against 43.9 µs with 32: an expert averages 64 items at chunk
//!   2048, tiles of 32 run emptier); with f16 tiles (`f16_tiles`, off until measured: session 11
//!   wgpu-prefill in docs/perf-notes.md) the dense products take tiles of 64 where they fit the
//!   device's workgroup memory and each expert's tiles are sized by its load (`expert_tiles`);
//! - prefill's tile products on cooperative matrices (`coop`, on since its A/B: prefill +39 % at
//!   4K on an H100 through Vulkan, session 17 in docs/perf-notes.md): linear_q4_coop.wgsl in linear_q4_mm's place at every
//!   tile size (`Specs::linear_q4_mm16` / `32` / `64`: the same launches), its operands in f16
//!   (so the f16 tiles' sizes), where the device enabled the feature (`gpu::coop_size`: 16 × 16
//!   or 8 × 8 f16 × f16 → f32, subgroups of 32), the kernels fit its workgroup memory and the
//!   backend's check at load passes; with `coop_big` (on: session 21 on an H200 through Vulkan,
//!   prefill +25 % at 512 and +29 % at 4K, docs/perf-notes.md) linear_q4_coop_big.wgsl instead
//!   (the same launches; steps of 64 columns, every invocation staging, 2 × 2 subgroup blocks
//!   where the tile allows), the dense products on workgroups of 128 rows with `coop_rows` 128
//!   (the default) where they fit the device's workgroup memory (`Plan::mm_rows`: the launches'
//!   row blocks follow), the routed experts' grouped products on 64 (`Plan::expert_rows`,
//!   `Specs::experts_coop`: 128 lost there on the H100, session 22); where the
//!   backend's check at load refuses a kernel, `products_choice` names the next one
//!   (linear_q4_coop_big on 128 rows, on 64, then linear_q4_coop, then linear_q4_mm);
//! - prefill attention: attend_tile.wgsl (K/V read once per tile of tokens; 49.4 → 12.3 µs a token
//!   at a 4K prompt) with blocks of 32 keys, or of 16 where 32 do not fit the device's workgroup
//!   memory (Apple: 32 KiB), else attend_gqa.wgsl; decode attention: attend_gqa.wgsl (the query
//!   heads of a KV head together) where hq / hkv is a power of two ≤ 8, else attend.wgsl; its
//!   keys split with `attn_split` by `SplitRule::decode` (spans of one block of attend_gqa's keys,
//!   ≤ 256 splits, workgroups by the adapter's kind), off by `SplitRule::WIDE` (spans of 64 keys,
//!   ≤ 64 splits: prefill's rule); with `attn_flat` its reads unconditional (both on since the
//!   H100 through Vulkan measured attend_gqa 84.9 → 38.6 µs a layer at 4K, session 15);
//!   with `attn_v_early` (on since session 25: attend_gqa 92.3 → 86.3 µs a call at 32K on an
//!   H100 through Vulkan) and `attn_flat` a block's values requested as
//!   soon as its key products are formed (`attend_gqa_spec`'s `VEARLY`);
//! - decode's products: linear_q4_rows.wgsl (input in registers, norm folded in) for 2,048- and
//!   4,096-column 4-bit and 2,048-column 8-bit matrices, with 16 / 4 / 2 rows a workgroup by the
//!   matrix's rows (`rows_rb`: ≥ 128 workgroups; lm_head 16); the experts' gate/up as one GLU
//!   dispatch; their down projections and the weighted sum in one (moe_down_rows.wgsl), the
//!   routing inside the GLU dispatch (no moe_route.wgsl dispatch: 40 fewer a token on the full
//!   model), DeltaNet's conv inside in_proj's linear_q4_rows and its q/k norms inside
//!   dn_recur_norm (30 fewer), attn_prep's work inside attend_gqa (10 fewer); the general kernels
//!   (linear_q4.wgsl, linear.wgsl) for whatever else. The decode MoE's reads issued before any
//!   arithmetic (`EARLY` of linear_q4_rows: `rows_early`, the router 16.2 → 15.0 µs; of
//!   linear_q4_glu_rows, with its routing's cheaper rounds: `glu_early`, 36.0 → 28.9 µs) are on
//!   (session 15, the H100 through Vulkan). Measured and gone from main (docs/perf-notes.md,
//!   sessions 15–16): lm_head's 32 / 64 rows a workgroup, linear_q4_rows' flat and deep reads,
//!   moe_down_rows' early reads, the DeltaNet recurrence over column blocks with its gate in
//!   out_proj and dn_recur_norm's early reads. linear_q4_rows' 16-row kernel on a persistent
//!   grid (`rows_persist`: `rows_grid`, `PERSIST_RB`; CUDA's `dec_gemv4` geometry, the next
//!   round's reads in flight, the input staged once a workgroup) is on (session 20, the H100
//!   through Vulkan: decode +9.6 % at 4K, +9.4 % at 32K; in_proj 36.3 → 25.5 µs a call).
//!   On since session 21 (an H200 through Vulkan: decode +7.6 % at 4K, +6.9 % at 32K): the
//!   decode MoE in rounds (`moe_rounds`: linear_q4_glu_rows' `ITEMS`, `glu_items`;
//!   moe_down_rows' `ROUNDS`) and the 1,024–8,191-row products on 2 rows a workgroup
//!   (`out_rows` 2: `Plan::rows_rb`; 8 is the 8-row kernel in rounds), and the down products
//!   on 2 rows a workgroup (`down_rows` 2: +2–3 % at 4K with `moe_rounds`, an H100). The GLU's
//!   rows a workgroup (`glu_rows`) stay the rule's (4 lost: 30.1 against 26.9 µs a call).
//!   The 16-row kernel compiled for one-word rows (`rows_one_word`, on since session 24:
//!   `rows_spec`'s `WORDS` 1, `Plan::rows_rb` sending two-word matrices of ≥ 8,192 rows to the
//!   8-row kernel), which drops the second words' registers the persistent loop carried for
//!   every matrix since session 21: in_proj / q/k/v 34.1 / 31.0 → 24.8 / 23.1 µs a call, decode
//!   +9.6 % at 4K and +7.9 % at 32K (an H100 through Vulkan). The products of < 1,024 rows
//!   (the router) on a 1-row kernel whose row total and folded norm meet in one reduction
//!   (`router_lean`, on since session 26: `rows_lean_spec`'s `LEAN`; decode +4.0 % at 4K and
//!   +3.9 % at 32K, an H100 through Vulkan). The down products with one item a lane
//!   (`down_item_lanes`, on since session 31: moe_down_lanes.wgsl, `down_lanes_spec`; 160 lanes
//!   a workgroup on the full model, every item's reads in one trip after its id, the residual
//!   read at the start; decode +3.5 % at 4K and +2.2 % at 32K, an H100 through Vulkan).
//! - the workgroup reductions on subgroups where the adapter has them (reduce_subgroup.wgsl): the
//!   issue's design (29), not measured on a GPU yet (session 10 in docs/perf-notes.md);
//! - the activations between kernels and the KV cache in f16 (`f16_acts`, `f16_kv`: `auto`, `on`
//!   or `off`) where the adapter has SHADER_F16 and `f16_rule` says so for its kind: on for Apple
//!   GPUs through Metal (the deliverable 2, the seed's precision) and for NVIDIA's (their
//!   A/B with `coop` on an H100 through Vulkan, session 19: decode +1.9 % at 4K, +7.6 % at 32K),
//!   off on the others until measured; the DeltaNet state, the residual stream and every sum
//!   stay f32.

use anyhow::{bail, Result};
use lily_core::config::ModelConfig;

use crate::options::Choice;
use crate::shaders::{Form, Spec};
use crate::weights::{Fused, GpuLinear, GpuMoe};

pub use crate::options::WgpuOptions;

/// What the device offers the plan: its limits (as created) and the optional features enabled.
#[derive(Clone, Debug)]
pub struct DeviceCaps {
    pub limits: wgpu::Limits,
    pub subgroups: bool,
    pub f16: bool,
    /// The adapter's kind (`split_workgroups`: how many workgroups cover it).
    pub device_type: wgpu::DeviceType,
    /// The cooperative matrices enabled: their size (16 or 8; `gpu::coop_size`), or 0.
    pub coop: u32,
    /// Whether the adapter runs through wgpu's Metal backend (an Apple GPU): `f16_rule`'s
    /// `auto` turns f16 on there.
    pub metal: bool,
    /// The adapter's PCI vendor id (`wgpu::AdapterInfo::vendor`): `f16_rule`'s `auto` turns f16
    /// on for NVIDIA's (`VENDOR_NVIDIA`).
    pub vendor: u32,
}

/// The prefill chunk a plan takes for `asked` tokens: `asked`, halved while a chunk's largest
/// activation, the routed experts' outputs (`(top_k + 1) × hidden` values a token, the shared
/// expert's row included; `Scratch::new`'s `expert_out`), would exceed `max_binding` bytes. On the
/// full model at 4,096 tokens that buffer is 151 MB in f16 (302 MB in f32): it fits NVIDIA's
/// bindings and Apple's 1 GiB, not wgpu's default 128 MiB.
pub fn fitting_chunk(asked: usize, c: &ModelConfig, act_f16: bool, max_binding: u64) -> usize {
    let per_token = ((c.top_k + 1) * c.hidden) as u64 * crate::forward::act_bytes(act_f16);
    let mut chunk = asked.max(1);
    while chunk > 1 && chunk as u64 * per_token > max_binding {
        chunk /= 2;
    }
    chunk
}

/// NVIDIA's PCI vendor id (`DeviceCaps::vendor`).
pub const VENDOR_NVIDIA: u32 = 0x10de;

/// Where an f16 option (`f16_acts`, `f16_kv`) set to `auto` is on: the one rule for both, by the
/// adapter's kind.
/// - Apple GPUs through Metal: on. Their f16 arithmetic runs at full rate (f32's, with half the
///   registers) and memory is shared with the CPU at 68–800 GB/s, so the bytes f16 saves
///   (half the KV cache's and the activations' reads and writes, half the cache's memory) are
///   the decode's currency; the seed and MLX run f16 / bf16 activations there; measured on the
///   H200 through Vulkan, f16 activations agree with CUDA fp32 far inside HF transformers bf16's
///   bar (0.0569 against 0.246 relative L2 over 1,024 full-shape positions, docs/perf-notes.md,
///   issue 29). Never run on a Mac yet.
/// - NVIDIA GPUs (any backend; Vulkan is what runs there): on. Measured with `coop` on an H100
///   through Vulkan (session 19, scripts/wgpu_f16_ab.sh, two rounds): f16 activations and KV
///   cache against f32 gave decode +1.9 % at 4K and +7.6 % at 32K, prefill −0.8 % at 4K, half
///   the KV cache's memory, and agreed with CUDA fp32 at 0.0619 relative L2 (f32: 0.0594; HF
///   transformers bf16's bar 0.246) over 1,024 full-shape positions.
/// - Any other adapter (AMD, Intel, lavapipe and other CPU adapters): off until its A/B with
///   `coop` on decides (scripts/wgpu_f16_ab.sh measures it).
///
/// `on` and `off` force it; without SHADER_F16 it is off whatever was asked. Returns whether it
/// is on and the reason for the plan line where the plan decided or refused (`None` where the
/// option forced it and the adapter obliged). `as_apple`: resolve `auto` as on Apple's
/// (`WgpuOptions::auto_as_apple`, tests).
pub fn f16_rule(
    choice: Choice,
    device: &DeviceCaps,
    as_apple: bool,
) -> (bool, Option<&'static str>) {
    match (choice, device.f16) {
        (Choice::Off, _) => (false, None),
        (_, false) => (false, Some("the adapter lacks SHADER_F16")),
        (Choice::On, true) => (true, None),
        (Choice::Auto, true) if device.metal => (
            true,
            Some(
                "Apple GPUs through Metal: f16 at full rate, half the bytes; the seed's precision",
            ),
        ),
        (Choice::Auto, true) if device.vendor == VENDOR_NVIDIA => (
            true,
            Some(
                "NVIDIA: measured with coop, decode +2 % at 4K and +8 % at 32K, half the KV memory",
            ),
        ),
        (Choice::Auto, true) if as_apple => {
            (true, Some("Apple GPUs' default, asked for on this adapter"))
        }
        (Choice::Auto, true) => (false, Some("not yet measured on this adapter kind")),
    }
}

/// Items per tile of linear_q4_mm.wgsl (its `TT` override); 64 rows a workgroup either way.
/// Tiles of 64 in f16 take the bytes of f32 tiles of 32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MmTile {
    T16,
    T32,
    T64,
}

impl MmTile {
    pub fn items(self) -> usize {
        match self {
            MmTile::T16 => 16,
            MmTile::T32 => 32,
            MmTile::T64 => 64,
        }
    }

    /// This size and the smaller ones, largest first (moe_group.wgsl's sizes: each half the
    /// one before).
    pub fn down_to_16(self) -> Vec<MmTile> {
        [MmTile::T64, MmTile::T32, MmTile::T16]
            .into_iter()
            .filter(|t| t.items() <= self.items())
            .collect()
    }
}

/// Rows per workgroup of linear_q4_mm.wgsl.
pub const MM_ROWS: usize = 64;
/// Output rows one workgroup of linear.wgsl, linear_q4.wgsl, linear_q4_glu.wgsl and moe_down.wgsl
/// computes (their `ROWS`).
pub const LINEAR_ROWS: usize = 8;
/// Rows per workgroup of moe_down_rows.wgsl (its `RB` override; a power of two ≤ 8).
pub const DOWN_RB: usize = 4;
/// Rows per workgroup of linear_q4_glu_rows.wgsl (its `RB` override; a multiple of 8, ≤ 16).
pub const GLU_RB: usize = 8;

/// The kernel of prefill attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefillAttention {
    /// attend_tile.wgsl: tiles of 64 / g tokens × the g query heads of a KV head, blocks of
    /// `keys` keys (32, or 16 where 32 do not fit the workgroup memory).
    Tile { g: usize, keys: usize },
    /// attend_gqa.wgsl as at decode, one token a workgroup.
    Gqa,
    /// attend.wgsl, one head and token a workgroup.
    Plain,
}

/// How attention spreads the keys of its (head or KV head, token) pairs over workgroups, split
/// by split (forward.rs `attention_splits`; attend_merge.wgsl combines the splits). The plan's
/// `splits` says which rule a launch takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitRule {
    /// Workgroups wanted: the keys are split where the pairs are fewer than half this many.
    pub workgroups: usize,
    /// Keys per split: a multiple of this.
    pub granule: usize,
    /// Most splits per pair (≤ forward.rs `MERGE_MAX_SPLITS`).
    pub max_splits: usize,
    /// Rows of partials, (query head, token) × splits, at most (≤ forward.rs `PART_ROWS`).
    pub part_rows: usize,
}

impl SplitRule {
    /// Prefill's rule, and decode's without `attn_split`: ≈ 512 workgroups, spans of whole 64
    /// keys, ≤ 64 splits and 1,024 rows of partials (at 4K on the full model: 33 splits of 128
    /// keys a KV head, 66 workgroups of 4 blocks of attend_gqa's 32 keys).
    pub const WIDE: SplitRule = SplitRule {
        workgroups: 512,
        granule: 64,
        max_splits: 64,
        part_rows: 1024,
    };

    /// Decode's rule with `attn_split`: `workgroups` for the adapter (`split_workgroups`), spans
    /// of whole blocks of the kernel's keys (`granule`: attend_gqa's 256 / G), up to 256 splits
    /// (at 4K on the full model: 129 splits of 32 keys a KV head, 258 workgroups of one block;
    /// at 32K 205 of 160).
    pub fn decode(workgroups: usize, granule: usize) -> SplitRule {
        SplitRule {
            workgroups,
            granule,
            max_splits: 256,
            part_rows: 4096,
        }
    }
}

/// Workgroups decode attention wants with `attn_split`, by the adapter's kind: a discrete GPU's
/// (the H200's 132 SMs: ≈ 4 each), an integrated one's (Apple's 8–40 GPU cores: 3–16 each),
/// anything else's (lavapipe's CPU threads).
pub fn split_workgroups(device_type: wgpu::DeviceType) -> usize {
    match device_type {
        wgpu::DeviceType::DiscreteGpu => 512,
        wgpu::DeviceType::IntegratedGpu => 128,
        _ => 64,
    }
}

/// The kernel of decode attention (split over the keys where the heads alone do not fill the
/// GPU, merged by attend_merge.wgsl).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DecodeAttention {
    /// attend_gqa.wgsl: the g query heads of a KV head in one workgroup.
    Gqa { g: usize },
    /// attend.wgsl.
    Plain,
}

/// The kernel one matrix product (a launch site of `Forward::linear`) takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LinearKernel {
    /// linear_q4_rows.wgsl (decode; the norm may be folded in), `rows_rb` rows a workgroup.
    Rows,
    /// linear_q4_mm.wgsl (prefill): 64 rows × a tile of items a workgroup.
    Mm(MmTile),
    /// linear_q4.wgsl: 16-byte reads of 4-bit (or 8-bit) weights, 8 rows a workgroup.
    Q4,
    /// linear.wgsl: any format, 8 rows a workgroup.
    Plain,
}

/// How a MoE block's gate/up products run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertsUp {
    /// Prefill: items grouped by expert on the GPU (moe_group.wgsl), gate and up as tiles of
    /// linear_q4_mm.wgsl, then swiglu.wgsl; tiles of this size and the smaller ones
    /// (`MmTile::down_to_16`), each expert's by its load.
    Grouped(MmTile),
    /// Decode: silu(gate x) ⊙ (up x) in one dispatch, linear_q4_glu_rows.wgsl.
    GluRows,
    /// The same on linear_q4_glu.wgsl (other widths).
    Glu,
    /// Gate and up one item at a time (`linear`), then swiglu.wgsl.
    Separate,
}

/// How a MoE block's down products and the weighted sum run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertsDown {
    /// Decode with the shared expert in the stacks: every item's down projection and the weighted
    /// sum into the residual at once, moe_down_rows.wgsl.
    FusedRows,
    /// The same on moe_down.wgsl (rows whose quads do not divide 64).
    Fused,
    /// Tiles of linear_q4_mm.wgsl from the grouping, then moe_combine.wgsl.
    Grouped(MmTile),
    /// One item at a time (`linear`), then moe_combine.wgsl.
    Separate,
}

/// The kernels of a DeltaNet block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeltaNetPath {
    /// A decode step: the conv inside the in_proj product (linear_q4_rows.wgsl's `conv_step`),
    /// then dn_recur_norm.wgsl (q/k norms, recurrence, output norm; a workgroup of 512 a head).
    StepConvInRows,
    /// A decode step whose in_proj does not run on linear_q4_rows: dn_conv_step.wgsl, then
    /// dn_recur_norm.wgsl.
    Step,
    /// A chunk: dn_conv.wgsl, dn_qk_norm.wgsl, dn_recur.wgsl, gated_norm.wgsl.
    Chunk,
}

/// A matrix product kernel in the forms its launch sites take (`Form`: what it reads and
/// writes): one `Spec` where activations are f32 (every form the same kernel), else one per form
/// (`in_forms`).
pub type FormSpecs = Vec<Spec>;

/// The forms of the products whose input is always an activation (prefill's tiles, the general
/// kernels: a folded norm runs on linear_q4_rows only): output an activation or an f32 buffer
/// (`Form::ALL`'s first two).
const READS_ACT: [Form; 2] = [Form::ALL[0], Form::ALL[1]];

/// linear_q4_glu_rows.wgsl's forms: the residual stream (folded norm) or an activation in, an
/// activation out (`Form::ALL`'s first and third).
const WRITES_ACT: [Form; 2] = [Form::ALL[0], Form::ALL[2]];

/// `spec` in each of `forms` where activations are f16, else once.
pub fn in_forms(spec: Spec, forms: &[Form], act_f16: bool) -> FormSpecs {
    if !act_f16 {
        return vec![spec];
    }
    forms
        .iter()
        .map(|&form| Spec {
            form,
            ..spec.clone()
        })
        .collect()
}

/// The kernels the backend compiles, as `Spec`s: one field per kernel (file and constants); the
/// matrix products in their forms (`FormSpecs`).
#[derive(Clone, Debug)]
pub struct Specs {
    pub linear: FormSpecs,
    pub linear_q4: FormSpecs,
    /// linear_q4_rows.wgsl with 16, 8, 4 and 2 rows a workgroup (`Plan::rows_rb`; the 8-row
    /// kernel persistent, in rounds: `out_rows` 8 alone takes it).
    pub linear_q4_rows16: FormSpecs,
    pub linear_q4_rows8: FormSpecs,
    pub linear_q4_rows4: FormSpecs,
    pub linear_q4_rows2: FormSpecs,
    /// linear_q4_rows.wgsl with one row a workgroup and `LEAN` (`router_lean`: the matrices of
    /// fewer than 1,024 rows, the router | shared gate on the full model; `rows_lean_spec`);
    /// None without the switch.
    pub linear_q4_rows1: Option<FormSpecs>,
    /// Prefill's tile products with tiles of 16, 32 and 64 items: linear_q4_mm.wgsl, or
    /// linear_q4_coop.wgsl where the plan takes cooperative matrices (`Plan::coop`; with
    /// `coop_big` linear_q4_coop_big.wgsl; the same launches, so kernels.rs and forward.rs need
    /// not know which).
    pub linear_q4_mm16: FormSpecs,
    pub linear_q4_mm32: FormSpecs,
    /// Where the tiles are f16 and 64 items fit the device's workgroup memory.
    pub linear_q4_mm64: Option<FormSpecs>,
    /// The routed experts' grouped tile products (16, 32, 64 items) where they differ from the
    /// dense ones: linear_q4_coop_big on 64 rows while the dense products run on 128
    /// (`coop_rows` 128; `Plan::expert_rows`); else None, the experts on `linear_q4_mm16` / ….
    pub experts_coop: Option<[FormSpecs; 3]>,
    pub linear_q4_glu: Spec,
    pub linear_q4_glu_rows: FormSpecs,
    pub moe_group: Spec,
    pub embed: Spec,
    pub rms_norm: Spec,
    pub gated_norm: Spec,
    pub attn_prep: Spec,
    pub attend: Spec,
    pub attend_gqa: Spec,
    pub attend_merge: Spec,
    /// Where prefill attention is `PrefillAttention::Tile`.
    pub attend_tile: Option<Spec>,
    pub dn_conv: Spec,
    pub dn_qk_norm: Spec,
    pub dn_recur: Spec,
    pub dn_conv_step: Spec,
    pub dn_recur_norm: Spec,
    pub moe_route: Spec,
    pub swiglu: Spec,
    pub moe_combine: Spec,
    pub moe_down: Spec,
    pub moe_down_rows: Spec,
    pub argmax_part: Spec,
    pub argmax_final: Spec,
    pub sample_adjust: Spec,
    pub sample_prefilter: Spec,
    pub sample_pick: Spec,
}

impl Specs {
    /// Every kernel (each product in each of its forms).
    pub fn all(&self) -> Vec<&Spec> {
        let mut v: Vec<&Spec> = [
            &self.linear,
            &self.linear_q4,
            &self.linear_q4_mm16,
            &self.linear_q4_mm32,
            &self.linear_q4_glu_rows,
            &self.linear_q4_rows16,
            &self.linear_q4_rows8,
            &self.linear_q4_rows4,
            &self.linear_q4_rows2,
        ]
        .into_iter()
        .flatten()
        .collect();
        v.extend(self.linear_q4_rows1.iter().flatten());
        v.extend(self.linear_q4_mm64.iter().flatten());
        v.extend(self.experts_coop.iter().flatten().flatten());
        v.extend([
            &self.linear_q4_glu,
            &self.moe_group,
            &self.embed,
            &self.rms_norm,
            &self.gated_norm,
            &self.attn_prep,
            &self.attend,
            &self.attend_gqa,
            &self.attend_merge,
            &self.dn_conv,
            &self.dn_qk_norm,
            &self.dn_recur,
            &self.dn_conv_step,
            &self.dn_recur_norm,
            &self.moe_route,
            &self.swiglu,
            &self.moe_combine,
            &self.moe_down,
            &self.moe_down_rows,
            &self.argmax_part,
            &self.argmax_final,
            &self.sample_adjust,
            &self.sample_prefilter,
            &self.sample_pick,
        ]);
        v.extend(self.attend_tile.as_ref());
        v
    }

    /// `all`, to change: the choices every kernel shares (reductions, element types).
    fn all_mut(&mut self) -> Vec<&mut Spec> {
        let mut v: Vec<&mut Spec> = [
            &mut self.linear,
            &mut self.linear_q4,
            &mut self.linear_q4_mm16,
            &mut self.linear_q4_mm32,
            &mut self.linear_q4_glu_rows,
            &mut self.linear_q4_rows16,
            &mut self.linear_q4_rows8,
            &mut self.linear_q4_rows4,
            &mut self.linear_q4_rows2,
        ]
        .into_iter()
        .flatten()
        .collect();
        v.extend(self.linear_q4_rows1.iter_mut().flatten());
        v.extend(self.linear_q4_mm64.iter_mut().flatten());
        v.extend(self.experts_coop.iter_mut().flatten().flatten());
        v.extend([
            &mut self.linear_q4_glu,
            &mut self.moe_group,
            &mut self.embed,
            &mut self.rms_norm,
            &mut self.gated_norm,
            &mut self.attn_prep,
            &mut self.attend,
            &mut self.attend_gqa,
            &mut self.attend_merge,
            &mut self.dn_conv,
            &mut self.dn_qk_norm,
            &mut self.dn_recur,
            &mut self.dn_conv_step,
            &mut self.dn_recur_norm,
            &mut self.moe_route,
            &mut self.swiglu,
            &mut self.moe_combine,
            &mut self.moe_down,
            &mut self.moe_down_rows,
            &mut self.argmax_part,
            &mut self.argmax_final,
            &mut self.sample_adjust,
            &mut self.sample_prefilter,
            &mut self.sample_pick,
        ]);
        v.extend(self.attend_tile.as_mut());
        v
    }
}

/// linear_q4_rows.wgsl with `rb` rows a workgroup (≤ 8 rows' reads in flight together); `early`:
/// every read of its first rows, the input and the norm's weights before any arithmetic or
/// barrier, the norm's scale on the totals (`WgpuOptions::rows_early`, its `EARLY`); `persist`:
/// each workgroup streams several row blocks in rounds of `PERSIST_RI` rows, the next round's
/// reads in flight during this round's sums (`WgpuOptions::rows_persist`, its `PERSIST`;
/// launched on `rows_grid`); `one_word`: compiled for rows of one 16-byte word a lane (4-bit,
/// 2,048 columns) only, its second words' registers gone (`WgpuOptions::rows_one_word`, its
/// `WORDS` 1; `Plan::rows_rb` gives it no other matrix).
pub fn rows_spec(rb: usize, early: bool, persist: bool, one_word: bool) -> Spec {
    let ri = if persist { PERSIST_RI } else { rb.min(8) };
    let mut constants = vec![
        ("RB", rb as f64),
        ("RI", ri as f64),
        ("EARLY", early as u32 as f64),
        ("PERSIST", persist as u32 as f64),
    ];
    if one_word {
        constants.push(("WORDS", 1.0));
    }
    Spec::new("linear_q4_rows", &constants)
}

/// linear_q4_rows.wgsl with one row a workgroup and its row's partials summed with the folded
/// norm's Σx² in one two-value workgroup sum (`WgpuOptions::router_lean`, its `LEAN`: one
/// barrier on subgroups where `row_total` and `rms_scale` take five, no serial adds); `early`:
/// as `rows_spec`'s (`LEAN` sums the norm's Σx² only with it).
pub fn rows_lean_spec(early: bool) -> Spec {
    let mut spec = rows_spec(1, early, false, false);
    spec.constants.push(("LEAN", 1.0));
    spec
}

/// The 16-byte words a lane reads of each row of `w` on linear_q4_rows.wgsl (its 64 lanes
/// cover a row in one or two): 1 for 4-bit 2,048 columns, 2 for 4,096 columns or 8-bit.
pub fn row_words(w: &GpuLinear) -> usize {
    words_of(w.cols, w.bits as usize)
}

/// `row_words` of a matrix of `cols` columns of `bits`-bit weights.
pub fn words_of(cols: usize, bits: usize) -> usize {
    (cols * bits).div_ceil(128 * 64)
}

/// The rows a workgroup of linear_q4_rows' persistent kernel (`rows_persist`): the 16-row one
/// (`rows_rb` gives it the matrices of ≥ 8,192 rows: DeltaNet's in_proj, attention's q/k/v,
/// lm_head), whose row blocks outnumber the workgroups an adapter holds at once; the 4- and
/// 2-row kernels' matrices (≤ 512 blocks of one round) have nothing to stream.
pub const PERSIST_RB: usize = 16;

/// The persistent kernel's rows a round: two rounds in flight hold 4 + 4 rows' words and scales
/// (48 registers an invocation, as one round of 8 does), 128 bytes of words an invocation
/// requested as the 8-row kernel's one round, but requested again while the previous round is
/// summed.
pub const PERSIST_RI: usize = 4;

/// The fewest row blocks a workgroup of a persistent launch streams: below `PERSIST_SHARE` ×
/// workers blocks, the persistent kernel runs one workgroup a block (its rounds still pipelined
/// within the block), so that no workgroup carries a second block's chain while most carry one
/// (DeltaNet's in_proj: 772 blocks, attention's q/k/v: 576, against 512 workgroups on a
/// discrete GPU); lm_head's 15,520 blocks stream 30 a workgroup.
pub const PERSIST_SHARE: usize = 2;

/// The grid of a linear_q4_rows launch over `blocks` row blocks: one workgroup a block, or, for
/// a persistent kernel (`workers` Some) with at least `PERSIST_SHARE` blocks a workgroup,
/// `workers` workgroups streaming the blocks (linear_q4_rows.wgsl's `PERSIST` takes the
/// launch's workgroup count as its stride).
pub fn rows_grid(blocks: usize, workers: Option<usize>) -> (u32, u32) {
    match workers {
        Some(w) if blocks >= PERSIST_SHARE * w.max(1) => (w.max(1) as u32, 1),
        _ => crate::gpu::grid_2d(blocks),
    }
}

/// dn_recur_norm.wgsl for key head dim `dk`; `one_sync`: one exchange of the slices' partials
/// and the short norm sum (`WgpuOptions::dn_one_sync`, its `ONE_SYNC`: the same state bits).
pub fn dn_recur_norm_spec(dk: usize, one_sync: bool) -> Spec {
    let mut spec = Spec::new("dn_recur_norm", &[("DK", dk as f64)]);
    if one_sync {
        spec.constants.push(("ONE_SYNC", 1.0));
    }
    spec
}

/// linear_q4_glu_rows.wgsl with `rb` rows a workgroup (`Plan::glu_rb`: GLU_RB, or the
/// `glu_rows` knob's 4, 8 or 16); `early`: its routing on order keys,
/// one barrier a round and only the rounds its item needs, the norm's weights read with the
/// input and its scale on the totals (`WgpuOptions::glu_early`, its `EARLY`); `items`: its
/// launches that route their own items take one row of every item of a token a workgroup, the
/// items in rounds, each item's reads issued as its routing round ends
/// (`WgpuOptions::moe_rounds`, its `ITEMS`; `Plan::glu_items` says where; the other launches
/// run as without it).
pub fn glu_rows_spec(rb: usize, early: bool, items: bool) -> Spec {
    Spec::new(
        "linear_q4_glu_rows",
        &[
            ("RB", rb as f64),
            ("EARLY", early as u32 as f64),
            ("ITEMS", items as u32 as f64),
        ],
    )
}

/// The most items a token linear_q4_glu_rows' `ITEMS` form takes (its totals meet in one
/// `rows2_total` over 16 slots).
pub const GLU_ITEMS_MAX: usize = 16;

/// moe_down_rows.wgsl for `topk` items a token of `cols` columns, `rb` rows a workgroup
/// (`Plan::down_rb`: DOWN_RB, or the `down_rows` knob's 2, 4 or 8); `rounds`: a slot's next
/// item's reads in flight during this item's sums (`WgpuOptions::moe_rounds`, its `ROUNDS`).
pub fn down_rows_spec(topk: usize, cols: usize, rb: usize, rounds: bool) -> Spec {
    Spec::new(
        "moe_down_rows",
        &[
            ("TOPK", topk as f64),
            ("COLS", cols as f64),
            ("RB", rb as f64),
            ("ROUNDS", rounds as u32 as f64),
        ],
    )
}

/// moe_down_lanes.wgsl's invocations a workgroup (`WgpuOptions::down_item_lanes`: one item a
/// lane): `topk` · `cols` / 32 lanes rounded up to whole subgroups of 32, at least the 64 whose
/// partials the row totals sum (160 on the full model: 9 items × 16 quads); None where that
/// exceeds 256 (the largest workgroup every adapter runs) or a row's quads do not divide 64
/// (moe_down_rows' own condition: the sums follow its slots' order).
pub fn down_lanes_wg(topk: usize, cols: usize) -> Option<usize> {
    let qn = cols / 32;
    let wg = ((topk * qn).div_ceil(32) * 32).max(64);
    (qn > 0 && 64_usize.is_multiple_of(qn) && cols.is_multiple_of(32) && wg <= 256).then_some(wg)
}

/// moe_down_lanes.wgsl for `topk` items a token of `cols` columns, `rb` rows a workgroup,
/// `wg` invocations (`down_lanes_wg`).
pub fn down_lanes_spec(topk: usize, cols: usize, rb: usize, wg: usize) -> Spec {
    Spec::new(
        "moe_down_lanes",
        &[
            ("TOPK", topk as f64),
            ("COLS", cols as f64),
            ("RB", rb as f64),
            ("WG", wg as f64),
        ],
    )
}

/// linear_q4_mm.wgsl with tiles of `tile` items, in f16 (`f16`) or f32; its register arrays
/// sized for 32 items (so tiles of 16 and 32 compile as main's did), or 64.
pub fn mm_spec(tile: MmTile, f16: bool) -> Spec {
    let mut spec = Spec::new("linear_q4_mm", &[("TT", tile.items() as f64)]);
    spec.tile_f16 = f16;
    spec.tile_max = tile.items().max(32) as u32;
    spec
}

/// linear_q4_coop.wgsl (linear_q4_mm.wgsl on cooperative matrices: the same launches) with
/// tiles of `tile` items, on matrices of `size` (8 or 16) f16 × f16 → f32; `big`
/// (`coop_big`): linear_q4_coop_big.wgsl, the same launches in steps of 64 columns.
pub fn coop_spec(tile: MmTile, size: u32, big: bool) -> Spec {
    let name = if big {
        "linear_q4_coop_big"
    } else {
        "linear_q4_coop"
    };
    let mut spec = Spec::new(name, &[("TT", tile.items() as f64)]);
    spec.coop = size;
    spec
}

/// The kernels prefill's tile products can run on, from the most to the least demanding: the
/// order the backend checks them in at load (`products_candidates`, `products_choice`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum ProductsKernel {
    /// linear_q4_coop_big.wgsl on workgroups of 128 rows (`coop`, `coop_big`, `coop_rows` 128).
    CoopBigWide,
    /// linear_q4_coop_big.wgsl (`coop` and `coop_big`; 64 rows a workgroup).
    CoopBig,
    /// linear_q4_coop.wgsl (`coop` without `coop_big`).
    Coop,
    /// linear_q4_mm.wgsl: no cooperative matrices, nothing to check at load.
    Mm,
}

impl ProductsKernel {
    /// The kernel's file name, as the plan line says it.
    pub fn name(self) -> &'static str {
        match self {
            ProductsKernel::CoopBigWide => "linear_q4_coop_big on 128 rows",
            ProductsKernel::CoopBig => "linear_q4_coop_big",
            ProductsKernel::Coop => "linear_q4_coop",
            ProductsKernel::Mm => "linear_q4_mm",
        }
    }

    /// The kernel `opts` name (a resolved plan's options: the one it runs).
    pub fn of(opts: &WgpuOptions) -> ProductsKernel {
        match (opts.coop, opts.coop_big) {
            (true, true) if opts.coop_rows == 128 => ProductsKernel::CoopBigWide,
            (true, true) => ProductsKernel::CoopBig,
            (true, false) => ProductsKernel::Coop,
            (false, _) => ProductsKernel::Mm,
        }
    }

    /// `opts` asking for this kernel (every other option as it was).
    pub fn options(self, opts: &WgpuOptions) -> WgpuOptions {
        use ProductsKernel::{CoopBig, CoopBigWide, Mm};
        WgpuOptions {
            coop: self != Mm,
            coop_big: matches!(self, CoopBigWide | CoopBig),
            coop_rows: if self == CoopBigWide { 128 } else { 64 },
            ..opts.clone()
        }
    }
}

/// The prefill products' kernels the backend may take for `opts`, in the order it checks them
/// at load: the one asked for, then each less demanding one (linear_q4_coop_big on 128 rows,
/// on 64, linear_q4_coop, linear_q4_mm; the last needs no check and is never refused).
pub fn products_candidates(opts: &WgpuOptions) -> Vec<ProductsKernel> {
    let asked = ProductsKernel::of(opts);
    [
        ProductsKernel::CoopBigWide,
        ProductsKernel::CoopBig,
        ProductsKernel::Coop,
        ProductsKernel::Mm,
    ]
    .into_iter()
    .filter(|&k| k >= asked)
    .collect()
}

/// The kernel the backend takes for `opts` when the adapter refused `refused` at load (each
/// checked against the host's product): the first of `products_candidates` less demanding than
/// every refused one, so linear_q4_mm once every cooperative one was refused.
pub fn products_choice(opts: &WgpuOptions, refused: &[ProductsKernel]) -> ProductsKernel {
    let last = refused.iter().max();
    products_candidates(opts)
        .into_iter()
        .find(|k| last.is_none_or(|r| k > r))
        .unwrap_or(ProductsKernel::Mm)
}

/// attend_gqa.wgsl for head dim `d` and `g` query heads per KV head; `flat`: its reads with no
/// condition around them (`WgpuOptions::attn_flat`, its `FLAT`); `v_early`: with `flat`, a
/// block's first 32 values requested after its key products (`WgpuOptions::attn_v_early`, its
/// `VEARLY`; without `flat` the kernel has no flat value loop to take them from, so it is not
/// compiled).
pub fn attend_gqa_spec(d: usize, g: usize, flat: bool, v_early: bool) -> Spec {
    let mut constants = vec![
        ("D", d as f64),
        ("G", g as f64),
        ("FLAT", flat as u32 as f64),
    ];
    if flat && v_early {
        constants.push(("VEARLY", 1.0));
    }
    Spec::new("attend_gqa", &constants)
}

/// attend_tile.wgsl for head dim `d` (a multiple of 64, ≤ 256), `g` query heads per KV head (a
/// power of two ≤ 8) and blocks of `keys` keys (16 or 32).
pub fn attend_tile_spec(d: usize, g: usize, keys: usize) -> Result<Spec> {
    if !d.is_multiple_of(64) || d > 256 || !g.is_power_of_two() || g > 8 {
        bail!("attend_tile takes head dims of a multiple of 64 up to 256 and 1, 2, 4 or 8 query heads a KV head (not {d}, {g})");
    }
    if keys != 16 && keys != 32 {
        bail!("attend_tile takes blocks of 16 or 32 keys (not {keys})");
    }
    Ok(Spec::new(
        "attend_tile",
        &[("D", d as f64), ("G", g as f64), ("KB", keys as f64)],
    ))
}

/// Query heads per KV head where attend_gqa.wgsl takes the model: a power of two ≤ 8 (its
/// blocks of 256 / G keys, its score partials in shared memory), head dim a multiple of 4 and
/// ≤ 256 (one invocation a dimension).
pub fn gqa_group(c: &ModelConfig) -> Option<usize> {
    let g = c.n_heads / c.n_kv_heads.max(1);
    (c.n_kv_heads > 0
        && c.n_heads.is_multiple_of(c.n_kv_heads)
        && g.is_power_of_two()
        && g <= 8
        && c.head_dim.is_multiple_of(4)
        && c.head_dim <= 256)
        .then_some(g)
}

/// Query heads per KV head where attend_tile.wgsl takes the model: `gqa_group`'s with a head dim
/// that is a multiple of 64 (its chunks of dimensions).
pub fn tile_group(c: &ModelConfig) -> Option<usize> {
    gqa_group(c).filter(|_| c.head_dim.is_multiple_of(64))
}

/// Whether prefill attention is attend_tile.wgsl.
fn attend_tile_on(a: PrefillAttention) -> bool {
    matches!(a, PrefillAttention::Tile { .. })
}

/// The resolved plan.
#[derive(Clone, Debug)]
pub struct Plan {
    pub chunk: usize,
    pub all_logits_chunk: usize,
    pub checked: bool,
    pub max_slice_bytes: Option<u64>,
    /// Prefill's plain (dense) products' tiles, and the routed experts' largest (each expert's
    /// tiles sized by its load from this one down to 16: `expert_tiles`).
    pub dense_mm: MmTile,
    pub expert_mm: MmTile,
    /// linear_q4_mm.wgsl's tiles in f16 (else f32); always with `coop`.
    pub tile_f16: bool,
    /// The prefill tile products on cooperative matrices of this size (16 or 8:
    /// linear_q4_coop.wgsl in `Specs::linear_q4_mm16` / `32` / `64`, the same launches), or 0
    /// (linear_q4_mm.wgsl).
    pub coop: u32,
    /// The tile products' rows a workgroup, so their launches' row blocks (the dense ones' and
    /// moe_group's arguments for the experts'): `MM_ROWS` (64), or 128 with linear_q4_coop_big
    /// on `coop_rows` 128 (`Spec::mm_rows`).
    pub mm_rows: usize,
    /// The routed experts' grouped tile products' rows a workgroup (moe_group's row blocks):
    /// always `MM_ROWS` (64). With `coop_rows` 128 they stay on linear_q4_coop_big's 64-row form
    /// (`Specs::experts_coop`): 128 rows lost there (H100, 4K: gate / up / down 367 / 368 / 400
    /// → 428 / 428 / 452 µs a call; few items a tile) while the dense products won.
    pub expert_rows: usize,
    pub prefill_attention: PrefillAttention,
    pub decode_attention: DecodeAttention,
    /// How decode attention splits its keys (`splits`): `SplitRule::WIDE`, or with `attn_split`
    /// the adapter's `SplitRule::decode`.
    pub decode_splits: SplitRule,
    /// Every kernel compiled, with the constants of this model and plan.
    pub specs: Specs,
    /// Whether the workgroup reductions (norms, softmax, argmax) run on subgroups
    /// (reduce_subgroup.wgsl) or through workgroup memory (reduce_workgroup.wgsl).
    pub subgroups: bool,
    /// Whether the KV cache is f16 (else f32): 2 or 4 bytes an element.
    pub kv_f16: bool,
    /// Whether the activations between kernels are f16 (else f32): `Scratch`'s buffers but the
    /// residual stream, logits and router logits (the crate README's table).
    pub act_f16: bool,
    /// Whether the model's routing fits linear_q4_glu_rows.wgsl's `route` (E ≤ 512: 8 experts an
    /// invocation); `routes_in_glu` says where it is used.
    pub route_in_glu: bool,
    /// Whether the routed experts' GLU runs in items' rounds (`moe_rounds`, linear_q4_glu_rows'
    /// `ITEMS`: one row of each of a token's ≤ `GLU_ITEMS_MAX` items a workgroup) where it
    /// routes its own items (`glu_items` says where).
    pub glu_items: bool,
    /// Rows a workgroup of linear_q4_glu_rows.wgsl (GLU_RB, or `glu_rows`) and of
    /// moe_down_rows.wgsl (DOWN_RB, or `down_rows`).
    pub glu_rb: usize,
    pub down_rb: usize,
    /// moe_down_lanes.wgsl's invocations a workgroup where `down_item_lanes` put the down
    /// products on it (`Specs::moe_down_rows` is then its spec: the same launch), else 0.
    pub down_lanes: usize,
    /// linear_q4_rows' persistent kernel (`rows_persist`): the workgroups a launch of the
    /// `PERSIST_RB`-row kernel takes (`rows_workers`, else `split_workgroups`: the adapter's
    /// kind), or None.
    pub rows_workers: Option<usize>,
    /// What was changed to fit the device, or refused at load, and why (for the log line).
    pub notes: Vec<String>,
    /// The options as resolved: those asked for, with the switches the device or the model
    /// turned off turned off (for the log line).
    pub options: WgpuOptions,
}

impl Plan {
    /// `opts` (environment overrides already applied) resolved for model `c` (`stacked`: the
    /// shared expert rides in the routed stacks, so each token has top_k + 1 items) on a device
    /// `device` offers. Each kernel's needs are checked against the device's limits: where the
    /// preferred variant does not fit, the next is taken and a note says so; where none does, an
    /// error names the kernel.
    pub fn resolve(
        opts: &WgpuOptions,
        c: &ModelConfig,
        stacked: bool,
        device: &DeviceCaps,
    ) -> Result<Plan> {
        let limits = &device.limits;
        let subgroups = device.subgroups && opts.subgroups;
        let mut notes = Vec::new();
        // The f16 choices (`auto`: the adapter's kind decides), each with its reason in the line.
        let mut f16 = |label: &str, choice: Choice| {
            let (on, why) = f16_rule(choice, device, opts.auto_as_apple);
            if let Some(why) = why {
                notes.push(format!(
                    "{label}: {} ({why})",
                    if on { "on" } else { "off" }
                ));
            }
            on
        };
        let act_f16 = f16("f16 activations", opts.f16_acts);
        let kv_f16 = f16("f16 KV cache", opts.f16_kv);
        // Cooperative matrices (`coop`) where the device enabled them: linear_q4_coop.wgsl in
        // linear_q4_mm's place at every tile size, its operands staged in f16 (so the f16
        // tiles' sizes: dense 64, each expert's by its load); with `coop_big`
        // linear_q4_coop_big.wgsl (the same launches and tiles on NVIDIA and Apple: its
        // subgroups' blocks follow the matrices' size, its memory fits 32 KiB at both).
        let coop = if opts.coop && device.f16 {
            device.coop
        } else {
            0
        };
        let tile_f16 = device.f16 && (opts.f16_tiles || coop > 0);
        // The dense products' tiles: as asked (`dense_tile`), else 64 in f16 (the bytes of f32's
        // 32), else 32; tiles of 64 only where they fit the device's workgroup memory.
        let mut dense_mm = match opts.dense_tile {
            16 => MmTile::T16,
            32 => MmTile::T32,
            64 => MmTile::T64,
            _ if tile_f16 => MmTile::T64,
            _ => MmTile::T32,
        };
        let mut linear_q4_mm64 = None;
        let mut coop_specs = None;
        let mut experts_coop = None;
        // linear_q4_coop_big's rows a workgroup (`coop_rows`): 128 where its three tiles fit the
        // device's workgroup memory (NVIDIA's 48 KiB; not Apple's 32 KiB at 64 items), else 64.
        let mut mm_rows = MM_ROWS;
        if coop > 0 {
            let tiles = [MmTile::T16, MmTile::T32, MmTile::T64];
            let specs_of = |rows: usize| {
                tiles.map(|t| {
                    let mut spec = coop_spec(t, coop, opts.coop_big);
                    spec.coop_rows = rows as u32;
                    spec
                })
            };
            if opts.coop_big && opts.coop_rows == 128 {
                mm_rows = 128;
                for spec in &specs_of(128) {
                    if let Some(why) = spec.needs()?.exceeds(limits) {
                        notes.push(format!(
                            "{} with 128 rows and tiles of {}: {why}; 64 rows",
                            spec.name, spec.constants[0].1
                        ));
                        mm_rows = MM_ROWS;
                        break;
                    }
                }
            }
            let specs = specs_of(mm_rows);
            let mut fit = true;
            for spec in &specs {
                if let Some(why) = spec.needs()?.exceeds(limits) {
                    notes.push(format!(
                        "{} with tiles of {}: {why}",
                        spec.name, spec.constants[0].1
                    ));
                    fit = false;
                }
            }
            if fit {
                coop_specs = Some(specs.map(|s| in_forms(s, &READS_ACT, act_f16)));
                // The routed experts' grouped tiles keep 64 rows (`Plan::expert_rows`).
                if mm_rows != MM_ROWS {
                    experts_coop =
                        Some(specs_of(MM_ROWS).map(|s| in_forms(s, &READS_ACT, act_f16)));
                }
            }
        }
        let coop = if coop_specs.is_some() { coop } else { 0 };
        if coop == 0 {
            mm_rows = MM_ROWS;
        }
        if let Some([_, _, c64]) = &coop_specs {
            linear_q4_mm64 = Some(c64.clone());
        } else if tile_f16 || dense_mm == MmTile::T64 {
            let spec = mm_spec(MmTile::T64, tile_f16).with_subgroups(subgroups);
            match spec.needs()?.exceeds(limits) {
                None => linear_q4_mm64 = Some(in_forms(spec, &READS_ACT, act_f16)),
                Some(why) => {
                    notes.push(format!("linear_q4_mm with tiles of 64: {why}"));
                    if dense_mm == MmTile::T64 {
                        dense_mm = MmTile::T32;
                    }
                }
            }
        }
        let top = (c.top_k + stacked as usize) as f64;
        let decode_attention = match gqa_group(c) {
            Some(g) => DecodeAttention::Gqa { g },
            None => DecodeAttention::Plain,
        };
        let gqa_g = match decode_attention {
            DecodeAttention::Gqa { g } => g,
            DecodeAttention::Plain => 1,
        };
        let mut prefill_attention = match decode_attention {
            DecodeAttention::Gqa { .. } => PrefillAttention::Gqa,
            DecodeAttention::Plain => PrefillAttention::Plain,
        };
        let mut attend_tile = None;
        if let (true, Some(g)) = (opts.attn_tile, tile_group(c)) {
            // Blocks of 32 keys where they fit, else 16 (Apple's 32 KiB), else attend_gqa.
            for keys in [32, 16] {
                let mut spec = attend_tile_spec(c.head_dim, g, keys)?.with_subgroups(subgroups);
                spec.kv_f16 = kv_f16;
                match spec.needs()?.exceeds(limits) {
                    None => {
                        prefill_attention = PrefillAttention::Tile { g, keys };
                        attend_tile = Some(spec);
                        break;
                    }
                    Some(why) => {
                        notes.push(format!("attend_tile with blocks of {keys} keys: {why}"))
                    }
                }
            }
        }
        // The MoE row kernels' rows a workgroup (`glu_rows`, `down_rows`: 0 the rules GLU_RB and
        // DOWN_RB; `down_rows` ships as 2, session 21).
        let glu_rb = match opts.glu_rows {
            0 => GLU_RB,
            n => n,
        };
        let down_rb = match opts.down_rows {
            0 => DOWN_RB,
            n => n,
        };
        // `down_item_lanes`: moe_down_rows' launches on moe_down_lanes.wgsl where it fits.
        let down_lanes = if opts.down_item_lanes {
            let wg = down_lanes_wg(top as usize, c.expert_inter);
            if wg.is_none() {
                notes.push(format!(
                    "down_item_lanes: {top} items of {} columns do not fit one workgroup of ≤ 256 lanes, moe_down_rows kept",
                    c.expert_inter
                ));
            }
            wg
        } else {
            None
        };
        let rows = |rb: usize| {
            // The 8-row kernel (`out_rows` 8) always in rounds.
            let persist = (opts.rows_persist && rb == PERSIST_RB) || rb == 8;
            // `rows_one_word`: the 16-row kernel for one-word rows only (`Plan::rows_rb`).
            let one_word = opts.rows_one_word && rb == 16;
            in_forms(
                rows_spec(rb, opts.rows_early, persist, one_word),
                &Form::ALL,
                act_f16,
            )
        };
        let mut specs = Specs {
            linear: in_forms(Spec::new("linear", &[]), &READS_ACT, act_f16),
            linear_q4: in_forms(Spec::new("linear_q4", &[]), &READS_ACT, act_f16),
            linear_q4_rows16: rows(16),
            linear_q4_rows8: rows(8),
            linear_q4_rows4: rows(4),
            linear_q4_rows2: rows(2),
            // The router's lean 1-row kernel (`router_lean`).
            linear_q4_rows1: opts
                .router_lean
                .then(|| in_forms(rows_lean_spec(opts.rows_early), &Form::ALL, act_f16)),
            linear_q4_mm16: match &coop_specs {
                Some([c16, _, _]) => c16.clone(),
                None => in_forms(mm_spec(MmTile::T16, tile_f16), &READS_ACT, act_f16),
            },
            linear_q4_mm32: match &coop_specs {
                Some([_, c32, _]) => c32.clone(),
                None => in_forms(mm_spec(MmTile::T32, tile_f16), &READS_ACT, act_f16),
            },
            linear_q4_mm64,
            experts_coop,
            linear_q4_glu: Spec::new("linear_q4_glu", &[]),
            linear_q4_glu_rows: in_forms(
                glu_rows_spec(glu_rb, opts.glu_early, opts.moe_rounds),
                &WRITES_ACT,
                act_f16,
            ),
            moe_group: Spec::new("moe_group", &[]),
            embed: Spec::new("embed", &[]),
            rms_norm: Spec::new("rms_norm", &[]),
            gated_norm: Spec::new("gated_norm", &[]),
            attn_prep: Spec::new("attn_prep", &[]),
            attend: Spec::new("attend", &[("D", c.head_dim as f64)]),
            attend_gqa: attend_gqa_spec(c.head_dim, gqa_g, opts.attn_flat, opts.attn_v_early),
            attend_merge: Spec::new("attend_merge", &[]),
            attend_tile,
            dn_conv: Spec::new("dn_conv", &[]),
            dn_qk_norm: Spec::new("dn_qk_norm", &[]),
            dn_recur: Spec::new("dn_recur", &[("DK", c.dn_k_dim as f64)]),
            dn_conv_step: Spec::new("dn_conv_step", &[]),
            dn_recur_norm: dn_recur_norm_spec(c.dn_k_dim, opts.dn_one_sync),
            moe_route: Spec::new("moe_route", &[]),
            swiglu: Spec::new("swiglu", &[]),
            moe_combine: Spec::new("moe_combine", &[]),
            moe_down: Spec::new(
                "moe_down",
                &[("TOPK", top), ("COLS", c.expert_inter as f64)],
            ),
            moe_down_rows: match down_lanes {
                Some(wg) => down_lanes_spec(top as usize, c.expert_inter, down_rb, wg),
                None => down_rows_spec(top as usize, c.expert_inter, down_rb, opts.moe_rounds),
            },
            argmax_part: Spec::new("argmax_part", &[]),
            argmax_final: Spec::new("argmax_final", &[]),
            sample_adjust: Spec::new("sample_adjust", &[]),
            sample_prefilter: Spec::new("sample_prefilter", &[]),
            sample_pick: Spec::new("sample_pick", &[]),
        };
        for s in specs.all_mut() {
            // linear_q4_coop's module without subgroup operations (its reductions' file unused):
            // NVIDIA's Vulkan driver has crashed building pipelines that hold both (docs/WGPU.md).
            s.subgroups = subgroups && s.coop == 0;
            s.act_f16 = act_f16;
        }
        for s in [
            &mut specs.attn_prep,
            &mut specs.attend,
            &mut specs.attend_gqa,
        ] {
            s.kv_f16 = kv_f16;
        }
        for spec in specs.all() {
            if let Some(why) = spec.needs()?.exceeds(limits) {
                bail!(
                    "WGSL kernel {} ({:?}) does not fit this device: {why}",
                    spec.name,
                    spec.constants
                );
            }
        }
        let expert_mm = match (tile_f16, specs.linear_q4_mm64.is_some()) {
            (true, true) => MmTile::T64,
            (true, false) => MmTile::T32,
            (false, _) => MmTile::T16,
        };
        // Decode attention's splits: whole blocks of attend_gqa's 256 / G keys (attend.wgsl:
        // 64), as many workgroups as the adapter's kind wants.
        let decode_splits = if opts.attn_split {
            let granule = match decode_attention {
                DecodeAttention::Gqa { g } => 256 / g,
                DecodeAttention::Plain => 64,
            };
            SplitRule::decode(split_workgroups(device.device_type), granule)
        } else {
            SplitRule::WIDE
        };
        let options = WgpuOptions {
            attn_tile: attend_tile_on(prefill_attention),
            subgroups,
            f16_kv: Choice::of(kv_f16),
            f16_tiles: tile_f16,
            f16_acts: Choice::of(act_f16),
            coop: coop > 0,
            coop_big: coop > 0 && opts.coop_big,
            coop_rows: mm_rows,
            dense_tile: dense_mm.items(),
            ..opts.clone()
        };
        let rows_workers = opts.rows_persist.then(|| match opts.rows_workers {
            0 => split_workgroups(device.device_type),
            n => n,
        });
        if opts.attn_v_early && !opts.attn_flat {
            notes.push(
                "attn_v_early without attn_flat: attend_gqa reads its values after the softmax (the early values take flat reads)".into(),
            );
        }
        // The prefill chunk, as large as asked where its activations fit the device's bindings.
        let max_binding = limits
            .max_storage_buffer_binding_size
            .min(limits.max_buffer_size);
        let chunk = fitting_chunk(opts.chunk, c, act_f16, max_binding);
        if chunk < opts.chunk {
            notes.push(format!(
                "prefill chunk {} → {chunk}: the routed experts' outputs of a larger chunk exceed the device's largest storage binding ({max_binding} bytes)",
                opts.chunk
            ));
        }
        let options = WgpuOptions {
            rows_workers: rows_workers.unwrap_or(0),
            chunk,
            ..options
        };
        Ok(Plan {
            options,
            chunk,
            all_logits_chunk: opts.all_logits_chunk.clamp(1, chunk.max(1)),
            checked: opts.checked,
            max_slice_bytes: opts.max_slice_bytes,
            dense_mm,
            expert_mm,
            tile_f16,
            coop,
            mm_rows,
            expert_rows: MM_ROWS,
            prefill_attention,
            decode_attention,
            decode_splits,
            specs,
            subgroups,
            kv_f16,
            act_f16,
            route_in_glu: c.n_experts <= 512,
            glu_items: opts.moe_rounds && top as usize <= GLU_ITEMS_MAX,
            glu_rb,
            down_rb,
            down_lanes: down_lanes.unwrap_or(0),
            rows_workers,
            notes,
        })
    }

    /// linear_q4_rows.wgsl's rows a workgroup for a matrix (slice) of `rows` rows: `rows_rb`'s,
    /// but `out_rows` (where not 0) for the matrices of 1,024 to 8,191 rows (`rows_rb`'s 4-row
    /// kernel's: DeltaNet's out_proj and attention's o on the full model); `words`: the
    /// 16-byte words a lane reads of a row (`row_words`): with `rows_one_word` the 16-row
    /// kernel is compiled for one-word rows, so a two-word matrix of ≥ 8,192 rows takes the
    /// 8-row kernel (in rounds) instead (none on the full model: in_proj, q/k/v and lm_head
    /// are 4-bit of 2,048 columns); with `router_lean`, 1 for the matrices of fewer than 1,024
    /// rows (`rows_rb`'s 2-row kernel's: the router | shared gate on the full model) on the
    /// `LEAN` kernel (`Specs::linear_q4_rows1`).
    pub fn rows_rb(&self, rows: usize, words: usize) -> usize {
        if self.options.router_lean && rows < 1024 {
            return 1;
        }
        let rb = match self.options.out_rows {
            0 => rows_rb(rows),
            n if rows_rb(rows) == 4 => n,
            _ => rows_rb(rows),
        };
        if rb == 16 && words > 1 && self.options.rows_one_word {
            8
        } else {
            rb
        }
    }

    /// The grid of a linear_q4_rows launch with `rb` rows a workgroup over `blocks` row blocks
    /// (`rows_grid`): persistent where `rows_persist` compiled that kernel so.
    pub fn rows_grid(&self, rb: usize, blocks: usize) -> (u32, u32) {
        rows_grid(blocks, self.rows_workers.filter(|_| rb == PERSIST_RB))
    }

    /// Prefill attention falls back to attend_gqa.wgsl (attend_tile refused at load: `why`).
    pub fn refuse_attend_tile(&mut self, why: String) {
        self.prefill_attention = match self.decode_attention {
            DecodeAttention::Gqa { .. } => PrefillAttention::Gqa,
            DecodeAttention::Plain => PrefillAttention::Plain,
        };
        self.specs.attend_tile = None;
        self.options.attn_tile = false;
        self.notes.push(why);
    }

    /// One line for logs: every choice and what was changed to fit the device.
    pub fn describe(&self) -> String {
        let prefill_attention = match self.prefill_attention {
            PrefillAttention::Tile { g, keys } => {
                format!(
                    "attend_tile ({} tokens × {g} heads, blocks of {keys} keys)",
                    64 / g
                )
            }
            PrefillAttention::Gqa => "attend_gqa".into(),
            PrefillAttention::Plain => "attend".into(),
        };
        let splits = self.decode_splits;
        let decode_attention = match self.decode_attention {
            DecodeAttention::Gqa { g } => format!(
                "attend_gqa ({g} heads a KV head, keys split for ≈ {} workgroups in spans of {}, ≤ {} splits{})",
                splits.workgroups,
                splits.granule,
                splits.max_splits,
                if self.options.attn_flat && self.options.attn_v_early {
                    ", a block's values requested after its key products"
                } else {
                    ""
                }
            ),
            DecodeAttention::Plain => format!(
                "attend (keys split for ≈ {} workgroups in spans of {})",
                splits.workgroups, splits.granule
            ),
        };
        let notes = if self.notes.is_empty() {
            String::new()
        } else {
            format!("; {}", self.notes.join("; "))
        };
        format!(
            "{} activations, {}, prefill products {} ({} tiles: dense tiles of {}, experts' tiles of {}), prefill attention {prefill_attention}, decode attention {decode_attention}, decode products linear_q4_rows{}{} / linear_q4_glu_rows{} / {}, decode routing {}{notes}",
            if self.act_f16 { "f16" } else { "fp32" },
            self.options.describe(),
            match self.coop {
                0 => "linear_q4_mm".to_string(),
                n => format!(
                    "{} on {n}×{n} cooperative matrices, {} rows a workgroup{}",
                    self.specs.linear_q4_mm16[0].name,
                    self.mm_rows,
                    if self.specs.experts_coop.is_some() {
                        format!(" (routed experts' {})", self.expert_rows)
                    } else {
                        String::new()
                    }
                ),
            },
            if self.tile_f16 { "f16" } else { "f32" },
            self.dense_mm.items(),
            match self.expert_tiles().as_slice() {
                [one] => one.items().to_string(),
                more => format!(
                    "{} by each expert's load",
                    more.iter()
                        .map(|t| t.items().to_string())
                        .collect::<Vec<_>>()
                        .join("/")
                ),
            },
            match (self.rows_workers, self.options.out_rows) {
                (Some(w), 0) => format!(" (its {PERSIST_RB}-row kernel persistent on ≤ {w} workgroups)"),
                (None, 0) => String::new(),
                (Some(w), n) => format!(" (its {PERSIST_RB}-row kernel persistent on ≤ {w} workgroups; the 1,024–8,191-row products on its {n}-row kernel{})", if n == 8 { " in rounds of 4" } else { "" }),
                (None, n) => format!(" (the 1,024–8,191-row products on its {n}-row kernel{})", if n == 8 { " in rounds of 4" } else { "" }),
            },
            match (self.options.rows_one_word, self.options.router_lean) {
                (true, false) => " (its 16-row kernel compiled for one-word rows: no second words)",
                (true, true) => " (its 16-row kernel compiled for one-word rows: no second words; the products of < 1,024 rows on its lean 1-row kernel)",
                (false, true) => " (the products of < 1,024 rows on its lean 1-row kernel)",
                (false, false) => "",
            },
            if self.glu_items {
                " (the routed experts' one row of every item a workgroup, each item's reads issued as its routing round ends)"
            } else {
                ""
            },
            match (self.down_lanes, self.options.moe_rounds) {
                (0, true) => "moe_down_rows (in rounds of one item, the next item's reads in flight)".to_string(),
                (0, false) => "moe_down_rows".to_string(),
                (n, _) => format!("moe_down_lanes (one item a lane, {n} lanes a workgroup: every item's reads in one trip, the residual read at the start)"),
            },
            if self.route_in_glu {
                "in linear_q4_glu_rows"
            } else {
                "moe_route"
            },
        )
    }

    /// The form of a product (`Form`) that reads the residual stream (`x_f32`: a folded norm) or
    /// an activation, and writes an f32 buffer (`y_f32`: the residual stream, logits, the
    /// router's logits) or an activation: where activations are f32, every launch site's the one
    /// form compiled.
    pub fn form(&self, x_f32: bool, y_f32: bool) -> Form {
        if self.act_f16 {
            Form { x_f32, y_f32 }
        } else {
            Form::default()
        }
    }

    /// The kernel for `w` at one launch site of `Forward::linear`: `items` items (tokens, or
    /// routed items where `experts`), inputs on 16-byte boundaries where `aligned`.
    /// `Rows`: the rows per workgroup by the slice's rows, `rows_rb`.
    pub fn linear(
        &self,
        w: &GpuLinear,
        items: usize,
        experts: bool,
        aligned: bool,
    ) -> LinearKernel {
        let q4 = q4_ok(w, aligned);
        // 8-bit matrices (the router) take linear_q4_mm.wgsl too where each 32-column step lies
        // in one group.
        let mm8 = q8_ok(w, aligned) && w.group.is_multiple_of(32) && w.cols.is_multiple_of(32);
        if !experts && items > 1 && (q4 || mm8) {
            return LinearKernel::Mm(self.dense_mm);
        }
        if !experts && rows_ok(w, aligned) {
            return LinearKernel::Rows;
        }
        if q4 || q8_ok(w, aligned) {
            LinearKernel::Q4
        } else {
            LinearKernel::Plain
        }
    }

    /// Whether the norm before `f` (one launch site's matrices) over `t` tokens folds into them:
    /// a decode step, one part, on linear_q4_rows.wgsl.
    pub fn folds_norm(&self, f: &Fused, t: usize) -> bool {
        t == 1 && f.parts.len() == 1 && rows_ok(&f.parts[0].0, true)
    }

    /// Whether the norm before the MoE over `t` tokens folds into its readers: a decode step, the
    /// router (`folds_norm`) and the experts' gate/up on linear_q4_glu_rows.wgsl, the shared
    /// expert riding in the stacks (nothing else reads the normalised input).
    pub fn folds_moe_norm(&self, m: &GpuMoe, t: usize) -> bool {
        m.shared.is_none()
            && self.folds_norm(&m.router, t)
            && self.experts_up(m, t) == ExpertsUp::GluRows
    }

    /// Whether the final norm folds into lm_head (`lm`) over `t` tokens: a decode step whose
    /// lm_head runs on linear_q4_rows.wgsl.
    pub fn folds_final_norm(&self, lm: &GpuLinear, t: usize) -> bool {
        t == 1 && self.linear(lm, 1, false, true) == LinearKernel::Rows
    }

    /// The gate/up kernels of a MoE block over `t` tokens.
    pub fn experts_up(&self, m: &GpuMoe, t: usize) -> ExpertsUp {
        if t > 1 && [&m.gate, &m.up, &m.down].iter().all(|w| q4_ok(w, true)) {
            return ExpertsUp::Grouped(self.expert_mm);
        }
        if glu_ok(&m.gate, &m.up) {
            if glu_rows_ok(&m.gate) {
                ExpertsUp::GluRows
            } else {
                ExpertsUp::Glu
            }
        } else {
            ExpertsUp::Separate
        }
    }

    /// The tiles the routed experts' products take, largest first: with f16 tiles 64 (where
    /// compiled) or 32 down to 16, each expert's by its load in each chunk (moe_group.wgsl: the
    /// largest of at most half its items, so that its last tile is not mostly empty); with f32
    /// tiles 16 alone (measured best at chunk 2,048 against 32, session 7).
    pub fn expert_tiles(&self) -> Vec<MmTile> {
        self.expert_mm.down_to_16()
    }

    /// Whether a MoE block's routing over `t` tokens runs inside its experts' GLU dispatch
    /// (linear_q4_glu_rows.wgsl's `route`: each workgroup ranks its token's experts itself, row
    /// block 0 writes the ids and weights the down products read), with no moe_route.wgsl
    /// dispatch: where the experts' gate/up run on linear_q4_glu_rows.wgsl (decode) and E ≤ 512.
    pub fn routes_in_glu(&self, m: &GpuMoe, t: usize) -> bool {
        self.route_in_glu && self.experts_up(m, t) == ExpertsUp::GluRows
    }

    /// Whether a MoE block's experts' GLU over `t` tokens runs in items' rounds
    /// (linear_q4_glu_rows' `ITEMS`, `moe_rounds`): where it routes its own items
    /// (`routes_in_glu`) and a token has at most `GLU_ITEMS_MAX` items. Its grid: one workgroup
    /// a row and token.
    pub fn glu_items(&self, m: &GpuMoe, t: usize) -> bool {
        self.glu_items && self.routes_in_glu(m, t)
    }

    /// The shared expert's gate/up (where it does not ride in the stacks) over `t` tokens.
    pub fn shared_up(&self, gate: &GpuLinear, up: &GpuLinear, t: usize) -> ExpertsUp {
        match (t, glu_ok(gate, up), glu_rows_ok(gate)) {
            (1, true, true) => ExpertsUp::GluRows,
            (1, true, false) => ExpertsUp::Glu,
            _ => ExpertsUp::Separate,
        }
    }

    /// The down products and weighted sum of a MoE block over `t` tokens.
    pub fn experts_down(&self, m: &GpuMoe, t: usize) -> ExpertsDown {
        let up = self.experts_up(m, t);
        if let ExpertsUp::Grouped(tile) = up {
            return ExpertsDown::Grouped(tile);
        }
        if m.shared.is_none() && t == 1 && q4_ok(&m.down, true) && m.down.slices.len() == 1 {
            // moe_down_rows.wgsl where a row's quads divide 64 (512 columns: 16).
            let quads = m.down.cols / 32;
            return if quads > 0 && 64 % quads == 0 {
                ExpertsDown::FusedRows
            } else {
                ExpertsDown::Fused
            };
        }
        ExpertsDown::Separate
    }

    /// The attention kernel for `t` tokens.
    pub fn attention(&self, t: usize) -> PrefillAttention {
        if t > 1 {
            return self.prefill_attention;
        }
        match self.decode_attention {
            DecodeAttention::Gqa { .. } => PrefillAttention::Gqa,
            DecodeAttention::Plain => PrefillAttention::Plain,
        }
    }

    /// How attention over `t` tokens splits its keys over workgroups: decode's rule
    /// (`decode_splits`) for one token, `SplitRule::WIDE` for a chunk.
    pub fn splits(&self, t: usize) -> SplitRule {
        if t == 1 {
            self.decode_splits
        } else {
            SplitRule::WIDE
        }
    }

    /// Whether attention over `t` tokens does attn_prep.wgsl's work (q/k norms, RoPE, the new K/V
    /// into the cache) inside attend_gqa.wgsl (`prep`), with no attn_prep dispatch: a decode step
    /// on attend_gqa.
    pub fn prep_in_attend(&self, t: usize) -> bool {
        t == 1 && matches!(self.decode_attention, DecodeAttention::Gqa { .. })
    }

    /// The DeltaNet kernels for `t` tokens of model `c` whose input projection is `in_proj`.
    pub fn deltanet(&self, c: &ModelConfig, t: usize, in_proj: &Fused) -> DeltaNetPath {
        // dn_recur_norm.wgsl: 4 slices of whole vec4s of dk, ≤ 32 state values an invocation.
        let dk_ok = c.dn_k_dim.is_multiple_of(16) && c.dn_k_dim <= 128;
        if t == 1 && c.conv_dim().is_multiple_of(c.dn_k_dim) && c.dn_v_dim <= 128 && dk_ok {
            // The conv on the product's rows where that product is one linear_q4_rows dispatch.
            if self.folds_norm(in_proj, t) {
                DeltaNetPath::StepConvInRows
            } else {
                DeltaNetPath::Step
            }
        } else {
            DeltaNetPath::Chunk
        }
    }
}

/// linear_q4_rows.wgsl's rows per workgroup for a matrix (slice) of `rows` rows: 16 from 8,192
/// rows, else 4 from 1,024, else 2, so that even the router (257 rows) and the 2,048-row output
/// projections run on ≥ 128 workgroups.
pub fn rows_rb(rows: usize) -> usize {
    if rows >= 8192 {
        16
    } else if rows >= 1024 {
        4
    } else {
        2
    }
}

/// Whether linear_q4(_mm).wgsl take this matrix: MLX 4-bit, groups of a multiple of 32, inputs
/// on 16-byte boundaries.
fn q4_ok(w: &GpuLinear, aligned: bool) -> bool {
    w.bits == 4 && w.group.is_multiple_of(32) && w.cols.is_multiple_of(32) && aligned
}

/// Whether linear_q4.wgsl takes this 8-bit matrix (16 weights per 16-byte read): groups and
/// columns multiples of 16, inputs on 16-byte boundaries.
fn q8_ok(w: &GpuLinear, aligned: bool) -> bool {
    w.bits == 8 && w.group.is_multiple_of(16) && w.cols.is_multiple_of(16) && aligned
}

/// Whether linear_q4_rows.wgsl takes this plain matrix: 4-bit with 2,048 or 4,096 columns, or
/// 8-bit with 2,048 (each of its 64 invocations holds the inputs of one or two 16-byte words of
/// a row).
fn rows_ok(w: &GpuLinear, aligned: bool) -> bool {
    let q4 = q4_ok(w, aligned) && (w.cols == 2048 || w.cols == 4096);
    let q8 = q8_ok(w, aligned) && w.cols == 2048;
    (q4 || q8) && w.experts <= 1
}

/// Whether linear_q4_glu(_rows).wgsl take this gate and up: both 4-bit as `q4_ok` wants, the
/// same shape, each in one slice with the same layout (one set of offsets serves both).
fn glu_ok(gate: &GpuLinear, up: &GpuLinear) -> bool {
    q4_ok(gate, true)
        && q4_ok(up, true)
        && gate.rows == up.rows
        && gate.cols == up.cols
        && gate.group == up.group
        && gate.experts == up.experts
        && gate.slices.len() == 1
        && up.slices.len() == 1
        && gate.slices[0].scale_off == up.slices[0].scale_off
        && gate.slices[0].bias_off == up.slices[0].bias_off
}

/// Whether linear_q4_glu_rows.wgsl takes this gate: 2,048 input columns (its 64 invocations
/// hold one quad each).
fn glu_rows_ok(gate: &GpuLinear) -> bool {
    gate.cols == 2048 && gate.mat_words.is_multiple_of(4)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn products_fall_back_in_order() {
        use ProductsKernel::{Coop, CoopBig, CoopBigWide, Mm};
        let big = WgpuOptions {
            coop: true,
            coop_big: true,
            coop_rows: 64,
            ..WgpuOptions::default()
        };
        let wide = CoopBigWide.options(&big);
        assert_eq!(ProductsKernel::of(&wide), CoopBigWide);
        assert_eq!(wide.coop_rows, 128);
        assert_eq!(products_candidates(&wide), [CoopBigWide, CoopBig, Coop, Mm]);
        assert_eq!(products_choice(&wide, &[]), CoopBigWide);
        assert_eq!(products_choice(&wide, &[CoopBigWide]), CoopBig);
        assert_eq!(products_choice(&wide, &[CoopBigWide, CoopBig]), Coop);
        assert_eq!(products_choice(&wide, &[CoopBigWide, CoopBig, Coop]), Mm);
        assert_eq!(CoopBig.options(&wide).coop_rows, 64);
        let coop = CoopBig.options(&big);
        let coop = Coop.options(&coop);
        let mm = Mm.options(&big);
        assert_eq!(ProductsKernel::of(&big), CoopBig);
        assert_eq!(ProductsKernel::of(&coop), Coop);
        assert_eq!(ProductsKernel::of(&mm), Mm);
        // `coop_big` without `coop` asks for no cooperative matrices.
        let stray = WgpuOptions {
            coop: false,
            coop_big: true,
            ..WgpuOptions::default()
        };
        assert_eq!(ProductsKernel::of(&stray), Mm);

        assert_eq!(products_candidates(&big), [CoopBig, Coop, Mm]);
        assert_eq!(products_candidates(&coop), [Coop, Mm]);
        assert_eq!(products_candidates(&mm), [Mm]);

        assert_eq!(products_choice(&big, &[]), CoopBig);
        assert_eq!(products_choice(&big, &[CoopBig]), Coop);
        assert_eq!(products_choice(&big, &[CoopBig, Coop]), Mm);
        // A refusal of a less demanding kernel rules out the more demanding ones too.
        assert_eq!(products_choice(&big, &[Coop]), Mm);
        assert_eq!(products_choice(&coop, &[]), Coop);
        assert_eq!(products_choice(&coop, &[Coop]), Mm);
        assert_eq!(products_choice(&mm, &[]), Mm);

        // Each choice's options name it and leave the rest as asked.
        for k in [CoopBigWide, CoopBig, Coop, Mm] {
            let o = k.options(&big);
            assert_eq!(ProductsKernel::of(&o), k);
            assert_eq!(o.chunk, big.chunk);
            assert_eq!(o.dense_tile, big.dense_tile);
        }
        assert_eq!(CoopBig.name(), coop_spec(MmTile::T64, 16, true).name);
        assert!(CoopBigWide.name().starts_with(CoopBig.name()));
        assert_eq!(Coop.name(), coop_spec(MmTile::T64, 16, false).name);
        assert_eq!(Mm.name(), mm_spec(MmTile::T64, true).name);
    }
}
