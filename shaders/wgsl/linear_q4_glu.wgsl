// act = silu(Wg x) ⊙ (Wu x): linear_q4.wgsl over a gate and an up matrix of the same shape and
// slice layout at once (a decode step's experts or shared expert: one dispatch instead of gate,
// up and swiglu), each invocation streaming its row of both. `accumulate` is ignored.
//
// What follows is linear_q4's description: y = W x for the common case, MLX affine 4-bit with groups of a multiple of 32
// (every matrix of the MLX checkpoints): each invocation reads 16 bytes of W at a time (32
// weights of one group) and the 32 matching inputs as 8 vec4, so 8 invocations sharing a row
// stream 128 contiguous bytes per step. Same parameters, bindings and slice layout as
// linear.wgsl (the host picks this kernel when bits = 4, group % 32 = 0, cols % 32 = 0 and the
// input offsets are multiples of 4).

@group(0) @binding(0) var<uniform> p: Mat;
@group(0) @binding(1) var<storage, read> W: array<vec4<u32>>;   // gate
@group(0) @binding(2) var<storage, read> X: array<ACT4>;
@group(0) @binding(3) var<storage, read_write> Y: array<ACT>;
@group(0) @binding(4) var<storage, read> ids: array<u32>;
@group(0) @binding(5) var<storage, read> Wu: array<vec4<u32>>;  // up

var<workgroup> wg_expert: u32;
var<workgroup> wg_part_u: array<f32, 64>;

// bf16 number i (in halves from the start of W).
fn w_half4(i: u32) -> f32 {
    return bf16_at(W[i >> 3u][(i >> 1u) & 3u], i);
}

fn u_half4(i: u32) -> f32 {
    return bf16_at(Wu[i >> 3u][(i >> 1u) & 3u], i);
}


// (gate, up): scale · Σ q x + bias · Σ x over the 32 weights of quad q of a row of each matrix
// (16 bytes `wg` of the gate, `wu` of up), whose inputs start at vec4 `xb` and whose groups start
// at half `hbase`; the inputs are read once for both.
fn quad2(wg: vec4<u32>, wu: vec4<u32>, xb: u32, hbase: u32, q: u32) -> vec2<f32> {
    let x = xb + q * 8u;
    let x0 = vec4<f32>(X[x]);
    let x1 = vec4<f32>(X[x + 1u]);
    let x2 = vec4<f32>(X[x + 2u]);
    let x3 = vec4<f32>(X[x + 3u]);
    let x4 = vec4<f32>(X[x + 4u]);
    let x5 = vec4<f32>(X[x + 5u]);
    let x6 = vec4<f32>(X[x + 6u]);
    let x7 = vec4<f32>(X[x + 7u]);
    let xs = xsum32(x0, x1, x2, x3, x4, x5, x6, x7);
    let g = hbase + (q * 32u) / p.group;
    let gate = w_half4(p.scale_off + g) * qdot32(wg, x0, x1, x2, x3, x4, x5, x6, x7)
        + w_half4(p.bias_off + g) * xs;
    let up = u_half4(p.scale_off + g) * qdot32(wu, x0, x1, x2, x3, x4, x5, x6, x7)
        + u_half4(p.bias_off + g) * xs;
    return vec2<f32>(gate, up);
}

const ROWS: u32 = 8u;
const LANES: u32 = 8u;

@compute @workgroup_size(64)
fn linear_q4_glu(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let block = wid.x + wid.y * p.nwx;
    let item = wid.z;
    if (block * ROWS >= p.rows) {
        return;
    }
    var slot = 0u;
    var xrow = item;
    if (p.expert_mode != 0u) {
        if (lid == 0u) {
            wg_expert = ids[item];
        }
        let e = workgroupUniformLoad(&wg_expert);
        if (e < p.e0 || e >= p.e0 + p.e_count) {
            return;
        }
        slot = e - p.e0;
        xrow = item / p.x_div;
    }
    let row = block * ROWS + lid / LANES;
    let lane = lid % LANES;
    var acc = 0.0;
    var acc_u = 0.0;
    if (row < p.rows) {
        let quads = p.cols / 32u;  // vec4<u32> per row
        let groups = p.cols / p.group;
        let qbase = (slot * p.mat_words + row * (p.cols / 8u)) / 4u;
        let hbase = (slot * p.rows + row) * groups;
        let xb = (p.x_off + xrow * p.x_stride) / 4u;
        // Four 16-byte reads of each matrix in flight per invocation while the row has them
        // (eight in all; two round trips for rows of 2,048 4-bit weights), then the rest.
        var q = lane;
        for (; q + 3u * LANES < quads; q += 4u * LANES) {
            let g0 = W[qbase + q];
            let g1 = W[qbase + q + LANES];
            let g2 = W[qbase + q + 2u * LANES];
            let g3 = W[qbase + q + 3u * LANES];
            let u0 = Wu[qbase + q];
            let u1 = Wu[qbase + q + LANES];
            let u2 = Wu[qbase + q + 2u * LANES];
            let u3 = Wu[qbase + q + 3u * LANES];
            let a = (quad2(g0, u0, xb, hbase, q) + quad2(g1, u1, xb, hbase, q + LANES))
                + (quad2(g2, u2, xb, hbase, q + 2u * LANES) + quad2(g3, u3, xb, hbase, q + 3u * LANES));
            acc += a.x;
            acc_u += a.y;
        }
        for (; q < quads; q += LANES) {
            let a = quad2(W[qbase + q], Wu[qbase + q], xb, hbase, q);
            acc += a.x;
            acc_u += a.y;
        }
    }
    wg_part[lid] = acc;
    wg_part_u[lid] = acc_u;
    workgroupBarrier();
    if (lane == 0u && row < p.rows) {
        var g = 0.0;
        var u = 0.0;
        for (var i = 0u; i < LANES; i++) {
            g += wg_part[lid + i];
            u += wg_part_u[lid + i];
        }
        Y[p.y_off + item * p.y_stride + p.row0 + row] = ACT(silu(g) * u);
    }
}
