// Greedy token selection, stage 2 of 2: over argmax_part.wgsl's `parts` partials, the lowest id
// of the largest logit M (ranges are in id order, so the first range holding M has it) and its
// log-probability −log Σ_b sum_b · exp(max_b − M). Out[0] = token id, Out[1] = the
// log-probability's bits; the next step's embedding reads Out[0].

struct P {
    parts: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> Parts: array<f32>;
@group(0) @binding(2) var<storage, read_write> Out: array<u32>;

@compute @workgroup_size(256)
fn argmax_final(lanes_in: Lanes) {
    lanes_init(lanes_in);
    let lid = lanes_in.lid;
    var m = NEG_BIG;
    var mi = 0xffffffffu;
    for (var b = lid; b < p.parts; b += 256u) {
        let v = Parts[4u * b];
        let i = bitcast<u32>(Parts[4u * b + 1u]);
        if (v > m || (v == m && i < mi)) {
            m = v;
            mi = i;
        }
    }
    let best = wg256_argmax(lid, m, mi);
    let mx = best.v;
    let idx = best.i;
    var sum = 0.0;
    for (var b = lid; b < p.parts; b += 256u) {
        let s = Parts[4u * b + 2u];
        if (s > 0.0) {
            sum += s * exp(Parts[4u * b] - mx);
        }
    }
    let total = wg256_sum(lid, sum);
    if (lid == 0u) {
        Out[0] = idx;
        Out[1] = bitcast<u32>(-log(total));
    }
}
