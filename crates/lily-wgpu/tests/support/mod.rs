//! Pieces the wgpu test binaries share: a seeded generator, a synthetic model, the backend or a
//! skip (outside CI) where no adapter exists.
#![allow(dead_code)] // each binary uses its own subset

use std::sync::Arc;

use lily_core::checkpoint::{self, LoadOptions};
use lily_core::synth::{synth, Preset, SynthFormat, SynthOptions};
use lily_core::weights::ModelWeights;
use lily_wgpu::{DeviceLimits, WgpuBackend, WgpuOptions};

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
/// adapter exists; under CI=true a missing adapter fails the test.
pub fn wgpu_backend_with(w: &ModelWeights, opts: WgpuOptions) -> Option<WgpuBackend> {
    let opts = WgpuOptions {
        limits: limits(),
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
