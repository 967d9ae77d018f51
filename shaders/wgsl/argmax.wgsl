// Greedy token selection on the GPU: the lowest id of the largest logit, and its log-probability
// −log Σ exp(l − max). One workgroup of 256 scans the vocabulary (248,320 logits: ≈ 1 MB read).
// Out[0] = token id, Out[1] = the log-probability's bits; the next step's embedding reads Out[0].

struct P {
    n: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> L: array<f32>;
@group(0) @binding(2) var<storage, read_write> Out: array<u32>;

var<workgroup> best_v: array<f32, 256>;
var<workgroup> best_i: array<u32, 256>;

@compute @workgroup_size(256)
fn argmax(@builtin(local_invocation_index) lid: u32) {
    var m = NEG_BIG;
    var mi = 0xffffffffu;
    for (var i = lid; i < p.n; i += 256u) {
        let v = L[i];
        if (v > m) {
            m = v;
            mi = i;
        }
    }
    best_v[lid] = m;
    best_i[lid] = mi;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s = s >> 1u) {
        if (lid < s) {
            let ov = best_v[lid + s];
            let oi = best_i[lid + s];
            if (ov > best_v[lid] || (ov == best_v[lid] && oi < best_i[lid])) {
                best_v[lid] = ov;
                best_i[lid] = oi;
            }
        }
        workgroupBarrier();
    }
    let mx = best_v[0];
    let idx = best_i[0];
    workgroupBarrier();
    var sum = 0.0;
    for (var i = lid; i < p.n; i += 256u) {
        sum += exp(L[i] - mx);
    }
    best_v[lid] = sum;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s = s >> 1u) {
        if (lid < s) {
            best_v[lid] += best_v[lid + s];
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        Out[0] = idx;
        Out[1] = bitcast<u32>(-log(best_v[0]));
    }
}
