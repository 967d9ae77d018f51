// A decode step's DeltaNet conv (dn_conv.wgsl for one token) where the in_proj product does not
// run it itself (linear_q4_rows.wgsl's `conv_step`, the same arithmetic): one invocation per
// conv channel, the causal conv over the state's K − 1 earlier inputs and this one, the state
// shifted, silu into C. dn_recur_norm.wgsl normalises q and k itself.

struct P {
    cd: u32,
    k: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> M: array<ACT>;            // the joint in_proj output
@group(0) @binding(2) var<storage, read> taps: array<f32>;         // [cd, k]
@group(0) @binding(3) var<storage, read_write> state: array<f32>;  // [k − 1, cd]
@group(0) @binding(4) var<storage, read_write> C: array<ACT>;      // [cd]

@compute @workgroup_size(64)
fn dn_conv_step(@builtin(global_invocation_id) gid: vec3<u32>) {
    let ch = gid.x;
    if (ch >= p.cd) {
        return;
    }
    let km1 = p.k - 1u;
    let x = f32(M[ch]);
    var s = 0.0;
    for (var j = 0u; j < km1; j++) {
        s += taps[ch * p.k + j] * state[j * p.cd + ch];
    }
    s += taps[ch * p.k + km1] * x;
    for (var j = 0u; j + 1u < km1; j++) {
        state[j * p.cd + ch] = state[(j + 1u) * p.cd + ch];
    }
    if (km1 > 0u) {
        state[(km1 - 1u) * p.cd + ch] = x;
    }
    C[ch] = ACT(silu(s));
}
