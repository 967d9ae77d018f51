// Combines attend.wgsl's partials of one (query head, token) over its key splits:
//   M = max m_s, L = Σ l_s e^(m_s − M), o = Σ acc_s e^(m_s − M) / L, then o ⊙ sigmoid(gate).
// A split that held no keys has l = 0 and m = NEG_BIG and adds nothing.

struct P {
    hq: u32,
    d: u32,
    nsplit: u32,
    qg_stride: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> Part: array<f32>;
@group(0) @binding(2) var<storage, read> QG: array<f32>;
@group(0) @binding(3) var<storage, read_write> O: array<f32>;

@compute @workgroup_size(64)
fn attend_merge(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let row = wid.y * p.hq + wid.x;
    let d = p.d;
    let w = d + 2u;
    let b = row * p.nsplit * w;
    var mx = NEG_BIG;
    for (var s = 0u; s < p.nsplit; s++) {
        mx = max(mx, Part[b + s * w + d]);
    }
    var l = 0.0;
    for (var s = 0u; s < p.nsplit; s++) {
        let ls = Part[b + s * w + d + 1u];
        if (ls > 0.0) {
            l += ls * exp(Part[b + s * w + d] - mx);
        }
    }
    for (var c = lid; c < d; c += 64u) {
        var a = 0.0;
        for (var s = 0u; s < p.nsplit; s++) {
            let ls = Part[b + s * w + d + 1u];
            if (ls > 0.0) {
                a += Part[b + s * w + c] * exp(Part[b + s * w + d] - mx);
            }
        }
        let g = QG[wid.y * p.qg_stride + wid.x * 2u * d + d + c];
        O[row * d + c] = a / l * sigmoid(g);
    }
}
