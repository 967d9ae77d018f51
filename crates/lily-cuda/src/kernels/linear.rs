//! linear.cu: linears on CUDA cores straight from the packed weights (decode, fp32 mode, the
//! router's exact logits, the routed experts gathered or grouped).

use anyhow::Result;

use super::{blocks, check_x, config, Grouped, KernelFile, Project, Rows, Store};
use crate::gpu::{Gpu, Kernel, Module};
use crate::weights::DevLinear;

/// Warps per block; each warp computes one output row.
pub const LINEAR_WARPS: usize = 4;
/// Tokens `linear` reuses each dequantised weight word for (decode: less idle work).
pub const LINEAR_TOK: usize = 4;
/// Tokens `linear_wide` reuses each dequantised weight word for (prefill); also the fewest
/// tokens of a step that take it.
pub const LINEAR_WIDE_TOK: usize = 16;
/// Most items per tile of linear_grouped (the tile moe_group is given for it).
pub const GROUP_TILE: usize = 16;

pub const FILE: KernelFile = KernelFile {
    name: "linear",
    source: include_str!("../../../../shaders/cuda/linear.cu"),
    defines: &[
        ("LINEAR_WARPS", LINEAR_WARPS as i64),
        ("GROUP_TILE", GROUP_TILE as i64),
    ],
};

/// y[n, :] = W_{ids[n]} x[n / x_div, :] for n < n_items: one expert per item (MoE decode).
pub struct Gather<'a> {
    pub w: &'a DevLinear,
    /// i32 [n_items] expert ids.
    pub ids: u64,
    pub x: Rows,
    pub x_div: usize,
    pub y: Rows,
    pub n_items: usize,
}

pub struct Linear {
    linear: Kernel,
    linear_wide: Kernel,
    linear_gather: Kernel,
    linear_grouped: Kernel,
}

/// linear_rows' store modes (linear.cu).
const MODE_ROUND: i32 = 0;
const MODE_ACCUMULATE: i32 = 1;
const MODE_EXACT: i32 = 2;

impl Linear {
    pub fn load(m: &Module) -> Result<Linear> {
        Ok(Linear {
            linear: m.kernel("linear")?,
            linear_wide: m.kernel("linear_wide")?,
            linear_gather: m.kernel("linear_gather")?,
            linear_grouped: m.kernel("linear_grouped")?,
        })
    }

    /// y (+)= W x, rounded to the activation type.
    pub fn project(&self, gpu: &Gpu, a: &Project, store: Store) -> Result<()> {
        check_x("linear", a.x)?;
        let mode = match store {
            Store::Overwrite => MODE_ROUND,
            Store::AddToResidual => MODE_ACCUMULATE,
        };
        self.rows(gpu, a, mode)
    }

    /// y = W x in fp32, not rounded to bf16 on the way in or out (the MoE router's logits).
    pub fn project_exact(&self, gpu: &Gpu, a: &Project) -> Result<()> {
        check_x("linear_router", a.x)?;
        self.rows(gpu, a, MODE_EXACT)
    }

    /// linear (4 tokens per weight word) or, from LINEAR_WIDE_TOK tokens on, linear_wide (16).
    fn rows(&self, gpu: &Gpu, a: &Project, mode: i32) -> Result<()> {
        let (kernel, tok) = if a.n_tok >= LINEAR_WIDE_TOK {
            (&self.linear_wide, LINEAR_WIDE_TOK)
        } else {
            (&self.linear, LINEAR_TOK)
        };
        let w = a.w.arg();
        let (x_stride, y_stride, n_tok) = (a.x.stride as i32, a.y.stride as i32, a.n_tok as i32);
        let grid = (blocks(a.w.rows, LINEAR_WARPS), blocks(a.n_tok, tok), 1);
        let cfg = config(grid, (LINEAR_WARPS * 32) as u32, 0);
        gpu.launch(kernel, cfg, |l| {
            l.arg(&w)
                .arg(&a.x.ptr)
                .arg(&x_stride)
                .arg(&a.y.ptr)
                .arg(&y_stride)
                .arg(&n_tok)
                .arg(&mode);
        })
    }

    /// One block row per 4 output rows, one grid column per item (each grid column every
    /// GRID_Y_MAX-th item past GRID_Y_MAX).
    pub fn gather(&self, gpu: &Gpu, a: &Gather) -> Result<()> {
        check_x("linear_gather", a.x)?;
        let w = a.w.arg();
        let (x_stride, x_div) = (a.x.stride as i32, a.x_div as i32);
        let (y_stride, n_items) = (a.y.stride as i32, a.n_items as i32);
        // Past GRID_Y_MAX items (a chunk of more than 65,535 / top_k tokens) the kernel loops.
        let grid = (
            blocks(a.w.rows, LINEAR_WARPS),
            a.n_items.min(super::GRID_Y_MAX) as u32,
            1,
        );
        let cfg = config(grid, (LINEAR_WARPS * 32) as u32, 0);
        gpu.launch(&self.linear_gather, cfg, |l| {
            l.arg(&w)
                .arg(&a.ids)
                .arg(&a.x.ptr)
                .arg(&x_stride)
                .arg(&x_div)
                .arg(&a.y.ptr)
                .arg(&y_stride)
                .arg(&n_items);
        })
    }

    /// The routed experts over tiles of up to GROUP_TILE items: each expert's weights are read
    /// once per tile instead of once per item.
    pub fn grouped(&self, gpu: &Gpu, a: &Grouped) -> Result<()> {
        check_x("linear_grouped", a.x)?;
        let g = a.groups;
        let w = a.w.arg();
        let (x_stride, x_div, y_stride) = (a.x.stride as i32, a.x_div as i32, a.y.stride as i32);
        let grid = (blocks(a.w.rows, LINEAR_WARPS), g.max_tiles as u32, 1);
        let cfg = config(grid, (LINEAR_WARPS * 32) as u32, 0);
        gpu.launch(&self.linear_grouped, cfg, |l| {
            l.arg(&w)
                .arg(&g.perm)
                .arg(&g.tiles)
                .arg(&g.n_tiles)
                .arg(&a.x.ptr)
                .arg(&x_stride)
                .arg(&x_div)
                .arg(&a.y.ptr)
                .arg(&y_stride);
        })
    }
}
