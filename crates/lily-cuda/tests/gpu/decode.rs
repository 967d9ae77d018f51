//! decode.cu: the fused one-token kernels against the CPU.

use crate::common::*;
use lily_cuda::kernels::decode::{
    DownCombine, DownRegs, GemvGrid, GemvProducts, Glu, GluLoads, GroupedDown, GroupedGlu,
    MoeProducts, RowsKernel,
};

/// decode.cu's fused one-token blocks against the CPU (fp32 activations, outputs poisoned first):
/// attention and DeltaNet over single-token steps after a per-kernel chunk (caches, recurrent
/// and conv state carried across both paths), the MoE from the residual row with its norm folded
/// in, and the lm_head's GEMV against the CPU matmul.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn fused_decode_blocks_match_cpu() {
    let rig = BlockRig::new(8);
    let c = rig.cfg.clone();
    let h = c.hidden;
    let mut rng = Rng(11);
    let as_is = |x: u64| Input::row(x, h);
    let steps = [(5usize, false), (1, true), (1, true), (2, false), (1, true)];

    let w = random_attention(&mut rng, &c);
    let dw = upload_attention(&rig.g, &c, "attn", &w).unwrap();
    let mut kv = ops::KvCache::default();
    let mut pos = 0;
    for (n, fused) in steps {
        let x = rng.vec(n * h, 0.5);
        let xn = rng.vec(n * h, 1.0);
        let (k, v) = &rig.seq.kv[0];
        let got = rig.run(&x, &xn, |f| {
            let p = rig.seq.pos.ptr;
            if fused {
                let input = as_is(rig.scratch.xn.ptr);
                f.attention_one_token(&dw, k.ptr, v.ptr, p, pos + n, input)
                    .unwrap();
            } else {
                f.attention(&dw, k.ptr, v.ptr, p, pos + n, n).unwrap();
            }
            rig.g.k.sample.advance_pos(&rig.g, p, n).unwrap();
        });
        let want = ops::attention(&c, &w, &xn, &mut kv, pos);
        let what = format!("attention pos={pos} T={n} fused={fused}");
        check(&what, &got, &want, 1e-4);
        pos += n;
    }

    let w = random_deltanet(&mut rng, &c);
    let dw = upload_deltanet(&rig.g, &c, "dn", &w).unwrap();
    let mut st = ops::DeltaNetState::new(&c);
    for (n, fused) in steps {
        let x = rng.vec(n * h, 0.5);
        let xn = rng.vec(n * h, 1.0);
        let (state, conv) = &rig.seq.dn[0];
        let got = rig.run(&x, &xn, |f| {
            if fused {
                let input = as_is(rig.scratch.xn.ptr);
                f.deltanet_one_token(&dw, state.ptr, conv.ptr, input)
                    .unwrap();
            } else {
                f.deltanet(&dw, state.ptr, conv.ptr, n).unwrap();
            }
        });
        let want = ops::deltanet(&c, &w, &xn, &mut st);
        check(&format!("deltanet T={n} fused={fused}"), &got, &want, 1e-4);
        let sv: Vec<f32> = rig.g.read(state, 0, st.state.len()).unwrap();
        check(
            &format!("deltanet state T={n} fused={fused}"),
            &sv,
            &st.state,
            1e-4,
        );
        let cv: Vec<f32> = rig.g.read(conv, 0, st.conv.len()).unwrap();
        check(
            &format!("deltanet conv T={n} fused={fused}"),
            &cv,
            &st.conv,
            1e-6,
        );
    }

    let e = c.n_experts;
    let w = random_moe(&mut rng, &c);
    let dw = upload_moe(&rig.g, "moe", &w).unwrap();
    let norm_w: Vec<f32> = rng.vec(h, 1.0).iter().map(|v| 1.0 + 0.3 * v).collect();
    let norm_dev = rig.g.upload(&norm_w).unwrap();
    for _ in 0..3 {
        let x = rng.vec(h, 0.5);
        let got = rig.run(&x, &rng.vec(h, 1.0), |f| {
            let input = Input {
                x: rig.scratch.x.ptr,
                cols: h,
                prologue: Prologue::RmsNorm {
                    weight: norm_dev.ptr,
                    eps: c.rms_eps,
                },
                staged_out: Some(rig.scratch.xn.ptr),
            };
            f.moe_one_token(&dw, input).unwrap()
        });
        let xn = ops::rms_norm(&x, &norm_w, c.rms_eps);
        check(
            "fused moe (norm folded in)",
            &got,
            &ops::moe(&c, &w, &xn),
            1e-4,
        );
        let staged: Vec<f32> = rig.g.read(&rig.scratch.xn, 0, h).unwrap();
        check("fused moe staged norm", &staged, &xn, 1e-6);
        let logits: Vec<f32> = rig.g.read(&rig.scratch.router, 0, e).unwrap();
        check(
            "fused router logits",
            &logits,
            &matmul(&w.router, &xn),
            1e-5,
        );
    }

    // A wide single-row GEMV with several outputs per launch (the lm_head's and in_proj's path).
    let heads = linear(&mut rng, 4, 1, 1000, h);
    let dh = upload_linear(&rig.g, "head", &heads).unwrap();
    let x = rng.vec(h, 1.0);
    rig.g.write(&rig.scratch.xn, 0, &x).unwrap();
    let out = poisoned(&rig.g, 1000);
    let outs = [(&dh, Out::Store(out.ptr))];
    rig.g
        .k
        .decode
        .project(
            &rig.g,
            as_is(rig.scratch.xn.ptr),
            &outs,
            GemvProducts::Float,
            GemvGrid::Persistent,
        )
        .unwrap();
    let got: Vec<f32> = rig.g.read(&out, 0, 1000).unwrap();
    check("dec_gemv 1000 rows", &got, &matmul(&heads, &x), 1e-5);
    println!("KERNEL decode.cu fused blocks: attention, DeltaNet, MoE and GEMV match the CPU");
}

/// One fused-projection case of the decode GEMV tests: four random 4-bit weights of 300, 77, 16
/// and 1 rows over `cols` columns (rows that end mid-tile), the input row with RMSNorm or
/// DeltaNet's gated norm folded in (head dim 128), every store mode, one launch; `xn` is the CPU's
/// normed row. With `bf16`, the inputs are bf16 values (what that mode stores).
struct GemvCase {
    ws: Vec<Linear>,
    dws: Vec<DevLinear>,
    xn: Vec<f32>,
    resid: Vec<f32>,
    bufs: [DevBuf; 3],
    gated: bool,
    head_dim: usize,
    cols: usize,
}

const GEMV_CASE_ROWS: [usize; 4] = [300, 77, 16, 1];

const GEMV_CASE_EPS: f32 = 1e-6;

impl GemvCase {
    fn new(d: &Dev, rng: &mut Rng, cols: usize, gated: bool, bf16: bool) -> GemvCase {
        let r = |v: Vec<f32>| -> Vec<f32> {
            if bf16 {
                v.into_iter().map(round_bf16).collect()
            } else {
                v
            }
        };
        let ws: Vec<Linear> = GEMV_CASE_ROWS
            .iter()
            .map(|&n| linear(rng, 4, 1, n, cols))
            .collect();
        let dws = ws
            .iter()
            .enumerate()
            .map(|(i, w)| upload_linear(d, &format!("w{i}"), w).unwrap())
            .collect();
        let x = r(rng.vec(cols, 1.0));
        let z = r(rng.vec(cols, 1.0));
        let head_dim = 128.min(cols);
        let eps = GEMV_CASE_EPS;
        let norm_w: Vec<f32> = r(rng
            .vec(if gated { head_dim } else { cols }, 1.0)
            .iter()
            .map(|v| 1.0 + 0.3 * v)
            .collect());
        let xn: Vec<f32> = if gated {
            let mut y = vec![0f32; cols];
            for h in 0..cols / head_dim {
                let o = &x[h * head_dim..(h + 1) * head_dim];
                let ss: f32 = o.iter().map(|v| v * v).sum();
                let inv = 1.0 / (ss / head_dim as f32 + eps).sqrt();
                for i in 0..head_dim {
                    let zc = z[h * head_dim + i];
                    y[h * head_dim + i] = norm_w[i] * (o[i] * inv) * (zc / (1.0 + (-zc).exp()));
                }
            }
            y
        } else {
            ops::rms_norm(&x, &norm_w, eps)
        };
        let resid = r(rng.vec(GEMV_CASE_ROWS[1], 1.0));
        let bufs = [
            d.upload(&x).unwrap(),
            d.upload(&z).unwrap(),
            d.upload(&norm_w).unwrap(),
        ];
        GemvCase {
            ws,
            dws,
            xn,
            resid,
            bufs,
            gated,
            head_dim,
            cols,
        }
    }

    /// One launch through `Decode::project` as `d` is set up: the staged row and the four outputs.
    fn run(&self, d: &Dev) -> (Vec<f32>, Vec<Vec<f32>>) {
        let [xd, zd, nd] = &self.bufs;
        let outs_dev: Vec<DevBuf> = GEMV_CASE_ROWS.iter().map(|&r| poisoned(d, r)).collect();
        d.write(&outs_dev[1], 0, &self.resid).unwrap();
        let staged = poisoned(d, self.cols);
        let eps = GEMV_CASE_EPS;
        let prologue = if self.gated {
            Prologue::GatedNorm {
                weight: nd.ptr,
                z: zd.ptr,
                head_dim: self.head_dim,
                eps,
            }
        } else {
            Prologue::RmsNorm {
                weight: nd.ptr,
                eps,
            }
        };
        let input = Input {
            x: xd.ptr,
            cols: self.cols,
            prologue,
            staged_out: Some(staged.ptr),
        };
        let outs = [
            (&self.dws[0], Out::Store(outs_dev[0].ptr)),
            (&self.dws[1], Out::AddToResidual(outs_dev[1].ptr)),
            (&self.dws[2], Out::Exact(outs_dev[2].ptr)),
            (&self.dws[3], Out::Store(outs_dev[3].ptr)),
        ];
        d.k.decode
            .project(d, input, &outs, GemvProducts::Float, GemvGrid::Persistent)
            .unwrap();
        let got_xn = d.read(&staged, 0, self.cols).unwrap();
        let outs = outs_dev
            .iter()
            .zip(GEMV_CASE_ROWS)
            .map(|(b, n)| d.read(b, 0, n).unwrap())
            .collect();
        (got_xn, outs)
    }

    /// The CPU's outputs for the staged row `xn`: W·xn, plus the residual for output 1.
    fn want(&self, i: usize, xn: &[f32]) -> Vec<f32> {
        let mut want = matmul(&self.ws[i], xn);
        if i == 1 {
            want.iter_mut().zip(&self.resid).for_each(|(a, r)| *a += r);
        }
        want
    }
}

/// bf16 rounding to nearest even (what the bf16-activation kernels store).
fn round_bf16(v: f32) -> f32 {
    bf16::from_f32(v).to_f32()
}

/// The decode GEMVs at the model's widths (2048: in_proj, q/k/v, lm_head; 4096: o_proj /
/// out_proj) with the staging forms they use there (RMSNorm and DeltaNet's gated norm folded in,
/// every store mode, several projections per launch, rows that end mid-tile, more tiles than a
/// the grid holds at once), against the CPU.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn wide_decode_gemvs_match_cpu() {
    let d = gpu();
    let mut rng = Rng(29);
    for (cols, gated) in [
        (2048usize, false),
        (2048, true),
        (1024, false),
        (4096, true),
        (4096, false),
    ] {
        let case = GemvCase::new(&d, &mut rng, cols, gated, false);
        let (got_xn, got) = case.run(&d);
        let what = format!("dec_gemv {cols} cols gated={gated}");
        check(&format!("{what} staged input"), &got_xn, &case.xn, 1e-6);
        for (i, got) in got.iter().enumerate() {
            let what = format!("{what} output {i} ({} rows)", GEMV_CASE_ROWS[i]);
            check(&what, got, &case.want(i, &case.xn), 1e-5);
        }
    }
    // More tiles than the persistent grid takes at once (the lm_head's shape, shorter).
    let w = linear(&mut rng, 4, 1, 20_000, 2048);
    let dw = upload_linear(&d, "long", &w).unwrap();
    let x = rng.vec(2048, 1.0);
    let xd = d.upload(&x).unwrap();
    let out = poisoned(&d, 20_000);
    d.k.decode
        .project(
            &d,
            Input::row(xd.ptr, 2048),
            &[(&dw, Out::Store(out.ptr))],
            GemvProducts::Float,
            GemvGrid::Persistent,
        )
        .unwrap();
    let got: Vec<f32> = d.read(&out, 0, 20_000).unwrap();
    check("dec_gemv 20000 rows", &got, &matmul(&w, &x), 1e-5);
    println!("KERNEL decode.cu wide GEMVs match the CPU");
}

/// One batched-projection launch of `kernel` (`Decode::project_rows`) per row count of `nbs`,
/// four weights of `rows_of` rows and `bits` on a `cols`-wide input, every store mode (stored,
/// added into a residual, exact), outputs poisoned first, against the CPU's product (x as the
/// activations hold it: rounded to bf16 in bf16 mode, or always with `bf16_x`; each output
/// rounded as the kernel rounds it) to `tol`.
#[allow(clippy::too_many_arguments)]
fn rows_case(
    d: &Dev,
    kernel: RowsKernel,
    rng: &mut Rng,
    cols: usize,
    rows_of: &[usize; 4],
    bits: [u32; 4],
    nbs: &[usize],
    bf16_x: bool,
    tol: f64,
) {
    let bf16_activations = d.opts.bf16_activations;
    let r = |v: f32| if bf16_activations { round_bf16(v) } else { v };
    let rx = |v: f32| {
        if bf16_activations || bf16_x {
            round_bf16(v)
        } else {
            v
        }
    };
    let ws: Vec<Linear> = rows_of
        .iter()
        .zip(bits)
        .map(|(&n, b)| linear(rng, b, 1, n, cols))
        .collect();
    let dws: Vec<DevLinear> = ws
        .iter()
        .enumerate()
        .map(|(i, w)| upload_linear(d, &format!("w{i}"), w).unwrap())
        .collect();
    for &nb in nbs {
        let x: Vec<f32> = rng.vec(nb * cols, 1.0).into_iter().map(rx).collect();
        let resid: Vec<f32> = rng.vec(nb * rows_of[1], 1.0).into_iter().map(r).collect();
        let xd = d.upload(&x).unwrap();
        let outs_dev: Vec<DevBuf> = rows_of.iter().map(|&n| poisoned(d, nb * n)).collect();
        d.write(&outs_dev[1], 0, &resid).unwrap();
        let outs = [
            (&dws[0], Out::Store(outs_dev[0].ptr)),
            (&dws[1], Out::AddToResidual(outs_dev[1].ptr)),
            (&dws[2], Out::Exact(outs_dev[2].ptr)),
            (&dws[3], Out::Store(outs_dev[3].ptr)),
        ];
        d.k.decode
            .project_rows(d, kernel, xd.ptr, cols, nb, &outs)
            .unwrap();
        let what = format!("{kernel:?} {cols} cols, {nb} rows, bf16 {bf16_activations}");
        for (i, n) in rows_of.iter().enumerate() {
            let got: Vec<f32> = d.read(&outs_dev[i], 0, nb * n).unwrap();
            // [nb, n]: every row's product in one call.
            let y = matmul(&ws[i], &x);
            let want: Vec<f32> = y
                .iter()
                .enumerate()
                .map(|(k, &v)| match i {
                    1 => r(resid[k] + r(v)),
                    2 => v,
                    _ => r(v),
                })
                .collect();
            check(
                &format!("{what}: output {i} ({n} rows, {}-bit)", bits[i]),
                &got,
                &want,
                tol,
            );
        }
    }
}

/// `dec_gemv_rows` (a batched decode step's projections, `Decode::project_rows`) against the CPU:
/// at the model's widths (2048; 4096, whose eight rows take two launches, 5 + 3) and narrow ones
/// (64 and 256 columns: 1 and 4 lanes a weight row), 1, 2, 3, 8 and 11 rows (more than a launch
/// takes), four weights a launch with rows that end mid-tile (300, 77, 16, 1), 4-bit beside 8-bit
/// (the router's and the shared-expert gate's width) and every store mode (`rows_case`). fp32:
/// 1e-5 as the one-row GEMVs; bf16 inputs and stores: 1e-2.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn batched_decode_gemv_rows_match_cpu() {
    for bf16_activations in [false, true] {
        let d = dev(bf16_activations);
        let tol = if bf16_activations { 1e-2 } else { 1e-5 };
        let mut rng = Rng(41);
        for cols in [2048usize, 4096, 64, 256] {
            let nbs = [1usize, 2, 3, 4, 5, 6, 7, 8, 11];
            let (rows_of, bits) = ([300, 77, 16, 1], [4, 4, 8, 8]);
            rows_case(
                &d,
                RowsKernel::Gemv,
                &mut rng,
                cols,
                &rows_of,
                bits,
                &nbs,
                false,
                tol,
            );
        }
    }
    // Bad calls are refused with a message, nothing launched.
    let d = gpu();
    let mut rng = Rng(43);
    let w = upload_linear(&d, "w", &linear(&mut rng, 4, 1, 16, 128)).unwrap();
    let buf = poisoned(&d, 4 * 128);
    let out = [(&w, Out::Store(buf.ptr))];
    for kernel in [RowsKernel::Gemv, RowsKernel::Mma, RowsKernel::MmaDeep] {
        for (x, cols, rows, says) in [
            (buf.ptr, 256, 2, "256-wide"),
            (buf.ptr, 128, 0, "no input rows"),
            (buf.ptr + 4, 128, 1, "16-byte"),
        ] {
            let e =
                d.k.decode
                    .project_rows(&d, kernel, x, cols, rows, &out)
                    .unwrap_err();
            assert!(e.to_string().contains(says), "{kernel:?}: {e}");
        }
    }
    let w8 = upload_linear(&d, "w8", &linear(&mut rng, 8, 1, 16, 128)).unwrap();
    for kernel in [RowsKernel::Mma, RowsKernel::MmaDeep] {
        let e =
            d.k.decode
                .project_rows(&d, kernel, buf.ptr, 128, 1, &[(&w8, Out::Store(buf.ptr))])
                .unwrap_err();
        assert!(e.to_string().contains("4-bit"), "{kernel:?}: {e}");
    }
    println!("KERNEL decode.cu dec_gemv_rows matches the CPU");
}

/// `dec_mma_rows` (`mma_rows`: the batched 4-bit projections on the tensor cores) against the
/// CPU, as `rows_case` says: 4-bit weights only, inputs of 2,048, 4,096 (o_proj / out_proj), 512
/// and 64 columns, 1 to 8 and 11 rows, four weights a launch with rows that end mid-tile (300, 77,
/// 16, 1: a launch of few tiles, each split over a block's warps), and a launch of 68,000 rows
/// (4,250 tiles: whole tiles a warp, as lm_head's 15,520) at 1, 4 and 8 rows. x is fed to the
/// tensor cores as bf16, so in fp32 mode the inputs are bf16 values (as the activations are in
/// bf16 mode, the only mode the plan takes it in) and the bound is the sums' own rounding,
/// 1e-4 (the cancellation of the 128 offset costs a few bits); bf16 mode: 1e-2. The same for
/// `dec_mma_rows_deep` (`mma_rows_deep`: its weights through shared-memory stages; 4,096 columns
/// at 8 rows take its two-stage form).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn batched_decode_mma_rows_match_cpu() {
    for (kernel, bf16_activations) in [
        (RowsKernel::Mma, false),
        (RowsKernel::Mma, true),
        (RowsKernel::MmaDeep, false),
        (RowsKernel::MmaDeep, true),
    ] {
        let d = dev(bf16_activations);
        let tol = if bf16_activations { 1e-2 } else { 1e-4 };
        let mut rng = Rng(47);
        let nbs = [1usize, 2, 3, 4, 5, 6, 7, 8, 11];
        for cols in [2048usize, 4096, 512, 64] {
            let rows_of = [300, 77, 16, 1];
            rows_case(
                &d, kernel, &mut rng, cols, &rows_of, [4; 4], &nbs, true, tol,
            );
        }
        let rows_of = [68_000, 16, 5, 1];
        rows_case(
            &d,
            kernel,
            &mut rng,
            2048,
            &rows_of,
            [4; 4],
            &[1, 4, 8],
            true,
            tol,
        );
    }
    println!("KERNEL decode.cu dec_mma_rows and dec_mma_rows_deep match the CPU");
}

/// `dec_gemv_rows_split` (`router_rows_split`: a warp a weight row, its groups one a lane) against
/// the CPU as `rows_case` says: the router's width (2,048) and 4,096 (two groups a lane), 256 and
/// 64 (lanes idle), 1 to 8 and 11 rows, four weights of 300, 77, 16 and 1 rows, 8-bit beside 4-bit,
/// every store mode. fp32: 1e-5 (another order than dec_gemv_rows', both the sums' rounding);
/// bf16 inputs and stores: 1e-2.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn batched_decode_gemv_rows_split_matches_cpu() {
    for bf16_activations in [false, true] {
        let d = dev(bf16_activations);
        let tol = if bf16_activations { 1e-2 } else { 1e-5 };
        let mut rng = Rng(53);
        for cols in [2048usize, 4096, 256, 64] {
            let nbs = [1usize, 2, 3, 4, 5, 6, 7, 8, 11];
            rows_case(
                &d,
                RowsKernel::GemvSplit,
                &mut rng,
                cols,
                &[300, 77, 16, 1],
                [8, 8, 4, 4],
                &nbs,
                false,
                tol,
            );
        }
    }
    println!("KERNEL decode.cu dec_gemv_rows_split matches the CPU");
}

/// `batch_lean_glue`'s kernels give the plain ones' bits on the device (their FMA contraction,
/// rsqrtf and scheduling, which the CPU emulation does not have): `rms_norm_rows` against
/// `rms_norm` on 1 to 8 rows (the batched step's) of 2,048 (the model's), 4,096 (every register
/// a thread) and 1,000 columns, strided, rows of different scales, and near the CPU's norm;
/// `dec_gemv_rows_split_lean` against `dec_gemv_rows_split` on `rows_case`'s four weights (300,
/// 77, 16 and 1 rows, 8-bit beside 4-bit, every store mode) at 2,048, 4,096, 256 and 64 columns,
/// 1 to 8 and 11 rows; both activation modes.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn batch_lean_glue_gives_the_plain_kernels_bits() {
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for bf16_activations in [false, true] {
        let d = dev(bf16_activations);
        let mut rng = Rng(271);
        for (cols, stride) in [
            (2048usize, 2048usize),
            (2048, 2112),
            (4096, 4096),
            (1000, 1024),
        ] {
            for rows in [1usize, 2, 3, 4, 5, 8] {
                let mut x = rng.vec(rows * stride, 1.5);
                for (r, row) in x.chunks_mut(stride).enumerate() {
                    let scale = (r + 1) as f32 * if r % 2 == 1 { 7.0 } else { 0.05 };
                    row.iter_mut().for_each(|v| *v *= scale);
                }
                let w = rng.vec(cols, 1.0);
                let (dx, dw) = (d.upload(&x).unwrap(), d.upload(&w).unwrap());
                let ys = [0, 1].map(|_| poisoned(&d, rows * stride));
                let a = |y: &DevBuf| RmsNorm {
                    x: Rows {
                        ptr: dx.ptr,
                        stride,
                    },
                    weight: dw.ptr,
                    y: Rows { ptr: y.ptr, stride },
                    cols,
                    eps: 1e-6,
                    rows,
                };
                d.k.norm.rms_norm(&d, &a(&ys[0])).unwrap();
                d.k.norm.rms_norm_rows(&d, &a(&ys[1])).unwrap();
                let [want, got]: [Vec<f32>; 2] =
                    [0, 1].map(|i| d.read(&ys[i], 0, rows * stride).unwrap());
                let what = format!("rms_norm_rows {rows} rows of {cols} (stride {stride}), bf16 {bf16_activations}");
                let pick = |v: &[f32]| -> Vec<f32> {
                    v.chunks(stride).flat_map(|r| r[..cols].to_vec()).collect()
                };
                let (want, got) = (pick(&want), pick(&got));
                assert!(
                    want.iter().all(|v| v.is_finite()),
                    "{what}: rms_norm left NaN"
                );
                assert_eq!(bits(&got), bits(&want), "{what}");
                let xr: Vec<f32> = x.chunks(stride).flat_map(|r| r[..cols].to_vec()).collect();
                let tol = if bf16_activations { 1e-2 } else { 1e-5 };
                check(&what, &got, &ops::rms_norm(&xr, &w, 1e-6), tol);
            }
        }
        // Wider than a thread's registers hold: refused, nothing launched.
        let buf = poisoned(&d, 8192);
        let wide = RmsNorm {
            x: Rows::new(buf.ptr, 4352),
            weight: buf.ptr,
            y: Rows::new(buf.ptr, 4352),
            cols: 4352,
            eps: 1e-6,
            rows: 1,
        };
        let e = d.k.norm.rms_norm_rows(&d, &wide).unwrap_err();
        assert!(e.to_string().contains("columns"), "{e}");
        let mut rng = Rng(277);
        for cols in [2048usize, 4096, 256, 64] {
            let rows_of = [300usize, 77, 16, 1];
            let ws: Vec<DevLinear> = rows_of
                .iter()
                .zip([8u32, 8, 4, 4])
                .enumerate()
                .map(|(i, (&n, b))| {
                    upload_linear(&d, &format!("w{i}"), &linear(&mut rng, b, 1, n, cols)).unwrap()
                })
                .collect();
            for nb in [1usize, 2, 3, 4, 5, 6, 7, 8, 11] {
                let x: Vec<f32> = rng.vec(nb * cols, 1.0);
                let x: Vec<f32> = if bf16_activations {
                    x.into_iter().map(round_bf16).collect()
                } else {
                    x
                };
                let resid = rng.vec(nb * rows_of[1], 1.0);
                let xd = d.upload(&x).unwrap();
                let mut got = Vec::new();
                for kernel in [RowsKernel::GemvSplit, RowsKernel::GemvSplitLean] {
                    let outs_dev: Vec<DevBuf> =
                        rows_of.iter().map(|&n| poisoned(&d, nb * n)).collect();
                    d.write(&outs_dev[1], 0, &resid).unwrap();
                    let outs = [
                        (&ws[0], Out::Store(outs_dev[0].ptr)),
                        (&ws[1], Out::AddToResidual(outs_dev[1].ptr)),
                        (&ws[2], Out::Exact(outs_dev[2].ptr)),
                        (&ws[3], Out::Store(outs_dev[3].ptr)),
                    ];
                    d.k.decode
                        .project_rows(&d, kernel, xd.ptr, cols, nb, &outs)
                        .unwrap();
                    let v: Vec<Vec<f32>> = rows_of
                        .iter()
                        .enumerate()
                        .map(|(i, &n)| d.read(&outs_dev[i], 0, nb * n).unwrap())
                        .collect();
                    got.push(v);
                }
                for (i, n) in rows_of.iter().enumerate() {
                    let what = format!(
                        "dec_gemv_rows_split_lean {cols} cols, {nb} rows, output {i} ({n} rows), bf16 {bf16_activations}"
                    );
                    assert!(
                        got[0][i].iter().all(|v| v.is_finite()),
                        "{what}: dec_gemv_rows_split left NaN"
                    );
                    assert_eq!(bits(&got[1][i]), bits(&got[0][i]), "{what}");
                }
            }
        }
    }
    println!("KERNEL rms_norm_rows and dec_gemv_rows_split_lean give rms_norm's and dec_gemv_rows_split's bits");
}

/// `kernel`'s outputs equal `reference`'s bit for bit on the device (what the CPU emulation cannot
/// show: cp.async's copies, the barriers, the real scheduling): for each (columns, weights) of
/// `shapes` (a weight: its rows and bits), 1 to 8 and 11 input rows, both activation modes, the
/// weights' store modes exact / added to a residual / stored in turn; nothing left NaN.
fn rows_kernel_gives_the_bits_of(
    reference: RowsKernel,
    kernel: RowsKernel,
    shapes: &[(usize, &[(usize, u32)])],
    seed: u64,
) {
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    for bf16_activations in [false, true] {
        let d = dev(bf16_activations);
        let mut rng = Rng(seed);
        for &(cols, shape) in shapes {
            let ws: Vec<DevLinear> = shape
                .iter()
                .enumerate()
                .map(|(i, &(n, b))| {
                    upload_linear(&d, &format!("w{i}"), &linear(&mut rng, b, 1, n, cols)).unwrap()
                })
                .collect();
            for nb in [1usize, 2, 3, 4, 5, 6, 7, 8, 11] {
                let x: Vec<f32> = rng.vec(nb * cols, 1.0);
                let x: Vec<f32> = if bf16_activations {
                    x.into_iter().map(round_bf16).collect()
                } else {
                    x
                };
                let resid: Vec<Vec<f32>> =
                    shape.iter().map(|&(n, _)| rng.vec(nb * n, 1.0)).collect();
                let xd = d.upload(&x).unwrap();
                let mut got = Vec::new();
                for k in [reference, kernel] {
                    let outs_dev: Vec<DevBuf> =
                        shape.iter().map(|&(n, _)| poisoned(&d, nb * n)).collect();
                    let outs: Vec<(&DevLinear, Out)> = ws
                        .iter()
                        .zip(&outs_dev)
                        .enumerate()
                        .map(|(i, (w, y))| {
                            let out = match i % 3 {
                                0 => Out::Exact(y.ptr),
                                1 => Out::AddToResidual(y.ptr),
                                _ => Out::Store(y.ptr),
                            };
                            if i % 3 == 1 {
                                d.write(y, 0, &resid[i]).unwrap();
                            }
                            (w, out)
                        })
                        .collect();
                    d.k.decode
                        .project_rows(&d, k, xd.ptr, cols, nb, &outs)
                        .unwrap();
                    let v: Vec<Vec<f32>> = shape
                        .iter()
                        .enumerate()
                        .map(|(i, &(n, _))| d.read(&outs_dev[i], 0, nb * n).unwrap())
                        .collect();
                    got.push(v);
                }
                for (i, &(n, b)) in shape.iter().enumerate() {
                    let what = format!(
                        "{kernel:?} against {reference:?}: {cols} cols, {nb} rows, output {i} ({n} rows of {b}-bit), bf16 {bf16_activations}"
                    );
                    assert!(
                        got[0][i].iter().all(|v| v.is_finite()),
                        "{what}: {reference:?} left NaN"
                    );
                    assert_eq!(bits(&got[1][i]), bits(&got[0][i]), "{what}");
                }
            }
        }
    }
}

/// `router_async_stage`'s kernel gives the lean router's bits on the device:
/// `dec_gemv_rows_split_async` against `dec_gemv_rows_split_lean` on the router's shape (256 + 1
/// rows of 8-bit, 2,048 columns) and on `rows_case`'s four weights (300, 77, 16 and 1 rows, 8-bit
/// beside 4-bit) at 2,048, 4,096, 256 and 64 columns (`rows_kernel_gives_the_bits_of`).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn router_async_stage_gives_the_lean_routers_bits() {
    let four: &[(usize, u32)] = &[(300, 8), (77, 8), (16, 4), (1, 4)];
    rows_kernel_gives_the_bits_of(
        RowsKernel::GemvSplitLean,
        RowsKernel::GemvSplitAsync,
        &[
            (2048, &[(256, 8), (1, 8)]),
            (2048, four),
            (4096, four),
            (256, four),
            (64, four),
        ],
        281,
    );
    println!("KERNEL dec_gemv_rows_split_async gives dec_gemv_rows_split_lean's bits");
}

/// `mma_stage_rounds`' kernel gives the deep kernel's bits on the device:
/// `dec_mma_rows_deep_rounds` against `dec_mma_rows_deep` on DeltaNet's in_proj shape (12,288 +
/// 64 rows of 2,048 columns), out_proj's (2,048 rows of 4,096: its two-stage form at 8 rows),
/// `rows_case`'s four weights (300, 77, 16, 1 rows) at 2,048, 512 and 64 columns, and a launch of
/// 20,000 rows (whole tiles a warp, as lm_head's), all 4-bit (`rows_kernel_gives_the_bits_of`).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn mma_stage_rounds_gives_the_deep_kernels_bits() {
    let four: &[(usize, u32)] = &[(300, 4), (77, 4), (16, 4), (1, 4)];
    rows_kernel_gives_the_bits_of(
        RowsKernel::MmaDeep,
        RowsKernel::MmaDeepRounds,
        &[
            (2048, &[(8192, 4), (4096, 4), (32, 4), (32, 4)]),
            (4096, &[(2048, 4)]),
            (2048, four),
            (512, four),
            (64, four),
            (2048, &[(20_000, 4)]),
        ],
        283,
    );
    println!("KERNEL dec_mma_rows_deep_rounds gives dec_mma_rows_deep's bits");
}

/// The batched step's DeltaNet scans (`dec_dn_conv_rows` + `dec_dn_step_rows`: every sequence in
/// one launch each, its states through a pointer table) against `dec_dn_conv` + `dec_dn_step` run
/// one sequence at a time on copies of the same states (those are tested against the CPU in
/// fused_decode_blocks_match_cpu): the same code per sequence, so the outputs, recurrent states
/// and conv states agree bit for bit, over two steps (the second reading the states the first
/// wrote through the table), for 1, 3 and 8 sequences, at the full model's head shape and a
/// small one, in both activation modes.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn batched_decode_deltanet_scans_match_one_sequence_at_a_time() {
    use lily_cuda::kernels::decode::{DnConv, DnStep};
    use lily_cuda::kernels::deltanet::PREP_EPS;
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
    for bf16_activations in [false, true] {
        let d = dev(bf16_activations);
        let mut rng = Rng(47);
        // (k heads, v heads, dk, dv, conv taps)
        for (nk, nv, dk, dv, taps) in [
            (16usize, 32usize, 128usize, 128usize, 4usize),
            (1, 2, 32, 16, 2),
        ] {
            let conv_dim = 2 * nk * dk + nv * dv;
            let (state_n, conv_n) = (nv * dk * dv, (taps - 1) * conv_dim);
            let weight = d.upload(&rng.vec(conv_dim * taps, 0.5)).unwrap();
            let a_log = d.upload(&rng.vec(nv, 0.5)).unwrap();
            let dt_bias = d.upload(&rng.vec(nv, 0.5)).unwrap();
            for rows in [1usize, 3, 8] {
                let what = format!("{rows} sequences, heads {nk}/{nv} of {dk}/{dv}, {taps} taps, bf16 {bf16_activations}");
                let states: Vec<Vec<f32>> = (0..rows).map(|_| rng.vec(state_n, 0.1)).collect();
                let convs: Vec<Vec<f32>> = (0..rows).map(|_| rng.vec(conv_n, 1.0)).collect();
                let up = |v: &Vec<Vec<f32>>| -> Vec<DevBuf> {
                    v.iter().map(|s| d.upload(s).unwrap()).collect()
                };
                let (st_rows, cv_rows, st_one, cv_one) =
                    (up(&states), up(&convs), up(&states), up(&convs));
                let mut table: Vec<u64> = st_rows.iter().map(|b| b.ptr).collect();
                let states_at = 0;
                let convs_at = rows * 8;
                table.extend(cv_rows.iter().map(|b| b.ptr));
                let table = d.upload(&table).unwrap();
                let (c_rows, o_rows) =
                    (poisoned(&d, rows * conv_dim), poisoned(&d, rows * nv * dv));
                let (c_one, o_one) = (poisoned(&d, rows * conv_dim), poisoned(&d, rows * nv * dv));
                for step in 0..2 {
                    let m = d.upload(&rng.vec(rows * conv_dim, 1.0)).unwrap();
                    let b = d.upload(&rng.vec(rows * nv, 1.0)).unwrap();
                    let a = d.upload(&rng.vec(rows * nv, 1.0)).unwrap();
                    let conv = |m: u64, conv_state: u64, c: u64| DnConv {
                        m,
                        conv_state,
                        weight: weight.ptr,
                        c,
                        conv_dim,
                        kernel: taps,
                    };
                    let dn_step = |c: u64, b: u64, a: u64, state: u64, o: u64| DnStep {
                        c,
                        b,
                        a,
                        a_log: a_log.ptr,
                        dt_bias: dt_bias.ptr,
                        state,
                        o,
                        n_k: nk,
                        n_v: nv,
                        dk,
                        dv,
                    };
                    let dec = &d.k.decode;
                    dec.dn_conv_rows(
                        &d,
                        &conv(m.ptr, table.ptr + convs_at as u64, c_rows.ptr),
                        rows,
                    )
                    .unwrap();
                    let s = dn_step(
                        c_rows.ptr,
                        b.ptr,
                        a.ptr,
                        table.ptr + states_at as u64,
                        o_rows.ptr,
                    );
                    dec.dn_step_rows(&d, &s, PREP_EPS, rows).unwrap();
                    for r in 0..rows {
                        let f = |buf: u64, n: usize| buf + (r * n * 4) as u64;
                        let cr = f(c_one.ptr, conv_dim);
                        dec.dn_conv(&d, &conv(f(m.ptr, conv_dim), cv_one[r].ptr, cr))
                            .unwrap();
                        let s = dn_step(
                            cr,
                            f(b.ptr, nv),
                            f(a.ptr, nv),
                            st_one[r].ptr,
                            f(o_one.ptr, nv * dv),
                        );
                        dec.dn_step(&d, &s, PREP_EPS).unwrap();
                    }
                    let read = |buf: &DevBuf, n: usize| -> Vec<f32> { d.read(buf, 0, n).unwrap() };
                    let what = format!("{what}, step {step}");
                    assert!(
                        bits(&read(&c_rows, rows * conv_dim))
                            == bits(&read(&c_one, rows * conv_dim)),
                        "{what}: conv outputs"
                    );
                    let o = read(&o_rows, rows * nv * dv);
                    assert!(o.iter().all(|v| v.is_finite()), "{what}: outputs unwritten");
                    assert!(
                        bits(&o) == bits(&read(&o_one, rows * nv * dv)),
                        "{what}: outputs"
                    );
                    for r in 0..rows {
                        assert!(
                            bits(&read(&st_rows[r], state_n)) == bits(&read(&st_one[r], state_n)),
                            "{what}: row {r} state"
                        );
                        assert!(
                            bits(&read(&cv_rows[r], conv_n)) == bits(&read(&cv_one[r], conv_n)),
                            "{what}: row {r} conv state"
                        );
                    }
                }
            }
        }
    }
    println!("KERNEL decode.cu batched DeltaNet scans equal one sequence at a time");
}

/// A MoE's sizes: hidden, experts, top_k, expert inter, shared inter.
fn moe_sizes(c: &ModelConfig) -> (usize, usize, usize, usize, usize) {
    (
        c.hidden,
        c.n_experts,
        c.top_k,
        c.expert_inter,
        c.shared_inter,
    )
}

/// Two sets of the MoE's first-half outputs for `rows` tokens, for two runs to compare: expert
/// ids, routing weights, experts' hidden rows, shared expert's hidden rows (all but the ids
/// poisoned).
fn moe_outputs(d: &Dev, rows: usize, tk: usize, inter: usize, si: usize) -> [[DevBuf; 2]; 4] {
    let pair = |n: usize| [poisoned(d, n), poisoned(d, n)];
    [
        [
            d.alloc(rows * tk * 4).unwrap(),
            d.alloc(rows * tk * 4).unwrap(),
        ],
        pair(rows * tk),
        pair(rows * tk * inter),
        pair(rows * si),
    ]
}

/// The `Glu` of `dw`'s gate/up writing run `i` of `moe_outputs`' buffers `out` (ids, routing
/// weights, experts' and shared expert's hidden rows), from router logits [rows, e] and xn.
fn glu_run<'a>(
    dw: &'a lily_cuda::weights::DevMoe,
    logits: &DevBuf,
    e: usize,
    tk: usize,
    xn: &DevBuf,
    out: &[[DevBuf; 2]; 4],
    i: usize,
) -> Glu<'a> {
    let [ids, rw, eh, sh] = out;
    Glu {
        gate: &dw.gate,
        up: &dw.up,
        router_logits: logits.ptr,
        n_experts: e,
        ids: ids[i].ptr,
        route_w: rw[i].ptr,
        top_k: tk,
        shared_gate: &dw.shared_gate,
        shared_up: &dw.shared_up,
        xn: xn.ptr,
        h: eh[i].ptr,
        h_shared: sh[i].ptr,
    }
}

/// The two runs of a batched-MoE test (`moe_outputs`' pairs and two residual copies, run 0 and
/// run 1): the `Glu` and `DownCombine` of run `i` at token `at` over shared inputs (router logits
/// [rows, experts], xn [rows, hidden], s_gate [rows]).
struct MoeRuns<'a> {
    dw: &'a lily_cuda::weights::DevMoe,
    c: &'a ModelConfig,
    logits: u64,
    xn: u64,
    s_gate: u64,
    /// ids, route_w, experts' hidden rows, shared expert's hidden rows, residual rows
    out: [&'a [DevBuf; 2]; 5],
}

impl MoeRuns<'_> {
    fn glu(&self, i: usize, at: usize) -> Glu<'_> {
        let (h, e, tk, inter, si) = moe_sizes(self.c);
        let [ids, rw, eh, sh, _] = self.out;
        Glu {
            gate: &self.dw.gate,
            up: &self.dw.up,
            router_logits: self.logits + (at * e * 4) as u64,
            n_experts: e,
            ids: ids[i].ptr + (at * tk * 4) as u64,
            route_w: rw[i].ptr + (at * tk * 4) as u64,
            top_k: tk,
            shared_gate: &self.dw.shared_gate,
            shared_up: &self.dw.shared_up,
            xn: self.xn + (at * h * 4) as u64,
            h: eh[i].ptr + (at * tk * inter * 4) as u64,
            h_shared: sh[i].ptr + (at * si * 4) as u64,
        }
    }

    /// Asserts that both runs wrote every output for `rows` tokens and agree bit for bit, and
    /// that the residual rows moved from `x0`.
    fn assert_equal(&self, d: &Dev, rows: usize, x0: &[f32], what: &str) {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
        let (h, _, tk, inter, si) = moe_sizes(self.c);
        let [ids, rw, eh, sh, x] = self.out;
        let read = |b: &DevBuf, n: usize| -> Vec<f32> { d.read(b, 0, n).unwrap() };
        let read_ids = |b: &DevBuf| -> Vec<i32> { d.read(b, 0, rows * tk).unwrap() };
        assert_eq!(read_ids(&ids[0]), read_ids(&ids[1]), "{what}: expert ids");
        for (name, b, n) in [
            ("routing weights", rw, rows * tk),
            ("experts' hidden rows", eh, rows * tk * inter),
            ("shared expert's hidden rows", sh, rows * si),
            ("residual rows", x, rows * h),
        ] {
            let got = read(&b[0], n);
            assert!(
                got.iter().all(|v| v.is_finite()),
                "{what}: {name} unwritten"
            );
            assert!(bits(&got) == bits(&read(&b[1], n)), "{what}: {name}");
        }
        let moved = read(&x[0], rows * h);
        assert!(moved != x0, "{what}: the residual rows did not change");
    }

    fn down(&self, i: usize, at: usize) -> DownCombine<'_> {
        let (h, _, tk, inter, si) = moe_sizes(self.c);
        let [ids, rw, eh, sh, x] = self.out;
        DownCombine {
            down: &self.dw.down,
            shared_down: &self.dw.shared_down,
            ids: ids[i].ptr + (at * tk * 4) as u64,
            weights: rw[i].ptr + (at * tk * 4) as u64,
            top_k: tk,
            h: eh[i].ptr + (at * tk * inter * 4) as u64,
            h_shared: sh[i].ptr + (at * si * 4) as u64,
            shared_gate: self.s_gate + (at * 4) as u64,
            x: x[i].ptr + (at * h * 4) as u64,
        }
    }
}

/// The batched step's MoE (`dec_glu4_rows` + `dec_down_combine_rows`: one-token decode's kernels
/// with the token in a grid dimension) against `dec_glu4` + `dec_down_combine` run one token at a
/// time on the same inputs (those are tested against the CPU in fused_decode_blocks_match_cpu):
/// the routing (ids, weights), the experts' and shared expert's hidden rows and the residual
/// rows agree bit for bit, for 1, 3 and 8 tokens, on tiny's and small's MoE shapes, in both
/// activation modes, with the products in f32, in int8 (`dec_glu4_q8_rows` +
/// `dec_down_combine_q8_rows` against `dec_glu4_q8` + `dec_down_combine_q8`, `moe_int8`) and in
/// int8 pairs (the `_x8x2` forms, `moe_int8_pairs`).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn batched_decode_moe_rows_match_one_token_at_a_time() {
    for (bf16_activations, products) in [false, true].into_iter().flat_map(|b| {
        [
            (b, MoeProducts::Float),
            (b, MoeProducts::Int8),
            (b, MoeProducts::Int8Pairs),
        ]
    }) {
        let d = dev(bf16_activations);
        let mut rng = Rng(53);
        for preset in [Preset::Tiny, Preset::Small] {
            let c = ModelConfig::from_json(&preset_text_config(preset)).unwrap();
            let (h, e, tk, inter, si) = moe_sizes(&c);
            let w = random_moe(&mut rng, &c);
            let dw = upload_moe(&d, "moe", &w).unwrap();
            let glu_shapes = [
                dw.gate.shape(),
                dw.up.shape(),
                dw.shared_gate.shape(),
                dw.shared_up.shape(),
            ];
            assert!(
                lily_cuda::kernels::decode::glu_rows_serves(
                    &glu_shapes[0],
                    &glu_shapes[1],
                    &glu_shapes[2],
                    &glu_shapes[3]
                ),
                "{preset:?}: the test needs dec_glu4's shapes"
            );
            for rows in [1usize, 3, 8] {
                let what =
                    format!("{preset:?}, {rows} tokens, bf16 {bf16_activations}, {products:?}");
                let logits = d.upload(&rng.vec(rows * e, 2.0)).unwrap();
                let xn = d.upload(&rng.vec(rows * h, 1.0)).unwrap();
                let s_gate = d.upload(&rng.vec(rows, 1.0)).unwrap();
                let x0 = rng.vec(rows * h, 1.0);
                // [rows-form, one-at-a-time] buffers
                let [ids, rw, eh, sh] = moe_outputs(&d, rows, tk, inter, si);
                let x = [d.upload(&x0).unwrap(), d.upload(&x0).unwrap()];
                let runs = MoeRuns {
                    dw: &dw,
                    c: &c,
                    logits: logits.ptr,
                    xn: xn.ptr,
                    s_gate: s_gate.ptr,
                    out: [&ids, &rw, &eh, &sh, &x],
                };
                let (glu, down) = (|i, at| runs.glu(i, at), |i, at| runs.down(i, at));
                let dec = &d.k.decode;
                dec.glu_rows(&d, &glu(0, 0), rows, products).unwrap();
                dec.down_combine_rows(&d, &down(0, 0), rows, products)
                    .unwrap();
                for at in 0..rows {
                    dec.glu(&d, &glu(1, at), products, GluLoads::Registers)
                        .unwrap();
                    dec.down_combine(&d, &down(1, at), products, DownRegs::Unbounded)
                        .unwrap();
                }
                runs.assert_equal(&d, rows, &x0, &what);
            }
        }
    }
    println!("KERNEL decode.cu batched MoE equals one token at a time");
}

/// The batched step's MoE grouped by expert (`dec_glu4_x8x2_grouped` +
/// `dec_down_combine_x8x2_grouped`, `moe_grouped_rows`: each picked expert's weights read once
/// for all rows that picked it) against `dec_glu4_x8x2` + `dec_down_combine_x8x2` run one token
/// at a time on the same inputs (those are tested against the CPU in moe_int8_matches_cpu): the
/// routing, the experts' and shared expert's hidden rows and the residual rows agree bit for bit,
/// for 1, 3, 4 and 8 tokens whose picks overlap (a third of the rows copy the previous row's
/// logits, the others push the same three experts up), on tiny's and small's MoE shapes and the
/// full model's widths with 32 experts, in both activation modes; the down kernel's 16-warp block
/// (`grouped_down_wide`) too, its residual rows bit for bit the one-token kernels'.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn batched_decode_moe_grouped_matches_one_token_at_a_time() {
    let products = MoeProducts::Int8Pairs;
    for bf16_activations in [false, true] {
        let d = dev(bf16_activations);
        let mut rng = Rng(59);
        for preset in [Preset::Tiny, Preset::Small, Preset::Full] {
            let mut c = ModelConfig::from_json(&preset_text_config(preset)).unwrap();
            if preset == Preset::Full {
                c.n_experts = 32; // the full widths, few enough experts to upload quickly
            }
            let (h, e, tk, inter, si) = moe_sizes(&c);
            let w = random_moe(&mut rng, &c);
            let dw = upload_moe(&d, "moe", &w).unwrap();
            let (down_shape, sdown_shape) = (dw.down.shape(), dw.shared_down.shape());
            let glu_shapes = [
                dw.gate.shape(),
                dw.up.shape(),
                dw.shared_gate.shape(),
                dw.shared_up.shape(),
            ];
            let [g, u, sg, su] = &glu_shapes;
            for rows in [1usize, 3, 4, 8] {
                let what = format!("{preset:?}, {rows} tokens, bf16 {bf16_activations}");
                if rows > 1 {
                    assert!(
                        lily_cuda::kernels::decode::grouped_serves(
                            [g, u, sg, su],
                            &down_shape,
                            &sdown_shape,
                            e,
                            tk,
                            rows
                        ),
                        "{what}: the test needs the grouped kernels' shapes"
                    );
                }
                let mut lg = rng.vec(rows * e, 2.0);
                let hot = [1, e / 2 + 3, e - 2];
                for t in 0..rows {
                    if t % 3 == 1 {
                        lg.copy_within((t - 1) * e..t * e, t * e);
                    } else {
                        for &x in &hot {
                            lg[t * e + x] += 5.0;
                        }
                    }
                }
                let logits = d.upload(&lg).unwrap();
                let xn = d.upload(&rng.vec(rows * h, 1.0)).unwrap();
                let s_gate = d.upload(&rng.vec(rows, 1.0)).unwrap();
                let x0 = rng.vec(rows * h, 1.0);
                // [grouped, one-at-a-time] buffers
                let [ids, rw, eh, sh] = moe_outputs(&d, rows, tk, inter, si);
                let x = [d.upload(&x0).unwrap(), d.upload(&x0).unwrap()];
                let runs = MoeRuns {
                    dw: &dw,
                    c: &c,
                    logits: logits.ptr,
                    xn: xn.ptr,
                    s_gate: s_gate.ptr,
                    out: [&ids, &rw, &eh, &sh, &x],
                };
                let (glu, down) = (|i, at| runs.glu(i, at), |i, at| runs.down(i, at));
                let dec = &d.k.decode;
                dec.glu_grouped(&d, &glu(0, 0), rows, GroupedGlu::Pairs)
                    .unwrap();
                dec.down_combine_grouped(&d, &down(0, 0), rows, GroupedDown::Warps12)
                    .unwrap();
                // grouped_down_wide's 16-warp block on the same hidden rows, its own residual.
                let x_wide = d.upload(&x0).unwrap();
                let wide = DownCombine {
                    x: x_wide.ptr,
                    ..down(0, 0)
                };
                dec.down_combine_grouped(&d, &wide, rows, GroupedDown::Warps16)
                    .unwrap();
                for at in 0..rows {
                    dec.glu(&d, &glu(1, at), products, GluLoads::Registers)
                        .unwrap();
                    dec.down_combine(&d, &down(1, at), products, DownRegs::Unbounded)
                        .unwrap();
                }
                let picked: Vec<i32> = d.read(&ids[1], 0, rows * tk).unwrap();
                let distinct: std::collections::BTreeSet<i32> = picked.iter().copied().collect();
                assert!(
                    rows == 1 || distinct.len() < rows * tk,
                    "{what}: the rows' picks do not overlap"
                );
                runs.assert_equal(&d, rows, &x0, &what);
                let bits = |b: &DevBuf| -> Vec<u32> {
                    let v: Vec<f32> = d.read(b, 0, rows * h).unwrap();
                    v.iter().map(|x| x.to_bits()).collect()
                };
                assert!(
                    bits(&x_wide) == bits(&x[1]),
                    "{what}: the 16-warp grouped down kernel's residual rows"
                );
            }
        }
    }
    println!("KERNEL decode.cu batched MoE grouped by expert equals one token at a time");
}

/// `grouped_moe_stream`: `dec_glu4_x8x2_grouped_ring` + `dec_down_combine_x8x2_grouped_ring` (the
/// grouped kernels with deeper rings of weight loads) against `dec_glu4_x8x2_grouped` +
/// `dec_down_combine_x8x2_grouped_wide` (the shipping pair, itself tested against one token at a
/// time above) on the same inputs, every output written over NaN: the routing, the experts' and
/// shared expert's hidden rows and the residual rows bit for bit, for 2, 4 and 8 rows whose picks
/// overlap, on small's MoE shape and the full model's widths with 32 and 64 experts (few enough
/// to upload quickly; a block's chunk of items from shorter than the rings to several times
/// longer), in both activation modes.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn grouped_moe_stream_gives_the_grouped_kernels_bits() {
    for bf16_activations in [false, true] {
        let d = dev(bf16_activations);
        let mut rng = Rng(283);
        for (preset, experts) in [
            (Preset::Small, None),
            (Preset::Full, Some(32)),
            (Preset::Full, Some(64)),
        ] {
            let mut c = ModelConfig::from_json(&preset_text_config(preset)).unwrap();
            if let Some(n) = experts {
                c.n_experts = n;
            }
            let (h, e, tk, inter, si) = moe_sizes(&c);
            let w = random_moe(&mut rng, &c);
            let dw = upload_moe(&d, "moe", &w).unwrap();
            for rows in [2usize, 4, 8] {
                let what =
                    format!("{preset:?} ({e} experts), {rows} rows, bf16 {bf16_activations}");
                let mut lg = rng.vec(rows * e, 2.0);
                for t in 0..rows {
                    if t % 3 == 1 {
                        lg.copy_within((t - 1) * e..t * e, t * e);
                    } else {
                        for x in [1, e / 2 + 3, e - 2] {
                            lg[t * e + x] += 5.0;
                        }
                    }
                }
                let logits = d.upload(&lg).unwrap();
                let xn = d.upload(&rng.vec(rows * h, 1.0)).unwrap();
                let s_gate = d.upload(&rng.vec(rows, 1.0)).unwrap();
                let x0 = rng.vec(rows * h, 1.0);
                // [the ring kernels, the shipping grouped kernels]
                let [ids, rw, eh, sh] = moe_outputs(&d, rows, tk, inter, si);
                let x = [d.upload(&x0).unwrap(), d.upload(&x0).unwrap()];
                let runs = MoeRuns {
                    dw: &dw,
                    c: &c,
                    logits: logits.ptr,
                    xn: xn.ptr,
                    s_gate: s_gate.ptr,
                    out: [&ids, &rw, &eh, &sh, &x],
                };
                let dec = &d.k.decode;
                dec.glu_grouped(&d, &runs.glu(0, 0), rows, GroupedGlu::Ring)
                    .unwrap();
                dec.down_combine_grouped(&d, &runs.down(0, 0), rows, GroupedDown::Warps16Ring)
                    .unwrap();
                dec.glu_grouped(&d, &runs.glu(1, 0), rows, GroupedGlu::Pairs)
                    .unwrap();
                dec.down_combine_grouped(&d, &runs.down(1, 0), rows, GroupedDown::Warps16)
                    .unwrap();
                runs.assert_equal(&d, rows, &x0, &what);
            }
        }
    }
    println!("KERNEL decode.cu grouped MoE rings (grouped_moe_stream) equal the grouped kernels");
}

/// A rounding of x per 64-column group (`int8_groups`, `int8_pair_groups`): the rounded values
/// (exact in f64) and each group's largest magnitude.
type RoundGroups = fn(&[f32]) -> (Vec<f64>, Vec<f64>);

/// A 64-column group's int8 scale as decode.cu's stage_x8 / stage_x8x2 take it, in f32:
/// m = max|x|, inv = 127 / m, scale = m / 127 (both 0 for a group of zeros).
fn int8_group_scale(g: &[f32]) -> (f32, f32, f32) {
    let m = g.iter().fold(0f32, |m, v| m.max(v.abs()));
    if m > 0.0 {
        (m, 127.0 / m, m / 127.0)
    } else {
        (m, 0.0, 0.0)
    }
}

/// x rounded to int8 per 64-column group as `moe_int8` specifies (decode.cu's stage_x8), in f32
/// steps of our own: m = max|x|, x̂ = round-half-even(x · (127 / m)), scale = m / 127. Returns
/// scale · x̂ per value (exact in f64) and each group's m.
fn int8_groups(x: &[f32]) -> (Vec<f64>, Vec<f64>) {
    let mut xq = Vec::with_capacity(x.len());
    let mut gmax = Vec::new();
    for g in x.chunks(64) {
        let (m, inv, scale) = int8_group_scale(g);
        gmax.push(m as f64);
        for v in g {
            let q = (v * inv).round_ties_even();
            assert!(q.abs() <= 127.0, "int8 of {v}: {q}");
            xq.push(scale as f64 * q as f64);
        }
    }
    (xq, gmax)
}

/// `moe_int8`'s kernels (`dec_glu4_q8_rows` + `dec_down_combine_q8_rows` for 2..=8 tokens,
/// `dec_glu4_q8` + `dec_down_combine_q8` for one) against the CPU: the routing bit for bit the
/// f32 kernels'; every hidden row of the routed experts and the shared expert against an f64
/// SwiGLU of the same int8 x (the weights dequantised by lily_core, the x rounded per group as
/// specified): fp32 activations within f32 rounding (rel L2 1e-5), bf16 within its rounding
/// (1e-2); and against the unquantised f64 SwiGLU, element by element, within the bound the
/// rounding step gives (|x̂ − x| ≤ max|x| / 254 per element: |Δg| ≤ Σ|w| max|x| / 254, carried
/// through SiLU(g)·u with |SiLU'| ≤ 1.1, plus the activations' own rounding). Then the residual
/// update against an f64 combine of the int8 of the kernel's own hidden rows (1e-5 fp32, 5e-2
/// bf16). Tiny's and small's MoE shapes. The same for `moe_int8_pairs`' kernels
/// (`MoeProducts::Int8Pairs`: `dec_glu4_x8x2(_rows)` + `dec_down_combine_x8x2(_rows)`), the rows
/// rounded to int8 pairs as specified (|x̃ − x| ≤ max|x| / 64,516).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn moe_int8_matches_cpu() {
    let silu = |v: f64| v / (1.0 + (-v).exp());
    for bf16_activations in [false, true] {
        let d = dev(bf16_activations);
        let act = |v: f64| {
            if bf16_activations {
                round_bf16(v as f32) as f64
            } else {
                v
            }
        };
        let mut rng = Rng(61);
        for products in [MoeProducts::Int8, MoeProducts::Int8Pairs] {
            // the rounding `products` specifies, and its bound's divisor (max|x| / step an element)
            let (round, step): (RoundGroups, f64) = match products {
                MoeProducts::Int8Pairs => (int8_pair_groups, 64516.0),
                _ => (int8_groups, 254.0),
            };
            for preset in [Preset::Tiny, Preset::Small] {
                let c = ModelConfig::from_json(&preset_text_config(preset)).unwrap();
                let (h, e, tk, inter, si) = moe_sizes(&c);
                let w = random_moe(&mut rng, &c);
                let dw = upload_moe(&d, "moe", &w).unwrap();
                for rows in 1..=8usize {
                    let what =
                        format!("{products:?}, {preset:?}, {rows} tokens, bf16 {bf16_activations}");
                    let logits = d.upload(&rng.vec(rows * e, 2.0)).unwrap();
                    let mut x = rng.vec(rows * h, 1.0);
                    // One wide value a row: its group's scale must stay its own.
                    for r in 0..rows {
                        x[r * h + 64 * (r % (h / 64)) + 3] *= 9.0;
                    }
                    if bf16_activations {
                        x.iter_mut().for_each(|v| *v = round_bf16(*v));
                    }
                    let xn = d.upload(&x).unwrap();
                    // [int8, f32] buffers
                    let out = moe_outputs(&d, rows, tk, inter, si);
                    let [ids, rw, eh, sh] = &out;
                    let glu = |i: usize| glu_run(&dw, &logits, e, tk, &xn, &out, i);
                    let dec = &d.k.decode;
                    if rows == 1 {
                        dec.glu(&d, &glu(0), products, GluLoads::Registers).unwrap();
                    } else {
                        dec.glu_rows(&d, &glu(0), rows, products).unwrap();
                    }
                    dec.glu_rows(&d, &glu(1), rows, MoeProducts::Float).unwrap();
                    let ids_got: Vec<i32> = d.read(&ids[0], 0, rows * tk).unwrap();
                    let ids_f32: Vec<i32> = d.read(&ids[1], 0, rows * tk).unwrap();
                    assert_eq!(ids_got, ids_f32, "{what}: expert ids");
                    let rw_got: Vec<f32> = d.read(&rw[0], 0, rows * tk).unwrap();
                    let rw_f32: Vec<f32> = d.read(&rw[1], 0, rows * tk).unwrap();
                    assert!(
                        rw_got
                            .iter()
                            .zip(&rw_f32)
                            .all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{what}: routing weights"
                    );
                    let eh_got: Vec<f32> = d.read(&eh[0], 0, rows * tk * inter).unwrap();
                    let sh_got: Vec<f32> = d.read(&sh[0], 0, rows * si).unwrap();
                    let (mut want_q, mut want_f, mut got) = (Vec::new(), Vec::new(), Vec::new());
                    let mut wrow = vec![0f32; h];
                    let (mut worst, mut outside) = (0f64, 0usize);
                    for r in 0..rows {
                        let (xq, gmax) = round(&x[r * h..(r + 1) * h]);
                        let xr = &x[r * h..(r + 1) * h];
                        // item k < tk: routed expert ids[k]; item tk: the shared expert
                        for k in 0..=tk {
                            let (gw, uw, n, out) = if k < tk {
                                let ex = ids_got[r * tk + k] as usize;
                                let at = (r * tk + k) * inter;
                                (
                                    w.gate.expert(ex),
                                    w.up.expert(ex),
                                    inter,
                                    &eh_got[at..at + inter],
                                )
                            } else {
                                (
                                    w.shared_gate.expert(0),
                                    w.shared_up.expert(0),
                                    si,
                                    &sh_got[r * si..(r + 1) * si],
                                )
                            };
                            for (j, &o) in out.iter().enumerate().take(n) {
                                // (Σ w x̂, Σ w x, Σ |w| max|x| / 254) of the gate and of the up row
                                let mut sums = [[0f64; 3]; 2];
                                for (s, m) in sums.iter_mut().zip([&gw, &uw]) {
                                    m.dequant_row(j, &mut wrow);
                                    for (cc, &wv) in wrow.iter().enumerate() {
                                        let wv = wv as f64;
                                        s[0] += wv * xq[cc];
                                        s[1] += wv * xr[cc] as f64;
                                        s[2] += wv.abs() * gmax[cc / 64] / step;
                                    }
                                }
                                let [[gq, gf, eg], [uq, uf, eu]] = sums;
                                want_q.push(act(act(silu(act(gq))) * act(uq)) as f32);
                                let f = silu(gf) * uf;
                                want_f.push(f as f32);
                                got.push(o);
                                // the activations' rounding: bf16, act(g) carried through SiLU
                                // (|SiLU'| ≤ 1.1) and three roundings of 2^-9, doubled for margin
                                let rounding = if bf16_activations {
                                    (1.1 * (gf * uf).abs() + 3.0 * f.abs()) / 256.0
                                } else {
                                    f.abs() * 1e-5
                                };
                                let bound = 1.1 * eg * uf.abs()
                                    + silu(gf).abs() * eu
                                    + 1.1 * eg * eu
                                    + rounding
                                    + 1e-7;
                                let dev = (o as f64 - f).abs();
                                worst = worst.max(dev / bound);
                                if dev.is_nan() || dev > bound {
                                    outside += 1;
                                }
                            }
                        }
                    }
                    let tol = if bf16_activations { 1e-2 } else { 1e-5 };
                    let e_q = rel_l2(&what, &got, &want_q);
                    assert!(
                        e_q < tol,
                        "{what}: vs the f64 of the int8 x: rel L2 {e_q:.2e}"
                    );
                    assert_eq!(
                    outside, 0,
                    "{what}: {outside} values outside the rounding step's bound (worst {worst:.2} of it)"
                );
                    println!(
                    "KERNEL dec_glu4_q8 {what}: vs f64 of the int8 x rel L2 {e_q:.2e}; vs unquantised {:.2e} (worst {worst:.2} of the bound)",
                    rel_l2(&what, &got, &want_f)
                );
                    // The down half on the kernel's hidden rows.
                    let s_gate_v = rng.vec(rows, 1.0);
                    let s_gate = d.upload(&s_gate_v).unwrap();
                    let mut x0 = rng.vec(rows * h, 1.0);
                    if bf16_activations {
                        x0.iter_mut().for_each(|v| *v = round_bf16(*v));
                    }
                    let xr = d.upload(&x0).unwrap();
                    let down = DownCombine {
                        down: &dw.down,
                        shared_down: &dw.shared_down,
                        ids: ids[0].ptr,
                        weights: rw[0].ptr,
                        top_k: tk,
                        h: eh[0].ptr,
                        h_shared: sh[0].ptr,
                        shared_gate: s_gate.ptr,
                        x: xr.ptr,
                    };
                    if rows == 1 {
                        dec.down_combine(&d, &down, products, DownRegs::Unbounded)
                            .unwrap();
                    } else {
                        dec.down_combine_rows(&d, &down, rows, products).unwrap();
                    }
                    let x_got: Vec<f32> = d.read(&xr, 0, rows * h).unwrap();
                    // down_96_regs: the pair kernel held to 96 registers gives the same bits
                    // (so the check against the CPU below holds for it too).
                    if rows == 1 && products == MoeProducts::Int8Pairs {
                        let x96 = d.upload(&x0).unwrap();
                        let at96 = DownCombine { x: x96.ptr, ..down };
                        dec.down_combine(&d, &at96, products, DownRegs::Next96)
                            .unwrap();
                        let got96: Vec<f32> = d.read(&x96, 0, h).unwrap();
                        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                        assert_eq!(
                            bits(&got96),
                            bits(&x_got),
                            "{what}: dec_down_combine_x8x2_r96 vs dec_down_combine_x8x2"
                        );
                        println!(
                            "KERNEL dec_down_combine_x8x2_r96 {what}: dec_down_combine_x8x2's bits"
                        );
                    }
                    let (mut dx, mut want_dx) = (Vec::new(), Vec::new());
                    let mut drow = vec![0f32; inter.max(si)];
                    for r in 0..rows {
                        // the int8 of each item's hidden row, as the kernel rounds it
                        let items: Vec<Vec<f64>> = (0..=tk)
                            .map(|k| {
                                let row = if k < tk {
                                    &eh_got[(r * tk + k) * inter..(r * tk + k + 1) * inter]
                                } else {
                                    &sh_got[r * si..(r + 1) * si]
                                };
                                round(row).0
                            })
                            .collect();
                        let sg = act(1.0 / (1.0 + (-(s_gate_v[r] as f64)).exp()));
                        for c in 0..h {
                            let mut acc = 0f64;
                            for (k, hq) in items.iter().enumerate() {
                                let m = if k < tk {
                                    w.down.expert(ids_got[r * tk + k] as usize)
                                } else {
                                    w.shared_down.expert(0)
                                };
                                m.dequant_row(c, &mut drow[..hq.len()]);
                                let dot: f64 =
                                    drow.iter().zip(hq).map(|(&a, &b)| a as f64 * b).sum();
                                if k < tk {
                                    acc += rw_got[r * tk + k] as f64 * act(dot);
                                } else {
                                    acc += act(sg * act(dot));
                                }
                            }
                            let x0c = x0[r * h + c] as f64;
                            want_dx.push((act(x0c + act(acc)) - x0c) as f32);
                            dx.push(x_got[r * h + c] - x0[r * h + c]);
                        }
                    }
                    let e_d = rel_l2(&what, &dx, &want_dx);
                    let tol_d = if bf16_activations { 5e-2 } else { 1e-5 };
                    assert!(
                        e_d < tol_d,
                        "{what}: residual update vs f64 of the int8 rows: rel L2 {e_d:.2e}"
                    );
                    println!("KERNEL dec_down_combine_q8 {what}: residual update vs f64 of the int8 rows rel L2 {e_d:.2e}");
                }
            }
        }
    }
}

/// x rounded to int8 pairs per 64-column group as `gemv_int8` specifies (decode.cu's
/// stage_x8x2), in f32 steps of our own: m = max|x|, inv = 127 / m, scale = m / 127, x_hi =
/// round-half-even(x · inv), x_lo = round-half-even(fma(−scale, x_hi, x) · (254 · inv)). Returns
/// x̃ = scale · (254 x_hi + x_lo) / 254 per value (exact in f64) and each group's m.
fn int8_pair_groups(x: &[f32]) -> (Vec<f64>, Vec<f64>) {
    let mut xt = Vec::with_capacity(x.len());
    let mut gmax = Vec::new();
    for g in x.chunks(64) {
        let (m, inv, scale) = int8_group_scale(g);
        let inv_lo = 254.0 * inv;
        gmax.push(m as f64);
        for &v in g {
            let hi = (v * inv).round_ties_even();
            let lo = ((-scale).mul_add(hi, v) * inv_lo).round_ties_even();
            assert!(
                hi.abs() <= 127.0 && lo.abs() <= 127.0,
                "int8 pair of {v}: ({hi}, {lo})"
            );
            xt.push(scale as f64 * (254.0 * hi as f64 + lo as f64) / 254.0);
        }
    }
    (xt, gmax)
}

/// `gemv_int8`'s kernels (`dec_gemv4_x8x2`, `dec_gemv4w_x8x2`: `Decode::project` with
/// `GemvProducts::Int8Pairs`) against the CPU, at the projections of the tiny and small shapes
/// (DeltaNet's in_proj with the block's RMSNorm folded in, q/k/v, o_proj, out_proj with the gated
/// norm folded in, lm_head; the stagings' slow form where a head is narrower than the block's
/// columns a thread) and at the full model's widths (2,048 and 4,096: both kernels), both
/// activation modes. Every output unrounded (Out::Exact) against the f64 product of the
/// kernel's own staged row rounded to int8 pairs as specified (the weights dequantised by
/// lily_core): rel L2 ≤ 1e-6, f32 rounding only; and element by element against the f64 product
/// of the unrounded staged row within the pairs' bound (|x̃ − x| ≤ max|x|_group / 64,516: Σ|w|
/// max|x| / 64,516, plus 1e-6 Σ|w x| of f32 rounding). Then the model's store modes (stored,
/// added into a residual) against the f32 kernels on the same inputs (rel L2 1e-4 fp32, 1e-2
/// bf16: the stores' rounding). The staged row against the CPU's norm.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn gemv_int8_matches_cpu() {
    use lily_cuda::kernels::decode::x8x2_serves;
    // (name, columns, rows of each weight, prologue: 0 none, 1 RMSNorm, 2 gated norm of heads)
    type Case = (String, usize, Vec<usize>, u8, usize);
    let mut cases: Vec<Case> = Vec::new();
    for preset in [Preset::Tiny, Preset::Small] {
        let c = ModelConfig::from_json(&preset_text_config(preset)).unwrap();
        let (h, dv, hv) = (c.hidden, c.dn_value_dim(), c.dn_v_heads);
        let (q, kv) = (2 * c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim);
        let p = format!("{preset:?}");
        cases.extend([
            (
                format!("{p} in_proj"),
                h,
                vec![c.conv_dim(), dv, hv, hv],
                1,
                0,
            ),
            (format!("{p} q/k/v"), h, vec![q, kv, kv], 1, 0),
            (format!("{p} o_proj"), c.n_heads * c.head_dim, vec![h], 0, 0),
            (format!("{p} out_proj"), dv, vec![h], 2, c.dn_v_dim),
            (format!("{p} lm_head"), h, vec![c.vocab], 0, 0),
        ]);
    }
    cases.push(("2048 wide".into(), 2048, vec![3001, 77, 16, 1], 1, 0));
    cases.push(("4096 wide".into(), 4096, vec![2048, 5], 2, 128));
    let eps = 1e-6f32;
    for bf16_activations in [false, true] {
        let d = dev(bf16_activations);
        let r = |v: Vec<f32>| -> Vec<f32> {
            if bf16_activations {
                v.into_iter().map(round_bf16).collect()
            } else {
                v
            }
        };
        let mut rng = Rng(71);
        for (name, cols, rows, prologue, head_dim) in &cases {
            let (cols, prologue, head_dim) = (*cols, *prologue, *head_dim);
            let what = format!("{name} ({cols} cols), bf16 {bf16_activations}");
            let ws: Vec<Linear> = rows
                .iter()
                .map(|&n| linear(&mut rng, 4, 1, n, cols))
                .collect();
            let dws: Vec<DevLinear> = ws
                .iter()
                .enumerate()
                .map(|(i, w)| upload_linear(&d, &format!("w{i}"), w).unwrap())
                .collect();
            let shapes: Vec<_> = dws.iter().map(|w| w.shape()).collect();
            assert!(x8x2_serves(&shapes), "{what}: not a gemv_int8 launch");
            let mut x = rng.vec(cols, 1.0);
            // One wide value every few groups: each group's own scale must be the one applied.
            for g in (0..cols / 64).step_by(3) {
                x[64 * g + g % 64] *= 9.0;
            }
            let x = r(x);
            let z = r(rng.vec(cols, 1.0));
            let norm_len = if prologue == 2 { head_dim } else { cols };
            let norm_w = r(rng.vec(norm_len, 0.3).iter().map(|v| 1.0 + v).collect());
            let (xd, zd, nd) = (
                d.upload(&x).unwrap(),
                d.upload(&z).unwrap(),
                d.upload(&norm_w).unwrap(),
            );
            let prologue_arg = match prologue {
                0 => Prologue::None,
                1 => Prologue::RmsNorm {
                    weight: nd.ptr,
                    eps,
                },
                _ => Prologue::GatedNorm {
                    weight: nd.ptr,
                    z: zd.ptr,
                    head_dim,
                    eps,
                },
            };
            // The CPU's staged row.
            let staged_cpu: Vec<f32> = match prologue {
                0 => x.clone(),
                1 => ops::rms_norm(&x, &norm_w, eps),
                _ => {
                    let mut y = vec![0f32; cols];
                    for hh in 0..cols / head_dim {
                        let o = &x[hh * head_dim..(hh + 1) * head_dim];
                        let ss: f32 = o.iter().map(|v| v * v).sum();
                        let inv = 1.0 / (ss / head_dim as f32 + eps).sqrt();
                        for i in 0..head_dim {
                            let zc = z[hh * head_dim + i];
                            y[hh * head_dim + i] =
                                norm_w[i] * (o[i] * inv) * (zc / (1.0 + (-zc).exp()));
                        }
                    }
                    y
                }
            };
            let resid = r(rng.vec(rows[0], 1.0));
            // launch: (staged row, outputs) of one project call with these store modes
            let launch = |products: GemvProducts, exact: bool, grid: GemvGrid| {
                let bufs: Vec<DevBuf> = rows.iter().map(|&n| poisoned(&d, n)).collect();
                if !exact {
                    d.write(&bufs[0], 0, &resid).unwrap();
                }
                let staged = poisoned(&d, cols);
                let outs: Vec<(&DevLinear, Out)> = dws
                    .iter()
                    .zip(&bufs)
                    .enumerate()
                    .map(|(i, (w, b))| {
                        let out = match (exact, i) {
                            (true, _) => Out::Exact(b.ptr),
                            (false, 0) => Out::AddToResidual(b.ptr),
                            (false, _) => Out::Store(b.ptr),
                        };
                        (w, out)
                    })
                    .collect();
                let input = Input {
                    x: xd.ptr,
                    cols,
                    prologue: prologue_arg,
                    staged_out: Some(staged.ptr),
                };
                d.k.decode
                    .project(&d, input, &outs, products, grid)
                    .unwrap();
                let got: Vec<Vec<f32>> = bufs
                    .iter()
                    .zip(rows)
                    .map(|(b, &n)| d.read(b, 0, n).unwrap())
                    .collect();
                (d.read(&staged, 0, cols).unwrap(), got)
            };
            // gemv4w_sm_grid: every check below for both grids, and the two tiles a block give
            // the persistent grid's bits.
            for grid in [GemvGrid::Persistent, GemvGrid::TwoTilesABlock] {
                let what = format!("{what}, {grid:?} grid");
                let (staged, got) = launch(GemvProducts::Int8Pairs, true, grid);
                let tol_staged = if bf16_activations { 1e-2 } else { 1e-5 };
                check(
                    &format!("{what}: staged row"),
                    &staged,
                    &staged_cpu,
                    tol_staged,
                );
                let (xt, gmax) = int8_pair_groups(&staged);
                let mut wrow = vec![0f32; cols];
                for (i, (w, got)) in ws.iter().zip(&got).enumerate() {
                    let (mut want_q, mut worst, mut outside) = (Vec::new(), 0f64, 0usize);
                    for (j, &o) in got.iter().enumerate() {
                        w.dequant_row(j, &mut wrow);
                        let (mut yq, mut yf, mut bound, mut mag) = (0f64, 0f64, 0f64, 0f64);
                        for (cc, &wv) in wrow.iter().enumerate() {
                            let wv = wv as f64;
                            yq += wv * xt[cc];
                            yf += wv * staged[cc] as f64;
                            bound += wv.abs() * gmax[cc / 64] / 64516.0;
                            mag += (wv * staged[cc] as f64).abs();
                        }
                        want_q.push(yq as f32);
                        let bound = bound * 1.001 + 1e-6 * mag + 1e-30;
                        let dev = (o as f64 - yf).abs();
                        worst = worst.max(dev / bound);
                        if dev.is_nan() || dev > bound {
                            outside += 1;
                        }
                    }
                    let what = format!("{what}: output {i} ({} rows)", got.len());
                    let e_q = rel_l2(&what, got, &want_q);
                    assert!(
                        e_q <= 1e-6,
                        "{what}: vs the f64 of the int8 pairs: rel L2 {e_q:.2e}"
                    );
                    assert_eq!(
                    outside, 0,
                    "{what}: {outside} values outside the pairs' bound (worst {worst:.2} of it)"
                );
                    println!(
                    "KERNEL dec_gemv4_x8x2 {what}: vs f64 of the int8 pairs rel L2 {e_q:.2e}; vs unrounded within the bound (worst {worst:.2} of it)"
                );
                }
                // The model's store modes, beside the f32 kernels.
                let (_, pairs) = launch(GemvProducts::Int8Pairs, false, grid);
                let (_, float) = launch(GemvProducts::Float, false, GemvGrid::Persistent);
                let tol = if bf16_activations { 1e-2 } else { 1e-4 };
                for (i, (p, f)) in pairs.iter().zip(&float).enumerate() {
                    check(
                        &format!("{what}: stored output {i} vs dec_gemv4"),
                        p,
                        f,
                        tol,
                    );
                }
                if grid == GemvGrid::TwoTilesABlock {
                    for exact in [true, false] {
                        let (s0, g0) = launch(GemvProducts::Int8Pairs, exact, GemvGrid::Persistent);
                        let (s1, g1) = launch(GemvProducts::Int8Pairs, exact, grid);
                        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                        assert_eq!(
                            bits(&s0),
                            bits(&s1),
                            "{what}: staged row vs the persistent grid"
                        );
                        for (i, (a, b)) in g0.iter().zip(&g1).enumerate() {
                            assert_eq!(
                                bits(a),
                                bits(b),
                                "{what}: output {i} (exact {exact}) vs the persistent grid"
                            );
                        }
                    }
                    println!("KERNEL dec_gemv4_x8x2 {what}: the persistent grid's bits");
                }
            }
        }
    }
    println!("KERNEL decode.cu int8-pair projections match the CPU");
}

/// The batched step's attention (`attn_split_mma_prep_rows` + `attn_split_combine_rows`: every
/// sequence in one launch each, its caches and position through pointer tables) against
/// `attn_split_mma_prep` + `attn_split_combine` run one sequence at a time on copies of the same
/// caches (those are tested against the CPU in attention.rs): the same code per sequence, so the
/// outputs and the caches (the new key and value written at each position) agree bit for bit.
/// bf16 (the tensor-core kernels' mode); the full model's head shape (general and _long bodies)
/// and a small one (head dim 64, rotary 16); 1, 3 and 8 sequences of different lengths (one
/// split to many).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn batched_decode_attention_rows_match_one_sequence_at_a_time() {
    use gattn::{QkPrep, RowsAttend, SplitKernel, SplitPartials};
    let d = dev(true);
    let mut rng = Rng(59);
    let max_ctx = 1024;
    let shapes = [
        (
            AttnShape {
                n_q: 16,
                n_kv: 2,
                d: 256,
                rotary: 64,
                theta: 1e7,
                eps: 1e-6,
            },
            SplitKernel::Mma,
        ),
        (
            AttnShape {
                n_q: 16,
                n_kv: 2,
                d: 256,
                rotary: 64,
                theta: 1e7,
                eps: 1e-6,
            },
            SplitKernel::MmaLong,
        ),
        (
            AttnShape {
                n_q: 4,
                n_kv: 2,
                d: 64,
                rotary: 16,
                theta: 1e7,
                eps: 1e-6,
            },
            SplitKernel::Mma,
        ),
    ];
    let lens = [37usize, 700, 5, 129, 1, 64, 999, 300];
    let (po, pml) = gattn::split_kv_scratch(16, 256);
    let (part_o, part_ml) = (poisoned(&d, po), poisoned(&d, pml));
    let parts = SplitPartials {
        part_o: part_o.ptr,
        part_ml: part_ml.ptr,
    };
    for (s, kernel) in shapes {
        let (hq, hkv, hd) = (s.n_q, s.n_kv, s.d);
        let q_norm = d
            .upload(
                &rng.vec(hd, 0.3)
                    .iter()
                    .map(|v| 1.0 + v)
                    .collect::<Vec<f32>>(),
            )
            .unwrap();
        let k_norm = d
            .upload(
                &rng.vec(hd, 0.3)
                    .iter()
                    .map(|v| 1.0 + v)
                    .collect::<Vec<f32>>(),
            )
            .unwrap();
        for rows in [1usize, 3, 8] {
            let what = format!("{hq}/{hkv} heads of {hd}, {kernel:?}, {rows} sequences");
            let cache_n = max_ctx * hkv * hd;
            let bf16_vals = |n: usize, rng: &mut Rng| -> Vec<u16> {
                rng.vec(n, 1.0)
                    .iter()
                    .map(|&v| bf16::from_f32(v).to_bits())
                    .collect()
            };
            let caches: Vec<(Vec<u16>, Vec<u16>)> = (0..rows)
                .map(|_| (bf16_vals(cache_n, &mut rng), bf16_vals(cache_n, &mut rng)))
                .collect();
            let up = || -> Vec<(DevBuf, DevBuf)> {
                caches
                    .iter()
                    .map(|(k, v)| (d.upload(k).unwrap(), d.upload(v).unwrap()))
                    .collect()
            };
            let (c_rows, c_one) = (up(), up());
            let pos: Vec<DevBuf> = (0..rows)
                .map(|b| d.upload(&[lens[b] as i32 - 1]).unwrap())
                .collect();
            let r = |v: Vec<f32>| -> Vec<f32> {
                v.into_iter().map(|x| bf16::from_f32(x).to_f32()).collect()
            };
            let qg = d.upload(&r(rng.vec(rows * 2 * hq * hd, 1.0))).unwrap();
            let kin = d.upload(&r(rng.vec(rows * hkv * hd, 1.0))).unwrap();
            let vin = d.upload(&r(rng.vec(rows * hkv * hd, 1.0))).unwrap();
            let q_scratch = poisoned(&d, hq * hd);
            let (out_rows, out_one) = (poisoned(&d, rows * hq * hd), poisoned(&d, rows * hq * hd));
            let mut caches_t: Vec<u64> = c_rows.iter().map(|(k, _)| k.ptr).collect();
            caches_t.extend(c_rows.iter().map(|(_, v)| v.ptr));
            let caches_t = d.upload(&caches_t).unwrap();
            let pos_t = d
                .upload(&pos.iter().map(|p| p.ptr).collect::<Vec<u64>>())
                .unwrap();
            let a = RowsAttend {
                qg: qg.ptr,
                k: kin.ptr,
                v: vin.ptr,
                q_norm: q_norm.ptr,
                k_norm: k_norm.ptr,
                caches: caches_t.ptr,
                positions: pos_t.ptr,
                out: out_rows.ptr,
                parts,
                rows,
            };
            d.k.attention
                .split_kv_prepped_rows(&d, kernel, s, &a)
                .unwrap();
            for b in 0..rows {
                let at = |buf: &DevBuf, n: usize| buf.ptr + (b * n * 4) as u64;
                let (kc, vc) = &c_one[b];
                let prep = QkPrep {
                    qg: at(&qg, 2 * hq * hd),
                    k: at(&kin, hkv * hd),
                    v: at(&vin, hkv * hd),
                    q_out: q_scratch.ptr,
                    k_cache: kc.ptr,
                    v_cache: vc.ptr,
                    q_norm: q_norm.ptr,
                    k_norm: k_norm.ptr,
                    pos: pos[b].ptr,
                };
                let attend = Attend {
                    shape: s,
                    q: q_scratch.ptr,
                    qg: at(&qg, 2 * hq * hd),
                    k_cache: kc.ptr,
                    v_cache: vc.ptr,
                    out: at(&out_one, hq * hd),
                    pos: pos[b].ptr,
                    n_tok: 1,
                };
                d.k.attention
                    .split_kv_prepped(&d, kernel, &attend, parts, &prep)
                    .unwrap();
            }
            let got: Vec<f32> = d.read(&out_rows, 0, rows * hq * hd).unwrap();
            let want: Vec<f32> = d.read(&out_one, 0, rows * hq * hd).unwrap();
            assert!(
                got.iter().all(|v| v.is_finite()),
                "{what}: outputs unwritten"
            );
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<u32>>();
            assert!(bits(&got) == bits(&want), "{what}: outputs");
            for b in 0..rows {
                for (i, name) in [(0, "key"), (1, "value")] {
                    let (x, y) = if i == 0 {
                        (&c_rows[b].0, &c_one[b].0)
                    } else {
                        (&c_rows[b].1, &c_one[b].1)
                    };
                    let gx: Vec<u16> = d.read(x, 0, cache_n).unwrap();
                    let gy: Vec<u16> = d.read(y, 0, cache_n).unwrap();
                    assert!(gx == gy, "{what}: sequence {b} {name} cache");
                    let row = (lens[b] - 1) * hkv * hd;
                    let before = if i == 0 { &caches[b].0 } else { &caches[b].1 };
                    assert!(
                        gx[row..row + hkv * hd] != before[row..row + hkv * hd],
                        "{what}: sequence {b}: no new {name} written"
                    );
                }
            }
        }
    }
    println!("KERNEL attention.cu batched split attention equals one sequence at a time");
}

/// `moe_bulk`: `dec_glu4_x8x2_bulk` (every tile of a block bulk-copied into shared memory before
/// any is summed) gives `dec_glu4_x8x2`'s outputs bit for bit: the routing (ids, weights) and
/// every routed and shared hidden row, written over NaN. The model's shapes (hidden 2,048, the
/// experts' and the shared expert's intermediate 512, top 8; 32 experts instead of 256, which only
/// the routing sees: 576 tiles, at most three a block on an H100's 264 blocks), and the kernel's
/// edges: routed experts of 516 rows (a last tile of 4 rows) beside a shared expert of 1,024 (the
/// routed items' tiles past their rows copy and store nothing; 1,152 tiles, more than the
/// persistent grid's 3 a block, so the launcher widens it to 384 blocks of 3). bf16 activations
/// (the plan names the kernel in bf16 mode only; the CPU emulation, scripts/cuda_emu/run_batch.sh
/// moe_bulk, checks fp32 too), three random tokens each.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn glu_bulk_gives_dec_glu4_x8x2_bits() {
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let mut rng = Rng(251);
    let full = ModelConfig {
        n_experts: 32,
        ..ModelConfig::from_json(&preset_text_config(Preset::Full)).unwrap()
    };
    // (routed rows, config, weights): a whole MoE of the model's widths (the down projections'
    // columns whole groups), its routed gate/up then of `inter` rows: the kernels read only those.
    let cases: Vec<(usize, ModelConfig, MoeWeights)> =
        [(full.expert_inter, full.shared_inter), (516, 1024)]
            .into_iter()
            .map(|(inter, shared_inter)| {
                let c = ModelConfig {
                    shared_inter,
                    ..full.clone()
                };
                let mut w = random_moe(&mut rng, &c);
                if inter != c.expert_inter {
                    w.gate = linear(&mut rng, 4, c.n_experts, inter, c.hidden);
                    w.up = linear(&mut rng, 4, c.n_experts, inter, c.hidden);
                }
                (inter, c, w)
            })
            .collect();
    let d = dev(true);
    for (inter, c, w) in &cases {
        let (h, e, tk, _, si) = moe_sizes(c);
        let inter = *inter;
        let dw = upload_moe(&d, "moe", w).unwrap();
        for draw in 0..3 {
            let what = format!("experts {e} of {inter} rows, shared {si}, draw {draw}");
            let logits = d.upload(&rng.vec(e, 2.0)).unwrap();
            let x: Vec<f32> = rng.vec(h, 1.0).into_iter().map(round_bf16).collect();
            let xn = d.upload(&x).unwrap();
            let out = moe_outputs(&d, 1, tk, inter, si);
            let [ids, rw, eh, sh] = &out;
            let glu = |i: usize| glu_run(&dw, &logits, e, tk, &xn, &out, i);
            let dec = &d.k.decode;
            let pairs = MoeProducts::Int8Pairs;
            dec.glu(&d, &glu(0), pairs, GluLoads::Registers).unwrap();
            dec.glu(&d, &glu(1), pairs, GluLoads::Bulk).unwrap();
            let ids_v: [Vec<i32>; 2] = [0, 1].map(|i| d.read(&ids[i], 0, tk).unwrap());
            assert_eq!(ids_v[0], ids_v[1], "{what}: expert ids");
            for (name, buf, n) in [
                ("routing weights", &rw, tk),
                ("experts' hidden rows", &eh, tk * inter),
                ("shared expert's hidden row", &sh, si),
            ] {
                let [want, got]: [Vec<f32>; 2] = [0, 1].map(|i| d.read(&buf[i], 0, n).unwrap());
                assert!(
                    want.iter().all(|v| v.is_finite()),
                    "{what}: {name}: dec_glu4_x8x2 left NaN"
                );
                assert_eq!(bits(&got), bits(&want), "{what}: {name}");
            }
            println!("KERNEL dec_glu4_x8x2_bulk {what}: dec_glu4_x8x2's bits");
        }
    }
}
