//! The WGSL kernels (shaders/wgsl/, one entry point per file, named after it), compiled once per
//! device with shaders/wgsl/common.wgsl in front.

use anyhow::{bail, Result};
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
                    // Chosen by the backend among `coop_variants` (each checked at load).
                    linear_q4_mm_coop: None,
                })
            }
        }
    };
}

kernels!(
    linear,
    linear_q4,
    linear_q4_rows,
    linear_q4_mm,
    linear_q4_glu,
    linear_q4_glu_rows,
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
    dn_conv_norm,
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

/// Query heads per KV head where attend_gqa.wgsl takes the model: a power of two ≤ 16 (its
/// blocks of 256 / G keys), head dim a multiple of 4 and ≤ 256 (one invocation a dimension).
pub fn gqa_group(c: &ModelConfig) -> Option<usize> {
    let g = c.n_heads / c.n_kv_heads.max(1);
    (c.n_kv_heads > 0
        && c.n_heads.is_multiple_of(c.n_kv_heads)
        && g.is_power_of_two()
        && g <= 16
        && c.head_dim.is_multiple_of(4)
        && c.head_dim <= 256)
        .then_some(g)
}

/// The `override` constants of kernel `name` for model `c`.
fn constants(name: &str, c: &ModelConfig, stacked: bool) -> Vec<(&'static str, f64)> {
    match name {
        "dn_recur" | "dn_recur_norm" => vec![("DK", c.dn_k_dim as f64)],
        "attend" => vec![("D", c.head_dim as f64)],
        "attend_gqa" => vec![
            ("D", c.head_dim as f64),
            ("G", gqa_group(c).unwrap_or(1) as f64),
        ],
        "moe_down" | "moe_down_rows" => vec![
            ("TOPK", (c.top_k + stacked as usize) as f64),
            ("COLS", c.expert_inter as f64),
        ],
        _ => Vec::new(),
    }
}

/// linear_q4_mm_coop.wgsl as written and in variants, for the backend to check one after the
/// other at load (forward::check_mm) and use the first that computes the right product. On the
/// H200 through Vulkan (driver 580.159.04, wgpu 30.0.2) the kernel as written differed from the
/// host's product by 4.2e-1 (relative L2), while its logic with the cooperative operations
/// emulated is right (tests/coop_emulated.rs). The variants test the suspects:
/// - "one array": the f16 operands in one workgroup array (ws | xh | xl), in case separate f16
///   arrays are not laid out on the 16-byte boundaries cooperative loads need;
/// - "swapped layouts": row- and column-major exchanged in every load and store, in case
///   `coopLoadT` / `coopLoad` reach the driver the other way round;
/// - both together;
/// - those two with the accumulators loaded from zeroed workgroup memory instead of made by the
///   zero constructor (naga emits OpConstantNull of the cooperative-matrix type for it).
///
/// Any that is wrong is refused by the check, so a wrong guess costs only a compile and a check.
/// (A third suspect, the Vulkan memory model naga emits for cooperative matrices without
/// NonPrivatePointer on workgroup accesses, has no variant in WGSL.)
pub fn coop_variants() -> Vec<(&'static str, String)> {
    let src = include_str!("../../../shaders/wgsl/linear_q4_mm_coop.wgsl");
    let one_array = |s: &str| {
        s.replace(
            "var<workgroup> ws: array<f16, 4608>;",
            "var<workgroup> shm: array<f16, 9216>;",
        )
        .replace("var<workgroup> xh: array<f16, 2304>;\n", "")
        .replace("var<workgroup> xl: array<f16, 2304>;\n", "")
        .replace("ws[", "shm[")
        .replace("xh[", "shm[4608u + ")
        .replace("xl[", "shm[6912u + ")
    };
    let swapped = |s: &str| {
        s.replace("coopLoadT<", "COOP_ROW<")
            .replace("coopLoad<", "coopLoadT<")
            .replace("COOP_ROW<", "coopLoad<")
            .replace("coopStore(", "coopStoreT(")
    };
    let zeroed = |s: &str| {
        let mut out = s.to_string();
        for c in ["c00", "c01", "c10", "c11"] {
            out = out.replace(
                &format!("var {c} = coop_mat16x16<f32, C>();"),
                &format!("var {c} = coopLoad<coop_mat16x16<f32, C>>(&cs[0], 64u);"),
            );
        }
        out.replace(
            "    let sg = lid / 32u;\n",
            "    let sg = lid / 32u;\n    for (var i = lid; i < 2048u; i += 64u) {\n        cs[i] = 0.0;\n    }\n    workgroupBarrier();\n",
        )
    };
    vec![
        ("as written", src.to_string()),
        ("one array", one_array(src)),
        ("swapped layouts", swapped(src)),
        ("one array, swapped layouts", swapped(&one_array(src))),
        ("zeroed accumulators, one array", zeroed(&one_array(src))),
        (
            "zeroed accumulators, one array, swapped layouts",
            swapped(&zeroed(&one_array(src))),
        ),
    ]
}

/// Compiles variant `source` of linear_q4_mm_coop.wgsl (`coop_variants`).
pub fn coop_kernel(gpu: &Gpu, source: &str, checked: bool) -> Result<Kernel> {
    Kernel::new(gpu, "linear_q4_mm_coop", COMMON, source, checked, &[])
}

/// linear_q4_mm_coop.wgsl with its cooperative-matrix operations done in plain WGSL (f32
/// throughout; each invocation of a 32-invocation group holds 8 of a 16 × 16 accumulator's
/// elements), for adapters without them (lavapipe in CI): tests its tiling, dequantisation,
/// bias terms, expert tiles and output against the CPU (`WgpuOptions::emulate_coop`). The
/// operations' own semantics (row- and column-major loads and stores, multiply-add) are
/// SPV_KHR_cooperative_matrix's as the emulation reads them; on real hardware they are checked
/// at load (forward::check_mm).
pub fn coop_emulated_source() -> Result<String> {
    let src = include_str!("../../../shaders/wgsl/linear_q4_mm_coop.wgsl");
    let mut out = String::new();
    for line in src.lines() {
        let code = line.split("//").next().unwrap_or("");
        if code.trim_start().starts_with("enable ") {
            continue;
        }
        out += &emulate_line(code)?;
        out.push('\n');
    }
    out += COOP_EMULATION;
    for word in [
        "coop_mat",
        "coopLoad",
        "coopStore",
        "coopMultiplyAdd",
        "<f16",
        "f16>",
    ] {
        if out.contains(word) {
            bail!("linear_q4_mm_coop.wgsl uses {word} in a form the emulation does not rewrite");
        }
    }
    Ok(out)
}

/// The kernel of `coop_emulated_source`, named linear_q4_mm_coop.
pub fn coop_emulated(gpu: &Gpu, checked: bool) -> Result<Kernel> {
    Kernel::new(
        gpu,
        "linear_q4_mm_coop",
        COMMON,
        &coop_emulated_source()?,
        checked,
        &[],
    )
}

/// One line of linear_q4_mm_coop.wgsl for `coop_emulated_source`: a matrix operand becomes its
/// element offset in shared memory, an accumulator 8 f32 per invocation.
fn emulate_line(line: &str) -> Result<String> {
    let l = line
        .trim_end()
        .replace("coop_mat16x16<f32, C>()", "array<f32, 8>()")
        .replace("vec4<f16>", "vec4<f32>")
        .replace("array<f16,", "array<f32,");
    // let NAME = coopLoad<coop_mat16x16<f16, ROLE>>(&ARR[OFF], STRIDE);
    if let Some(i) = l.find("coopLoad") {
        let lhs = &l[..i];
        let rest = &l[i..];
        let arr_at = rest.find("(&").map(|p| p + 2).unwrap_or(0);
        let open = rest[arr_at..].find('[').map(|p| p + arr_at).unwrap_or(0);
        let close = rest.rfind("],").unwrap_or(0);
        let arr = &rest[arr_at..open];
        let off = &rest[open + 1..close];
        // What emu_mma reads: A row-major, B column-major, both with stride WS.
        let layout_ok = if rest.contains("f16, A>") {
            rest.starts_with("coopLoadT<")
        } else {
            rest.starts_with("coopLoad<") && rest.contains("f16, B>")
        };
        if !layout_ok || !rest.ends_with("], WS);") {
            bail!("a cooperative load the emulation does not take: {line}");
        }
        // The array rides in the offset's top bits: 0 ws, 1 xh, 2 xl.
        let tag = match arr {
            "ws" => 0,
            "xh" => 1,
            _ => 2,
        };
        return Ok(format!("{lhs}(({off}) | ({tag}u << 28u));"));
    }
    if let Some(i) = l.find("coopMultiplyAdd(") {
        let args = &l[i + "coopMultiplyAdd(".len()..l.rfind(");").unwrap_or(l.len())];
        return Ok(format!("{}emu_mma({args}, lid);", &l[..i]));
    }
    if let Some(i) = l.find("coopStore(") {
        // coopStore(C, &cs[OFF], 64u): column-major, stride 64, as emu_store writes.
        let rest = &l[i..];
        if !rest.ends_with("], 64u);") || !rest.contains("&cs[") {
            bail!("a cooperative store the emulation does not take: {line}");
        }
        let name = &rest["coopStore(".len()..rest.find(',').unwrap_or(0)];
        let open = rest.find('[').unwrap_or(0);
        let close = rest.rfind("],").unwrap_or(0);
        return Ok(format!(
            "{}emu_store({name}, {}, lid);",
            &l[..i],
            &rest[open + 1..close]
        ));
    }
    Ok(l)
}

const COOP_EMULATION: &str = r#"
fn emu_at(tagged: u32, i: u32) -> f32 {
    let tag = tagged >> 28u;
    let o = (tagged & 0x0fffffffu) + i;
    if (tag == 0u) {
        return ws[o];
    }
    if (tag == 1u) {
        return xh[o];
    }
    return xl[o];
}

// c += a · b for the 8 elements (i, j) = divmod((lid % 32) · 8 + e, 16) this invocation holds:
// a row-major (element (i, k) at a + i·WS + k), b column-major (element (k, j) at b + j·WS + k).
fn emu_mma(a: u32, b: u32, c: array<f32, 8>, lid: u32) -> array<f32, 8> {
    var r = c;
    for (var e = 0u; e < 8u; e++) {
        let idx = (lid % 32u) * 8u + e;
        let i = idx / 16u;
        let j = idx % 16u;
        var s = 0.0;
        for (var k = 0u; k < 16u; k++) {
            s += emu_at(a, i * WS + k) * emu_at(b, j * WS + k);
        }
        r[e] += s;
    }
    return r;
}

// Column-major with stride 64: element (i, j) at cs[base + i + 64·j].
fn emu_store(c: array<f32, 8>, base: u32, lid: u32) {
    for (var e = 0u; e < 8u; e++) {
        let idx = (lid % 32u) * 8u + e;
        cs[base + idx / 16u + 64u * (idx % 16u)] = c[e];
    }
}
"#;

#[cfg(test)]
mod tests {
    use super::*;
    use wgpu::naga;

    /// Every variant of linear_q4_mm_coop.wgsl, with the shared helpers as the loader joins them,
    /// parses and validates in naga with cooperative matrices and f16 allowed (no GPU needed:
    /// the variants only compile on adapters that have cooperative matrices).
    #[test]
    fn coop_variants_validate() {
        let variants = coop_variants();
        assert_eq!(variants.len(), 6);
        // Each rewrite took effect.
        assert!(variants[1].1.contains("shm[4608u + ") && !variants[1].1.contains("xh["));
        assert!(
            variants[2].1.contains("coopStoreT(")
                && variants[2].1.contains("coopLoad<coop_mat16x16<f16, A>>")
        );
        assert!(variants[3].1.contains("shm[6912u + ") && variants[3].1.contains("coopStoreT("));
        for v in &variants[4..] {
            assert!(v.1.contains("cs[i] = 0.0;") && !v.1.contains("coop_mat16x16<f32, C>()"));
        }
        for (name, source) in variants {
            let (enables, body): (Vec<&str>, Vec<&str>) = source
                .lines()
                .partition(|l| l.trim_start().starts_with("enable "));
            let code = format!("{}\n{COMMON}\n{}", enables.join("\n"), body.join("\n"));
            let module = naga::front::wgsl::parse_str(&code)
                .unwrap_or_else(|e| panic!("{name}: {}", e.emit_to_string(&code)));
            naga::valid::Validator::new(
                naga::valid::ValidationFlags::all(),
                naga::valid::Capabilities::all(),
            )
            .validate(&module)
            .unwrap_or_else(|e| panic!("{name}: {e:?}"));
        }
    }
}
