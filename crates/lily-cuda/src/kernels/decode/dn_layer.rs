//! `dec_dn_layer` (decode.cu): a one-token step's gated DeltaNet layer in one persistent launch
//! (`--fused-dn`), what `dec_gemv4` (in_proj, the input norm folded in), `dec_dn_conv`,
//! `dec_dn_step` and `dec_gemv4w` (gated norm, out_proj, residual add) do: which shapes it takes,
//! the shared memory a block needs, the launcher.

use anyhow::{bail, Result};
use cudarc::driver::DeviceRepr;
use lily_core::config::ModelConfig;

use super::{check_persistent, config, input_norm, row_rec, Decode, Input, WARPS, XPAD};
use crate::gpu::Gpu;
use crate::kernels::deltanet::DnShape;
use crate::weights::{DevDeltaNet, DevLinear, LinearShape, QWeightArg};

/// A DeltaNet layer's weights and head shapes as `dec_dn_layer` reads them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DnLayerShapes {
    pub in_qkv: LinearShape,
    pub in_z: LinearShape,
    pub in_b: LinearShape,
    pub in_a: LinearShape,
    pub out_proj: LinearShape,
    pub heads: DnShape,
    /// The conv's taps.
    pub taps: usize,
}

impl DnLayerShapes {
    pub fn of(d: &DevDeltaNet, cfg: &ModelConfig) -> DnLayerShapes {
        DnLayerShapes {
            in_qkv: d.in_qkv.shape(),
            in_z: d.in_z.shape(),
            in_b: d.in_b.shape(),
            in_a: d.in_a.shape(),
            out_proj: d.out_proj.shape(),
            heads: DnShape::of(cfg),
            taps: cfg.conv_kernel,
        }
    }

    /// Rows of in_proj's four weights together (the list the grid splits).
    fn in_rows(&self) -> usize {
        self.in_qkv.rows + self.in_z.rows + self.in_b.rows + self.in_a.rows
    }
}

/// Why `dec_dn_layer` cannot run this layer (`None`: it can): in_proj's four weights and out_proj
/// 4-bit with 64-column groups; an input of 512, 1,024 or 2,048 columns (one group a lane) and a
/// value width of 512 ..= 4,096, a power of two (one or two groups a lane; whole 16-byte pieces of
/// scales a row); the rows the heads say; head shapes the one-token step takes
/// (`Decode::dn_serves`).
pub fn dn_layer_unfit(w: &DnLayerShapes) -> Option<String> {
    let DnShape { n_k, n_v, dk, dv } = w.heads;
    if !Decode::dn_serves(n_k, n_v, dk, dv, w.taps) {
        return Some(format!(
            "heads {n_k}/{n_v} of dims {dk}/{dv} with {} conv taps",
            w.taps
        ));
    }
    let hidden = w.in_qkv.cols;
    let (conv_dim, vd) = (2 * n_k * dk + n_v * dv, n_v * dv);
    if ![512, 1024, 2048].contains(&hidden) {
        return Some(format!("a {hidden}-wide input: must be 512, 1024 or 2048"));
    }
    if !(512..=4096).contains(&vd) || !vd.is_power_of_two() {
        return Some(format!(
            "a value width of {vd}: must be a power of two of 512 ..= 4096"
        ));
    }
    let want = |name: &str, s: &LinearShape, rows: usize, cols: usize| {
        (s.bits != 4 || s.group != 64 || s.experts != 1 || s.rows != rows || s.cols != cols).then(
            || {
                format!(
                    "{name}: {} x [{}, {}] {}-bit (group {}), wants [{rows}, {cols}] 4-bit (group 64)",
                    s.experts, s.rows, s.cols, s.bits, s.group
                )
            },
        )
    };
    want("in_proj_qkv", &w.in_qkv, conv_dim, hidden)
        .or_else(|| want("in_proj_z", &w.in_z, vd, hidden))
        .or_else(|| want("in_proj_b", &w.in_b, n_v, hidden))
        .or_else(|| want("in_proj_a", &w.in_a, n_v, hidden))
        .or_else(|| want("out_proj", &w.out_proj, hidden, vd))
}

/// The split of the work over `grid` blocks: rows of the concatenated in_proj list, and out_proj's
/// output rows, a block.
fn dn_layer_shares(w: &DnLayerShapes, grid: usize) -> (usize, usize) {
    let grid = grid.max(1);
    (w.in_rows().div_ceil(grid), w.out_proj.rows.div_ceil(grid))
}

/// Dynamic shared memory of a `dec_dn_layer` block on a grid of `grid` blocks (decode.cu's
/// layout): x staged with its group sums, the conv taps and conv state of the block's channels,
/// its in_proj rows as staged records (phase C's gated row and its group sums in the same bytes),
/// its out_proj rows as staged records.
fn dn_layer_smem(w: &DnLayerShapes, grid: usize) -> usize {
    let r4 = |n: usize| n.next_multiple_of(4);
    let (in_share, out_share) = dn_layer_shares(w, grid);
    let (hidden, vd, k) = (w.in_qkv.cols, w.out_proj.cols, w.taps);
    let (gh, gv) = (hidden / 64, vd / 64);
    let front = 4 * (gh * XPAD + r4(gh) + r4(in_share * k) + r4(in_share * (k - 1)));
    let records = in_share * row_rec(hidden);
    let phase_c = 4 * (gv * XPAD + r4(gv));
    front + records.max(phase_c) + out_share * row_rec(vd)
}

/// Bytes of static shared memory a `dec_dn_layer` block holds at most (the step's q, k, α and β
/// for two groups, the group sums' and block_sum's arrays: 2,224 bytes); the launcher checks the
/// exact figure.
const DN_LAYER_STATIC_SMEM: usize = 2_304;

/// Whether `dec_dn_layer` runs this layer on a device of `sm_count` SMs granting a block
/// `max_shared_memory` bytes: the shapes it takes (`dn_layer_unfit`), and one block an SM fits the
/// shared memory its share of the weights needs (H200: 153 KB of 227; not an A100's 163 KB on its
/// 108 SMs' larger shares, nor sm_86 / 89 / 120's 99 KB).
pub fn dn_layer_fits(w: &DnLayerShapes, sm_count: usize, max_shared_memory: usize) -> bool {
    dn_layer_unfit(w).is_none()
        && sm_count > 0
        && dn_layer_smem(w, sm_count) + DN_LAYER_STATIC_SMEM <= max_shared_memory
}

/// The buffers a DeltaNet layer's one-token step writes, the same whether it runs in one launch
/// (`dec_dn_layer`) or four: f32 [conv_dim] the conv's output, [value_dim] z, [n_v] b and a,
/// [value_dim] the recurrence's output.
#[derive(Clone, Copy)]
pub struct DnOutputs {
    pub c: u64,
    pub z: u64,
    pub b: u64,
    pub a: u64,
    pub o: u64,
}

/// The whole DeltaNet layer of one token in one launch (`dec_dn_layer`).
pub struct DnLayer<'a> {
    /// The layer's input row and its RMSNorm (`Prologue::RmsNorm`, or `None` for a row taken as it
    /// is).
    pub input: Input,
    pub dn: &'a DevDeltaNet,
    pub heads: DnShape,
    pub taps: usize,
    /// f32 [n_v, dk, dv] and [taps - 1, conv_dim], updated.
    pub state: u64,
    pub conv_state: u64,
    /// Written, as the four launches write them.
    pub out: DnOutputs,
    /// The residual row [hidden]: += out_proj · gated_norm(o, z).
    pub residual: u64,
    /// The gated norm's epsilon, and dn_prep's (q/k norms).
    pub gnorm_eps: f32,
    pub prep_eps: f32,
}

/// `struct DecDn` of decode.cu, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct DecDnArg {
    in_qkv: QWeightArg,
    in_z: QWeightArg,
    in_b: QWeightArg,
    in_a: QWeightArg,
    out: QWeightArg,
    x: u64,
    norm_w: u64,
    conv_w: u64,
    conv_state: u64,
    a_log: u64,
    dt_bias: u64,
    state: u64,
    gnorm_w: u64,
    c: u64,
    z: u64,
    b: u64,
    a: u64,
    o: u64,
    y: u64,
    bar: u64,
    eps: f32,
    gnorm_eps: f32,
    prep_eps: f32,
    n_k: i32,
    n_v: i32,
    dk: i32,
    dv: i32,
    k: i32,
    in_share: i32,
    out_share: i32,
}

// SAFETY: plain #[repr(C)] data matching decode.cu's DecDn field for field (five 40-byte
// QWeights, fifteen 8-byte pointers, three floats and seven ints: 4-byte fields to the end, the
// same layout and tail padding in both).
unsafe impl DeviceRepr for DecDnArg {}

/// Whether every weight's packed words, scales and biases are 16-byte aligned: `dec_dn_layer`
/// copies them with cp.async.
fn weights_aligned(ws: &[&DevLinear]) -> bool {
    ws.iter().all(|l| {
        let q = l.arg();
        [q.q, q.scales, q.biases]
            .iter()
            .all(|p| p.is_multiple_of(16))
    })
}

impl Decode {
    /// The whole DeltaNet layer of one token in one launch (`dec_dn_layer`): a persistent grid
    /// of one block an SM, every block resident at once (checked against the driver's occupancy
    /// for its shared memory), phases separated by a grid barrier over `dn_barrier`.
    pub fn dn_layer(&self, gpu: &Gpu, a: &DnLayer) -> Result<()> {
        let d = a.dn;
        let w = DnLayerShapes {
            in_qkv: d.in_qkv.shape(),
            in_z: d.in_z.shape(),
            in_b: d.in_b.shape(),
            in_a: d.in_a.shape(),
            out_proj: d.out_proj.shape(),
            heads: a.heads,
            taps: a.taps,
        };
        if let Some(why) = dn_layer_unfit(&w) {
            bail!("dec_dn_layer: {why}");
        }
        let (norm_w, eps) = input_norm("dec_dn_layer", &a.input, w.in_qkv.cols)?;
        if !weights_aligned(&[&d.in_qkv, &d.in_z, &d.in_b, &d.in_a, &d.out_proj]) {
            bail!("dec_dn_layer: weights must be 16-byte aligned");
        }
        let grid = gpu.sm_count;
        let smem = dn_layer_smem(&w, grid);
        let threads = WARPS * 32;
        let smem_max = self.dn_layer_smem_max;
        check_persistent(
            "dec_dn_layer",
            &self.dn_layer,
            threads,
            smem,
            smem_max,
            grid,
        )?;
        let (in_share, out_share) = dn_layer_shares(&w, grid);
        let DnShape { n_k, n_v, dk, dv } = a.heads;
        let args = DecDnArg {
            in_qkv: d.in_qkv.arg(),
            in_z: d.in_z.arg(),
            in_b: d.in_b.arg(),
            in_a: d.in_a.arg(),
            out: d.out_proj.arg(),
            x: a.input.x,
            norm_w,
            conv_w: d.conv.ptr,
            conv_state: a.conv_state,
            a_log: d.a_log.ptr,
            dt_bias: d.dt_bias.ptr,
            state: a.state,
            gnorm_w: d.norm.ptr,
            c: a.out.c,
            z: a.out.z,
            b: a.out.b,
            a: a.out.a,
            o: a.out.o,
            y: a.residual,
            bar: self.dn_barrier.ptr,
            eps,
            gnorm_eps: a.gnorm_eps,
            prep_eps: a.prep_eps,
            n_k: n_k as i32,
            n_v: n_v as i32,
            dk: dk as i32,
            dv: dv as i32,
            k: a.taps as i32,
            in_share: in_share as i32,
            out_share: out_share as i32,
        };
        let cfg = config((grid as u32, 1, 1), threads as u32, smem);
        gpu.launch(&self.dn_layer, cfg, |l| {
            l.arg(&args);
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mlx(rows: usize, cols: usize) -> LinearShape {
        LinearShape {
            experts: 1,
            rows,
            cols,
            bits: 4,
            group: 64,
        }
    }

    /// Qwen3.6's DeltaNet layer: hidden 2,048, 16 key heads and 32 value heads of 128, 4 taps.
    fn full() -> DnLayerShapes {
        DnLayerShapes {
            in_qkv: mlx(8192, 2048),
            in_z: mlx(4096, 2048),
            in_b: mlx(32, 2048),
            in_a: mlx(32, 2048),
            out_proj: mlx(2048, 4096),
            heads: DnShape {
                n_k: 16,
                n_v: 32,
                dk: 128,
                dv: 128,
            },
            taps: 4,
        }
    }

    /// The figures the comments give: 94 in_proj rows and 16 output rows a block on an H200's 132
    /// SMs, 153 KB of shared memory; the A100's 108 SMs take 115 and 19 rows, past its 163 KB.
    #[test]
    fn the_full_layer_fits_an_h200_not_an_a100() {
        let w = full();
        assert_eq!(dn_layer_unfit(&w), None);
        assert_eq!(dn_layer_shares(&w, 132), (94, 16));
        let smem = dn_layer_smem(&w, 132);
        assert!((150_000..160_000).contains(&smem), "{smem}");
        assert!(dn_layer_fits(&w, 132, 232_448));
        assert!(!dn_layer_fits(&w, 108, 166_912));
        assert!(!dn_layer_fits(&w, 84, 101_376));
    }

    #[test]
    fn shapes_it_does_not_read_are_named() {
        let w = full();
        let cases = [
            (
                DnLayerShapes {
                    in_b: LinearShape { bits: 8, ..w.in_b },
                    ..w
                },
                "in_proj_b",
            ),
            (
                DnLayerShapes {
                    in_z: mlx(4000, 2048),
                    ..w
                },
                "in_proj_z",
            ),
            (
                DnLayerShapes {
                    in_qkv: mlx(8192, 4096),
                    ..w
                },
                "4096-wide input",
            ),
            (DnLayerShapes { taps: 9, ..w }, "conv taps"),
        ];
        for (bad, why) in cases {
            let got = dn_layer_unfit(&bad).expect("unfit");
            assert!(got.contains(why), "{got}");
            assert!(!dn_layer_fits(&bad, 132, 232_448));
        }
    }
}
