// y = W x for a matrix stored as MLX affine 4/8-bit groups (MODEL.md §3.4) or as bf16, one
// workgroup per (8 output rows, item), 8 invocations per row. An item is a token (plain mode) or a (token, routed expert)
// pair whose expert id is read from `ids` (expert mode: only matrices of this slice's experts).
//
// W is one weight slice (lily-wgpu/src/weights.rs): packed words of `count` rows or expert
// matrices, then their bf16 scales, then their biases, at half-word offsets scale_off/bias_off.
// Per group: y += scale · Σ qᵢxᵢ + bias · Σ xᵢ (the CPU's fused dot, cpu/linear.rs).
// Bytes: the slice's rows once per item; FLOPs: 2 · rows · cols per item.

@group(0) @binding(0) var<uniform> p: Mat;
@group(0) @binding(1) var<storage, read> W: array<u32>;
@group(0) @binding(2) var<storage, read> X: array<XS>;
@group(0) @binding(3) var<storage, read_write> Y: array<YS>;
@group(0) @binding(4) var<storage, read> ids: array<u32>;

var<workgroup> wg_expert: u32;

fn w_half(i: u32) -> f32 {
    return bf16_at(W[i >> 1u], i);
}

const ROWS: u32 = 8u;  // rows per workgroup; LANES = 64 / ROWS invocations share a row
const LANES: u32 = 8u;

@compute @workgroup_size(64)
fn linear(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
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
        let words = p.cols * p.bits / 32u;
        let epw = 32u / p.bits;
        let groups = p.cols / p.group;
        let wbase = slot * p.mat_words + row * words;
        let hbase = (slot * p.rows + row) * groups;
        let xb = p.x_off + xrow * p.x_stride;
        let mask = (1u << p.bits) - 1u;
        for (var w = lane; w < words; w += LANES) {
            let word = W[wbase + w];
            let c0 = w * epw;
            if (p.bits == 16u) {
                acc += bf16_lo(word) * f32(X[xb + c0]) + bf16_hi(word) * f32(X[xb + c0 + 1u]);
            } else {
                var qd = 0.0;
                var xs = 0.0;
                for (var j = 0u; j < epw; j++) {
                    let xv = f32(X[xb + c0 + j]);
                    qd += f32((word >> (j * p.bits)) & mask) * xv;
                    xs += xv;
                }
                let g = hbase + c0 / p.group;
                acc += w_half(p.scale_off + g) * qd + w_half(p.bias_off + g) * xs;
            }
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
