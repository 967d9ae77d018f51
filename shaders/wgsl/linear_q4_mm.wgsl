// linear_q4.wgsl for many items at once (prefill): one workgroup per (8 output rows, tile of up
// to TT items), 8 invocations per row. Each invocation dequantises 32 weights of a quad (16
// bytes, one group) into registers once and applies them to every item of the tile, so the
// weights are read once per tile instead of once per item. An item is a token (plain mode: tile
// z holds items z·TT..) or a (token, routed expert) pair (expert mode: tile z is entry z of the
// tile list moe_group.wgsl wrote, items of one expert, dispatched indirectly).
// Same slice layout as linear.wgsl. Bytes: the slice's rows once per tile; FLOPs: 2·rows·cols
// per item.

struct P {
    rows: u32,
    cols: u32,
    bits: u32,
    group: u32,
    row0: u32,
    x_stride: u32,
    x_off: u32,
    y_stride: u32,
    y_off: u32,
    scale_off: u32,
    bias_off: u32,
    expert_mode: u32,
    e0: u32,
    e_count: u32,
    x_div: u32,
    mat_words: u32,
    nwx: u32,
    accumulate: u32,
    items: u32,       // plain mode: items in all
    tiles_at: u32,    // expert mode: where the tile list starts in G (u32s)
    order_at: u32,    // expert mode: where the items sorted by expert start in G
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> W: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> X: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> Y: array<f32>;
@group(0) @binding(4) var<storage, read> G: array<u32>;

const TT: u32 = 16u;
const ROWS: u32 = 8u;
const LANES: u32 = 8u;

var<workgroup> red: array<f32, 1024>;   // [64 invocations][TT]
var<workgroup> tile_items: array<u32, 16>;
var<workgroup> tile_info: vec2<u32>;    // (items in the tile, expert slot + 1; 0: skip)

fn w_half4(i: u32) -> f32 {
    return bf16_at(W[i >> 3u][(i >> 1u) & 3u], i);
}

const SH_LO = vec4<u32>(0u, 4u, 8u, 12u);
const SH_HI = vec4<u32>(16u, 20u, 24u, 28u);
const NIB = vec4<u32>(15u);

fn deq(w: u32, sh: vec4<u32>, s: f32, b: f32) -> vec4<f32> {
    return vec4<f32>((vec4<u32>(w) >> sh) & NIB) * s + vec4<f32>(b);
}

@compute @workgroup_size(64)
fn linear_q4_mm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let block = wid.x + wid.y * p.nwx;
    if (block * ROWS >= p.rows) {
        return;
    }
    if (lid == 0u) {
        if (p.expert_mode == 0u) {
            let first = wid.z * TT;
            let n = min(TT, p.items - first);
            for (var i = 0u; i < n; i++) {
                tile_items[i] = first + i;
            }
            tile_info = vec2<u32>(n, 1u);
        } else {
            let tb = p.tiles_at + wid.z * 4u;
            let e = G[tb];
            let start = G[tb + 1u];
            let n = G[tb + 2u];
            for (var i = 0u; i < n; i++) {
                tile_items[i] = G[p.order_at + start + i];
            }
            var slot1 = 0u;
            if (e >= p.e0 && e < p.e0 + p.e_count) {
                slot1 = e - p.e0 + 1u;
            }
            tile_info = vec2<u32>(n, slot1);
        }
    }
    let info = workgroupUniformLoad(&tile_info);
    let nt = info.x;
    if (info.y == 0u) {
        return;
    }
    let slot = info.y - 1u;
    let row = block * ROWS + lid / LANES;
    let lane = lid % LANES;
    var xb: array<u32, 16>;
    for (var tt = 0u; tt < TT; tt++) {
        var xr = 0u;
        if (tt < nt) {
            xr = tile_items[tt];
            if (p.expert_mode != 0u) {
                xr = xr / p.x_div;
            }
        }
        xb[tt] = (p.x_off + xr * p.x_stride) / 4u;
    }
    var acc: array<f32, 16>;
    for (var tt = 0u; tt < TT; tt++) {
        acc[tt] = 0.0;
    }
    if (row < p.rows) {
        let quads = p.cols / 32u;
        let groups = p.cols / p.group;
        let qbase = (slot * p.mat_words + row * (p.cols / 8u)) / 4u;
        let hbase = (slot * p.rows + row) * groups;
        for (var q = lane; q < quads; q += LANES) {
            let w = W[qbase + q];
            let g = hbase + (q * 32u) / p.group;
            let s = w_half4(p.scale_off + g);
            let b = w_half4(p.bias_off + g);
            let f0 = deq(w.x, SH_LO, s, b);
            let f1 = deq(w.x, SH_HI, s, b);
            let f2 = deq(w.y, SH_LO, s, b);
            let f3 = deq(w.y, SH_HI, s, b);
            let f4 = deq(w.z, SH_LO, s, b);
            let f5 = deq(w.z, SH_HI, s, b);
            let f6 = deq(w.w, SH_LO, s, b);
            let f7 = deq(w.w, SH_HI, s, b);
            for (var tt = 0u; tt < TT; tt++) {
                if (tt < nt) {
                    let x = xb[tt] + q * 8u;
                    acc[tt] += ((dot(f0, X[x]) + dot(f1, X[x + 1u])) + (dot(f2, X[x + 2u]) + dot(f3, X[x + 3u])))
                        + ((dot(f4, X[x + 4u]) + dot(f5, X[x + 5u])) + (dot(f6, X[x + 6u]) + dot(f7, X[x + 7u])));
                }
            }
        }
    }
    for (var tt = 0u; tt < TT; tt++) {
        red[lid * TT + tt] = acc[tt];
    }
    workgroupBarrier();
    // Invocation (row r, lane l) finishes items l and l + 8 of row r.
    let rbase = (lid / LANES) * LANES;
    for (var tt = lane; tt < nt; tt += LANES) {
        if (row < p.rows) {
            var total = 0.0;
            for (var i = 0u; i < LANES; i++) {
                total += red[(rbase + i) * TT + tt];
            }
            let o = p.y_off + tile_items[tt] * p.y_stride + p.row0 + row;
            if (p.accumulate != 0u) {
                Y[o] += total;
            } else {
                Y[o] = total;
            }
        }
    }
}
