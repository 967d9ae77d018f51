//! TEMPORARY stub of the lead's announced weights API, so lily-cuda compiles before it lands.
//! Reverted before merging main.
use crate::config::ModelConfig;

pub enum Blob {
    Owned(Vec<u8>),
}
impl Blob {
    pub fn bytes(&self) -> &[u8] {
        match self {
            Blob::Owned(v) => v,
        }
    }
}
pub enum WeightData {
    Affine { bits: u32, group: usize, packed: Blob, scales: Blob, biases: Blob },
    Bf16 { data: Blob },
}
pub struct Linear {
    pub experts: usize,
    pub rows: usize,
    pub cols: usize,
    pub data: WeightData,
}
pub struct AttentionWeights {
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
}
pub struct DeltaNetWeights {
    pub in_qkv: Linear,
    pub in_z: Linear,
    pub in_b: Linear,
    pub in_a: Linear,
    pub conv: Vec<f32>,
    pub a_log: Vec<f32>,
    pub dt_bias: Vec<f32>,
    pub norm: Vec<f32>,
    pub out_proj: Linear,
}
pub enum Mixer {
    Attention(AttentionWeights),
    DeltaNet(DeltaNetWeights),
}
pub struct MoeWeights {
    pub router: Linear,
    pub gate: Linear,
    pub up: Linear,
    pub down: Linear,
    pub shared_gate: Linear,
    pub shared_up: Linear,
    pub shared_down: Linear,
    pub shared_expert_gate: Linear,
}
pub struct LayerWeights {
    pub input_norm: Vec<f32>,
    pub post_norm: Vec<f32>,
    pub mixer: Mixer,
    pub moe: MoeWeights,
}
pub struct ModelWeights {
    pub config: ModelConfig,
    pub embed: Linear,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Vec<f32>,
    pub lm_head: Linear,
}
