// A decode step's DeltaNet conv and q/k norm in one dispatch (dn_conv.wgsl then dn_qk_norm.wgsl
// for one token): one workgroup per block of `dk` conv channels. Each invocation runs the causal
// conv of its channels (state shift, silu) into C; a block that is a query or key head (blocks
// 0..2·hk) then also writes its l2-normalised values (queries × 1/sqrt(dk)) into QK.
// Needs cd % dk = 0 (the host checks).

struct P {
    cd: u32,
    k: u32,
    m_stride: u32,
    hk: u32,
    dk: u32,
    qscale: f32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> M: array<f32>;            // the joint in_proj output
@group(0) @binding(2) var<storage, read> taps: array<f32>;         // [cd, k]
@group(0) @binding(3) var<storage, read_write> state: array<f32>;  // [k − 1, cd]
@group(0) @binding(4) var<storage, read_write> C: array<f32>;      // [cd]
@group(0) @binding(5) var<storage, read_write> QK: array<f32>;     // [2·hk·dk]

var<workgroup> vals: array<f32, 256>;

@compute @workgroup_size(64)
fn dn_conv_norm(@builtin(workgroup_id) wid: vec3<u32>, lanes_in: Lanes) {
    lanes_init(lanes_in);
    let lid = lanes_in.lid;
    let block = wid.x;
    let km1 = p.k - 1u;
    var ss = 0.0;
    for (var c = lid; c < p.dk; c += 64u) {
        let ch = block * p.dk + c;
        let x = M[ch];
        var s = 0.0;
        for (var j = 0u; j < km1; j++) {
            s += taps[ch * p.k + j] * state[j * p.cd + ch];
        }
        s += taps[ch * p.k + km1] * x;
        for (var j = 0u; j + 1u < km1; j++) {
            state[j * p.cd + ch] = state[(j + 1u) * p.cd + ch];
        }
        state[(km1 - 1u) * p.cd + ch] = x;
        let y = silu(s);
        C[ch] = y;
        vals[c] = y;
        ss += y * y;
    }
    if (block >= 2u * p.hk) {
        return;
    }
    let total = wg_sum(lid, ss);
    let r = 1.0 / sqrt(total + 1e-6);
    var scale = 1.0;
    if (block < p.hk) {
        scale = p.qscale;
    }
    for (var c = lid; c < p.dk; c += 64u) {
        if (block < p.hk) {
            QK[block * p.dk + c] = vals[c] * r * scale;
        } else {
            QK[block * p.dk + c] = vals[c] * r;
        }
    }
}
