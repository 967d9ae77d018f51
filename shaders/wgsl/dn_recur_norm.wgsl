// A decode step's DeltaNet recurrence and output norm in one dispatch (dn_recur.wgsl for one
// token, then gated_norm.wgsl): one workgroup of 512 per value head, invocation lid = q · 128 + j
// owns rows q · DK/4 .. (q + 1) · DK/4 − 1 of column j of the state (j < dv ≤ 128), so that each
// invocation keeps DK/4 state values in registers and a head's 64 KB (full model) are read by
// 16 warps with DK/4 loads each in flight, not 4 warps with DK each (session 11: the step was
// latency-bound on 32 workgroups of 128). The four slices' partial dot products meet in
// workgroup memory; then y = w ⊙ (o · rsqrt(mean(o²) + eps)) ⊙ silu(z) over the head. q and k
// come as the conv's output (C: q | k | v) and are l2-normalised here (dn_qk_norm.wgsl's
// arithmetic: × rsqrt(Σ² + 1e-6), queries also × qscale), the slices' sums of squares met in
// workgroup memory, so that no dispatch between the conv and this one is needed.
//
// Gated DeltaNet step 5–7 (MODEL.md §2.5), recurrent form, fp32 state S [hv, dk, dv]:
//   β = sigmoid(b), g = −exp(A_log) · softplus(a + dt_bias), S ← exp(g) · S,
//   u = Sᵀk, δ = β (v − u), S ← S + k δᵀ, o = Sᵀq (the updated state).
// Value head h reads key head h / (hv / hk). The plan takes this kernel where DK is a multiple
// of 16 (each slice whole vec4s) and dv ≤ 128.
// Bytes a head: the state read and written (DK · dv · 4 each: 64 KB on the full model), q, k (DK
// each), v, z (dv each) from L2; FLOPs ≈ 6 · DK · dv. The time is its chain of dependent steps
// (32 workgroups on the full model), not bytes.
//
// `ONE_SYNC` = 1 (`dn_one_sync`, WgpuOptions): one exchange instead of two and a short norm sum.
// The first loop also sums the slice's (αS₀)ᵀq and kᵀq; after its one barrier, o comes from
// o = S'ᵀq̂ = α S₀ᵀq̂ + δ (k̂ᵀq̂) (S' = αS₀ + k̂ δᵀ), so the state's update and stores leave
// the chain to the output; v, z and the norm's weight are read with the state at the start; the
// head's Σ o² is 16 partial sums of 8 columns (one barrier) then their sum in one order by every
// storing invocation (one barrier): 3 barriers, not 10, and one memory trip, not three. The
// state's values (and u, δ) are the same operations as with 0: the state is bit for bit the same;
// o is summed in another order (within rounding).

struct P {
    tokens: u32,
    hv: u32,
    hk: u32,
    dk: u32,
    dv: u32,
    cd: u32,
    ba_stride: u32,  // BA: row stride (per token) and offset of b (a follows at + hv)
    ba_off: u32,
    z_off: u32,      // z of head h at BA[z_off + h · dv] (the joint in_proj output)
    eps: f32,
    qscale: f32,     // 1 / sqrt(dk)
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> C: array<ACT4>; // conv output q | k | v
@group(0) @binding(2) var<storage, read> BA: array<ACT>;     // per token: b[hv] then a[hv]
@group(0) @binding(3) var<storage, read> decay: array<f32>;  // A_log[hv] then dt_bias[hv]
@group(0) @binding(4) var<storage, read_write> S: array<f32>;
@group(0) @binding(5) var<storage, read> Wn: array<f32>;     // the norm's weight [dv]
@group(0) @binding(6) var<storage, read_write> Y: array<ACT>; // [hv·dv]

// The slices' partials of u and o: [slice · 128 + column]; then the columns' o² for the norm.
var<workgroup> part_u: array<f32, 512>;
var<workgroup> part_o: array<f32, 512>;
var<workgroup> sq: array<f32, 128>;
// The slices' Σ q², Σ k².
var<workgroup> nqk: array<vec2<f32>, 4>;
// `ONE_SYNC`: the slices' Σ q², Σ k², Σ kq; the 16 partial sums of 8 columns' o².
var<workgroup> nqk3: array<vec4<f32>, 4>;
var<workgroup> sq16: array<f32, 16>;

// The key head dim, fixed per model (lily-wgpu/src/plan.rs): constant loop bounds let the
// driver unroll the loops and keep the state slice in registers.
override DK: u32 = 128u;
override ONE_SYNC: u32 = 0u;
const SLICES: u32 = 4u;

@compute @workgroup_size(512)
fn dn_recur_norm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let h = wid.x;
    let q = lid / 128u;
    let jj = lid % 128u;
    // Columns past dv compute on column 0 (in bounds) and write nothing, so every invocation
    // reaches the barriers below.
    let live = jj < p.dv;
    let j = select(0u, jj, live);
    let n = DK / SLICES;
    let i0 = q * n;
    let key_dim = p.hk * DK;
    let kh = h / (p.hv / p.hk);
    var s: array<f32, 32>;
    for (var i = 0u; i < n; i++) {
        s[i] = S[(h * DK + i0 + i) * p.dv + j];
    }
    let t = 0u;
    let vi = 2u * key_dim + h * p.dv + j;
    let beta = sigmoid(f32(BA[t * p.ba_stride + p.ba_off + h]));
    let g = -exp(decay[h]) * softplus(f32(BA[t * p.ba_stride + p.ba_off + p.hv + h]) + decay[p.hv + h]);
    let alpha = exp(g);
    // `ONE_SYNC` = 1 (see the file's head): the step from here in one exchange. Every invocation
    // reaches its three barriers (the branch is uniform: an override; `live` only masks stores).
    if (ONE_SYNC == 1u) {
        let qb = (kh * DK + i0) / 4u;
        let kb = qb + key_dim / 4u;
        // Read with the state: v, z and the norm's weight of column j.
        let v = f32(C[vi / 4u][vi % 4u]);
        let z = f32(BA[p.z_off + h * p.dv + j]);
        let wn = Wn[j];
        var nq4 = vec4<f32>(0.0);
        var nk4 = vec4<f32>(0.0);
        var nkq4 = vec4<f32>(0.0);
        var u4 = vec4<f32>(0.0);
        var o4 = vec4<f32>(0.0);
        for (var i = 0u; i < n; i += 4u) {
            let sv = vec4<f32>(s[i], s[i + 1u], s[i + 2u], s[i + 3u]) * alpha;
            s[i] = sv.x;
            s[i + 1u] = sv.y;
            s[i + 2u] = sv.z;
            s[i + 3u] = sv.w;
            let q4 = vec4<f32>(C[qb + i / 4u]);
            let k4 = vec4<f32>(C[kb + i / 4u]);
            nq4 += q4 * q4;
            nk4 += k4 * k4;
            nkq4 += k4 * q4;
            u4 += sv * k4;
            o4 += sv * q4;
        }
        if (jj == 0u) {
            nqk3[q] = vec4<f32>(
                (nq4.x + nq4.y) + (nq4.z + nq4.w),
                (nk4.x + nk4.y) + (nk4.z + nk4.w),
                (nkq4.x + nkq4.y) + (nkq4.z + nkq4.w),
                0.0,
            );
        }
        part_u[lid] = (u4.x + u4.y) + (u4.z + u4.w);
        part_o[lid] = (o4.x + o4.y) + (o4.z + o4.w);
        workgroupBarrier();
        let nn = (nqk3[0] + nqk3[1]) + (nqk3[2] + nqk3[3]);
        let rq = p.qscale / sqrt(nn.x + 1e-6);
        let rk = 1.0 / sqrt(nn.y + 1e-6);
        let u = rk * ((part_u[jj] + part_u[128u + jj]) + (part_u[256u + jj] + part_u[384u + jj]));
        let delta = beta * (v - u);
        let sq_raw = (part_o[jj] + part_o[128u + jj]) + (part_o[256u + jj] + part_o[384u + jj]);
        let o = rq * (sq_raw + delta * (rk * nn.z));
        if (q == 0u) {
            sq[jj] = select(0.0, o * o, live);
        }
        // The state's update and stores, off the chain to the output (the same operations as
        // ONE_SYNC 0's second loop).
        if (live) {
            for (var i = 0u; i < n; i += 4u) {
                let k4 = vec4<f32>(C[kb + i / 4u]) * rk;
                let sv = vec4<f32>(s[i], s[i + 1u], s[i + 2u], s[i + 3u]) + k4 * delta;
                let r0 = (h * DK + i0 + i) * p.dv + j;
                S[r0] = sv.x;
                S[r0 + p.dv] = sv.y;
                S[r0 + 2u * p.dv] = sv.z;
                S[r0 + 3u * p.dv] = sv.w;
            }
        }
        workgroupBarrier();
        if (lid < 16u) {
            let b = lid * 8u;
            sq16[lid] = ((sq[b] + sq[b + 1u]) + (sq[b + 2u] + sq[b + 3u]))
                + ((sq[b + 4u] + sq[b + 5u]) + (sq[b + 6u] + sq[b + 7u]));
        }
        workgroupBarrier();
        if (live && q == 0u) {
            var t = 0.0;
            for (var m = 0u; m < 16u; m++) {
                t += sq16[m];
            }
            let r = 1.0 / sqrt(t / f32(p.dv) + p.eps);
            Y[h * p.dv + j] = ACT(o * r * wn * silu(z));
        }
        return;
    }
    // q and k of the token as vec4 (this slice's DK/4 rows, unnormalised); four partial sums
    // each. One token: C holds q at 0, k at key_dim, v at 2·key_dim.
    let qb = (kh * DK + i0) / 4u;
    let kb = qb + key_dim / 4u;
    var nq4 = vec4<f32>(0.0);
    var nk4 = vec4<f32>(0.0);
    var u4 = vec4<f32>(0.0);
    for (var i = 0u; i < n; i += 4u) {
        let sv = vec4<f32>(s[i], s[i + 1u], s[i + 2u], s[i + 3u]) * alpha;
        s[i] = sv.x;
        s[i + 1u] = sv.y;
        s[i + 2u] = sv.z;
        s[i + 3u] = sv.w;
        let q4 = vec4<f32>(C[qb + i / 4u]);
        let k4 = vec4<f32>(C[kb + i / 4u]);
        nq4 += q4 * q4;
        nk4 += k4 * k4;
        u4 += sv * k4;
    }
    if (jj == 0u) {
        nqk[q] = vec2<f32>((nq4.x + nq4.y) + (nq4.z + nq4.w), (nk4.x + nk4.y) + (nk4.z + nk4.w));
    }
    part_u[lid] = (u4.x + u4.y) + (u4.z + u4.w);
    workgroupBarrier();
    let nn = (nqk[0] + nqk[1]) + (nqk[2] + nqk[3]);
    let rq = p.qscale / sqrt(nn.x + 1e-6);
    let rk = 1.0 / sqrt(nn.y + 1e-6);
    let u = rk * ((part_u[jj] + part_u[128u + jj]) + (part_u[256u + jj] + part_u[384u + jj]));
    let v = f32(C[vi / 4u][vi % 4u]);
    let delta = beta * (v - u);
    var o4 = vec4<f32>(0.0);
    for (var i = 0u; i < n; i += 4u) {
        let k4 = vec4<f32>(C[kb + i / 4u]) * rk;
        let sv = vec4<f32>(s[i], s[i + 1u], s[i + 2u], s[i + 3u]) + k4 * delta;
        s[i] = sv.x;
        s[i + 1u] = sv.y;
        s[i + 2u] = sv.z;
        s[i + 3u] = sv.w;
        o4 += sv * vec4<f32>(C[qb + i / 4u]);
    }
    if (live) {
        for (var i = 0u; i < n; i++) {
            S[(h * DK + i0 + i) * p.dv + j] = s[i];
        }
    }
    part_o[lid] = (o4.x + o4.y) + (o4.z + o4.w);
    workgroupBarrier();
    let o = rq * ((part_o[jj] + part_o[128u + jj]) + (part_o[256u + jj] + part_o[384u + jj]));
    if (q == 0u) {
        sq[jj] = select(0.0, o * o, live);
    }
    workgroupBarrier();
    for (var w = 64u; w > 0u; w = w >> 1u) {
        if (lid < w) {
            sq[lid] += sq[lid + w];
        }
        workgroupBarrier();
    }
    let r = 1.0 / sqrt(sq[0] / f32(p.dv) + p.eps);
    if (live && q == 0u) {
        let z = f32(BA[p.z_off + h * p.dv + j]);
        Y[h * p.dv + j] = ACT(o * r * Wn[j] * silu(z));
    }
}
