// moe_down.wgsl as linear_q4_rows.wgsl streams rows: a decode step's down projections of all
// TOPK items and their weighted sum into the residual, x[r] += Σ_k w_k · (down_{e_k} a_k)[r].
// A workgroup of 64 takes RB output rows; invocation (slot, q) = (lid / QN, lid % QN), QN =
// COLS / 32 quads a row, holds quad q of the inputs of items slot, slot + 64/QN, ... (one at a
// time) and reads that quad of the workgroup's RB rows of each item's expert (RB reads in flight;
// the QN invocations of a slot read a row's contiguous bytes). The 64 partial sums of a row meet
// through `row_put` / `row_total` (common.wgsl). main's profile on the H200
// (c7ee898): moe_down 29.5 µs a call for 4.7 MB
// (256 workgroups, each invocation 18 quads of inputs re-read per row). Same parameters and
// bindings as moe_down.wgsl; the host uses it where 64 is a multiple of COLS / 32.

// The parameters, bindings, TOPK, COLS, RB and `down_read`: moe_down_item.wgsl, in front.

// 1 (`WgpuOptions::moe_rounds`): a slot's items in rounds, item i + 1's input quad, rows and
// scales requested before item i's arithmetic (two items' reads held: `DownItem`), where 0
// requests each item's reads only after the previous item's sums (slot 0 of the full model:
// three DRAM round trips in series). The same sums in the same order: outputs bit for bit.
override ROUNDS: u32 = 0u;

@compute @workgroup_size(64)
fn moe_down_rows(@builtin(workgroup_id) wid: vec3<u32>, lanes_in: Lanes) {
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
    let slot = lid / qn;
    let q = lid % qn;
    let groups = COLS / p.group;
    let g = (q * 32u) / p.group;
    let nr = min(RB, p.rows - r0);
    var acc = array<f32, 8>();
    // This slot's items' experts and weights first, all reads in flight together.
    var es = array<u32, 16>();
    var wv = array<f32, 16>();
    for (var i = 0u; i < 16u; i++) {
        let k = slot + i * ns;
        if (k < TOPK) {
            es[i] = ids[t * TOPK + k];
            wv[i] = wts[t * TOPK + k];
        }
    }
    if (ROUNDS != 0u && slot < TOPK) {
        // Rounds: item i's arithmetic while item i + 1's reads are in flight.
        var cur = down_read(t, slot, es[0], wv[0], q, g, r0, nr);
        for (var i = 0u; i < 16u; i++) {
            let k = slot + i * ns;
            if (k >= TOPK) {
                break;
            }
            var nxt = DownItem();
            if (k + ns < TOPK && i + 1u < 16u) {
                nxt = down_read(t, k + ns, es[i + 1u], wv[i + 1u], q, g, r0, nr);
            }
            let xs = xsum32(cur.x[0], cur.x[1], cur.x[2], cur.x[3], cur.x[4], cur.x[5], cur.x[6],
                            cur.x[7]);
            for (var j = 0u; j < RB; j++) {
                acc[j] += cur.wk * (cur.s[j] * qdot32(cur.w[j], cur.x[0], cur.x[1], cur.x[2],
                    cur.x[3], cur.x[4], cur.x[5], cur.x[6], cur.x[7]) + cur.b[j] * xs);
            }
            cur = nxt;
        }
    }
    for (var i = 0u; i < 16u; i++) {
        let k = slot + i * ns;
        if (ROUNDS != 0u || k >= TOPK) {
            break;
        }
        let item = t * TOPK + k;
        let e = es[i];
        let wk = wv[i];
        let xb = item * (COLS / 4u) + q * 8u;
        let x0 = vec4<f32>(A[xb]);
        let x1 = vec4<f32>(A[xb + 1u]);
        let x2 = vec4<f32>(A[xb + 2u]);
        let x3 = vec4<f32>(A[xb + 3u]);
        let x4 = vec4<f32>(A[xb + 4u]);
        let x5 = vec4<f32>(A[xb + 5u]);
        let x6 = vec4<f32>(A[xb + 6u]);
        let x7 = vec4<f32>(A[xb + 7u]);
        let xs = xsum32(x0, x1, x2, x3, x4, x5, x6, x7);
        // Rows past the end read row r0 again (not stored).
        var w = array<vec4<u32>, 8>();
        var s = array<f32, 8>();
        var b = array<f32, 8>();
        for (var j = 0u; j < RB; j++) {
            var row = r0 + j;
            if (j >= nr) {
                row = r0;
            }
            let er = e * p.rows + row;
            w[j] = We[er * qn + q];
            s[j] = we_half(p.scale_off + er * groups + g);
            b[j] = we_half(p.bias_off + er * groups + g);
        }
        for (var j = 0u; j < RB; j++) {
            acc[j] += wk * (s[j] * qdot32(w[j], x0, x1, x2, x3, x4, x5, x6, x7) + b[j] * xs);
        }
    }
    for (var j = 0u; j < RB; j++) {
        row_put(lid, j, acc[j]);
    }
    let total = row_total(lid, RB);
    let r = lid / (64u / RB);
    if (lid % (64u / RB) == 0u && r < nr) {
        X[t * p.rows + r0 + r] += total;
    }
}
