//! Device-side sampling with the host `Sampler`'s exact steps (lily-core/src/sampling.rs): the
//! penalties, temperature, top_k, top_p and min_p run in sample.cu, the host only draws the
//! uniform (`Sampler::next_uniform`, so the random stream is the host's) and reads the token id
//! back to report it. The device keeps its own history (`hist`), loaded from the sampler when a
//! decode call starts and bumped by the kernel after each pick, as `Sampler::accept` does.
//!
//! Covered: temperature > 0 with top_k in 1..=256, and greedy with penalties or logit_bias (the
//! same kernels with top_k 1 and no temperature: the largest adjusted logit, ties to the lower
//! id, as the host's argmax; no uniform is drawn, as the host draws none when greedy). Plain
//! greedy has its own kernel (`argmax_logprob`); top_k 0 (off) or above 256 stays on the host, on
//! downloaded logits: a device top-p over the whole vocabulary would need a full sort, which the
//! host already does well. A constrained step (a grammar's token mask) runs here too: the mask is
//! uploaded as a bitset and applied to the adjusted logits before the pick.

use anyhow::Result;
use lily_core::sampling::{Sampler, SamplingParams};

use crate::gpu::{DevBuf, Gpu};
use crate::kernels::sample::{
    Pick, PickBuffers, PickParams, Sample, ARGMAX_SCRATCH, PICK_MAX_K, SAMPLE_CANDS_WORDS,
};

// `hist` words: lily-core's `HISTORY_SEEN` / `HISTORY_COUNT` (HIST_SEEN / HIST_COUNT in sample.cu).

/// Whether `params` can be sampled on the device (see the module comment).
pub fn supports(params: &SamplingParams) -> bool {
    params.temperature <= 0.0 || (params.top_k >= 1 && params.top_k <= PICK_MAX_K)
}

/// The device state of one sampler: history, logit_bias table, scratch.
pub struct DeviceSampler {
    vocab: usize,
    params: PickParams,
    hist: DevBuf,
    scaled: DevBuf,
    bias_ids: DevBuf,
    bias_vals: DevBuf,
    n_bias: usize,
    /// Greedy on adjusted logits: top_k 1, no temperature, no uniform drawn; picked by the
    /// two-stage argmax over these partials instead of sample_pick's one block.
    greedy: bool,
    argmax_parts: DevBuf,
    /// The many-block pick's candidates (`Plan::many_block_sampling`), else None: one block.
    cands: Option<DevBuf>,
}

impl DeviceSampler {
    /// Uploads `sampler`'s parameters, logit_bias and history (the tokens it has seen so far);
    /// a sampled pick's first pass runs over many blocks when `many_blocks`
    /// (`Plan::many_block_sampling`).
    pub fn new(
        gpu: &Gpu,
        vocab: usize,
        sampler: &Sampler,
        many_blocks: bool,
    ) -> Result<DeviceSampler> {
        let p = &sampler.params;
        let hist = sampler.device_history(vocab);
        let bias = p.sorted_logit_bias(vocab);
        let ids: Vec<i32> = bias.iter().map(|e| e.0 as i32).collect();
        let vals: Vec<f32> = bias.iter().map(|e| e.1).collect();
        // One spare entry so an empty table is still a valid allocation.
        let bias_ids = gpu.alloc((ids.len() + 1) * 4)?;
        let bias_vals = gpu.alloc((vals.len() + 1) * 4)?;
        gpu.write(&bias_ids, 0, &ids)?;
        gpu.write(&bias_vals, 0, &vals)?;
        let greedy = p.temperature <= 0.0;
        Ok(DeviceSampler {
            vocab,
            params: PickParams {
                inv_t: if greedy { 1.0 } else { 1.0 / p.temperature },
                top_k: if greedy { 1 } else { p.top_k },
                top_p: if greedy { 1.0 } else { p.top_p },
                min_p: if greedy { 0.0 } else { p.min_p },
                repetition: p.repetition_penalty,
                presence: p.presence_penalty,
                frequency: p.frequency_penalty,
            },
            hist: gpu.upload(&hist)?,
            scaled: gpu.alloc(vocab * 4)?,
            bias_ids,
            bias_vals,
            n_bias: ids.len(),
            greedy,
            argmax_parts: gpu.alloc(ARGMAX_SCRATCH * 4)?,
            cands: if many_blocks && !greedy {
                Some(gpu.alloc(SAMPLE_CANDS_WORDS * 4)?)
            } else {
                None
            },
        })
    }

    /// Picks the next token from `logits` [vocab] on the device: draws the sampler's uniform,
    /// writes the token to `token_out` and its raw log-probability to `logprob_out`. The caller
    /// still calls `sampler.accept(token)` once it has read the token (the host history stays
    /// the reference for later host sampling). `mask`: a constrained step's allowed tokens, a
    /// bitset on the device (`TokenMask::words`).
    #[allow(clippy::too_many_arguments)]
    pub fn sample(
        &self,
        gpu: &Gpu,
        kernels: &Sample,
        sampler: &mut Sampler,
        logits: u64,
        token_out: u64,
        logprob_out: u64,
        mask: Option<u64>,
    ) -> Result<()> {
        let u = if self.greedy {
            0.0
        } else {
            sampler.next_uniform()
        };
        let b = PickBuffers {
            hist: self.hist.ptr,
            bias_ids: self.bias_ids.ptr,
            bias_vals: self.bias_vals.ptr,
            n_bias: self.n_bias,
            scaled: self.scaled.ptr,
            cands: self.cands.as_ref().map_or(0, |c| c.ptr),
        };
        let pick = Pick {
            logits,
            vocab: self.vocab,
            params: &self.params,
            buffers: &b,
            u,
            token_out,
            logprob_out,
            mask,
        };
        if self.greedy {
            kernels.pick_greedy(gpu, &pick, self.argmax_parts.ptr)
        } else {
            kernels.pick(gpu, &pick)
        }
    }
}
