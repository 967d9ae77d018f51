//! The CPU backend: the readable reference of the whole model (MODEL.md §2.3), f32 activations,
//! multi-threaded with rayon. Prefill runs in chunks of `prefill_chunk` tokens through all layers.

pub mod chunked;
pub mod linear;
pub mod ops;

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{bail, Context, Result};

use crate::backend::{Backend, DecodeRow, Flow, SeqId, SnapshotId, StepOut};
use crate::config::ModelConfig;
use crate::logprob::token_logprob;
use crate::sampling::Sampler;
use crate::weights::{Mixer, ModelWeights};
use ops::{DeltaNetState, KvCache, KvFormat};

/// Everything one sequence carries between steps.
#[derive(Clone, Debug)]
pub struct SeqState {
    max_ctx: usize,
    pos: usize,
    /// One per layer: `Some` for attention layers.
    kv: Vec<Option<KvCache>>,
    /// One per layer: `Some` for DeltaNet layers.
    deltanet: Vec<Option<DeltaNetState>>,
    /// Logits of the last fed token.
    logits: Option<Vec<f32>>,
}

/// A sequence's state at one position, sharing its KV rows `0..pos` (backend.rs, `snapshot`).
#[derive(Clone, Debug)]
struct Snapshot {
    seq: u64,
    pos: usize,
    deltanet: Vec<Option<DeltaNetState>>,
    logits: Option<Vec<f32>>,
}

impl Snapshot {
    fn bytes(&self) -> usize {
        (deltanet_floats(&self.deltanet) + self.logits.as_ref().map_or(0, Vec::len)) * 4
    }
}

fn deltanet_floats(layers: &[Option<DeltaNetState>]) -> usize {
    layers
        .iter()
        .flatten()
        .map(|d| d.state.len() + d.conv.len())
        .sum()
}

pub struct CpuBackend {
    weights: Arc<ModelWeights>,
    prefill_chunk: usize,
    seqs: HashMap<u64, SeqState>,
    snapshots: HashMap<u64, Snapshot>,
    next_id: u64,
    kv_format: KvFormat,
}

impl CpuBackend {
    pub fn new(weights: Arc<ModelWeights>) -> Self {
        CpuBackend {
            weights,
            prefill_chunk: 512,
            seqs: HashMap::new(),
            snapshots: HashMap::new(),
            next_id: 1,
            kv_format: KvFormat::Full,
        }
    }

    /// The format new sequences keep their KV caches in (`KvFormat::Full` unless set): the
    /// reference of the GPU backends' compact caches.
    pub fn with_kv_format(mut self, format: KvFormat) -> Self {
        self.kv_format = format;
        self
    }

    /// Tokens per prefill chunk (bounds temporary memory; results do not depend on it).
    pub fn with_prefill_chunk(mut self, chunk: usize) -> Self {
        self.prefill_chunk = chunk.max(1);
        self
    }

    pub fn weights(&self) -> &Arc<ModelWeights> {
        &self.weights
    }

    fn seq_mut(&mut self, seq: SeqId) -> Result<&mut SeqState> {
        self.seqs
            .get_mut(&seq.0)
            .with_context(|| format!("unknown sequence {}", seq.0))
    }
}

/// One chunk of one sequence through the whole model. Returns the logits of the last token, or of
/// all tokens.
fn forward(
    w: &ModelWeights,
    st: &mut SeqState,
    tokens: &[u32],
    all_logits: bool,
) -> Result<Vec<f32>> {
    forward_batch(w, &mut [(st, tokens)], all_logits)
}

/// Several sequences' tokens through the whole model in one pass (a decode step of a batch: one
/// token each): every weight is applied to all rows at once, attention and DeltaNet run on each
/// sequence's own state. Returns the logits of each sequence's last token in order (of every
/// token with `all_logits`). Every sequence is checked before any state changes.
fn forward_batch(
    w: &ModelWeights,
    seqs: &mut [(&mut SeqState, &[u32])],
    all_logits: bool,
) -> Result<Vec<f32>> {
    let c = &w.config;
    let h = c.hidden;
    for (st, tokens) in seqs.iter() {
        if tokens.is_empty() {
            bail!("a forward pass needs at least one token of each sequence");
        }
        crate::backend::check_tokens(c.vocab, st.pos, st.max_ctx, tokens)?;
    }
    let t: usize = seqs.iter().map(|(_, tokens)| tokens.len()).sum();
    // §2.1 embedding.
    let mut x = vec![0f32; t * h];
    let all_tokens = seqs.iter().flat_map(|(_, tokens)| tokens.iter());
    for (row, &id) in x.chunks_mut(h).zip(all_tokens) {
        w.embed.dequant_row(id as usize, row);
    }
    // §2.3 decoder layers: two pre-norm residual branches each.
    for (i, layer) in w.layers.iter().enumerate() {
        let xn = ops::rms_norm(&x, &layer.input_norm, c.rms_eps);
        let mixed = match &layer.mixer {
            Mixer::Attention(a) => {
                let mut caches = seqs
                    .iter_mut()
                    .map(|(st, tokens)| {
                        Ok(ops::AttentionSeq {
                            pos0: st.pos,
                            len: tokens.len(),
                            kv: st.kv[i]
                                .as_mut()
                                .context("attention layer without KV cache")?,
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                ops::attention_batch(c, a, &xn, &mut caches)
            }
            Mixer::DeltaNet(d) => {
                let mut states = seqs
                    .iter_mut()
                    .map(|(st, tokens)| {
                        let state = st.deltanet[i]
                            .as_mut()
                            .context("DeltaNet layer without state")?;
                        Ok((state, tokens.len()))
                    })
                    .collect::<Result<Vec<_>>>()?;
                ops::deltanet_batch(c, d, &xn, &mut states)
            }
        };
        x.iter_mut().zip(&mixed).for_each(|(a, b)| *a += b);
        let xn = ops::rms_norm(&x, &layer.post_norm, c.rms_eps);
        let moe = ops::moe(c, &layer.moe, &xn);
        x.iter_mut().zip(&moe).for_each(|(a, b)| *a += b);
    }
    // §2.7 final norm + LM head, on the rows whose logits are wanted.
    let mut rows = Vec::new();
    let mut row0 = 0;
    for (st, tokens) in seqs.iter_mut() {
        st.pos += tokens.len();
        let end = row0 + tokens.len();
        let first = if all_logits { row0 } else { end - 1 };
        rows.extend_from_slice(&x[first * h..end * h]);
        row0 = end;
    }
    let hn = ops::rms_norm(&rows, &w.final_norm, c.rms_eps);
    let logits = linear::matmul(&w.lm_head, &hn);
    let mut row_end = 0;
    for (st, tokens) in seqs.iter_mut() {
        row_end += if all_logits { tokens.len() } else { 1 };
        st.logits = Some(logits[(row_end - 1) * c.vocab..row_end * c.vocab].to_vec());
    }
    Ok(logits)
}

impl Backend for CpuBackend {
    fn config(&self) -> &ModelConfig {
        &self.weights.config
    }

    fn describe(&self) -> String {
        let kv = match self.kv_format {
            KvFormat::Full => "",
            KvFormat::Bf16 => ", bf16 KV cache",
            KvFormat::Int8Row => ", int8-row KV cache",
        };
        format!("cpu ({} threads{kv})", rayon::current_num_threads())
    }

    fn kv_format(&self) -> KvFormat {
        self.kv_format
    }

    fn new_seq(&mut self, max_ctx: usize) -> Result<SeqId> {
        let c = &self.weights.config;
        let kv = c
            .layers
            .iter()
            .map(|k| {
                (*k == crate::config::LayerKind::Attention).then(|| KvCache {
                    format: self.kv_format,
                    ..KvCache::default()
                })
            })
            .collect();
        let deltanet = c
            .layers
            .iter()
            .map(|k| (*k == crate::config::LayerKind::DeltaNet).then(|| DeltaNetState::new(c)))
            .collect();
        let id = self.next_id;
        self.next_id += 1;
        self.seqs.insert(
            id,
            SeqState {
                max_ctx,
                pos: 0,
                kv,
                deltanet,
                logits: None,
            },
        );
        Ok(SeqId(id))
    }

    fn free_seq(&mut self, seq: SeqId) {
        self.seqs.remove(&seq.0);
        self.snapshots.retain(|_, s| s.seq != seq.0);
    }

    fn seq_len(&self, seq: SeqId) -> Result<usize> {
        Ok(self
            .seqs
            .get(&seq.0)
            .with_context(|| format!("unknown sequence {}", seq.0))?
            .pos)
    }

    fn prefill(&mut self, seq: SeqId, tokens: &[u32]) -> Result<()> {
        let chunk = self.prefill_chunk;
        let weights = self.weights.clone();
        let st = self.seq_mut(seq)?;
        for part in tokens.chunks(chunk) {
            forward(&weights, st, part, false)?;
        }
        Ok(())
    }

    fn prefill_chunk(&self) -> usize {
        self.prefill_chunk
    }

    fn prefill_all_logits(&mut self, seq: SeqId, tokens: &[u32]) -> Result<Vec<f32>> {
        let chunk = self.prefill_chunk;
        let weights = self.weights.clone();
        let st = self.seq_mut(seq)?;
        let mut all = Vec::with_capacity(tokens.len() * weights.config.vocab);
        for part in tokens.chunks(chunk) {
            all.extend(forward(&weights, st, part, true)?);
        }
        Ok(all)
    }

    fn logits(&mut self, seq: SeqId) -> Result<Vec<f32>> {
        self.seq_mut(seq)?
            .logits
            .clone()
            .context("the sequence has no logits yet: prefill first")
    }

    fn decode(
        &mut self,
        seq: SeqId,
        sampler: &mut Sampler,
        n: usize,
        top_logprobs: usize,
        on_token: &mut dyn FnMut(&StepOut) -> Flow,
    ) -> Result<()> {
        let weights = self.weights.clone();
        let st = self.seq_mut(seq)?;
        for i in 0..n {
            let logits = st
                .logits
                .as_ref()
                .context("decode before prefill: no logits to sample from")?;
            let token = sampler.sample(logits);
            sampler.accept(token);
            let (logprob, top) = token_logprob(logits, token, top_logprobs);
            if on_token(&StepOut {
                token,
                logprob,
                top,
            }) == Flow::Stop
                || i + 1 == n
            {
                break;
            }
            forward(&weights, st, &[token], false)?;
        }
        Ok(())
    }

    /// Samples every row, then feeds the continuing rows' tokens in one batched pass
    /// (`forward_batch`): the logits each sequence gets are those `decode` would give it.
    fn decode_step(
        &mut self,
        rows: &mut [DecodeRow<'_>],
        on_token: &mut dyn FnMut(usize, &StepOut) -> Flow,
    ) -> Result<()> {
        let mut feed: Vec<(u64, u32)> = Vec::with_capacity(rows.len());
        for (i, row) in rows.iter_mut().enumerate() {
            let st = self
                .seqs
                .get(&row.seq.0)
                .with_context(|| format!("unknown sequence {}", row.seq.0))?;
            let logits = st
                .logits
                .as_ref()
                .context("decode before prefill: no logits to sample from")?;
            let token = row.sampler.sample(logits);
            row.sampler.accept(token);
            let (logprob, top) = token_logprob(logits, token, row.top_logprobs);
            let step = StepOut {
                token,
                logprob,
                top,
            };
            if on_token(i, &step) == Flow::Continue && row.feed {
                if feed.iter().any(|&(id, _)| id == row.seq.0) {
                    bail!("sequence {} appears twice in one decode step", row.seq.0);
                }
                feed.push((row.seq.0, token));
            }
        }
        if feed.is_empty() {
            return Ok(());
        }
        // Taken out of the map for the pass (disjoint mutable borrows), put back whatever happens.
        let mut states: Vec<(u64, SeqState, [u32; 1])> = feed
            .iter()
            .filter_map(|&(id, token)| self.seqs.remove(&id).map(|st| (id, st, [token])))
            .collect();
        let mut batch: Vec<(&mut SeqState, &[u32])> = states
            .iter_mut()
            .map(|(_, st, token)| (st, &token[..]))
            .collect();
        let result = forward_batch(&self.weights, &mut batch, false);
        drop(batch);
        self.seqs
            .extend(states.into_iter().map(|(id, st, _)| (id, st)));
        result.map(|_| ())
    }

    fn snapshot(&mut self, seq: SeqId) -> Result<SnapshotId> {
        let st = self.seq_mut(seq)?;
        let snap = Snapshot {
            seq: seq.0,
            pos: st.pos,
            deltanet: st.deltanet.clone(),
            logits: st.logits.clone(),
        };
        let id = self.next_id;
        self.next_id += 1;
        self.snapshots.insert(id, snap);
        Ok(SnapshotId(id))
    }

    fn restore(&mut self, seq: SeqId, snap: SnapshotId) -> Result<()> {
        let saved = self
            .snapshots
            .get(&snap.0)
            .with_context(|| format!("unknown snapshot {}", snap.0))?
            .clone();
        let row = self.weights.config.n_kv_heads * self.weights.config.head_dim;
        let keep = saved.pos * row;
        if saved.seq == seq.0 {
            // Rewind: the rows past the snapshot will be overwritten, so the longer snapshots of
            // this sequence are gone.
            self.snapshots
                .retain(|_, s| s.seq != seq.0 || s.pos <= saved.pos);
        } else {
            // Fork: copy the KV prefix the snapshot shares with its own sequence.
            let source = self
                .seqs
                .get(&saved.seq)
                .with_context(|| format!("snapshot {} outlived its sequence", snap.0))?;
            let kv: Vec<Option<KvCache>> = source
                .kv
                .iter()
                .map(|c| {
                    c.as_ref().map(|c| KvCache {
                        k: c.k[..keep].to_vec(),
                        v: c.v[..keep].to_vec(),
                        format: c.format,
                    })
                })
                .collect();
            self.seq_mut(seq)?.kv = kv;
        }
        let st = self.seq_mut(seq)?;
        if saved.pos > st.max_ctx {
            bail!(
                "a snapshot of {} tokens does not fit a sequence of context {}",
                saved.pos,
                st.max_ctx
            );
        }
        for c in st.kv.iter_mut().flatten() {
            c.k.truncate(keep);
            c.v.truncate(keep);
        }
        st.pos = saved.pos;
        st.deltanet = saved.deltanet;
        st.logits = saved.logits;
        Ok(())
    }

    fn drop_snapshot(&mut self, snap: SnapshotId) {
        self.snapshots.remove(&snap.0);
    }

    fn seq_bytes(&self, seq: SeqId) -> usize {
        let Some(st) = self.seqs.get(&seq.0) else {
            return 0;
        };
        let kv: usize = st.kv.iter().flatten().map(|c| c.k.len() + c.v.len()).sum();
        (kv + deltanet_floats(&st.deltanet)) * 4
    }

    fn snapshot_bytes(&self, snap: SnapshotId) -> usize {
        self.snapshots.get(&snap.0).map_or(0, Snapshot::bytes)
    }
}
