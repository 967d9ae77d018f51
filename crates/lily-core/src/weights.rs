//! The model's weights as backends see them: every matrix stays in its checkpoint form (4/8-bit
//! affine groups, or bf16) and is read through a `Blob` that borrows the memory-mapped file.
//! Small vectors (norms, conv taps, decay parameters) are converted to f32 at load, with the +1
//! norm convention already resolved (MODEL.md §2.2, §3.3): a backend computes
//! `y = x · rsqrt(mean(x²) + eps) · w` with the `w` stored here, whatever the checkpoint format.

use std::sync::Arc;

use half::bf16;

use crate::config::ModelConfig;

/// Where a blob's bytes live.
pub enum Backing {
    Mmap(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mmap(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// A byte range of a mapped checkpoint file (or of an owned buffer). Cheap to clone.
#[derive(Clone)]
pub struct Blob {
    backing: Arc<Backing>,
    start: usize,
    len: usize,
}

impl Blob {
    pub fn new(backing: Arc<Backing>, start: usize, len: usize) -> Self {
        debug_assert!(start + len <= backing.bytes().len());
        Blob {
            backing,
            start,
            len,
        }
    }
    pub fn owned(bytes: Vec<u8>) -> Self {
        let len = bytes.len();
        Blob {
            backing: Arc::new(Backing::Owned(bytes)),
            start: 0,
            len,
        }
    }
    pub fn bytes(&self) -> &[u8] {
        &self.backing.bytes()[self.start..self.start + self.len]
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// A sub-range, in bytes.
    pub fn slice(&self, start: usize, len: usize) -> Blob {
        assert!(start + len <= self.len, "blob slice out of range");
        Blob {
            backing: self.backing.clone(),
            start: self.start + start,
            len,
        }
    }
}

impl std::fmt::Debug for Blob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Blob({} bytes)", self.len)
    }
}

/// How a matrix is stored.
#[derive(Clone, Debug)]
pub enum WeightData {
    /// MLX affine quantisation (MODEL.md §3.4): `w = scale · q + bias` per group of `group`
    /// consecutive input elements. `packed` holds little-endian u32 words `[E, rows, cols·bits/32]`
    /// with element j of a word at bit offset `bits·j`; `scales` and `biases` are bf16
    /// `[E, rows, cols/group]`.
    Affine {
        bits: u32,
        group: usize,
        packed: Blob,
        scales: Blob,
        biases: Blob,
    },
    /// Plain bf16 `[E, rows, cols]`.
    Bf16 { data: Blob },
}

/// A bias-free linear map `y = W x`, W `[rows, cols]` (PyTorch layout), or a stack of `experts`
/// such matrices stored back to back.
#[derive(Clone, Debug)]
pub struct Linear {
    pub experts: usize,
    pub rows: usize,
    pub cols: usize,
    pub data: WeightData,
}

impl Linear {
    /// Matrix `e` of a stack, as a plain linear map sharing the same bytes.
    pub fn expert(&self, e: usize) -> Linear {
        assert!(e < self.experts, "expert {e} out of {}", self.experts);
        let data = match &self.data {
            WeightData::Affine {
                bits,
                group,
                packed,
                scales,
                biases,
            } => {
                let p = packed.len() / self.experts;
                let s = scales.len() / self.experts;
                WeightData::Affine {
                    bits: *bits,
                    group: *group,
                    packed: packed.slice(e * p, p),
                    scales: scales.slice(e * s, s),
                    biases: biases.slice(e * s, s),
                }
            }
            WeightData::Bf16 { data } => {
                let n = data.len() / self.experts;
                WeightData::Bf16 {
                    data: data.slice(e * n, n),
                }
            }
        };
        Linear {
            experts: 1,
            rows: self.rows,
            cols: self.cols,
            data,
        }
    }

    /// Row `r` of a plain matrix, dequantised into `out` (`cols` values).
    pub fn dequant_row(&self, r: usize, out: &mut [f32]) {
        debug_assert_eq!(self.experts, 1);
        let cols = self.cols;
        match &self.data {
            WeightData::Affine {
                bits,
                group,
                packed,
                scales,
                biases,
            } => {
                let row_bytes = cols * *bits as usize / 8;
                let q = &packed.bytes()[r * row_bytes..(r + 1) * row_bytes];
                let groups = cols / group;
                let s = &scales.bytes()[r * groups * 2..(r + 1) * groups * 2];
                let b = &biases.bytes()[r * groups * 2..(r + 1) * groups * 2];
                for g in 0..groups {
                    let scale = read_bf16(s, g);
                    let bias = read_bf16(b, g);
                    for i in 0..*group {
                        let c = g * group + i;
                        out[c] = scale * unpack(q, *bits, c) as f32 + bias;
                    }
                }
            }
            WeightData::Bf16 { data } => {
                let row = &data.bytes()[r * cols * 2..(r + 1) * cols * 2];
                for (c, o) in out.iter_mut().enumerate().take(cols) {
                    *o = read_bf16(row, c);
                }
            }
        }
    }

    /// Bytes one token's pass through this (plain) matrix reads: the decode traffic.
    pub fn bytes_per_matrix(&self) -> usize {
        match &self.data {
            WeightData::Affine {
                packed,
                scales,
                biases,
                ..
            } => (packed.len() + scales.len() + biases.len()) / self.experts,
            WeightData::Bf16 { data } => data.len() / self.experts,
        }
    }
}

/// Element `c` of a packed row (4 or 8 bits, little-endian, low bits first).
#[inline]
pub fn unpack(row: &[u8], bits: u32, c: usize) -> u32 {
    match bits {
        4 => ((row[c / 2] >> (4 * (c % 2))) & 0xF) as u32,
        8 => row[c] as u32,
        _ => {
            // Generic path (2, 3, 5, 6 bits are not produced by any supported checkpoint).
            let bit = c * bits as usize;
            let word = u64::from_le_bytes({
                let mut w = [0u8; 8];
                let start = bit / 8;
                let end = (start + 8).min(row.len());
                w[..end - start].copy_from_slice(&row[start..end]);
                w
            });
            ((word >> (bit % 8)) & ((1u64 << bits) - 1)) as u32
        }
    }
}

#[inline]
pub fn read_bf16(bytes: &[u8], i: usize) -> f32 {
    bf16::from_bits(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])).to_f32()
}

#[derive(Clone, Debug)]
pub struct AttentionWeights {
    /// `[2·Hq·D, hidden]`; per head h, rows `h·2D..h·2D+D` are the query, the next D its gate.
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
}

#[derive(Clone, Debug)]
pub struct DeltaNetWeights {
    /// `[2·key_dim + value_dim, hidden]`: q, k, v rows (head-major).
    pub in_qkv: Linear,
    pub in_z: Linear,
    pub in_b: Linear,
    pub in_a: Linear,
    /// Depthwise causal conv taps `[conv_dim, K]`; tap K−1 multiplies the current token.
    pub conv: Vec<f32>,
    pub a_log: Vec<f32>,
    pub dt_bias: Vec<f32>,
    /// Gated RMSNorm weight over one value head (no +1 in any format).
    pub norm: Vec<f32>,
    pub out_proj: Linear,
}

#[derive(Clone, Debug)]
pub enum Mixer {
    Attention(AttentionWeights),
    DeltaNet(DeltaNetWeights),
}

#[derive(Clone, Debug)]
pub struct MoeWeights {
    /// `[E, hidden]` (8-bit in MLX checkpoints).
    pub router: Linear,
    /// Stacks of E matrices: gate and up `[I, hidden]`, down `[hidden, I]`.
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
    pub shared_gate: Linear,
    pub shared_up: Linear,
    pub shared_down: Linear,
    /// `[1, hidden]`: the shared expert's sigmoid gate.
    pub shared_expert_gate: Linear,
}

#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub input_norm: Vec<f32>,
    pub post_norm: Vec<f32>,
    pub mixer: Mixer,
    pub moe: MoeWeights,
}

/// Which file format the weights came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CheckpointFormat {
    /// Original Hugging Face safetensors (bf16, zero-centred norms stored as w).
    Hf,
    /// MLX conversion (affine-quantised, norms stored as 1 + w).
    Mlx,
}

#[derive(Clone, Debug)]
pub struct ModelWeights {
    pub config: ModelConfig,
    pub format: CheckpointFormat,
    /// `[vocab, hidden]`.
    pub embed: Linear,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Vec<f32>,
    /// `[vocab, hidden]`, untied.
    pub lm_head: Linear,
}
