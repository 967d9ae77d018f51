//! Synthetic checkpoints of the exact Qwen3.6-35B-A3B family shape (ARCHITECTURE.md §4), written
//! deterministically from a seed in the HF bf16 or the MLX 4-bit layout, streamed to disk with
//! bounded memory. Every value is a function of (seed, logical tensor, row), so the HF and MLX
//! files of one seed describe the same model up to quantisation, whatever the thread count.
//!
//! Scales keep activations finite through every layer and the router spread over experts: input
//! projections have unit output variance on normalised inputs, residual-branch outputs are halved,
//! the router's logits have a standard deviation near 3.

use std::fs::{self, File};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use half::bf16;
use rayon::prelude::*;
use serde_json::{json, Value};

use crate::config::{LayerKind, ModelConfig};
use crate::quant::quantize_row;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    /// A few-MB model with a 1,024-token vocabulary: the parity fixtures and unit tests.
    Tiny,
    /// The real 248,320-token vocabulary (so the real tokenizer works), tens of MB.
    Small,
    /// The full Qwen3.6-35B-A3B shape (~19.5 GB in MLX 4-bit).
    Full,
}

impl std::str::FromStr for Preset {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "tiny" => Ok(Preset::Tiny),
            "small" => Ok(Preset::Small),
            "qwen3.6-35b-a3b" | "full" => Ok(Preset::Full),
            _ => bail!("unknown preset {s:?}: expected tiny, small or qwen3.6-35b-a3b"),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SynthFormat {
    Hf,
    Mlx,
}

impl std::str::FromStr for SynthFormat {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "hf" => Ok(SynthFormat::Hf),
            "mlx" => Ok(SynthFormat::Mlx),
            _ => bail!("unknown format {s:?}: expected hf or mlx"),
        }
    }
}

/// The `text_config` of a preset.
pub fn preset_text_config(preset: Preset) -> Value {
    // (hidden, blocks of 4 layers, vocab, heads, kv heads, head dim, dn k heads, dn v heads, dn dim,
    //  experts, top-k, expert inter, shared inter)
    let (h, blocks, vocab, hq, hkv, d, dk_heads, dv_heads, dd, e, k, i, si) = match preset {
        Preset::Tiny => (128, 2, 1024, 4, 2, 64, 2, 4, 32, 16, 4, 64, 64),
        Preset::Small => (256, 2, 248_320, 4, 2, 64, 4, 8, 32, 32, 4, 128, 128),
        Preset::Full => (2048, 10, 248_320, 16, 2, 256, 16, 32, 128, 256, 8, 512, 512),
    };
    let mut layer_types = Vec::new();
    for _ in 0..blocks {
        layer_types.extend(["linear_attention"; 3]);
        layer_types.push("full_attention");
    }
    // The family's end-of-turn id, where the vocabulary has it (`tiny`'s 1024 ids do not: a config
    // naming an id outside the vocabulary is refused at load).
    let eos = if vocab > 248_044 {
        json!(248_044)
    } else {
        Value::Null
    };
    json!({
        "model_type": "qwen3_5_moe_text",
        "hidden_size": h, "num_hidden_layers": 4 * blocks, "layer_types": layer_types,
        "full_attention_interval": 4, "vocab_size": vocab,
        "num_attention_heads": hq, "num_key_value_heads": hkv, "head_dim": d,
        "attn_output_gate": true, "attention_bias": false, "attention_dropout": 0.0,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                            "mrope_interleaved": true, "mrope_section": [11, 11, 10]},
        "partial_rotary_factor": 0.25,
        "linear_num_key_heads": dk_heads, "linear_num_value_heads": dv_heads,
        "linear_key_head_dim": dd, "linear_value_head_dim": dd, "linear_conv_kernel_dim": 4,
        "num_experts": e, "num_experts_per_tok": k, "moe_intermediate_size": i,
        "shared_expert_intermediate_size": si, "mamba_ssm_dtype": "float32",
        "bos_token_id": eos, "eos_token_id": eos, "pad_token_id": null,
        "tie_word_embeddings": false, "dtype": "bfloat16"
    })
}

/// How a tensor's values are drawn.
#[derive(Clone, Copy, Debug)]
enum Init {
    /// U(−a, a).
    Uniform(f32),
    /// A zero-centred norm's w ~ U(−0.1, 0.1), stored as w (HF) or 1 + w (MLX).
    ZeroCentredNorm,
    /// 1 + U(−0.1, 0.1) (the DeltaNet gated norm, never shifted).
    NearOne,
    /// ln U(0.5, 4): DeltaNet A_log.
    ALog,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Store {
    Bf16,
    F32,
    /// MLX affine, groups of 64.
    Quant(u32),
}

/// One tensor to write.
struct Spec {
    name: String,
    shape: Vec<usize>,
    init: Init,
    store: Store,
    /// Rows (all dims but the last) map to logical rows: `key_row = e·stride + shift + r` for row r
    /// of matrix e (matrices of `rows_per` rows). Lets MLX's split gate/up share HF's fused values.
    logical: String,
    rows_per: usize,
    stride: usize,
    shift: usize,
}

impl Spec {
    fn cols(&self) -> usize {
        *self.shape.last().unwrap_or(&1)
    }
    fn n_rows(&self) -> usize {
        self.shape.iter().product::<usize>() / self.cols()
    }
    /// (name, dtype, shape, bytes) of each stored tensor.
    fn stored(&self) -> Vec<(String, &'static str, Vec<usize>, usize)> {
        let n = self.shape.iter().product::<usize>();
        match self.store {
            Store::Bf16 => vec![(self.name.clone(), "BF16", self.shape.clone(), 2 * n)],
            Store::F32 => vec![(self.name.clone(), "F32", self.shape.clone(), 4 * n)],
            Store::Quant(bits) => {
                let base = self.name.trim_end_matches(".weight");
                let lead = &self.shape[..self.shape.len() - 1];
                let cols = self.cols();
                let mut ws = lead.to_vec();
                ws.push(cols * bits as usize / 32);
                let mut ss = lead.to_vec();
                ss.push(cols / 64);
                let groups = n / 64;
                vec![
                    (format!("{base}.weight"), "U32", ws, n * bits as usize / 8),
                    (format!("{base}.scales"), "BF16", ss.clone(), 2 * groups),
                    (format!("{base}.biases"), "BF16", ss, 2 * groups),
                ]
            }
        }
    }
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn hash_str(seed: u64, s: &str) -> u64 {
    s.bytes()
        .fold(splitmix(seed), |h, b| splitmix(h ^ b as u64))
}

/// Row `r` of a spec, as f32 (exactly reproducible: integer PRNG, IEEE arithmetic).
fn row_values(spec: &Spec, tensor_seed: u64, r: usize, fmt: SynthFormat, out: &mut Vec<f32>) {
    let (e, within) = (r / spec.rows_per, r % spec.rows_per);
    let key_row = (e * spec.stride + spec.shift + within) as u64;
    let mut state = splitmix(tensor_seed ^ key_row.wrapping_mul(0xD6E8_FEB8_6659_FD93));
    let mut uniform = || {
        state = splitmix(state);
        (state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    out.clear();
    for _ in 0..spec.cols() {
        let u = uniform();
        out.push(match spec.init {
            Init::Uniform(a) => a * u,
            Init::ZeroCentredNorm => {
                let w = 0.1 * u;
                if fmt == SynthFormat::Mlx {
                    1.0 + w
                } else {
                    w
                }
            }
            Init::NearOne => 1.0 + 0.1 * u,
            Init::ALog => (2.25 + 1.75 * u).ln(),
        });
    }
}

fn encode_row(spec: &Spec, vals: &[f32]) -> [Vec<u8>; 3] {
    match spec.store {
        Store::Bf16 => [
            vals.iter()
                .flat_map(|v| bf16::from_f32(*v).to_bits().to_le_bytes())
                .collect(),
            Vec::new(),
            Vec::new(),
        ],
        Store::F32 => [
            vals.iter().flat_map(|v| v.to_le_bytes()).collect(),
            Vec::new(),
            Vec::new(),
        ],
        Store::Quant(bits) => {
            let (mut p, mut s, mut b) = (Vec::new(), Vec::new(), Vec::new());
            quantize_row(vals, bits, 64, &mut p, &mut s, &mut b);
            [p, s, b]
        }
    }
}

fn specs(c: &ModelConfig, fmt: SynthFormat) -> Vec<Spec> {
    let mlx = fmt == SynthFormat::Mlx;
    let (m, lm) = if mlx {
        ("language_model.model.", "language_model.lm_head.weight")
    } else {
        ("model.language_model.", "lm_head.weight")
    };
    let q4 = if mlx { Store::Quant(4) } else { Store::Bf16 };
    let q8 = if mlx { Store::Quant(8) } else { Store::Bf16 };
    let fan = |n: usize| (3.0 / n as f32).sqrt();
    let mut v = Vec::new();
    fn plain(name: String, shape: Vec<usize>, init: Init, store: Store) -> Spec {
        let rows_per = shape.iter().rev().nth(1).copied().unwrap_or(1);
        let logical = name.clone();
        Spec {
            name,
            shape,
            init,
            store,
            logical,
            rows_per,
            stride: rows_per,
            shift: 0,
        }
    }
    macro_rules! add {
        ($($arg:expr),*) => { v.push(plain($($arg),*)) };
    }
    let h = c.hidden;
    add!(
        format!("{m}embed_tokens.weight"),
        vec![c.vocab, h],
        Init::Uniform(1.0),
        q4
    );
    for (i, kind) in c.layers.iter().enumerate() {
        let p = format!("{m}layers.{i}.");
        add!(
            format!("{p}input_layernorm.weight"),
            vec![h],
            Init::ZeroCentredNorm,
            Store::Bf16
        );
        add!(
            format!("{p}post_attention_layernorm.weight"),
            vec![h],
            Init::ZeroCentredNorm,
            Store::Bf16
        );
        match kind {
            LayerKind::Attention => {
                let (hq, hkv, d) = (c.n_heads, c.n_kv_heads, c.head_dim);
                add!(
                    format!("{p}self_attn.q_proj.weight"),
                    vec![2 * hq * d, h],
                    Init::Uniform(fan(h)),
                    q4
                );
                add!(
                    format!("{p}self_attn.k_proj.weight"),
                    vec![hkv * d, h],
                    Init::Uniform(fan(h)),
                    q4
                );
                add!(
                    format!("{p}self_attn.v_proj.weight"),
                    vec![hkv * d, h],
                    Init::Uniform(fan(h)),
                    q4
                );
                add!(
                    format!("{p}self_attn.o_proj.weight"),
                    vec![h, hq * d],
                    Init::Uniform(0.5 * fan(hq * d)),
                    q4
                );
                add!(
                    format!("{p}self_attn.q_norm.weight"),
                    vec![d],
                    Init::ZeroCentredNorm,
                    Store::Bf16
                );
                add!(
                    format!("{p}self_attn.k_norm.weight"),
                    vec![d],
                    Init::ZeroCentredNorm,
                    Store::Bf16
                );
            }
            LayerKind::DeltaNet => {
                let (cd, vd, hv, k) = (c.conv_dim(), c.dn_value_dim(), c.dn_v_heads, c.conv_kernel);
                let a = format!("{p}linear_attn.");
                add!(
                    format!("{a}in_proj_qkv.weight"),
                    vec![cd, h],
                    Init::Uniform(fan(h)),
                    q4
                );
                add!(
                    format!("{a}in_proj_z.weight"),
                    vec![vd, h],
                    Init::Uniform(fan(h)),
                    q4
                );
                add!(
                    format!("{a}in_proj_b.weight"),
                    vec![hv, h],
                    Init::Uniform(fan(h)),
                    q4
                );
                add!(
                    format!("{a}in_proj_a.weight"),
                    vec![hv, h],
                    Init::Uniform(fan(h)),
                    q4
                );
                let conv_shape = if mlx { vec![cd, k, 1] } else { vec![cd, 1, k] };
                // Taps of one channel form one logical row in both layouts.
                v.push(Spec {
                    name: format!("{a}conv1d.weight"),
                    shape: conv_shape,
                    init: Init::Uniform(fan(k)),
                    store: Store::Bf16,
                    logical: format!("{a}conv1d.weight"),
                    rows_per: cd,
                    stride: cd,
                    shift: 0,
                });
                add!(format!("{a}A_log"), vec![hv], Init::ALog, Store::F32);
                add!(
                    format!("{a}dt_bias"),
                    vec![hv],
                    Init::Uniform(1.0),
                    Store::Bf16
                );
                add!(
                    format!("{a}norm.weight"),
                    vec![c.dn_v_dim],
                    Init::NearOne,
                    Store::Bf16
                );
                add!(
                    format!("{a}out_proj.weight"),
                    vec![h, vd],
                    Init::Uniform(0.5 * fan(vd)),
                    q4
                );
            }
        }
        let (e, ii, si) = (c.n_experts, c.expert_inter, c.shared_inter);
        add!(
            format!("{p}mlp.gate.weight"),
            vec![e, h],
            Init::Uniform(3.0 * fan(h)),
            q8
        );
        let gate_up = format!("{p}mlp.experts.gate_up_proj");
        if mlx {
            for (name, shift) in [("gate_proj", 0), ("up_proj", ii)] {
                v.push(Spec {
                    name: format!("{p}mlp.switch_mlp.{name}.weight"),
                    shape: vec![e, ii, h],
                    init: Init::Uniform(fan(h)),
                    store: q4,
                    logical: gate_up.clone(),
                    rows_per: ii,
                    stride: 2 * ii,
                    shift,
                });
            }
            v.push(Spec {
                name: format!("{p}mlp.switch_mlp.down_proj.weight"),
                shape: vec![e, h, ii],
                init: Init::Uniform(0.5 * fan(ii)),
                store: q4,
                logical: format!("{p}mlp.experts.down_proj"),
                rows_per: h,
                stride: h,
                shift: 0,
            });
        } else {
            add!(gate_up, vec![e, 2 * ii, h], Init::Uniform(fan(h)), q4);
            add!(
                format!("{p}mlp.experts.down_proj"),
                vec![e, h, ii],
                Init::Uniform(0.5 * fan(ii)),
                q4
            );
        }
        add!(
            format!("{p}mlp.shared_expert.gate_proj.weight"),
            vec![si, h],
            Init::Uniform(fan(h)),
            q4
        );
        add!(
            format!("{p}mlp.shared_expert.up_proj.weight"),
            vec![si, h],
            Init::Uniform(fan(h)),
            q4
        );
        add!(
            format!("{p}mlp.shared_expert.down_proj.weight"),
            vec![h, si],
            Init::Uniform(0.5 * fan(si)),
            q4
        );
        add!(
            format!("{p}mlp.shared_expert_gate.weight"),
            vec![1, h],
            Init::Uniform(fan(h)),
            q8
        );
    }
    add!(
        format!("{m}norm.weight"),
        vec![h],
        Init::ZeroCentredNorm,
        Store::Bf16
    );
    add!(
        lm.to_string(),
        vec![c.vocab, h],
        Init::Uniform(2.0 * fan(h)),
        q4
    );
    // Logical names ignore the format's prefix so both formats draw the same values.
    for s in &mut v {
        s.logical = s
            .logical
            .replacen(m, "", 1)
            .replace("switch_mlp", "experts");
    }
    v
}

pub struct SynthOptions {
    pub preset: Preset,
    pub format: SynthFormat,
    pub seed: u64,
    pub out: PathBuf,
    pub tokenizer: Option<PathBuf>,
    /// Fewer (or more) layers than the preset, keeping its widths: a multiple of 4 (three
    /// DeltaNet layers then one attention layer). Full-width kernels can be timed on a 4-layer
    /// model a tenth of the full checkpoint's size.
    pub layers: Option<usize>,
}

/// The preset's text config with `layers` layers (a multiple of 4) instead of its own count.
pub fn with_layers(mut cfg: Value, layers: usize) -> Result<Value> {
    if layers == 0 || !layers.is_multiple_of(4) {
        bail!("--layers must be a positive multiple of 4 (3 DeltaNet + 1 attention), got {layers}");
    }
    let mut types = Vec::new();
    for _ in 0..layers / 4 {
        types.extend(["linear_attention"; 3]);
        types.push("full_attention");
    }
    cfg["num_hidden_layers"] = json!(layers);
    cfg["layer_types"] = json!(types);
    Ok(cfg)
}

pub struct SynthReport {
    pub bytes: u64,
    pub files: usize,
    pub seconds: f64,
}

const SHARD_BYTES: usize = 5 << 30;

/// Writes a complete model directory. The output appears whole or not at all: everything is
/// written into `OUT.partial` and renamed at the end.
pub fn synth(opts: &SynthOptions) -> Result<SynthReport> {
    let start = Instant::now();
    if opts.out.exists()
        && fs::read_dir(&opts.out)
            .map(|mut d| d.next().is_some())
            .unwrap_or(true)
    {
        bail!("{} already exists and is not empty", opts.out.display());
    }
    let mut text_cfg = preset_text_config(opts.preset);
    if let Some(layers) = opts.layers {
        text_cfg = with_layers(text_cfg, layers)?;
    }
    let mut config = json!({
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text_cfg,
        "tie_word_embeddings": false,
        "lily_synthetic": {"preset": format!("{:?}", opts.preset).to_lowercase(), "seed": opts.seed},
    });
    let model_cfg = ModelConfig::from_json(&config)?;
    let specs = specs(&model_cfg, opts.format);
    if opts.format == SynthFormat::Mlx {
        let mut q = json!({"group_size": 64, "bits": 4, "mode": "affine"});
        for i in 0..model_cfg.n_layers() {
            for t in ["mlp.gate", "mlp.shared_expert_gate"] {
                q[format!("language_model.model.layers.{i}.{t}")] =
                    json!({"group_size": 64, "bits": 8});
            }
        }
        config["quantization"] = q.clone();
        config["quantization_config"] = q;
    }

    let partial = opts.out.with_extension("partial");
    if partial.exists() {
        fs::remove_dir_all(&partial)
            .with_context(|| format!("cannot remove stale {}", partial.display()))?;
    }
    fs::create_dir_all(&partial).with_context(|| format!("cannot create {}", partial.display()))?;

    // Plan shards: consecutive specs until a shard would pass SHARD_BYTES.
    let mut shards: Vec<Vec<usize>> = vec![Vec::new()];
    let mut size = 0;
    for (i, s) in specs.iter().enumerate() {
        let b: usize = s.stored().iter().map(|t| t.3).sum();
        if size > 0 && size + b > SHARD_BYTES {
            shards.push(Vec::new());
            size = 0;
        }
        size += b;
        shards.last_mut().expect("one shard at least").push(i);
    }
    let n_shards = shards.len();
    let mut weight_map = serde_json::Map::new();
    let mut total = 0u64;
    for (si, members) in shards.iter().enumerate() {
        let file_name = if n_shards == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", si + 1, n_shards)
        };
        let path = partial.join(&file_name);
        total += write_shard(&path, members.iter().map(|&i| &specs[i]), opts)?;
        for &i in members {
            for t in specs[i].stored() {
                weight_map.insert(t.0, Value::String(file_name.clone()));
            }
        }
    }
    if n_shards > 1 {
        let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
        fs::write(
            partial.join("model.safetensors.index.json"),
            serde_json::to_string_pretty(&index)?,
        )?;
    }
    if let Some(tok) = &opts.tokenizer {
        copy_tokenizer(tok, &partial)?;
    }
    fs::write(
        partial.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    if opts.out.exists() {
        fs::remove_dir(&opts.out)
            .with_context(|| format!("cannot replace empty {}", opts.out.display()))?;
    }
    fs::rename(&partial, &opts.out).with_context(|| {
        format!(
            "cannot move {} to {}",
            partial.display(),
            opts.out.display()
        )
    })?;
    Ok(SynthReport {
        bytes: total,
        files: n_shards,
        seconds: start.elapsed().as_secs_f64(),
    })
}

fn write_shard<'a>(
    path: &Path,
    specs: impl Iterator<Item = &'a Spec>,
    opts: &SynthOptions,
) -> Result<u64> {
    let specs: Vec<&Spec> = specs.collect();
    let mut header = serde_json::Map::new();
    header.insert(
        "__metadata__".into(),
        json!({"format": if opts.format == SynthFormat::Mlx { "mlx" } else { "pt" }}),
    );
    let mut offset = 0usize;
    let mut places = Vec::new();
    for s in &specs {
        let mut starts = Vec::new();
        for (name, dtype, shape, bytes) in s.stored() {
            header.insert(
                name,
                json!({"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + bytes]}),
            );
            starts.push(offset);
            offset += bytes;
        }
        places.push(starts);
    }
    let mut header_bytes = serde_json::to_vec(&Value::Object(header))?;
    while (8 + header_bytes.len()) % 8 != 0 {
        header_bytes.push(b' ');
    }
    let data_start = 8 + header_bytes.len();
    let mut file =
        File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    file.write_all(&(header_bytes.len() as u64).to_le_bytes())?;
    file.write_all(&header_bytes)?;
    file.set_len((data_start + offset) as u64)?;
    for (s, starts) in specs.iter().zip(places) {
        let tensor_seed = hash_str(opts.seed, &s.logical);
        let n_rows = s.n_rows();
        let row_bytes: Vec<usize> = s.stored().iter().map(|t| t.3 / n_rows).collect();
        // Runs of CHUNK rows, each computed, encoded and written at its own offsets by whichever
        // thread takes it (positioned writes to one file): nothing is gathered or written by one
        // thread while the others wait.
        const CHUNK: usize = 256;
        (0..n_rows.div_ceil(CHUNK))
            .into_par_iter()
            .try_for_each_init(
                || (Vec::new(), [Vec::new(), Vec::new(), Vec::new()]),
                |(buf, parts), c| -> Result<()> {
                    let rows = c * CHUNK..((c + 1) * CHUNK).min(n_rows);
                    parts.iter_mut().for_each(Vec::clear);
                    for r in rows.clone() {
                        row_values(s, tensor_seed, r, opts.format, buf);
                        for (part, bytes) in parts.iter_mut().zip(encode_row(s, buf)) {
                            part.extend_from_slice(&bytes);
                        }
                    }
                    for (part, (&start, &rb)) in parts.iter().zip(starts.iter().zip(&row_bytes)) {
                        file.write_all_at(part, (data_start + start + rows.start * rb) as u64)
                            .with_context(|| format!("cannot write {}", path.display()))?;
                    }
                    Ok(())
                },
            )?;
    }
    file.sync_all()?;
    Ok((data_start + offset) as u64)
}

fn copy_tokenizer(from: &Path, to: &Path) -> Result<()> {
    let mut found = false;
    for name in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
    ] {
        let src = from.join(name);
        if src.exists() {
            // Read + write rather than fs::copy: the copy must be writable even when the source is not.
            let bytes = fs::read(&src).with_context(|| format!("cannot read {}", src.display()))?;
            fs::write(to.join(name), bytes)
                .with_context(|| format!("cannot write {}", to.join(name).display()))?;
            found |= name == "tokenizer.json";
        }
    }
    if !found {
        bail!("{} has no tokenizer.json", from.display());
    }
    Ok(())
}
