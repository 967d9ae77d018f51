//! The CPU backend against the peer implementation (HF transformers, fp32) on synthetic `tiny`
//! checkpoints in both formats, and the forward pass's invariants: one-shot prefill == chunked
//! prefill == token-by-token decode; snapshot/restore gives identical next logits.
//!
//! Fixtures: crates/lily-core/tests/fixtures/parity/tiny-{hf,mlx}.{json,f32}, written by
//! scripts/reference_logits.py (its .json says the exact command and versions). The checkpoints
//! are regenerated here by the same deterministic `synth` that made them.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use lily_core::backend::{Backend, Flow};
use lily_core::checkpoint::{load, LoadOptions};
use lily_core::cpu::CpuBackend;
use lily_core::sampling::{Sampler, SamplingParams};
use lily_core::synth::{synth, Preset, SynthFormat, SynthOptions};
use lily_core::weights::ModelWeights;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/parity")
}

/// A fresh, unique temporary directory name (tests run in parallel).
fn temp_dir(tag: &str) -> PathBuf {
    static COUNTER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    std::env::temp_dir().join(format!("lily-{tag}-{}-{n}", std::process::id()))
}

/// A `tiny` checkpoint written into a fresh temporary directory.
fn synth_tiny(tag: &str, format: SynthFormat, seed: u64) -> PathBuf {
    let dir = temp_dir(tag);
    synth(&SynthOptions {
        preset: Preset::Tiny,
        format,
        seed,
        out: dir.clone(),
        tokenizer: None,
        layers: None,
    })
    .expect("synth tiny");
    dir
}

/// Logits after prefilling `ids` on the CPU backend.
fn last_logits(w: Arc<ModelWeights>, ids: &[u32]) -> Vec<f32> {
    let mut cpu = CpuBackend::new(w);
    let seq = cpu.new_seq(ids.len()).expect("seq");
    cpu.prefill(seq, ids).expect("prefill");
    cpu.logits(seq).expect("logits")
}

fn tiny(format: SynthFormat) -> Arc<ModelWeights> {
    let dir = synth_tiny("parity", format, 1);
    let w = load(&dir, &LoadOptions::default()).expect("load tiny");
    let _ = std::fs::remove_dir_all(&dir);
    Arc::new(w)
}

struct Fixture {
    sequences: Vec<Vec<u32>>,
    vocab: usize,
    logits: Vec<f32>,
}

fn read_fixture(name: &str) -> Fixture {
    let dir = fixture_dir();
    let meta: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join(format!("{name}.json"))).expect("fixture json"),
    )
    .expect("valid json");
    let bytes = std::fs::read(dir.join(format!("{name}.f32"))).expect("fixture logits");
    let logits = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let sequences = meta["sequences"]
        .as_array()
        .expect("sequences")
        .iter()
        .map(|s| {
            s.as_array()
                .expect("ids")
                .iter()
                .map(|v| v.as_u64().expect("id") as u32)
                .collect()
        })
        .collect();
    Fixture {
        sequences,
        vocab: meta["vocab"].as_u64().expect("vocab") as usize,
        logits,
    }
}

fn argmax(xs: &[f32]) -> usize {
    xs.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map(|(i, _)| i)
        .unwrap_or(0)
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
    (num / den).sqrt()
}

fn check_against_peer(format: SynthFormat, name: &str) {
    let fx = read_fixture(name);
    let w = tiny(format);
    assert_eq!(w.config.vocab, fx.vocab);
    let mut cpu = CpuBackend::new(w).with_prefill_chunk(48);
    let mut offset = 0;
    let (mut worst, mut agree, mut total) = (0f64, 0usize, 0usize);
    for ids in &fx.sequences {
        let seq = cpu.new_seq(ids.len()).expect("seq");
        let ours = cpu.prefill_all_logits(seq, ids).expect("prefill");
        let theirs = &fx.logits[offset * fx.vocab..(offset + ids.len()) * fx.vocab];
        for p in 0..ids.len() {
            let (a, b) = (
                &ours[p * fx.vocab..(p + 1) * fx.vocab],
                &theirs[p * fx.vocab..(p + 1) * fx.vocab],
            );
            worst = worst.max(rel_l2(a, b));
            agree += (argmax(a) == argmax(b)) as usize;
            total += 1;
        }
        offset += ids.len();
    }
    eprintln!(
        "{name}: worst per-position relative L2 error {worst:.3e}, top-1 agreement {agree}/{total}"
    );
    assert!(
        worst < 1e-3,
        "{name}: relative L2 error {worst:.3e} >= 1e-3"
    );
    assert_eq!(agree, total, "{name}: top-1 disagreement");
}

#[test]
fn hf_checkpoint_logits_match_hf_transformers() {
    check_against_peer(SynthFormat::Hf, "tiny-hf");
}

#[test]
fn mlx_checkpoint_logits_match_hf_transformers_on_dequantised_weights() {
    check_against_peer(SynthFormat::Mlx, "tiny-mlx");
}

fn prompt(n: usize, vocab: usize) -> Vec<u32> {
    let mut s = 0x2545_F491_4F6C_DD1Du64;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % vocab as u64) as u32
        })
        .collect()
}

#[test]
fn one_shot_chunked_and_token_by_token_prefill_agree() {
    let w = tiny(SynthFormat::Mlx);
    let ids = prompt(37, w.config.vocab);
    let logits_with_chunk = |chunk: usize| {
        let mut cpu = CpuBackend::new(w.clone()).with_prefill_chunk(chunk);
        let seq = cpu.new_seq(64).expect("seq");
        cpu.prefill(seq, &ids).expect("prefill");
        cpu.logits(seq).expect("logits")
    };
    let one_shot = logits_with_chunk(1000);
    for chunk in [1, 5, 16] {
        let other = logits_with_chunk(chunk);
        let err = rel_l2(&other, &one_shot);
        assert!(err < 1e-5, "chunk {chunk}: relative error {err:.3e}");
    }
    // Token-by-token through decode: feed the prompt's tokens as forced samples.
    let mut cpu = CpuBackend::new(w.clone());
    let seq = cpu.new_seq(64).expect("seq");
    cpu.prefill(seq, &ids[..1]).expect("prefill first");
    for &t in &ids[1..] {
        cpu.prefill(seq, &[t]).expect("step");
    }
    let err = rel_l2(&cpu.logits(seq).expect("logits"), &one_shot);
    assert!(err < 1e-5, "token by token: relative error {err:.3e}");
}

#[test]
fn snapshot_restore_gives_identical_next_logits() {
    let w = tiny(SynthFormat::Hf);
    let ids = prompt(20, w.config.vocab);
    let mut cpu = CpuBackend::new(w);
    let seq = cpu.new_seq(64).expect("seq");
    cpu.prefill(seq, &ids).expect("prefill");
    let snap = cpu.snapshot(seq).expect("snapshot");
    let mut first = Vec::new();
    let mut sampler = Sampler::new(SamplingParams::greedy());
    cpu.decode(seq, &mut sampler, 6, 0, &mut |s| {
        first.push(s.token);
        Flow::Continue
    })
    .expect("decode");
    let after_first = cpu.logits(seq).expect("logits");
    cpu.restore(seq, snap).expect("restore");
    assert_eq!(cpu.seq_len(seq).expect("len"), ids.len());
    let mut second = Vec::new();
    cpu.decode(seq, &mut sampler, 6, 0, &mut |s| {
        second.push(s.token);
        Flow::Continue
    })
    .expect("decode again");
    assert_eq!(first, second);
    assert_eq!(after_first, cpu.logits(seq).expect("logits"));
}

#[test]
fn bad_checkpoints_name_the_tensor() {
    let dir = synth_tiny("bad", SynthFormat::Hf, 2);
    // Rewrite the config so a tensor no longer fits its expected shape.
    let cfg_path = dir.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).expect("read")).expect("json");
    cfg["text_config"]["moe_intermediate_size"] = serde_json::json!(128);
    std::fs::write(&cfg_path, cfg.to_string()).expect("write");
    let err = format!(
        "{:#}",
        load(&dir, &LoadOptions::default()).expect_err("must fail")
    );
    assert!(
        err.contains("model.language_model.layers.0.mlp.experts.gate_up_proj"),
        "{err}"
    );
    std::fs::remove_file(dir.join("model.safetensors")).expect("rm");
    let err = format!(
        "{:#}",
        load(&dir, &LoadOptions::default()).expect_err("must fail")
    );
    assert!(err.contains("no .safetensors"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Rewrites a fused-expert HF checkpoint with the legacy per-expert keys
/// (`mlp.experts.{e}.{gate,up,down}_proj.weight`); both must give the same logits.
#[test]
fn per_expert_legacy_keys_load_like_fused_experts() {
    use safetensors::tensor::TensorView;
    use safetensors::{Dtype, SafeTensors};
    let dir = synth_tiny("legacy", SynthFormat::Hf, 1);
    let fused_w = Arc::new(load(&dir, &LoadOptions::default()).expect("load fused"));
    let file = dir.join("model.safetensors");
    let bytes = std::fs::read(&file).expect("read");
    let st = SafeTensors::deserialize(&bytes).expect("parse");
    let mut owned: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    for (name, view) in st.tensors() {
        let shape = view.shape().to_vec();
        let data = view.data();
        if let Some(prefix) = name.strip_suffix("experts.gate_up_proj") {
            let (e, two_i, h) = (shape[0], shape[1], shape[2]);
            let half = two_i / 2 * h * 2;
            for x in 0..e {
                let chunk = &data[x * 2 * half..(x + 1) * 2 * half];
                owned.push((
                    format!("{prefix}experts.{x}.gate_proj.weight"),
                    vec![two_i / 2, h],
                    chunk[..half].to_vec(),
                ));
                owned.push((
                    format!("{prefix}experts.{x}.up_proj.weight"),
                    vec![two_i / 2, h],
                    chunk[half..].to_vec(),
                ));
            }
        } else if let Some(prefix) = name.strip_suffix("experts.down_proj") {
            let (e, h, i) = (shape[0], shape[1], shape[2]);
            for x in 0..e {
                owned.push((
                    format!("{prefix}experts.{x}.down_proj.weight"),
                    vec![h, i],
                    data[x * h * i * 2..(x + 1) * h * i * 2].to_vec(),
                ));
            }
        } else {
            owned.push((name.to_string(), shape, data.to_vec()));
        }
    }
    let views: Vec<(String, TensorView)> = owned
        .iter()
        .map(|(n, s, d)| {
            let dtype = if n.ends_with("A_log") {
                Dtype::F32
            } else {
                Dtype::BF16
            };
            (
                n.clone(),
                TensorView::new(dtype, s.clone(), d).expect("view"),
            )
        })
        .collect();
    let out = safetensors::serialize(views, None).expect("serialize");
    // Unlink first: the fused weights still map the old file's pages.
    std::fs::remove_file(&file).expect("unlink");
    std::fs::write(&file, out).expect("write");
    let legacy_w = Arc::new(load(&dir, &LoadOptions::default()).expect("load legacy"));
    let _ = std::fs::remove_dir_all(&dir);
    let ids = prompt(12, fused_w.config.vocab);
    assert_eq!(last_logits(fused_w, &ids), last_logits(legacy_w, &ids));
}

#[test]
fn hf_checkpoint_quantised_at_load_uses_mlx_bit_widths_and_stays_close() {
    use lily_core::weights::{Mixer, WeightData};
    let dir = synth_tiny("quant", SynthFormat::Hf, 1);
    let dense = Arc::new(load(&dir, &LoadOptions::default()).expect("load"));
    let quant = Arc::new(
        load(
            &dir,
            &LoadOptions {
                quantize_bits: Some(4),
            },
        )
        .expect("load quantised"),
    );
    let _ = std::fs::remove_dir_all(&dir);
    let bits = |l: &lily_core::weights::Linear| match l.data {
        WeightData::Affine { bits, group, .. } => {
            assert_eq!(group, 64);
            bits
        }
        WeightData::Bf16 { .. } => 16,
    };
    assert_eq!(bits(&quant.embed), 4);
    assert_eq!(bits(&quant.lm_head), 4);
    for layer in &quant.layers {
        assert_eq!(bits(&layer.moe.router), 8);
        assert_eq!(bits(&layer.moe.shared_expert_gate), 8);
        assert_eq!(bits(&layer.moe.gate), 4);
        match &layer.mixer {
            Mixer::Attention(a) => assert_eq!(bits(&a.q_proj), 4),
            Mixer::DeltaNet(d) => assert_eq!(bits(&d.in_qkv), 4),
        }
    }
    // 4-bit weights move the logits (on a random 8-layer MoE, router flips amplify it: ~0.5
    // relative error measured), but they stay correlated with the bf16 model's.
    let ids = prompt(8, dense.config.vocab);
    let err = rel_l2(&last_logits(quant, &ids), &last_logits(dense, &ids));
    assert!(
        err > 0.0 && err < 0.9,
        "quantised vs bf16 relative error {err}"
    );
}
