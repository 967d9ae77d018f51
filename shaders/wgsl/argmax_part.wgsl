// Greedy token selection, stage 1 of 2 (stage 2: argmax_final.wgsl): workgroup b takes logits
// [b · span, (b + 1) · span) and writes Parts[4b..4b + 3] = (its largest logit, that logit's
// first id as bits, Σ exp(l − largest) over its range, 0). Many workgroups read the vocabulary
// (248,320 logits: ≈ 1 MB) at once instead of one.

struct P {
    n: u32,
    span: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> L: array<f32>;
@group(0) @binding(2) var<storage, read_write> Parts: array<f32>;

@compute @workgroup_size(256)
fn argmax_part(@builtin(workgroup_id) wid: vec3<u32>, lanes_in: Lanes) {
    lanes_init(lanes_in);
    let lid = lanes_in.lid;
    let a = wid.x * p.span;
    let b = min(a + p.span, p.n);
    var m = NEG_BIG;
    var mi = 0xffffffffu;
    for (var i = a + lid; i < b; i += 256u) {
        let v = L[i];
        if (v > m) {
            m = v;
            mi = i;
        }
    }
    let best = wg256_argmax(lid, m, mi);
    let mx = best.v;
    let idx = best.i;
    var sum = 0.0;
    for (var i = a + lid; i < b; i += 256u) {
        sum += exp(L[i] - mx);
    }
    let total = wg256_sum(lid, sum);
    if (lid == 0u) {
        Parts[4u * wid.x] = mx;
        Parts[4u * wid.x + 1u] = bitcast<f32>(idx);
        Parts[4u * wid.x + 2u] = total;
        Parts[4u * wid.x + 3u] = 0.0;
    }
}
