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

    #[test]
    fn fused_quantised_matmul_equals_dequantised_dot() {
        let mut seed = 3;
        let (rows, cols, t) = (24, 192, 3);
        let w = rand_vec(rows * cols, &mut seed);
        let bytes: Vec<u8> = w
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_bits().to_le_bytes())
            .collect();
        let dense = Linear {
            experts: 1,
            rows,
            cols,
            data: WeightData::Bf16 {
                data: Blob::owned(bytes),
            },
        };
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
