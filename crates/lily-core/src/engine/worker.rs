//! The engine thread: owns the backend (which is `Send` but not `Sync`) and runs queued jobs one at
//! a time, so answers never interleave.

use std::fmt::Write as _;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use super::job::{FinishReason, Job, Outcome, PromptLogprob, Usage};
use crate::logprob::token_logprob;
use super::prefix::{Lease, PrefixCache, PrefixStats};
use super::queue::{Queue, QueueFull};
use crate::backend::{Backend, Flow, SeqId};
use crate::config::ModelConfig;
use crate::sampling::Sampler;

#[derive(Clone, Copy, Debug)]
pub struct EngineOptions {
    /// Jobs that may wait behind the running one.
    pub max_queue: usize,
    /// Tokens a sequence may hold (prompt + output); sequences are sized to it when prefix reuse
    /// is on, so a kept sequence can take any later turn.
    pub ctx_size: usize,
    /// Bytes of kept sequences and snapshots for prefix reuse (0 = no reuse).
    pub prefix_cache_bytes: usize,
    /// Also snapshot every this many prompt tokens of a long prefill (0 = only at the ends of
    /// conversations, prompts and generated turns).
    pub snapshot_every: usize,
}

pub struct Engine {
    queue: Arc<Queue>,
    busy: Arc<AtomicBool>,
    cancel_all: Arc<AtomicBool>,
    thread: Mutex<Option<JoinHandle<()>>>,
    config: ModelConfig,
    description: String,
    prefix_stats: Arc<Mutex<PrefixStats>>,
}

impl Engine {
    /// Starts the engine thread.
    pub fn start(backend: Box<dyn Backend>, opts: EngineOptions) -> Result<Engine> {
        let config = backend.config().clone();
        let description = backend.describe();
        let queue = Arc::new(Queue::new(opts.max_queue));
        let busy = Arc::new(AtomicBool::new(false));
        let cancel_all = Arc::new(AtomicBool::new(false));
        let prefixes = PrefixCache::new(opts.prefix_cache_bytes);
        let prefix_stats = Arc::new(Mutex::new(prefixes.stats()));
        let worker = Worker {
            backend,
            eos_ids: config.eos_ids.clone(),
            cancel_all: cancel_all.clone(),
            prefixes,
            prefix_stats: prefix_stats.clone(),
            ctx_size: opts.ctx_size,
            snapshot_every: opts.snapshot_every,
            started: Instant::now(),
            chunk_times: Vec::new(),
        };
        let thread = {
            let (queue, busy) = (queue.clone(), busy.clone());
            std::thread::Builder::new()
                .name("lily-engine".into())
                .spawn(move || worker.serve(&queue, &busy))
                .context("cannot start the engine thread")?
        };
        Ok(Engine {
            queue,
            busy,
            cancel_all,
            thread: Mutex::new(Some(thread)),
            config,
            description,
            prefix_stats,
        })
    }

    /// Prefix reuse counters as of the last finished job.
    pub fn prefix_stats(&self) -> PrefixStats {
        *self.prefix_stats.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn describe(&self) -> &str {
        &self.description
    }

    /// Queues `job`; a full (or shut down) queue hands it back.
    pub fn submit(&self, job: Job) -> Result<(), QueueFull> {
        self.queue.push(job)
    }

    /// Jobs waiting, not counting the one running.
    pub fn queue_depth(&self) -> usize {
        self.queue.len()
    }

    /// Whether a job is running now.
    pub fn is_busy(&self) -> bool {
        self.busy.load(Ordering::Relaxed)
    }

    /// Cancels the running job and every waiting one (their sinks hear `Cancelled`), refuses new
    /// jobs and waits for the engine thread to end.
    pub fn shutdown(&self) {
        self.cancel_all.store(true, Ordering::Relaxed);
        for mut job in self.queue.close() {
            let usage = Usage {
                prompt_tokens: job.prompt.len(),
                ..Usage::default()
            };
            job.sink.finished(Outcome::Done {
                reason: FinishReason::Cancelled,
                usage,
            });
        }
        let handle = self.thread.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(handle) = handle {
            let _ = handle.join();
        }
    }
}

struct Worker {
    backend: Box<dyn Backend>,
    prefixes: PrefixCache,
    prefix_stats: Arc<Mutex<PrefixStats>>,
    ctx_size: usize,
    snapshot_every: usize,
    eos_ids: Vec<u32>,
    cancel_all: Arc<AtomicBool>,
    /// When the running job left the queue.
    started: Instant,
    /// The running job's prefill calls, timed (its timing line).
    chunk_times: Vec<Duration>,
}

impl Worker {
    fn serve(mut self, queue: &Queue, busy: &AtomicBool) {
        while let Some((mut job, queued_at)) = queue.pop() {
            busy.store(true, Ordering::Relaxed);
            self.started = Instant::now();
            self.chunk_times.clear();
            let mut usage = Usage {
                prompt_tokens: job.prompt.len(),
                ..Usage::default()
            };
            usage.queue_time = self.started.saturating_duration_since(queued_at);
            usage.phases.prepare = job
                .arrived
                .map(|arrived| queued_at.saturating_duration_since(arrived));
            // A panicking backend fails this job, not the server.
            let result = catch_unwind(AssertUnwindSafe(|| self.run(&mut job, &mut usage)));
            tracing::info!("{}", timing_line(&usage, &self.chunk_times));
            let outcome = match result {
                Ok(Ok(reason)) => Outcome::Done { reason, usage },
                Ok(Err(e)) => Outcome::Failed {
                    message: format!("{e:#}"),
                    usage,
                },
                Err(panic) => {
                    // Saved states may be half-written, and the job's lease is lost: start clean.
                    self.prefixes.reset(self.backend.as_mut());
                    Outcome::Failed {
                        message: panic_message(panic.as_ref()),
                        usage,
                    }
                }
            };
            if let Outcome::Failed { message, .. } = &outcome {
                tracing::error!("generation failed: {message}");
            }
            *self.prefix_stats.lock().unwrap_or_else(|p| p.into_inner()) = self.prefixes.stats();
            job.sink.finished(outcome);
            busy.store(false, Ordering::Relaxed);
        }
    }

    fn cancelled(&self, job: &Job) -> bool {
        self.cancel_all.load(Ordering::Relaxed) || job.sink.is_cancelled()
    }

    fn run(&mut self, job: &mut Job, usage: &mut Usage) -> Result<FinishReason> {
        if self.cancelled(job) {
            return Ok(FinishReason::Cancelled);
        }
        let needed = job.prompt.len() + job.max_tokens;
        // Scoring prompts feed every token from the start; they neither resume nor keep state.
        let reuse = !job.prompt_logprobs;
        let capacity = if reuse && self.prefixes.enabled() {
            needed.max(self.ctx_size)
        } else {
            needed
        };
        let backend = self.backend.as_mut();
        let acquiring = Instant::now();
        let lease = match self
            .prefixes
            .acquire(backend, &job.prompt, needed, capacity, reuse)
        {
            Ok(lease) => lease,
            Err(e) => {
                self.prefixes.clear(backend);
                return Err(e);
            }
        };
        usage.phases.acquire = acquiring.elapsed();
        usage.phases.sequence = lease.source;
        usage.cached_tokens = lease.resumed;
        let result = self.generate(&lease, job, usage);
        let releasing = Instant::now();
        if result.is_err() {
            self.prefixes.clear(self.backend.as_mut());
        }
        self.prefixes.release(self.backend.as_mut(), lease);
        usage.phases.release += releasing.elapsed();
        result
    }

    fn generate(
        &mut self,
        lease: &Lease,
        job: &mut Job,
        usage: &mut Usage,
    ) -> Result<FinishReason> {
        let seq = lease.seq;
        let start = Instant::now();
        let prefilled = if job.prompt_logprobs {
            self.prefill_scoring(seq, job)?
        } else {
            self.prefill(lease, job, usage)?
        };
        usage.prefill_time = start.elapsed();
        let prefill_end = Instant::now();
        let job_start = self.started;
        if !prefilled {
            return Ok(FinishReason::Cancelled);
        }
        if job.max_tokens == 0 {
            return Ok(FinishReason::Length);
        }

        let decode_start = Instant::now();
        let mut sampler = Sampler::with_prompt(job.sampling.clone(), &job.prompt)
            .constrained(job.constraint.take());
        let mut ended_by_eos = false;
        let mut stopped = false;
        let mut generated = 0usize;
        let mut emitted = Vec::new();
        let (eos_ids, cancel_all) = (&self.eos_ids, &self.cancel_all);
        let sink = &mut job.sink;
        self.backend.decode(
            seq,
            &mut sampler,
            job.max_tokens,
            job.top_logprobs,
            &mut |step| {
                let entered = Instant::now();
                emitted.push(step.token);
                if eos_ids.contains(&step.token) {
                    ended_by_eos = true;
                    return Flow::Stop;
                }
                generated += 1;
                if generated == 1 {
                    usage.time_to_first_token = Some(entered.duration_since(start));
                    usage.phases.engine_ttft = Some(entered.duration_since(job_start));
                    usage.phases.first_pick = entered.duration_since(prefill_end);
                }
                if cancel_all.load(Ordering::Relaxed) || sink.is_cancelled() {
                    stopped = true;
                    return Flow::Stop;
                }
                let flow = sink.token(step);
                stopped = flow == Flow::Stop;
                usage.sink_time += entered.elapsed();
                flow
            },
        )?;
        usage.decode_time = decode_start.elapsed();
        usage.constraint = sampler.mask_stats();
        let masks = usage.constraint;
        if masks.masks > 0 {
            tracing::info!(
                "constrained decoding: {} masks, mean {:.1} µs, max {:.1} µs; decode {:.1} µs/token",
                masks.masks,
                masks.total.as_secs_f64() * 1e6 / masks.masks as f64,
                masks.max.as_secs_f64() * 1e6,
                usage.decode_time.as_secs_f64() * 1e6 / generated.max(1) as f64
            );
        }
        tracing::debug!(
            "decoded {generated} tokens in {:.1} ms, {:.1} µs/token in the sink",
            usage.decode_time.as_secs_f64() * 1e3,
            usage.sink_time.as_secs_f64() * 1e6 / generated.max(1) as f64
        );
        usage.completion_tokens = generated;
        if lease.keeps() {
            let saving = Instant::now();
            self.save_turn(lease, &job.prompt, &emitted)?;
            usage.phases.release += saving.elapsed();
        }
        Ok(if self.cancelled(job) {
            FinishReason::Cancelled
        } else if ended_by_eos || stopped {
            FinishReason::Stop
        } else {
            FinishReason::Length
        })
    }

    /// Keeps the state at the end of the generated turn: the prompt and the generated tokens the
    /// model was fed, as `seq_len` tells (`Backend::decode`: the last one sampled, an
    /// end-of-sequence token included, may or may not have been).
    fn save_turn(&mut self, lease: &Lease, prompt: &[u32], emitted: &[u32]) -> Result<()> {
        let fed = self
            .backend
            .seq_len(lease.seq)?
            .saturating_sub(prompt.len());
        if fed > 0 && fed <= emitted.len() {
            let tokens = [prompt, &emitted[..fed]].concat();
            self.prefixes
                .save(self.backend.as_mut(), lease, &tokens, false);
        }
        Ok(())
    }

    /// Feeds the prompt in chunks from where the lease resumed, keeping the state at the save
    /// points; false if the job was cancelled on the way.
    fn prefill(&mut self, lease: &Lease, job: &Job, usage: &mut Usage) -> Result<bool> {
        let mut done = lease.resumed;
        let points = if lease.keeps() {
            save_points(
                job.prompt.len(),
                done,
                job.save_prefix_at,
                self.snapshot_every,
            )
        } else {
            Vec::new()
        };
        // The backend's chunk, so a cancelled request stops within one piece.
        let chunk = self.backend.prefill_chunk().max(1);
        while done < job.prompt.len() {
            if self.cancelled(job) {
                return Ok(false);
            }
            let mut end = (done + chunk).min(job.prompt.len());
            if let Some(&at) = points.iter().find(|&&at| at > done) {
                end = end.min(at);
            }
            let t = Instant::now();
            self.backend.prefill(lease.seq, &job.prompt[done..end])?;
            let took = t.elapsed();
            self.chunk_times.push(took);
            let p = &mut usage.phases;
            p.chunks += 1;
            p.chunk_time += took;
            p.max_chunk = p.max_chunk.max(took);
            done = end;
            if points.contains(&done) {
                let end = job.save_prefix_at == Some(done);
                let t = Instant::now();
                self.prefixes
                    .save(self.backend.as_mut(), lease, &job.prompt[..done], end);
                usage.phases.snapshots += 1;
                usage.phases.snapshot_time += t.elapsed();
            }
        }
        Ok(true)
    }

    /// Feeds the prompt in chunks and scores each token against the logits before it (teacher
    /// forcing); the first token has nothing before it. False if the job was cancelled on the way.
    fn prefill_scoring(&mut self, seq: SeqId, job: &mut Job) -> Result<bool> {
        let vocab = self.backend.config().vocab;
        let mut scores = Vec::with_capacity(job.prompt.len());
        let mut previous: Option<Vec<f32>> = None;
        for piece in job.prompt.chunks(SCORING_CHUNK) {
            if self.cancelled(job) {
                return Ok(false);
            }
            let all = self.backend.prefill_all_logits(seq, piece)?;
            for (i, &token) in piece.iter().enumerate() {
                let before = if i == 0 {
                    previous.as_deref()
                } else {
                    Some(&all[(i - 1) * vocab..i * vocab])
                };
                scores.push(match before {
                    None => PromptLogprob {
                        token,
                        logprob: None,
                        top: Vec::new(),
                    },
                    Some(logits) => {
                        let (logprob, top) = token_logprob(logits, token, job.top_logprobs);
                        PromptLogprob {
                            token,
                            logprob: Some(logprob),
                            top,
                        }
                    }
                });
            }
            previous = Some(all[(piece.len() - 1) * vocab..].to_vec());
        }
        job.sink.prompt_logprobs(scores);
        Ok(true)
    }
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

/// The job's one-line timing log: `timing:` then `key=value` pairs (milliseconds as `_ms`), so
/// scripts (scripts/serve_bench.py) can read it. Keys: prompt, cached, prepare_ms (arrival to
/// queueing, when known), queue_ms, seq (new, rewound, forked), acquire_ms, chunks, prefill_ms
/// (the backend's prefill calls), max_chunk_ms, chunk_ms (each call, the first 16), snapshots,
/// snapshot_ms, first_pick_ms, engine_ttft_ms (queue exit to first token), ttft_ms (arrival to
/// first token, when known), tokens, decode_ms, release_ms.
pub(super) fn timing_line(usage: &Usage, chunks: &[Duration]) -> String {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    let p = &usage.phases;
    let mut line = format!(
        "timing: prompt={} cached={}",
        usage.prompt_tokens, usage.cached_tokens
    );
    if let Some(prepare) = p.prepare {
        let _ = write!(line, " prepare_ms={:.2}", ms(prepare));
    }
    let _ = write!(
        line,
        " queue_ms={:.2} seq={} acquire_ms={:.2} chunks={} prefill_ms={:.2} max_chunk_ms={:.2}",
        ms(usage.queue_time),
        p.sequence.as_str(),
        ms(p.acquire),
        p.chunks,
        ms(p.chunk_time),
        ms(p.max_chunk)
    );
    if !chunks.is_empty() {
        let shown: Vec<String> = chunks
            .iter()
            .take(TIMED_CHUNKS_SHOWN)
            .map(|&d| format!("{:.2}", ms(d)))
            .collect();
        let _ = write!(line, " chunk_ms={}", shown.join(","));
        if chunks.len() > TIMED_CHUNKS_SHOWN {
            let _ = write!(line, ",+{}", chunks.len() - TIMED_CHUNKS_SHOWN);
        }
    }
    let _ = write!(
        line,
        " snapshots={} snapshot_ms={:.2}",
        p.snapshots,
        ms(p.snapshot_time)
    );
    if let Some(engine_ttft) = p.engine_ttft {
        let _ = write!(
            line,
            " first_pick_ms={:.2} engine_ttft_ms={:.2}",
            ms(p.first_pick),
            ms(engine_ttft)
        );
        if let Some(prepare) = p.prepare {
            let _ = write!(
                line,
                " ttft_ms={:.2}",
                ms(prepare + usage.queue_time + engine_ttft)
            );
        }
    }
    let _ = write!(
        line,
        " tokens={} decode_ms={:.2} release_ms={:.2}",
        usage.completion_tokens,
        ms(usage.decode_time),
        ms(p.release)
    );
    line
}

/// Prefill calls listed one by one in the timing line (the rest are counted).
const TIMED_CHUNKS_SHOWN: usize = 16;

/// Prompt tokens per scoring pass: bounds the host copy of all-position logits (64 × 248,320 f32
/// = 64 MB).
const SCORING_CHUNK: usize = 64;

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    let detail = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into());
    format!("the backend panicked: {detail}")
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
