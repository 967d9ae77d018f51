enable f16;
enable wgpu_cooperative_matrix;

// linear_q4_mm.wgsl on cooperative matrices (tensor cores): the same tiles (a workgroup = 64
// output rows × up to TT = 16 items, plain or expert mode, the same parameters and grid), the
// products as 16 × 16 × 16 f16 multiply-adds into f32 accumulators. Only where the adapter has
// that configuration and subgroups of exactly 32 (the host checks, lily-wgpu/src/gpu.rs): the two
// subgroups of the workgroup own 32 rows each (two 16 × 16 accumulators).
//
// Precision: a weight is q·s + b (q the 4-bit integer, s and b the group's bf16 scale and bias).
// The matrix products take q·s in f16 (q·s has ≤ 12 significant bits: exact or rounded by at most
// 2⁻¹²) against the input split in two f16 parts, x = hi + lo (≈ 22 bits together), accumulated
// in f32; the bias term b · Σx of each group is added in f32 beside them. So the result is close
// to the fp32 kernel's (the host checks both on a random matrix at load; forward.rs).
//
// Per step of 64 columns (two quads of 32 per row): invocation r dequantises row r's 64 weights
// (q·s) into shared memory, and brings 16 columns of one item (hi, lo and their sum); the next
// step's reads are issued before this step's products.

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
const RT: u32 = 64u;   // rows per tile (MM_ROWS on the host)
// f16 row stride of ws / item stride of xh, xl: 64 columns + 8 (rows on 16-byte boundaries).
const WS: u32 = 72u;

// ws[r · WS + k]: q·s of row r, column k of the step (row-major A). xh[n · WS + k], xl: item n's
// input at column k, f16 part and remainder (column-major B). xq[n · 4 + part]: Σ x of item n
// over columns 16·part .. 16·part + 15. cs[n · 64 + r]: the products (column-major C).
var<workgroup> ws: array<f16, 4608>;
var<workgroup> xh: array<f16, 1152>;
var<workgroup> xl: array<f16, 1152>;
var<workgroup> xq: array<f32, 64>;
var<workgroup> cs: array<f32, 1024>;
var<workgroup> tile_items: array<u32, 16>;
var<workgroup> tile_info: vec2<u32>;    // (items in the tile, expert slot + 1; 0: skip)

fn w_half4(i: u32) -> f32 {
    return bf16_at(W[i >> 3u][(i >> 1u) & 3u], i);
}

// q·s of the 8 nibbles of `w`, as f16, into ws at `at`.
fn put8(at: u32, w: u32, s: f32) {
    let wv = vec4<u32>(w);
    let lo = vec4<f16>(vec4<f32>((wv >> SH_LO) & NIB) * s);
    let hi = vec4<f16>(vec4<f32>((wv >> SH_HI) & NIB) * s);
    ws[at] = lo.x;
    ws[at + 1u] = lo.y;
    ws[at + 2u] = lo.z;
    ws[at + 3u] = lo.w;
    ws[at + 4u] = hi.x;
    ws[at + 5u] = hi.y;
    ws[at + 6u] = hi.z;
    ws[at + 7u] = hi.w;
}

// Input columns at..at + 3 of an item: f16 parts into xh, remainders into xl; returns their sum.
fn put_x(at: u32, v: vec4<f32>) -> f32 {
    let h = vec4<f16>(v);
    let l = vec4<f16>(v - vec4<f32>(h));
    xh[at] = h.x;
    xh[at + 1u] = h.y;
    xh[at + 2u] = h.z;
    xh[at + 3u] = h.w;
    xl[at] = l.x;
    xl[at + 1u] = l.y;
    xl[at + 2u] = l.z;
    xl[at + 3u] = l.w;
    return (v.x + v.y) + (v.z + v.w);
}

@compute @workgroup_size(64)
fn linear_q4_mm_coop(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
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
    let steps = p.cols / 64u;
    let groups = p.cols / p.group;
    // Row `lid`'s two quads per step.
    let wrow = block * RT + lid;
    let wlive = wrow < p.rows;
    let qbase = (slot * p.mat_words + select(0u, wrow, wlive) * (p.cols / 8u)) / 4u;
    let hbase = (slot * p.rows + select(0u, wrow, wlive)) * groups;
    // Columns 16·part .. 16·part + 15 of item `ti`.
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
    let xb = (p.x_off + xr * p.x_stride) / 4u + part * 4u;
    // The subgroup's rows: 32·sg .. 32·sg + 31 (host: subgroups of exactly 32).
    let sg = lid / 32u;
    var c0 = coop_mat16x16<f32, C>();
    var c1 = coop_mat16x16<f32, C>();
    // Σ_groups b · Σx for row `lid`, per item.
    var bacc = array<f32, 16>();
    // Step 0's reads.
    var w0 = vec4<u32>(0u);
    var w1 = vec4<u32>(0u);
    var s0 = 0.0;
    var b0 = 0.0;
    var s1 = 0.0;
    var b1 = 0.0;
    if (wlive) {
        w0 = W[qbase];
        w1 = W[qbase + 1u];
        let g1 = hbase + 32u / p.group;
        s0 = w_half4(p.scale_off + hbase);
        b0 = w_half4(p.bias_off + hbase);
        s1 = w_half4(p.scale_off + g1);
        b1 = w_half4(p.bias_off + g1);
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
    for (var st = 0u; st < steps; st++) {
        let wa = lid * WS;
        put8(wa, w0.x, s0);
        put8(wa + 8u, w0.y, s0);
        put8(wa + 16u, w0.z, s0);
        put8(wa + 24u, w0.w, s0);
        put8(wa + 32u, w1.x, s1);
        put8(wa + 40u, w1.y, s1);
        put8(wa + 48u, w1.z, s1);
        put8(wa + 56u, w1.w, s1);
        let xa = ti * WS + part * 16u;
        let sx = (put_x(xa, x0) + put_x(xa + 4u, x1)) + (put_x(xa + 8u, x2) + put_x(xa + 12u, x3));
        xq[lid] = sx;
        let bq0 = b0;
        let bq1 = b1;
        workgroupBarrier();
        // The next step's reads, in flight while this one computes.
        let sn = st + 1u;
        if (sn < steps) {
            if (wlive) {
                w0 = W[qbase + 2u * sn];
                w1 = W[qbase + 2u * sn + 1u];
                let g0 = hbase + (sn * 64u) / p.group;
                let g1 = hbase + (sn * 64u + 32u) / p.group;
                s0 = w_half4(p.scale_off + g0);
                b0 = w_half4(p.bias_off + g0);
                s1 = w_half4(p.scale_off + g1);
                b1 = w_half4(p.bias_off + g1);
            }
            if (xlive) {
                let o = xb + sn * 16u;
                x0 = X[o];
                x1 = X[o + 1u];
                x2 = X[o + 2u];
                x3 = X[o + 3u];
            }
        }
        for (var k = 0u; k < 4u; k++) {
            let bh = coopLoad<coop_mat16x16<f16, B>>(&xh[k * 16u], WS);
            let bl = coopLoad<coop_mat16x16<f16, B>>(&xl[k * 16u], WS);
            let a0 = coopLoadT<coop_mat16x16<f16, A>>(&ws[(sg * 32u) * WS + k * 16u], WS);
            let a1 = coopLoadT<coop_mat16x16<f16, A>>(&ws[(sg * 32u + 16u) * WS + k * 16u], WS);
            c0 = coopMultiplyAdd(a0, bh, c0);
            c1 = coopMultiplyAdd(a1, bh, c1);
            c0 = coopMultiplyAdd(a0, bl, c0);
            c1 = coopMultiplyAdd(a1, bl, c1);
        }
        for (var n = 0u; n < 16u; n++) {
            let q = n * 4u;
            bacc[n] += bq0 * (xq[q] + xq[q + 1u]) + bq1 * (xq[q + 2u] + xq[q + 3u]);
        }
        workgroupBarrier();
    }
    coopStore(c0, &cs[sg * 32u], 64u);
    coopStore(c1, &cs[sg * 32u + 16u], 64u);
    workgroupBarrier();
    let row = block * RT + lid;
    if (row < p.rows) {
        for (var n = 0u; n < 16u; n++) {
            if (n < nt) {
                let v = cs[n * 64u + lid] + bacc[n];
                let o = p.y_off + tile_items[n] * p.y_stride + p.row0 + row;
                if (p.accumulate != 0u) {
                    Y[o] += v;
                } else {
                    Y[o] = v;
                }
            }
        }
    }
}
