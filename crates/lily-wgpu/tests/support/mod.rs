//! Pieces the wgpu test binaries share: a seeded generator, a synthetic model, the backend or a
//! skip (outside CI) where no adapter exists.
#![allow(dead_code)] // each binary uses its own subset

use std::sync::Arc;

use lily_core::checkpoint::{self, LoadOptions};
use lily_core::synth::{synth, Preset, SynthFormat, SynthOptions};
use lily_core::weights::ModelWeights;
use lily_wgpu::probes::F16_STORE;
use lily_wgpu::{DeviceLimits, Plan, WgpuBackend, WgpuOptions};

pub struct Rng(pub u64);

impl Rng {
    pub fn below(&mut self, n: usize) -> usize {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        ((z ^ (z >> 31)) % n as u64) as usize
    }
    pub fn tokens(&mut self, n: usize, vocab: usize) -> Vec<u32> {
        (0..n).map(|_| self.below(vocab) as u32).collect()
    }
}

pub fn synth_model(preset: Preset, format: SynthFormat, seed: u64) -> Arc<ModelWeights> {
    synth_model_layers(preset, format, seed, None)
}

/// `synth_model` with `layers` layers (a multiple of 4) instead of the preset's, its widths kept.
pub fn synth_model_layers(
    preset: Preset,
    format: SynthFormat,
    seed: u64,
    layers: Option<usize>,
) -> Arc<ModelWeights> {
    let dir = std::env::temp_dir().join(format!(
        "lily-wgpu-test-{preset:?}-{format:?}-{seed}-{layers:?}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    synth(&SynthOptions {
        preset,
        format,
        seed,
        out: dir.clone(),
        tokenizer: None,
        layers,
    })
    .unwrap();
    let w = checkpoint::load(&dir, &LoadOptions::default()).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    Arc::new(w)
}

/// The limits this test binary creates devices with: Apple's in tests/apple_limits.rs (which
/// runs tests/model.rs's tests as its module `model`), the adapter's elsewhere.
pub fn limits() -> DeviceLimits {
    if module_path!().starts_with("apple_limits::") {
        DeviceLimits::Apple
    } else {
        DeviceLimits::Adapter
    }
}

/// The backend with `opts` (under `limits()`), or `None` (test skipped, with a message) where no
/// adapter exists; under CI=true a missing adapter fails the test. Under Apple's limits the
/// `auto` choices resolve as on an Apple GPU (`WgpuOptions::auto_as_apple`: f16 activations and
/// KV cache where the adapter has SHADER_F16, lavapipe does), so tests/apple_limits.rs runs the
/// configuration a Mac gets; `Bounds` gives each test its tolerance for what the plan took.
pub fn wgpu_backend_with(w: &ModelWeights, opts: WgpuOptions) -> Option<WgpuBackend> {
    let opts = WgpuOptions {
        limits: limits(),
        auto_as_apple: limits() == DeviceLimits::Apple,
        ..opts
    };
    match WgpuBackend::new(w, opts) {
        Ok(b) => {
            println!("adapter: {}", lily_wgpu::describe_adapter(b.adapter()));
            println!("plan: {}", b.plan().describe());
            Some(b)
        }
        Err(e) => {
            let ci = matches!(std::env::var("CI").as_deref(), Ok("true") | Ok("1"));
            if ci {
                panic!("CI needs a wgpu adapter (lavapipe: apt-get install mesa-vulkan-drivers libvulkan1): {e:#}");
            }
            println!("SKIPPED: no usable wgpu adapter here: {e:#}");
            None
        }
    }
}

/// Relative L2 distance of `got` from `want` (panics on a non-finite value of `got`).
pub fn rel_l2(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    if let Some(i) = got.iter().position(|v| !v.is_finite()) {
        panic!("element {i} is {}", got[i]);
    }
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        num += ((g - w) as f64).powi(2);
        den += (*w as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

/// How far a configuration (`plan`, as resolved) may be from the CPU's fp32: the logits' relative
/// L2 over a test's positions and a kernel's relative L2 against the host's f64.
#[derive(Clone, Copy, Debug)]
pub struct Bounds {
    pub logits: f64,
    pub kernel: f64,
    /// Two runs of the same model that store different intermediates (prefill's chunks against
    /// token by token): 2e-5 where only the f32 sums' order differs.
    pub paths: f64,
    /// Greedy picks: `None`, the CPU's own tokens exactly (fp32); with f16 activations, how near
    /// (× the row's RMS) the pick's logit must be to the CPU's largest on the same tokens: f16
    /// may flip a near-tied pick of a random-weight model, after which the sequences part
    /// (`model.rs` `assert_greedy_as_cpu`).
    pub near_tie: Option<f32>,
}

impl Bounds {
    /// fp32 activations (any KV cache: the f16 cache alone is within 1e-3,
    /// `kv_cache_in_f16_and_f32_match_cpu`): the logits within 1e-3, a kernel 1e-5. f16
    /// activations (Apple's default; tests/apple_limits.rs on lavapipe): the logits within 5e-2
    /// (`activations_in_f16_and_f32_match_cpu`: 4.5e-3 tiny MLX, 1.5e-2 tiny HF; selftest's
    /// `small` 2.8e-2 with the f16 KV cache too), a kernel within its output's f16 store
    /// (`F16_STORE`), two paths within 5e-2.
    pub fn of(plan: &Plan) -> Bounds {
        if plan.act_f16 {
            // Picks within 4 × the logits' bound of the row's RMS: the difference of two
            // logits' errors at the bound's size, with room.
            Bounds {
                logits: 5e-2,
                kernel: F16_STORE,
                paths: 5e-2,
                near_tie: Some(0.2),
            }
        } else {
            Bounds {
                logits: 1e-3,
                kernel: 1e-5,
                paths: 2e-5,
                near_tie: None,
            }
        }
    }
}
