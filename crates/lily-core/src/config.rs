//! The model description: every dimension of a `qwen3_5_moe` text model, read from `config.json`
//! (shared/docs/MODEL.md §1). Backends read shapes from here and nowhere else.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::Value;

/// Which token mixer a decoder layer uses (MODEL.md §2.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Gated DeltaNet (`linear_attention`), MODEL.md §2.5.
    DeltaNet,
    /// Gated full attention (`full_attention`), MODEL.md §2.4.
    Attention,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub hidden: usize,
    pub vocab: usize,
    pub layers: Vec<LayerKind>,
    pub rms_eps: f32,
    // Gated full attention.
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub rotary_dim: usize,
    pub rope_theta: f64,
    // Gated DeltaNet.
    pub dn_k_heads: usize,
    pub dn_v_heads: usize,
    pub dn_k_dim: usize,
    pub dn_v_dim: usize,
    pub conv_kernel: usize,
    // Mixture of experts.
    pub n_experts: usize,
    pub top_k: usize,
    pub expert_inter: usize,
    pub shared_inter: usize,
    pub max_position: usize,
    /// End-of-sequence ids: the config's own plus 248046/248044 when they exist (MODEL.md §4).
    pub eos_ids: Vec<u32>,
}

impl ModelConfig {
    /// Reads `DIR/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("cannot read model config {}", path.display()))?;
        let json: Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", path.display()))?;
        Self::from_json(&json).with_context(|| format!("in {}", path.display()))
    }

    /// Accepts the multimodal wrapper (`text_config` inside) or a bare text config.
    pub fn from_json(json: &Value) -> Result<Self> {
        let top_type = json.get("model_type").and_then(Value::as_str).unwrap_or("");
        let text = match json.get("text_config") {
            Some(t) if t.is_object() => t,
            _ => json,
        };
        let text_type = text
            .get("model_type")
            .and_then(Value::as_str)
            .unwrap_or(top_type);
        if !matches!(text_type, "qwen3_5_moe" | "qwen3_5_moe_text") {
            bail!("model_type {text_type:?} is not supported: Lily runs the qwen3_5_moe family (Qwen3.5/3.6 MoE)");
        }
        let f = Fields(text);
        let hidden = f.usize("hidden_size")?;
        let n_layers = f.usize("num_hidden_layers")?;
        let layers = match text.get("layer_types") {
            Some(Value::Array(kinds)) => {
                if kinds.len() != n_layers {
                    bail!(
                        "layer_types has {} entries but num_hidden_layers is {n_layers}",
                        kinds.len()
                    );
                }
                kinds
                    .iter()
                    .enumerate()
                    .map(|(i, k)| match k.as_str() {
                        Some("linear_attention") => Ok(LayerKind::DeltaNet),
                        Some("full_attention") => Ok(LayerKind::Attention),
                        other => bail!("layer_types[{i}] = {other:?}: expected \"linear_attention\" or \"full_attention\""),
                    })
                    .collect::<Result<Vec<_>>>()?
            }
            Some(_) => bail!("layer_types must be an array of strings"),
            None => {
                let every = f.usize_or("full_attention_interval", 4)?;
                if every == 0 {
                    bail!("full_attention_interval must be > 0");
                }
                (0..n_layers)
                    .map(|i| {
                        if (i + 1) % every == 0 {
                            LayerKind::Attention
                        } else {
                            LayerKind::DeltaNet
                        }
                    })
                    .collect()
            }
        };
        let head_dim = f.usize("head_dim")?;
        let rope = text
            .get("rope_parameters")
            .or_else(|| text.get("rope_scaling"));
        let rope_field = |name: &str| rope.and_then(|r| r.get(name)).or_else(|| text.get(name));
        let partial = rope_field("partial_rotary_factor")
            .and_then(Value::as_f64)
            .unwrap_or(0.25);
        let rope_theta = rope_field("rope_theta")
            .and_then(Value::as_f64)
            .unwrap_or(10_000_000.0);
        if let Some(kind) = rope
            .and_then(|r| r.get("rope_type"))
            .and_then(Value::as_str)
        {
            if kind != "default" {
                bail!("rope_type {kind:?} is not supported (only \"default\")");
            }
        }
        let rotary_dim = (head_dim as f64 * partial).round() as usize;
        if rotary_dim == 0 || !rotary_dim.is_multiple_of(2) || rotary_dim > head_dim {
            bail!("partial_rotary_factor {partial} gives rotary dim {rotary_dim} for head_dim {head_dim}: must be even and in 2..=head_dim");
        }
        if let Some(false) = text.get("attn_output_gate").and_then(Value::as_bool) {
            bail!("attn_output_gate = false is not supported: the qwen3_5_moe attention is gated");
        }
        if let Some(true) = text.get("attention_bias").and_then(Value::as_bool) {
            bail!("attention_bias = true is not supported");
        }
        if let Some(act) = text.get("hidden_act").and_then(Value::as_str) {
            if act != "silu" {
                bail!("hidden_act {act:?} is not supported (only \"silu\")");
            }
        }
        let mut eos_ids: Vec<u32> = Vec::new();
        for src in [text.get("eos_token_id"), json.get("eos_token_id")]
            .into_iter()
            .flatten()
        {
            match src {
                Value::Number(n) => eos_ids.extend(n.as_u64().map(|v| v as u32)),
                Value::Array(a) => {
                    eos_ids.extend(a.iter().filter_map(Value::as_u64).map(|v| v as u32))
                }
                _ => {}
            }
        }
        let vocab = f.usize("vocab_size")?;
        for id in [248046u32, 248044] {
            if (id as usize) < vocab && !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
        eos_ids.retain(|&id| (id as usize) < vocab);
        eos_ids.dedup();

        let cfg = ModelConfig {
            hidden,
            vocab,
            layers,
            rms_eps: f.f64_or("rms_norm_eps", 1e-6)? as f32,
            n_heads: f.usize("num_attention_heads")?,
            n_kv_heads: f.usize("num_key_value_heads")?,
            head_dim,
            rotary_dim,
            rope_theta,
            dn_k_heads: f.usize("linear_num_key_heads")?,
            dn_v_heads: f.usize("linear_num_value_heads")?,
            dn_k_dim: f.usize("linear_key_head_dim")?,
            dn_v_dim: f.usize("linear_value_head_dim")?,
            conv_kernel: f.usize_or("linear_conv_kernel_dim", 4)?,
            n_experts: f.usize("num_experts")?,
            top_k: f.usize("num_experts_per_tok")?,
            expert_inter: f.usize("moe_intermediate_size")?,
            shared_inter: f.usize("shared_expert_intermediate_size")?,
            max_position: f.usize_or("max_position_embeddings", 262_144)?,
            eos_ids,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<()> {
        if self.n_kv_heads == 0 || !self.n_heads.is_multiple_of(self.n_kv_heads) {
            bail!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                self.n_heads,
                self.n_kv_heads
            );
        }
        if self.dn_k_heads == 0 || !self.dn_v_heads.is_multiple_of(self.dn_k_heads) {
            bail!(
                "linear_num_value_heads {} is not a multiple of linear_num_key_heads {}",
                self.dn_v_heads,
                self.dn_k_heads
            );
        }
        if self.top_k == 0 || self.top_k > self.n_experts {
            bail!(
                "num_experts_per_tok {} must be in 1..=num_experts ({})",
                self.top_k,
                self.n_experts
            );
        }
        if self.conv_kernel < 1 {
            bail!("linear_conv_kernel_dim must be >= 1");
        }
        for (name, v) in [
            ("hidden_size", self.hidden),
            ("vocab_size", self.vocab),
            ("head_dim", self.head_dim),
        ] {
            if v == 0 {
                bail!("{name} must be > 0");
            }
        }
        Ok(())
    }

    pub fn n_layers(&self) -> usize {
        self.layers.len()
    }
    /// Query heads per KV head (GQA group).
    pub fn gqa_group(&self) -> usize {
        self.n_heads / self.n_kv_heads
    }
    /// DeltaNet key dim (all Q or K heads): Hk · dk.
    pub fn dn_key_dim(&self) -> usize {
        self.dn_k_heads * self.dn_k_dim
    }
    /// DeltaNet value dim: Hv · dv.
    pub fn dn_value_dim(&self) -> usize {
        self.dn_v_heads * self.dn_v_dim
    }
    /// Channels of the causal conv: q, k and v together.
    pub fn conv_dim(&self) -> usize {
        2 * self.dn_key_dim() + self.dn_value_dim()
    }
    pub fn n_attention_layers(&self) -> usize {
        self.layers
            .iter()
            .filter(|k| **k == LayerKind::Attention)
            .count()
    }
    pub fn n_deltanet_layers(&self) -> usize {
        self.layers
            .iter()
            .filter(|k| **k == LayerKind::DeltaNet)
            .count()
    }
}

struct Fields<'a>(&'a Value);

impl Fields<'_> {
    fn usize(&self, name: &str) -> Result<usize> {
        match self.0.get(name) {
            Some(v) => v.as_u64().map(|n| n as usize).with_context(|| {
                format!("config field {name} must be a non-negative integer, got {v}")
            }),
            None => bail!("config field {name} is missing"),
        }
    }
    fn usize_or(&self, name: &str, default: usize) -> Result<usize> {
        match self.0.get(name) {
            None | Some(Value::Null) => Ok(default),
            Some(_) => self.usize(name),
        }
    }
    fn f64_or(&self, name: &str, default: f64) -> Result<f64> {
        match self.0.get(name) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v
                .as_f64()
                .with_context(|| format!("config field {name} must be a number, got {v}")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn real_text_config() -> Value {
        let mut layer_types = Vec::new();
        for _ in 0..10 {
            layer_types.extend(["linear_attention"; 3]);
            layer_types.push("full_attention");
        }
        serde_json::json!({
            "architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "model_type": "qwen3_5_moe",
            "text_config": {
                "model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40,
                "layer_types": layer_types, "vocab_size": 248320, "num_attention_heads": 16,
                "num_key_value_heads": 2, "head_dim": 256, "rms_norm_eps": 1e-6,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                    "mrope_interleaved": true, "mrope_section": [11, 11, 10]},
                "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 256,
                "num_experts_per_tok": 8, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
                "eos_token_id": 248044, "attn_output_gate": true, "hidden_act": "silu"
            }
        })
    }

    #[test]
    fn reads_the_real_wrapper_config() {
        let cfg = ModelConfig::from_json(&real_text_config()).expect("valid config");
        assert_eq!(cfg.hidden, 2048);
        assert_eq!(cfg.n_attention_layers(), 10);
        assert_eq!(cfg.layers[3], LayerKind::Attention);
        assert_eq!(cfg.layers[38], LayerKind::DeltaNet);
        assert_eq!(cfg.rotary_dim, 64);
        assert_eq!(cfg.conv_dim(), 8192);
        assert_eq!(cfg.gqa_group(), 8);
        assert_eq!(cfg.eos_ids, vec![248044, 248046]);
    }

    #[test]
    fn missing_field_is_named() {
        let mut json = real_text_config();
        json["text_config"]
            .as_object_mut()
            .expect("object")
            .remove("num_experts");
        let err = format!("{:#}", ModelConfig::from_json(&json).unwrap_err());
        assert!(err.contains("num_experts"), "{err}");
    }

    #[test]
    fn other_families_are_refused() {
        let json = serde_json::json!({"model_type": "llama", "hidden_size": 16});
        let err = format!("{:#}", ModelConfig::from_json(&json).unwrap_err());
        assert!(err.contains("llama"), "{err}");
    }
}
