//! sample.cu: greedy pick with its log-probability, the host sampler's steps on the device
//! (sampler.rs), and the device-side position.

use anyhow::{bail, Result};

use super::{blocks, config, KernelFile};
use crate::gpu::{Gpu, Kernel, Module};

/// Threads of the one-block argmax_logprob and sample_pick kernels.
pub const SAMPLE_THREADS: usize = 1024;
/// Blocks of the two-stage argmax (argmax_part), and threads of its final block.
pub const ARGMAX_BLOCKS: usize = 128;
/// f32 scratch the two-stage argmax needs (four per block).
pub const ARGMAX_SCRATCH: usize = 4 * ARGMAX_BLOCKS;
/// Largest top_k the device sampler takes.
pub const PICK_MAX_K: u32 = 256;
/// Blocks of `sample_part` (the many-block first pass of a sampled pick) and the most values a
/// block takes (its slice of the vocabulary, in shared memory).
pub const SAMPLE_PARTS: usize = 128;
pub const SAMPLE_PART_CAP: usize = 2048;
/// u32 words of the candidates' scratch (`sample_part` / `sample_pick_parts`, see sample.cu).
pub const SAMPLE_CANDS_WORDS: usize = 3 * SAMPLE_PARTS + 4 * SAMPLE_PARTS * PICK_MAX_K as usize;
/// Most top log-probabilities the device computes (OpenAI's maximum `top_logprobs`).
pub const LOGPROB_MAX_K: usize = 20;
/// u32 words of the top log-probabilities' scratch: per ARGMAX_BLOCKS block its maximum, its
/// exp-sum and LOGPROB_MAX_K candidates of two words (see sample.cu).
pub const LOGPROB_SCRATCH_WORDS: usize = ARGMAX_BLOCKS * (2 + 2 * LOGPROB_MAX_K);

pub const FILE: KernelFile = KernelFile {
    name: "sample",
    source: include_str!("../../../../shaders/cuda/sample.cu"),
    defines: &[
        ("SAMPLE_THREADS", SAMPLE_THREADS as i64),
        ("PICK_MAX_K", PICK_MAX_K as i64),
        ("ARGMAX_BLOCKS", ARGMAX_BLOCKS as i64),
        ("SAMPLE_PARTS", SAMPLE_PARTS as i64),
        ("SAMPLE_PART_CAP", SAMPLE_PART_CAP as i64),
        ("LOGPROB_MAX_K", LOGPROB_MAX_K as i64),
    ],
};

/// The greedy token of `logits` [vocab] into `token_out` (i32) and its log-probability into
/// `logprob_out` (f32). With `partials` (f32 [ARGMAX_SCRATCH] scratch) it runs over
/// ARGMAX_BLOCKS blocks and a final one; without, in one block.
pub struct Argmax {
    pub logits: u64,
    pub vocab: usize,
    pub token_out: u64,
    pub logprob_out: u64,
    pub partials: Option<u64>,
}

/// The sampler's knobs as sample.cu takes them (`SamplingParams`, with 1/temperature computed
/// in f32 exactly as the host sampler does).
#[derive(Clone, Copy, Debug)]
pub struct PickParams {
    pub inv_t: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition: f32,
    pub presence: f32,
    pub frequency: f32,
}

/// Buffers of one device sampling step (see sample.cu): `hist` [vocab] u32 history, `bias_ids`
/// (sorted stably) / `bias_vals` [n_bias], `scaled` [vocab] f32 scratch.
pub struct PickBuffers {
    pub hist: u64,
    pub bias_ids: u64,
    pub bias_vals: u64,
    pub n_bias: usize,
    pub scaled: u64,
    /// Scratch of SAMPLE_CANDS_WORDS u32 for the many-block pick, or 0 for one block.
    pub cands: u64,
}

/// One sampling step: `u` is the host-drawn uniform.
pub struct Pick<'a> {
    pub logits: u64,
    pub vocab: usize,
    pub params: &'a PickParams,
    pub buffers: &'a PickBuffers,
    pub u: f64,
    pub token_out: u64,
    pub logprob_out: u64,
    /// A constrained step: the allowed tokens as a bitset on the device (u32 [vocab / 32],
    /// lily-core's `TokenMask::words`), applied after the penalties.
    pub mask: Option<u64>,
}

/// The `k` (1..=LOGPROB_MAX_K, at most `vocab`) most likely tokens of `logits` [vocab] with their
/// log-probabilities, into `out` (u32 [2k]: id, then the f32 bits of its log-probability, most
/// likely first, ties to the lower id); `parts` is u32 [LOGPROB_SCRATCH_WORDS] scratch.
pub struct TopLogprobs {
    pub logits: u64,
    pub vocab: usize,
    pub k: usize,
    pub parts: u64,
    pub out: u64,
}

pub struct Sample {
    logprob_part: Kernel,
    logprob_final: Kernel,
    argmax_logprob: Kernel,
    argmax_part: Kernel,
    argmax_final: Kernel,
    adjust: Kernel,
    pick: Kernel,
    part: Kernel,
    pick_parts: Kernel,
    mask: Kernel,
    advance_pos: Kernel,
    advance_pos_rows: Kernel,
}

impl Sample {
    pub fn load(m: &Module) -> Result<Sample> {
        Ok(Sample {
            logprob_part: m.kernel("logprob_part")?,
            logprob_final: m.kernel("logprob_final")?,
            argmax_logprob: m.kernel("argmax_logprob")?,
            argmax_part: m.kernel("argmax_part")?.waits_for_predecessor(),
            argmax_final: m.kernel("argmax_final")?.waits_for_predecessor(),
            adjust: m.kernel("sample_adjust")?,
            pick: m.kernel("sample_pick")?,
            part: m.kernel("sample_part")?,
            pick_parts: m.kernel("sample_pick_parts")?,
            mask: m.kernel("sample_mask")?,
            advance_pos: m.kernel("advance_pos")?.waits_for_predecessor(),
            advance_pos_rows: m.kernel("advance_pos_rows")?.waits_for_predecessor(),
        })
    }

    pub fn argmax_logprob(&self, gpu: &Gpu, a: &Argmax) -> Result<()> {
        let vocab = a.vocab as i32;
        if let Some(parts) = a.partials {
            return self.argmax_two_stage(gpu, a.logits, a, parts, None);
        }
        let cfg = config((1, 1, 1), SAMPLE_THREADS as u32, 0);
        gpu.launch(&self.argmax_logprob, cfg, |l| {
            l.arg(&a.logits)
                .arg(&vocab)
                .arg(&a.token_out)
                .arg(&a.logprob_out);
        })
    }

    /// The largest of `keys` (first index on ties) and its log-probability under `a.logits`, over
    /// ARGMAX_BLOCKS blocks and a final one; `hist` (with `remember`) is bumped as `pick` does.
    fn argmax_two_stage(
        &self,
        gpu: &Gpu,
        keys: u64,
        a: &Argmax,
        parts: u64,
        hist: Option<(u64, bool)>,
    ) -> Result<()> {
        let vocab = a.vocab as i32;
        let cfg = config((ARGMAX_BLOCKS as u32, 1, 1), 256, 0);
        gpu.launch(&self.argmax_part, cfg, |l| {
            l.arg(&keys).arg(&a.logits).arg(&vocab).arg(&parts);
        })?;
        let n_parts = ARGMAX_BLOCKS as i32;
        let (hist, remember) = hist.map_or((0u64, 0i32), |(h, r)| (h, r as i32));
        let cfg = config((1, 1, 1), ARGMAX_BLOCKS as u32, 0);
        gpu.launch(&self.argmax_final, cfg, |l| {
            l.arg(&parts)
                .arg(&n_parts)
                .arg(&a.logits)
                .arg(&vocab)
                .arg(&a.token_out)
                .arg(&a.logprob_out)
                .arg(&hist)
                .arg(&remember);
        })
    }

    /// keys [vocab] = src where the bitset `words` (u32 [vocab / 32] on the device) allows the
    /// token, else -inf; src may be keys.
    pub fn mask(&self, gpu: &Gpu, src: u64, words: u64, vocab: usize, keys: u64) -> Result<()> {
        let n = vocab as i32;
        let cfg = config((blocks(vocab, 256), 1, 1), 256, 0);
        gpu.launch(&self.mask, cfg, |l| {
            l.arg(&src).arg(&words).arg(&n).arg(&keys);
        })
    }

    /// The greedy token among those the bitset `words` allows (a constrained step), with its
    /// log-probability under the raw `a.logits`: the masked logits go to `keys` (f32 [vocab]
    /// scratch), then the two-stage argmax (`a.partials` is required).
    pub fn argmax_masked(&self, gpu: &Gpu, a: &Argmax, words: u64, keys: u64) -> Result<()> {
        let Some(parts) = a.partials else {
            bail!("a masked argmax needs the two-stage scratch");
        };
        self.mask(gpu, a.logits, words, a.vocab, keys)?;
        self.argmax_two_stage(gpu, keys, a, parts, None)
    }

    /// sample_adjust: penalties, logit_bias and 1/temperature into `scaled`, then the step's
    /// mask, if any.
    fn adjust(&self, gpu: &Gpu, a: &Pick) -> Result<()> {
        let (pp, b) = (a.params, a.buffers);
        let (vocab, n_bias) = (a.vocab as i32, b.n_bias as i32);
        let cfg = config((blocks(a.vocab, 256), 1, 1), 256, 0);
        gpu.launch(&self.adjust, cfg, |l| {
            l.arg(&a.logits)
                .arg(&vocab)
                .arg(&b.hist)
                .arg(&b.bias_ids)
                .arg(&b.bias_vals)
                .arg(&n_bias)
                .arg(&pp.repetition)
                .arg(&pp.presence)
                .arg(&pp.frequency)
                .arg(&pp.inv_t)
                .arg(&b.scaled);
        })?;
        match a.mask {
            Some(words) => self.mask(gpu, b.scaled, words, a.vocab, b.scaled),
            None => Ok(()),
        }
    }

    /// Greedy on adjusted logits (penalties, logit_bias; `a.params` with top_k 1 and no
    /// temperature): sample_adjust, then the two-stage argmax of the adjusted values, with the
    /// log-probability under the raw logits and the history bumped, as `pick` would give.
    pub fn pick_greedy(&self, gpu: &Gpu, a: &Pick, parts: u64) -> Result<()> {
        let (pp, b) = (a.params, a.buffers);
        if pp.top_k != 1 || pp.inv_t != 1.0 {
            bail!("greedy picks take top_k 1 and no temperature");
        }
        self.adjust(gpu, a)?;
        let argmax = Argmax {
            logits: a.logits,
            vocab: a.vocab,
            token_out: a.token_out,
            logprob_out: a.logprob_out,
            partials: Some(parts),
        };
        let remember = pp.repetition != 1.0;
        self.argmax_two_stage(gpu, b.scaled, &argmax, parts, Some((b.hist, remember)))
    }

    /// Steps 1–6 of the host sampler on the device: writes the token to `token_out`, its raw
    /// log-probability to `logprob_out`, and updates the history.
    pub fn pick(&self, gpu: &Gpu, a: &Pick) -> Result<()> {
        let (pp, b) = (a.params, a.buffers);
        if pp.top_k == 0 || pp.top_k > PICK_MAX_K {
            bail!(
                "device sampling takes top_k in 1..={PICK_MAX_K}, got {}",
                pp.top_k
            );
        }
        self.adjust(gpu, a)?;
        let vocab = a.vocab as i32;
        let top_k = pp.top_k as i32;
        let remember = (pp.repetition != 1.0) as i32;
        if b.cands != 0 && a.vocab.div_ceil(SAMPLE_PARTS) <= SAMPLE_PART_CAP {
            let cfg = config((SAMPLE_PARTS as u32, 1, 1), 256, 0);
            gpu.launch(&self.part, cfg, |l| {
                l.arg(&a.logits)
                    .arg(&b.scaled)
                    .arg(&vocab)
                    .arg(&top_k)
                    .arg(&b.cands);
            })?;
            let parts = SAMPLE_PARTS as i32;
            let cfg = config((1, 1, 1), SAMPLE_THREADS as u32, 0);
            return gpu.launch(&self.pick_parts, cfg, |l| {
                l.arg(&a.logits)
                    .arg(&vocab)
                    .arg(&top_k)
                    .arg(&pp.top_p)
                    .arg(&pp.min_p)
                    .arg(&a.u)
                    .arg(&remember)
                    .arg(&b.hist)
                    .arg(&b.cands)
                    .arg(&parts)
                    .arg(&a.token_out)
                    .arg(&a.logprob_out);
            });
        }
        let cfg = config((1, 1, 1), SAMPLE_THREADS as u32, 0);
        gpu.launch(&self.pick, cfg, |l| {
            l.arg(&a.logits)
                .arg(&b.scaled)
                .arg(&vocab)
                .arg(&top_k)
                .arg(&pp.top_p)
                .arg(&pp.min_p)
                .arg(&a.u)
                .arg(&remember)
                .arg(&b.hist)
                .arg(&a.token_out)
                .arg(&a.logprob_out);
        })
    }

    /// The top log-probabilities of a row (`TopLogprobs`): ARGMAX_BLOCKS blocks, then one.
    pub fn top_logprobs(&self, gpu: &Gpu, a: &TopLogprobs) -> Result<()> {
        if a.k == 0 || a.k > LOGPROB_MAX_K || a.k > a.vocab {
            bail!(
                "device top log-probabilities take k in 1..={} (and at most the vocabulary of {}), got {}",
                LOGPROB_MAX_K,
                a.vocab,
                a.k
            );
        }
        let (vocab, k) = (a.vocab as i32, a.k as i32);
        let cfg = config((ARGMAX_BLOCKS as u32, 1, 1), 256, 0);
        gpu.launch(&self.logprob_part, cfg, |l| {
            l.arg(&a.logits).arg(&vocab).arg(&k).arg(&a.parts);
        })?;
        let n_parts = ARGMAX_BLOCKS as i32;
        gpu.launch(&self.logprob_final, config((1, 1, 1), 256, 0), |l| {
            l.arg(&a.parts).arg(&n_parts).arg(&k).arg(&a.out);
        })
    }

    /// *pos += n on the device (the position a captured decode step reads).
    pub fn advance_pos(&self, gpu: &Gpu, pos: u64, n: usize) -> Result<()> {
        let n = n as i32;
        gpu.launch(&self.advance_pos, config((1, 1, 1), 32, 0), |l| {
            l.arg(&pos).arg(&n);
        })
    }

    /// `advance_pos` for the `rows` sequences of a batched decode step in one launch (`pos`: a
    /// device table of their position pointers).
    pub fn advance_pos_rows(&self, gpu: &Gpu, pos: u64, rows: usize, n: usize) -> Result<()> {
        let (r, n) = (rows as i32, n as i32);
        let cfg = config((rows.div_ceil(128).max(1) as u32, 1, 1), 128, 0);
        gpu.launch(&self.advance_pos_rows, cfg, |l| {
            l.arg(&pos).arg(&r).arg(&n);
        })
    }
}
