//! The model's weights on the device, uploaded once with `queue.write_buffer` (no mmap import:
//! the same path works on Metal and Vulkan). Matrices stay in their checkpoint form (MLX affine
//! 4/8-bit groups or bf16) and are cut into slices that each fit one storage binding (lavapipe
//! binds at most 128 MiB; the full model's expert stacks and embedding are larger).
//!
//! A slice is one buffer: the packed u32 words of `count` consecutive rows (or, for an expert
//! stack, of `count` whole expert matrices), then their bf16 scales, then their bf16 biases, each
//! part starting on a word; `scale_off`/`bias_off` are in bf16 halves from the buffer's start.
//! Rows / experts never straddle two slices. linear.wgsl and embed.wgsl read this layout.

use anyhow::{bail, Result};
use lily_core::config::ModelConfig;
use lily_core::weights::{Blob, Linear, Mixer, ModelWeights, MoeWeights, WeightData};

use crate::gpu::Gpu;

pub struct Slice {
    pub buf: wgpu::Buffer,
    /// First row (plain matrix) or first expert (stack) held.
    pub first: usize,
    pub count: usize,
    pub scale_off: u32,
    pub bias_off: u32,
}

pub struct GpuLinear {
    pub experts: usize,
    pub rows: usize,
    pub cols: usize,
    /// 4 or 8 (affine) or 16 (bf16).
    pub bits: u32,
    pub group: usize,
    /// Packed words per expert matrix.
    pub mat_words: usize,
    pub slices: Vec<Slice>,
}

fn pad4(v: &mut Vec<u8>) {
    v.resize(v.len().div_ceil(4) * 4, 0);
}

/// Uploads one matrix (or expert stack) in slices of at most `slice_bytes` each.
pub fn upload_linear(gpu: &Gpu, slice_bytes: u64, label: &str, lin: &Linear) -> Result<GpuLinear> {
    upload_stack(gpu, slice_bytes, label, lin, None)
}

/// The packed words, scales and biases of `lin` (empty scales and biases for bf16), with its
/// format: (bits, group).
fn parts_of(lin: &Linear) -> (u32, usize, &[u8], &[u8], &[u8]) {
    match &lin.data {
        WeightData::Affine {
            bits,
            group,
            packed,
            scales,
            biases,
        } => (
            *bits,
            *group,
            packed.bytes(),
            scales.bytes(),
            biases.bytes(),
        ),
        WeightData::Bf16 { data } => (16, 64, data.bytes(), &[][..], &[][..]),
    }
}

/// `upload_linear`, with `extra` (one matrix of the stack's shape and format: the shared
/// expert's) appended to an expert stack as its last expert, read from where it lies (no
/// joined copy of the stack is made).
fn upload_stack(
    gpu: &Gpu,
    slice_bytes: u64,
    label: &str,
    lin: &Linear,
    extra: Option<&Linear>,
) -> Result<GpuLinear> {
    let (bits, group, packed, scales, biases) = parts_of(lin);
    if !matches!(bits, 4 | 8 | 16) {
        bail!("{label}: {bits}-bit weights are not supported by the wgpu backend (4, 8 or bf16)");
    }
    if !lin.cols.is_multiple_of(group) || !group.is_multiple_of(32 / bits as usize) {
        bail!(
            "{label}: {} columns in groups of {group} do not fit the {bits}-bit kernels",
            lin.cols
        );
    }
    // One unit = one row of a plain matrix, or one whole matrix of an expert stack.
    let (units, unit_rows) = if lin.experts > 1 {
        (lin.experts, lin.rows)
    } else {
        (lin.rows, 1)
    };
    let packed_unit = unit_rows * lin.cols * bits as usize / 8;
    let halves_unit = if bits == 16 {
        0
    } else {
        unit_rows * (lin.cols / group)
    };
    if packed.len() != units * packed_unit || scales.len() != units * halves_unit * 2 {
        bail!("{label}: stored sizes do not match its shape");
    }
    // The extra unit's bytes (packed, scales, biases).
    let extra = match extra {
        None => None,
        Some(x) => {
            let (xb, xg, xp, xs, xz) = parts_of(x);
            if lin.experts < 2
                || x.experts != 1
                || x.rows != lin.rows
                || x.cols != lin.cols
                || xb != bits
                || xg != group
                || xp.len() != packed_unit
                || xs.len() != halves_unit * 2
            {
                bail!("{label}: the shared expert does not fit the routed stack");
            }
            Some((xp, xs, xz))
        }
    };
    let (stack_units, units) = (units, units + extra.is_some() as usize);
    // Bytes of units first..first + count of one part (`which`: 0 packed, 1 scales, 2 biases),
    // the extra unit after the stack's.
    let range = |which: usize, first: usize, count: usize, out: &mut Vec<u8>| {
        let (src, unit) = match which {
            0 => (packed, packed_unit),
            1 => (scales, halves_unit * 2),
            _ => (biases, halves_unit * 2),
        };
        let end = (first + count).min(stack_units);
        if first < end {
            out.extend_from_slice(&src[first * unit..end * unit]);
        }
        if first + count > stack_units {
            if let Some(x) = extra {
                out.extend_from_slice([x.0, x.1, x.2][which]);
            }
        }
    };
    let unit_bytes = (packed_unit + 4 * halves_unit) as u64;
    let per_slice = (slice_bytes.saturating_sub(16) / unit_bytes.max(1)) as usize;
    if per_slice == 0 {
        bail!(
            "{label}: one {} of {unit_bytes} bytes exceeds the slice limit ({slice_bytes} bytes: the device's largest storage binding)",
            if lin.experts > 1 { "expert matrix" } else { "row" },
        );
    }
    let mut slices = Vec::new();
    let mut first = 0;
    while first < units {
        let count = per_slice.min(units - first);
        let mut data = Vec::with_capacity(count * unit_bytes as usize + 8);
        range(0, first, count, &mut data);
        let scale_off = (data.len() / 2) as u32;
        range(1, first, count, &mut data);
        pad4(&mut data);
        let bias_off = (data.len() / 2) as u32;
        range(2, first, count, &mut data);
        let buf = gpu.upload(&format!("{label}[{first}..]"), &data)?;
        slices.push(Slice {
            buf,
            first,
            count,
            scale_off,
            bias_off,
        });
        first += count;
    }
    Ok(GpuLinear {
        experts: lin.experts + extra.is_some() as usize,
        rows: lin.rows,
        cols: lin.cols,
        bits,
        group,
        mat_words: packed_unit / 4,
        slices,
    })
}

/// Matrices that read the same input, concatenated by rows where their formats agree (one
/// dispatch for all), each part with the column its rows start at in the joint output.
pub struct Fused {
    pub parts: Vec<(GpuLinear, usize)>,
    /// Rows of the joint output (its row stride).
    pub rows: usize,
}

/// The bytes of `parts` one after the other (packed words, scales and biases each joined), when
/// all have the same format: the data of their rows stacked, or of their matrices stacked.
fn join_data(parts: &[&Linear]) -> Option<WeightData> {
    let first = parts.first()?;
    // Part `which` of an affine matrix of this format (0 packed, 1 scales, 2 biases), or the
    // data of a bf16 one (`which` 0).
    fn part(l: &Linear, format: Option<(u32, usize)>, which: usize) -> Option<&[u8]> {
        match (&l.data, format) {
            (
                WeightData::Affine {
                    bits,
                    group,
                    packed,
                    scales,
                    biases,
                },
                Some((b, g)),
            ) if *bits == b && *group == g => Some([packed, scales, biases][which].bytes()),
            (WeightData::Bf16 { data }, None) => Some(data.bytes()),
            _ => None,
        }
    }
    let joined = |format: Option<(u32, usize)>, which: usize| -> Option<Blob> {
        let mut v = Vec::new();
        for l in parts {
            v.extend_from_slice(part(l, format, which)?);
        }
        Some(Blob::owned(v))
    };
    match &first.data {
        WeightData::Affine { bits, group, .. } => {
            let f = Some((*bits, *group));
            Some(WeightData::Affine {
                bits: *bits,
                group: *group,
                packed: joined(f, 0)?,
                scales: joined(f, 1)?,
                biases: joined(f, 2)?,
            })
        }
        WeightData::Bf16 { .. } => Some(WeightData::Bf16 {
            data: joined(None, 0)?,
        }),
    }
}

/// The rows of `parts` stacked into one matrix, when all are plain (not expert stacks) with
/// the same columns and format.
fn concat(parts: &[&Linear]) -> Option<Linear> {
    let first = parts.first()?;
    if parts.iter().any(|l| l.experts != 1 || l.cols != first.cols) {
        return None;
    }
    Some(Linear {
        experts: 1,
        rows: parts.iter().map(|l| l.rows).sum(),
        cols: first.cols,
        data: join_data(parts)?,
    })
}

/// Whether the shared expert can ride in the routed experts' stacks as expert E (same shapes
/// and formats): it then runs in the same dispatches as the routed ones, with its sigmoid gate
/// as its weight.
pub fn shared_stackable(m: &MoeWeights) -> bool {
    let fits = |stack: &Linear, extra: &Linear| {
        stack.experts >= 2
            && extra.experts == 1
            && extra.rows == stack.rows
            && extra.cols == stack.cols
            && match (&stack.data, &extra.data) {
                (
                    WeightData::Affine {
                        bits: a, group: g, ..
                    },
                    WeightData::Affine {
                        bits: b, group: h, ..
                    },
                ) => a == b && g == h,
                (WeightData::Bf16 { .. }, WeightData::Bf16 { .. }) => true,
                _ => false,
            }
    };
    fits(&m.gate, &m.shared_gate) && fits(&m.up, &m.shared_up) && fits(&m.down, &m.shared_down)
}

/// `parts` (plain matrices reading the same input) as few uploads as their formats allow:
/// consecutive parts that `concat` joins become one matrix.
pub fn upload_fused(gpu: &Gpu, slice_bytes: u64, label: &str, parts: &[&Linear]) -> Result<Fused> {
    let mut out = Vec::new();
    let mut at = 0;
    let mut i = 0;
    while i < parts.len() {
        // The longest run from i that joins.
        let mut j = parts.len();
        let joined = loop {
            if j == i + 1 {
                break None;
            }
            if let Some(l) = concat(&parts[i..j]) {
                break Some(l);
            }
            j -= 1;
        };
        let (lin, n) = match joined {
            Some(l) => (
                upload_linear(gpu, slice_bytes, &format!("{label}[{i}..{j}]"), &l)?,
                j - i,
            ),
            None => (
                upload_linear(gpu, slice_bytes, &format!("{label}[{i}]"), parts[i])?,
                1,
            ),
        };
        let rows = lin.rows;
        out.push((lin, at));
        at += rows;
        i += n;
    }
    Ok(Fused {
        parts: out,
        rows: at,
    })
}

pub struct GpuAttention {
    /// q_proj (query | gate per head), k_proj, v_proj: joint output [q | k | v] per token.
    pub qkv: Fused,
    pub o_proj: GpuLinear,
    /// q_norm then k_norm, f32.
    pub qk_norm: wgpu::Buffer,
}

pub struct GpuDeltaNet {
    /// in_proj_qkv, in_proj_z, in_proj_b, in_proj_a: joint output [qkv | z | b | a] per token.
    pub in_proj: Fused,
    pub out_proj: GpuLinear,
    /// `[conv_dim, K]` taps, f32.
    pub conv: wgpu::Buffer,
    /// A_log then dt_bias, f32.
    pub decay: wgpu::Buffer,
    pub norm: wgpu::Buffer,
}

pub enum GpuMixer {
    Attention(GpuAttention),
    DeltaNet(GpuDeltaNet),
}

pub struct GpuMoe {
    /// The router's E rows and the shared expert's gate row: joint output [E + 1] per token.
    pub router: Fused,
    pub gate: GpuLinear,
    pub up: GpuLinear,
    pub down: GpuLinear,
    /// The shared expert's gate, up and down, or `None` where they are expert E of the stacks
    /// above (`shared_stackable`).
    pub shared: Option<SharedExpert>,
}

pub struct SharedExpert {
    pub gate: GpuLinear,
    pub up: GpuLinear,
    pub down: GpuLinear,
}

pub struct GpuLayer {
    pub input_norm: wgpu::Buffer,
    pub post_norm: wgpu::Buffer,
    pub mixer: GpuMixer,
    pub moe: GpuMoe,
}

pub struct GpuModel {
    pub embed: GpuLinear,
    pub layers: Vec<GpuLayer>,
    pub final_norm: wgpu::Buffer,
    pub lm_head: GpuLinear,
    /// Bytes uploaded.
    pub bytes: u64,
}

/// `stack`: put the shared expert into the routed stacks as expert E (`shared_stackable`).
fn upload_moe(gpu: &Gpu, sb: u64, p: &str, m: &MoeWeights, stack: bool) -> Result<GpuMoe> {
    if m.shared_expert_gate.rows != 1 || m.router.experts != 1 {
        bail!("{p}: the shared expert's gate must be one row and the router one matrix");
    }
    let router = upload_fused(
        gpu,
        sb,
        &format!("{p}.router"),
        &[&m.router, &m.shared_expert_gate],
    )?;
    let experts = |name: &str, stack_w: &Linear, extra: &Linear| -> Result<GpuLinear> {
        let label = format!("{p}.experts.{name}");
        upload_stack(gpu, sb, &label, stack_w, stack.then_some(extra))
    };
    let gate = experts("gate", &m.gate, &m.shared_gate)?;
    let up = experts("up", &m.up, &m.shared_up)?;
    let down = experts("down", &m.down, &m.shared_down)?;
    let shared = if stack {
        None
    } else {
        Some(SharedExpert {
            gate: upload_linear(gpu, sb, &format!("{p}.shared.gate"), &m.shared_gate)?,
            up: upload_linear(gpu, sb, &format!("{p}.shared.up"), &m.shared_up)?,
            down: upload_linear(gpu, sb, &format!("{p}.shared.down"), &m.shared_down)?,
        })
    };
    Ok(GpuMoe {
        router,
        gate,
        up,
        down,
        shared,
    })
}

/// Whether every layer's shared expert rides in its routed stacks (`shared_stackable`).
pub fn stack_shared(w: &ModelWeights) -> bool {
    !w.layers.is_empty() && w.layers.iter().all(|l| shared_stackable(&l.moe))
}

/// Shapes the kernels rely on (fixed-size arrays in the WGSL), checked once here.
pub fn check_shapes(c: &ModelConfig) -> Result<()> {
    let checks = [
        (
            c.head_dim <= 256 && c.head_dim.is_multiple_of(4),
            "head_dim ≤ 256 and a multiple of 4 (attn_prep/attend)",
        ),
        (
            c.rotary_dim <= c.head_dim && c.rotary_dim.is_multiple_of(2),
            "an even rotary_dim ≤ head_dim",
        ),
        (
            c.n_kv_heads > 0 && c.n_heads.is_multiple_of(c.n_kv_heads),
            "n_heads a multiple of n_kv_heads",
        ),
        (
            c.dn_k_dim <= 128 && c.dn_k_dim.is_multiple_of(4),
            "linear_key_head_dim ≤ 128 and a multiple of 4 (dn_recur)",
        ),
        (c.dn_v_dim <= 128, "linear_value_head_dim ≤ 128 (dn_recur)"),
        (
            c.dn_k_heads > 0 && c.dn_v_heads.is_multiple_of(c.dn_k_heads),
            "linear_num_value_heads a multiple of linear_num_key_heads",
        ),
        (
            (2..=9).contains(&c.conv_kernel),
            "linear_conv_kernel_dim in 2..=9 (dn_conv)",
        ),
        (
            c.top_k <= 16 && c.top_k <= c.n_experts,
            "num_experts_per_tok ≤ 16 (moe_route)",
        ),
        (
            c.n_experts < 512,
            "num_experts < 512 (moe_route, moe_group with the shared expert)",
        ),
        (
            c.hidden.is_multiple_of(4),
            "hidden_size a multiple of 4 (rms_norm)",
        ),
    ];
    for (ok, what) in checks {
        if !ok {
            bail!("the wgpu backend needs {what}");
        }
    }
    Ok(())
}

/// The whole model; `max_slice_bytes` lowers the slice size below the device's limit (tests use
/// it to cut even a tiny model into many slices).
pub fn upload_model(gpu: &Gpu, w: &ModelWeights, max_slice_bytes: Option<u64>) -> Result<GpuModel> {
    check_shapes(&w.config)?;
    let stack = stack_shared(w);
    let sb = max_slice_bytes.unwrap_or(u64::MAX).min(gpu.max_binding());
    let mut layers = Vec::new();
    for (i, l) in w.layers.iter().enumerate() {
        let p = format!("layers.{i}");
        let c = &w.config;
        let mixer = match &l.mixer {
            Mixer::Attention(a) => {
                let want = (2 * c.n_heads + 2 * c.n_kv_heads) * c.head_dim;
                let got = a.q_proj.rows + a.k_proj.rows + a.v_proj.rows;
                if got != want || a.q_proj.rows != 2 * c.n_heads * c.head_dim {
                    bail!("{p}: q/k/v rows {got} do not match the config ({want})");
                }
                let mut norms = a.q_norm.clone();
                norms.extend_from_slice(&a.k_norm);
                GpuMixer::Attention(GpuAttention {
                    qkv: upload_fused(
                        gpu,
                        sb,
                        &format!("{p}.qkv_proj"),
                        &[&a.q_proj, &a.k_proj, &a.v_proj],
                    )?,
                    o_proj: upload_linear(gpu, sb, &format!("{p}.o_proj"), &a.o_proj)?,
                    qk_norm: gpu.upload_f32(&format!("{p}.qk_norm"), &norms)?,
                })
            }
            Mixer::DeltaNet(d) => {
                let want = c.conv_dim() + c.dn_v_heads * c.dn_v_dim + 2 * c.dn_v_heads;
                let got = d.in_qkv.rows + d.in_z.rows + d.in_b.rows + d.in_a.rows;
                if got != want || d.in_qkv.rows != c.conv_dim() {
                    bail!("{p}: in_proj rows {got} do not match the config ({want})");
                }
                let mut decay = d.a_log.clone();
                decay.extend_from_slice(&d.dt_bias);
                GpuMixer::DeltaNet(GpuDeltaNet {
                    in_proj: upload_fused(
                        gpu,
                        sb,
                        &format!("{p}.in_proj"),
                        &[&d.in_qkv, &d.in_z, &d.in_b, &d.in_a],
                    )?,
                    out_proj: upload_linear(gpu, sb, &format!("{p}.out_proj"), &d.out_proj)?,
                    conv: gpu.upload_f32(&format!("{p}.conv1d"), &d.conv)?,
                    decay: gpu.upload_f32(&format!("{p}.decay"), &decay)?,
                    norm: gpu.upload_f32(&format!("{p}.norm"), &d.norm)?,
                })
            }
        };
        layers.push(GpuLayer {
            input_norm: gpu.upload_f32(&format!("{p}.input_layernorm"), &l.input_norm)?,
            post_norm: gpu.upload_f32(&format!("{p}.post_attention_layernorm"), &l.post_norm)?,
            mixer,
            moe: upload_moe(gpu, sb, &format!("{p}.mlp"), &l.moe, stack)?,
        });
        // Let the staged uploads of each layer reach the device before the next is staged.
        gpu.queue.submit([]);
        gpu.wait()?;
    }
    let model = GpuModel {
        embed: upload_linear(gpu, sb, "embed_tokens", &w.embed)?,
        layers,
        final_norm: gpu.upload_f32("norm", &w.final_norm)?,
        lm_head: upload_linear(gpu, sb, "lm_head", &w.lm_head)?,
        bytes: 0,
    };
    gpu.queue.submit([]);
    gpu.wait()?;
    let bytes = device_bytes(&model);
    Ok(GpuModel { bytes, ..model })
}

fn linear_bytes(l: &GpuLinear) -> u64 {
    l.slices.iter().map(|s| s.buf.size()).sum()
}

fn device_bytes(m: &GpuModel) -> u64 {
    let mut n = linear_bytes(&m.embed) + linear_bytes(&m.lm_head);
    for l in &m.layers {
        let moe = &l.moe;
        n += moe
            .router
            .parts
            .iter()
            .map(|x| linear_bytes(&x.0))
            .sum::<u64>();
        n += [&moe.gate, &moe.up, &moe.down]
            .iter()
            .map(|x| linear_bytes(x))
            .sum::<u64>();
        if let Some(sh) = &moe.shared {
            n += [&sh.gate, &sh.up, &sh.down]
                .iter()
                .map(|x| linear_bytes(x))
                .sum::<u64>();
        }
        n += match &l.mixer {
            GpuMixer::Attention(a) => {
                a.qkv.parts.iter().map(|x| linear_bytes(&x.0)).sum::<u64>()
                    + linear_bytes(&a.o_proj)
            }
            GpuMixer::DeltaNet(d) => {
                d.in_proj
                    .parts
                    .iter()
                    .map(|x| linear_bytes(&x.0))
                    .sum::<u64>()
                    + linear_bytes(&d.out_proj)
            }
        };
    }
    n
}
