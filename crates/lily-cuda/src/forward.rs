//! The model's forward step on the device, step for step the structure of MODEL.md §2 and of the
//! CPU backend: embed → 40 × (norm → attention | DeltaNet → residual → norm → MoE → residual)
//! → final norm → lm_head. Every buffer it touches exists before it runs (scratch for the largest
//! chunk, per-sequence state), positions are read on the device, and nothing waits on the host,
//! so the decode step can be captured as one replayable CUDA graph. Which kernel runs for a step
//! is the plan's decision (plan.rs): every `match self.plan…` below names the kernels of each
//! answer, and the launchers take the plan's kernel as an argument.

use anyhow::{bail, Result};
use lily_core::config::ModelConfig;

use crate::gpu::{DevBuf, Gpu};
use crate::kernels::attention::{
    self, Attend, AttnShape, QkPrep, RowsAttend, SplitKernel, SplitPartials,
};
use crate::kernels::decode::{DnConv, DnStep, DownCombine, Glu, Input, MoeOutputs, Out, Prologue};
use crate::kernels::deltanet::{self, Conv, DnRecurrent, DnScan, DnShape, GatedNorm};
use crate::kernels::embed::Lookup;
use crate::kernels::gemm::GroupedGemm;
use crate::kernels::linear::{Gather, GROUP_TILE};
use crate::kernels::moe::{self, Combine, Group, MoeShape, Route, SiluMul};
use crate::kernels::norm::RmsNorm;
use crate::kernels::{ExpertGroups, Grouped, Kernels, Project, Rows, Store};
use crate::plan::{
    AttentionKernels, BatchAttention, BatchHead, BatchMoe, BatchNorm, BatchProjections, BatchScan,
    DecodePath, Dense, Experts, MoeRows, Plan, Router,
};
use crate::weights::{
    DevAttention, DevDeltaNet, DevLinear, DevMixer, DevModel, DevMoe, LinearShape,
};

const F32: usize = 4;

/// Activations for one chunk of up to `chunk` tokens, shared by all sequences (one runs at a time).
pub struct Scratch {
    pub chunk: usize,
    /// f32 [ARGMAX_SCRATCH]: the two-stage argmax's per-block partials.
    pub argmax_parts: DevBuf,
    /// u32 [LOGPROB_SCRATCH_WORDS]: the device top log-probabilities' partials.
    pub logprob_parts: DevBuf,
    pub tokens: DevBuf,
    pub x: DevBuf,
    pub xn: DevBuf,
    pub qg: DevBuf,
    pub k: DevBuf,
    pub v: DevBuf,
    pub q: DevBuf,
    pub attn_o: DevBuf,
    /// Split-KV attention partials (attention::split_kv_scratch): outputs and (max, sum) per split.
    pub part_o: DevBuf,
    /// `kv_cache int8`: one layer's K then V rows dequantised to bf16 ([max_position][n_kv][d]
    /// each) for the attention kernels that read bf16 (`Forward::attend`); None with a bf16 cache.
    pub kv_deq: Option<DevBuf>,
    pub part_ml: DevBuf,
    pub m: DevBuf,
    pub z: DevBuf,
    pub b: DevBuf,
    pub a: DevBuf,
    pub c: DevBuf,
    pub dn_o: DevBuf,
    pub dn_qk: DevBuf,
    pub dn_ab: DevBuf,
    /// The tensor-core DeltaNet scan's per-chunk records (`deltanet::wy_records` for the chunk),
    /// allocated only when the plan runs that scan for a full chunk (`Plan::deltanet_scan`).
    pub dn_records: Option<DevBuf>,
    pub dn_y: DevBuf,
    /// bf16 [chunk × the widest GEMM input]: a projection's input staged for the bf16-input
    /// wgmma kernels (`Forward::stage_bf16`), allocated only when the plan stages a full chunk.
    pub xbf: Option<DevBuf>,
    pub router: DevBuf,
    pub ids: DevBuf,
    pub route_w: DevBuf,
    pub eg: DevBuf,
    pub eu: DevBuf,
    pub eh: DevBuf,
    pub ey: DevBuf,
    pub sg: DevBuf,
    pub su: DevBuf,
    pub sh: DevBuf,
    pub sy: DevBuf,
    pub s_gate: DevBuf,
    /// MoE items grouped by expert (prefill): permutation, tiles (expert, start, count), counts
    /// (the tiles', the remainders'), the remainders' tiles (one an expert, `ExpertGroups::tail`).
    pub perm: DevBuf,
    pub tiles: DevBuf,
    pub n_tiles: DevBuf,
    pub max_tiles: usize,
    pub tail_tiles: DevBuf,
}

impl Scratch {
    /// Fills every activation buffer with NaN (tests: unwritten outputs are caught).
    pub fn poison(&self, gpu: &Gpu) -> Result<()> {
        for b in [
            &self.xn,
            &self.qg,
            &self.k,
            &self.v,
            &self.q,
            &self.attn_o,
            &self.part_o,
            &self.part_ml,
            &self.m,
            &self.z,
            &self.b,
            &self.a,
            &self.c,
            &self.dn_o,
            &self.dn_qk,
            &self.dn_ab,
            &self.dn_y,
            &self.router,
            &self.route_w,
            &self.eg,
            &self.eu,
            &self.eh,
            &self.ey,
            &self.sg,
            &self.su,
            &self.sh,
            &self.sy,
            &self.s_gate,
            &self.perm,
            &self.tiles,
            &self.n_tiles,
        ] {
            gpu.fill(b, 0xff)?;
        }
        Ok(())
    }

    /// Scratch for chunks of up to `chunk` tokens as `plan` runs them: the bf16 staging where
    /// such a chunk stages its GEMM inputs (`Plan::stages`), the DeltaNet records where it takes
    /// the tensor-core scan (`Plan::deltanet_scan`).
    pub fn new(gpu: &Gpu, cfg: &ModelConfig, chunk: usize, plan: &Plan) -> Result<Scratch> {
        let c = chunk;
        let stages = plan.stages(chunk);
        let dn = DnShape::of(cfg);
        let buf = |elems: usize| gpu.alloc(elems * F32);
        let (h, tk) = (cfg.hidden, cfg.top_k);
        let (part_o, part_ml) = attention::split_kv_scratch(cfg.n_heads, cfg.head_dim);
        Ok(Scratch {
            chunk,
            argmax_parts: buf(crate::kernels::sample::ARGMAX_SCRATCH)?,
            logprob_parts: buf(crate::kernels::sample::LOGPROB_SCRATCH_WORDS)?,
            tokens: buf(c)?,
            x: buf(c * h)?,
            xn: buf(c * h)?,
            qg: buf(c * 2 * cfg.n_heads * cfg.head_dim)?,
            k: buf(c * cfg.n_kv_heads * cfg.head_dim)?,
            v: buf(c * cfg.n_kv_heads * cfg.head_dim)?,
            q: buf(c * cfg.n_heads * cfg.head_dim)?,
            attn_o: buf(c * cfg.n_heads * cfg.head_dim)?,
            part_o: buf(part_o)?,
            part_ml: buf(part_ml)?,
            kv_deq: if plan.kv_int8() {
                Some(gpu.alloc(2 * cfg.max_position * cfg.n_kv_heads * cfg.head_dim * 2)?)
            } else {
                None
            },
            m: buf(c * cfg.conv_dim())?,
            z: buf(c * cfg.dn_value_dim())?,
            b: buf(c * cfg.dn_v_heads)?,
            a: buf(c * cfg.dn_v_heads)?,
            c: buf(c * cfg.conv_dim())?,
            dn_o: buf(c * cfg.dn_value_dim())?,
            dn_qk: buf(c * cfg.dn_k_heads * 2 * cfg.dn_k_dim)?,
            dn_ab: buf(c * cfg.dn_v_heads * 2)?,
            dn_records: match plan.deltanet_scan(dn, c) {
                DnScan::Chunked => Some(buf(deltanet::wy_records(dn, c))?),
                DnScan::Recurrent => None,
            },
            dn_y: buf(c * cfg.dn_value_dim())?,
            xbf: if stages {
                let widest = [
                    h,
                    cfg.dn_value_dim(),
                    cfg.n_heads * cfg.head_dim,
                    tk * cfg.expert_inter,
                    cfg.shared_inter,
                ];
                Some(gpu.alloc(c * widest.into_iter().max().unwrap_or(h) * 2)?)
            } else {
                None
            },
            router: buf(c * cfg.n_experts)?,
            ids: buf(c * tk)?,
            route_w: buf(c * tk)?,
            eg: buf(c * tk * cfg.expert_inter)?,
            eu: buf(c * tk * cfg.expert_inter)?,
            eh: buf(c * tk * cfg.expert_inter)?,
            ey: buf(c * tk * h)?,
            sg: buf(c * cfg.shared_inter)?,
            su: buf(c * cfg.shared_inter)?,
            sh: buf(c * cfg.shared_inter)?,
            sy: buf(c * h)?,
            s_gate: buf(c)?,
            perm: buf(c * tk)?,
            tiles: buf(3 * moe::max_group_tiles(c * tk, cfg.n_experts))?,
            n_tiles: buf(2)?,
            max_tiles: moe::max_group_tiles(c * tk, cfg.n_experts),
            tail_tiles: buf(3 * cfg.n_experts)?,
        })
    }
}

/// Where a batched step's kernels find each sequence's buffers in the device copy of
/// `Forward::batch_table` (`rows` sequences of `model`).
struct BatchTable {
    at: u64,
    rows: usize,
    dn_layers: usize,
    attn_layers: usize,
}

impl BatchTable {
    fn new(at: u64, model: &DevModel, rows: usize) -> Result<BatchTable> {
        if at == 0 {
            bail!("a batched step's kernels need the sequences' pointer table");
        }
        let dn_layers = model
            .layers
            .iter()
            .filter(|l| matches!(l.mixer, DevMixer::DeltaNet(_)))
            .count();
        Ok(BatchTable {
            at,
            rows,
            dn_layers,
            attn_layers: model.layers.len() - dn_layers,
        })
    }

    /// Entry `i` (in u64s) of the table.
    fn entry(&self, i: usize) -> u64 {
        self.at + (i * 8) as u64
    }

    /// DeltaNet layer `i`'s recurrent states, then its conv states.
    fn states(&self, i: usize) -> u64 {
        self.entry(2 * i * self.rows)
    }

    fn convs(&self, i: usize) -> u64 {
        self.entry((2 * i + 1) * self.rows)
    }

    /// Attention layer `i`'s key caches followed by its value caches.
    fn caches(&self, i: usize) -> u64 {
        self.entry((2 * self.dn_layers + 2 * i) * self.rows)
    }

    fn positions(&self) -> u64 {
        self.entry((2 * self.dn_layers + 2 * self.attn_layers) * self.rows)
    }

    /// The sequences' next tokens (i32 at the start of each `next_token`).
    fn tokens(&self) -> u64 {
        self.entry((2 * self.dn_layers + 2 * self.attn_layers + 1) * self.rows)
    }
}

/// One sequence's state on the device.
pub struct SeqState {
    pub max_ctx: usize,
    /// Tokens consumed (host mirror of `pos`).
    pub len: usize,
    /// i32: the position of the next token; kernels read it, `advance_pos` moves it.
    pub pos: DevBuf,
    /// [i32, f32, then LOGPROB_MAX_K × (u32 id, f32)]: the sampled next token (the sampler
    /// writes it, the next decode step embeds it), its log-probability (`next_logprob`) and the
    /// step's top log-probabilities when the device computes them (`top_logprobs_out`), side by
    /// side so one read brings all three.
    pub next_token: DevBuf,
    /// f32 [vocab]: logits of the last consumed token.
    pub logits: DevBuf,
    /// Per attention layer: K and V caches [max_ctx, Hkv, D] (fp32, or bf16 in bf16 mode).
    pub kv: Vec<(DevBuf, DevBuf)>,
    /// Per DeltaNet layer: recurrent state [Hv, dk, dv] fp32 and conv state [K-1, conv_dim].
    pub dn: Vec<(DevBuf, DevBuf)>,
    /// The one-token step embedding `next_token` (graphs on), one per attention-kernel choice,
    /// indexed by `Plan::long_keys`: each captured at the first decode step that takes it.
    pub decode_graphs: [Option<crate::graph::DecodeGraph>; 2],
}

impl SeqState {
    /// Where the sampler writes the next token's log-probability (f32, beside the token).
    pub fn next_logprob(&self) -> u64 {
        self.next_token.ptr + 4
    }

    /// Where the device writes the step's top log-probabilities (u32 [2 · LOGPROB_MAX_K]).
    pub fn top_logprobs_out(&self) -> u64 {
        self.next_token.ptr + 8
    }
}

/// u32 words of `SeqState::next_token`: token, log-probability, the top log-probabilities.
pub const NEXT_TOKEN_WORDS: usize = 2 + 2 * crate::kernels::sample::LOGPROB_MAX_K;

pub fn kv_elem_bytes(bf16: bool) -> usize {
    if bf16 {
        2
    } else {
        4
    }
}

impl SeqState {
    /// A sequence of context `max_ctx` with a bf16 (`bf16`) or f32 KV cache.
    pub fn new(gpu: &Gpu, cfg: &ModelConfig, max_ctx: usize, bf16: bool) -> Result<SeqState> {
        let pos_bytes =
            attention::kv_pos_bytes(cfg.n_kv_heads, cfg.head_dim, kv_elem_bytes(bf16), false);
        SeqState::with_kv(gpu, cfg, max_ctx, pos_bytes)
    }

    /// A sequence of context `max_ctx` whose KV caches take `kv_row` bytes a position and layer
    /// (`Plan::kv_pos_bytes`: the format's).
    pub fn with_kv(
        gpu: &Gpu,
        cfg: &ModelConfig,
        max_ctx: usize,
        kv_row: usize,
    ) -> Result<SeqState> {
        let mut kv = Vec::new();
        let mut dn = Vec::new();
        for _ in 0..cfg.n_attention_layers() {
            kv.push((gpu.alloc(max_ctx * kv_row)?, gpu.alloc(max_ctx * kv_row)?));
        }
        for _ in 0..cfg.n_deltanet_layers() {
            let state = gpu.alloc(cfg.dn_v_heads * cfg.dn_k_dim * cfg.dn_v_dim * F32)?;
            let conv =
                gpu.alloc(cfg.conv_kernel.saturating_sub(1).max(1) * cfg.conv_dim() * F32)?;
            gpu.fill(&state, 0)?;
            gpu.fill(&conv, 0)?;
            dn.push((state, conv));
        }
        let pos = gpu.alloc(4)?;
        gpu.fill(&pos, 0)?;
        let s = SeqState {
            max_ctx,
            len: 0,
            pos,
            next_token: gpu.alloc(NEXT_TOKEN_WORDS * 4)?,
            logits: gpu.alloc(cfg.vocab * F32)?,
            kv,
            dn,
            decode_graphs: [None, None],
        };
        gpu.fill(&s.next_token, 0)?;
        Ok(s)
    }
}

/// Where the logits of a forward pass go.
pub enum LogitsOut {
    /// Only the last token's, into the sequence's `logits`.
    Last,
    /// Every token's, into a [n, vocab] buffer (tests and echo).
    All(u64),
}

pub struct Forward<'a> {
    pub gpu: &'a Gpu,
    pub kernels: &'a Kernels,
    pub plan: &'a Plan,
    pub cfg: &'a ModelConfig,
    pub scratch: &'a Scratch,
}

impl Forward<'_> {
    /// Runs `n` tokens (ids at device address `tokens`, n <= chunk) through the model at the
    /// sequence's position, updating its caches and states, and advances the position by `n`.
    pub fn run(
        &self,
        model: &DevModel,
        seq: &SeqState,
        tokens: u64,
        n: usize,
        out: LogitsOut,
    ) -> Result<()> {
        let (gpu, k, cfg, s) = (self.gpu, self.kernels, self.cfg, self.scratch);
        let h = cfg.hidden;
        let lookup = Lookup {
            table: &model.embed,
            tokens,
            x: s.x.ptr,
            n_tok: n,
        };
        gpu.profile_scope(if n == 1 {
            "decode embed"
        } else {
            "prefill embed"
        });
        k.embed.lookup(gpu, &lookup)?;
        let (mut attn_i, mut dn_i) = (0usize, 0usize);
        let eps = cfg.rms_eps;
        // The residual row of a one-token step, RMS-normed inside the fused kernels.
        let normed = |weight: u64, staged_out: Option<u64>| Input {
            x: s.x.ptr,
            cols: h,
            prologue: Prologue::RmsNorm { weight, eps },
            staged_out,
        };
        for layer in &model.layers {
            match &layer.mixer {
                DevMixer::Attention(a) => {
                    gpu.profile_scope(if n == 1 {
                        "decode attention"
                    } else {
                        "prefill attention"
                    });
                    let (k_cache, v_cache) = &seq.kv[attn_i];
                    attn_i += 1;
                    let (kc, vc, pos) = (k_cache.ptr, v_cache.ptr, seq.pos.ptr);
                    let keys = seq.len + n;
                    match self.plan.decode_attention(a, n) {
                        DecodePath::Fused => {
                            let input = normed(layer.input_norm.ptr, None);
                            self.attention_one_token(a, kc, vc, pos, keys, input)?
                        }
                        DecodePath::PerKernel => {
                            self.norm(Rows::new(s.x.ptr, h), layer.input_norm.ptr, n)?;
                            self.attention(a, kc, vc, pos, keys, n)?
                        }
                    }
                }
                DevMixer::DeltaNet(d) => {
                    gpu.profile_scope(if n == 1 {
                        "decode deltanet"
                    } else {
                        "prefill deltanet"
                    });
                    let (state, conv) = &seq.dn[dn_i];
                    dn_i += 1;
                    match self.plan.decode_deltanet(d, cfg, n) {
                        DecodePath::Fused => {
                            let input = normed(layer.input_norm.ptr, None);
                            self.deltanet_one_token(d, state.ptr, conv.ptr, input)?
                        }
                        DecodePath::PerKernel => {
                            self.norm(Rows::new(s.x.ptr, h), layer.input_norm.ptr, n)?;
                            self.deltanet(d, state.ptr, conv.ptr, n)?
                        }
                    }
                }
            }
            gpu.profile_scope(if n == 1 { "decode moe" } else { "prefill moe" });
            match self.plan.decode_moe(&layer.moe, MoeShape::of(cfg), n) {
                DecodePath::Fused => {
                    // The MoE's later kernels read the normed row from scratch.xn.
                    let input = normed(layer.post_norm.ptr, Some(s.xn.ptr));
                    self.moe_one_token(&layer.moe, input)?
                }
                DecodePath::PerKernel => {
                    self.norm(Rows::new(s.x.ptr, h), layer.post_norm.ptr, n)?;
                    self.moe(&layer.moe, n)?
                }
            }
        }
        gpu.profile_scope(if n == 1 {
            "decode head"
        } else {
            "prefill head"
        });
        k.sample.advance_pos(gpu, seq.pos.ptr, n)?;
        let v = cfg.vocab;
        let xn = Rows::new(s.xn.ptr, h);
        match out {
            LogitsOut::Last => {
                let last = s.x.ptr + ((n - 1) * h * F32) as u64;
                self.norm(Rows::new(last, h), model.final_norm.ptr, 1)?;
                match self.plan.one_row(&model.lm_head.shape()) {
                    DecodePath::Fused => {
                        let out = [(&model.lm_head, Out::Store(seq.logits.ptr))];
                        self.project_one_token(Input::row(s.xn.ptr, h), &out)?
                    }
                    DecodePath::PerKernel => {
                        let logits = Rows::new(seq.logits.ptr, v);
                        self.project(&model.lm_head, xn, logits, 1, Store::Overwrite)?
                    }
                }
            }
            LogitsOut::All(dst) => {
                self.norm(Rows::new(s.x.ptr, h), model.final_norm.ptr, n)?;
                self.project(&model.lm_head, xn, Rows::new(dst, v), n, Store::Overwrite)?;
                // The last row is also the sequence's pending logits.
                gpu.copy_raw(seq.logits.ptr, dst + ((n - 1) * v * F32) as u64, v * F32)?;
            }
        }
        Ok(())
    }

    /// One decode step for several sequences (`CudaBackend`'s batched `decode_step`): the token
    /// each sequence's sampler left in its `next_token` goes through the model at row b of the
    /// scratch (b: its index in `seqs`). The norms, every projection, the router, the routed
    /// experts (grouped over all rows' picks) and lm_head run once over the rows, each weight
    /// read once for the batch, with the kernels the plan names for a step of that many tokens;
    /// attention and the DeltaNet conv and recurrence run per sequence on its own row, caches,
    /// state and position (`Plan::batch_scan` names the scan). lm_head writes the rows' logits
    /// into `logits` ([rows, vocab]), each row then copied into its sequence's `logits`; every
    /// position advances by one. Like `run`, nothing waits on the host (graph-capturable).
    ///
    /// `table`: the device copy of `batch_table(seqs)` (`BatchTable`: the kernels that run
    /// every sequence in one launch find its states, caches and position through it). Like the
    /// graphs, it holds for exactly these sequences in this order.
    pub fn run_batch(
        &self,
        model: &DevModel,
        seqs: &[&SeqState],
        logits: u64,
        table: u64,
    ) -> Result<()> {
        let (gpu, k, cfg, s) = (self.gpu, self.kernels, self.cfg, self.scratch);
        let (h, rows) = (cfg.hidden, seqs.len());
        if rows == 0 || rows > s.chunk {
            bail!(
                "a batched step of {rows} sequences: the scratch holds 1..={}",
                s.chunk
            );
        }
        gpu.profile_scope("batch embed");
        let head = self.plan.batch_head();
        match head {
            BatchHead::Rows => {
                let t = BatchTable::new(table, model, rows)?;
                k.embed
                    .lookup_rows(gpu, &model.embed, t.tokens(), s.x.ptr, rows)?;
            }
            BatchHead::PerSequence => {
                for (row, seq) in seqs.iter().enumerate() {
                    let lookup = Lookup {
                        table: &model.embed,
                        tokens: seq.next_token.ptr,
                        x: s.x.ptr + (row * h * F32) as u64,
                        n_tok: 1,
                    };
                    k.embed.lookup(gpu, &lookup)?;
                }
            }
        }
        let (mut attn_i, mut dn_i) = (0usize, 0usize);
        for layer in &model.layers {
            let input_norm = layer.input_norm.ptr;
            match &layer.mixer {
                DevMixer::Attention(a) => {
                    gpu.profile_scope("batch attention");
                    let qkv = [
                        (&a.q_proj, Out::Store(s.qg.ptr)),
                        (&a.k_proj, Out::Store(s.k.ptr)),
                        (&a.v_proj, Out::Store(s.v.ptr)),
                    ];
                    self.norm_project_batch(input_norm, rows, &qkv)?;
                    let keys: Vec<usize> = seqs.iter().map(|seq| seq.len + 1).collect();
                    match self.plan.batch_attention(AttnShape::of(cfg), &keys) {
                        BatchAttention::Rows(kernel) => {
                            let t = BatchTable::new(table, model, rows)?;
                            let rows_attend = RowsAttend {
                                qg: s.qg.ptr,
                                k: s.k.ptr,
                                v: s.v.ptr,
                                q_norm: a.q_norm.ptr,
                                k_norm: a.k_norm.ptr,
                                caches: t.caches(attn_i),
                                positions: t.positions(),
                                out: s.attn_o.ptr,
                                parts: SplitPartials {
                                    part_o: s.part_o.ptr,
                                    part_ml: s.part_ml.ptr,
                                },
                                rows,
                            };
                            k.attention.split_kv_prepped_rows(
                                gpu,
                                kernel,
                                AttnShape::of(cfg),
                                &rows_attend,
                            )?;
                        }
                        BatchAttention::PerSequence => {
                            for (row, seq) in seqs.iter().enumerate() {
                                let (kc, vc) = &seq.kv[attn_i];
                                let keys = seq.len + 1;
                                self.attend(a, kc.ptr, vc.ptr, seq.pos.ptr, keys, 1, row)?;
                            }
                        }
                    }
                    attn_i += 1;
                    let hqd = cfg.n_heads * cfg.head_dim;
                    let o = [(&a.o_proj, Out::AddToResidual(s.x.ptr))];
                    self.project_batch(s.attn_o.ptr, hqd, rows, &o)?;
                }
                DevMixer::DeltaNet(d) => {
                    gpu.profile_scope("batch deltanet");
                    let inputs = [
                        (&d.in_qkv, Out::Store(s.m.ptr)),
                        (&d.in_z, Out::Store(s.z.ptr)),
                        (&d.in_b, Out::Store(s.b.ptr)),
                        (&d.in_a, Out::Store(s.a.ptr)),
                    ];
                    self.norm_project_batch(input_norm, rows, &inputs)?;
                    match self.plan.batch_scan(cfg) {
                        BatchScan::Rows => {
                            let t = BatchTable::new(table, model, rows)?;
                            self.deltanet_scan_rows(d, t.states(dn_i), t.convs(dn_i), rows)?;
                        }
                        scan => {
                            for (row, seq) in seqs.iter().enumerate() {
                                let (state, conv) = &seq.dn[dn_i];
                                if scan == BatchScan::OneToken {
                                    self.deltanet_scan_one_token(d, state.ptr, conv.ptr, row)?
                                } else {
                                    self.deltanet_scan(d, state.ptr, conv.ptr, 1, row)?
                                }
                            }
                        }
                    }
                    dn_i += 1;
                    self.deltanet_gated_norm(d, rows)?;
                    let out = [(&d.out_proj, Out::AddToResidual(s.x.ptr))];
                    self.project_batch(s.dn_y.ptr, cfg.dn_value_dim(), rows, &out)?;
                }
            }
            gpu.profile_scope("batch moe");
            self.moe_batch(&layer.moe, layer.post_norm.ptr, rows)?;
        }
        gpu.profile_scope("batch head");
        match head {
            BatchHead::Rows => {
                let t = BatchTable::new(table, model, rows)?;
                k.sample.advance_pos_rows(gpu, t.positions(), rows, 1)?;
            }
            BatchHead::PerSequence => {
                for seq in seqs {
                    k.sample.advance_pos(gpu, seq.pos.ptr, 1)?;
                }
            }
        }
        let v = cfg.vocab;
        let head = [(&model.lm_head, Out::Store(logits))];
        self.norm_project_batch(model.final_norm.ptr, rows, &head)?;
        for (row, seq) in seqs.iter().enumerate() {
            gpu.copy_raw(seq.logits.ptr, logits + (row * v * F32) as u64, v * F32)?;
        }
        Ok(())
    }

    /// The arguments of the MoE's two fused launches (decode.cu `dec_glu4` and
    /// `dec_down_combine`, or their rows forms) over the scratch buffers: one place for the
    /// one-token step and the batched one.
    fn moe_args<'m>(&self, m: &'m DevMoe) -> (Glu<'m>, DownCombine<'m>) {
        let (cfg, s) = (self.cfg, self.scratch);
        let out = self.moe_outputs();
        let glu = out.glu(m, s.xn.ptr, cfg.n_experts, cfg.top_k);
        (glu, out.down_combine(m, s.x.ptr, cfg.top_k))
    }

    /// The MoE block's outputs in scratch, whichever kernels write them: router, s_gate, ids,
    /// route_w, eh, sh.
    fn moe_outputs(&self) -> MoeOutputs {
        let s = self.scratch;
        MoeOutputs {
            logits: s.router.ptr,
            shared_gate_logit: s.s_gate.ptr,
            ids: s.ids.ptr,
            route_w: s.route_w.ptr,
            h: s.eh.ptr,
            h_shared: s.sh.ptr,
        }
    }

    /// `moe_one_token` for each of the `rows` rows of a batched step (scratch.x, normed with
    /// `norm` into scratch.xn first: `norm_project_batch`): the
    /// router logits and the shared-expert gate of all rows in one launch, then each row's
    /// routing with its experts' and the shared expert's gate/up/SiLU in one, every down
    /// projection with the combine and the residual add in one: per row, or grouped by expert
    /// (each picked expert's weights read once for all its rows) as `Plan::moe_rows` says.
    fn moe_rows(&self, m: &DevMoe, norm: u64, rows: usize) -> Result<()> {
        let (gpu, k, s) = (self.gpu, self.kernels, self.scratch);
        let first = [
            (&m.router, Out::Exact(s.router.ptr)),
            (&m.shared_expert_gate, Out::Store(s.s_gate.ptr)),
        ];
        self.norm_project_batch(norm, rows, &first)?;
        let (glu, down) = self.moe_args(m);
        let cfg = self.cfg;
        match self.plan.moe_rows(m, cfg.n_experts, cfg.top_k, rows) {
            MoeRows::ByExpert(kernel, block) => {
                k.decode.glu_grouped(gpu, &glu, rows, kernel)?;
                k.decode.down_combine_grouped(gpu, &down, rows, block)
            }
            MoeRows::PerRow => {
                let products = self.plan.moe_products(m, cfg.top_k);
                k.decode.glu_rows(gpu, &glu, rows, products)?;
                k.decode.down_combine_rows(gpu, &down, rows, products)
            }
        }
    }

    /// The pointer table of a batched step (`BatchTable` reads it): u64, one a sequence in
    /// `seqs`'s order: per DeltaNet layer the recurrent states then the conv states, per
    /// attention layer the key caches then the value caches, then the positions, then the
    /// next tokens.
    pub fn batch_table(seqs: &[&SeqState]) -> Vec<u64> {
        let (dn, attn) = seqs.first().map_or((0, 0), |s| (s.dn.len(), s.kv.len()));
        let mut t = Vec::with_capacity((2 * dn + 2 * attn + 2) * seqs.len());
        for i in 0..dn {
            t.extend(seqs.iter().map(|s| s.dn[i].0.ptr));
            t.extend(seqs.iter().map(|s| s.dn[i].1.ptr));
        }
        for i in 0..attn {
            t.extend(seqs.iter().map(|s| s.kv[i].0.ptr));
            t.extend(seqs.iter().map(|s| s.kv[i].1.ptr));
        }
        t.extend(seqs.iter().map(|s| s.pos.ptr));
        t.extend(seqs.iter().map(|s| s.next_token.ptr));
        t
    }

    /// The conv and recurrent step of the `rows` sequences of a batched step in one launch
    /// each, their tokens at rows 0.. of scratch.m / b / a, into those rows of scratch.dn_o;
    /// `states` and `convs`: device tables of each row's recurrent and conv state pointers.
    fn deltanet_scan_rows(
        &self,
        d: &DevDeltaNet,
        states: u64,
        convs: u64,
        rows: usize,
    ) -> Result<()> {
        let (gpu, k, cfg, s) = (self.gpu, self.kernels, self.cfg, self.scratch);
        let c = DnConv {
            m: s.m.ptr,
            conv_state: convs,
            weight: d.conv.ptr,
            c: s.c.ptr,
            conv_dim: cfg.conv_dim(),
            kernel: cfg.conv_kernel,
        };
        k.decode.dn_conv_rows(gpu, &c, rows)?;
        let step = DnStep {
            c: s.c.ptr,
            b: s.b.ptr,
            a: s.a.ptr,
            a_log: d.a_log.ptr,
            dt_bias: d.dt_bias.ptr,
            state: states,
            o: s.dn_o.ptr,
            n_k: cfg.dn_k_heads,
            n_v: cfg.dn_v_heads,
            dk: cfg.dn_k_dim,
            dv: cfg.dn_v_dim,
        };
        k.decode.dn_step_rows(gpu, &step, deltanet::PREP_EPS, rows)
    }

    /// The block norm (weight `norm`) of the `rows` residual rows of a batched decode step
    /// (scratch.x) into scratch.xn (`rms_norm`), then the projections of the normed rows
    /// (`project_batch`).
    fn norm_project_batch(&self, norm: u64, rows: usize, outs: &[(&DevLinear, Out)]) -> Result<()> {
        let (cfg, s) = (self.cfg, self.scratch);
        let h = cfg.hidden;
        let a = RmsNorm {
            x: Rows::new(s.x.ptr, h),
            weight: norm,
            y: Rows::new(s.xn.ptr, h),
            cols: h,
            eps: cfg.rms_eps,
            rows,
        };
        match self.plan.batch_norm(h) {
            BatchNorm::Plain => self.kernels.norm.rms_norm(self.gpu, &a)?,
            BatchNorm::Rows => self.kernels.norm.rms_norm_rows(self.gpu, &a)?,
        }
        self.project_batch(s.xn.ptr, h, rows, outs)
    }

    /// The projections of one input for the `rows` rows of a batched decode step (x: f32
    /// [rows, cols]), as `Plan::batch_projections` says: decode.cu's `dec_gemv_rows` in one
    /// launch, or each weight's B-token kernel (`project`; the router's exact `router_logits`).
    /// Output row b of a weight of r rows goes to its pointer + b · r floats.
    fn project_batch(
        &self,
        x: u64,
        cols: usize,
        rows: usize,
        outs: &[(&DevLinear, Out)],
    ) -> Result<()> {
        let shapes: Vec<LinearShape> = outs.iter().map(|(w, _)| w.shape()).collect();
        match self.plan.batch_projections(&shapes) {
            BatchProjections::Rows(kernel) => self
                .kernels
                .decode
                .project_rows(self.gpu, kernel, x, cols, rows, outs),
            BatchProjections::PerKernel => {
                let xr = Rows::new(x, cols);
                for &(w, out) in outs {
                    match out {
                        Out::Store(y) => {
                            self.project(w, xr, Rows::new(y, w.rows), rows, Store::Overwrite)?
                        }
                        Out::AddToResidual(y) => {
                            self.project(w, xr, Rows::new(y, w.rows), rows, Store::AddToResidual)?
                        }
                        Out::Exact(y) => self.router_logits(w, xr, Rows::new(y, w.rows), rows)?,
                    }
                }
                Ok(())
            }
        }
    }

    /// The MoE of a batched decode step's `rows` rows (scratch.x, normed with `norm` into
    /// scratch.xn), as `Plan::batch_moe` says: one-token decode's three launches with the token
    /// in a grid dimension (`moe_rows`), or the router and the shared expert's gate, gate and up
    /// projections of xn together (`norm_project_batch`), the routing, the routed experts grouped
    /// over the rows' picks, the shared expert's down projection, the combine into the residual.
    fn moe_batch(&self, m: &DevMoe, norm: u64, rows: usize) -> Result<()> {
        let (gpu, k, cfg, s) = (self.gpu, self.kernels, self.cfg, self.scratch);
        if self.plan.batch_moe(m, MoeShape::of(cfg)) == BatchMoe::Rows {
            return self.moe_rows(m, norm, rows);
        }
        let sinter = cfg.shared_inter;
        let first = [
            (&m.router, Out::Exact(s.router.ptr)),
            (&m.shared_expert_gate, Out::Store(s.s_gate.ptr)),
            (&m.shared_gate, Out::Store(s.sg.ptr)),
            (&m.shared_up, Out::Store(s.su.ptr)),
        ];
        self.norm_project_batch(norm, rows, &first)?;
        let route = Route {
            logits: s.router.ptr,
            ids: s.ids.ptr,
            weights: s.route_w.ptr,
            n_tok: rows,
            shape: MoeShape::of(cfg),
        };
        k.moe.route(gpu, &route)?;
        self.routed_experts(m, rows, None)?;
        let shared_silu = SiluMul {
            g: s.sg.ptr,
            u: s.su.ptr,
            h: s.sh.ptr,
            n: rows * sinter,
        };
        k.moe.silu_mul(gpu, &shared_silu)?;
        self.project_batch(
            s.sh.ptr,
            sinter,
            rows,
            &[(&m.shared_down, Out::Store(s.sy.ptr))],
        )?;
        self.combine(rows)
    }

    /// scratch.xn[..rows] = RMSNorm(x[..rows]) · weight.
    fn norm(&self, x: Rows, weight: u64, rows: usize) -> Result<()> {
        let h = self.cfg.hidden;
        let a = RmsNorm {
            x,
            weight,
            y: Rows::new(self.scratch.xn.ptr, h),
            cols: h,
            eps: self.cfg.rms_eps,
            rows,
        };
        self.kernels.norm.rms_norm(self.gpu, &a)
    }

    /// y (+)= W x for `n` rows: tensor cores or CUDA cores, as the plan says.
    pub fn project(&self, w: &DevLinear, x: Rows, y: Rows, n: usize, store: Store) -> Result<()> {
        self.project_staged(w, x, None, y, n, store)
    }

    /// `project` with x also staged as bf16 (`stage_bf16`) for the kernels that read it so.
    pub fn project_staged(
        &self,
        w: &DevLinear,
        x: Rows,
        xb: Option<Rows>,
        y: Rows,
        n: usize,
        store: Store,
    ) -> Result<()> {
        let (gpu, k) = (self.gpu, self.kernels);
        let a = Project {
            w,
            x,
            xb,
            y,
            n_tok: n,
        };
        match self.plan.dense(&w.shape(), n, xb.is_some()) {
            Dense::Gemm(kernel) => k.gemm.dense(gpu, kernel, &a, store),
            Dense::Linear => k.linear.project(gpu, &a, store),
        }
    }

    /// The MoE router's logits: y = W x in fp32 from the stored weights (not rounded to bf16 on
    /// the way in or out, also in bf16 mode), so top-k routing, which a rounding can flip,
    /// follows the fp32 model wherever it can.
    pub fn router_logits(&self, w: &DevLinear, x: Rows, y: Rows, n: usize) -> Result<()> {
        let (gpu, k) = (self.gpu, self.kernels);
        let a = Project {
            w,
            x,
            xb: None,
            y,
            n_tok: n,
        };
        match self.plan.router(&w.shape(), n) {
            Router::GemmExact { parts } => k.gemm.dense_exact(gpu, parts, &a),
            Router::LinearExact => k.linear.project_exact(gpu, &a),
        }
    }

    /// `rows` rows of x (`cols` wide) as bf16 in scratch.xbf, for the GEMMs of an n-token chunk
    /// when the plan stages them (`Plan::stages`); None: the GEMMs read x. The staged rows stay
    /// until the next call.
    fn stage_bf16(&self, x: Rows, rows: usize, cols: usize, n: usize) -> Result<Option<Rows>> {
        let Some(buf) = &self.scratch.xbf else {
            return Ok(None);
        };
        if !self.plan.stages(n) || !cols.is_multiple_of(8) || rows * cols * 2 > buf.bytes {
            return Ok(None);
        }
        self.kernels
            .gemm
            .to_bf16(self.gpu, x, rows, cols, buf.ptr)?;
        Ok(Some(Rows::new(buf.ptr, cols)))
    }

    // The blocks below read the normed input from scratch.xn and add their output to scratch.x.

    /// Gated attention (MODEL.md §2.4): x += o_proj(attn(q, k, v) ⊙ sigmoid(gate)). `keys`:
    /// the sequence's keys after this step as the host knows them (picks kernels, never results).
    pub fn attention(
        &self,
        a: &DevAttention,
        k_cache: u64,
        v_cache: u64,
        pos: u64,
        keys: usize,
        n: usize,
    ) -> Result<()> {
        self.attention_in(a, n)?;
        self.attend(a, k_cache, v_cache, pos, keys, n, 0)?;
        self.attention_out(a, n)
    }

    /// q_proj (query and gate), k_proj and v_proj of `n` rows of scratch.xn.
    fn attention_in(&self, a: &DevAttention, n: usize) -> Result<()> {
        let (cfg, s) = (self.cfg, self.scratch);
        let h = cfg.hidden;
        let (hq, hkv, d) = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim);
        let xn = Rows::new(s.xn.ptr, h);
        let xb = self.stage_bf16(xn, n, h, n)?;
        let qg = Rows::new(s.qg.ptr, 2 * hq * d);
        self.project_staged(&a.q_proj, xn, xb, qg, n, Store::Overwrite)?;
        let kr = Rows::new(s.k.ptr, hkv * d);
        self.project_staged(&a.k_proj, xn, xb, kr, n, Store::Overwrite)?;
        let vr = Rows::new(s.v.ptr, hkv * d);
        self.project_staged(&a.v_proj, xn, xb, vr, n, Store::Overwrite)
    }

    /// o_proj of `n` rows of scratch.attn_o, added into the residual.
    fn attention_out(&self, a: &DevAttention, n: usize) -> Result<()> {
        let (cfg, s) = (self.cfg, self.scratch);
        let hqd = cfg.n_heads * cfg.head_dim;
        let o = Rows::new(s.attn_o.ptr, hqd);
        let ob = self.stage_bf16(o, n, hqd, n)?;
        let x = Rows::new(s.x.ptr, cfg.hidden);
        self.project_staged(&a.o_proj, o, ob, x, n, Store::AddToResidual)
    }

    /// q/k norms, RoPE and the cache write of scratch.qg / k / v, then attention into
    /// scratch.attn_o with the kernel the plan picks; the `n` tokens of one sequence from row
    /// `row` of those buffers on (a batched step runs each sequence's token at its own row).
    #[allow(clippy::too_many_arguments)]
    fn attend(
        &self,
        a: &DevAttention,
        k_cache: u64,
        v_cache: u64,
        pos: u64,
        keys: usize,
        n: usize,
        row: usize,
    ) -> Result<()> {
        let (gpu, k, cfg, s) = (self.gpu, self.kernels, self.cfg, self.scratch);
        let shape = AttnShape::of(cfg);
        let (hq, hkv, d) = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim);
        let at = |buf: &DevBuf, cols: usize| buf.ptr + (row * cols * F32) as u64;
        let (qg, q) = (at(&s.qg, 2 * hq * d), at(&s.q, hq * d));
        let prep = QkPrep {
            qg,
            k: at(&s.k, hkv * d),
            v: at(&s.v, hkv * d),
            q_out: q,
            k_cache,
            v_cache,
            q_norm: a.q_norm.ptr,
            k_norm: a.k_norm.ptr,
            pos,
        };
        let kernels = self.plan.attention(shape, n, keys);
        // `kv_cache int8`: the tensor-core split kernels read the int8 rows in place; every other
        // kernel reads rows 0..keys dequantised into scratch.kv_deq after this step's write.
        let in_place = matches!(
            kernels,
            AttentionKernels::Split {
                kernel: SplitKernel::Mma | SplitKernel::MmaLong,
                ..
            }
        );
        let deq = s.kv_deq.as_ref().filter(|_| !in_place);
        let fused = deq.is_none()
            && matches!(
                kernels,
                AttentionKernels::Split {
                    prep_fused: true,
                    ..
                }
            );
        if !fused {
            k.attention.qk_prep(gpu, shape, &prep, n)?;
        }
        let (k_read, v_read) = match deq {
            Some(buf) => {
                let half = buf.bytes / 2;
                let rows = half / (hkv * d * 2).max(1);
                if keys > rows {
                    bail!(
                        "an int8 KV cache's attention over {keys} keys: its bf16 scratch holds {rows} (the model's max_position)"
                    );
                }
                let out = (buf.ptr, buf.ptr + half as u64);
                k.attention
                    .kv_int8_dequant(gpu, shape, (k_cache, v_cache), out, pos, n, rows)?;
                out
            }
            None => (k_cache, v_cache),
        };
        let attend = Attend {
            shape,
            q,
            qg,
            k_cache: k_read,
            v_cache: v_read,
            out: at(&s.attn_o, hq * d),
            pos,
            n_tok: n,
        };
        let parts = SplitPartials {
            part_o: s.part_o.ptr,
            part_ml: s.part_ml.ptr,
        };
        match kernels {
            AttentionKernels::Split { kernel, .. } if fused => k
                .attention
                .split_kv_prepped(gpu, kernel, &attend, parts, &prep)?,
            AttentionKernels::Split { kernel, .. } => {
                k.attention.split_kv(gpu, kernel, &attend, parts)?
            }
            AttentionKernels::Prefill(kernel) => k.attention.flash_prefill(gpu, kernel, &attend)?,
            AttentionKernels::OneBlockPerHead => k.attention.one_block_per_head(gpu, &attend)?,
        }
        Ok(())
    }

    // One-token steps with decode.cu's fused kernels. `input` is the block's input row: the
    // residual with the block's norm as prologue (Forward::run), or an already normed row (tests).

    /// Gated attention of one token: q/k/v in one launch, attention, o_proj into the residual.
    pub fn attention_one_token(
        &self,
        a: &DevAttention,
        k_cache: u64,
        v_cache: u64,
        pos: u64,
        keys: usize,
        input: Input,
    ) -> Result<()> {
        let (cfg, s) = (self.cfg, self.scratch);
        let qkv = [
            (&a.q_proj, Out::Store(s.qg.ptr)),
            (&a.k_proj, Out::Store(s.k.ptr)),
            (&a.v_proj, Out::Store(s.v.ptr)),
        ];
        self.project_one_token(input, &qkv)?;
        self.attend(a, k_cache, v_cache, pos, keys, 1, 0)?;
        let o = Input::row(s.attn_o.ptr, cfg.n_heads * cfg.head_dim);
        self.project_one_token(o, &[(&a.o_proj, Out::AddToResidual(s.x.ptr))])
    }

    /// Gated DeltaNet of one token: the four input projections in one launch, conv, recurrence,
    /// then the gated norm folded into out_proj; the residual row scratch.x gets the layer's
    /// output.
    pub fn deltanet_one_token(
        &self,
        d: &DevDeltaNet,
        state: u64,
        conv: u64,
        input: Input,
    ) -> Result<()> {
        let (cfg, s) = (self.cfg, self.scratch);
        let inputs = [
            (&d.in_qkv, Out::Store(s.m.ptr)),
            (&d.in_z, Out::Store(s.z.ptr)),
            (&d.in_b, Out::Store(s.b.ptr)),
            (&d.in_a, Out::Store(s.a.ptr)),
        ];
        self.project_one_token(input, &inputs)?;
        self.deltanet_scan_one_token(d, state, conv, 0)?;
        let o = Input {
            x: s.dn_o.ptr,
            cols: cfg.dn_value_dim(),
            prologue: Prologue::GatedNorm {
                weight: d.norm.ptr,
                z: s.z.ptr,
                head_dim: cfg.dn_v_dim,
                eps: cfg.rms_eps,
            },
            staged_out: None,
        };
        self.project_one_token(o, &[(&d.out_proj, Out::AddToResidual(s.x.ptr))])
    }

    /// One-token projections of `input` in one decode.cu launch, with the products and grid the
    /// plan picks for these weights (`gemv_products`: f32, or int8 pairs under `gemv_int8`;
    /// `gemv_grid`: two tiles a block for dec_gemv4w_x8x2 under `gemv4w_sm_grid`).
    fn project_one_token(&self, input: Input, outs: &[(&DevLinear, Out)]) -> Result<()> {
        let shapes: Vec<LinearShape> = outs.iter().map(|(w, _)| w.shape()).collect();
        let (products, grid) = (
            self.plan.gemv_products(&shapes),
            self.plan.gemv_grid(&shapes),
        );
        self.kernels
            .decode
            .project(self.gpu, input, outs, products, grid)
    }

    /// decode.cu's conv and recurrent step of one token at row `row` of scratch.m / b / a, into
    /// that row of scratch.dn_o.
    fn deltanet_scan_one_token(
        &self,
        d: &DevDeltaNet,
        state: u64,
        conv: u64,
        row: usize,
    ) -> Result<()> {
        let (gpu, k, cfg, s) = (self.gpu, self.kernels, self.cfg, self.scratch);
        let (conv_dim, hv) = (cfg.conv_dim(), cfg.dn_v_heads);
        let at = |buf: &DevBuf, cols: usize| buf.ptr + (row * cols * F32) as u64;
        let c = DnConv {
            m: at(&s.m, conv_dim),
            conv_state: conv,
            weight: d.conv.ptr,
            c: at(&s.c, conv_dim),
            conv_dim,
            kernel: cfg.conv_kernel,
        };
        k.decode.dn_conv(gpu, &c)?;
        let step = DnStep {
            c: at(&s.c, conv_dim),
            b: at(&s.b, hv),
            a: at(&s.a, hv),
            a_log: d.a_log.ptr,
            dt_bias: d.dt_bias.ptr,
            state,
            o: at(&s.dn_o, cfg.dn_value_dim()),
            n_k: cfg.dn_k_heads,
            n_v: hv,
            dk: cfg.dn_k_dim,
            dv: cfg.dn_v_dim,
        };
        k.decode.dn_step(gpu, &step, deltanet::PREP_EPS)
    }

    /// MoE of one token: router logits and shared-expert gate in one launch (which also leaves
    /// the normed row in scratch.xn), routing with every expert's gate/up/SiLU in one launch,
    /// every down projection with the combine and the residual add in one.
    pub fn moe_one_token(&self, m: &DevMoe, input: Input) -> Result<()> {
        let (gpu, k, s) = (self.gpu, self.kernels, self.scratch);
        if input.x != s.xn.ptr && input.staged_out != Some(s.xn.ptr) {
            bail!("moe_one_token: the normed row must end up in scratch.xn");
        }
        let first = [
            (&m.router, Out::Exact(s.router.ptr)),
            (&m.shared_expert_gate, Out::Store(s.s_gate.ptr)),
        ];
        self.project_one_token(input, &first)?;
        let (glu, down) = self.moe_args(m);
        let products = self.plan.moe_products(m, self.cfg.top_k);
        k.decode
            .glu(gpu, &glu, products, self.plan.glu_loads(m, products))?;
        k.decode
            .down_combine(gpu, &down, products, self.plan.down_regs(products))
    }

    /// Gated DeltaNet (MODEL.md §2.5): x += out_proj(gated_norm(recurrence(conv(qkv)), z)).
    pub fn deltanet(&self, dnw: &DevDeltaNet, state: u64, conv: u64, n: usize) -> Result<()> {
        self.deltanet_in(dnw, n)?;
        self.deltanet_scan(dnw, state, conv, n, 0)?;
        self.deltanet_out(dnw, n)
    }

    /// The four input projections (qkv, z, b, a) of `n` rows of scratch.xn.
    fn deltanet_in(&self, dnw: &DevDeltaNet, n: usize) -> Result<()> {
        let (cfg, s) = (self.cfg, self.scratch);
        let h = cfg.hidden;
        let (conv_dim, vd, hv) = (cfg.conv_dim(), cfg.dn_value_dim(), cfg.dn_v_heads);
        let xn = Rows::new(s.xn.ptr, h);
        let xb = self.stage_bf16(xn, n, h, n)?;
        let m = Rows::new(s.m.ptr, conv_dim);
        self.project_staged(&dnw.in_qkv, xn, xb, m, n, Store::Overwrite)?;
        let z = Rows::new(s.z.ptr, vd);
        self.project_staged(&dnw.in_z, xn, xb, z, n, Store::Overwrite)?;
        let b = Rows::new(s.b.ptr, hv);
        self.project_staged(&dnw.in_b, xn, xb, b, n, Store::Overwrite)?;
        let a = Rows::new(s.a.ptr, hv);
        self.project_staged(&dnw.in_a, xn, xb, a, n, Store::Overwrite)
    }

    /// Conv and recurrence of one sequence's `n` tokens, from row `row` of scratch.m / b / a on,
    /// into the same rows of scratch.dn_o (a batched step runs each sequence at its own row).
    fn deltanet_scan(
        &self,
        dnw: &DevDeltaNet,
        state: u64,
        conv: u64,
        n: usize,
        row: usize,
    ) -> Result<()> {
        let (gpu, k, cfg, s) = (self.gpu, self.kernels, self.cfg, self.scratch);
        let (conv_dim, vd, hv) = (cfg.conv_dim(), cfg.dn_value_dim(), cfg.dn_v_heads);
        let at = |buf: &DevBuf, cols: usize| buf.ptr + (row * cols * F32) as u64;
        let c = Conv {
            m: at(&s.m, conv_dim),
            m_stride: conv_dim,
            conv_state: conv,
            weight: dnw.conv.ptr,
            c: at(&s.c, conv_dim),
            n_tok: n,
            conv_dim,
            k: cfg.conv_kernel,
        };
        k.deltanet.conv(gpu, &c)?;
        let shape = DnShape::of(cfg);
        let rec = DnRecurrent {
            c: at(&s.c, conv_dim),
            b: at(&s.b, hv),
            a: at(&s.a, hv),
            ba_stride: hv,
            a_log: dnw.a_log.ptr,
            dt_bias: dnw.dt_bias.ptr,
            state,
            o: at(&s.dn_o, vd),
            qk: s.dn_qk.ptr,
            ab: s.dn_ab.ptr,
            records: s.dn_records.as_ref().map_or(0, |r| r.ptr),
        };
        k.deltanet
            .scan(gpu, self.plan.deltanet_scan(shape, n), shape, &rec, n)
    }

    /// The gated norm of `n` rows of scratch.dn_o with scratch.z, then out_proj, added into the
    /// residual.
    fn deltanet_out(&self, dnw: &DevDeltaNet, n: usize) -> Result<()> {
        let (cfg, s) = (self.cfg, self.scratch);
        let vd = cfg.dn_value_dim();
        self.deltanet_gated_norm(dnw, n)?;
        let y = Rows::new(s.dn_y.ptr, vd);
        let yb = self.stage_bf16(y, n, vd, n)?;
        let x = Rows::new(s.x.ptr, cfg.hidden);
        self.project_staged(&dnw.out_proj, y, yb, x, n, Store::AddToResidual)
    }

    /// The gated norm of `n` rows of scratch.dn_o with scratch.z into scratch.dn_y.
    fn deltanet_gated_norm(&self, dnw: &DevDeltaNet, n: usize) -> Result<()> {
        let (gpu, k, cfg, s) = (self.gpu, self.kernels, self.cfg, self.scratch);
        let vd = cfg.dn_value_dim();
        let gn = GatedNorm {
            o: s.dn_o.ptr,
            z: s.z.ptr,
            z_stride: vd,
            weight: dnw.norm.ptr,
            y: s.dn_y.ptr,
            n_tok: n,
            eps: cfg.rms_eps,
        };
        k.deltanet.gated_norm(gpu, DnShape::of(cfg), &gn)
    }

    /// MoE (MODEL.md §2.6): x += Σ_k w_k expert_k(xn) + sigmoid(gate·xn) shared(xn).
    pub fn moe(&self, m: &DevMoe, n: usize) -> Result<()> {
        let (gpu, k, cfg, s) = (self.gpu, self.kernels, self.cfg, self.scratch);
        let h = cfg.hidden;
        let (e, sinter) = (cfg.n_experts, cfg.shared_inter);
        let shape = MoeShape::of(cfg);
        let xn = Rows::new(s.xn.ptr, h);
        self.router_logits(&m.router, xn, Rows::new(s.router.ptr, e), n)?;
        let route = Route {
            logits: s.router.ptr,
            ids: s.ids.ptr,
            weights: s.route_w.ptr,
            n_tok: n,
            shape,
        };
        k.moe.route(gpu, &route)?;
        // xn staged once for every projection that reads it: the shared expert's first (they
        // are independent of the routed experts), then the routed gate and up, before the
        // routed and shared down projections stage their own hidden rows over it.
        let xb = self.stage_bf16(xn, n, h, n)?;
        let (sg, su) = (Rows::new(s.sg.ptr, sinter), Rows::new(s.su.ptr, sinter));
        self.project_staged(&m.shared_gate, xn, xb, sg, n, Store::Overwrite)?;
        self.project_staged(&m.shared_up, xn, xb, su, n, Store::Overwrite)?;
        let s_gate = Rows::new(s.s_gate.ptr, 1);
        self.project_staged(&m.shared_expert_gate, xn, xb, s_gate, n, Store::Overwrite)?;
        self.routed_experts(m, n, xb)?;
        let shared_silu = SiluMul {
            g: s.sg.ptr,
            u: s.su.ptr,
            h: s.sh.ptr,
            n: n * sinter,
        };
        k.moe.silu_mul(gpu, &shared_silu)?;
        let sh = Rows::new(s.sh.ptr, sinter);
        let shb = self.stage_bf16(sh, n, sinter, n)?;
        let sy = Rows::new(s.sy.ptr, h);
        self.project_staged(&m.shared_down, sh, shb, sy, n, Store::Overwrite)?;
        self.combine(n)
    }

    /// The routed experts of `n` rows of scratch.xn (`xb`: staged as bf16), routed in
    /// scratch.ids, into scratch.ey, with the kernels `Plan::experts` names.
    fn routed_experts(&self, m: &DevMoe, n: usize, xb: Option<Rows>) -> Result<()> {
        let (gpu, k, cfg, s) = (self.gpu, self.kernels, self.cfg, self.scratch);
        let h = cfg.hidden;
        let (e, top_k, inter) = (cfg.n_experts, cfg.top_k, cfg.expert_inter);
        let shape = MoeShape::of(cfg);
        let xn = Rows::new(s.xn.ptr, h);
        let items = n * top_k;
        let (eg, eu) = (Rows::new(s.eg.ptr, inter), Rows::new(s.eu.ptr, inter));
        let (eh, ey) = (Rows::new(s.eh.ptr, inter), Rows::new(s.ey.ptr, h));
        let silu = SiluMul {
            g: s.eg.ptr,
            u: s.eu.ptr,
            h: s.eh.ptr,
            n: items * inter,
        };
        let groups = |tile: usize, tail: usize| ExpertGroups {
            perm: s.perm.ptr,
            tiles: s.tiles.ptr,
            n_tiles: s.n_tiles.ptr,
            max_tiles: self.plan.tile_rows(items, e, tile, s.max_tiles),
            tile,
            tail,
            tail_tiles: s.tail_tiles.ptr,
        };
        let group = |groups: ExpertGroups| Group {
            ids: s.ids.ptr,
            n_items: items,
            n_experts: e,
            into: groups,
        };
        // gate and up read token rows (item / top_k), down reads item rows.
        let by_expert = |w, groups, x, x_div, y| Grouped {
            w,
            groups,
            x,
            xb: None,
            x_div,
            y,
        };
        let weights = [&m.gate.shape(), &m.up.shape(), &m.down.shape()];
        match self.plan.experts(weights, shape, n) {
            Experts::Gemm {
                tile,
                gate,
                up,
                down,
                tail,
            } => {
                let g = groups(tile, tail.map_or(0, GroupedGemm::tile));
                k.moe.group(gpu, &group(g))?;
                // Each projection over the tiles, then (`tail`) over the remainders' list.
                let run = |kernel, w, x, xb, x_div, y| -> Result<()> {
                    let a = Grouped {
                        xb,
                        ..by_expert(w, g, x, x_div, y)
                    };
                    k.gemm.grouped(gpu, kernel, &a)?;
                    if let Some(t) = tail {
                        let a = Grouped {
                            groups: g.tail_groups(e),
                            ..a
                        };
                        k.gemm.grouped(gpu, t, &a)?;
                    }
                    Ok(())
                };
                run(gate, &m.gate, xn, xb, top_k, eg)?;
                run(up, &m.up, xn, xb, top_k, eu)?;
                k.moe.silu_mul(gpu, &silu)?;
                let hb = if down.staged() {
                    self.stage_bf16(eh, items, inter, n)?
                } else {
                    None
                };
                run(down, &m.down, eh, hb, 1, ey)?;
            }
            Experts::LinearGrouped => {
                let g = groups(GROUP_TILE, 0);
                k.moe.group(gpu, &group(g))?;
                k.linear
                    .grouped(gpu, &by_expert(&m.gate, g, xn, top_k, eg))?;
                k.linear.grouped(gpu, &by_expert(&m.up, g, xn, top_k, eu))?;
                k.moe.silu_mul(gpu, &silu)?;
                k.linear.grouped(gpu, &by_expert(&m.down, g, eh, 1, ey))?;
            }
            Experts::Gather => {
                let gather = |w, x, x_div, y| Gather {
                    w,
                    ids: s.ids.ptr,
                    x,
                    x_div,
                    y,
                    n_items: items,
                };
                k.linear.gather(gpu, &gather(&m.gate, xn, top_k, eg))?;
                k.linear.gather(gpu, &gather(&m.up, xn, top_k, eu))?;
                k.moe.silu_mul(gpu, &silu)?;
                k.linear.gather(gpu, &gather(&m.down, eh, 1, ey))?;
            }
        }
        Ok(())
    }

    /// x += Σ_k w_k · ey_k + sigmoid(s_gate) · sy for `n` rows (moe_combine).
    fn combine(&self, n: usize) -> Result<()> {
        let (gpu, k, cfg, s) = (self.gpu, self.kernels, self.cfg, self.scratch);
        let (h, top_k) = (cfg.hidden, cfg.top_k);
        let combine = Combine {
            x: s.x.ptr,
            y_experts: s.ey.ptr,
            weights: s.route_w.ptr,
            y_shared: s.sy.ptr,
            shared_gate: s.s_gate.ptr,
            n_tok: n,
            hidden: h,
            top_k,
        };
        k.moe.combine_into_residual(gpu, &combine)
    }
}
