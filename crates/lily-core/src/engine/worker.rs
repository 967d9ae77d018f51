//! The engine thread: owns the backend (which is `Send` but not `Sync`) and schedules the jobs
//! on it. Up to `max_batch` jobs run at once, each in its own sequence: every turn of the loop
//! admits waiting jobs, feeds one prefill chunk of one job still reading its prompt, then runs
//! one decode step for every job that is generating — one token each, in one batched backend
//! call (`Backend::decode_step`). So a new request joins between two steps, and a long prompt
//! holds the others' streams up by at most one chunk at a time.
//!
//! A job alone on the engine runs the single-sequence path: one `Backend::decode` call for all its
//! tokens (the CUDA backend's pipelined, graph-replayed loop), left only when another job could
//! join. With `max_batch` 1 jobs run strictly one after another.
//!
//! Admission by memory: a job joins only when its sequence can be had (the prefix cache frees
//! kept states first); if the backend has no room while others run, the job waits at the head of
//! the queue until one of them ends, instead of failing.

use std::fmt::Write as _;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context, Result};

use super::job::{FinishReason, Job, Outcome, Usage};
use super::prefix::{PrefixCache, PrefixStats};
use super::queue::{Queue, QueueFull};
use super::slot::{Slot, Stage};
use crate::backend::{Backend, DecodeRow, Flow};
use crate::config::ModelConfig;

#[derive(Clone, Copy, Debug)]
pub struct EngineOptions {
    /// Jobs that may wait behind the running ones.
    pub max_queue: usize,
    /// Tokens a sequence may hold (prompt + output); sequences are sized to it when prefix reuse
    /// is on, so a kept sequence can take any later turn.
    pub ctx_size: usize,
    /// Bytes of kept sequences and snapshots for prefix reuse (0 = no reuse).
    pub prefix_cache_bytes: usize,
    /// Also snapshot every this many prompt tokens of a long prefill (0 = only at the ends of
    /// conversations, prompts and generated turns).
    pub snapshot_every: usize,
    /// Jobs decoding together at most; `None`: the backend's `default_max_batch`.
    pub max_batch: Option<usize>,
}

/// The scheduler's state, for `/metrics`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    /// Jobs running now (prefilling or decoding).
    pub running: usize,
    /// Jobs waiting for a place: queued, or held back until a sequence fits in memory.
    pub waiting: usize,
    pub max_batch: usize,
    /// Decode steps by batch size: `steps[b - 1]` steps decoded `b` sequences at once.
    pub steps: Vec<u64>,
}

/// Counters the engine thread updates and callers read.
struct Shared {
    running: AtomicUsize,
    /// A job taken from the queue that waits for memory (0 or 1).
    held: AtomicUsize,
    steps: Vec<AtomicU64>,
}

pub struct Engine {
    queue: Arc<Queue>,
    shared: Arc<Shared>,
    cancel_all: Arc<AtomicBool>,
    thread: Mutex<Option<JoinHandle<()>>>,
    config: ModelConfig,
    description: String,
    prefix_stats: Arc<Mutex<PrefixStats>>,
    max_batch: usize,
}

impl Engine {
    /// Starts the engine thread.
    pub fn start(backend: Box<dyn Backend>, opts: EngineOptions) -> Result<Engine> {
        let config = backend.config().clone();
        let description = backend.describe();
        let max_batch = opts
            .max_batch
            .unwrap_or_else(|| backend.default_max_batch())
            .max(1);
        let queue = Arc::new(Queue::new(opts.max_queue));
        let shared = Arc::new(Shared {
            running: AtomicUsize::new(0),
            held: AtomicUsize::new(0),
            steps: (0..max_batch).map(|_| AtomicU64::new(0)).collect(),
        });
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
            max_batch,
            shared: shared.clone(),
        };
        let thread = {
            let queue = queue.clone();
            std::thread::Builder::new()
                .name("lily-engine".into())
                .spawn(move || worker.serve(&queue))
                .context("cannot start the engine thread")?
        };
        Ok(Engine {
            queue,
            shared,
            cancel_all,
            thread: Mutex::new(Some(thread)),
            config,
            description,
            prefix_stats,
            max_batch,
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

    /// Jobs decoding together at most.
    pub fn max_batch(&self) -> usize {
        self.max_batch
    }

    /// Queues `job`; a full (or shut down) queue hands it back.
    pub fn submit(&self, job: Job) -> Result<(), QueueFull> {
        self.queue.push(job)
    }

    /// Jobs waiting, not counting the running ones.
    pub fn queue_depth(&self) -> usize {
        self.queue.len() + self.shared.held.load(Ordering::Relaxed)
    }

    /// Jobs running now.
    pub fn running(&self) -> usize {
        self.shared.running.load(Ordering::Relaxed)
    }

    /// Whether a job is running now.
    pub fn is_busy(&self) -> bool {
        self.running() > 0
    }

    pub fn scheduler_stats(&self) -> SchedulerStats {
        SchedulerStats {
            running: self.running(),
            waiting: self.queue_depth(),
            max_batch: self.max_batch,
            steps: self
                .shared
                .steps
                .iter()
                .map(|n| n.load(Ordering::Relaxed))
                .collect(),
        }
    }

    /// Cancels the running jobs and every waiting one (their sinks hear `Cancelled`), refuses new
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
    max_batch: usize,
    shared: Arc<Shared>,
}

/// A job taken from the queue, with when it was queued.
type Queued = (Job, Instant);

impl Worker {
    fn serve(mut self, queue: &Queue) {
        let mut slots: Vec<Slot> = Vec::new();
        // The head of the queue, waiting until its sequence fits beside the running ones.
        let mut held: Option<Queued> = None;
        // Whether to try the held job again (a running job has ended since it was refused).
        let mut retry_held = false;
        loop {
            if slots.is_empty() {
                let Some(next) = held.take().or_else(|| queue.pop()) else {
                    break;
                };
                self.admit(next, &mut slots, &mut held);
            }
            while slots.len() < self.max_batch && (held.is_none() || retry_held) {
                retry_held = false;
                let Some(next) = held.take().or_else(|| queue.try_pop()) else {
                    break;
                };
                if !self.admit(next, &mut slots, &mut held) {
                    break;
                }
            }
            self.publish(slots.len(), held.is_some());
            if slots.is_empty() {
                continue;
            }
            self.step(&mut slots, queue, held.is_some());
            let before = slots.len();
            self.finish_ended(&mut slots);
            retry_held |= slots.len() < before;
        }
        self.publish(0, false);
    }

    fn publish(&self, running: usize, held: bool) {
        self.shared.running.store(running, Ordering::Relaxed);
        self.shared.held.store(usize::from(held), Ordering::Relaxed);
    }

    /// Starts `job` in a new slot if its sequence can be had. False if it must wait for memory
    /// (then it is `held`); a job that cannot run even alone fails.
    fn admit(
        &mut self,
        (mut job, queued_at): Queued,
        slots: &mut Vec<Slot>,
        held: &mut Option<Queued>,
    ) -> bool {
        let started = Instant::now();
        let mut usage = Usage {
            prompt_tokens: job.prompt.len(),
            ..Usage::default()
        };
        usage.queue_time = started.saturating_duration_since(queued_at);
        usage.phases.prepare = job
            .arrived
            .map(|arrived| queued_at.saturating_duration_since(arrived));
        if self.cancel_all.load(Ordering::Relaxed) || job.sink.is_cancelled() {
            self.report(&mut job, &usage, &[], Ok(FinishReason::Cancelled));
            return true;
        }
        let needed = job.prompt.len() + job.max_tokens;
        // Scoring prompts feed every token from the start; they neither resume nor keep state.
        let reuse = !job.prompt_logprobs;
        let capacity = if reuse && self.prefixes.enabled() {
            needed.max(self.ctx_size)
        } else {
            needed
        };
        let acquiring = Instant::now();
        let (backend, prefixes) = (self.backend.as_mut(), &mut self.prefixes);
        let acquired = catch_unwind(AssertUnwindSafe(|| {
            match prefixes.acquire(backend, &job.prompt, needed, capacity, reuse) {
                // No room for a sequence of the whole context: one of the job's own size still
                // runs it (and is kept for the later turns that fit in it).
                Err(_) if capacity > needed => {
                    prefixes.acquire(backend, &job.prompt, needed, needed, reuse)
                }
                acquired => acquired,
            }
        }));
        usage.phases.acquire = acquiring.elapsed();
        let lease = match acquired {
            Ok(Ok(lease)) => lease,
            Ok(Err(e)) if !slots.is_empty() => {
                tracing::info!(
                    "a job of {needed} tokens waits for memory beside {} running ({e:#})",
                    slots.len()
                );
                *held = Some((job, queued_at));
                return false;
            }
            Ok(Err(e)) => {
                self.prefixes.clear(self.backend.as_mut());
                self.report(&mut job, &usage, &[], Err(e));
                return true;
            }
            Err(panic) => {
                self.prefixes.clear(self.backend.as_mut());
                self.report(
                    &mut job,
                    &usage,
                    &[],
                    Err(anyhow!(panic_message(panic.as_ref()))),
                );
                return true;
            }
        };
        usage.phases.sequence = lease.source;
        slots.push(Slot::new(job, usage, lease, started, self.snapshot_every));
        true
    }

    /// One turn of the schedule: a prefill chunk for the first job still reading its prompt, then
    /// one token for every generating job.
    fn step(&mut self, slots: &mut [Slot], queue: &Queue, held: bool) {
        let others_decode = slots.iter().any(|s| matches!(s.stage, Stage::Decode));
        if let Some(slot) = slots.iter_mut().find(|s| matches!(s.stage, Stage::Prefill)) {
            let (backend, prefixes) = (self.backend.as_mut(), &mut self.prefixes);
            let cancel_all = &*self.cancel_all;
            let result = catch_unwind(AssertUnwindSafe(|| {
                slot.prefill_piece(backend, prefixes, cancel_all, others_decode)
            }));
            if let Some(e) = failure(result) {
                slot.stage = Stage::Finished(Err(e));
            }
        }
        let decoding: Vec<usize> = (0..slots.len())
            .filter(|&i| matches!(slots[i].stage, Stage::Decode))
            .collect();
        if decoding.is_empty() {
            return;
        }
        if slots.len() == 1 {
            // Alone: the single-sequence path, left after a token when another job could join.
            let may_join = self.max_batch > 1 && !held;
            self.decode_alone(&mut slots[0], queue, may_join);
        } else {
            // A token left unfed fails only its own job.
            for &i in &decoding {
                let slot = &mut slots[i];
                let fed = catch_unwind(AssertUnwindSafe(|| self.feed_unfed(slot)));
                if let Some(e) = failure(fed) {
                    slot.stage = Stage::Finished(Err(e));
                }
            }
            let rows: Vec<usize> = decoding
                .iter()
                .copied()
                .filter(|&i| matches!(slots[i].stage, Stage::Decode))
                .collect();
            if !rows.is_empty() {
                self.decode_together(slots, &rows);
            }
        }
        for &i in &decoding {
            let slot = &mut slots[i];
            if matches!(slot.stage, Stage::Decode) && slot.decoded_all() {
                let (backend, prefixes) = (self.backend.as_mut(), &mut self.prefixes);
                let cancel_all = &*self.cancel_all;
                let result = catch_unwind(AssertUnwindSafe(|| {
                    slot.end_decode(backend, prefixes, cancel_all)
                }));
                if let Err(panic) = result {
                    slot.stage = Stage::Finished(Err(anyhow!(panic_message(panic.as_ref()))));
                }
            }
        }
    }

    /// Feeds a token reported but not fed when `decode` was left early.
    fn feed_unfed(&mut self, slot: &mut Slot) -> Result<()> {
        if let (Some(token), Some(seq)) = (slot.unfed.take(), slot.seq()) {
            self.backend.prefill(seq, &[token])?;
        }
        Ok(())
    }

    /// The only job: one `decode` call for its remaining tokens. With `may_join`, it stops after
    /// a token when a job is queued, so that the next turn admits it.
    fn decode_alone(&mut self, slot: &mut Slot, queue: &Queue, may_join: bool) {
        let result = catch_unwind(AssertUnwindSafe(|| -> Result<()> {
            self.feed_unfed(slot)?;
            let seq = slot.seq().context("a running job without a sequence")?;
            let mut sampler = slot
                .sampler
                .take()
                .context("a generating job without a sampler")?;
            let (eos_ids, cancel_all) = (&self.eos_ids, &*self.cancel_all);
            let (n, top) = (slot.remaining(), slot.job.top_logprobs);
            let mut tokens = 0u64;
            let mut left = false;
            let decoded = self.backend.decode(seq, &mut sampler, n, top, &mut |step| {
                tokens += 1;
                let flow = slot.on_token(step, eos_ids, cancel_all);
                if flow == Flow::Continue && may_join && !queue.is_empty() {
                    left = true;
                    return Flow::Stop;
                }
                flow
            });
            slot.sampler = Some(sampler);
            self.shared.steps[0].fetch_add(tokens, Ordering::Relaxed);
            decoded?;
            if left && !slot.decoded_all() {
                // `decode` may have fed the token it was stopped at (`Backend::decode`).
                if self.backend.seq_len(seq)? < slot.fed_len() {
                    slot.unfed = slot.last_emitted();
                }
            }
            Ok(())
        }));
        if let Some(e) = failure(result) {
            slot.stage = Stage::Finished(Err(e));
        }
    }

    /// One token for each generating job, in one `decode_step`.
    fn decode_together(&mut self, slots: &mut [Slot], decoding: &[usize]) {
        let result = catch_unwind(AssertUnwindSafe(|| -> Result<()> {
            let mut samplers = Vec::with_capacity(decoding.len());
            for &i in decoding {
                samplers.push(
                    slots[i]
                        .sampler
                        .take()
                        .context("a generating job without a sampler")?,
                );
            }
            let mut rows = Vec::with_capacity(decoding.len());
            for (&i, sampler) in decoding.iter().zip(samplers.iter_mut()) {
                let slot = &slots[i];
                rows.push(DecodeRow {
                    seq: slot.seq().context("a running job without a sequence")?,
                    sampler,
                    top_logprobs: slot.job.top_logprobs,
                    feed: slot.remaining() > 1,
                });
            }
            let (eos_ids, cancel_all) = (&self.eos_ids, &*self.cancel_all);
            let stepped = self.backend.decode_step(&mut rows, &mut |row, step| {
                slots[decoding[row]].on_token(step, eos_ids, cancel_all)
            });
            drop(rows);
            for (&i, sampler) in decoding.iter().zip(samplers) {
                slots[i].sampler = Some(sampler);
            }
            if let Some(n) = self.shared.steps.get(decoding.len() - 1) {
                n.fetch_add(1, Ordering::Relaxed);
            }
            stepped
        }));
        if let Some(e) = failure(result) {
            // One batched call: every job in it fails.
            let message = format!("{e:#}");
            for &i in decoding {
                slots[i].stage = Stage::Finished(Err(anyhow!("{message}")));
            }
        }
    }

    /// Hands every ended job's sequence back and reports its outcome.
    fn finish_ended(&mut self, slots: &mut Vec<Slot>) {
        let mut i = 0;
        while i < slots.len() {
            if !matches!(slots[i].stage, Stage::Finished(_)) {
                i += 1;
                continue;
            }
            let mut slot = slots.remove(i);
            // Counted out before its sink hears the end, so a client that has its answer never
            // sees itself still running.
            self.shared.running.store(slots.len(), Ordering::Relaxed);
            let Stage::Finished(result) = std::mem::replace(&mut slot.stage, Stage::Prefill) else {
                continue;
            };
            let releasing = Instant::now();
            if result.is_err() {
                // After a failure the saved states are not trusted (the running jobs' are kept).
                self.prefixes.clear(self.backend.as_mut());
            }
            if let Some(lease) = slot.lease.take() {
                let (backend, prefixes) = (self.backend.as_mut(), &mut self.prefixes);
                let released = catch_unwind(AssertUnwindSafe(|| prefixes.release(backend, lease)));
                if released.is_err() {
                    tracing::error!("releasing a sequence panicked; the kept prefixes are dropped");
                    self.prefixes.clear(self.backend.as_mut());
                }
            }
            slot.usage.phases.release += releasing.elapsed();
            let chunk_times = std::mem::take(&mut slot.chunk_times);
            let usage = slot.usage;
            self.report(&mut slot.job, &usage, &chunk_times, result);
        }
    }

    /// The job's end: its timing line, its outcome to the sink.
    fn report(
        &self,
        job: &mut Job,
        usage: &Usage,
        chunk_times: &[Duration],
        result: Result<FinishReason>,
    ) {
        tracing::info!("{}", timing_line(usage, chunk_times));
        let outcome = match result {
            Ok(reason) => Outcome::Done {
                reason,
                usage: *usage,
            },
            Err(e) => {
                let message = format!("{e:#}");
                tracing::error!("generation failed: {message}");
                Outcome::Failed {
                    message,
                    usage: *usage,
                }
            }
        };
        *self.prefix_stats.lock().unwrap_or_else(|p| p.into_inner()) = self.prefixes.stats();
        job.sink.finished(outcome);
    }
}

/// The error of a backend call that failed or panicked.
fn failure<T>(result: std::thread::Result<Result<T>>) -> Option<anyhow::Error> {
    match result {
        Ok(Ok(_)) => None,
        Ok(Err(e)) => Some(e),
        Err(panic) => Some(anyhow!(panic_message(panic.as_ref()))),
    }
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

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    let detail = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into());
    format!("the backend panicked: {detail}")
}
