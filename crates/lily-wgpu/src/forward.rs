//! One chunk of tokens through the whole model on the GPU, step for step as the CPU reference
//! (lily-core/src/cpu/mod.rs `forward`, MODEL.md §2): embedding, per layer RMSNorm → gated
//! attention or Gated DeltaNet → residual, RMSNorm → MoE → residual, final norm, lm_head.
//! Activations are fp32; every dispatch of the chunk goes into one submission.

use anyhow::{bail, Result};
use lily_core::config::{LayerKind, ModelConfig};

use crate::gpu::{grid_2d, Gpu, Kernel, Prepared, Recorder};
use crate::kernels::{gqa_group, Kernels};
use crate::weights::{
    Fused, GpuAttention, GpuDeltaNet, GpuLinear, GpuMixer, GpuModel, GpuMoe, Slice,
};

type Buf = wgpu::Buffer;

/// Output rows one `linear` workgroup computes (linear.wgsl's `ROWS`).
const LINEAR_ROWS: usize = 8;

/// Most workgroups of argmax_part.wgsl.
const ARGMAX_PARTS: usize = 1024;

/// Items per tile of linear_q4_mm.wgsl (its `TT`).
const MM_TILE: usize = 16;
/// Items per tile of linear_q4_mm_coop.wgsl and linear_q4_mm_t32.wgsl (their `TT`; their rows
/// per workgroup are `MM_ROWS`).
const MM_TILE_COOP: usize = 32;
/// Rows per workgroup of a tiled product kernel (linear_q4_mm or linear_q4_mm_coop: both 64).
fn mm_rows(_kernel: &Kernel) -> usize {
    MM_ROWS
}

/// Items per tile of a tiled product kernel (linear_q4_mm, linear_q4_mm_t32 in its place, or
/// linear_q4_mm_coop).
fn mm_tile(kernel: &Kernel) -> usize {
    if kernel.name == "linear_q4_mm_coop" || kernel.name == "linear_q4_mm_t32" {
        MM_TILE_COOP
    } else {
        MM_TILE
    }
}
/// Rows per workgroup of linear_q4_mm.wgsl and linear_q4_mm_coop.wgsl (their `RT`).
const MM_ROWS: usize = 64;

/// Workgroups of attention below which the keys are split over several workgroups (attend.wgsl,
/// attend_gqa.wgsl), and the rows of partials that allows (`attention_splits`).
const SPLIT_PAIRS: usize = 256;
const PART_ROWS: usize = 1024;
/// Most splits per (head, token): attend_merge.wgsl's workgroup holds one per invocation.
const MAX_SPLITS: usize = 64;

/// How attention splits the keys of `groups` workgroups' worth of (head or KV head, token)
/// pairs, `rows` (query head, token) rows of partials per split, whose longest causal range is
/// `n_max` keys: (splits, keys per split, a multiple of 64). Enough workgroups to fill a large
/// GPU at decode (≈ 512), at least 64 keys each; one split where the pairs alone suffice.
pub fn attention_splits(groups: usize, rows: usize, n_max: usize) -> (usize, usize) {
    let want = if groups >= SPLIT_PAIRS {
        1
    } else {
        (2 * SPLIT_PAIRS / groups.max(1)).max(1)
    };
    let nsplit = want
        .min(PART_ROWS / rows.max(1))
        .min(n_max.div_ceil(64))
        .clamp(1, MAX_SPLITS);
    let span = n_max.div_ceil(nsplit).div_ceil(64) * 64;
    (n_max.div_ceil(span), span)
}

/// Whether linear_q4(_mm).wgsl take this matrix and input: MLX 4-bit, groups of a multiple of
/// 32, inputs on 16-byte boundaries.
fn q4_ok(w: &GpuLinear, io: &Io) -> bool {
    w.bits == 4
        && w.group.is_multiple_of(32)
        && w.cols.is_multiple_of(32)
        && io.x_off.is_multiple_of(4)
        && io.x_stride.is_multiple_of(4)
}

/// Whether linear_q4_glu.wgsl takes this gate and up: both 4-bit as `q4_ok` wants, the same
/// shape, each in one slice with the same layout (so one set of offsets serves both).
fn glu_ok(gate: &GpuLinear, up: &GpuLinear, io: &Io) -> bool {
    q4_ok(gate, io)
        && q4_ok(up, io)
        && gate.rows == up.rows
        && gate.cols == up.cols
        && gate.group == up.group
        && gate.experts == up.experts
        && gate.slices.len() == 1
        && up.slices.len() == 1
        && gate.slices[0].scale_off == up.slices[0].scale_off
        && gate.slices[0].bias_off == up.slices[0].bias_off
}

/// Rows per workgroup of moe_down_rows.wgsl (its `RB` override; a power of two ≤ 8).
pub const DOWN_RB: usize = 4;

/// Rows per workgroup of linear_q4_rows.wgsl (its `RB`) as the model's `linear_q4_rows` has it.
const ROWS_RB: usize = 16;

/// Rows per workgroup of linear_q4_glu_rows.wgsl (its `RB` override; a multiple of 8, ≤ 16).
pub const GLU_RB: usize = 8;

/// linear_q4_rows.wgsl's instance for a slice of `rows` rows, and its rows per workgroup: 16
/// from 8,192 rows, else 4 from 1,024, else 2, so that even the router (257 rows) and the
/// 2,048-row output projections run on ≥ 128 workgroups.
fn rows_rb(k: &Kernels, rows: usize) -> (&Kernel, usize) {
    if rows >= 8192 {
        (&k.linear_q4_rows, ROWS_RB)
    } else if rows >= 1024 {
        (&k.linear_q4_rows4, 4)
    } else {
        (&k.linear_q4_rows2, 2)
    }
}

/// Whether linear_q4_rows.wgsl takes this plain matrix and input: `q4_ok` with 2,048 or 4,096
/// columns, or `q8_ok` with 2,048 (each of its 64 invocations holds the inputs of one or two
/// 16-byte words of a row).
fn rows_ok(w: &GpuLinear, io: &Io) -> bool {
    let q4 = q4_ok(w, io) && (w.cols == 2048 || w.cols == 4096);
    let q8 = q8_ok(w, io) && w.cols == 2048;
    (q4 || q8) && w.experts <= 1
}

/// Whether linear_q4_glu_rows.wgsl takes this gate (and up, which `glu_ok` matched to it): 2,048
/// input columns (its 64 invocations hold one quad each).
fn glu_rows_ok(gate: &GpuLinear) -> bool {
    gate.cols == 2048 && gate.mat_words.is_multiple_of(4)
}

/// The row kernels' parameters: linear.wgsl's first 18, then whether to normalise the input
/// first (`Io::norm`) and the norm's eps.
fn norm_params(params: &[u32; 21], io: &Io, eps: f32) -> [u32; 20] {
    let mut out = [0u32; 20];
    out[..18].copy_from_slice(&params[..18]);
    out[18] = io.norm.is_some() as u32;
    out[19] = eps.to_bits();
    out
}

/// Whether linear_q4.wgsl takes this 8-bit matrix (16 weights per 16-byte read): groups and
/// columns multiples of 16, inputs on 16-byte boundaries.
fn q8_ok(w: &GpuLinear, io: &Io) -> bool {
    w.bits == 8
        && w.group.is_multiple_of(16)
        && w.cols.is_multiple_of(16)
        && io.x_off.is_multiple_of(4)
        && io.x_stride.is_multiple_of(4)
}

/// Whether linear_q4_mm.wgsl takes this 8-bit matrix: `q8_ok` with groups and columns multiples
/// of 32 (the kernel's 32-column steps, two 16-byte words of a row each, within one group).
fn mm8_ok(w: &GpuLinear, io: &Io) -> bool {
    q8_ok(w, io) && w.group.is_multiple_of(32) && w.cols.is_multiple_of(32)
}

/// The tiled product for `w` (q4_ok holds): on cooperative matrices where the device has them
/// and the columns are a multiple of 64 (linear_q4_mm_coop.wgsl's step), else linear_q4_mm.wgsl.
/// Both take the same parameters, bindings and grid.
fn mm_kernel<'k>(k: &'k Kernels, w: &GpuLinear) -> &'k Kernel {
    match &k.linear_q4_mm_coop {
        Some(coop) if w.cols.is_multiple_of(64) => coop,
        _ => &k.linear_q4_mm,
    }
}

/// A tiled 4-bit product kernel (linear_q4_mm.wgsl or linear_q4_mm_coop.wgsl) against the
/// host's product in f64, on a random 4-bit matrix (160 rows, the last workgroup partly filled;
/// 512 columns in groups of 64; 40 items, the last tile of 8): the relative L2 difference. The
/// cooperative kernel uses an experimental feature of wgpu, so the backend checks it this way
/// before using it.
pub fn check_mm(gpu: &Gpu, kernel: &Kernel) -> Result<f64> {
    check_mm_bits(gpu, kernel, 4)
}

/// `check_mm` on a random matrix of `bits` (4, or 8: linear_q4_mm.wgsl's 8-bit path, `mm8_ok`).
pub fn check_mm_bits(gpu: &Gpu, kernel: &Kernel, bits: usize) -> Result<f64> {
    let (rows, cols, group, items) = (160usize, 512usize, 64usize, 40usize);
    let m = RandomQ4::with_bits(bits, rows, cols, group, items);
    let (nx, ny) = grid_2d(rows.div_ceil(mm_rows(kernel)));
    let z = items.div_ceil(mm_tile(kernel)) as u32;
    let groups_buf = gpu.storage("mm_check.groups", 16)?;
    m.run(gpu, kernel, &[nx, ny, z], nx, Some(&groups_buf), None)
}

/// How `probe_mm` changes `check_mm`'s random matrix and inputs (all off: unchanged).
#[derive(Clone, Copy, Default)]
struct ProbeShape {
    /// Every group's bias −8·s: the bias term (b + 8·s)·Σx is 0, the output the cooperative
    /// products' alone.
    zero_bias: bool,
    /// Inputs rounded to integers (−3..3; exact in f16, so the remainder part x − f16(x) is 0).
    int_x: bool,
    /// Inputs zero outside columns [a, b).
    x_window: Option<(usize, usize)>,
}

/// A tiled 4-bit product kernel (meant for linear_q4_mm_coop.wgsl where its check at load
/// fails) on `check_mm`'s matrix and on changed ones, one line each, for the log
/// ($LILY_WGPU_COOP_DIAG=1): the relative L2 difference from the host's product, and a map of
/// which part of the output is wrong and how. Each output block of 16 rows × 8 items is one
/// character: `.` right (< 1e-3 relative), `0` all zero, `b` only the bias terms (b + 8·s) · Σx (the
/// cooperative products missing), `p` only the cooperative products (the bias terms missing),
/// `2` the products counted twice, `x` something else. One character per 16 rows across, one
/// group of them per 8 items (`|` between). Then the same matrix with the inputs in only one
/// window of 32 columns at a time (which steps of 64 columns and which half of a step go wrong).
/// A few milliseconds.
pub fn probe_mm(gpu: &Gpu, kernel: &Kernel) -> Result<Vec<String>> {
    let plain = ProbeShape::default();
    let cases: [(&str, usize, usize, usize, ProbeShape); 6] = [
        (
            "check's matrix: 160 rows, 512 columns, 40 items",
            160,
            512,
            40,
            plain,
        ),
        (
            "the same, bias terms 0",
            160,
            512,
            40,
            ProbeShape {
                zero_bias: true,
                ..plain
            },
        ),
        (
            "the same, integer inputs",
            160,
            512,
            40,
            ProbeShape {
                int_x: true,
                ..plain
            },
        ),
        (
            "one workgroup, one step: 64 rows, 64 columns, 32 items, bias terms 0, integer inputs",
            64,
            64,
            32,
            ProbeShape {
                zero_bias: true,
                int_x: true,
                ..plain
            },
        ),
        (
            "one workgroup, 8 steps: 64 rows, 512 columns, 32 items",
            64,
            512,
            32,
            plain,
        ),
        (
            "two tiles of 32 items, two row blocks: 128 rows, 128 columns, 64 items",
            128,
            128,
            64,
            plain,
        ),
    ];
    let mut lines = Vec::new();
    for (what, rows, cols, items, shape) in cases {
        let m = RandomQ4::shaped(4, rows, cols, 64, items, shape);
        let got = m.run_probe(gpu, kernel)?;
        lines.push(format!(
            "coop probe ({what}): {:.1e} relative; {}",
            rel_diff(&got, &m.want),
            m.block_map(&got)
        ));
    }
    // One window of 32 input columns at a time.
    let mut windows = Vec::new();
    for w in 0..16 {
        let shape = ProbeShape {
            x_window: Some((32 * w, 32 * w + 32)),
            ..plain
        };
        let m = RandomQ4::shaped(4, 160, 512, 64, 40, shape);
        let got = m.run_probe(gpu, kernel)?;
        windows.push(format!("{}: {:.1e}", 32 * w, rel_diff(&got, &m.want)));
    }
    lines.push(format!(
        "coop probe (check's matrix, inputs only in columns c..c+31), c: relative: {}",
        windows.join(", ")
    ));
    Ok(lines)
}

/// Relative L2 difference of `got` from `want` (infinite where `got` has a non-finite value).
fn rel_diff(got: &[f32], want: &[f64]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (g, w) in got.iter().zip(want) {
        if !g.is_finite() {
            return f64::INFINITY;
        }
        num += (*g as f64 - w).powi(2);
        den += w.powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

/// linear_q4_rows.wgsl against the host's product in f64 on random 4-bit matrices of 4,096 and
/// 2,048 columns and an 8-bit one of 2,048 (37 rows: the last workgroup partly filled; 2 items),
/// and linear_q4_glu_rows.wgsl (`check_glu_rows`): the largest relative L2 difference.
pub fn check_rows(gpu: &Gpu, k: &Kernels) -> Result<f64> {
    let glu = check_glu_rows(gpu, k)?;
    let mut worst = 0f64;
    for (bits, cols) in [(4, 4096), (4, 2048), (8, 2048)] {
        let (rows, items) = (37usize, 2usize);
        let m = RandomQ4::with_bits(bits, rows, cols, 64, items);
        for (kernel, rb) in [
            (&k.linear_q4_rows, ROWS_RB),
            (&k.linear_q4_rows4, 4),
            (&k.linear_q4_rows2, 2),
        ] {
            let (nx, ny) = grid_2d(rows.div_ceil(rb));
            // Plain, then with the RMSNorm folded in (decode's norms: `Io::norm`).
            for norm in [None, Some(1e-6)] {
                let e = m.run(gpu, kernel, &[nx, ny, items as u32], nx, None, Some(norm))?;
                worst = worst.max(e);
            }
        }
    }
    Ok(worst.max(glu))
}

/// linear_q4_glu_rows.wgsl (plain mode: gate and up two random 4-bit matrices of 2,048 columns,
/// 37 rows, 2 items) against silu(gate x) · (up x) on the host: the relative L2 difference.
fn check_glu_rows(gpu: &Gpu, k: &Kernels) -> Result<f64> {
    let (rows, cols, items) = (37usize, 2048usize, 2usize);
    let gate = RandomQ4::new(rows, cols, 64, items);
    let up = RandomQ4::new(rows + 1, cols, 64, items);
    // Up's first `rows` rows in gate's slice layout (the kernel takes one set of offsets).
    let words = rows * cols / 8;
    let mut data = up.data[..words * 4].to_vec();
    let ng = rows * cols / 64;
    let (us, ub) = (up.scale_off as usize * 2, up.bias_off as usize * 2);
    data.extend_from_slice(&up.data[us..us + ng * 2]);
    data.resize(gate.bias_off as usize * 2, 0);
    data.extend_from_slice(&up.data[ub..ub + ng * 2]);
    let wg = gpu.upload("check.gate", &gate.data)?;
    let wu = gpu.upload("check.up", &data)?;
    let xbuf = gpu.upload_f32("check.x", &gate.x)?;
    let wn = gpu.upload_f32("check.wn", &gate.norm_w)?;
    let ybuf = gpu.storage("check.y", (items * rows * 4) as u64)?;
    let ids = gpu.storage("check.ids", 16)?;
    let (nx, ny) = grid_2d(rows.div_ceil(GLU_RB));
    let silu = |v: f64| v / (1.0 + (-v).exp());
    let mut worst = 0f64;
    // Plain, then with the RMSNorm folded in (decode's norms: `Io::norm`).
    for norm in [None, Some(1e-6f32)] {
        let x = match norm {
            Some(eps) => gate.normed(eps),
            None => gate.x.clone(),
        };
        let params: [u32; 20] = [
            rows as u32,
            cols as u32,
            4,
            64,
            0,
            cols as u32,
            0,
            rows as u32,
            0,
            gate.scale_off,
            gate.bias_off,
            0,
            0,
            0,
            1,
            (rows * cols / 8) as u32,
            nx,
            0,
            norm.is_some() as u32,
            norm.unwrap_or(0.0).to_bits(),
        ];
        let mut r = Recorder::new(gpu);
        r.dispatch(
            &k.linear_q4_glu_rows,
            &params,
            &[&wg, &xbuf, &ybuf, &ids, &wu, &wn],
            [nx, ny, items as u32],
        );
        r.submit()?;
        let got = gpu.read_f32(&ybuf, 0, items * rows)?;
        let (mut num, mut den) = (0f64, 0f64);
        for t in 0..items {
            let xt = &x[t * cols..(t + 1) * cols];
            for row in 0..rows {
                let dot = |w: &[f64]| -> f64 { w.iter().zip(xt).map(|(a, b)| a * *b as f64).sum() };
                let want = silu(dot(&gate.w[row])) * dot(&up.w[row]);
                let g = got[t * rows + row];
                if !g.is_finite() {
                    return Ok(f64::INFINITY);
                }
                num += (g as f64 - want).powi(2);
                den += want.powi(2);
            }
        }
        worst = worst.max((num / den.max(1e-30)).sqrt());
    }
    Ok(worst)
}

/// attend_gqa.wgsl (compiled for `d`, `g` = hq / hkv by `kernels::attend_gqa_for`) and
/// attend_merge.wgsl against the host's gated attention in f64, on random queries, gates and a
/// random cache of `n` positions: `t` tokens at positions n − t .. n (decode: t = 1, keys split
/// as `attention_splits` says; prefill-like: t > 1), split as the forward pass would. The
/// relative L2 difference of the outputs.
/// With `merge` None, `gqa` is attend_tile.wgsl (`kernels::attend_tile_for`): tiles of 64 / g
/// tokens, no key splits.
pub fn check_attention(
    gpu: &Gpu,
    gqa: &Kernel,
    merge: Option<&Kernel>,
    (hkv, g, d): (usize, usize, usize),
    n: usize,
    t: usize,
) -> Result<f64> {
    let hq = hkv * g;
    let pos0 = n - t;
    let qg_stride = hq * 2 * d + 2 * hkv * d;
    let mut seed = 0x9e37_79b9_7f4a_7c15u64 ^ (n * 131 + t * 7 + d + g) as u64;
    let mut rnd = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        ((seed % 20_001) as f32 / 10_000.0 - 1.0) * 1.5
    };
    let q: Vec<f32> = (0..t * hq * d).map(|_| rnd()).collect();
    let qg: Vec<f32> = (0..t * qg_stride).map(|_| rnd()).collect();
    let kc: Vec<f32> = (0..n * hkv * d).map(|_| rnd()).collect();
    let vc: Vec<f32> = (0..n * hkv * d).map(|_| rnd()).collect();
    let scale = 1.0 / (d as f32).sqrt();
    let (nsplit, span) = attention_splits(hkv * t, hq * t, n);
    let qb = gpu.upload_f32("check.q", &q)?;
    let qgb = gpu.upload_f32("check.qg", &qg)?;
    let kb = gpu.upload_f32("check.k", &kc)?;
    let vb = gpu.upload_f32("check.v", &vc)?;
    let ob = gpu.storage("check.o", (t * hq * d * 4) as u64)?;
    let part = gpu.storage("check.part", (PART_ROWS * (d + 2) * 4) as u64)?;
    let mut r = Recorder::new(gpu);
    let Some(merge) = merge else {
        r.dispatch(
            gqa,
            &[
                hq as u32,
                hkv as u32,
                d as u32,
                pos0 as u32,
                scale.to_bits(),
                1,
                0,
                qg_stride as u32,
                t as u32,
            ],
            &[&qb, &qgb, &kb, &vb, &ob],
            [hkv as u32, t.div_ceil(64 / g) as u32, 1],
        );
        r.submit()?;
        let got = gpu.read_f32(&ob, 0, t * hq * d)?;
        return Ok(attention_error(&got, &q, &qg, &kc, &vc, (hkv, g, d), n, t));
    };
    r.dispatch(
        gqa,
        &[
            hq as u32,
            hkv as u32,
            d as u32,
            pos0 as u32,
            scale.to_bits(),
            nsplit as u32,
            span as u32,
            qg_stride as u32,
        ],
        &[&qb, &qgb, &kb, &vb, &ob, &part],
        [hkv as u32, t as u32, nsplit as u32],
    );
    if nsplit > 1 {
        r.dispatch(
            merge,
            &[hq as u32, d as u32, nsplit as u32, qg_stride as u32],
            &[&part, &qgb, &ob],
            [hq as u32, t as u32, d.div_ceil(64) as u32],
        );
    }
    r.submit()?;
    let got = gpu.read_f32(&ob, 0, t * hq * d)?;
    Ok(attention_error(&got, &q, &qg, &kc, &vc, (hkv, g, d), n, t))
}

/// `check_attention`'s comparison: the relative L2 difference of `got` from the host's gated
/// attention in f64 (infinite where `got` has a non-finite value).
#[allow(clippy::too_many_arguments)]
fn attention_error(
    got: &[f32],
    q: &[f32],
    qg: &[f32],
    kc: &[f32],
    vc: &[f32],
    (hkv, g, d): (usize, usize, usize),
    n: usize,
    t: usize,
) -> f64 {
    let hq = hkv * g;
    let pos0 = n - t;
    let qg_stride = hq * 2 * d + 2 * hkv * d;
    let scale = 1.0 / (d as f32).sqrt();
    let (mut num, mut den) = (0f64, 0f64);
    for ti in 0..t {
        let keys = pos0 + ti + 1;
        for h in 0..hq {
            let kv = h / g;
            let qr = &q[(ti * hq + h) * d..][..d];
            let sc: Vec<f64> = (0..keys)
                .map(|j| {
                    let kr = &kc[(j * hkv + kv) * d..][..d];
                    qr.iter()
                        .zip(kr)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let mx = sc.iter().cloned().fold(f64::MIN, f64::max);
            let w: Vec<f64> = sc.iter().map(|v| (v - mx).exp()).collect();
            let sum: f64 = w.iter().sum();
            for c in 0..d {
                let o: f64 = (0..keys)
                    .map(|j| w[j] * vc[(j * hkv + kv) * d + c] as f64)
                    .sum::<f64>()
                    / sum;
                let gate = qg[ti * qg_stride + h * 2 * d + d + c] as f64;
                let want = o / (1.0 + (-gate).exp());
                let gv = got[(ti * hq + h) * d + c] as f64;
                if !gv.is_finite() {
                    return f64::INFINITY;
                }
                num += (gv - want).powi(2);
                den += want * want;
            }
        }
    }
    (num / den.max(1e-30)).sqrt()
}

/// A random MLX 4-bit (or 8-bit) matrix (one slice: packed words, bf16 scales, bf16 biases),
/// random inputs for `items` items, and the host's product in f64.
struct RandomQ4 {
    bits: usize,
    rows: usize,
    cols: usize,
    group: usize,
    items: usize,
    data: Vec<u8>,
    scale_off: u32,
    bias_off: u32,
    x: Vec<f32>,
    /// The dequantised rows, and the host's product with `x`.
    w: Vec<Vec<f64>>,
    want: Vec<f64>,
    /// The part of `want` from q·s alone (without the groups' bias terms b · Σx).
    products_part: Vec<f64>,
    /// A random RMSNorm weight (`run` with a norm).
    norm_w: Vec<f32>,
}

impl RandomQ4 {
    /// Each item's inputs through RMSNorm (rms_norm.wgsl's formula) with `norm_w`.
    fn normed(&self, eps: f32) -> Vec<f32> {
        let mut out = self.x.clone();
        for row in out.chunks_mut(self.cols) {
            let ms = row.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / self.cols as f64;
            let r = 1.0 / (ms + eps as f64).sqrt();
            for (v, w) in row.iter_mut().zip(&self.norm_w) {
                *v = (*v as f64 * r * *w as f64) as f32;
            }
        }
        out
    }

    /// The host's product of the rows with inputs `x` (items × cols), f64.
    fn product(&self, x: &[f32]) -> Vec<f64> {
        let mut want = vec![0f64; self.items * self.rows];
        for (r, w) in self.w.iter().enumerate() {
            for t in 0..self.items {
                let xt = &x[t * self.cols..(t + 1) * self.cols];
                want[t * self.rows + r] = w.iter().zip(xt).map(|(a, b)| a * *b as f64).sum();
            }
        }
        want
    }

    fn new(rows: usize, cols: usize, group: usize, items: usize) -> RandomQ4 {
        RandomQ4::with_bits(4, rows, cols, group, items)
    }

    fn with_bits(bits: usize, rows: usize, cols: usize, group: usize, items: usize) -> RandomQ4 {
        RandomQ4::shaped(bits, rows, cols, group, items, ProbeShape::default())
    }

    /// `with_bits`'s matrix and inputs (the same random draws) changed as `shape` says.
    fn shaped(
        bits: usize,
        rows: usize,
        cols: usize,
        group: usize,
        items: usize,
        shape: ProbeShape,
    ) -> RandomQ4 {
        let mut seed = 0x2545_f491_4f6c_dd1du64 ^ (rows * 31 + cols + bits) as u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        // bf16 (truncated) and its value.
        let bf16 = |v: f32| {
            let h = (v.to_bits() >> 16) as u16;
            (h, f32::from_bits((h as u32) << 16))
        };
        let per = 32 / bits;
        let words: Vec<u32> = (0..rows * cols / per).map(|_| next() as u32).collect();
        let mut data: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let scale_off = (data.len() / 2) as u32;
        let ngroups = rows * cols / group;
        let mut scales = Vec::with_capacity(ngroups);
        for _ in 0..ngroups {
            let (h, v) = bf16(0.002 + 0.03 * (next() % 1000) as f32 / 1000.0);
            scales.push(v);
            data.extend_from_slice(&h.to_le_bytes());
        }
        data.resize(data.len().div_ceil(4) * 4, 0);
        let bias_off = (data.len() / 2) as u32;
        let mut biases = Vec::with_capacity(ngroups);
        for s in &scales {
            let (mut h, mut v) = bf16(-s * (4.0 + 8.0 * (next() % 1000) as f32 / 1000.0));
            if shape.zero_bias {
                // b = −8·s (exact in bf16): the bias term (b + 8·s)·Σx is 0.
                (h, v) = bf16(-8.0 * s);
            }
            biases.push(v);
            data.extend_from_slice(&h.to_le_bytes());
        }
        let x: Vec<f32> = (0..items * cols)
            .map(|_| ((next() % 20_001) as f32 / 10_000.0 - 1.0) * 3.0)
            .enumerate()
            .map(|(i, v)| {
                let v = if shape.int_x { v.round() } else { v };
                match shape.x_window {
                    Some((a, b)) if !(a..b).contains(&(i % cols)) => 0.0,
                    _ => v,
                }
            })
            .collect();
        // The products' part (q − 2^(bits−1))·s alone (linear_q4_mm_coop.wgsl's cooperative
        // share; the rest is (b + 2^(bits−1)·s) · Σx).
        let wq: Vec<Vec<f64>> = (0..rows)
            .map(|r| {
                (0..cols)
                    .map(|k| {
                        let q =
                            (words[(r * cols + k) / per] >> (bits * (k % per))) & ((1 << bits) - 1);
                        let mid = (1u64 << (bits - 1)) as f64;
                        (q as f64 - mid) * scales[r * (cols / group) + k / group] as f64
                    })
                    .collect()
            })
            .collect();
        // The whole weight: q·s plus the group's bias.
        let mid = (1u64 << (bits - 1)) as f64;
        let w: Vec<Vec<f64>> = wq
            .iter()
            .enumerate()
            .map(|(r, row)| {
                row.iter()
                    .enumerate()
                    .map(|(k, qs)| {
                        let g = r * (cols / group) + k / group;
                        qs + mid * scales[g] as f64 + biases[g] as f64
                    })
                    .collect()
            })
            .collect();
        let norm_w: Vec<f32> = (0..cols)
            .map(|_| 0.5 + (next() % 1000) as f32 / 1000.0)
            .collect();
        let mut m = RandomQ4 {
            bits,
            rows,
            cols,
            group,
            items,
            data,
            scale_off,
            bias_off,
            x,
            w,
            want: Vec::new(),
            products_part: Vec::new(),
            norm_w,
        };
        m.want = m.product(&m.x);
        // products_part: the q·s rows' product alone (`wq` in the place of `w`).
        let full = std::mem::replace(&mut m.w, wq);
        m.products_part = m.product(&m.x);
        m.w = full;
        m
    }

    /// A tiled product kernel on this matrix with `check_mm`'s grid (`probe_mm`).
    fn run_probe(&self, gpu: &Gpu, kernel: &Kernel) -> Result<Vec<f32>> {
        let (nx, ny) = grid_2d(self.rows.div_ceil(mm_rows(kernel)));
        let z = self.items.div_ceil(mm_tile(kernel)) as u32;
        let groups_buf = gpu.storage("mm_probe.groups", 16)?;
        self.run_raw(gpu, kernel, &[nx, ny, z], nx, Some(&groups_buf), None)
    }

    /// `probe_mm`'s map of `got` (items × rows) against this matrix's product.
    fn block_map(&self, got: &[f32]) -> String {
        let (rows, items) = (self.rows, self.items);
        let mut groups = Vec::new();
        for t0 in (0..items).step_by(8) {
            let mut g = String::new();
            for r0 in (0..rows).step_by(16) {
                let at: Vec<usize> = (t0..(t0 + 8).min(items))
                    .flat_map(|t| (r0..(r0 + 16).min(rows)).map(move |r| t * rows + r))
                    .collect();
                let sub = |v: &dyn Fn(usize) -> f64| -> f64 {
                    let (mut num, mut den) = (0f64, 0f64);
                    for &i in &at {
                        num += (got[i] as f64 - v(i)).powi(2);
                        den += self.want[i].powi(2);
                    }
                    (num / den.max(1e-30)).sqrt()
                };
                let p = &self.products_part;
                let w = &self.want;
                let c = if at.iter().any(|&i| !got[i].is_finite()) {
                    'n'
                } else if sub(&|i| w[i]) < 1e-3 {
                    '.'
                } else if at.iter().all(|&i| got[i] == 0.0) {
                    '0'
                } else if sub(&|i| w[i] - p[i]) < 1e-2 {
                    'b'
                } else if sub(&|i| p[i]) < 1e-2 {
                    'p'
                } else if sub(&|i| w[i] + p[i]) < 1e-2 {
                    '2'
                } else {
                    'x'
                };
                g.push(c);
            }
            groups.push(g);
        }
        format!(
            "map (16 rows a character, 8 items a group): {}",
            groups.join("|")
        )
    }

    /// `kernel` (linear.wgsl's parameters, plain mode) on this matrix: its output (items ×
    /// rows). `fourth`: the fourth binding, where the kernel has one.
    fn run_raw(
        &self,
        gpu: &Gpu,
        kernel: &Kernel,
        grid: &[u32; 3],
        nx: u32,
        fourth: Option<&wgpu::Buffer>,
        rows_norm: Option<Option<f32>>,
    ) -> Result<Vec<f32>> {
        let (rows, cols, items) = (self.rows, self.cols, self.items);
        let wbuf = gpu.upload("check.w", &self.data)?;
        let xbuf = gpu.upload_f32("check.x", &self.x)?;
        let ybuf = gpu.storage("check.y", (items * rows * 4) as u64)?;
        let params: [u32; 21] = [
            rows as u32,
            cols as u32,
            self.bits as u32,
            self.group as u32,
            0,
            cols as u32,
            0,
            rows as u32,
            0,
            self.scale_off,
            self.bias_off,
            0,
            0,
            0,
            1,
            (rows * cols * self.bits / 32) as u32,
            nx,
            0,
            items as u32,
            0,
            0,
        ];
        // The row kernels (`rows_norm` Some): field 18 says whether to normalise the input
        // first (RMSNorm with eps `Some(eps)` and the weight `self.norm_w`), 19 the eps.
        let mut params = params;
        let wn = gpu.upload_f32("check.wn", &self.norm_w)?;
        if let Some(norm) = rows_norm {
            params[18] = norm.is_some() as u32;
            params[19] = norm.unwrap_or(0.0).to_bits();
        }
        let mut bufs = vec![&wbuf, &xbuf, &ybuf];
        bufs.extend(fourth);
        if rows_norm.is_some() {
            bufs.push(&wn);
        }
        let mut r = Recorder::new(gpu);
        r.dispatch(kernel, &params, &bufs, *grid);
        r.submit()?;
        let got = gpu.read_f32(&ybuf, 0, items * rows)?;
        Ok(got)
    }

    /// `run_raw`'s output against the host's product: the relative L2 difference.
    fn run(
        &self,
        gpu: &Gpu,
        kernel: &Kernel,
        grid: &[u32; 3],
        nx: u32,
        fourth: Option<&wgpu::Buffer>,
        rows_norm: Option<Option<f32>>,
    ) -> Result<f64> {
        let got = self.run_raw(gpu, kernel, grid, nx, fourth, rows_norm)?;
        let want = match rows_norm {
            Some(Some(eps)) => self.product(&self.normed(eps)),
            _ => self.want.clone(),
        };
        let (mut num, mut den) = (0f64, 0f64);
        for (g, w) in got.iter().zip(&want) {
            if !g.is_finite() {
                return Ok(f64::INFINITY);
            }
            num += (*g as f64 - w).powi(2);
            den += w.powi(2);
        }
        Ok((num / den.max(1e-30)).sqrt())
    }
}

/// The parameters of linear.wgsl, linear_q4.wgsl and linear_q4_mm.wgsl (the first two read
/// only the leading fields).
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
) -> [u32; 21] {
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
        io.items as u32,
        tiles_at as u32,
        order_at as u32,
    ]
}

/// Activation buffers for chunks of up to `chunk` tokens, shared by all sequences.
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
    /// moe_group.wgsl's output: indirect dispatch arguments, tile list, items by expert.
    groups: Buf,
    tiles_at: usize,
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
    pub fn new(gpu: &Gpu, c: &ModelConfig, chunk: usize, all_chunk: usize) -> Result<Scratch> {
        // Items per token: the top_k routed experts and, where it rides in their stacks, the
        // shared expert (sized for it either way).
        let ks = c.top_k + 1;
        if chunk == 0 || chunk * ks > 65_535 {
            bail!("prefill chunk {chunk} must be in 1..={}", 65_535 / ks);
        }
        let f = |label: &str, n: usize| gpu.storage(label, n as u64 * 4);
        let t = chunk;
        let (h, tk) = (c.hidden, t * ks);
        let tiles_at = 8;
        let order_at = tiles_at + 4 * (tk.div_ceil(MM_TILE) + c.n_experts + 1);
        Ok(Scratch {
            chunk,
            all_chunk,
            x: f("x", t * h)?,
            xn: f("xn", t * h)?,
            attn_proj: f(
                "attn_proj",
                t * (c.n_heads * 2 + c.n_kv_heads * 2) * c.head_dim,
            )?,
            q: f("q", t * c.n_heads * c.head_dim)?,
            o: f("o", t * c.n_heads * c.head_dim)?,
            attn_part: f("attention_partials", PART_ROWS * (c.head_dim + 2))?,
            dn_proj: f(
                "dn_proj",
                t * (c.conv_dim() + c.dn_v_heads * c.dn_v_dim + 2 * c.dn_v_heads),
            )?,
            c: f("conv_out", t * c.conv_dim())?,
            qk: f("qk", t * 2 * c.dn_key_dim())?,
            odn: f("deltanet_out", t * c.dn_v_heads * c.dn_v_dim)?,
            ogn: f("deltanet_normed", t * c.dn_v_heads * c.dn_v_dim)?,
            router_logits: f("router_logits", t * (c.n_experts + 1))?,
            ids: f("expert_ids", tk)?,
            wts: f("expert_weights", tk)?,
            groups: gpu.storage_indirect("expert_groups", (order_at + tk) as u64 * 4)?,
            tiles_at,
            order_at,
            g: f("expert_gate", tk * c.expert_inter)?,
            u: f("expert_up", tk * c.expert_inter)?,
            act: f("expert_act", tk * c.expert_inter)?,
            ye: f("expert_out", tk * h)?,
            sg: f("shared_gate", t * c.shared_inter)?,
            su: f("shared_up", t * c.shared_inter)?,
            sa: f("shared_act", t * c.shared_inter)?,
            sh: f("shared_out", t * h)?,
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
    pub fn new(gpu: &Gpu, c: &ModelConfig, max_ctx: usize) -> Result<SeqState> {
        let kv_bytes = (max_ctx * c.n_kv_heads * c.head_dim * 4) as u64;
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

pub fn state_bytes(c: &ModelConfig) -> u64 {
    (c.dn_v_heads * c.dn_k_dim * c.dn_v_dim * 4) as u64
}

pub fn conv_bytes(c: &ModelConfig) -> u64 {
    ((c.conv_kernel - 1) * c.conv_dim() * 4) as u64
}

pub fn kv_row_bytes(c: &ModelConfig) -> u64 {
    (c.n_kv_heads * c.head_dim * 4) as u64
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

/// Where a matrix-vector product reads and writes, in f32 elements.
struct Io<'b> {
    x: &'b Buf,
    x_off: usize,
    x_stride: usize,
    y: &'b Buf,
    y_off: usize,
    y_stride: usize,
    items: usize,
    accumulate: bool,
    /// Where set, `x` is the residual stream and the kernel applies RMSNorm with this weight
    /// first (decode's norms folded into linear_q4_rows / linear_q4_glu_rows: no rms_norm
    /// dispatch; `Forward::fold_*`).
    norm: Option<&'b Buf>,
}

pub struct Forward<'a> {
    pub gpu: &'a Gpu,
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
            let fold_in = t == 1
                && self.fold_fused(match &layer.mixer {
                    GpuMixer::Attention(a) => &a.qkv,
                    GpuMixer::DeltaNet(d) => &d.in_proj,
                });
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
            let fold_post = t == 1 && self.fold_moe(&layer.moe);
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
                if t == 1 && rows_ok(lm, &io) {
                    io.norm = Some(&self.model.final_norm);
                } else {
                    self.rms_norm(&mut r, &s.x, &self.model.final_norm, &s.xn, t - 1, 1);
                    io.x = &s.xn;
                }
                self.linear(&mut r, "lin.lm_head", lm, io);
            }
            LogitsOut::All => {
                self.rms_norm(&mut r, &s.x, &self.model.final_norm, &s.xn, 0, t);
                self.linear(
                    &mut r,
                    "lin.lm_head",
                    &self.model.lm_head,
                    self.plain(&s.xn, h, &s.all_logits, v, t),
                );
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
            norm: None,
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
    /// `norm`: the parts read the residual stream and normalise it themselves (`fold_fused`).
    fn fused(
        &self,
        r: &mut Recorder<'a>,
        label: &'static str,
        f: &'a Fused,
        y: &'a Buf,
        t: usize,
        norm: Option<&'a Buf>,
    ) {
        for (lin, off) in &f.parts {
            let x = if norm.is_some() {
                &self.s.x
            } else {
                &self.s.xn
            };
            let mut io = self.plain(x, self.cfg.hidden, y, f.rows, t);
            io.y_off = *off;
            io.norm = norm;
            self.linear(r, label, lin, io);
        }
    }

    /// Whether a decode step's norm before `f` can be folded into it: one part, through
    /// linear_q4_rows.wgsl.
    fn fold_fused(&self, f: &Fused) -> bool {
        let io = self.plain(&self.s.x, self.cfg.hidden, &self.s.x, f.rows, 1);
        f.parts.len() == 1 && rows_ok(&f.parts[0].0, &io)
    }

    /// Whether a decode step's norm before the MoE can be folded into its readers: the router
    /// (`fold_fused`) and the experts' gate/up through linear_q4_glu_rows.wgsl, the shared expert
    /// riding in the stacks (nothing else reads the normalised input).
    fn fold_moe(&self, m: &GpuMoe) -> bool {
        let c = self.cfg;
        let io = self.plain(
            &self.s.x,
            c.hidden,
            &self.s.act,
            c.expert_inter,
            c.top_k + 1,
        );
        m.shared.is_none()
            && self.fold_fused(&m.router)
            && glu_ok(&m.gate, &m.up, &io)
            && glu_rows_ok(&m.gate)
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
        // linear_q4.wgsl: 16-byte reads of 4-bit weights, where the shapes allow; several
        // tokens: linear_q4_mm.wgsl, each weight read once per tile of tokens.
        let q4 = q4_ok(w, &io);
        // 8-bit matrices (the router) take linear_q4_mm.wgsl too where each 32-column step
        // lies in one group (`mm8_ok`).
        let mm8 = mm8_ok(w, &io) && experts.is_none() && io.items > 1;
        let mm = (q4 && experts.is_none() && io.items > 1) || mm8;
        if !mm && experts.is_none() && rows_ok(w, &io) {
            // linear_q4_rows.wgsl: inputs once per workgroup, rows streamed.
            for sl in &w.slices {
                let (kernel, rb) = rows_rb(self.k, sl.count);
                let (nx, ny) = grid_2d(sl.count.div_ceil(rb));
                let params = linear_params(w, sl, &io, sl.count, sl.first, None, 0, 0, nx, 0, 0);
                let params = norm_params(&params, &io, self.cfg.rms_eps);
                r.dispatch_as(
                    label,
                    kernel,
                    &params,
                    &[&sl.buf, io.x, io.y, io.norm.unwrap_or(io.x)],
                    [nx, ny, io.items as u32],
                );
            }
            return;
        }
        debug_assert!(io.norm.is_none(), "a folded norm needs linear_q4_rows");
        let kernel = if mm8 {
            &self.k.linear_q4_mm
        } else if mm {
            mm_kernel(self.k, w)
        } else if q4 || q8_ok(w, &io) {
            &self.k.linear_q4
        } else {
            &self.k.linear
        };
        for sl in &w.slices {
            let (rows, row0, e0, e_count) = match experts {
                None => (sl.count, sl.first, 0, 0),
                Some(_) => (w.rows, 0, sl.first, sl.count),
            };
            let per = if mm { mm_rows(kernel) } else { LINEAR_ROWS };
            let (nx, ny) = grid_2d(rows.div_ceil(per));
            let params = linear_params(w, sl, &io, rows, row0, experts, e0, e_count, nx, 0, 0);
            let z = if mm {
                io.items.div_ceil(mm_tile(kernel))
            } else {
                io.items
            };
            let fourth = if mm { &self.s.groups } else { &self.s.ids };
            r.dispatch_as(
                label,
                kernel,
                &params,
                &[&sl.buf, io.x, io.y, fourth],
                [nx, ny, z as u32],
            );
        }
    }

    /// `io.y = silu(gate x) ⊙ (up x)` through linear_q4_glu.wgsl (`glu_ok` holds): plain
    /// matrices (`experts` None) or routed experts (item i: token i / x_div, expert `ids[i]`).
    fn glu(
        &self,
        r: &mut Recorder<'a>,
        label: &'static str,
        gate: &'a GpuLinear,
        up: &'a GpuLinear,
        io: Io<'a>,
        experts: Option<usize>,
    ) {
        let (sg, su) = (&gate.slices[0], &up.slices[0]);
        let rows = gate.rows;
        // linear_q4_glu_rows.wgsl (input once per workgroup, 16 rows streamed) for 2,048
        // input columns, else linear_q4_glu.wgsl (8 rows a workgroup).
        let row_kernel = glu_rows_ok(gate);
        let (kernel, per) = if row_kernel {
            (&self.k.linear_q4_glu_rows, GLU_RB)
        } else {
            (&self.k.linear_q4_glu, LINEAR_ROWS)
        };
        debug_assert!(row_kernel || io.norm.is_none());
        let (nx, ny) = grid_2d(rows.div_ceil(per));
        let e_count = if experts.is_some() { gate.experts } else { 0 };
        let params = linear_params(gate, sg, &io, rows, 0, experts, 0, e_count, nx, 0, 0);
        if row_kernel {
            let params = norm_params(&params, &io, self.cfg.rms_eps);
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
                ],
                [nx, ny, io.items as u32],
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

    /// Routed experts of a prefill chunk through `kernel` (linear_q4_mm or linear_q4_mm_coop,
    /// the one whose tile size moe_group.wgsl was given): the tiles moe_group.wgsl listed,
    /// dispatched with the arguments it wrote at byte `args` of `Scratch::groups`.
    #[allow(clippy::too_many_arguments)]
    fn experts_mm(
        &self,
        r: &mut Recorder<'a>,
        label: &'static str,
        kernel: &'a Kernel,
        w: &'a GpuLinear,
        io: Io<'a>,
        x_div: usize,
        args: u64,
    ) {
        let s = self.s;
        let nx = w.rows.div_ceil(mm_rows(kernel));
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
                s.tiles_at,
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
        self.fused(r, "lin.attn.qkv", &a.qkv, &s.attn_proj, t, norm);
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
        // attend_tile (where it is in use, `WgpuOptions::attn_tile`): a prefill chunk's tokens
        // in tiles of 64 / G with the G query heads of a KV head, no key splits.
        if let (Some(tile), Some(g), true) = (&self.k.attend_tile, gqa_group(c), t > 1) {
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
            let mut io = self.plain(&s.o, hq * d, &s.x, h, t);
            io.accumulate = true;
            self.linear(r, "lin.attn.o", &a.o_proj, io);
            return;
        }
        // attend_gqa: the query heads of a KV head in one workgroup (K and V read once for
        // them), where the shapes allow; the same parameters, bindings and partials.
        let (kernel, heads) = match gqa_group(c) {
            Some(_) => (&self.k.attend_gqa, hkv),
            None => (&self.k.attend, hq),
        };
        let (nsplit, span) = attention_splits(heads * t, hq * t, pos0 + t);
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
            ],
            &[&s.q, &s.attn_proj, kc, vc, &s.o, &s.attn_part],
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
        let mut io = self.plain(&s.o, hq * d, &s.x, h, t);
        io.accumulate = true;
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
        self.fused(r, "lin.dn.in_proj", &d.in_proj, &s.dn_proj, t, norm);
        let (dk, dv) = (c.dn_k_dim, c.dn_v_dim);
        if t == 1 && cd.is_multiple_of(dk) && dv <= 128 {
            // A decode step: conv and q/k norm in one dispatch, recurrence and output norm in
            // another.
            r.dispatch(
                &self.k.dn_conv_norm,
                &[
                    cd as u32,
                    c.conv_kernel as u32,
                    stride as u32,
                    hk as u32,
                    dk as u32,
                    (1.0 / (dk as f32).sqrt()).to_bits(),
                ],
                &[&s.dn_proj, &d.conv, conv, &s.c, &s.qk],
                [(cd / dk) as u32, 1, 1],
            );
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
                ],
                &[&s.c, &s.qk, &s.dn_proj, &d.decay, state, &d.norm, &s.ogn],
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
        let mut io = self.plain(&s.ogn, vd, &s.x, h, t);
        io.accumulate = true;
        self.linear(r, "lin.dn.out", &d.out_proj, io);
    }

    /// MODEL.md §2.6: routed experts + gated shared expert, added into the residual. Where
    /// the shared expert rides in the routed stacks (expert E, `GpuMoe::shared` None), each
    /// token has k + 1 items, the last one expert E with weight sigmoid(shared gate logit), and
    /// the same dispatches serve both.
    /// `norm`: the router and the experts' GLU read the residual stream and normalise it
    /// themselves (`fold_moe`).
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
        self.fused(r, "lin.router", &m.router, &s.router_logits, t, norm);
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
        let tk = t * ks;
        let gate_io = self.plain(&s.xn, h, &s.g, i, tk);
        let up_io = self.plain(&s.xn, h, &s.u, i, tk);
        let down_io = self.plain(&s.act, i, &s.ye, h, tk);
        // A prefill chunk: items grouped by expert on the GPU, each expert's weights read once
        // per tile of its tokens (linear_q4_mm.wgsl), when all three matrices allow it.
        let grouped =
            t > 1 && q4_ok(&m.gate, &gate_io) && q4_ok(&m.up, &up_io) && q4_ok(&m.down, &down_io);
        // One kernel for the three (their tiles are one list): the cooperative one where it
        // takes all three.
        let ek = match &self.k.linear_q4_mm_coop {
            Some(coop)
                if [&m.gate, &m.up, &m.down]
                    .iter()
                    .all(|w| w.cols.is_multiple_of(64)) =>
            {
                coop
            }
            _ => self
                .k
                .linear_q4_mm_expert
                .as_ref()
                .unwrap_or(&self.k.linear_q4_mm),
        };
        if grouped {
            r.dispatch(
                &self.k.moe_group,
                &[
                    tk as u32,
                    (e + stacked as usize) as u32,
                    mm_tile(ek) as u32,
                    i.div_ceil(mm_rows(ek)) as u32,
                    h.div_ceil(mm_rows(ek)) as u32,
                    s.tiles_at as u32,
                    s.order_at as u32,
                ],
                &[&s.ids, &s.groups],
                [1, 1, 1],
            );
            self.experts_mm(r, "lin.experts.gate", ek, &m.gate, gate_io, ks, 0);
            self.experts_mm(r, "lin.experts.up", ek, &m.up, up_io, ks, 0);
            self.swiglu(r, &s.g, &s.u, &s.act, tk * i);
        } else if glu_ok(&m.gate, &m.up, &gate_io) {
            // A decode step: gate, up and silu(gate) ⊙ up in one dispatch.
            let mut io = self.plain(if norm.is_some() { &s.x } else { &s.xn }, h, &s.act, i, tk);
            io.norm = norm;
            self.glu(r, "lin.experts.glu", &m.gate, &m.up, io, Some(ks));
        } else {
            self.linear_experts(r, "lin.experts.gate", &m.gate, gate_io, ks);
            self.linear_experts(r, "lin.experts.up", &m.up, up_io, ks);
            self.swiglu(r, &s.g, &s.u, &s.act, tk * i);
        }
        if let Some(sh) = &m.shared {
            let sg_io = self.plain(&s.xn, h, &s.sg, si, t);
            let su_io = self.plain(&s.xn, h, &s.su, si, t);
            if t == 1 && glu_ok(&sh.gate, &sh.up, &sg_io) {
                let io = self.plain(&s.xn, h, &s.sa, si, t);
                self.glu(r, "lin.shared.glu", &sh.gate, &sh.up, io, None);
            } else {
                self.linear(r, "lin.shared.gate", &sh.gate, sg_io);
                self.linear(r, "lin.shared.up", &sh.up, su_io);
                self.swiglu(r, &s.sg, &s.su, &s.sa, t * si);
            }
            self.linear(
                r,
                "lin.shared.down",
                &sh.down,
                self.plain(&s.sa, si, &s.sh, h, t),
            );
        }
        let fused =
            stacked && !grouped && t == 1 && q4_ok(&m.down, &down_io) && m.down.slices.len() == 1;
        if fused {
            // A decode step: every item's down projection and the weighted sum into the
            // residual at once.
            let de = &m.down.slices[0];
            // moe_down_rows.wgsl where a row's quads divide 64 (512 columns: 16), else
            // moe_down.wgsl.
            let quads = i / 32;
            let (kernel, per) = if quads > 0 && 64 % quads == 0 {
                (&self.k.moe_down_rows, DOWN_RB)
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
        if grouped {
            self.experts_mm(r, "lin.experts.down", ek, &m.down, down_io, 1, 16);
        } else {
            self.linear_experts(r, "lin.experts.down", &m.down, down_io, 1);
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

    /// Every split count fits attend_merge (≤ 64) and the partials buffer, the splits cover
    /// the keys in spans of whole 64-key blocks, and none is empty at the longest range.
    #[test]
    fn attention_splits_cover_the_keys_within_the_buffers() {
        for pairs in [1, 2, 4, 16, 64, 100, 255, 256, 2048, 8192] {
            for per_group in [1, 2, 8] {
                for n_max in [1, 63, 64, 65, 300, 4096, 4097, 32_768, 262_144] {
                    let rows = pairs * per_group;
                    let (nsplit, span) = attention_splits(pairs, rows, n_max);
                    assert!((1..=MAX_SPLITS).contains(&nsplit), "{pairs} {n_max}");
                    assert!(span.is_multiple_of(64) && span > 0);
                    assert!(nsplit * span >= n_max && (nsplit - 1) * span < n_max);
                    if nsplit > 1 {
                        assert!(rows * nsplit <= PART_ROWS, "{rows} × {nsplit}");
                    }
                }
            }
        }
        // Decode on the full model (2 KV heads of 8 query heads) at 4K: 64 splits of 64 keys,
        // 128 workgroups.
        assert_eq!(attention_splits(2, 16, 4096), (64, 64));
    }
}
