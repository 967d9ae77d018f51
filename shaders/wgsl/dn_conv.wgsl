// Gated DeltaNet step 2 (MODEL.md §2.5): causal depthwise conv (K taps) + SiLU over the q|k|v
// channels, for a chunk of tokens. Each output depends only on K inputs, so invocation (channel,
// block of TB = 16 tokens) computes its block alone: it reads the block's inputs and the K − 1
// before it (from the conv state before the chunk's first token), all reads in flight together.
// The first block's invocation of a channel also writes the new conv state (the chunk's last
// K − 1 inputs, oldest first) after reading the old one; no other block reads the state (TB ≥
// K − 1). The first version walked the whole chunk per channel (8,192 invocations, one token
// after another): 281 µs per 512-token chunk on the H200 (profile of main 07ac75d).

struct P {
    tokens: u32,
    cd: u32,
    k: u32,
    m_stride: u32,   // row stride of M (the joint in_proj output; conv channels first)
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> M: array<ACT>;       // [tokens, cd] pre-conv
@group(0) @binding(2) var<storage, read> taps: array<f32>;    // [cd, k]
@group(0) @binding(3) var<storage, read_write> state: array<f32>;  // [k − 1, cd]
@group(0) @binding(4) var<storage, read_write> C: array<ACT>; // [tokens, cd]

const TB: u32 = 16u;

@compute @workgroup_size(64)
fn dn_conv(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let ch = (wid.x + wid.y * 65535u) * 64u + lid;
    if (ch >= p.cd) {
        return;
    }
    let km1 = p.k - 1u;
    let t0 = wid.z * TB;
    // xs[i]: the input at token t0 − 8 + i (i < 8: the K − 1 before the block, at 8 − km1 ..;
    // i ≥ 8: the block's own).
    var xs = array<f32, 24>();
    for (var i = 0u; i < 8u; i++) {
        if (i >= 8u - km1) {
            let back = 8u - i;   // tokens before t0: 1 ..= km1
            if (t0 >= back) {
                xs[i] = f32(M[(t0 - back) * p.m_stride + ch]);
            } else {
                // State row km1 − (back − t0): the oldest first.
                xs[i] = state[(km1 - (back - t0)) * p.cd + ch];
            }
        }
    }
    for (var i = 0u; i < TB; i++) {
        if (t0 + i < p.tokens) {
            xs[8u + i] = f32(M[(t0 + i) * p.m_stride + ch]);
        }
    }
    var w = array<f32, 9>();
    for (var j = 0u; j < 9u; j++) {
        if (j <= km1) {
            w[j] = taps[ch * p.k + j];
        }
    }
    for (var i = 0u; i < TB; i++) {
        if (t0 + i < p.tokens) {
            // Taps j = 0 ..= km1 against the inputs at t − km1 + j.
            var s = 0.0;
            for (var j = 0u; j < 9u; j++) {
                if (j <= km1) {
                    s += w[j] * xs[8u + i + j - km1];
                }
            }
            C[(t0 + i) * p.cd + ch] = ACT(silu(s));
        }
    }
    if (wid.z == 0u) {
        // The new state: inputs at tokens − km1 + j, j < km1; from the old state (already read
        // into xs) where that is before the chunk.
        for (var j = 0u; j < 8u; j++) {
            if (j < km1) {
                let back = km1 - j;   // tokens before the chunk's end
                var v = 0.0;
                if (p.tokens >= back) {
                    v = f32(M[(p.tokens - back) * p.m_stride + ch]);
                } else {
                    v = xs[8u - (back - p.tokens)];
                }
                state[j * p.cd + ch] = v;
            }
        }
    }
}
