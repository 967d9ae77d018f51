// Gated attention, steps 6–7 (MODEL.md §2.4): causal softmax(q·Kᵀ · scale) V for one query head
// and token per workgroup, keys in blocks of 64 with a running max (online softmax, fp32), then
// o ⊙ sigmoid(gate). Query head h reads KV head h / (hq / hkv). Bytes: the cached K and V rows
// of the head's KV group, once per query head; FLOPs: 4 · D per key.

struct P {
    hq: u32,
    hkv: u32,
    d: u32,
    pos0: u32,
    scale: f32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> Q: array<f32>;
@group(0) @binding(2) var<storage, read> QG: array<f32>;
@group(0) @binding(3) var<storage, read> Kc: array<f32>;
@group(0) @binding(4) var<storage, read> Vc: array<f32>;
@group(0) @binding(5) var<storage, read_write> O: array<f32>;

var<workgroup> qs: array<f32, 256>;
var<workgroup> probs: array<f32, 64>;

@compute @workgroup_size(64)
fn attend(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let h = wid.x;
    let t = wid.y;
    let d = p.d;
    let kvh = h / (p.hq / p.hkv);
    for (var c = lid; c < d; c += 64u) {
        qs[c] = Q[(t * p.hq + h) * d + c];
    }
    workgroupBarrier();
    let n = p.pos0 + t + 1u;
    var m = NEG_BIG;
    var l = 0.0;
    var acc = array<f32, 4>(0.0, 0.0, 0.0, 0.0);
    for (var kb = 0u; kb < n; kb += 64u) {
        let j = kb + lid;
        var s = NEG_BIG;
        if (j < n) {
            let kbase = (j * p.hkv + kvh) * d;
            var dotv = 0.0;
            for (var c = 0u; c < d; c++) {
                dotv += qs[c] * Kc[kbase + c];
            }
            s = dotv * p.scale;
        }
        let m_new = max(m, wg_max(lid, s));
        var pj = 0.0;
        if (j < n) {
            pj = exp(s - m_new);
        }
        probs[lid] = pj;
        let corr = exp(m - m_new);
        l = l * corr + wg_sum(lid, pj);
        m = m_new;
        let cnt = min(64u, n - kb);
        for (var i = 0u; i < 4u; i++) {
            let c = lid + 64u * i;
            if (c < d) {
                var a = acc[i] * corr;
                for (var jj = 0u; jj < cnt; jj++) {
                    a += probs[jj] * Vc[((kb + jj) * p.hkv + kvh) * d + c];
                }
                acc[i] = a;
            }
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i++) {
        let c = lid + 64u * i;
        if (c < d) {
            let g = QG[(t * p.hq + h) * 2u * d + d + c];
            O[(t * p.hq + h) * d + c] = acc[i] / l * sigmoid(g);
        }
    }
}
