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

var<workgroup> best_v: array<f32, 256>;
var<workgroup> best_i: array<u32, 256>;

@compute @workgroup_size(256)
fn argmax_part(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
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
    for (var i = a + lid; i < b; i += 256u) {
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
        Parts[4u * wid.x] = mx;
        Parts[4u * wid.x + 1u] = bitcast<f32>(idx);
        Parts[4u * wid.x + 2u] = best_v[0];
        Parts[4u * wid.x + 3u] = 0.0;
    }
}
