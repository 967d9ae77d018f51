//! `CudaBackend`: the `Backend` contract (lily-core/src/backend.rs) on one NVIDIA GPU.
//! Prefill runs in chunks of at most `chunk` tokens; decode embeds the token the device sampler
//! wrote, so the id only crosses to the host to be reported, and (pipelined, the default) the
//! next step is queued before the host has read it.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use anyhow::{anyhow, bail, Result};
use lily_core::backend::{Backend, DecodeRow, Flow, SeqId, SnapshotId, StepOut};
use lily_core::config::ModelConfig;
use lily_core::cpu::ops::KvFormat;
use lily_core::logprob::{token_logprob, LogSoftmax};
use lily_core::sampling::Sampler;
use lily_core::weights::ModelWeights;

use crate::forward::{Forward, LogitsOut, Scratch, SeqState, NEXT_TOKEN_WORDS};
use crate::gpu::{DevBuf, Gpu};
use crate::graph::DecodeGraph;
use crate::kernels::attention::AttnShape;
use crate::kernels::sample::{Argmax, TopLogprobs};
use crate::kernels::{self, Kernels};
use crate::pinned::Pinned;
pub use crate::plan::CudaOptions;
use crate::plan::{LogprobsPath, Plan, SamplingPath};
use crate::sampler::DeviceSampler;
use crate::weights::{upload_model, DevModel};

mod batch;

/// The CUDA backend for `opts` (the environment overrides apply on top, plan.rs), or the reason
/// it cannot run here (no driver, no GPU, no NVRTC, ...): what lily-server's `--device cuda|auto`
/// calls.
pub fn cuda_backend(weights: &ModelWeights, opts: &CudaOptions) -> Result<Box<dyn Backend>> {
    Ok(Box::new(CudaBackend::new(weights, opts.clone())?))
}

/// Most tokens per forward pass when every position's logits are kept (`prefill_all_logits`).
const ALL_LOGITS_CHUNK: usize = 256;

/// A sequence's state at `len` tokens; the KV rows `0..len` stay in the sequence `seq` and are
/// shared, not copied (lily-core backend.rs, `snapshot`). The rest (logits, next token, every
/// DeltaNet layer's recurrent and conv state) lies in one buffer, laid out by `snapshot_parts`.
struct Snapshot {
    seq: u64,
    len: usize,
    buf: DevBuf,
}

/// The per-sequence buffers a snapshot copies, each with its byte offset in the snapshot's
/// buffer (256-byte aligned), and the buffer's size. Every sequence of a backend has the same
/// shapes, so every snapshot has the same size and a freed one's buffer fits the next.
fn snapshot_parts(s: &SeqState) -> (Vec<(&DevBuf, usize)>, usize) {
    let mut parts = Vec::with_capacity(2 + 2 * s.dn.len());
    let mut end = 0usize;
    let bufs = [&s.logits, &s.next_token]
        .into_iter()
        .chain(s.dn.iter().flat_map(|(st, cv)| [st, cv]));
    for b in bufs {
        parts.push((b, end));
        end = (end + b.bytes).next_multiple_of(256);
    }
    (parts, end)
}

/// A constrained step's device buffers: the allowed tokens as a bitset (u32 [vocab / 32]) and the
/// masked logits (f32 [vocab]); and the page-locked words a pipelined decode uploads the bitset
/// from without waiting for the stream.
struct MaskBufs {
    words: DevBuf,
    keys: DevBuf,
    staging: Pinned,
}

impl MaskBufs {
    fn new(gpu: &Gpu, vocab: usize) -> Result<MaskBufs> {
        let n_words = vocab.div_ceil(32);
        Ok(MaskBufs {
            words: gpu.alloc(n_words * 4)?,
            keys: gpu.alloc(vocab * 4)?,
            staging: Pinned::new(gpu, n_words)?,
        })
    }
}

/// Freed snapshots' buffers kept for the next snapshots (≈ 61 MB each on the full model): a
/// snapshot then costs its device copies only, no allocation.
const SPARE_SNAPSHOTS: usize = 8;

pub struct CudaBackend {
    // Field order matters for drop: device buffers before the GPU (context, modules).
    seqs: HashMap<u64, SeqState>,
    snaps: HashMap<u64, Snapshot>,
    /// The largest freed sequence, kept so the next `new_seq` that fits in it reuses its device
    /// buffers (reset: position 0, DeltaNet state zeroed, no decode graph) instead of
    /// allocating: with the default context (262,144 tokens on an H200) a sequence is 20 KV
    /// buffers of 268 MB. Outside the prefix cache's budget; freed when an allocation fails
    /// (`with_room`).
    spare_seq: Option<SeqState>,
    /// Freed snapshots' buffers (at most SPARE_SNAPSHOTS), for the next snapshots.
    spare_snaps: Vec<DevBuf>,
    next_id: u64,
    scratch: Scratch,
    /// A constrained step's buffers, allocated by the first constrained decode.
    mask_bufs: Option<MaskBufs>,
    /// Where a pipelined decode's token, log-probability and device top log-probabilities land
    /// (NEXT_TOKEN_WORDS words), allocated by the first pipelined decode.
    token_read: Option<Pinned>,
    /// The batched decode step's buffers and graphs (batch.rs).
    batch: batch::BatchState,
    model: DevModel,
    cfg: ModelConfig,
    plan: Plan,
    kernels: Kernels,
    gpu: Gpu,
}

impl CudaBackend {
    /// The backend for `opts` with the environment overrides on top.
    pub fn new(weights: &ModelWeights, opts: CudaOptions) -> Result<CudaBackend> {
        CudaBackend::with_options(weights, &opts.with_env_overrides())
    }

    /// The backend for exactly `opts` (no environment), resolved for its GPU (`Plan::open`).
    pub fn with_options(weights: &ModelWeights, opts: &CudaOptions) -> Result<CudaBackend> {
        kernels::check_limits(&weights.config)?;
        let chunk = opts.chunk;
        kernels::check_chunk(&weights.config, chunk)?;
        let (mut gpu, plan) = Plan::open(opts)?;
        gpu.dependent_launch = plan.dependent_launch();
        let kernels = Kernels::load(&gpu, &plan.build())?;
        let model = upload_model(&gpu, weights)?;
        let scratch = Scratch::new(&gpu, &weights.config, chunk, &plan)?;
        gpu.sync()?;
        tracing::info!(
            "cuda: {} ({}), {:.2} GB of weights on the device; {}",
            gpu.name,
            gpu.arch,
            model.bytes as f64 / 1e9,
            plan.describe()
        );
        Ok(CudaBackend {
            seqs: HashMap::new(),
            snaps: HashMap::new(),
            spare_seq: None,
            spare_snaps: Vec::new(),
            next_id: 1,
            scratch,
            mask_bufs: None,
            token_read: None,
            batch: batch::BatchState::default(),
            model,
            cfg: weights.config.clone(),
            plan,
            kernels,
            gpu,
        })
    }

    pub fn gpu(&self) -> &Gpu {
        &self.gpu
    }

    /// The path decisions this backend runs with.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    fn seq(&self, seq: SeqId) -> Result<&SeqState> {
        self.seqs
            .get(&seq.0)
            .ok_or_else(|| anyhow!("unknown sequence {}", seq.0))
    }

    fn forward(&self) -> Forward<'_> {
        Forward {
            gpu: &self.gpu,
            kernels: &self.kernels,
            plan: &self.plan,
            cfg: &self.cfg,
            scratch: &self.scratch,
        }
    }

    /// Tokens `s`'s KV cache can hold (its allocation, whatever `max_ctx` it was reset to).
    fn capacity(&self, s: &SeqState) -> usize {
        let row = self.plan.kv_pos_bytes(&self.cfg);
        s.kv.first()
            .map_or(usize::MAX, |(k, _)| k.bytes / row.max(1))
    }

    /// The spare sequence reset to an empty one of context `max_ctx`, if it is large enough; a
    /// spare too small for it is freed (the caller is about to allocate a larger one).
    fn take_spare_seq(&mut self, max_ctx: usize) -> Result<Option<SeqState>> {
        let Some(mut s) = self.spare_seq.take() else {
            return Ok(None);
        };
        if self.capacity(&s) < max_ctx {
            return Ok(None);
        }
        // What `SeqState::new` initialises: the position, the pending token, the DeltaNet
        // recurrent and conv states. KV rows at and past the position are never read before
        // they are written (as after a rewind), and the logits are written by the first prefill.
        // The decode graph goes too (captured again at the first decode, as for a new
        // sequence), so a reused sequence behaves exactly as a new one, timing included.
        s.len = 0;
        s.max_ctx = max_ctx;
        s.decode_graphs = [None, None];
        self.gpu.fill(&s.pos, 0)?;
        self.gpu.fill(&s.next_token, 0)?;
        for (state, conv) in &s.dn {
            self.gpu.fill(state, 0)?;
            self.gpu.fill(conv, 0)?;
        }
        Ok(Some(s))
    }

    /// Keeps a freed sequence's buffers as the spare if it is at least as large as the current
    /// spare (which is then freed); else frees them.
    fn keep_spare_seq(&mut self, s: SeqState) {
        let larger = self
            .spare_seq
            .as_ref()
            .is_none_or(|spare| self.capacity(&s) >= self.capacity(spare));
        if larger {
            self.spare_seq = Some(s);
        }
    }

    /// Runs an allocating step; if it fails while spare buffers are kept, frees them and runs it
    /// once more (the spares may be what the device is short of).
    fn with_room<T>(&mut self, mut f: impl FnMut(&Self) -> Result<T>) -> Result<T> {
        match f(self) {
            Ok(v) => Ok(v),
            Err(_) if self.spare_seq.is_some() || !self.spare_snaps.is_empty() => {
                let _ = self.gpu.sync();
                self.spare_seq = None;
                self.spare_snaps.clear();
                f(self)
            }
            Err(e) => Err(e),
        }
    }

    fn check_tokens(&self, s: &SeqState, tokens: &[u32]) -> Result<()> {
        lily_core::backend::check_tokens(self.cfg.vocab, s.len, s.max_ctx, tokens)
    }

    /// Feeds the token the sampler left in `next_token`: the captured graph when graphs are on,
    /// else the same launches one by one. A sequence keeps two graphs, captured at its first
    /// decode step on each side of `split_long_keys` keys (the attention kernels differ there,
    /// `Plan::long_keys`); each replays at any position on its side.
    fn feed_next(&mut self, seq: SeqId) -> Result<()> {
        let shape = AttnShape::of(&self.cfg);
        let which = usize::from(self.plan.long_keys(shape, self.seq(seq)?.len + 1));
        if self.plan.decode_graphs() && self.seq(seq)?.decode_graphs[which].is_none() {
            let s = self.seq(seq)?;
            let fwd = self.forward();
            match DecodeGraph::capture(&self.gpu, || {
                fwd.run(&self.model, s, s.next_token.ptr, 1, LogitsOut::Last)
            }) {
                Ok(g) => {
                    self.seqs
                        .get_mut(&seq.0)
                        .expect("checked above")
                        .decode_graphs[which] = Some(g)
                }
                Err(e) => {
                    tracing::warn!("CUDA graph capture failed, decoding without graphs: {e:#}");
                    self.plan.give_up_graphs();
                }
            }
        }
        let s = self.seq(seq)?;
        match (&s.decode_graphs[which], self.plan.decode_graphs()) {
            (Some(g), true) => g.launch()?,
            _ => self
                .forward()
                .run(&self.model, s, s.next_token.ptr, 1, LogitsOut::Last)?,
        }
        self.seqs.get_mut(&seq.0).expect("checked above").len += 1;
        Ok(())
    }

    /// Queues a device pick from `s`'s pending logits into its `next_token` words: the device
    /// sampler when one is given, else the greedy argmax; `mask`: the allowed tokens' bitset on
    /// the device. Then, on the device path, the top `top_logprobs` log-probabilities beside it.
    fn queue_pick(
        &self,
        s: &SeqState,
        sampler: &mut Sampler,
        device_pick: Option<&DeviceSampler>,
        mask: Option<(u64, u64)>,
        lp_path: LogprobsPath,
        top_logprobs: usize,
    ) -> Result<()> {
        match device_pick {
            Some(ds) => ds.sample(
                &self.gpu,
                &self.kernels.sample,
                sampler,
                s.logits.ptr,
                s.next_token.ptr,
                s.next_logprob(),
                mask.map(|m| m.0),
            )?,
            None => {
                let argmax = Argmax {
                    logits: s.logits.ptr,
                    vocab: self.cfg.vocab,
                    token_out: s.next_token.ptr,
                    logprob_out: s.next_logprob(),
                    partials: Some(self.scratch.argmax_parts.ptr),
                };
                match mask {
                    Some((words, keys)) => self
                        .kernels
                        .sample
                        .argmax_masked(&self.gpu, &argmax, words, keys)?,
                    None => self.kernels.sample.argmax_logprob(&self.gpu, &argmax)?,
                }
            }
        }
        if lp_path == LogprobsPath::Device {
            self.kernels.sample.top_logprobs(
                &self.gpu,
                &TopLogprobs {
                    logits: s.logits.ptr,
                    vocab: self.cfg.vocab,
                    k: top_logprobs,
                    parts: self.scratch.logprob_parts.ptr,
                    out: s.top_logprobs_out(),
                },
            )?;
        }
        Ok(())
    }

    /// Pipelined decode, after a pick was queued: queues the copy of its token and
    /// log-probability into page-locked memory (on the pinned buffer's side stream, so the next
    /// pass need not wait for it), then (when `more` steps may follow and the context has room)
    /// the forward pass that feeds the token, which only reads them, then waits for the copy
    /// alone, on every path (the copy must end before the token's buffer can be written or
    /// freed). The first `words` words (token, log-probability, then the device top
    /// log-probabilities' pairs), and whether the token was fed.
    fn read_pick_pipelined(
        &mut self,
        seq: SeqId,
        words: usize,
        more: bool,
        timing: &mut StepTiming,
    ) -> Result<(Vec<u32>, bool)> {
        let s = self
            .seqs
            .get(&seq.0)
            .ok_or_else(|| anyhow!("unknown sequence {}", seq.0))?;
        const ALLOCATED: &str = "decode allocates token_read when it pipelines";
        let read = self.token_read.as_mut().expect(ALLOCATED);
        read.queue_read(&self.gpu, &s.next_token, 0, words)?;
        let feed = more && s.len < s.max_ctx;
        let launched = if feed {
            timing
                .launching(&self.gpu)
                .and_then(|()| self.feed_next(seq))
                .and_then(|()| timing.launched(&self.gpu))
        } else {
            Ok(())
        };
        let read = self
            .token_read
            .as_mut()
            .expect(ALLOCATED)
            .wait(words)
            .map(<[u32]>::to_vec);
        launched?;
        Ok((read?, feed))
    }
}

/// A device pick as read back (`NEXT_TOKEN_WORDS` layout: token, log-probability, then the
/// device top log-probabilities' (id, log-probability) pairs when `lp_path` is `Device`; `w`
/// holds just the words the pick wrote): the token, its log-probability and the alternatives
/// (empty unless on the device). Ids outside the vocabulary are refused.
fn picked_step(w: &[u32], vocab: usize, lp_path: LogprobsPath) -> Result<StepOut> {
    let (id, lp) = (w[0] as i32, f32::from_bits(w[1]));
    if id < 0 || id as usize >= vocab {
        bail!("the device sampler chose token {id}, outside the vocabulary");
    }
    let mut top = Vec::new();
    if lp_path == LogprobsPath::Device {
        for pair in w[2..].chunks_exact(2) {
            if pair[0] as usize >= vocab {
                bail!(
                    "the device's top log-probabilities name token {}, outside the vocabulary",
                    pair[0]
                );
            }
            top.push((pair[0], f32::from_bits(pair[1])));
        }
    }
    Ok(StepOut {
        token: id as u32,
        logprob: lp,
        top,
    })
}

/// A timing event recorded on the stream now (step timing: one-sequence and batched).
fn timing_event(gpu: &Gpu) -> Result<cudarc::driver::CudaEvent> {
    gpu.stream
        .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(|e| anyhow!("step timing event: {e}"))
}

/// Milliseconds between two recorded timing events (both passed).
fn span_ms(start: &cudarc::driver::CudaEvent, end: &cudarc::driver::CudaEvent) -> Result<f64> {
    Ok(f64::from(
        start
            .elapsed_ms(end)
            .map_err(|e| anyhow!("step timing: {e}"))?,
    ))
}

/// `CudaOptions::step_timing`: the device's work per token (events around each forward pass and
/// each pick, summed) beside the host's wall time per token over the same steps, from the first
/// forward pass's launch to the last timed token's read; the difference is the time a token the
/// device waits for the host (read, callback, launch). Pipelined too: a span is summed once its
/// end has passed (`read`), never waited for in the middle of a call, which would stall the
/// pipeline; a forward pass queued for a token that ended generation counts as work.
struct StepTiming {
    on: bool,
    /// The start event of the span being queued (a forward pass or a pick).
    open: Option<cudarc::driver::CudaEvent>,
    /// Queued spans (start, end), not yet summed.
    spans: VecDeque<(cudarc::driver::CudaEvent, cudarc::driver::CudaEvent)>,
    device_ms: f64,
    /// Timed picks read so far, and whether the pick queued last was timed.
    steps: usize,
    pick_timed: bool,
    first: Option<Instant>,
    last: Option<Instant>,
}

impl StepTiming {
    fn new(on: bool) -> StepTiming {
        StepTiming {
            on,
            open: None,
            spans: VecDeque::new(),
            device_ms: 0.0,
            steps: 0,
            pick_timed: false,
            first: None,
            last: None,
        }
    }

    fn close(&mut self, gpu: &Gpu) -> Result<bool> {
        match self.open.take() {
            Some(start) => {
                self.spans.push_back((start, timing_event(gpu)?));
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// Before a forward pass is queued: timing starts with the call's first.
    fn launching(&mut self, gpu: &Gpu) -> Result<()> {
        if self.on {
            self.first.get_or_insert_with(Instant::now);
            self.open = Some(timing_event(gpu)?);
        }
        Ok(())
    }

    /// After the forward pass was queued.
    fn launched(&mut self, gpu: &Gpu) -> Result<()> {
        self.close(gpu).map(|_| ())
    }

    /// Before a pick is queued: timed once a forward pass was (the first pick of a call reads
    /// logits an earlier call or prefill left).
    fn picking(&mut self, gpu: &Gpu) -> Result<()> {
        if self.on && self.first.is_some() {
            self.open = Some(timing_event(gpu)?);
        }
        Ok(())
    }

    /// After the pick was queued.
    fn picked(&mut self, gpu: &Gpu) -> Result<()> {
        self.pick_timed = self.close(gpu)?;
        Ok(())
    }

    /// After the pick's token was read: counts it if its pick was timed, and sums the spans that
    /// have ended (a forward pass queued behind the pick may still run: left for later).
    fn read(&mut self) -> Result<()> {
        if std::mem::take(&mut self.pick_timed) {
            self.steps += 1;
            self.last = Some(Instant::now());
        }
        while self.spans.front().is_some_and(|(_, end)| end.is_complete()) {
            self.sum_first()?;
        }
        Ok(())
    }

    fn sum_first(&mut self) -> Result<()> {
        if let Some((a, b)) = self.spans.pop_front() {
            self.device_ms += span_ms(&a, &b)?;
        }
        Ok(())
    }

    /// At the end of the call (the stream is synchronised): the rest of the spans, and the line.
    fn report(&mut self) -> Result<()> {
        while !self.spans.is_empty() {
            self.sum_first()?;
        }
        if let (Some(first), Some(last), true) = (self.first, self.last, self.steps > 0) {
            let n = self.steps as f64;
            let wall = last.duration_since(first).as_secs_f64() * 1e3 / n;
            let device = self.device_ms / n;
            tracing::info!(
                "decode step timing over {} steps: device {device:.3} ms a token (forward pass and pick), wall {wall:.3} ms a token: the device waits {:.3} ms a token for the host",
                self.steps,
                wall - device
            );
        }
        Ok(())
    }
}

/// Share of the free device memory one sequence's KV cache may take for the default context
/// (the rest is for the prefix cache's kept sequences and snapshots).
const DEFAULT_CONTEXT_MEMORY_SHARE: usize = 4;

impl Backend for CudaBackend {
    fn prefill_chunk(&self) -> usize {
        self.plan.prefill_chunk
    }

    fn interleaved_chunk(&self) -> usize {
        self.plan.interleaved_chunk
    }

    /// The model's whole context when a quarter of the free device memory holds its KV cache
    /// (the full model on an H200: 262,144 tokens, 5.2 GB in bf16), else what that quarter holds.
    fn default_context(&self) -> usize {
        let c = &self.cfg;
        let per_token = (2 * c.n_attention_layers() * self.plan.kv_pos_bytes(c)).max(1);
        let _ = self.gpu.bind();
        let free = cudarc::driver::result::mem_get_info().map_or(0, |(free, _)| free);
        let fits = free / DEFAULT_CONTEXT_MEMORY_SHARE / per_token;
        // Never below what the default of every backend offers.
        c.max_position.min(fits.max(32_768))
    }

    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn describe(&self) -> String {
        format!(
            "cuda {} {} ({} activations{})",
            self.gpu.name,
            self.gpu.arch,
            if self.plan.bf16_activations {
                "bf16"
            } else {
                "fp32"
            },
            if self.plan.kv_int8() {
                ", int8 KV cache"
            } else {
                ""
            }
        )
    }

    fn kv_format(&self) -> KvFormat {
        if self.plan.kv_int8() {
            KvFormat::Int8Row
        } else if self.plan.bf16_activations {
            KvFormat::Bf16
        } else {
            KvFormat::Full
        }
    }

    fn new_seq(&mut self, max_ctx: usize) -> Result<SeqId> {
        if max_ctx == 0 {
            bail!("a sequence needs a context of at least one token");
        }
        self.gpu.bind()?;
        let s = match self.take_spare_seq(max_ctx)? {
            Some(s) => s,
            None => self.with_room(|b| {
                SeqState::with_kv(&b.gpu, &b.cfg, max_ctx, b.plan.kv_pos_bytes(&b.cfg))
            })?,
        };
        self.gpu.sync()?;
        let id = self.next_id;
        self.next_id += 1;
        self.seqs.insert(id, s);
        Ok(SeqId(id))
    }

    fn free_seq(&mut self, seq: SeqId) {
        let _ = self.gpu.bind();
        let _ = self.gpu.sync();
        self.batch.forget(seq);
        if let Some(s) = self.seqs.remove(&seq.0) {
            self.keep_spare_seq(s);
        }
        let gone: Vec<u64> = self
            .snaps
            .iter()
            .filter(|(_, s)| s.seq == seq.0)
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            self.drop_snapshot(SnapshotId(id));
        }
    }

    fn seq_len(&self, seq: SeqId) -> Result<usize> {
        Ok(self.seq(seq)?.len)
    }

    fn prefill_all_logits(&mut self, seq: SeqId, tokens: &[u32]) -> Result<Vec<f32>> {
        self.gpu.bind()?;
        let v = self.cfg.vocab;
        // Every position's logits are [n, vocab] f32 (1 MB per token on this model): pieces of
        // at most ALL_LOGITS_CHUNK tokens bound the device buffer, whatever the prefill chunk.
        let chunk = self
            .scratch
            .chunk
            .min(ALL_LOGITS_CHUNK)
            .min(tokens.len().max(1));
        let out = self.gpu.alloc(chunk * v * 4)?;
        let mut all = Vec::with_capacity(tokens.len() * v);
        self.check_tokens(self.seq(seq)?, tokens)?;
        for piece in tokens.chunks(chunk) {
            let ids: Vec<i32> = piece.iter().map(|&t| t as i32).collect();
            self.gpu.write(&self.scratch.tokens, 0, &ids)?;
            let s = self.seq(seq)?;
            self.forward().run(
                &self.model,
                s,
                self.scratch.tokens.ptr,
                piece.len(),
                LogitsOut::All(out.ptr),
            )?;
            let flat: Vec<f32> = self.gpu.read(&out, 0, piece.len() * v)?;
            all.extend_from_slice(&flat);
            self.seqs.get_mut(&seq.0).expect("checked above").len += piece.len();
        }
        Ok(all)
    }

    fn prefill(&mut self, seq: SeqId, tokens: &[u32]) -> Result<()> {
        self.gpu.bind()?;
        self.check_tokens(self.seq(seq)?, tokens)?;
        for piece in tokens.chunks(self.scratch.chunk) {
            let ids: Vec<i32> = piece.iter().map(|&t| t as i32).collect();
            self.gpu.write(&self.scratch.tokens, 0, &ids)?;
            let s = self.seq(seq)?;
            self.forward().run(
                &self.model,
                s,
                self.scratch.tokens.ptr,
                piece.len(),
                LogitsOut::Last,
            )?;
            self.seqs.get_mut(&seq.0).expect("checked above").len += piece.len();
        }
        self.gpu.sync()
    }

    fn logits(&mut self, seq: SeqId) -> Result<Vec<f32>> {
        self.gpu.bind()?;
        let s = self.seq(seq)?;
        if s.len == 0 {
            bail!(
                "sequence {} has consumed no tokens, so it has no logits",
                seq.0
            );
        }
        self.gpu.read(&s.logits, 0, self.cfg.vocab)
    }

    fn decode(
        &mut self,
        seq: SeqId,
        sampler: &mut Sampler,
        n: usize,
        top_logprobs: usize,
        on_token: &mut dyn FnMut(&StepOut) -> Flow,
    ) -> Result<()> {
        self.gpu.bind()?;
        if self.seq(seq)?.len == 0 {
            bail!("decode needs a prefilled sequence");
        }
        // Sampling runs after the (possibly graph-replayed) forward step, outside the graph, so
        // the graph stays the same whatever the sampler is.
        let path = self.plan.sampling(&sampler.params);
        // Pipelined (`Plan::pipelined_decode`): step N's pick is followed on the stream by the
        // copy of its token and log-probability into page-locked memory (behind an event) and at
        // once by step N + 1's forward pass, which embeds the token from the device. The host
        // waits for that copy only, reports token N and, if the caller goes on, queues pick
        // N + 1 behind the running pass (its mask and uniform taken now, after token N was
        // accepted, exactly as unpipelined). The device so always has the next pass queued
        // while the host handles a token. A token that ends generation has then been fed
        // (`seq_len` says so; `Backend::decode`). The host checks the id after the pass that
        // embeds it was queued: a device pick only writes ids in the vocabulary.
        // Top log-probabilities on the device (`Plan::logprobs`): computed right after the pick
        // into the words beside the token, read with it (pipelined too).
        let lp_path = self.plan.logprobs(path, top_logprobs, self.cfg.vocab);
        let words = 2 + if lp_path == LogprobsPath::Device {
            2 * top_logprobs
        } else {
            0
        };
        let pipelined = self.plan.pipelined_decode(path, lp_path);
        // Created when the first device pick needs it.
        let mut device_pick: Option<DeviceSampler> = None;
        // LILY_STEP_TIMING: each forward pass's and pick's device work (events around them)
        // against the wall time between the first launch and the last read.
        let mut timing = StepTiming::new(self.plan.step_timing);
        if sampler.is_constrained() && path != SamplingPath::Host && self.mask_bufs.is_none() {
            self.mask_bufs = Some(MaskBufs::new(&self.gpu, self.cfg.vocab)?);
        }
        if pipelined && self.token_read.is_none() {
            self.token_read = Some(Pinned::with_side_stream(&self.gpu, NEXT_TOKEN_WORDS)?);
        }
        for step in 0..n {
            // A constrained step (a grammar's token mask; lily-core `constrain`): on the device
            // paths the mask goes up as a bitset and the pick stays on the device; on the host
            // path it applies to the downloaded logits.
            let vocab = self.cfg.vocab;
            let mask = sampler.next_mask().map(|m| {
                let mut w = m.words().to_vec();
                w.resize(vocab.div_ceil(32), 0); // a mask's own vocabulary may differ: none beyond
                w
            });
            if path == SamplingPath::Device && device_pick.is_none() {
                device_pick = Some(DeviceSampler::new(
                    &self.gpu,
                    self.cfg.vocab,
                    sampler,
                    self.plan.many_block_sampling(),
                )?);
            }
            let mask_dev = match (&mask, self.mask_bufs.as_mut()) {
                (Some(words), Some(m)) if path != SamplingPath::Host => {
                    if pipelined {
                        // Queued behind the running forward pass, no wait for it.
                        m.staging.queue_write(&self.gpu, words, &m.words, 0)?;
                    } else {
                        self.gpu.write(&m.words, 0, words)?;
                    }
                    Some((m.words.ptr, m.keys.ptr))
                }
                _ => None,
            };
            // Whether this step's token was fed already (pipelined), so the step ends with it.
            let mut fed = false;
            let (token, logprob, top) = if path != SamplingPath::Host {
                let s = self.seq(seq)?;
                self.gpu.profile_scope("decode pick");
                timing.picking(&self.gpu)?;
                self.queue_pick(
                    s,
                    sampler,
                    device_pick.as_ref(),
                    mask_dev,
                    lp_path,
                    top_logprobs,
                )?;
                timing.picked(&self.gpu)?;
                // Token, log-probability and device top log-probabilities in one read: one wait
                // for the device a token.
                let w = if pipelined {
                    let (w, fed_now) =
                        self.read_pick_pipelined(seq, words, step + 1 < n, &mut timing)?;
                    fed = fed_now;
                    w
                } else {
                    self.gpu.read::<u32>(&s.next_token, 0, words)?
                };
                timing.read()?;
                let step = picked_step(&w, self.cfg.vocab, lp_path)?;
                let top = match lp_path {
                    LogprobsPath::Host => {
                        let s = self.seq(seq)?;
                        let logits: Vec<f32> = self.gpu.read(&s.logits, 0, self.cfg.vocab)?;
                        LogSoftmax::new(&logits).top(top_logprobs)
                    }
                    _ => step.top,
                };
                (step.token, step.logprob, top)
            } else {
                // SamplingPath::Host: top_k off or above 256, or device sampling off.
                let s = self.seq(seq)?;
                let logits: Vec<f32> = self.gpu.read(&s.logits, 0, self.cfg.vocab)?;
                let id = sampler.sample(&logits);
                if id as usize >= self.cfg.vocab {
                    bail!("the sampler chose token {id}, outside the vocabulary");
                }
                self.gpu.write(&s.next_token, 0, &[id as i32])?;
                let (lp, top) = token_logprob(&logits, id, top_logprobs);
                (id, lp, top)
            };
            sampler.accept(token);
            let flow = on_token(&StepOut {
                token,
                logprob,
                top,
            });
            if flow == Flow::Stop || step + 1 == n {
                break;
            }
            if !fed {
                let s = self.seq(seq)?;
                if s.len + 1 > s.max_ctx {
                    bail!("the sequence's context of {} tokens is full", s.max_ctx);
                }
                timing.launching(&self.gpu)?;
                self.feed_next(seq)?;
                timing.launched(&self.gpu)?;
            }
        }
        // Waits for a forward pass queued for a token that ended generation too (at most one
        // step): its errors surface in this call, and the engine's next use of the sequence
        // (a snapshot of the turn) would wait for it anyway.
        self.gpu.sync()?;
        timing.report()
    }

    /// 8 with the batched step (batch.rs: up to 8 rows a launch); without it a batch is only the
    /// rows one after another, so 1 (requests queue, each decoded at one sequence's rate).
    fn default_max_batch(&self) -> usize {
        if self.plan.batched_decode() {
            8
        } else {
            1
        }
    }

    /// With `batched_decode`: every row picked as `decode` picks, then one forward pass for the
    /// rows fed (batch.rs). Without: the rows one after another, as the trait's default.
    fn decode_step(
        &mut self,
        rows: &mut [DecodeRow<'_>],
        on_token: &mut dyn FnMut(usize, &StepOut) -> Flow,
    ) -> Result<()> {
        if self.plan.batched_decode() {
            self.decode_rows(rows, on_token)
        } else {
            lily_core::backend::decode_step_one_by_one(self, rows, on_token)
        }
    }

    fn snapshot(&mut self, seq: SeqId) -> Result<SnapshotId> {
        self.gpu.bind()?;
        let (_, bytes) = snapshot_parts(self.seq(seq)?);
        let buf = match self.spare_snaps.pop() {
            Some(b) if b.bytes >= bytes => b,
            _ => self.with_room(|b| b.gpu.alloc(bytes))?,
        };
        let s = self.seq(seq)?;
        let g = &self.gpu;
        for (part, at) in snapshot_parts(s).0 {
            g.copy(&buf, at, part, 0, part.bytes)?;
        }
        let snap = Snapshot {
            seq: seq.0,
            len: s.len,
            buf,
        };
        g.sync()?;
        let id = self.next_id;
        self.next_id += 1;
        self.snaps.insert(id, snap);
        Ok(SnapshotId(id))
    }

    fn restore(&mut self, seq: SeqId, snap: SnapshotId) -> Result<()> {
        self.gpu.bind()?;
        let sn = self
            .snaps
            .get(&snap.0)
            .ok_or_else(|| anyhow!("unknown snapshot {}", snap.0))?;
        let s = self
            .seqs
            .get(&seq.0)
            .ok_or_else(|| anyhow!("unknown sequence {}", seq.0))?;
        if sn.len > s.max_ctx {
            bail!(
                "snapshot of {} tokens does not fit a sequence of context {}",
                sn.len,
                s.max_ctx
            );
        }
        let g = &self.gpu;
        if sn.seq != seq.0 {
            // Fork: copy the KV prefix from the sequence the snapshot shares it with.
            let source = self
                .seqs
                .get(&sn.seq)
                .ok_or_else(|| anyhow!("snapshot {} outlived its sequence", snap.0))?;
            let kv_bytes = sn.len * self.plan.kv_pos_bytes(&self.cfg);
            for ((k, v), (sk, sv)) in s.kv.iter().zip(&source.kv) {
                g.copy(k, 0, sk, 0, kv_bytes)?;
                g.copy(v, 0, sv, 0, kv_bytes)?;
            }
        }
        for (part, at) in snapshot_parts(s).0 {
            g.copy(part, 0, &sn.buf, at, part.bytes)?;
        }
        g.write(&s.pos, 0, &[sn.len as i32])?;
        g.sync()?;
        let (len, own) = (sn.len, sn.seq == seq.0);
        if own {
            // Rewind: the rows past `len` will be overwritten, so longer snapshots of this
            // sequence are gone.
            let longer: Vec<u64> = self
                .snaps
                .iter()
                .filter(|(_, x)| x.seq == seq.0 && x.len > len)
                .map(|(&id, _)| id)
                .collect();
            for id in longer {
                self.drop_snapshot(SnapshotId(id));
            }
        }
        self.seqs.get_mut(&seq.0).expect("checked above").len = len;
        Ok(())
    }

    fn drop_snapshot(&mut self, snap: SnapshotId) {
        let _ = self.gpu.bind();
        let _ = self.gpu.sync();
        if let Some(sn) = self.snaps.remove(&snap.0) {
            if self.spare_snaps.len() < SPARE_SNAPSHOTS {
                self.spare_snaps.push(sn.buf);
            }
        }
    }

    fn seq_bytes(&self, seq: SeqId) -> usize {
        self.seqs.get(&seq.0).map_or(0, |s| {
            let kv: usize = s.kv.iter().map(|(k, v)| k.bytes + v.bytes).sum();
            let dn: usize = s.dn.iter().map(|(st, cv)| st.bytes + cv.bytes).sum();
            kv + dn + s.logits.bytes
        })
    }

    fn snapshot_bytes(&self, snap: SnapshotId) -> usize {
        self.snaps.get(&snap.0).map_or(0, |s| s.buf.bytes)
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        let _ = self.gpu.bind();
        let _ = self.gpu.sync();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(token: i32, logprob: f32, top: &[(u32, f32)]) -> Vec<u32> {
        let mut w = vec![token as u32, logprob.to_bits()];
        for &(id, lp) in top {
            w.extend([id, lp.to_bits()]);
        }
        w
    }

    #[test]
    fn a_pick_is_read_back_with_its_alternatives_and_ids_past_the_vocabulary_are_refused() {
        let top = [(7, -0.25), (3, -1.5)];
        let step = picked_step(&words(7, -0.25, &top), 10, LogprobsPath::Device).unwrap();
        assert_eq!(
            step,
            StepOut {
                token: 7,
                logprob: -0.25,
                top: top.to_vec()
            }
        );
        // Without device alternatives only the token and its log-probability are read.
        for path in [LogprobsPath::None, LogprobsPath::Host] {
            let step = picked_step(&words(9, -2.0, &[]), 10, path).unwrap();
            assert_eq!((step.token, step.logprob, step.top.len()), (9, -2.0, 0));
        }
        for bad in [10, -1] {
            let e = picked_step(&words(bad, 0.0, &[]), 10, LogprobsPath::None).unwrap_err();
            assert!(e.to_string().contains("outside the vocabulary"), "{e}");
        }
        let e = picked_step(
            &words(2, -0.1, &[(2, -0.1), (12, -3.0)]),
            10,
            LogprobsPath::Device,
        )
        .unwrap_err();
        assert!(e.to_string().contains("name token 12"), "{e}");
    }
}
