//! One running job in the scheduler: its sequence (a prefix-cache lease), how far its prompt has
//! been fed, its sampler and what it has generated. The worker (worker.rs) moves every slot on
//! by one piece at a time — a prefill chunk, a decode step — so several jobs can share the
//! backend; a slot's own logic (save points, stop rules, timing) is the one a job always had.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::Result;

use super::job::{FinishReason, Job, PromptLogprob, Usage};
use super::prefix::{Lease, PrefixCache};
use crate::backend::{Backend, Flow, StepOut};
use crate::logprob::token_logprob;
use crate::sampling::Sampler;

/// Prompt tokens per scoring pass: bounds the host copy of all-position logits (64 × 248,320 f32
/// = 64 MB).
const SCORING_CHUNK: usize = 64;

pub(super) enum Stage {
    /// Feeding the prompt, `Slot::done` tokens of it in the sequence so far.
    Prefill,
    /// Generating: the sequence's pending logits are those the next token is sampled from
    /// (after `Slot::unfed`, if any, is fed).
    Decode,
    /// Over; the worker hands the outcome to the sink.
    Finished(Result<FinishReason>),
}

pub(super) struct Slot {
    pub job: Job,
    pub usage: Usage,
    /// `None` once handed back to the prefix cache.
    pub lease: Option<Lease>,
    pub stage: Stage,
    /// When the job left the queue.
    started: Instant,
    /// Its prefill calls, timed (its timing line).
    pub chunk_times: Vec<Duration>,
    /// Prompt tokens in the sequence.
    done: usize,
    /// Prompt lengths to snapshot at (prefix reuse).
    points: Vec<usize>,
    prefill_start: Instant,
    prefill_end: Instant,
    /// Scoring jobs (`prompt_logprobs`): the scores so far and the logits after the last token.
    scores: Vec<PromptLogprob>,
    previous: Option<Vec<f32>>,
    /// Taken out while a backend call samples with it.
    pub sampler: Option<Sampler>,
    decode_start: Instant,
    /// Every token reported by the backend, an end-of-sequence one included.
    emitted: Vec<u32>,
    /// Tokens handed to the sink.
    generated: usize,
    ended_by_eos: bool,
    stopped: bool,
    /// A token reported and to be continued from but not fed yet (the backend's `decode` was
    /// stopped early so that other jobs could join): fed before the next step.
    pub unfed: Option<u32>,
}

impl Slot {
    pub fn new(
        job: Job,
        usage: Usage,
        lease: Lease,
        started: Instant,
        snapshot_every: usize,
    ) -> Slot {
        let now = Instant::now();
        let done = lease.resumed;
        let points = if lease.keeps() && !job.prompt_logprobs {
            save_points(job.prompt.len(), done, job.save_prefix_at, snapshot_every)
        } else {
            Vec::new()
        };
        let mut slot = Slot {
            job,
            usage,
            lease: Some(lease),
            stage: Stage::Prefill,
            started,
            chunk_times: Vec::new(),
            done,
            points,
            prefill_start: now,
            prefill_end: now,
            scores: Vec::new(),
            previous: None,
            sampler: None,
            decode_start: now,
            emitted: Vec::new(),
            generated: 0,
            ended_by_eos: false,
            stopped: false,
            unfed: None,
        };
        slot.usage.cached_tokens = done;
        if slot.done >= slot.job.prompt.len() {
            slot.prefill_done();
        }
        slot
    }

    pub fn seq(&self) -> Option<crate::backend::SeqId> {
        self.lease.as_ref().map(|l| l.seq)
    }

    pub fn cancelled(&self, cancel_all: &AtomicBool) -> bool {
        cancel_all.load(Ordering::Relaxed) || self.job.sink.is_cancelled()
    }

    /// Tokens the job may still generate.
    pub fn remaining(&self) -> usize {
        self.job.max_tokens.saturating_sub(self.generated)
    }

    /// Feeds the next piece of the prompt: at most the backend's chunk, or its interleaved chunk
    /// while `others_decode` (so a decode step of the other jobs waits at most one such piece,
    /// and a cancelled job stops within one), cut at the next save point, where the state is
    /// kept for later jobs.
    pub fn prefill_piece(
        &mut self,
        backend: &mut dyn Backend,
        prefixes: &mut PrefixCache,
        cancel_all: &AtomicBool,
        others_decode: bool,
    ) -> Result<()> {
        if self.cancelled(cancel_all) {
            self.stage = Stage::Finished(Ok(FinishReason::Cancelled));
            return Ok(());
        }
        let Some(lease) = self.lease.as_ref() else {
            anyhow::bail!("a running job without a sequence");
        };
        if self.job.prompt_logprobs {
            self.score_piece(backend, lease.seq)?;
        } else {
            let chunk = if others_decode {
                backend.interleaved_chunk().min(backend.prefill_chunk())
            } else {
                backend.prefill_chunk()
            }
            .max(1);
            let mut end = (self.done + chunk).min(self.job.prompt.len());
            if let Some(&at) = self.points.iter().find(|&&at| at > self.done) {
                end = end.min(at);
            }
            let t = Instant::now();
            backend.prefill(lease.seq, &self.job.prompt[self.done..end])?;
            let took = t.elapsed();
            self.chunk_times.push(took);
            let p = &mut self.usage.phases;
            p.chunks += 1;
            p.chunk_time += took;
            p.max_chunk = p.max_chunk.max(took);
            self.done = end;
            if self.points.contains(&end) {
                let conversation_end = self.job.save_prefix_at == Some(end);
                let t = Instant::now();
                prefixes.save(backend, lease, &self.job.prompt[..end], conversation_end);
                self.usage.phases.snapshots += 1;
                self.usage.phases.snapshot_time += t.elapsed();
            }
        }
        if self.done >= self.job.prompt.len() {
            self.prefill_done();
        }
        Ok(())
    }

    /// Feeds a piece of the prompt and scores each token against the logits before it (teacher
    /// forcing); the first token has nothing before it. The scores go to the sink at the end.
    fn score_piece(&mut self, backend: &mut dyn Backend, seq: crate::backend::SeqId) -> Result<()> {
        let vocab = backend.config().vocab;
        let end = (self.done + SCORING_CHUNK).min(self.job.prompt.len());
        let piece = &self.job.prompt[self.done..end];
        let all = backend.prefill_all_logits(seq, piece)?;
        for (i, &token) in piece.iter().enumerate() {
            let before = if i == 0 {
                self.previous.as_deref()
            } else {
                Some(&all[(i - 1) * vocab..i * vocab])
            };
            self.scores.push(match before {
                None => PromptLogprob {
                    token,
                    logprob: None,
                    top: Vec::new(),
                },
                Some(logits) => {
                    let (logprob, top) = token_logprob(logits, token, self.job.top_logprobs);
                    PromptLogprob {
                        token,
                        logprob: Some(logprob),
                        top,
                    }
                }
            });
        }
        self.previous = Some(all[(piece.len() - 1) * vocab..].to_vec());
        self.done = end;
        if self.done >= self.job.prompt.len() {
            let scores = std::mem::take(&mut self.scores);
            self.job.sink.prompt_logprobs(scores);
        }
        Ok(())
    }

    /// The prompt is in: the job generates next (or ends, asked for no tokens).
    fn prefill_done(&mut self) {
        self.prefill_end = Instant::now();
        self.usage.prefill_time = self.prefill_end.duration_since(self.prefill_start);
        self.previous = None;
        if self.job.max_tokens == 0 {
            self.stage = Stage::Finished(Ok(FinishReason::Length));
            return;
        }
        self.decode_start = Instant::now();
        self.sampler = Some(
            Sampler::with_prompt(self.job.sampling.clone(), &self.job.prompt)
                .constrained(self.job.constraint.take()),
        );
        self.stage = Stage::Decode;
    }

    /// One token from the backend: an end-of-sequence token ends the job unreported; the others
    /// go to the sink unless the job was cancelled. What the backend should do next.
    pub fn on_token(&mut self, step: &StepOut, eos_ids: &[u32], cancel_all: &AtomicBool) -> Flow {
        let entered = Instant::now();
        self.emitted.push(step.token);
        if eos_ids.contains(&step.token) {
            self.ended_by_eos = true;
            return Flow::Stop;
        }
        self.generated += 1;
        if self.generated == 1 {
            let u = &mut self.usage;
            u.time_to_first_token = Some(entered.duration_since(self.prefill_start));
            u.phases.engine_ttft = Some(entered.duration_since(self.started));
            u.phases.first_pick = entered.duration_since(self.prefill_end);
        }
        if self.cancelled(cancel_all) {
            self.stopped = true;
            return Flow::Stop;
        }
        let flow = self.job.sink.token(step);
        self.stopped = flow == Flow::Stop;
        self.usage.sink_time += entered.elapsed();
        if self.generated >= self.job.max_tokens {
            return Flow::Stop;
        }
        flow
    }

    /// Whether generation is over (end of sequence, a stop, a cancel, or `max_tokens`).
    pub fn decoded_all(&self) -> bool {
        self.ended_by_eos || self.stopped || self.generated >= self.job.max_tokens
    }

    /// The last token reported, which the sequence holds only if it was fed.
    pub fn last_emitted(&self) -> Option<u32> {
        self.emitted.last().copied()
    }

    /// Tokens the sequence holds when every reported token was fed.
    pub fn fed_len(&self) -> usize {
        self.job.prompt.len() + self.emitted.len()
    }

    /// Generation is over: the timings and the generated turn's state kept for later jobs.
    pub fn end_decode(
        &mut self,
        backend: &mut dyn Backend,
        prefixes: &mut PrefixCache,
        cancel_all: &AtomicBool,
    ) {
        let usage = &mut self.usage;
        usage.decode_time = self.decode_start.elapsed();
        if let Some(sampler) = &self.sampler {
            usage.constraint = sampler.mask_stats();
        }
        let masks = usage.constraint;
        if masks.masks > 0 {
            tracing::info!(
                "constrained decoding: {} masks, mean {:.1} µs, max {:.1} µs; decode {:.1} µs/token",
                masks.masks,
                masks.total.as_secs_f64() * 1e6 / masks.masks as f64,
                masks.max.as_secs_f64() * 1e6,
                usage.decode_time.as_secs_f64() * 1e6 / self.generated.max(1) as f64
            );
        }
        tracing::debug!(
            "decoded {} tokens in {:.1} ms, {:.1} µs/token in the sink",
            self.generated,
            usage.decode_time.as_secs_f64() * 1e3,
            usage.sink_time.as_secs_f64() * 1e6 / self.generated.max(1) as f64
        );
        usage.completion_tokens = self.generated;
        let saved = match self.lease.as_ref() {
            Some(lease) if lease.keeps() => {
                let saving = Instant::now();
                let saved = save_turn(backend, prefixes, lease, &self.job.prompt, &self.emitted);
                self.usage.phases.release += saving.elapsed();
                saved
            }
            _ => Ok(()),
        };
        let reason = if self.cancelled(cancel_all) {
            FinishReason::Cancelled
        } else if self.ended_by_eos || self.stopped {
            FinishReason::Stop
        } else {
            FinishReason::Length
        };
        self.stage = Stage::Finished(saved.map(|()| reason));
    }
}

/// Keeps the state at the end of the generated turn: the prompt and the generated tokens the
/// model was fed, as `seq_len` tells (`Backend::decode`: the last one sampled, an end-of-sequence
/// token included, may or may not have been).
fn save_turn(
    backend: &mut dyn Backend,
    prefixes: &mut PrefixCache,
    lease: &Lease,
    prompt: &[u32],
    emitted: &[u32],
) -> Result<()> {
    let fed = backend.seq_len(lease.seq)?.saturating_sub(prompt.len());
    if fed > 0 && fed <= emitted.len() {
        let tokens = [prompt, &emitted[..fed]].concat();
        prefixes.save(backend, lease, &tokens, false);
    }
    Ok(())
}

/// Where a prompt of `len` tokens, resumed at `resumed`, is snapshotted, in order: the end of the
/// conversation (`conversation_end`, before the generation prompt), every multiple of `every`,
/// and the end of the prompt.
fn save_points(
    len: usize,
    resumed: usize,
    conversation_end: Option<usize>,
    every: usize,
) -> Vec<usize> {
    let mut points: Vec<usize> = conversation_end.into_iter().collect();
    if let Some(last) = len.checked_div(every) {
        points.extend((resumed / every + 1..=last).map(|k| k * every));
    }
    points.push(len);
    points.retain(|&p| p > resumed && p <= len);
    points.sort_unstable();
    points.dedup();
    points
}

#[cfg(test)]
mod tests {
    use super::save_points;

    #[test]
    fn save_points_are_the_conversation_end_the_multiples_and_the_prompt_end_after_the_resume() {
        assert_eq!(save_points(10, 0, Some(7), 0), vec![7, 10]);
        assert_eq!(save_points(10, 0, Some(7), 4), vec![4, 7, 8, 10]);
        assert_eq!(save_points(10, 5, Some(7), 4), vec![7, 8, 10]);
        assert_eq!(save_points(10, 8, Some(7), 4), vec![10]);
        assert_eq!(save_points(8, 0, Some(8), 4), vec![4, 8]);
        assert_eq!(save_points(3, 0, None, 4), vec![3]);
    }
}
