// Gated attention, steps 3–5 (MODEL.md §2.4): q_norm / k_norm per head, then NeoX RoPE on the
// first `rot` dims. One workgroup per (head, token) of the joint projection QKV (row stride
// `stride`: per token [query | gate per query head (2D wide) | keys | values]): heads 0..hq are
// query heads, written to Q; heads hq..hq+hkv key heads and hq+hkv..hq+2hkv value heads, written
// into the KV cache at position pos0 + token (values as they are). The host writes cos/sin for
// the chunk's positions into `rope` ([token][cos 0..rot/2 | sin 0..rot/2], computed in f64 as
// the CPU does).

struct P {
    hq: u32,
    hkv: u32,
    d: u32,
    rot: u32,
    pos0: u32,
    eps: f32,
    stride: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> QKV: array<ACT>;
@group(0) @binding(2) var<storage, read> norms: array<f32>;  // q_norm[d] then k_norm[d]
@group(0) @binding(3) var<storage, read> rope: array<f32>;
@group(0) @binding(4) var<storage, read_write> Q: array<ACT>;
@group(0) @binding(5) var<storage, read_write> Kc: array<KV>;
@group(0) @binding(6) var<storage, read_write> Vc: array<KV>;

var<workgroup> head: array<f32, 256>;

@compute @workgroup_size(64)
fn attn_prep(@builtin(workgroup_id) wid: vec3<u32>, lanes_in: Lanes) {
    lanes_init(lanes_in);
    let lid = lanes_in.lid;
    let h = wid.x;
    let t = wid.y;
    let d = p.d;
    let row = t * p.stride;
    let k0 = p.hq * 2u * d;
    if (h >= p.hq + p.hkv) {
        // A value head: into the cache as it is.
        let vh = h - p.hq - p.hkv;
        let src = row + k0 + p.hkv * d + vh * d;
        let dst = ((p.pos0 + t) * p.hkv + vh) * d;
        for (var c = lid; c < d; c += 64u) {
            Vc[dst + c] = KV(f32(QKV[src + c]));
        }
        return;
    }
    let is_q = h < p.hq;
    var ss = 0.0;
    for (var c = lid; c < d; c += 64u) {
        var v: f32;
        if (is_q) {
            v = f32(QKV[row + h * 2u * d + c]);
        } else {
            v = f32(QKV[row + k0 + (h - p.hq) * d + c]);
        }
        head[c] = v;
        ss += v * v;
    }
    let total = wg_sum(lid, ss);
    let r = 1.0 / sqrt(total / f32(d) + p.eps);
    var nb = 0u;
    if (!is_q) {
        nb = d;
    }
    for (var c = lid; c < d; c += 64u) {
        head[c] = head[c] * r * norms[nb + c];
    }
    workgroupBarrier();
    let half = p.rot / 2u;
    let rb = t * p.rot;
    for (var c = lid; c < d; c += 64u) {
        var y = head[c];
        if (c < half) {
            y = head[c] * rope[rb + c] - head[c + half] * rope[rb + half + c];
        } else if (c < p.rot) {
            let i = c - half;
            y = head[c] * rope[rb + i] + head[i] * rope[rb + half + i];
        }
        if (is_q) {
            Q[(t * p.hq + h) * d + c] = ACT(y);
        } else {
            Kc[((p.pos0 + t) * p.hkv + h - p.hq) * d + c] = KV(y);
        }
    }
}
