// Device sampling, stage 1 of sample_pick.wgsl's selection: workgroup b takes the adjusted
// logits S[b · span, (b + 1) · span) (span ≤ 1,024) and keeps its own top k (the k largest
// valid values, ties at its threshold going to the lower ids), written in id order to
// Cand[b · k ..] as (value bits, id) pairs, unused slots marked with id 0xffffffff. The global
// top k is among the kept ones, and the candidates stay in id order across workgroups (ranges
// ascend), so sample_pick.wgsl selects from G · k candidates instead of the vocabulary. Also
// Parts[b] = (largest raw logit of the range, Σ exp(l − it)) for the log-probability.

struct P {
    vocab: u32,
    k: u32,
    span: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> L: array<f32>;
@group(0) @binding(2) var<storage, read> S: array<f32>;
@group(0) @binding(3) var<storage, read_write> Cand: array<u32>;   // [G · k] (value bits, id)
@group(0) @binding(4) var<storage, read_write> Parts: array<f32>;  // [G] (max, sum)

const T: u32 = 256u;
const PER: u32 = 4u;   // span ≤ T · PER

var<workgroup> keys: array<u32, 1024>;
var<workgroup> sel: vec3<u32>;           // (key prefix, how many still to take, k here)
var<workgroup> nvalid: atomic<u32>;
var<workgroup> scan: array<u32, 256>;
var<workgroup> red: array<f32, 256>;

fn valid(v: f32) -> bool {
    let b = bitcast<u32>(v);
    return (b & 0x7fffffffu) <= 0x7f800000u && b != 0xff800000u;
}

// Larger key = later in f32::total_cmp order; 0 for values that can never be picked.
fn key(v: f32) -> u32 {
    if (!valid(v)) {
        return 0u;
    }
    let b = bitcast<u32>(v);
    if ((b & 0x80000000u) != 0u) {
        return ~b;
    }
    return b | 0x80000000u;
}

@compute @workgroup_size(256)
fn sample_prefilter(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let a = wid.x * p.span;
    let n = min(p.span, p.vocab - min(a, p.vocab));
    if (lid == 0u) {
        atomicStore(&nvalid, 0u);
    }
    workgroupBarrier();
    // Keys into shared memory; invocation lid owns elements lid·PER .. lid·PER + PER (in id
    // order, for the compaction below). Raw logits: the range's max and sum for the
    // log-probability.
    var nv = 0u;
    var lm = NEG_BIG;
    for (var j = 0u; j < PER; j++) {
        let e = lid * PER + j;
        var kk = 0u;
        if (e < n) {
            kk = key(S[a + e]);
            let l = L[a + e];
            if (valid(l)) {
                lm = max(lm, l);
            }
        }
        keys[e] = kk;
        nv += u32(kk != 0u);
    }
    atomicAdd(&nvalid, nv);
    red[lid] = lm;
    workgroupBarrier();
    for (var s = T / 2u; s > 0u; s = s >> 1u) {
        if (lid < s) {
            red[lid] = max(red[lid], red[lid + s]);
        }
        workgroupBarrier();
    }
    let lmax = red[0];
    workgroupBarrier();
    var ls = 0.0;
    for (var j = 0u; j < PER; j++) {
        let e = lid * PER + j;
        if (e < n) {
            let l = L[a + e];
            if (valid(l)) {
                ls += exp(l - lmax);
            }
        }
    }
    red[lid] = ls;
    workgroupBarrier();
    for (var s = T / 2u; s > 0u; s = s >> 1u) {
        if (lid < s) {
            red[lid] += red[lid + s];
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        Parts[2u * wid.x] = lmax;
        Parts[2u * wid.x + 1u] = red[0];
    }
    let k = min(p.k, atomicLoad(&nvalid));
    if (lid == 0u) {
        sel = vec3<u32>(0u, k, k);
    }
    // Radix select of this range's k-th largest key, 8 bits a round.
    var mask = 0u;
    for (var round = 0u; round < 4u; round++) {
        let shift = 24u - 8u * round;
        atomicStore(&wg_bins[lid], 0u);
        let s0 = workgroupUniformLoad(&sel);
        for (var j = 0u; j < PER; j++) {
            let kk = keys[lid * PER + j];
            if (kk != 0u && (kk & mask) == s0.x) {
                atomicAdd(&wg_bins[(kk >> shift) & 255u], 1u);
            }
        }
        workgroupBarrier();
        if (lid == 0u && k > 0u) {
            let hit = radix_bin(s0.y);
            sel = vec3<u32>(s0.x | (hit.x << shift), hit.y, k);
        }
        mask = mask | (255u << shift);
        workgroupBarrier();
    }
    let s1 = workgroupUniformLoad(&sel);
    let thr = s1.x;
    let need = s1.y;
    // Keep: keys above the threshold, and the first `need` equal to it. Ties first, in id
    // order: an exclusive scan of each invocation's tie count.
    var nt = 0u;
    for (var j = 0u; j < PER; j++) {
        let kk = keys[lid * PER + j];
        nt += u32(k > 0u && kk != 0u && kk == thr);
    }
    scan[lid] = nt;
    workgroupBarrier();
    if (lid == 0u) {
        var acc = 0u;
        for (var i = 0u; i < T; i++) {
            let c = scan[i];
            scan[i] = acc;
            acc += c;
        }
    }
    workgroupBarrier();
    var tie_rank = scan[lid];
    var keep = array<bool, 4>(false, false, false, false);
    var nk = 0u;
    for (var j = 0u; j < PER; j++) {
        let kk = keys[lid * PER + j];
        var take = false;
        if (k > 0u && kk != 0u) {
            if (kk > thr) {
                take = true;
            } else if (kk == thr) {
                take = tie_rank < need;
                tie_rank++;
            }
        }
        keep[j] = take;
        nk += u32(take);
    }
    workgroupBarrier();
    // Compaction in id order: an exclusive scan of the kept counts.
    scan[lid] = nk;
    workgroupBarrier();
    if (lid == 0u) {
        var acc = 0u;
        for (var i = 0u; i < T; i++) {
            let c = scan[i];
            scan[i] = acc;
            acc += c;
        }
    }
    workgroupBarrier();
    var at = scan[lid];
    let base = 2u * wid.x * p.k;
    for (var j = 0u; j < PER; j++) {
        if (keep[j]) {
            let e = lid * PER + j;
            Cand[base + 2u * at] = bitcast<u32>(S[a + e]);
            Cand[base + 2u * at + 1u] = a + e;
            at++;
        }
    }
    // Unused slots.
    for (var slot = k + lid; slot < p.k; slot += T) {
        Cand[base + 2u * slot] = 0x7fc00000u;
        Cand[base + 2u * slot + 1u] = 0xffffffffu;
    }
}
