// Shared by every kernel file: the loader (lily-wgpu/src/kernels.rs) puts this text in front of
// each one. Helpers only; no bindings. Workgroup reductions assume a workgroup of 64 invocations
// and never a subgroup width (lavapipe has 8 lanes, NVIDIA and Apple 32).

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

const NEG_BIG: f32 = -3.0e38;

var<workgroup> wg_part: array<f32, 64>;

// Σ v over a 64-invocation workgroup; every invocation gets the total. Uniform control flow only.
fn wg_sum(lid: u32, v: f32) -> f32 {
    wg_part[lid] = v;
    workgroupBarrier();
    for (var s = 32u; s > 0u; s = s >> 1u) {
        if (lid < s) {
            wg_part[lid] += wg_part[lid + s];
        }
        workgroupBarrier();
    }
    let total = wg_part[0];
    workgroupBarrier();
    return total;
}

// max v over a 64-invocation workgroup.
fn wg_max(lid: u32, v: f32) -> f32 {
    wg_part[lid] = v;
    workgroupBarrier();
    for (var s = 32u; s > 0u; s = s >> 1u) {
        if (lid < s) {
            wg_part[lid] = max(wg_part[lid], wg_part[lid + s]);
        }
        workgroupBarrier();
    }
    let m = wg_part[0];
    workgroupBarrier();
    return m;
}
