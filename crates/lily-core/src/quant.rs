//! MLX's affine quantiser (MODEL.md §3.4): used to write synthetic MLX checkpoints and to
//! quantise an HF bf16 checkpoint at load so both formats meet in one kernel set.

use half::bf16;
use rayon::prelude::*;

use crate::weights::{read_bf16, Blob, Linear, WeightData};

/// Quantises one row (`w.len()` a multiple of `group`), appending the packed bytes and the bf16
/// scales and biases (MLX's affine layout; readers must not assume a positive scale, as MLX's own
/// quantiser may write negative ones).
pub fn quantize_row(
    w: &[f32],
    bits: u32,
    group: usize,
    packed: &mut Vec<u8>,
    scales: &mut Vec<u8>,
    biases: &mut Vec<u8>,
) {
    assert!(
        bits == 4 || bits == 8,
        "only 4- and 8-bit affine quantisation is supported"
    );
    assert_eq!(w.len() % group, 0);
    let n_bins = ((1u32 << bits) - 1) as f32;
    let mut codes = Vec::with_capacity(group);
    for g in w.chunks(group) {
        let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
        for &x in g {
            lo = lo.min(x);
            hi = hi.max(x);
        }
        // Plain min-max affine: the format is MLX's (w = scale·q + bias); every value lands within
        // half a step of its code.
        let scale = ((hi - lo) / n_bins).max(1e-7);
        let bias = lo;
        // The kernels dequantise with the bf16-rounded scale and bias, so quantise against them.
        let (scale_b, bias_b) = (bf16::from_f32(scale), bf16::from_f32(bias));
        let (s, b) = (scale_b.to_f32(), bias_b.to_f32());
        codes.clear();
        codes.extend(
            g.iter()
                .map(|&x| ((x - b) / s).round().clamp(0.0, n_bins) as u8),
        );
        match bits {
            4 => packed.extend(codes.chunks(2).map(|p| p[0] | (p[1] << 4))),
            _ => packed.extend_from_slice(&codes),
        }
        scales.extend_from_slice(&scale_b.to_bits().to_le_bytes());
        biases.extend_from_slice(&bias_b.to_bits().to_le_bytes());
    }
}

/// Quantises a bf16 matrix (or stack) to `bits`-bit affine groups of `group`.
pub fn quantize_linear(lin: &Linear, bits: u32, group: usize) -> Linear {
    let WeightData::Bf16 { data } = &lin.data else {
        return lin.clone();
    };
    let cols = lin.cols;
    let n_rows = lin.experts * lin.rows;
    let bytes = data.bytes();
    let rows: Vec<(Vec<u8>, Vec<u8>, Vec<u8>)> = (0..n_rows)
        .into_par_iter()
        .map(|r| {
            let row = &bytes[r * cols * 2..(r + 1) * cols * 2];
            let w: Vec<f32> = (0..cols).map(|c| read_bf16(row, c)).collect();
            let (mut p, mut s, mut b) = (Vec::new(), Vec::new(), Vec::new());
            quantize_row(&w, bits, group, &mut p, &mut s, &mut b);
            (p, s, b)
        })
        .collect();
    let (mut packed, mut scales, mut biases) = (Vec::new(), Vec::new(), Vec::new());
    for (p, s, b) in rows {
        packed.extend(p);
        scales.extend(s);
        biases.extend(b);
    }
    Linear {
        experts: lin.experts,
        rows: lin.rows,
        cols,
        data: WeightData::Affine {
            bits,
            group,
            packed: Blob::owned(packed),
            scales: Blob::owned(scales),
            biases: Blob::owned(biases),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    #[test]
    fn quantised_rows_dequantise_within_half_a_step() {
        let mut seed = 7;
        for bits in [4u32, 8] {
            let w: Vec<f32> = (0..256).map(|_| lcg(&mut seed) * 0.3).collect();
            let (mut p, mut s, mut b) = (Vec::new(), Vec::new(), Vec::new());
            quantize_row(&w, bits, 64, &mut p, &mut s, &mut b);
            assert_eq!(p.len(), 256 * bits as usize / 8);
            let lin = Linear {
                experts: 1,
                rows: 1,
                cols: 256,
                data: WeightData::Affine {
                    bits,
                    group: 64,
                    packed: Blob::owned(p),
                    scales: Blob::owned(s.clone()),
                    biases: Blob::owned(b),
                },
            };
            let mut out = vec![0.0; 256];
            lin.dequant_row(0, &mut out);
            for g in 0..4 {
                let step = read_bf16(&s, g).abs();
                for i in g * 64..(g + 1) * 64 {
                    assert!(
                        (out[i] - w[i]).abs() <= 0.5 * step + 0.01 * 15.0 * step,
                        "bits {bits} elem {i}: {} vs {}",
                        out[i],
                        w[i]
                    );
                }
            }
        }
    }
}
