//! The WGSL kernels (shaders/wgsl/, one entry point per file, named after it), compiled once per
//! device with shaders/wgsl/common.wgsl in front.

use anyhow::{bail, Result};
use lily_core::config::ModelConfig;

use crate::gpu::{Gpu, Kernel};

pub(crate) const COMMON: &str = include_str!("../../../shaders/wgsl/common.wgsl");

macro_rules! kernels {
    ($($name:ident),* $(,)?) => {
        pub struct Kernels {
            $(pub $name: Kernel,)*
            /// linear_q4_mm.wgsl on cooperative matrices, where the device has them
            /// (`Gpu::coop`) and its check at load passed (backend.rs).
            pub linear_q4_mm_coop: Option<Kernel>,
            /// attend_tile.wgsl (prefill attention over tiles of tokens), where the backend
            /// was asked for it ($LILY_WGPU_ATTN_TILE=1), the model's shapes allow it
            /// (`tile_group`) and its check at load passed (backend.rs).
            pub attend_tile: Option<Kernel>,
            /// The routed experts' tiled products where they run on another kernel than the
            /// plain ones (`WgpuOptions::mm_t32` = Dense: linear_q4_mm.wgsl, the plain ones on
            /// linear_q4_mm_t32.wgsl); None: `linear_q4_mm`.
            pub linear_q4_mm_expert: Option<Kernel>,
            /// linear_q4_rows.wgsl with 4 and 2 rows a workgroup (its `RB`; the model's
            /// `linear_q4_rows` has 16), for matrices of few rows (forward.rs `rows_rb`).
            pub linear_q4_rows4: Kernel,
            pub linear_q4_rows2: Kernel,
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
                    attend_tile: None,
                    linear_q4_mm_expert: None,
                    linear_q4_rows4: rows_kernel(gpu, 4, checked)?,
                    linear_q4_rows2: rows_kernel(gpu, 2, checked)?,
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

/// linear_q4_rows.wgsl with `rb` rows a workgroup (≤ 8: all their reads in flight together).
fn rows_kernel(gpu: &Gpu, rb: u32, checked: bool) -> Result<Kernel> {
    Kernel::new(
        gpu,
        "linear_q4_rows",
        COMMON,
        include_str!("../../../shaders/wgsl/linear_q4_rows.wgsl"),
        checked,
        &[("RB", rb as f64), ("RI", rb.min(8) as f64)],
    )
}

/// Query heads per KV head where attend_gqa.wgsl takes the model: a power of two ≤ 8 (its
/// blocks of 256 / G keys, its score partials in shared memory), head dim a multiple of 4 and ≤ 256 (one invocation a dimension).
pub fn gqa_group(c: &ModelConfig) -> Option<usize> {
    let g = c.n_heads / c.n_kv_heads.max(1);
    (c.n_kv_heads > 0
        && c.n_heads.is_multiple_of(c.n_kv_heads)
        && g.is_power_of_two()
        && g <= 8
        && c.head_dim.is_multiple_of(4)
        && c.head_dim <= 256)
        .then_some(g)
}

/// Query heads per KV head where attend_tile.wgsl takes the model: attend_gqa.wgsl's
/// (`gqa_group`) with a head dim that is a multiple of 64 (its chunks of dimensions).
pub fn tile_group(c: &ModelConfig) -> Option<usize> {
    gqa_group(c).filter(|_| c.head_dim.is_multiple_of(64))
}

/// attend_tile.wgsl compiled for head dim `d` (a multiple of 64, ≤ 256) and `g` query heads per
/// KV head (a power of two ≤ 8): 64 / g tokens a workgroup.
pub fn attend_tile_for(gpu: &Gpu, d: usize, g: usize, checked: bool) -> Result<Kernel> {
    if !d.is_multiple_of(64) || d > 256 || !g.is_power_of_two() || g > 8 {
        bail!("attend_tile takes head dims of a multiple of 64 up to 256 and 1, 2, 4 or 8 query heads a KV head (not {d}, {g})");
    }
    Kernel::new(
        gpu,
        "attend_tile",
        COMMON,
        include_str!("../../../shaders/wgsl/attend_tile.wgsl"),
        checked,
        &[("D", d as f64), ("G", g as f64)],
    )
}

/// attend_gqa.wgsl compiled for head dim `d` and `g` query heads per KV head (the model's own
/// instance takes them from its config): for checking the kernel at shapes the test models lack
/// (forward::check_attention).
pub fn attend_gqa_for(gpu: &Gpu, d: usize, g: usize, checked: bool) -> Result<Kernel> {
    Kernel::new(
        gpu,
        "attend_gqa",
        COMMON,
        include_str!("../../../shaders/wgsl/attend_gqa.wgsl"),
        checked,
        &[("D", d as f64), ("G", g as f64)],
    )
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
        "linear_q4_glu_rows" => vec![("RB", crate::forward::GLU_RB as f64)],
        "moe_down" => vec![
            ("TOPK", (c.top_k + stacked as usize) as f64),
            ("COLS", c.expert_inter as f64),
        ],
        "moe_down_rows" => vec![
            ("TOPK", (c.top_k + stacked as usize) as f64),
            ("COLS", c.expert_inter as f64),
            ("RB", crate::forward::DOWN_RB as f64),
        ],
        _ => Vec::new(),
    }
}

/// One variant of linear_q4_mm_coop.wgsl for the backend to try at load (`coop_variants`).
pub struct CoopVariant {
    pub name: &'static str,
    pub source: String,
    /// Through naga's SPIR-V with its workgroup accesses marked non-private (`mark_nonprivate`),
    /// where the device takes SPIR-V as is.
    pub nonprivate: bool,
    /// Whether the backend may use it where its check passes (false: a diagnostic only, run
    /// under $LILY_WGPU_COOP_DIAG=1, e.g. one that drops the input's remainder part).
    pub usable: bool,
}

/// `src` with the lines between `// <name>` and `// </name>` replaced by `with` (the markers
/// kept, so a later rewrite can replace the section again); unchanged where the markers are
/// missing (the unit test `coop_variants_validate` checks that every variant differs from the
/// kernel as written).
fn with_section(src: &str, name: &str, with: &str) -> String {
    let open = format!("// <{name}>\n");
    let close = format!("// </{name}>\n");
    match (src.find(&open), src.find(&close)) {
        (Some(a), Some(b)) if a + open.len() <= b => {
            // The closing marker's line starts after the last newline before it.
            let b = src[..b].rfind('\n').map_or(0, |i| i + 1);
            format!("{}{}{}", &src[..a + open.len()], with, &src[b..])
        }
        _ => src.to_string(),
    }
}

/// The lines between `// <name>` and `// </name>` of `src` (empty where missing).
fn section<'s>(src: &'s str, name: &str) -> &'s str {
    let open = format!("// <{name}>\n");
    let close = format!("// </{name}>\n");
    match (src.find(&open), src.find(&close)) {
        (Some(a), Some(b)) if a + open.len() <= b => {
            let b = src[..b].rfind('\n').map_or(0, |i| i + 1);
            &src[a + open.len()..b]
        }
        _ => "",
    }
}

/// The inputs of the step read from memory while they are staged (no private array of 8 vec4
/// carried across the step's products).
const STAGE_X_DIRECT: &str = "        let xa = ti * WS + half * 32u;
        var sx = 0.0;
        for (var i = 0u; i < 8u; i++) {
            var v = vec4<f32>(0.0);
            if (xlive) {
                v = X[xb + st * 16u + i];
            }
            sx += put_x(xa + 4u * i, v);
        }
        xq[lid] = sx;
";

/// The next step's weights read during this step's products (the inputs no longer).
const PREFETCH_W_ONLY: &str = "        let sn = st + 1u;
        if (sn < steps && wlive) {
            w0 = W[qbase + 2u * sn];
            w1 = W[qbase + 2u * sn + 1u];
            let g0 = hbase + (sn * 64u) / p.group;
            let g1 = hbase + (sn * 64u + 32u) / p.group;
            s0 = w_half4(p.scale_off + g0);
            b0 = w_half4(p.bias_off + g0);
            s1 = w_half4(p.scale_off + g1);
            b1 = w_half4(p.bias_off + g1);
        }
";

/// This step's weights read at the step's start (no reads in flight during the products).
const READ_W_NOW: &str = "        if (wlive) {
            w0 = W[qbase + 2u * st];
            w1 = W[qbase + 2u * st + 1u];
            let g0 = hbase + (st * 64u) / p.group;
            let g1 = hbase + (st * 64u + 32u) / p.group;
            s0 = w_half4(p.scale_off + g0);
            b0 = w_half4(p.bias_off + g0);
            s1 = w_half4(p.scale_off + g1);
            b1 = w_half4(p.bias_off + g1);
        }
";

/// Invocation n < 32 stages all 64 columns of item n (no split of an item's step in halves
/// between two invocations), read from memory at the step.
const STAGE_X_PER_ITEM: &str = "        if (lid < TT) {
            let live = lid < nt;
            var r = 0u;
            if (live) {
                r = tile_items[lid];
                if (p.expert_mode != 0u) {
                    r = r / p.x_div;
                }
            }
            let xo = (p.x_off + r * p.x_stride) / 4u + st * 16u;
            var sa = 0.0;
            var sb = 0.0;
            for (var i = 0u; i < 16u; i++) {
                var v = vec4<f32>(0.0);
                if (live) {
                    v = X[xo + i];
                }
                let t = put_x(lid * WS + 4u * i, v);
                if (i < 8u) {
                    sa += t;
                } else {
                    sb += t;
                }
            }
            xq[2u * lid] = sa;
            xq[2u * lid + 1u] = sb;
        }
";

/// put8 and put_x converting one f32 at a time to f16 (no vec4<f16> conversions).
const PUT_SCALAR: &str = "fn put8(at: u32, w: u32, s: f32) {
    for (var j = 0u; j < 4u; j++) {
        let q_lo = f32((w >> (4u * j)) & 15u) - 8.0;
        let q_hi = f32((w >> (16u + 4u * j)) & 15u) - 8.0;
        ws[at + j] = f16(q_lo * s);
        ws[at + 4u + j] = f16(q_hi * s);
    }
}
fn put_x(at: u32, v: vec4<f32>) -> f32 {
    for (var j = 0u; j < 4u; j++) {
        let h = f16(v[j]);
        xh[at + j] = h;
        xl[at + j] = f16(v[j] - f32(h));
    }
    return (v.x + v.y) + (v.z + v.w);
}
";

/// Columns 32..63 of each step in arrays of their own (ws2, xh2, xl2; stride 40 for all six):
/// staging and products of the two halves apart.
fn second_arrays(src: &str) -> String {
    let s = src
        .replace("const WS: u32 = 72u;", "const WS: u32 = 40u;")
        .replace(
            "var<workgroup> ws: array<f16, 4608>;\nvar<workgroup> xh: array<f16, 2304>;\nvar<workgroup> xl: array<f16, 2304>;\n",
            "var<workgroup> ws: array<f16, 2560>;\nvar<workgroup> xh: array<f16, 1280>;\nvar<workgroup> xl: array<f16, 1280>;\nvar<workgroup> ws2: array<f16, 2560>;\nvar<workgroup> xh2: array<f16, 1280>;\nvar<workgroup> xl2: array<f16, 1280>;\n",
        );
    // put8 / put_x writing the second arrays: the same functions renamed.
    let put8 = section(&s, "put8");
    let put_x = section(&s, "put_x");
    let extra = format!(
        "{}{}",
        put8.replace("fn put8(", "fn put8_2(")
            .replace("ws[", "ws2["),
        put_x
            .replace("fn put_x(", "fn put_x2(")
            .replace("xh[", "xh2[")
            .replace("xl[", "xl2[")
    );
    let s = with_section(&s, "put_x", &format!("{put_x}{extra}"));
    let stage_w = section(&s, "stage_w")
        .replace("put8(wa + 32u,", "put8_2(wa,")
        .replace("put8(wa + 40u,", "put8_2(wa + 8u,")
        .replace("put8(wa + 48u,", "put8_2(wa + 16u,")
        .replace("put8(wa + 56u,", "put8_2(wa + 24u,");
    let s = with_section(&s, "stage_w", &stage_w);
    let s = with_section(
        &s,
        "stage_x",
        "        let xa = ti * WS;
        var sx = 0.0;
        for (var i = 0u; i < 8u; i++) {
            if (half == 0u) {
                sx += put_x(xa + 4u * i, x[i]);
            } else {
                sx += put_x2(xa + 4u * i, x[i]);
            }
        }
        xq[lid] = sx;
",
    );
    let products = section(&s, "products").replace("k < 4u", "k < 2u");
    let second = products
        .replace("&ws[", "&ws2[")
        .replace("&xh[", "&xh2[")
        .replace("&xl[", "&xl2[");
    with_section(&s, "products", &format!("{products}{second}"))
}

/// The k loop of the products written out four times (k = 0..3 constants).
fn unrolled(src: &str) -> String {
    let products = section(src, "products");
    let body = products
        .strip_prefix("        for (var k = 0u; k < 4u; k++) {\n")
        .and_then(|b| b.strip_suffix("        }\n"))
        .unwrap_or("");
    let mut out = String::new();
    for k in 0..4 {
        out += &format!("        {{\n            let k = {k}u;\n{body}        }}\n");
    }
    with_section(src, "products", &out)
}

/// linear_q4_mm_coop.wgsl as written and in variants, for the backend to check one after the
/// other at load (forward::check_mm) and use the first usable one that computes the right
/// product. On the H200 through Vulkan (driver 580.159.04, wgpu 30.0.2) the kernel with its bias
/// sums in a private array computed garbage; with them in workgroup memory (the form written
/// now) the products of columns 0..31 of each 64-column step were right and those of columns
/// 32..63 wrong (0.5–0.6 relative where only they had inputs), while coop_diag_tile.wgsl (the
/// same loads, strides and loops on copied operands) was right. The variants each change one
/// suspect of that difference:
/// - the inputs read from memory at staging (no private array of 8 vec4 live across the
///   products), and no reads in flight at all (the structure of coop_diag_tile.wgsl);
/// - one invocation stages all 64 columns of an item (no half split);
/// - the k loop unrolled; the f16 rows at stride 80 instead of 72;
/// - columns 32..63 in arrays of their own;
/// - the workgroup accesses marked non-private (SPIR-V);
/// - diagnostic only (never used): the remainder part dropped (f16 inputs alone), to see the
///   precision that leaves.
///
/// Any that is wrong is refused by the check, so a wrong guess costs only a compile and a check.
pub fn coop_variants() -> Vec<CoopVariant> {
    let src = include_str!("../../../shaders/wgsl/linear_q4_mm_coop.wgsl");
    let direct = |s: &str| {
        let s = with_section(s, "load_x", "");
        let s = with_section(&s, "stage_x", STAGE_X_DIRECT);
        with_section(&s, "prefetch", PREFETCH_W_ONLY)
    };
    let no_prefetch = |s: &str| {
        let s = direct(s);
        let s = with_section(&s, "prefetch", "");
        with_section(&s, "read_w", READ_W_NOW)
    };
    let per_item = |s: &str| with_section(&no_prefetch(s), "stage_x", STAGE_X_PER_ITEM);
    let stride80 = |s: &str| {
        s.replace("const WS: u32 = 72u;", "const WS: u32 = 80u;")
            .replace("array<f16, 4608>", "array<f16, 5120>")
            .replace("array<f16, 2304>", "array<f16, 2560>")
    };
    let hi_only = |s: &str| {
        let products = section(s, "products");
        let kept: String = products
            .lines()
            .filter(|l| !l.contains("l0") && !l.contains("l1"))
            .map(|l| format!("{l}\n"))
            .collect();
        with_section(s, "products", &kept)
    };
    let v = |name, source: String, nonprivate, usable| CoopVariant {
        name,
        source,
        nonprivate,
        usable,
    };
    vec![
        v("as written", src.to_string(), false, true),
        v("k loop unrolled", unrolled(src), false, true),
        v("rows at stride 80", stride80(src), false, true),
        v("inputs read at staging", direct(src), false, true),
        v(
            "columns 32..63 in arrays of their own",
            second_arrays(src),
            false,
            true,
        ),
        v("no reads in flight", no_prefetch(src), false, true),
        v(
            "no reads in flight, one invocation an item",
            per_item(src),
            false,
            true,
        ),
        v(
            "no reads in flight, one invocation an item, k loop unrolled",
            unrolled(&per_item(src)),
            false,
            true,
        ),
        v(
            "scalar f16 conversions",
            with_section(&with_section(src, "put8", PUT_SCALAR), "put_x", ""),
            false,
            true,
        ),
        v(
            "as written, non-private workgroup accesses",
            src.to_string(),
            true,
            true,
        ),
        v(
            "no reads in flight, non-private workgroup accesses",
            no_prefetch(src),
            true,
            true,
        ),
        v(
            "hi part only (a diagnostic: never used)",
            hi_only(src),
            false,
            false,
        ),
    ]
}

/// The cases of coop_diag.wgsl: (what the case does, what a device following
/// SPV_KHR_cooperative_matrix as linear_q4_mm_coop.wgsl reads it gives).
const COOP_DIAG_CASES: [(&str, &str); 18] = [
    ("A=coopLoad(X) B=I coopStore", "X"),
    ("A=coopLoadT(X) B=I coopStore", "Xt"),
    ("A=coopLoad(X) B=I coopStoreT", "Xt"),
    ("A=I B=coopLoad(X) coopStore", "X"),
    ("A=I B=coopLoadT(X) coopStore", "Xt"),
    ("A=0 B=I C=coopLoad(f32 X) coopStore", "X"),
    ("A=coopLoadT(X) B=coopLoadT(Y) coopStoreT", "XY"),
    ("case 0 from workgroup memory", "X"),
    ("case 6 from workgroup memory (stride 24)", "XY"),
    ("case 6 accumulated twice", "2XY"),
    ("case 6, C loaded from zeroed workgroup f32", "XY"),
    ("case 8 stored to workgroup memory, copied out", "XY"),
    ("A=I B=coopLoad(X) from workgroup memory (stride 24)", "X"),
    (
        "case 0 stored column-major to workgroup memory, copied out",
        "X",
    ),
    (
        "case 6 with A from workgroup memory at stride 72, row 16, column 16",
        "XY",
    ),
    (
        "A=coopLoadT(X) B=coopLoad(Yt laid out as the kernel's xh, stride 72, offset)",
        "XY",
    ),
    ("case 6 accumulated in a loop of 4 with barriers", "4XY"),
    (
        "case 6 stored column-major to workgroup f32 at stride 64, offset 16",
        "XY",
    ),
];

/// The cases of coop_diag_tile.wgsl: (what the case does, which product is right, what it is
/// without the remainder part / with one step only, for naming a wrong result).
const COOP_DIAG_TILE_CASES: [&str; 4] = [
    "the kernel's tile, one step, hi part",
    "the kernel's tile, one step, hi and remainder parts",
    "the kernel's tile, two steps with barriers, accumulators carried",
    "two steps, the subgroups' rows swapped",
];

/// Runs coop_diag.wgsl (tiny 16 × 16 products through each cooperative-matrix operation, on a
/// device with them: `Gpu::coop`) and names each case's result: one line per case, "ok" where it
/// is what SPV_KHR_cooperative_matrix says, else what it equals (X, Xt, XY, …) or its first
/// row and column. For the log ($LILY_WGPU_COOP_DIAG=1); milliseconds.
pub fn coop_diag(gpu: &Gpu) -> Result<Vec<String>> {
    let source = include_str!("../../../shaders/wgsl/coop_diag.wgsl");
    let kernel = Kernel::new(gpu, "coop_diag", COMMON, source, false, &[])?;
    let mut lines = coop_diag_run(gpu, &kernel, "")?;
    // The kernel's whole tile of products (coop_diag_tile.wgsl), as wgpu compiles it and
    // non-private.
    let tile = include_str!("../../../shaders/wgsl/coop_diag_tile.wgsl");
    match Kernel::new(gpu, "coop_diag_tile", COMMON, tile, false, &[]) {
        Ok(k) => lines.extend(coop_diag_tile_run(gpu, &k, "", false)?),
        Err(e) => lines.push(format!("coop diag tile: {e:#}")),
    }
    match Kernel::from_patched_spirv(gpu, "coop_diag_tile", COMMON, tile, 64, mark_nonprivate) {
        Ok((k, n)) => lines.extend(coop_diag_tile_run(
            gpu,
            &k,
            &format!(" [SPIR-V with {n} workgroup accesses non-private]"),
            false,
        )?),
        Err(e) => lines.push(format!(
            "coop diag tile with non-private workgroup accesses: {e:#}"
        )),
    }
    // The same with the workgroup accesses non-private (`mark_nonprivate`), where the device
    // takes SPIR-V as is.
    match Kernel::from_patched_spirv(gpu, "coop_diag", COMMON, source, 32, mark_nonprivate) {
        Ok((k, n)) => lines.extend(coop_diag_run(
            gpu,
            &k,
            &format!(" [SPIR-V with {n} workgroup accesses non-private]"),
        )?),
        Err(e) => lines.push(format!(
            "coop diag with non-private workgroup accesses: {e:#}"
        )),
    }
    Ok(lines)
}

/// coop_diag.wgsl's cases through `kernel`, one line each (`coop_diag`), `tag` after each.
fn coop_diag_run(gpu: &Gpu, kernel: &Kernel, tag: &str) -> Result<Vec<String>> {
    let n = 16usize;
    let x: Vec<f64> = (0..n * n).map(|i| i as f64).collect();
    let mut seed = 0x1234_5678_9abc_def1u64;
    let y: Vec<f64> = (0..n * n)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % 7) as f64 - 3.0
        })
        .collect();
    let eye: Vec<f64> = (0..n * n)
        .map(|i| if i / n == i % n { 1.0 } else { 0.0 })
        .collect();
    let mut s = Vec::with_capacity(4 * n * n);
    for v in x
        .iter()
        .chain(&y)
        .chain(&eye)
        .chain(std::iter::repeat_n(&0.0, n * n))
    {
        s.push(half::f16::from_f64(*v));
    }
    let s_bytes: Vec<u8> = s.iter().flat_map(|h| h.to_le_bytes()).collect();
    let f: Vec<f32> = x.iter().map(|v| *v as f32).collect();
    let sb = gpu.upload("coop_diag.s", &s_bytes)?;
    let fb = gpu.upload_f32("coop_diag.f", &f)?;
    let cases = COOP_DIAG_CASES.len();
    let ob = gpu.storage("coop_diag.o", (cases * n * n * 4) as u64)?;
    let mut r = crate::gpu::Recorder::new(gpu);
    r.dispatch(
        kernel,
        &[cases as u32],
        &[&sb, &fb, &ob],
        [cases as u32, 1, 1],
    );
    r.submit()?;
    let got = gpu.read_f32(&ob, 0, cases * n * n)?;
    let t = |m: &[f64]| -> Vec<f64> { (0..n * n).map(|i| m[(i % n) * n + i / n]).collect() };
    let mul = |a: &[f64], b: &[f64]| -> Vec<f64> {
        (0..n * n)
            .map(|i| (0..n).map(|k| a[(i / n) * n + k] * b[k * n + i % n]).sum())
            .collect()
    };
    let (xt, yt) = (t(&x), t(&y));
    let xy = mul(&x, &y);
    let named: Vec<(&str, Vec<f64>)> = vec![
        ("X", x.clone()),
        ("Xt", xt.clone()),
        ("XY", xy.clone()),
        ("(XY)t", t(&xy)),
        ("2XY", xy.iter().map(|v| 2.0 * v).collect()),
        ("4XY", xy.iter().map(|v| 4.0 * v).collect()),
        ("YX", mul(&y, &x)),
        ("XtY", mul(&xt, &y)),
        ("XYt", mul(&x, &yt)),
        ("XtYt", mul(&xt, &yt)),
        ("YtXt", mul(&yt, &xt)),
        ("zero", vec![0.0; n * n]),
    ];
    let mut lines = Vec::new();
    for (c, (what, want)) in COOP_DIAG_CASES.iter().enumerate() {
        let o = &got[c * n * n..(c + 1) * n * n];
        let same = |m: &[f64]| o.iter().zip(m).all(|(a, b)| (*a as f64 - b).abs() < 1e-3);
        let found = named.iter().find(|(_, m)| same(m)).map(|(name, _)| *name);
        let verdict = match found {
            Some(name) if name == *want => "ok".to_string(),
            Some(name) => format!("WRONG: = {name}, want {want}"),
            None => format!(
                "WRONG: none of X, Xt, XY, … (want {want}); row 0 {:?}, column 0 {:?}",
                &o[..8],
                (0..8).map(|i| o[i * n]).collect::<Vec<_>>()
            ),
        };
        lines.push(format!("coop diag case {c} ({what}){tag}: {verdict}"));
    }
    Ok(lines)
}

/// coop_diag_tile.wgsl's cases through `kernel`, one line each (`coop_diag`), `tag` after each:
/// "ok", or what the result equals among the cases' products (one step, no remainder part), and
/// a map of its 16 × 16 blocks (4 of rows across, 2 of items: `.` right, `0` zero, `o` the right
/// block of the other subgroup's rows, `x` else) with its first wrong element.
/// `f32_inputs`: S in f32 (the emulation's, `emulate_coop_source`).
pub fn coop_diag_tile_run(
    gpu: &Gpu,
    kernel: &Kernel,
    tag: &str,
    f32_inputs: bool,
) -> Result<Vec<String>> {
    let (rows, cols, items) = (64usize, 64usize, 32usize);
    let mut seed = 0x0bad_cafe_1234_5677u64;
    let mut small = |n: usize| -> Vec<f64> {
        (0..n)
            .map(|_| {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                (seed % 5) as f64 - 2.0
            })
            .collect()
    };
    let (a, a2, b, b2) = (
        small(rows * cols),
        small(rows * cols),
        small(items * cols),
        small(items * cols),
    );
    let all = a.iter().chain(&a2).chain(&b).chain(&b2);
    let s: Vec<u8> = if f32_inputs {
        all.flat_map(|v| (*v as f32).to_le_bytes()).collect()
    } else {
        all.flat_map(|v| half::f16::from_f64(*v).to_le_bytes())
            .collect()
    };
    // Element (row r, item n) at n · rows + r, as the kernel's cs.
    let prod = |a: &[f64], b: &[f64]| -> Vec<f64> {
        (0..rows * items)
            .map(|i| {
                let (n, r) = (i / rows, i % rows);
                (0..cols).map(|k| a[r * cols + k] * b[n * cols + k]).sum()
            })
            .collect()
    };
    let add = |x: &[f64], y: &[f64]| -> Vec<f64> { x.iter().zip(y).map(|(p, q)| p + q).collect() };
    let bb = add(&b, &b2);
    let (ab, abb) = (prod(&a, &b), prod(&a, &bb));
    let a2bb = prod(&a2, &bb);
    let both = add(&abb, &a2bb);
    let named: Vec<(&str, &Vec<f64>)> = vec![
        ("A·Bt (hi part only, one step)", &ab),
        ("A·(B+B2)t (one step)", &abb),
        ("A2·(B+B2)t (the second step only)", &a2bb),
        ("(A+A2)·(B+B2)t", &both),
    ];
    let wants = [&ab, &abb, &both, &both];
    let cases = COOP_DIAG_TILE_CASES.len();
    let sb = gpu.upload("coop_diag_tile.s", &s)?;
    let ob = gpu.storage("coop_diag_tile.o", (cases * rows * items * 4) as u64)?;
    let mut r = crate::gpu::Recorder::new(gpu);
    r.dispatch(kernel, &[cases as u32], &[&sb, &ob], [cases as u32, 1, 1]);
    r.submit()?;
    let got = gpu.read_f32(&ob, 0, cases * rows * items)?;
    let mut lines = Vec::new();
    for (c, what) in COOP_DIAG_TILE_CASES.iter().enumerate() {
        let o = &got[c * rows * items..(c + 1) * rows * items];
        let want = wants[c];
        let same = |m: &[f64]| o.iter().zip(m).all(|(g, w)| (*g as f64 - w).abs() < 1e-3);
        let verdict = if same(want) {
            "ok".to_string()
        } else {
            let found = named.iter().find(|(_, m)| same(m)).map(|(n, _)| *n);
            let mut map = String::new();
            for n0 in [0usize, 16] {
                if n0 > 0 {
                    map.push('|');
                }
                for r0 in [0usize, 16, 32, 48] {
                    let at = |r: usize, n: usize| n * rows + r;
                    let block = |f: &dyn Fn(usize, usize) -> bool| {
                        (n0..n0 + 16).all(|n| (r0..r0 + 16).all(|r| f(r, n)))
                    };
                    let other = (r0 + 32) % 64;
                    map.push(
                        if block(&|r, n| (o[at(r, n)] as f64 - want[at(r, n)]).abs() < 1e-3) {
                            '.'
                        } else if block(&|r, n| o[at(r, n)] == 0.0) {
                            '0'
                        } else if block(&|r, n| {
                            (o[at(r, n)] as f64 - want[at(other + r - r0, n)]).abs() < 1e-3
                        }) {
                            'o'
                        } else {
                            'x'
                        },
                    );
                }
            }
            let first = (0..rows * items)
                .find(|&i| (o[i] as f64 - want[i]).abs() >= 1e-3)
                .map(|i| {
                    format!(
                        "first wrong: row {}, item {}: {} (want {})",
                        i % rows,
                        i / rows,
                        o[i],
                        want[i]
                    )
                })
                .unwrap_or_default();
            match found {
                Some(name) => format!("WRONG: = {name}; map {map}; {first}"),
                None => format!("WRONG: map {map}; {first}"),
            }
        };
        lines.push(format!("coop diag tile case {c} ({what}){tag}: {verdict}"));
    }
    Ok(lines)
}

/// Marks every access to workgroup memory in SPIR-V `words` non-private (memory operand
/// NonPrivatePointer): OpLoad, OpStore and the cooperative-matrix loads and stores through a
/// pointer into a Workgroup variable. naga writes modules with cooperative matrices under the
/// Vulkan memory model (SPV_KHR_vulkan_memory_model) but marks no access non-private, and under
/// that model a barrier orders only non-private accesses: the driver may keep one invocation's
/// workgroup stores from the others' loads after a barrier (glslang marks every access to
/// `shared` variables non-private under that model). Returns how many accesses it marked; an
/// error where the module is not under the Vulkan memory model or its words do not parse.
pub fn mark_nonprivate(words: &mut Vec<u32>) -> Result<usize> {
    const OP_MEMORY_MODEL: u32 = 14;
    const OP_TYPE_POINTER: u32 = 32;
    const OP_FUNCTION_PARAMETER: u32 = 55;
    const OP_VARIABLE: u32 = 59;
    const OP_LOAD: u32 = 61;
    const OP_STORE: u32 = 62;
    const OP_ACCESS_CHAIN: u32 = 65;
    const OP_IN_BOUNDS_ACCESS_CHAIN: u32 = 66;
    const OP_PTR_ACCESS_CHAIN: u32 = 67;
    const OP_COPY_OBJECT: u32 = 83;
    const OP_COOP_LOAD: u32 = 4457;
    const OP_COOP_STORE: u32 = 4458;
    const SC_WORKGROUP: u32 = 4;
    const MM_VULKAN: u32 = 3;
    const NON_PRIVATE_POINTER: u32 = 0x20;
    if words.len() < 5 || words[0] != 0x0723_0203 {
        bail!("not SPIR-V");
    }
    // The instructions as (opcode, operand range).
    let mut insts = Vec::new();
    let mut i = 5;
    while i < words.len() {
        let wc = (words[i] >> 16) as usize;
        if wc == 0 || i + wc > words.len() {
            bail!("malformed SPIR-V at word {i}");
        }
        insts.push((words[i] & 0xffff, i + 1..i + wc));
        i += wc;
    }
    let mut vulkan = false;
    let mut wg_ptr_types = std::collections::HashSet::new();
    let mut wg_ptrs = std::collections::HashSet::new();
    for (op, r) in &insts {
        let a = &words[r.clone()];
        match *op {
            OP_MEMORY_MODEL if a.len() >= 2 => vulkan = a[1] == MM_VULKAN,
            OP_TYPE_POINTER if a.len() >= 2 && a[1] == SC_WORKGROUP => {
                wg_ptr_types.insert(a[0]);
            }
            OP_FUNCTION_PARAMETER
            | OP_VARIABLE
            | OP_ACCESS_CHAIN
            | OP_IN_BOUNDS_ACCESS_CHAIN
            | OP_PTR_ACCESS_CHAIN
            | OP_COPY_OBJECT
                if a.len() >= 2 && wg_ptr_types.contains(&a[0]) =>
            {
                wg_ptrs.insert(a[1]);
            }
            _ => {}
        }
    }
    if !vulkan {
        bail!("the module is not under the Vulkan memory model");
    }
    // Where the memory operand sits (operand index) for each access through a workgroup pointer.
    let mut out = Vec::with_capacity(words.len() + 64);
    out.extend_from_slice(&words[..5]);
    let mut marked = 0;
    for (op, r) in &insts {
        let a = &words[r.clone()];
        let at = match *op {
            OP_LOAD if a.len() >= 3 && wg_ptrs.contains(&a[2]) => Some(3),
            OP_STORE if a.len() >= 2 && wg_ptrs.contains(&a[0]) => Some(2),
            // Result type, result, pointer, layout, stride, memory operand.
            OP_COOP_LOAD if a.len() >= 5 && wg_ptrs.contains(&a[2]) => Some(5),
            // Pointer, object, layout, stride, memory operand.
            OP_COOP_STORE if a.len() >= 4 && wg_ptrs.contains(&a[0]) => Some(4),
            _ => None,
        };
        let mut ops = a.to_vec();
        if let Some(at) = at {
            if ops.len() > at {
                ops[at] |= NON_PRIVATE_POINTER;
            } else {
                ops.push(NON_PRIVATE_POINTER);
            }
            marked += 1;
        }
        out.push(((ops.len() as u32 + 1) << 16) | op);
        out.extend_from_slice(&ops);
    }
    *words = out;
    Ok(marked)
}

/// linear_q4_mm.wgsl through `Kernel::from_patched_spirv`, its SPIR-V moved to the Vulkan memory
/// model (`to_vulkan_memory_model`) and its workgroup accesses marked non-private
/// (`mark_nonprivate`): checks the path of the cooperative-matrix variants (naga's SPIR-V here,
/// the patch, the bind group layout, the driver taking the words as they are) on any adapter
/// that takes SPIR-V as is, lavapipe included (`WgpuBackend::check_passthrough`).
pub fn passthrough_mm(gpu: &Gpu) -> Result<(Kernel, usize)> {
    Kernel::from_patched_spirv(
        gpu,
        "linear_q4_mm",
        COMMON,
        include_str!("../../../shaders/wgsl/linear_q4_mm.wgsl"),
        64,
        |w| {
            to_vulkan_memory_model(w)?;
            mark_nonprivate(w)
        },
    )
}

/// Puts SPIR-V `words` (1.5 or later, naga's GLSL450 memory model) under the Vulkan memory model,
/// as naga writes modules with cooperative matrices: the memory model operand and the
/// VulkanMemoryModel capability. For `passthrough_mm` (no cooperative matrices on lavapipe).
fn to_vulkan_memory_model(words: &mut Vec<u32>) -> Result<()> {
    const OP_CAPABILITY: u32 = 17;
    const OP_MEMORY_MODEL: u32 = 14;
    const CAP_VULKAN_MEMORY_MODEL: u32 = 5345;
    if words.len() < 5 || words[1] < 0x0001_0500 {
        bail!("SPIR-V before 1.5");
    }
    let mut i = 5;
    let mut first_cap = None;
    let mut model = None;
    while i < words.len() {
        let wc = (words[i] >> 16) as usize;
        if wc == 0 {
            bail!("malformed SPIR-V at word {i}");
        }
        match words[i] & 0xffff {
            OP_CAPABILITY if first_cap.is_none() => first_cap = Some(i),
            OP_MEMORY_MODEL => model = Some(i),
            _ => {}
        }
        i += wc;
    }
    let (Some(cap), Some(mm)) = (first_cap, model) else {
        bail!("no capability or memory model instruction");
    };
    words[mm + 2] = 3;
    words.splice(
        cap..cap,
        [(2 << 16) | OP_CAPABILITY, CAP_VULKAN_MEMORY_MODEL],
    );
    Ok(())
}

/// Compiles variant `source` of linear_q4_mm_coop.wgsl (`coop_variants`); `nonprivate`: through
/// naga's SPIR-V with its workgroup accesses marked non-private (`mark_nonprivate`), handed to
/// the driver as is.
pub fn coop_kernel(gpu: &Gpu, source: &str, checked: bool, nonprivate: bool) -> Result<Kernel> {
    if nonprivate {
        let (k, _) = Kernel::from_patched_spirv(
            gpu,
            "linear_q4_mm_coop",
            COMMON,
            source,
            64,
            mark_nonprivate,
        )?;
        return Ok(k);
    }
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
    emulate_coop_source(include_str!("../../../shaders/wgsl/linear_q4_mm_coop.wgsl"))
}

/// `src` (linear_q4_mm_coop.wgsl, or coop_diag_tile.wgsl, which uses its operations in the same
/// forms) with its cooperative-matrix operations done in plain WGSL and f32 in place of f16
/// (`coop_emulated_source`).
pub fn emulate_coop_source(src: &str) -> Result<String> {
    let mut out = String::new();
    for line in src.lines() {
        let code = line.split("//").next().unwrap_or("");
        if code.trim_start().starts_with("enable ") {
            continue;
        }
        out += &emulate_line(code)?;
        out.push('\n');
    }
    // emu_at: the f16 arrays the kernel declares, by tag.
    out += "fn emu_at(tagged: u32, i: u32) -> f32 {\n    let tag = tagged >> 28u;\n    let o = (tagged & 0x0fffffffu) + i;\n";
    for (tag, arr) in EMU_ARRAYS.iter().enumerate() {
        if src.contains(&format!("var<workgroup> {arr}: array<f16,")) {
            out += &format!("    if (tag == {tag}u) {{\n        return {arr}[o];\n    }}\n");
        }
    }
    out += "    return 0.0;\n}\n";
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
            bail!("the kernel uses {word} in a form the emulation does not rewrite");
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
        .replace("array<f16,", "array<f32,")
        .replace("array<f16>", "array<f32>")
        .replace("f16(", "f32(");
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
        // The array rides in the offset's top bits: its place in EMU_ARRAYS.
        let Some(tag) = EMU_ARRAYS.iter().position(|a| *a == arr) else {
            bail!("a cooperative load from an array the emulation does not know: {line}");
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

/// The f16 workgroup arrays cooperative loads may read in the emulation (`emulate_line`), in
/// tag order.
const EMU_ARRAYS: [&str; 6] = ["ws", "xh", "xl", "ws2", "xh2", "xl2"];

const COOP_EMULATION: &str = r#"

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
    /// `mark_nonprivate` on naga's SPIR-V of linear_q4_mm_coop.wgsl and coop_diag.wgsl: every
    /// load and store through a workgroup pointer (plain and cooperative) gets NonPrivatePointer,
    /// nothing else changes, and the words still parse; a module outside the Vulkan memory model
    /// (no cooperative matrices) is refused.
    #[test]
    fn nonprivate_marks_every_workgroup_access() {
        use crate::gpu::naga_spirv;
        let sources = [
            ("linear_q4_mm_coop", coop_variants()[0].source.clone()),
            (
                "coop_diag",
                include_str!("../../../shaders/wgsl/coop_diag.wgsl").to_string(),
            ),
            (
                "coop_diag_tile",
                include_str!("../../../shaders/wgsl/coop_diag_tile.wgsl").to_string(),
            ),
        ];
        for (name, source) in sources {
            let before = naga_spirv(name, COMMON, &source).unwrap();
            let mut after = before.clone();
            let n = mark_nonprivate(&mut after).unwrap();
            // Parse both: (opcode, operands) per instruction.
            let parse = |w: &[u32]| {
                let mut out = Vec::new();
                let mut i = 5;
                while i < w.len() {
                    let wc = (w[i] >> 16) as usize;
                    assert!(wc > 0 && i + wc <= w.len());
                    out.push((w[i] & 0xffff, w[i + 1..i + wc].to_vec()));
                    i += wc;
                }
                out
            };
            let (b, a) = (parse(&before), parse(&after));
            assert_eq!(b.len(), a.len());
            let wg_types: std::collections::HashSet<u32> = b
                .iter()
                .filter(|(op, o)| *op == 32 && o[1] == 4)
                .map(|(_, o)| o[0])
                .collect();
            let wg_ptrs: std::collections::HashSet<u32> = b
                .iter()
                .filter(|(op, o)| [55, 59, 65, 66, 67, 83].contains(op) && wg_types.contains(&o[0]))
                .map(|(_, o)| o[1])
                .collect();
            let mut accesses = 0;
            for ((op, ob), (op2, oa)) in b.iter().zip(&a) {
                assert_eq!(op, op2);
                let at = match op {
                    61 if wg_ptrs.contains(&ob[2]) => Some(3),
                    62 if wg_ptrs.contains(&ob[0]) => Some(2),
                    4457 if wg_ptrs.contains(&ob[2]) => Some(5),
                    4458 if wg_ptrs.contains(&ob[0]) => Some(4),
                    _ => None,
                };
                match at {
                    Some(at) => {
                        accesses += 1;
                        assert_eq!(oa[..at], ob[..at.min(ob.len())]);
                        assert_ne!(oa[at] & 0x20, 0, "{name}: op {op} not marked");
                    }
                    None => assert_eq!(oa, ob),
                }
            }
            assert!(accesses > 10, "{name}: {accesses} workgroup accesses");
            assert_eq!(n, accesses);
        }
        let plain = naga_spirv(
            "rms_norm",
            COMMON,
            include_str!("../../../shaders/wgsl/rms_norm.wgsl"),
        )
        .unwrap();
        assert!(mark_nonprivate(&mut plain.clone()).is_err());
    }

    /// coop_diag.wgsl and coop_diag_tile.wgsl parse and validate as `coop_variants_validate`
    /// checks the variants; the tile's emulation (`emulate_coop_source`) takes its forms.
    #[test]
    fn coop_diag_validates() {
        emulate_coop_source(include_str!("../../../shaders/wgsl/coop_diag_tile.wgsl")).unwrap();
        for source in [
            include_str!("../../../shaders/wgsl/coop_diag.wgsl"),
            include_str!("../../../shaders/wgsl/coop_diag_tile.wgsl"),
        ] {
            validate_wgsl(source);
        }
    }

    fn validate_wgsl(source: &str) {
        let (enables, body): (Vec<&str>, Vec<&str>) = source
            .lines()
            .partition(|l| l.trim_start().starts_with("enable "));
        let code = format!("{}\n{COMMON}\n{}", enables.join("\n"), body.join("\n"));
        let module = naga::front::wgsl::parse_str(&code)
            .unwrap_or_else(|e| panic!("{}", e.emit_to_string(&code)));
        naga::valid::Validator::new(
            naga::valid::ValidationFlags::all(),
            naga::valid::Capabilities::all(),
        )
        .validate(&module)
        .unwrap_or_else(|e| panic!("{e:?}"));
    }

    #[test]
    fn coop_variants_validate() {
        let variants = coop_variants();
        assert_eq!(variants.len(), 12);
        let base = &variants[0].source;
        assert!(base.contains("bs[n * 64u + lid] += ") && !base.contains("bacc"));
        // Each rewrite took effect: every variant but the non-private copy of one differs from
        // those before it.
        for (i, v) in variants.iter().enumerate() {
            let same = variants[..i]
                .iter()
                .any(|w| w.source == v.source && w.nonprivate == v.nonprivate);
            assert!(!same, "{}: the same as an earlier variant", v.name);
        }
        assert!(variants[1].source.contains("let k = 3u;"));
        assert!(variants[2].source.contains("const WS: u32 = 80u;"));
        assert!(!variants[3].source.contains("x[i] = X["));
        let second = &variants[4].source;
        assert!(second.contains("fn put8_2(") && second.contains("fn put_x2("));
        assert!(second.contains("&xl2[16u * WS + k * 16u]") && second.contains("put8_2(wa + 24u,"));
        assert!(!variants[5].source.contains("let sn = st + 1u;"));
        assert!(variants[5].source.contains("w0 = W[qbase + 2u * st];"));
        assert!(variants[6].source.contains("xq[2u * lid + 1u] = sb;"));
        assert!(variants[7].source.contains("let k = 3u;") && variants[7].source.contains("= sb;"));
        assert!(variants[8]
            .source
            .contains("ws[at + 4u + j] = f16(q_hi * s);"));
        assert!(!variants[8].source.contains("vec4<f16>"));
        assert!(variants[9].nonprivate && variants[10].nonprivate);
        let hi = &variants[11];
        assert!(!hi.usable && !hi.source.contains("l0") && hi.source.contains("(a1, h1, c11)"));
        assert!(variants[..11].iter().all(|v| v.usable));
        for v in &variants {
            let (name, source) = (v.name, &v.source);
            if std::env::var("DUMP_VARIANTS").is_ok() {
                let _ = std::fs::write(
                    format!("/tmp/variant-{}.wgsl", name.replace(' ', "_")),
                    source,
                );
            }
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
