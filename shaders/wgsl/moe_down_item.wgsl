// What moe_down.wgsl, moe_down_rows.wgsl and moe_down_lanes.wgsl share (in front of those three
// only: shaders.rs `DOWN_KERNELS`): a decode step's down projections of a token's TOPK items and
// their weighted sum into the residual, x[r] += Σ_k w_k · (down_{e_k} a_k)[r]: the parameters, the
// bindings, the fixed shapes, and (moe_down_rows and moe_down_lanes: moe_down has its own rows
// and takes no RB) one item's reads for quad q (32 columns: one 16-byte word) of a workgroup's RB
// rows: its weight, 8 vec4 of input, RB words, scales and biases.

struct P {
    rows: u32,        // hidden
    cols: u32,        // expert intermediate size
    group: u32,
    scale_off: u32,   // halves from the start of We
    bias_off: u32,
    nwx: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> We: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> A: array<ACT4>;    // [tokens · TOPK, cols]
@group(0) @binding(3) var<storage, read> wts: array<f32>;        // [tokens, TOPK]
@group(0) @binding(4) var<storage, read> ids: array<u32>;        // [tokens, TOPK]
@group(0) @binding(5) var<storage, read_write> X: array<f32>;    // [tokens, rows]

// Items per token and the expert intermediate size, fixed per model (lily-wgpu/src/plan.rs).
override TOPK: u32 = 9u;
override COLS: u32 = 512u;

// Rows per workgroup (DOWN_RB on the host; a power of two ≤ 8): 4, so that a decode step runs
// on 512 workgroups (with 8: 256, 28 µs a call on the H200, profile of main 07ac75d).
override RB: u32 = 4u;

// One item's reads: its weight, input quad and RB rows' words, scales and biases.
struct DownItem {
    wk: f32,
    x: array<vec4<f32>, 8>,
    w: array<vec4<u32>, 8>,
    s: array<f32, 8>,
    b: array<f32, 8>,
}

fn we_half(i: u32) -> f32 {
    return bf16_at(We[i >> 3u][(i >> 1u) & 3u], i);
}

// The reads of item k of token t (expert e, weight wk) for quad q of rows r0 .. r0 + RB − 1 (`nr`
// real; past them row r0 again, not stored).
fn down_read(t: u32, k: u32, e: u32, wk: f32, q: u32, g: u32, r0: u32, nr: u32) -> DownItem {
    var o: DownItem;
    o.wk = wk;
    let qn = COLS / 32u;
    let groups = COLS / p.group;
    let xb = (t * TOPK + k) * (COLS / 4u) + q * 8u;
    for (var i = 0u; i < 8u; i++) {
        o.x[i] = vec4<f32>(A[xb + i]);
    }
    for (var j = 0u; j < RB; j++) {
        let row = select(r0, r0 + j, j < nr);
        let er = e * p.rows + row;
        o.w[j] = We[er * qn + q];
        o.s[j] = we_half(p.scale_off + er * groups + g);
        o.b[j] = we_half(p.bias_off + er * groups + g);
    }
    return o;
}
