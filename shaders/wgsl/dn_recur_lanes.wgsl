// dn_recur.wgsl's recurrence with its ONE_SYNC form's sums (`recur_lanes`, plan.rs
// `dn_recur_spec`): no barrier a token. Each state column's dk rows are split over 4 invocations
// as in dn_recur.wgsl, but the 4 are lanes 4i .. 4i + 3 of one subgroup (column (subgroup_id ·
// subgroup_size + subgroup_invocation_id) / 4, slice subgroup_invocation_id % 4), so their partial
// sums of S₀ᵀk and S₀ᵀq meet by two subgroup shuffles (xor 1, xor 2: every lane of the 4 gets the
// same bits, additions being commutative) instead of through workgroup memory and a barrier.
// o = α (S₀ᵀq) + (kᵀq) δ as in dn_recur.wgsl's ONE_SYNC form (kᵀq summed per block of tokens).
// Barriers: 4 a block of 16 tokens (the staging, kᵀq's two steps, the block's end) instead of 2
// a token plus 1 a block. Needs wgpu's SUBGROUP feature (the plan takes it only with subgroups)
// and full subgroups of at least 4 lanes in a workgroup of 128 (4..64 on Metal, 8 on lavapipe, 32
// on NVIDIA); nothing else about the subgroup size or the invocations' placement is assumed.
// Parameters, bindings, workgroup geometry: dn_recur.wgsl's (forward.rs launches either).

struct P {
    tokens: u32,
    hv: u32,
    hk: u32,
    dk: u32,
    dv: u32,
    cd: u32,
    ba_stride: u32,  // BA: row stride (per token) and offset of b (a follows at + hv)
    ba_off: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> C: array<ACT>;      // conv output; v at 2·hk·dk
@group(0) @binding(2) var<storage, read> QK: array<ACT4>; // normalised q | k
@group(0) @binding(3) var<storage, read> BA: array<ACT>;     // per token: b[hv] then a[hv]
@group(0) @binding(4) var<storage, read> decay: array<f32>;  // A_log[hv] then dt_bias[hv]
@group(0) @binding(5) var<storage, read_write> S: array<f32>;
@group(0) @binding(6) var<storage, read_write> O: array<ACT>; // [tokens, hv·dv]

override DK: u32 = 128u;

const TB: u32 = 16u;
const NS: u32 = 4u;
const MV: u32 = 8u;   // vec4 of state per invocation at most (DK ≤ 128)

var<workgroup> qs: array<vec4<f32>, 512>;   // TB tokens × DK/4 (DK ≤ 128)
var<workgroup> ks: array<vec4<f32>, 512>;
var<workgroup> ba: array<vec2<f32>, 16>;    // (β, exp(g)) per token of the block
var<workgroup> kqp: array<f32, 128>;        // kᵀq of the block's tokens: 8 partial sums each
var<workgroup> kqs: array<f32, 16>;

@compute @workgroup_size(128)
fn dn_recur_lanes(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(subgroup_size) sgs: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let h = wid.x;
    let col = (sg * sgs + lane) / NS;
    let sl = lane % NS;
    let j = wid.y * 32u + col;
    let live = j < p.dv;
    let jj = select(0u, j, live);
    let dk = DK;
    let d4 = DK / 4u;
    let key_dim = p.hk * dk;
    let kh = h / (p.hv / p.hk);
    // s[m]: state rows 4 (sl + NS m) .. + 3 of column j (zeros past dk).
    var s = array<vec4<f32>, MV>();
    for (var m = 0u; m < MV; m++) {
        let i4 = sl + NS * m;
        if (i4 < d4) {
            let r = h * dk + 4u * i4;
            s[m] = vec4<f32>(
                S[r * p.dv + jj],
                S[(r + 1u) * p.dv + jj],
                S[(r + 2u) * p.dv + jj],
                S[(r + 3u) * p.dv + jj]
            );
        }
    }
    for (var tb = 0u; tb < p.tokens; tb += TB) {
        let n = min(TB, p.tokens - tb);
        for (var i = lid; i < n * d4; i += 128u) {
            let tt = i / d4;
            let c = i % d4;
            let qb = ((tb + tt) * 2u * key_dim + kh * dk) / 4u;
            qs[i] = vec4<f32>(QK[qb + c]);
            ks[i] = vec4<f32>(QK[qb + key_dim / 4u + c]);
        }
        if (lid < n) {
            let t = tb + lid;
            let beta = sigmoid(f32(BA[t * p.ba_stride + p.ba_off + h]));
            let g = -exp(decay[h]) * softplus(f32(BA[t * p.ba_stride + p.ba_off + p.hv + h]) + decay[p.hv + h]);
            ba[lid] = vec2<f32>(beta, exp(g));
        }
        var vv = array<f32, 16>();
        for (var tt = 0u; tt < TB; tt++) {
            if (tt < n) {
                vv[tt] = f32(C[(tb + tt) * p.cd + 2u * key_dim + h * p.dv + jj]);
            }
        }
        workgroupBarrier();
        // kᵀq of each token of the block (dn_recur.wgsl's ONE_SYNC step, the same sums).
        if (lid < n * 8u) {
            let kt = (lid / 8u) * d4;
            var acc = vec4<f32>(0.0);
            for (var c = lid % 8u; c < d4; c += 8u) {
                acc += qs[kt + c] * ks[kt + c];
            }
            kqp[lid] = (acc.x + acc.y) + (acc.z + acc.w);
        }
        workgroupBarrier();
        if (lid < n) {
            let kb = lid * 8u;
            kqs[lid] = ((kqp[kb] + kqp[kb + 1u]) + (kqp[kb + 2u] + kqp[kb + 3u]))
                + ((kqp[kb + 4u] + kqp[kb + 5u]) + (kqp[kb + 6u] + kqp[kb + 7u]));
        }
        workgroupBarrier();
        for (var tt = 0u; tt < n; tt++) {
            let beta = ba[tt].x;
            let alpha = ba[tt].y;
            let base = tt * d4;
            var a4 = vec4<f32>(0.0);
            var b4 = vec4<f32>(0.0);
            for (var m = 0u; m < MV; m++) {
                let i4 = sl + NS * m;
                if (i4 < d4) {
                    a4 += s[m] * ks[base + i4];
                    b4 += s[m] * qs[base + i4];
                }
            }
            var ab = vec2<f32>((a4.x + a4.y) + (a4.z + a4.w), (b4.x + b4.y) + (b4.z + b4.w));
            ab += subgroupShuffleXor(ab, 1u);
            ab += subgroupShuffleXor(ab, 2u);
            let delta = beta * (vv[tt] - alpha * ab.x);
            let o = alpha * ab.y + kqs[tt] * delta;
            for (var m = 0u; m < MV; m++) {
                let i4 = sl + NS * m;
                if (i4 < d4) {
                    s[m] = s[m] * alpha + ks[base + i4] * delta;
                }
            }
            if (live && sl == 0u) {
                O[(tb + tt) * p.hv * p.dv + h * p.dv + j] = ACT(o);
            }
        }
        workgroupBarrier();
    }
    if (live) {
        for (var m = 0u; m < MV; m++) {
            let i4 = sl + NS * m;
            if (i4 < d4) {
                let r = h * dk + 4u * i4;
                S[r * p.dv + j] = s[m].x;
                S[(r + 1u) * p.dv + j] = s[m].y;
                S[(r + 2u) * p.dv + j] = s[m].z;
                S[(r + 3u) * p.dv + j] = s[m].w;
            }
        }
    }
}
