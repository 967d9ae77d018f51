//! The checkpoint's weights on the device, uploaded as they are stored (ARCHITECTURE.md §4):
//! MLX affine 4-bit/8-bit words with their bf16 scales and biases, or bf16 for HF checkpoints.
//! Nothing is dequantised here; the kernels read the packed form (common.cuh `QWeight`).

use anyhow::{bail, Context, Result};
use lily_core::config::ModelConfig;
use lily_core::weights::{
    AttentionWeights, DeltaNetWeights, Linear, Mixer, ModelWeights, MoeWeights, WeightData,
};

use crate::gpu::{DevBuf, Gpu};

/// `struct QWeight` of common.cuh, passed to kernels by value.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct QWeightArg {
    pub q: u64,
    pub scales: u64,
    pub biases: u64,
    pub bits: i32,
    pub rows: i32,
    pub cols: i32,
    pub group: i32,
}

// SAFETY: a plain `#[repr(C)]` struct of integers laid out exactly as common.cuh's `QWeight`
// (three 8-byte pointers, four ints: 40 bytes, no padding), copied into the launch's parameters.
unsafe impl cudarc::driver::DeviceRepr for QWeightArg {}

/// A weight matrix (or a stack of expert matrices) on the device, in the checkpoint's own packing.
pub struct DevLinear {
    pub experts: usize,
    pub rows: usize,
    pub cols: usize,
    /// 4 or 8 (MLX affine), 16 (bf16).
    pub bits: u32,
    pub group: usize,
    pub q: DevBuf,
    pub scales: Option<DevBuf>,
    pub biases: Option<DevBuf>,
}

/// A weight's layout: what the plan's kernel choices and the kernels' limits depend on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearShape {
    pub experts: usize,
    pub rows: usize,
    pub cols: usize,
    /// 4 or 8 (MLX affine), 16 (bf16).
    pub bits: u32,
    pub group: usize,
}

impl DevLinear {
    pub fn shape(&self) -> LinearShape {
        LinearShape {
            experts: self.experts,
            rows: self.rows,
            cols: self.cols,
            bits: self.bits,
            group: self.group,
        }
    }

    /// The kernels' view of this weight.
    pub fn arg(&self) -> QWeightArg {
        QWeightArg {
            q: self.q.ptr,
            scales: self.scales.as_ref().map_or(0, |b| b.ptr),
            biases: self.biases.as_ref().map_or(0, |b| b.ptr),
            bits: self.bits as i32,
            rows: self.rows as i32,
            cols: self.cols as i32,
            group: self.group as i32,
        }
    }
}

pub struct DevAttention {
    pub q_proj: DevLinear,
    pub k_proj: DevLinear,
    pub v_proj: DevLinear,
    pub o_proj: DevLinear,
    pub q_norm: DevBuf,
    pub k_norm: DevBuf,
}

pub struct DevDeltaNet {
    pub in_qkv: DevLinear,
    pub in_z: DevLinear,
    pub in_b: DevLinear,
    pub in_a: DevLinear,
    pub conv: DevBuf,
    pub a_log: DevBuf,
    pub dt_bias: DevBuf,
    pub norm: DevBuf,
    pub out_proj: DevLinear,
}

pub enum DevMixer {
    Attention(DevAttention),
    DeltaNet(DevDeltaNet),
}

pub struct DevMoe {
    pub router: DevLinear,
    pub gate: DevLinear,
    pub up: DevLinear,
    pub down: DevLinear,
    pub shared_gate: DevLinear,
    pub shared_up: DevLinear,
    pub shared_down: DevLinear,
    pub shared_expert_gate: DevLinear,
}

pub struct DevLayer {
    pub input_norm: DevBuf,
    pub post_norm: DevBuf,
    pub mixer: DevMixer,
    pub moe: DevMoe,
}

pub struct DevModel {
    pub embed: DevLinear,
    pub layers: Vec<DevLayer>,
    pub final_norm: DevBuf,
    pub lm_head: DevLinear,
    /// Bytes of weights on the device.
    pub bytes: usize,
}

/// Uploads one matrix (or expert stack), checking its byte sizes against its shape.
pub fn upload_linear(gpu: &Gpu, name: &str, l: &Linear) -> Result<DevLinear> {
    let elems = l.experts * l.rows * l.cols;
    match &l.data {
        WeightData::Affine {
            bits,
            group,
            packed,
            scales,
            biases,
        } => {
            let (bits, group) = (*bits, *group);
            if !matches!(bits, 4 | 8)
                || group == 0
                || !l.cols.is_multiple_of(group)
                || !(l.cols * bits as usize).is_multiple_of(32)
            {
                bail!(
                    "{name}: unsupported affine layout (bits {bits}, group {group}, cols {})",
                    l.cols
                );
            }
            let want_q = elems * bits as usize / 8;
            let want_s = l.experts * l.rows * (l.cols / group) * 2;
            if packed.bytes().len() != want_q
                || scales.bytes().len() != want_s
                || biases.bytes().len() != want_s
            {
                bail!(
                    "{name}: packed/scales/biases are {}/{}/{} bytes, expected {want_q}/{want_s}/{want_s} for [{}, {}, {}] at {bits} bits",
                    packed.bytes().len(), scales.bytes().len(), biases.bytes().len(), l.experts, l.rows, l.cols
                );
            }
            Ok(DevLinear {
                experts: l.experts,
                rows: l.rows,
                cols: l.cols,
                bits,
                group,
                q: gpu
                    .upload(packed.bytes())
                    .with_context(|| name.to_string())?,
                scales: Some(
                    gpu.upload(scales.bytes())
                        .with_context(|| name.to_string())?,
                ),
                biases: Some(
                    gpu.upload(biases.bytes())
                        .with_context(|| name.to_string())?,
                ),
            })
        }
        WeightData::Bf16 { data } => {
            if data.bytes().len() != elems * 2 || !l.cols.is_multiple_of(2) {
                bail!(
                    "{name}: bf16 data is {} bytes, expected {} for [{}, {}, {}]",
                    data.bytes().len(),
                    elems * 2,
                    l.experts,
                    l.rows,
                    l.cols
                );
            }
            Ok(DevLinear {
                experts: l.experts,
                rows: l.rows,
                cols: l.cols,
                bits: 16,
                group: 64,
                q: gpu.upload(data.bytes()).with_context(|| name.to_string())?,
                scales: None,
                biases: None,
            })
        }
    }
}

fn vec_f32(gpu: &Gpu, name: &str, v: &[f32], len: usize) -> Result<DevBuf> {
    if v.len() != len {
        bail!("{name}: {} values, expected {len}", v.len());
    }
    gpu.upload(v).with_context(|| name.to_string())
}

fn lin_bytes(l: &DevLinear) -> usize {
    l.q.bytes + l.scales.as_ref().map_or(0, |b| b.bytes) + l.biases.as_ref().map_or(0, |b| b.bytes)
}

/// Uploads one attention block's weights (`name` prefixes error messages).
pub fn upload_attention(
    gpu: &Gpu,
    cfg: &ModelConfig,
    name: &str,
    a: &AttentionWeights,
) -> Result<DevAttention> {
    let n = |s: &str| format!("{name}.{s}");
    Ok(DevAttention {
        q_proj: upload_linear(gpu, &n("q_proj"), &a.q_proj)?,
        k_proj: upload_linear(gpu, &n("k_proj"), &a.k_proj)?,
        v_proj: upload_linear(gpu, &n("v_proj"), &a.v_proj)?,
        o_proj: upload_linear(gpu, &n("o_proj"), &a.o_proj)?,
        q_norm: vec_f32(gpu, &n("q_norm"), &a.q_norm, cfg.head_dim)?,
        k_norm: vec_f32(gpu, &n("k_norm"), &a.k_norm, cfg.head_dim)?,
    })
}

/// Uploads one Gated DeltaNet block's weights.
pub fn upload_deltanet(
    gpu: &Gpu,
    cfg: &ModelConfig,
    name: &str,
    d: &DeltaNetWeights,
) -> Result<DevDeltaNet> {
    let n = |s: &str| format!("{name}.{s}");
    Ok(DevDeltaNet {
        in_qkv: upload_linear(gpu, &n("in_proj_qkv"), &d.in_qkv)?,
        in_z: upload_linear(gpu, &n("in_proj_z"), &d.in_z)?,
        in_b: upload_linear(gpu, &n("in_proj_b"), &d.in_b)?,
        in_a: upload_linear(gpu, &n("in_proj_a"), &d.in_a)?,
        conv: vec_f32(gpu, &n("conv1d"), &d.conv, cfg.conv_dim() * cfg.conv_kernel)?,
        a_log: vec_f32(gpu, &n("A_log"), &d.a_log, cfg.dn_v_heads)?,
        dt_bias: vec_f32(gpu, &n("dt_bias"), &d.dt_bias, cfg.dn_v_heads)?,
        norm: vec_f32(gpu, &n("norm"), &d.norm, cfg.dn_v_dim)?,
        out_proj: upload_linear(gpu, &n("out_proj"), &d.out_proj)?,
    })
}

/// Uploads one MoE block's weights.
pub fn upload_moe(gpu: &Gpu, name: &str, m: &MoeWeights) -> Result<DevMoe> {
    let n = |s: &str| format!("{name}.{s}");
    Ok(DevMoe {
        router: upload_linear(gpu, &n("gate"), &m.router)?,
        gate: upload_linear(gpu, &n("experts.gate_proj"), &m.gate)?,
        up: upload_linear(gpu, &n("experts.up_proj"), &m.up)?,
        down: upload_linear(gpu, &n("experts.down_proj"), &m.down)?,
        shared_gate: upload_linear(gpu, &n("shared_expert.gate_proj"), &m.shared_gate)?,
        shared_up: upload_linear(gpu, &n("shared_expert.up_proj"), &m.shared_up)?,
        shared_down: upload_linear(gpu, &n("shared_expert.down_proj"), &m.shared_down)?,
        shared_expert_gate: upload_linear(gpu, &n("shared_expert_gate"), &m.shared_expert_gate)?,
    })
}

fn moe_bytes(m: &DevMoe) -> usize {
    [
        &m.router,
        &m.gate,
        &m.up,
        &m.down,
        &m.shared_gate,
        &m.shared_up,
        &m.shared_down,
        &m.shared_expert_gate,
    ]
    .into_iter()
    .map(lin_bytes)
    .sum()
}

pub fn upload_model(gpu: &Gpu, w: &ModelWeights) -> Result<DevModel> {
    let cfg = &w.config;
    let h = cfg.hidden;
    let embed = upload_linear(gpu, "embed_tokens", &w.embed)?;
    let lm_head = upload_linear(gpu, "lm_head", &w.lm_head)?;
    let mut bytes = lin_bytes(&embed) + lin_bytes(&lm_head);
    let mut layers = Vec::with_capacity(w.layers.len());
    for (i, lw) in w.layers.iter().enumerate() {
        let mixer = match &lw.mixer {
            Mixer::Attention(a) => {
                let d = upload_attention(gpu, cfg, &format!("layers.{i}.self_attn"), a)?;
                bytes += [&d.q_proj, &d.k_proj, &d.v_proj, &d.o_proj]
                    .into_iter()
                    .map(lin_bytes)
                    .sum::<usize>();
                DevMixer::Attention(d)
            }
            Mixer::DeltaNet(dn) => {
                let d = upload_deltanet(gpu, cfg, &format!("layers.{i}.linear_attn"), dn)?;
                bytes += [&d.in_qkv, &d.in_z, &d.in_b, &d.in_a, &d.out_proj]
                    .into_iter()
                    .map(lin_bytes)
                    .sum::<usize>();
                DevMixer::DeltaNet(d)
            }
        };
        let moe = upload_moe(gpu, &format!("layers.{i}.mlp"), &lw.moe)?;
        bytes += moe_bytes(&moe);
        layers.push(DevLayer {
            input_norm: vec_f32(
                gpu,
                &format!("layers.{i}.input_layernorm"),
                &lw.input_norm,
                h,
            )?,
            post_norm: vec_f32(
                gpu,
                &format!("layers.{i}.post_attention_layernorm"),
                &lw.post_norm,
                h,
            )?,
            mixer,
            moe,
        });
    }
    let final_norm = vec_f32(gpu, "norm", &w.final_norm, h)?;
    Ok(DevModel {
        embed,
        layers,
        final_norm,
        lm_head,
        bytes,
    })
}
