//! What a checkpoint may hold: non-finite norm weights or quantisation scales/biases are refused at
//! load with the tensor's name, not served as garbage (issue 16 item 7). The config side is in
//! config.rs's unit tests.

use std::path::{Path, PathBuf};

use lily_core::checkpoint::{load, LoadOptions};
use lily_core::synth::{synth, Preset, SynthFormat, SynthOptions};

fn temp_dir(tag: &str) -> PathBuf {
    static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    std::env::temp_dir().join(format!("lily-{tag}-{}-{n}", std::process::id()))
}

fn synth_tiny(tag: &str, format: SynthFormat) -> PathBuf {
    let dir = temp_dir(tag);
    synth(&SynthOptions {
        preset: Preset::Tiny,
        format,
        seed: 3,
        out: dir.clone(),
        tokenizer: None,
        layers: None,
    })
    .expect("synth tiny");
    dir
}

/// Overwrites element `index` of tensor `name` in DIR/model.safetensors with `value`.
fn poke(dir: &Path, name: &str, index: usize, value: f32) {
    let path = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&path).expect("read");
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).expect("header");
    let t = &header[name];
    let start = 8 + n + t["data_offsets"][0].as_u64().expect("offsets") as usize;
    match t["dtype"].as_str().expect("dtype") {
        "BF16" => {
            let at = start + 2 * index;
            bytes[at..at + 2].copy_from_slice(&((value.to_bits() >> 16) as u16).to_le_bytes());
        }
        "F32" => {
            let at = start + 4 * index;
            bytes[at..at + 4].copy_from_slice(&value.to_le_bytes());
        }
        other => panic!("{name}: dtype {other}"),
    }
    std::fs::write(&path, bytes).expect("write");
}

fn load_error(dir: &Path) -> String {
    format!(
        "{:#}",
        load(dir, &LoadOptions::default()).expect_err("must be refused")
    )
}

#[test]
fn non_finite_norm_weights_are_refused_by_name() {
    for (format, tensor) in [
        (SynthFormat::Mlx, "language_model.model.norm.weight"),
        (
            SynthFormat::Mlx,
            "language_model.model.layers.1.input_layernorm.weight",
        ),
        (
            SynthFormat::Mlx,
            "language_model.model.layers.3.self_attn.q_norm.weight",
        ),
        (
            SynthFormat::Mlx,
            "language_model.model.layers.0.linear_attn.norm.weight",
        ),
        (
            SynthFormat::Hf,
            "model.language_model.layers.0.post_attention_layernorm.weight",
        ),
    ] {
        for value in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let dir = synth_tiny("nonfinite-norm", format);
            load(&dir, &LoadOptions::default()).expect("the untouched checkpoint loads");
            poke(&dir, tensor, 5, value);
            let err = load_error(&dir);
            assert!(
                err.contains(tensor) && err.contains("non-finite"),
                "{tensor} = {value}: {err}"
            );
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
}

#[test]
fn non_finite_quantisation_scales_and_biases_are_refused_by_name() {
    for tensor in [
        "language_model.model.embed_tokens.scales",
        "language_model.lm_head.biases",
        "language_model.model.layers.2.mlp.switch_mlp.down_proj.scales",
        "language_model.model.layers.3.self_attn.o_proj.biases",
        "language_model.model.layers.0.mlp.gate.scales",
    ] {
        let dir = synth_tiny("nonfinite-scales", SynthFormat::Mlx);
        poke(&dir, tensor, 7, f32::NAN);
        let err = load_error(&dir);
        assert!(
            err.contains(tensor) && err.contains("non-finite"),
            "{tensor}: {err}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// `LILY_TIME_LOAD=DIR cargo test --release --test checkpoint_validation -- --ignored --nocapture`:
/// how long `load` takes on a model directory (the scales/biases scan included).
#[test]
#[ignore = "timing, run by hand on a model directory"]
fn time_load() {
    let dir = PathBuf::from(std::env::var("LILY_TIME_LOAD").expect("LILY_TIME_LOAD=DIR"));
    for _ in 0..3 {
        let t = std::time::Instant::now();
        load(&dir, &LoadOptions::default()).expect("load");
        eprintln!(
            "load {}: {:.1} ms",
            dir.display(),
            t.elapsed().as_secs_f64() * 1e3
        );
    }
}
