// Gated DeltaNet step 2 (MODEL.md §2.5): causal depthwise conv (K taps) + SiLU over the q|k|v
// channels, for a chunk of tokens in order. One invocation per channel walks the chunk with
// the last K−1 pre-conv values in registers, then leaves them in the conv state (oldest first).
// The chunk's inputs are read 16 tokens at a time, all 16 reads in flight (main's profile on the
// H200, c7ee898: 217 µs per 512-token chunk, one dependent read per token).

struct P {
    tokens: u32,
    cd: u32,
    k: u32,
    m_stride: u32,   // row stride of M (the joint in_proj output; conv channels first)
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> M: array<f32>;       // [tokens, cd] pre-conv
@group(0) @binding(2) var<storage, read> taps: array<f32>;    // [cd, k]
@group(0) @binding(3) var<storage, read_write> state: array<f32>;  // [k − 1, cd]
@group(0) @binding(4) var<storage, read_write> C: array<f32>; // [tokens, cd]

@compute @workgroup_size(64)
fn dn_conv(@builtin(global_invocation_id) gid: vec3<u32>) {
    let ch = gid.x + gid.y * 65535u * 64u;
    if (ch >= p.cd) {
        return;
    }
    let km1 = p.k - 1u;
    var hist: array<f32, 8>;
    for (var j = 0u; j < km1; j++) {
        hist[j] = state[j * p.cd + ch];
    }
    for (var tb = 0u; tb < p.tokens; tb += 16u) {
        let n = min(16u, p.tokens - tb);
        var xs = array<f32, 16>();
        for (var i = 0u; i < 16u; i++) {
            if (i < n) {
                xs[i] = M[(tb + i) * p.m_stride + ch];
            }
        }
        for (var i = 0u; i < n; i++) {
            let t = tb + i;
            let x = xs[i];
            var s = 0.0;
            for (var j = 0u; j < km1; j++) {
                s += taps[ch * p.k + j] * hist[j];
            }
            s += taps[ch * p.k + km1] * x;
            C[t * p.cd + ch] = silu(s);
            for (var j = 0u; j + 1u < km1; j++) {
                hist[j] = hist[j + 1u];
            }
            hist[km1 - 1u] = x;
        }
    }
    for (var j = 0u; j < km1; j++) {
        state[j * p.cd + ch] = hist[j];
    }
}
