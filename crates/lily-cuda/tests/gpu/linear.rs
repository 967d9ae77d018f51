//! linear.cu: the CUDA-core linears (dense, gathered and grouped experts) against the CPU.

use crate::common::*;

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn linear_matches_cpu_matmul_for_4bit_8bit_and_bf16() {
    let g = gpu();
    let mut rng = Rng(1);
    for bits in [4u32, 8, 16] {
        for t in [1usize, 3, 9, 16, 37] {
            let (rows, cols) = (70, 320);
            let w = linear(&mut rng, bits, 1, rows, cols);
            let dw = upload_linear(&g, "w", &w).unwrap();
            let x = rng.vec(t * cols, 1.0);
            let dx = g.upload(&x).unwrap();
            let dy = poisoned(&g, t * rows);
            g.project(&dw, dx.ptr, cols, dy.ptr, rows, t, Store::Overwrite);
            let y: Vec<f32> = g.read(&dy, 0, t * rows).unwrap();
            check(
                &format!("linear bits={bits} T={t}"),
                &y,
                &matmul(&w, &x),
                1e-5,
            );
            // accumulate: y = r + W x
            let r = rng.vec(t * rows, 0.5);
            g.write(&dy, 0, &r).unwrap();
            g.project(&dw, dx.ptr, cols, dy.ptr, rows, t, Store::AddToResidual);
            let y: Vec<f32> = g.read(&dy, 0, t * rows).unwrap();
            let want: Vec<f32> = matmul(&w, &x).iter().zip(&r).map(|(a, b)| a + b).collect();
            check(
                &format!("linear+residual bits={bits} T={t}"),
                &y,
                &want,
                1e-5,
            );
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn linear_gather_matches_cpu_per_expert() {
    let g = gpu();
    let mut rng = Rng(2);
    for bits in [4u32, 8, 16] {
        let (e, rows, cols, t, k) = (6, 40, 128, 3, 2);
        let w = linear(&mut rng, bits, e, rows, cols);
        let dw = upload_linear(&g, "w", &w).unwrap();
        let x = rng.vec(t * cols, 1.0);
        let ids: Vec<i32> = (0..t * k).map(|_| rng.below(e) as i32).collect();
        let (dx, dids) = (g.upload(&x).unwrap(), g.upload(&ids).unwrap());
        let dy = poisoned(&g, t * k * rows);
        let gather = Gather {
            w: &dw,
            ids: dids.ptr,
            x: Rows::new(dx.ptr, cols),
            x_div: k,
            y: Rows::new(dy.ptr, rows),
            n_items: t * k,
        };
        g.k.linear.gather(&g, &gather).unwrap();
        let y: Vec<f32> = g.read(&dy, 0, t * k * rows).unwrap();
        let mut want = Vec::new();
        for (n, &id) in ids.iter().enumerate() {
            want.extend(matmul(
                &w.expert(id as usize),
                &x[(n / k) * cols..(n / k + 1) * cols],
            ));
        }
        check(&format!("linear_gather bits={bits}"), &y, &want, 1e-5);
    }
}

/// More items than grid.y takes (72,000 > GRID_Y_MAX, a prefill chunk of 9,000 tokens at top-8):
/// linear_gather's block rows loop over items GRID_Y_MAX apart. Against the CPU, and bit for bit
/// against the same items in two launches of fewer than GRID_Y_MAX (one pass each, as every
/// launch of a chunk of at most 8,191 tokens).
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn linear_gather_past_the_grid_y_limit_matches_cpu_and_one_pass_launches() {
    let g = gpu();
    let mut rng = Rng(31);
    let (e, rows, cols, t, k) = (6, 8, 64, 36_000, 2);
    let items = t * k;
    assert!(items > lily_cuda::kernels::GRID_Y_MAX);
    for bits in [4u32, 16] {
        let w = linear(&mut rng, bits, e, rows, cols);
        let dw = upload_linear(&g, "w", &w).unwrap();
        let x = rng.vec(t * cols, 1.0);
        let ids: Vec<i32> = (0..items).map(|_| rng.below(e) as i32).collect();
        let (dx, dids) = (g.upload(&x).unwrap(), g.upload(&ids).unwrap());
        let gather = |dy: u64, first: usize, n_items: usize| Gather {
            w: &dw,
            ids: dids.ptr + 4 * first as u64,
            x: Rows::new(dx.ptr + 4 * (first / k * cols) as u64, cols),
            x_div: k,
            y: Rows::new(dy + 4 * (first * rows) as u64, rows),
            n_items,
        };
        let dy = poisoned(&g, items * rows);
        g.k.linear.gather(&g, &gather(dy.ptr, 0, items)).unwrap();
        let y: Vec<f32> = g.read(&dy, 0, items * rows).unwrap();
        let mut want = Vec::new();
        for (n, &id) in ids.iter().enumerate() {
            want.extend(matmul(
                &w.expert(id as usize),
                &x[(n / k) * cols..(n / k + 1) * cols],
            ));
        }
        check(
            &format!("linear_gather bits={bits} {items} items"),
            &y,
            &want,
            1e-5,
        );
        let split = 40_000;
        let dy2 = poisoned(&g, items * rows);
        g.k.linear.gather(&g, &gather(dy2.ptr, 0, split)).unwrap();
        g.k.linear
            .gather(&g, &gather(dy2.ptr, split, items - split))
            .unwrap();
        let y2: Vec<f32> = g.read(&dy2, 0, items * rows).unwrap();
        let differ = y
            .iter()
            .zip(&y2)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            differ, 0,
            "linear_gather bits={bits}: looped vs one-pass launches"
        );
    }
}

/// Items grouped by expert on the device (moe_group) and run tile by tile (linear_grouped):
/// some experts get more than one 16-item tile, some none.
#[test]
#[ignore = "needs an NVIDIA GPU"]
fn linear_grouped_matches_cpu_per_expert() {
    let g = gpu();
    let mut rng = Rng(21);
    for bits in [4u32, 8, 16] {
        let (e, rows, cols, t, k) = (7, 36, 128, 25, 2);
        let items = t * k;
        let w = linear(&mut rng, bits, e, rows, cols);
        let dw = upload_linear(&g, "w", &w).unwrap();
        let x = rng.vec(t * cols, 1.0);
        // Skewed routing: expert 3 gets > 16 items, expert 6 none.
        let gr = Grouping::skewed(&g, &mut rng, items, e, GROUP_TILE);
        let dx = g.upload(&x).unwrap();
        let dy = poisoned(&g, items * rows);
        let grouped = Grouped {
            w: &dw,
            groups: gr.groups,
            x: Rows::new(dx.ptr, cols),
            xb: None,
            x_div: k,
            y: Rows::new(dy.ptr, rows),
        };
        g.k.linear.grouped(&g, &grouped).unwrap();
        let y: Vec<f32> = g.read(&dy, 0, items * rows).unwrap();
        let want = gr.want(&w, &x, k, matmul);
        check(
            &format!("linear_grouped bits={bits} ({} tiles)", gr.tiles_made(&g)),
            &y,
            &want,
            1e-5,
        );
    }
}
