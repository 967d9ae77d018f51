// y = x · rsqrt(mean(x²) + eps) · w per row (MODEL.md §2.2; the +1 of zero-centred norms is
// folded into w at load). One workgroup per row; rows r0.. of X go to rows 0.. of Y.

struct P {
    cols: u32,
    eps: f32,
    r0: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> X: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> Wn: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> Y: array<vec4<f32>>;

// cols % 4 = 0 (checked at load): 16-byte reads and writes.
@compute @workgroup_size(64)
fn rms_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let c4 = p.cols / 4u;
    let xb = (p.r0 + wid.x) * c4;
    let yb = wid.x * c4;
    var ss = 0.0;
    for (var c = lid; c < c4; c += 64u) {
        let v = X[xb + c];
        ss += dot(v, v);
    }
    let total = wg_sum(lid, ss);
    let r = 1.0 / sqrt(total / f32(p.cols) + p.eps);
    for (var c = lid; c < c4; c += 64u) {
        Y[yb + c] = X[xb + c] * r * Wn[c];
    }
}
