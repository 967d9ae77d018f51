// Gated DeltaNet step 5–7 (MODEL.md §2.5), recurrent form, fp32 state S [hv, dk, dv]:
//   β = sigmoid(b), g = −exp(A_log) · softplus(a + dt_bias), S ← exp(g) · S,
//   u = Sᵀk, δ = β (v − u), S ← S + k δᵀ, o = Sᵀq (the updated state).
// Column j of S only meets column j, so the invocations of column j own it in registers for
// the whole chunk. Workgroups of 32 columns (hv · dv / 32 workgroups, 128 on the full model). Value head h reads key head
// h / (hv / hk). Bytes: S read and written once per chunk; FLOPs: ≈ 6 · dk · dv per token and head.

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

// The key head dim, fixed per model (lily-wgpu/src/plan.rs): constant loop bounds let the
// driver unroll the loops and keep the state column in registers.
override DK: u32 = 128u;

// Tokens per block: their q, k, β and decay are staged in shared memory by the whole workgroup
// (many reads in flight) before the block's recurrence runs from there; main's profile on the
// H200 (c7ee898): 844 µs per 512-token chunk and layer, ≈ 1.6 µs per token, each token's reads
// waited for inside the serial chain.
const TB: u32 = 16u;

// Each column's dk state rows are split over NS = 4 invocations (vec4 i of the column belongs
// to invocation slice i % 4), so the per-token dot products are chains of dk / 16 vec4 steps
// and a workgroup of 128 invocations = 4 slices × 32 columns; the 4 partial sums of u and of o
// meet in shared memory (double-buffered: one barrier each). With one invocation per column
// (32-invocation workgroups, 128 on the full model: one warp per SM) the H200 spent 446 µs per
// 512-token chunk (profile of main 07ac75d).
const NS: u32 = 4u;
const MV: u32 = 8u;   // vec4 of state per invocation at most (DK ≤ 128)

var<workgroup> qs: array<vec4<f32>, 512>;   // TB tokens × DK/4 (DK ≤ 128)
var<workgroup> ks: array<vec4<f32>, 512>;
var<workgroup> ba: array<vec2<f32>, 16>;    // (β, exp(g)) per token of the block
var<workgroup> red: array<f32, 256>;        // [buffer][slice][column] partial sums

@compute @workgroup_size(128)
fn dn_recur(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let h = wid.x;
    let col = lid % 32u;
    let sl = lid / 32u;
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
    var buf = 0u;
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
        for (var tt = 0u; tt < n; tt++) {
            let t = tb + tt;
            let beta = ba[tt].x;
            let alpha = ba[tt].y;
            let base = tt * d4;
            var u4 = vec4<f32>(0.0);
            for (var m = 0u; m < MV; m++) {
                let i4 = sl + NS * m;
                if (i4 < d4) {
                    s[m] *= alpha;
                    u4 += s[m] * ks[base + i4];
                }
            }
            red[buf * 128u + lid] = (u4.x + u4.y) + (u4.z + u4.w);
            workgroupBarrier();
            let rb = buf * 128u + col;
            let u = (red[rb] + red[rb + 32u]) + (red[rb + 64u] + red[rb + 96u]);
            buf ^= 1u;
            let delta = beta * (vv[tt] - u);
            var o4 = vec4<f32>(0.0);
            for (var m = 0u; m < MV; m++) {
                let i4 = sl + NS * m;
                if (i4 < d4) {
                    s[m] += ks[base + i4] * delta;
                    o4 += s[m] * qs[base + i4];
                }
            }
            red[buf * 128u + lid] = (o4.x + o4.y) + (o4.z + o4.w);
            workgroupBarrier();
            let ob = buf * 128u + col;
            let o = (red[ob] + red[ob + 32u]) + (red[ob + 64u] + red[ob + 96u]);
            buf ^= 1u;
            if (live && sl == 0u) {
                O[t * p.hv * p.dv + h * p.dv + j] = ACT(o);
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
