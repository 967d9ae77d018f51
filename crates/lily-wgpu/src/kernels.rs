//! The compiled kernels: one pipeline per `Spec` of the plan (plan.rs `Specs`), compiled once
//! per device; the matrix products one per form (`Forms`).

use anyhow::Result;

use crate::gpu::{Gpu, Kernel};
use crate::plan::{FormSpecs, MmTile, Specs};
use crate::shaders::Form;

/// A matrix product kernel in each form the plan compiled (`plan::FormSpecs`): one where
/// activations are f32, else one per form its launch sites take.
pub struct Forms(Vec<(Form, Kernel)>);

impl Forms {
    fn load(gpu: &Gpu, specs: &FormSpecs, checked: bool) -> Result<Forms> {
        let mut v = Vec::new();
        for s in specs {
            v.push((s.form, Kernel::new(gpu, s, checked)?));
        }
        Ok(Forms(v))
    }

    /// Each form compiled, with its kernel.
    pub fn iter(&self) -> impl Iterator<Item = (Form, &Kernel)> {
        self.0.iter().map(|(f, k)| (*f, k))
    }

    /// The kernel in `form` (`Plan::form`: the one form where activations are f32).
    pub fn get(&self, form: Form) -> &Kernel {
        &self
            .0
            .iter()
            .find(|(f, _)| *f == form)
            .expect("the plan compiles each product in every form its launch sites take")
            .1
    }
}

macro_rules! kernels {
    (forms: $($form:ident),*; $($name:ident),* $(,)?) => {
        pub struct Kernels {
            $(pub $form: Forms,)*
            $(pub $name: Kernel,)*
            /// Where the plan's prefill attention is attend_tile.wgsl.
            pub attend_tile: Option<Kernel>,
            /// Where the plan takes `router_lean` (`Specs::linear_q4_rows1`).
            pub linear_q4_rows1: Option<Forms>,
            /// Where the plan's tiles are f16 and 64 items fit (`Specs::linear_q4_mm64`).
            pub linear_q4_mm64: Option<Forms>,
            /// The routed experts' tile products where the plan splits them off
            /// (`Specs::experts_coop`: 16, 32, 64 items).
            pub experts_coop: Option<[Forms; 3]>,
        }

        impl Kernels {
            /// Every kernel of `specs`; `checked`: keep runtime bounds checks
            /// ($LILY_WGPU_CHECKED=1; for debugging).
            pub fn load(gpu: &Gpu, specs: &Specs, checked: bool) -> Result<Kernels> {
                Ok(Kernels {
                    $($form: Forms::load(gpu, &specs.$form, checked)?,)*
                    $($name: Kernel::new(gpu, &specs.$name, checked)?,)*
                    attend_tile: match &specs.attend_tile {
                        Some(s) => Some(Kernel::new(gpu, s, checked)?),
                        None => None,
                    },
                    linear_q4_rows1: match &specs.linear_q4_rows1 {
                        Some(s) => Some(Forms::load(gpu, s, checked)?),
                        None => None,
                    },
                    linear_q4_mm64: match &specs.linear_q4_mm64 {
                        Some(s) => Some(Forms::load(gpu, s, checked)?),
                        None => None,
                    },
                    experts_coop: match &specs.experts_coop {
                        Some([a, b, c]) => Some([
                            Forms::load(gpu, a, checked)?,
                            Forms::load(gpu, b, checked)?,
                            Forms::load(gpu, c, checked)?,
                        ]),
                        None => None,
                    },
                })
            }
        }
    };
}

kernels!(
    forms: linear,
    linear_q4,
    linear_q4_mm16,
    linear_q4_mm32,
    linear_q4_rows16,
    linear_q4_rows8,
    linear_q4_rows4,
    linear_q4_rows2,
    linear_q4_glu_rows;
    linear_q4_glu,
    moe_group,
    embed,
    rms_norm,
    gated_norm,
    attn_prep,
    attend,
    attend_gqa,
    attend_merge,
    dn_conv,
    dn_qk_norm,
    dn_recur,
    dn_conv_step,
    dn_recur_norm,
    moe_route,
    swiglu,
    moe_combine,
    moe_down,
    moe_down_rows,
    argmax_part,
    argmax_final,
    sample_adjust,
    sample_prefilter,
    sample_pick,
);

impl Kernels {
    /// linear_q4_mm.wgsl with tiles of `tile`, where compiled.
    pub fn mm_if(&self, tile: MmTile) -> Option<&Forms> {
        match tile {
            MmTile::T16 => Some(&self.linear_q4_mm16),
            MmTile::T32 => Some(&self.linear_q4_mm32),
            MmTile::T64 => self.linear_q4_mm64.as_ref(),
        }
    }

    /// linear_q4_mm.wgsl with tiles of `tile`: one the plan chose (`Plan::dense_mm`,
    /// `Plan::expert_tiles`), so compiled — tiles of 64 are chosen only where
    /// `Specs::linear_q4_mm64` exists, and `load` compiles every spec.
    pub fn mm(&self, tile: MmTile) -> &Forms {
        self.mm_if(tile)
            .expect("the plan chooses linear_q4_mm tiles of 64 only where it compiled them")
    }

    /// The routed experts' grouped tile product with tiles of `tile`: `Specs::experts_coop`'s
    /// where the plan splits them off (64 rows while the dense products take 128), else `mm`'s.
    pub fn experts_mm(&self, tile: MmTile) -> &Forms {
        match (&self.experts_coop, tile) {
            (Some([k16, _, _]), MmTile::T16) => k16,
            (Some([_, k32, _]), MmTile::T32) => k32,
            (Some([_, _, k64]), MmTile::T64) => k64,
            (None, _) => self.mm(tile),
        }
    }

    /// Every tile product compiled (the dense ones, then the routed experts' where split off):
    /// what the load check runs.
    pub fn products(&self) -> Vec<(MmTile, &Forms)> {
        let tiles = [MmTile::T16, MmTile::T32, MmTile::T64];
        let mut v: Vec<(MmTile, &Forms)> = tiles
            .into_iter()
            .filter_map(|t| self.mm_if(t).map(|f| (t, f)))
            .collect();
        if let Some(ex) = &self.experts_coop {
            v.extend(tiles.into_iter().zip(ex));
        }
        v
    }

    /// linear_q4_rows.wgsl with `rb` rows a workgroup (`Plan::rows_rb`: 16, 8, 4 or 2; 1 with
    /// `router_lean`, the only plan that compiles it).
    pub fn rows(&self, rb: usize) -> &Forms {
        self.rows_if(rb).expect(
            "the plan gives a matrix one row a workgroup only where it compiled that kernel",
        )
    }

    /// `rows`, None for the 1-row kernel where not compiled (the probes' loop over every kernel).
    pub fn rows_if(&self, rb: usize) -> Option<&Forms> {
        match rb {
            16 => Some(&self.linear_q4_rows16),
            8 => Some(&self.linear_q4_rows8),
            4 => Some(&self.linear_q4_rows4),
            1 => self.linear_q4_rows1.as_ref(),
            _ => Some(&self.linear_q4_rows2),
        }
    }
}
