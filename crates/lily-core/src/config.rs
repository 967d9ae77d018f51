//! The model description: every dimension of a `qwen3_5_moe` text model, read from `config.json`
//! (docs/MODEL.md §1). Backends read shapes from here and nowhere else.

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
        if n_layers == 0 {
            bail!("num_hidden_layers must be > 0");
        }
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
        let vocab = f.usize("vocab_size")?;
        let mut eos_ids: Vec<u32> = Vec::new();
        for src in [text.get("eos_token_id"), json.get("eos_token_id")]
            .into_iter()
            .flatten()
        {
            let ids: &[Value] = match src {
                Value::Null => &[],
                Value::Array(a) => a,
                one => std::slice::from_ref(one),
            };
            for id in ids {
                match id.as_u64() {
                    Some(v) if (v as usize) < vocab => eos_ids.push(v as u32),
                    _ => {
                        bail!("eos_token_id {id} is not a token id of the vocabulary (0..{vocab})")
                    }
                }
            }
        }
        for id in [248046u32, 248044] {
            if (id as usize) < vocab && !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
        eos_ids.sort_unstable();
        eos_ids.dedup();

        let rms_eps = f.f64_or("rms_norm_eps", 1e-6)? as f32;
        if !(rms_eps.is_finite() && rms_eps > 0.0) {
            bail!("rms_norm_eps {rms_eps} must be a positive finite number (as f32)");
        }
        let cfg = ModelConfig {
            hidden,
            vocab,
            layers,
            rms_eps,
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
        for name in ["quantization", "quantization_config"] {
            for src in [json.get(name), text.get(name)].into_iter().flatten() {
                cfg.check_quantization(name, src)?;
            }
        }
        Ok(cfg)
    }

    /// An MLX `quantization` block (or `quantization_config` of that shape): affine, 4 or 8 bits,
    /// groups of 64 that divide every matrix's input dimension — what the kernels run. Per-tensor
    /// overrides (`"…mlp.gate": {"bits": 8, "group_size": 64}`) are held to the same rules. A
    /// transformers-style block of another method (`quant_method`) is left to the tensor checks.
    fn check_quantization(&self, name: &str, q: &Value) -> Result<()> {
        let Some(q) = q.as_object() else {
            return Ok(());
        };
        if q.contains_key("quant_method") && !q.contains_key("bits") {
            return Ok(());
        }
        if let Some(mode) = q.get("mode") {
            if mode.as_str() != Some("affine") {
                bail!("{name}.mode {mode} is not supported (only \"affine\")");
            }
        }
        self.check_bits_group(name, q)?;
        for (key, v) in q {
            if let Some(o) = v.as_object() {
                if o.contains_key("bits") || o.contains_key("group_size") {
                    self.check_bits_group(&format!("{name}.{key}"), o)?;
                }
            }
        }
        Ok(())
    }

    fn check_bits_group(&self, at: &str, q: &serde_json::Map<String, Value>) -> Result<()> {
        if let Some(bits) = q.get("bits") {
            if !matches!(bits.as_u64(), Some(4 | 8)) {
                bail!("{at}.bits {bits} is not supported (4 or 8)");
            }
        }
        if let Some(group) = q.get("group_size") {
            let g = match group.as_u64() {
                Some(g) if g > 0 => g as usize,
                _ => bail!("{at}.group_size {group} must be a positive integer"),
            };
            for (dim, n) in self.input_dims() {
                if !n.is_multiple_of(g) {
                    bail!("{at}.group_size {g} does not divide {dim} ({n}), an input dimension");
                }
            }
            if g != 64 {
                bail!("{at}.group_size {g} is not supported (groups of 64)");
            }
        }
        Ok(())
    }

    /// The input (column) dimensions of the quantised matrices, by what sets them.
    fn input_dims(&self) -> [(&'static str, usize); 5] {
        [
            ("hidden_size", self.hidden),
            ("moe_intermediate_size", self.expert_inter),
            ("shared_expert_intermediate_size", self.shared_inter),
            (
                "num_attention_heads · head_dim",
                self.n_heads * self.head_dim,
            ),
            (
                "linear_num_value_heads · linear_value_head_dim",
                self.dn_value_dim(),
            ),
        ]
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
            ("max_position_embeddings", self.max_position),
            ("num_experts", self.n_experts),
            ("moe_intermediate_size", self.expert_inter),
            ("shared_expert_intermediate_size", self.shared_inter),
            ("linear_key_head_dim", self.dn_k_dim),
            ("linear_value_head_dim", self.dn_v_dim),
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

    /// The config with `edit` applied to its text_config.
    fn edited(edit: impl FnOnce(&mut serde_json::Map<String, Value>)) -> Value {
        let mut json = real_text_config();
        edit(json["text_config"].as_object_mut().expect("object"));
        json
    }

    fn error_of(json: &Value) -> String {
        format!(
            "{:#}",
            ModelConfig::from_json(json).expect_err("must be refused")
        )
    }

    #[test]
    fn zero_context_or_layers_are_refused_by_name() {
        let json = edited(|t| {
            t.insert("max_position_embeddings".into(), 0.into());
        });
        assert!(error_of(&json).contains("max_position_embeddings"));
        let json = edited(|t| {
            t.insert("num_hidden_layers".into(), 0.into());
            t.insert("layer_types".into(), serde_json::json!([]));
        });
        assert!(error_of(&json).contains("num_hidden_layers"));
        let json = edited(|t| {
            t.insert("num_hidden_layers".into(), 0.into());
            t.remove("layer_types");
        });
        assert!(error_of(&json).contains("num_hidden_layers"));
    }

    #[test]
    fn eos_outside_the_vocabulary_is_refused() {
        for bad in [
            serde_json::json!(1e9),
            serde_json::json!(1_000_000_000),
            serde_json::json!(248320),
            serde_json::json!([248044, 300000]),
            serde_json::json!(-1),
            serde_json::json!("x"),
        ] {
            let json = edited(|t| {
                t.insert("eos_token_id".into(), bad.clone());
            });
            let err = error_of(&json);
            assert!(err.contains("eos_token_id"), "{bad}: {err}");
        }
        let mut json = real_text_config();
        json["eos_token_id"] = serde_json::json!(999_999_999);
        assert!(error_of(&json).contains("eos_token_id"));
    }

    #[test]
    fn rms_norm_eps_must_be_positive_and_finite() {
        for bad in [
            serde_json::json!(-1),
            serde_json::json!(0),
            serde_json::json!(1e300),
        ] {
            let json = edited(|t| {
                t.insert("rms_norm_eps".into(), bad.clone());
            });
            let err = error_of(&json);
            assert!(err.contains("rms_norm_eps"), "{bad}: {err}");
        }
    }

    #[test]
    fn quantization_must_be_what_the_engine_runs() {
        let q = |bits: Value, group: Value| {
            let mut json = real_text_config();
            json["quantization"] = serde_json::json!({"bits": bits, "group_size": group, "mode": "affine",
                "language_model.model.layers.0.mlp.gate": {"bits": 8, "group_size": 64}});
            json
        };
        ModelConfig::from_json(&q(4.into(), 64.into())).expect("4-bit groups of 64");
        ModelConfig::from_json(&q(8.into(), 64.into())).expect("8-bit groups of 64");
        for (bits, group, field) in [
            (3, 64, "bits"),
            (16, 64, "bits"),
            (4, 0, "group_size"),
            // 2048 / 96 and 512 / 96 are not whole groups.
            (4, 96, "group_size"),
            // Divides every input dimension, but the kernels run groups of 64.
            (4, 32, "group_size"),
        ] {
            let err = error_of(&q(bits.into(), group.into()));
            assert!(
                err.contains(&format!("quantization.{field}")),
                "{bits}/{group}: {err}"
            );
        }
        let mut json = q(4.into(), 64.into());
        json["quantization"]["mode"] = "mxfp4".into();
        assert!(error_of(&json).contains("quantization.mode"));
        let mut json = q(4.into(), 64.into());
        json["quantization"]["language_model.model.layers.0.mlp.gate"]["bits"] = 2.into();
        let err = error_of(&json);
        assert!(
            err.contains("language_model.model.layers.0.mlp.gate"),
            "{err}"
        );
        // The same checks under the name transformers uses.
        let mut json = real_text_config();
        json["quantization_config"] = serde_json::json!({"bits": 3, "group_size": 64});
        assert!(error_of(&json).contains("quantization_config.bits"));
    }
}
