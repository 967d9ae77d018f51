// Device sampling, steps 1–4 of lily-core/src/sampling.rs on every logit: logit_bias (B: (id,
// value bits) pairs sorted by id, stably, so repeated ids add in the request's order), the
// repetition penalty (tokens whose hist entry has the SEEN bit), presence / frequency penalties
// (hist's count bits: times generated), then × 1/temperature (1 when greedy), into S.
// One invocation per logit.

struct P {
    vocab: u32,
    n_bias: u32,
    inv_t: f32,
    repetition: f32,
    presence: f32,
    frequency: f32,
    nwx: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> L: array<f32>;
@group(0) @binding(2) var<storage, read> hist: array<u32>;
@group(0) @binding(3) var<storage, read> B: array<u32>;
@group(0) @binding(4) var<storage, read_write> S: array<f32>;

const HIST_SEEN: u32 = 0x80000000u;
const HIST_COUNT: u32 = 0x7fffffffu;

@compute @workgroup_size(256)
fn sample_adjust(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = (wid.x + wid.y * p.nwx) * 256u + lid;
    if (i >= p.vocab) {
        return;
    }
    var l = L[i];
    if (p.n_bias > 0u) {
        // First entry with id ≥ i.
        var lo = 0u;
        var hi = p.n_bias;
        while (lo < hi) {
            let mid = (lo + hi) / 2u;
            if (B[2u * mid] < i) {
                lo = mid + 1u;
            } else {
                hi = mid;
            }
        }
        for (var j = lo; j < p.n_bias && B[2u * j] == i; j++) {
            l = l + bitcast<f32>(B[2u * j + 1u]);
        }
    }
    let h = hist[i];
    if ((h & HIST_SEEN) != 0u && p.repetition != 1.0) {
        if (l > 0.0) {
            l = l / p.repetition;
        } else {
            l = l * p.repetition;
        }
    }
    let n = h & HIST_COUNT;
    if (n > 0u) {
        l = l - (p.presence + p.frequency * f32(n));
    }
    S[i] = l * p.inv_t;
}
