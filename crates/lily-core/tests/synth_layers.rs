//! `synth --layers N`: a preset's widths with another layer count (used to time full-width kernels
//! on a model a tenth of the full checkpoint's size). The checkpoint must load like any other,
//! with the pattern of three DeltaNet layers then one attention layer, and run.

use lily_core::backend::Backend;
use lily_core::checkpoint::{self, LoadOptions};
use lily_core::config::LayerKind;
use lily_core::cpu::CpuBackend;
use lily_core::synth::{preset_text_config, synth, with_layers, Preset, SynthFormat, SynthOptions};
use std::sync::Arc;

#[test]
fn a_tiny_checkpoint_with_eight_layers_loads_and_runs() {
    let dir = std::env::temp_dir().join(format!("lily-synth-layers-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    synth(&SynthOptions {
        preset: Preset::Tiny,
        format: SynthFormat::Mlx,
        seed: 5,
        out: dir.clone(),
        tokenizer: None,
        layers: Some(8),
    })
    .expect("synth tiny with 8 layers");
    let w = checkpoint::load(&dir, &LoadOptions::default()).expect("load");
    let _ = std::fs::remove_dir_all(&dir);
    let kinds: Vec<LayerKind> = w.config.layers.clone();
    assert_eq!(kinds.len(), 8);
    for (i, k) in kinds.iter().enumerate() {
        let want = if i % 4 == 3 {
            LayerKind::Attention
        } else {
            LayerKind::DeltaNet
        };
        assert_eq!(*k, want, "layer {i}");
    }
    assert_eq!(w.layers.len(), 8);
    // The preset's widths are kept.
    let tiny = preset_text_config(Preset::Tiny);
    assert_eq!(
        w.config.hidden as u64,
        tiny["hidden_size"].as_u64().unwrap()
    );
    let mut cpu = CpuBackend::new(Arc::new(w));
    let seq = cpu.new_seq(8).expect("seq");
    cpu.prefill(seq, &[3, 1, 4, 1, 5]).expect("prefill");
    let logits = cpu.logits(seq).expect("logits");
    assert!(logits.iter().all(|v| v.is_finite()));
}

#[test]
fn a_layer_count_that_is_not_a_multiple_of_four_is_refused() {
    for bad in [0usize, 3, 6, 10] {
        let err = with_layers(preset_text_config(Preset::Tiny), bad)
            .expect_err("not a multiple of 4")
            .to_string();
        assert!(
            err.contains("--layers") && err.contains(&bad.to_string()),
            "{err}"
        );
    }
}
