//! The bytes one decode step has to move (docs/PERFORMANCE.md §2): the floor a batch-1
//! decoder is measured against. Counted from the checkpoint as stored (packed words, scales and
//! biases), so 4-bit, 8-bit and bf16 weights each count what they are.

use crate::config::ModelConfig;
use crate::cpu::ops::KvFormat;
use crate::weights::{Linear, Mixer, ModelWeights, WeightData};

/// Bytes read (and written) by one decode step at a given context.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeBytes {
    /// Active weights: every projection of every layer, the routed experts' share (top_k of
    /// n_experts), router, shared expert, norms, lm_head and one embedding row.
    pub weights: u64,
    /// Recurrent state: DeltaNet's fp32 state and conv state, read and written.
    pub state: u64,
    /// KV cache: every cached key and value read, the new token's written.
    pub kv: u64,
}

impl DecodeBytes {
    pub fn total(&self) -> u64 {
        self.weights + self.state + self.kv
    }
}

/// The bytes a matrix (or a stack of expert matrices) occupies as stored.
pub fn stored_bytes(l: &Linear) -> u64 {
    match &l.data {
        WeightData::Affine {
            packed,
            scales,
            biases,
            ..
        } => (packed.len() + scales.len() + biases.len()) as u64,
        WeightData::Bf16 { data } => data.len() as u64,
    }
}

fn f32s(v: &[f32]) -> u64 {
    4 * v.len() as u64
}

/// The bytes one cached row (one position, one KV head, `head_dim` values) takes in `format`:
/// fp32 for `Full`, bf16 (or f16) for `Bf16`, int8 values and their f32 scale for `Int8Row`
/// (MODEL.md §2.4; CUDA's padding of the scales to 16 bytes a position is not counted).
pub fn kv_row_bytes(format: KvFormat, head_dim: usize) -> usize {
    match format {
        KvFormat::Full => 4 * head_dim,
        KvFormat::Bf16 => 2 * head_dim,
        KvFormat::Int8Row => head_dim + 4,
    }
}

/// What one decode step moves with `ctx` tokens already in the cache, the cache's rows in
/// `kv` (`kv_row_bytes`).
pub fn decode_bytes(w: &ModelWeights, ctx: usize, kv: KvFormat) -> DecodeBytes {
    let cfg: &ModelConfig = &w.config;
    let mut weights = stored_bytes(&w.embed) / cfg.vocab.max(1) as u64
        + f32s(&w.final_norm)
        + stored_bytes(&w.lm_head);
    for layer in &w.layers {
        weights += f32s(&layer.input_norm) + f32s(&layer.post_norm);
        weights += match &layer.mixer {
            Mixer::Attention(a) => {
                [&a.q_proj, &a.k_proj, &a.v_proj, &a.o_proj]
                    .iter()
                    .map(|l| stored_bytes(l))
                    .sum::<u64>()
                    + f32s(&a.q_norm)
                    + f32s(&a.k_norm)
            }
            Mixer::DeltaNet(d) => {
                [&d.in_qkv, &d.in_z, &d.in_b, &d.in_a, &d.out_proj]
                    .iter()
                    .map(|l| stored_bytes(l))
                    .sum::<u64>()
                    + f32s(&d.conv)
                    + f32s(&d.a_log)
                    + f32s(&d.dt_bias)
                    + f32s(&d.norm)
            }
        };
        let m = &layer.moe;
        let routed: u64 = [&m.gate, &m.up, &m.down]
            .iter()
            .map(|l| stored_bytes(l))
            .sum();
        weights += routed * cfg.top_k as u64 / cfg.n_experts.max(1) as u64;
        weights += [
            &m.router,
            &m.shared_gate,
            &m.shared_up,
            &m.shared_down,
            &m.shared_expert_gate,
        ]
        .iter()
        .map(|l| stored_bytes(l))
        .sum::<u64>();
    }
    let dn = cfg.n_deltanet_layers() as u64;
    let recurrent = (cfg.dn_v_heads * cfg.dn_k_dim * cfg.dn_v_dim * 4) as u64;
    let conv = (cfg.conv_kernel.saturating_sub(1) * cfg.conv_dim() * 4) as u64;
    let state = 2 * dn * (recurrent + conv);
    let row = (2 * cfg.n_kv_heads * kv_row_bytes(kv, cfg.head_dim)) as u64;
    let kv = cfg.n_attention_layers() as u64 * row * (ctx as u64 + 1);
    DecodeBytes { weights, state, kv }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::{load, LoadOptions};
    use crate::synth::{synth, Preset, SynthFormat, SynthOptions};

    /// Against arithmetic done by hand from the tiny preset's shapes (MLX, 4-bit groups of 64 with
    /// bf16 scale and bias: 4.5 bits per weight; the router and shared-expert gate 8-bit: 8.5).
    #[test]
    fn decode_bytes_of_the_tiny_model_match_its_shapes() {
        let dir = std::env::temp_dir().join(format!("lily-traffic-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        synth(&SynthOptions {
            preset: Preset::Tiny,
            format: SynthFormat::Mlx,
            seed: 5,
            out: dir.clone(),
            tokenizer: None,
            layers: None,
        })
        .unwrap();
        let w = load(&dir, &LoadOptions::default()).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let c = &w.config;
        // Tiny: hidden 128, 8 layers (6 DeltaNet, 2 attention), vocab 1024, 4 q / 2 kv heads of
        // 64, DeltaNet 2 k / 4 v heads of 32, conv 4, 16 experts top 4 of 64, shared 64.
        let (h, v) = (128u64, 1024u64);
        let q4 = |rows: u64, cols: u64| rows * cols / 2 + rows * cols / 64 * 4;
        let q8 = |rows: u64, cols: u64| rows * cols + rows * cols / 64 * 4;
        let attn = q4(2 * 4 * 64, h) + 2 * q4(2 * 64, h) + q4(h, 4 * 64) + 2 * 64 * 4;
        let conv_dim = 2 * 2 * 32 + 4 * 32;
        let dn = q4(conv_dim, h)
            + q4(4 * 32, h)
            + 2 * q4(4, h)
            + q4(h, 4 * 32)
            + (conv_dim * 4 + 4 + 4 + 32) * 4;
        let moe =
            4 * (2 * q4(64, h) + q4(h, 64)) + q8(16, h) + 2 * q4(64, h) + q4(h, 64) + q8(1, h);
        let norms = 2 * h * 4;
        let want_weights = q4(v, h) / v + h * 4 + q4(v, h) + 6 * dn + 2 * attn + 8 * (moe + norms);
        let b = decode_bytes(&w, 1000, KvFormat::Bf16);
        assert_eq!(c.n_deltanet_layers(), 6);
        assert_eq!(b.weights, want_weights);
        assert_eq!(b.state, 2 * 6 * (4 * 32 * 32 * 4 + 3 * conv_dim * 4));
        assert_eq!(b.kv, 2 * (2 * 2 * 64 * 2) * 1001);
        assert_eq!(b.total(), b.weights + b.state + b.kv);
        // int8 rows: 64 values and one f32 scale a (position, KV head) row; fp32: 4 bytes a value.
        let b8 = decode_bytes(&w, 1000, KvFormat::Int8Row);
        assert_eq!(b8.kv, 2 * (2 * 2 * (64 + 4)) * 1001);
        assert_eq!(b8.weights + b8.state, b.weights + b.state);
        assert_eq!(decode_bytes(&w, 1000, KvFormat::Full).kv, 2 * b.kv);
        // `bench` counts the format the backend reports: the CPU reference's is the one it keeps.
        let w = std::sync::Arc::new(w);
        for f in [KvFormat::Full, KvFormat::Bf16, KvFormat::Int8Row] {
            let cpu = crate::cpu::CpuBackend::new(w.clone()).with_kv_format(f);
            assert_eq!(crate::backend::Backend::kv_format(&cpu), f);
        }
    }
}
