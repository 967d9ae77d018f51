// The workgroup reductions on subgroups (wgpu's SUBGROUP feature: Vulkan subgroups, Metal
// simdgroups), the same functions as reduce_workgroup.wgsl: each subgroup reduces in registers,
// its first active invocation writes one slot per subgroup (`subgroup_id`), and every invocation
// combines the `num_subgroups` slots in the same order, so all get the same value. Correct for
// any subgroup size the device uses (wgpu reports 4..64 on Metal, lavapipe 8, NVIDIA 32) and
// any placement of invocations in subgroups. Uniform control flow only, as the workgroup forms.

struct Lanes {
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
}

var<private> lanes: Lanes;

fn lanes_init(l: Lanes) {
    lanes = l;
}

// Whether this invocation is its subgroup's first active one (the one that writes the
// subgroup's slot).
fn subgroup_first() -> bool {
    return subgroupBroadcastFirst(lanes.lid) == lanes.lid;
}

// One slot per subgroup: at most 256 / 4.
var<workgroup> wg_part: array<f32, 64>;
var<workgroup> wg_part_i: array<u32, 64>;

// Σ v over the workgroup (64 invocations; any size); every invocation gets the total.
fn wg_sum(lid: u32, v: f32) -> f32 {
    let t = subgroupAdd(v);
    if (subgroup_first()) {
        wg_part[lanes.sg] = t;
    }
    workgroupBarrier();
    var total = 0.0;
    for (var i = 0u; i < lanes.nsg; i++) {
        total += wg_part[i];
    }
    workgroupBarrier();
    return total;
}

var<workgroup> wg_part2: array<vec2<f32>, 64>;

// Σ v over the workgroup for two values at once (one subgroupAdd of the pair, one barrier);
// every invocation gets the totals, combined from the `num_subgroups` slots in one order. Its
// last call in a kernel: no barrier after the slots are read (linear_q4_rows' `LEAN`, one call
// an invocation). Uniform control flow only.
fn wg_sum2(lid: u32, v: vec2<f32>) -> vec2<f32> {
    let t = subgroupAdd(v);
    if (subgroup_first()) {
        wg_part2[lanes.sg] = t;
    }
    workgroupBarrier();
    var total = vec2<f32>(0.0);
    for (var i = 0u; i < lanes.nsg; i++) {
        total += wg_part2[i];
    }
    return total;
}

// max v over the workgroup.
fn wg_max(lid: u32, v: f32) -> f32 {
    let t = subgroupMax(v);
    if (subgroup_first()) {
        wg_part[lanes.sg] = t;
    }
    workgroupBarrier();
    var m = wg_part[0];
    for (var i = 1u; i < lanes.nsg; i++) {
        m = max(m, wg_part[i]);
    }
    workgroupBarrier();
    return m;
}

// rsqrt(Σ ss / cols + eps) where each invocation brings its part `ss` of the row's Σ x².
fn rms_scale(lid: u32, ss: f32, cols: u32, eps: f32) -> f32 {
    return 1.0 / sqrt(wg_sum(lid, ss) / f32(cols) + eps);
}

struct ValId {
    v: f32,
    i: u32,
}

// The largest v over a 256-invocation workgroup and its id i, the lower id on ties; every
// invocation gets it.
fn wg256_argmax(lid: u32, v: f32, i: u32) -> ValId {
    let m = subgroupMax(v);
    let mi = subgroupMin(select(0xffffffffu, i, v == m));
    if (subgroup_first()) {
        wg_part[lanes.sg] = m;
        wg_part_i[lanes.sg] = mi;
    }
    workgroupBarrier();
    var best = ValId(wg_part[0], wg_part_i[0]);
    for (var s = 1u; s < lanes.nsg; s++) {
        let ov = wg_part[s];
        let oi = wg_part_i[s];
        if (ov > best.v || (ov == best.v && oi < best.i)) {
            best = ValId(ov, oi);
        }
    }
    workgroupBarrier();
    return best;
}

// Σ v over a 256-invocation workgroup (the same order every time); every invocation gets it.
fn wg256_sum(lid: u32, v: f32) -> f32 {
    return wg_sum(lid, v);
}

// The largest v over a 64-invocation workgroup and its id i, the lower id on ties (the same
// function as wg256_argmax: any workgroup size).
fn wg_argmax(lid: u32, v: f32, i: u32) -> ValId {
    return wg256_argmax(lid, v, i);
}

struct KeyId {
    k: u32,
    i: u32,
}

// Two sets of slots, round by round (`round` & 1), so a round needs one barrier: an invocation
// writes a set again two rounds later, after the next round's barrier, which every invocation
// reaches only once it has read this round's.
var<workgroup> wg_key2: array<u32, 128>;
var<workgroup> wg_key2_i: array<u32, 128>;

// The largest u32 key over the workgroup and its id i, the lower id on ties; every invocation
// gets it. Calls must number their rounds 0, 1, 2, … (one barrier a call). Integer subgroup
// reductions (no shuffle chain on NVIDIA: `redux`). Uniform control flow only.
fn wg_argmax_key(lid: u32, key: u32, i: u32, round: u32) -> KeyId {
    let m = subgroupMax(key);
    let mi = subgroupMin(select(0xffffffffu, i, key == m));
    let base = (round & 1u) * 64u;
    if (subgroup_first()) {
        wg_key2[base + lanes.sg] = m;
        wg_key2_i[base + lanes.sg] = mi;
    }
    workgroupBarrier();
    var best = KeyId(wg_key2[base], wg_key2_i[base]);
    for (var s = 1u; s < lanes.nsg; s++) {
        let ok = wg_key2[base + s];
        let oi = wg_key2_i[base + s];
        if (ok > best.k || (ok == best.k && oi < best.i)) {
            best = KeyId(ok, oi);
        }
    }
    return best;
}
