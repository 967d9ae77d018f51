// Shared by every kernel file: the loader (lily-wgpu/src/shaders.rs) puts this text in front of
// each one, after one of the two reduction files (reduce_subgroup.wgsl where the device has
// subgroup operations, else reduce_workgroup.wgsl: the same functions). Helpers only; no
// bindings.

// The two bf16 values packed in one little-endian u32: element 2i is the low half.
fn bf16_lo(w: u32) -> f32 {
    return bitcast<f32>(w << 16u);
}

fn bf16_hi(w: u32) -> f32 {
    return bitcast<f32>(w & 0xffff0000u);
}

// bf16 element i of an array of packed pairs, given the word holding it (`words[i >> 1u]`).
fn bf16_at(word: u32, i: u32) -> f32 {
    if ((i & 1u) == 0u) {
        return bf16_lo(word);
    }
    return bf16_hi(word);
}

// The matrix products' parameters (forward.rs `linear_params`, words 0..17): the uniform of
// linear.wgsl, linear_q4.wgsl and linear_q4_glu.wgsl, and member `m` of the others' (their own
// fields from word 20: a struct member of a uniform takes a multiple of 16 bytes).
struct Mat {
    rows: u32,        // rows of one matrix (or of this slice, plain mode)
    cols: u32,
    bits: u32,        // 4, 8 (affine) or 16 (bf16)
    group: u32,
    row0: u32,        // first output row of this slice (plain mode)
    x_stride: u32,
    x_off: u32,
    y_stride: u32,
    y_off: u32,
    scale_off: u32,   // in bf16 halves from the start of W
    bias_off: u32,
    expert_mode: u32,
    e0: u32,          // first expert of this slice
    e_count: u32,
    x_div: u32,       // expert mode: input row = item / x_div
    mat_words: u32,   // packed words per expert matrix
    nwx: u32,         // workgroups along x (row block = x + y · nwx)
    accumulate: u32,  // 1: Y += W x
}

fn silu(x: f32) -> f32 {
    return x / (1.0 + exp(-x));
}

fn sigmoid(x: f32) -> f32 {
    return 1.0 / (1.0 + exp(-x));
}

// torch's softplus (linear above 20); exp(x) below −15, where 1 + exp(x) rounds to 1.
fn softplus(x: f32) -> f32 {
    if (x > 20.0) {
        return x;
    }
    if (x < -15.0) {
        return exp(x);
    }
    return log(1.0 + exp(x));
}

// MLX affine 4-bit words: weight j of a u32 in bits 4j .. 4j + 3; as vec4 lanes, the nibbles
// 0..3 (SH_LO) and 4..7 (SH_HI).
const SH_LO = vec4<u32>(0u, 4u, 8u, 12u);
const SH_HI = vec4<u32>(16u, 20u, 24u, 28u);
const NIB = vec4<u32>(15u);

// Σ q_j x_j over the 8 nibbles of `w` against inputs a (nibbles 0..3) and b (4..7).
fn dot8(w: u32, a: vec4<f32>, b: vec4<f32>) -> f32 {
    let wv = vec4<u32>(w);
    return dot(vec4<f32>((wv >> SH_LO) & NIB), a) + dot(vec4<f32>((wv >> SH_HI) & NIB), b);
}

// Σ q_j x_j over the 32 weights of one 16-byte word `w` against their inputs x0 .. x7.
fn qdot32(w: vec4<u32>, x0: vec4<f32>, x1: vec4<f32>, x2: vec4<f32>, x3: vec4<f32>, x4: vec4<f32>,
          x5: vec4<f32>, x6: vec4<f32>, x7: vec4<f32>) -> f32 {
    return dot8(w.x, x0, x1) + dot8(w.y, x2, x3) + dot8(w.z, x4, x5) + dot8(w.w, x6, x7);
}

// Σ x over those 32 inputs (the bias term of an affine group).
fn xsum32(x0: vec4<f32>, x1: vec4<f32>, x2: vec4<f32>, x3: vec4<f32>, x4: vec4<f32>, x5: vec4<f32>,
          x6: vec4<f32>, x7: vec4<f32>) -> f32 {
    let s4 = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7));
    return (s4.x + s4.y) + (s4.z + s4.w);
}

const NEG_BIG: f32 = -3.0e38;

// The row kernels' totals (linear_q4_rows, moe_down_rows: `row_*`, one value a row;
// linear_q4_glu_rows: `rows2_*`, gate and up), through workgroup memory in both reduction forms:
// 64 invocations, rb ≤ 16 rows. Each invocation puts its partial of rows 0..rb − 1, then
// `row_total` gives row lid / (64 / rb)'s total at the first invocation of its group of 64 / rb.
// part[r · 65 + invocation] (65: rows on different banks). On the H200 this beat one subgroupAdd
// a row (docs/perf-notes.md, session 11: 16 rows were 80 shuffle steps an invocation, 160 with
// the unused second value of a shared vec2 form).
var<workgroup> row_part: array<f32, 1040>;

fn row_put(lid: u32, r: u32, v: f32) {
    row_part[r * 65u + lid] = v;
}

// Row r's 64 partials: the 64 / rb invocations of its group sum rb each, then the first of them
// all of those. Uniform control flow only.
fn row_total(lid: u32, rb: u32) -> f32 {
    workgroupBarrier();
    let pr = 64u / rb;
    let r = lid / pr;
    let k = lid % pr;
    var t = 0.0;
    for (var i = 0u; i < rb; i++) {
        t += row_part[r * 65u + k * rb + i];
    }
    workgroupBarrier();
    row_part[r * 65u + k] = t;
    workgroupBarrier();
    var total = 0.0;
    if (k == 0u) {
        for (var i = 0u; i < pr; i++) {
            total += row_part[r * 65u + i];
        }
    }
    return total;
}

var<workgroup> rows2_part: array<vec2<f32>, 1040>;

fn rows2_put(lid: u32, r: u32, v: vec2<f32>) {
    rows2_part[r * 65u + lid] = v;
}

fn rows2_total(lid: u32, rb: u32) -> vec2<f32> {
    workgroupBarrier();
    let pr = 64u / rb;
    let r = lid / pr;
    let k = lid % pr;
    var t = vec2<f32>(0.0);
    for (var i = 0u; i < rb; i++) {
        t += rows2_part[r * 65u + k * rb + i];
    }
    workgroupBarrier();
    rows2_part[r * 65u + k] = t;
    workgroupBarrier();
    var total = vec2<f32>(0.0);
    if (k == 0u) {
        for (var i = 0u; i < pr; i++) {
            total += rows2_part[r * 65u + i];
        }
    }
    return total;
}

// A radix-select pass's histogram (byte `shift` of the keys that match the prefix so far; the
// sampling kernels fill it).
var<workgroup> wg_bins: array<atomic<u32>, 256>;

// The bin holding the remaining-th largest key, walking wg_bins from the top, and how many of
// that bin's keys are still wanted: (bin, remaining within it). One invocation calls it.
fn radix_bin(wanted: u32) -> vec2<u32> {
    var remaining = wanted;
    var d = 255u;
    loop {
        let c = atomicLoad(&wg_bins[d]);
        if (remaining <= c || d == 0u) {
            break;
        }
        remaining -= c;
        d--;
    }
    return vec2<u32>(d, remaining);
}
