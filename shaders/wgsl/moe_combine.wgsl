// The MoE output into the residual (MODEL.md §2.3, §2.6):
//   x += Σ_k w_k · y_k + sigmoid(shared_gate · x) · shared(x)
// One invocation per (column, token). Where the shared expert rides in the routed stacks it is
// the last of the k items (its weight the sigmoid) and `with_shared` is 0.

struct P {
    tokens: u32,
    h: u32,
    k: u32,
    sg_stride: u32,  // SG: the shared expert's gate logit of token t at t · sg_stride + sg_off
    sg_off: u32,
    with_shared: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read_write> X: array<f32>;  // [tokens, h] residual
@group(0) @binding(2) var<storage, read> Ye: array<ACT>;       // [tokens · k, h]
@group(0) @binding(3) var<storage, read> wts: array<f32>;      // [tokens, k]
@group(0) @binding(4) var<storage, read> Sh: array<ACT>;       // [tokens, h]
@group(0) @binding(5) var<storage, read> SG: array<f32>;

@compute @workgroup_size(64)
fn moe_combine(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.x;
    let t = gid.y;
    if (c >= p.h || t >= p.tokens) {
        return;
    }
    var o = 0.0;
    for (var k = 0u; k < p.k; k++) {
        o += wts[t * p.k + k] * f32(Ye[(t * p.k + k) * p.h + c]);
    }
    if (p.with_shared != 0u) {
        o += sigmoid(SG[t * p.sg_stride + p.sg_off]) * f32(Sh[t * p.h + c]);
    }
    X[t * p.h + c] += o;
}
