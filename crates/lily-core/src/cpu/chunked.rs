//! The gated delta rule in chunks (the "WY" or UT-transform form): the same recurrence as
//! `ops::deltanet_recurrence`'s step 7 (MODEL.md §2.5), rewritten so that a chunk of C tokens is a
//! handful of small matrix products instead of C dependent rank-one updates. This is the
//! specification the GPUs' chunked prefill scans implement on their matrix units (issue 31); the
//! tests below hold it equal to the token-by-token recurrence, and the GPU tests can take it as
//! their reference. The CPU backend itself keeps the token-by-token form: by FLOPs its scan is
//! under 2 % of a CPU prefill step at the full shape, and it is the readable one.
//!
//! One value head, its state S (dk × dv) at the chunk's start S₀, tokens t = 1..C with key k_t,
//! query q_t (dk), value v_t (dv), write strength β_t and decay α_t = e^{g_t} (g_t ≤ 0). Token by
//! token:
//!
//! ```text
//! S ← α_t S;   δ_t = β_t (v_t − Sᵀ k_t);   S ← S + k_t δ_tᵀ;   o_t = Sᵀ q_t
//! ```
//!
//! Write G_t = g_1 + … + g_t (G_0 = 0) and D(t, s) = e^{G_t − G_s} ≤ 1 for s ≤ t: the decay from
//! just after token s to just after token t. Unrolled, S_t = e^{G_t} S₀ + Σ_{s ≤ t} D(t, s) k_s δ_sᵀ, so
//!
//! ```text
//! δ_t = β_t v_t − β_t e^{G_t} S₀ᵀ k_t − Σ_{s < t} β_t D(t, s) (k_t · k_s) δ_s
//! ```
//!
//! With A strictly lower triangular, A[t, s] = β_t D(t, s) (k_t · k_s), and the rows of Δ, V, K
//! being δ_tᵀ, v_tᵀ, k_tᵀ: (I + A) Δ = diag(β) V − diag(β e^{G}) K S₀. I + A is unit lower
//! triangular; its inverse T comes from forward substitution (C³/6 multiply-adds), and
//!
//! ```text
//! U = T diag(β) V             (C × dv)     W = T diag(β e^{G}) K    (C × dk)
//! Δ = U − W S₀                (C × dv)
//! O = diag(e^{G}) Q S₀ + (M ∘ Q Kᵀ) Δ      M[t, s] = D(t, s) for s ≤ t, else 0
//! S_C = e^{G_C} S₀ + Kᵀ diag(D(C, ·)) Δ
//! ```
//!
//! Every exponent is a difference G_t − G_s with s ≤ t (or G_t itself), never positive: no
//! overflow however strong the decay, which is why the decays are carried as sums of logarithms.

/// One value head's inputs over T tokens, row-major: `q`, `k` [T, dk], `v` [T, dv], `beta` and
/// `log_alpha` [T] (β_t and g_t = ln α_t ≤ 0, as `ops::deltanet_recurrence` computes them from the
/// `b` and `a` projections).
pub struct HeadInputs<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub beta: &'a [f32],
    pub log_alpha: &'a [f32],
}

/// Runs one head's T tokens through the gated delta rule in chunks of at most `chunk` tokens:
/// `state` (S, [dk, dv], row i = key dimension i) is updated in place and `out` ([T, dv]) gets
/// o_t = S_tᵀ q_t for each token. Equal to the token-by-token recurrence up to rounding.
pub fn scan(
    x: &HeadInputs,
    dk: usize,
    dv: usize,
    chunk: usize,
    state: &mut [f32],
    out: &mut [f32],
) {
    let t_all = x.beta.len();
    assert!(chunk > 0, "a chunk holds at least one token");
    assert_eq!(x.q.len(), t_all * dk);
    assert_eq!(x.k.len(), t_all * dk);
    assert_eq!(x.v.len(), t_all * dv);
    assert_eq!(x.log_alpha.len(), t_all);
    assert_eq!(state.len(), dk * dv);
    assert_eq!(out.len(), t_all * dv);
    let mut t0 = 0;
    while t0 < t_all {
        let c = chunk.min(t_all - t0);
        let head = HeadInputs {
            q: &x.q[t0 * dk..(t0 + c) * dk],
            k: &x.k[t0 * dk..(t0 + c) * dk],
            v: &x.v[t0 * dv..(t0 + c) * dv],
            beta: &x.beta[t0..t0 + c],
            log_alpha: &x.log_alpha[t0..t0 + c],
        };
        one_chunk(&head, dk, dv, state, &mut out[t0 * dv..(t0 + c) * dv]);
        t0 += c;
    }
}

/// Row t of a row-major matrix of width w.
fn rows(t: usize, w: usize) -> std::ops::Range<usize> {
    t * w..(t + 1) * w
}

/// Σ_i a[i] b[i].
fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// One chunk of C tokens (the module comment's equations, in their order).
fn one_chunk(x: &HeadInputs, dk: usize, dv: usize, s0: &mut [f32], out: &mut [f32]) {
    let c = x.beta.len();
    let (q, k, v) = (x.q, x.k, x.v);
    // G_t, cumulative within the chunk.
    let mut g = vec![0f32; c];
    let mut acc = 0f32;
    for (gt, la) in g.iter_mut().zip(x.log_alpha) {
        acc += la;
        *gt = acc;
    }
    let decay = |t: usize, s: usize| (g[t] - g[s]).exp();
    // T = (I + A)⁻¹ by forward substitution: row t of T is e_t − Σ_{s<t} A[t, s] T[s, ·].
    let mut tm = vec![0f32; c * c];
    for t in 0..c {
        tm[t * c + t] = 1.0;
        for s in 0..t {
            let a_ts = x.beta[t] * decay(t, s) * dot(&k[rows(t, dk)], &k[rows(s, dk)]);
            if a_ts == 0.0 {
                continue;
            }
            // Row s of T is zero past column s.
            for j in 0..=s {
                tm[t * c + j] -= a_ts * tm[s * c + j];
            }
        }
    }
    // U = T diag(β) V; W = T diag(β e^G) K.
    let mut u = vec![0f32; c * dv];
    let mut w = vec![0f32; c * dk];
    for t in 0..c {
        for s in 0..=t {
            let ts = tm[t * c + s];
            if ts == 0.0 {
                continue;
            }
            let (bu, bw) = (ts * x.beta[s], ts * x.beta[s] * g[s].exp());
            for (ui, vi) in u[t * dv..(t + 1) * dv].iter_mut().zip(&v[rows(s, dv)]) {
                *ui += bu * vi;
            }
            for (wi, ki) in w[t * dk..(t + 1) * dk].iter_mut().zip(&k[rows(s, dk)]) {
                *wi += bw * ki;
            }
        }
    }
    // Δ = U − W S₀.
    let mut delta = u;
    for t in 0..c {
        let (wt, dt) = (&w[rows(t, dk)], &mut delta[t * dv..(t + 1) * dv]);
        for (i, &wi) in wt.iter().enumerate() {
            for (dj, sj) in dt.iter_mut().zip(&s0[i * dv..(i + 1) * dv]) {
                *dj -= wi * sj;
            }
        }
    }
    // O = diag(e^G) Q S₀ + (M ∘ Q Kᵀ) Δ.
    for t in 0..c {
        let qt = &q[rows(t, dk)];
        let ot = &mut out[t * dv..(t + 1) * dv];
        ot.fill(0.0);
        let gt = g[t].exp();
        for (i, &qi) in qt.iter().enumerate() {
            for (oj, sj) in ot.iter_mut().zip(&s0[i * dv..(i + 1) * dv]) {
                *oj += gt * qi * sj;
            }
        }
        for s in 0..=t {
            let m = decay(t, s) * dot(qt, &k[rows(s, dk)]);
            for (oj, dj) in ot.iter_mut().zip(&delta[s * dv..(s + 1) * dv]) {
                *oj += m * dj;
            }
        }
    }
    // S_C = e^{G_C} S₀ + Kᵀ diag(D(C, ·)) Δ.
    let last = c - 1;
    let gc = g[last].exp();
    s0.iter_mut().for_each(|x| *x *= gc);
    for s in 0..c {
        let d = decay(last, s);
        let (ks, ds) = (&k[rows(s, dk)], &delta[s * dv..(s + 1) * dv]);
        for (i, &ki) in ks.iter().enumerate() {
            let f = d * ki;
            for (sj, dj) in s0[i * dv..(i + 1) * dv].iter_mut().zip(ds) {
                *sj += f * dj;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{scan, HeadInputs};

    /// A small deterministic generator (xorshift), uniform in [-1, 1).
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> f32 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
        fn vec(&mut self, n: usize) -> Vec<f32> {
            (0..n).map(|_| self.next()).collect()
        }
    }

    /// Unit-length rows (the model l2-normalises q and k per head before the scan).
    fn unit_rows(x: &mut [f32], w: usize) {
        for r in x.chunks_mut(w) {
            let n = r.iter().map(|v| v * v).sum::<f32>().sqrt().max(1e-6);
            r.iter_mut().for_each(|v| *v /= n);
        }
    }

    struct Head {
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        beta: Vec<f32>,
        log_alpha: Vec<f32>,
        s0: Vec<f32>,
    }

    /// T random tokens of one head; decays ln α uniform in [-decay, 0], β in (0, 1).
    fn head(seed: u64, t: usize, dk: usize, dv: usize, decay: f32) -> Head {
        let mut r = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let (mut q, mut k) = (r.vec(t * dk), r.vec(t * dk));
        unit_rows(&mut q, dk);
        unit_rows(&mut k, dk);
        let scale = 1.0 / (dk as f32).sqrt();
        q.iter_mut().for_each(|x| *x *= scale);
        Head {
            q,
            k,
            v: r.vec(t * dv),
            beta: (0..t)
                .map(|_| 1.0 / (1.0 + (-3.0 * r.next()).exp()))
                .collect(),
            log_alpha: (0..t).map(|_| -decay * (r.next() + 1.0) / 2.0).collect(),
            s0: r.vec(dk * dv),
        }
    }

    /// The token-by-token recurrence, written here from MODEL.md §2.5 step 7 in f64: the
    /// reference the chunked form must equal.
    fn sequential(h: &Head, dk: usize, dv: usize) -> (Vec<f64>, Vec<f64>) {
        let t_all = h.beta.len();
        let mut s: Vec<f64> = h.s0.iter().map(|&x| x as f64).collect();
        let mut out = vec![0f64; t_all * dv];
        for t in 0..t_all {
            let alpha = (h.log_alpha[t] as f64).exp();
            s.iter_mut().for_each(|x| *x *= alpha);
            let k = &h.k[t * dk..(t + 1) * dk];
            let q = &h.q[t * dk..(t + 1) * dk];
            let v = &h.v[t * dv..(t + 1) * dv];
            let mut delta = vec![0f64; dv];
            for j in 0..dv {
                let u: f64 = (0..dk).map(|i| s[i * dv + j] * k[i] as f64).sum();
                delta[j] = h.beta[t] as f64 * (v[j] as f64 - u);
            }
            for i in 0..dk {
                for j in 0..dv {
                    s[i * dv + j] += k[i] as f64 * delta[j];
                }
            }
            for j in 0..dv {
                out[t * dv + j] = (0..dk).map(|i| s[i * dv + j] * q[i] as f64).sum();
            }
        }
        (out, s)
    }

    /// max |got − want| / max |want|.
    fn rel_err(got: &[f32], want: &[f64]) -> f64 {
        let scale = want.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-30);
        got.iter()
            .zip(want)
            .fold(0f64, |m, (g, w)| m.max((*g as f64 - w).abs()))
            / scale
    }

    fn chunked(h: &Head, dk: usize, dv: usize, chunk: usize) -> (Vec<f32>, Vec<f32>) {
        let t = h.beta.len();
        let mut state = h.s0.clone();
        let mut out = vec![f32::NAN; t * dv];
        let x = HeadInputs {
            q: &h.q,
            k: &h.k,
            v: &h.v,
            beta: &h.beta,
            log_alpha: &h.log_alpha,
        };
        scan(&x, dk, dv, chunk, &mut state, &mut out);
        (out, state)
    }

    #[test]
    fn chunks_of_any_size_give_the_token_by_token_recurrence() {
        let (dk, dv, t) = (16, 24, 150);
        for (seed, decay) in [(1u64, 0.05f32), (2, 1.0), (3, 8.0)] {
            let h = head(seed, t, dk, dv, decay);
            let (want_out, want_state) = sequential(&h, dk, dv);
            // 1: the recurrence itself; 7 and 64: ragged last chunks; 200: one chunk.
            for chunk in [1, 7, 16, 32, 64, 200] {
                let (out, state) = chunked(&h, dk, dv, chunk);
                let (eo, es) = (rel_err(&out, &want_out), rel_err(&state, &want_state));
                assert!(
                    eo < 2e-5 && es < 2e-5,
                    "decay {decay}, chunk {chunk}: outputs {eo:.2e}, state {es:.2e} from the recurrence"
                );
            }
        }
    }

    #[test]
    fn the_model_head_shape_agrees_at_the_gpu_chunk_sizes() {
        // Qwen3.6's DeltaNet heads: dk = dv = 128.
        let (dk, dv, t) = (128, 128, 96);
        let h = head(11, t, dk, dv, 2.0);
        let (want_out, want_state) = sequential(&h, dk, dv);
        for chunk in [16, 32, 64] {
            let (out, state) = chunked(&h, dk, dv, chunk);
            let (eo, es) = (rel_err(&out, &want_out), rel_err(&state, &want_state));
            assert!(
                eo < 2e-5 && es < 2e-5,
                "chunk {chunk}: outputs {eo:.2e}, state {es:.2e} from the recurrence"
            );
        }
    }

    #[test]
    fn a_wrong_decay_or_write_strength_is_caught() {
        // The comparison has teeth: the same inputs with one token's gate changed disagree.
        let (dk, dv, t) = (16, 16, 40);
        let h = head(5, t, dk, dv, 1.0);
        let (want_out, _) = sequential(&h, dk, dv);
        let mut bent = head(5, t, dk, dv, 1.0);
        bent.log_alpha[17] -= 0.1;
        let (out, _) = chunked(&bent, dk, dv, 16);
        assert!(rel_err(&out, &want_out) > 1e-3);
        let mut bent = head(5, t, dk, dv, 1.0);
        bent.beta[30] *= 0.9;
        let (out, _) = chunked(&bent, dk, dv, 16);
        assert!(rel_err(&out, &want_out) > 1e-4);
    }
}
