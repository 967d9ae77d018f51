//! moe.cu: the MoE block's device-side glue (MODEL.md §2.6): top-k routing, grouping routed
//! items by expert, SiLU·up, and the weighted combine with the shared expert into the residual.

use anyhow::{bail, Result};
use lily_core::config::ModelConfig;

use super::linear::GROUP_TILE;
use super::{blocks, config, ExpertGroups, KernelFile};
use crate::gpu::{Gpu, Kernel, Module};

/// Most experts the router and the grouping take (shared-memory tables).
pub const MOE_MAX_E: usize = 1024;
/// Most experts per token: moe_route is one warp per token.
pub const MOE_MAX_TOP_K: usize = 32;
/// Most items per tile moe_group builds (gemm_grouped_wgb128).
pub const MOE_MAX_TILE: usize = 128;

pub const FILE: KernelFile = KernelFile {
    name: "moe",
    source: include_str!("../../../../shaders/cuda/moe.cu"),
    defines: &[("MOE_MAX_E", MOE_MAX_E as i64)],
};

/// The model's expert count and top-k against the router's limits.
pub fn check_limits(cfg: &ModelConfig) -> Result<()> {
    if cfg.n_experts > MOE_MAX_E || cfg.top_k > MOE_MAX_TOP_K {
        bail!(
            "{} experts / top {} exceed the CUDA router's limits ({MOE_MAX_E} / {MOE_MAX_TOP_K})",
            cfg.n_experts,
            cfg.top_k
        );
    }
    Ok(())
}

/// Upper bound of the tiles moe_group can produce for `n_items` items over `n_experts`.
pub fn max_group_tiles(n_items: usize, n_experts: usize) -> usize {
    group_tiles_bound(n_items, n_experts, GROUP_TILE)
}

/// Upper bound of the tiles of `tile` items moe_group makes for `n_items` items over `n_experts`
/// (with or without a remainder list): each expert's ⌈count / tile⌉ ≤ count / tile + 1.
pub fn group_tiles_bound(n_items: usize, n_experts: usize, tile: usize) -> usize {
    n_items.div_ceil(tile) + n_experts.min(n_items)
}

/// The experts and top-k of one model (the MoE path depends on them).
#[derive(Clone, Copy, Debug)]
pub struct MoeShape {
    pub n_experts: usize,
    pub top_k: usize,
}

impl MoeShape {
    pub fn of(cfg: &ModelConfig) -> MoeShape {
        MoeShape {
            n_experts: cfg.n_experts,
            top_k: cfg.top_k,
        }
    }
}

/// Top-k of softmax(logits) per token: expert `ids` [T, k] i32 and normalised `weights` [T, k].
pub struct Route {
    pub logits: u64,
    pub ids: u64,
    pub weights: u64,
    pub n_tok: usize,
    pub shape: MoeShape,
}

/// Groups `n_items` routed items (expert `ids` [n_items]) by expert into `into`'s tiles.
pub struct Group {
    pub ids: u64,
    pub n_items: usize,
    pub n_experts: usize,
    pub into: ExpertGroups,
}

/// h = act(silu(g)) · u elementwise over `n` values.
pub struct SiluMul {
    pub g: u64,
    pub u: u64,
    pub h: u64,
    pub n: usize,
}

/// x += Σ_k weights[t, k] · y_experts[t, k, :] + sigmoid(shared_gate[t]) · y_shared[t, :].
pub struct Combine {
    pub x: u64,
    pub y_experts: u64,
    pub weights: u64,
    pub y_shared: u64,
    pub shared_gate: u64,
    pub n_tok: usize,
    pub hidden: usize,
    pub top_k: usize,
}

pub struct Moe {
    route: Kernel,
    group: Kernel,
    silu_mul: Kernel,
    combine: Kernel,
}

impl Moe {
    pub fn load(m: &Module) -> Result<Moe> {
        Ok(Moe {
            route: m.kernel("moe_route")?,
            group: m.kernel("moe_group")?,
            silu_mul: m.kernel("silu_mul")?,
            combine: m.kernel("moe_combine")?,
        })
    }

    /// One warp per token.
    pub fn route(&self, gpu: &Gpu, a: &Route) -> Result<()> {
        let (n_tok, n_experts, top_k) = (
            a.n_tok as i32,
            a.shape.n_experts as i32,
            a.shape.top_k as i32,
        );
        let cfg = config((a.n_tok as u32, 1, 1), 32, 0);
        gpu.launch(&self.route, cfg, |l| {
            l.arg(&a.logits)
                .arg(&a.ids)
                .arg(&a.weights)
                .arg(&n_tok)
                .arg(&n_experts)
                .arg(&top_k);
        })
    }

    /// One block of 1024 threads builds every tile (GROUP_TILE..=MOE_MAX_TILE items each), and
    /// with `into.tail` > 0 the list of each expert's last ≤ tail items.
    pub fn group(&self, gpu: &Gpu, a: &Group) -> Result<()> {
        let g = a.into;
        if !(GROUP_TILE..=MOE_MAX_TILE).contains(&g.tile) {
            bail!(
                "moe_group: tiles of {} items (expected {GROUP_TILE}..={MOE_MAX_TILE})",
                g.tile
            );
        }
        if g.tail >= g.tile || (g.tail > 0 && g.tail_tiles == 0) {
            bail!(
                "moe_group: remainders of {} items beside tiles of {} (expected fewer, and their list)",
                g.tail,
                g.tile
            );
        }
        let (n_items, n_experts, tile) = (a.n_items as i32, a.n_experts as i32, g.tile as i32);
        let tail = g.tail as i32;
        gpu.launch(&self.group, config((1, 1, 1), 1024, 0), |l| {
            l.arg(&a.ids)
                .arg(&n_items)
                .arg(&n_experts)
                .arg(&tile)
                .arg(&g.perm)
                .arg(&g.tiles)
                .arg(&g.n_tiles)
                .arg(&tail)
                .arg(&g.tail_tiles);
        })
    }

    pub fn silu_mul(&self, gpu: &Gpu, a: &SiluMul) -> Result<()> {
        let n = a.n as i64;
        let cfg = config((blocks(a.n, 256), 1, 1), 256, 0);
        gpu.launch(&self.silu_mul, cfg, |l| {
            l.arg(&a.g).arg(&a.u).arg(&a.h).arg(&n);
        })
    }

    /// The weighted sum of the routed experts and the gated shared expert, added to the residual.
    pub fn combine_into_residual(&self, gpu: &Gpu, a: &Combine) -> Result<()> {
        let (n_tok, hidden, top_k) = (a.n_tok as i32, a.hidden as i32, a.top_k as i32);
        let cfg = config((blocks(a.n_tok * a.hidden, 256), 1, 1), 256, 0);
        gpu.launch(&self.combine, cfg, |l| {
            l.arg(&a.x)
                .arg(&a.y_experts)
                .arg(&a.weights)
                .arg(&a.y_shared)
                .arg(&a.shared_gate)
                .arg(&n_tok)
                .arg(&hidden)
                .arg(&top_k);
        })
    }
}
