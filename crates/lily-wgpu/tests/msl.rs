//! Apple's limits as a tested contract, without a Mac (issue 29): every kernel the backend can
//! choose for the full Qwen3.6-35B-A3B shape is translated to Metal Shading Language by naga's
//! MSL back end (the translation wgpu's Metal backend makes), with its `override` constants
//! resolved to the real model's values, and the kernels the plan chooses under an Apple GPU's
//! limits (`lily_wgpu::gpu::apple_limits`) are checked against them: workgroup memory ≤ 32 KiB
//! (naga's layout of the workgroup variables the entry point uses, each rounded up to 16 bytes
//! as Metal allocates them), invocations ≤ 1,024, storage buffers ≤ 29. No GPU needed.

use lily_core::config::ModelConfig;
use lily_core::synth::{preset_text_config, Preset};
use lily_wgpu::gpu::apple_limits;
use lily_wgpu::plan::{
    coop_spec, fitting_chunk, products_choice, DeviceCaps, MmTile, Plan, PrefillAttention,
    ProductsKernel, VENDOR_NVIDIA,
};
use lily_wgpu::shaders::{validator, Form, Spec};
use lily_wgpu::{Choice, WgpuOptions};

fn full_config() -> ModelConfig {
    let mut text = preset_text_config(Preset::Full);
    text["model_type"] = "qwen3_5_moe_text".into();
    ModelConfig::from_json(&text).unwrap()
}

/// Limits of a large GPU (the H200 through Vulkan: 48 KiB of workgroup memory).
fn large_limits() -> wgpu::Limits {
    wgpu::Limits {
        max_compute_workgroup_storage_size: 48 << 10,
        max_compute_invocations_per_workgroup: 1024,
        max_storage_buffers_per_shader_stage: 64,
        ..wgpu::Limits::default()
    }
}

/// A large discrete GPU (`large_limits`) with subgroups and SHADER_F16, without cooperative
/// matrices, of `vendor`.
fn discrete_gpu(vendor: u32) -> DeviceCaps {
    DeviceCaps {
        limits: large_limits(),
        subgroups: true,
        f16: true,
        device_type: wgpu::DeviceType::DiscreteGpu,
        coop: 0,
        metal: false,
        vendor,
    }
}

/// Every kernel some plan can choose for the full model: both prefill attentions, the shared
/// expert in the stacks or not, on a large GPU and on an Apple one, reductions on subgroups and
/// through workgroup memory, the KV cache in f16 and in f32, prefill's product tiles in f16
/// and in f32 (tiles of 16, 32 and 64 each: f32's 64 through `dense_tile`), the activations in
/// f16 and in f32 (each product in each of its forms), and the decode switches (each picks its
/// own kernel's variant) all on and all off: attend_gqa's reads flat and not, the decode MoE's
/// early reads and not.
fn choosable() -> Vec<Spec> {
    let c = full_config();
    let mut out: Vec<Spec> = Vec::new();
    for attn_tile in [true, false] {
        for stacked in [true, false] {
            // Cooperative matrices of NVIDIA Vulkan's 16 × 16 on the large GPU, Apple's 8 × 8.
            for (limits, coop) in [(large_limits(), 16), (apple_limits(), 8)] {
                for (subgroups, f16) in [(true, true), (false, false), (true, false), (false, true)]
                {
                    // f16 activations alone, and with the f16 KV cache and tiles.
                    // Each with the decode switches on (`sw`) and off.
                    for (f16_acts, sw) in
                        [(false, false), (false, true), (true, false), (true, true)]
                    {
                        let opts = WgpuOptions {
                            attn_tile,
                            f16_kv: Choice::of(f16),
                            f16_tiles: f16,
                            f16_acts: Choice::of(f16_acts),
                            // attend_gqa with its reads flat (FLAT = 1) and without.
                            attn_flat: sw,
                            attn_split: sw,
                            // The decode MoE's early reads (EARLY = 1) and not.
                            rows_early: sw,
                            glu_early: sw,
                            // linear_q4_rows' persistent 16-row kernel (PERSIST = 1) and not.
                            rows_persist: sw,
                            // The decode MoE in rounds (ITEMS = 1, ROUNDS = 1) and not.
                            moe_rounds: sw,
                            // linear_q4_rows' 16-row kernel for one-word rows (WORDS = 1),
                            // persistent (the switches on) and not (f16 activations alone).
                            rows_one_word: sw || f16_acts,
                            // linear_q4_rows' lean 1-row kernel (LEAN = 1, `router_lean`).
                            router_lean: sw,
                            // dn_recur_norm's one exchange (ONE_SYNC = 1, `dn_one_sync`).
                            dn_one_sync: sw,
                            // moe_down_lanes in moe_down_rows' place (`down_item_lanes`).
                            down_item_lanes: sw,
                            // The MoE row kernels' other rows a workgroup (`glu_rows`,
                            // `down_rows`: 4 / 2 and 16 / 8).
                            glu_rows: match (sw, subgroups) {
                                (false, _) => 0,
                                (true, true) => 4,
                                (true, false) => 16,
                            },
                            down_rows: match (sw, subgroups) {
                                (false, _) => 0,
                                (true, true) => 2,
                                (true, false) => 8,
                            },
                            // linear_q4_coop in linear_q4_mm's place (where f16 is), with the
                            // decode switches on; linear_q4_mm's f16 tiles with them off.
                            coop: f16 && sw,
                            // linear_q4_coop_big in its place (`coop_big`) where the reductions
                            // go through workgroup memory (coop's kernels take no subgroups).
                            coop_big: !subgroups,
                            // Its workgroups of 128 rows (`coop_rows`) with the decode switches
                            // on: where they fit (the large GPU; Apple's keep 64).
                            coop_rows: if sw { 128 } else { 64 },
                            // The A/B's f32 tiles of 64 (and f16's by default).
                            dense_tile: if subgroups { 64 } else { 0 },
                            ..WgpuOptions::default()
                        };
                        let device = DeviceCaps {
                            limits: limits.clone(),
                            subgroups,
                            f16: f16 || f16_acts,
                            device_type: wgpu::DeviceType::DiscreteGpu,
                            coop,
                            metal: false,
                            vendor: 0,
                        };
                        let plan = Plan::resolve(&opts, &c, stacked, &device).unwrap();
                        for s in plan.specs.all() {
                            if !out.contains(s) {
                                out.push(s.clone());
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

/// `spec` translated to MSL as wgpu's Metal backend would: overrides resolved, validated with
/// the capabilities naga's MSL writer supports, each buffer binding given a slot and the
/// buffer-sizes buffer after them.
fn to_msl(spec: &Spec) -> Result<String, String> {
    let (module, _) = spec.resolved().map_err(|e| format!("{e:#}"))?;
    let info = naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::back::msl::supported_capabilities(),
    )
    .validate(&module)
    .map_err(|e| format!("{}: not valid for Metal: {e:?}", spec.name))?;
    let mut resources = naga::back::msl::EntryPointResources::default();
    let mut slot = 0u8;
    for (_, var) in module.global_variables.iter() {
        if let Some(rb) = var.binding {
            resources.resources.insert(
                rb,
                naga::back::msl::BindTarget {
                    buffer: Some(slot),
                    mutable: matches!(var.space, naga::AddressSpace::Storage { access } if access.contains(naga::StorageAccess::STORE)),
                    ..Default::default()
                },
            );
            slot += 1;
        }
    }
    resources.sizes_buffer = Some(slot);
    let mut options = naga::back::msl::Options {
        lang_version: (2, 4),
        fake_missing_bindings: false,
        zero_initialize_workgroup_memory: false,
        ..Default::default()
    };
    options
        .per_entry_point_map
        .insert(spec.name.to_string(), resources);
    let pipeline = naga::back::msl::PipelineOptions {
        entry_point: Some((naga::ShaderStage::Compute, spec.name.to_string())),
        ..Default::default()
    };
    naga::back::msl::write_string(&module, &info, &options, &pipeline)
        .map(|(msl, _)| msl)
        .map_err(|e| format!("{}: MSL: {e:?}", spec.name))
}

#[test]
fn every_choosable_kernel_translates_to_msl() {
    let specs = choosable();
    assert!(specs.len() > 60, "{} kernels", specs.len());
    // Prefill's products in both tile forms, every tile size each form takes.
    for (f16, tts) in [
        (true, &[16.0, 32.0, 64.0][..]),
        (false, &[16.0, 32.0, 64.0][..]),
    ] {
        for tt in tts {
            assert!(
                specs.iter().any(|s| s.name == "linear_q4_mm"
                    && s.tile_f16 == f16
                    && s.constants.contains(&("TT", *tt))),
                "linear_q4_mm with tiles of {tt} in f16 {f16} is not among the kernels checked"
            );
        }
    }
    // linear_q4_coop and linear_q4_coop_big at every tile size, on Apple's 8 × 8 matrices and
    // NVIDIA's 16 × 16, activations in f16 and f32.
    for name in ["linear_q4_coop", "linear_q4_coop_big"] {
        for coop in [8, 16] {
            for tt in [16.0, 32.0, 64.0] {
                for act_f16 in [false, true] {
                    assert!(
                        specs.iter().any(|s| s.name == name
                            && s.coop == coop
                            && s.act_f16 == act_f16
                            && s.constants.contains(&("TT", tt))),
                        "{name} with tiles of {tt} on {coop}×{coop} (f16 activations {act_f16}) is not among the kernels checked"
                    );
                }
            }
        }
    }
    assert!(
        specs.iter().any(|s| s.kv_f16),
        "no kernel with the f16 KV cache checked"
    );
    // Every kernel with f16 activations, the products in each form their launch sites take.
    let f32_names: Vec<&str> = specs
        .iter()
        .filter(|s| !s.act_f16)
        .map(|s| s.name)
        .collect();
    for name in f32_names {
        assert!(
            specs.iter().any(|s| s.name == name && s.act_f16),
            "{name} with f16 activations is not among the kernels checked"
        );
    }
    for form in Form::ALL {
        assert!(
            specs
                .iter()
                .any(|s| s.name == "linear_q4_rows" && s.act_f16 && s.form == form),
            "linear_q4_rows in form {form:?} with f16 activations is not among the kernels checked"
        );
    }
    let mut failed = Vec::new();
    for spec in &specs {
        match to_msl(spec) {
            Ok(msl) => assert!(
                msl.contains(&format!("kernel void {}", spec.name)),
                "{}: no kernel function in its MSL",
                spec.name
            ),
            Err(e) => failed.push(e),
        }
    }
    assert!(
        failed.is_empty(),
        "kernels that do not translate to MSL:\n{}",
        failed.join("\n")
    );
    println!("{} kernels translate to MSL", specs.len());
}

/// Every combination of the decode switches (`DECODE_SWITCHES` of them: attn_flat, attn_split,
/// rows_early, glu_early, rows_persist, moe_rounds, rows_one_word), with f16 and f32 element
/// types.
#[test]
fn the_apple_plan_fits_apple_limits() {
    for f16 in [false, true] {
        for bits in 0..1u32 << DECODE_SWITCHES {
            let on = |i: u32| bits & (1 << i) != 0;
            apple_plan_fits(f16, [on(0), on(1), on(2), on(3), on(4), on(5), on(6)]);
        }
    }
}

/// The decode switches `apple_plan_fits` takes.
const DECODE_SWITCHES: u32 = 7;

/// The plan for an Apple GPU (f16 KV cache, f16 product tiles and f16 activations `f16` or not;
/// the decode switches attn_flat, attn_split, rows_early, glu_early, rows_persist, moe_rounds and
/// rows_one_word as `sw` says) fits its limits.
fn apple_plan_fits(f16: bool, sw: [bool; DECODE_SWITCHES as usize]) {
    let c = full_config();
    let limits = apple_limits();
    let device = DeviceCaps {
        limits,
        subgroups: true,
        f16: true,
        device_type: wgpu::DeviceType::IntegratedGpu,
        coop: 0,
        metal: true,
        vendor: APPLE,
    };
    let opts = WgpuOptions {
        f16_kv: Choice::of(f16),
        f16_tiles: f16,
        f16_acts: Choice::of(f16),
        attn_flat: sw[0],
        attn_split: sw[1],
        rows_early: sw[2],
        glu_early: sw[3],
        rows_persist: sw[4],
        moe_rounds: sw[5],
        rows_one_word: sw[6],
        // linear_q4_rows' lean 1-row kernel (`router_lean`) with rows_early's EARLY and without.
        router_lean: sw[2],
        // dn_recur_norm's one exchange (`dn_one_sync`, ONE_SYNC) with attn_split and without.
        dn_one_sync: sw[1],
        // moe_down_lanes in moe_down_rows' place (`down_item_lanes`) with moe_rounds and
        // without.
        down_item_lanes: sw[5],
        ..WgpuOptions::default()
    };
    let plan = Plan::resolve(&opts, &c, true, &device).unwrap();
    println!("plan: {}", plan.describe());
    let o = &plan.options;
    assert_eq!(
        [
            o.attn_flat,
            o.attn_split,
            o.rows_early,
            o.glu_early,
            o.rows_persist,
            o.moe_rounds,
            o.rows_one_word
        ],
        sw
    );
    assert_eq!(plan.specs.linear_q4_rows1.is_some(), sw[2]);
    // The persistent kernel on an integrated GPU's workgroups (`split_workgroups`: 128).
    assert_eq!(plan.rows_workers, sw[4].then_some(128));
    assert_eq!(plan.act_f16, f16);
    // f16 tiles of 64 items fit 32 KiB (the same bytes as f32's 32): the dense products take them.
    assert_eq!(plan.tile_f16, f16);
    assert_eq!(plan.dense_mm, if f16 { MmTile::T64 } else { MmTile::T32 });
    // attend_tile is kept, with blocks of 16 keys (32 do not fit).
    assert_eq!(
        plan.prefill_attention,
        PrefillAttention::Tile { g: 8, keys: 16 }
    );
    let mut over = Vec::new();
    for spec in plan.specs.all() {
        let (module, info) = spec.resolved().unwrap();
        let needs = lily_wgpu::shaders::needs_of(&module, &info, spec.name).unwrap();
        println!(
            "{:<20} {:>6} bytes of workgroup memory, {:>4} invocations, {} storage buffers",
            spec.name, needs.workgroup_bytes, needs.invocations, needs.storage_buffers
        );
        if needs.workgroup_bytes > 32 << 10
            || needs.invocations > 1024
            || needs.storage_buffers > 29
        {
            over.push(format!("{} {:?}: {needs:?}", spec.name, spec.constants));
        }
    }
    assert!(over.is_empty(), "kernels over Apple's limits: {over:?}");
}

/// The check itself: attend_tile with blocks of 32 keys (what every device ran before the plan
/// checked workgroup memory) needs 42,752 bytes, over Apple's 32 KiB, and the plan refuses it
/// there but takes it on a large GPU.
#[test]
fn an_oversized_kernel_is_caught() {
    let c = full_config();
    let big = lily_wgpu::plan::attend_tile_spec(c.head_dim, 8, 32).unwrap();
    let needs = big.needs().unwrap();
    assert_eq!(needs.workgroup_bytes, 42_752);
    assert!(needs.exceeds(&apple_limits()).is_some());
    let device = discrete_gpu(0);
    let plan = Plan::resolve(&WgpuOptions::default(), &c, true, &device).unwrap();
    assert_eq!(
        plan.prefill_attention,
        PrefillAttention::Tile { g: 8, keys: 32 }
    );
    // A plain validator accepts the same module: the limit is the plan's to check.
    let (module, _) = big.resolved().unwrap();
    validator().validate(&module).unwrap();
}

/// Without SHADER_F16 the f16 activations are refused by the plan: the kernels compiled are the
/// very ones the switch off gives (every product in one form, every kernel's text the same), and
/// the resolved options say the switch is off.
#[test]
fn f16_activations_fall_back_to_f32_without_shader_f16() {
    let c = full_config();
    let device = |f16| DeviceCaps {
        limits: large_limits(),
        subgroups: true,
        f16,
        device_type: wgpu::DeviceType::DiscreteGpu,
        coop: 0,
        metal: false,
        vendor: 0,
    };
    let on = WgpuOptions {
        f16_acts: Choice::On,
        ..WgpuOptions::default()
    };
    let refused = Plan::resolve(&on, &c, true, &device(false)).unwrap();
    let off = Plan::resolve(&WgpuOptions::default(), &c, true, &device(true)).unwrap();
    assert!(!refused.act_f16 && refused.options.f16_acts == Choice::Off);
    assert!(
        refused
            .notes
            .iter()
            .any(|n| n == "f16 activations: off (the adapter lacks SHADER_F16)"),
        "{:?}",
        refused.notes
    );
    let code =
        |p: &Plan| -> Vec<String> { p.specs.all().iter().map(|s| s.code().unwrap()).collect() };
    assert_eq!(code(&refused), code(&off));
    assert_eq!(refused.specs.linear_q4_rows16.len(), 1);
    // With SHADER_F16 the same options compile every kernel with f16 activations, the row
    // products in their four forms.
    let f16 = Plan::resolve(&on, &c, true, &device(true)).unwrap();
    assert!(f16.act_f16 && f16.specs.all().iter().all(|s| s.act_f16));
    assert_eq!(f16.specs.linear_q4_rows16.len(), 4);
}

/// `rows_persist` on a discrete GPU's plan for the full model: the 16-row linear_q4_rows kernel
/// compiled with `PERSIST` (rounds of 4 rows), the others not; lm_head's 15,520 row blocks on
/// 512 workgroups (the knob's count where set), DeltaNet's in_proj (772 blocks) and
/// attention's q/k/v (576) on one workgroup a block (fewer than 2 blocks a worker), the 4-row
/// kernel's launches never persistent; off, every launch one workgroup a block.
#[test]
fn the_persistent_rows_grid_streams_lm_head_and_leaves_the_smaller_products() {
    let c = full_config();
    let device = discrete_gpu(VENDOR_NVIDIA);
    let constant = |s: &Spec, name: &str| {
        s.constants
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| *v)
            .unwrap()
    };
    for workers in [0, 264] {
        let opts = WgpuOptions {
            rows_persist: true,
            rows_workers: workers,
            ..WgpuOptions::default()
        };
        let plan = Plan::resolve(&opts, &c, true, &device).unwrap();
        let w = if workers == 0 { 512 } else { workers };
        assert_eq!(plan.rows_workers, Some(w));
        assert_eq!(plan.options.rows_workers, w);
        for s in &plan.specs.linear_q4_rows16 {
            assert_eq!((constant(s, "PERSIST"), constant(s, "RI")), (1.0, 4.0));
        }
        for s in plan
            .specs
            .linear_q4_rows4
            .iter()
            .chain(&plan.specs.linear_q4_rows2)
        {
            assert_eq!(constant(s, "PERSIST"), 0.0);
        }
        assert_eq!(plan.rows_grid(16, 15_520), (w as u32, 1));
        let small = if workers == 0 { (772, 1) } else { (264, 1) };
        assert_eq!(plan.rows_grid(16, 772), small);
        assert_eq!(plan.rows_grid(4, 15_520), (15_520, 1));
    }
    let opts = WgpuOptions {
        rows_persist: false,
        ..WgpuOptions::default()
    };
    let off = Plan::resolve(&opts, &c, true, &device).unwrap();
    assert_eq!(off.rows_workers, None);
    assert_eq!(off.rows_grid(16, 15_520), (15_520, 1));
    assert_eq!(constant(&off.specs.linear_q4_rows16[0], "PERSIST"), 0.0);
}

/// The plan takes linear_q4_coop only where `coop` asks and the device enabled cooperative
/// matrices with f16 (at the device's size, every tile size, f16 tiles' sizes), and says so in its
/// line; otherwise linear_q4_mm as the other options ask (lavapipe and CI: no cooperative
/// matrices, so the default kernels).
#[test]
fn coop_is_planned_only_where_asked_and_enabled() {
    let c = full_config();
    let device = |coop, f16, limits: wgpu::Limits| DeviceCaps {
        limits,
        subgroups: true,
        f16,
        device_type: wgpu::DeviceType::DiscreteGpu,
        coop,
        metal: false,
        vendor: 0,
    };
    // On by default (with `coop_big`, below); linear_q4_coop itself with `coop_big` off.
    assert!(WgpuOptions::default().coop);
    let on = WgpuOptions {
        coop_big: false,
        ..WgpuOptions::default()
    };
    let names = |p: &Plan| -> Vec<(&str, u32)> {
        [&p.specs.linear_q4_mm16, &p.specs.linear_q4_mm32]
            .into_iter()
            .chain(p.specs.linear_q4_mm64.as_ref())
            .flatten()
            .map(|s| (s.name, s.coop))
            .collect()
    };
    for (size, limits) in [(16, large_limits()), (8, apple_limits())] {
        let plan = Plan::resolve(&on, &c, true, &device(size, true, limits.clone())).unwrap();
        assert_eq!(plan.coop, size);
        assert_eq!(names(&plan), vec![("linear_q4_coop", size); 3]);
        assert!(plan.tile_f16 && plan.options.coop);
        assert_eq!(plan.dense_mm, MmTile::T64);
        assert_eq!(plan.expert_tiles(), [MmTile::T64, MmTile::T32, MmTile::T16]);
        let line = plan.describe();
        assert!(
            line.contains(&format!(
                "linear_q4_coop on {size}×{size} cooperative matrices"
            )) && line.contains("cooperative matrices on"),
            "{line}"
        );
        for spec in plan.specs.all() {
            assert!(
                spec.needs().unwrap().exceeds(&limits).is_none(),
                "{}",
                spec.name
            );
        }
    }
    // `coop_big` (on by default): linear_q4_coop_big in linear_q4_coop's place, the same tiles
    // at either size, on 64 rows (`coop_rows` 64) fitting 32 KiB, named in the line.
    let big = WgpuOptions {
        coop_rows: 64,
        ..WgpuOptions::default()
    };
    assert!(big.coop_big);
    for (size, limits) in [(16, large_limits()), (8, apple_limits())] {
        let plan = Plan::resolve(&big, &c, true, &device(size, true, limits.clone())).unwrap();
        assert_eq!(plan.coop, size);
        assert_eq!(names(&plan), vec![("linear_q4_coop_big", size); 3]);
        assert!(plan.options.coop && plan.options.coop_big);
        assert_eq!(plan.expert_tiles(), [MmTile::T64, MmTile::T32, MmTile::T16]);
        let line = plan.describe();
        assert!(
            line.contains(&format!(
                "linear_q4_coop_big on {size}×{size} cooperative matrices"
            )) && line.contains("coop big tiles on"),
            "{line}"
        );
        for spec in plan.specs.all() {
            let needs = spec.needs().unwrap();
            assert!(needs.exceeds(&limits).is_none(), "{}", spec.name);
            if spec.name == "linear_q4_coop_big" {
                assert!(needs.workgroup_bytes <= 32 << 10, "{needs:?}");
            }
        }
    }
    // `coop_rows` 128 (the default): linear_q4_coop_big on workgroups of 128 rows (their launches' row blocks
    // too) where its three tiles fit (the large GPU's 48 KiB), else 64 with a note (Apple's 32
    // KiB at 8 × 8); nothing for linear_q4_coop.
    let wide = WgpuOptions::default();
    assert_eq!(wide.coop_rows, 128);
    let plan = Plan::resolve(&wide, &c, true, &device(16, true, large_limits())).unwrap();
    assert_eq!((plan.mm_rows, plan.options.coop_rows), (128, 128));
    assert!(
        plan.describe().contains("coop rows 128"),
        "{}",
        plan.describe()
    );
    for spec in [&plan.specs.linear_q4_mm16, &plan.specs.linear_q4_mm32]
        .into_iter()
        .chain(plan.specs.linear_q4_mm64.as_ref())
        .flatten()
    {
        assert_eq!((spec.name, spec.mm_rows()), ("linear_q4_coop_big", 128));
        let needs = spec.needs().unwrap();
        assert!(needs.exceeds(&large_limits()).is_none(), "{needs:?}");
        assert_eq!(needs.invocations, 256);
    }
    // The routed experts' grouped products keep linear_q4_coop_big's 64-row form (moe_group's
    // row blocks too): 128 rows lost there on the H100 (session 22).
    assert_eq!(plan.expert_rows, 64);
    let experts = plan
        .specs
        .experts_coop
        .as_ref()
        .expect("the experts' own products");
    for (forms, items) in experts.iter().zip([16, 32, 64]) {
        assert_eq!(forms.len(), plan.specs.linear_q4_mm16.len());
        for spec in forms {
            assert_eq!((spec.name, spec.mm_rows()), ("linear_q4_coop_big", 64));
            assert_eq!(spec.constants[0], ("TT", items as f64));
        }
    }
    assert!(plan.specs.all().iter().any(|s| s.mm_rows() == 64));
    assert!(
        plan.describe()
            .contains("128 rows a workgroup (routed experts' 64)"),
        "{}",
        plan.describe()
    );
    // Refused at load, 128 rows fall back to 64 for every product: today's plan, no split.
    let next = products_choice(&wide, &[ProductsKernel::CoopBigWide]);
    let plan = Plan::resolve(
        &next.options(&wide),
        &c,
        true,
        &device(16, true, large_limits()),
    )
    .unwrap();
    assert_eq!((plan.mm_rows, plan.expert_rows), (64, 64));
    assert!(plan.specs.experts_coop.is_none());
    assert!(plan.specs.all().iter().all(|s| s.mm_rows() == 64));
    let plan = Plan::resolve(&wide, &c, true, &device(8, true, apple_limits())).unwrap();
    assert_eq!((plan.mm_rows, plan.options.coop_rows), (64, 64));
    assert!(plan.specs.experts_coop.is_none());
    assert!(
        plan.notes
            .iter()
            .any(|n| n.contains("linear_q4_coop_big with 128 rows") && n.ends_with("64 rows")),
        "{:?}",
        plan.notes
    );
    assert_eq!(names(&plan), vec![("linear_q4_coop_big", 8); 3]);
    for opts in [
        WgpuOptions {
            coop_big: false,
            ..wide.clone()
        },
        WgpuOptions {
            coop: false,
            ..wide.clone()
        },
    ] {
        let plan = Plan::resolve(&opts, &c, true, &device(16, true, large_limits())).unwrap();
        assert_eq!((plan.mm_rows, plan.options.coop_rows), (64, 64));
        assert!(plan.specs.all().iter().all(|s| s.mm_rows() == 64));
    }
    // Turned off (`--wgpu-no-coop`, `coop_big` asked or not), no cooperative matrices on the
    // device, or no f16: linear_q4_mm.
    let off = WgpuOptions {
        coop: false,
        ..big.clone()
    };
    for (opts, coop, f16) in [
        (off, 16, true),
        (on.clone(), 0, true),
        (on.clone(), 16, false),
        (big.clone(), 0, true),
    ] {
        let plan = Plan::resolve(&opts, &c, true, &device(coop, f16, large_limits())).unwrap();
        assert_eq!(plan.coop, 0);
        assert!(!plan.options.coop && !plan.options.coop_big);
        assert!(names(&plan)
            .iter()
            .all(|&(n, s)| n == "linear_q4_mm" && s == 0));
        assert!(plan.describe().contains("cooperative matrices off"));
    }
}

/// linear_q4_coop.wgsl and linear_q4_coop_big.wgsl (`coop_big`) on NVIDIA Vulkan's 16 × 16
/// matrices (and Apple's 8 × 8) translated to
/// SPIR-V by naga's SPIR-V back end, as wgpu's Vulkan backend does (overrides resolved), at every
/// tile size and form: the cooperative-matrix capability and the f16 × f16 → f32 multiply-add
/// are there. (The Debian spirv-val, 2023.1, predates SPV_KHR_cooperative_matrix: the module is
/// validated by naga only.)
#[test]
fn coop_kernels_translate_to_spirv() {
    // OpCooperativeMatrixMulAddKHR and the CooperativeMatrixKHR capability.
    const MUL_ADD: u32 = 4459;
    const CAPABILITY: u32 = 6022;
    for (coop, big, rows) in [
        (16, false, 64),
        (8, false, 64),
        (16, true, 64),
        (8, true, 64),
        (16, true, 128),
        (8, true, 128),
    ] {
        for tile in [MmTile::T16, MmTile::T32, MmTile::T64] {
            for form in [Form::ALL[0], Form::ALL[1]] {
                let mut spec = coop_spec(tile, coop, big);
                spec.act_f16 = form.y_f32;
                spec.form = form;
                spec.coop_rows = rows;
                let (module, info) = spec.resolved().unwrap();
                let options = naga::back::spv::Options {
                    lang_version: (1, 3),
                    ..Default::default()
                };
                let pipeline = naga::back::spv::PipelineOptions {
                    shader_stage: naga::ShaderStage::Compute,
                    entry_point: spec.name.into(),
                };
                let words = naga::back::spv::write_vec(&module, &info, &options, Some(&pipeline))
                    .unwrap_or_else(|e| panic!("{coop} {tile:?}: SPIR-V: {e:?}"));
                let ops: Vec<u32> = spirv_ops(&words);
                assert!(ops.contains(&MUL_ADD), "{coop} {tile:?}: no multiply-add");
                // No subgroup operations beside the cooperative ones (NVIDIA's driver has
                // crashed on modules with both: docs/WGPU.md).
                assert!(
                    !words
                        .windows(2)
                        .any(|w| w[0] == (2 << 16 | 17) && (61..=70).contains(&w[1])),
                    "{coop} {tile:?}: a GroupNonUniform capability"
                );
                assert!(
                    words
                        .windows(2)
                        .any(|w| w[0] == (2 << 16 | 17) && w[1] == CAPABILITY),
                    "{coop} {tile:?}: no CooperativeMatrixKHR capability"
                );
                // 64 rows: Apple's 32 KiB; 128 (`coop_rows`): NVIDIA's 48 KiB.
                let needs = spec.needs().unwrap();
                let most = if rows == 128 { 48 << 10 } else { 32 << 10 };
                assert!(needs.workgroup_bytes <= most, "{rows} rows: {needs:?}");
            }
        }
    }
}

/// The opcodes of a SPIR-V module's instructions, in order.
fn spirv_ops(words: &[u32]) -> Vec<u32> {
    let mut ops = Vec::new();
    let mut i = 5;
    while i < words.len() {
        let n = (words[i] >> 16) as usize;
        ops.push(words[i] & 0xffff);
        i += n.max(1);
    }
    ops
}

// PCI vendor ids (`DeviceCaps::vendor`) beside `plan::VENDOR_NVIDIA`: Apple's (`f16_rule` goes
// by `metal` there, not the id), AMD's, Intel's and Mesa's (`VK_VENDOR_ID_MESA`: lavapipe).
const APPLE: u32 = 0x106b;
const AMD: u32 = 0x1002;
const INTEL: u32 = 0x8086;
const MESA: u32 = 0x10005;

/// The f16 choices' rule (`plan::f16_rule`, `f16_acts` and `f16_kv` at `auto`): on for Apple
/// GPUs through Metal and for NVIDIA's (any backend), off on every other adapter (AMD, Intel,
/// CPU adapters; the reason in the plan line), `on` and `off` forcing either way, never without
/// SHADER_F16 (the reason said); Apple's limits alone (`--wgpu-limits apple`) do not turn f16
/// on, `auto_as_apple` (tests/apple_limits.rs) does.
#[test]
fn f16_is_on_for_apple_and_nvidia_gpus_and_off_elsewhere_unless_asked() {
    let c = full_config();
    let device = |metal, vendor, f16, device_type| DeviceCaps {
        limits: if metal {
            apple_limits()
        } else {
            large_limits()
        },
        subgroups: true,
        f16,
        device_type,
        coop: 0,
        metal,
        vendor,
    };
    let auto = WgpuOptions::default();
    assert_eq!((auto.f16_acts, auto.f16_kv), (Choice::Auto, Choice::Auto));
    let resolve = |opts: &WgpuOptions, d: &DeviceCaps| Plan::resolve(opts, &c, true, d).unwrap();
    let has = |p: &Plan, note: &str| p.notes.iter().any(|n| n == note);
    // Both on, the plan line saying why.
    let on_because = |p: &Plan, why: &str| {
        assert!(p.act_f16 && p.kv_f16, "{:?}", p.notes);
        assert_eq!(
            (p.options.f16_acts, p.options.f16_kv),
            (Choice::On, Choice::On)
        );
        assert!(p.specs.attend_gqa.kv_f16 && p.specs.all().iter().all(|s| s.act_f16));
        assert!(
            has(p, &format!("f16 activations: on ({why})")),
            "{:?}",
            p.notes
        );
        assert!(
            has(p, &format!("f16 KV cache: on ({why})")),
            "{:?}",
            p.notes
        );
        assert!(
            p.describe().starts_with("f16 activations,"),
            "{}",
            p.describe()
        );
    };
    // Apple (integrated, through Metal).
    on_because(
        &resolve(
            &auto,
            &device(true, APPLE, true, wgpu::DeviceType::IntegratedGpu),
        ),
        "Apple GPUs through Metal: f16 at full rate, half the bytes; the seed's precision",
    );
    // NVIDIA (through Vulkan: `metal` false), discrete or integrated (Jetson).
    for kind in [
        wgpu::DeviceType::DiscreteGpu,
        wgpu::DeviceType::IntegratedGpu,
    ] {
        on_because(
            &resolve(&auto, &device(false, VENDOR_NVIDIA, true, kind)),
            "NVIDIA: measured with coop, decode +2 % at 4K and +8 % at 32K, half the KV memory",
        );
    }
    // Every other adapter (AMD, Intel through Vulkan; lavapipe): off, with the reason.
    for (vendor, kind) in [
        (AMD, wgpu::DeviceType::DiscreteGpu),
        (AMD, wgpu::DeviceType::IntegratedGpu),
        (INTEL, wgpu::DeviceType::IntegratedGpu),
        (MESA, wgpu::DeviceType::Cpu),
    ] {
        let other = resolve(&auto, &device(false, vendor, true, kind));
        assert!(!other.act_f16 && !other.kv_f16, "{vendor:#x} {kind:?}");
        assert_eq!(
            (other.options.f16_acts, other.options.f16_kv),
            (Choice::Off, Choice::Off)
        );
        let why = "not yet measured on this adapter kind";
        assert!(
            has(&other, &format!("f16 activations: off ({why})")),
            "{:?}",
            other.notes
        );
        assert!(
            has(&other, &format!("f16 KV cache: off ({why})")),
            "{:?}",
            other.notes
        );
        assert!(other.describe().starts_with("fp32 activations,"));
        // Apple's limits alone change nothing; Apple's defaults asked for (the tests) do.
        let limits = WgpuOptions {
            limits: lily_wgpu::DeviceLimits::Apple,
            ..WgpuOptions::default()
        };
        assert!(!resolve(&limits, &device(false, vendor, true, kind)).act_f16);
        let as_apple = WgpuOptions {
            auto_as_apple: true,
            ..WgpuOptions::default()
        };
        let p = resolve(&as_apple, &device(false, vendor, true, kind));
        assert!(p.act_f16 && p.kv_f16);
        assert!(has(
            &p,
            "f16 activations: on (Apple GPUs' default, asked for on this adapter)"
        ));
    }
    // The flags force either way, each on its own, with no note (nothing decided for them).
    let forced = |acts, kv| WgpuOptions {
        f16_acts: acts,
        f16_kv: kv,
        ..WgpuOptions::default()
    };
    for (metal, vendor) in [(true, APPLE), (false, VENDOR_NVIDIA), (false, AMD)] {
        let d = device(metal, vendor, true, wgpu::DeviceType::DiscreteGpu);
        for (acts, kv) in [
            (Choice::On, Choice::Off),
            (Choice::Off, Choice::On),
            (Choice::On, Choice::On),
            (Choice::Off, Choice::Off),
        ] {
            let p = resolve(&forced(acts, kv), &d);
            assert_eq!(
                (p.act_f16, p.kv_f16),
                (acts == Choice::On, kv == Choice::On),
                "metal {metal}, vendor {vendor:#x}"
            );
            assert!(
                !p.notes.iter().any(|n| n.starts_with("f16 ")),
                "{:?}",
                p.notes
            );
        }
    }
    // Without SHADER_F16: off whatever was asked, the reason said where f16 was wanted.
    for (metal, vendor, acts) in [
        (true, APPLE, Choice::Auto),
        (false, VENDOR_NVIDIA, Choice::Auto),
        (false, AMD, Choice::On),
        (true, APPLE, Choice::On),
        (false, VENDOR_NVIDIA, Choice::On),
    ] {
        let p = resolve(
            &forced(acts, acts),
            &device(metal, vendor, false, wgpu::DeviceType::DiscreteGpu),
        );
        assert!(!p.act_f16 && !p.kv_f16);
        assert!(has(
            &p,
            "f16 activations: off (the adapter lacks SHADER_F16)"
        ));
        assert!(has(&p, "f16 KV cache: off (the adapter lacks SHADER_F16)"));
    }
}

/// The prefill chunk (4,096 tokens by default): as asked where a chunk's largest activation, the
/// routed experts' outputs, fits the device's largest storage binding (NVIDIA's, Apple's 1 GiB),
/// halved until it does where it does not (wgpu's default 128 MiB), which the plan line says.
#[test]
fn the_prefill_chunk_fits_the_devices_largest_binding() {
    let c = full_config();
    // 4,096 tokens × 9 items × 2,048 values: 151 MB in f16, 302 MB in f32.
    assert_eq!(fitting_chunk(4096, &c, true, 1 << 30), 4096);
    assert_eq!(fitting_chunk(4096, &c, false, 1 << 30), 4096);
    assert_eq!(fitting_chunk(4096, &c, true, 128 << 20), 2048);
    assert_eq!(fitting_chunk(4096, &c, false, 128 << 20), 1024);
    assert_eq!(fitting_chunk(300, &c, true, 128 << 20), 300);
    let device = |limits: wgpu::Limits| DeviceCaps {
        limits,
        subgroups: true,
        f16: true,
        device_type: wgpu::DeviceType::DiscreteGpu,
        coop: 0,
        metal: false,
        vendor: VENDOR_NVIDIA,
    };
    let opts = WgpuOptions::default();
    assert_eq!(opts.chunk, 4096);
    // wgpu's default binding (128 MiB) with f16 activations: 2,048, said in the line.
    let small = Plan::resolve(&opts, &c, true, &device(large_limits())).unwrap();
    assert_eq!((small.chunk, small.options.chunk), (2048, 2048));
    assert!(
        small.describe().contains("prefill chunk 4096 → 2048"),
        "{}",
        small.describe()
    );
    // Apple's 1 GiB, and a large GPU's own: as asked.
    for limits in [
        apple_limits(),
        wgpu::Limits {
            max_storage_buffer_binding_size: 4 << 30,
            max_buffer_size: 1 << 40,
            ..large_limits()
        },
    ] {
        let plan = Plan::resolve(&opts, &c, true, &device(limits)).unwrap();
        assert_eq!(plan.chunk, 4096);
        assert!(!plan.describe().contains("prefill chunk 4096 →"));
    }
}

/// `attn_v_early` compiles attend_gqa with `VEARLY` 1 only with `attn_flat` (the early values
/// take the flat value loop; without it the plan says so), changes no other kernel, and the
/// kernel translates to MSL and fits Apple's limits in every element type (its registers are
/// what it adds, not workgroup memory).
#[test]
fn attention_early_values_compile_only_with_flat_reads_and_fit_apple() {
    let c = full_config();
    for (limits, device_type, metal, vendor) in [
        (large_limits(), wgpu::DeviceType::DiscreteGpu, false, 0),
        (apple_limits(), wgpu::DeviceType::IntegratedGpu, true, APPLE),
    ] {
        for f16 in [false, true] {
            let device = DeviceCaps {
                limits: limits.clone(),
                subgroups: true,
                f16: true,
                device_type,
                coop: 0,
                metal,
                vendor,
            };
            let plan_of = |attn_v_early: bool, attn_flat: bool| {
                let opts = WgpuOptions {
                    attn_v_early,
                    attn_flat,
                    f16_kv: Choice::of(f16),
                    f16_acts: Choice::of(f16),
                    ..WgpuOptions::default()
                };
                Plan::resolve(&opts, &c, true, &device).unwrap()
            };
            let early = |p: &Plan| p.specs.attend_gqa.constants.contains(&("VEARLY", 1.0));
            let named = |p: &Plan| {
                p.describe()
                    .contains("a block's values requested after its key products")
            };
            let (off, on) = (plan_of(false, true), plan_of(true, true));
            assert!(early(&on) && named(&on));
            assert!(!early(&off) && !named(&off));
            // Off, the spec as before the switch: no VEARLY constant at all.
            assert!(!off
                .specs
                .attend_gqa
                .constants
                .iter()
                .any(|(n, _)| *n == "VEARLY"));
            // Every other kernel the same.
            let others = |p: &Plan| {
                p.specs
                    .all()
                    .into_iter()
                    .filter(|s| s.name != "attend_gqa")
                    .cloned()
                    .collect::<Vec<_>>()
            };
            assert_eq!(others(&on), others(&off));
            let msl = to_msl(&on.specs.attend_gqa).unwrap();
            assert!(msl.contains("kernel void attend_gqa"));
            let (module, info) = on.specs.attend_gqa.resolved().unwrap();
            let needs = lily_wgpu::shaders::needs_of(&module, &info, "attend_gqa").unwrap();
            assert!(
                needs.exceeds(&apple_limits()).is_none(),
                "attend_gqa with VEARLY over Apple's limits: {needs:?}"
            );
            // Without flat reads: not compiled, and the line says why.
            let plain = plan_of(true, false);
            assert!(!early(&plain) && !named(&plain));
            assert!(plain.describe().contains("attn_v_early without attn_flat"));
        }
    }
}
