// linear_q4.wgsl for many items at once (prefill) as a tiled matrix product: one workgroup of
// 64 per (64 output rows, tile of up to TT items; TT = 16, 32 or 64 ≤ TMAX, an override: the
// plan's `MmTile`). The tiles' element type is `TS` (tile_f32.wgsl or
// tile_f16.wgsl in front: f16 where the device has SHADER_F16 and the plan's `f16_tiles` is on),
// each element converted to f32 as it is read back: the sums are f32 in both forms. Per step of 32 columns (one quad per row: 16 bytes, one group), invocation r
// dequantises row r's 32 weights into shared memory and the tile's TT × 32 inputs go there too;
// then each invocation accumulates a 4-row × TT/4-item block (vec4 reads of both from shared
// memory: at TT = 64 five reads per 64 multiply-adds, at 32 three per 32, at 16 two per 16). The next step's
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

override TT: u32 = 16u;   // items per tile, 16, 32 or 64 ≤ TMAX (MmTile on the host)
override XS_LEN: u32 = 8u * TT;
const RT: u32 = 64u;   // rows per tile (MM_ROWS on the host)

// ws[k · 16 + g]: rows 4g..4g + 3 of the tile at column k of the step; xs[k · TT/4 + g]: items
// 4g..4g + 3 at column k. (Parameters, bindings, tile_items and the dequantisation: mm_tile.wgsl.)
var<workgroup> ws: array<TS4, 512>;
var<workgroup> xs: array<TS4, XS_LEN>;

@compute @workgroup_size(64)
fn linear_q4_mm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
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
    // What this invocation brings to shared memory each step: row `lid`'s quad, and columns
    // TT/2 · part .. of item `ti` (64 / TT invocations an item, TT / 8 vec4 each).
    let wrow = block * RT + lid;
    let wlive = wrow < p.m.rows;
    // 16-byte words per step: one at 4 bits, two at 8 (each step is 32 columns).
    let eight = p.m.bits == 8u;
    let bases = row_bases(slot, wrow, wlive);
    let ipi = 64u / TT;
    let nx4 = TT / 8u;
    let ti = lid / ipi;
    let part = lid % ipi;
    let xlive = ti < nt;
    let xb = (p.m.x_off + item_input(ti, xlive) * p.m.x_stride) / 4u + part * nx4;
    // The block this invocation accumulates: rows 4·rg.., items nb·4·tg.. (nb vec4 of items;
    // acc[4b + i]: row 4·rg + i, items of vec4 b).
    let rg = lid / 4u;
    let tg = lid % 4u;
    let nb = TT / 16u;
    let xw = TT / 4u;
    var acc = array<vec4<f32>, TMAX / 4u>();
    // Step 0's reads.
    var sw = step_words(wlive, bases, 0u, eight);
    var xv = array<vec4<f32>, TMAX / 8u>();
    if (xlive) {
        for (var e = 0u; e < nx4; e++) {
            xv[e] = vec4<f32>(X[xb + e]);
        }
    }
    for (var q = 0u; q < quads; q++) {
        // This step's weights, dequantised, and inputs into shared memory.
        let cols = deq_step(sw, eight);
        let wg = lid / 4u;
        let wc = lid % 4u;
        for (var j = 0u; j < 8u; j++) {
            let v = cols[j];
            ws[(4u * j) * 16u + wg][wc] = TS(v.x);
            ws[(4u * j + 1u) * 16u + wg][wc] = TS(v.y);
            ws[(4u * j + 2u) * 16u + wg][wc] = TS(v.z);
            ws[(4u * j + 3u) * 16u + wg][wc] = TS(v.w);
        }
        let k0 = part * 4u * nx4;
        let xg = ti / 4u;
        let xc = ti % 4u;
        for (var e = 0u; e < nx4; e++) {
            let v = xv[e];
            let k = k0 + 4u * e;
            xs[k * xw + xg][xc] = TS(v.x);
            xs[(k + 1u) * xw + xg][xc] = TS(v.y);
            xs[(k + 2u) * xw + xg][xc] = TS(v.z);
            xs[(k + 3u) * xw + xg][xc] = TS(v.w);
        }
        workgroupBarrier();
        // The next step's reads, in flight while this one computes.
        let qn = q + 1u;
        if (qn < quads) {
            sw = step_words(wlive, bases, qn, eight);
            if (xlive) {
                for (var e = 0u; e < nx4; e++) {
                    xv[e] = vec4<f32>(X[xb + qn * 8u + e]);
                }
            }
        }
        for (var k = 0u; k < 32u; k++) {
            let w4 = vec4<f32>(ws[k * 16u + rg]);
            for (var b = 0u; b < nb; b++) {
                let x4 = vec4<f32>(xs[k * xw + nb * tg + b]);
                acc[4u * b] += w4.x * x4;
                acc[4u * b + 1u] += w4.y * x4;
                acc[4u * b + 2u] += w4.z * x4;
                acc[4u * b + 3u] += w4.w * x4;
            }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i++) {
        let row = block * RT + rg * 4u + i;
        if (row < p.m.rows) {
            for (var j = 0u; j < 4u * nb; j++) {
                let v = acc[i + 4u * (j / 4u)];
                let t = tg * 4u * nb + j;
                if (t < nt) {
                    put_y(t, row, v[j % 4u]);
                }
            }
        }
    }
}
