//! gemm.cu: the tensor-core linears (mma.sync and wgmma; dense, grouped, the split-precision router) against the exact product of their bf16 inputs.

use crate::common::*;

/// y = W x with W's dequantised values and x rounded to bf16 (what the tensor-core kernels
/// multiply), summed in f64: the exact product those kernels approximate.
fn bf16_product(w: &Linear, x: &[f32]) -> Vec<f32> {
    let (rows, cols) = (w.rows, w.cols);
    let rb = |v: f32| bf16::from_f32(v).to_f32() as f64;
    let mut wr = vec![0f32; cols];
    let mut wq = vec![0f64; rows * cols];
    for r in 0..rows {
        w.dequant_row(r, &mut wr);
        for c in 0..cols {
            wq[r * cols + c] = rb(wr[c]);
        }
    }
    let t = x.len() / cols;
    let mut y = vec![0f32; t * rows];
    for n in 0..t {
        for r in 0..rows {
            let s: f64 = (0..cols)
                .map(|c| wq[r * cols + c] * rb(x[n * cols + c]))
                .sum();
            y[n * rows + r] = s as f32;
        }
    }
    y
}

/// Each value rounded to bf16 (the activations the bf16 mode's kernels read).
fn bf(v: Vec<f32>) -> Vec<f32> {
    v.iter().map(|&a| bf16::from_f32(a).to_f32()).collect()
}

/// The device with the bf16 mode's kernels where it runs the wgmma ones (sm_90a); elsewhere a
/// line saying `what` was skipped, and None.
fn hopper(what: &str) -> Option<Dev> {
    let g = dev(true);
    if g.g.arch != "sm_90a" {
        println!("KERNEL {what}: skipped on {} (sm_90a only)", g.g.arch);
        return None;
    }
    Some(g)
}

/// x (rows of `cols`) on the device, and staged as bf16 rows (`to_bf16`) for the wgmma kernels.
fn upload_staged(g: &Dev, x: &[f32], cols: usize) -> (DevBuf, DevBuf) {
    let n = x.len() / cols;
    let dx = g.upload(x).unwrap();
    let xb = g.alloc(n * cols * 2).unwrap();
    g.k.gemm
        .to_bf16(&g.g, Rows::new(dx.ptr, cols), n, cols, xb.ptr)
        .unwrap();
    (dx, xb)
}

/// The routed experts' product through `Gemm::grouped` (tensor cores) for the grouping `gr` of
/// x's rows (x_div = top_k), outputs NaN-poisoned first; x also staged as bf16 (`to_bf16`) for
/// the wgmma kernels when `kernel` reads it so.
#[allow(clippy::too_many_arguments)]
fn gemm_grouped(
    g: &Dev,
    kernel: GroupedGemm,
    dw: &DevLinear,
    gr: &Grouping,
    x: &[f32],
    k: usize,
    rows: usize,
    cols: usize,
) -> Vec<f32> {
    gemm_grouped_runs(g, &[(kernel, gr.groups)], dw, x, k, rows, cols)
}

/// As `gemm_grouped`, one launch a (kernel, tiles) pair into the same outputs (the tiles of 128
/// and the remainders' list of `wgmma_tail_tiles`).
fn gemm_grouped_runs(
    g: &Dev,
    runs: &[(GroupedGemm, ExpertGroups)],
    dw: &DevLinear,
    x: &[f32],
    k: usize,
    rows: usize,
    cols: usize,
) -> Vec<f32> {
    let items = x.len() / cols * k;
    let (dx, xb) = upload_staged(g, x, cols);
    let dy = poisoned(g, items * rows);
    for &(kernel, groups) in runs {
        let grouped = Grouped {
            w: dw,
            groups,
            x: Rows::new(dx.ptr, cols),
            xb: kernel.staged().then(|| Rows::new(xb.ptr, cols)),
            x_div: k,
            y: Rows::new(dy.ptr, rows),
        };
        g.k.gemm.grouped(g, kernel, &grouped).unwrap();
    }
    g.read(&dy, 0, items * rows).unwrap()
}

/// gemm_dense_wgb, gemm_dense_wgb256 and gemm_grouped_wgb64 (wgmma, sm_90a; the plan's
/// `wgmma_gemm`, on inputs staged as bf16 by `to_bf16`) vs the exact product of the bf16 values
/// they multiply, as gemm_dense's test: 4-bit weights with groups of 16 … 128, rows not a
/// multiple of the block's 128, tokens not a multiple of the block's, two and many k-steps, store
/// and residual add; the grouped form over skewed routing; then at prefill's shapes against
/// gemm_dense (same bf16 operands, fp32 sums, outputs rounded to bf16: 5e-3), with every
/// kernel's time printed (never asserted). Skipped (with a line) on GPUs other than sm_90a.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn wgmma_linears_match_the_bf16_product() {
    let Some(g) = hopper("gemm_dense_wg") else {
        return;
    };
    let mut rng = Rng(37);
    // x (rows × cols f32 on the device) staged as bf16 rows. Every chunk size below takes the
    // kernel asked for (the plan keeps 256-token blocks for chunks of WGB256_MIN_TOK or more).
    #[allow(clippy::too_many_arguments)]
    let dense = |g: &Dev,
                 kernel: DenseGemm,
                 dw: &DevLinear,
                 x: u64,
                 xb: Option<Rows>,
                 y: u64,
                 t: usize,
                 store: Store| {
        let a = Project {
            w: dw,
            x: Rows::new(x, dw.cols),
            xb,
            y: Rows::new(y, dw.rows),
            n_tok: t,
        };
        g.k.gemm.dense(&g.g, kernel, &a, store).unwrap()
    };
    let stage = |g: &Dev, x: u64, rows: usize, cols: usize| -> DevBuf {
        let b = g.alloc(rows * cols * 2).unwrap();
        g.k.gemm
            .to_bf16(&g.g, Rows::new(x, cols), rows, cols, b.ptr)
            .unwrap();
        b
    };
    for (group, t, rows, cols) in [
        (64usize, 128usize, 128usize, 128usize),
        (64, 300, 200, 256),
        (32, 130, 136, 512),
        (64, 256, 1000, 2048),
        (16, 200, 136, 256),
        (128, 300, 264, 1024),
    ] {
        let w = quantize_linear(&bf16_linear(&mut rng, 1, rows, cols), 4, group);
        let dw = upload_linear(&g, "w", &w).unwrap();
        assert!(
            lily_cuda::kernels::gemm::wg_fits(&dw.shape()),
            "{rows}x{cols} group {group}: a weight the wgmma kernels take"
        );
        let x = bf(rng.vec(t * cols, 1.0));
        let dx = g.upload(&x).unwrap();
        let want = bf16_product(&w, &x);
        let r = bf(rng.vec(t * rows, 0.5));
        let xb = stage(&g, dx.ptr, t, cols);
        let staged = Some(Rows::new(xb.ptr, cols));
        for (name, kernel) in [
            ("gemm_dense_wgb", DenseGemm::Wgb),
            ("gemm_dense_wgb256", DenseGemm::Wgb256),
        ] {
            let dy = poisoned(&g, t * rows);
            dense(&g, kernel, &dw, dx.ptr, staged, dy.ptr, t, Store::Overwrite);
            let y: Vec<f32> = g.read(&dy, 0, t * rows).unwrap();
            let what = format!("{name} group={group} T={t} {rows}x{cols}");
            check(&what, &y, &want, 5e-3);
            g.write(&dy, 0, &r).unwrap();
            dense(
                &g,
                kernel,
                &dw,
                dx.ptr,
                staged,
                dy.ptr,
                t,
                Store::AddToResidual,
            );
            let y: Vec<f32> = g.read(&dy, 0, t * rows).unwrap();
            let want: Vec<f32> = want.iter().zip(&r).map(|(a, b)| a + b).collect();
            check(&format!("{what} +residual"), &y, &want, 5e-3);
        }
    }
    // Grouped (gemm_grouped_wgb64, _wgb128): skewed routing over tiles of 64 and 128 (one expert
    // over two tiles, one with none), groups of 64 and 32, two and many k-steps.
    for (group, cols) in [(64usize, 256usize), (32, 512), (64, 128)] {
        let (e, rows, t, k) = (7, 136, 90, 2);
        let items = t * k;
        let w = quantize_linear(&bf16_linear(&mut rng, e, rows, cols), 4, group);
        let dw = upload_linear(&g, "w", &w).unwrap();
        let x = bf(rng.vec(t * cols, 1.0));
        for kernel in [GroupedGemm::Wgb64, GroupedGemm::Wgb128] {
            let tile = kernel.tile();
            let gr = Grouping::skewed(&g, &mut rng, items, e, tile);
            let want = gr.want(&w, &x, k, bf16_product);
            let y = gemm_grouped(&g, kernel, &dw, &gr, &x, k, rows, cols);
            let what = format!(
                "gemm_grouped_wgb{tile} group={group} {rows}x{cols} ({} tiles)",
                gr.tiles_made(&g)
            );
            check(&what, &y, &want, 5e-3);
        }
    }
    // Prefill's shapes (DeltaNet in_proj, out_proj, shared expert down) against gemm_dense.
    for (t, rows, cols) in [
        (4096usize, 8192usize, 2048usize),
        (4096, 2048, 4096),
        (512, 2048, 512),
    ] {
        let w = quantize_linear(&bf16_linear(&mut rng, 1, rows, cols), 4, 64);
        let dw = upload_linear(&g, "w", &w).unwrap();
        let x = bf(rng.vec(t * cols, 1.0));
        let dx = g.upload(&x).unwrap();
        let xb = stage(&g, dx.ptr, t, cols);
        let reps = 10;
        let timed = |g: &Dev, f: &dyn Fn()| -> f64 {
            f();
            g.sync().unwrap();
            let start = std::time::Instant::now();
            for _ in 0..reps {
                f();
            }
            g.sync().unwrap();
            start.elapsed().as_secs_f64() / reps as f64
        };
        let secs = timed(&g, &|| {
            g.k.gemm
                .to_bf16(&g.g, Rows::new(dx.ptr, cols), t, cols, xb.ptr)
                .unwrap()
        });
        println!("KERNEL to_bf16 T={t} x{cols}: {:.1} µs", secs * 1e6);
        let mut outs = Vec::new();
        let staged = Some(Rows::new(xb.ptr, cols));
        for (name, kernel, staged) in [
            ("gemm_dense", DenseGemm::Mma, None),
            ("gemm_dense_wgb", DenseGemm::Wgb, staged),
            ("gemm_dense_wgb256", DenseGemm::Wgb256, staged),
        ] {
            let dy = poisoned(&g, t * rows);
            let secs = timed(&g, &|| {
                dense(&g, kernel, &dw, dx.ptr, staged, dy.ptr, t, Store::Overwrite)
            });
            let tflops = 2.0 * (t * rows * cols) as f64 / secs / 1e12;
            println!(
                "KERNEL {name} T={t} {rows}x{cols}: {:.1} µs, {tflops:.0} TFLOP/s",
                secs * 1e6
            );
            outs.push((name, g.read::<f32>(&dy, 0, t * rows).unwrap()));
        }
        for (name, y) in &outs[1..] {
            let what = format!("{name} vs gemm_dense T={t} {rows}x{cols}");
            check(&what, y, &outs[0].1, 5e-3);
        }
    }
}

/// Tensor-core linears (gemm.cu, bf16 activation mode) vs the exact product of the bf16 values
/// they multiply. Tolerance 5e-3: the outputs are rounded to bf16 (≈ 1e-3 relative RMS) and
/// summed in fp32; a wrong fragment layout or tile bound gives errors of order 1.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn tensor_core_linears_match_the_bf16_product() {
    let g = dev(true);
    let mut rng = Rng(31);
    // Dense: rows not a multiple of 128 (or under 64), tokens not a multiple of 64, several k-steps.
    for bits in [4u32, 8, 16] {
        for (t, rows, cols) in [
            (16usize, 200usize, 192usize),
            (100, 130, 512),
            (64, 64, 64),
            (300, 20, 128),
            (128, 256, 256),
        ] {
            let w = linear(&mut rng, bits, 1, rows, cols);
            let dw = upload_linear(&g, "w", &w).unwrap();
            assert_eq!(
                g.plan.dense(&dw.shape(), t, false),
                Dense::Gemm(DenseGemm::Mma),
                "bf16 mode runs chunks of >= 16 tokens on tensor cores unless LILY_TENSOR_CORES=0"
            );
            let x = bf(rng.vec(t * cols, 1.0));
            let dx = g.upload(&x).unwrap();
            let dy = poisoned(&g, t * rows);
            g.project(&dw, dx.ptr, cols, dy.ptr, rows, t, Store::Overwrite);
            let y: Vec<f32> = g.read(&dy, 0, t * rows).unwrap();
            let want = bf16_product(&w, &x);
            check(
                &format!("gemm_dense bits={bits} T={t} {rows}x{cols}"),
                &y,
                &want,
                5e-3,
            );
            let r = bf(rng.vec(t * rows, 0.5));
            g.write(&dy, 0, &r).unwrap();
            g.project(&dw, dx.ptr, cols, dy.ptr, rows, t, Store::AddToResidual);
            let y: Vec<f32> = g.read(&dy, 0, t * rows).unwrap();
            let want: Vec<f32> = want.iter().zip(&r).map(|(a, b)| a + b).collect();
            check(
                &format!("gemm_dense+residual bits={bits} T={t}"),
                &y,
                &want,
                5e-3,
            );
        }
    }
    // The router in split precision (gemm_dense_exact): the fp32 weights' product to ~1e-5; in
    // one pass over the columns and split into parts (`router_split_k`; 512 tokens of 256
    // experts × 2,048 columns: 8 parts, as Qwen3.6's router at a 512-token chunk).
    for (bits, t, rows, cols) in [
        (8u32, 100usize, 136usize, 256usize),
        (4, 100, 136, 256),
        (8, 512, 256, 2048),
    ] {
        let w = linear(&mut rng, bits, 1, rows, cols);
        let dw = upload_linear(&g, "router", &w).unwrap();
        let x = bf(rng.vec(t * cols, 1.0));
        let dx = g.upload(&x).unwrap();
        let mut wr = vec![0f32; cols];
        let mut want = vec![0f32; t * rows];
        for r in 0..rows {
            w.dequant_row(r, &mut wr);
            for n in 0..t {
                let s: f64 = (0..cols)
                    .map(|c| wr[c] as f64 * x[n * cols + c] as f64)
                    .sum();
                want[n * rows + r] = s as f32;
            }
        }
        for split in [false, true] {
            let plan = g.plan_with(|o| o.router_split_k = split);
            let Router::GemmExact { parts } = plan.router(&dw.shape(), t) else {
                panic!("bf16 mode runs the router of >= 16 tokens on tensor cores");
            };
            let dy = poisoned(&g, t * rows);
            let a = Project {
                w: &dw,
                x: Rows::new(dx.ptr, cols),
                xb: None,
                y: Rows::new(dy.ptr, rows),
                n_tok: t,
            };
            g.k.gemm.dense_exact(&g.g, parts, &a).unwrap();
            let y: Vec<f32> = g.read(&dy, 0, t * rows).unwrap();
            check(
                &format!(
                    "gemm_dense_exact (router) bits={bits} T={t} {rows}x{cols}, {parts} parts"
                ),
                &y,
                &want,
                2e-5,
            );
        }
    }
    // Grouped: skewed routing (one expert over two 64-item tiles, one expert with none).
    for kernel in [GroupedGemm::Mma32, GroupedGemm::Mma64] {
        let tile = kernel.tile();
        for bits in [4u32, 8] {
            let (e, rows, cols, t, k) = (7, 136, 256, 90, 2);
            let items = t * k;
            let w = linear(&mut rng, bits, e, rows, cols);
            let dw = upload_linear(&g, "w", &w).unwrap();
            let x = bf(rng.vec(t * cols, 1.0));
            let gr = Grouping::skewed(&g, &mut rng, items, e, tile);
            let y = gemm_grouped(&g, kernel, &dw, &gr, &x, k, rows, cols);
            let want = gr.want(&w, &x, k, bf16_product);
            check(
                &format!(
                    "gemm_grouped{tile} bits={bits} ({} tiles)",
                    gr.tiles_made(&g)
                ),
                &y,
                &want,
                5e-3,
            );
        }
    }
}

/// A random 4-bit MLX-affine stack without a bf16 original (quick at the model's full size):
/// random packed nibbles, bf16 scales in [0.2, 1) / (8 √cols), biases within ±8 scales.
fn random_q4(rng: &mut Rng, experts: usize, rows: usize, cols: usize, group: usize) -> Linear {
    let packed: Vec<u8> = (0..experts * rows * cols / 8)
        .flat_map(|_| (rng.next() as u32).to_le_bytes())
        .collect();
    let n = experts * rows * cols / group;
    let (mut scales, mut biases) = (Vec::with_capacity(2 * n), Vec::with_capacity(2 * n));
    for _ in 0..n {
        let sc = (0.2 + 0.8 * rng.val(1.0).abs()) / (8.0 * (cols as f32).sqrt());
        let sc = bf16::from_f32(sc);
        let bi = bf16::from_f32(rng.val(8.0) * sc.to_f32());
        scales.extend(sc.to_bits().to_le_bytes());
        biases.extend(bi.to_bits().to_le_bytes());
    }
    Linear {
        experts,
        rows,
        cols,
        data: WeightData::Affine {
            bits: 4,
            group,
            packed: Blob::owned(packed),
            scales: Blob::owned(scales),
            biases: Blob::owned(biases),
        },
    }
}

/// The items `top_k` distinct experts of `e` a token, uniform (for n tokens: n·top_k / e ± its
/// square root an expert, the load the perf notes' 512 / 4K arithmetic assumes).
fn uniform_routing(rng: &mut Rng, n: usize, top_k: usize, e: usize) -> Vec<i32> {
    let mut ids = Vec::with_capacity(n * top_k);
    for _ in 0..n {
        let start = ids.len();
        while ids.len() < start + top_k {
            let x = rng.below(e) as i32;
            if !ids[start..].contains(&x) {
                ids.push(x);
            }
        }
    }
    ids
}

/// The wgmma kernels' _lean variants (the plan's `wgmma_lean_dequant`) against the kernels they
/// stand for, bit for bit: gemm_dense_wgb / _wgb256 (store and residual add) and
/// gemm_grouped_wgb32 / 64 / 128 over skewed routing, groups of 64 and 128, two and many k-steps,
/// rows off the block's 128; each also against the exact product (5e-3). Skipped (with a line) on
/// GPUs other than sm_90a.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn wgmma_lean_dequant_gives_the_same_bits() {
    let Some(g) = hopper("gemm_dense_wgb_lean") else {
        return;
    };
    let mut rng = Rng(71);
    let same = |what: &str, a: &[f32], b: &[f32]| {
        let differ = a
            .iter()
            .zip(b)
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count();
        println!("KERNEL {what}: {differ} of {} outputs differ", a.len());
        assert_eq!(differ, 0, "{what}: outputs differ");
    };
    for (group, t, rows, cols) in [
        (64usize, 300usize, 200usize, 256usize),
        (128, 260, 264, 1024),
    ] {
        let w = quantize_linear(&bf16_linear(&mut rng, 1, rows, cols), 4, group);
        let dw = upload_linear(&g, "w", &w).unwrap();
        let x = bf(rng.vec(t * cols, 1.0));
        let want = bf16_product(&w, &x);
        let (dx, xb) = upload_staged(&g, &x, cols);
        let r = bf(rng.vec(t * rows, 0.5));
        for (plain, lean) in [
            (DenseGemm::Wgb, DenseGemm::WgbLean),
            (DenseGemm::Wgb256, DenseGemm::Wgb256Lean),
        ] {
            for store in [Store::Overwrite, Store::AddToResidual] {
                let mut outs = Vec::new();
                for kernel in [plain, lean] {
                    let dy = poisoned(&g, t * rows);
                    if store == Store::AddToResidual {
                        g.write(&dy, 0, &r).unwrap();
                    }
                    let a = Project {
                        w: &dw,
                        x: Rows::new(dx.ptr, cols),
                        xb: Some(Rows::new(xb.ptr, cols)),
                        y: Rows::new(dy.ptr, rows),
                        n_tok: t,
                    };
                    g.k.gemm.dense(&g.g, kernel, &a, store).unwrap();
                    outs.push(g.read::<f32>(&dy, 0, t * rows).unwrap());
                }
                let what =
                    format!("{lean:?} vs {plain:?} group={group} T={t} {rows}x{cols} {store:?}");
                same(&what, &outs[1], &outs[0]);
                if store == Store::Overwrite {
                    check(&what, &outs[1], &want, 5e-3);
                }
            }
        }
        for tile in [32usize, 64, 128] {
            let (e, k) = (7, 2);
            let gw = quantize_linear(&bf16_linear(&mut rng, e, rows, cols), 4, group);
            let gdw = upload_linear(&g, "w", &gw).unwrap();
            let gx = bf(rng.vec(90 * cols, 1.0));
            let gr = Grouping::skewed(&g, &mut rng, 90 * k, e, tile);
            let gwant = gr.want(&gw, &gx, k, bf16_product);
            let plain = match tile {
                32 => GroupedGemm::Wgb32,
                64 => GroupedGemm::Wgb64,
                _ => GroupedGemm::Wgb128,
            };
            let y0 = gemm_grouped(&g, plain, &gdw, &gr, &gx, k, rows, cols);
            let y1 = gemm_grouped(&g, plain.lean(), &gdw, &gr, &gx, k, rows, cols);
            let what = format!(
                "{:?} vs {plain:?} group={group} {rows}x{cols}",
                plain.lean()
            );
            same(&what, &y1, &y0);
            check(&what, &y1, &gwant, 5e-3);
        }
    }
}

/// The grouped _lean kernels' _hoist variants (the plan's `wgmma_hoisted_addrs`: a k-step's
/// addresses held in registers, the ring slots rotated) against the plain kernels, bit for bit:
/// gemm_grouped_wgb32 / 64 / 128 over skewed routing, groups of 64 and 128, fewer k-steps than
/// the ring's stages and many (the ring wrapping), rows off the block's 128; each also against
/// the exact product (5e-3). Skipped (with a line) on GPUs other than sm_90a.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn wgmma_hoisted_addrs_gives_the_same_bits() {
    let Some(g) = hopper("gemm_grouped_wgb64_hoist") else {
        return;
    };
    let mut rng = Rng(73);
    for (group, rows, cols) in [
        (64usize, 200usize, 256usize),
        (64, 136, 1024),
        (128, 264, 1024),
    ] {
        for tile in [32usize, 64, 128] {
            let (e, k) = (7, 2);
            let gw = quantize_linear(&bf16_linear(&mut rng, e, rows, cols), 4, group);
            let gdw = upload_linear(&g, "w", &gw).unwrap();
            let gx = bf(rng.vec(90 * cols, 1.0));
            let gr = Grouping::skewed(&g, &mut rng, 90 * k, e, tile);
            let gwant = gr.want(&gw, &gx, k, bf16_product);
            let plain = match tile {
                32 => GroupedGemm::Wgb32,
                64 => GroupedGemm::Wgb64,
                _ => GroupedGemm::Wgb128,
            };
            let hoist = plain.lean().hoist();
            let y0 = gemm_grouped(&g, plain, &gdw, &gr, &gx, k, rows, cols);
            let y1 = gemm_grouped(&g, hoist, &gdw, &gr, &gx, k, rows, cols);
            let what = format!("{hoist:?} vs {plain:?} group={group} {rows}x{cols}");
            let differ = y1
                .iter()
                .zip(&y0)
                .filter(|(a, b)| a.to_bits() != b.to_bits())
                .count();
            println!("KERNEL {what}: {differ} of {} outputs differ", y0.len());
            assert_eq!(differ, 0, "{what}: outputs differ");
            check(&what, &y1, &gwant, 5e-3);
        }
    }
}

/// gemm_grouped_wgb32 (tiles of 32: the plan's `wgmma_narrow_tiles`, and the remainders'
/// launch of `wgmma_tail_tiles` after gemm_grouped_wgb128) vs the exact product of the bf16
/// values (5e-3, as the other grouped kernels): skewed routing over tiles of 32, groups of 64 /
/// 32, two and many k-steps; moe_group's two lists (each expert's tiles of 128 until ≤ 32 items
/// are left, those in the second list: counts checked on the host) run as two launches into
/// the same outputs. Then the model's shapes (256 experts, gate/up 512 × 2,048 and down 2,048 ×
/// 512, groups of 64, 8 of 256 uniform routing) at 512 / 768 / 4,096 tokens: the new runs against
/// the fixed tiles they replace (gemm_grouped_wgb64 at 512 / 768, gemm_grouped_wgb128 alone at
/// 4,096), with the count of bit-identical outputs (the same bf16 products summed in the same
/// k order: expected all) and each launch's time printed (never asserted); both again on the
/// _lean variants (`wgmma_lean_dequant`) and their _hoist variants (`wgmma_hoisted_addrs`),
/// timed, whose outputs must be bit-identical to the plain kernels'. Skipped (with a line) on GPUs other than sm_90a.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn grouped_narrow_and_tail_tiles_match_the_fixed_tiles() {
    let Some(g) = hopper("gemm_grouped_wgb32") else {
        return;
    };
    let mut rng = Rng(53);
    for (group, cols) in [(64usize, 256usize), (32, 512), (64, 128)] {
        let (e, rows, t, k) = (7, 136, 90, 2);
        let items = t * k;
        let w = quantize_linear(&bf16_linear(&mut rng, e, rows, cols), 4, group);
        let dw = upload_linear(&g, "w", &w).unwrap();
        let x = bf(rng.vec(t * cols, 1.0));
        let gr = Grouping::skewed(&g, &mut rng, items, e, 32);
        let want = gr.want(&w, &x, k, bf16_product);
        let y = gemm_grouped(&g, GroupedGemm::Wgb32, &dw, &gr, &x, k, rows, cols);
        let what = format!(
            "gemm_grouped_wgb32 group={group} {rows}x{cols} ({} tiles)",
            gr.tiles_made(&g)
        );
        check(&what, &y, &want, 5e-3);
    }
    // Two lists: experts of 0, 20, 32, 33, 128, 129, 160, 161, 281 items (tiles of 128 until at
    // most 32 are left: 0 + 0, 0 + 1, 0 + 1, 1 + 0, 1 + 0, 1 + 1, 1 + 1, 2 + 0, 2 + 1).
    let counts = [0usize, 20, 32, 33, 128, 129, 160, 161, 281];
    let (want_tiles, want_tails) = (8, 5);
    let e = counts.len();
    for (group, rows, cols, k) in [(64usize, 136usize, 256usize, 2usize), (32, 264, 512, 1)] {
        let mut ids: Vec<i32> = counts
            .iter()
            .enumerate()
            .flat_map(|(x, &c)| std::iter::repeat_n(x as i32, c))
            .collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, rng.below(i + 1));
        }
        let items = ids.len();
        let w = quantize_linear(&bf16_linear(&mut rng, e, rows, cols), 4, group);
        let dw = upload_linear(&g, "w", &w).unwrap();
        let x = bf(rng.vec(items / k * cols, 1.0));
        let gr = Grouping::of(&g, ids, e, 128, 32);
        let (tiles, tails) = (gr.tiles_made(&g), gr.tails_made(&g));
        assert_eq!(
            (tiles, tails),
            (want_tiles, want_tails),
            "moe_group's two lists"
        );
        let want = gr.want(&w, &x, k, bf16_product);
        let runs = [
            (GroupedGemm::Wgb128, gr.groups),
            (GroupedGemm::Wgb32, gr.groups.tail_groups(e)),
        ];
        let y = gemm_grouped_runs(&g, &runs, &dw, &x, k, rows, cols);
        let what = format!(
            "gemm_grouped_wgb128 + _wgb32 remainders group={group} {rows}x{cols} ({tiles} + {tails} tiles)"
        );
        check(&what, &y, &want, 5e-3);
    }
    // The model's shapes against the fixed tiles, timed.
    let (e, top_k, hidden, inter) = (256usize, 8usize, 2048usize, 512usize);
    let gate = random_q4(&mut rng, e, inter, hidden, 64);
    let down = random_q4(&mut rng, e, hidden, inter, 64);
    let (dgate, ddown) = (
        upload_linear(&g, "gate", &gate).unwrap(),
        upload_linear(&g, "down", &down).unwrap(),
    );
    for n in [512usize, 768, 4096] {
        let ids = uniform_routing(&mut rng, n, top_k, e);
        let items = n * top_k;
        let (fixed, new): (Grouping, Grouping) = if n <= 768 {
            (
                Grouping::of(&g, ids.clone(), e, 64, 0),
                Grouping::of(&g, ids, e, 32, 0),
            )
        } else {
            (
                Grouping::of(&g, ids.clone(), e, 128, 0),
                Grouping::of(&g, ids, e, 128, 32),
            )
        };
        let fixed_kernel = if n <= 768 {
            GroupedGemm::Wgb64
        } else {
            GroupedGemm::Wgb128
        };
        let fixed_runs = vec![(fixed_kernel, fixed.groups)];
        let fixed_lean_runs = vec![(fixed_kernel.lean(), fixed.groups)];
        let new_runs = if n <= 768 {
            vec![(GroupedGemm::Wgb32, new.groups)]
        } else {
            vec![
                (GroupedGemm::Wgb128, new.groups),
                (GroupedGemm::Wgb32, new.groups.tail_groups(e)),
            ]
        };
        let tiles = |gr: &Grouping, tail: bool| {
            let t = gr.tiles_made(&g);
            if tail {
                format!("{t} + {}", gr.tails_made(&g))
            } else {
                t.to_string()
            }
        };
        let lean_runs: Vec<(GroupedGemm, ExpertGroups)> =
            new_runs.iter().map(|&(k, gr)| (k.lean(), gr)).collect();
        let fixed_hoist_runs = vec![(fixed_kernel.lean().hoist(), fixed.groups)];
        let hoist_runs: Vec<(GroupedGemm, ExpertGroups)> = new_runs
            .iter()
            .map(|&(k, gr)| (k.lean().hoist(), gr))
            .collect();
        let (fixed_tiles, new_tiles) = (tiles(&fixed, false), tiles(&new, n > 768));
        for (name, dw, rows, cols, k) in [
            ("gate/up", &dgate, inter, hidden, top_k),
            ("down", &ddown, hidden, inter, 1),
        ] {
            let x = bf(rng.vec(items / k * cols, 1.0));
            let (dx, xb) = upload_staged(&g, &x, cols);
            let dy = poisoned(&g, items * rows);
            let launch = |runs: &[(GroupedGemm, ExpertGroups)]| {
                for &(kernel, groups) in runs {
                    let a = Grouped {
                        w: dw,
                        groups,
                        x: Rows::new(dx.ptr, cols),
                        xb: Some(Rows::new(xb.ptr, cols)),
                        x_div: k,
                        y: Rows::new(dy.ptr, rows),
                    };
                    g.k.gemm.grouped(&g, kernel, &a).unwrap();
                }
            };
            let mut outs = Vec::new();
            for (label, runs, tiles) in [
                ("fixed", &fixed_runs, &fixed_tiles),
                ("new", &new_runs, &new_tiles),
                ("fixed lean", &fixed_lean_runs, &fixed_tiles),
                ("new lean", &lean_runs, &new_tiles),
                ("fixed hoist", &fixed_hoist_runs, &fixed_tiles),
                ("new hoist", &hoist_runs, &new_tiles),
            ] {
                g.write(&dy, 0, &vec![f32::NAN; items * rows]).unwrap();
                launch(runs);
                g.sync().unwrap();
                outs.push(g.read::<f32>(&dy, 0, items * rows).unwrap());
                let reps = 20;
                let start = std::time::Instant::now();
                for _ in 0..reps {
                    launch(runs);
                }
                g.sync().unwrap();
                let secs = start.elapsed().as_secs_f64() / reps as f64;
                let kernels: Vec<String> = runs.iter().map(|(k, _)| format!("{k:?}")).collect();
                let tflops = 2.0 * (items * rows * cols) as f64 / secs / 1e12;
                println!(
                    "KERNEL grouped {label} {} T={n} {name} {rows}x{cols} ({tiles} tiles): {:.1} µs, {tflops:.0} TFLOP/s",
                    kernels.join(" + "),
                    secs * 1e6
                );
            }
            let same = outs[0]
                .iter()
                .zip(&outs[1])
                .filter(|(a, b)| a.to_bits() == b.to_bits())
                .count();
            println!(
                "KERNEL grouped new vs fixed T={n} {name}: {same} of {} outputs bit-identical",
                outs[0].len()
            );
            check(
                &format!("grouped new vs fixed T={n} {name}"),
                &outs[1],
                &outs[0],
                5e-3,
            );
            // `wgmma_lean_dequant` and `wgmma_hoisted_addrs`: the same fragments, so every
            // output bit for bit.
            for (variant, plain, label) in [
                (2, 0, "fixed lean vs fixed"),
                (3, 1, "new lean vs new"),
                (4, 0, "fixed hoist vs fixed"),
                (5, 1, "new hoist vs new"),
            ] {
                let differ = outs[variant]
                    .iter()
                    .zip(&outs[plain])
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                println!("KERNEL grouped {label} T={n} {name}: {differ} outputs differ");
                assert_eq!(differ, 0, "{label} T={n} {name}: outputs differ");
            }
        }
    }
}
