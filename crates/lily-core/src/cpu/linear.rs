//! `y = W x` for every stored form of W, multi-threaded over output rows. The 4/8-bit path is a
//! fused dot product: per group `scale · Σ qᵢxᵢ + bias · Σ xᵢ`, never materialising the row.
//! The same arithmetic runs for one token or many, so prefill and decode agree bit for bit.

use rayon::prelude::*;

use crate::weights::{read_bf16, Linear, WeightData};

/// `ys[t] = W xs[t]` for `t` tokens: `xs` is `[t, cols]`, the result `[t, rows]`.
pub fn matmul(w: &Linear, xs: &[f32]) -> Vec<f32> {
    let (rows, cols) = (w.rows, w.cols);
    debug_assert_eq!(w.experts, 1);
    debug_assert_eq!(xs.len() % cols, 0);
    let t = xs.len() / cols;
    // Row-major result per output row first (parallel over rows), then transposed to [t, rows].
    let mut by_row = vec![0f32; rows * t];
    match &w.data {
        WeightData::Affine {
            bits,
            group,
            packed,
            scales,
            biases,
        } => {
            let (bits, group) = (*bits as usize, *group);
            let groups = cols / group;
            let row_bytes = cols * bits / 8;
            // Σ x over each group, once per token: the bias term of the fused dot.
            let xsums: Vec<f32> = xs.chunks(group).map(|g| g.iter().sum()).collect();
            // 4-bit: each group's activations reordered once per token as [even | odd] halves, so
            // the low and high nibbles of consecutive bytes meet consecutive floats (vectorises).
            let xs = if bits == 4 {
                split_even_odd(xs, group)
            } else {
                xs.to_vec()
            };
            let (p, s, b) = (packed.bytes(), scales.bytes(), biases.bytes());
            if bits == 4 && t > 1 {
                // Several tokens: each row's nibbles are widened to f32 once (exact) and reused by
                // every token, with the very same products and sums as `dot_q4` (bit-identical
                // to the one-token path; ≈ 2–3× faster for prefill chunks and `score`).
                by_row.par_chunks_mut(t).enumerate().for_each_init(
                    || vec![0f32; cols],
                    |qf, (r, out)| {
                        let q = &p[r * row_bytes..(r + 1) * row_bytes];
                        let sc = &s[r * groups * 2..(r + 1) * groups * 2];
                        let bi = &b[r * groups * 2..(r + 1) * groups * 2];
                        widen_q4(q, group, qf);
                        let (sc, bi) = (bf16_row(sc, groups), bf16_row(bi, groups));
                        rows_q4_widened(qf, &sc, &bi, &xs, &xsums, group, out);
                    },
                );
            } else {
                by_row.par_chunks_mut(t).enumerate().for_each(|(r, out)| {
                    let q = &p[r * row_bytes..(r + 1) * row_bytes];
                    let sc = &s[r * groups * 2..(r + 1) * groups * 2];
                    let bi = &b[r * groups * 2..(r + 1) * groups * 2];
                    for (ti, o) in out.iter_mut().enumerate() {
                        let x = &xs[ti * cols..(ti + 1) * cols];
                        let xs_g = &xsums[ti * groups..(ti + 1) * groups];
                        let mut acc = 0f32;
                        for g in 0..groups {
                            let xg = &x[g * group..(g + 1) * group];
                            let qg = &q[g * group * bits / 8..(g + 1) * group * bits / 8];
                            let dot = if bits == 4 {
                                let (xe, xo) = xg.split_at(group / 2);
                                dot_q4(qg, xe, xo)
                            } else {
                                dot_q8(qg, xg)
                            };
                            acc += read_bf16(sc, g) * dot + read_bf16(bi, g) * xs_g[g];
                        }
                        *o = acc;
                    }
                });
            }
        }
        WeightData::Bf16 { data } => {
            let d = data.bytes();
            by_row.par_chunks_mut(t).enumerate().for_each_init(
                || vec![0f32; cols],
                |row, (r, out)| {
                    let src = &d[r * cols * 2..(r + 1) * cols * 2];
                    for (c, v) in row.iter_mut().enumerate() {
                        *v = read_bf16(src, c);
                    }
                    for (ti, o) in out.iter_mut().enumerate() {
                        *o = dot(row, &xs[ti * cols..(ti + 1) * cols]);
                    }
                },
            );
        }
    }
    let mut ys = vec![0f32; t * rows];
    for r in 0..rows {
        for ti in 0..t {
            ys[ti * rows + r] = by_row[r * t + ti];
        }
    }
    ys
}

#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight partial sums: lets the compiler vectorise, and fixes the summation order.
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// Each group of `group` values as its even-indexed then odd-indexed elements.
fn split_even_odd(xs: &[f32], group: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(xs.len());
    for g in xs.chunks(group) {
        out.extend(g.iter().step_by(2));
        out.extend(g.iter().skip(1).step_by(2));
    }
    out
}

/// Σ qᵢxᵢ over one 4-bit group: byte j holds element 2j (low nibble) and 2j+1 (high nibble);
/// `xe`/`xo` are the group's even and odd activations.
#[inline]
fn dot_q4(q: &[u8], xe: &[f32], xo: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for ((qc, ec), oc) in q
        .chunks_exact(8)
        .zip(xe.chunks_exact(8))
        .zip(xo.chunks_exact(8))
    {
        for j in 0..8 {
            acc[j] += (qc[j] & 0xF) as f32 * ec[j] + (qc[j] >> 4) as f32 * oc[j];
        }
    }
    acc.iter().sum()
}

/// One row's 4-bit values as f32, each group laid out as `dot_q4` reads it: the low nibbles
/// (even elements) then the high nibbles (odd elements).
fn widen_q4(q: &[u8], group: usize, out: &mut [f32]) {
    for (qg, og) in q.chunks(group / 2).zip(out.chunks_mut(group)) {
        let (oe, oo) = og.split_at_mut(group / 2);
        for ((byte, e), o) in qg.iter().zip(oe).zip(oo) {
            *e = (byte & 0xF) as f32;
            *o = (byte >> 4) as f32;
        }
    }
}

/// One row's `groups` bf16 values (scales or biases) as f32.
fn bf16_row(bytes: &[u8], groups: usize) -> Vec<f32> {
    (0..groups).map(|g| read_bf16(bytes, g)).collect()
}

/// `out[ti] = Σ_g sc[g]·dot(q_g, x_ti,g) + bi[g]·Σx_ti,g` for every token of `xs` (`[t, cols]`,
/// each group split even/odd) against one row widened by `widen_q4`: the arithmetic of the
/// one-token path exactly, four tokens at a time so that their independent sums overlap and each
/// widened weight is loaded once for the four.
fn rows_q4_widened(
    qf: &[f32],
    sc: &[f32],
    bi: &[f32],
    xs: &[f32],
    xsums: &[f32],
    group: usize,
    out: &mut [f32],
) {
    let cols = qf.len();
    let groups = cols / group;
    let half = group / 2;
    let t = out.len();
    let mut ti = 0;
    while ti + 4 <= t {
        let x: [&[f32]; 4] = std::array::from_fn(|k| &xs[(ti + k) * cols..(ti + k + 1) * cols]);
        let mut acc = [0f32; 4];
        for g in 0..groups {
            let (qe, qo) = qf[g * group..(g + 1) * group].split_at(half);
            let dots = if half == 32 {
                dot_q4f_x4::<32>(qe, qo, x.map(|x| &x[g * group..(g + 1) * group]))
            } else {
                x.map(|x| {
                    let (xe, xo) = x[g * group..(g + 1) * group].split_at(half);
                    dot_q4f(qe, qo, xe, xo)
                })
            };
            for k in 0..4 {
                acc[k] += sc[g] * dots[k] + bi[g] * xsums[(ti + k) * groups + g];
            }
        }
        out[ti..ti + 4].copy_from_slice(&acc);
        ti += 4;
    }
    for (ti, o) in out.iter_mut().enumerate().skip(ti) {
        let x = &xs[ti * cols..(ti + 1) * cols];
        let mut acc = 0f32;
        for g in 0..groups {
            let (qe, qo) = qf[g * group..(g + 1) * group].split_at(half);
            let (xe, xo) = x[g * group..(g + 1) * group].split_at(half);
            acc += sc[g] * dot_q4f(qe, qo, xe, xo) + bi[g] * xsums[ti * groups + g];
        }
        *o = acc;
    }
}

/// `dot_q4f` for four tokens' groups (`xg`: each `[even | odd]`, 2·H values) at once, H = half
/// the group, known at compile time: each token's sums in `dot_q4f`'s exact order.
#[inline]
fn dot_q4f_x4<const H: usize>(qe: &[f32], qo: &[f32], xg: [&[f32]; 4]) -> [f32; 4] {
    let (qe, qo) = (&qe[..H], &qo[..H]);
    let xg = xg.map(|x| &x[..2 * H]);
    let mut acc = [[0f32; 8]; 4];
    for c in 0..H / 8 {
        let (qe8, qo8) = (&qe[c * 8..c * 8 + 8], &qo[c * 8..c * 8 + 8]);
        for k in 0..4 {
            let (xe8, xo8) = (&xg[k][c * 8..c * 8 + 8], &xg[k][H + c * 8..H + c * 8 + 8]);
            for j in 0..8 {
                acc[k][j] += qe8[j] * xe8[j] + qo8[j] * xo8[j];
            }
        }
    }
    acc.map(|a| a.iter().sum())
}

/// `dot_q4` on nibbles already widened to f32 (`widen_q4`): the same products in the same order.
#[inline]
fn dot_q4f(qe: &[f32], qo: &[f32], xe: &[f32], xo: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for (((qec, qoc), ec), oc) in qe
        .chunks_exact(8)
        .zip(qo.chunks_exact(8))
        .zip(xe.chunks_exact(8))
        .zip(xo.chunks_exact(8))
    {
        for j in 0..8 {
            acc[j] += qec[j] * ec[j] + qoc[j] * oc[j];
        }
    }
    acc.iter().sum()
}

#[inline]
fn dot_q8(q: &[u8], x: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for (qb, xc) in q.chunks_exact(8).zip(x.chunks_exact(8)) {
        for j in 0..8 {
            acc[j] += qb[j] as f32 * xc[j];
        }
    }
    acc.iter().sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::quantize_linear;
    use crate::weights::Blob;

    fn rand_vec(n: usize, seed: &mut u64) -> Vec<f32> {
        (0..n)
            .map(|_| {
                *seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// A rows × cols bf16 matrix of random values in [-1, 1).
    fn random_bf16(rows: usize, cols: usize, seed: &mut u64) -> Linear {
        let bytes: Vec<u8> = rand_vec(rows * cols, seed)
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes())
            .collect();
        Linear {
            experts: 1,
            rows,
            cols,
            data: WeightData::Bf16 {
                data: Blob::owned(bytes),
            },
        }
    }

    /// Throughput of the 4-bit path, one token at a time against 64 at once (not a CI assertion:
    /// `cargo test --release -p lily-core q4_matmul_throughput -- --ignored --nocapture`).
    #[test]
    #[ignore]
    fn q4_matmul_throughput() {
        let mut seed = 5;
        let (rows, cols, t) = (2048, 2048, 64);
        let dense = random_bf16(rows, cols, &mut seed);
        let q = quantize_linear(&dense, 4, 64);
        let xs = rand_vec(t * cols, &mut seed);
        for _ in 0..2 {
            let s = std::time::Instant::now();
            for ti in 0..t {
                std::hint::black_box(matmul(&q, &xs[ti * cols..(ti + 1) * cols]));
            }
            let one = s.elapsed().as_secs_f64();
            let s = std::time::Instant::now();
            std::hint::black_box(matmul(&q, &xs));
            let many = s.elapsed().as_secs_f64();
            let macs = (rows * cols * t) as f64;
            println!(
                "one token at a time {:.2} G MAC/s, {t} at once {:.2} G MAC/s",
                macs / one / 1e9,
                macs / many / 1e9
            );
        }
    }

    #[test]
    fn many_tokens_give_the_one_token_results_bit_for_bit() {
        // Prefill (many tokens, widened nibbles) and decode (one token) must agree exactly:
        // prefix reuse and chunked prefill compare logits with `==`.
        let mut seed = 11;
        let (rows, cols, t) = (7, 256, 5);
        let dense = random_bf16(rows, cols, &mut seed);
        let xs = rand_vec(t * cols, &mut seed);
        // Group 64: the compile-time four-token kernel; 32: its general form.
        for (bits, group) in [(4, 64), (4, 32), (8, 64)] {
            let q = quantize_linear(&dense, bits, group);
            let all = matmul(&q, &xs);
            for ti in 0..t {
                let one = matmul(&q, &xs[ti * cols..(ti + 1) * cols]);
                for r in 0..rows {
                    assert_eq!(
                        all[ti * rows + r].to_bits(),
                        one[r].to_bits(),
                        "bits {bits} group {group} token {ti} row {r}"
                    );
                }
            }
        }
    }

    #[test]
    fn fused_quantised_matmul_equals_dequantised_dot() {
        let mut seed = 3;
        let (rows, cols, t) = (24, 192, 3);
        let dense = random_bf16(rows, cols, &mut seed);
        let xs = rand_vec(t * cols, &mut seed);
        for bits in [4, 8] {
            let q = quantize_linear(&dense, bits, 64);
            let ys = matmul(&q, &xs);
            let mut row = vec![0f32; cols];
            for r in 0..rows {
                q.dequant_row(r, &mut row);
                for ti in 0..t {
                    let want: f64 = row
                        .iter()
                        .zip(&xs[ti * cols..])
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum();
                    let got = ys[ti * rows + r] as f64;
                    assert!(
                        (got - want).abs() < 1e-4 * (1.0 + want.abs()),
                        "bits {bits} r {r} t {ti}: {got} vs {want}"
                    );
                }
            }
        }
        // And the bf16 path against an f64 dot of the bf16 values.
        let ys = matmul(&dense, &xs);
        let mut row = vec![0f32; cols];
        dense.dequant_row(5, &mut row);
        let want: f64 = row
            .iter()
            .zip(&xs[cols..])
            .map(|(a, b)| *a as f64 * *b as f64)
            .sum();
        assert!((ys[rows + 5] as f64 - want).abs() < 1e-4);
    }
}
