//! The WGSL kernels (shaders/wgsl/, one entry point per file, named after it), compiled once per
//! device with shaders/wgsl/common.wgsl in front.

use anyhow::Result;
use lily_core::config::ModelConfig;

use crate::gpu::{Gpu, Kernel};

const COMMON: &str = include_str!("../../../shaders/wgsl/common.wgsl");

macro_rules! kernels {
    ($($name:ident),* $(,)?) => {
        pub struct Kernels {
            $(pub $name: Kernel,)*
            /// linear_q4_mm.wgsl on cooperative matrices, where the device has them
            /// (`Gpu::coop`) and its check at load passed (backend.rs).
            pub linear_q4_mm_coop: Option<Kernel>,
        }

        impl Kernels {
            /// `checked`: keep runtime bounds checks ($LILY_WGPU_CHECKED=1; for debugging).
            /// `c`: the model, whose shapes some kernels take as `override` constants;
            /// `stacked`: whether the shared expert rides in the routed stacks
            /// (weights::stack_shared), so that each token has top_k + 1 expert items.
            pub fn load(gpu: &Gpu, c: &ModelConfig, stacked: bool, checked: bool) -> Result<Kernels> {
                Ok(Kernels {
                    $($name: Kernel::new(
                        gpu,
                        stringify!($name),
                        COMMON,
                        include_str!(concat!("../../../shaders/wgsl/", stringify!($name), ".wgsl")),
                        checked,
                        &constants(stringify!($name), c, stacked),
                    )?,)*
                    // An experimental feature of wgpu: where it does not compile, the
                    // products stay on linear_q4_mm.
                    linear_q4_mm_coop: if gpu.coop {
                        Kernel::new(
                            gpu,
                            "linear_q4_mm_coop",
                            COMMON,
                            include_str!("../../../shaders/wgsl/linear_q4_mm_coop.wgsl"),
                            checked,
                            &[],
                        )
                        .map_err(|e| tracing::warn!("wgpu: linear_q4_mm_coop not used: {e:#}"))
                        .ok()
                    } else {
                        None
                    },
                })
            }
        }
    };
}

kernels!(
    linear,
    linear_q4,
    linear_q4_mm,
    linear_q4_glu,
    moe_group,
    embed,
    rms_norm,
    gated_norm,
    attn_prep,
    attend,
    attend_merge,
    dn_conv,
    dn_qk_norm,
    dn_recur,
    dn_conv_norm,
    dn_recur_norm,
    moe_route,
    swiglu,
    moe_combine,
    moe_down,
    argmax_part,
    argmax_final,
    sample_adjust,
    sample_prefilter,
    sample_pick,
);

/// The `override` constants of kernel `name` for model `c`.
fn constants(name: &str, c: &ModelConfig, stacked: bool) -> Vec<(&'static str, f64)> {
    match name {
        "dn_recur" | "dn_recur_norm" => vec![("DK", c.dn_k_dim as f64)],
        "attend" => vec![("D", c.head_dim as f64)],
        "moe_down" => vec![
            ("TOPK", (c.top_k + stacked as usize) as f64),
            ("COLS", c.expert_inter as f64),
        ],
        _ => Vec::new(),
    }
}
