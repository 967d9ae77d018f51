//! Sampling parameters and the host sampler. `SamplingParams` is a plain struct so a GPU sampler can
//! copy it as is.

/// Every knob of token selection. `temperature == 0` means greedy.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: u32,
    pub min_p: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub repetition_penalty: f32,
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: u64,
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            seed: 0,
        }
    }
}

/// Stateful sampler: parameters, random state and the token history the penalties need.
#[derive(Clone, Debug)]
pub struct Sampler {
    pub params: SamplingParams,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        Sampler { params }
    }

    /// Picks the next token from raw logits. (Greedy only until the text issue lands.)
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        argmax(logits)
    }

    /// Records a token that was generated (for presence/frequency/repetition penalties).
    pub fn accept(&mut self, _token: u32) {}
}

pub fn argmax(xs: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &x) in xs.iter().enumerate() {
        if x > xs[best] {
            best = i;
        }
    }
    best as u32
}
