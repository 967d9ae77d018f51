//! The wgpu backend against the CPU reference backend on synthetic checkpoints (random weights,
//! random token ids): teacher-forced logits, greedy decoding, chunked prefill, snapshots.
//! They run on any wgpu adapter, including Mesa's lavapipe (CPU Vulkan) which CI installs
//! (scripts/test.sh). Without any adapter they are skipped with a message, except under CI=true,
//! where a missing adapter fails them.
//!
//! With its defaults on a non-Apple adapter (lavapipe) the wgpu backend keeps fp32 activations and
//! KV cache and differs from the CPU in summation order only, so logits must agree within 1e-3
//! relative (L2 over all positions; an f32 cache: 2e-5, `kv_cache_in_f16_and_f32_match_cpu`).
//! tests/apple_limits.rs runs these tests in the configuration a Mac gets (the plan's `auto`
//! resolved as on Apple's: f16 activations and KV cache, lavapipe has SHADER_F16), each test's
//! tolerance taken from the plan (`support::Bounds`: logits 5e-2, a kernel `F16_STORE`); the
//! tests of one precision option set the others explicitly.

use std::sync::Arc;

use lily_core::backend::{Backend, Flow};
use lily_core::cpu::CpuBackend;
use lily_core::sampling::{Sampler, SamplingParams};
use lily_core::synth::{Preset, SynthFormat};
use lily_core::weights::ModelWeights;
use lily_wgpu::plan::MmTile;
use lily_wgpu::probes::F16_STORE;
use lily_wgpu::{Choice, WgpuBackend, WgpuOptions};

// A path from this file's directory: tests/apple_limits.rs includes this file as a module.
#[path = "support/mod.rs"]
mod support;
use support::{rel_l2, synth_model, synth_model_layers, wgpu_backend_with, Bounds, Rng};

/// `n` greedy tokens decoded from sequence `s` of `b`.
fn greedy_tokens(b: &mut dyn Backend, s: lily_core::backend::SeqId, n: usize) -> Vec<u32> {
    let mut sampler = Sampler::new(SamplingParams::greedy());
    let mut out = Vec::new();
    b.decode(s, &mut sampler, n, 0, &mut |step| {
        out.push(step.token);
        Flow::Continue
    })
    .unwrap();
    out
}

/// `n` greedy tokens of `gpu` (its sequence `gs`) against the CPU at the same point (its sequence
/// `cs`, which moves on as `gs` does): in fp32 (`Bounds::near_tie` `None`) the CPU's own greedy
/// tokens; with f16 activations, the CPU fed the GPU's tokens one by one, each of which must be
/// the CPU's largest logit there or within a near tie of it (`near_tie` × the row's RMS), since
/// f16's rounding may flip a near-tied pick of a random-weight model and the sequences part
/// after it. Returns the GPU's tokens.
fn assert_greedy_as_cpu(
    cpu: &mut CpuBackend,
    cs: lily_core::backend::SeqId,
    gpu: &mut WgpuBackend,
    gs: lily_core::backend::SeqId,
    n: usize,
    what: &str,
) -> Vec<u32> {
    let bounds = Bounds::of(gpu.plan());
    let got = greedy_tokens(gpu, gs, n);
    let Some(tie) = bounds.near_tie else {
        assert_eq!(got, greedy_tokens(cpu, cs, n), "{what}: greedy tokens");
        return got;
    };
    let mut flips = 0;
    for (i, &t) in got.iter().enumerate() {
        let row = cpu.logits(cs).unwrap();
        let best = lily_core::sampling::argmax(&row);
        let rms = (row.iter().map(|v| v * v).sum::<f32>() / row.len() as f32).sqrt();
        let gap = row[best as usize] - row[t as usize];
        assert!(
            gap <= tie * rms,
            "{what}: step {i}: the GPU picked {t}, {gap} under the CPU's best {best} (near tie: {})",
            tie * rms
        );
        flips += (gap > 0.0) as usize;
        cpu.prefill(cs, &[t]).unwrap();
    }
    println!("{what}: {n} greedy picks the CPU's or near-tied ({flips} near ties taken)");
    got
}

/// Positions whose largest logit is at the same id in `got` and `want` (rows of `vocab`).
fn top1_agreement(got: &[f32], want: &[f32], vocab: usize) -> usize {
    got.chunks(vocab)
        .zip(want.chunks(vocab))
        .filter(|(g, w)| lily_core::sampling::argmax(g) == lily_core::sampling::argmax(w))
        .count()
}

/// The wgpu backend, or `None` (test skipped) where no adapter exists outside CI.
fn wgpu_backend(w: &ModelWeights, chunk: usize) -> Option<WgpuBackend> {
    wgpu_backend_with(
        w,
        WgpuOptions {
            chunk,
            all_logits_chunk: chunk.min(32),
            ..WgpuOptions::default()
        },
    )
}

/// The last logits after `tokens` prefilled one at a time into a new sequence.
fn logits_token_by_token(gpu: &mut WgpuBackend, tokens: &[u32]) -> Vec<f32> {
    let b = gpu.new_seq(16).unwrap();
    for t in tokens {
        gpu.prefill(b, &[*t]).unwrap();
    }
    gpu.logits(b).unwrap()
}

/// `got` bit for bit `plain` (the same case without a switch); `what` starts the message.
fn assert_same_bits(got: &[f32], plain: &[f32], what: &str) {
    assert!(
        got.iter()
            .zip(plain)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "{what}: {:.3e} from the case without",
        rel_l2(got, plain)
    );
}

/// Teacher-forced logits over `positions` random tokens: wgpu (prefill chunks of `chunk`) vs CPU.
fn logits_match_cpu(w: Arc<ModelWeights>, positions: usize, chunk: usize) {
    let vocab = w.config.vocab;
    let tokens = Rng(99).tokens(positions, vocab);
    let mut cpu = CpuBackend::new(w.clone()).with_prefill_chunk(16);
    let cs = cpu.new_seq(positions + 4).unwrap();
    let want = cpu.prefill_all_logits(cs, &tokens).unwrap();
    let Some(mut gpu) = wgpu_backend(&w, chunk) else {
        return;
    };
    let gs = gpu.new_seq(positions + 4).unwrap();
    let got = gpu.prefill_all_logits(gs, &tokens).unwrap();
    let e = rel_l2(&got, &want);
    let same = top1_agreement(&got, &want, vocab);
    println!(
        "logits rel_l2 {e:.3e} over {positions} positions, top-1 agreement {same}/{positions}"
    );
    let bound = Bounds::of(gpu.plan()).logits;
    assert!(
        e < bound,
        "logits differ from the CPU by {e:.3e} (relative L2; bound {bound:e})"
    );
    assert_eq!(gpu.seq_len(gs).unwrap(), positions);
    // The pending logits are the last position's.
    let last = gpu.logits(gs).unwrap();
    assert_eq!(last, got[(positions - 1) * vocab..]);
}

#[test]
fn logits_match_cpu_on_tiny_mlx() {
    // 160 positions: attention crosses two 64-key blocks (attend.wgsl), chunks of 24 end mid-block.
    logits_match_cpu(synth_model(Preset::Tiny, SynthFormat::Mlx, 11), 160, 24);
}

#[test]
fn logits_match_cpu_on_tiny_hf_bf16_weights() {
    logits_match_cpu(synth_model(Preset::Tiny, SynthFormat::Hf, 12), 40, 16);
}

#[test]
fn logits_match_cpu_on_small_mlx() {
    logits_match_cpu(synth_model(Preset::Small, SynthFormat::Mlx, 13), 24, 8);
}

/// Both prefill attentions, teacher-forced logits against the CPU over 100 positions in chunks
/// of 40 (tiles partly filled, chunks after a cache, keys past one block): attend_tile.wgsl (the
/// default, `WgpuOptions::attn_tile`: tiles of 64 / G tokens; tiny has G = 2, so 32 tokens a
/// tile) and attend_gqa.wgsl (the fallback).
#[test]
fn logits_match_cpu_with_either_prefill_attention() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 53);
    let positions = 100;
    let tokens = Rng(5).tokens(positions, w.config.vocab);
    let mut cpu = CpuBackend::new(w.clone()).with_prefill_chunk(16);
    let cs = cpu.new_seq(positions + 4).unwrap();
    let want = cpu.prefill_all_logits(cs, &tokens).unwrap();
    for tile in [true, false] {
        let Some(mut gpu) = wgpu_backend_with(
            &w,
            WgpuOptions {
                chunk: 40,
                all_logits_chunk: 40,
                attn_tile: tile,
                ..WgpuOptions::default()
            },
        ) else {
            return;
        };
        assert_eq!(gpu.attn_tile(), tile, "attend_tile in use");
        let gs = gpu.new_seq(positions + 4).unwrap();
        let got = gpu.prefill_all_logits(gs, &tokens).unwrap();
        let e = rel_l2(&got, &want);
        println!("logits rel_l2 {e:.3e} over {positions} positions (attend_tile {tile})");
        println!("plan: {}", gpu.plan().describe());
        assert!(
            e < Bounds::of(gpu.plan()).logits,
            "logits differ from the CPU by {e:.3e} (attend_tile {tile})"
        );
    }
}

/// The workgroup reductions (norms, attention's softmax and merge, the greedy pick) in both
/// forms: on subgroups (the default where the adapter has them; lavapipe: 8 lanes) and through
/// workgroup memory (`WgpuOptions::subgroups` false): teacher-forced logits against the CPU over
/// 70 positions in chunks of 24, then 8 greedy tokens (decode's folded norms, split attention
/// merged, argmax on the GPU) equal to the CPU's.
#[test]
fn reductions_on_subgroups_and_in_workgroup_memory_match_cpu() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 61);
    let positions = 70;
    let tokens = Rng(17).tokens(positions, w.config.vocab);
    let mut cpu = CpuBackend::new(w.clone()).with_prefill_chunk(16);
    let cs = cpu.new_seq(positions + 12).unwrap();
    let want = cpu.prefill_all_logits(cs, &tokens).unwrap();
    let mut forms = Vec::new();
    for subgroups in [true, false] {
        let Some(mut gpu) = wgpu_backend_with(
            &w,
            WgpuOptions {
                chunk: 24,
                all_logits_chunk: 24,
                subgroups,
                ..WgpuOptions::default()
            },
        ) else {
            return;
        };
        let on = gpu.plan().subgroups;
        let b = Bounds::of(gpu.plan());
        assert!(subgroups || !on, "subgroups turned off but in use");
        forms.push(on);
        let gs = gpu.new_seq(positions + 12).unwrap();
        let got = gpu.prefill_all_logits(gs, &tokens).unwrap();
        let e = rel_l2(&got, &want);
        println!("reductions on subgroups {on}: logits rel_l2 {e:.3e} over {positions} positions");
        assert!(
            e < b.logits,
            "subgroups {on}: logits differ from the CPU by {e:.3e}"
        );
        let cs2 = cpu.new_seq(positions + 12).unwrap();
        cpu.prefill(cs2, &tokens).unwrap();
        assert_greedy_as_cpu(&mut cpu, cs2, &mut gpu, gs, 8, &format!("subgroups {on}"));
        cpu.free_seq(cs2);
        let (att, _) = gpu.check_attention().unwrap();
        assert!(
            att < b.kernel,
            "subgroups {on}: attention differs from the host by {att:.2e}"
        );
        // The row kernels' totals and the GLU's own routing (its workgroup argmax) in this form.
        let (mm, rows) = gpu.check_products().unwrap();
        assert!(
            mm < b.kernel && rows < b.kernel,
            "subgroups {on}: products differ from the host by {mm:.2e} / {rows:.2e}"
        );
    }
    // CI's lavapipe has subgroups: both forms ran there.
    if std::env::var("CI").is_ok_and(|v| v == "true" || v == "1") {
        assert_eq!(forms, [true, false], "both reduction forms in CI");
    }
}

/// The KV cache in f16 (`WgpuOptions::f16_kv` on, where the adapter has SHADER_F16; lavapipe
/// has it) and in f32 (off, the fallback), the activations in f32: teacher-forced logits against the CPU's fp32
/// over 90 positions in chunks of 32 (f32: the summation-order bound 2e-5; f16: within 1e-3, as
/// every model test), then 8 greedy tokens equal to the CPU's.
#[test]
fn kv_cache_in_f16_and_f32_match_cpu() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 67);
    let positions = 90;
    let tokens = Rng(23).tokens(positions, w.config.vocab);
    let mut cpu = CpuBackend::new(w.clone()).with_prefill_chunk(16);
    let cs = cpu.new_seq(positions + 12).unwrap();
    let want = cpu.prefill_all_logits(cs, &tokens).unwrap();
    let want_tokens = greedy_tokens(&mut cpu, cs, 8);
    let mut forms = Vec::new();
    for f16_kv in [Choice::On, Choice::Off] {
        let Some(mut gpu) = wgpu_backend_with(
            &w,
            WgpuOptions {
                chunk: 32,
                all_logits_chunk: 32,
                f16_kv,
                // The cache alone in f16 (tests/apple_limits.rs would take Apple's f16
                // activations too).
                f16_acts: Choice::Off,
                ..WgpuOptions::default()
            },
        ) else {
            return;
        };
        let on = gpu.plan().kv_f16;
        assert!(f16_kv == Choice::On || !on, "f16 KV turned off but in use");
        forms.push(on);
        let gs = gpu.new_seq(positions + 12).unwrap();
        let got = gpu.prefill_all_logits(gs, &tokens).unwrap();
        let e = rel_l2(&got, &want);
        let bound = if on { 1e-3 } else { 2e-5 };
        println!("KV cache in f16 {on}: logits rel_l2 {e:.3e} over {positions} positions");
        assert!(
            e < bound,
            "f16 KV {on}: logits differ from the CPU by {e:.3e}"
        );
        assert_eq!(
            greedy_tokens(&mut gpu, gs, 8),
            want_tokens,
            "f16 KV {on}: greedy tokens"
        );
        let (att, _) = gpu.check_attention().unwrap();
        assert!(
            att < 1e-5,
            "f16 KV {on}: attention differs from the host by {att:.2e}"
        );
    }
    if std::env::var("CI").is_ok_and(|v| v == "true" || v == "1") {
        assert_eq!(forms, [true, false], "both KV cache forms in CI");
    }
}

/// The prompt the tile tests feed: `w`'s 808 positions as 512 + 256 + 40 tokens (so each routed
/// expert's tiles take a size by its load), with the CPU's fp32 logits of them and its 8 greedy
/// tokens after them.
struct TileCase {
    tokens: Vec<u32>,
    want: Vec<f32>,
    want_tokens: Vec<u32>,
}

impl TileCase {
    const PIECES: [usize; 3] = [512, 256, 40];

    fn new(w: &Arc<ModelWeights>) -> TileCase {
        let positions: usize = Self::PIECES.iter().sum();
        let tokens = Rng(37).tokens(positions, w.config.vocab);
        let mut cpu = CpuBackend::new(w.clone()).with_prefill_chunk(64);
        let cs = cpu.new_seq(positions + 12).unwrap();
        let want = cpu.prefill_all_logits(cs, &tokens).unwrap();
        let want_tokens = greedy_tokens(&mut cpu, cs, 8);
        TileCase {
            tokens,
            want,
            want_tokens,
        }
    }

    /// `b`'s logits of the prompt fed in `PIECES`, and its sequence (room for 12 more tokens).
    fn prefill(&self, b: &mut WgpuBackend) -> (lily_core::backend::SeqId, Vec<f32>) {
        let s = b.new_seq(self.tokens.len() + 12).unwrap();
        let mut got = Vec::new();
        let mut at = 0;
        for n in Self::PIECES {
            got.extend(b.prefill_all_logits(s, &self.tokens[at..at + n]).unwrap());
            at += n;
        }
        (s, got)
    }
}

/// Prefill's product tiles in f16 (`f16_tiles`, where the adapter has SHADER_F16; lavapipe has
/// it), in f32 (the fallback, the default) and in f32 with dense tiles of 64 (`dense_tile`, the
/// A/B's third form): teacher-forced logits against the CPU's fp32 over
/// 808 positions prefilled as 512 + 256 + 40 tokens, so that with f16 tiles the dense products
/// run on tiles of 64 and each routed expert's tiles take a size by its load (`tiny`: 4 of 16
/// experts a token, so 128 / 64 / 10 items an expert on average: tiles of 64 for experts with
/// ≥ 128 items, 32 for ≥ 64, else 16, in one chunk); then 8 greedy
/// tokens equal to the CPU's, and the product kernels against the host's f64 (f16: the inputs'
/// rounding, ≈ 2^-11 relative each, visible and bounded; f32: summation order only).
#[test]
fn prefill_tiles_in_f16_and_f32_match_cpu() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 71);
    let case = TileCase::new(&w);
    let (tokens, want, want_tokens) = (&case.tokens, &case.want, case.want_tokens.clone());
    let positions = tokens.len();
    let mut forms = Vec::new();
    for (f16_tiles, dense_tile) in [(true, 0), (false, 0), (false, 64)] {
        let Some(mut gpu) = wgpu_backend_with(
            &w,
            WgpuOptions {
                chunk: 512,
                all_logits_chunk: 512,
                f16_tiles,
                dense_tile,
                // The tiles alone in f16 (tests/apple_limits.rs would take Apple's f16
                // activations and KV cache too).
                f16_acts: Choice::Off,
                f16_kv: Choice::Off,
                ..WgpuOptions::default()
            },
        ) else {
            return;
        };
        let plan = gpu.plan();
        let plan_dense = plan.dense_mm.items();
        let on = plan.tile_f16;
        assert!(f16_tiles || !on, "f16 tiles turned off but in use");
        forms.push(on);
        if on {
            assert_eq!(
                plan.dense_mm,
                MmTile::T64,
                "f16 dense tiles of 64 fit lavapipe"
            );
            assert_eq!(plan.expert_tiles(), [MmTile::T64, MmTile::T32, MmTile::T16]);
        } else {
            let dense = if dense_tile == 64 {
                MmTile::T64
            } else {
                MmTile::T32
            };
            assert_eq!(
                (plan.dense_mm, plan.expert_tiles()),
                (dense, vec![MmTile::T16])
            );
        }
        let (mm, rows) = gpu.check_products().unwrap();
        println!("f16 tiles {on}: linear_q4_mm vs the host {mm:.2e}");
        assert!(
            mm < 1e-5,
            "f16 tiles {on}: linear_q4_mm differs from the host by {mm:.2e}"
        );
        assert!(
            rows < 1e-5,
            "linear_q4_rows differs from the host by {rows:.2e}"
        );
        if on {
            // Against the exact operands: each product's two inputs rounded to f16 (relative
            // error ≤ 2^-11 each, ≈ 2^-11 · √(2/3) ≈ 4e-4 in L2 for independent roundings):
            // visible, and bounded.
            let (exact, staged) = gpu.check_products_f16().unwrap();
            println!("f16 tiles: linear_q4_mm vs the exact product {exact:.2e}, vs the f16-staged one {staged:.2e}");
            assert!(
                (1e-5..2e-3).contains(&exact),
                "f16 tiles: linear_q4_mm differs from the exact product by {exact:.2e}"
            );
        }
        let (gs, got) = case.prefill(&mut gpu);
        let e = rel_l2(&got, want);
        // f16: every product's inputs rounded (3.1e-4 a product, above), amplified through 8
        // layers of random weights and routing near-ties (lavapipe: 9.4e-3, top-1 802 of 808);
        // f32: summation order only (6.1e-6).
        let bound = if on { 3e-2 } else { 2e-5 };
        let vocab = w.config.vocab;
        let same = top1_agreement(&got, want, vocab);
        println!("f16 tiles {on}, dense tiles of {}: logits rel_l2 {e:.3e} over {positions} positions, top-1 agreement {same}/{positions}", plan_dense);
        assert!(
            e < bound,
            "f16 tiles {on}: logits differ from the CPU by {e:.3e}"
        );
        assert!(
            same * 100 >= positions * 98,
            "f16 tiles {on}: top-1 agreement {same}/{positions}"
        );
        assert_eq!(
            greedy_tokens(&mut gpu, gs, 8),
            want_tokens,
            "f16 tiles {on}: greedy tokens"
        );
        if on {
            // The same prompt in chunks of 32 (no expert gets 64 items, so tiles of 16
            // throughout): each item's
            // product is summed in the same order whatever its tile, so the two differ only by
            // the chunking's f32 order in attention and the scan (and the f16 roundings that
            // flips; lavapipe: 0, bit-identical); tiles of 64 or 32 that lost or mixed items
            // would differ by far more.
            let Some(mut small) = wgpu_backend_with(
                &w,
                WgpuOptions {
                    chunk: 32,
                    all_logits_chunk: 32,
                    f16_tiles: true,
                    f16_acts: Choice::Off,
                    f16_kv: Choice::Off,
                    ..WgpuOptions::default()
                },
            ) else {
                return;
            };
            let ss = small.new_seq(positions + 12).unwrap();
            let by32 = small.prefill_all_logits(ss, tokens).unwrap();
            let d = rel_l2(&got, &by32);
            println!("f16 tiles: chunks of 512 / 256 / 40 against chunks of 32: rel_l2 {d:.3e}");
            assert!(
                d < 1e-4,
                "f16 tiles: tiles by load differ from tiles of 16 by {d:.3e}"
            );
        }
    }
    if std::env::var("CI").is_ok_and(|v| v == "true" || v == "1") {
        assert_eq!(forms, [true, false, false], "both tile forms in CI");
    }
}

/// Prefill's tile products on cooperative matrices (`coop`: linear_q4_coop.wgsl, 16 × 16 on
/// NVIDIA Vulkan, 8 × 8 on Metal) where the adapter has them (skipped with a message where it
/// does not: lavapipe, CI): the kernel at every tile size, 4- and 8-bit, against the host's f64
/// product of its f16-staged operands (only the f32 sums' order differs) and of the exact ones
/// (the f16 rounding: as the f16 tiles', < 2e-3), then `tiny`'s teacher-forced logits over 808
/// positions as 512 + 256 + 40 tokens (every tile size by the experts' loads) against the CPU's
/// fp32 within the f16 tiles' bound (3e-2, top-1 ≥ 98 %), and against linear_q4_mm's f16 tiles
/// on the same adapter (the same operands), and 8 greedy tokens equal to the CPU's.
#[test]
fn coop_products_and_logits_match_cpu() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 71);
    let opts = |coop| WgpuOptions {
        chunk: 512,
        all_logits_chunk: 512,
        f16_tiles: true,
        coop,
        // The products alone in f16 (as the f16 tiles' test).
        f16_acts: Choice::Off,
        f16_kv: Choice::Off,
        ..WgpuOptions::default()
    };
    let Some(mut gpu) = wgpu_backend_with(&w, opts(true)) else {
        return;
    };
    let plan = gpu.plan();
    // `LILY_WGPU_COOP_BIG=1` (the environment's overrides apply): linear_q4_coop_big.wgsl.
    let big = plan.options.coop_big;
    // `coop_rows` 128 (the default; `LILY_WGPU_COOP_ROWS=64` for 64): the dense products'
    // workgroups of 128 rows where they fit the device (the routed experts' stay on 64).
    let rows = plan.mm_rows as u32;
    if let Some(map) = gpu.coop_map(false, big, rows).unwrap() {
        // The device has cooperative matrices: where the kernel is right and where not.
        println!("linear_q4_coop (big {big}, {rows} rows) on this device:\n{map}");
    }
    if let Some(refusal) = plan
        .notes
        .iter()
        .find(|n| n.contains("linear_q4_coop") && n.contains("refused at load"))
    {
        panic!("the adapter has cooperative matrices but {refusal}");
    }
    if plan.coop == 0 {
        println!(
            "SKIPPED: no cooperative matrices here (the adapter lacks wgpu's experimental feature, an f16 x f16 -> f32 configuration of 8 or 16, or subgroups of 32): {}",
            plan.describe()
        );
        return;
    }
    let size = plan.coop;
    assert!(plan.tile_f16 && plan.options.coop);
    assert_eq!(plan.dense_mm, MmTile::T64);
    assert_eq!(plan.expert_tiles(), [MmTile::T64, MmTile::T32, MmTile::T16]);
    let (exact, staged) = gpu.check_products_f16().unwrap();
    println!("linear_q4_coop ({size}×{size}): vs the f16-staged product {staged:.2e}, vs the exact one {exact:.2e}");
    assert!(
        staged < 1e-5,
        "linear_q4_coop vs the f16-staged product: {staged:.2e}"
    );
    assert!(
        exact < 2e-3,
        "linear_q4_coop vs the exact product: {exact:.2e}"
    );
    let case = TileCase::new(&w);
    let (tokens, want, want_tokens) = (&case.tokens, &case.want, case.want_tokens.clone());
    let positions = tokens.len();
    let (gs, got) = case.prefill(&mut gpu);
    let e = rel_l2(&got, want);
    let same = top1_agreement(&got, want, w.config.vocab);
    println!("coop: logits rel_l2 {e:.3e} from the CPU over {positions} positions, top-1 {same}/{positions}");
    assert!(e < 3e-2, "coop: logits differ from the CPU by {e:.3e}");
    assert!(
        same * 100 >= positions * 98,
        "coop: top-1 agreement {same}/{positions}"
    );
    assert_eq!(
        greedy_tokens(&mut gpu, gs, 8),
        want_tokens,
        "coop: greedy tokens"
    );
    let Some(mut tiles) = wgpu_backend_with(&w, opts(false)) else {
        return;
    };
    let (_, f16_tiles) = case.prefill(&mut tiles);
    let d = rel_l2(&got, &f16_tiles);
    println!("coop against linear_q4_mm's f16 tiles: rel_l2 {d:.3e}");
    assert!(d < 3e-2, "coop differs from the f16 tiles by {d:.3e}");
}

/// linear_q4_coop.wgsl's and linear_q4_coop_big.wgsl's own staging, indexing and stores, with
/// their cooperative operations emulated in plain WGSL (`Spec::coop_emulated`; lavapipe has no
/// cooperative matrices): on Apple's 8 × 8 and NVIDIA's 16 × 16 (activations in f32; in f16,
/// both forms, at 16 × 16, and linear_q4_coop_big at 8 × 8 too), each map of `coop_map` right
/// everywhere (the one-quad shape: a step of 64 columns half past the matrix),
/// tiles of 16, 32 and 64 items (partly filled), 4- and 8-bit, against the host's f64 product of
/// the operands rounded to f16 as the kernel stages them: only the f32 sums' order differs
/// (lavapipe: 4.1e-7, as linear_q4_mm's f16 tiles; 2.1e-4 with an f16 output's rounding).
#[test]
fn coop_kernel_emulated_matches_the_host() {
    for f16_acts in [false, true] {
        let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 5);
        let Some(gpu) = wgpu_backend_with(
            &w,
            WgpuOptions {
                f16_acts: Choice::of(f16_acts),
                // The device with SHADER_F16 (the kernel stages in f16).
                f16_tiles: true,
                ..WgpuOptions::default()
            },
        ) else {
            return;
        };
        if !gpu.plan().tile_f16 {
            println!("SKIPPED: no SHADER_F16 here");
            continue;
        }
        // linear_q4_coop_big on 128 rows (`coop_rows`) only where the device allows its
        // 45,328 bytes of workgroup memory (not under Apple's limits).
        let wide = gpu.device_limits().max_compute_workgroup_storage_size >= 45_328;
        for (big, rows) in [(false, 64), (true, 64), (true, 128)]
            .into_iter()
            .filter(|&(_, rows)| !f16_acts && (rows == 64 || wide))
        {
            // The map a device call prints, on the emulated kernel: right everywhere.
            let map = gpu.coop_map(true, big, rows).unwrap().unwrap();
            println!("{map}");
            let blocks = map
                .lines()
                .filter_map(|l| l.split_once(';'))
                .map(|(_, b)| b);
            assert!(
                blocks.clone().count() == 3 && blocks.clone().all(|b| b.contains('.')),
                "the emulated kernel's map (big {big}):\n{map}"
            );
            assert!(
                blocks.clone().all(|b| !b.contains('x') && !b.contains('0')),
                "the emulated kernel's map (big {big}):\n{map}"
            );
        }
        // An f16 output's own rounding (≤ 2^-11) comes on top with f16 activations.
        let bound = 1e-5 + if f16_acts { F16_STORE } else { 0.0 };
        // linear_q4_coop_big (`coop_big`) at both sizes with either activations, on
        // workgroups of 64 rows and of 128 (`coop_rows`; its tiles where they fit the device).
        for (size, big, rows) in [
            (8, false, 64),
            (16, false, 64),
            (8, true, 64),
            (16, true, 64),
            (8, true, 128),
            (16, true, 128),
        ] {
            if f16_acts && (size, big) == (8, false) {
                continue;
            }
            {
                let (tiles, e) = gpu.check_coop_emulated(size, big, rows).unwrap();
                println!("linear_q4_coop (big {big}, {rows} rows) emulated, {size}×{size}, f16 activations {f16_acts}, tiles {tiles:?}: {e:.2e} from the f16-staged product");
                // Every tile on 64 rows; on 128, 64 items where the device allows 45,328 bytes,
                // 16 and 32 (≤ 32,016 bytes) under Apple's 32 KiB and lavapipe's too.
                let want: &[MmTile] = if rows == 64 || wide {
                    &[MmTile::T16, MmTile::T32, MmTile::T64]
                } else {
                    &[MmTile::T16, MmTile::T32]
                };
                assert_eq!(tiles, want, "{rows} rows, {size}×{size}");
                assert!(
                    e < bound,
                    "linear_q4_coop (big {big}, {rows} rows) emulated ({size}×{size}, f16 activations {f16_acts}): {e:.2e}"
                );
            }
        }
    }
}

/// The activations between kernels in f16 (`f16_acts`, where the adapter has SHADER_F16;
/// lavapipe has it) and in f32 (the fallback), the f16 activations alone and with
/// the f16 KV cache: teacher-forced logits against the CPU's fp32 on `tiny` (MLX: 90 positions
/// in chunks of 32; HF bf16 weights, the general product kernel: 40 in chunks of 16), then 8
/// greedy tokens (decode's kernels: the row products in their forms that read the residual
/// stream) equal to the CPU's; the product kernels in every form compiled and the attention
/// kernels against the host's f64 (inputs rounded to f16 as the kernels read them, so only the
/// output's own f16 store remains: ≤ 2^-11 relative, `F16_STORE`).
#[test]
fn activations_in_f16_and_f32_match_cpu() {
    let mut forms = Vec::new();
    let cases = [
        (SynthFormat::Mlx, 90usize, 32usize),
        (SynthFormat::Hf, 40, 16),
    ];
    for (format, positions, chunk) in cases {
        let w = synth_model(Preset::Tiny, format, 73);
        let tokens = Rng(41).tokens(positions, w.config.vocab);
        let mut cpu = CpuBackend::new(w.clone()).with_prefill_chunk(16);
        let cs = cpu.new_seq(positions + 12).unwrap();
        let want = cpu.prefill_all_logits(cs, &tokens).unwrap();
        let want_tokens = greedy_tokens(&mut cpu, cs, 8);
        for (f16_acts, f16_kv) in [(true, false), (true, true), (false, false)] {
            let Some(mut gpu) = wgpu_backend_with(
                &w,
                WgpuOptions {
                    chunk,
                    all_logits_chunk: chunk,
                    f16_acts: Choice::of(f16_acts),
                    f16_kv: Choice::of(f16_kv),
                    ..WgpuOptions::default()
                },
            ) else {
                return;
            };
            let (on, kv) = (gpu.plan().act_f16, gpu.plan().kv_f16);
            assert!(f16_acts || !on, "f16 activations turned off but in use");
            forms.push(on);
            let what = format!("{format:?} f16 activations {on}, f16 KV {kv}");
            let (mm, rows) = gpu.check_products().unwrap();
            let (att, _) = gpu.check_attention().unwrap();
            println!("{what}: linear_q4_mm vs the host {mm:.2e}, row kernels {rows:.2e}, attention {att:.2e}");
            // f16: each output stored in f16 (≤ 2^-11 relative; ≈ 2^-11 / √3 in L2 for
            // uniform rounding), the inputs' rounding taken out of the host's reference; f32:
            // summation order only.
            let kernel_bound = if on { F16_STORE } else { 1e-5 };
            for (kernel, e) in [
                ("linear_q4_mm", mm),
                ("a row kernel", rows),
                ("attention", att),
            ] {
                assert!(
                    e < kernel_bound,
                    "{what}: {kernel} differs from the host by {e:.2e}"
                );
            }
            let gs = gpu.new_seq(positions + 12).unwrap();
            let got = gpu.prefill_all_logits(gs, &tokens).unwrap();
            let e = rel_l2(&got, &want);
            let vocab = w.config.vocab;
            let same = top1_agreement(&got, &want, vocab);
            println!("{what}: logits rel_l2 {e:.3e} over {positions} positions, top-1 agreement {same}/{positions}");
            // f16: a value stored ≈ 6 times on a layer's longest path (DeltaNet's projection,
            // conv, q/k, recurrence, gated norm; 2^-11 / √3 each, ≈ 7e-4 a layer in quadrature),
            // 8 layers (≈ 2e-3 a position), amplified by random weights: most positions 2–5e-3
            // on lavapipe, with bursts over a few consecutive positions where a perturbed state
            // flips a near-tied routing (up to 4.7e-2 at one position of the HF model; in all
            // 4.5e-3 MLX, 1.5e-2 HF), the bound of the f16 tiles' test; f32: summation order
            // only (the f16 KV cache alone: 1e-3, `kv_cache_in_f16_and_f32_match_cpu`).
            let bound = if on {
                3e-2
            } else if kv {
                1e-3
            } else {
                2e-5
            };
            assert!(e < bound, "{what}: logits differ from the CPU by {e:.3e}");
            assert!(
                same * 100 >= positions * 97,
                "{what}: top-1 agreement {same}/{positions}"
            );
            assert_eq!(
                greedy_tokens(&mut gpu, gs, 8),
                want_tokens,
                "{what}: greedy tokens"
            );
        }
    }
    if std::env::var("CI").is_ok_and(|v| v == "true" || v == "1") {
        assert!(forms.contains(&true), "f16 activations in CI");
    }
}

/// The 4-bit product kernels on shapes the small presets do not reach, against the host's f64
/// product on random matrices: linear_q4_mm.wgsl with tiles of 16 and 32 items, 4- and 8-bit
/// (160 rows, 512 columns, 40 items: the last tile and row block partly filled) and
/// linear_q4_rows.wgsl (decode's kernel for 2,048 and 4,096 columns; 37 rows, 2 items).
#[test]
fn product_kernels_match_the_host() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 29);
    let Some(gpu) = wgpu_backend(&w, 16) else {
        return;
    };
    let (fp32, rows) = gpu.check_products().unwrap();
    let bound = Bounds::of(gpu.plan()).kernel;
    println!("4-bit products vs the host's: linear_q4_mm {fp32:.2e}, linear_q4_rows {rows:.2e}");
    assert!(
        fp32 < bound,
        "linear_q4_mm differs from the host by {fp32:.2e}"
    );
    assert!(
        rows < bound,
        "linear_q4_rows differs from the host by {rows:.2e}"
    );
}

/// The decode MoE's kernels with their reads issued early (`rows_early`, `glu_early`: the
/// defaults) and without, in both reduction forms, against the host's f64: linear_q4_rows (the
/// router's 8-bit 2,048 columns among its shapes, the norm folded in and not),
/// linear_q4_glu_rows (plain, and routing its own items: experts equal to the host's with planted
/// ties, weights, products) and moe_down_rows (the full model's 9 items of 512 columns, 9 of
/// 256, 5 of 64).
#[test]
fn moe_kernels_with_and_without_early_reads_match_the_host() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 37);
    for (subgroups, early) in [(true, true), (true, false), (false, true), (false, false)] {
        let opts = WgpuOptions {
            chunk: 16,
            all_logits_chunk: 16,
            subgroups,
            rows_early: early,
            glu_early: early,
            ..WgpuOptions::default()
        };
        let Some(gpu) = wgpu_backend_with(&w, opts) else {
            return;
        };
        let o = &gpu.plan().options;
        assert_eq!((o.rows_early, o.glu_early), (early, early));
        let (_, rows) = gpu.check_products().unwrap();
        let down = gpu.check_down_rows().unwrap();
        let bound = Bounds::of(gpu.plan()).kernel;
        println!(
            "subgroups {subgroups}, early reads {early}: linear_q4_rows / glu_rows {rows:.2e}, moe_down_rows {:.2e} (rounds bit for bit: {})",
            down.err, down.same_bits
        );
        assert!(
            rows < bound,
            "linear_q4_rows or linear_q4_glu_rows (early {early}) differs from the host by {rows:.2e}"
        );
        assert!(
            down.err < bound,
            "moe_down_rows differs from the host by {:.2e}",
            down.err
        );
        // `moe_rounds`' form: the same sums in the same order.
        assert!(
            down.same_bits,
            "moe_down_rows in rounds is not bit for bit the kernel one item at a time"
        );
    }
}

/// linear_q4_rows.wgsl's persistent 16-row kernel (`rows_persist`), in both reduction forms:
/// on 1, 2, 5 and 12 workgroups over 12 row blocks (4-bit 2,048 / 4,096 columns, 8-bit 2,048,
/// the norm folded and not, early reads on and off) against the host's f64 and **bit for bit**
/// the kernel with one workgroup a block; then the plan with the switch on: its 16-row kernel is
/// the persistent one (every product probe through it, the DeltaNet conv and the residual add
/// among them, on one workgroup a block) and the plan line says so. (Tiny's products are too
/// narrow for linear_q4_rows: `full_width_decode_matches_cpu` runs the switch on the model.)
#[test]
fn persistent_row_kernel_matches_the_host_and_the_plain_kernel() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 53);
    for subgroups in [true, false] {
        let opts = WgpuOptions {
            chunk: 16,
            all_logits_chunk: 16,
            subgroups,
            rows_persist: true,
            ..WgpuOptions::default()
        };
        let Some(gpu) = wgpu_backend_with(&w, opts) else {
            return;
        };
        assert!(gpu.plan().options.rows_persist);
        // A software adapter's workgroups (`split_workgroups`: 64).
        assert_eq!(gpu.plan().rows_workers, Some(64));
        assert!(
            gpu.plan().describe().contains("persistent on ≤"),
            "{}",
            gpu.plan().describe()
        );
        let bound = Bounds::of(gpu.plan()).kernel;
        let pc = gpu.check_rows_persist().unwrap();
        let (_, rows) = gpu.check_products().unwrap();
        println!(
            "subgroups {subgroups}: persistent linear_q4_rows {:.2e} (same bits as one workgroup a block: {}), product probes {rows:.2e}",
            pc.err, pc.same_bits
        );
        assert!(
            pc.err < bound,
            "persistent linear_q4_rows differs from the host by {:.2e}",
            pc.err
        );
        assert!(
            pc.same_bits,
            "persistent linear_q4_rows is not bit for bit the kernel with one workgroup a block"
        );
        assert!(
            rows < bound,
            "linear_q4_rows (persistent plan) differs from the host by {rows:.2e}"
        );
    }
}

/// `rows_one_word`: linear_q4_rows' 16-row kernel compiled for one-word rows (`WORDS` 1), in
/// both reduction forms and with f16 activations: the plan's rows a workgroup (the full model's
/// one-word products of ≥ 8,192 rows on it, a two-word one on the 8-row kernel instead, the
/// others as without), the plan line; the kernel persistent on 1, 2, 5 and 12 workers and in one
/// pass against the host's f64 and **bit for bit** today's kernel (`check_rows_one_word`); every
/// product probe through the plan's kernels (the DeltaNet conv and the residual add on the
/// 16-row kernel among them; its two-word shapes go to the kernels the plan gives them).
#[test]
fn one_word_row_kernel_matches_the_host_and_todays() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 71);
    for (subgroups, f16) in [(true, false), (false, false), (true, true)] {
        let opts = WgpuOptions {
            chunk: 16,
            all_logits_chunk: 16,
            subgroups,
            rows_one_word: true,
            // The router on the 2-row kernel, as without `router_lean` (its own test's case).
            router_lean: false,
            f16_acts: Choice::of(f16),
            ..WgpuOptions::default()
        };
        let Some(gpu) = wgpu_backend_with(&w, opts) else {
            return;
        };
        let plan = gpu.plan();
        assert!(plan.options.rows_one_word);
        // lm_head, in_proj, q/k/v (one word); a two-word matrix of ≥ 8,192 rows; out_proj, the
        // router (two words, 2 rows as without the switch).
        assert_eq!(
            (
                plan.rows_rb(248_320, 1),
                plan.rows_rb(12_352, 1),
                plan.rows_rb(9_216, 1),
                plan.rows_rb(8_192, 2),
                plan.rows_rb(2_048, 2),
                plan.rows_rb(257, 2)
            ),
            (16, 16, 16, 8, 2, 2)
        );
        let d = plan.describe();
        assert!(
            d.contains("linear_q4_rows one-word 16-row kernel on")
                && d.contains("its 16-row kernel compiled for one-word rows"),
            "{d}"
        );
        let bound = Bounds::of(plan).kernel;
        let one = gpu.check_rows_one_word().unwrap();
        let (_, rows) = gpu.check_products().unwrap();
        println!(
            "subgroups {subgroups}, f16 activations {}: one-word linear_q4_rows {:.2e} (same bits as today's: {}), product probes {rows:.2e}",
            plan.act_f16, one.err, one.same_bits
        );
        assert!(
            one.err < bound,
            "one-word linear_q4_rows differs from the host by {:.2e}",
            one.err
        );
        assert!(
            one.same_bits,
            "one-word linear_q4_rows is not bit for bit today's kernel"
        );
        assert!(
            rows < bound,
            "linear_q4_rows (one-word plan) differs from the host by {rows:.2e}"
        );
    }
    // Without the switch (on by default) nothing moves.
    let Some(gpu) = wgpu_backend_with(
        &w,
        WgpuOptions {
            chunk: 16,
            all_logits_chunk: 16,
            rows_one_word: false,
            ..WgpuOptions::default()
        },
    ) else {
        return;
    };
    assert_eq!(gpu.plan().rows_rb(8_192, 2), 16);
    assert!(!gpu.plan().describe().contains("one-word rows"));
}

/// `down_item_lanes`: moe_down_lanes.wgsl (one item a lane, the residual read at the start) in
/// both reduction forms, with f32 and f16 activations, 2 rows a workgroup (the plan's) and 8:
/// against the host's f64 on `check_down_rows`' cases (9 items of 512 columns — the full model's,
/// 160 lanes —, 9 of 256, 5 of 64; 37 rows, the last block partly filled, 2 tokens) and against
/// moe_down_rows in rounds within the kernel bound (1e-5 with f32 activations, an f16 store with
/// f16): the same additions in the same order, bit for bit on lavapipe, but a driver may contract
/// or reorder them (NVIDIA's Vulkan driver did, session 31: 2.3e-7 from the host, not the same
/// bits), so whether bit for bit is printed, not asserted; the workgroup sizes, the plan's spec and
/// line, and a shape that does not fit (kept on moe_down_rows with a note).
#[test]
fn down_item_lanes_kernel_matches_the_host_and_todays() {
    use lily_wgpu::plan::down_lanes_wg;
    assert_eq!(down_lanes_wg(9, 512), Some(160));
    assert_eq!(down_lanes_wg(9, 256), Some(96));
    assert_eq!(down_lanes_wg(5, 64), Some(64));
    assert_eq!(down_lanes_wg(16, 512), Some(256));
    assert_eq!(down_lanes_wg(17, 512), None);
    assert_eq!(down_lanes_wg(9, 96), None);
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 71);
    for (subgroups, f16, down_rows) in [
        (true, false, 2),
        (false, false, 2),
        (true, true, 2),
        (false, true, 2),
        (true, false, 8),
    ] {
        let opts = WgpuOptions {
            chunk: 16,
            all_logits_chunk: 16,
            subgroups,
            down_rows,
            down_item_lanes: true,
            f16_acts: Choice::of(f16),
            ..WgpuOptions::default()
        };
        let Some(gpu) = wgpu_backend_with(&w, opts) else {
            return;
        };
        let plan = gpu.plan();
        // tiny: 4 routed items + the stacked shared expert of 64 columns: 10 lanes → 64.
        assert_eq!(plan.down_lanes, 64);
        assert_eq!(plan.specs.moe_down_rows.name, "moe_down_lanes");
        let d = plan.describe();
        assert!(
            d.contains("moe_down one item a lane on")
                && d.contains("moe_down_lanes (one item a lane, 64 lanes a workgroup"),
            "{d}"
        );
        let bound = Bounds::of(plan).kernel;
        let down = gpu.check_down_lanes().unwrap();
        println!(
            "subgroups {subgroups}, f16 activations {}, {} rows a workgroup: moe_down_rows in rounds / moe_down_lanes {:.2e} from the host, {:.2e} from each other (bit for bit: {})",
            plan.act_f16, plan.down_rb, down.err, down.vs_first, down.same_bits
        );
        assert!(
            down.err < bound,
            "moe_down_lanes or moe_down_rows differs from the host by {:.2e}",
            down.err
        );
        // The sums' f32 rounding in another order or contraction, not a different sum.
        assert!(
            down.vs_first < bound,
            "moe_down_lanes differs from moe_down_rows in rounds by {:.2e}",
            down.vs_first
        );
    }
    // Off: moe_down_rows as before.
    let Some(gpu) = wgpu_backend_with(
        &w,
        WgpuOptions {
            chunk: 16,
            all_logits_chunk: 16,
            down_item_lanes: false,
            ..WgpuOptions::default()
        },
    ) else {
        return;
    };
    assert_eq!(gpu.plan().down_lanes, 0);
    assert_eq!(gpu.plan().specs.moe_down_rows.name, "moe_down_rows");
    // A tiny model's greedy decode with the switch (the default: every MoE layer's down on
    // moe_down_lanes) against the CPU's tokens (near ties allowed with f16 activations:
    // `assert_greedy_as_cpu`).
    let prompt = Rng(17).tokens(10, w.config.vocab);
    let Some(mut gpu) = wgpu_backend_with(
        &w,
        WgpuOptions {
            chunk: 8,
            all_logits_chunk: 8,
            ..WgpuOptions::default()
        },
    ) else {
        return;
    };
    assert_eq!(gpu.plan().down_lanes, 64);
    let mut cpu = CpuBackend::new(w.clone());
    let cs = cpu.new_seq(64).unwrap();
    cpu.prefill(cs, &prompt).unwrap();
    let gs = gpu.new_seq(64).unwrap();
    gpu.prefill(gs, &prompt).unwrap();
    assert_greedy_as_cpu(&mut cpu, cs, &mut gpu, gs, 16, "down_item_lanes");
}

/// The decode MoE in rounds (`moe_rounds`), in both reduction forms, with f32 and f16
/// activations: linear_q4_glu_rows' `ITEMS` form routing its own items (a workgroup a row and
/// token; E = 130, k = 8, the stacked shared expert, planted ties: ids exactly the host's,
/// weights and products against the host's f64) and moe_down_rows in rounds (against the host
/// and bit for bit the kernel one item at a time); the plan line names both.
#[test]
fn moe_rounds_kernels_match_the_host() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 59);
    for (subgroups, f16) in [(true, false), (false, false), (true, true), (false, true)] {
        let opts = WgpuOptions {
            chunk: 16,
            all_logits_chunk: 16,
            subgroups,
            moe_rounds: true,
            f16_acts: Choice::of(f16),
            ..WgpuOptions::default()
        };
        let Some(gpu) = wgpu_backend_with(&w, opts) else {
            return;
        };
        assert!(gpu.plan().options.moe_rounds && gpu.plan().glu_items);
        let d = gpu.plan().describe();
        assert!(
            d.contains("decode MoE rounds on") && d.contains("each item's reads issued as"),
            "{d}"
        );
        let bound = Bounds::of(gpu.plan()).kernel;
        let (_, rows) = gpu.check_products().unwrap();
        let down = gpu.check_down_rows().unwrap();
        println!(
            "subgroups {subgroups}, f16 activations {}: linear_q4_rows / glu_rows (items' rounds) {rows:.2e}, moe_down_rows {:.2e} (rounds bit for bit: {})",
            gpu.plan().act_f16, down.err, down.same_bits
        );
        assert!(
            rows < bound,
            "linear_q4_glu_rows in items' rounds differs from the host by {rows:.2e}"
        );
        assert!(
            down.err < bound,
            "moe_down_rows differs from the host by {:.2e}",
            down.err
        );
        assert!(
            down.same_bits,
            "moe_down_rows in rounds is not bit for bit the kernel one item at a time"
        );
    }
}

/// The MoE row kernels' rows a workgroup as the knobs set them (`glu_rows` 4 / 16, `down_rows`
/// 2 / 8), in both reduction forms: linear_q4_glu_rows plain and routing its own items, and
/// moe_down_rows one item at a time and in rounds (bit for bit), against the host.
#[test]
fn moe_rows_knobs_match_the_host() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 67);
    for (subgroups, glu_rows, down_rows) in [(true, 4, 2), (false, 4, 2), (true, 16, 8)] {
        let opts = WgpuOptions {
            chunk: 16,
            all_logits_chunk: 16,
            subgroups,
            glu_rows,
            down_rows,
            ..WgpuOptions::default()
        };
        let Some(gpu) = wgpu_backend_with(&w, opts) else {
            return;
        };
        assert_eq!(
            (gpu.plan().glu_rb, gpu.plan().down_rb),
            (glu_rows, down_rows)
        );
        let bound = Bounds::of(gpu.plan()).kernel;
        let (_, rows) = gpu.check_products().unwrap();
        let down = gpu.check_down_rows().unwrap();
        println!(
            "subgroups {subgroups}, glu rows {glu_rows}, down rows {down_rows}: linear_q4_rows / glu_rows {rows:.2e}, moe_down_rows {:.2e} (rounds bit for bit: {})",
            down.err, down.same_bits
        );
        assert!(
            rows < bound && down.err < bound,
            "{rows:.2e} / {:.2e}",
            down.err
        );
        assert!(down.same_bits);
    }
}

/// `out_rows`: the products of 1,024 to 8,191 rows (DeltaNet's out_proj and attention's o on the
/// full model) on linear_q4_rows' 8-row kernel in two rounds (its second round's words, both of
/// a 4,096-column row, before the first's sums), on the 16- and 2-row ones: the plan's rows a
/// workgroup; the 8-row kernel in rounds against the host and bit for bit the 8-row kernel of
/// one round (`check_rows_persist`, streaming and not), every product probe through the plan's
/// kernels (the residual add at 4,096 columns and 8 / 16 rows among them), both reduction forms.
#[test]
fn out_rows_kernels_match_the_host() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 61);
    for (subgroups, out_rows) in [(true, 8), (false, 8), (true, 16), (true, 2)] {
        // The 16-row kernel of one or two words a row (`rows_one_word` off): a two-word
        // matrix may take it here (with the switch on, as it ships, it takes the 8-row kernel).
        let opts = WgpuOptions {
            chunk: 16,
            all_logits_chunk: 16,
            subgroups,
            out_rows,
            rows_one_word: false,
            // The router on the 2-row kernel, as without `router_lean` (its own test's case).
            router_lean: false,
            ..WgpuOptions::default()
        };
        let Some(gpu) = wgpu_backend_with(&w, opts) else {
            return;
        };
        let plan = gpu.plan();
        assert_eq!(plan.options.out_rows, out_rows);
        assert_eq!(
            (
                plan.rows_rb(2048, 2),
                plan.rows_rb(12_352, 1),
                plan.rows_rb(257, 2)
            ),
            (out_rows, 16, 2)
        );
        assert!(
            plan.describe().contains(&format!(
                "1,024–8,191-row products on its {out_rows}-row kernel"
            )),
            "{}",
            plan.describe()
        );
        let bound = Bounds::of(plan).kernel;
        let pc = gpu.check_rows_persist().unwrap();
        let (_, rows) = gpu.check_products().unwrap();
        println!(
            "subgroups {subgroups}, out rows {out_rows}: persistent linear_q4_rows (16 and 8 rows) {:.2e} (same bits: {}), product probes {rows:.2e}",
            pc.err, pc.same_bits
        );
        assert!(
            pc.err < bound && rows < bound,
            "{:.2e} / {rows:.2e}",
            pc.err
        );
        assert!(
            pc.same_bits,
            "linear_q4_rows in rounds is not bit for bit the kernel of one round"
        );
    }
}

/// `router_lean`: the products of fewer than 1,024 rows (the router | shared gate on the full
/// model, 257 rows of 8 bits) on linear_q4_rows' 1-row kernel with `LEAN` (the row's partials and
/// the folded norm's Σx² in one two-value workgroup sum); the plan's rows a workgroup (the
/// router 1, the output projections still 2, in_proj 16) and its plan line; every product probe
/// through the plan's kernels, the 1-row kernel among them (4-bit 2,048 and 4,096 columns, 8-bit
/// 2,048; 37 rows, 2 items; the norm folded and not) against the host's f64, in both reduction
/// forms, with f32 and f16 activations.
#[test]
fn router_lean_kernel_matches_the_host() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 67);
    for (subgroups, f16) in [(true, false), (false, false), (true, true), (false, true)] {
        let opts = WgpuOptions {
            chunk: 16,
            all_logits_chunk: 16,
            subgroups,
            router_lean: true,
            f16_acts: Choice::of(f16),
            ..WgpuOptions::default()
        };
        let Some(gpu) = wgpu_backend_with(&w, opts) else {
            return;
        };
        let plan = gpu.plan();
        assert!(plan.options.router_lean && plan.specs.linear_q4_rows1.is_some());
        assert_eq!(
            (
                plan.rows_rb(257, 2),
                plan.rows_rb(1023, 1),
                plan.rows_rb(2048, 2),
                plan.rows_rb(12_352, 1)
            ),
            (1, 1, 2, 16)
        );
        let d = plan.describe();
        assert!(
            d.contains("linear_q4_rows lean 1-row router on")
                && d.contains("the products of < 1,024 rows on its lean 1-row kernel"),
            "{d}"
        );
        let bound = Bounds::of(plan).kernel;
        let (_, rows) = gpu.check_products().unwrap();
        println!(
            "subgroups {subgroups}, f16 activations {}: linear_q4_rows (the lean 1-row kernel among them) {rows:.2e}",
            plan.act_f16
        );
        assert!(
            rows < bound,
            "linear_q4_rows (LEAN, one row a workgroup) differs from the host by {rows:.2e}"
        );
    }
    // As it ships (on since session 26): the router on the 1-row kernel; off: no 1-row kernel,
    // the router on the 2-row one.
    let Some(gpu) = wgpu_backend_with(&w, WgpuOptions::default()) else {
        return;
    };
    assert!(gpu.plan().specs.linear_q4_rows1.is_some());
    assert_eq!(gpu.plan().rows_rb(257, 2), 1);
    let Some(gpu) = wgpu_backend_with(
        &w,
        WgpuOptions {
            router_lean: false,
            ..WgpuOptions::default()
        },
    ) else {
        return;
    };
    assert!(gpu.plan().specs.linear_q4_rows1.is_none());
    assert_eq!(gpu.plan().rows_rb(257, 2), 2);
}

/// `down_item_lanes` on the full widths (4 layers, synth seed 41, as the other full-width decode
/// tests): the down products of 9 items of 512 columns on moe_down_lanes' 160 lanes, 12
/// positions token by token against the CPU, and **bit for bit** the logits without the switch
/// (moe_down_rows in rounds: the same sums in the same order) where the driver contracts neither
/// kernel (else within rounding: the bound below). `cargo test --release -p lily-wgpu --test
/// model -- --ignored full_width_down_item_lanes`.
#[test]
#[ignore]
fn full_width_down_item_lanes_decode_matches_cpu() {
    let (w, tokens, want) = full_width_model();
    let mut stepped_of = Vec::new();
    for lanes in [false, true] {
        let opts = WgpuOptions {
            chunk: 16,
            all_logits_chunk: 1,
            f16_acts: Choice::Off,
            f16_kv: Choice::Off,
            down_item_lanes: lanes,
            ..WgpuOptions::default()
        };
        let Some(mut gpu) = wgpu_backend_with(&w, opts) else {
            return;
        };
        assert_eq!(gpu.plan().down_lanes, if lanes { 160 } else { 0 });
        let stepped = logits_token_by_token(&mut gpu, &tokens);
        let e_cpu = rel_l2(&stepped, &want);
        println!("full widths, down_item_lanes {lanes}: token by token vs CPU {e_cpu:.3e}");
        assert!(e_cpu < 1e-3, "decode differs from the CPU by {e_cpu:.3e}");
        stepped_of.push(stepped);
    }
    let e = rel_l2(&stepped_of[1], &stepped_of[0]);
    let same = stepped_of[1]
        .iter()
        .zip(&stepped_of[0])
        .all(|(a, b)| a.to_bits() == b.to_bits());
    println!("full widths: down_item_lanes against moe_down_rows {e:.3e} (bit for bit: {same})");
    assert!(e < 1e-5, "down_item_lanes moves the logits by {e:.3e}");
}

/// dn_recur_norm.wgsl (a decode step's DeltaNet recurrence and output norm), in both reduction
/// forms, against the host's f64 at the full model's dk = dv = 128 and at dk 64, dv 96 (columns
/// past dv idle).
#[test]
fn deltanet_step_matches_the_host() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 47);
    for subgroups in [true, false] {
        let opts = WgpuOptions {
            chunk: 16,
            all_logits_chunk: 16,
            subgroups,
            ..WgpuOptions::default()
        };
        let Some(gpu) = wgpu_backend_with(&w, opts) else {
            return;
        };
        let mut dn = 0f64;
        for (dk, dv) in [(128, 128), (64, 96)] {
            let st = gpu.check_dn_step(dk, dv).unwrap();
            dn = dn.max(st.y_err).max(st.state_err);
        }
        println!("subgroups {subgroups}: dn_recur_norm {dn:.2e}");
        let bound = Bounds::of(gpu.plan()).kernel;
        assert!(
            dn < bound,
            "dn_recur_norm differs from the host by {dn:.2e}"
        );
    }
}

/// `dn_one_sync`: dn_recur_norm.wgsl's `ONE_SYNC` form (one exchange of the slices' partials,
/// o = α S₀ᵀq̂ + δ (k̂ᵀq̂), the short norm sum) in both reduction forms, f32 and f16
/// activations, at dk = dv = 128 (the full model's), dk 64 / dv 96 (columns past dv idle) and
/// dk 32 / dv 32: the updated state **bit for bit** the `ONE_SYNC` 0 kernel's, the output within
/// the kernel bound of the host's f64 and of the old kernel's output; the plan line names it.
#[test]
fn deltanet_step_one_sync_matches_the_old_kernel() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 53);
    for (subgroups, f16) in [(true, false), (false, false), (true, true), (false, true)] {
        let opts = |one: bool| WgpuOptions {
            chunk: 16,
            all_logits_chunk: 16,
            subgroups,
            dn_one_sync: one,
            f16_acts: Choice::of(f16),
            ..WgpuOptions::default()
        };
        let Some(off) = wgpu_backend_with(&w, opts(false)) else {
            return;
        };
        let Some(on) = wgpu_backend_with(&w, opts(true)) else {
            return;
        };
        assert!(!off.plan().options.dn_one_sync && on.plan().options.dn_one_sync);
        let d = on.plan().describe();
        assert!(d.contains("decode DeltaNet step one exchange on"), "{d}");
        let bound = Bounds::of(on.plan()).kernel;
        for (dk, dv) in [(128, 128), (64, 96), (32, 32)] {
            let a = off.check_dn_step(dk, dv).unwrap();
            let b = on.check_dn_step(dk, dv).unwrap();
            assert!(a.state.iter().all(|v| v.is_finite()) && a.y.iter().any(|v| *v != 0.0));
            let same_state = a.state.len() == b.state.len()
                && a.state
                    .iter()
                    .zip(&b.state)
                    .all(|(x, y)| x.to_bits() == y.to_bits());
            let num: f64 =
                a.y.iter()
                    .zip(&b.y)
                    .map(|(x, y)| ((x - y) as f64).powi(2))
                    .sum();
            let den: f64 = a.y.iter().map(|x| (*x as f64).powi(2)).sum();
            let y_vs_old = (num / den).sqrt();
            println!(
                "subgroups {subgroups}, f16 activations {}, dk {dk} dv {dv}: ONE_SYNC y {:.2e} (old {:.2e}), state {:.2e}, y vs old {y_vs_old:.2e}, state bit for bit {same_state}",
                on.plan().act_f16,
                b.y_err,
                a.y_err,
                b.state_err
            );
            assert!(same_state, "ONE_SYNC's state differs from the old kernel's");
            assert!(
                b.y_err < bound && b.state_err < bound,
                "dn_recur_norm ONE_SYNC differs from the host by {:.2e} / {:.2e}",
                b.y_err,
                b.state_err
            );
            assert!(
                y_vs_old < bound,
                "ONE_SYNC's output vs the old kernel's {y_vs_old:.2e}"
            );
        }
    }
}

/// attend_gqa.wgsl with attend_merge.wgsl, and attend_tile.wgsl, against the host's gated
/// attention in f64 on random queries and caches, at the full model's shapes (8 query heads per
/// KV head, head dim 256) and at `tiny`'s: decode with the keys split over workgroups, and
/// prefill-like blocks of tokens.
#[test]
fn attention_kernels_match_the_host() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 31);
    let Some(gpu) = wgpu_backend(&w, 16) else {
        return;
    };
    let (e, tiles) = gpu.check_attention().unwrap();
    println!("attention vs the host's: {e:.2e}; attend_tile (head dim, heads, keys a block) checked: {tiles:?}");
    assert!(
        tiles.iter().any(|t| t[2] == 16),
        "attend_tile with blocks of 16 keys (Apple's) fits every device"
    );
    assert!(
        e < Bounds::of(gpu.plan()).kernel,
        "attend_gqa or attend_tile differs from the host by {e:.2e}"
    );
}

/// Long chunks (128 tokens: 32 routed items per expert on `tiny`, so several tiles of
/// linear_q4_mm per expert) and decode steps whose attention is split over the keys
/// (attend_merge), against the CPU: the last prompt position's logits, then 8 greedy tokens.
#[test]
fn long_chunks_and_split_attention_match_cpu() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 17);
    let tokens = Rng(5).tokens(300, w.config.vocab);
    let mut cpu = CpuBackend::new(w.clone()).with_prefill_chunk(64);
    let cs = cpu.new_seq(320).unwrap();
    cpu.prefill(cs, &tokens).unwrap();
    let want = cpu.logits(cs).unwrap();
    let Some(mut gpu) = wgpu_backend(&w, 128) else {
        return;
    };
    let gs = gpu.new_seq(320).unwrap();
    gpu.prefill(gs, &tokens).unwrap();
    let got = gpu.logits(gs).unwrap();
    let e = rel_l2(&got, &want);
    println!("300 positions in chunks of 128: last logits rel_l2 {e:.3e}");
    let bound = Bounds::of(gpu.plan()).logits;
    assert!(e < bound, "logits differ from the CPU by {e:.3e}");
    assert_greedy_as_cpu(&mut cpu, cs, &mut gpu, gs, 8, "after 300 positions");
}

/// Decode attention with its reads flat (`attn_flat`) and its keys split by the plan
/// (`attn_split`), as a decode step runs them (attn_prep's work inside attend_gqa, the new key
/// and value in workgroup memory): 300 positions prefilled, then 4 one token at a time; the last
/// logits against the CPU for each of the four settings (both on: the defaults), `attn_flat` bit
/// for bit those without it (the same sums in the same order), then 8 greedy tokens with both on
/// as the CPU's.
#[test]
fn decode_attention_flat_and_split_match_cpu() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 19);
    let tokens = Rng(6).tokens(304, w.config.vocab);
    let mut cpu = CpuBackend::new(w.clone()).with_prefill_chunk(64);
    let cs = cpu.new_seq(320).unwrap();
    cpu.prefill(cs, &tokens).unwrap();
    let want = cpu.logits(cs).unwrap();
    let run = |attn_flat: bool, attn_split: bool| {
        let opts = WgpuOptions {
            chunk: 128,
            all_logits_chunk: 32,
            attn_flat,
            attn_split,
            ..WgpuOptions::default()
        };
        let mut gpu = wgpu_backend_with(&w, opts)?;
        let s = gpu.new_seq(320).unwrap();
        gpu.prefill(s, &tokens[..300]).unwrap();
        for t in &tokens[300..] {
            gpu.prefill(s, &[*t]).unwrap();
        }
        let logits = gpu.logits(s).unwrap();
        Some((gpu, s, logits))
    };
    let Some((_, _, neither)) = run(false, false) else {
        return;
    };
    let (_, _, flat) = run(true, false).unwrap();
    let (_, _, split) = run(false, true).unwrap();
    let (mut both, bs, both_logits) = run(true, true).unwrap();
    for (name, got) in [
        ("neither", &neither),
        ("flat", &flat),
        ("split", &split),
        ("both", &both_logits),
    ] {
        let e = rel_l2(got, &want);
        println!("decode attention {name}: last logits rel_l2 {e:.3e}");
        let bound = Bounds::of(both.plan()).logits;
        assert!(e < bound, "{name}: logits differ from the CPU by {e:.3e}");
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(
        bits(&flat),
        bits(&neither),
        "attn_flat changed the 64-key split's logits"
    );
    assert_eq!(
        bits(&both_logits),
        bits(&split),
        "attn_flat changed attn_split's logits"
    );
    assert_greedy_as_cpu(&mut cpu, cs, &mut both, bs, 8, "attn_flat and attn_split");
}

/// The device sampler (sample_adjust.wgsl, sample_pick.wgsl) against the host's
/// `Sampler::sample` on the same logits, seed and history: every pick must be the same token,
/// over 6 settings × 150 seeds on `tiny` and × 25 on `small` (temperature with top_k / top_p / min_p, ties, −∞ and NaN logits,
/// logit_bias, presence / frequency / repetition penalties, greedy on adjusted logits), and the
/// log-probability the raw logits' log-softmax.
#[test]
fn device_sampler_picks_as_the_host_sampler() {
    // tiny: one prefilter range; small (248,320 ids): 243 ranges, the top k's ties spread over
    // many of them.
    device_sampler_matches_host(Preset::Tiny, 150);
    device_sampler_matches_host(Preset::Small, 25);
}

fn device_sampler_matches_host(preset: Preset, seeds: u64) {
    let w = synth_model(preset, SynthFormat::Mlx, 81);
    let vocab = w.config.vocab;
    let Some(mut gpu) = wgpu_backend(&w, 8) else {
        return;
    };
    let mut rng = Rng(21);
    // Logits in [−8, 8) with a heavy head of exact ties (every vocab/40-th id, 4 values), −∞
    // and a NaN.
    let mut logits: Vec<f32> = (0..vocab)
        .map(|_| (rng.below(16_000) as f32 / 1000.0) - 8.0)
        .collect();
    let stride = (vocab / 40).max(1);
    for i in 0..40 {
        logits[i * stride] = 9.0 + (i % 4) as f32 * 0.25;
    }
    logits[101] = f32::NEG_INFINITY;
    logits[102] = f32::NAN;
    let history = rng.tokens(12, vocab);
    let settings = [
        SamplingParams {
            temperature: 0.7,
            top_k: 50,
            top_p: 0.9,
            ..SamplingParams::greedy()
        },
        SamplingParams {
            temperature: 1.3,
            top_k: 256,
            min_p: 0.05,
            ..SamplingParams::greedy()
        },
        SamplingParams {
            temperature: 1.0,
            top_k: 7,
            ..SamplingParams::greedy()
        },
        SamplingParams {
            temperature: 0.9,
            top_k: 64,
            top_p: 0.95,
            presence_penalty: 0.8,
            frequency_penalty: 0.3,
            logit_bias: vec![(5, -3.0), (700, 12.0), (5, 1.5)],
            ..SamplingParams::greedy()
        },
        SamplingParams {
            temperature: 1.1,
            top_k: 100,
            repetition_penalty: 1.3,
            ..SamplingParams::greedy()
        },
        SamplingParams {
            presence_penalty: 2.0,
            logit_bias: vec![(3, -50.0)],
            ..SamplingParams::greedy()
        },
    ];
    let mut picks = 0;
    for (n, params) in settings.iter().enumerate() {
        let mut distinct = std::collections::HashSet::new();
        for seed in 0..seeds {
            let p = SamplingParams {
                seed: seed * 7919 + n as u64,
                ..params.clone()
            };
            let make = || {
                let mut s = Sampler::with_prompt(p.clone(), &history[..4]);
                for &t in &history[4..] {
                    s.accept(t);
                }
                s
            };
            let (mut host, mut dev) = (make(), make());
            let want = host.sample(&logits);
            let (got, lp) = gpu
                .sample_on_device(&logits, &mut dev)
                .unwrap()
                .expect("these settings sample on the device");
            assert_eq!(
                got, want,
                "setting {n}, seed {seed}: device picked {got}, host {want}"
            );
            let finite: Vec<f32> = logits
                .iter()
                .map(|&l| if l.is_nan() { f32::NEG_INFINITY } else { l })
                .collect();
            let mx = finite.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let z: f64 = finite.iter().map(|&l| ((l - mx) as f64).exp()).sum();
            let want_lp = (logits[want as usize] - mx) as f64 - z.ln();
            assert!(
                (lp as f64 - want_lp).abs() < 1e-4,
                "setting {n}: log-probability {lp}, host {want_lp}"
            );
            distinct.insert(got);
            picks += 1;
        }
        println!(
            "{preset:?} setting {n}: {} distinct tokens over {seeds} seeds",
            distinct.len()
        );
    }
    println!("device sampler on {preset:?}: {picks} picks identical to the host's");
}

/// A decode stopped by the caller leaves the sequence (and the sampler's random stream) where
/// the CPU backend leaves them: the wgpu decode encodes the next step before the caller has
/// seen the token, and that step must not run nor draw. A second decode call with the same
/// sampler then continues with the CPU's tokens. Greedy, and sampled on the device (with
/// penalties, so the device's history must follow too).
#[test]
fn stopped_decode_continues_as_cpu() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 23);
    let prompt = Rng(9).tokens(11, w.config.vocab);
    let sampled = SamplingParams {
        temperature: 0.8,
        top_k: 30,
        top_p: 0.9,
        frequency_penalty: 0.4,
        seed: 77,
        ..SamplingParams::greedy()
    };
    for params in [SamplingParams::greedy(), sampled] {
        let run = |b: &mut dyn Backend| {
            let s = b.new_seq(64).unwrap();
            b.prefill(s, &prompt).unwrap();
            let mut sampler = Sampler::new(params.clone());
            let mut out = Vec::new();
            b.decode(s, &mut sampler, 10, 0, &mut |t| {
                out.push(t.token);
                if out.len() == 3 {
                    Flow::Stop
                } else {
                    Flow::Continue
                }
            })
            .unwrap();
            let len = b.seq_len(s).unwrap();
            b.decode(s, &mut sampler, 9, 0, &mut |t| {
                out.push(t.token);
                Flow::Continue
            })
            .unwrap();
            (out, len, b.seq_len(s).unwrap())
        };
        let mut cpu = CpuBackend::new(w.clone());
        let want = run(&mut cpu);
        let Some(mut gpu) = wgpu_backend(&w, 8) else {
            return;
        };
        let got = run(&mut gpu);
        if Bounds::of(gpu.plan()).near_tie.is_none() {
            assert_eq!(
                got, want,
                "{params:?}: (tokens, length after the stop, length at the end)"
            );
            continue;
        }
        // f16 activations (tests/apple_limits.rs): a draw near a boundary of the distribution
        // may take another token than the CPU's. The lengths are the CPU's, and the stopped
        // decode's tokens those of a decode of exactly 3 steps (which encodes no step after its
        // last) and then 9 on the GPU with the same sampler (the same kernels, so bit for bit):
        // the stop neither ran nor drew the step it had encoded ahead.
        assert_eq!((got.1, got.2), (want.1, want.2), "{params:?}: lengths");
        let s = gpu.new_seq(64).unwrap();
        gpu.prefill(s, &prompt).unwrap();
        let mut sampler = Sampler::new(params.clone());
        let mut whole = Vec::new();
        for n in [3, 9] {
            gpu.decode(s, &mut sampler, n, 0, &mut |t| {
                whole.push(t.token);
                Flow::Continue
            })
            .unwrap();
        }
        assert_eq!(got.0, whole, "{params:?}: stopped against 3 + 9 steps");
    }
}

/// Greedy tokens from the same prompt, with the GPU picking and feeding back its own tokens.
#[test]
fn greedy_tokens_match_cpu_over_32_steps() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 21);
    let prompt = Rng(5).tokens(12, w.config.vocab);
    let run = |b: &mut dyn Backend| -> Vec<(u32, f32)> {
        let s = b.new_seq(64).unwrap();
        b.prefill(s, &prompt).unwrap();
        let mut out = Vec::new();
        let mut sampler = Sampler::new(SamplingParams::greedy());
        b.decode(s, &mut sampler, 32, 0, &mut |t| {
            out.push((t.token, t.logprob));
            Flow::Continue
        })
        .unwrap();
        assert_eq!(b.seq_len(s).unwrap(), prompt.len() + 31);
        out
    };
    let want = run(&mut CpuBackend::new(w.clone()));
    let Some(mut gpu) = wgpu_backend(&w, 8) else {
        return;
    };
    let got = run(&mut gpu);
    let ids = |v: &[(u32, f32)]| v.iter().map(|x| x.0).collect::<Vec<_>>();
    assert_eq!(ids(&got), ids(&want), "greedy tokens differ");
    let bound = Bounds::of(gpu.plan()).logits as f32;
    for (i, ((_, g), (_, c))) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - c).abs() < bound * (1.0 + c.abs()),
            "step {i}: logprob {g} vs {c}"
        );
    }
    println!("greedy: 32 identical tokens {:?}", ids(&got));
}

/// `dn_one_sync` in a whole model: tiny (dn_recur_norm at dk 32 on every DeltaNet decode step),
/// both reduction forms, 24 greedy steps picked and fed back by the GPU against the CPU (the same
/// tokens, logprobs within the logits bound).
#[test]
fn decode_with_dn_one_sync_matches_cpu() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 23);
    let prompt = Rng(9).tokens(10, w.config.vocab);
    let run = |b: &mut dyn Backend| -> Vec<(u32, f32)> {
        let s = b.new_seq(64).unwrap();
        b.prefill(s, &prompt).unwrap();
        let mut out = Vec::new();
        let mut sampler = Sampler::new(SamplingParams::greedy());
        b.decode(s, &mut sampler, 24, 0, &mut |t| {
            out.push((t.token, t.logprob));
            Flow::Continue
        })
        .unwrap();
        out
    };
    let want = run(&mut CpuBackend::new(w.clone()));
    for subgroups in [true, false] {
        let opts = WgpuOptions {
            chunk: 8,
            all_logits_chunk: 8,
            subgroups,
            dn_one_sync: true,
            ..WgpuOptions::default()
        };
        let Some(mut gpu) = wgpu_backend_with(&w, opts) else {
            return;
        };
        assert!(gpu.plan().options.dn_one_sync);
        let got = run(&mut gpu);
        let ids = |v: &[(u32, f32)]| v.iter().map(|x| x.0).collect::<Vec<_>>();
        assert_eq!(
            ids(&got),
            ids(&want),
            "greedy tokens differ (subgroups {subgroups})"
        );
        let bound = Bounds::of(gpu.plan()).logits as f32;
        let mut worst = 0f32;
        for (i, ((_, g), (_, c))) in got.iter().zip(&want).enumerate() {
            worst = worst.max((g - c).abs());
            assert!(
                (g - c).abs() < bound * (1.0 + c.abs()),
                "step {i}: logprob {g} vs {c}"
            );
        }
        println!("subgroups {subgroups}: 24 identical tokens, logprobs within {worst:.2e}");
    }
}

/// Weights cut into many slices (as the full model's experts, embedding and lm_head are under
/// lavapipe's 128 MiB binding limit) give the same logits as whole tensors.
#[test]
fn sliced_weights_give_the_same_logits() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 61);
    let tokens = Rng(4).tokens(20, w.config.vocab);
    let run = |max_slice_bytes: Option<u64>| {
        let mut b = wgpu_backend_with(
            &w,
            WgpuOptions {
                chunk: 8,
                max_slice_bytes,
                ..WgpuOptions::default()
            },
        )?;
        let s = b.new_seq(32).unwrap();
        b.prefill(s, &tokens).unwrap();
        Some(b.logits(s).unwrap())
    };
    let Some(whole) = run(None) else {
        return;
    };
    // 20 KB: the embedding, lm_head (1,024 rows of 72 bytes) and each expert stack (16 matrices
    // of ≈ 4.6 KB) in 4 slices each.
    let sliced = run(Some(20_000)).unwrap();
    assert_eq!(sliced, whole, "sliced weights change the logits");
}

/// Non-greedy settings (top_k 40: the device sampler) give, with the same seed, the CPU
/// backend's tokens; the top log-probabilities are the CPU's too.
#[test]
fn sampled_tokens_and_top_logprobs_match_cpu() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 71);
    let prompt = Rng(6).tokens(9, w.config.vocab);
    let params = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        top_k: 40,
        presence_penalty: 0.5,
        seed: 1234,
        ..SamplingParams::greedy()
    };
    let run = |b: &mut dyn Backend, params: &SamplingParams| {
        let s = b.new_seq(64).unwrap();
        b.prefill(s, &prompt).unwrap();
        let mut out = Vec::new();
        let mut sampler = Sampler::new(params.clone());
        b.decode(s, &mut sampler, 16, 3, &mut |t| {
            out.push(t.clone());
            Flow::Continue
        })
        .unwrap();
        out
    };
    let Some(mut gpu) = wgpu_backend(&w, 8) else {
        return;
    };
    let mut cpu = CpuBackend::new(w.clone());
    let bounds = Bounds::of(gpu.plan());
    let bound = bounds.logits as f32;
    for p in [params, SamplingParams::greedy()] {
        if let Some(tie) = bounds.near_tie {
            // f16 activations (tests/apple_limits.rs): a draw near a boundary of the
            // distribution may pick another token than the CPU's, after which the sequences
            // part. So the CPU is fed the GPU's tokens, and each pick must be one the CPU's
            // distribution allows (within its top_k by logit, or its best for greedy, less a
            // near tie and the presence penalty's shift), with the log-probabilities of the pick
            // and of its alternatives the CPU's within the bound.
            let got = run(&mut gpu, &p);
            let s = cpu.new_seq(64).unwrap();
            cpu.prefill(s, &prompt).unwrap();
            let k = if p.temperature > 0.0 { p.top_k } else { 1 };
            for (i, g) in got.iter().enumerate() {
                let row = cpu.logits(s).unwrap();
                let ls = lily_core::logprob::LogSoftmax::new(&row);
                let rms = (row.iter().map(|v| v * v).sum::<f32>() / row.len() as f32).sqrt();
                let kth = ls.top(k as usize).last().map_or(f32::NEG_INFINITY, |t| t.1);
                let slack = tie * rms + p.presence_penalty;
                assert!(
                    ls.at(g.token) >= kth - slack,
                    "step {i}: token {} at log-probability {} under the CPU's top {k} (from {kth})",
                    g.token,
                    ls.at(g.token)
                );
                for (t, lp) in std::iter::once((g.token, g.logprob)).chain(g.top.iter().copied()) {
                    let c = ls.at(t);
                    assert!(
                        (lp - c).abs() < bound * (1.0 + c.abs()),
                        "step {i}: token {t}'s log-probability {lp} vs the CPU's {c}"
                    );
                }
                cpu.prefill(s, &[g.token]).unwrap();
            }
            cpu.free_seq(s);
            continue;
        }
        let (got, want) = (run(&mut gpu, &p), run(&mut cpu, &p));
        let ids = |v: &[lily_core::backend::StepOut]| v.iter().map(|x| x.token).collect::<Vec<_>>();
        assert_eq!(
            ids(&got),
            ids(&want),
            "tokens differ (temperature {})",
            p.temperature
        );
        for (g, c) in got.iter().zip(&want) {
            assert!((g.logprob - c.logprob).abs() < bound * (1.0 + c.logprob.abs()));
            let top =
                |x: &lily_core::backend::StepOut| x.top.iter().map(|t| t.0).collect::<Vec<_>>();
            assert_eq!(top(g), top(c), "top-3 alternatives differ");
        }
    }
}

/// Chunks of 7 and 1-token steps give the same logits (each token's arithmetic is the same).
#[test]
fn chunked_prefill_equals_token_by_token() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 33);
    let tokens = Rng(8).tokens(30, w.config.vocab);
    let Some(mut chunked) = wgpu_backend(&w, 7) else {
        return;
    };
    let a = chunked.new_seq(40).unwrap();
    chunked.prefill(a, &tokens).unwrap();
    let la = chunked.logits(a).unwrap();
    let Some(mut single) = wgpu_backend(&w, 1) else {
        return;
    };
    let b = single.new_seq(40).unwrap();
    for t in &tokens {
        single.prefill(b, &[*t]).unwrap();
    }
    let lb = single.logits(b).unwrap();
    let e = rel_l2(&la, &lb);
    println!("chunked (7) vs token by token: rel_l2 {e:.3e}");
    // A chunk's matrix products run as tiled products (linear_q4_mm.wgsl: weights dequantised
    // once per tile of tokens) and one token's as matrix-vector products (linear_q4.wgsl): the
    // same sums in another order, so fp32 rounding differs (≈ 3e-6 here). With f16
    // activations (tests/apple_limits.rs) the two paths store different intermediates in f16.
    // A wrong position, state or cache row would differ by far more.
    assert!(
        e < Bounds::of(single.plan()).paths,
        "chunked prefill differs from token-by-token: {e:.3e}"
    );
}

/// The full model's widths (4 layers: three DeltaNet, one attention), where decode runs its own
/// kernels (the row products with the norms and the DeltaNet conv folded in, the GLU routing its
/// items itself, moe_down_rows, dn_recur_norm with dk = 128, attend_gqa with 8 heads a KV head):
/// 12 positions token by token against the CPU (the last logits within 1e-3) and against the
/// same prompt as one chunk (prefill's kernels; within 2e-5), in both reduction forms, and with
/// f16 activations (`f16_acts`, where the adapter has SHADER_F16: within `F16_WIDE` of both,
/// decode and prefill storing different intermediates in f16). About 2.5 GB of weights and two
/// minutes on lavapipe: `cargo test --release -p lily-wgpu --test model -- --ignored full_width`
/// (and on the GPU machine).
#[test]
#[ignore]
fn full_width_decode_matches_cpu() {
    let (w, tokens, want) = full_width_model();
    // Each case's token-by-token logits, for the persistent cases' bit-for-bit check.
    let mut stepped_of = std::collections::HashMap::new();
    for (subgroups, f16_acts, early, persist, rounds) in [
        (true, false, true, false, false),
        (false, false, true, false, false),
        (true, true, true, false, false),
        (true, false, false, false, false),
        (false, false, false, false, false),
        (true, false, true, true, false),
        (false, false, true, true, false),
        (true, false, true, true, true),
        (false, false, true, true, true),
        (true, true, true, true, true),
    ] {
        // `early`: the MoE's reads issued early (the row products, the router among them, and
        // the GLU: `rows_early`, `glu_early`; the defaults), which only the full widths take.
        // `persist`: linear_q4_rows' persistent 16-row kernel (`rows_persist`: in_proj and
        // lm_head's slices here), whose logits must be bit for bit those of the same case
        // without it. `rounds`: the decode MoE in rounds (`moe_rounds`: the GLU's items' rounds,
        // within rounding of the case without it; moe_down's rounds, bit for bit), held to the
        // same bounds. On lavapipe the experts' stacks (≈ 135 MB) exceed its 128 MiB binding, so
        // they are sliced and decode's MoE takes the one-item products there (`Separate`): these
        // cases equal the others bit for bit; a device that binds the stacks whole runs the
        // rounds (their kernels' own tests: `moe_rounds_kernels_match_the_host`).
        let opts = WgpuOptions {
            chunk: 16,
            all_logits_chunk: 1,
            subgroups,
            f16_acts: Choice::of(f16_acts),
            f16_kv: Choice::Off,
            rows_early: early,
            glu_early: early,
            rows_persist: persist,
            moe_rounds: rounds,
            ..WgpuOptions::default()
        };
        let Some(mut gpu) = wgpu_backend_with(&w, opts) else {
            return;
        };
        let on = gpu.plan().act_f16;
        let a = gpu.new_seq(16).unwrap();
        gpu.prefill(a, &tokens).unwrap();
        let chunked = gpu.logits(a).unwrap();
        let stepped = logits_token_by_token(&mut gpu, &tokens);
        let (e_cpu, e_chunk) = (rel_l2(&stepped, &want), rel_l2(&stepped, &chunked));
        println!(
            "full widths, subgroups {subgroups}, f16 activations {on}, early MoE reads {early}, persistent rows {persist}, MoE rounds {rounds}: token by token vs CPU {e_cpu:.3e}, vs one chunk {e_chunk:.3e}"
        );
        if rounds {
            let plain: &Vec<f32> = &stepped_of[&(subgroups, on, early)];
            println!(
                "  the MoE in rounds: {:.3e} from the same case without",
                rel_l2(&stepped, plain)
            );
        } else if persist {
            let plain: &Vec<f32> = &stepped_of[&(subgroups, on, early)];
            assert_same_bits(&stepped, plain, "persistent rows change the logits");
        } else {
            stepped_of.insert((subgroups, on, early), stepped.clone());
        }
        let (to_cpu, to_chunk) = if on {
            (F16_WIDE, F16_WIDE)
        } else {
            (1e-3, 2e-5)
        };
        assert!(
            e_cpu < to_cpu,
            "f16 activations {on}: decode differs from the CPU by {e_cpu:.3e}"
        );
        assert!(
            e_chunk < to_chunk,
            "f16 activations {on}: decode differs from prefill by {e_chunk:.3e}"
        );
    }
}

/// The full widths' model of the full-width tests (4 layers, synth seed 41), a 12-token prompt and
/// the CPU's last logits after it.
fn full_width_model() -> (Arc<ModelWeights>, Vec<u32>, Vec<f32>) {
    let w = synth_model_layers(Preset::Full, SynthFormat::Mlx, 41, Some(4));
    let tokens = Rng(5).tokens(12, w.config.vocab);
    let mut cpu = CpuBackend::new(w.clone());
    let cs = cpu.new_seq(16).unwrap();
    cpu.prefill(cs, &tokens).unwrap();
    let want = cpu.logits(cs).unwrap();
    (w, tokens, want)
}

/// `rows_one_word` on the full widths (4 layers, synth seed 41, as `full_width_decode_matches_cpu`):
/// in_proj (with its conv), q/k/v and lm_head on the 16-row kernel compiled for one-word rows,
/// persistent on lavapipe's 64 workers; 12 positions token by token, both reduction forms: the
/// last logits within 1e-3 of the CPU and **bit for bit** those of the same case without the
/// switch. `cargo test --release -p lily-wgpu --test model -- --ignored full_width_one_word`.
#[test]
#[ignore]
fn full_width_one_word_decode_matches_cpu() {
    let (w, tokens, want) = full_width_model();
    for subgroups in [true, false] {
        let mut stepped_of = Vec::new();
        for one_word in [false, true] {
            let opts = WgpuOptions {
                chunk: 16,
                all_logits_chunk: 1,
                subgroups,
                f16_acts: Choice::Off,
                f16_kv: Choice::Off,
                rows_one_word: one_word,
                ..WgpuOptions::default()
            };
            let Some(mut gpu) = wgpu_backend_with(&w, opts) else {
                return;
            };
            let stepped = logits_token_by_token(&mut gpu, &tokens);
            let e_cpu = rel_l2(&stepped, &want);
            println!(
                "full widths, subgroups {subgroups}, one-word rows {one_word}: token by token vs CPU {e_cpu:.3e}"
            );
            assert!(e_cpu < 1e-3, "decode differs from the CPU by {e_cpu:.3e}");
            stepped_of.push(stepped);
        }
        assert_same_bits(
            &stepped_of[1],
            &stepped_of[0],
            "one-word rows change the logits",
        );
    }
}

/// Bound on the full widths' last logits with f16 activations (4 layers, 12 positions): 2^-11 a
/// store, ≈ 6 stores on a layer's longest path, in quadrature ≈ 7e-4 a layer, ≈ 1.4e-3 over 4
/// layers, with the tiny models' measured amplification (×2–5). lavapipe: token by token 6.6e-4
/// from the CPU, 1.1e-3 from one chunk (decode and prefill store different intermediates).
const F16_WIDE: f64 = 1e-2;

/// Restoring a snapshot gives back exactly the state it saved: the same logits and the same
/// greedy continuation, bit for bit, after the sequence moved on.
#[test]
fn snapshot_restore_is_exact() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 41);
    let vocab = w.config.vocab;
    let mut rng = Rng(3);
    let (first, second) = (rng.tokens(10, vocab), rng.tokens(9, vocab));
    let Some(mut gpu) = wgpu_backend(&w, 4) else {
        return;
    };
    let s = gpu.new_seq(64).unwrap();
    gpu.prefill(s, &first).unwrap();
    let snap = gpu.snapshot(s).unwrap();
    gpu.prefill(s, &second).unwrap();
    let after_second = gpu.logits(s).unwrap();
    let cont_a = greedy_tokens(&mut gpu, s, 6);
    gpu.restore(s, snap).unwrap();
    assert_eq!(gpu.seq_len(s).unwrap(), first.len());
    gpu.prefill(s, &second).unwrap();
    assert_eq!(
        gpu.logits(s).unwrap(),
        after_second,
        "logits after restore differ"
    );
    assert_eq!(
        greedy_tokens(&mut gpu, s, 6),
        cont_a,
        "continuation after restore differs"
    );
    // A second sequence restored from the same snapshot matches too.
    let s2 = gpu.new_seq(32).unwrap();
    gpu.restore(s2, snap).unwrap();
    gpu.prefill(s2, &second).unwrap();
    assert_eq!(gpu.logits(s2).unwrap(), after_second);
    gpu.drop_snapshot(snap);
    assert!(gpu.restore(s, snap).is_err());
}

/// Bad input is an error, never a panic: ids outside the vocabulary, a full context.
#[test]
fn bad_tokens_and_full_context_are_errors() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 51);
    let Some(mut gpu) = wgpu_backend(&w, 4) else {
        return;
    };
    let s = gpu.new_seq(4).unwrap();
    let err = gpu.prefill(s, &[w.config.vocab as u32]).unwrap_err();
    assert!(
        format!("{err:#}").contains("outside the vocabulary"),
        "{err:#}"
    );
    assert!(gpu.prefill(s, &[1, 2, 3, 4, 5]).is_err());
    assert!(gpu.logits(s).is_err(), "no logits before any token");
    gpu.prefill(s, &[1, 2, 3]).unwrap();
    let mut sampler = Sampler::new(SamplingParams::greedy());
    let err = gpu
        .decode(s, &mut sampler, 5, 0, &mut |_| Flow::Continue)
        .unwrap_err();
    assert!(format!("{err:#}").contains("full"), "{err:#}");
}

/// `--device auto` never takes a software adapter (lavapipe): asked not to, the backend refuses
/// one with a reason, so the server falls back to the CPU and can say why.
#[test]
fn a_software_adapter_is_refused_when_not_allowed() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 81);
    let Some(b) = wgpu_backend(&w, 4) else {
        return;
    };
    if b.adapter().device_type != wgpu::DeviceType::Cpu
        || std::env::var("LILY_WGPU_ADAPTER").is_ok()
    {
        println!(
            "SKIPPED: the best adapter here is hardware ({})",
            b.adapter().name
        );
        return;
    }
    drop(b);
    let opts = WgpuOptions {
        allow_software: false,
        ..WgpuOptions::default()
    };
    let err = WgpuBackend::new(&w, opts)
        .err()
        .expect("a software adapter must be refused");
    assert!(format!("{err:#}").contains("software renderer"), "{err:#}");
}

/// The synthetic MLX checkpoints quantise the shared expert as the routed ones, so it rides in
/// their stacks (one set of expert dispatches per layer); the logits tests above then cover
/// that path.
#[test]
fn shared_expert_rides_in_the_routed_stacks() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 91);
    assert!(lily_wgpu::weights::stack_shared(&w));
}

/// attend_gqa with a block's values requested after its key products (`attn_v_early`, its `VEARLY`) as a
/// decode step runs it (attn_prep's work inside, the new key and value from workgroup memory):
/// 258 positions prefilled, then 38 one token at a time, so that the new position falls in a
/// block's first 32 keys (the early values: positions 258–287 of the block from 256) and after
/// them (288–295: the rounds of 8 that follow, `tiny`'s blocks being 128 keys); the keys split
/// by `attn_split` and by prefill's 64-key rule. The logits after 262 and after 296 positions
/// bit for bit the same as without the switch (the same sums in the same order), and within the
/// plan's bound of the CPU's.
#[test]
fn attention_early_values_decode_the_same_bits() {
    let w = synth_model(Preset::Tiny, SynthFormat::Mlx, 23);
    let tokens = Rng(8).tokens(296, w.config.vocab);
    let mut cpu = CpuBackend::new(w.clone()).with_prefill_chunk(64);
    let cs = cpu.new_seq(320).unwrap();
    cpu.prefill(cs, &tokens).unwrap();
    let want = cpu.logits(cs).unwrap();
    let run = |attn_v_early: bool, attn_split: bool| {
        let opts = WgpuOptions {
            chunk: 128,
            all_logits_chunk: 32,
            attn_v_early,
            attn_split,
            ..WgpuOptions::default()
        };
        let mut gpu = wgpu_backend_with(&w, opts)?;
        let line = gpu.plan().describe();
        assert_eq!(
            line.contains("a block's values requested after its key products"),
            attn_v_early,
            "{line}"
        );
        let s = gpu.new_seq(320).unwrap();
        gpu.prefill(s, &tokens[..258]).unwrap();
        let mut got = Vec::new();
        for (i, t) in tokens[258..].iter().enumerate() {
            gpu.prefill(s, &[*t]).unwrap();
            if i == 3 || i == 37 {
                got.push(gpu.logits(s).unwrap());
            }
        }
        let bound = Bounds::of(gpu.plan()).logits;
        Some((got, bound))
    };
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for attn_split in [true, false] {
        let Some((off, bound)) = run(false, attn_split) else {
            return;
        };
        let (on, _) = run(true, attn_split).unwrap();
        let e = rel_l2(&on[1], &want);
        println!("attn_v_early, attn_split {attn_split}: last logits rel_l2 {e:.3e}");
        assert!(e < bound, "logits differ from the CPU by {e:.3e}");
        for (k, (a, b)) in on.iter().zip(&off).enumerate() {
            assert_eq!(
                bits(a),
                bits(b),
                "attn_v_early changed the logits (step {k}, attn_split {attn_split})"
            );
        }
    }
}
