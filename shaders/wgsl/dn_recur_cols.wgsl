// A decode step's DeltaNet recurrence over blocks of CB columns of a value head
// (`WgpuOptions::dn_split`): dn_recur_norm.wgsl's q/k norms and gated delta rule without its
// output norm. That norm couples a head's dv columns and so kept a head in one workgroup (32
// workgroups on the full model, each moving its head's 64 KB of state in and out through one
// SM); without it the columns are independent: hv · ⌈dv / CB⌉ workgroups of 512, invocation
// lid = q · CB + c owning rows q · n .. (q + 1) · n − 1 (n = DK / (512 / CB)) of column c of its
// block. o = Sᵀq (q l2-normalised and scaled) goes out unnormalised; out_proj's linear_q4_rows
// applies w ⊙ o · rsqrt(mean(o²) + eps) ⊙ silu(z) as it reads it (its `gate`).
//
// Gated DeltaNet step 5–7 (MODEL.md §2.5), recurrent form, fp32 state S [hv, dk, dv]:
//   β = sigmoid(b), g = −exp(A_log) · softplus(a + dt_bias), S ← exp(g) · S,
//   u = Sᵀk, δ = β (v − u), S ← S + k δᵀ, o = Sᵀq (the updated state).
// Bytes a workgroup: its DK · CB state values read and written (16 KB each way at DK 128, CB 32),
// q and k (DK each) and v (CB) from L2; FLOPs ≈ 6 · DK · CB. The plan takes this kernel where
// n is a whole number of vec4 (DK a multiple of 4 · 512 / CB) and at most 32.

struct P {
    tokens: u32,
    hv: u32,
    hk: u32,
    dk: u32,
    dv: u32,
    cd: u32,
    ba_stride: u32,  // BA: row stride (per token) and offset of b (a follows at + hv)
    ba_off: u32,
    z_off: u32,      // dn_recur_norm.wgsl's parameters: z and eps are out_proj's here
    eps: f32,
    qscale: f32,     // 1 / sqrt(dk)
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> C: array<ACT4>;    // conv output q | k | v
@group(0) @binding(2) var<storage, read> BA: array<ACT>;    // per token: b[hv] then a[hv]
@group(0) @binding(3) var<storage, read> decay: array<f32>; // A_log[hv] then dt_bias[hv]
@group(0) @binding(4) var<storage, read_write> S: array<f32>;
@group(0) @binding(5) var<storage, read_write> O: array<ACT>; // [hv · dv], o unnormalised

override DK: u32 = 128u;
// Columns a workgroup (a divisor of 512).
override CB: u32 = 32u;
const WG: u32 = 512u;

// The slices' partials of u and o: [slice · CB + column]; the slices' Σ q², Σ k².
var<workgroup> part_u: array<f32, 512>;
var<workgroup> part_o: array<f32, 512>;
var<workgroup> nqk: array<vec2<f32>, 64>;

@compute @workgroup_size(512)
fn dn_recur_cols(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let h = wid.x;
    let slices = WG / CB;
    let q = lid / CB;
    let c = lid % CB;
    let jj = wid.y * CB + c;
    // Columns past dv compute on column 0 (in bounds) and write nothing, so every invocation
    // reaches the barriers below.
    let live = jj < p.dv;
    let j = select(0u, jj, live);
    let n = DK / slices;
    let i0 = q * n;
    let key_dim = p.hk * DK;
    let kh = h / (p.hv / p.hk);
    var s: array<f32, 32>;
    for (var i = 0u; i < n; i++) {
        s[i] = S[(h * DK + i0 + i) * p.dv + j];
    }
    let vi = 2u * key_dim + h * p.dv + j;
    let v = f32(C[vi / 4u][vi % 4u]);
    let beta = sigmoid(f32(BA[p.ba_off + h]));
    let g = -exp(decay[h]) * softplus(f32(BA[p.ba_off + p.hv + h]) + decay[p.hv + h]);
    let alpha = exp(g);
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
    if (c == 0u) {
        nqk[q] = vec2<f32>((nq4.x + nq4.y) + (nq4.z + nq4.w), (nk4.x + nk4.y) + (nk4.z + nk4.w));
    }
    part_u[lid] = (u4.x + u4.y) + (u4.z + u4.w);
    workgroupBarrier();
    var nn = vec2<f32>(0.0);
    var ut = 0.0;
    for (var k = 0u; k < slices; k++) {
        nn += nqk[k];
        ut += part_u[k * CB + c];
    }
    let rq = p.qscale / sqrt(nn.x + 1e-6);
    let rk = 1.0 / sqrt(nn.y + 1e-6);
    let delta = beta * (v - rk * ut);
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
    if (live && q == 0u) {
        var ot = 0.0;
        for (var k = 0u; k < slices; k++) {
            ot += part_o[k * CB + c];
        }
        O[h * p.dv + jj] = ACT(rq * ot);
    }
}
