// Shared by linear_q4_mm.wgsl and linear_q4_coop.wgsl (the loader, lily-wgpu/src/shaders.rs,
// puts it in front of those two only): their parameters and bindings, the tile's items, a row's
// words of one 32-column step and their dequantisation, an item's input row, and the output's
// store. Each kernel declares `override TT` (items per tile) itself.

struct P {
    @size(80) m: Mat,   // words 0..19 (Mat and two unused)
    items: u32,       // plain mode: items in all
    tiles_at: u32,    // expert mode: where the tile list starts in G (u32s)
    order_at: u32,    // expert mode: where the items sorted by expert start in G
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> W: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> X: array<XS4>;
@group(0) @binding(3) var<storage, read_write> Y: array<YS>;
@group(0) @binding(4) var<storage, read> G: array<u32>;

var<workgroup> tile_items: array<u32, TT>;
var<workgroup> tile_info: vec2<u32>;    // (items in the tile, expert slot + 1; 0: skip)

fn w_half4(i: u32) -> f32 {
    return bf16_at(W[i >> 3u][(i >> 1u) & 3u], i);
}

// Tile z's items into `tile_items` (plain mode: items z·TT..; expert mode: entry z of the tile
// list moe_group.wgsl wrote, items of one expert); returns `tile_info`'s value. One invocation.
fn mm_tile(z: u32) -> vec2<u32> {
    if (p.m.expert_mode == 0u) {
        let first = z * TT;
        let n = min(TT, p.items - first);
        for (var i = 0u; i < n; i++) {
            tile_items[i] = first + i;
        }
        return vec2<u32>(n, 1u);
    }
    let tb = p.tiles_at + z * 4u;
    let e = G[tb];
    let start = G[tb + 1u];
    let n = G[tb + 2u];
    for (var i = 0u; i < n; i++) {
        tile_items[i] = G[p.order_at + start + i];
    }
    var slot1 = 0u;
    if (e >= p.m.e0 && e < p.m.e0 + p.m.e_count) {
        slot1 = e - p.m.e0 + 1u;
    }
    return vec2<u32>(n, slot1);
}

fn deq(w: u32, sh: vec4<u32>, s: f32, b: f32) -> vec4<f32> {
    return vec4<f32>((vec4<u32>(w) >> sh) & NIB) * s + vec4<f32>(b);
}

const SH_8 = vec4<u32>(0u, 8u, 16u, 24u);
const BYTE = vec4<u32>(255u);

// The four 8-bit weights of word w (bits = 8: the router).
fn deq8(w: u32, s: f32, b: f32) -> vec4<f32> {
    return vec4<f32>((vec4<u32>(w) >> SH_8) & BYTE) * s + vec4<f32>(b);
}

// A row's 32 weights of one step, dequantised in column order: the 4-bit quad `w`, or the two
// 8-bit words `w`, `w2` (`eight`), with the group's scale and bias.
fn deq_step(s: StepWords, eight: bool) -> array<vec4<f32>, 8> {
    let w = s.w;
    let w2 = s.w2;
    let sc = s.sc;
    let bi = s.bi;
    if (eight) {
        return array<vec4<f32>, 8>(
            deq8(w.x, sc, bi), deq8(w.y, sc, bi), deq8(w.z, sc, bi), deq8(w.w, sc, bi),
            deq8(w2.x, sc, bi), deq8(w2.y, sc, bi), deq8(w2.z, sc, bi), deq8(w2.w, sc, bi));
    }
    return array<vec4<f32>, 8>(
        deq(w.x, SH_LO, sc, bi), deq(w.x, SH_HI, sc, bi),
        deq(w.y, SH_LO, sc, bi), deq(w.y, SH_HI, sc, bi),
        deq(w.z, SH_LO, sc, bi), deq(w.z, SH_HI, sc, bi),
        deq(w.w, SH_LO, sc, bi), deq(w.w, SH_HI, sc, bi));
}

// The words of one 32-column step of a row: its 16-byte quad (two at 8 bits: `w`, `w2`) and its
// group's scale and bias.
struct StepWords {
    w: vec4<u32>,
    w2: vec4<u32>,
    sc: f32,
    bi: f32,
}

// Where row `wrow` of expert slot `slot`'s matrix starts: its first 16-byte word in W (x) and its
// first group's scale index (y); row 0's where the row is past the matrix (`live` false).
fn row_bases(slot: u32, wrow: u32, live: bool) -> vec2<u32> {
    let r = select(0u, wrow, live);
    return vec2<u32>(
        (slot * p.m.mat_words + r * (p.m.cols * p.m.bits / 32u)) / 4u,
        (slot * p.m.rows + r) * (p.m.cols / p.m.group));
}

// Step q's words of the row at `bases` (row_bases); zero where `live` is false (a row past the
// matrix: its weights dequantise to 0).
fn step_words(live: bool, bases: vec2<u32>, q: u32, eight: bool) -> StepWords {
    var s = StepWords(vec4<u32>(0u), vec4<u32>(0u), 0.0, 0.0);
    if (live) {
        let at = bases.x + q * select(1u, 2u, eight);
        s.w = W[at];
        if (eight) {
            s.w2 = W[at + 1u];
        }
        let g = bases.y + (q * 32u) / p.m.group;
        s.sc = w_half4(p.m.scale_off + g);
        s.bi = w_half4(p.m.bias_off + g);
    }
    return s;
}

// The input row of the tile's item `ti` (expert mode: item / x_div), or 0 where `live` is false.
fn item_input(ti: u32, live: bool) -> u32 {
    var xr = 0u;
    if (live) {
        xr = tile_items[ti];
        if (p.m.expert_mode != 0u) {
            xr = xr / p.m.x_div;
        }
    }
    return xr;
}

// Output `v` of the tile's item `t` at row `row` of this slice: Y = v, or Y += v (`accumulate`).
fn put_y(t: u32, row: u32, v: f32) {
    let o = p.m.y_off + tile_items[t] * p.m.y_stride + p.m.row0 + row;
    if (p.m.accumulate != 0u) {
        Y[o] = YS(f32(Y[o]) + v);
    } else {
        Y[o] = YS(v);
    }
}
