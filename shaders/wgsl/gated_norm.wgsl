// The DeltaNet output norm (MODEL.md §2.5 step 8): y = w ⊙ (o · rsqrt(mean(o²) + eps)) ⊙ silu(z)
// per value head; one workgroup per (token, head) row of `cols` = dv values.

struct P {
    cols: u32,
    eps: f32,
    rows: u32,
    heads: u32,      // rows per token
    z_stride: u32,   // Z: row stride (per token) and offset of head 0 (the joint in_proj output)
    z_off: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> O: array<ACT>;
@group(0) @binding(2) var<storage, read> Wn: array<f32>;
@group(0) @binding(3) var<storage, read> Z: array<ACT>;
@group(0) @binding(4) var<storage, read_write> Y: array<ACT>;

@compute @workgroup_size(64)
fn gated_norm(@builtin(workgroup_id) wid: vec3<u32>, lanes_in: Lanes) {
    lanes_init(lanes_in);
    let lid = lanes_in.lid;
    let row = wid.x + wid.y * 65535u;
    if (row >= p.rows) {
        return;
    }
    let b = row * p.cols;
    let zb = (row / p.heads) * p.z_stride + p.z_off + (row % p.heads) * p.cols;
    var ss = 0.0;
    for (var c = lid; c < p.cols; c += 64u) {
        let v = f32(O[b + c]);
        ss += v * v;
    }
    let total = wg_sum(lid, ss);
    let r = 1.0 / sqrt(total / f32(p.cols) + p.eps);
    for (var c = lid; c < p.cols; c += 64u) {
        Y[b + c] = ACT(f32(O[b + c]) * r * Wn[c] * silu(f32(Z[zb + c])));
    }
}
