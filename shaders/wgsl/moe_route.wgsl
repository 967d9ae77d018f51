// MoE routing (MODEL.md §2.6): softmax over all experts, top-k (ties to the lower id), weights
// renormalised over the k picked. One invocation per token (E = 256, k = 8: a few µs).

struct P {
    tokens: u32,
    e: u32,
    k: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> L: array<f32>;            // [tokens, e] router logits
@group(0) @binding(2) var<storage, read_write> ids: array<u32>;    // [tokens, k]
@group(0) @binding(3) var<storage, read_write> wts: array<f32>;    // [tokens, k]

@compute @workgroup_size(64)
fn moe_route(@builtin(global_invocation_id) gid: vec3<u32>) {
    let t = gid.x;
    if (t >= p.tokens) {
        return;
    }
    let b = t * p.e;
    var mx = NEG_BIG;
    for (var i = 0u; i < p.e; i++) {
        mx = max(mx, L[b + i]);
    }
    var sum = 0.0;
    for (var i = 0u; i < p.e; i++) {
        sum += exp(L[b + i] - mx);
    }
    var picked: array<u32, 16>;
    var probs: array<f32, 16>;
    var kept = 0.0;
    for (var k = 0u; k < p.k; k++) {
        var best = 0u;
        var bv = -1.0;
        for (var i = 0u; i < p.e; i++) {
            var taken = false;
            for (var q = 0u; q < k; q++) {
                if (picked[q] == i) {
                    taken = true;
                }
            }
            let v = exp(L[b + i] - mx);
            if (!taken && v > bv) {
                bv = v;
                best = i;
            }
        }
        picked[k] = best;
        probs[k] = bv / sum;
        kept += bv / sum;
    }
    for (var k = 0u; k < p.k; k++) {
        ids[t * p.k + k] = picked[k];
        wts[t * p.k + k] = probs[k] / kept;
    }
}
