// linear_q4_mm.wgsl with tiles of 32 items instead of 16 (64 rows × 32 items a workgroup of 64;
// each invocation a 4-row × 8-item block: three shared vec4 reads per 32 multiply-adds, was two
// per 16; each weight dequantised once per 32 items). Same parameters, bindings and grid
// (z: tiles of 32; expert tiles of 32 from moe_group.wgsl). On the H200 it ran the dense
// products faster (DeltaNet in_proj 73.9 → 67.4 µs a token) and the experts' tiles slower (42.5 →
// 43.9), so both kernels stay: this one for the dense products by default (`WgpuOptions::mm_t32`).
// Only the tile width differs from linear_q4_mm.wgsl; one source for both (the block width a
// constant) would change the 16-item kernel's inner loop, so it waits for an H200 A/B. The rest
// as linear_q4_mm.wgsl says:
//
// linear_q4.wgsl for many items at once (prefill) as a tiled matrix product: one workgroup of
// 64 per (64 output rows, tile of up to TT = 16 items). Per step of 32 columns (one quad per
// row: 16 bytes, one group), invocation r dequantises row r's 32 weights into shared memory and
// the tile's 16 × 32 inputs go there too; then each invocation accumulates a 4-row × 4-item
// block (vec4 reads of both from shared memory, 16 products per pair of reads). The next step's
// weights and inputs are read from memory while this one computes. Weights are read once per
// tile of items, inputs once per 64 rows. (A 128-row form with 8 × 4 register blocks, main
// 9f9f7ee, ran slower on the H200: prefill at 4K 1,956 tok/s against this one's 2,363, every
// product's time 18–25 % longer; removed.)
// An item is a token (plain mode: tile z holds items z·TT..) or a (token, routed expert) pair
// (expert mode: tile z is entry z of the tile list moe_group.wgsl wrote, items of one expert,
// dispatched indirectly). Same slice layout as linear.wgsl. FLOPs: 2·rows·cols per item.
// 8-bit matrices (the router, plain mode; groups of a multiple of 32): two 16-byte words per
// row and step (on the H200 the router's prefill pass ran one item at a time on linear_q4.wgsl,
// 152 µs per 512-token chunk).

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

const TT: u32 = 32u;   // items per tile (MM_TILE_T32 on the host)
const RT: u32 = 64u;   // rows per tile (MM_ROWS on the host, as linear_q4_mm_coop's)

// ws[k · 16 + g]: rows 4g..4g + 3 of the tile at column k of the step; xs[k · 8 + g]: items
// 4g..4g + 3 at column k.
var<workgroup> ws: array<vec4<f32>, 512>;
var<workgroup> xs: array<vec4<f32>, 256>;
var<workgroup> tile_items: array<u32, 32>;
var<workgroup> tile_info: vec2<u32>;    // (items in the tile, expert slot + 1; 0: skip)

fn w_half4(i: u32) -> f32 {
    return bf16_at(W[i >> 3u][(i >> 1u) & 3u], i);
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

@compute @workgroup_size(64)
fn linear_q4_mm_t32(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let block = wid.x + wid.y * p.nwx;
    if (block * RT >= p.rows) {
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
    let quads = p.cols / 32u;
    let groups = p.cols / p.group;
    // What this invocation brings to shared memory each step: row `lid`'s quad, and columns
    // 16·part .. 16·part + 15 of item `ti`.
    let wrow = block * RT + lid;
    let wlive = wrow < p.rows;
    // 16-byte words per step: one at 4 bits, two at 8 (each step is 32 columns).
    let eight = p.bits == 8u;
    let wps = select(1u, 2u, eight);
    let qbase = (slot * p.mat_words + select(0u, wrow, wlive) * (p.cols * p.bits / 32u)) / 4u;
    let hbase = (slot * p.rows + select(0u, wrow, wlive)) * groups;
    let ti = lid / 2u;
    let part = lid % 2u;
    let xlive = ti < nt;
    var xr = 0u;
    if (xlive) {
        xr = tile_items[ti];
        if (p.expert_mode != 0u) {
            xr = xr / p.x_div;
        }
    }
    let xb = (p.x_off + xr * p.x_stride) / 4u + part * 4u;
    // The block this invocation accumulates: rows 4·rg.., items 8·tg.. (a·: 8·tg..8·tg + 3,
    // b·: 8·tg + 4..).
    let rg = lid / 4u;
    let tg = lid % 4u;
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
    var b0 = vec4<f32>(0.0);
    var b1 = vec4<f32>(0.0);
    var b2 = vec4<f32>(0.0);
    var b3 = vec4<f32>(0.0);
    // Step 0's reads.
    var w = vec4<u32>(0u);
    var w2 = vec4<u32>(0u);
    var sc = 0.0;
    var bi = 0.0;
    if (wlive) {
        w = W[qbase];
        if (eight) {
            w2 = W[qbase + 1u];
        }
        sc = w_half4(p.scale_off + hbase);
        bi = w_half4(p.bias_off + hbase);
    }
    var x0 = vec4<f32>(0.0);
    var x1 = vec4<f32>(0.0);
    var x2 = vec4<f32>(0.0);
    var x3 = vec4<f32>(0.0);
    if (xlive) {
        x0 = X[xb];
        x1 = X[xb + 1u];
        x2 = X[xb + 2u];
        x3 = X[xb + 3u];
    }
    for (var q = 0u; q < quads; q++) {
        // This step's weights, dequantised, and inputs into shared memory.
        var cols = array<vec4<f32>, 8>(
            deq(w.x, SH_LO, sc, bi), deq(w.x, SH_HI, sc, bi),
            deq(w.y, SH_LO, sc, bi), deq(w.y, SH_HI, sc, bi),
            deq(w.z, SH_LO, sc, bi), deq(w.z, SH_HI, sc, bi),
            deq(w.w, SH_LO, sc, bi), deq(w.w, SH_HI, sc, bi));
        if (eight) {
            cols = array<vec4<f32>, 8>(
                deq8(w.x, sc, bi), deq8(w.y, sc, bi), deq8(w.z, sc, bi), deq8(w.w, sc, bi),
                deq8(w2.x, sc, bi), deq8(w2.y, sc, bi), deq8(w2.z, sc, bi), deq8(w2.w, sc, bi));
        }
        let wg = lid / 4u;
        let wc = lid % 4u;
        for (var j = 0u; j < 8u; j++) {
            let v = cols[j];
            ws[(4u * j) * 16u + wg][wc] = v.x;
            ws[(4u * j + 1u) * 16u + wg][wc] = v.y;
            ws[(4u * j + 2u) * 16u + wg][wc] = v.z;
            ws[(4u * j + 3u) * 16u + wg][wc] = v.w;
        }
        let k0 = part * 16u;
        let xg = ti / 4u;
        let xc = ti % 4u;
        let xv = array<vec4<f32>, 4>(x0, x1, x2, x3);
        for (var e = 0u; e < 4u; e++) {
            let v = xv[e];
            let k = k0 + 4u * e;
            xs[k * 8u + xg][xc] = v.x;
            xs[(k + 1u) * 8u + xg][xc] = v.y;
            xs[(k + 2u) * 8u + xg][xc] = v.z;
            xs[(k + 3u) * 8u + xg][xc] = v.w;
        }
        workgroupBarrier();
        // The next step's reads, in flight while this one computes.
        let qn = q + 1u;
        if (qn < quads) {
            if (wlive) {
                w = W[qbase + qn * wps];
                if (eight) {
                    w2 = W[qbase + qn * wps + 1u];
                }
                let g = hbase + (qn * 32u) / p.group;
                sc = w_half4(p.scale_off + g);
                bi = w_half4(p.bias_off + g);
            }
            if (xlive) {
                x0 = X[xb + qn * 8u];
                x1 = X[xb + qn * 8u + 1u];
                x2 = X[xb + qn * 8u + 2u];
                x3 = X[xb + qn * 8u + 3u];
            }
        }
        for (var k = 0u; k < 32u; k++) {
            let w4 = ws[k * 16u + rg];
            let x4 = xs[k * 8u + 2u * tg];
            let y4 = xs[k * 8u + 2u * tg + 1u];
            a0 += w4.x * x4;
            a1 += w4.y * x4;
            a2 += w4.z * x4;
            a3 += w4.w * x4;
            b0 += w4.x * y4;
            b1 += w4.y * y4;
            b2 += w4.z * y4;
            b3 += w4.w * y4;
        }
        workgroupBarrier();
    }
    var acc = array<vec4<f32>, 8>(a0, a1, a2, a3, b0, b1, b2, b3);
    for (var i = 0u; i < 4u; i++) {
        let row = block * RT + rg * 4u + i;
        if (row < p.rows) {
            for (var j = 0u; j < 8u; j++) {
                let v = acc[i + 4u * (j / 4u)];
                let t = tg * 8u + j;
                if (t < nt) {
                    let o = p.y_off + tile_items[t] * p.y_stride + p.row0 + row;
                    if (p.accumulate != 0u) {
                        Y[o] += v[j % 4u];
                    } else {
                        Y[o] = v[j % 4u];
                    }
                }
            }
        }
    }
}
