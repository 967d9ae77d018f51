enable f16;
enable wgpu_cooperative_matrix;

// linear_q4_mm.wgsl on cooperative matrices (tensor cores): a workgroup = 64 output rows × a tile
// of up to TT = 32 items (plain mode: items 32·z..; expert mode: entry z of moe_group.wgsl's
// tile list, which the host makes with tiles of 32 for this kernel), the same parameters as
// linear_q4_mm.wgsl; the products as 16 × 16 × 16 f16 multiply-adds into f32 accumulators. Only
// where the adapter has that configuration and subgroups of exactly 32 (the host checks,
// lily-wgpu/src/gpu.rs): each of the two subgroups owns 32 rows × 32 items (four accumulators).
//
// Precision: a weight is q·s + b (q the 4-bit integer, s and b the group's bf16 scale and bias)
// = (q − 8)·s + (b + 8·s). The matrix products take (q − 8)·s in f16: |q − 8| ≤ 8 has at most 3
// significant bits and s 8 (bf16), so the product is exact in f16 wherever it is a normal f16
// (q·s itself can need 12 bits and rounded by up to 2⁻¹¹: ≈ 4.5e-4 relative on the H200's probe).
// The input is split in two f16 parts, x = hi + lo (≈ 22 bits together), accumulated in f32;
// the bias term (b + 8·s) · Σx of each group is added in f32 beside them. So the result is close
// to the fp32 kernel's (the host checks it against its own product at load; forward.rs).
//
// The bias sums live in workgroup memory (bs: each invocation its own 32 slots): the form with a
// private array of 32 f32 beside the four accumulators computed garbage on the H200 (3.5e2
// relative, changing between runs). kernels.rs `coop_variants` makes the other forms the
// backend tries at load from the sections between `// <name>` and `// </name>` below.
//
// Per step of 64 columns (two quads of 32 per row): invocation r dequantises row r's 64 weights
// (q·s) into shared memory, and brings one quad of one item (hi, lo and their sum); the next
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

const TT: u32 = 32u;   // items per tile (MM_TILE_COOP on the host)
const RT: u32 = 64u;   // rows per tile (MM_ROWS on the host)
// f16 row stride of ws / item stride of xh, xl: 64 columns + 8 (rows on 16-byte boundaries).
const WS: u32 = 72u;

// ws[r · WS + k]: q·s of row r, column k of the step (row-major A). xh[n · WS + k], xl: item n's
// input at column k, f16 part and remainder (column-major B). xq[n · 2 + h]: Σ x of item n over
// quad h of the step. cs[n · 64 + r]: the products (column-major C). bs[n · 64 + r]: row r's
// bias terms Σ (b + 8·s) · Σx for item n.
var<workgroup> ws: array<f16, 4608>;
var<workgroup> xh: array<f16, 2304>;
var<workgroup> xl: array<f16, 2304>;
var<workgroup> xq: array<f32, 64>;
var<workgroup> cs: array<f32, 2048>;
var<workgroup> bs: array<f32, 2048>;
var<workgroup> tile_items: array<u32, 32>;
var<workgroup> tile_info: vec2<u32>;    // (items in the tile, expert slot + 1; 0: skip)

fn w_half4(i: u32) -> f32 {
    return bf16_at(W[i >> 3u][(i >> 1u) & 3u], i);
}

// (q − 8)·s of the 8 nibbles of `w`, as f16 (exact), into ws at `at`.
// <put8>
fn put8(at: u32, w: u32, s: f32) {
    let wv = vec4<u32>(w);
    let lo = vec4<f16>((vec4<f32>((wv >> SH_LO) & NIB) - vec4<f32>(8.0)) * s);
    let hi = vec4<f16>((vec4<f32>((wv >> SH_HI) & NIB) - vec4<f32>(8.0)) * s);
    ws[at] = lo.x;
    ws[at + 1u] = lo.y;
    ws[at + 2u] = lo.z;
    ws[at + 3u] = lo.w;
    ws[at + 4u] = hi.x;
    ws[at + 5u] = hi.y;
    ws[at + 6u] = hi.z;
    ws[at + 7u] = hi.w;
}
// </put8>

// Input columns at..at + 3 of an item: f16 parts into xh, remainders into xl; returns their sum.
// <put_x>
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
// </put_x>

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
    // Quad `half` (columns 32·half .. 32·half + 31 of the step) of item `ti`.
    let ti = lid / 2u;
    let half = lid % 2u;
    let xlive = ti < nt;
    var xr = 0u;
    if (xlive) {
        xr = tile_items[ti];
        if (p.expert_mode != 0u) {
            xr = xr / p.x_div;
        }
    }
    let xb = (p.x_off + xr * p.x_stride) / 4u + half * 8u;
    // The subgroup's rows: 32·sg .. 32·sg + 31 (host: subgroups of exactly 32); accumulator
    // c_ij holds rows 32·sg + 16·i.., items 16·j...
    let sg = lid / 32u;
    var c00 = coop_mat16x16<f32, C>();
    var c01 = coop_mat16x16<f32, C>();
    var c10 = coop_mat16x16<f32, C>();
    var c11 = coop_mat16x16<f32, C>();
    for (var n = 0u; n < 32u; n++) {
        bs[n * 64u + lid] = 0.0;
    }
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
    // <load_x>
    var x = array<vec4<f32>, 8>();
    if (xlive) {
        for (var i = 0u; i < 8u; i++) {
            x[i] = X[xb + i];
        }
    }
    // </load_x>
    for (var st = 0u; st < steps; st++) {
        // <read_w>
        // </read_w>
        // <stage_w>
        let wa = lid * WS;
        put8(wa, w0.x, s0);
        put8(wa + 8u, w0.y, s0);
        put8(wa + 16u, w0.z, s0);
        put8(wa + 24u, w0.w, s0);
        put8(wa + 32u, w1.x, s1);
        put8(wa + 40u, w1.y, s1);
        put8(wa + 48u, w1.z, s1);
        put8(wa + 56u, w1.w, s1);
        // </stage_w>
        // <stage_x>
        let xa = ti * WS + half * 32u;
        var sx = 0.0;
        for (var i = 0u; i < 8u; i++) {
            sx += put_x(xa + 4u * i, x[i]);
        }
        xq[lid] = sx;
        // </stage_x>
        let bq0 = b0 + 8.0 * s0;
        let bq1 = b1 + 8.0 * s1;
        workgroupBarrier();
        // The next step's reads, in flight while this one computes.
        // <prefetch>
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
                for (var i = 0u; i < 8u; i++) {
                    x[i] = X[o + i];
                }
            }
        }
        // </prefetch>
        // <products>
        for (var k = 0u; k < 4u; k++) {
            let a0 = coopLoadT<coop_mat16x16<f16, A>>(&ws[(sg * 32u) * WS + k * 16u], WS);
            let a1 = coopLoadT<coop_mat16x16<f16, A>>(&ws[(sg * 32u + 16u) * WS + k * 16u], WS);
            let h0 = coopLoad<coop_mat16x16<f16, B>>(&xh[k * 16u], WS);
            let h1 = coopLoad<coop_mat16x16<f16, B>>(&xh[16u * WS + k * 16u], WS);
            c00 = coopMultiplyAdd(a0, h0, c00);
            c01 = coopMultiplyAdd(a0, h1, c01);
            c10 = coopMultiplyAdd(a1, h0, c10);
            c11 = coopMultiplyAdd(a1, h1, c11);
            let l0 = coopLoad<coop_mat16x16<f16, B>>(&xl[k * 16u], WS);
            let l1 = coopLoad<coop_mat16x16<f16, B>>(&xl[16u * WS + k * 16u], WS);
            c00 = coopMultiplyAdd(a0, l0, c00);
            c01 = coopMultiplyAdd(a0, l1, c01);
            c10 = coopMultiplyAdd(a1, l0, c10);
            c11 = coopMultiplyAdd(a1, l1, c11);
        }
        // </products>
        for (var n = 0u; n < 32u; n++) {
            bs[n * 64u + lid] += bq0 * xq[2u * n] + bq1 * xq[2u * n + 1u];
        }
        workgroupBarrier();
    }
    coopStore(c00, &cs[sg * 32u], 64u);
    coopStore(c10, &cs[sg * 32u + 16u], 64u);
    coopStore(c01, &cs[1024u + sg * 32u], 64u);
    coopStore(c11, &cs[1024u + sg * 32u + 16u], 64u);
    workgroupBarrier();
    let row = block * RT + lid;
    if (row < p.rows) {
        for (var n = 0u; n < 32u; n++) {
            if (n < nt) {
                let v = cs[n * 64u + lid] + bs[n * 64u + lid];
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
