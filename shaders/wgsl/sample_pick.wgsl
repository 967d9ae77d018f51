// Device sampling, steps 5–6 of lily-core/src/sampling.rs, one workgroup of 256 (top_k ≤ 256),
// over the candidates sample_prefilter.wgsl kept from sample_adjust.wgsl's output (Cand: n
// (value bits, id) pairs in id order, unused ones NaN):
// - the top_k largest valid values (not NaN, not −∞) by a radix select over 32-bit keys ordered
//   as f32::total_cmp (4 passes of 8 bits), ties at the threshold going to the lower ids as the
//   host's order does;
// - on those candidates, in one invocation and in the host's order: weights exp(v − max), their
//   total, top_p (the floor, then the sort by (weight, id) and the running mass), min_p, and the
//   inverse-CDF pick with the host-drawn uniform u (u_hi + u_lo). The host sums in f64; here
//   sums are compensated f32 pairs (≈ 48 bits).
// Writes Out = [token, log-probability bits under the raw logits L, from the prefilter's per-range
// (max, sum) in Parts] and bumps hist[token] as Sampler::accept does. Greedy with penalties runs
// this with top_k 1 and u = 0.

struct P {
    vocab: u32,      // candidates in Cand
    parts: u32,      // (max, sum) pairs in Parts
    k: u32,
    top_p: f32,
    min_p: f32,
    u_hi: f32,
    u_lo: f32,
    seen_bit: u32,   // 1: the repetition penalty is on, mark the token seen
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> L: array<f32>;
@group(0) @binding(2) var<storage, read> Cand: array<u32>;
@group(0) @binding(3) var<storage, read> Parts: array<f32>;
@group(0) @binding(4) var<storage, read_write> hist: array<u32>;
@group(0) @binding(5) var<storage, read_write> Out: array<u32>;

fn cv(i: u32) -> f32 {
    return bitcast<f32>(Cand[2u * i]);
}

fn cid(i: u32) -> u32 {
    return Cand[2u * i + 1u];
}

const HIST_SEEN: u32 = 0x80000000u;
const HIST_COUNT: u32 = 0x7fffffffu;
const T: u32 = 256u;

var<workgroup> ncand: atomic<u32>;
var<workgroup> nvalid: atomic<u32>;
var<workgroup> sel: vec3<u32>;            // (key prefix, how many still to take, k in effect)
var<workgroup> ties: array<u32, 256>;
var<workgroup> cand_v: array<f32, 256>;
var<workgroup> cand_i: array<u32, 256>;
var<workgroup> cand_w: array<f32, 256>;
var<workgroup> order: array<u32, 256>;
var<workgroup> red: array<f32, 256>;
var<workgroup> picked: u32;

fn valid(v: f32) -> bool {
    let b = bitcast<u32>(v);
    return (b & 0x7fffffffu) <= 0x7f800000u && b != 0xff800000u;
}

// Larger key = later in f32::total_cmp order.
fn key(v: f32) -> u32 {
    let b = bitcast<u32>(v);
    if ((b & 0x80000000u) != 0u) {
        return ~b;
    }
    return b | 0x80000000u;
}

fn red_max(lid: u32, v: f32) -> f32 {
    red[lid] = v;
    workgroupBarrier();
    for (var s = T / 2u; s > 0u; s = s >> 1u) {
        if (lid < s) {
            red[lid] = max(red[lid], red[lid + s]);
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

fn red_sum(lid: u32, v: f32) -> f32 {
    red[lid] = v;
    workgroupBarrier();
    for (var s = T / 2u; s > 0u; s = s >> 1u) {
        if (lid < s) {
            red[lid] += red[lid + s];
        }
        workgroupBarrier();
    }
    let r = red[0];
    workgroupBarrier();
    return r;
}

// Compensated sums: (hi, lo) with hi + lo the exact sum as far as two f32 hold it.
fn two_sum(a: f32, b: f32) -> vec2<f32> {
    let s = a + b;
    let bb = s - a;
    let e = (a - (s - bb)) + (b - bb);
    return vec2<f32>(s, e);
}

fn df_add(x: vec2<f32>, y: f32) -> vec2<f32> {
    let t = two_sum(x.x, y);
    let e = t.y + x.y;
    let s = t.x + e;
    return vec2<f32>(s, e - (s - t.x));
}

fn df_mul(x: vec2<f32>, y: f32) -> vec2<f32> {
    let pr = x.x * y;
    let e = fma(x.x, y, -pr) + x.y * y;
    let s = pr + e;
    return vec2<f32>(s, e - (s - pr));
}

// a ≥ b for compensated pairs.
fn df_ge(a: vec2<f32>, b: vec2<f32>) -> bool {
    let d = df_add(vec2<f32>(a.x, a.y), -b.x);
    let d2 = df_add(d, -b.y);
    return d2.x > 0.0 || (d2.x == 0.0 && d2.y >= 0.0);
}

@compute @workgroup_size(256)
fn sample_pick(@builtin(local_invocation_index) lid: u32) {
    let v_n = p.vocab;
    if (lid == 0u) {
        atomicStore(&ncand, 0u);
        atomicStore(&nvalid, 0u);
    }
    workgroupBarrier();
    var nv = 0u;
    for (var i = lid; i < v_n; i += T) {
        if (valid(cv(i))) {
            nv++;
        }
    }
    atomicAdd(&nvalid, nv);
    workgroupBarrier();
    let n_valid = atomicLoad(&nvalid);
    let k = min(p.k, n_valid);
    if (lid == 0u) {
        sel = vec3<u32>(0u, k, k);
    }
    // Radix select of the k-th largest key.
    var mask = 0u;
    for (var round = 0u; round < 4u; round++) {
        let shift = 24u - 8u * round;
        atomicStore(&wg_bins[lid], 0u);
        let s0 = workgroupUniformLoad(&sel);
        let prefix = s0.x;
        if (k > 0u) {
            for (var i = lid; i < v_n; i += T) {
                let v = cv(i);
                if (valid(v)) {
                    let kk = key(v);
                    if ((kk & mask) == prefix) {
                        atomicAdd(&wg_bins[(kk >> shift) & 255u], 1u);
                    }
                }
            }
        }
        workgroupBarrier();
        if (lid == 0u && k > 0u) {
            let hit = radix_bin(s0.y);
            sel = vec3<u32>(prefix | (hit.x << shift), hit.y, k);
        }
        mask = mask | (255u << shift);
        // Invocation 0 has read the bins before they are cleared for the next pass.
        workgroupBarrier();
    }
    let s1 = workgroupUniformLoad(&sel);
    let thr = s1.x;
    let need = s1.y;     // keys equal to thr to take, the lowest ids first
    // Keys above the threshold in any order; ties counted per contiguous range of ids.
    let span = (v_n + T - 1u) / T;
    let a = min(lid * span, v_n);
    let b = min(a + span, v_n);
    var nt = 0u;
    if (k > 0u) {
        for (var i = a; i < b; i++) {
            let v = cv(i);
            if (valid(v)) {
                let kk = key(v);
                if (kk > thr) {
                    let slot = atomicAdd(&ncand, 1u);
                    cand_v[slot] = v;
                    cand_i[slot] = cid(i);
                } else if (kk == thr) {
                    nt++;
                }
            }
        }
    }
    ties[lid] = nt;
    workgroupBarrier();
    if (lid == 0u) {
        var acc = 0u;
        for (var j = 0u; j < T; j++) {
            let c = ties[j];
            ties[j] = acc;
            acc += c;
        }
    }
    workgroupBarrier();
    let above = k - need;
    var r = ties[lid];
    if (k > 0u && r < need) {
        for (var i = a; i < b && r < need; i++) {
            let v = cv(i);
            if (valid(v) && key(v) == thr) {
                cand_v[above + r] = v;
                cand_i[above + r] = cid(i);
                r++;
            }
        }
    }
    workgroupBarrier();
    // Weights relative to the best candidate, then the order (weight desc, id asc).
    let mx = red_max(lid, select(NEG_BIG, cand_v[min(lid, 255u)], lid < k));
    if (lid < k) {
        cand_w[lid] = exp(cand_v[lid] - mx);
    }
    workgroupBarrier();
    if (lid < k) {
        let w = cand_w[lid];
        let id = cand_i[lid];
        var rank = 0u;
        for (var j = 0u; j < k; j++) {
            let wj = cand_w[j];
            if (wj > w || (wj == w && cand_i[j] < id)) {
                rank++;
            }
        }
        order[rank] = lid;
    }
    workgroupBarrier();
    if (lid == 0u) {
        var token = 0u;
        if (k > 0u) {
            var total = vec2<f32>(0.0, 0.0);
            for (var j = 0u; j < k; j++) {
                total = df_add(total, cand_w[j]);
            }
            var n = k;
            var floor = 0.0;
            if (p.top_p < 1.0) {
                floor = (1.0 - p.top_p) * (total.x + total.y) / f32(k);
            }
            // The floor drops the lightest candidates: a prefix of the order survives.
            var kept = 0u;
            for (var j = 0u; j < n; j++) {
                if (cand_w[order[j]] >= floor) {
                    kept = j + 1u;
                }
            }
            n = kept;
            if (p.top_p < 1.0) {
                let goal = df_mul(total, p.top_p);
                var mass = vec2<f32>(0.0, 0.0);
                for (var j = 0u; j < n; j++) {
                    mass = df_add(mass, cand_w[order[j]]);
                    if (df_ge(mass, goal)) {
                        n = j + 1u;
                        break;
                    }
                }
            }
            if (p.min_p > 0.0) {
                var m = 0u;
                for (var j = 0u; j < n; j++) {
                    if (cand_w[order[j]] >= p.min_p) {
                        m = j + 1u;
                    } else {
                        break;
                    }
                }
                n = max(m, 1u);
            }
            var t2 = vec2<f32>(0.0, 0.0);
            for (var j = 0u; j < n; j++) {
                t2 = df_add(t2, cand_w[order[j]]);
            }
            // target = u · total, u = u_hi + u_lo.
            var tg = df_add(df_mul(t2, p.u_hi), t2.x * p.u_lo);
            token = cand_i[order[n - 1u]];
            for (var j = 0u; j < n; j++) {
                tg = df_add(tg, -cand_w[order[j]]);
                if (tg.x < 0.0 || (tg.x == 0.0 && tg.y < 0.0)) {
                    token = cand_i[order[j]];
                    break;
                }
            }
        }
        picked = token;
    }
    let token = workgroupUniformLoad(&picked);
    // Log-probability of the token under the raw logits (NaN logits left out), from the
    // prefilter's per-range (max, sum).
    var m = NEG_BIG;
    for (var i = lid; i < p.parts; i += T) {
        m = max(m, Parts[2u * i]);
    }
    let lmax = red_max(lid, m);
    var s = 0.0;
    for (var i = lid; i < p.parts; i += T) {
        let ps = Parts[2u * i + 1u];
        if (ps > 0.0) {
            s += ps * exp(Parts[2u * i] - lmax);
        }
    }
    let sum = red_sum(lid, s);
    if (lid == 0u) {
        Out[0] = token;
        Out[1] = bitcast<u32>(L[token] - lmax - log(sum));
        let h = hist[token];
        var c = h & HIST_COUNT;
        if (c < HIST_COUNT) {
            c++;
        }
        var seen = h & HIST_SEEN;
        if (p.seen_bit != 0u) {
            seen = HIST_SEEN;
        }
        hist[token] = c | seen;
    }
}
