//! The model's forward step on the device, step for step the structure of MODEL.md §2 and of the
//! CPU backend: embed → 40 × (norm → attention | DeltaNet → residual → norm → MoE → residual)
//! → final norm → lm_head. Every buffer it touches exists before it runs (scratch for the largest
//! chunk, per-sequence state), positions are read on the device, and nothing waits on the host,
//! so the decode step can become one replayable CUDA graph later.

use anyhow::Result;
use lily_core::config::ModelConfig;

use crate::device::{DevBuf, Gpu};
use crate::ops::{self, AttnShape, DnRecurrent, DnShape, QkPrep};
use crate::weights::{DevMixer, DevModel};

const F32: usize = 4;

/// Activations for one chunk of up to `chunk` tokens, shared by all sequences (one runs at a time).
pub struct Scratch {
    pub chunk: usize,
    pub tokens: DevBuf,
    pub x: DevBuf,
    pub xn: DevBuf,
    pub qg: DevBuf,
    pub k: DevBuf,
    pub v: DevBuf,
    pub q: DevBuf,
    pub attn_o: DevBuf,
    /// Split-KV attention partials (ops::split_kv_scratch): outputs and (max, sum) per split.
    pub part_o: DevBuf,
    pub part_ml: DevBuf,
    pub m: DevBuf,
    pub z: DevBuf,
    pub b: DevBuf,
    pub a: DevBuf,
    pub c: DevBuf,
    pub dn_o: DevBuf,
    pub dn_qk: DevBuf,
    pub dn_ab: DevBuf,
    pub dn_y: DevBuf,
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
    /// MoE items grouped by expert (prefill): permutation, tiles (expert, start, count), count.
    pub perm: DevBuf,
    pub tiles: DevBuf,
    pub n_tiles: DevBuf,
    pub max_tiles: usize,
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

    pub fn new(gpu: &Gpu, cfg: &ModelConfig, chunk: usize) -> Result<Scratch> {
        let c = chunk;
        let buf = |elems: usize| gpu.alloc(elems * F32);
        let (h, tk) = (cfg.hidden, cfg.top_k);
        let (part_o, part_ml) = ops::split_kv_scratch(cfg.n_heads, cfg.head_dim);
        Ok(Scratch {
            chunk,
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
            m: buf(c * cfg.conv_dim())?,
            z: buf(c * cfg.dn_value_dim())?,
            b: buf(c * cfg.dn_v_heads)?,
            a: buf(c * cfg.dn_v_heads)?,
            c: buf(c * cfg.conv_dim())?,
            dn_o: buf(c * cfg.dn_value_dim())?,
            dn_qk: buf(c * cfg.dn_k_heads * 2 * cfg.dn_k_dim)?,
            dn_ab: buf(c * cfg.dn_v_heads * 2)?,
            dn_y: buf(c * cfg.dn_value_dim())?,
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
            tiles: buf(3 * ops::max_group_tiles(c * tk, cfg.n_experts))?,
            n_tiles: buf(1)?,
            max_tiles: ops::max_group_tiles(c * tk, cfg.n_experts),
        })
    }
}

/// One sequence's state on the device.
pub struct SeqState {
    pub max_ctx: usize,
    /// Tokens consumed (host mirror of `pos`).
    pub len: usize,
    /// i32: the position of the next token; kernels read it, `advance_pos` moves it.
    pub pos: DevBuf,
    /// i32: the sampled next token (the sampler writes it, the next decode step embeds it).
    pub next_token: DevBuf,
    /// f32: its log-probability.
    pub next_logprob: DevBuf,
    /// f32 [vocab]: logits of the last consumed token.
    pub logits: DevBuf,
    /// Per attention layer: K and V caches [max_ctx, Hkv, D] (fp32, or bf16 in bf16 mode).
    pub kv: Vec<(DevBuf, DevBuf)>,
    /// Per DeltaNet layer: recurrent state [Hv, dk, dv] fp32 and conv state [K-1, conv_dim].
    pub dn: Vec<(DevBuf, DevBuf)>,
    /// The one-token step embedding `next_token`, captured at the first decode (graphs on).
    pub decode_graph: Option<crate::graph::DecodeGraph>,
}

pub fn kv_elem_bytes(bf16: bool) -> usize {
    if bf16 {
        2
    } else {
        4
    }
}

impl SeqState {
    pub fn new(gpu: &Gpu, cfg: &ModelConfig, max_ctx: usize, bf16: bool) -> Result<SeqState> {
        let kv_row = cfg.n_kv_heads * cfg.head_dim * kv_elem_bytes(bf16);
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
            next_token: gpu.alloc(4)?,
            next_logprob: gpu.alloc(4)?,
            logits: gpu.alloc(cfg.vocab * F32)?,
            kv,
            dn,
            decode_graph: None,
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
    pub cfg: &'a ModelConfig,
    pub scratch: &'a Scratch,
    /// Prefill chunks run the routed experts grouped by expert (moe_group + linear_grouped), so
    /// each expert's weights are read once per tile instead of once per item (LILY_MOE_GROUPED=0
    /// turns it off). Decode (one token) always gathers.
    pub moe_grouped: bool,
    /// Prefill chunks of at least ops::TENSOR_CORE_MIN_TOK tokens run `attn_prefill` (flash attention
    /// on tensor cores: bf16 mma, fp32 softmax) instead of one block per (token, query head).
    /// Only with bf16 activations: it rounds the softmax weights to bf16 as HF's bf16 path does,
    /// and would round fp32-mode q, k and v too.
    pub attn_prefill: bool,
    /// Steps of at most ops::SPLIT_MAX_TOK tokens (decode) run split-KV (flash-decoding)
    /// attention: many blocks per kv head over slices of the cache instead of one block per query
    /// head reading it all (LILY_SPLIT_KV=0 turns it off).
    pub split_kv: bool,
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
        let (gpu, cfg, s) = (self.gpu, self.cfg, self.scratch);
        let h = cfg.hidden;
        let eps = cfg.rms_eps;
        ops::embed(gpu, &model.embed, tokens, s.x.ptr, n)?;
        let (mut attn_i, mut dn_i) = (0usize, 0usize);
        for layer in &model.layers {
            ops::rms_norm(
                gpu,
                s.x.ptr,
                h,
                layer.input_norm.ptr,
                s.xn.ptr,
                h,
                h,
                eps,
                n,
            )?;
            match &layer.mixer {
                DevMixer::Attention(a) => {
                    let (k_cache, v_cache) = &seq.kv[attn_i];
                    attn_i += 1;
                    self.attention(a, k_cache.ptr, v_cache.ptr, seq.pos.ptr, n)?;
                }
                DevMixer::DeltaNet(d) => {
                    let (state, conv) = &seq.dn[dn_i];
                    dn_i += 1;
                    self.deltanet(d, state.ptr, conv.ptr, n)?;
                }
            }
            ops::rms_norm(gpu, s.x.ptr, h, layer.post_norm.ptr, s.xn.ptr, h, h, eps, n)?;
            self.moe(&layer.moe, n)?;
        }
        ops::advance_pos(gpu, seq.pos.ptr, n)?;
        let v = cfg.vocab;
        match out {
            LogitsOut::Last => {
                let last = s.x.ptr + ((n - 1) * h * F32) as u64;
                ops::rms_norm(gpu, last, h, model.final_norm.ptr, s.xn.ptr, h, h, eps, 1)?;
                ops::linear(
                    gpu,
                    &model.lm_head,
                    s.xn.ptr,
                    h,
                    seq.logits.ptr,
                    v,
                    1,
                    false,
                )?;
            }
            LogitsOut::All(dst) => {
                ops::rms_norm(
                    gpu,
                    s.x.ptr,
                    h,
                    model.final_norm.ptr,
                    s.xn.ptr,
                    h,
                    h,
                    eps,
                    n,
                )?;
                ops::linear(gpu, &model.lm_head, s.xn.ptr, h, dst, v, n, false)?;
                // The last row is also the sequence's pending logits.
                gpu.copy_raw(seq.logits.ptr, dst + ((n - 1) * v * F32) as u64, v * F32)?;
            }
        }
        Ok(())
    }

    // The blocks below read the normed input from scratch.xn and add their output to scratch.x.

    /// Gated attention (MODEL.md §2.4): x += o_proj(attn(q, k, v) ⊙ sigmoid(gate)).
    pub fn attention(
        &self,
        a: &crate::weights::DevAttention,
        k_cache: u64,
        v_cache: u64,
        pos: u64,
        n: usize,
    ) -> Result<()> {
        let (gpu, cfg, s) = (self.gpu, self.cfg, self.scratch);
        let h = cfg.hidden;
        let (hq, hkv, d) = (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim);
        ops::linear(gpu, &a.q_proj, s.xn.ptr, h, s.qg.ptr, 2 * hq * d, n, false)?;
        ops::linear(gpu, &a.k_proj, s.xn.ptr, h, s.k.ptr, hkv * d, n, false)?;
        ops::linear(gpu, &a.v_proj, s.xn.ptr, h, s.v.ptr, hkv * d, n, false)?;
        let shape = AttnShape {
            n_q: hq,
            n_kv: hkv,
            d,
            rotary: cfg.rotary_dim,
            theta: cfg.rope_theta as f32,
            eps: cfg.rms_eps,
        };
        let prep = QkPrep {
            qg: s.qg.ptr,
            k: s.k.ptr,
            v: s.v.ptr,
            q_out: s.q.ptr,
            k_cache,
            v_cache,
            q_norm: a.q_norm.ptr,
            k_norm: a.k_norm.ptr,
            pos,
        };
        ops::attn_qk_prep(gpu, shape, &prep, n)?;
        if self.split_kv && ops::split_kv_fits(shape, n) {
            ops::attn_split(
                gpu,
                shape,
                s.q.ptr,
                s.qg.ptr,
                k_cache,
                v_cache,
                s.part_o.ptr,
                s.part_ml.ptr,
                s.attn_o.ptr,
                pos,
                n,
            )?;
        } else {
            // The same inputs and output: flash attention on tensor cores for prefill chunks, one
            // block per (token, query head) otherwise.
            let kernel = if self.attn_prefill && ops::attn_prefill_fits(shape, n) {
                ops::attn_prefill
            } else {
                ops::attn_decode
            };
            let (q, qg, out) = (s.q.ptr, s.qg.ptr, s.attn_o.ptr);
            kernel(gpu, shape, q, qg, k_cache, v_cache, out, pos, n)?;
        }
        ops::linear(gpu, &a.o_proj, s.attn_o.ptr, hq * d, s.x.ptr, h, n, true)
    }

    /// Gated DeltaNet (MODEL.md §2.5): x += out_proj(gated_norm(recurrence(conv(qkv)), z)).
    pub fn deltanet(
        &self,
        dnw: &crate::weights::DevDeltaNet,
        state: u64,
        conv: u64,
        n: usize,
    ) -> Result<()> {
        let (gpu, cfg, s) = (self.gpu, self.cfg, self.scratch);
        let h = cfg.hidden;
        let (conv_dim, vd, hv) = (cfg.conv_dim(), cfg.dn_value_dim(), cfg.dn_v_heads);
        ops::linear(gpu, &dnw.in_qkv, s.xn.ptr, h, s.m.ptr, conv_dim, n, false)?;
        ops::linear(gpu, &dnw.in_z, s.xn.ptr, h, s.z.ptr, vd, n, false)?;
        ops::linear(gpu, &dnw.in_b, s.xn.ptr, h, s.b.ptr, hv, n, false)?;
        ops::linear(gpu, &dnw.in_a, s.xn.ptr, h, s.a.ptr, hv, n, false)?;
        ops::dn_conv(
            gpu,
            s.m.ptr,
            conv_dim,
            conv,
            dnw.conv.ptr,
            s.c.ptr,
            n,
            conv_dim,
            cfg.conv_kernel,
        )?;
        let shape = DnShape {
            n_k: cfg.dn_k_heads,
            n_v: hv,
            dk: cfg.dn_k_dim,
            dv: cfg.dn_v_dim,
        };
        let rec = DnRecurrent {
            c: s.c.ptr,
            b: s.b.ptr,
            a: s.a.ptr,
            ba_stride: hv,
            a_log: dnw.a_log.ptr,
            dt_bias: dnw.dt_bias.ptr,
            state,
            o: s.dn_o.ptr,
            qk: s.dn_qk.ptr,
            ab: s.dn_ab.ptr,
        };
        ops::dn_recurrent(gpu, shape, &rec, n)?;
        ops::dn_gated_norm(
            gpu,
            shape,
            s.dn_o.ptr,
            s.z.ptr,
            vd,
            dnw.norm.ptr,
            s.dn_y.ptr,
            n,
            cfg.rms_eps,
        )?;
        ops::linear(gpu, &dnw.out_proj, s.dn_y.ptr, vd, s.x.ptr, h, n, true)
    }

    /// MoE (MODEL.md §2.6): x += Σ_k w_k expert_k(xn) + sigmoid(gate·xn) shared(xn).
    pub fn moe(&self, m: &crate::weights::DevMoe, n: usize) -> Result<()> {
        let (gpu, cfg, s) = (self.gpu, self.cfg, self.scratch);
        let h = cfg.hidden;
        let (e, k, inter, sinter) = (cfg.n_experts, cfg.top_k, cfg.expert_inter, cfg.shared_inter);
        ops::linear_router(gpu, &m.router, s.xn.ptr, h, s.router.ptr, e, n)?;
        ops::moe_route(gpu, s.router.ptr, s.ids.ptr, s.route_w.ptr, n, e, k)?;
        let items = n * k;
        let tensor_cores = [&m.gate, &m.up, &m.down]
            .iter()
            .all(|w| ops::gemm_fits(gpu, w));
        if self.moe_grouped && n >= ops::TENSOR_CORE_MIN_TOK && tensor_cores {
            // Tiles of 64 items once experts average that many, else 32 (less padding).
            let tile = if items >= 48 * e { 64 } else { 32 };
            let (perm, tiles, nt, mt) = (s.perm.ptr, s.tiles.ptr, s.n_tiles.ptr, s.max_tiles);
            ops::moe_group(gpu, s.ids.ptr, items, e, tile, perm, tiles, nt)?;
            let (gate, up, down) = (&m.gate, &m.up, &m.down);
            ops::gemm_grouped(
                gpu, gate, tile, perm, tiles, nt, mt, s.xn.ptr, h, k, s.eg.ptr, inter,
            )?;
            ops::gemm_grouped(
                gpu, up, tile, perm, tiles, nt, mt, s.xn.ptr, h, k, s.eu.ptr, inter,
            )?;
            ops::silu_mul(gpu, s.eg.ptr, s.eu.ptr, s.eh.ptr, items * inter)?;
            ops::gemm_grouped(
                gpu, down, tile, perm, tiles, nt, mt, s.eh.ptr, inter, 1, s.ey.ptr, h,
            )?;
        } else if self.moe_grouped && n > 1 {
            let (perm, tiles, nt, mt) = (s.perm.ptr, s.tiles.ptr, s.n_tiles.ptr, s.max_tiles);
            let tile = ops::GROUP_TILE;
            ops::moe_group(gpu, s.ids.ptr, items, e, tile, perm, tiles, nt)?;
            ops::linear_grouped(
                gpu, &m.gate, perm, tiles, nt, mt, s.xn.ptr, h, k, s.eg.ptr, inter,
            )?;
            ops::linear_grouped(
                gpu, &m.up, perm, tiles, nt, mt, s.xn.ptr, h, k, s.eu.ptr, inter,
            )?;
            ops::silu_mul(gpu, s.eg.ptr, s.eu.ptr, s.eh.ptr, items * inter)?;
            ops::linear_grouped(
                gpu, &m.down, perm, tiles, nt, mt, s.eh.ptr, inter, 1, s.ey.ptr, h,
            )?;
        } else {
            ops::linear_gather(
                gpu, &m.gate, s.ids.ptr, s.xn.ptr, h, k, s.eg.ptr, inter, items,
            )?;
            ops::linear_gather(
                gpu, &m.up, s.ids.ptr, s.xn.ptr, h, k, s.eu.ptr, inter, items,
            )?;
            ops::silu_mul(gpu, s.eg.ptr, s.eu.ptr, s.eh.ptr, items * inter)?;
            ops::linear_gather(
                gpu, &m.down, s.ids.ptr, s.eh.ptr, inter, 1, s.ey.ptr, h, items,
            )?;
        }
        ops::linear(gpu, &m.shared_gate, s.xn.ptr, h, s.sg.ptr, sinter, n, false)?;
        ops::linear(gpu, &m.shared_up, s.xn.ptr, h, s.su.ptr, sinter, n, false)?;
        ops::silu_mul(gpu, s.sg.ptr, s.su.ptr, s.sh.ptr, n * sinter)?;
        ops::linear(gpu, &m.shared_down, s.sh.ptr, sinter, s.sy.ptr, h, n, false)?;
        ops::linear(
            gpu,
            &m.shared_expert_gate,
            s.xn.ptr,
            h,
            s.s_gate.ptr,
            1,
            n,
            false,
        )?;
        ops::moe_combine(
            gpu,
            s.x.ptr,
            s.ey.ptr,
            s.route_w.ptr,
            s.sy.ptr,
            s.s_gate.ptr,
            n,
            h,
            k,
        )
    }
}
