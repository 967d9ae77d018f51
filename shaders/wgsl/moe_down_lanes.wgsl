// moe_down_rows.wgsl with one item a lane (`WgpuOptions::down_item_lanes`): a decode step's down
// projections of a token's TOPK items and their weighted sum into the residual,
// x[r] += Σ_k w_k · (down_{e_k} a_k)[r], for the RB rows r0 .. r0 + RB − 1 of a workgroup
// (the same parameters, bindings and grid as moe_down_rows: moe_down_item.wgsl, in front).
//
// Shapes (the full model): TOPK 9 items (8 routed + the stacked shared expert), COLS 512 = QN 16
// quads of 32 columns, RB 2 rows, 2,048 rows: 1,024 workgroups a token. moe_down_rows puts the 9
// items on 64 lanes, 4 slots of 16 quads, so slot 0 takes items 0, 4 and 8 and (with `ROUNDS`)
// asks for item 8's words only after item 0's have come back: after the ids, two memory trips in
// series, then `row_total`'s barriers, then the residual's read (a third trip) before its store.
// Here a workgroup has WG ≥ TOPK · QN lanes (144 → 160: 5 warps, not 2), lane (k, q) = (lid / QN,
// lid % QN) reads quad q of item k alone: after the ids, **one** trip for every item, and the
// residual's element is read by its storing lane at the start, beside the ids. A lane holds one
// item's reads (8 vec4 of input, RB words, 2·RB halves), not two as `ROUNDS` does.
//
// Bytes a workgroup (unchanged): TOPK × RB rows × 256 B of words + scales, TOPK × 2 KB of inputs
// (L2), 2 × TOPK ids and weights; FLOPs ≈ 2 · TOPK · COLS · RB.
//
// The sums: lane (k, q) forms item k's term c_k = w_k (s · (q · x) + b · Σx) for each row, exactly
// as moe_down_rows does; after one barrier the first 64 lanes add their slot's items' terms in
// moe_down_rows' order (items slot, slot + 64 / QN, …) and the row's 64 partials meet in
// `row_total`'s order: the same additions in the same order as moe_down_rows (bit for bit where
// the driver contracts neither kernel's `acc + w · (…)` into one fused multiply-add: lavapipe;
// NVIDIA's Vulkan driver gives the same sums within rounding, not bit for bit: session 31).

// Invocations a workgroup: TOPK · QN rounded up to whole subgroups of 32, at least 64 (the row
// totals' 64 partials), at most 256 (`plan::down_lanes_spec`).
override WG: u32 = 160u;

// Each lane's terms of the RB rows, [RB][256] (8 KB at RB 8; 1.3 KB used on the full model).
var<workgroup> item_part: array<f32, 2048>;

// `row_total` (common.wgsl) where the workgroup is wider than the 64 invocations holding the
// partials: the same sums in the same order, the other invocations at the barriers only.
fn row_total_of_64(lid: u32, rb: u32) -> f32 {
    workgroupBarrier();
    let pr = 64u / rb;
    let r = lid / pr;
    let k = lid % pr;
    var t = 0.0;
    if (lid < 64u) {
        for (var i = 0u; i < rb; i++) {
            t += row_part[r * 65u + k * rb + i];
        }
    }
    workgroupBarrier();
    if (lid < 64u) {
        row_part[r * 65u + k] = t;
    }
    workgroupBarrier();
    var total = 0.0;
    if (lid < 64u && k == 0u) {
        for (var i = 0u; i < pr; i++) {
            total += row_part[r * 65u + i];
        }
    }
    return total;
}

@compute @workgroup_size(WG)
fn moe_down_lanes(@builtin(workgroup_id) wid: vec3<u32>, lanes_in: Lanes) {
    lanes_init(lanes_in);
    let lid = lanes_in.lid;
    let block = wid.x + wid.y * p.nwx;
    let t = wid.z;
    let r0 = block * RB;
    if (r0 >= p.rows) {
        return;
    }
    let qn = COLS / 32u;
    let ns = 64u / qn;
    let nr = min(RB, p.rows - r0);
    // The storing lanes (as moe_down_rows': the first of each row's group of 64 / RB) read their
    // residual element now, so that no memory trip follows the totals.
    let sr = lid / (64u / RB);
    let stores = lid < 64u && lid % (64u / RB) == 0u && sr < nr;
    var x_old = 0.0;
    if (stores) {
        x_old = X[t * p.rows + r0 + sr];
    }
    // Lane (k, q): item k's quad q, all of its reads in one trip after its id.
    let k = lid / qn;
    let q = lid % qn;
    let g = (q * 32u) / p.group;
    if (k < TOPK) {
        let e = ids[t * TOPK + k];
        let it = down_read(t, k, e, wts[t * TOPK + k], q, g, r0, nr);
        let xs = xsum32(it.x[0], it.x[1], it.x[2], it.x[3], it.x[4], it.x[5], it.x[6], it.x[7]);
        var c = array<f32, 8>();
        for (var j = 0u; j < RB; j++) {
            c[j] = it.wk * (it.s[j] * qdot32(it.w[j], it.x[0], it.x[1], it.x[2], it.x[3],
                it.x[4], it.x[5], it.x[6], it.x[7]) + it.b[j] * xs);
        }
        for (var j = 0u; j < RB; j++) {
            item_part[j * 256u + lid] = c[j];
        }
    }
    workgroupBarrier();
    // moe_down_rows' slot sums: lane (slot, q) of the first 64 adds items slot, slot + ns, … .
    if (lid < 64u) {
        let slot = lid / qn;
        var acc = array<f32, 8>();
        for (var i = 0u; i < 16u; i++) {
            let kk = slot + i * ns;
            if (kk >= TOPK) {
                break;
            }
            for (var j = 0u; j < RB; j++) {
                acc[j] += item_part[j * 256u + kk * qn + q];
            }
        }
        for (var j = 0u; j < RB; j++) {
            row_put(lid, j, acc[j]);
        }
    }
    let total = row_total_of_64(lid, RB);
    if (stores) {
        X[t * p.rows + r0 + sr] = x_old + total;
    }
}
