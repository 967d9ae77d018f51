//! norm.cu: RMSNorm.

use crate::common::*;

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn rms_norm_matches_cpu() {
    let g = gpu();
    let mut rng = Rng(4);
    let (rows, cols) = (5, 300);
    let x = rng.vec(rows * cols, 2.0);
    let w = rng.vec(cols, 1.0);
    let (dx, dw) = (g.upload(&x).unwrap(), g.upload(&w).unwrap());
    let dy = poisoned(&g, rows * cols);
    g.rms_norm(dx.ptr, dw.ptr, dy.ptr, cols, rows);
    let y: Vec<f32> = g.read(&dy, 0, rows * cols).unwrap();
    check("rms_norm", &y, &ops::rms_norm(&x, &w, 1e-6), 1e-5);
}
