// h⁰ = E[token] (MODEL.md §2.1): one invocation per (column, token), dequantising the row of one
// embedding slice (same slice layout as linear.wgsl); tokens outside the slice are left alone.
// `ids` is the prompt chunk, or the token the sampler just wrote (decode never leaves the GPU).

struct P {
    cols: u32,
    bits: u32,
    group: u32,
    row0: u32,
    rows: u32,
    scale_off: u32,
    bias_off: u32,
    tokens: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> W: array<u32>;
@group(0) @binding(2) var<storage, read> ids: array<u32>;
@group(0) @binding(3) var<storage, read_write> Y: array<f32>;

fn w_half(i: u32) -> f32 {
    return bf16_at(W[i >> 1u], i);
}

@compute @workgroup_size(64)
fn embed(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.x;
    let t = gid.y;
    if (c >= p.cols || t >= p.tokens) {
        return;
    }
    let tok = ids[t];
    if (tok < p.row0 || tok >= p.row0 + p.rows) {
        return;
    }
    let r = tok - p.row0;
    var v: f32;
    if (p.bits == 16u) {
        v = w_half(r * p.cols + c);
    } else {
        let epw = 32u / p.bits;
        let word = W[r * (p.cols / epw) + c / epw];
        let q = f32((word >> ((c % epw) * p.bits)) & ((1u << p.bits) - 1u));
        let g = r * (p.cols / p.group) + c / p.group;
        v = w_half(p.scale_off + g) * q + w_half(p.bias_off + g);
    }
    Y[t * p.cols + c] = v;
}
