// MoE routing (MODEL.md §2.6): softmax over all experts, top-k (ties to the lower id), weights
// renormalised over the k picked. One workgroup of 256 per token: the logits are read once into
// shared memory, then each invocation ranks its expert(s) against all others (rank = how many
// come before it), so the k picked are found in one pass with no serial selection. E ≤ 512
// (checked at load). Where the shared expert rides in the routed stacks (`stacked`), item k of
// the token is expert E with weight sigmoid(its gate logit, column E of the router's output).

struct P {
    tokens: u32,
    e: u32,
    k: u32,
    stride: u32,   // row stride of L (the router's joint output: E logits, then the shared gate's)
    ks: u32,       // items per token in ids / wts: k, or k + 1 with the shared expert
    stacked: u32,  // 1: item k is the shared expert (id E), weight sigmoid(L[t, E])
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> L: array<f32>;            // [tokens, stride] router logits
@group(0) @binding(2) var<storage, read_write> ids: array<u32>;    // [tokens, ks]
@group(0) @binding(3) var<storage, read_write> wts: array<f32>;    // [tokens, ks]

const T: u32 = 256u;

var<workgroup> ev: array<f32, 512>;
var<workgroup> red: array<f32, 256>;
var<workgroup> picked: array<u32, 16>;

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

@compute @workgroup_size(256)
fn moe_route(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = wid.x;
    let b = t * p.stride;
    var mx = NEG_BIG;
    for (var i = lid; i < p.e; i += T) {
        let l = L[b + i];
        ev[i] = l;
        mx = max(mx, l);
    }
    mx = red_max(lid, mx);
    var part = 0.0;
    for (var i = lid; i < p.e; i += T) {
        let v = exp(ev[i] - mx);
        ev[i] = v;
        part += v;
    }
    let sum = red_sum(lid, part);
    for (var i = lid; i < p.e; i += T) {
        let v = ev[i];
        var rank = 0u;
        for (var j = 0u; j < p.e; j++) {
            let u = ev[j];
            rank += u32(u > v || (u == v && j < i));
        }
        if (rank < p.k) {
            picked[rank] = i;
        }
    }
    workgroupBarrier();
    if (lid == 0u) {
        var kept = 0.0;
        for (var k = 0u; k < p.k; k++) {
            kept += ev[picked[k]] / sum;
        }
        for (var k = 0u; k < p.k; k++) {
            let i = picked[k];
            ids[t * p.ks + k] = i;
            wts[t * p.ks + k] = ev[i] / sum / kept;
        }
        if (p.stacked != 0u) {
            ids[t * p.ks + p.k] = p.e;
            wts[t * p.ks + p.k] = sigmoid(L[b + p.e]);
        }
    }
}
