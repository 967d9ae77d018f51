// The workgroup reductions through workgroup memory (trees of barriers), for devices without
// subgroup operations; reduce_subgroup.wgsl has the same functions on subgroups. The loader
// (lily-wgpu/src/shaders.rs) puts one of the two in front of every kernel. A kernel that
// reduces takes `lanes_in: Lanes` among its entry point's parameters and calls
// `lanes_init(lanes_in)` first.

struct Lanes {
    @builtin(local_invocation_index) lid: u32,
}

var<private> lanes: Lanes;

fn lanes_init(l: Lanes) {
    lanes = l;
}

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

var<workgroup> wg_part2: array<vec2<f32>, 64>;

// Σ v over a 64-invocation workgroup for two values at once (one tree); every invocation gets
// the totals. Its last call in a kernel: no barrier after the totals are read (linear_q4_rows'
// `LEAN`, one call an invocation). Uniform control flow only.
fn wg_sum2(lid: u32, v: vec2<f32>) -> vec2<f32> {
    wg_part2[lid] = v;
    workgroupBarrier();
    for (var s = 32u; s > 0u; s = s >> 1u) {
        if (lid < s) {
            wg_part2[lid] += wg_part2[lid + s];
        }
        workgroupBarrier();
    }
    return wg_part2[0];
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

// rsqrt(Σ ss / cols + eps) where each of a 64-invocation workgroup brings its part `ss` of the
// row's Σ x² (rms_norm.wgsl's scale). Uniform control flow only.
fn rms_scale(lid: u32, ss: f32, cols: u32, eps: f32) -> f32 {
    return 1.0 / sqrt(wg_sum(lid, ss) / f32(cols) + eps);
}

var<workgroup> wg256_v: array<f32, 256>;
var<workgroup> wg256_i: array<u32, 256>;

struct ValId {
    v: f32,
    i: u32,
}

var<workgroup> wg_part_i: array<u32, 64>;

// The largest v over a 64-invocation workgroup and its id i, the lower id on ties; every
// invocation gets it. Uniform control flow only.
fn wg_argmax(lid: u32, v: f32, i: u32) -> ValId {
    wg_part[lid] = v;
    wg_part_i[lid] = i;
    workgroupBarrier();
    for (var s = 32u; s > 0u; s = s >> 1u) {
        if (lid < s) {
            let ov = wg_part[lid + s];
            let oi = wg_part_i[lid + s];
            if (ov > wg_part[lid] || (ov == wg_part[lid] && oi < wg_part_i[lid])) {
                wg_part[lid] = ov;
                wg_part_i[lid] = oi;
            }
        }
        workgroupBarrier();
    }
    let r = ValId(wg_part[0], wg_part_i[0]);
    workgroupBarrier();
    return r;
}


// The largest v over a 256-invocation workgroup and its id i, the lower id on ties; every
// invocation gets it. Uniform control flow only.
fn wg256_argmax(lid: u32, v: f32, i: u32) -> ValId {
    wg256_v[lid] = v;
    wg256_i[lid] = i;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s = s >> 1u) {
        if (lid < s) {
            let ov = wg256_v[lid + s];
            let oi = wg256_i[lid + s];
            if (ov > wg256_v[lid] || (ov == wg256_v[lid] && oi < wg256_i[lid])) {
                wg256_v[lid] = ov;
                wg256_i[lid] = oi;
            }
        }
        workgroupBarrier();
    }
    let r = ValId(wg256_v[0], wg256_i[0]);
    workgroupBarrier();
    return r;
}

// Σ v over a 256-invocation workgroup (a tree, the same order every time); every invocation
// gets it. Uniform control flow only.
fn wg256_sum(lid: u32, v: f32) -> f32 {
    wg256_v[lid] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s = s >> 1u) {
        if (lid < s) {
            wg256_v[lid] += wg256_v[lid + s];
        }
        workgroupBarrier();
    }
    let total = wg256_v[0];
    workgroupBarrier();
    return total;
}


struct KeyId {
    k: u32,
    i: u32,
}

var<workgroup> wg_key: array<u32, 64>;
var<workgroup> wg_key_i: array<u32, 64>;

// The largest u32 key over a 64-invocation workgroup and its id i, the lower id on ties; every
// invocation gets it (`round`: reduce_subgroup.wgsl's slot sets; a tree needs its own barriers).
// Uniform control flow only.
fn wg_argmax_key(lid: u32, key: u32, i: u32, round: u32) -> KeyId {
    wg_key[lid] = key;
    wg_key_i[lid] = i;
    workgroupBarrier();
    for (var s = 32u; s > 0u; s = s >> 1u) {
        if (lid < s) {
            let ok = wg_key[lid + s];
            let oi = wg_key_i[lid + s];
            if (ok > wg_key[lid] || (ok == wg_key[lid] && oi < wg_key_i[lid])) {
                wg_key[lid] = ok;
                wg_key_i[lid] = oi;
            }
        }
        workgroupBarrier();
    }
    let r = KeyId(wg_key[0], wg_key_i[0]);
    workgroupBarrier();
    return r;
}
