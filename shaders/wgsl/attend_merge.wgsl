// Combines attend.wgsl's partials of one (query head, token) over its key splits:
//   M = max m_s, L = Σ l_s e^(m_s − M), o = Σ acc_s e^(m_s − M) / L, then o ⊙ sigmoid(gate).
// A split that held no keys has l = 0 and m = NEG_BIG and adds nothing. Each split's (m, l) is
// read once (invocation s), its factor e^(m_s − M) kept in shared memory; the column sums then
// read the partials with no dependent loads between them. A workgroup per (head, token, 64 columns). nsplit ≤ 64 (attention_splits).

struct P {
    hq: u32,
    d: u32,
    nsplit: u32,
    qg_stride: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> Part: array<f32>;
@group(0) @binding(2) var<storage, read> QG: array<ACT>;
@group(0) @binding(3) var<storage, read_write> O: array<ACT>;

var<workgroup> factor: array<f32, 64>;

@compute @workgroup_size(64)
fn attend_merge(@builtin(workgroup_id) wid: vec3<u32>, lanes_in: Lanes) {
    lanes_init(lanes_in);
    let lid = lanes_in.lid;
    let row = wid.y * p.hq + wid.x;
    let d = p.d;
    let w = d + 2u;
    let b = row * p.nsplit * w;
    var ms = NEG_BIG;
    var ls = 0.0;
    if (lid < p.nsplit) {
        ms = Part[b + lid * w + d];
        ls = Part[b + lid * w + d + 1u];
    }
    let mx = wg_max(lid, ms);
    var f = 0.0;
    if (ls > 0.0) {
        f = exp(ms - mx);
    }
    factor[lid] = f;
    let l = wg_sum(lid, ls * f);
    // Workgroup z: columns 64 z .. 64 z + 63 (more workgroups at decode: 16 heads × 4).
    workgroupBarrier();
    let c = wid.z * 64u + lid;
    if (c < d) {
        var a = 0.0;
        for (var s = 0u; s < p.nsplit; s++) {
            a += Part[b + s * w + c] * factor[s];
        }
        let g = f32(QG[wid.y * p.qg_stride + wid.x * 2u * d + d + c]);
        O[row * d + c] = ACT(a / l * sigmoid(g));
    }
}
