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
