// linear_q4.wgsl for many items at once (prefill) as a tiled matrix product: one workgroup of
// 64 per (128 output rows, tile of up to TT = 16 items). Per step of 32 columns (one quad per
// row: 16 bytes, one group), invocation r dequantises rows r and r + 64's 32 weights into shared
// memory and the tile's 16 × 32 inputs go there too; then each invocation accumulates an 8-row ×
// 4-item block (three vec4 reads from shared memory per 32 products). The next step's weights
// and inputs are read from memory while this one computes. Weights are read once per tile of
// items, inputs once per 128 rows. With 64 rows and 4 × 4 blocks (two shared reads per 16
// products) the H200 ran these products at ≈ 23 TFLOPS (profile of main 07ac75d), which the
// shared-memory reads, not the multiply-adds, bound.
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

const TT: u32 = 16u;   // items per tile (MM_TILE on the host)
const RT: u32 = 128u;  // rows per tile (MM_ROWS_F32 on the host)

// ws[k · 32 + g]: rows 4g..4g + 3 of the tile at column k of the step; xs[k · 4 + g]: items
// 4g..4g + 3 at column k.
var<workgroup> ws: array<vec4<f32>, 1024>;
var<workgroup> xs: array<vec4<f32>, 128>;
var<workgroup> tile_items: array<u32, 16>;
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
fn linear_q4_mm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
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
    // What this invocation brings to shared memory each step: rows `lid` and `lid + 64`'s
    // quads, and columns 8·part .. 8·part + 7 of item `ti`.
    let wrow = block * RT + lid;
    let wlive = wrow < p.rows;
    let wrow1 = wrow + 64u;
    let wlive1 = wrow1 < p.rows;
    // 16-byte words per step: one at 4 bits, two at 8 (each step is 32 columns).
    let eight = p.bits == 8u;
    let wps = select(1u, 2u, eight);
    let qbase = (slot * p.mat_words + select(0u, wrow, wlive) * (p.cols * p.bits / 32u)) / 4u;
    let hbase = (slot * p.rows + select(0u, wrow, wlive)) * groups;
    let qbase1 = (slot * p.mat_words + select(0u, wrow1, wlive1) * (p.cols * p.bits / 32u)) / 4u;
    let hbase1 = (slot * p.rows + select(0u, wrow1, wlive1)) * groups;
    let ti = lid / 4u;
    let part = lid % 4u;
    let xlive = ti < nt;
    var xr = 0u;
    if (xlive) {
        xr = tile_items[ti];
        if (p.expert_mode != 0u) {
            xr = xr / p.x_div;
        }
    }
    let xb = (p.x_off + xr * p.x_stride) / 4u + part * 2u;
    // The block this invocation accumulates: rows 8·rg.., items 4·tg...
    let rg = lid / 4u;
    let tg = lid % 4u;
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
    var a4 = vec4<f32>(0.0);
    var a5 = vec4<f32>(0.0);
    var a6 = vec4<f32>(0.0);
    var a7 = vec4<f32>(0.0);
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
    var v = vec4<u32>(0u);
    var v2 = vec4<u32>(0u);
    var sc1 = 0.0;
    var bi1 = 0.0;
    if (wlive1) {
        v = W[qbase1];
        if (eight) {
            v2 = W[qbase1 + 1u];
        }
        sc1 = w_half4(p.scale_off + hbase1);
        bi1 = w_half4(p.bias_off + hbase1);
    }
    var x0 = vec4<f32>(0.0);
    var x1 = vec4<f32>(0.0);
    if (xlive) {
        x0 = X[xb];
        x1 = X[xb + 1u];
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
        var cols1 = array<vec4<f32>, 8>(
            deq(v.x, SH_LO, sc1, bi1), deq(v.x, SH_HI, sc1, bi1),
            deq(v.y, SH_LO, sc1, bi1), deq(v.y, SH_HI, sc1, bi1),
            deq(v.z, SH_LO, sc1, bi1), deq(v.z, SH_HI, sc1, bi1),
            deq(v.w, SH_LO, sc1, bi1), deq(v.w, SH_HI, sc1, bi1));
        if (eight) {
            cols1 = array<vec4<f32>, 8>(
                deq8(v.x, sc1, bi1), deq8(v.y, sc1, bi1), deq8(v.z, sc1, bi1), deq8(v.w, sc1, bi1),
                deq8(v2.x, sc1, bi1), deq8(v2.y, sc1, bi1), deq8(v2.z, sc1, bi1),
                deq8(v2.w, sc1, bi1));
        }
        let wg = lid / 4u;
        let wc = lid % 4u;
        for (var j = 0u; j < 8u; j++) {
            let c0 = cols[j];
            ws[(4u * j) * 32u + wg][wc] = c0.x;
            ws[(4u * j + 1u) * 32u + wg][wc] = c0.y;
            ws[(4u * j + 2u) * 32u + wg][wc] = c0.z;
            ws[(4u * j + 3u) * 32u + wg][wc] = c0.w;
            let c1 = cols1[j];
            ws[(4u * j) * 32u + 16u + wg][wc] = c1.x;
            ws[(4u * j + 1u) * 32u + 16u + wg][wc] = c1.y;
            ws[(4u * j + 2u) * 32u + 16u + wg][wc] = c1.z;
            ws[(4u * j + 3u) * 32u + 16u + wg][wc] = c1.w;
        }
        let k0 = part * 8u;
        let xg = ti / 4u;
        let xc = ti % 4u;
        xs[(k0) * 4u + xg][xc] = x0.x;
        xs[(k0 + 1u) * 4u + xg][xc] = x0.y;
        xs[(k0 + 2u) * 4u + xg][xc] = x0.z;
        xs[(k0 + 3u) * 4u + xg][xc] = x0.w;
        xs[(k0 + 4u) * 4u + xg][xc] = x1.x;
        xs[(k0 + 5u) * 4u + xg][xc] = x1.y;
        xs[(k0 + 6u) * 4u + xg][xc] = x1.z;
        xs[(k0 + 7u) * 4u + xg][xc] = x1.w;
        workgroupBarrier();
        // The next step's reads, in flight while this one computes.
        let qn = q + 1u;
        if (qn < quads) {
            let gq = (qn * 32u) / p.group;
            if (wlive) {
                w = W[qbase + qn * wps];
                if (eight) {
                    w2 = W[qbase + qn * wps + 1u];
                }
                sc = w_half4(p.scale_off + hbase + gq);
                bi = w_half4(p.bias_off + hbase + gq);
            }
            if (wlive1) {
                v = W[qbase1 + qn * wps];
                if (eight) {
                    v2 = W[qbase1 + qn * wps + 1u];
                }
                sc1 = w_half4(p.scale_off + hbase1 + gq);
                bi1 = w_half4(p.bias_off + hbase1 + gq);
            }
            if (xlive) {
                x0 = X[xb + qn * 8u];
                x1 = X[xb + qn * 8u + 1u];
            }
        }
        for (var k = 0u; k < 32u; k++) {
            let wa = ws[k * 32u + 2u * rg];
            let wb = ws[k * 32u + 2u * rg + 1u];
            let x4 = xs[k * 4u + tg];
            a0 += wa.x * x4;
            a1 += wa.y * x4;
            a2 += wa.z * x4;
            a3 += wa.w * x4;
            a4 += wb.x * x4;
            a5 += wb.y * x4;
            a6 += wb.z * x4;
            a7 += wb.w * x4;
        }
        workgroupBarrier();
    }
    var acc = array<vec4<f32>, 8>(a0, a1, a2, a3, a4, a5, a6, a7);
    for (var i = 0u; i < 8u; i++) {
        let row = block * RT + rg * 8u + i;
        if (row < p.rows) {
            let v = acc[i];
            for (var j = 0u; j < 4u; j++) {
                let t = tg * 4u + j;
                if (t < nt) {
                    let o = p.y_off + tile_items[t] * p.y_stride + p.row0 + row;
                    if (p.accumulate != 0u) {
                        Y[o] += v[j];
                    } else {
                        Y[o] = v[j];
                    }
                }
            }
        }
    }
}
