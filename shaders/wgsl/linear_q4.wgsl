// linear.wgsl's y = W x for the common cases: MLX affine 4-bit with groups of a multiple of 32
// (every matrix of the MLX checkpoints but the router) and 8-bit with groups of a multiple of
// 16 (the router and the shared expert's gate). Each invocation reads 16 bytes of W at a time
// (32 4-bit or 16 8-bit weights of one group) and the matching inputs as vec4, so 8 invocations
// sharing a row stream 128 contiguous bytes per step. Same parameters, bindings and slice layout
// as linear.wgsl (the host picks this kernel when bits is 4 or 8, the group and the columns are
// multiples of 128 / bits and the input offsets multiples of 4).

@group(0) @binding(0) var<uniform> p: Mat;
@group(0) @binding(1) var<storage, read> W: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> X: array<XS4>;
@group(0) @binding(3) var<storage, read_write> Y: array<YS>;
@group(0) @binding(4) var<storage, read> ids: array<u32>;

var<workgroup> wg_expert: u32;

// bf16 number i (in halves from the start of W).
fn w_half4(i: u32) -> f32 {
    return bf16_at(W[i >> 3u][(i >> 1u) & 3u], i);
}


// scale · Σ q x + bias · Σ x over the 32 weights of quad q (16 bytes `w`) of a row whose inputs
// start at vec4 `xb` and whose groups start at half `hbase`.
fn quad(w: vec4<u32>, xb: u32, hbase: u32, q: u32) -> f32 {
    if (p.bits == 8u) {
        return quad8(w, xb, hbase, q);
    }
    let x = xb + q * 8u;
    let x0 = vec4<f32>(X[x]);
    let x1 = vec4<f32>(X[x + 1u]);
    let x2 = vec4<f32>(X[x + 2u]);
    let x3 = vec4<f32>(X[x + 3u]);
    let x4 = vec4<f32>(X[x + 4u]);
    let x5 = vec4<f32>(X[x + 5u]);
    let x6 = vec4<f32>(X[x + 6u]);
    let x7 = vec4<f32>(X[x + 7u]);
    let qd = qdot32(w, x0, x1, x2, x3, x4, x5, x6, x7);
    let xs = xsum32(x0, x1, x2, x3, x4, x5, x6, x7);
    let g = hbase + (q * 32u) / p.group;
    return w_half4(p.scale_off + g) * qd + w_half4(p.bias_off + g) * xs;
}

const SH_8 = vec4<u32>(0u, 8u, 16u, 24u);
const BYTE = vec4<u32>(255u);

// quad for 8-bit weights: 16 per quad (4 per word), one group (group % 16 = 0).
fn quad8(w: vec4<u32>, xb: u32, hbase: u32, q: u32) -> f32 {
    let x = xb + q * 4u;
    let x0 = vec4<f32>(X[x]);
    let x1 = vec4<f32>(X[x + 1u]);
    let x2 = vec4<f32>(X[x + 2u]);
    let x3 = vec4<f32>(X[x + 3u]);
    let qd = (dot(vec4<f32>((vec4<u32>(w.x) >> SH_8) & BYTE), x0)
        + dot(vec4<f32>((vec4<u32>(w.y) >> SH_8) & BYTE), x1))
        + (dot(vec4<f32>((vec4<u32>(w.z) >> SH_8) & BYTE), x2)
        + dot(vec4<f32>((vec4<u32>(w.w) >> SH_8) & BYTE), x3));
    let s4 = (x0 + x1) + (x2 + x3);
    let xs = (s4.x + s4.y) + (s4.z + s4.w);
    let g = hbase + (q * 16u) / p.group;
    return w_half4(p.scale_off + g) * qd + w_half4(p.bias_off + g) * xs;
}

const ROWS: u32 = 8u;
const LANES: u32 = 8u;

@compute @workgroup_size(64)
fn linear_q4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
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
    if (row < p.rows) {
        let quads = p.cols * p.bits / 128u;  // vec4<u32> per row
        let groups = p.cols / p.group;
        let qbase = (slot * p.mat_words + row * (p.cols * p.bits / 32u)) / 4u;
        let hbase = (slot * p.rows + row) * groups;
        let xb = (p.x_off + xrow * p.x_stride) / 4u;
        // Eight 16-byte reads in flight per invocation while the row has them (a decode step is
        // latency-bound: one round trip to memory for rows of 2,048 4-bit weights, two for
        // 4,096), then the rest one by one. Named values, not an array: registers everywhere.
        var q = lane;
        for (; q + 7u * LANES < quads; q += 8u * LANES) {
            let w0 = W[qbase + q];
            let w1 = W[qbase + q + LANES];
            let w2 = W[qbase + q + 2u * LANES];
            let w3 = W[qbase + q + 3u * LANES];
            let w4 = W[qbase + q + 4u * LANES];
            let w5 = W[qbase + q + 5u * LANES];
            let w6 = W[qbase + q + 6u * LANES];
            let w7 = W[qbase + q + 7u * LANES];
            acc += ((quad(w0, xb, hbase, q) + quad(w1, xb, hbase, q + LANES))
                + (quad(w2, xb, hbase, q + 2u * LANES) + quad(w3, xb, hbase, q + 3u * LANES)))
                + ((quad(w4, xb, hbase, q + 4u * LANES) + quad(w5, xb, hbase, q + 5u * LANES))
                + (quad(w6, xb, hbase, q + 6u * LANES) + quad(w7, xb, hbase, q + 7u * LANES)));
        }
        for (; q < quads; q += LANES) {
            acc += quad(W[qbase + q], xb, hbase, q);
        }
    }
    wg_part[lid] = acc;
    workgroupBarrier();
    if (lane == 0u && row < p.rows) {
        var total = 0.0;
        for (var i = 0u; i < LANES; i++) {
            total += wg_part[lid + i];
        }
        let o = p.y_off + item * p.y_stride + p.row0 + row;
        if (p.accumulate != 0u) {
            Y[o] = YS(f32(Y[o]) + total);
        } else {
            Y[o] = YS(total);
        }
    }
}
