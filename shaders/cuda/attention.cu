// Gated full attention (MODEL.md §2.4), after the q/k/v projections and before o_proj.
//
// attn_qk_prep: per token t (absolute position pos+t) and head: RMSNorm over head_dim (q_norm /
//   k_norm weights), NeoX RoPE on dims [0, rotary) with theta; q goes to q_out [T, Hq, D]; k and v
//   go into the KV cache [max_ctx, Hkv, D] at row pos+t. The gate half of q_proj stays where it is.
// attn_decode: causal softmax(q·k / sqrt(D)) · v for query head h over kv head h / (Hq/Hkv), fp32
//   online softmax; the result times sigmoid(gate) is written to out [T, Hq·D] for o_proj.
//
// `pos` is read from device memory (the sequence's step state), so launches are position-free.
// Bytes per query: the K and V rows of its kv head up to its position; simple version: one block
// (4 warps) per (token, query head), each warp an interleaved quarter of the keys.

#define ATTN_MAX_D 256
#define ATTN_WARPS 4

extern "C" __global__ void attn_qk_prep(const float* __restrict__ qg, const float* __restrict__ k_in,
                                        const float* __restrict__ v_in, float* __restrict__ q_out,
                                        kv_t* __restrict__ k_cache, kv_t* __restrict__ v_cache,
                                        const float* __restrict__ q_norm, const float* __restrict__ k_norm,
                                        const int* __restrict__ pos_ptr, int n_tok, int n_q, int n_kv, int d,
                                        int rotary, float theta, float eps) {
    __shared__ float buf[ATTN_MAX_D];
    int t = blockIdx.x, h = blockIdx.y;
    if (t >= n_tok) return;
    int pos = *pos_ptr + t;
    bool is_q = h < n_q;
    int kvh = h - n_q;
    const float* src = is_q ? qg + (long long)t * n_q * 2 * d + (long long)h * 2 * d
                            : k_in + (long long)t * n_kv * d + (long long)kvh * d;
    const float* w = is_q ? q_norm : k_norm;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) ss += src[i] * src[i];
    ss = block_sum(ss);
    float inv = rsqrtf(ss / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x) buf[i] = act(src[i] * inv * w[i]);
    __syncthreads();
    int half = rotary / 2;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float y = buf[i];
        if (i < rotary) {
            int f = i < half ? i : i - half;
            // The angle in double: pos · theta^(-2f/R) loses whole radians in fp32 at long context.
            double inv_freq = 1.0 / pow((double)theta, (double)(2 * f) / (double)rotary);
            double ang = (double)pos * inv_freq;
            float c = act((float)cos(ang)), s = act((float)sin(ang));
            y = i < half ? buf[i] * c - buf[i + half] * s : buf[i] * c + buf[i - half] * s;
            y = act(y);
        }
        if (is_q) {
            q_out[(long long)t * n_q * d + (long long)h * d + i] = y;
        } else {
            long long at = (long long)pos * n_kv * d + (long long)kvh * d + i;
            k_cache[at] = kv_store(y);
            v_cache[at] = kv_store(v_in[(long long)t * n_kv * d + (long long)kvh * d + i]);
        }
    }
}

extern "C" __global__ void __launch_bounds__(ATTN_WARPS * 32)
attn_decode(const float* __restrict__ q, const float* __restrict__ qg, const kv_t* __restrict__ k_cache,
            const kv_t* __restrict__ v_cache, float* __restrict__ out, const int* __restrict__ pos_ptr,
            int n_tok, int n_q, int n_kv, int d, float scale) {
    __shared__ float sm_acc[ATTN_WARPS][ATTN_MAX_D];
    __shared__ float sm_m[ATTN_WARPS], sm_l[ATTN_WARPS];
    const int PER = ATTN_MAX_D / 32;
    int t = blockIdx.x, h = blockIdx.y;
    if (t >= n_tok) return;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int kvh = h / (n_q / n_kv);
    int last = *pos_ptr + t;  // attends to keys 0..=last
    const float* qh = q + (long long)t * n_q * d + (long long)h * d;
    float qv[PER], acc[PER];
#pragma unroll
    for (int i = 0; i < PER; i++) {
        int c = lane + 32 * i;
        qv[i] = c < d ? qh[c] : 0.0f;
        acc[i] = 0.0f;
    }
    float m = NEG_INF, l = 0.0f;
    for (int j = warp; j <= last; j += ATTN_WARPS) {
        const kv_t* kr = k_cache + (long long)j * n_kv * d + (long long)kvh * d;
        float s = 0.0f;
#pragma unroll
        for (int i = 0; i < PER; i++) {
            int c = lane + 32 * i;
            if (c < d) s += qv[i] * kv_load(kr[c]);
        }
        s = warp_sum(s) * scale;
        float m_new = fmaxf(m, s);
        float corr = expf(m - m_new);
        float p = expf(s - m_new);
        l = l * corr + p;
        const kv_t* vr = v_cache + (long long)j * n_kv * d + (long long)kvh * d;
#pragma unroll
        for (int i = 0; i < PER; i++) {
            int c = lane + 32 * i;
            acc[i] = acc[i] * corr + (c < d ? p * kv_load(vr[c]) : 0.0f);
        }
        m = m_new;
    }
#pragma unroll
    for (int i = 0; i < PER; i++) sm_acc[warp][lane + 32 * i] = acc[i];
    if (lane == 0) {
        sm_m[warp] = m;
        sm_l[warp] = l;
    }
    __syncthreads();
    float big = NEG_INF;
    for (int w = 0; w < ATTN_WARPS; w++) big = fmaxf(big, sm_m[w]);
    float total = 0.0f;
    for (int w = 0; w < ATTN_WARPS; w++)
        if (sm_l[w] > 0.0f) total += sm_l[w] * expf(sm_m[w] - big);
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float o = 0.0f;
        for (int w = 0; w < ATTN_WARPS; w++)
            if (sm_l[w] > 0.0f) o += sm_acc[w][c] * expf(sm_m[w] - big);
        o = act(o / total);
        float gate = qg[(long long)t * n_q * 2 * d + (long long)h * 2 * d + d + c];
        out[(long long)t * n_q * d + (long long)h * d + c] = act(o * act(sigmoidf(gate)));
    }
}
