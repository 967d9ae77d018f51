//! The WGSL sources (shaders/wgsl/, one entry point per file, named after it), how a kernel is
//! assembled from one (shaders/wgsl/common.wgsl in front), and what an instance of it needs from
//! the device: its workgroup memory and invocations, computed by naga with the `override`
//! constants resolved, so that the plan can check them against the adapter's limits before a
//! pipeline is built (wgpu checks the invocations, not the workgroup memory; on Metal an
//! oversized kernel fails or misbehaves at dispatch: docs WGPU.md).

use anyhow::{anyhow, bail, Context, Result};
use wgpu::naga;

pub const COMMON: &str = include_str!("../../../shaders/wgsl/common.wgsl");
/// The workgroup reductions (wg_sum, wg_max, rms_scale, wg256_sum, wg256_argmax) on subgroups,
/// and the same through workgroup memory for devices without subgroup operations.
pub const REDUCE_SUBGROUP: &str = include_str!("../../../shaders/wgsl/reduce_subgroup.wgsl");
pub const REDUCE_WORKGROUP: &str = include_str!("../../../shaders/wgsl/reduce_workgroup.wgsl");
/// The KV cache's element types (`KV`, `KV4`): f32, or f16 where the device has SHADER_F16.
pub const KV_F32: &str = include_str!("../../../shaders/wgsl/kv_f32.wgsl");
pub const KV_F16: &str = include_str!("../../../shaders/wgsl/kv_f16.wgsl");
/// linear_q4_mm.wgsl's tile element type (`TS`, `TS4`): f32, or f16 where the device has
/// SHADER_F16 and the plan's `f16_tiles` is on (`Spec::tile_max` gives its `TMAX`).
pub const TILE_F32: &str = include_str!("../../../shaders/wgsl/tile_f32.wgsl");
pub const TILE_F16: &str = include_str!("../../../shaders/wgsl/tile_f16.wgsl");
/// The activations' element type between kernels (`ACT`, `ACT4`): f32, or f16 where the device
/// has SHADER_F16 and the plan's `act_f16` is on.
pub const ACT_F32: &str = include_str!("../../../shaders/wgsl/act_f32.wgsl");
pub const ACT_F16: &str = include_str!("../../../shaders/wgsl/act_f16.wgsl");
/// The parameters, bindings, tile items and dequantisation linear_q4_mm.wgsl,
/// linear_q4_coop.wgsl and linear_q4_coop_big.wgsl share (in front of those only: `MM_KERNELS`).
pub const MM_TILE: &str = include_str!("../../../shaders/wgsl/mm_tile.wgsl");
/// The kernels mm_tile.wgsl goes in front of.
pub const MM_KERNELS: [&str; 3] = ["linear_q4_mm", "linear_q4_coop", "linear_q4_coop_big"];
/// The parameters, bindings, shapes and one item's reads moe_down.wgsl, moe_down_rows.wgsl and
/// moe_down_lanes.wgsl share (in front of those only: `DOWN_KERNELS`).
pub const DOWN_ITEM: &str = include_str!("../../../shaders/wgsl/moe_down_item.wgsl");
/// The kernels moe_down_item.wgsl goes in front of.
pub const DOWN_KERNELS: [&str; 3] = ["moe_down", "moe_down_rows", "moe_down_lanes"];

macro_rules! sources {
    ($($name:literal),* $(,)?) => {
        /// Every kernel file, by entry point.
        pub const SOURCES: &[(&str, &str)] = &[
            $(($name, include_str!(concat!("../../../shaders/wgsl/", $name, ".wgsl"))),)*
        ];
    };
}

sources!(
    "argmax_final",
    "argmax_part",
    "attend",
    "attend_gqa",
    "attend_merge",
    "attend_tile",
    "attn_prep",
    "dn_conv",
    "dn_conv_step",
    "dn_qk_norm",
    "dn_recur",
    "dn_recur_norm",
    "embed",
    "gated_norm",
    "linear",
    "linear_q4",
    "linear_q4_glu",
    "linear_q4_glu_rows",
    "linear_q4_coop",
    "linear_q4_coop_big",
    "linear_q4_mm",
    "linear_q4_rows",
    "moe_combine",
    "moe_down",
    "moe_down_rows",
    "moe_down_lanes",
    "moe_group",
    "moe_route",
    "rms_norm",
    "sample_adjust",
    "sample_pick",
    "sample_prefilter",
    "swiglu",
);

/// One kernel as compiled: its file (= entry point), its `override` constants, whether its
/// reductions run on subgroups (reduce_subgroup.wgsl in front) or through workgroup memory
/// (reduce_workgroup.wgsl), whether the KV cache it reads or writes is f16 (kv_f16.wgsl) or
/// f32 (kv_f32.wgsl), whether its workgroup tiles are f16 (tile_f16.wgsl) or f32
/// (tile_f32.wgsl; only linear_q4_mm.wgsl has such tiles), and whether the activations it reads
/// and writes are f16 (act_f16.wgsl) or f32 (act_f32.wgsl).
#[derive(Clone, Debug, PartialEq)]
pub struct Spec {
    pub name: &'static str,
    pub constants: Vec<(&'static str, f64)>,
    pub subgroups: bool,
    pub kv_f16: bool,
    pub tile_f16: bool,
    /// `TMAX` in front of the kernel: the most items a linear_q4_mm.wgsl tile holds (the size
    /// of its register arrays): 32, or 64 for tiles of 64.
    pub tile_max: u32,
    pub act_f16: bool,
    /// linear_q4_coop.wgsl's (or linear_q4_coop_big.wgsl's) cooperative matrices: their size
    /// (8 or 16: `coop_prelude`'s types in front of it, its cooperative operations written for
    /// it and its `TT` by `coop_code`), or 0 for every other kernel.
    pub coop: u32,
    /// linear_q4_coop.wgsl with its cooperative operations emulated by plain WGSL
    /// (`coop_prelude`'s plain functions: for checking the kernel's staging, indexing and stores
    /// on adapters without cooperative matrices, lavapipe; never what the plan runs).
    pub coop_emulated: bool,
    /// linear_q4_coop_big.wgsl's rows a workgroup (`coop_rows`: 128, its invocations 256), or 0
    /// for the 64 of every tile product (`MM_ROWS`; `Spec::mm_rows`).
    pub coop_rows: u32,
    /// A product kernel's form (`XS`, `YS` in front of it): its input is the f32 residual
    /// stream (a decode step's folded norm) rather than an activation (`ACT`), its output an
    /// f32 buffer (the residual stream it adds into, the router's or the model's logits).
    pub form: Form,
}

/// What a matrix product reads and writes (`Spec::form`): `x_f32` its input is the residual
/// stream, `y_f32` its output is an f32 buffer. Where activations are f32 every form compiles
/// to the same kernel (`Form::F32`'s only).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Form {
    pub x_f32: bool,
    pub y_f32: bool,
}

impl Form {
    /// Every form, as `Forms` indexes them.
    pub const ALL: [Form; 4] = [
        Form {
            x_f32: false,
            y_f32: false,
        },
        Form {
            x_f32: false,
            y_f32: true,
        },
        Form {
            x_f32: true,
            y_f32: false,
        },
        Form {
            x_f32: true,
            y_f32: true,
        },
    ];
}

impl Spec {
    pub fn new(name: &'static str, constants: &[(&'static str, f64)]) -> Spec {
        Spec {
            name,
            constants: constants.to_vec(),
            subgroups: false,
            kv_f16: false,
            tile_f16: false,
            tile_max: 32,
            act_f16: false,
            coop: 0,
            coop_emulated: false,
            coop_rows: 0,
            form: Form::default(),
        }
    }

    /// The rows a workgroup of a tile product (linear_q4_mm, linear_q4_coop, linear_q4_coop_big)
    /// covers, so its launches' row blocks: 128 for linear_q4_coop_big with `coop_rows` 128,
    /// else `MM_ROWS` (64).
    pub fn mm_rows(&self) -> usize {
        if self.name == "linear_q4_coop_big" && self.coop_rows == 128 {
            128
        } else {
            crate::plan::MM_ROWS
        }
    }

    /// This kernel with its reductions on subgroups (`true`) or through workgroup memory.
    pub fn with_subgroups(mut self, on: bool) -> Spec {
        self.subgroups = on;
        self
    }

    /// The kernel file's text.
    pub fn source(&self) -> Result<&'static str> {
        SOURCES
            .iter()
            .find(|(n, _)| *n == self.name)
            .map(|(_, s)| *s)
            .with_context(|| format!("no WGSL kernel named {}", self.name))
    }

    /// The module as the device compiles it: `enable` directives first, then
    /// the reductions' file, common.wgsl, the KV cache's types, the tiles' types, the
    /// activations' types (and a product's `XS` / `YS`: `ACT`, or f32 as its form says), the
    /// cooperative matrices' types (`coop`), mm_tile.wgsl (`MM_KERNELS`) or moe_down_item.wgsl (`DOWN_KERNELS`) and the kernel (with
    /// its cooperative operations written: `coop_code`).
    pub fn code(&self) -> Result<String> {
        let kv = if self.kv_f16 { KV_F16 } else { KV_F32 };
        let tile = if self.tile_f16 { TILE_F16 } else { TILE_F32 };
        let act = if self.act_f16 { ACT_F16 } else { ACT_F32 };
        let side = |name: &str, f32_side: bool| {
            let (t, t4) = if f32_side {
                ("f32", "vec4<f32>")
            } else {
                ("ACT", "ACT4")
            };
            format!("alias {name} = {t};\nalias {name}4 = {t4};")
        };
        let forms = format!(
            "{}\n{}",
            side("XS", self.form.x_f32),
            side("YS", self.form.y_f32)
        );
        let (coop, source) = if self.coop > 0 {
            let tt = self
                .constants
                .iter()
                .find(|(k, _)| *k == "TT")
                .map(|(_, v)| *v as u32)
                .with_context(|| format!("{}: no tile size (TT) given", self.name))?;
            (
                coop_prelude(self.coop, self.coop_emulated),
                if self.name == "linear_q4_coop_big" {
                    coop_big_code(
                        self.source()?,
                        self.coop,
                        tt,
                        self.mm_rows() as u32,
                        self.coop_emulated,
                    )?
                } else {
                    coop_code(self.source()?, self.coop, tt, self.coop_emulated)?
                },
            )
        } else {
            (String::new(), self.source()?.to_string())
        };
        let mm = if MM_KERNELS.contains(&self.name) {
            MM_TILE
        } else if DOWN_KERNELS.contains(&self.name) {
            DOWN_ITEM
        } else {
            ""
        };
        let (mut enables, body): (Vec<&str>, Vec<&str>) = kv
            .lines()
            .chain([""])
            .chain(tile.lines())
            .chain([""])
            .chain(act.lines())
            .chain(forms.lines())
            .chain([""])
            .chain(coop.lines())
            .chain(mm.lines())
            .chain([""])
            .chain(source.lines())
            .partition(|l| l.trim_start().starts_with("enable "));
        // One line per extension (the KV cache, the tiles and the activations may each enable
        // f16).
        let mut seen = Vec::new();
        enables.retain(|l| {
            let new = !seen.contains(&l.trim());
            seen.push(l.trim());
            new
        });
        let reduce = if self.subgroups {
            REDUCE_SUBGROUP
        } else {
            REDUCE_WORKGROUP
        };
        Ok(format!(
            "{}\n{reduce}\n{COMMON}\nconst TMAX: u32 = {}u;\n{}",
            enables.join("\n"),
            self.tile_max,
            body.join("\n")
        ))
    }

    /// The module parsed and validated by naga, with the constants resolved (naga's
    /// `process_overrides`, as wgpu does before handing a module to its backend).
    pub fn resolved(&self) -> Result<(naga::Module, naga::valid::ModuleInfo)> {
        let code = self.code()?;
        let module = naga::front::wgsl::parse_str(&code)
            .map_err(|e| anyhow!("{}: {}", self.name, e.emit_to_string(&code)))?;
        let info = validator()
            .validate(&module)
            .map_err(|e| anyhow!("{}: {e:?}", self.name))?;
        let mut constants = naga::back::PipelineConstants::default();
        for (k, v) in &self.constants {
            constants.insert(k.to_string(), *v);
        }
        let (module, info) = naga::back::pipeline_constants::process_overrides(
            &module,
            &info,
            Some((naga::ShaderStage::Compute, self.name)),
            &constants,
        )
        .map_err(|e| anyhow!("{}: resolving its override constants: {e}", self.name))?;
        Ok((module.into_owned(), info.into_owned()))
    }

    /// What the kernel needs from the device (`Needs`).
    pub fn needs(&self) -> Result<Needs> {
        let (module, info) = self.resolved()?;
        needs_of(&module, &info, self.name)
    }
}

/// What goes in front of linear_q4_coop.wgsl for matrices of `size` (8 or 16): the
/// `wgpu_cooperative_matrix` extension, the types CA (CM × CM f16 weights), CB (CM × CM f16
/// inputs) and CC (the f32 accumulator), and `CM`. `emulated` (`Spec::coop_emulated`): the same
/// names as plain WGSL with the cooperative operations' meaning (docs/WGPU.md), for adapters
/// without them (lavapipe): an A or B matrix is where it lies (offset and stride in `ws`,
/// row-major, or `xs`, column-major); a C matrix is spread over its subgroup of 32 as on the
/// hardware, lane l holding elements l · PER .. l · PER + PER − 1 (row-major), each summed in f32
/// over k; a store writes each lane's elements column-major into `cs`.
fn coop_prelude(size: u32, emulated: bool) -> String {
    if !emulated {
        return format!(
            "enable wgpu_cooperative_matrix;\nenable f16;\n\
             alias CA = coop_mat{size}x{size}<f16, A>;\nalias CB = coop_mat{size}x{size}<f16, B>;\n\
             alias CC = coop_mat{size}x{size}<f32, C>;\nconst CM: u32 = {size}u;"
        );
    }
    format!(
        "enable f16;
alias CA = vec2<u32>;
alias CB = vec2<u32>;
alias CC = array<f32, {per}>;
const CM: u32 = {size}u;
const PER: u32 = {per}u;
fn emu_load_ws_t(at: u32, stride: u32) -> CA {{
    return vec2<u32>(at, stride);
}}
fn emu_load_xs(at: u32, stride: u32) -> CB {{
    return vec2<u32>(at, stride);
}}
fn emu_mma(lane: u32, a: CA, b: CB, c: CC) -> CC {{
    var d = c;
    for (var e = 0u; e < PER; e++) {{
        let i = (lane * PER + e) / CM;
        let j = (lane * PER + e) % CM;
        for (var k = 0u; k < CM; k++) {{
            d[e] += f32(ws[a.x + i * a.y + k]) * f32(xs[b.x + j * b.y + k]);
        }}
    }}
    return d;
}}
fn emu_store_cs(lane: u32, m: CC, at: u32, stride: u32) {{
    for (var e = 0u; e < PER; e++) {{
        let i = (lane * PER + e) / CM;
        let j = (lane * PER + e) % CM;
        cs[at + j * stride + i] = m[e];
    }}
}}",
        per = size * size / 32
    )
}

/// linear_q4_coop.wgsl (`source`) with its `// <coop: …>` lines written for matrices of `size`
/// and tiles of `tt` items: `declare` the subgroup's (16 / size) × (tt / size) accumulators
/// `c{a}_{b}` (rows 16s + size · a, items size · b); `multiply` one k-slice (`kk`) of them: the A
/// matrices row-major from `ws`, the B matrices column-major from `xs`, every product;
/// `store` them column-major into `cs`. Named variables, every index and stride a `let`.
/// `emulated`: the same with `coop_prelude`'s plain functions (lane `lid % 32`).
fn coop_code(source: &str, size: u32, tt: u32, emulated: bool) -> Result<String> {
    if !(size == 8 || size == 16) || !(tt == 16 || tt == 32 || tt == 64) {
        bail!("linear_q4_coop takes matrices of 8 or 16 and tiles of 16, 32 or 64 items (not {size}, {tt})");
    }
    let (na, nb) = (16 / size, tt / size);
    let (declare, multiply) = coop_products(size, na, nb, None, emulated);
    let mut store = String::from("    let cp = CP;\n");
    for (a, b) in accumulators(na, nb) {
        let c = format!("c{a}_{b}");
        let put = if emulated {
            format!("    emu_store_cs(lid % 32u, {c}, io_{c}, cp);\n")
        } else {
            format!("    coopStore({c}, &cs[io_{c}], cp);\n")
        };
        store += &format!(
            "    let io_{c} = {}u * CP + arow + {}u;\n{put}",
            b * size,
            a * size
        );
    }
    write_markers(
        source,
        "linear_q4_coop",
        [
            ("// <coop: declare>", declare),
            ("// <coop: multiply>", multiply),
            ("// <coop: store>", store),
        ],
    )
}

/// The accumulators `c{a}_{b}` of a subgroup with `na` × `nb` of them, row-major.
fn accumulators(na: u32, nb: u32) -> Vec<(u32, u32)> {
    (0..na).flat_map(|a| (0..nb).map(move |b| (a, b))).collect()
}

/// The `declare` and `multiply` code of linear_q4_coop.wgsl and linear_q4_coop_big.wgsl: the
/// subgroup's `na` × `nb` accumulators `c{a}_{b}` of matrices of `size`; per k-slice (`kk`) the
/// A matrices row-major from `ws` at rows arow + size · a, the B matrices column-major from `xs`
/// at items size · b (after `item_base`, a WGSL expression, where given), every product. Named
/// variables, every index and stride a `let`; `emulated`: `coop_prelude`'s plain functions
/// (lane `lid % 32`).
fn coop_products(
    size: u32,
    na: u32,
    nb: u32,
    item_base: Option<&str>,
    emulated: bool,
) -> (String, String) {
    let mut declare = String::new();
    let mut multiply = String::from("            let kp = KP;\n");
    for (a, b) in accumulators(na, nb) {
        let c = format!("c{a}_{b}");
        declare += &if emulated {
            format!("    var {c}: CC;\n")
        } else {
            format!("    var {c} = CC();\n")
        };
    }
    for a in 0..na {
        let load = if emulated {
            format!("emu_load_ws_t(ia{a}, kp)")
        } else {
            format!("coopLoadT<CA>(&ws[ia{a}], kp)")
        };
        multiply += &format!(
            "            let ia{a} = (arow + {}u) * KP + kk;\n            let a{a} = {load};\n",
            a * size
        );
    }
    for b in 0..nb {
        let load = if emulated {
            format!("emu_load_xs(ib{b}, kp)")
        } else {
            format!("coopLoad<CB>(&xs[ib{b}], kp)")
        };
        let item = match item_base {
            None => format!("{}u", b * size),
            Some(base) => format!("({base} + {}u)", b * size),
        };
        multiply +=
            &format!("            let ib{b} = {item} * KP + kk;\n            let b{b} = {load};\n");
    }
    for (a, b) in accumulators(na, nb) {
        let c = format!("c{a}_{b}");
        multiply += &if emulated {
            format!("            {c} = emu_mma(lid % 32u, a{a}, b{b}, {c});\n")
        } else {
            format!("            {c} = coopMultiplyAdd(a{a}, b{b}, {c});\n")
        };
    }
    (declare, multiply)
}

/// `source` (kernel `name`) with each marker line replaced by its code.
fn write_markers<const N: usize>(
    source: &str,
    name: &str,
    codes: [(&str, String); N],
) -> Result<String> {
    let mut text = source.to_string();
    for (marker, code) in codes {
        let line = text
            .lines()
            .find(|l| l.trim() == marker)
            .with_context(|| format!("{name}.wgsl has no line `{marker}`"))?
            .to_string();
        text = text.replace(&format!("{line}\n"), &code);
    }
    Ok(text)
}

/// How linear_q4_coop_big.wgsl's subgroups (`rows` / 16 of them: four at 64 rows a workgroup,
/// eight at 128 with `coop_rows`) split a tile of `tt` items on matrices of `size`: `si` blocks
/// across the items (2 where half the tile is at least one matrix wide, else 1), so
/// subgroups / si across the `rows` rows, each of `rs` rows × `is` items; its accumulators go
/// out in `passes` passes of `cr` rows (2 where a subgroup has two rows of accumulators or more,
/// so that `cs` holds half the rows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BigLayout {
    /// Rows a workgroup (`RT`: 64, or 128), its invocations twice that (`WG`).
    pub rows: u32,
    pub si: u32,
    pub rs: u32,
    pub is: u32,
    pub passes: u32,
    pub cr: u32,
}

impl BigLayout {
    pub fn new(size: u32, tt: u32, rows: u32) -> BigLayout {
        let subgroups = rows / 16;
        let si = if tt / 2 >= size { 2 } else { 1 };
        let rs = rows / (subgroups / si);
        let passes = if rs / size >= 2 { 2 } else { 1 };
        BigLayout {
            rows,
            si,
            rs,
            is: tt / si,
            passes,
            cr: rows / passes,
        }
    }
}

/// linear_q4_coop_big.wgsl (`source`) with its `// <coop: …>` lines written for matrices of
/// `size` and tiles of `tt` items (`BigLayout`): `layout` its constants; `declare` the
/// subgroup's (rs / size) × (is / size) accumulators `c{a}_{b}` (rows arow + size · a, items
/// aitem + size · b); `multiply` one k-slice (`kk`) of them, as `coop_code`'s; `store` them pass
/// by pass (accumulator rows a of pass a / (rs / size / passes)) column-major into `cs` at the
/// pass's rows (crow + size · (a mod rows a pass)), each pass followed by `write_out`.
/// `emulated`: the same with `coop_prelude`'s plain functions (lane `lid % 32`).
fn coop_big_code(source: &str, size: u32, tt: u32, rows: u32, emulated: bool) -> Result<String> {
    if !(size == 8 || size == 16) || !(tt == 16 || tt == 32 || tt == 64) {
        bail!("linear_q4_coop_big takes matrices of 8 or 16 and tiles of 16, 32 or 64 items (not {size}, {tt})");
    }
    if !(rows == 64 || rows == 128) {
        bail!("linear_q4_coop_big takes 64 or 128 rows a workgroup (not {rows})");
    }
    let l = BigLayout::new(size, tt, rows);
    let (na, nb) = (l.rs / size, l.is / size);
    let per_pass = na / l.passes;
    let layout = format!(
        "const RT: u32 = {}u;   // rows a workgroup (Spec::mm_rows on the host)\n\
         const WG: u32 = {}u;   // invocations a workgroup (2 · RT)\n\
         const SI: u32 = {}u;   // subgroup blocks across the items\n\
         const RS: u32 = {}u;   // rows a subgroup block\n\
         const IS: u32 = {}u;   // items a subgroup block\n\
         const PASSES: u32 = {}u;   // passes writing out the accumulators\n\
         const CR: u32 = {}u;   // rows in cs a pass\n",
        l.rows,
        2 * l.rows,
        l.si,
        l.rs,
        l.is,
        l.passes,
        l.cr
    );
    let (declare, multiply) = coop_products(size, na, nb, Some("aitem"), emulated);
    let mut store = String::from("    let cp = CSP;\n");
    for h in 0..l.passes {
        for (a, b) in accumulators(na, nb)
            .into_iter()
            .filter(|(a, _)| a / per_pass == h)
        {
            let c = format!("c{a}_{b}");
            let put = if emulated {
                format!("    emu_store_cs(lid % 32u, {c}, io_{c}, cp);\n")
            } else {
                format!("    coopStore({c}, &cs[io_{c}], cp);\n")
            };
            store += &format!(
                "    let io_{c} = (aitem + {}u) * CSP + crow + {}u;\n{put}",
                b * size,
                (a % per_pass) * size
            );
        }
        store += &format!("    write_out({h}u, block, lid, nt);\n");
    }
    write_markers(
        source,
        "linear_q4_coop_big",
        [
            ("// <coop: layout>", layout),
            ("// <coop: declare>", declare),
            ("// <coop: multiply>", multiply),
            ("// <coop: store>", store),
        ],
    )
}

/// A validator allowing every capability (the device's features are checked by wgpu).
pub fn validator() -> naga::valid::Validator {
    naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        naga::valid::Capabilities::all(),
    )
}

/// What a kernel instance needs from the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Needs {
    /// Workgroup memory of the variables the entry point uses, each rounded up to 16 bytes (as
    /// Metal allocates threadgroup memory).
    pub workgroup_bytes: u64,
    /// Invocations per workgroup.
    pub invocations: u32,
    /// Storage buffers bound.
    pub storage_buffers: u32,
}

impl Needs {
    /// Why this kernel does not fit `limits`, or None where it does.
    pub fn exceeds(&self, limits: &wgpu::Limits) -> Option<String> {
        if self.workgroup_bytes > limits.max_compute_workgroup_storage_size as u64 {
            return Some(format!(
                "{} bytes of workgroup memory, above the device's {}",
                self.workgroup_bytes, limits.max_compute_workgroup_storage_size
            ));
        }
        if self.invocations > limits.max_compute_invocations_per_workgroup {
            return Some(format!(
                "{} invocations a workgroup, above the device's {}",
                self.invocations, limits.max_compute_invocations_per_workgroup
            ));
        }
        if self.storage_buffers > limits.max_storage_buffers_per_shader_stage {
            return Some(format!(
                "{} storage buffers, above the device's {}",
                self.storage_buffers, limits.max_storage_buffers_per_shader_stage
            ));
        }
        None
    }
}

/// `Needs` of entry point `name` of a resolved module.
pub fn needs_of(
    module: &naga::Module,
    info: &naga::valid::ModuleInfo,
    name: &str,
) -> Result<Needs> {
    let ep = module
        .entry_points
        .iter()
        .position(|e| e.name == name)
        .with_context(|| format!("{name}: no entry point {name}"))?;
    let uses = info.get_entry_point(ep);
    let mut layouter = naga::proc::Layouter::default();
    layouter
        .update(module.to_ctx())
        .map_err(|e| anyhow!("{name}: laying out its types: {e}"))?;
    let (mut workgroup_bytes, mut storage_buffers) = (0u64, 0u32);
    for (handle, var) in module.global_variables.iter() {
        if uses[handle].is_empty() {
            continue;
        }
        match var.space {
            naga::AddressSpace::WorkGroup => {
                workgroup_bytes += (layouter[var.ty].size as u64).div_ceil(16) * 16;
            }
            naga::AddressSpace::Storage { .. } => storage_buffers += 1,
            _ => {}
        }
    }
    let [x, y, z] = module.entry_points[ep].workgroup_size;
    if module.entry_points[ep].workgroup_size_overrides.is_some() {
        bail!("{name}: its workgroup size is still an override after resolving");
    }
    Ok(Needs {
        workgroup_bytes,
        invocations: x * y * z,
        storage_buffers,
    })
}
