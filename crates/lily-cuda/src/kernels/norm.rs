//! norm.cu: RMSNorm of rows.

use anyhow::{bail, Result};

use super::{config, KernelFile, Rows};
use crate::gpu::{Gpu, Kernel, Module};

pub const FILE: KernelFile = KernelFile {
    name: "norm",
    source: include_str!("../../../../shaders/cuda/norm.cu"),
    defines: &[
        ("RMS_ROWS_THREADS", RMS_ROWS_THREADS as i64),
        ("RMS_ROWS_REG", RMS_ROWS_REG as i64),
    ],
};

/// y[r, :] = x[r, :] / rms(x[r, :]) · weight for r < rows (MODEL.md §2.2).
pub struct RmsNorm {
    pub x: Rows,
    /// f32 [cols].
    pub weight: u64,
    pub y: Rows,
    pub cols: usize,
    pub eps: f32,
    pub rows: usize,
}

/// Threads of an `rms_norm_rows` block (one block a row, as `rms_norm`'s 256; norm.cu's
/// RMS_ROWS_THREADS, defined from here).
pub const RMS_ROWS_THREADS: usize = 256;
/// Columns an `rms_norm_rows` thread holds in registers (norm.cu's RMS_ROWS_REG, defined from here): the widest
/// row it takes is RMS_ROWS_THREADS · RMS_ROWS_REG columns.
pub const RMS_ROWS_REG: usize = 16;

/// Whether `rms_norm_rows` takes rows of `cols` columns (`batch_lean_glue`).
pub fn rms_rows_serves(cols: usize) -> bool {
    cols > 0 && cols <= RMS_ROWS_THREADS * RMS_ROWS_REG
}

pub struct Norm {
    rms_norm: Kernel,
    rms_norm_rows: Kernel,
}

impl Norm {
    pub fn load(m: &Module) -> Result<Norm> {
        Ok(Norm {
            rms_norm: m.kernel("rms_norm")?.waits_for_predecessor(),
            rms_norm_rows: m.kernel("rms_norm_rows")?.waits_for_predecessor(),
        })
    }

    /// One block of 256 threads per row.
    pub fn rms_norm(&self, gpu: &Gpu, a: &RmsNorm) -> Result<()> {
        self.launch(gpu, &self.rms_norm, a)
    }

    /// `rms_norm`'s outputs bit for bit in `rms_norm_rows` (`batch_lean_glue`): each thread's
    /// columns held in registers, loaded in one round trip, the weights before the dependency
    /// wait. Rows of at most RMS_ROWS_THREADS · RMS_ROWS_REG columns (`rms_rows_serves`).
    pub fn rms_norm_rows(&self, gpu: &Gpu, a: &RmsNorm) -> Result<()> {
        if !rms_rows_serves(a.cols) {
            bail!(
                "rms_norm_rows: {} columns (1..={})",
                a.cols,
                RMS_ROWS_THREADS * RMS_ROWS_REG
            );
        }
        self.launch(gpu, &self.rms_norm_rows, a)
    }

    fn launch(&self, gpu: &Gpu, kernel: &Kernel, a: &RmsNorm) -> Result<()> {
        let (x_stride, y_stride) = (a.x.stride as i32, a.y.stride as i32);
        let (cols, rows) = (a.cols as i32, a.rows as i32);
        let cfg = config((a.rows as u32, 1, 1), RMS_ROWS_THREADS as u32, 0);
        gpu.launch(kernel, cfg, |l| {
            l.arg(&a.x.ptr)
                .arg(&x_stride)
                .arg(&a.weight)
                .arg(&a.y.ptr)
                .arg(&y_stride)
                .arg(&cols)
                .arg(&a.eps)
                .arg(&rows);
        })
    }
}
