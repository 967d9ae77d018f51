// Token selection on the device (ARCHITECTURE.md §3): the next token id is written straight into
// the buffer the next step's embedding reads, so decode needs no host round trip.
//
// argmax_logprob: over logits [V] (fp32): the first index of the maximum, and its log-probability
//   log softmax(logits)[id] = -log Σ exp(l - max). One block of 1024 threads; bytes: V·4 read twice.
// advance_pos: the sequence's position += n (one thread), so graph replays see the new position.

#define SAMPLE_THREADS 1024

extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
argmax_logprob(const float* __restrict__ logits, int vocab, int* __restrict__ token_out,
               float* __restrict__ logprob_out) {
    __shared__ float sv[32];
    __shared__ int si[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float best = NEG_INF;
    int best_i = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        float v = logits[i];
        if (v > best) {
            best = v;
            best_i = i;
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
        if (ov > best || (ov == best && oi < best_i)) {
            best = ov;
            best_i = oi;
        }
    }
    if (lane == 0) {
        sv[warp] = best;
        si[warp] = best_i;
    }
    __syncthreads();
    if (warp == 0) {
        int nw = blockDim.x >> 5;
        best = lane < nw ? sv[lane] : NEG_INF;
        best_i = lane < nw ? si[lane] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
            if (ov > best || (ov == best && oi < best_i)) {
                best = ov;
                best_i = oi;
            }
        }
        if (lane == 0) {
            sv[0] = best;
            si[0] = best_i;
        }
    }
    __syncthreads();
    float mx = sv[0];
    int id = si[0];
    float s = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) s += expf(logits[i] - mx);
    s = block_sum(s);
    if (threadIdx.x == 0) {
        *token_out = id < vocab ? id : 0;
        *logprob_out = -logf(s);
    }
}

extern "C" __global__ void advance_pos(int* pos, int n) {
    if (threadIdx.x == 0 && blockIdx.x == 0) *pos += n;
}
