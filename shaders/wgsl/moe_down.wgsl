// A decode step's MoE output straight into the residual (MODEL.md §2.6), one dispatch instead of
// the down projections and moe_combine:
//   x[r] += Σ_k w_k · (down_{e_k} a_k)[r]
// over the token's TOPK items, the shared expert among them as expert E with weight
// sigmoid(its gate) (it rides in the routed stacks; moe_route.wgsl writes its item). The down
// stack MLX 4-bit (groups of a multiple of 32) in one slice; workgroups of 8 output rows, 8
// invocations per row, each holding the 16-byte reads of all TOPK items' rows in flight.
// Tokens along z. The host takes it where a row's quads do not divide 64 (else moe_down_rows or
// moe_down_lanes).

// The parameters, bindings, TOPK and COLS (fixed per model: the loops over items and quads have
// constant bounds and unroll, every read in flight at once): moe_down_item.wgsl, in front.

const ROWS: u32 = 8u;
const LANES: u32 = 8u;

// scale · Σ q a + bias · Σ a over quad q (32 weights) of row `row` of expert e, inputs at vec4 xb.
fn expert_quad(e: u32, row: u32, xb: u32, q: u32) -> f32 {
    let quads = p.cols / 32u;
    let w = We[(e * p.rows + row) * quads + q];
    let x = xb + q * 8u;
    let x0 = vec4<f32>(A[x]);
    let x1 = vec4<f32>(A[x + 1u]);
    let x2 = vec4<f32>(A[x + 2u]);
    let x3 = vec4<f32>(A[x + 3u]);
    let x4 = vec4<f32>(A[x + 4u]);
    let x5 = vec4<f32>(A[x + 5u]);
    let x6 = vec4<f32>(A[x + 6u]);
    let x7 = vec4<f32>(A[x + 7u]);
    let qd = qdot32(w, x0, x1, x2, x3, x4, x5, x6, x7);
    let xs = xsum32(x0, x1, x2, x3, x4, x5, x6, x7);
    let g = (e * p.rows + row) * (p.cols / p.group) + (q * 32u) / p.group;
    return we_half(p.scale_off + g) * qd + we_half(p.bias_off + g) * xs;
}

@compute @workgroup_size(64)
fn moe_down(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let block = wid.x + wid.y * p.nwx;
    let t = wid.z;
    if (block * ROWS >= p.rows) {
        return;
    }
    let row = block * ROWS + lid / LANES;
    let lane = lid % LANES;
    var acc = 0.0;
    if (row < p.rows) {
        let quads = COLS / 32u;
        for (var k = 0u; k < TOPK; k++) {
            let item = t * TOPK + k;
            let e = ids[item];
            let xb = item * (p.cols / 4u);
            var part = 0.0;
            for (var q = lane; q < quads; q += LANES) {
                part += expert_quad(e, row, xb, q);
            }
            acc += wts[item] * part;
        }
    }
    wg_part[lid] = acc;
    workgroupBarrier();
    if (lane == 0u && row < p.rows) {
        var total = 0.0;
        for (var i = 0u; i < LANES; i++) {
            total += wg_part[lid + i];
        }
        X[t * p.rows + row] += total;
    }
}
