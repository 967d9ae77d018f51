// A decode step's MoE output straight into the residual (MODEL.md §2.6), one dispatch instead
// of the routed down projection, the shared expert's down projection and moe_combine:
//   x[r] += Σ_k w_k · (down_{e_k} a_k)[r] + sigmoid(sg) · (shared_down s)[r]
// Both down matrices MLX 4-bit (groups of a multiple of 32), each in one slice; workgroups of
// 8 output rows, 8 invocations per row, every invocation holding the 16-byte reads of all TOPK
// experts' and the shared expert's rows in flight at once. Tokens along z.

struct P {
    rows: u32,        // hidden
    cols_e: u32,      // routed expert intermediate size
    cols_s: u32,      // shared expert intermediate size
    sg_stride: u32,   // SG: the shared expert's gate logit of token t at t · sg_stride + sg_off
    sg_off: u32,
    group_e: u32,
    group_s: u32,
    scale_e: u32,     // halves from the start of We / Ws
    bias_e: u32,
    scale_s: u32,
    bias_s: u32,
    nwx: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> We: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> Ws: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> A: array<vec4<f32>>;    // [tokens · TOPK, cols_e]
@group(0) @binding(4) var<storage, read> SA: array<vec4<f32>>;   // [tokens, cols_s]
@group(0) @binding(5) var<storage, read> wts: array<f32>;        // [tokens, TOPK]
@group(0) @binding(6) var<storage, read> ids: array<u32>;        // [tokens, TOPK]
@group(0) @binding(7) var<storage, read> SG: array<f32>;
@group(0) @binding(8) var<storage, read_write> X: array<f32>;    // [tokens, rows]

override TOPK: u32 = 8u;

const ROWS: u32 = 8u;
const LANES: u32 = 8u;
const SH_LO = vec4<u32>(0u, 4u, 8u, 12u);
const SH_HI = vec4<u32>(16u, 20u, 24u, 28u);
const NIB = vec4<u32>(15u);

fn dot8(w: u32, a: vec4<f32>, b: vec4<f32>) -> f32 {
    let wv = vec4<u32>(w);
    return dot(vec4<f32>((wv >> SH_LO) & NIB), a) + dot(vec4<f32>((wv >> SH_HI) & NIB), b);
}

// Σ q x and Σ x of one quad (32 weights) against inputs starting at vec4 x of `from_shared`'s
// array.
fn qdot(w: vec4<u32>, x0: vec4<f32>, x1: vec4<f32>, x2: vec4<f32>, x3: vec4<f32>,
        x4: vec4<f32>, x5: vec4<f32>, x6: vec4<f32>, x7: vec4<f32>) -> vec2<f32> {
    let qd = dot8(w.x, x0, x1) + dot8(w.y, x2, x3) + dot8(w.z, x4, x5) + dot8(w.w, x6, x7);
    let s4 = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7));
    return vec2<f32>(qd, (s4.x + s4.y) + (s4.z + s4.w));
}

fn we_half(i: u32) -> f32 {
    return bf16_at(We[i >> 3u][(i >> 1u) & 3u], i);
}

fn ws_half(i: u32) -> f32 {
    return bf16_at(Ws[i >> 3u][(i >> 1u) & 3u], i);
}

fn expert_quad(e: u32, row: u32, xb: u32, q: u32) -> f32 {
    let quads = p.cols_e / 32u;
    let w = We[(e * p.rows + row) * quads + q];
    let x = xb + q * 8u;
    let d = qdot(w, A[x], A[x + 1u], A[x + 2u], A[x + 3u], A[x + 4u], A[x + 5u], A[x + 6u], A[x + 7u]);
    let g = (e * p.rows + row) * (p.cols_e / p.group_e) + (q * 32u) / p.group_e;
    return we_half(p.scale_e + g) * d.x + we_half(p.bias_e + g) * d.y;
}

fn shared_quad(row: u32, xb: u32, q: u32) -> f32 {
    let quads = p.cols_s / 32u;
    let w = Ws[row * quads + q];
    let x = xb + q * 8u;
    let d = qdot(w, SA[x], SA[x + 1u], SA[x + 2u], SA[x + 3u], SA[x + 4u], SA[x + 5u], SA[x + 6u], SA[x + 7u]);
    let g = row * (p.cols_s / p.group_s) + (q * 32u) / p.group_s;
    return ws_half(p.scale_s + g) * d.x + ws_half(p.bias_s + g) * d.y;
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
        let qe = p.cols_e / 32u;
        for (var k = 0u; k < TOPK; k++) {
            let item = t * TOPK + k;
            let e = ids[item];
            let xb = item * (p.cols_e / 4u);
            var part = 0.0;
            for (var q = lane; q < qe; q += LANES) {
                part += expert_quad(e, row, xb, q);
            }
            acc += wts[item] * part;
        }
        let qs = p.cols_s / 32u;
        var sh = 0.0;
        for (var q = lane; q < qs; q += LANES) {
            sh += shared_quad(row, t * (p.cols_s / 4u), q);
        }
        acc += sigmoid(SG[t * p.sg_stride + p.sg_off]) * sh;
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
