//! The Backend contract (docs/ARCHITECTURE.md §3): a backend implements the model's forward
//! step itself, not tensor ops. Sequences and snapshots live inside the backend (device memory on a
//! GPU), so the trait is object safe and the engine can hold `Box<dyn Backend>`.

use anyhow::{bail, Result};

use crate::config::ModelConfig;
use crate::cpu::ops::KvFormat;
use crate::sampling::Sampler;

/// A sequence's handle: KV cache + DeltaNet recurrent and conv state, owned by the backend.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SeqId(pub u64);

/// A sequence's state at one position (prefix reuse, ARCHITECTURE.md §7): the DeltaNet recurrent
/// and conv state and the pending logits, copied; the KV cache is not copied but shared with the
/// sequence it was taken from, as a length into it (KV rows can be truncated to any prefix,
/// DeltaNet state cannot).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SnapshotId(pub u64);

/// What the caller of `decode` wants after each token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    Continue,
    Stop,
}

/// One sampled token, with its log-probability under the model (raw logits, before sampling
/// transforms) and, when asked for, the most likely alternatives.
#[derive(Clone, Debug, PartialEq)]
pub struct StepOut {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// Refuses tokens a sequence cannot take: an id outside the vocabulary, or more than the `max_ctx
/// - len` positions its context has left. Every backend checks a step with it before its forward.
pub fn check_tokens(vocab: usize, len: usize, max_ctx: usize, tokens: &[u32]) -> Result<()> {
    if let Some(&bad) = tokens.iter().find(|&&id| id as usize >= vocab) {
        bail!("token id {bad} is outside the vocabulary ({vocab} ids)");
    }
    if len + tokens.len() > max_ctx {
        bail!(
            "sequence would hold {} tokens, more than its context of {max_ctx}",
            len + tokens.len()
        );
    }
    Ok(())
}

/// `Backend::decode_step`'s default: the rows one after another, each through `decode` (one
/// token) and, when it is fed, `prefill` — one forward pass a row. A backend whose batched step is
/// switched off calls it too.
pub fn decode_step_one_by_one<B: Backend + ?Sized>(
    backend: &mut B,
    rows: &mut [DecodeRow<'_>],
    on_token: &mut dyn FnMut(usize, &StepOut) -> Flow,
) -> Result<()> {
    for (i, row) in rows.iter_mut().enumerate() {
        let before = backend.seq_len(row.seq)?;
        let mut picked = None;
        backend.decode(row.seq, row.sampler, 1, row.top_logprobs, &mut |step| {
            picked = Some((step.token, on_token(i, step)));
            Flow::Stop
        })?;
        // `decode` never feeds its n-th token; checked all the same (`seq_len` tells).
        if let Some((token, Flow::Continue)) = picked {
            if row.feed && backend.seq_len(row.seq)? == before {
                backend.prefill(row.seq, &[token])?;
            }
        }
    }
    Ok(())
}

/// One sequence's part in a batched decode step (`Backend::decode_step`).
pub struct DecodeRow<'a> {
    pub seq: SeqId,
    pub sampler: &'a mut Sampler,
    /// Alternatives to report with the token (0 = none).
    pub top_logprobs: usize,
    /// Whether the token may be fed when the caller goes on: false for a sequence's last one.
    pub feed: bool,
}

impl<'a> DecodeRow<'a> {
    /// A row for each of `seqs` with its sampler (in order), each fed, with `top_logprobs`
    /// alternatives.
    pub fn each(
        seqs: &[SeqId],
        samplers: &'a mut [Sampler],
        top_logprobs: usize,
    ) -> Vec<DecodeRow<'a>> {
        seqs.iter()
            .zip(samplers.iter_mut())
            .map(|(&seq, sampler)| DecodeRow {
                seq,
                sampler,
                top_logprobs,
                feed: true,
            })
            .collect()
    }
}

pub trait Backend: Send {
    fn config(&self) -> &ModelConfig;
    /// A short human description ("cpu (16 threads)", "cuda NVIDIA H200 sm_90a").
    fn describe(&self) -> String;

    /// How the KV cache holds a cached row (what a decode step reads back for each position): by
    /// default each value as computed. `traffic::decode_bytes` counts a step's bytes by it.
    fn kv_format(&self) -> KvFormat {
        KvFormat::Full
    }

    /// The context a server offers when none is asked for: the model's whole context where this
    /// backend holds a sequence of it comfortably, else less. By default min(model maximum,
    /// 32,768), a KV cache any machine that holds the model can afford.
    fn default_context(&self) -> usize {
        self.config().max_position.min(32_768)
    }

    /// A fresh sequence able to hold `max_ctx` tokens.
    fn new_seq(&mut self, max_ctx: usize) -> Result<SeqId>;
    fn free_seq(&mut self, seq: SeqId);
    /// Tokens consumed so far.
    fn seq_len(&self, seq: SeqId) -> Result<usize>;

    /// Feeds `tokens` (chunked inside). The logits of the last one become the sequence's pending
    /// logits, from which `decode` samples next.
    fn prefill(&mut self, seq: SeqId, tokens: &[u32]) -> Result<()>;

    /// The largest piece of a prompt the engine should hand to `prefill` at once: the backend's
    /// own best chunk, so serving feeds it as `lily-engine bench` does. A cancelled request stops
    /// within one piece. At least 1.
    fn prefill_chunk(&self) -> usize {
        512
    }

    /// The largest piece of a prompt the engine hands to `prefill` at once while other
    /// sequences decode: a running stream waits at most one such piece between two of its
    /// tokens. At most `prefill_chunk`; a backend whose best chunk takes long answers less.
    fn interleaved_chunk(&self) -> usize {
        self.prefill_chunk()
    }

    /// Host copy of the pending logits (tests, `echo` log-probabilities, debugging).
    fn logits(&mut self, seq: SeqId) -> Result<Vec<f32>>;

    /// Feeds `tokens` and returns the logits after each of them, `[T, vocab]` (teacher forcing:
    /// prompt log-probabilities, parity checks). The last row also becomes the pending logits.
    /// The default feeds one token at a time; backends override it with a chunked pass.
    fn prefill_all_logits(&mut self, seq: SeqId, tokens: &[u32]) -> Result<Vec<f32>> {
        let mut all = Vec::new();
        for &t in tokens {
            self.prefill(seq, &[t])?;
            all.extend(self.logits(seq)?);
        }
        Ok(all)
    }

    /// Up to `n` times: sample a token from the pending logits with `sampler`, hand it to
    /// `on_token`; on `Flow::Continue` (and if fewer than `n` were sampled) feed it to the model so
    /// its logits become pending. `top_logprobs` alternatives are computed when > 0.
    ///
    /// A token that ends generation (`Flow::Stop`) is reported and may or may not have been fed:
    /// a backend may feed each token before it is reported, so the device never waits for the
    /// caller (the CUDA backend's pipelined decode; never the `n`-th token, and never past the
    /// context). `seq_len` afterwards tells which: every reported token up to `seq_len` minus
    /// the length before the call was fed, and the sequence is in exactly the state of that
    /// prefix (its pending logits those after the last token fed).
    fn decode(
        &mut self,
        seq: SeqId,
        sampler: &mut Sampler,
        n: usize,
        top_logprobs: usize,
        on_token: &mut dyn FnMut(&StepOut) -> Flow,
    ) -> Result<()>;

    /// How many sequences the engine decodes together when the server is not told
    /// (`lily-engine serve --max-batch`): the batch this backend's `decode_step` serves best.
    /// 1 for a backend whose `decode_step` is the default one-at-a-time loop.
    fn default_max_batch(&self) -> usize {
        1
    }

    /// One decode step for several sequences (each at most once): for each row in order, sample a
    /// token from its pending logits with its sampler and report it with `on_token(row index,
    /// step)`; then feed every token whose row has `feed` and whose report answered
    /// `Flow::Continue`, so that its logits become pending. A token not fed leaves its sequence as
    /// it was (its sampler has accepted it). As in `decode`, a token whose report answered
    /// `Flow::Stop` may have been fed all the same when its row has `feed` (a backend may feed the
    /// step's tokens before they are reported, so the device never waits for the caller: the
    /// CUDA backend's pipelined batched step); `seq_len` afterwards tells which. A row without
    /// `feed` is never fed. A backend overrides this with one forward pass for
    /// all the fed tokens (each weight read once for the batch); the default runs the rows one
    /// after another through `decode` (one token) and `prefill` (`decode_step_one_by_one`). An
    /// error fails the whole step.
    fn decode_step(
        &mut self,
        rows: &mut [DecodeRow<'_>],
        on_token: &mut dyn FnMut(usize, &StepOut) -> Flow,
    ) -> Result<()> {
        decode_step_one_by_one(self, rows, on_token)
    }

    /// Saves `seq`'s state at its current length. The snapshot shares `seq`'s KV rows up to that
    /// length: it stays valid while `seq` lives and those rows are not rewritten, which only a
    /// `restore` to a shorter snapshot of `seq` can do (and that drops it, below). Freeing `seq`
    /// drops its snapshots.
    fn snapshot(&mut self, seq: SeqId) -> Result<SnapshotId>;
    /// Puts `seq` in the state `snap` saved. With a snapshot of `seq` itself this rewinds it: the
    /// KV is truncated to the snapshot's length (nothing is copied) and every snapshot of `seq`
    /// longer than `snap` is dropped, since the tokens fed next overwrite their rows. With a
    /// snapshot of another sequence (which must still be alive) this forks: the KV prefix is copied
    /// into `seq`, and the other sequence and its snapshots are left as they are.
    fn restore(&mut self, seq: SeqId, snap: SnapshotId) -> Result<()>;
    /// Forgets `snap`; an unknown (already dropped) snapshot is ignored.
    fn drop_snapshot(&mut self, snap: SnapshotId);

    /// Bytes `seq` holds (KV cache as allocated, recurrent and conv state): what keeping it alive
    /// for reuse costs. 0 for a backend that does not know.
    fn seq_bytes(&self, _seq: SeqId) -> usize {
        0
    }

    /// Bytes `snap` holds of its own (not the KV it shares with its sequence).
    fn snapshot_bytes(&self, _snap: SnapshotId) -> usize {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::check_tokens;

    #[test]
    fn a_step_is_refused_past_the_vocabulary_or_the_context() {
        assert!(check_tokens(10, 3, 8, &[0, 9, 4]).is_ok());
        assert!(check_tokens(10, 5, 8, &[1, 2, 3]).is_ok()); // exactly fills the context
        let e = check_tokens(10, 0, 8, &[3, 10]).unwrap_err().to_string();
        assert!(e.contains("token id 10") && e.contains("10 ids"), "{e}");
        let e = check_tokens(10, 6, 8, &[1, 2, 3]).unwrap_err().to_string();
        assert!(e.contains("9 tokens") && e.contains("context of 8"), "{e}");
    }
}
