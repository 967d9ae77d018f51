//! Reading checkpoints (MODEL.md §3): the original HF bf16 safetensors (single file or sharded,
//! fused or per-expert MoE tensors) and MLX affine 4/8-bit conversions. Files are memory-mapped;
//! matrices stay in their stored form. Every missing, mis-shaped or wrong-dtype tensor is an error
//! that names it.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use safetensors::{Dtype, SafeTensors};

use crate::config::{LayerKind, ModelConfig};
use crate::quant::quantize_linear;
use crate::weights::*;

/// How to load.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Quantise bf16 matrices at load to this many bits (4), groups of 64, as MLX would
    /// (routers and the shared-expert gate get 8 bits).
    pub quantize_bits: Option<u32>,
}

struct TensorRef {
    file: Arc<Backing>,
    offset: usize,
    len: usize,
    dtype: Dtype,
    shape: Vec<usize>,
}

/// All tensors of a model directory, by name.
pub struct TensorIndex {
    tensors: HashMap<String, TensorRef>,
}

impl TensorIndex {
    pub fn open(dir: &Path) -> Result<Self> {
        let files = shard_files(dir)?;
        let mut tensors = HashMap::new();
        for path in files {
            let file =
                File::open(&path).with_context(|| format!("cannot open {}", path.display()))?;
            // SAFETY: the mapping is read-only; a checkpoint changed underneath a running engine is
            // outside what any engine can defend against.
            let mmap = unsafe { memmap2::Mmap::map(&file) }
                .with_context(|| format!("cannot map {}", path.display()))?;
            let backing = Arc::new(Backing::Mmap(mmap));
            let Backing::Mmap(map) = backing.as_ref() else {
                unreachable!()
            };
            let base = map.as_ptr() as usize;
            let st = SafeTensors::deserialize(map)
                .with_context(|| format!("{} is not a valid safetensors file", path.display()))?;
            for (name, view) in st.tensors() {
                let data = view.data();
                tensors.insert(
                    name,
                    TensorRef {
                        file: backing.clone(),

                        offset: data.as_ptr() as usize - base,
                        len: data.len(),
                        dtype: view.dtype(),
                        shape: view.shape().to_vec(),
                    },
                );
            }
        }
        Ok(TensorIndex { tensors })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    fn get(&self, name: &str) -> Result<&TensorRef> {
        self.tensors
            .get(name)
            .with_context(|| format!("tensor {name} is missing from the checkpoint"))
    }

    fn blob(t: &TensorRef) -> Blob {
        Blob::new(t.file.clone(), t.offset, t.len)
    }

    fn shape(&self, name: &str) -> Result<&[usize]> {
        Ok(&self.get(name)?.shape)
    }

    /// A small tensor of `numel` values as f32 (bf16, f16 or f32 stored).
    fn vector(&self, name: &str, numel: usize) -> Result<Vec<f32>> {
        let t = self.get(name)?;
        let n: usize = t.shape.iter().product();
        if n != numel {
            bail!(
                "tensor {name} has shape {:?} ({n} values), expected {numel} values",
                t.shape
            );
        }
        let b = t.file_bytes();
        let values: Vec<f32> = match t.dtype {
            Dtype::BF16 => (0..n).map(|i| read_bf16(b, i)).collect(),
            Dtype::F16 => (0..n)
                .map(|i| {
                    half::f16::from_bits(u16::from_le_bytes([b[2 * i], b[2 * i + 1]])).to_f32()
                })
                .collect(),
            Dtype::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            other => bail!("tensor {name} has dtype {other:?}, expected BF16, F16 or F32"),
        };
        // Norms, conv taps and decay parameters are tiny; one NaN among them poisons every
        // answer (each token comes out as the same id), so they are checked, all of them.
        if let Some(i) = values.iter().position(|v| !v.is_finite()) {
            bail!(
                "tensor {name} holds a non-finite value ({} at index {i})",
                values[i]
            );
        }
        Ok(values)
    }

    /// A matrix `[rows, cols]` or a stack `[experts, rows, cols]`, quantised (`{base}.weight` +
    /// `.scales` + `.biases`) or bf16 (`weight_name`).
    fn linear(
        &self,
        base: &str,
        weight_name: &str,
        experts: usize,
        rows: usize,
        cols: usize,
    ) -> Result<Linear> {
        let lead: Vec<usize> = if experts > 1 {
            vec![experts, rows]
        } else {
            vec![rows]
        };
        let scales_name = format!("{base}.scales");
        if self.contains(&scales_name) {
            let wname = format!("{base}.weight");
            let (w, s) = (self.get(&wname)?, self.get(&scales_name)?);
            let b = self.get(&format!("{base}.biases"))?;
            let (wl, sl) = (*w.shape.last().unwrap_or(&0), *s.shape.last().unwrap_or(&0));
            if w.dtype != Dtype::U32 {
                bail!(
                    "tensor {wname} has dtype {:?}, expected U32 (packed quantised weights)",
                    w.dtype
                );
            }
            if w.shape[..w.shape.len().saturating_sub(1)] != lead[..]
                || s.shape[..s.shape.len().saturating_sub(1)] != lead[..]
                || b.shape != s.shape
            {
                bail!("tensor {base}: weight {:?} / scales {:?} / biases {:?} do not fit [{}{rows}, {cols}]", w.shape, s.shape, b.shape, if experts > 1 { format!("{experts}, ") } else { String::new() });
            }
            if sl == 0 || !cols.is_multiple_of(sl) || (wl * 32) % cols != 0 {
                bail!("tensor {base}: cannot derive bits/group from weight {:?} and scales {:?} for {cols} input columns", w.shape, s.shape);
            }
            let (bits, group) = ((wl * 32 / cols) as u32, cols / sl);
            if !matches!(bits, 4 | 8) || group != 64 {
                bail!("tensor {base}: {bits}-bit groups of {group} are not supported (4 or 8 bits, group 64)");
            }
            for (t, part) in [(s, "scales"), (b, "biases")] {
                if t.dtype != Dtype::BF16 {
                    bail!(
                        "tensor {base}: scales/biases have dtype {:?}, expected BF16",
                        t.dtype
                    );
                }
                if let Some(i) = first_non_finite_bf16(t.file_bytes()) {
                    bail!("tensor {base}.{part} holds a non-finite value at index {i}");
                }
            }
            return Ok(Linear {
                experts,
                rows,
                cols,
                data: WeightData::Affine {
                    bits,
                    group,
                    packed: Self::blob(w),
                    scales: Self::blob(s),
                    biases: Self::blob(b),
                },
            });
        }
        let t = self.get(weight_name)?;
        let mut want = lead.clone();
        want.push(cols);
        if t.shape != want {
            bail!(
                "tensor {weight_name} has shape {:?}, expected {want:?}",
                t.shape
            );
        }
        if t.dtype != Dtype::BF16 {
            bail!("tensor {weight_name} has dtype {:?}, expected BF16 (or a quantised weight with .scales/.biases)", t.dtype);
        }
        Ok(Linear {
            experts,
            rows,
            cols,
            data: WeightData::Bf16 {
                data: Self::blob(t),
            },
        })
    }
}

/// The index of the first NaN or infinity among little-endian bf16 values: exponent bits all ones.
/// One pass over the scales and biases (a ninth of a 4-bit checkpoint), in 4 KiB blocks that the
/// compiler vectorises, going element by element only in a block that has one.
fn first_non_finite_bf16(bytes: &[u8]) -> Option<usize> {
    const BLOCK: usize = 4096;
    let bad = |c: &[u8]| u16::from_le_bytes([c[0], c[1]]) & 0x7f80 == 0x7f80;
    bytes.chunks(BLOCK).enumerate().find_map(|(k, block)| {
        let any = block.chunks_exact(2).fold(false, |acc, c| acc | bad(c));
        any.then(|| k * BLOCK / 2 + block.chunks_exact(2).position(bad).unwrap_or(0))
    })
}

impl TensorRef {
    fn file_bytes(&self) -> &[u8] {
        let Backing::Mmap(m) = self.file.as_ref() else {
            return &[];
        };
        &m[self.offset..self.offset + self.len]
    }
}

fn shard_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let text = std::fs::read_to_string(&index)
            .with_context(|| format!("cannot read {}", index.display()))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not valid JSON", index.display()))?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .with_context(|| format!("{} has no weight_map object", index.display()))?;
        let mut files: Vec<PathBuf> = map
            .values()
            .filter_map(|v| v.as_str())
            .map(|f| dir.join(f))
            .collect();
        files.sort();
        files.dedup();
        for f in &files {
            if !f.exists() {
                bail!(
                    "{} names shard {} which does not exist",
                    index.display(),
                    f.display()
                );
            }
        }
        return Ok(files);
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot read model directory {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        bail!("no .safetensors files in {}", dir.display());
    }
    Ok(files)
}

/// Loads a model directory (config.json + safetensors).
pub fn load(dir: &Path, opts: &LoadOptions) -> Result<ModelWeights> {
    let config = ModelConfig::from_dir(dir)?;
    let index = TensorIndex::open(dir)?;
    let weights =
        build(&config, &index).with_context(|| format!("loading checkpoint {}", dir.display()))?;
    Ok(match opts.quantize_bits {
        Some(bits) => quantize_model(weights, bits),
        None => weights,
    })
}

/// The naming scheme of a checkpoint: where the text model's tensors live.
struct Names {
    model: &'static str,
    lm_head: &'static str,
}

fn detect_names(index: &TensorIndex) -> Result<Names> {
    for (model, lm_head) in [
        ("model.language_model.", "lm_head"),
        ("language_model.model.", "language_model.lm_head"),
        ("model.", "lm_head"),
    ] {
        if index.contains(&format!("{model}embed_tokens.weight")) {
            return Ok(Names { model, lm_head });
        }
    }
    bail!("no embedding tensor found (looked for model.language_model.embed_tokens.weight, language_model.model.embed_tokens.weight, model.embed_tokens.weight)")
}

fn build(c: &ModelConfig, ix: &TensorIndex) -> Result<ModelWeights> {
    let names = detect_names(ix)?;
    let m = names.model;
    let h = c.hidden;
    // MODEL.md §3.3: an HF conv weight is [C, 1, K], an MLX one [C, K, 1]; the same test decides
    // whether the zero-centred norms are stored as w (HF: add 1) or already as 1 + w (MLX).
    let first_dn = c.layers.iter().position(|k| *k == LayerKind::DeltaNet);
    let format = match first_dn {
        Some(i) => {
            let name = format!("{m}layers.{i}.linear_attn.conv1d.weight");
            let shape = ix.shape(&name)?;
            match shape {
                [_, 1, k] if *k == c.conv_kernel && *k != 1 => CheckpointFormat::Hf,
                [_, k, 1] if *k == c.conv_kernel => CheckpointFormat::Mlx,
                _ => bail!("tensor {name} has shape {shape:?}, expected [{}, 1, {}] (HF) or [{}, {}, 1] (MLX)", c.conv_dim(), c.conv_kernel, c.conv_dim(), c.conv_kernel),
            }
        }
        None if ix.contains(&format!("{m}embed_tokens.scales")) => CheckpointFormat::Mlx,
        None => CheckpointFormat::Hf,
    };
    let norm = |name: &str, n: usize| -> Result<Vec<f32>> {
        let mut w = ix.vector(name, n)?;
        if format == CheckpointFormat::Hf {
            w.iter_mut().for_each(|x| *x += 1.0);
        }
        Ok(w)
    };
    let lin = |base: &str, rows: usize, cols: usize| {
        ix.linear(base, &format!("{base}.weight"), 1, rows, cols)
    };

    let embed = lin(&format!("{m}embed_tokens"), c.vocab, h)?;
    let lm_head = lin(names.lm_head, c.vocab, h)?;
    let final_norm = norm(&format!("{m}norm.weight"), h)?;

    let mut layers = Vec::with_capacity(c.n_layers());
    for (i, kind) in c.layers.iter().enumerate() {
        let p = format!("{m}layers.{i}.");
        let mixer = match kind {
            LayerKind::Attention => {
                let a = format!("{p}self_attn.");
                let (hq, hkv, d) = (c.n_heads, c.n_kv_heads, c.head_dim);
                Mixer::Attention(AttentionWeights {
                    q_proj: lin(&format!("{a}q_proj"), 2 * hq * d, h)?,
                    k_proj: lin(&format!("{a}k_proj"), hkv * d, h)?,
                    v_proj: lin(&format!("{a}v_proj"), hkv * d, h)?,
                    o_proj: lin(&format!("{a}o_proj"), h, hq * d)?,
                    q_norm: norm(&format!("{a}q_norm.weight"), d)?,
                    k_norm: norm(&format!("{a}k_norm.weight"), d)?,
                })
            }
            LayerKind::DeltaNet => {
                let a = format!("{p}linear_attn.");
                let hv = c.dn_v_heads;
                Mixer::DeltaNet(DeltaNetWeights {
                    in_qkv: lin(&format!("{a}in_proj_qkv"), c.conv_dim(), h)?,
                    in_z: lin(&format!("{a}in_proj_z"), c.dn_value_dim(), h)?,
                    in_b: lin(&format!("{a}in_proj_b"), hv, h)?,
                    in_a: lin(&format!("{a}in_proj_a"), hv, h)?,
                    conv: ix.vector(&format!("{a}conv1d.weight"), c.conv_dim() * c.conv_kernel)?,
                    a_log: ix.vector(&format!("{a}A_log"), hv)?,
                    dt_bias: ix.vector(&format!("{a}dt_bias"), hv)?,
                    norm: ix.vector(&format!("{a}norm.weight"), c.dn_v_dim)?,
                    out_proj: lin(&format!("{a}out_proj"), h, c.dn_value_dim())?,
                })
            }
        };
        layers.push(LayerWeights {
            input_norm: norm(&format!("{p}input_layernorm.weight"), h)?,
            post_norm: norm(&format!("{p}post_attention_layernorm.weight"), h)?,
            mixer,
            moe: moe(c, ix, &format!("{p}mlp."))?,
        });
    }
    Ok(ModelWeights {
        config: c.clone(),
        format,
        embed,
        layers,
        final_norm,
        lm_head,
    })
}

fn moe(c: &ModelConfig, ix: &TensorIndex, p: &str) -> Result<MoeWeights> {
    let (h, e, i) = (c.hidden, c.n_experts, c.expert_inter);
    let lin = |base: &str, rows: usize, cols: usize| {
        ix.linear(base, &format!("{base}.weight"), 1, rows, cols)
    };
    let (gate, up, down) = if ix.contains(&format!("{p}switch_mlp.gate_proj.weight")) {
        let s = format!("{p}switch_mlp.");
        let stack = |name: &str, rows, cols| {
            ix.linear(
                &format!("{s}{name}"),
                &format!("{s}{name}.weight"),
                e,
                rows,
                cols,
            )
        };
        (
            stack("gate_proj", i, h)?,
            stack("up_proj", i, h)?,
            stack("down_proj", h, i)?,
        )
    } else if ix.contains(&format!("{p}experts.gate_up_proj")) {
        let fused = ix.linear(
            &format!("{p}experts.gate_up_proj"),
            &format!("{p}experts.gate_up_proj"),
            e,
            2 * i,
            h,
        )?;
        let down = ix.linear(
            &format!("{p}experts.down_proj"),
            &format!("{p}experts.down_proj"),
            e,
            h,
            i,
        )?;
        let (gate, up) = split_gate_up(&fused, i);
        (gate, up, down)
    } else {
        let per = |name: &str, rows, cols| -> Result<Linear> {
            let parts = (0..e)
                .map(|x| lin(&format!("{p}experts.{x}.{name}"), rows, cols))
                .collect::<Result<Vec<_>>>()?;
            stack_bf16(&parts, &format!("{p}experts.*.{name}"))
        };
        (
            per("gate_proj", i, h)?,
            per("up_proj", i, h)?,
            per("down_proj", h, i)?,
        )
    };
    let si = c.shared_inter;
    Ok(MoeWeights {
        router: lin(&format!("{p}gate"), e, h)?,
        gate,
        up,
        down,
        shared_gate: lin(&format!("{p}shared_expert.gate_proj"), si, h)?,
        shared_up: lin(&format!("{p}shared_expert.up_proj"), si, h)?,
        shared_down: lin(&format!("{p}shared_expert.down_proj"), h, si)?,
        shared_expert_gate: lin(&format!("{p}shared_expert_gate"), 1, h)?,
    })
}

/// HF's fused `gate_up_proj` `[E, 2I, H]`: per expert, rows `0..I` are the gate, `I..2I` the up
/// projection (MODEL.md §2.6). Copied into two stacks so every backend sees one layout.
fn split_gate_up(fused: &Linear, inter: usize) -> (Linear, Linear) {
    let WeightData::Bf16 { data } = &fused.data else {
        unreachable!("fused gate_up_proj is only read from bf16 checkpoints")
    };
    let bytes = data.bytes();
    let half = inter * fused.cols * 2;
    let (mut g, mut u) = (
        Vec::with_capacity(bytes.len() / 2),
        Vec::with_capacity(bytes.len() / 2),
    );
    for e in bytes.chunks(2 * half) {
        g.extend_from_slice(&e[..half]);
        u.extend_from_slice(&e[half..]);
    }
    let mk = |v: Vec<u8>| Linear {
        experts: fused.experts,
        rows: inter,
        cols: fused.cols,
        data: WeightData::Bf16 {
            data: Blob::owned(v),
        },
    };
    (mk(g), mk(u))
}

fn stack_bf16(parts: &[Linear], what: &str) -> Result<Linear> {
    let mut bytes = Vec::new();
    for p in parts {
        match &p.data {
            WeightData::Bf16 { data } => bytes.extend_from_slice(data.bytes()),
            WeightData::Affine { .. } => bail!("{what}: per-expert tensors must be bf16"),
        }
    }
    Ok(Linear {
        experts: parts.len(),
        rows: parts[0].rows,
        cols: parts[0].cols,
        data: WeightData::Bf16 {
            data: Blob::owned(bytes),
        },
    })
}

/// Quantises every bf16 matrix (routers and the shared-expert gate to 8 bits, as MLX does).
pub fn quantize_model(mut w: ModelWeights, bits: u32) -> ModelWeights {
    let q = |l: &mut Linear, b: u32| *l = quantize_linear(l, b, 64);
    q(&mut w.embed, bits);
    q(&mut w.lm_head, bits);
    for layer in &mut w.layers {
        match &mut layer.mixer {
            Mixer::Attention(a) => {
                for l in [&mut a.q_proj, &mut a.k_proj, &mut a.v_proj, &mut a.o_proj] {
                    q(l, bits);
                }
            }
            Mixer::DeltaNet(d) => {
                for l in [
                    &mut d.in_qkv,
                    &mut d.in_z,
                    &mut d.in_b,
                    &mut d.in_a,
                    &mut d.out_proj,
                ] {
                    q(l, bits);
                }
            }
        }
        let m = &mut layer.moe;
        q(&mut m.router, 8);
        q(&mut m.shared_expert_gate, 8);
        for l in [
            &mut m.gate,
            &mut m.up,
            &mut m.down,
            &mut m.shared_gate,
            &mut m.shared_up,
            &mut m.shared_down,
        ] {
            q(l, bits);
        }
    }
    w.format = CheckpointFormat::Mlx;
    w
}

#[cfg(test)]
mod tests {
    use super::first_non_finite_bf16;

    fn bf16_bytes(values: &[f32]) -> Vec<u8> {
        values
            .iter()
            .flat_map(|v| ((v.to_bits() >> 16) as u16).to_le_bytes())
            .collect()
    }

    #[test]
    fn finds_the_first_non_finite_bf16_value() {
        let mut v = vec![1.5f32; 10_000];
        assert_eq!(first_non_finite_bf16(&bf16_bytes(&v)), None);
        v[5_000] = f32::MAX; // finite: bf16 rounds the top bits only
        v[9_999] = -0.0;
        assert_eq!(first_non_finite_bf16(&bf16_bytes(&v)), None);
        for (i, bad) in [
            (0, f32::NAN),
            (2047, f32::INFINITY),
            (2048, f32::NEG_INFINITY),
            (7777, f32::NAN),
        ] {
            let mut w = v.clone();
            w[i] = bad;
            w[9_000] = f32::NAN;
            assert_eq!(first_non_finite_bf16(&bf16_bytes(&w)), Some(i), "{i}");
        }
    }

    #[test]
    #[ignore = "timing, run by hand"]
    fn scan_throughput() {
        let buf = bf16_bytes(&vec![0.25f32; 256 << 20]);
        let t = std::time::Instant::now();
        for _ in 0..4 {
            assert_eq!(first_non_finite_bf16(std::hint::black_box(&buf)), None);
        }
        let s = t.elapsed().as_secs_f64() / 4.0;
        eprintln!("{:.2} GB/s", buf.len() as f64 / s / 1e9);
    }
}
