// linear_q4_mm.wgsl on cooperative matrices (wgpu 30's `wgpu_cooperative_matrix`: Vulkan's
// VK_KHR_cooperative_matrix, tensor cores on NVIDIA; Metal's simdgroup matrices on Apple): the
// same parameters, bindings, items and launch geometry (one workgroup per 64 output rows × a
// tile of TT = 16, 32 or 64 items), so the plan swaps one kernel for the other at every launch
// site of linear_q4_mm. Y[item][row] = Σ_k W[row][k] · X[item][k], i.e. C = A · B with A the
// weights (64 rows × K), B the inputs transposed (K × TT items), C (64 × TT) in f32.
// Per step of 32 columns (one 16-byte quad of 4-bit weights a row, two of 8-bit), invocation r
// < 64 dequantises row r's 32 weights to f16 into `ws` (row-major [row][k]) and every invocation
// stages TT / 4 inputs in f16 into `xs` ([item][k]: B column-major); the next step's words are
// read while this one multiplies. Four subgroups of 32 (the workgroup is 128 invocations, and
// the plan takes this kernel only where the adapter's subgroups are 32 wide, so subgroup s is
// invocations 32s .. 32s + 31): subgroup s owns output rows 16s .. 16s + 15 and all TT items, as
// (16 / CM) × (TT / CM) accumulators of CM × CM (CM = 16 on NVIDIA Vulkan, 8 on Metal). At the
// end each subgroup stores its accumulators into `cs` ([item][row], f32) and the workgroup
// writes them out (`put_y`: item indirection of expert mode, `accumulate`, the output's type
// YS) as linear_q4_mm does. Products of f16 operands summed in f32: the same rounding of the operands
// as linear_q4_mm's f16 tiles.
// The lines `// <coop: …>` are the cooperative operations, written by the loader (shaders.rs
// `coop_code`) for this CM and TT: one named variable per accumulator, every pointer index and
// stride a `let` of its own, no array of matrices and no private array live across them (the
// forms known to work through naga's SPIR-V on NVIDIA). naga wants them in control flow uniform
// across the workgroup: every loop around them runs on constants and `p`; a subgroup's rows
// enter only as pointer offsets. (Parameters, bindings, tile_items and the dequantisation:
// mm_tile.wgsl.)
// Workgroup memory: ws 64 × 40 f16 (5 KiB) + xs TT × 40 f16 (≤ 5 KiB) + cs TT × 68 f32 (≤ 17
// KiB): 27,920 bytes at TT = 64, under Apple's 32 KiB. FLOPs 2·rows·cols per item; weights read
// once per tile of items, inputs once per 64 rows.

override TT: u32 = 64u;   // items per tile, 16, 32 or 64 (MmTile on the host)
const RT: u32 = 64u;      // rows per tile (MM_ROWS on the host)
const KP: u32 = 40u;      // a staged row's stride in f16: 32 columns + 8 (16-byte aligned)
const CP: u32 = 68u;      // cs's stride in f32: 64 rows + 4
override XS_LEN: u32 = KP * TT;
override CS_LEN: u32 = CP * TT;

var<workgroup> ws: array<f16, 2560>;   // RT × KP
var<workgroup> xs: array<f16, XS_LEN>;
var<workgroup> cs: array<f32, CS_LEN>;

// Four values into ws (row-major weights) or xs (an item's inputs) at `at`.
fn put_ws(at: u32, v: vec4<f32>) {
    ws[at] = f16(v.x);
    ws[at + 1u] = f16(v.y);
    ws[at + 2u] = f16(v.z);
    ws[at + 3u] = f16(v.w);
}

fn put_xs(at: u32, v: vec4<f32>) {
    xs[at] = f16(v.x);
    xs[at + 1u] = f16(v.y);
    xs[at + 2u] = f16(v.z);
    xs[at + 3u] = f16(v.w);
}

// An invocation's inputs of one step: up to 4 vec4 (nx4 of them), zero where `live` is false
// (an item past the tile's: its products are never stored).
struct Inputs {
    x0: vec4<f32>,
    x1: vec4<f32>,
    x2: vec4<f32>,
    x3: vec4<f32>,
}

fn read_inputs(live: bool, at: u32, nx4: u32) -> Inputs {
    var x = Inputs(vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0));
    if (live) {
        x.x0 = vec4<f32>(X[at]);
        if (nx4 > 1u) {
            x.x1 = vec4<f32>(X[at + 1u]);
        }
        if (nx4 > 2u) {
            x.x2 = vec4<f32>(X[at + 2u]);
            x.x3 = vec4<f32>(X[at + 3u]);
        }
    }
    return x;
}

@compute @workgroup_size(128)
fn linear_q4_coop(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
) {
    // The same prologue as linear_q4_mm's, inline: behind a function returning the tile, naga's
    // uniformity analysis takes the early return as non-uniform control flow for the
    // cooperative operations (and refuses the module).
    let block = wid.x + wid.y * p.m.nwx;
    if (block * RT >= p.m.rows) {
        return;
    }
    if (lid == 0u) {
        tile_info = mm_tile(wid.z);
    }
    let info = workgroupUniformLoad(&tile_info);
    let nt = info.x;
    if (info.y == 0u) {
        return;
    }
    let slot = info.y - 1u;
    let quads = p.m.cols / 32u;
    // Row `lid`'s quad (invocations 0..63), and columns 32 / ipi · part .. of item `ti` (ipi =
    // 128 / TT invocations an item, nx4 = TT / 16 vec4 each).
    let wrow = block * RT + lid;
    let wlive = lid < RT && wrow < p.m.rows;
    let eight = p.m.bits == 8u;
    let bases = row_bases(slot, wrow, wlive);
    let ipi = 128u / TT;
    let nx4 = TT / 16u;
    let ti = lid / ipi;
    let part = lid % ipi;
    let xlive = ti < nt;
    let xb = (p.m.x_off + item_input(ti, xlive) * p.m.x_stride) / 4u + part * nx4;
    let xo = ti * KP + part * 4u * nx4;
    // Step 0's reads.
    var sw = step_words(wlive, bases, 0u, eight);
    var xin = read_inputs(xlive, xb, nx4);
    // This subgroup's rows.
    let arow = (lid / 32u) * 16u;
    // <coop: declare>
    for (var q = 0u; q < quads; q++) {
        if (lid < RT) {
            // (The array is gone before the cooperative operations.)
            let cols = deq_step(sw, eight);
            for (var j = 0u; j < 8u; j++) {
                put_ws(lid * KP + 4u * j, cols[j]);
            }
        }
        put_xs(xo, xin.x0);
        if (nx4 > 1u) {
            put_xs(xo + 4u, xin.x1);
        }
        if (nx4 > 2u) {
            put_xs(xo + 8u, xin.x2);
            put_xs(xo + 12u, xin.x3);
        }
        workgroupBarrier();
        // The next step's reads, in flight while this one multiplies.
        let qn = q + 1u;
        if (qn < quads) {
            sw = step_words(wlive, bases, qn, eight);
            xin = read_inputs(xlive, xb + qn * 8u, nx4);
        }
        for (var kk = 0u; kk < 32u; kk += CM) {
            // <coop: multiply>
        }
        workgroupBarrier();
    }
    // C is [row][item]; cs holds it column-major ([item][row]) so the stores below run along
    // the rows of Y.
    // <coop: store>
    workgroupBarrier();
    let r = lid % RT;
    let row = block * RT + r;
    if (row < p.m.rows) {
        for (var t = lid / RT; t < nt; t += 2u) {
            put_y(t, row, cs[t * CP + r]);
        }
    }
}
