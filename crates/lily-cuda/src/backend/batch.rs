//! The batched decode step (`Backend::decode_step`, docs/batching.md): every row's token is
//! picked on the device as `decode` picks one (or on the host where `decode` would), all picks
//! come back in one read, they are reported in row order, and then the continuing rows' tokens
//! go through the model together in one forward pass (`Forward::run_batch`: each weight read
//! once for the batch). A step that feeds one sequence takes that sequence's own one-token path
//! (`feed_next`: decode.cu's fused kernels, its own graph), so a batch of one runs today's step.
//! Pipelined (`Plan::pipelined_batch`, on by default since session 16 (+1.4–1.8 % served); where every pick is on the device): the
//! forward pass that feeds the rows that may go on is queued right behind the picks, before the
//! host has read them (the picks' read waits on a side stream for the copy alone), so the device
//! is busy with step N's pass while the host reports step N's tokens and the engine comes round
//! to step N + 1 — as `decode` pipelines one sequence. A row that then stops has been fed.
//!
//! Graphs: the batched pass bakes every sequence's buffers into its launches, so a captured
//! graph replays only for exactly the same sequences in the same order, each on the same side of
//! `Plan::long_keys` — the batch changes only when a job joins or leaves, so steady decoding
//! replays one graph. Kept at most BATCH_GRAPHS, the oldest dropped first; a graph goes when one
//! of its sequences is freed, all go when the logits buffer they write is replaced.
//!
//! Device samplers: a row sampled on the device (penalties, logit_bias, temperature: anything
//! but plain greedy — a request that names only `temperature: 0` gets the model card's presence
//! penalty) needs its sampler's history on the device. Made anew each step, that was an upload of
//! a 1 MB history, six allocations and three stream synchronisations a row (issue 32: the
//! served step, whose requests had the presence penalty, took 1.8× the bench's plain-greedy
//! step), and the synchronisations made the next step wait for the device to drain. So each
//! row's `DeviceSampler` is kept from one step to the next (`BatchState::samplers`) while its
//! host sampler is the same one with just the tokens the device picked since
//! (`Sampler::history_stamp`) and the same parameters; otherwise it is made anew, as `decode`
//! makes one a call.
//!
//! Pointer table: the kernels that run every sequence in one launch (the embedding, the DeltaNet
//! scans, attention, the position update) find each sequence's token, states, caches and
//! position through a device table of
//! pointers (`Forward::batch_table`), written when a set of sequences is first run: a graph
//! keeps its own table (its launches read it at every replay), plain launches rewrite one table
//! each step.

use std::collections::VecDeque;
use std::time::Instant;

use anyhow::{anyhow, bail, Result};
use cudarc::driver::CudaEvent;
use lily_core::backend::{DecodeRow, Flow, SeqId, StepOut};
use lily_core::logprob::{token_logprob, LogSoftmax};
use lily_core::sampling::{HistoryStamp, Sampler, SamplingParams};

use super::{picked_step, span_ms, timing_event, CudaBackend};
use crate::forward::{Forward, SeqState, NEXT_TOKEN_WORDS};
use crate::gpu::DevBuf;
use crate::graph::DecodeGraph;
use crate::kernels::attention::AttnShape;
use crate::pinned::Pinned;
use crate::plan::{LogprobsPath, SamplingPath};
use crate::sampler::DeviceSampler;

/// Batched-step graphs kept (each a set of sequences in an order).
const BATCH_GRAPHS: usize = 16;

/// What a graph of the batched pass was captured for: each sequence, and whether its attention
/// took the long-context kernels (`Plan::long_keys`).
type GraphKey = Vec<(u64, bool)>;

/// The batched step's device buffers and graphs, allocated by the first batched step.
#[derive(Default)]
pub(super) struct BatchState {
    /// u32 [rows × NEXT_TOKEN_WORDS]: each row's pick words, gathered for one read.
    picks: Option<DevBuf>,
    /// f32 [rows, vocab]: lm_head's output for the rows, copied into each sequence's logits.
    logits: Option<DevBuf>,
    graphs: VecDeque<Captured>,
    /// The pointer table of plain (not captured) batched passes, rewritten each step.
    plain_table: Option<DevBuf>,
    /// `CudaOptions::step_timing`: device and wall time of the batched steps.
    timing: StepTimes,
    /// The device samplers of the last step's rows, kept for their next step (module comment).
    samplers: Vec<KeptSampler>,
    /// Where a pipelined step's picks are read (`decode_rows`), and how many words it holds.
    read: Option<(Pinned, usize)>,
}

/// A row's device sampler between batched steps: whose it is and the host sampler's state it
/// matches.
struct KeptSampler {
    seq: u64,
    /// The host sampler's stamp once it accepted the token this sampler picked last.
    stamp: HistoryStamp,
    params: SamplingParams,
    ds: DeviceSampler,
}

impl KeptSampler {
    /// Whether this is `seq`'s sampler with `sampler`'s history and parameters.
    fn serves(&self, seq: SeqId, sampler: &Sampler) -> bool {
        self.seq == seq.0 && self.stamp == sampler.history_stamp() && self.params == sampler.params
    }
}

/// Batched steps timed (`step_timing`): the device's work a step (events around the picks and
/// around the forward pass) beside the host's wall time a step, logged every TIMED_STEPS steps.
/// Each span is summed after the picks' read that follows it, which has waited for it.
#[derive(Default)]
struct StepTimes {
    /// The forward pass queued last, not yet summed.
    forward: Option<(CudaEvent, CudaEvent)>,
    /// The picks of the step being run.
    picks: Option<(CudaEvent, CudaEvent)>,
    steps: usize,
    rows: usize,
    forward_ms: f64,
    picks_ms: f64,
    since: Option<Instant>,
}

/// Batched steps a `step_timing` line sums.
const TIMED_STEPS: usize = 64;

impl StepTimes {
    /// After a step's picks were read (the stream has reached them): sums its picks and the
    /// forward pass before them, and logs the line every TIMED_STEPS steps.
    fn read(&mut self, rows: usize) -> Result<()> {
        let picks = match self.picks.take() {
            Some((a, b)) => span_ms(&a, &b)?,
            None => 0.0,
        };
        let Some(forward) = self.forward.take() else {
            // The picks read logits a prefill or a one-sequence step left (not timed here): the
            // timing starts again from this step.
            *self = StepTimes {
                since: Some(Instant::now()),
                ..StepTimes::default()
            };
            return Ok(());
        };
        self.forward_ms += span_ms(&forward.0, &forward.1)?;
        self.picks_ms += picks;
        self.steps += 1;
        self.rows += rows;
        if self.steps >= TIMED_STEPS {
            let n = self.steps as f64;
            let wall = self
                .since
                .map_or(0.0, |t| t.elapsed().as_secs_f64() * 1e3 / n);
            let (fwd, pick) = (self.forward_ms / n, self.picks_ms / n);
            tracing::info!(
                "batched decode step timing over {} steps of {:.1} rows: device {:.3} ms a step (forward pass {fwd:.3}, picks {pick:.3}), wall {wall:.3} ms a step: the device waits {:.3} ms a step for the host",
                self.steps,
                self.rows as f64 / n,
                fwd + pick,
                wall - fwd - pick
            );
            *self = StepTimes {
                since: Some(Instant::now()),
                ..StepTimes::default()
            };
        }
        Ok(())
    }
}

/// A captured batched pass: the sequences it was captured for, the graph and the pointer table
/// its launches read.
struct Captured {
    key: GraphKey,
    graph: DecodeGraph,
    _table: Option<DevBuf>,
}

impl BatchState {
    /// Drops the graphs that feed `seq` (it is being freed: its buffers may go to another).
    pub(super) fn forget(&mut self, seq: SeqId) {
        self.graphs
            .retain(|c| c.key.iter().all(|&(id, _)| id != seq.0));
        self.samplers.retain(|k| k.seq != seq.0);
    }
}

/// How one row's token was picked.
enum Picked {
    /// On the device (`path` not the host's): its words are in `BatchState::picks` at the row.
    Device {
        words: usize,
        path: SamplingPath,
        lp_path: LogprobsPath,
    },
    /// On the host, from the downloaded logits.
    Host(StepOut),
}

/// At least `bytes` in `buf`: the buffer kept if large enough, else a new one. True when it was
/// replaced.
fn ensure(backend: &CudaBackend, buf: &mut Option<DevBuf>, bytes: usize) -> Result<bool> {
    if buf.as_ref().is_some_and(|b| b.bytes >= bytes) {
        return Ok(false);
    }
    backend.gpu.sync()?;
    *buf = None;
    *buf = Some(backend.gpu.alloc(bytes)?);
    Ok(true)
}

impl CudaBackend {
    /// `Backend::decode_step` (see the module comment). The forward pass is queued, not waited
    /// for: the next call's picks queue behind it, so the host's turn overlaps the device's pass
    /// (an error in it surfaces at the next synchronisation).
    pub(super) fn decode_rows(
        &mut self,
        rows: &mut [DecodeRow<'_>],
        on_token: &mut dyn FnMut(usize, &StepOut) -> Flow,
    ) -> Result<()> {
        self.gpu.bind()?;
        for (i, row) in rows.iter().enumerate() {
            if self.seq(row.seq)?.len == 0 {
                bail!("decode needs a prefilled sequence");
            }
            if rows[..i].iter().any(|r| r.seq == row.seq) {
                bail!("sequence {} appears twice in one decode step", row.seq.0);
            }
        }
        let mut picks = std::mem::take(&mut self.batch.picks);
        let sized = ensure(self, &mut picks, rows.len() * NEXT_TOKEN_WORDS * 4);
        self.batch.picks = picks;
        sized?;
        // The device samplers kept from the last step; this step's are kept for the next one
        // (the ones not reused are dropped after the picks are read: their buffers were inputs).
        let mut kept = std::mem::take(&mut self.batch.samplers);
        let mut samplers = Vec::new();
        let mut picked = Vec::with_capacity(rows.len());
        let timed = self.plan.step_timing;
        let pick_start = timed.then(|| timing_event(&self.gpu)).transpose()?;
        for (i, row) in rows.iter_mut().enumerate() {
            picked.push(self.queue_row_pick(i, row, &mut kept, &mut samplers)?);
        }
        if let Some(start) = pick_start {
            self.batch.timing.picks = Some((start, timing_event(&self.gpu)?));
        }
        // Pipelined (`Plan::pipelined_batch`, as `decode` is): the picks' words are copied into
        // page-locked memory on a side stream and every row that may go on is fed at once, so the
        // device runs this step's forward pass while the host reads and reports the tokens and
        // the engine turns round to the next step. A row whose report then answers Stop has been
        // fed all the same (`Backend::decode_step`: `seq_len` tells). Only where every pick is on
        // the device and nothing reads the logits after it, and not while steps are timed.
        let pipelined = !timed
            && picked.iter().all(|p| {
                matches!(p, Picked::Device { path, lp_path, .. }
                    if self.plan.pipelined_batch(*path, *lp_path))
            });
        let mut prefed = Vec::new();
        let all: Vec<u32> = match &self.batch.picks {
            Some(_) if pipelined => {
                for row in rows.iter() {
                    let s = self.seq(row.seq)?;
                    if row.feed && s.len < s.max_ctx {
                        prefed.push(row.seq);
                    }
                }
                self.read_picks_pipelined(rows.len() * NEXT_TOKEN_WORDS, &prefed)?
            }
            Some(buf) if picked.iter().any(|p| matches!(p, Picked::Device { .. })) => {
                self.gpu.read(buf, 0, rows.len() * NEXT_TOKEN_WORDS)?
            }
            _ => Vec::new(),
        };
        if timed {
            // The read waited for the picks and the forward pass queued before them.
            self.gpu.sync()?;
            self.batch.timing.read(rows.len())?;
        }
        drop(kept);
        let mut fed = Vec::with_capacity(rows.len());
        for (i, (row, pick)) in rows.iter_mut().zip(picked).enumerate() {
            let step = match pick {
                Picked::Device { words, lp_path, .. } => {
                    let at = i * NEXT_TOKEN_WORDS;
                    let mut step = picked_step(&all[at..at + words], self.cfg.vocab, lp_path)?;
                    if lp_path == LogprobsPath::Host {
                        let s = self.seq(row.seq)?;
                        let logits: Vec<f32> = self.gpu.read(&s.logits, 0, self.cfg.vocab)?;
                        step.top = LogSoftmax::new(&logits).top(row.top_logprobs);
                    }
                    step
                }
                Picked::Host(step) => step,
            };
            row.sampler.accept(step.token);
            if let Some(k) = samplers.iter_mut().find(|k| k.seq == row.seq.0) {
                // The device bumped its history for the token as `accept` did.
                k.stamp = row.sampler.history_stamp();
            }
            if on_token(i, &step) == Flow::Continue && row.feed && !prefed.contains(&row.seq) {
                fed.push(row.seq);
            }
        }
        self.batch.samplers = samplers;
        // Pipelined, only a row whose context was full can be left: it fails the step here.
        for &seq in &fed {
            let s = self.seq(seq)?;
            if s.len + 1 > s.max_ctx {
                bail!("the sequence's context of {} tokens is full", s.max_ctx);
            }
        }
        self.feed_rows(&fed)
    }

    /// Feeds each of `fed`'s sequences the token in its `next_token`: one sequence its own
    /// one-token path, several one batched pass.
    fn feed_rows(&mut self, fed: &[SeqId]) -> Result<()> {
        match fed {
            [] => Ok(()),
            [one] => self.feed_next(*one),
            many => self.feed_batch(many),
        }
    }

    /// The pipelined step's read (see `decode_rows`): queues the copy of the gathered picks'
    /// first `words` words into page-locked memory (`BatchState::read`), then the forward pass
    /// feeding `fed`, then waits for the copy alone. The copy is waited for even when the launch
    /// failed (its buffer must not be rewritten or freed under it).
    fn read_picks_pipelined(&mut self, words: usize, fed: &[SeqId]) -> Result<Vec<u32>> {
        if self.batch.read.as_ref().is_none_or(|(_, cap)| *cap < words) {
            self.batch.read = None;
            let pinned = Pinned::with_side_stream(&self.gpu, words)?;
            self.batch.read = Some((pinned, words));
        }
        let (read, picks) = match (self.batch.read.as_mut(), self.batch.picks.as_ref()) {
            (Some((read, _)), Some(picks)) => (read, picks),
            _ => bail!("the batched step's pick buffers are missing"),
        };
        read.queue_read(&self.gpu, picks, 0, words)?;
        let launched = self.feed_rows(fed);
        let read = match self.batch.read.as_mut() {
            Some((read, _)) => read.wait(words).map(<[u32]>::to_vec),
            None => Err(anyhow!("the batched step's pick read is missing")),
        };
        launched?;
        read
    }

    /// Row `i`'s pick as `decode` makes it for one step, not waited for on the device paths:
    /// queued, its words then copied to row `i` of the gathered picks. A device-sampled row's
    /// sampler is taken from `kept` when one there serves it, else made, and put in `samplers`.
    fn queue_row_pick(
        &mut self,
        i: usize,
        row: &mut DecodeRow<'_>,
        kept: &mut Vec<KeptSampler>,
        samplers: &mut Vec<KeptSampler>,
    ) -> Result<Picked> {
        let vocab = self.cfg.vocab;
        let path = self.plan.sampling(&row.sampler.params);
        let mask = row.sampler.next_mask().map(|m| {
            let mut w = m.words().to_vec();
            w.resize(vocab.div_ceil(32), 0); // a mask's own vocabulary may differ: none beyond
            w
        });
        if path == SamplingPath::Host {
            let s = self.seq(row.seq)?;
            let logits: Vec<f32> = self.gpu.read(&s.logits, 0, vocab)?;
            let id = row.sampler.sample(&logits);
            if id as usize >= vocab {
                bail!("the sampler chose token {id}, outside the vocabulary");
            }
            self.gpu.write(&s.next_token, 0, &[id as i32])?;
            let (logprob, top) = token_logprob(&logits, id, row.top_logprobs);
            return Ok(Picked::Host(StepOut {
                token: id,
                logprob,
                top,
            }));
        }
        if mask.is_some() && self.mask_bufs.is_none() {
            self.mask_bufs = Some(super::MaskBufs::new(&self.gpu, vocab)?);
        }
        // `gpu.write` is ordered after the picks queued before it, so one mask buffer serves
        // every row.
        let mask_dev = match (&mask, &self.mask_bufs) {
            (Some(words), Some(m)) => {
                self.gpu.write(&m.words, 0, words)?;
                Some((m.words.ptr, m.keys.ptr))
            }
            _ => None,
        };
        if path == SamplingPath::Device {
            let sampler = match kept.iter().position(|k| k.serves(row.seq, row.sampler)) {
                Some(at) => kept.swap_remove(at),
                None => KeptSampler {
                    seq: row.seq.0,
                    stamp: row.sampler.history_stamp(),
                    params: row.sampler.params.clone(),
                    ds: DeviceSampler::new(
                        &self.gpu,
                        vocab,
                        row.sampler,
                        self.plan.many_block_sampling(),
                    )?,
                },
            };
            samplers.push(sampler);
        }
        let lp_path = self.plan.logprobs(path, row.top_logprobs, vocab);
        let s = self.seq(row.seq)?;
        self.gpu.profile_scope("decode pick");
        let ds = if path == SamplingPath::Device {
            samplers.last().map(|k| &k.ds)
        } else {
            None
        };
        self.queue_pick(s, row.sampler, ds, mask_dev, lp_path, row.top_logprobs)?;
        let words = 2 + if lp_path == LogprobsPath::Device {
            2 * row.top_logprobs
        } else {
            0
        };
        let picks = self
            .batch
            .picks
            .as_ref()
            .ok_or_else(|| anyhow!("the batched step's pick buffer is missing"))?;
        let at = picks.ptr + (i * NEXT_TOKEN_WORDS * 4) as u64;
        self.gpu.copy_raw(at, s.next_token.ptr, words * 4)?;
        Ok(Picked::Device {
            words,
            path,
            lp_path,
        })
    }

    /// Feeds each of `fed`'s (at least two) sequences the token in its `next_token`, in one
    /// batched forward pass: its graph replayed when one was captured for these sequences, else
    /// captured now (graphs on) or launched plainly.
    fn feed_batch(&mut self, fed: &[SeqId]) -> Result<()> {
        let bytes = fed.len() * self.cfg.vocab * 4;
        let mut logits = std::mem::take(&mut self.batch.logits);
        let replaced = self.with_room(|b| ensure(b, &mut logits, bytes));
        self.batch.logits = logits;
        if replaced? {
            self.batch.graphs.clear();
        }
        let shape = AttnShape::of(&self.cfg);
        let mut key = GraphKey::with_capacity(fed.len());
        for &seq in fed {
            key.push((seq.0, self.plan.long_keys(shape, self.seq(seq)?.len + 1)));
        }
        let forward_start = self
            .plan
            .step_timing
            .then(|| timing_event(&self.gpu))
            .transpose()?;
        self.launch_batch(fed, key)?;
        if let Some(start) = forward_start {
            self.batch.timing.forward = Some((start, timing_event(&self.gpu)?));
        }
        for &seq in fed {
            if let Some(s) = self.seqs.get_mut(&seq.0) {
                s.len += 1;
            }
        }
        Ok(())
    }

    /// The batched forward pass of `fed` (graph key `key`): replayed, captured or launched.
    fn launch_batch(&mut self, fed: &[SeqId], key: GraphKey) -> Result<()> {
        let graphs = self.plan.decode_graphs();
        let hit = graphs
            .then(|| self.batch.graphs.iter().position(|c| c.key == key))
            .flatten();
        match hit {
            Some(i) => self.batch.graphs[i].graph.launch()?,
            None => {
                // The pointer table for these sequences: a new one for a graph to keep, else the
                // plain passes' one (the previous pass is done: this step's picks were read).
                let words = {
                    let seqs = fed
                        .iter()
                        .map(|&seq| self.seq(seq))
                        .collect::<Result<Vec<&SeqState>>>()?;
                    Forward::batch_table(&seqs)
                };
                let bytes = words.len() * 8;
                let table = if graphs {
                    Some(self.with_room(|b| b.gpu.alloc(bytes))?)
                } else {
                    let mut plain = self.batch.plain_table.take();
                    let sized = self.with_room(|b| ensure(b, &mut plain, bytes));
                    let plain = plain;
                    sized?;
                    plain
                };
                let table_ptr = match &table {
                    Some(t) => {
                        self.gpu.write(t, 0, &words)?;
                        t.ptr
                    }
                    None => bail!("the batched step's pointer table is missing"),
                };
                let seqs = fed
                    .iter()
                    .map(|&seq| self.seq(seq))
                    .collect::<Result<Vec<&SeqState>>>()?;
                let out = self
                    .batch
                    .logits
                    .as_ref()
                    .ok_or_else(|| anyhow!("the batched step's logits buffer is missing"))?
                    .ptr;
                let fwd = self.forward();
                let run = || fwd.run_batch(&self.model, &seqs, out, table_ptr);
                let captured = graphs.then(|| DecodeGraph::capture(&self.gpu, run));
                match captured {
                    Some(Ok(g)) => {
                        tracing::info!(
                            "captured the batched step's graph for {} sequences ({} kept before)",
                            fed.len(),
                            self.batch.graphs.len()
                        );
                        g.launch()?;
                        if self.batch.graphs.len() >= BATCH_GRAPHS {
                            self.batch.graphs.pop_front();
                        }
                        self.batch.graphs.push_back(Captured {
                            key,
                            graph: g,
                            _table: table,
                        });
                    }
                    Some(Err(e)) => {
                        run()?;
                        tracing::warn!(
                            "CUDA graph capture of a batched step failed, decoding without graphs: {e:#}"
                        );
                        self.plan.give_up_graphs();
                        // Kept until the next plain pass replaces it (this one may still read it).
                        self.batch.plain_table = table;
                    }
                    None => {
                        run()?;
                        self.batch.plain_table = table;
                    }
                }
            }
        }
        Ok(())
    }
}
