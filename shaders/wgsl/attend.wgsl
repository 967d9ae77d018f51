// Gated attention, steps 6–7 (MODEL.md §2.4): causal softmax(q·Kᵀ · scale) V. One workgroup per
// (query head, token, split of the keys): split s takes keys [s · span, (s + 1) · span) of the
// token's causal range, in blocks of 64 with a running max (online softmax, fp32). With one
// split the workgroup writes o ⊙ sigmoid(gate) straight into O; with several (decode and short
// chunks: too few (head, token) pairs to fill the GPU) it writes its partial (acc[d], max, sum)
// and attend_merge.wgsl combines them. Query head h reads KV head h / (hq / hkv).
// Bytes: the cached K and V rows of the head's KV group, once per query head; FLOPs: 4 · D per key.

struct P {
    hq: u32,
    hkv: u32,
    d: u32,
    pos0: u32,
    scale: f32,
    nsplit: u32,
    span: u32,     // keys per split, a multiple of 64
    qg_stride: u32, // row stride of QG (the joint projection; gate of head h at h·2D + D)
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> Q: array<ACT4>;
@group(0) @binding(2) var<storage, read> QG: array<ACT>;
@group(0) @binding(3) var<storage, read> Kc: array<KV4>;
@group(0) @binding(4) var<storage, read> Vc: array<KV>;
@group(0) @binding(5) var<storage, read_write> O: array<ACT>;
// [(token · hq + head) · nsplit + split] · (d + 2): acc[d], running max, running sum.
@group(0) @binding(6) var<storage, read_write> Part: array<f32>;

// The head dim, fixed per model (lily-wgpu/src/plan.rs): the loops over it, and over the 64
// keys of a block, have constant bounds and unroll, so their reads issue together.
override D: u32 = 256u;

var<workgroup> qs: array<vec4<f32>, 64>;
var<workgroup> probs: array<f32, 64>;

@compute @workgroup_size(64)
fn attend(@builtin(workgroup_id) wid: vec3<u32>, lanes_in: Lanes) {
    lanes_init(lanes_in);
    let lid = lanes_in.lid;
    let h = wid.x;
    let t = wid.y;
    let split = wid.z;
    let d = D;
    let d4 = D / 4u;
    let kvh = h / (p.hq / p.hkv);
    for (var c = lid; c < d4; c += 64u) {
        qs[c] = vec4<f32>(Q[(t * p.hq + h) * d4 + c]);
    }
    workgroupBarrier();
    let n = p.pos0 + t + 1u;
    let k0 = split * p.span;
    let k1 = min(n, k0 + p.span);
    var m = NEG_BIG;
    var l_part = 0.0;
    var acc = array<f32, 4>(0.0, 0.0, 0.0, 0.0);
    for (var kb = k0; kb < k1; kb += 64u) {
        let j = kb + lid;
        var s = NEG_BIG;
        if (j < k1) {
            let kbase = (j * p.hkv + kvh) * d4;
            var dot4 = vec4<f32>(0.0);
            for (var c = 0u; c < d4; c++) {
                dot4 += qs[c] * vec4<f32>(Kc[kbase + c]);
            }
            s = (dot4.x + dot4.y + dot4.z + dot4.w) * p.scale;
        }
        let m_new = max(m, wg_max(lid, s));
        var pj = 0.0;
        if (j < k1) {
            pj = exp(s - m_new);
        }
        probs[lid] = pj;
        let corr = exp(m - m_new);
        l_part = l_part * corr + pj;
        m = m_new;
        workgroupBarrier();
        let cnt = min(64u, k1 - kb);
        for (var i = 0u; i < 4u; i++) {
            let c = lid + 64u * i;
            if (c < d) {
                var a = acc[i] * corr;
                for (var jj = 0u; jj < 64u; jj++) {
                    if (jj < cnt) {
                        a += probs[jj] * f32(Vc[((kb + jj) * p.hkv + kvh) * d + c]);
                    }
                }
                acc[i] = a;
            }
        }
        workgroupBarrier();
    }
    let l = wg_sum(lid, l_part);
    let row = t * p.hq + h;
    if (p.nsplit == 1u) {
        for (var i = 0u; i < 4u; i++) {
            let c = lid + 64u * i;
            if (c < d) {
                let g = f32(QG[t * p.qg_stride + h * 2u * d + d + c]);
                O[row * d + c] = ACT(acc[i] / l * sigmoid(g));
            }
        }
        return;
    }
    let pb = (row * p.nsplit + split) * (d + 2u);
    for (var i = 0u; i < 4u; i++) {
        let c = lid + 64u * i;
        if (c < d) {
            Part[pb + c] = acc[i];
        }
    }
    if (lid == 0u) {
        Part[pb + d] = m;
        Part[pb + d + 1u] = l;
    }
}
