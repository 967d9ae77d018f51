// Gated DeltaNet step 4 (MODEL.md §2.5): q ← l2norm(q)/sqrt(dk), k ← l2norm(k) per key head,
// l2norm(x) = x · rsqrt(Σx² + 1e-6). One workgroup per (head, token): heads 0..hk are query
// heads, hk..2hk key heads (the conv output holds them in that order). Out: [token, 2·hk·dk].

struct P {
    hk: u32,
    dk: u32,
    cd: u32,
    qscale: f32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> C: array<ACT>;
@group(0) @binding(2) var<storage, read_write> QK: array<ACT>;

@compute @workgroup_size(64)
fn dn_qk_norm(@builtin(workgroup_id) wid: vec3<u32>, lanes_in: Lanes) {
    lanes_init(lanes_in);
    let lid = lanes_in.lid;
    let hh = wid.x;
    let t = wid.y;
    let src = t * p.cd + hh * p.dk;
    let dst = (t * 2u * p.hk + hh) * p.dk;
    var ss = 0.0;
    for (var c = lid; c < p.dk; c += 64u) {
        let v = f32(C[src + c]);
        ss += v * v;
    }
    let total = wg_sum(lid, ss);
    let r = 1.0 / sqrt(total + 1e-6);
    var scale = 1.0;
    if (hh < p.hk) {
        scale = p.qscale;
    }
    for (var c = lid; c < p.dk; c += 64u) {
        if (hh < p.hk) {
            QK[dst + c] = ACT(f32(C[src + c]) * r * scale);
        } else {
            QK[dst + c] = ACT(f32(C[src + c]) * r);
        }
    }
}
