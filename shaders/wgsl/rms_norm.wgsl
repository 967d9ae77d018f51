// y = x · rsqrt(mean(x²) + eps) · w per row (MODEL.md §2.2; the +1 of zero-centred norms is
// folded into w at load). One workgroup of 256 per row; rows r0.. of X go to rows 0.. of Y.
// Each invocation loads its (at most PER) vec4 of the row and of w once, up front, and keeps
// them in registers across the reduction: a decode step's norm waits on one round trip to
// memory, not one per element. cols % 4 = 0 and cols ≤ 4 · 256 · PER (checked at load).

struct P {
    cols: u32,
    eps: f32,
    r0: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> X: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> Wn: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> Y: array<ACT4>;

const T: u32 = 256u;
const PER: u32 = 4u;

@compute @workgroup_size(256)
fn rms_norm(@builtin(workgroup_id) wid: vec3<u32>, lanes_in: Lanes) {
    lanes_init(lanes_in);
    let lid = lanes_in.lid;
    let c4 = p.cols / 4u;
    let xb = (p.r0 + wid.x) * c4;
    let yb = wid.x * c4;
    var xv: array<vec4<f32>, 4>;
    var wv: array<vec4<f32>, 4>;
    var ss = 0.0;
    for (var j = 0u; j < PER; j++) {
        let c = lid + j * T;
        if (c < c4) {
            xv[j] = X[xb + c];
            wv[j] = Wn[c];
            ss += dot(xv[j], xv[j]);
        }
    }
    let r = 1.0 / sqrt(wg256_sum(lid, ss) / f32(p.cols) + p.eps);
    for (var j = 0u; j < PER; j++) {
        let c = lid + j * T;
        if (c < c4) {
            Y[yb + c] = ACT4(xv[j] * r * wv[j]);
        }
    }
}
