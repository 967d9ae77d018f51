//! The WGSL kernels (shaders/wgsl/, one entry point per file, named after it), compiled once per
//! device with shaders/wgsl/common.wgsl in front.

use anyhow::Result;

use crate::gpu::{Gpu, Kernel};

const COMMON: &str = include_str!("../../../shaders/wgsl/common.wgsl");

macro_rules! kernels {
    ($($name:ident),* $(,)?) => {
        pub struct Kernels {
            $(pub $name: Kernel,)*
        }

        impl Kernels {
            /// `checked`: keep runtime bounds checks ($LILY_WGPU_CHECKED=1; for debugging).
            pub fn load(gpu: &Gpu, checked: bool) -> Result<Kernels> {
                Ok(Kernels {
                    $($name: Kernel::new(
                        gpu,
                        stringify!($name),
                        COMMON,
                        include_str!(concat!("../../../shaders/wgsl/", stringify!($name), ".wgsl")),
                        checked,
                    )?,)*
                })
            }
        }
    };
}

kernels!(
    linear,
    linear_q4,
    embed,
    rms_norm,
    gated_norm,
    attn_prep,
    attend,
    attend_merge,
    dn_conv,
    dn_qk_norm,
    dn_recur,
    moe_route,
    swiglu,
    moe_combine,
    argmax,
);
