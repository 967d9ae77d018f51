//! The model's steps, one function each, in the words and order of docs/MODEL.md §2.
//! Activations are f32 `[T, features]` row-major for a chunk of T consecutive tokens.
//! These are also the references the CUDA kernels are tested against.

use rayon::prelude::*;

use super::linear::{dot, matmul};
use crate::config::ModelConfig;
use crate::weights::{AttentionWeights, DeltaNetWeights, Linear, MoeWeights};

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// torch's softplus (threshold 20: linear above).
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// RMSNorm of each `w.len()`-wide row: `x · rsqrt(mean(x²) + eps) · w` (MODEL.md §2.2; the +1 of
/// zero-centred norms is already folded into `w` at load).
pub fn rms_norm(xs: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mut out = xs.to_vec();
    rms_norm_in_place(&mut out, w, eps);
    out
}

pub fn rms_norm_in_place(xs: &mut [f32], w: &[f32], eps: f32) {
    for row in xs.chunks_mut(w.len()) {
        let ms = row.iter().map(|v| v * v).sum::<f32>() / row.len() as f32;
        let r = 1.0 / (ms + eps).sqrt();
        for (v, g) in row.iter_mut().zip(w) {
            *v = *v * r * g;
        }
    }
}

/// `x · rsqrt(Σx² + 1e-6)` (the DeltaNet q/k normalisation, MODEL.md §2.5 step 4).
pub fn l2_norm_in_place(x: &mut [f32]) {
    let r = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() + 1e-6).sqrt();
    x.iter_mut().for_each(|v| *v *= r);
}

/// NeoX-style rotary embedding on the first `rotary_dim` dims of one head (MODEL.md §2.4 step 4).
pub fn rope_in_place(head: &mut [f32], pos: usize, rotary_dim: usize, theta: f64) {
    let half = rotary_dim / 2;
    for i in 0..half {
        let inv_freq = 1.0 / theta.powf(2.0 * i as f64 / rotary_dim as f64);
        let angle = pos as f64 * inv_freq;
        let (sin, cos) = (angle.sin() as f32, angle.cos() as f32);
        let (a, b) = (head[i], head[i + half]);
        head[i] = a * cos - b * sin;
        head[i + half] = b * cos + a * sin;
    }
}

/// How a KV cache keeps its rows (MODEL.md §2.4, "The KV cache's formats").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvFormat {
    /// Each value as computed (f32 here; the GPU backends' bf16 / f16 / f32 caches).
    #[default]
    Full,
    /// Each value rounded to bf16 (round to nearest even): what CUDA's default cache holds.
    Bf16,
    /// Each `D`-wide row (one position, one KV head) as int8 with one f32 scale: the values
    /// `kv_int8_row` gives.
    Int8Row,
}

/// Post-norm, post-RoPE keys and values of one attention layer: `[len, Hkv, D]` each, in
/// `format` (an `Int8Row` cache holds the dequantised values, `kv_int8_row`'s).
#[derive(Clone, Debug, Default)]
pub struct KvCache {
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub format: KvFormat,
}

/// One KV row in the int8 row format (MODEL.md §2.4): the scale `s = max|x| / 127` (f32) and
/// `q_i = round_half_even(x_i / s)` in −127..=127 (0 where the row is all zeros). Returns `s`
/// and writes `q` (as `i8`); the row's value is `q_i · s`. The GPU kernels store exactly
/// these: decode scales a key's dot product and a value's weight by `s` after the integer row
/// is read, so the row itself needs no conversion beyond int8 → the tensor cores' bf16 (exact).
pub fn kv_int8_encode(row: &[f32], q: &mut [i8]) -> f32 {
    let amax = row.iter().fold(0f32, |m, v| m.max(v.abs()));
    if amax == 0.0 || !amax.is_finite() {
        q.iter_mut().for_each(|v| *v = 0);
        return if amax.is_finite() { 0.0 } else { f32::NAN };
    }
    let s = amax / 127.0;
    for (o, &v) in q.iter_mut().zip(row) {
        *o = (v / s).round_ties_even().clamp(-127.0, 127.0) as i8;
    }
    s
}

/// The values an int8-row cache returns for `row`: `kv_int8_encode`'s `q_i · s`, in place.
pub fn kv_int8_row(row: &mut [f32]) {
    let mut q = vec![0i8; row.len()];
    let s = kv_int8_encode(row, &mut q);
    for (v, &qi) in row.iter_mut().zip(&q) {
        *v = qi as f32 * s;
    }
}

/// One sequence's rows in a batched pass: the next `len` rows of the activations are its tokens
/// at positions `pos0..pos0+len`, with its own KV cache.
pub struct AttentionSeq<'a> {
    pub kv: &'a mut KvCache,
    pub pos0: usize,
    pub len: usize,
}

/// Gated full attention for T tokens at positions `pos0..pos0+T` of one sequence (MODEL.md §2.4).
pub fn attention(
    c: &ModelConfig,
    w: &AttentionWeights,
    xn: &[f32],
    kv: &mut KvCache,
    pos0: usize,
) -> Vec<f32> {
    let len = xn.len() / c.hidden;
    attention_batch(c, w, xn, &mut [AttentionSeq { kv, pos0, len }])
}

/// Gated full attention for the rows of several sequences at once (MODEL.md §2.4): the
/// projections over every row (each weight read once), the attention itself per sequence over
/// its own cache and positions.
pub fn attention_batch(
    c: &ModelConfig,
    w: &AttentionWeights,
    xn: &[f32],
    seqs: &mut [AttentionSeq<'_>],
) -> Vec<f32> {
    let (hq, hkv, d) = (c.n_heads, c.n_kv_heads, c.head_dim);
    let t = xn.len() / c.hidden;
    // Each row's sequence and position.
    let rows: Vec<(usize, usize)> = seqs
        .iter()
        .enumerate()
        .flat_map(|(s, seq)| (0..seq.len).map(move |i| (s, seq.pos0 + i)))
        .collect();
    debug_assert_eq!(rows.len(), t);
    let qg = matmul(&w.q_proj, xn); // [T, Hq, 2D]: per head [query | gate]
    let mut k = matmul(&w.k_proj, xn); // [T, Hkv, D]
    let v = matmul(&w.v_proj, xn);
    let mut q = vec![0f32; t * hq * d];
    let mut gate = vec![0f32; t * hq * d];
    for ti in 0..t {
        for h in 0..hq {
            let src = &qg[(ti * hq + h) * 2 * d..];
            q[(ti * hq + h) * d..][..d].copy_from_slice(&src[..d]);
            gate[(ti * hq + h) * d..][..d].copy_from_slice(&src[d..2 * d]);
        }
    }
    for (i, head) in q.chunks_mut(d).enumerate() {
        rms_norm_in_place(head, &w.q_norm, c.rms_eps);
        rope_in_place(head, rows[i / hq].1, c.rotary_dim, c.rope_theta);
    }
    for (i, head) in k.chunks_mut(d).enumerate() {
        rms_norm_in_place(head, &w.k_norm, c.rms_eps);
        rope_in_place(head, rows[i / hkv].1, c.rotary_dim, c.rope_theta);
    }
    let mut row0 = 0;
    for seq in seqs.iter_mut() {
        let span = row0 * hkv * d..(row0 + seq.len) * hkv * d;
        let (k0, v0) = (seq.kv.k.len(), seq.kv.v.len());
        seq.kv.k.extend_from_slice(&k[span.clone()]);
        seq.kv.v.extend_from_slice(&v[span]);
        match seq.kv.format {
            KvFormat::Full => {}
            KvFormat::Bf16 => {
                let round = |x: &mut f32| *x = half::bf16::from_f32(*x).to_f32();
                seq.kv.k[k0..].iter_mut().for_each(round);
                seq.kv.v[v0..].iter_mut().for_each(round);
            }
            KvFormat::Int8Row => {
                seq.kv.k[k0..].chunks_mut(d).for_each(kv_int8_row);
                seq.kv.v[v0..].chunks_mut(d).for_each(kv_int8_row);
            }
        }
        row0 += seq.len;
    }
    let caches: Vec<&KvCache> = seqs.iter().map(|s| &*s.kv).collect();
    let scale = 1.0 / (d as f32).sqrt();
    let group = c.gqa_group();
    let mut o = vec![0f32; t * hq * d];
    o.par_chunks_mut(d).enumerate().for_each(|(i, out)| {
        let (ti, h) = (i / hq, i % hq);
        let (s, pos) = rows[ti];
        let kv = caches[s];
        let kvh = h / group;
        let qh = &q[i * d..(i + 1) * d];
        let n = pos + 1; // causal: keys 0..=pos
        let mut scores: Vec<f32> = (0..n)
            .map(|j| dot(qh, &kv.k[(j * hkv + kvh) * d..][..d]) * scale)
            .collect();
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        out.fill(0.0);
        for (j, s) in scores.iter().enumerate() {
            let p = s / sum;
            for (o, vv) in out.iter_mut().zip(&kv.v[(j * hkv + kvh) * d..][..d]) {
                *o += p * vv;
            }
        }
        for (o, g) in out.iter_mut().zip(&gate[i * d..(i + 1) * d]) {
            *o *= sigmoid(*g);
        }
    });
    matmul(&w.o_proj, &o)
}

/// Recurrent and conv state of one DeltaNet layer.
#[derive(Clone, Debug)]
pub struct DeltaNetState {
    /// `S` per value head, `[Hv, dk, dv]`, fp32.
    pub state: Vec<f32>,
    /// The last K−1 pre-conv rows of q|k|v, `[K−1, conv_dim]`, oldest first.
    pub conv: Vec<f32>,
}

impl DeltaNetState {
    pub fn new(c: &ModelConfig) -> Self {
        DeltaNetState {
            state: vec![0.0; c.dn_v_heads * c.dn_k_dim * c.dn_v_dim],
            conv: vec![0.0; (c.conv_kernel - 1) * c.conv_dim()],
        }
    }
}

/// Gated DeltaNet for T tokens of one sequence (MODEL.md §2.5), recurrent form.
pub fn deltanet(
    c: &ModelConfig,
    w: &DeltaNetWeights,
    xn: &[f32],
    st: &mut DeltaNetState,
) -> Vec<f32> {
    let len = xn.len() / c.hidden;
    deltanet_batch(c, w, xn, &mut [(st, len)])
}

/// Gated DeltaNet for the rows of several sequences at once (MODEL.md §2.5): `seqs` holds each
/// sequence's state and its number of rows, in row order. The projections run over every row
/// (each weight read once); the conv and the recurrence per sequence, on its own state.
pub fn deltanet_batch(
    c: &ModelConfig,
    w: &DeltaNetWeights,
    xn: &[f32],
    seqs: &mut [(&mut DeltaNetState, usize)],
) -> Vec<f32> {
    let t = xn.len() / c.hidden;
    let (hv, dv) = (c.dn_v_heads, c.dn_v_dim);
    let cd = c.conv_dim();
    let m = matmul(&w.in_qkv, xn); // [T, conv_dim]
    let z = matmul(&w.in_z, xn); // [T, Hv·dv]
    let b = matmul(&w.in_b, xn); // [T, Hv]
    let a = matmul(&w.in_a, xn); // [T, Hv]
    let mut o = vec![0f32; t * hv * dv];
    let mut row0 = 0;
    for (st, len) in seqs.iter_mut() {
        let rows = row0..row0 + *len;
        deltanet_recurrence(
            c,
            w,
            &m[rows.start * cd..rows.end * cd],
            &b[rows.start * hv..rows.end * hv],
            &a[rows.start * hv..rows.end * hv],
            st,
            &mut o[rows.start * hv * dv..rows.end * hv * dv],
        );
        row0 = rows.end;
    }
    // Step 8: gated RMSNorm per value head: w ⊙ norm(o) ⊙ silu(z).
    for (oh, zh) in o.chunks_mut(dv).zip(z.chunks(dv)) {
        rms_norm_in_place(oh, &w.norm, c.rms_eps);
        for (x, zz) in oh.iter_mut().zip(zh) {
            *x *= silu(*zz);
        }
    }
    matmul(&w.out_proj, &o)
}

/// Steps 2-7 of MODEL.md §2.5 for one sequence's consecutive rows: the projected `m` (q|k|v),
/// `b` and `a`, its state updated in place; the per-head outputs `o`, before the gated norm.
fn deltanet_recurrence(
    c: &ModelConfig,
    w: &DeltaNetWeights,
    m: &[f32],
    b: &[f32],
    a: &[f32],
    st: &mut DeltaNetState,
    o: &mut [f32],
) {
    let (cd, kk) = (c.conv_dim(), c.conv_kernel);
    let (hk, hv, dk, dv) = (c.dn_k_heads, c.dn_v_heads, c.dn_k_dim, c.dn_v_dim);
    let key_dim = c.dn_key_dim();
    let t = m.len() / cd;
    // Step 2: causal depthwise conv over [history; m], then SiLU.
    let mut hist = st.conv.clone();
    hist.extend_from_slice(m);
    let mut conv_out = vec![0f32; t * cd];
    for ti in 0..t {
        for ch in 0..cd {
            let taps = &w.conv[ch * kk..(ch + 1) * kk];
            let s: f32 = (0..kk).map(|j| taps[j] * hist[(ti + j) * cd + ch]).sum();
            conv_out[ti * cd + ch] = silu(s);
        }
    }
    st.conv.copy_from_slice(&hist[t * cd..]);

    let ratio = hv / hk;
    for ti in 0..t {
        let row = &conv_out[ti * cd..(ti + 1) * cd];
        // Steps 3-4: split and normalise q, k per key head.
        let mut q = row[..key_dim].to_vec();
        let mut k = row[key_dim..2 * key_dim].to_vec();
        let v = &row[2 * key_dim..];
        for h in 0..hk {
            l2_norm_in_place(&mut q[h * dk..(h + 1) * dk]);
            l2_norm_in_place(&mut k[h * dk..(h + 1) * dk]);
        }
        let qscale = 1.0 / (dk as f32).sqrt();
        q.iter_mut().for_each(|x| *x *= qscale);
        let out_t = &mut o[ti * hv * dv..(ti + 1) * hv * dv];
        st.state
            .par_chunks_mut(dk * dv)
            .zip(out_t.par_chunks_mut(dv))
            .enumerate()
            .for_each(|(h, (s, out))| {
                // Step 5: gates. Step 6: value head h reads key head h / ratio.
                let beta = sigmoid(b[ti * hv + h]);
                let g = -w.a_log[h].exp() * softplus(a[ti * hv + h] + w.dt_bias[h]);
                let alpha = g.exp();
                let kh = &k[(h / ratio) * dk..][..dk];
                let qh = &q[(h / ratio) * dk..][..dk];
                let vh = &v[h * dv..(h + 1) * dv];
                // Step 7: S ← αS; u = Sᵀk; δ = β(v − u); S ← S + kδᵀ; o = Sᵀq.
                s.iter_mut().for_each(|x| *x *= alpha);
                let mut delta = vec![0f32; dv];
                for (i, &ki) in kh.iter().enumerate() {
                    for (j, dj) in delta.iter_mut().enumerate() {
                        *dj += s[i * dv + j] * ki;
                    }
                }
                for (dj, vj) in delta.iter_mut().zip(vh) {
                    *dj = beta * (vj - *dj);
                }
                out.fill(0.0);
                for (i, (&ki, &qi)) in kh.iter().zip(qh).enumerate() {
                    let srow = &mut s[i * dv..(i + 1) * dv];
                    for (j, sv) in srow.iter_mut().enumerate() {
                        *sv += ki * delta[j];
                        out[j] += *sv * qi;
                    }
                }
            });
    }
}

/// Router: softmax over all experts, top-k, renormalised (MODEL.md §2.6). Returns (expert, weight)
/// pairs, highest probability first.
pub fn route(logits: &[f32], top_k: usize) -> Vec<(usize, f32)> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
    let sum: f32 = e.iter().sum();
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    idx.sort_by(|&i, &j| e[j].total_cmp(&e[i]).then(i.cmp(&j)));
    idx.truncate(top_k);
    let picked: f32 = idx.iter().map(|&i| e[i] / sum).sum();
    idx.into_iter().map(|i| (i, e[i] / sum / picked)).collect()
}

/// `Down( silu(Gate x) ⊙ Up x )` for a batch of rows.
pub fn swiglu_mlp(gate: &Linear, up: &Linear, down: &Linear, xs: &[f32]) -> Vec<f32> {
    let g = matmul(gate, xs);
    let u = matmul(up, xs);
    let act: Vec<f32> = g.iter().zip(&u).map(|(g, u)| silu(*g) * u).collect();
    matmul(down, &act)
}

/// The MoE block for T tokens: routed experts + sigmoid-gated shared expert (MODEL.md §2.6).
pub fn moe(c: &ModelConfig, w: &MoeWeights, xn: &[f32]) -> Vec<f32> {
    let h = c.hidden;
    let t = xn.len() / h;
    let router_logits = matmul(&w.router, xn);
    let mut by_expert: Vec<Vec<(usize, f32)>> = vec![Vec::new(); c.n_experts];
    for ti in 0..t {
        for (e, p) in route(
            &router_logits[ti * c.n_experts..(ti + 1) * c.n_experts],
            c.top_k,
        ) {
            by_expert[e].push((ti, p));
        }
    }
    let mut out = vec![0f32; t * h];
    for (e, tokens) in by_expert.iter().enumerate() {
        if tokens.is_empty() {
            continue;
        }
        let xs: Vec<f32> = tokens
            .iter()
            .flat_map(|(ti, _)| xn[ti * h..(ti + 1) * h].iter().copied())
            .collect();
        let y = swiglu_mlp(&w.gate.expert(e), &w.up.expert(e), &w.down.expert(e), &xs);
        for (k, (ti, p)) in tokens.iter().enumerate() {
            for (o, v) in out[ti * h..(ti + 1) * h]
                .iter_mut()
                .zip(&y[k * h..(k + 1) * h])
            {
                *o += p * v;
            }
        }
    }
    let shared = swiglu_mlp(&w.shared_gate, &w.shared_up, &w.shared_down, xn);
    let sgate = matmul(&w.shared_expert_gate, xn);
    for ti in 0..t {
        let s = sigmoid(sgate[ti]);
        for (o, v) in out[ti * h..(ti + 1) * h]
            .iter_mut()
            .zip(&shared[ti * h..(ti + 1) * h])
        {
            *o += s * v;
        }
    }
    out
}
