// Combines attend.wgsl's partials of one (query head, token) over its key splits:
//   M = max m_s, L = Σ l_s e^(m_s − M), o = Σ acc_s e^(m_s − M) / L, then o ⊙ sigmoid(gate).
// A split that held no keys has l = 0 and m = NEG_BIG and adds nothing. Each split's (m, l) is
// read by one invocation (split s by invocation s mod 64), its factor e^(m_s − M) kept in shared
// memory (0 past the last split); the column sums then read the partials 8 splits at a time with
// no condition around the reads (past the last split: the last again, times 0), so 8 reads of an
// invocation are in flight together. The same sums in the same order for any count. A workgroup
// per (head, token, 64 columns). nsplit ≤ SMAX (forward.rs `MERGE_MAX_SPLITS`).

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

// Most splits (forward.rs `MERGE_MAX_SPLITS`).
const SMAX: u32 = 256u;

var<workgroup> factor: array<f32, SMAX>;

@compute @workgroup_size(64)
fn attend_merge(@builtin(workgroup_id) wid: vec3<u32>, lanes_in: Lanes) {
    lanes_init(lanes_in);
    let lid = lanes_in.lid;
    let row = wid.y * p.hq + wid.x;
    let d = p.d;
    let w = d + 2u;
    let b = row * p.nsplit * w;
    var ms = NEG_BIG;
    for (var s = lid; s < p.nsplit; s += 64u) {
        ms = max(ms, Part[b + s * w + d]);
    }
    let mx = wg_max(lid, ms);
    var ls = 0.0;
    for (var s = lid; s < SMAX; s += 64u) {
        var f = 0.0;
        if (s < p.nsplit) {
            let l_s = Part[b + s * w + d + 1u];
            if (l_s > 0.0) {
                f = exp(Part[b + s * w + d] - mx);
            }
            ls += l_s * f;
        }
        factor[s] = f;
    }
    let l = wg_sum(lid, ls);
    // Workgroup z: columns 64 z .. 64 z + 63 (more workgroups at decode: 16 heads × 4).
    workgroupBarrier();
    let c = wid.z * 64u + lid;
    if (c < d) {
        let last = p.nsplit - 1u;
        var a = 0.0;
        for (var s0 = 0u; s0 < p.nsplit; s0 += 8u) {
            var x = array<f32, 8>();
            for (var i = 0u; i < 8u; i++) {
                x[i] = Part[b + min(s0 + i, last) * w + c];
            }
            for (var i = 0u; i < 8u; i++) {
                a += x[i] * factor[s0 + i];
            }
        }
        let g = f32(QG[wid.y * p.qg_stride + wid.x * 2u * d + d + c]);
        O[row * d + c] = ACT(a / l * sigmoid(g));
    }
}
