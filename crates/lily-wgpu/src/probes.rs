//! Load-time and test checks of kernels against the host: each runs a kernel on random inputs
//! (a random MLX 4/8-bit matrix, random queries and cache) and compares with the same
//! computation in f64 on the host, as a relative L2 difference. The backend checks attend_tile
//! this way before using it; tests check every product and attention kernel.

use anyhow::{bail, Result};

use crate::forward::{attention_splits, PART_ROWS};
use crate::gpu::{grid_2d, Gpu, Kernel, Recorder};
use crate::kernels::Kernels;
use crate::plan::{
    coop_spec, dn_recur_norm_spec, down_lanes_spec, down_lanes_wg, down_rows_spec, rows_grid,
    rows_spec, MmTile, SplitRule,
};
use crate::shaders::Form;

/// The largest relative difference an f16 store adds to one value (round to nearest, 11
/// significant bits): 2^-11. A kernel whose output is an f16 activation differs from the host's
/// f64 by up to this (its inputs' rounding taken out of the host's reference, `Sides`).
pub const F16_STORE: f64 = 1.0 / 2048.0;

/// Which of a kernel's inputs and outputs hold f16 activations, as a probe feeds it and reads it
/// back: the input (an activation, not the residual stream) and the output (an activation, not
/// an f32 buffer), where activations are f16. The host's reference takes the input rounded to
/// f16 as the kernel reads it; the output's own rounding (2^-11 relative at most) remains.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Sides {
    pub x_f16: bool,
    pub y_f16: bool,
}

impl Sides {
    /// A product kernel's `form` where activations are f16 (`act_f16`) or f32.
    pub fn of(form: Form, act_f16: bool) -> Sides {
        Sides {
            x_f16: act_f16 && !form.x_f32,
            y_f16: act_f16 && !form.y_f32,
        }
    }
}

/// Each value rounded to f16 where `f16` (as a kernel reading an f16 activation sees it).
fn round_f16(v: &[f32], f16: bool) -> Vec<f32> {
    if !f16 {
        return v.to_vec();
    }
    v.iter().map(|x| half::f16::from_f32(*x).to_f32()).collect()
}

/// `v` uploaded as an activation: f16 where `f16`, else f32.
fn upload_act(gpu: &Gpu, label: &str, v: &[f32], f16: bool) -> Result<wgpu::Buffer> {
    if f16 {
        let h: Vec<half::f16> = v.iter().map(|x| half::f16::from_f32(*x)).collect();
        gpu.upload(label, bytemuck::cast_slice(&h))
    } else {
        gpu.upload_f32(label, v)
    }
}

/// The first `n` elements of an activation buffer (f16 where `f16`), as f32.
fn read_act(gpu: &Gpu, buf: &wgpu::Buffer, n: usize, f16: bool) -> Result<Vec<f32>> {
    if !f16 {
        return gpu.read_f32(buf, 0, n);
    }
    let words = gpu.read_u32(buf, n.div_ceil(2))?;
    Ok(words
        .iter()
        .flat_map(|w| [*w as u16, (*w >> 16) as u16])
        .take(n)
        .map(|h| half::f16::from_bits(h).to_f32())
        .collect())
}

/// linear_q4_mm.wgsl with tiles of `tile` against the host's product in f64, on a random matrix
/// of `bits` (4, or 8: the router's path) with 160 rows (the last workgroup partly filled), 512
/// columns in groups of 64 and 40 items (the last tile partly filled): the relative L2
/// difference. `sides`: the kernel's form's f16 input and output (`Sides`).
pub fn check_mm(
    gpu: &Gpu,
    kernel: &Kernel,
    tile: MmTile,
    bits: usize,
    sides: Sides,
) -> Result<f64> {
    let (m, got) = mm_probe(gpu, kernel, tile, bits, sides)?;
    Ok(rel_l2_f64(&got, &m.want_for(None, sides)))
}

/// `check_mm`'s random matrix and inputs through `kernel`: the matrix, and the kernel's output.
fn mm_probe(
    gpu: &Gpu,
    kernel: &Kernel,
    tile: MmTile,
    bits: usize,
    sides: Sides,
) -> Result<(RandomQ4, Vec<f32>)> {
    let (rows, cols, group, items) = (160usize, 512usize, 64usize, 40usize);
    let m = RandomQ4::with_bits(bits, rows, cols, group, items);
    let (nx, ny) = grid_2d(rows.div_ceil(kernel.rows));
    let z = items.div_ceil(tile.items()) as u32;
    let groups_buf = gpu.storage("mm_check.groups", 16)?;
    let grid = [nx, ny, z];
    let got = m.run_raw(gpu, kernel, &grid, nx, Some(&groups_buf), None, sides)?;
    Ok((m, got))
}

/// linear_q4_mm.wgsl with f16 tiles (tile_f16.wgsl) on `check_mm`'s matrix and inputs: the
/// relative L2 difference from the host's f64 product of the exact operands (the f16 rounding of
/// both, visible), and from the host's f64 product of the operands rounded to f16 as the kernel
/// stages them (the dequantised weight `q·s + b` and the input, each to the nearest f16: only the
/// f32 sums' order differs, so a wrong item, row or column shows here where f16 rounding would
/// hide it in the first figure). `sides`: as `check_mm`'s (the f16 output's rounding remains in
/// both figures).
pub fn check_mm_f16(
    gpu: &Gpu,
    kernel: &Kernel,
    tile: MmTile,
    bits: usize,
    sides: Sides,
) -> Result<(f64, f64)> {
    let (m, got) = mm_probe(gpu, kernel, tile, bits, sides)?;
    let staged = m.staged_f16();
    Ok((rel_l2_f64(&got, &m.want), rel_l2_f64(&got, &staged)))
}

/// Where linear_q4_coop.wgsl (`kernel`, matrices of `size`, tiles of 64, 4-bit) goes wrong, for
/// the device call after a refusal at load: on one workgroup and one step (64 rows, 32 columns,
/// 64 items), one workgroup and 8 steps (256 columns), and `check_mm`'s shape (160 × 512, 40
/// items: row blocks and a tile partly filled), the relative L2 difference from the host's
/// product of the f16-staged operands, then a map of size-row × size-item blocks (items down,
/// rows across; `.` within 1e-3, `0` all zero, `x` else).
pub fn coop_map(gpu: &Gpu, kernel: &Kernel, size: usize) -> Result<String> {
    let mut out = String::new();
    for (rows, cols, items) in [(64usize, 32usize, 64usize), (64, 256, 64), (160, 512, 40)] {
        let m = RandomQ4::with_bits(4, rows, cols, 64.min(cols), items);
        let (nx, ny) = grid_2d(rows.div_ceil(kernel.rows));
        let z = items.div_ceil(MmTile::T64.items()) as u32;
        let groups_buf = gpu.storage("coop_map.groups", 16)?;
        let sides = Sides::of(Form::default(), false);
        let got = m.run_raw(
            gpu,
            kernel,
            &[nx, ny, z],
            nx,
            Some(&groups_buf),
            None,
            sides,
        )?;
        let want = m.staged_f16();
        out += &format!(
            "{rows} rows × {cols} columns, {items} items: {:.1e};",
            rel_l2_f64(&got, &want)
        );
        for t0 in (0..items).step_by(size) {
            out.push(' ');
            for r0 in (0..rows).step_by(size) {
                let (mut num, mut den, mut zero) = (0f64, 0f64, true);
                for t in t0..(t0 + size).min(items) {
                    for r in r0..(r0 + size).min(rows) {
                        let (g, w) = (got[t * rows + r] as f64, want[t * rows + r]);
                        num += (g - w).powi(2);
                        den += w.powi(2);
                        zero &= g == 0.0;
                    }
                }
                out.push(if zero {
                    '0'
                } else if num <= 1e-6 * den {
                    '.'
                } else {
                    'x'
                });
            }
        }
        out += "\n";
    }
    Ok(out)
}

/// linear_q4_coop.wgsl with its cooperative operations emulated in plain WGSL
/// (`Spec::coop_emulated`: what CI can run, on adapters without cooperative matrices) on
/// matrices of `size` (8 or 16), tiles of 16, 32 and 64 items, 4- and 8-bit, in the forms a plan
/// with activations in f16 (`act_f16`) or f32 compiles (`big`: linear_q4_coop_big.wgsl, each
/// tile in its `BigLayout`, on workgroups of `rows` rows: 64, or 128 as `coop_rows` 128 compiles
/// it, each tile size where it fits this device's workgroup memory): the tiles run, and the
/// largest relative L2 difference from
/// the host's product of the f16-staged operands (`check_mm_f16`'s second figure). The kernel's
/// staging, indexing and stores are the real ones; the emulated operations have the meaning
/// naga gives the cooperative ones (docs/WGPU.md).
pub fn check_coop_emulated(
    gpu: &Gpu,
    size: u32,
    act_f16: bool,
    big: bool,
    rows: u32,
) -> Result<(Vec<MmTile>, f64)> {
    let forms: &[Form] = if act_f16 {
        &Form::ALL[..2]
    } else {
        &[Form::ALL[0]]
    };
    let mut worst = 0f64;
    let mut run = Vec::new();
    for tile in [MmTile::T16, MmTile::T32, MmTile::T64] {
        let mut fits = coop_spec(tile, size, big);
        fits.coop_emulated = true;
        fits.coop_rows = rows;
        if fits.needs()?.exceeds(&gpu.limits).is_some() {
            continue;
        }
        run.push(tile);
        for &form in forms {
            let mut spec = coop_spec(tile, size, big);
            spec.coop_emulated = true;
            spec.coop_rows = rows;
            spec.act_f16 = act_f16;
            spec.form = form;
            let kernel = Kernel::new(gpu, &spec, false)?;
            for bits in [4, 8] {
                let sides = Sides::of(form, act_f16);
                let (_, staged) = check_mm_f16(gpu, &kernel, tile, bits, sides)?;
                worst = worst.max(staged);
            }
        }
    }
    Ok((run, worst))
}

/// Relative L2 difference of `got` from `want` (infinite where `got` holds a non-finite value).
fn rel_l2_f64(got: &[f32], want: &[f64]) -> f64 {
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
/// 2,048 columns and an 8-bit one of 2,048 (37 rows: the last workgroup partly filled; 2 items)
/// at 16, 4 and 2 rows a workgroup, and linear_q4_glu_rows.wgsl (`check_glu_rows`): the largest
/// relative L2 difference, over every form compiled (`act_f16`: the activations f16, `Sides`).
/// `items`: the plan's linear_q4_glu_rows routes in items' rounds (`Plan::glu_items`: its grid a
/// workgroup a row and token); `glu_rb`: its rows a workgroup otherwise (`Plan::glu_rb`).
#[allow(clippy::too_many_arguments)]
pub fn check_rows(
    gpu: &Gpu,
    k: &Kernels,
    act_f16: bool,
    items: bool,
    glu_rb: usize,
    one_word: bool,
) -> Result<f64> {
    let glu = check_glu_rows(gpu, k, act_f16, glu_rb)?
        .max(check_glu_route(gpu, k, act_f16, items, glu_rb)?)
        .max(check_rows_conv(gpu, k, act_f16)?)
        .max(check_rows_accumulate(gpu, k, act_f16, one_word)?);
    let mut worst = 0f64;
    for (bits, cols) in [(4, 4096), (4, 2048), (8, 2048)] {
        for rb in [16usize, 8, 4, 2, 1] {
            // `one_word` (`rows_one_word`): the 16-row kernel takes one-word rows only.
            if one_word && rb == 16 && crate::plan::words_of(cols, bits) > 1 {
                continue;
            }
            // The 1-row kernel (`router_lean`'s `LEAN`) where the plan compiled it.
            let Some(forms) = k.rows_if(rb) else {
                continue;
            };
            let (rows, items) = (37usize, 2usize);
            let m = RandomQ4::with_bits(bits, rows, cols, 64, items);
            for (form, kernel) in forms.iter() {
                let sides = Sides::of(form, act_f16);
                let (nx, ny) = grid_2d(rows.div_ceil(rb));
                // Plain, then with the RMSNorm folded in (decode's norms: `Io::norm`) where
                // the input is the residual stream.
                let norms = if sides.x_f16 {
                    &[None][..]
                } else {
                    &[None, Some(1e-6)][..]
                };
                for &norm in norms {
                    let grid = [nx, ny, items as u32];
                    let e = m.run(gpu, kernel, &grid, nx, None, Some(norm), sides)?;
                    worst = worst.max(e);
                }
            }
        }
    }
    Ok(worst.max(glu))
}

/// What `check_rows_persist` (or `check_rows_one_word`) found: the largest relative L2
/// difference from the host's f64, and whether the new form's outputs (the persistent kernel;
/// the one-word rows) were bit for bit those of the reference form (one workgroup a block,
/// `PERSIST` 0; rows of one or two words chosen at run time) in every case.
#[derive(Clone, Copy, Debug)]
pub struct PersistCheck {
    pub err: f64,
    pub same_bits: bool,
}

/// linear_q4_rows.wgsl's persistent 16-row kernel (`rows_persist`: `PERSIST` 1, launched on
/// fewer workgroups than row blocks, each streaming blocks wid, wid + workgroups, ...), and its
/// 8-row one (`out_rows` 8: 23 blocks), against
/// the host's f64 and against the same kernel with `PERSIST` 0 on one workgroup a block: 4-bit
/// 2,048 and 4,096 columns and 8-bit 2,048, 181 rows (12 blocks, the last of 5 rows), 2 items,
/// the norm folded and not, `EARLY` 0 and 1, on `rows_grid`'s grids for 1, 2, 5 and 12 workers
/// (12, 6, 3 or 2 blocks a workgroup — with 5 the workgroups' shares differ —, and for 12, one
/// workgroup a block: fewer than `PERSIST_SHARE` blocks a worker). The input and output f32
/// (the residual stream in, as the folded norm reads it); the plan's reductions (`subgroups`).
pub fn check_rows_persist(gpu: &Gpu, subgroups: bool) -> Result<PersistCheck> {
    let mut out = PersistCheck {
        err: 0.0,
        same_bits: true,
    };
    // The 16-row kernel (`rows_persist`) and the 8-row one (`out_rows` 8).
    for rb in [crate::plan::PERSIST_RB, 8] {
        let one = check_rows_persist_rb(gpu, subgroups, rb, false)?;
        out.err = out.err.max(one.err);
        out.same_bits &= one.same_bits;
    }
    Ok(out)
}

/// linear_q4_rows.wgsl's 16-row kernel compiled for one-word rows (`rows_one_word`: `WORDS` 1)
/// on the one-word rows it is given (4-bit, 2,048 columns; 181 rows, 2 items, the norm folded
/// and not, `EARLY` 0 and 1): persistent (`PERSIST` 1) on `rows_grid`'s grids for 1, 2, 5 and
/// 12 workers and in one pass (`PERSIST` 0) on one workgroup a block, each against the host's
/// f64 and bit for bit against today's kernel (`WORDS` 2, `PERSIST` 0, one workgroup a block).
pub fn check_rows_one_word(gpu: &Gpu, subgroups: bool) -> Result<PersistCheck> {
    check_rows_persist_rb(gpu, subgroups, crate::plan::PERSIST_RB, true)
}

/// `check_rows_persist` for the kernel of `rb` rows a workgroup; `one_word`: the kernels under
/// test compiled with `WORDS` 1 (`check_rows_one_word`), on the one-word shape only.
fn check_rows_persist_rb(
    gpu: &Gpu,
    subgroups: bool,
    rb: usize,
    one_word: bool,
) -> Result<PersistCheck> {
    let (rows, items) = (181usize, 2usize);
    let blocks = rows.div_ceil(rb);
    let sides = Sides::default();
    let form = Form {
        x_f32: true,
        y_f32: true,
    };
    let mut out = PersistCheck {
        err: 0.0,
        same_bits: true,
    };
    let shapes: &[(usize, usize)] = if one_word {
        &[(4, 2048)]
    } else {
        &[(4, 2048), (4, 4096), (8, 2048)]
    };
    for &(bits, cols) in shapes {
        let m = RandomQ4::with_bits(bits, rows, cols, 64, items);
        for early in [false, true] {
            let spec = |persist, one| crate::shaders::Spec {
                form,
                ..rows_spec(rb, early, persist, one).with_subgroups(subgroups)
            };
            let plain = Kernel::new(gpu, &spec(false, false), false)?;
            let persist = Kernel::new(gpu, &spec(true, one_word), false)?;
            let plain_one = match one_word {
                true => Some(Kernel::new(gpu, &spec(false, true), false)?),
                false => None,
            };
            for norm in [None, Some(1e-6)] {
                let (nx, ny) = grid_2d(blocks);
                let grid = [nx, ny, items as u32];
                let want = m.run_raw(gpu, &plain, &grid, nx, None, Some(norm), sides)?;
                if let Some(k1) = &plain_one {
                    // The one-pass kernel with `WORDS` 1 on the same grid.
                    let got = m.run_raw(gpu, k1, &grid, nx, None, Some(norm), sides)?;
                    out.err = out
                        .err
                        .max(rel_l2_f64(&got, &m.want_for(Some(norm), sides)));
                    out.same_bits &= got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                }
                for workers in [1usize, 2, 5, 12] {
                    let (wx, wy) = rows_grid(blocks, Some(workers));
                    let grid = [wx, wy, items as u32];
                    let got = m.run_raw(gpu, &persist, &grid, wx, None, Some(norm), sides)?;
                    let host = m.want_for(Some(norm), sides);
                    out.err = out.err.max(rel_l2_f64(&got, &host));
                    let same = got
                        .iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    out.same_bits &= same;
                }
            }
        }
    }
    Ok(out)
}

/// linear_q4_glu_rows.wgsl (plain mode: gate and up two random 4-bit matrices of 2,048 columns,
/// 37 rows, 2 items) against silu(gate x) · (up x) on the host: the relative L2 difference.
fn check_glu_rows(gpu: &Gpu, k: &Kernels, act_f16: bool, glu_rb: usize) -> Result<f64> {
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
    let wn = gpu.upload_f32("check.wn", &gate.norm_w)?;
    let ybuf = gpu.storage("check.y", (items * rows * 4) as u64)?;
    let ids = gpu.storage("check.ids", 16)?;
    let (nx, ny) = grid_2d(rows.div_ceil(glu_rb));
    let mut worst = 0f64;
    for (kernel, sides, norm) in glu_cases(k, act_f16) {
        let xbuf = upload_act(gpu, "check.x", &gate.x, sides.x_f16)?;
        let x = match norm {
            Some(eps) => gate.normed(eps),
            None => round_f16(&gate.x, sides.x_f16),
        };
        let params: [u32; 27] = [
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
            0,
            0,
            norm.is_some() as u32,
            norm.unwrap_or(0.0).to_bits(),
            0,
            0,
            0,
            0,
            0,
        ];
        let mut r = Recorder::new(gpu);
        r.dispatch(
            kernel,
            &params,
            &[&wg, &xbuf, &ybuf, &ids, &wu, &wn, &xbuf, &ids],
            [nx, ny, items as u32],
        );
        r.submit()?;
        let got = read_act(gpu, &ybuf, items * rows, sides.y_f16)?;
        let items_x = (0..items).map(|t| (&x[t * cols..(t + 1) * cols], 0));
        worst = worst.max(glu_rel_err(&got, rows, &gate, &up, items_x));
    }
    Ok(worst)
}

/// linear_q4_glu_rows.wgsl's forms (`Sides`), each plain and, where its input is the residual
/// stream, with the RMSNorm folded in (decode's norms: `Io::norm`; eps 1e-6).
fn glu_cases(k: &Kernels, act_f16: bool) -> Vec<(&Kernel, Sides, Option<f32>)> {
    let mut v = Vec::new();
    for (form, kernel) in k.linear_q4_glu_rows.iter() {
        let sides = Sides::of(form, act_f16);
        v.push((kernel, sides, None));
        if !sides.x_f16 {
            v.push((kernel, sides, Some(1e-6f32)));
        }
    }
    v
}

/// linear_q4_rows.wgsl running DeltaNet's causal conv on its first rows (`conv_ch`, decode's
/// in_proj): a random 4-bit matrix of 37 rows × 2,048 columns (the input normalised first, as at
/// decode), the first 29 rows conv channels with random taps (k = 4) and a random state, for
/// 16, 4 and 2 rows a workgroup. Against the host in f64: each conv channel's silu(Σ taps ·
/// (state, x)) with x its product, the other rows' products, and the shifted state: the largest
/// relative L2 difference.
fn check_rows_conv(gpu: &Gpu, k: &Kernels, act_f16: bool) -> Result<f64> {
    let (rows, cols, ch, taps_k) = (37usize, 2048usize, 29usize, 4usize);
    let m = RandomQ4::new(rows, cols, 64, 1);
    let eps = 1e-6f32;
    let x = m.normed(eps);
    let prod = m.product(&x);
    let mut seed = 0x51ed_2701_a3c4_9b17u64;
    let mut rnd = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        ((seed % 20_001) as f32 / 10_000.0) - 1.0
    };
    let taps: Vec<f32> = (0..ch * taps_k).map(|_| rnd() * 0.5).collect();
    let state0: Vec<f32> = (0..(taps_k - 1) * ch).map(|_| rnd() * 2.0).collect();
    let mut want_y = prod.clone();
    let mut want_state = state0.iter().map(|&v| v as f64).collect::<Vec<f64>>();
    for c in 0..ch {
        let mut acc = taps[c * taps_k + taps_k - 1] as f64 * prod[c];
        for j in 0..taps_k - 1 {
            acc += taps[c * taps_k + j] as f64 * state0[j * ch + c] as f64;
        }
        want_y[c] = silu(acc);
        for j in 0..taps_k - 2 {
            want_state[j * ch + c] = state0[(j + 1) * ch + c] as f64;
        }
        want_state[(taps_k - 2) * ch + c] = prod[c];
    }
    let wbuf = gpu.upload("check.w", &m.data)?;
    let xbuf = gpu.upload_f32("check.x", &m.x)?;
    let wn = gpu.upload_f32("check.wn", &m.norm_w)?;
    let tbuf = gpu.upload_f32("check.taps", &taps)?;
    let mut worst = 0f64;
    for rb in [16usize, 4, 2] {
        let ybuf = gpu.storage("check.y", (rows * 4) as u64)?;
        let sbuf = gpu.upload_f32("check.state", &state0)?;
        let (nx, ny) = grid_2d(rows.div_ceil(rb));
        let mut params = m.rows_params(nx, false);
        params[20] = 1;
        params[21] = eps.to_bits();
        params[22] = ch as u32;
        params[23] = taps_k as u32;
        let mut r = Recorder::new(gpu);
        // The residual stream in (the norm folded), DeltaNet's joint projection (an activation)
        // out; the conv state f32.
        let form = Form {
            x_f32: act_f16,
            y_f32: false,
        };
        r.dispatch(
            k.rows(rb).get(form),
            &params,
            &[&wbuf, &xbuf, &ybuf, &wn, &tbuf, &sbuf],
            [nx, ny, 1],
        );
        r.submit()?;
        let y = read_act(gpu, &ybuf, rows, act_f16)?;
        let st = gpu.read_f32(&sbuf, 0, state0.len())?;
        worst = worst
            .max(rel_l2_f64(&y, &want_y))
            .max(rel_l2_f64(&st, &want_state));
    }
    Ok(worst)
}

/// linear_q4_rows.wgsl adding into the residual stream (`accumulate`: decode's output
/// projections, 4,096 columns at 4 rows a workgroup, and 2,048 at 16, 37 rows, 2 items): the
/// host's random residual plus the f64 product of the activation input, against the residual
/// read back, every form that writes an f32 buffer. The relative L2 difference of the sums added.
fn check_rows_accumulate(gpu: &Gpu, k: &Kernels, act_f16: bool, one_word: bool) -> Result<f64> {
    let (rows, items) = (37usize, 2usize);
    let mut worst = 0f64;
    // 4,096 columns also at 8 and 16 rows (`out_rows`: out_proj in rounds; not at 16 where
    // that kernel takes one-word rows only, `one_word`).
    for (cols, rb) in [(4096usize, 4usize), (4096, 8), (4096, 16), (2048, 16)] {
        if one_word && rb == 16 && crate::plan::words_of(cols, 4) > 1 {
            continue;
        }
        let m = RandomQ4::new(rows, cols, 64, items);
        let y0: Vec<f32> =
            m.x.iter()
                .take(items * rows)
                .map(|v| v * 0.7 + 0.1)
                .collect();
        for (form, kernel) in k.rows(rb).iter() {
            if act_f16 && !form.y_f32 {
                continue;
            }
            let sides = Sides::of(form, act_f16);
            let (nx, ny) = grid_2d(rows.div_ceil(rb));
            let wbuf = gpu.upload("check.w", &m.data)?;
            let xbuf = upload_act(gpu, "check.x", &m.x, sides.x_f16)?;
            let ybuf = gpu.upload_f32("check.y", &y0)?;
            let params = m.rows_params(nx, true);
            let mut r = Recorder::new(gpu);
            r.dispatch(
                kernel,
                &params,
                &[&wbuf, &xbuf, &ybuf, &xbuf, &xbuf, &ybuf],
                [nx, ny, items as u32],
            );
            r.submit()?;
            let got = gpu.read_f32(&ybuf, 0, items * rows)?;
            let added: Vec<f32> = got
                .iter()
                .zip(&y0)
                .map(|(g, y)| (*g as f64 - *y as f64) as f32)
                .collect();
            worst = worst.max(rel_l2_f64(&added, &m.want_for(None, sides)));
        }
    }
    Ok(worst)
}

/// The outputs of dn_recur_norm.wgsl on one probe (`check_dn_step`): the normed, gated output
/// `[hv · dv]` and the updated state `[hv, dk, dv]`.
pub struct DnStep {
    pub y: Vec<f32>,
    pub state: Vec<f32>,
    /// Their relative L2 differences from the host's f64.
    pub y_err: f64,
    pub state_err: f64,
}

/// dn_recur_norm.wgsl (a decode step's DeltaNet: q/k L2 norms, gated delta rule, output norm
/// with the silu(z) gate; MODEL.md §2.5) compiled for key dim `dk` as `dn_recur_norm_spec(dk)`
/// with the plan's reductions and activations (`one_sync`: its `ONE_SYNC` form,
/// `dn_one_sync`), against the host in f64 on random inputs: 4
/// value heads over 2 key heads of dk = `dk`, dv = `dv` (below 128: columns past dv
/// idle), a random state, conv output (q | k | v), z, b, a, decay and norm weight (the
/// activations rounded to f16 where `act_f16`, as the kernel reads them).
pub fn check_dn_step(
    gpu: &Gpu,
    subgroups: bool,
    act_f16: bool,
    one_sync: bool,
    (dk, dv): (usize, usize),
) -> Result<DnStep> {
    let (hv, hk) = (4usize, 2usize);
    let (key_dim, vd) = (hk * dk, hv * dv);
    let cd = 2 * key_dim + vd;
    let eps = 1e-6f32;
    let mut seed = 0x9e37_79b9_7f4a_7c15u64 ^ (dk * 1000 + dv) as u64;
    let mut rnd = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed % 20_001) as f32 / 10_000.0 - 1.0
    };
    let c = round_f16(&(0..cd).map(|_| rnd()).collect::<Vec<f32>>(), act_f16);
    // The joint projection's tail as the kernel reads it: z [hv · dv], then b [hv], a [hv].
    let ba = round_f16(
        &(0..vd + 2 * hv).map(|_| rnd() * 2.0).collect::<Vec<f32>>(),
        act_f16,
    );
    let decay: Vec<f32> = (0..2 * hv).map(|_| rnd() * 0.5).collect();
    let state0: Vec<f32> = (0..hv * dk * dv).map(|_| rnd() * 0.3).collect();
    let wn: Vec<f32> = (0..dv).map(|_| 0.5 + 0.5 * rnd().abs()).collect();
    let qscale = 1.0 / (dk as f32).sqrt();
    // The host in f64.
    let softplus = |x: f64| if x > 20.0 { x } else { x.exp().ln_1p() };
    let mut want_s: Vec<f64> = state0.iter().map(|&v| v as f64).collect();
    let mut want_y = vec![0f64; vd];
    for h in 0..hv {
        let kh = h / (hv / hk);
        let l2 = |v: &[f32], scale: f64| {
            let n = v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>();
            let r = scale / (n + 1e-6).sqrt();
            v.iter().map(|x| *x as f64 * r).collect::<Vec<f64>>()
        };
        let q = l2(&c[kh * dk..(kh + 1) * dk], qscale as f64);
        let kk = l2(&c[key_dim + kh * dk..key_dim + (kh + 1) * dk], 1.0);
        let v = &c[2 * key_dim + h * dv..2 * key_dim + (h + 1) * dv];
        let beta = 1.0 / (1.0 + (-(ba[vd + h] as f64)).exp());
        let g = -(decay[h] as f64).exp() * softplus(ba[vd + hv + h] as f64 + decay[hv + h] as f64);
        let alpha = g.exp();
        let st = &mut want_s[h * dk * dv..(h + 1) * dk * dv];
        st.iter_mut().for_each(|x| *x *= alpha);
        let mut o = vec![0f64; dv];
        for (j, oj) in o.iter_mut().enumerate() {
            let u: f64 = (0..dk).map(|i| st[i * dv + j] * kk[i]).sum();
            let delta = beta * (v[j] as f64 - u);
            for i in 0..dk {
                st[i * dv + j] += kk[i] * delta;
            }
            *oj = (0..dk).map(|i| st[i * dv + j] * q[i]).sum();
        }
        let ms = o.iter().map(|x| x * x).sum::<f64>() / dv as f64;
        let r = 1.0 / (ms + eps as f64).sqrt();
        for j in 0..dv {
            let z = ba[h * dv + j] as f64;
            want_y[h * dv + j] = o[j] * r * wn[j] as f64 * (z / (1.0 + (-z).exp()));
        }
    }
    let spec = crate::shaders::Spec {
        act_f16,
        ..dn_recur_norm_spec(dk, one_sync).with_subgroups(subgroups)
    };
    let kernel = Kernel::new(gpu, &spec, false)?;
    let cbuf = upload_act(gpu, "check.c", &c, act_f16)?;
    let babuf = upload_act(gpu, "check.ba", &ba, act_f16)?;
    let dbuf = gpu.upload_f32("check.decay", &decay)?;
    let sbuf = gpu.upload_f32("check.state", &state0)?;
    let wbuf = gpu.upload_f32("check.wn", &wn)?;
    let ybuf = gpu.storage("check.y", (vd * 4) as u64)?;
    let mut r = Recorder::new(gpu);
    r.dispatch(
        &kernel,
        &[
            1,
            hv as u32,
            hk as u32,
            dk as u32,
            dv as u32,
            cd as u32,
            (vd + 2 * hv) as u32,
            vd as u32,
            0,
            eps.to_bits(),
            qscale.to_bits(),
        ],
        &[&cbuf, &babuf, &dbuf, &sbuf, &wbuf, &ybuf],
        [hv as u32, 1, 1],
    );
    r.submit()?;
    let y = read_act(gpu, &ybuf, vd, act_f16)?;
    let state = gpu.read_f32(&sbuf, 0, state0.len())?;
    let (y_err, state_err) = (rel_l2_f64(&y, &want_y), rel_l2_f64(&state, &want_s));
    Ok(DnStep {
        y,
        state,
        y_err,
        state_err,
    })
}

/// linear_q4_glu_rows.wgsl routing its items itself (`route`, decode's experts): 2 tokens, E = 130
/// routed experts (the third of an invocation's slots partly filled) and the shared expert as
/// expert E of random 4-bit stacks (12 rows an expert: two row blocks, the second partly filled),
/// k = 8, random router logits with planted ties (three equal among the first picks of token 0;
/// two equal across the k-th place of token 1), the norm folded in and not. Against the host:
/// the experts picked (ids equal, the lower id on ties), their weights (softmax renormalised over
/// the k; the shared expert's sigmoid of its gate logit) and silu(gate x) · (up x) of each item's
/// expert in f64: the largest relative difference. ids and weights start poisoned. `items`: the
/// kernel's `ITEMS` form (`moe_rounds`), launched on a workgroup a row and token.
fn check_glu_route(
    gpu: &Gpu,
    k: &Kernels,
    act_f16: bool,
    items_form: bool,
    glu_rb: usize,
) -> Result<f64> {
    let (e, topk, r_e, cols, tokens) = (130usize, 8usize, 12usize, 2048usize, 2usize);
    let ks = topk + 1;
    let items = tokens * ks;
    let stack = (e + 1) * r_e;
    let gate = RandomQ4::new(stack, cols, 64, tokens);
    let up = RandomQ4::new(stack + 1, cols, 64, tokens);
    let words = stack * cols / 8;
    let mut data = up.data[..words * 4].to_vec();
    let ng = stack * cols / 64;
    let (us, ub) = (up.scale_off as usize * 2, up.bias_off as usize * 2);
    data.extend_from_slice(&up.data[us..us + ng * 2]);
    data.resize(gate.bias_off as usize * 2, 0);
    data.extend_from_slice(&up.data[ub..ub + ng * 2]);
    // Router logits [tokens, E + 1] (column E: the shared expert's gate), random in ±4.
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut logits: Vec<f32> = (0..tokens * (e + 1))
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            ((seed % 80_001) as f32 / 10_000.0) - 4.0
        })
        .collect();
    // Token 0: experts 5, 70 and 129 tie above every other; token 1: 9 and 100 tie at a value
    // between its 7th and 8th largest others, so one of them takes the 8th place (the lower id).
    for i in [5, 70, 129] {
        logits[i] = 6.0;
    }
    {
        let row = &mut logits[e + 1..2 * (e + 1)];
        let mut others: Vec<f32> = (0..e)
            .filter(|&i| i != 9 && i != 100)
            .map(|i| row[i])
            .collect();
        others.sort_by(|a, b| b.total_cmp(a));
        let tie = (others[6] + others[7]) / 2.0;
        row[9] = tie;
        row[100] = tie;
    }
    // The host's routing: experts by (logit descending, id ascending), the first k, weights
    // exp(l − top) renormalised over them; item k the shared expert.
    let mut want_ids = Vec::new();
    let mut want_wts = Vec::new();
    for t in 0..tokens {
        let row = &logits[t * (e + 1)..(t + 1) * (e + 1)];
        let mut order: Vec<usize> = (0..e).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        let top = row[order[0]] as f64;
        let ev: Vec<f64> = order[..topk]
            .iter()
            .map(|&i| (row[i] as f64 - top).exp())
            .collect();
        let den: f64 = ev.iter().sum();
        for (r, &i) in order[..topk].iter().enumerate() {
            want_ids.push(i as u32);
            want_wts.push(ev[r] / den);
        }
        want_ids.push(e as u32);
        want_wts.push(1.0 / (1.0 + (-(row[e] as f64)).exp()));
    }
    let wg = gpu.upload("check.gate", &gate.data)?;
    let wu = gpu.upload("check.up", &data)?;
    let wn = gpu.upload_f32("check.wn", &gate.norm_w)?;
    let lbuf = gpu.upload_f32("check.logits", &logits)?;
    let ybuf = gpu.storage("check.y", (items * r_e * 4) as u64)?;
    let ((nx, ny), nz) = if items_form {
        (grid_2d(r_e), tokens)
    } else {
        (grid_2d(r_e.div_ceil(glu_rb)), items)
    };
    let mut worst = 0f64;
    for (kernel, sides, norm) in glu_cases(k, act_f16) {
        let xbuf = upload_act(gpu, "check.x", &gate.x, sides.x_f16)?;
        let ids = gpu.upload("check.ids", &vec![0xffu8; items * 4])?;
        let wts = gpu.upload_f32("check.wts", &vec![f32::NAN; items])?;
        let x = match norm {
            Some(eps) => gate.normed(eps),
            None => round_f16(&gate.x, sides.x_f16),
        };
        let params: [u32; 27] = [
            r_e as u32,
            cols as u32,
            4,
            64,
            0,
            cols as u32,
            0,
            r_e as u32,
            0,
            gate.scale_off,
            gate.bias_off,
            1,
            0,
            (e + 1) as u32,
            ks as u32,
            (r_e * cols / 8) as u32,
            nx,
            0,
            0,
            0,
            norm.is_some() as u32,
            norm.unwrap_or(0.0).to_bits(),
            1,
            e as u32,
            topk as u32,
            (e + 1) as u32,
            ks as u32,
        ];
        let mut r = Recorder::new(gpu);
        r.dispatch(
            kernel,
            &params,
            &[&wg, &xbuf, &ybuf, &ids, &wu, &wn, &lbuf, &wts],
            [nx, ny, nz as u32],
        );
        r.submit()?;
        let got_ids = gpu.read_u32(&ids, items)?;
        if got_ids != want_ids {
            anyhow::bail!(
                "linear_q4_glu_rows routed experts {got_ids:?}, the host's {want_ids:?} (norm {norm:?})"
            );
        }
        let got_wts = gpu.read_f32(&wts, 0, items)?;
        for (g, w) in got_wts.iter().zip(&want_wts) {
            let d = (*g as f64 - w).abs() / w.abs().max(1e-30);
            if !d.is_finite() {
                return Ok(f64::INFINITY);
            }
            worst = worst.max(d);
        }
        let got = read_act(gpu, &ybuf, items * r_e, sides.y_f16)?;
        let items_x = want_ids.iter().enumerate().map(|(item, &ex)| {
            (
                &x[(item / ks) * cols..(item / ks + 1) * cols],
                ex as usize * r_e,
            )
        });
        worst = worst.max(glu_rel_err(&got, r_e, &gate, &up, items_x));
    }
    Ok(worst)
}

/// moe_down_rows.wgsl (a decode step's down projections and weighted sum into the residual,
/// compiled as `down_rows_spec(topk, cols, rb, ..)` with the plan's reductions and activations)
/// against the host in f64: x[t, r] += Σ_k w_{t,k} · (down_{e_{t,k}} a_{t,k})[r] on a random 4-bit
/// stack of 11 experts of 37 rows (the last row block partly filled), 2 tokens, random experts
/// and weights, random inputs (rounded to f16 where activations are, as the kernel reads them)
/// and a random residual; for 9 items of 512 columns (the full model's: 3 items a slot), 9 of
/// 256 (2 a slot, most slots' second past the last item) and 5 of 64 (slots without items).
/// Both forms: one item at a time (`ROUNDS` 0) and in rounds, the next item's reads in flight
/// (`ROUNDS` 1, `moe_rounds`). The largest relative L2 difference of the sums added, and
/// whether the rounds' sums are bit for bit the one-item-at-a-time kernel's in every case.
pub fn check_down_rows(gpu: &Gpu, subgroups: bool, act_f16: bool, rb: usize) -> Result<DownCheck> {
    check_down_forms(gpu, act_f16, rb, |topk, cols| {
        [false, true]
            .map(|rounds| down_rows_spec(topk, cols, rb, rounds).with_subgroups(subgroups))
            .to_vec()
    })
}

/// moe_down_lanes.wgsl (`down_item_lanes`: one item a lane, `down_lanes_spec`) on
/// `check_down_rows`' cases, after moe_down_rows in rounds (`ROUNDS` 1, what it replaces), both
/// with the plan's reductions and activations: the largest relative L2 difference of either's
/// sums from the host's f64, the largest of the lanes' sums from the rounds' (the same additions
/// in the same order, which a driver may still contract or reorder: NVIDIA's Vulkan driver did,
/// session 31), and whether the lanes' outputs are bit for bit the rounds' in every case (9 items
/// of 512 columns: 160 lanes; 9 of 256: 96; 5 of 64: 64, most lanes idle).
pub fn check_down_lanes(gpu: &Gpu, subgroups: bool, act_f16: bool, rb: usize) -> Result<DownCheck> {
    check_down_forms(gpu, act_f16, rb, |topk, cols| {
        let mut v = vec![down_rows_spec(topk, cols, rb, true).with_subgroups(subgroups)];
        v.extend(
            down_lanes_wg(topk, cols)
                .map(|wg| down_lanes_spec(topk, cols, rb, wg).with_subgroups(subgroups)),
        );
        v
    })
}

/// What `check_down_rows` / `check_down_lanes` found over every case: the largest relative L2
/// difference of any form's sums from the host's f64 (`err`), the largest of a later form's sums
/// from the first form's (`vs_first`), and whether every later form's outputs were the first's
/// bits (`same_bits`).
#[derive(Clone, Copy, Debug)]
pub struct DownCheck {
    pub err: f64,
    pub vs_first: f64,
    pub same_bits: bool,
}

/// `check_down_rows`' cases on each kernel `forms(topk, cols)` gives (the same launch): the
/// largest relative L2 difference from the host's f64 and from the first form's sums, and
/// whether every form's outputs are the first's bits.
fn check_down_forms(
    gpu: &Gpu,
    act_f16: bool,
    rb: usize,
    forms: impl Fn(usize, usize) -> Vec<crate::shaders::Spec>,
) -> Result<DownCheck> {
    let (n_e, rows, tokens) = (11usize, 37usize, 2usize);
    let mut out = DownCheck {
        err: 0.0,
        vs_first: 0.0,
        same_bits: true,
    };
    for (topk, cols) in [(9usize, 512usize), (9, 256), (5, 64)] {
        let items = tokens * topk;
        let m = RandomQ4::new(n_e * rows, cols, 64, items);
        let mut seed = 0x3c6e_f372_fe94_f82bu64 ^ cols as u64;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let ids: Vec<u32> = (0..items).map(|_| (next() % n_e as u64) as u32).collect();
        let wts: Vec<f32> = (0..items)
            .map(|_| 0.05 + (next() % 1000) as f32 / 1000.0)
            .collect();
        let x0: Vec<f32> = (0..tokens * rows)
            .map(|_| ((next() % 2001) as f32 / 1000.0 - 1.0) * 0.5)
            .collect();
        let a = round_f16(&m.x, act_f16);
        let mut want = vec![0f64; tokens * rows];
        for t in 0..tokens {
            for (r, w) in want[t * rows..(t + 1) * rows].iter_mut().enumerate() {
                for k in 0..topk {
                    let item = t * topk + k;
                    let wrow = &m.w[ids[item] as usize * rows + r];
                    let at = &a[item * cols..(item + 1) * cols];
                    let dot: f64 = wrow.iter().zip(at).map(|(p, q)| p * *q as f64).sum();
                    *w += wts[item] as f64 * dot;
                }
            }
        }
        let wbuf = gpu.upload("check.down", &m.data)?;
        let abuf = upload_act(gpu, "check.a", &m.x, act_f16)?;
        let wtbuf = gpu.upload_f32("check.wts", &wts)?;
        let idbuf = gpu.upload("check.ids", bytemuck::cast_slice(&ids))?;
        let (nx, ny) = grid_2d(rows.div_ceil(rb));
        let params = [rows as u32, cols as u32, 64, m.scale_off, m.bias_off, nx];
        // The first form's outputs and its sums added (in f64, as the host's).
        let mut first: Option<(Vec<f32>, Vec<f64>)> = None;
        let specs = forms(topk, cols);
        if specs.len() < 2 {
            bail!("moe_down check: fewer than two forms for {topk} items of {cols} columns");
        }
        for spec in specs {
            let spec = crate::shaders::Spec { act_f16, ..spec };
            let kernel = Kernel::new(gpu, &spec, false)?;
            let xbuf = gpu.upload_f32("check.x", &x0)?;
            let mut r = Recorder::new(gpu);
            r.dispatch(
                &kernel,
                &params,
                &[&wbuf, &abuf, &wtbuf, &idbuf, &xbuf],
                [nx, ny, tokens as u32],
            );
            r.submit()?;
            let got = gpu.read_f32(&xbuf, 0, tokens * rows)?;
            let added: Vec<f32> = got
                .iter()
                .zip(&x0)
                .map(|(g, x)| (*g as f64 - *x as f64) as f32)
                .collect();
            out.err = out.err.max(rel_l2_f64(&added, &want));
            match &first {
                None => first = Some((got, added.iter().map(|v| *v as f64).collect())),
                Some((f, f_added)) => {
                    out.vs_first = out.vs_first.max(rel_l2_f64(&added, f_added));
                    out.same_bits &= same_bits(f, &got);
                }
            }
        }
    }
    Ok(out)
}

/// Whether two outputs are the same bits.
fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

/// attend_gqa.wgsl (compiled for `d`, `g` = hq / hkv: `plan::attend_gqa_spec`) and
/// attend_merge.wgsl against the host's gated attention in f64, on random queries, gates and a
/// random cache of `n` positions: `t` tokens at positions n − t .. n (decode: t = 1; prefill-like:
/// t > 1), the keys split as `attention_splits` says under `merge`'s rule. The relative L2
/// difference of the outputs.
/// With `merge` None, `gqa` is attend_tile.wgsl (`plan::attend_tile_spec`): tiles of 64 / g
/// tokens, no key splits. `kv_f16`: the kernel reads an f16 cache; `act_f16`: its queries, gates
/// and output are f16 activations (the host takes the queries and gates rounded to f16; the
/// output's rounding, 2^-11 relative at most, remains).
#[allow(clippy::too_many_arguments)]
pub fn check_attention(
    gpu: &Gpu,
    gqa: &Kernel,
    merge: Option<(&Kernel, &SplitRule)>,
    (hkv, g, d): (usize, usize, usize),
    n: usize,
    t: usize,
    kv_f16: bool,
    act_f16: bool,
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
    let (q, qg) = (round_f16(&q, act_f16), round_f16(&qg, act_f16));
    // An f16 cache (`kv_f16`: the kernel compiled for one) holds the values rounded to f16; the
    // host's reference takes the same rounded values, so the check is of the kernel's arithmetic.
    let round = |v: f32| {
        if kv_f16 {
            half::f16::from_f32(v).to_f32()
        } else {
            v
        }
    };
    let kc: Vec<f32> = (0..n * hkv * d).map(|_| round(rnd())).collect();
    let vc: Vec<f32> = (0..n * hkv * d).map(|_| round(rnd())).collect();
    let scale = 1.0 / (d as f32).sqrt();
    let qb = upload_act(gpu, "check.q", &q, act_f16)?;
    let qgb = upload_act(gpu, "check.qg", &qg, act_f16)?;
    let cache = |label: &str, v: &[f32]| {
        if kv_f16 {
            let h: Vec<half::f16> = v.iter().map(|x| half::f16::from_f32(*x)).collect();
            gpu.upload(label, bytemuck::cast_slice(&h))
        } else {
            gpu.upload_f32(label, v)
        }
    };
    let kb = cache("check.k", &kc)?;
    let vb = cache("check.v", &vc)?;
    let ob = gpu.storage("check.o", (t * hq * d * 4) as u64)?;
    let part = gpu.storage("check.part", (PART_ROWS * (d + 2) * 4) as u64)?;
    let mut r = Recorder::new(gpu);
    let Some((merge, rule)) = merge else {
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
        let got = read_act(gpu, &ob, t * hq * d, act_f16)?;
        return Ok(attention_error(&got, &q, &qg, &kc, &vc, (hkv, g, d), n, t));
    };
    let (nsplit, span) = attention_splits(rule, hkv * t, hq * t, n);
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
        // The q/k norms' weights and the rope table (bindings 7, 8): unused without `prep`.
        &[&qb, &qgb, &kb, &vb, &ob, &part, &qb, &qb],
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
    let got = read_act(gpu, &ob, t * hq * d, act_f16)?;
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

/// SiLU in f64, for the host references.
fn silu(v: f64) -> f64 {
    v / (1.0 + (-v).exp())
}

/// The relative L2 difference of a GLU kernel's `got` ([items, rows]) from the host's
/// silu(gate · x) · (up · x) in f64, item i taking the input row and the first weight row that
/// `items` gives it; infinite on any non-finite value.
fn glu_rel_err<'x>(
    got: &[f32],
    rows: usize,
    gate: &RandomQ4,
    up: &RandomQ4,
    items: impl Iterator<Item = (&'x [f32], usize)>,
) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (item, (xt, w0)) in items.enumerate() {
        for row in 0..rows {
            let dot = |w: &[f64]| -> f64 { w.iter().zip(xt).map(|(a, b)| a * *b as f64).sum() };
            let want = silu(dot(&gate.w[w0 + row])) * dot(&up.w[w0 + row]);
            let g = got[item * rows + row];
            if !g.is_finite() {
                return f64::INFINITY;
            }
            num += (g as f64 - want).powi(2);
            den += want.powi(2);
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
    /// A random RMSNorm weight (`run` with a norm).
    norm_w: Vec<f32>,
}

impl RandomQ4 {
    /// The host's f64 product of the operands rounded to f16 as the f16 tiles and
    /// linear_q4_coop.wgsl stage them (the dequantised weight `q·s + b` and the input, each to
    /// the nearest f16), `[item][row]`.
    fn staged_f16(&self) -> Vec<f64> {
        let (rows, cols, items) = (self.rows, self.cols, self.items);
        let f16 = |v: f64| half::f16::from_f64(v).to_f64();
        let x16: Vec<f64> = self.x.iter().map(|v| f16(*v as f64)).collect();
        let mut staged = vec![0f64; items * rows];
        for (r, w) in self.w.iter().enumerate() {
            for t in 0..items {
                let xt = &x16[t * cols..(t + 1) * cols];
                staged[t * rows + r] = w.iter().zip(xt).map(|(a, b)| f16(*a) * b).sum();
            }
        }
        staged
    }

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
            let (h, v) = bf16(-s * (4.0 + 8.0 * (next() % 1000) as f32 / 1000.0));
            biases.push(v);
            data.extend_from_slice(&h.to_le_bytes());
        }
        let x: Vec<f32> = (0..items * cols)
            .map(|_| ((next() % 20_001) as f32 / 10_000.0 - 1.0) * 3.0)
            .collect();
        // The dequantised weight, MLX's affine form: q·s + b per group.
        let w: Vec<Vec<f64>> = (0..rows)
            .map(|r| {
                (0..cols)
                    .map(|k| {
                        let q =
                            (words[(r * cols + k) / per] >> (bits * (k % per))) & ((1 << bits) - 1);
                        let g = r * (cols / group) + k / group;
                        q as f64 * scales[g] as f64 + biases[g] as f64
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
            norm_w,
        };
        m.want = m.product(&m.x);
        m
    }

    /// linear_q4_rows.wgsl's parameters for this matrix (4- or 8-bit) in plain mode (one item a row of
    /// `cols` inputs, outputs `rows` apart; `nx` workgroups along x), adding into the output where
    /// `accumulate`; no norm, no conv (words 20.. zero).
    fn rows_params(&self, nx: u32, accumulate: bool) -> [u32; 24] {
        let (rows, cols) = (self.rows, self.cols);
        let mut params = [0u32; 24];
        params[..18].copy_from_slice(&[
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
            accumulate as u32,
        ]);
        params
    }

    /// `kernel` (linear.wgsl's parameters, plain mode) on this matrix: its output (items ×
    /// rows). `fourth`: the fourth binding, where the kernel has one.
    #[allow(clippy::too_many_arguments)]
    fn run_raw(
        &self,
        gpu: &Gpu,
        kernel: &Kernel,
        grid: &[u32; 3],
        nx: u32,
        fourth: Option<&wgpu::Buffer>,
        rows_norm: Option<Option<f32>>,
        sides: Sides,
    ) -> Result<Vec<f32>> {
        let (rows, cols, items) = (self.rows, self.cols, self.items);
        let wbuf = gpu.upload("check.w", &self.data)?;
        let xbuf = upload_act(gpu, "check.x", &self.x, sides.x_f16)?;
        let ybuf = gpu.storage("check.y", (items * rows * 4) as u64)?;
        let params: [u32; 23] = [
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
            0,
            0,
            items as u32,
            0,
            0,
        ];
        // The row kernels (`rows_norm` Some): word 20 says whether to normalise the input first
        // (RMSNorm with eps `Some(eps)` and the weight `self.norm_w`), 21 the eps.
        let mut params = params;
        let wn = gpu.upload_f32("check.wn", &self.norm_w)?;
        if let Some(norm) = rows_norm {
            params[20] = norm.is_some() as u32;
            params[21] = norm.unwrap_or(0.0).to_bits();
        }
        let mut bufs = vec![&wbuf, &xbuf, &ybuf];
        bufs.extend(fourth);
        if rows_norm.is_some() {
            // The norm's weight, then the conv's taps and state (unused: no conv channels).
            bufs.extend([&wn, &xbuf, &ybuf]);
        }
        let mut r = Recorder::new(gpu);
        r.dispatch(kernel, &params, &bufs, *grid);
        r.submit()?;
        read_act(gpu, &ybuf, items * rows, sides.y_f16)
    }

    /// `run_raw`'s output against the host's product (of the inputs as the kernel reads them:
    /// rounded to f16 where `sides.x_f16`): the relative L2 difference.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        gpu: &Gpu,
        kernel: &Kernel,
        grid: &[u32; 3],
        nx: u32,
        fourth: Option<&wgpu::Buffer>,
        rows_norm: Option<Option<f32>>,
        sides: Sides,
    ) -> Result<f64> {
        let got = self.run_raw(gpu, kernel, grid, nx, fourth, rows_norm, sides)?;
        Ok(rel_l2_f64(&got, &self.want_for(rows_norm, sides)))
    }

    /// The host's product of the inputs as `run_raw` feeds them: normalised first
    /// (`rows_norm`), or rounded to f16 where `sides.x_f16`.
    fn want_for(&self, rows_norm: Option<Option<f32>>, sides: Sides) -> Vec<f64> {
        match rows_norm {
            Some(Some(eps)) => self.product(&self.normed(eps)),
            _ if sides.x_f16 => self.product(&round_f16(&self.x, true)),
            _ => self.want.clone(),
        }
    }
}
