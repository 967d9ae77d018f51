//! norm.cu: RMSNorm of rows.

use anyhow::Result;

use super::{config, KernelFile, Rows};
use crate::gpu::{Gpu, Kernel, Module};

pub const FILE: KernelFile = KernelFile {
    name: "norm",
    source: include_str!("../../../../shaders/cuda/norm.cu"),
    defines: &[],
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

pub struct Norm {
    rms_norm: Kernel,
}

impl Norm {
    pub fn load(m: &Module) -> Result<Norm> {
        Ok(Norm {
            rms_norm: m.kernel("rms_norm")?.waits_for_predecessor(),
        })
    }

    /// One block of 256 threads per row.
    pub fn rms_norm(&self, gpu: &Gpu, a: &RmsNorm) -> Result<()> {
        let (x_stride, y_stride) = (a.x.stride as i32, a.y.stride as i32);
        let (cols, rows) = (a.cols as i32, a.rows as i32);
        let cfg = config((a.rows as u32, 1, 1), 256, 0);
        gpu.launch(&self.rms_norm, cfg, |l| {
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
