//! One chunk of tokens through the whole model on the GPU, step for step as the CPU reference
//! (lily-core/src/cpu/mod.rs `forward`, MODEL.md §2): embedding, per layer RMSNorm → gated
//! attention or Gated DeltaNet → residual, RMSNorm → MoE → residual, final norm, lm_head.
//! Activations between kernels are f32, or f16 where the plan says (`Plan::act_f16`: `Scratch`'s
//! buffers but the residual stream, logits and router logits); every dispatch of the chunk goes
//! into one submission.

use anyhow::{bail, Result};
use lily_core::config::{LayerKind, ModelConfig};

use crate::gpu::{grid_2d, Gpu, Prepared, Recorder};
use crate::kernels::Kernels;
use crate::plan::{
    row_words, DeltaNetPath, ExpertsDown, ExpertsUp, LinearKernel, MmTile, Plan, PrefillAttention,
    SplitRule, LINEAR_ROWS,
};
use crate::weights::{
    Fused, GpuAttention, GpuDeltaNet, GpuLinear, GpuMixer, GpuModel, GpuMoe, Slice,
};

type Buf = wgpu::Buffer;

/// Most workgroups of argmax_part.wgsl.
const ARGMAX_PARTS: usize = 1024;

/// Rows of attention's partials, (query head, token) × splits (the buffer; each rule's
/// `part_rows` at most).
pub const PART_ROWS: usize = 4096;
/// Most splits per (head, token): attend_merge.wgsl's `SMAX` (each rule's `max_splits` at most).
pub const MERGE_MAX_SPLITS: usize = 256;

/// How attention splits the keys of `groups` workgroups' worth of (head or KV head, token)
/// pairs, `rows` (query head, token) rows of partials per split, whose longest causal range is
/// `n_max` keys, under `rule` (the plan's `splits`): (splits, keys per split, a multiple of the
/// rule's granule). Enough splits for the rule's workgroups, each at least a granule; one split
/// where the pairs alone are half as many.
pub fn attention_splits(
    rule: &SplitRule,
    groups: usize,
    rows: usize,
    n_max: usize,
) -> (usize, usize) {
    let want = if 2 * groups >= rule.workgroups {
        1
    } else {
        (rule.workgroups / groups.max(1)).max(1)
    };
    let nsplit = want
        .min(rule.part_rows.min(PART_ROWS) / rows.max(1))
        .min(n_max.div_ceil(rule.granule))
        .clamp(1, rule.max_splits.min(MERGE_MAX_SPLITS));
    let span = n_max.div_ceil(nsplit).div_ceil(rule.granule) * rule.granule;
    (n_max.div_ceil(span), span)
}

/// The row kernels' parameters (linear_q4_rows.wgsl, linear_q4_glu_rows.wgsl): common.wgsl's
/// `Mat`, then from word 20 whether to normalise the input first (`Io::norm`) and the norm's eps.
fn norm_params(params: &[u32; 23], io: &Io, eps: f32) -> [u32; 22] {
    let mut out = [0u32; 22];
    out[..MAT_WORDS].copy_from_slice(&params[..MAT_WORDS]);
    out[20] = io.norm.is_some() as u32;
    out[21] = eps.to_bits();
    out
}

/// linear_q4_rows.wgsl's parameters: `norm_params`, then from word 22 the DeltaNet conv it runs on
/// its first rows (channels, taps; `Io::conv`) or 0.
fn rows_params(norm: &[u32; 22], conv: Option<(usize, usize)>) -> [u32; 24] {
    let mut out = [0u32; 24];
    out[..22].copy_from_slice(norm);
    if let Some((channels, k)) = conv {
        out[22] = channels as u32;
        out[23] = k as u32;
    }
    out
}

/// A MoE block's routing done inside linear_q4_glu_rows.wgsl (`Plan::routes_in_glu`): E routed
/// experts, k picked a token, the router output's row stride, items a token.
#[derive(Clone, Copy, Debug)]
struct Route {
    e: usize,
    k: usize,
    stride: usize,
    ks: usize,
}

/// linear_q4_glu_rows.wgsl's parameters: `norm_params`, then from word 22 its routing (`route`
/// 1, E, k, the logits' row stride, items a token) or 0 (ids read from the ids buffer).
fn glu_rows_params(norm: &[u32; 22], route: Option<Route>) -> [u32; 27] {
    let mut out = [0u32; 27];
    out[..22].copy_from_slice(norm);
    if let Some(rt) = route {
        out[22] = 1;
        out[23] = rt.e as u32;
        out[24] = rt.k as u32;
        out[25] = rt.stride as u32;
        out[26] = rt.ks as u32;
    }
    out
}

/// Words of common.wgsl's `Mat`; a kernel's own parameters start at word 20 (a struct member of
/// a uniform takes a multiple of 16 bytes).
pub const MAT_WORDS: usize = 18;

/// The parameters of linear.wgsl, linear_q4.wgsl (common.wgsl's `Mat`) and linear_q4_mm.wgsl
/// (`Mat`, then from word 20 the items, and where its tile list and sorted items start).
#[allow(clippy::too_many_arguments)]
fn linear_params(
    w: &GpuLinear,
    sl: &Slice,
    io: &Io,
    rows: usize,
    row0: usize,
    experts: Option<usize>,
    e0: usize,
    e_count: usize,
    nx: u32,
    tiles_at: usize,
    order_at: usize,
) -> [u32; 23] {
    [
        rows as u32,
        w.cols as u32,
        w.bits,
        w.group as u32,
        row0 as u32,
        io.x_stride as u32,
        io.x_off as u32,
        io.y_stride as u32,
        io.y_off as u32,
        sl.scale_off,
        sl.bias_off,
        experts.is_some() as u32,
        e0 as u32,
        e_count as u32,
        experts.unwrap_or(1) as u32,
        w.mat_words as u32,
        nx,
        io.accumulate as u32,
        0,
        0,
        io.items as u32,
        tiles_at as u32,
        order_at as u32,
    ]
}

/// Activation buffers for chunks of up to `chunk` tokens, shared by all sequences. `x` (the
/// residual stream), the router's logits, routing, attention's partials, the rope table and the
/// logits are f32 (`holds_f32`); the others hold `ACT` (f16 where `Plan::act_f16`).
pub struct Scratch {
    pub chunk: usize,
    /// Rows of `all_logits`: the most positions whose logits one pass keeps.
    pub all_chunk: usize,
    x: Buf,
    xn: Buf,
    // Gated attention: the joint q | k | v projection per token, the normalised queries.
    attn_proj: Buf,
    q: Buf,
    o: Buf,
    /// attend.wgsl's partials when the keys are split: `PART_ROWS` rows of (head_dim + 2).
    attn_part: Buf,
    // Gated DeltaNet: the joint qkv | z | b | a projection per token, the conv output, q | k.
    dn_proj: Buf,
    c: Buf,
    qk: Buf,
    odn: Buf,
    ogn: Buf,
    // MoE.
    router_logits: Buf,
    ids: Buf,
    wts: Buf,
    /// moe_group.wgsl's output: indirect dispatch arguments, a tile list per tile size (room
    /// for `tile_cap` tiles each), items by expert.
    groups: Buf,
    tiles_at: usize,
    tile_cap: usize,
    order_at: usize,
    g: Buf,
    u: Buf,
    act: Buf,
    ye: Buf,
    sg: Buf,
    su: Buf,
    sa: Buf,
    sh: Buf,
    /// cos | sin of the chunk's positions, `[t, rotary_dim]`.
    rope: Buf,
    /// argmax_part.wgsl's partials, 4 floats each.
    argmax_parts: Buf,
    /// The prompt chunk's ids (u32).
    pub tokens: Buf,
    pub all_logits: Buf,
}

impl Scratch {
    /// Whether `b` is one of the f32 buffers (the products' `Form`: what they read and write),
    /// not an activation.
    fn holds_f32(&self, b: &Buf) -> bool {
        [&self.x, &self.router_logits, &self.all_logits].contains(&b)
    }

    /// moe_group.wgsl's tile lists: one per tile size (at most 3: 64, 32, 16), each with room
    /// for a chunk's items in tiles of 16 (the smallest, the most tiles). `act_f16`: the
    /// activations in f16 (`Plan::act_f16`).
    pub fn new(
        gpu: &Gpu,
        c: &ModelConfig,
        chunk: usize,
        all_chunk: usize,
        act_f16: bool,
    ) -> Result<Scratch> {
        // Items per token: the top_k routed experts and, where it rides in their stacks, the
        // shared expert (sized for it either way).
        let ks = c.top_k + 1;
        if chunk == 0 || chunk * ks > 65_535 {
            bail!("prefill chunk {chunk} must be in 1..={}", 65_535 / ks);
        }
        let f = |label: &str, n: usize| gpu.storage(label, n as u64 * 4);
        // An activation of n elements (whole 16 bytes: an f16 buffer may end mid-word).
        let a = |label: &str, n: usize| {
            gpu.storage(label, (n as u64 * act_bytes(act_f16)).div_ceil(16) * 16)
        };
        let t = chunk;
        let (h, tk) = (c.hidden, t * ks);
        // Three sizes' indirect arguments (8 words each), then their lists.
        let tiles_at = 24;
        let tile_cap = tk.div_ceil(MmTile::T16.items()) + c.n_experts + 1;
        let order_at = tiles_at + 4 * tile_cap * 3;
        Ok(Scratch {
            chunk,
            all_chunk,
            x: f("x", t * h)?,
            xn: a("xn", t * h)?,
            attn_proj: a(
                "attn_proj",
                t * (c.n_heads * 2 + c.n_kv_heads * 2) * c.head_dim,
            )?,
            q: a("q", t * c.n_heads * c.head_dim)?,
            o: a("o", t * c.n_heads * c.head_dim)?,
            attn_part: f("attention_partials", PART_ROWS * (c.head_dim + 2))?,
            dn_proj: a(
                "dn_proj",
                t * (c.conv_dim() + c.dn_v_heads * c.dn_v_dim + 2 * c.dn_v_heads),
            )?,
            c: a("conv_out", t * c.conv_dim())?,
            qk: a("qk", t * 2 * c.dn_key_dim())?,
            odn: a("deltanet_out", t * c.dn_v_heads * c.dn_v_dim)?,
            ogn: a("deltanet_normed", t * c.dn_v_heads * c.dn_v_dim)?,
            router_logits: f("router_logits", t * (c.n_experts + 1))?,
            ids: f("expert_ids", tk)?,
            wts: f("expert_weights", tk)?,
            groups: gpu.storage_indirect("expert_groups", (order_at + tk) as u64 * 4)?,
            tiles_at,
            tile_cap,
            order_at,
            g: a("expert_gate", tk * c.expert_inter)?,
            u: a("expert_up", tk * c.expert_inter)?,
            act: a("expert_act", tk * c.expert_inter)?,
            ye: a("expert_out", tk * h)?,
            sg: a("shared_gate", t * c.shared_inter)?,
            su: a("shared_up", t * c.shared_inter)?,
            sa: a("shared_act", t * c.shared_inter)?,
            sh: a("shared_out", t * h)?,
            rope: f("rope", t * c.rotary_dim)?,
            tokens: f("tokens", t)?,
            argmax_parts: f("argmax_parts", 4 * ARGMAX_PARTS)?,
            all_logits: f("all_logits", all_chunk * c.vocab)?,
        })
    }
}

/// Everything one sequence carries between steps, on the device.
pub struct SeqState {
    pub max_ctx: usize,
    pub len: usize,
    /// Per layer: post-norm, post-RoPE K and V `[max_ctx, Hkv, D]` for attention layers.
    pub kv: Vec<Option<(Buf, Buf)>>,
    /// Per layer: recurrent state `[Hv, dk, dv]` and conv state `[K−1, conv_dim]` for DeltaNet.
    pub dn: Vec<Option<(Buf, Buf)>>,
    /// Logits of the last token fed.
    pub logits: Buf,
    /// [token id, log-probability bits]: what the sampler chose; the next step embeds it.
    pub next: Buf,
}

impl SeqState {
    /// `kv_f16`: the KV cache in f16 (the plan's `kv_f16`), else f32.
    pub fn new(gpu: &Gpu, c: &ModelConfig, max_ctx: usize, kv_f16: bool) -> Result<SeqState> {
        let kv_bytes = max_ctx as u64 * kv_row_bytes(c, kv_f16);
        let mut kv = Vec::new();
        let mut dn = Vec::new();
        for (i, kind) in c.layers.iter().enumerate() {
            match kind {
                LayerKind::Attention => {
                    kv.push(Some((
                        gpu.storage(&format!("k_cache.{i}"), kv_bytes)?,
                        gpu.storage(&format!("v_cache.{i}"), kv_bytes)?,
                    )));
                    dn.push(None);
                }
                LayerKind::DeltaNet => {
                    kv.push(None);
                    dn.push(Some((
                        gpu.storage(&format!("state.{i}"), state_bytes(c))?,
                        gpu.storage(&format!("conv_state.{i}"), conv_bytes(c))?,
                    )));
                }
            }
        }
        Ok(SeqState {
            max_ctx,
            len: 0,
            kv,
            dn,
            logits: gpu.storage("logits", c.vocab as u64 * 4)?,
            next: gpu.storage("next_token", 8)?,
        })
    }
}

/// Bytes of one activation element: f16 or f32.
pub fn act_bytes(act_f16: bool) -> u64 {
    if act_f16 {
        2
    } else {
        4
    }
}

pub fn state_bytes(c: &ModelConfig) -> u64 {
    (c.dn_v_heads * c.dn_k_dim * c.dn_v_dim * 4) as u64
}

pub fn conv_bytes(c: &ModelConfig) -> u64 {
    ((c.conv_kernel - 1) * c.conv_dim() * 4) as u64
}

/// Bytes of one position's K (or V) in the cache: f16 or f32 elements.
pub fn kv_row_bytes(c: &ModelConfig, kv_f16: bool) -> u64 {
    (c.n_kv_heads * c.head_dim * if kv_f16 { 2 } else { 4 }) as u64
}

/// Byte offset of u_hi, u_lo in sample_pick.wgsl's parameters.
const PICK_U_BYTE: u64 = 20;

/// The uniform's halves as sample_pick.wgsl takes them.
pub fn uniform_words(u: f64) -> [u32; 2] {
    let hi = u as f32;
    let lo = (u - hi as f64) as f32;
    [hi.to_bits(), lo.to_bits()]
}

/// Most candidates sample_pick.wgsl keeps (its workgroup size): top_k above stays on the host.
pub const PICK_MAX_K: u32 = 256;

/// Bits of a `DevicePick::hist` entry: times generated, and seen by the repetition penalty
/// (lily-core's `Sampler::device_history` layout).
pub use lily_core::sampling::{HISTORY_COUNT as HIST_COUNT, HISTORY_SEEN as HIST_SEEN};

/// The device sampler of one decode call (sample_adjust.wgsl, sample_pick.wgsl): the
/// `Sampler`'s parameters, its history and logit_bias on the device, scratch for the adjusted
/// logits. The kernels bump `hist` after each pick as `Sampler::accept` does.
pub struct DevicePick {
    pub hist: Buf,
    /// (id, value bits) pairs sorted by id, stably.
    pub bias: Buf,
    pub n_bias: u32,
    pub scaled: Buf,
    /// sample_prefilter.wgsl's output: each range's top k (value bits, id), its (max, sum).
    pub cand: Buf,
    pub parts: Buf,
    pub inv_t: f32,
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    pub repetition: f32,
    pub presence: f32,
    pub frequency: f32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsOut {
    /// Only the last token's logits, into the sequence's `logits`.
    Last,
    /// Every token's, into `Scratch::all_logits` (the last row also into `logits`).
    All,
}

/// Where a matrix-vector product reads and writes, in elements.
#[derive(Clone, Copy)]
struct Io<'b> {
    x: &'b Buf,
    x_off: usize,
    x_stride: usize,
    y: &'b Buf,
    y_off: usize,
    y_stride: usize,
    items: usize,
    accumulate: bool,
    /// `y` is an f32 buffer outside the scratch (the sequence's logits); the scratch's f32
    /// buffers say so themselves (`Scratch::holds_f32`, `Forward::form`).
    y_f32: bool,
    /// Where set, `x` is the residual stream and the kernel applies RMSNorm with this weight
    /// first (decode's norms folded into linear_q4_rows / linear_q4_glu_rows: no rms_norm
    /// dispatch; `Forward::fold_*`).
    norm: Option<&'b Buf>,
    /// Where set, output rows below `channels` are DeltaNet conv channels: linear_q4_rows runs
    /// their causal conv too (decode, `DeltaNetPath::StepConvInRows`).
    conv: Option<ConvIo<'b>>,
}

/// A DeltaNet conv run inside the in_proj product: its taps `[channels, k]` and state
/// `[k − 1, channels]`.
#[derive(Clone, Copy)]
struct ConvIo<'b> {
    taps: &'b Buf,
    state: &'b Buf,
    channels: usize,
    k: usize,
}

impl Io<'_> {
    /// Whether the input rows lie on 16-byte boundaries (the vec4 kernels' reads).
    fn aligned(&self) -> bool {
        self.x_off.is_multiple_of(4) && self.x_stride.is_multiple_of(4)
    }

    /// Added into `y` (the residual stream).
    fn into_residual(mut self) -> Self {
        self.accumulate = true;
        self
    }
}

pub struct Forward<'a> {
    pub gpu: &'a Gpu,
    pub plan: &'a Plan,
    pub k: &'a Kernels,
    pub model: &'a GpuModel,
    pub s: &'a Scratch,
    pub cfg: &'a ModelConfig,
}

impl<'a> Forward<'a> {
    /// `t` tokens whose ids are in `ids` (the prompt chunk in `Scratch::tokens`, or the
    /// sequence's `next`) at positions `seq.len..`. The caller advances `seq.len`.
    pub fn run(&self, seq: &'a SeqState, ids: &'a Buf, t: usize, out: LogitsOut) -> Result<()> {
        let r = self.record(seq, ids, t, out)?;
        r.submit()
    }

    /// `run`, then the greedy pick of the new logits into `seq.next`, in the same submission
    /// (a greedy decode step: the next step embeds that token straight from `next`).
    pub fn run_and_pick(&self, seq: &'a SeqState, ids: &'a Buf) -> Result<()> {
        let mut r = self.record(seq, ids, 1, LogitsOut::Last)?;
        self.record_argmax(&mut r, seq);
        r.submit()
    }

    /// A greedy decode step made ready but not submitted: the forward pass of `ids` (the token
    /// `seq.next` holds), the pick into `next`, and a copy of `next` into `readback`. Encoding
    /// it while the GPU still runs the previous step takes the host's share off the critical
    /// path; the caller submits it once it knows the step is wanted.
    pub fn prepare_step(
        &self,
        seq: &'a SeqState,
        ids: &'a Buf,
        readback: &'a Buf,
    ) -> Result<Prepared<'a>> {
        let mut r = self.record(seq, ids, 1, LogitsOut::Last)?;
        self.record_argmax(&mut r, seq);
        r.copy(&seq.next, 0, readback, 0, 8);
        r.prepare()
    }

    /// `prepare_step` with the device sampler's pick instead of the argmax; its uniform is set
    /// when the step is submitted (`Prepared::submit_with_uniform`), once the host knows the
    /// step runs (so the sampler draws exactly when the host path would).
    pub fn prepare_sample_step(
        &self,
        seq: &'a SeqState,
        ids: &'a Buf,
        d: &'a DevicePick,
        readback: &'a Buf,
    ) -> Result<Prepared<'a>> {
        let mut r = self.record(seq, ids, 1, LogitsOut::Last)?;
        self.record_sample(&mut r, &seq.logits, &seq.next, d, 0.0);
        let at = r.last_param_offset().expect("sample_pick was recorded") + PICK_U_BYTE;
        r.copy(&seq.next, 0, readback, 0, 8);
        let mut p = r.prepare()?;
        p.set_uniform_at(at);
        Ok(p)
    }

    /// The device sampler's pick of the pending logits into `seq.next`, copied into
    /// `readback`.
    pub fn sample_into(
        &self,
        seq: &'a SeqState,
        d: &'a DevicePick,
        u: f64,
        readback: &'a Buf,
    ) -> Result<()> {
        let mut r = Recorder::new(self.gpu);
        r.set_phase("pick", 0);
        self.record_sample(&mut r, &seq.logits, &seq.next, d, u);
        r.copy(&seq.next, 0, readback, 0, 8);
        r.submit()
    }

    /// The greedy pick of the pending logits into `seq.next`, copied into `readback`.
    pub fn argmax_into(&self, seq: &'a SeqState, readback: &'a Buf) -> Result<()> {
        let mut r = Recorder::new(self.gpu);
        r.set_phase("pick", 0);
        self.record_argmax(&mut r, seq);
        r.copy(&seq.next, 0, readback, 0, 8);
        r.submit()
    }

    fn record(
        &self,
        seq: &'a SeqState,
        ids: &'a Buf,
        t: usize,
        out: LogitsOut,
    ) -> Result<Recorder<'a>> {
        let c = self.cfg;
        let s = self.s;
        if t == 0 || t > s.chunk || (out == LogitsOut::All && t > s.all_chunk) {
            bail!("a forward pass of {t} tokens does not fit the scratch buffers");
        }
        if seq.len + t > seq.max_ctx {
            bail!(
                "sequence would hold {} tokens, more than its context of {}",
                seq.len + t,
                seq.max_ctx
            );
        }
        self.write_rope(seq.len, t);
        let mut r = Recorder::new(self.gpu);
        r.set_phase(if t == 1 { "decode" } else { "prefill" }, t);
        self.embed(&mut r, ids, t);
        let h = c.hidden;
        for (i, layer) in self.model.layers.iter().enumerate() {
            // Decode: the norms folded into the row kernels that read them, where all do.
            let fold_in = self.plan.folds_norm(
                match &layer.mixer {
                    GpuMixer::Attention(a) => &a.qkv,
                    GpuMixer::DeltaNet(d) => &d.in_proj,
                },
                t,
            );
            let norm_in = fold_in.then_some(&layer.input_norm);
            if !fold_in {
                self.rms_norm(&mut r, &s.x, &layer.input_norm, &s.xn, 0, t);
            }
            match &layer.mixer {
                GpuMixer::Attention(a) => {
                    let (kc, vc) = seq.kv[i].as_ref().expect("attention layer has a KV cache");
                    self.attention(&mut r, a, kc, vc, seq.len, t, norm_in);
                }
                GpuMixer::DeltaNet(d) => {
                    let (st, conv) = seq.dn[i].as_ref().expect("DeltaNet layer has state");
                    self.deltanet(&mut r, d, st, conv, t, norm_in);
                }
            }
            let fold_post = self.plan.folds_moe_norm(&layer.moe, t);
            if !fold_post {
                self.rms_norm(&mut r, &s.x, &layer.post_norm, &s.xn, 0, t);
            }
            self.moe(&mut r, &layer.moe, t, fold_post.then_some(&layer.post_norm));
        }
        // §2.7 final norm + LM head.
        let v = c.vocab;
        match out {
            LogitsOut::Last => {
                let lm = &self.model.lm_head;
                let mut io = self.plain(&s.x, h, &seq.logits, v, 1);
                // The sequence's logits (f32).
                io.y_f32 = true;
                if self.plan.folds_final_norm(lm, t) {
                    io.norm = Some(&self.model.final_norm);
                } else {
                    self.rms_norm(&mut r, &s.x, &self.model.final_norm, &s.xn, t - 1, 1);
                    io.x = &s.xn;
                }
                self.linear(&mut r, "lin.lm_head", lm, io);
            }
            LogitsOut::All => {
                self.rms_norm(&mut r, &s.x, &self.model.final_norm, &s.xn, 0, t);
                let io = self.plain(&s.xn, h, &s.all_logits, v, t);
                self.linear(&mut r, "lin.lm_head", &self.model.lm_head, io);
                r.copy(
                    &s.all_logits,
                    ((t - 1) * v * 4) as u64,
                    &seq.logits,
                    0,
                    (v * 4) as u64,
                );
            }
        }
        Ok(r)
    }

    /// `run` of one token, then the device sampler's pick of the new logits into `seq.next`, in
    /// the same submission.
    pub fn run_and_sample(
        &self,
        seq: &'a SeqState,
        ids: &'a Buf,
        d: &'a DevicePick,
        u: f64,
    ) -> Result<()> {
        let mut r = self.record(seq, ids, 1, LogitsOut::Last)?;
        self.record_sample(&mut r, &seq.logits, &seq.next, d, u);
        r.submit()
    }

    /// The device sampler's pick from `logits` into `out` (token id, log-probability).
    pub fn sample(&self, logits: &'a Buf, out: &'a Buf, d: &'a DevicePick, u: f64) -> Result<()> {
        let mut r = Recorder::new(self.gpu);
        r.set_phase("pick", 0);
        self.record_sample(&mut r, logits, out, d, u);
        r.submit()
    }

    fn record_sample(
        &self,
        r: &mut Recorder<'a>,
        logits: &'a Buf,
        out: &'a Buf,
        d: &'a DevicePick,
        u: f64,
    ) {
        let v = self.cfg.vocab;
        let (nx, ny) = grid_2d(v.div_ceil(256));
        r.dispatch(
            &self.k.sample_adjust,
            &[
                v as u32,
                d.n_bias,
                d.inv_t.to_bits(),
                d.repetition.to_bits(),
                d.presence.to_bits(),
                d.frequency.to_bits(),
                nx,
            ],
            &[logits, &d.hist, &d.bias, &d.scaled],
            [nx, ny, 1],
        );
        // Each workgroup keeps its range's top k: the pick then looks at parts · k candidates.
        let span = v.div_ceil(v.div_ceil(1024));
        let parts = v.div_ceil(span);
        r.dispatch(
            &self.k.sample_prefilter,
            &[v as u32, d.top_k, span as u32],
            &[logits, &d.scaled, &d.cand, &d.parts],
            [parts as u32, 1, 1],
        );
        let [u_hi, u_lo] = uniform_words(u);
        r.dispatch(
            &self.k.sample_pick,
            &[
                (parts * d.top_k as usize) as u32,
                parts as u32,
                d.top_k,
                d.top_p.to_bits(),
                d.min_p.to_bits(),
                u_hi,
                u_lo,
                (d.repetition != 1.0) as u32,
            ],
            &[logits, &d.cand, &d.parts, &d.hist, out],
            [1, 1, 1],
        );
    }

    /// Greedy pick from the sequence's logits into its `next` (token id, log-probability).
    pub fn argmax(&self, seq: &'a SeqState) -> Result<()> {
        let mut r = Recorder::new(self.gpu);
        r.set_phase("pick", 0);
        self.record_argmax(&mut r, seq);
        r.submit()
    }

    /// argmax_part.wgsl over ranges of ≈ 1,024 logits (at most `ARGMAX_PARTS`), then
    /// argmax_final.wgsl.
    fn record_argmax(&self, r: &mut Recorder<'a>, seq: &'a SeqState) {
        let v = self.cfg.vocab;
        let parts = v.div_ceil(1024).clamp(1, ARGMAX_PARTS);
        let span = v.div_ceil(parts);
        let parts = v.div_ceil(span);
        r.dispatch(
            &self.k.argmax_part,
            &[v as u32, span as u32],
            &[&seq.logits, &self.s.argmax_parts],
            [parts as u32, 1, 1],
        );
        r.dispatch(
            &self.k.argmax_final,
            &[parts as u32],
            &[&self.s.argmax_parts, &seq.next],
            [1, 1, 1],
        );
    }

    /// cos/sin of every rotary frequency at positions pos0.., in f64 as the CPU's
    /// `rope_in_place` computes them.
    fn write_rope(&self, pos0: usize, t: usize) {
        let c = self.cfg;
        let half = c.rotary_dim / 2;
        let mut table = vec![0f32; t * c.rotary_dim];
        for ti in 0..t {
            let row = &mut table[ti * c.rotary_dim..(ti + 1) * c.rotary_dim];
            for i in 0..half {
                let inv_freq = 1.0 / c.rope_theta.powf(2.0 * i as f64 / c.rotary_dim as f64);
                let angle = (pos0 + ti) as f64 * inv_freq;
                row[i] = angle.cos() as f32;
                row[half + i] = angle.sin() as f32;
            }
        }
        if !table.is_empty() {
            self.gpu
                .queue
                .write_buffer(&self.s.rope, 0, bytemuck::cast_slice(&table));
        }
    }

    /// The form of the product `io` describes (`Plan::form`): whether it reads the residual
    /// stream (a folded norm), whether it writes an f32 buffer.
    fn form(&self, io: &Io) -> crate::shaders::Form {
        let s = self.s;
        self.plan
            .form(s.holds_f32(io.x), io.y_f32 || s.holds_f32(io.y))
    }

    fn plain<'b>(&self, x: &'b Buf, cols: usize, y: &'b Buf, rows: usize, t: usize) -> Io<'b> {
        Io {
            x,
            x_off: 0,
            x_stride: cols,
            y,
            y_off: 0,
            y_stride: rows,
            items: t,
            accumulate: false,
            y_f32: false,
            norm: None,
            conv: None,
        }
    }

    fn embed(&self, r: &mut Recorder<'a>, ids: &'a Buf, t: usize) {
        let e = &self.model.embed;
        for sl in &e.slices {
            r.dispatch(
                &self.k.embed,
                &[
                    e.cols as u32,
                    e.bits,
                    e.group as u32,
                    sl.first as u32,
                    sl.count as u32,
                    sl.scale_off,
                    sl.bias_off,
                    t as u32,
                ],
                &[&sl.buf, ids, &self.s.x],
                [e.cols.div_ceil(64) as u32, t as u32, 1],
            );
        }
    }

    /// Rows `r0..r0 + rows` of `x` normalised into rows `0..rows` of `y`.
    fn rms_norm(
        &self,
        r: &mut Recorder<'a>,
        x: &'a Buf,
        w: &'a Buf,
        y: &'a Buf,
        r0: usize,
        rows: usize,
    ) {
        r.dispatch(
            &self.k.rms_norm,
            &[
                self.cfg.hidden as u32,
                self.cfg.rms_eps.to_bits(),
                r0 as u32,
            ],
            &[x, w, y],
            [rows as u32, 1, 1],
        );
    }

    /// The parts of `f` into `y` (row stride `f.rows`), each at its column offset: one matrix
    /// product per part (one in all where the formats allowed joining them at load).
    /// `norm`: the parts read the residual stream and normalise it themselves (`Plan::folds_norm`).
    #[allow(clippy::too_many_arguments)]
    fn fused(
        &self,
        r: &mut Recorder<'a>,
        label: &'static str,
        f: &'a Fused,
        y: &'a Buf,
        t: usize,
        norm: Option<&'a Buf>,
        conv: Option<ConvIo<'a>>,
    ) {
        debug_assert!(conv.is_none() || f.parts.len() == 1);
        for (lin, off) in &f.parts {
            let x = if norm.is_some() {
                &self.s.x
            } else {
                &self.s.xn
            };
            let mut io = self.plain(x, self.cfg.hidden, y, f.rows, t);
            io.y_off = *off;
            io.norm = norm;
            io.conv = conv;
            self.linear(r, label, lin, io);
        }
    }

    /// `y = W x` for plain matrices, slice by slice.
    fn linear(&self, r: &mut Recorder<'a>, label: &'static str, w: &'a GpuLinear, io: Io<'a>) {
        self.linear_impl(r, label, w, io, None);
    }

    /// Routed experts: item i = (token i / x_div's row, expert `ids[i]`).
    fn linear_experts(
        &self,
        r: &mut Recorder<'a>,
        label: &'static str,
        w: &'a GpuLinear,
        io: Io<'a>,
        x_div: usize,
    ) {
        self.linear_impl(r, label, w, io, Some(x_div));
    }

    fn linear_impl(
        &self,
        r: &mut Recorder<'a>,
        label: &'static str,
        w: &'a GpuLinear,
        io: Io<'a>,
        experts: Option<usize>,
    ) {
        let choice = self
            .plan
            .linear(w, io.items, experts.is_some(), io.aligned());
        let form = self.form(&io);
        debug_assert!(
            (io.norm.is_none() && io.conv.is_none()) || choice == LinearKernel::Rows,
            "a folded norm or conv needs linear_q4_rows"
        );
        for sl in &w.slices {
            let (rows, row0, e0, e_count) = match experts {
                None => (sl.count, sl.first, 0, 0),
                Some(_) => (w.rows, 0, sl.first, sl.count),
            };
            let (kernel, per, z, fourth) = match choice {
                LinearKernel::Rows => {
                    // Inputs once per workgroup, rows streamed; the norm folded in where asked.
                    let rb = self.plan.rows_rb(sl.count, row_words(w));
                    let (nx, ny) = self.plan.rows_grid(rb, sl.count.div_ceil(rb));
                    let params =
                        linear_params(w, sl, &io, sl.count, sl.first, None, 0, 0, nx, 0, 0);
                    let params = rows_params(
                        &norm_params(&params, &io, self.cfg.rms_eps),
                        io.conv.map(|cv| (cv.channels, cv.k)),
                    );
                    r.dispatch_as(
                        label,
                        self.k.rows(rb).get(form),
                        &params,
                        &[
                            &sl.buf,
                            io.x,
                            io.y,
                            io.norm.unwrap_or(io.x),
                            io.conv.map_or(io.x, |cv| cv.taps),
                            io.conv.map_or(io.y, |cv| cv.state),
                        ],
                        [nx, ny, io.items as u32],
                    );
                    continue;
                }
                // Each weight read once per tile of tokens.
                LinearKernel::Mm(tile) => (
                    self.k.mm(tile).get(form),
                    self.k.mm(tile).get(form).rows,
                    io.items.div_ceil(tile.items()),
                    &self.s.groups,
                ),
                LinearKernel::Q4 => (
                    self.k.linear_q4.get(form),
                    LINEAR_ROWS,
                    io.items,
                    &self.s.ids,
                ),
                LinearKernel::Plain => {
                    (self.k.linear.get(form), LINEAR_ROWS, io.items, &self.s.ids)
                }
            };
            let (nx, ny) = grid_2d(rows.div_ceil(per));
            let params = linear_params(w, sl, &io, rows, row0, experts, e0, e_count, nx, 0, 0);
            r.dispatch_as(
                label,
                kernel,
                &params,
                &[&sl.buf, io.x, io.y, fourth],
                [nx, ny, z as u32],
            );
        }
    }

    /// `io.y = silu(gate x) ⊙ (up x)` in one dispatch (the plan's `ExpertsUp::GluRows`, else
    /// `Glu`): plain matrices (`experts` None) or routed experts (item i: token i / x_div,
    /// expert `ids[i]`).
    #[allow(clippy::too_many_arguments)]
    fn glu(
        &self,
        r: &mut Recorder<'a>,
        label: &'static str,
        gate: &'a GpuLinear,
        up: &'a GpuLinear,
        io: Io<'a>,
        experts: Option<usize>,
        how: ExpertsUp,
        route: Option<Route>,
        items: bool,
    ) {
        let (sg, su) = (&gate.slices[0], &up.slices[0]);
        let rows = gate.rows;
        // linear_q4_glu_rows.wgsl (input once per workgroup, 8 rows streamed) for 2,048
        // input columns, else linear_q4_glu.wgsl (8 rows a workgroup).
        let row_kernel = how == ExpertsUp::GluRows;
        let form = self.form(&io);
        let (kernel, per) = if row_kernel {
            (self.k.linear_q4_glu_rows.get(form), self.plan.glu_rb)
        } else {
            (&self.k.linear_q4_glu, LINEAR_ROWS)
        };
        debug_assert!(row_kernel || io.norm.is_none());
        // `items`: the routed experts in items' rounds (`Plan::glu_items`): a workgroup a row
        // and token.
        let (nx, ny, nz) = match (items, route) {
            (true, Some(rt)) => {
                let (nx, ny) = grid_2d(rows);
                (nx, ny, io.items / rt.ks)
            }
            _ => {
                let (nx, ny) = grid_2d(rows.div_ceil(per));
                (nx, ny, io.items)
            }
        };
        let e_count = if experts.is_some() { gate.experts } else { 0 };
        let params = linear_params(gate, sg, &io, rows, 0, experts, 0, e_count, nx, 0, 0);
        if row_kernel {
            let params = glu_rows_params(&norm_params(&params, &io, self.cfg.rms_eps), route);
            r.dispatch_as(
                label,
                kernel,
                &params,
                &[
                    &sg.buf,
                    io.x,
                    io.y,
                    &self.s.ids,
                    &su.buf,
                    io.norm.unwrap_or(io.x),
                    &self.s.router_logits,
                    &self.s.wts,
                ],
                [nx, ny, nz as u32],
            );
            return;
        }
        r.dispatch_as(
            label,
            kernel,
            &params,
            &[&sg.buf, io.x, io.y, &self.s.ids, &su.buf],
            [nx, ny, io.items as u32],
        );
    }

    /// Routed experts of a prefill chunk through linear_q4_mm.wgsl with tiles of `tile`: the
    /// tiles of that size moe_group.wgsl listed at word `list_at` of `Scratch::groups`,
    /// dispatched with the arguments it wrote at byte `args`.
    #[allow(clippy::too_many_arguments)]
    fn experts_mm(
        &self,
        r: &mut Recorder<'a>,
        label: &'static str,
        tile: MmTile,
        w: &'a GpuLinear,
        io: Io<'a>,
        x_div: usize,
        args: u64,
        list_at: usize,
    ) {
        let s = self.s;
        let kernel = self.k.experts_mm(tile).get(self.form(&io));
        let nx = w.rows.div_ceil(kernel.rows);
        for sl in &w.slices {
            let params = linear_params(
                w,
                sl,
                &io,
                w.rows,
                0,
                Some(x_div),
                sl.first,
                sl.count,
                nx as u32,
                list_at,
                s.order_at,
            );
            r.dispatch_indirect(
                label,
                kernel,
                &params,
                &[&sl.buf, io.x, io.y, &s.groups],
                &s.groups,
                args,
            );
        }
    }

    /// MODEL.md §2.4, with the output projection added into the residual.
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        r: &mut Recorder<'a>,
        a: &'a GpuAttention,
        kc: &'a Buf,
        vc: &'a Buf,
        pos0: usize,
        t: usize,
        norm: Option<&'a Buf>,
    ) {
        let c = self.cfg;
        let s = self.s;
        let (hq, hkv, d, h) = (c.n_heads, c.n_kv_heads, c.head_dim, c.hidden);
        let stride = a.qkv.rows;
        self.fused(r, "lin.attn.qkv", &a.qkv, &s.attn_proj, t, norm, None);
        let how = self.plan.attention(t);
        // Decode: attn_prep's work inside attend_gqa (`Plan::prep_in_attend`).
        let prep = self.plan.prep_in_attend(t);
        if !prep {
            r.dispatch(
                &self.k.attn_prep,
                &[
                    hq as u32,
                    hkv as u32,
                    d as u32,
                    c.rotary_dim as u32,
                    pos0 as u32,
                    c.rms_eps.to_bits(),
                    stride as u32,
                ],
                &[&s.attn_proj, &a.qk_norm, &s.rope, &s.q, kc, vc],
                [(hq + 2 * hkv) as u32, t as u32, 1],
            );
        }
        // attend_tile: a prefill chunk's tokens in tiles of 64 / G with the G query heads of a
        // KV head, no key splits.
        if let (PrefillAttention::Tile { g, .. }, Some(tile)) = (how, &self.k.attend_tile) {
            r.dispatch(
                tile,
                &[
                    hq as u32,
                    hkv as u32,
                    d as u32,
                    pos0 as u32,
                    (1.0 / (d as f32).sqrt()).to_bits(),
                    1,
                    0,
                    stride as u32,
                    t as u32,
                ],
                &[&s.q, &s.attn_proj, kc, vc, &s.o],
                [hkv as u32, t.div_ceil(64 / g) as u32, 1],
            );
            let io = self.plain(&s.o, hq * d, &s.x, h, t).into_residual();
            self.linear(r, "lin.attn.o", &a.o_proj, io);
            return;
        }
        // attend_gqa: the query heads of a KV head in one workgroup (K and V read once for
        // them), where the shapes allow; the same parameters, bindings and partials, and two
        // bindings more (the q/k norms and rope table of its `prep`).
        let bufs = [
            &s.q,
            &s.attn_proj,
            kc,
            vc,
            &s.o,
            &s.attn_part,
            &a.qk_norm,
            &s.rope,
        ];
        let (kernel, heads, bufs) = match how {
            PrefillAttention::Plain => (&self.k.attend, hq, &bufs[..6]),
            _ => (&self.k.attend_gqa, hkv, &bufs[..]),
        };
        let (nsplit, span) = attention_splits(&self.plan.splits(t), heads * t, hq * t, pos0 + t);
        r.dispatch(
            kernel,
            &[
                hq as u32,
                hkv as u32,
                d as u32,
                pos0 as u32,
                (1.0 / (d as f32).sqrt()).to_bits(),
                nsplit as u32,
                span as u32,
                stride as u32,
                prep as u32,
                c.rotary_dim as u32,
                c.rms_eps.to_bits(),
            ],
            bufs,
            [heads as u32, t as u32, nsplit as u32],
        );
        if nsplit > 1 {
            r.dispatch(
                &self.k.attend_merge,
                &[hq as u32, d as u32, nsplit as u32, stride as u32],
                &[&s.attn_part, &s.attn_proj, &s.o],
                [hq as u32, t as u32, d.div_ceil(64) as u32],
            );
        }
        let io = self.plain(&s.o, hq * d, &s.x, h, t).into_residual();
        self.linear(r, "lin.attn.o", &a.o_proj, io);
    }

    /// MODEL.md §2.5 (recurrent form over the chunk), output projection added into the residual.
    fn deltanet(
        &self,
        r: &mut Recorder<'a>,
        d: &'a GpuDeltaNet,
        state: &'a Buf,
        conv: &'a Buf,
        t: usize,
        norm: Option<&'a Buf>,
    ) {
        let c = self.cfg;
        let s = self.s;
        let (h, cd, hv, hk) = (c.hidden, c.conv_dim(), c.dn_v_heads, c.dn_k_heads);
        let vd = hv * c.dn_v_dim;
        // Joint output per token: [qkv (conv channels) | z | b | a].
        let stride = d.in_proj.rows;
        let path = self.plan.deltanet(c, t, &d.in_proj);
        // Decode: the conv inside the in_proj product where it runs on linear_q4_rows.
        let conv_in = (path == DeltaNetPath::StepConvInRows).then_some(ConvIo {
            taps: &d.conv,
            state: conv,
            channels: cd,
            k: c.conv_kernel,
        });
        self.fused(
            r,
            "lin.dn.in_proj",
            &d.in_proj,
            &s.dn_proj,
            t,
            norm,
            conv_in,
        );
        let (dk, dv) = (c.dn_k_dim, c.dn_v_dim);
        if path != DeltaNetPath::Chunk {
            // A decode step: the conv (in the product above, or a dispatch of its own), then
            // the q/k norms, recurrence and output norm in one dispatch.
            let conv_out = if path == DeltaNetPath::Step {
                r.dispatch(
                    &self.k.dn_conv_step,
                    &[cd as u32, c.conv_kernel as u32],
                    &[&s.dn_proj, &d.conv, conv, &s.c],
                    [cd.div_ceil(64) as u32, 1, 1],
                );
                &s.c
            } else {
                &s.dn_proj
            };
            r.dispatch(
                &self.k.dn_recur_norm,
                &[
                    1,
                    hv as u32,
                    hk as u32,
                    dk as u32,
                    dv as u32,
                    cd as u32,
                    stride as u32,
                    (cd + vd) as u32,
                    cd as u32,
                    c.rms_eps.to_bits(),
                    (1.0 / (dk as f32).sqrt()).to_bits(),
                ],
                &[conv_out, &s.dn_proj, &d.decay, state, &d.norm, &s.ogn],
                [hv as u32, 1, 1],
            );
        } else {
            // dn_conv.wgsl: a workgroup = 64 channels × 16 tokens.
            let (nx, ny) = grid_2d(cd.div_ceil(64));
            r.dispatch(
                &self.k.dn_conv,
                &[t as u32, cd as u32, c.conv_kernel as u32, stride as u32],
                &[&s.dn_proj, &d.conv, conv, &s.c],
                [nx, ny, t.div_ceil(16) as u32],
            );
            r.dispatch(
                &self.k.dn_qk_norm,
                &[
                    hk as u32,
                    c.dn_k_dim as u32,
                    cd as u32,
                    (1.0 / (c.dn_k_dim as f32).sqrt()).to_bits(),
                ],
                &[&s.c, &s.qk],
                [(2 * hk) as u32, t as u32, 1],
            );
            r.dispatch(
                &self.k.dn_recur,
                &[
                    t as u32,
                    hv as u32,
                    hk as u32,
                    c.dn_k_dim as u32,
                    c.dn_v_dim as u32,
                    cd as u32,
                    stride as u32,
                    (cd + vd) as u32,
                ],
                &[&s.c, &s.qk, &s.dn_proj, &d.decay, state, &s.odn],
                [hv as u32, c.dn_v_dim.div_ceil(32) as u32, 1],
            );
            let (nx, ny) = grid_2d(t * hv);
            r.dispatch(
                &self.k.gated_norm,
                &[
                    c.dn_v_dim as u32,
                    c.rms_eps.to_bits(),
                    (t * hv) as u32,
                    hv as u32,
                    stride as u32,
                    cd as u32,
                ],
                &[&s.odn, &d.norm, &s.dn_proj, &s.ogn],
                [nx, ny, 1],
            );
        }
        let io = self.plain(&s.ogn, vd, &s.x, h, t).into_residual();
        self.linear(r, "lin.dn.out", &d.out_proj, io);
    }

    /// MODEL.md §2.6: routed experts + gated shared expert, added into the residual. Where
    /// the shared expert rides in the routed stacks (expert E, `GpuMoe::shared` None), each
    /// token has k + 1 items, the last one expert E with weight sigmoid(shared gate logit), and
    /// the same dispatches serve both.
    /// `norm`: the router and the experts' GLU read the residual stream and normalise it
    /// themselves (`Plan::folds_moe_norm`).
    fn moe(&self, r: &mut Recorder<'a>, m: &'a GpuMoe, t: usize, norm: Option<&'a Buf>) {
        let c = self.cfg;
        let s = self.s;
        let (h, e, k, i, si) = (
            c.hidden,
            c.n_experts,
            c.top_k,
            c.expert_inter,
            c.shared_inter,
        );
        let stacked = m.shared.is_none();
        // Items per token.
        let ks = k + stacked as usize;
        // Per token: E router logits, then the shared expert's gate logit.
        let rs = m.router.rows;
        self.fused(r, "lin.router", &m.router, &s.router_logits, t, norm, None);
        // Decode: the routing inside the experts' GLU dispatch (`Plan::routes_in_glu`).
        let route = self.plan.routes_in_glu(m, t).then_some(Route {
            e,
            k,
            stride: rs,
            ks,
        });
        if route.is_none() {
            r.dispatch(
                &self.k.moe_route,
                &[
                    t as u32,
                    e as u32,
                    k as u32,
                    rs as u32,
                    ks as u32,
                    stacked as u32,
                ],
                &[&s.router_logits, &s.ids, &s.wts],
                [t as u32, 1, 1],
            );
        }
        let tk = t * ks;
        let gate_io = self.plain(&s.xn, h, &s.g, i, tk);
        let up_io = self.plain(&s.xn, h, &s.u, i, tk);
        let down_io = self.plain(&s.act, i, &s.ye, h, tk);
        match self.plan.experts_up(m, t) {
            ExpertsUp::Grouped(tile) => {
                // A prefill chunk: items grouped by expert on the GPU, each expert's weights read
                // once per tile of its tokens.
                // Each expert's tiles sized by its load: one list (and indirect dispatch) per
                // size.
                r.dispatch(
                    &self.k.moe_group,
                    &[
                        tk as u32,
                        (e + stacked as usize) as u32,
                        tile.down_to_16().len() as u32,
                        i.div_ceil(self.plan.expert_rows) as u32,
                        h.div_ceil(self.plan.expert_rows) as u32,
                        s.tiles_at as u32,
                        s.order_at as u32,
                        s.tile_cap as u32,
                        tile.items() as u32,
                    ],
                    &[&s.ids, &s.groups],
                    [1, 1, 1],
                );
                for (k, size) in tile.down_to_16().into_iter().enumerate() {
                    let list = s.tiles_at + 4 * s.tile_cap * k;
                    let args = 32 * k as u64;
                    self.experts_mm(
                        r,
                        "lin.experts.gate",
                        size,
                        &m.gate,
                        gate_io,
                        ks,
                        args,
                        list,
                    );
                    self.experts_mm(r, "lin.experts.up", size, &m.up, up_io, ks, args, list);
                }
                self.swiglu(r, &s.g, &s.u, &s.act, tk * i);
            }
            how @ (ExpertsUp::GluRows | ExpertsUp::Glu) => {
                // A decode step: gate, up and silu(gate) ⊙ up in one dispatch.
                let x = if norm.is_some() { &s.x } else { &s.xn };
                let mut io = self.plain(x, h, &s.act, i, tk);
                io.norm = norm;
                self.glu(
                    r,
                    "lin.experts.glu",
                    &m.gate,
                    &m.up,
                    io,
                    Some(ks),
                    how,
                    route,
                    self.plan.glu_items(m, t),
                );
            }
            ExpertsUp::Separate => {
                self.linear_experts(r, "lin.experts.gate", &m.gate, gate_io, ks);
                self.linear_experts(r, "lin.experts.up", &m.up, up_io, ks);
                self.swiglu(r, &s.g, &s.u, &s.act, tk * i);
            }
        }
        if let Some(sh) = &m.shared {
            match self.plan.shared_up(&sh.gate, &sh.up, t) {
                how @ (ExpertsUp::GluRows | ExpertsUp::Glu) => {
                    let io = self.plain(&s.xn, h, &s.sa, si, t);
                    self.glu(
                        r,
                        "lin.shared.glu",
                        &sh.gate,
                        &sh.up,
                        io,
                        None,
                        how,
                        None,
                        false,
                    );
                }
                _ => {
                    let sg_io = self.plain(&s.xn, h, &s.sg, si, t);
                    let su_io = self.plain(&s.xn, h, &s.su, si, t);
                    self.linear(r, "lin.shared.gate", &sh.gate, sg_io);
                    self.linear(r, "lin.shared.up", &sh.up, su_io);
                    self.swiglu(r, &s.sg, &s.su, &s.sa, t * si);
                }
            }
            self.linear(
                r,
                "lin.shared.down",
                &sh.down,
                self.plain(&s.sa, si, &s.sh, h, t),
            );
        }
        let down = self.plan.experts_down(m, t);
        match down {
            ExpertsDown::FusedRows | ExpertsDown::Fused => {
                // A decode step: every item's down projection and the weighted sum into the
                // residual at once.
                let de = &m.down.slices[0];
                let (kernel, per) = if down == ExpertsDown::FusedRows {
                    (&self.k.moe_down_rows, self.plan.down_rb)
                } else {
                    (&self.k.moe_down, LINEAR_ROWS)
                };
                let (nx, ny) = grid_2d(h.div_ceil(per));
                r.dispatch_as(
                    "moe_down",
                    kernel,
                    &[
                        h as u32,
                        i as u32,
                        m.down.group as u32,
                        de.scale_off,
                        de.bias_off,
                        nx,
                    ],
                    &[&de.buf, &s.act, &s.wts, &s.ids, &s.x],
                    [nx, ny, t as u32],
                );
                return;
            }
            ExpertsDown::Grouped(tile) => {
                for (k, size) in tile.down_to_16().into_iter().enumerate() {
                    let list = s.tiles_at + 4 * s.tile_cap * k;
                    let args = 32 * k as u64 + 16;
                    self.experts_mm(r, "lin.experts.down", size, &m.down, down_io, 1, args, list);
                }
            }
            ExpertsDown::Separate => {
                self.linear_experts(r, "lin.experts.down", &m.down, down_io, 1);
            }
        }
        r.dispatch(
            &self.k.moe_combine,
            &[
                t as u32,
                h as u32,
                ks as u32,
                rs as u32,
                e as u32,
                !stacked as u32,
            ],
            &[&s.x, &s.ye, &s.wts, &s.sh, &s.router_logits],
            [h.div_ceil(64) as u32, t as u32, 1],
        );
    }

    fn swiglu(&self, r: &mut Recorder<'a>, g: &'a Buf, u: &'a Buf, a: &'a Buf, n: usize) {
        let (nx, ny) = grid_2d(n.div_ceil(64));
        r.dispatch(&self.k.swiglu, &[n as u32], &[g, u, a], [nx, ny, 1]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Under each rule, every split count fits attend_merge and the partials buffer (and the
    /// rule's own bounds), the splits cover the keys in spans of whole granules, and none is
    /// empty at the longest range.
    #[test]
    fn attention_splits_cover_the_keys_within_the_buffers() {
        let rules = [
            SplitRule::WIDE,
            SplitRule::decode(512, 32),
            SplitRule::decode(128, 128),
            SplitRule::decode(64, 32),
        ];
        for rule in &rules {
            for pairs in [1, 2, 4, 16, 64, 100, 255, 256, 2048, 8192] {
                for per_group in [1, 2, 8] {
                    for n_max in [1, 63, 64, 65, 300, 4096, 4097, 32_768, 262_144] {
                        let rows = pairs * per_group;
                        let (nsplit, span) = attention_splits(rule, pairs, rows, n_max);
                        assert!((1..=rule.max_splits).contains(&nsplit), "{pairs} {n_max}");
                        assert!(nsplit <= MERGE_MAX_SPLITS);
                        assert!(span.is_multiple_of(rule.granule) && span > 0);
                        assert!(nsplit * span >= n_max && (nsplit - 1) * span < n_max);
                        if nsplit > 1 {
                            assert!(rows * nsplit <= rule.part_rows, "{rows} × {nsplit}");
                            assert!(rows * nsplit <= PART_ROWS, "{rows} × {nsplit}");
                        }
                    }
                }
            }
        }
        // Decode on the full model (2 KV heads of 8 query heads), today's rule: at 4,096 keys
        // 64 splits of 64 (128 workgroups), one key more 33 of 128 (66 workgroups).
        let wide = &SplitRule::WIDE;
        assert_eq!(attention_splits(wide, 2, 16, 4096), (64, 64));
        assert_eq!(attention_splits(wide, 2, 16, 4097), (33, 128));
        assert_eq!(attention_splits(wide, 2, 16, 32_800), (57, 576));
        // `attn_split` on a discrete GPU: blocks of 32 keys, up to 256 splits a KV head.
        let split = &SplitRule::decode(512, 32);
        assert_eq!(attention_splits(split, 2, 16, 4097), (129, 32));
        assert_eq!(attention_splits(split, 2, 16, 32_800), (205, 160));
        // Prefill's chunk (2 KV heads × 512 tokens) is never split.
        assert_eq!(attention_splits(wide, 1024, 8192, 4096).0, 1);
    }
}
