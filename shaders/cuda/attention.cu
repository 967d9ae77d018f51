// Gated full attention (MODEL.md §2.4), after the q/k/v projections and before o_proj.
//
// attn_qk_prep: per token t (absolute position pos+t) and head: RMSNorm over head_dim (q_norm /
//   k_norm weights), NeoX RoPE on dims [0, rotary) with theta; q goes to q_out [T, Hq, D]; k and v
//   go into the KV cache [max_ctx, Hkv, D] at row pos+t. The gate half of q_proj stays where it is.
// attn_decode: causal softmax(q·k / sqrt(D)) · v for query head h over kv head h / (Hq/Hkv), fp32
//   online softmax; the result times sigmoid(gate) is written to out [T, Hq·D] for o_proj.
//   One block (4 warps) per (token, query head), each warp an interleaved quarter of the keys.
//   Used for prefill chunks, and for decode unless LILY_SPLIT_KV=1.
//
// Split-KV decode (flash-decoding; default for steps of at most SPLIT_MAX_TOK tokens):
//   token t attends to keys 0..len-1, len = pos+t+1. The keys are cut into n_s = ceil(len/P)
//   splits of P keys, P = max(64, roundup64(ceil(len / SPLIT_MAX_SPLITS))): at most 256 splits,
//   at least 64 keys each (P and n_s follow len, which is read on the device, so the launch is
//   the same at every position and can be replayed as a CUDA graph: the grid is always
//   SPLIT_MAX_SPLITS wide and blocks past n_s exit at once).
//   attn_split: one block per (split s, kv head g [× chunk of 8 of its query heads], token t)
//     serves all G = Hq/Hkv query heads of g (GQA packing), so each K and V row of the split is
//     read once (16-byte loads) for G heads. Per head h it writes the split's partial stats
//       m_s = max_{j in s} q_h·k_j·scale,  l_s = sum_{j in s} exp(q_h·k_j·scale − m_s),
//       o_s = sum_{j in s} exp(q_h·k_j·scale − m_s) v_j          (unnormalised, fp32)
//     to part_ml [SPLIT_MAX_TOK, Hq, SPLIT_MAX_SPLITS, 2] and part_o [.., .., .., D].
//     Inside a block each warp takes tiles of 32 keys (one key per lane for q·k, then each lane
//     8 output columns for p·v) with its own online softmax; the warps merge at the end.
//   attn_split_combine: one block per (query head, token): M = max_s m_s, w_s = exp(m_s − M),
//     o = sum_s w_s o_s / sum_s w_s l_s (log-sum-exp rescaling), then exactly attn_decode's
//     epilogue: act(o) · act(sigmoid(gate)) into out [T, Hq·D].
//   Bytes per step and layer: K and V of len rows × Hkv × D once (Hq/Hkv times less than one
//   read per query head), plus the partials: Hq × n_s × (D+2) × 4 bytes written and read.
//   Limits (checked by the launcher, else attn_decode runs): D ≤ 256 and D % 8 == 0.

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

// ---- split-KV decode -------------------------------------------------------------------------

#define SPLIT_MAX_SPLITS 256
#define SPLIT_MIN_KEYS 64
#define SPLIT_WARPS 2
#define SPLIT_MAX_G 8
#define SPLIT_TILE 32

// Keys per split for a causal length `len` (the same in both kernels).
__device__ __forceinline__ int split_keys(int len) {
    int per = (len + SPLIT_MAX_SPLITS - 1) / SPLIT_MAX_SPLITS;
    per = (per + SPLIT_MIN_KEYS - 1) / SPLIT_MIN_KEYS * SPLIT_MIN_KEYS;
    return per > SPLIT_MIN_KEYS ? per : SPLIT_MIN_KEYS;
}

// Eight consecutive cache elements starting 16-byte aligned, as fp32.
__device__ __forceinline__ void kv_load8(const kv_t* __restrict__ p, float* out) {
#ifdef LILY_BF16_ACT
    uint4 w = *reinterpret_cast<const uint4*>(p);
    u32 ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        out[2 * i] = bf16_to_f32((u16)(ws[i] & 0xffffu));
        out[2 * i + 1] = bf16_to_f32((u16)(ws[i] >> 16));
    }
#else
    float4 a = *reinterpret_cast<const float4*>(p);
    float4 b = *reinterpret_cast<const float4*>(p + 4);
    out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
    out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
#endif
}

extern "C" __global__ void __launch_bounds__(SPLIT_WARPS * 32)
attn_split(const float* __restrict__ q, const kv_t* __restrict__ k_cache, const kv_t* __restrict__ v_cache,
           float* __restrict__ part_o, float* __restrict__ part_ml, const int* __restrict__ pos_ptr, int n_tok,
           int n_q, int n_kv, int d, float scale) {
    __shared__ __align__(16) float q_s[SPLIT_MAX_G][ATTN_MAX_D];
    __shared__ __align__(16) float p_s[SPLIT_WARPS][SPLIT_TILE][SPLIT_MAX_G];
    __shared__ float acc_s[SPLIT_WARPS][SPLIT_MAX_G][ATTN_MAX_D];
    __shared__ float m_s[SPLIT_WARPS][SPLIT_MAX_G], l_s[SPLIT_WARPS][SPLIT_MAX_G];
    int split = blockIdx.x, t = blockIdx.z;
    int g_heads = n_q / n_kv;
    int chunks = (g_heads + SPLIT_MAX_G - 1) / SPLIT_MAX_G;
    int kvh = blockIdx.y / chunks;
    int h0 = kvh * g_heads + (blockIdx.y % chunks) * SPLIT_MAX_G;
    int ng = min(SPLIT_MAX_G, kvh * g_heads + g_heads - h0);
    int len = *pos_ptr + t + 1;
    int per = split_keys(len);
    int start = split * per;
    if (t >= n_tok || start >= len) return;  // uniform over the block: no barrier is skipped
    int end = min(start + per, len);
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    // The block's query heads, zero rows past ng (their scores are computed and never stored).
    for (int i = threadIdx.x; i < SPLIT_MAX_G * ATTN_MAX_D; i += blockDim.x) {
        int hh = i / ATTN_MAX_D, c = i % ATTN_MAX_D;
        q_s[hh][c] = (hh < ng && c < d) ? q[((long long)t * n_q + h0 + hh) * d + c] : 0.0f;
    }
    __syncthreads();
    long long row = (long long)n_kv * d;  // elements between consecutive keys
    const kv_t* kbase = k_cache + (long long)kvh * d;
    const kv_t* vbase = v_cache + (long long)kvh * d;
    int c0 = lane * 8;  // this lane's 8 output columns in the p·v phase
    bool has_cols = c0 < d;
    float m[SPLIT_MAX_G], l[SPLIT_MAX_G], acc[SPLIT_MAX_G][8];
#pragma unroll
    for (int hh = 0; hh < SPLIT_MAX_G; hh++) {
        m[hh] = NEG_INF;
        l[hh] = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; e++) acc[hh][e] = 0.0f;
    }
    for (int j0 = start + warp * SPLIT_TILE; j0 < end; j0 += SPLIT_WARPS * SPLIT_TILE) {
        // q·k: one key per lane, all heads at once.
        int j = j0 + lane;
        bool valid = j < end;
        float s[SPLIT_MAX_G];
#pragma unroll
        for (int hh = 0; hh < SPLIT_MAX_G; hh++) s[hh] = 0.0f;
        if (valid) {
            const kv_t* kr = kbase + (long long)j * row;
            // Unrolled so several 16-byte loads are in flight per lane (d is a runtime value).
#pragma unroll 4
            for (int c = 0; c < d; c += 8) {
                float kx[8];
                kv_load8(kr + c, kx);
#pragma unroll
                for (int hh = 0; hh < SPLIT_MAX_G; hh++) {
                    float4 qa = *reinterpret_cast<const float4*>(&q_s[hh][c]);
                    float4 qb = *reinterpret_cast<const float4*>(&q_s[hh][c + 4]);
                    s[hh] += qa.x * kx[0] + qa.y * kx[1] + qa.z * kx[2] + qa.w * kx[3] + qb.x * kx[4] +
                             qb.y * kx[5] + qb.z * kx[6] + qb.w * kx[7];
                }
            }
        }
        // Online softmax over the tile (every lane keeps the warp's m and l).
        float corr[SPLIT_MAX_G];
#pragma unroll
        for (int hh = 0; hh < SPLIT_MAX_G; hh++) {
            float sc = valid ? s[hh] * scale : NEG_INF;
            float m_new = fmaxf(m[hh], warp_max(sc));  // finite: lane 0's key is valid
            corr[hh] = expf(m[hh] - m_new);
            float p = valid ? expf(sc - m_new) : 0.0f;
            l[hh] = l[hh] * corr[hh] + warp_sum(p);
            m[hh] = m_new;
            p_s[warp][lane][hh] = p;
        }
        __syncwarp();
        // p·v: each lane its 8 columns, the tile's keys in order.
#pragma unroll
        for (int hh = 0; hh < SPLIT_MAX_G; hh++)
#pragma unroll
            for (int e = 0; e < 8; e++) acc[hh][e] *= corr[hh];
        int n_valid = min(SPLIT_TILE, end - j0);
        if (has_cols) {
#pragma unroll 4
            for (int jj = 0; jj < n_valid; jj++) {
                float vx[8];
                kv_load8(vbase + (long long)(j0 + jj) * row + c0, vx);
                float4 pa = *reinterpret_cast<const float4*>(&p_s[warp][jj][0]);
                float4 pb = *reinterpret_cast<const float4*>(&p_s[warp][jj][4]);
                float pj[8] = {pa.x, pa.y, pa.z, pa.w, pb.x, pb.y, pb.z, pb.w};
#pragma unroll
                for (int hh = 0; hh < SPLIT_MAX_G; hh++)
#pragma unroll
                    for (int e = 0; e < 8; e++) acc[hh][e] += pj[hh] * vx[e];
            }
        }
        __syncwarp();  // p_s is rewritten by the next tile
    }
    // Merge the warps into the split's partial.
#pragma unroll
    for (int hh = 0; hh < SPLIT_MAX_G; hh++) {
        if (has_cols) {
#pragma unroll
            for (int e = 0; e < 8; e++) acc_s[warp][hh][c0 + e] = acc[hh][e];
        }
        if (lane == 0) {
            m_s[warp][hh] = m[hh];
            l_s[warp][hh] = l[hh];
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < ng * d; i += blockDim.x) {
        int hh = i / d, c = i % d;
        float big = NEG_INF;
        for (int w = 0; w < SPLIT_WARPS; w++) big = fmaxf(big, m_s[w][hh]);
        float o = 0.0f, sum = 0.0f;
        for (int w = 0; w < SPLIT_WARPS; w++) {
            if (l_s[w][hh] > 0.0f) {  // a warp without keys has m = -inf, l = 0
                float wt = expf(m_s[w][hh] - big);
                o += acc_s[w][hh][c] * wt;
                sum += l_s[w][hh] * wt;
            }
        }
        long long at = ((long long)t * n_q + h0 + hh) * SPLIT_MAX_SPLITS + split;
        part_o[at * d + c] = o;
        if (c == 0) {
            part_ml[at * 2] = big;
            part_ml[at * 2 + 1] = sum;
        }
    }
}

extern "C" __global__ void __launch_bounds__(128)
attn_split_combine(const float* __restrict__ qg, const float* __restrict__ part_o,
                   const float* __restrict__ part_ml, float* __restrict__ out, const int* __restrict__ pos_ptr,
                   int n_tok, int n_q, int d) {
    __shared__ float w_s[SPLIT_MAX_SPLITS];
    int h = blockIdx.x, t = blockIdx.y;
    if (t >= n_tok) return;
    int len = *pos_ptr + t + 1;
    int n_s = (len + split_keys(len) - 1) / split_keys(len);
    long long base = ((long long)t * n_q + h) * SPLIT_MAX_SPLITS;
    float big = NEG_INF;
    for (int s = 0; s < n_s; s++) big = fmaxf(big, part_ml[(base + s) * 2]);
    float part = 0.0f;
    for (int s = threadIdx.x; s < n_s; s += blockDim.x) {
        float w = expf(part_ml[(base + s) * 2] - big);
        w_s[s] = w;
        part += w * part_ml[(base + s) * 2 + 1];
    }
    float total = block_sum(part);  // its barriers also publish w_s
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float o = 0.0f;
        for (int s = 0; s < n_s; s++) o += w_s[s] * part_o[(base + s) * d + c];
        o = act(o / total);
        float gate = qg[(long long)t * n_q * 2 * d + (long long)h * 2 * d + d + c];
        out[(long long)t * n_q * d + (long long)h * d + c] = act(o * act(sigmoidf(gate)));
    }
}
