// Gated full attention (MODEL.md §2.4), after the q/k/v projections and before o_proj.
//
// attn_qk_prep: per token t (absolute position pos+t) and head: RMSNorm over head_dim (q_norm /
//   k_norm weights), NeoX RoPE on dims [0, rotary) with theta; q goes to q_out [T, Hq, D]; k and v
//   go into the KV cache [max_ctx, Hkv, D] at row pos+t. The gate half of q_proj stays where it is.
// attn_decode: causal softmax(q·k / sqrt(D)) · v for query head h over kv head h / (Hq/Hkv), fp32
//   online softmax; the result times sigmoid(gate) is written to out [T, Hq·D] for o_proj.
//   One block (4 warps) per (token, query head), each warp an interleaved quarter of the keys.
//   Used for decode only with split-KV off (it is on by default; --no-split-kv / LILY_SPLIT_KV=0),
//   for chunks between 5 and 15 tokens, and for prefill chunks with flash prefill off or in fp32 mode
//   (the plan decides: crates/lily-cuda/src/plan.rs).
//
// attn_prefill (flash attention 2 on tensor cores; prefill chunks of >= 16 tokens, bf16 mode):
//   the same inputs, causal mask and output as attn_decode. One block (4 warps) per 64
//   consecutive queries of one query head (grid ceil(T/64) x Hq, the last query block first: it
//   has the most keys); warp w owns queries 16w..16w+15 of the block. Head dims 64, 128, 256.
//   Shared memory (dynamic, bf16, rows padded to D+8 elements so ldmatrix rows fall in distinct
//   banks): the Q tile [64][D+8], staged once from fp32; one K tile and one V tile [BC][D+8],
//   BC = 64 keys (D <= 128) or 32 (D = 256, to keep the 16xD fp32 O accumulator of each warp in
//   registers without spills). Bytes: (64 + 2·BC)·(D+8)·2 = 66 KB for D = 256 (the launcher
//   computes it; above 48 KB the kernel is allowed it at load), within every arch's 99 KB.
//   Per key tile k0..k0+BC−1 (tiles up to the block's last query position kmax; rows past kmax
//   are zero-filled, never read from the cache):
//     S = Q·Kᵀ with mma.m16n8k16 bf16 → fp32 (A = Q rows via ldmatrix, B = K rows via ldmatrix,
//       K's rows being the "col" operand); scale; causal mask only on tiles that cross the
//       warp's diagonal; fp32 online softmax per row (max over the 4 lanes holding a row, expf,
//       running sum l of the fp32 weights); O *= exp(m_old − m_new);
//     O += P·V: the S accumulators are re-packed in registers as the A fragments (P rounded to
//       bf16, as HF's bf16 eager path casts the softmax before P·V), V via ldmatrix.trans.
//   Loads are cp.async (16 bytes) in bf16 mode: V(tile) lands while S is computed, K(tile+1)
//   while P·V runs (fp32 mode converts synchronously; the Rust side uses the kernel only in bf16
//   mode). A warp skips the math of tiles past its last query. Epilogue as attn_decode:
//   o = act(O / l), out = act(o · act(sigmoid(gate))); rows past the chunk are not written.
//
// Split-KV decode (flash-decoding; default for steps of at most SPLIT_MAX_TOK tokens):
//   token t attends to keys 0..len-1, len = pos+t+1. The keys are cut into n_s = ceil(len/P)
//   splits of P keys, P = max(M, roundup_M(ceil(len / SPLIT_MAX_SPLITS))) with M = SPLIT_MIN_KEYS:
//   at most SPLIT_MAX_SPLITS splits, at least M keys each (P and n_s follow len, which is read on the device, so the launch is
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

#ifndef ATTN_MAX_D
#error "ATTN_MAX_D comes from the launcher module (crates/lily-cuda/src/kernels/attention.rs)"
#endif
#ifndef ATTN_WARPS
#error "ATTN_WARPS comes from the launcher module (crates/lily-cuda/src/kernels/attention.rs)"
#endif

// The KV cache as the kernels that write or read it in place see it (attn_qk_prep and the
// attn_split_mma family): kv_t (bf16, or f32 in fp32 mode), or, built with LILY_KV_INT8 (the
// plan's `kv_cache int8`, MODEL.md §2.4 "The KV cache's formats"), int8 rows. An int8 cache is
// bytes, one record a position: the n_kv heads' rows of d int8 values q = round_half_even(x / s),
// then their f32 scales s = max|x| / 127 (0 for a zero row), n_kv floats padded to 16 bytes
// (kv8_rec_bytes: 528 bytes a position for 2 heads of 256 against bf16's 1,024), so a record and
// every row in it start 16-byte aligned (d a multiple of 16) and a prefix of positions is one
// contiguous range (the host's fork / snapshot copies). The kernels that read bf16 rows only
// (attn_decode, attn_split, the prefill kernels) are given kv_int8_dequant's bf16 scratch.
#ifdef LILY_KV_INT8
#ifndef LILY_BF16_ACT
#error "an int8 KV cache needs bf16 activations (the plan resolves kv_cache int8 only with them)"
#endif
typedef signed char kvc_t;
#else
typedef kv_t kvc_t;
#endif
__device__ __forceinline__ long long kv8_rec_bytes(int n_kv, int d) {
    return (long long)n_kv * d + (4LL * n_kv + 15) / 16 * 16;
}
// kv_int8_encode's value for x in a row of scale s (lily-core cpu::ops): round half to even of
// the IEEE quotient (no fast math in these modules), clamped to ±127; 0 in a zero row.
__device__ __forceinline__ int kv8_quant(float x, float s) {
    if (s == 0.0f) return 0;
    int q = __float2int_rn(x / s);
    return q < -127 ? -127 : q > 127 ? 127 : q;
}
// Four int8 values packed little-endian in a word.
__device__ __forceinline__ u32 kv8_pack4(int a, int b, int c, int d) {
    return (u32)(a & 0xff) | ((u32)(b & 0xff) << 8) | ((u32)(c & 0xff) << 16) | ((u32)(d & 0xff) << 24);
}

extern "C" __global__ void attn_qk_prep(const float* __restrict__ qg, const float* __restrict__ k_in,
                                        const float* __restrict__ v_in, float* __restrict__ q_out,
                                        kvc_t* __restrict__ k_cache, kvc_t* __restrict__ v_cache,
                                        const float* __restrict__ q_norm, const float* __restrict__ k_norm,
                                        const int* __restrict__ pos_ptr, int n_tok, int n_q, int n_kv, int d,
                                        int rotary, float theta, float eps) {
    pdl_wait();
    __shared__ float buf[ATTN_MAX_D];
#ifdef LILY_KV_INT8
    __shared__ float yk[ATTN_MAX_D];  // the new key row before quantisation
#endif
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
#ifdef LILY_KV_INT8
            yk[i] = y;  // quantised below, once the row's largest magnitude is known
#else
            long long at = (long long)pos * n_kv * d + (long long)kvh * d + i;
            k_cache[at] = kv_store(y);
            v_cache[at] = kv_store(v_in[(long long)t * n_kv * d + (long long)kvh * d + i]);
#endif
        }
    }
#ifdef LILY_KV_INT8
    if (is_q) return;  // uniform over the block
    // The key row (after norm and RoPE, as the bf16 cache would hold it before rounding) and the
    // value row, each as int8 with its scale (kv_int8_encode's rule).
    __syncthreads();
    const float* vr = v_in + (long long)t * n_kv * d + (long long)kvh * d;
    float ak = 0.0f, av = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        ak = fmaxf(ak, fabsf(yk[i]));
        av = fmaxf(av, fabsf(vr[i]));
    }
    float sk = block_max(ak) / 127.0f, sv = block_max(av) / 127.0f;
    long long rec = kv8_rec_bytes(n_kv, d), at = (long long)pos * rec + (long long)kvh * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        k_cache[at + i] = (kvc_t)kv8_quant(yk[i], sk);
        v_cache[at + i] = (kvc_t)kv8_quant(vr[i], sv);
    }
    if (threadIdx.x == 0) {
        float* sc_at = reinterpret_cast<float*>(k_cache + pos * rec + (long long)n_kv * d) + kvh;
        *sc_at = sk;
        *(reinterpret_cast<float*>(v_cache + pos * rec + (long long)n_kv * d) + kvh) = sv;
    }
#endif
}

#ifdef LILY_KV_INT8
// kv_int8_dequant: rows 0 .. *pos_ptr + n_tok − 1 of one layer's int8 K and V caches as bf16
// [rows][n_kv][d] (the layout of a bf16 cache), each value q · s rounded once to bf16, for the
// kernels that read bf16 rows (prefill's and every multi-token step's attention: the host
// points them at this scratch). A thread turns 8 values of one row: grid.x covers the rows the
// host allows for (`max_rows`), threads past the device's row count return. Bytes a row and
// head: d + 4 read, 2d written, for K and for V.
extern "C" __global__ void __launch_bounds__(256)
kv_int8_dequant(const kvc_t* __restrict__ k_cache, const kvc_t* __restrict__ v_cache, kv_t* __restrict__ k_out,
                kv_t* __restrict__ v_out, const int* __restrict__ pos_ptr, int n_tok, int n_kv, int d) {
    pdl_wait();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    long long per_row = (long long)n_kv * (d / 8);
    long long p = i / per_row;
    if (p >= (long long)*pos_ptr + n_tok) return;
    int h = (int)((i % per_row) / (d / 8)), ch = (int)(i % (d / 8)) * 8;
    long long rec = kv8_rec_bytes(n_kv, d);
    const kvc_t* caches[2] = {k_cache, v_cache};
    kv_t* outs[2] = {k_out, v_out};
#pragma unroll
    for (int c = 0; c < 2; c++) {
        const kvc_t* r = caches[c] + p * rec;
        float sc = *reinterpret_cast<const float*>(r + (long long)n_kv * d + 4LL * h);
        uint2 w = *reinterpret_cast<const uint2*>(r + (long long)h * d + ch);
        u32 ws[2] = {w.x, w.y};
        u32 o[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            float lo = (float)(signed char)((ws[k / 2] >> (16 * (k % 2))) & 0xffu) * sc;
            float hi = (float)(signed char)((ws[k / 2] >> (16 * (k % 2) + 8)) & 0xffu) * sc;
            o[k] = (u32)kv_store(lo) | ((u32)kv_store(hi) << 16);
        }
        *reinterpret_cast<uint4*>(outs[c] + p * n_kv * d + (long long)h * d + ch) = make_uint4(o[0], o[1], o[2], o[3]);
    }
}
#endif

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

#ifndef SPLIT_MAX_SPLITS
#error "SPLIT_MAX_SPLITS comes from the launcher module (crates/lily-cuda/src/kernels/attention.rs)"
#endif
#ifndef SPLIT_MIN_KEYS
#error "SPLIT_MIN_KEYS comes from the launcher module (crates/lily-cuda/src/kernels/attention.rs)"
#endif
#ifndef SPLIT_WARPS
#error "SPLIT_WARPS comes from the launcher module (crates/lily-cuda/src/kernels/attention.rs)"
#endif
#ifndef SPLIT_MAX_G
#error "SPLIT_MAX_G comes from the launcher module (crates/lily-cuda/src/kernels/attention.rs)"
#endif
#define SPLIT_TILE 32

// Keys per split for a causal length `len` (the same in both kernels).
__device__ __forceinline__ int split_keys(int len) {
    int per = (len + SPLIT_MAX_SPLITS - 1) / SPLIT_MAX_SPLITS;
    per = (per + SPLIT_MIN_KEYS - 1) / SPLIT_MIN_KEYS * SPLIT_MIN_KEYS;
    return per > SPLIT_MIN_KEYS ? per : SPLIT_MIN_KEYS;
}

// A split-KV block's share (grid: x the split, y the kv head × its chunks of SPLIT_MAX_G query
// heads): its kv head, first query head and head count, and its keys [start, end) of a causal
// length len (start >= end: past the live splits).
struct SplitBlock {
    int kvh, h0, ng, start, end;
};

__device__ __forceinline__ SplitBlock split_block(int split, int n_q, int n_kv, int len) {
    SplitBlock b;
    int g_heads = n_q / n_kv;
    int chunks = (g_heads + SPLIT_MAX_G - 1) / SPLIT_MAX_G;
    b.kvh = blockIdx.y / chunks;
    b.h0 = b.kvh * g_heads + (blockIdx.y % chunks) * SPLIT_MAX_G;
    b.ng = min(SPLIT_MAX_G, b.kvh * g_heads + g_heads - b.h0);
    int per = split_keys(len);
    b.start = split * per;
    b.end = min(b.start + per, len);
    return b;
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

// attn_split: the split's keys stream through shared memory in tiles of SPLIT_TILE keys, two
// tiles deep (cp.async: the next tile lands while this one is used), so a tile costs one memory
// round trip for the whole block. Warp w serves query heads w·HPW .. w·HPW + HPW − 1 of the block
// (HPW = SPLIT_MAX_G / SPLIT_WARPS) with its own online softmax and writes their partials itself:
// q·k one key per lane (K rows padded by 16 bytes, so the lanes' 16-byte reads of 32 different
// rows fall in distinct banks), p·v 8 output columns per lane. Dynamic shared memory
// (split_smem_bytes in the launcher): q [SPLIT_MAX_G][d] f32, K [2][SPLIT_TILE][d + pad], V
// [2][SPLIT_TILE][d], p [SPLIT_MAX_G][SPLIT_TILE] f32.
#define SPLIT_HPW (SPLIT_MAX_G / SPLIT_WARPS)
#define SPLIT_KV_E (16 / (int)sizeof(kv_t))  // cache elements per 16 bytes

// Eight consecutive cache elements from shared memory, as fp32.
__device__ __forceinline__ void kv_smem8(const kv_t* p, float* out) {
#ifdef LILY_BF16_ACT
    uint4 w = *reinterpret_cast<const uint4*>(p);
    u32 ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        out[2 * i] = __uint_as_float(ws[i] << 16);
        out[2 * i + 1] = __uint_as_float(ws[i] & 0xffff0000u);
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
    extern __shared__ __align__(16) float split_smem[];
    int split = blockIdx.x, t = blockIdx.z;
    // The position was moved by the previous step's advance_pos (this step's kernels before
    // this one do not write it): readable before pdl_wait.
    int pos = *pos_ptr;
    SplitBlock sb = split_block(split, n_q, n_kv, pos + t + 1);
    if (t >= n_tok || sb.start >= sb.end) return;  // uniform over the block: no barrier is skipped
    int kvh = sb.kvh, h0 = sb.h0, ng = sb.ng, start = sb.start, end = sb.end;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int kstride = d + SPLIT_KV_E;  // padded K row, in elements
    float* q_s = split_smem;                                                   // [SPLIT_MAX_G][d]
    kv_t* k_s = reinterpret_cast<kv_t*>(q_s + SPLIT_MAX_G * d);                 // [2][TILE][kstride]
    kv_t* v_s = k_s + 2 * SPLIT_TILE * kstride;                                // [2][TILE][d]
    float* p_s = reinterpret_cast<float*>(v_s + 2 * SPLIT_TILE * d);           // [SPLIT_MAX_G][TILE]
    long long row = (long long)n_kv * d;  // elements between consecutive keys
    const kv_t* kbase = k_cache + (long long)kvh * d;
    const kv_t* vbase = v_cache + (long long)kvh * d;
    int chunks_per_row = d / SPLIT_KV_E;
    // Keys j0 .. min(j0 + TILE, end) - 1 into buffer b (rows past the split are left as they are
    // and never used).
    auto issue = [&](int b, int j0) {
        for (int i = threadIdx.x; i < SPLIT_TILE * chunks_per_row; i += blockDim.x) {
            int jj = i / chunks_per_row, ch = (i % chunks_per_row) * SPLIT_KV_E;
            int j = j0 + jj;
            if (j < end) {
                cp_async16(k_s + (b * SPLIT_TILE + jj) * kstride + ch, kbase + (long long)j * row + ch);
                cp_async16(v_s + (b * SPLIT_TILE + jj) * d + ch, vbase + (long long)j * row + ch);
            }
        }
        cp_async_commit();
    };
    // Keys before pos were written by earlier steps: a first tile of only those streams in while
    // the kernel before this one (attn_qk_prep, which writes keys pos ..) finishes.
    bool early = min(start + SPLIT_TILE, end) <= pos;
    if (early) issue(0, start);
    pdl_wait();
    if (!early) issue(0, start);
    // The block's query heads, zero rows past ng (their scores are computed and never stored).
    for (int i = threadIdx.x; i < SPLIT_MAX_G * d; i += blockDim.x) {
        int hh = i / d, c = i % d;
        q_s[i] = hh < ng ? q[((long long)t * n_q + h0 + hh) * d + c] : 0.0f;
    }
    int c0 = lane * 8;  // this lane's 8 output columns in the p·v phase
    bool has_cols = c0 < d;
    float m[SPLIT_HPW], l[SPLIT_HPW], acc[SPLIT_HPW][8];
#pragma unroll
    for (int hh = 0; hh < SPLIT_HPW; hh++) {
        m[hh] = NEG_INF;
        l[hh] = 0.0f;
#pragma unroll
        for (int e = 0; e < 8; e++) acc[hh][e] = 0.0f;
    }
    int n_tiles = (end - start + SPLIT_TILE - 1) / SPLIT_TILE;
    for (int it = 0; it < n_tiles; it++) {
        int b = it & 1, j0 = start + it * SPLIT_TILE;
        if (it + 1 < n_tiles) {
            issue(b ^ 1, j0 + SPLIT_TILE);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        // q·k: one key per lane, the warp's heads at once.
        bool valid = j0 + lane < end;
        float sc[SPLIT_HPW];
#pragma unroll
        for (int hh = 0; hh < SPLIT_HPW; hh++) sc[hh] = 0.0f;
        const kv_t* kr = k_s + (b * SPLIT_TILE + lane) * kstride;
#pragma unroll 4
        for (int c = 0; c < d; c += 8) {
            float kx[8];
            kv_smem8(kr + c, kx);
#pragma unroll
            for (int hh = 0; hh < SPLIT_HPW; hh++) {
                const float* qh = q_s + (warp * SPLIT_HPW + hh) * d + c;
                float4 qa = *reinterpret_cast<const float4*>(qh);
                float4 qb = *reinterpret_cast<const float4*>(qh + 4);
                sc[hh] += qa.x * kx[0] + qa.y * kx[1] + qa.z * kx[2] + qa.w * kx[3] + qb.x * kx[4] +
                          qb.y * kx[5] + qb.z * kx[6] + qb.w * kx[7];
            }
        }
        // Online softmax over the tile (every lane keeps the warp's m and l).
        float corr[SPLIT_HPW];
#pragma unroll
        for (int hh = 0; hh < SPLIT_HPW; hh++) {
            float s_ = valid ? sc[hh] * scale : NEG_INF;
            float m_new = fmaxf(m[hh], warp_max(s_));  // finite: lane 0's key is valid
            corr[hh] = expf(m[hh] - m_new);
            float p = valid ? expf(s_ - m_new) : 0.0f;
            l[hh] = l[hh] * corr[hh] + warp_sum(p);
            m[hh] = m_new;
            p_s[(warp * SPLIT_HPW + hh) * SPLIT_TILE + lane] = p;
        }
        __syncwarp();
        // p·v: each lane its 8 columns, the tile's keys in order.
#pragma unroll
        for (int hh = 0; hh < SPLIT_HPW; hh++)
#pragma unroll
            for (int e = 0; e < 8; e++) acc[hh][e] *= corr[hh];
        int n_valid = min(SPLIT_TILE, end - j0);
        if (has_cols) {
            const kv_t* vr = v_s + b * SPLIT_TILE * d + c0;
#pragma unroll 4
            for (int jj = 0; jj < n_valid; jj++) {
                float vx[8];
                kv_smem8(vr + jj * d, vx);
#pragma unroll
                for (int hh = 0; hh < SPLIT_HPW; hh++) {
                    float pj = p_s[(warp * SPLIT_HPW + hh) * SPLIT_TILE + jj];
#pragma unroll
                    for (int e = 0; e < 8; e++) acc[hh][e] += pj * vx[e];
                }
            }
        }
        __syncthreads();  // buffer b and p_s are rewritten next
    }
    pdl_trigger();
    // The warp's heads' partials.
#pragma unroll
    for (int hh = 0; hh < SPLIT_HPW; hh++) {
        int hl = warp * SPLIT_HPW + hh;
        if (hl >= ng) continue;
        long long at = ((long long)t * n_q + h0 + hl) * SPLIT_MAX_SPLITS + split;
        if (has_cols) {
            float4* dst = reinterpret_cast<float4*>(part_o + at * d + c0);
            dst[0] = make_float4(acc[hh][0], acc[hh][1], acc[hh][2], acc[hh][3]);
            dst[1] = make_float4(acc[hh][4], acc[hh][5], acc[hh][6], acc[hh][7]);
        }
        if (lane == 0) {
            part_ml[at * 2] = m[hh];
            part_ml[at * 2 + 1] = l[hh];
        }
    }
}

// attn_split_mma: attn_split for one token (decode) with both products on the tensor cores
// (bf16 mode, sm_80+): at long context attn_split is bound by its CUDA-core FMAs (8 query heads ×
// 512 FMAs per 2-byte key-value element: ≈ 1 GFMA per layer at 128K, ≈ 150 µs), while the keys
// only take ≈ 65 µs to stream. Same grid, partials and split boundaries as attn_split; block
// SPLIT_WARPS (4) warps; tiles of SPLIT_TILE (32) keys, SPLIT_MMA_STAGES deep (cp.async: two
// tiles land while one is used; rows past the split zero-filled so they contribute nothing).
//   S = Q·Kᵀ: mma m16n8k16 with A = the block's ≤ 8 query heads (rows 8..15 zero, bf16, as the
//     flash prefill kernel rounds q) and B = 8 keys (ldmatrix); warp w scores keys 8w .. 8w+7 of
//     the tile. Lane (g, t) holds head g's scores of keys 8w + 2t, +1.
//   The tile's max and sum per head meet across the warps in shared memory (one barrier each);
//     every lane keeps its head's running m and l.
//   O += P·V: P (bf16, as the prefill kernel rounds it) through shared memory as A, V by
//     ldmatrix.trans as B; warp w owns output columns [d/4 · w, d/4 · (w+1)).
// Dynamic shared memory (split_mma_smem_bytes in the launcher): Q [16][d+8], K and V
// [STAGES][SPLIT_TILE][d+8] bf16, P [16][SPLIT_TILE+8] bf16, the warps' maxima and sums
// [2][2][4][8] f32.
#define SPLIT_MMA_PAD 8
#ifndef SPLIT_MMA_STAGES
#error "SPLIT_MMA_STAGES comes from the launcher module (crates/lily-cuda/src/kernels/attention.rs)"
#endif
// attn_qk_prep's work for one row (a query head or the new key) in one warp, lane l holding
// columns 8l .. 8l+7: the RMS norm with weights w, then NeoX RoPE on [0, rotary) with the angles'
// cosines and sines rc / rs (rotary / 2 of each, attn_qk_prep's arithmetic), each value rounded as
// attn_qk_prep rounds it. The partner of column i < rotary / 2 is i + rotary / 2, eight columns a
// lane, so it sits rotary / 16 lanes away (rotary / 2 a multiple of 8: the launcher checks).
__device__ __forceinline__ void prep_row(const float* __restrict__ src, const float* __restrict__ w, int d,
                                         int rotary, const float* rc, const float* rs, float eps, float (&y)[8]) {
    int lane = threadIdx.x & 31, c0 = 8 * lane;
    bool has = c0 < d;
    float x[8];
    float ss = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; e++) {
        x[e] = has ? src[c0 + e] : 0.0f;
        ss += x[e] * x[e];
    }
    ss = warp_sum(ss);
    float inv = rsqrtf(ss / (float)d + eps);
    float b[8];
#pragma unroll
    for (int e = 0; e < 8; e++) b[e] = has ? act(x[e] * inv * w[c0 + e]) : 0.0f;
    int half = rotary / 2, hop = half / 8;
    int from = c0 < half ? lane + hop : c0 < rotary ? lane - hop : lane;
#pragma unroll
    for (int e = 0; e < 8; e++) {
        float other = __shfl_sync(0xffffffffu, b[e], from & 31);
        int i = c0 + e;
        if (i < rotary) {
            int f = i < half ? i : i - half;
            float c = rc[f], s = rs[f];
            y[e] = act(i < half ? b[e] * c - other * s : b[e] * c + other * s);
        } else {
            y[e] = b[e];
        }
    }
}

// attn_qk_prep's inputs, for attn_split_mma_prep.
struct PrepIn {
    const float* qg;      // [n_q][2 d]: each head's q then its gate (the q projection's output)
    const float* k_in;    // [n_kv][d]
    const float* v_in;    // [n_kv][d]
    const float* q_norm;  // [d]
    const float* k_norm;  // [d]
    kvc_t* k_cache;       // written at row pos
    kvc_t* v_cache;
    int rotary;
    float theta, eps;
    // Shared memory the kernel declares (once, whichever body it runs): RoPE's cosines and
    // sines at this position [ATTN_MAX_D / 2] each, the new key and value in bf16 [ATTN_MAX_D]
    // (LILY_KV_INT8: as int8, their first d bytes, and their two scales in sc_s).
    float *rc_s, *rs_s;
    u16 *kn_s, *vn_s;
    float* sc_s;
};

#ifdef LILY_KV_INT8
// Eight int8 cache values (a uint2) as eight bf16 (a uint4), exactly, without an int → float or
// float → bf16 conversion (quarter-rate instructions: 12 a call would cost ≈ 1,500 cycles a tile
// and block): byte b with its sign bit flipped is b + 128 in 0..255; one byte permute makes the
// f32 2^23 + b + 128 (bits 0x4B0000xx), one FADD takes 2^23 + 128 away: b exactly. |b| <= 127 has
// at most 7 significant bits, so the f32's low 16 bits are zero and its top half is b's bf16;
// one more permute packs two of them.
__device__ __forceinline__ float kv8_byte_f(u32 flipped, u32 k) {
    return __uint_as_float(__byte_perm(flipped, 0x4B000000u, 0x7440u | k)) - 8388736.0f;
}
__device__ __forceinline__ u32 kv8_pack2(float lo, float hi) {
    return __byte_perm(__float_as_uint(lo), __float_as_uint(hi), 0x7632u);
}
__device__ __forceinline__ uint4 kv8_bf16x8(uint2 w) {
    u32 x = w.x ^ 0x80808080u, y = w.y ^ 0x80808080u;
    return make_uint4(kv8_pack2(kv8_byte_f(x, 0), kv8_byte_f(x, 1)), kv8_pack2(kv8_byte_f(x, 2), kv8_byte_f(x, 3)),
                      kv8_pack2(kv8_byte_f(y, 0), kv8_byte_f(y, 1)), kv8_pack2(kv8_byte_f(y, 2), kv8_byte_f(y, 3)));
}
#endif

// The body of attn_split_mma (PREP false: q from attn_qk_prep's q_out) and attn_split_mma_prep
// (PREP true: the block does attn_qk_prep's work itself — its query heads' norms and RoPE from the
// projection's output, and, in the block whose split holds the new position, the new key and value
// into the cache and straight into its shared tile — so one launch and one round trip less a layer).
// DC: the head dimension when known at compile time (the model's 256: strides, the tile copy's
// index arithmetic and the k loop fold into constants, whole tiles copied without per-chunk
// tests), 0 for any other (read from `d_arg`). The _long kernels take DC = 256; the host runs them
// past SPLIT_LONG_KEYS keys (attention.rs): on the H200 the 256 body ran 128K contexts 3.9–5.8 %
// faster and shorter ones slower (docs/perf-notes.md, session 7).
#if defined(LILY_BF16_ACT) && __CUDA_ARCH__ >= 800
template <bool PREP, int DC>
__device__ __forceinline__ void split_mma_body(const float* __restrict__ q, const kvc_t* k_cache,
                                               const kvc_t* v_cache, float* __restrict__ part_o,
                                               float* __restrict__ part_ml, const int* __restrict__ pos_ptr,
                                               int n_q, int n_kv, int d_arg, float scale, const PrepIn& pin) {
    const int d = DC ? DC : d_arg;
    extern __shared__ __align__(16) float split_smem[];
    // PREP: RoPE's cosines and sines at this position, the new key and value (bf16).
    float *rc_s = pin.rc_s, *rs_s = pin.rs_s;
    u16 *kn_s = pin.kn_s, *vn_s = pin.vn_s;
    int split = blockIdx.x;
    int pos = *pos_ptr;
    SplitBlock sb = split_block(split, n_q, n_kv, pos + 1);
    if (sb.start >= sb.end) return;  // uniform over the block
    int kvh = sb.kvh, h0 = sb.h0, ng = sb.ng, start = sb.start, end = sb.end;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tq = lane & 3;
    bool holds_new = PREP && pos >= start && pos < end;  // this split holds the new key
    int stride = d + SPLIT_MMA_PAD;  // bf16 elements per shared row
    u16* q_s = reinterpret_cast<u16*>(split_smem);    // [16][stride]
#ifdef LILY_KV_INT8
    // The int8 form (issue 30): the tiles land as int8 rows, STAGES deep, with each key's
    // 16-byte chunk of scales (the head's at sc_i); at the top of an iteration the block turns
    // the stage into one bf16 K tile and one V tile (exactly), which the MMAs read as below.
    u16* k_s = q_s + 16 * stride;                                // [TILE][stride]
    u16* v_s = k_s + SPLIT_TILE * stride;                        // [TILE][stride]
    u16* p_s = v_s + SPLIT_TILE * stride;                        // [16][TILE + 8]
    float* red = reinterpret_cast<float*>(p_s + 16 * (SPLIT_TILE + 8));  // [2][SPLIT_WARPS][8]
    float* ksc_s = red + 2 * 2 * SPLIT_WARPS * 8;                // [STAGES][TILE][4]
    float* vsc_s = ksc_s + SPLIT_MMA_STAGES * SPLIT_TILE * 4;    // [STAGES][TILE][4]
    signed char* k8_s = reinterpret_cast<signed char*>(vsc_s + SPLIT_MMA_STAGES * SPLIT_TILE * 4);  // [STAGES][TILE][d]
    signed char* v8_s = k8_s + SPLIT_MMA_STAGES * SPLIT_TILE * d;                                   // [STAGES][TILE][d]
    long long row = kv8_rec_bytes(n_kv, d);  // bytes a position
    const kvc_t* kbase = k_cache + (long long)kvh * d;
    const kvc_t* vbase = v_cache + (long long)kvh * d;
    const kvc_t* ksc_g = k_cache + (long long)n_kv * d + 16 * (kvh / 4);  // + j · row: key j's chunk
    const kvc_t* vsc_g = v_cache + (long long)n_kv * d + 16 * (kvh / 4);
    const int sc_i = kvh % 4;
    auto issue = [&](int b, int j0) {
        if (j0 >= end) {  // past the split: an empty group keeps the count
            cp_async_commit();
            return;
        }
        const int chunks16 = d / 16;
        for (int i = threadIdx.x; i < SPLIT_TILE * chunks16; i += blockDim.x) {
            int jj = i / chunks16, ch = (i % chunks16) * 16;
            int j = j0 + jj;
            signed char* kd = k8_s + (b * SPLIT_TILE + jj) * d + ch;
            signed char* vd = v8_s + (b * SPLIT_TILE + jj) * d + ch;
            if (PREP && j == pos) {  // the new key and value: from shared memory (after prep)
                *reinterpret_cast<uint4*>(kd) = *reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(kn_s) + ch);
                *reinterpret_cast<uint4*>(vd) = *reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(vn_s) + ch);
            } else if (j < end) {
                cp_async16(kd, kbase + (long long)j * row + ch);
                cp_async16(vd, vbase + (long long)j * row + ch);
            } else {
                *reinterpret_cast<uint4*>(kd) = make_uint4(0, 0, 0, 0);
                *reinterpret_cast<uint4*>(vd) = make_uint4(0, 0, 0, 0);
            }
        }
        for (int jj = threadIdx.x; jj < SPLIT_TILE; jj += blockDim.x) {
            int j = j0 + jj;
            float* kd = ksc_s + (b * SPLIT_TILE + jj) * 4;
            float* vd = vsc_s + (b * SPLIT_TILE + jj) * 4;
            if (PREP && j == pos) {
                kd[sc_i] = pin.sc_s[0];
                vd[sc_i] = pin.sc_s[1];
            } else if (j < end) {
                cp_async16(kd, ksc_g + (long long)j * row);
                cp_async16(vd, vsc_g + (long long)j * row);
            } else {  // zero rows past the split: their weight is 0 · 0
                kd[sc_i] = 0.0f;
                vd[sc_i] = 0.0f;
            }
        }
        cp_async_commit();
    };
#else
    u16* k_s = q_s + 16 * stride;                                // [STAGES][TILE][stride]
    u16* v_s = k_s + SPLIT_MMA_STAGES * SPLIT_TILE * stride;     // [STAGES][TILE][stride]
    u16* p_s = v_s + SPLIT_MMA_STAGES * SPLIT_TILE * stride;     // [16][TILE + 8]
    float* red = reinterpret_cast<float*>(p_s + 16 * (SPLIT_TILE + 8));  // [2][SPLIT_WARPS][8]
    long long row = (long long)n_kv * d;
    const kv_t* kbase = k_cache + (long long)kvh * d;
    const kv_t* vbase = v_cache + (long long)kvh * d;
    const int chunks_per_row = d / 8;
    auto issue = [&](int b, int j0) {
        if (j0 >= end) {  // past the split: an empty group keeps the count
            cp_async_commit();
            return;
        }
        if (DC != 0 && j0 + SPLIT_TILE <= end && !(holds_new && pos < j0 + SPLIT_TILE)) {
            // A whole tile of earlier steps' keys (every tile but a split's last): copies only,
            // SPLIT_TILE · d / 8 chunks over the block's threads, no per-chunk tests.
            constexpr int NT = SPLIT_WARPS * 32;
#pragma unroll 4
            for (int i = threadIdx.x; i < SPLIT_TILE * chunks_per_row; i += NT) {
                int jj = i / chunks_per_row, ch = (i % chunks_per_row) * 8;
                long long at = (long long)(j0 + jj) * row + ch;
                cp_async16(k_s + (b * SPLIT_TILE + jj) * stride + ch, kbase + at);
                cp_async16(v_s + (b * SPLIT_TILE + jj) * stride + ch, vbase + at);
            }
            cp_async_commit();
            return;
        }
        for (int i = threadIdx.x; i < SPLIT_TILE * chunks_per_row; i += blockDim.x) {
            int jj = i / chunks_per_row, ch = (i % chunks_per_row) * 8;
            int j = j0 + jj;
            u16* kd = k_s + (b * SPLIT_TILE + jj) * stride + ch;
            u16* vd = v_s + (b * SPLIT_TILE + jj) * stride + ch;
            if (PREP && j == pos) {  // the new key and value: from shared memory (after prep)
                *reinterpret_cast<uint4*>(kd) = *reinterpret_cast<const uint4*>(kn_s + ch);
                *reinterpret_cast<uint4*>(vd) = *reinterpret_cast<const uint4*>(vn_s + ch);
            } else if (j < end) {
                cp_async16(kd, kbase + (long long)j * row + ch);
                cp_async16(vd, vbase + (long long)j * row + ch);
            } else {
                *reinterpret_cast<uint4*>(kd) = make_uint4(0, 0, 0, 0);
                *reinterpret_cast<uint4*>(vd) = make_uint4(0, 0, 0, 0);
            }
        }
        cp_async_commit();
    };
#endif
    // The first STAGES − 1 tiles, in order (one cp.async group each); while every one of them
    // holds only earlier steps' keys (or none), before pdl_wait.
    int n_early = 0;
    while (n_early < SPLIT_MMA_STAGES - 1 && min(start + (n_early + 1) * SPLIT_TILE, end) <= pos) {
        issue(n_early, start + n_early * SPLIT_TILE);
        n_early++;
    }
    if (PREP) {
        // The angles depend only on the position (attn_qk_prep's arithmetic, in double).
        int half = pin.rotary / 2;
        for (int f = threadIdx.x; f < half; f += blockDim.x) {
            double inv_freq = 1.0 / pow((double)pin.theta, (double)(2 * f) / (double)pin.rotary);
            double ang = (double)pos * inv_freq;
            rc_s[f] = act((float)cos(ang));
            rs_s[f] = act((float)sin(ang));
        }
        __syncthreads();
    }
    pdl_wait();
    if (PREP) {
        // Warp 0 first makes the new key and value (only in the split that holds them), then
        // every warp its query rows; rows ng .. 15 zero.
        int c0 = 8 * lane;
        if (holds_new && warp == 0) {
            float y[8];
            prep_row(pin.k_in + (long long)kvh * d, pin.k_norm, d, pin.rotary, rc_s, rs_s, pin.eps, y);
#ifdef LILY_KV_INT8
            // Both rows as int8 with their scales (kv_int8_encode's rule over the warp's d values).
            float vv[8], ak = 0.0f, av = 0.0f;
#pragma unroll
            for (int e = 0; e < 8; e++) {
                vv[e] = c0 < d ? pin.v_in[(long long)kvh * d + c0 + e] : 0.0f;
                ak = fmaxf(ak, fabsf(y[e]));
                av = fmaxf(av, fabsf(vv[e]));
            }
            float sk = warp_max(ak) / 127.0f, sv = warp_max(av) / 127.0f;
            if (c0 < d) {
                long long at = (long long)pos * row + (long long)kvh * d + c0;
                uint2 kw = make_uint2(kv8_pack4(kv8_quant(y[0], sk), kv8_quant(y[1], sk), kv8_quant(y[2], sk), kv8_quant(y[3], sk)),
                                      kv8_pack4(kv8_quant(y[4], sk), kv8_quant(y[5], sk), kv8_quant(y[6], sk), kv8_quant(y[7], sk)));
                uint2 vw = make_uint2(kv8_pack4(kv8_quant(vv[0], sv), kv8_quant(vv[1], sv), kv8_quant(vv[2], sv), kv8_quant(vv[3], sv)),
                                      kv8_pack4(kv8_quant(vv[4], sv), kv8_quant(vv[5], sv), kv8_quant(vv[6], sv), kv8_quant(vv[7], sv)));
                *reinterpret_cast<uint2*>(reinterpret_cast<char*>(kn_s) + c0) = kw;
                *reinterpret_cast<uint2*>(reinterpret_cast<char*>(vn_s) + c0) = vw;
                *reinterpret_cast<uint2*>(pin.k_cache + at) = kw;
                *reinterpret_cast<uint2*>(pin.v_cache + at) = vw;
            }
            if (lane == 0) {
                pin.sc_s[0] = sk;
                pin.sc_s[1] = sv;
                long long sat = (long long)pos * row + (long long)n_kv * d + 4LL * kvh;
                *reinterpret_cast<float*>(pin.k_cache + sat) = sk;
                *reinterpret_cast<float*>(pin.v_cache + sat) = sv;
            }
#else
            if (c0 < d) {
                long long at = (long long)pos * n_kv * d + (long long)kvh * d + c0;
                uint4 kw, vw;
                const float* vr = pin.v_in + (long long)kvh * d + c0;
                kw.x = (u32)kv_store(y[0]) | ((u32)kv_store(y[1]) << 16);
                kw.y = (u32)kv_store(y[2]) | ((u32)kv_store(y[3]) << 16);
                kw.z = (u32)kv_store(y[4]) | ((u32)kv_store(y[5]) << 16);
                kw.w = (u32)kv_store(y[6]) | ((u32)kv_store(y[7]) << 16);
                vw.x = (u32)kv_store(vr[0]) | ((u32)kv_store(vr[1]) << 16);
                vw.y = (u32)kv_store(vr[2]) | ((u32)kv_store(vr[3]) << 16);
                vw.z = (u32)kv_store(vr[4]) | ((u32)kv_store(vr[5]) << 16);
                vw.w = (u32)kv_store(vr[6]) | ((u32)kv_store(vr[7]) << 16);
                *reinterpret_cast<uint4*>(kn_s + c0) = kw;
                *reinterpret_cast<uint4*>(vn_s + c0) = vw;
                *reinterpret_cast<uint4*>(pin.k_cache + at) = kw;
                *reinterpret_cast<uint4*>(pin.v_cache + at) = vw;
            }
#endif
        }
        for (int hh = warp; hh < 16; hh += SPLIT_WARPS) {
            float y[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
            if (hh < ng)
                prep_row(pin.qg + (long long)(h0 + hh) * 2 * d, pin.q_norm, d, pin.rotary, rc_s, rs_s, pin.eps, y);
            if (c0 < d) {
                uint4 qw = make_uint4(pack_bf16x2(y[0], y[1]), pack_bf16x2(y[2], y[3]), pack_bf16x2(y[4], y[5]),
                                      pack_bf16x2(y[6], y[7]));
                *reinterpret_cast<uint4*>(q_s + hh * stride + c0) = qw;
            }
        }
        __syncthreads();  // kn_s / vn_s before the tiles that copy them, q_s before the loop
        for (int s = n_early; s < SPLIT_MMA_STAGES - 1; s++) issue(s, start + s * SPLIT_TILE);
    } else {
        for (int s = n_early; s < SPLIT_MMA_STAGES - 1; s++) issue(s, start + s * SPLIT_TILE);
        // Q rows (heads h0 .. h0 + ng − 1, zero rows after).
        for (int i = threadIdx.x; i < 16 * (d / 2); i += blockDim.x) {
            int hh = i / (d / 2), c = (i % (d / 2)) * 2;
            u32 v = 0;
            if (hh < ng) {
                const float* qr = q + (long long)(h0 + hh) * d + c;
                v = pack_bf16x2(qr[0], qr[1]);
            }
            *reinterpret_cast<u32*>(q_s + hh * stride + c) = v;
        }
    }
    // P's rows 8..15 zero.
    for (int i = threadIdx.x; i < 8 * (SPLIT_TILE + 8) / 2; i += blockDim.x)
        reinterpret_cast<u32*>(p_s + 8 * (SPLIT_TILE + 8))[i] = 0;
    int ncol = d / SPLIT_WARPS;      // output columns of this warp
    int c_w = warp * ncol;
    float o[ATTN_MAX_D / SPLIT_WARPS / 8][4];
#pragma unroll
    for (int n = 0; n < ATTN_MAX_D / SPLIT_WARPS / 8; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m = NEG_INF, l = 0.0f;  // head g's running max and sum (every lane of the quad)
    // ldmatrix row addresses: A (16 rows × 16 columns) from lane's row lane % 16, column
    // 8 · (lane / 16); B from K rows: 8 keys × 16 dims for two k-steps.
    u32 q_addr = smem_addr(q_s + (lane & 15) * stride + 8 * (lane >> 4));
    u32 p_addr = smem_addr(p_s + (lane & 15) * (SPLIT_TILE + 8) + 8 * (lane >> 4));
    int n_tiles = (end - start + SPLIT_TILE - 1) / SPLIT_TILE;
    for (int it = 0; it < n_tiles; it++) {
        int b = it % SPLIT_MMA_STAGES, j0 = start + it * SPLIT_TILE;
        // Tile it + STAGES − 1 into the buffer tile it − 1 used (every warp is past it); a
        // group per iteration (empty past the split), so tile it is complete once all but the
        // newest STAGES − 1 groups are.
        issue((it + SPLIT_MMA_STAGES - 1) % SPLIT_MMA_STAGES, j0 + (SPLIT_MMA_STAGES - 1) * SPLIT_TILE);
        cp_async_wait<SPLIT_MMA_STAGES - 1>();
        __syncthreads();
#ifdef LILY_KV_INT8
        // Stage b's int8 rows into the bf16 tiles (the last iteration's readers are past the
        // barrier that closed it), then a barrier before the MMAs read them.
        for (int i = threadIdx.x; i < SPLIT_TILE * (d / 8); i += blockDim.x) {
            int jj = i / (d / 8), ch = (i % (d / 8)) * 8;
            uint2 kw = *reinterpret_cast<const uint2*>(k8_s + (b * SPLIT_TILE + jj) * d + ch);
            uint2 vw = *reinterpret_cast<const uint2*>(v8_s + (b * SPLIT_TILE + jj) * d + ch);
            *reinterpret_cast<uint4*>(k_s + jj * stride + ch) = kv8_bf16x8(kw);
            *reinterpret_cast<uint4*>(v_s + jj * stride + ch) = kv8_bf16x8(vw);
        }
        __syncthreads();
        const int tb = 0;  // the one bf16 tile
#else
        const int tb = b;
#endif
        // S for keys 8·warp .. +7: lanes 0-7 address K rows for dims [k, k+8), 8-15 [k+8, k+16),
        // 16-31 the same for the next k-step.
        float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        const u16* kt = k_s + (tb * SPLIT_TILE + 8 * warp + (lane & 7)) * stride + 8 * (lane >> 3);
        for (int k = 0; k < d; k += 32) {
            u32 a0[4], a1[4], kb[4];
            ldsm_x4(q_addr + 2 * k, a0);
            ldsm_x4(q_addr + 2 * (k + 16), a1);
            ldsm_x4(smem_addr(kt + k), kb);
            mma_bf16(sc, a0, kb[0], kb[1]);
            mma_bf16(sc, a1, kb[2], kb[3]);
        }
        // Scores of head g (rows 0..7: sc[0], sc[1]) for keys j0 + 8·warp + 2·tq, +1.
        int j = j0 + 8 * warp + 2 * tq;
#ifdef LILY_KV_INT8
        // Key j's dot product is s_k[j] · (q · q8_j): its scale joins the softmax scale.
        const float* ksc = ksc_s + (b * SPLIT_TILE + 8 * warp + 2 * tq) * 4 + sc_i;
        float s0 = j < end ? sc[0] * (scale * ksc[0]) : NEG_INF;
        float s1 = j + 1 < end ? sc[1] * (scale * ksc[4]) : NEG_INF;
#else
        float s0 = j < end ? sc[0] * scale : NEG_INF;
        float s1 = j + 1 < end ? sc[1] * scale : NEG_INF;
#endif
        float mx = fmaxf(s0, s1);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        float* rm = red + (it & 1) * 2 * SPLIT_WARPS * 8;
        float* rs = rm + SPLIT_WARPS * 8;
        if (tq == 0) rm[warp * 8 + g] = mx;
        __syncthreads();
        float m_new = m;
#pragma unroll
        for (int w = 0; w < SPLIT_WARPS; w++) m_new = fmaxf(m_new, rm[w * 8 + g]);  // finite: key j0 is valid
        float corr = expf(m - m_new);
        float p0 = expf(s0 - m_new), p1 = expf(s1 - m_new);
        float ps = p0 + p1;
        ps += __shfl_xor_sync(0xffffffffu, ps, 1);
        ps += __shfl_xor_sync(0xffffffffu, ps, 2);
        if (tq == 0) rs[warp * 8 + g] = ps;
#ifdef LILY_KV_INT8
        // Value j's row is s_v[j] · v8_j: its scale goes into P (the sums l keep the weights).
        const float* vsc = vsc_s + (b * SPLIT_TILE + 8 * warp + 2 * tq) * 4 + sc_i;
        *reinterpret_cast<u32*>(p_s + g * (SPLIT_TILE + 8) + 8 * warp + 2 * tq) = pack_bf16x2(p0 * vsc[0], p1 * vsc[4]);
#else
        *reinterpret_cast<u32*>(p_s + g * (SPLIT_TILE + 8) + 8 * warp + 2 * tq) = pack_bf16x2(p0, p1);
#endif
        __syncthreads();
        float ts = 0.0f;
#pragma unroll
        for (int w = 0; w < SPLIT_WARPS; w++) ts += rs[w * 8 + g];
        l = l * corr + ts;
        m = m_new;
        // O (rows: heads) *= corr, then += P · V over the tile's keys, 16 at a time.
#pragma unroll
        for (int n = 0; n < ATTN_MAX_D / SPLIT_WARPS / 8; n++) {
            o[n][0] *= corr;
            o[n][1] *= corr;
        }
#pragma unroll
        for (int kk = 0; kk < SPLIT_TILE; kk += 16) {
            u32 pa[4];
            ldsm_x4(p_addr + 2 * kk, pa);
            // V rows kk .. kk+15, columns c_w + 8n: lanes 0-7 keys kk+0..7 at column n0, 8-15
            // keys kk+8..15 at n0, 16-23 keys kk+0..7 at n0+8, 24-31 keys kk+8..15 at n0+8.
            const u16* vt = v_s + (tb * SPLIT_TILE + kk + (lane & 15)) * stride + c_w + 8 * (lane >> 4);
#pragma unroll
            for (int n = 0; n < ATTN_MAX_D / SPLIT_WARPS / 8; n += 2) {
                if (8 * n >= ncol) break;
                u32 vb[4];
                ldsm_x4_trans(smem_addr(vt + 8 * n), vb);
                mma_bf16(o[n], pa, vb[0], vb[1]);
                mma_bf16(o[n + 1], pa, vb[2], vb[3]);
            }
        }
        __syncthreads();  // buffer b and P are rewritten next
    }
    pdl_trigger();
    // Head g's partials: columns c_w + 8n + 2tq, +1.
    if (g < ng) {
        long long at = ((long long)h0 + g) * SPLIT_MAX_SPLITS + split;
#pragma unroll
        for (int n = 0; n < ATTN_MAX_D / SPLIT_WARPS / 8; n++) {
            if (8 * n >= ncol) break;
            *reinterpret_cast<float2*>(part_o + at * d + c_w + 8 * n + 2 * tq) = make_float2(o[n][0], o[n][1]);
        }
        if (warp == 0 && tq == 0) {
            part_ml[at * 2] = m;
            part_ml[at * 2 + 1] = l;
        }
    }
}
#endif

// attn_split_mma: one token's split-KV attention on the tensor cores, q from attn_qk_prep.
// attn_split_mma_long: the same with head dim 256 fixed at compile time (split_mma_body's DC), which
// the host takes past SPLIT_LONG_KEYS keys (attention.rs); a kernel of its own, so the general
// one keeps its registers (72; one kernel holding both bodies took 96 and ran 256…32K 1–3 %
// slower on the H200, docs/perf-notes.md, session 7).
// The _long kernels' head dimension: 256 on sm_90 (where the H200 measured it); elsewhere the
// general body (on sm_86 / sm_89 the 256 body of the fused-prep kernel spills registers).
#if __CUDA_ARCH__ >= 900
#define SPLIT_LONG_DC 256
#else
#define SPLIT_LONG_DC 0
#endif
#define SPLIT_MMA_ARGS                                                                                    \
    const float *__restrict__ q, const kvc_t *__restrict__ k_cache, const kvc_t *__restrict__ v_cache,    \
        float *__restrict__ part_o, float *__restrict__ part_ml, const int *__restrict__ pos_ptr, int n_tok, \
        int n_q, int n_kv, int d, float scale
extern "C" __global__ void __launch_bounds__(SPLIT_WARPS * 32) attn_split_mma(SPLIT_MMA_ARGS) {
#if defined(LILY_BF16_ACT) && __CUDA_ARCH__ >= 800
    PrepIn none = {};
    split_mma_body<false, 0>(q, k_cache, v_cache, part_o, part_ml, pos_ptr, n_q, n_kv, d, scale, none);
#else
    __trap();
#endif
}

extern "C" __global__ void __launch_bounds__(SPLIT_WARPS * 32) attn_split_mma_long(SPLIT_MMA_ARGS) {
#if defined(LILY_BF16_ACT) && __CUDA_ARCH__ >= 800
    if (d != 256) __trap();
    PrepIn none = {};
    split_mma_body<false, SPLIT_LONG_DC>(q, k_cache, v_cache, part_o, part_ml, pos_ptr, n_q, n_kv, d, scale, none);
#else
    __trap();
#endif
}

// attn_split_mma_prep: attn_qk_prep + attn_split_mma of one token in one launch (the plan's
// `fused_attn_prep`); the same partials, and the same cache row written at the position.
// attn_split_mma_prep_long: the same with head dim 256 fixed at compile time.
#define SPLIT_MMA_PREP_ARGS                                                                               \
    const float *__restrict__ qg, const float *__restrict__ k_in, const float *__restrict__ v_in,         \
        const float *__restrict__ q_norm, const float *__restrict__ k_norm, kvc_t *__restrict__ k_cache, \
        kvc_t *__restrict__ v_cache, float *__restrict__ part_o, float *__restrict__ part_ml,             \
        const int *__restrict__ pos_ptr, int n_q, int n_kv, int d, int rotary, float theta, float eps,   \
        float scale
#if defined(LILY_BF16_ACT) && __CUDA_ARCH__ >= 800
template <int DC>
__device__ __forceinline__ void split_mma_prep_entry(SPLIT_MMA_PREP_ARGS) {
    __shared__ float rc_s[ATTN_MAX_D / 2], rs_s[ATTN_MAX_D / 2];
    __shared__ __align__(16) u16 kn_s[ATTN_MAX_D], vn_s[ATTN_MAX_D];
    __shared__ float sc_s[2];
    PrepIn pin = {qg, k_in, v_in, q_norm, k_norm, k_cache, v_cache, rotary, theta, eps, rc_s, rs_s, kn_s, vn_s, sc_s};
    split_mma_body<true, DC>(nullptr, k_cache, v_cache, part_o, part_ml, pos_ptr, n_q, n_kv, d, scale, pin);
}
#endif

extern "C" __global__ void __launch_bounds__(SPLIT_WARPS * 32) attn_split_mma_prep(SPLIT_MMA_PREP_ARGS) {
#if defined(LILY_BF16_ACT) && __CUDA_ARCH__ >= 800
    split_mma_prep_entry<0>(qg, k_in, v_in, q_norm, k_norm, k_cache, v_cache, part_o, part_ml, pos_ptr, n_q, n_kv,
                            d, rotary, theta, eps, scale);
#else
    __trap();
#endif
}

extern "C" __global__ void __launch_bounds__(SPLIT_WARPS * 32) attn_split_mma_prep_long(SPLIT_MMA_PREP_ARGS) {
#if defined(LILY_BF16_ACT) && __CUDA_ARCH__ >= 800
    if (d != 256) __trap();
    split_mma_prep_entry<SPLIT_LONG_DC>(qg, k_in, v_in, q_norm, k_norm, k_cache, v_cache, part_o, part_ml, pos_ptr, n_q,
                              n_kv, d, rotary, theta, eps, scale);
#else
    __trap();
#endif
}

// attn_split_mma_prep_rows / attn_split_mma_prep_long_rows: attn_split_mma_prep for each sequence
// of a batched decode step (one token each), sequence b in blockIdx.z: its token's projections at
// row b of qg / k_in / v_in, its partials in slot b (token b's of a step), its caches and position
// through tables the host writes once per batch composition: caches[b] (keys), caches[B + b]
// (values), positions[b]. grid (SPLIT_MAX_SPLITS, n_kv · chunks, B).
#define SPLIT_MMA_PREP_ROWS_ARGS                                                                          \
    const float *__restrict__ qg, const float *__restrict__ k_in, const float *__restrict__ v_in,         \
        const float *__restrict__ q_norm, const float *__restrict__ k_norm, kvc_t *const *__restrict__ caches, \
        float *__restrict__ part_o, float *__restrict__ part_ml, const int *const *__restrict__ positions,  \
        int n_q, int n_kv, int d, int rotary, float theta, float eps, float scale
#if defined(LILY_BF16_ACT) && __CUDA_ARCH__ >= 800
template <int DC>
__device__ __forceinline__ void split_mma_prep_rows_entry(SPLIT_MMA_PREP_ROWS_ARGS) {
    long long b = blockIdx.z, slots = (long long)n_q * SPLIT_MAX_SPLITS;
    split_mma_prep_entry<DC>(qg + b * n_q * 2 * d, k_in + b * n_kv * d, v_in + b * n_kv * d, q_norm, k_norm,
                             caches[b], caches[gridDim.z + b], part_o + b * slots * d, part_ml + b * slots * 2,
                             positions[b], n_q, n_kv, d, rotary, theta, eps, scale);
}
#endif

extern "C" __global__ void __launch_bounds__(SPLIT_WARPS * 32) attn_split_mma_prep_rows(SPLIT_MMA_PREP_ROWS_ARGS) {
#if defined(LILY_BF16_ACT) && __CUDA_ARCH__ >= 800
    split_mma_prep_rows_entry<0>(qg, k_in, v_in, q_norm, k_norm, caches, part_o, part_ml, positions, n_q, n_kv, d,
                                 rotary, theta, eps, scale);
#else
    __trap();
#endif
}

extern "C" __global__ void __launch_bounds__(SPLIT_WARPS * 32)
attn_split_mma_prep_long_rows(SPLIT_MMA_PREP_ROWS_ARGS) {
#if defined(LILY_BF16_ACT) && __CUDA_ARCH__ >= 800
    if (d != 256) __trap();
    split_mma_prep_rows_entry<SPLIT_LONG_DC>(qg, k_in, v_in, q_norm, k_norm, caches, part_o, part_ml, positions, n_q,
                                             n_kv, d, rotary, theta, eps, scale);
#else
    __trap();
#endif
}

// attn_split_combine: one block per (query head, token, 64 columns); its 8 warps take every 8th
// split, each lane 2 columns, so the partials stream with many loads in flight instead of one
// thread walking every split in turn; the warps' sums meet in shared memory. Token t's `len`
// keys; the caller has waited for its predecessor (pdl_wait).
__device__ __forceinline__ void split_combine_token(const float* __restrict__ qg, const float* __restrict__ part_o,
                                                    const float* __restrict__ part_ml, float* __restrict__ out,
                                                    int t, int len, int n_q, int d) {
    __shared__ float w_s[SPLIT_MAX_SPLITS];
    __shared__ float mx_s[8];
    __shared__ float2 acc_s[8][32];
    int h = blockIdx.x, c = blockIdx.z * 64 + 2 * (threadIdx.x & 31);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int n_s = (len + split_keys(len) - 1) / split_keys(len);
    long long base = ((long long)t * n_q + h) * SPLIT_MAX_SPLITS;
    float big = NEG_INF;
    for (int s = threadIdx.x; s < n_s; s += blockDim.x) big = fmaxf(big, part_ml[(base + s) * 2]);
    big = warp_max(big);
    if (lane == 0) mx_s[warp] = big;
    __syncthreads();
    big = lane < 8 ? mx_s[lane] : NEG_INF;
    big = warp_max(big);
    float part = 0.0f;
    for (int s = threadIdx.x; s < n_s; s += blockDim.x) {
        float w = expf(part_ml[(base + s) * 2] - big);
        w_s[s] = w;
        part += w * part_ml[(base + s) * 2 + 1];
    }
    float total = block_sum(part);  // its barriers also publish w_s
    float2 o = make_float2(0.0f, 0.0f);
    if (c < d) {
#pragma unroll 4
        for (int s = warp; s < n_s; s += 8) {
            float2 v = *reinterpret_cast<const float2*>(&part_o[(base + s) * d + c]);
            o.x += w_s[s] * v.x;
            o.y += w_s[s] * v.y;
        }
    }
    acc_s[warp][lane] = o;
    __syncthreads();
    if (warp == 0 && c < d) {
        float2 sum = acc_s[0][lane];
        for (int w = 1; w < 8; w++) {
            sum.x += acc_s[w][lane].x;
            sum.y += acc_s[w][lane].y;
        }
        const float* gate = qg + (long long)t * n_q * 2 * d + (long long)h * 2 * d + d + c;
        float* dst = out + (long long)t * n_q * d + (long long)h * d + c;
        dst[0] = act(act(sum.x / total) * act(sigmoidf(gate[0])));
        dst[1] = act(act(sum.y / total) * act(sigmoidf(gate[1])));
    }
}

extern "C" __global__ void __launch_bounds__(256)
attn_split_combine(const float* __restrict__ qg, const float* __restrict__ part_o,
                   const float* __restrict__ part_ml, float* __restrict__ out, const int* __restrict__ pos_ptr,
                   int n_tok, int n_q, int d) {
    pdl_wait();
    int t = blockIdx.y;
    if (t >= n_tok) return;  // uniform over the block
    split_combine_token(qg, part_o, part_ml, out, t, *pos_ptr + t + 1, n_q, d);
}

// attn_split_combine_rows: attn_split_combine for each sequence of a batched decode step (one
// token each), sequence t in blockIdx.y: its rows of qg and out, its partials' slot t, its
// position through the table positions[t].
extern "C" __global__ void __launch_bounds__(256)
attn_split_combine_rows(const float* __restrict__ qg, const float* __restrict__ part_o,
                        const float* __restrict__ part_ml, float* __restrict__ out,
                        const int* const* __restrict__ positions, int n_q, int d) {
    pdl_wait();
    int t = blockIdx.y;
    split_combine_token(qg, part_o, part_ml, out, t, *positions[t] + 1, n_q, d);
}

// ---- prefill on tensor cores --------------------------------------------------------------------

// PF_Q: queries per block (16 per warp)
#ifndef PF_Q
#error "PF_Q comes from the launcher module (crates/lily-cuda/src/kernels/attention.rs)"
#endif
#ifndef PF_WARPS
#error "PF_WARPS comes from the launcher module (crates/lily-cuda/src/kernels/attention.rs)"
#endif
#define PF_THREADS (PF_WARPS * 32)
// PF_PAD: bf16 elements of padding per shared-memory row
#ifndef PF_PAD
#error "PF_PAD comes from the launcher module (crates/lily-cuda/src/kernels/attention.rs)"
#endif
// PF_KEYS_SMALL: keys per tile for D <= 128
#ifndef PF_KEYS_SMALL
#error "PF_KEYS_SMALL comes from the launcher module (crates/lily-cuda/src/kernels/attention.rs)"
#endif
// PF_KEYS_256: keys per tile for D = 256
#ifndef PF_KEYS_256
#error "PF_KEYS_256 comes from the launcher module (crates/lily-cuda/src/kernels/attention.rs)"
#endif

// Eight consecutive cache elements (16-byte aligned) into shared memory as bf16: an asynchronous
// 16-byte copy in bf16 mode; in fp32 mode a synchronous load and conversion.
__device__ __forceinline__ void stage8(u16* dst, const kv_t* src) {
#ifdef LILY_BF16_ACT
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
#else
    float4 a = *reinterpret_cast<const float4*>(src);
    float4 b = *reinterpret_cast<const float4*>(src + 4);
    uint4 w;
    w.x = pack_bf16x2(a.x, a.y);
    w.y = pack_bf16x2(a.z, a.w);
    w.z = pack_bf16x2(b.x, b.y);
    w.w = pack_bf16x2(b.z, b.w);
    *reinterpret_cast<uint4*>(dst) = w;
#endif
}

__device__ __forceinline__ void zero8(u16* dst) {
    uint4 z;
    z.x = z.y = z.z = z.w = 0u;
    *reinterpret_cast<uint4*>(dst) = z;
}

// attn_decode's epilogue for two adjacent columns c, c+1 of token t, head h.
__device__ __forceinline__ void attn_store2(const float* __restrict__ qg, float* __restrict__ out, int t, int h,
                                            int n_q, int d, int c, float o0, float o1, float l) {
    float2 gate = *reinterpret_cast<const float2*>(qg + ((long long)t * n_q * 2 + (long long)h * 2) * d + d + c);
    float2 r;
    r.x = act(act(o0 / l) * act(sigmoidf(gate.x)));
    r.y = act(act(o1 / l) * act(sigmoidf(gate.y)));
    *reinterpret_cast<float2*>(out + ((long long)t * n_q + h) * d + c) = r;
}

// The tensor-core prefill kernels' row sums: each of the 4 lanes of a quad holds part of rows g
// and g + 8; afterwards every lane holds the whole.
__device__ __forceinline__ void quad_sums(float& a, float& b) {
#pragma unroll
    for (int x = 1; x < 4; x <<= 1) {
        a += __shfl_xor_sync(0xffffffffu, a, x);
        b += __shfl_xor_sync(0xffffffffu, b, x);
    }
}

// One block: queries q0..q0+63 of head h against keys 0..kmax in tiles of BC keys (see the top).
template <int D, int BC>
__device__ __forceinline__ void attn_prefill_tiles(const float* __restrict__ q, const float* __restrict__ qg,
                                                   const kv_t* __restrict__ k_cache,
                                                   const kv_t* __restrict__ v_cache, float* __restrict__ out,
                                                   int pos, int n_tok, int n_q, int n_kv, float scale, u16* smem) {
    constexpr int LD = D + PF_PAD;  // shared row stride (bf16): 16 bytes past a multiple of 128
    constexpr int CH = D / 8;       // 16-byte chunks per row
    constexpr int NT_D = D / 8;     // 8-wide n-tiles over head dims (the O accumulator)
    constexpr int KS_D = D / 16;    // 16-deep k-steps over head dims (Q·Kᵀ)
    constexpr int NT_K = BC / 8;    // n-tiles over the tile's keys (S)
    constexpr int KS_K = BC / 16;   // k-steps over the tile's keys (P·V)
    static_assert(D % 16 == 0 && BC % 16 == 0, "mma tiles");
    static_assert((PF_Q * CH) % PF_THREADS == 0 && (BC * CH) % PF_THREADS == 0, "staging loops");
    u16* q_s = smem;             // [PF_Q][LD]
    u16* k_s = q_s + PF_Q * LD;  // [BC][LD]
    u16* v_s = k_s + BC * LD;    // [BC][LD]

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, tq = lane & 3;  // mma fragment coordinates: row group, thread in group
    const int h = blockIdx.y;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * PF_Q;  // the longest query blocks start first
    const int kvh = h / (n_q / n_kv);
    const int kmax = pos + min(q0 + PF_Q, n_tok) - 1;  // the block's last query attends to 0..=kmax
    const int n_tiles = kmax / BC + 1;
    const long long kv_stride = (long long)n_kv * D;  // elements between consecutive keys
    const kv_t* k_head = k_cache + (long long)kvh * D;
    const kv_t* v_head = v_cache + (long long)kvh * D;

    // The Q tile as bf16 (exact in bf16 mode), zero rows past the chunk.
#pragma unroll
    for (int it = 0; it < PF_Q * CH / PF_THREADS; it++) {
        int i = tid + it * PF_THREADS;
        int r = i / CH, c = (i % CH) * 8;
        u16* dst = q_s + r * LD + c;
        if (q0 + r < n_tok) {
            const float* src = q + ((long long)(q0 + r) * n_q + h) * D + c;
            float4 a = *reinterpret_cast<const float4*>(src);
            float4 b = *reinterpret_cast<const float4*>(src + 4);
            uint4 w;
            w.x = pack_bf16x2(a.x, a.y);
            w.y = pack_bf16x2(a.z, a.w);
            w.z = pack_bf16x2(b.x, b.y);
            w.w = pack_bf16x2(b.z, b.w);
            *reinterpret_cast<uint4*>(dst) = w;
        } else {
            zero8(dst);
        }
    }
    // Keys k0..k0+BC-1 of K or V into a tile; rows past kmax are zeros (they may lie past the
    // cache, and a zero V row keeps 0 · garbage out of P·V).
    auto stage_tile = [&](u16* tile, const kv_t* head, int k0) {
#pragma unroll
        for (int it = 0; it < BC * CH / PF_THREADS; it++) {
            int i = tid + it * PF_THREADS;
            int r = i / CH, c = (i % CH) * 8;
            if (k0 + r <= kmax)
                stage8(tile + r * LD + c, head + (long long)(k0 + r) * kv_stride + c);
            else
                zero8(tile + r * LD + c);
        }
    };

    // ldmatrix row addresses of this lane (bytes, shared space).
    //   Q (A operand, 16x16 at k-step ks): matrices (rows 0-7 | 8-15) x (dims 0-7 | 8-15) in
    //     a0..a3 order: lane L gives row L%16, dims 8·(L/16).
    //   K (B operand, col: b0/b1 = dims 0-7/8-15 of one 8-key n-tile), two n-tiles per load:
    //     lane L gives key (L%8) + 8·(L/16), dims 8·((L/8)%2).
    //   V (B operand via .trans: b0/b1 = keys 0-7/8-15 of one 8-dim n-tile), two n-tiles per
    //     load: lane L gives key (L%8) + 8·((L/8)%2), dims 8·(L/16).
    const int row0 = warp * 16;
    const u32 q_frag = smem_addr(q_s + (row0 + (lane & 15)) * LD + (lane >> 4) * 8);
    const u32 k_frag = smem_addr(k_s + ((lane & 7) + ((lane >> 4) << 3)) * LD + ((lane >> 3) & 1) * 8);
    const u32 v_frag = smem_addr(v_s + ((lane & 7) + (((lane >> 3) & 1) << 3)) * LD + (lane >> 4) * 8);

    const int first_pos = pos + q0 + row0;  // position of the warp's first query
    const int last_pos = first_pos + 15;
    const int pos_a = first_pos + g, pos_b = pos_a + 8;  // this thread's rows g and g+8

    float o[NT_D][4];
#pragma unroll
    for (int n = 0; n < NT_D; n++) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m_a = NEG_INF, m_b = NEG_INF;  // running max of rows g, g+8 (the same in the 4 lanes)
    float l_a = 0.0f, l_b = 0.0f;        // this lane's part of the running sums

    stage_tile(k_s, k_head, 0);
    cp_async_commit();
    for (int tile = 0; tile < n_tiles; tile++) {
        const int k0 = tile * BC;
        cp_async_wait<0>();
        __syncthreads();  // K(tile) (and Q) visible; every warp is done with V(tile - 1)
        stage_tile(v_s, v_head, k0);
        cp_async_commit();
        // Warp-uniform: whether any of the warp's queries sees a key of this tile. Tile 0 is live
        // for every warp and every row sees key 0 there, so m_a and m_b are finite after it.
        const bool live = k0 <= last_pos;
        float s[NT_K][4];
        if (live) {
            // S = Q·Kᵀ (fp32 accumulate).
#pragma unroll
            for (int n = 0; n < NT_K; n++) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < KS_D; ks++) {
                u32 a[4];
                ldsm_x4(q_frag + ks * 32, a);
#pragma unroll
                for (int p = 0; p < NT_K / 2; p++) {
                    u32 b[4];
                    ldsm_x4(k_frag + (p * 16 * LD + ks * 16) * 2, b);
                    mma_bf16(s[2 * p], a, b[0], b[1]);
                    mma_bf16(s[2 * p + 1], a, b[2], b[3]);
                }
            }
            // Scale; causal mask only where the tile crosses the warp's diagonal. Element e of
            // n-tile n is row g (e < 2) or g+8, key k0 + 8n + 2·tq + (e & 1).
            const bool diag = k0 + BC - 1 > first_pos;
#pragma unroll
            for (int n = 0; n < NT_K; n++) {
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float v = s[n][e] * scale;
                    if (diag && k0 + 8 * n + 2 * tq + (e & 1) > (e < 2 ? pos_a : pos_b)) v = NEG_INF;
                    s[n][e] = v;
                }
            }
            // Online softmax: new row max over the quad, rescale O and l, P = exp(S − m).
            float mx_a = m_a, mx_b = m_b;
#pragma unroll
            for (int n = 0; n < NT_K; n++) {
                mx_a = fmaxf(mx_a, fmaxf(s[n][0], s[n][1]));
                mx_b = fmaxf(mx_b, fmaxf(s[n][2], s[n][3]));
            }
#pragma unroll
            for (int x = 1; x < 4; x <<= 1) {
                mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, x));
                mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, x));
            }
            const float corr_a = expf(m_a - mx_a), corr_b = expf(m_b - mx_b);
            m_a = mx_a;
            m_b = mx_b;
            l_a *= corr_a;
            l_b *= corr_b;
#pragma unroll
            for (int n = 0; n < NT_D; n++) {
                o[n][0] *= corr_a;
                o[n][1] *= corr_a;
                o[n][2] *= corr_b;
                o[n][3] *= corr_b;
            }
#pragma unroll
            for (int n = 0; n < NT_K; n++) {
                s[n][0] = expf(s[n][0] - m_a);
                s[n][1] = expf(s[n][1] - m_a);
                s[n][2] = expf(s[n][2] - m_b);
                s[n][3] = expf(s[n][3] - m_b);
                l_a += s[n][0] + s[n][1];
                l_b += s[n][2] + s[n][3];
            }
        }
        __syncthreads();  // every warp is done with K(tile)
        if (tile + 1 < n_tiles) {
            stage_tile(k_s, k_head, k0 + BC);  // overlaps P·V below
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // V(tile) visible
        if (live) {
            // O += P·V: the S accumulators of n-tiles 2kk, 2kk+1 are the A fragment of k-step kk
            // (rows g / g+8, keys 2·tq.. of each half), P rounded to bf16.
#pragma unroll
            for (int kk = 0; kk < KS_K; kk++) {
                u32 a[4];
                a[0] = pack_bf16x2(s[2 * kk][0], s[2 * kk][1]);
                a[1] = pack_bf16x2(s[2 * kk][2], s[2 * kk][3]);
                a[2] = pack_bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                a[3] = pack_bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
                for (int p = 0; p < NT_D / 2; p++) {
                    u32 b[4];
                    ldsm_x4_trans(v_frag + (kk * 16 * LD + p * 16) * 2, b);
                    mma_bf16(o[2 * p], a, b[0], b[1]);
                    mma_bf16(o[2 * p + 1], a, b[2], b[3]);
                }
            }
        }
    }

    // Full row sums, then attn_decode's epilogue. Element e of n-tile n: row g (e < 2) or g+8,
    // dim 8n + 2·tq + (e & 1).
    quad_sums(l_a, l_b);
    const int t_a = q0 + row0 + g, t_b = t_a + 8;
#pragma unroll
    for (int n = 0; n < NT_D; n++) {
        int c = 8 * n + 2 * tq;
        if (t_a < n_tok) attn_store2(qg, out, t_a, h, n_q, D, c, o[n][0], o[n][1], l_a);
        if (t_b < n_tok) attn_store2(qg, out, t_b, h, n_q, D, c, o[n][2], o[n][3], l_b);
    }
}

extern "C" __global__ void __launch_bounds__(PF_THREADS)
attn_prefill(const float* __restrict__ q, const float* __restrict__ qg, const kv_t* __restrict__ k_cache,
             const kv_t* __restrict__ v_cache, float* __restrict__ out, const int* __restrict__ pos_ptr,
             int n_tok, int n_q, int n_kv, int d, float scale) {
    extern __shared__ __align__(16) u16 pf_smem[];
    const int pos = *pos_ptr;
    switch (d) {  // the launcher refuses other head dims
        case 64:
            attn_prefill_tiles<64, PF_KEYS_SMALL>(q, qg, k_cache, v_cache, out, pos, n_tok, n_q, n_kv, scale, pf_smem);
            break;
        case 128:
            attn_prefill_tiles<128, PF_KEYS_SMALL>(q, qg, k_cache, v_cache, out, pos, n_tok, n_q, n_kv, scale, pf_smem);
            break;
        case 256:
            attn_prefill_tiles<256, PF_KEYS_256>(q, qg, k_cache, v_cache, out, pos, n_tok, n_q, n_kv, scale, pf_smem);
            break;
        default:
            break;
    }
}

// ---- attn_prefill_wg: flash attention on Hopper's warpgroup MMA (sm_90a, bf16 mode, head dim 256) ----
// The same inputs, causal mask and output as attn_prefill, for the plan's `wgmma_attention`. One
// block of two warpgroups (256 threads) per WGA_Q (64) consecutive queries and two query heads of
// one kv head (grid ceil(T/64) x Hq/2, the last query block first); warpgroup w owns head 2y + w,
// warp 4w + i of it queries 16i..16i+15. Both warpgroups read the same K and V tiles, so a tile
// costs the L2 half what one head a block would, and their causal ranges are equal.
// Shared memory (dynamic, aligned to 1024 bytes; WGA_SMEM in the launcher): Q of both heads, 2 x
// 32 KB, then a ring of two stages of K and V tiles of WGA_KEYS (64) keys, 32 KB each. Every
// operand is stored as 64-dim column blocks of rows of 128 bytes with the 128-byte swizzle
// (16-byte chunk c of row r at chunk c ^ (r % 8)); a block is 64 rows (Q, keys) x 128 bytes, so Q
// and K are K-major operands (rows: queries / keys, contiguous: dims) and V, laid out exactly as
// K, is the MN-major operand of P·V (contiguous: the 256 output dims, 8 keys an atom).
// Per key tile (all of it double-buffered: tile j + 1's cp.async copies fly while j computes):
//   S = Q·Kᵀ: 16 wgmma.m64n64k16 (A and B from shared memory), fp32;
//   causal mask on the tiles that cross a warp's diagonal, online softmax per row in registers
//   (the 4 lanes of a quad hold a row's 64 scores; the scale folded into exp2's argument), O
//   rescaled only when some row of the warp has a new maximum;
//   O += P·V: P rounded to bf16 (as attn_prefill does) straight from the S accumulators into A
//   fragments, 4 wgmma.m64n256k16 with V through an MN-major descriptor.
// Keys past the block's last query position are zero rows (never read from the cache). The
// epilogue is attn_prefill's. Registers: O 128 + S 32 floats a thread, one block per SM.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && defined(LILY_BF16_ACT)
// S (64 × 64 f32) = Q (64 × 16 bf16) · Kᵀ (16 × 64), both K-major in shared memory through their
// descriptors; `acc` 0 overwrites S (the first k-step), else adds to it.
__device__ __forceinline__ void wgmma_qk(float (&d)[32], unsigned long long qd, unsigned long long kd, int acc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(qd), "l"(kd), "r"(acc));
}

// wgmma_qk's first k-step (S overwritten) with S an output alone: attn_prefill_wg_pipe writes the
// softmax weights over S while a P·V is in flight, and ptxas holds back any write to a register
// that a later wgmma reads until every wgmma in flight is done.
__device__ __forceinline__ void wgmma_qk_first(float (&d)[32], unsigned long long qd, unsigned long long kd) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "%32, %33, p, 1, 1, 0, 0;\n}\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7]), "=f"(d[8]), "=f"(d[9]), "=f"(d[10]), "=f"(d[11]), "=f"(d[12]), "=f"(d[13]), "=f"(d[14]), "=f"(d[15]), "=f"(d[16]), "=f"(d[17]), "=f"(d[18]), "=f"(d[19]), "=f"(d[20]), "=f"(d[21]), "=f"(d[22]), "=f"(d[23]), "=f"(d[24]), "=f"(d[25]), "=f"(d[26]), "=f"(d[27]), "=f"(d[28]), "=f"(d[29]), "=f"(d[30]), "=f"(d[31])
        : "l"(qd), "l"(kd), "r"(0));
}

// O (64 × 256 f32) += P (64 × 16 bf16, registers) · V (16 keys × 256 dims, MN-major in shared
// memory through `vd`, read with the transpose bit).
__device__ __forceinline__ void wgmma_pv(float (&d)[128], const u32 (&a)[4], unsigned long long vd) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
        "{%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(vd), "r"(1));
}
#endif

extern "C" __global__ void __launch_bounds__(256, 1)
attn_prefill_wg(const float* __restrict__ q, const float* __restrict__ qg, const kv_t* __restrict__ k_cache,
                const kv_t* __restrict__ v_cache, float* __restrict__ out, const int* __restrict__ pos_ptr,
                int n_tok, int n_q, int n_kv, int d, float scale) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && defined(LILY_BF16_ACT)
    constexpr int D = 256, BLK = WGA_Q * 128, TILE = WGA_KEYS * 128 * (D / 64);  // bytes
    static_assert(WGA_Q == 64 && WGA_KEYS == 64, "one m64 warpgroup tile of queries, S of 64 keys");
    extern __shared__ __align__(16) char wga_raw[];
    char* q_s = wga_raw + ((1024 - (smem_addr(wga_raw) & 1023)) & 1023);  // [2 heads][4 blocks][64][128 B]
    char* ring = q_s + 2 * (D / 64) * BLK;                                 // [2 stages][K, V][4 blocks][64][128 B]
    const int pos = *pos_ptr;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int wg = warp >> 2, row0 = (warp & 3) * 16;  // the warpgroup (head of the pair), the warp's rows
    const int h0 = blockIdx.y * 2, h = h0 + wg;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * WGA_Q;
    const int kvh = h0 / (n_q / n_kv);
    const int kmax = pos + min(q0 + WGA_Q, n_tok) - 1;
    const int n_tiles = kmax / WGA_KEYS + 1;
    const long long kv_stride = (long long)n_kv * D;
    const kv_t* k_head = k_cache + (long long)kvh * D;
    const kv_t* v_head = v_cache + (long long)kvh * D;
    (void)d;

    // Q of both heads as bf16 (exact in bf16 mode), zero rows past the chunk.
#pragma unroll 4
    for (int it = 0; it < 2 * WGA_Q * (D / 8) / 256; it++) {
        int i = tid + it * 256;
        int hw = i >> 11, r = (i >> 5) & 63, c = i & 31;
        uint4 w = make_uint4(0u, 0u, 0u, 0u);
        if (q0 + r < n_tok) {
            const float* src = q + ((long long)(q0 + r) * n_q + h0 + hw) * D + 8 * c;
            float4 a = *reinterpret_cast<const float4*>(src);
            float4 b = *reinterpret_cast<const float4*>(src + 4);
            w = make_uint4(pack_bf16x2(a.x, a.y), pack_bf16x2(a.z, a.w), pack_bf16x2(b.x, b.y), pack_bf16x2(b.z, b.w));
        }
        *reinterpret_cast<uint4*>(q_s + hw * (D / 64) * BLK + (c >> 3) * BLK + r * 128 + (((c & 7) ^ (r & 7)) << 4)) = w;
    }
    // Keys of tile `tile` into ring stage `st`: K at 0, V at TILE.
    auto stage = [&](int tile, int st) {
        char* ks = ring + st * 2 * TILE;
        int k0 = tile * WGA_KEYS;
#pragma unroll
        for (int it = 0; it < WGA_KEYS * (D / 8) / 256; it++) {
            int i = tid + it * 256;
            int r = i >> 5, c = i & 31;
            int off = (c >> 3) * (WGA_KEYS * 128) + r * 128 + (((c & 7) ^ (r & 7)) << 4);
            if (k0 + r <= kmax) {
                long long e = (long long)(k0 + r) * kv_stride + 8 * c;
                cp_async16(ks + off, k_head + e);
                cp_async16(ks + TILE + off, v_head + e);
            } else {
                *reinterpret_cast<uint4*>(ks + off) = make_uint4(0u, 0u, 0u, 0u);
                *reinterpret_cast<uint4*>(ks + TILE + off) = make_uint4(0u, 0u, 0u, 0u);
            }
        }
    };
    stage(0, 0);
    cp_async_commit();

    float o[128];
#pragma unroll
    for (int i = 0; i < 128; i++) o[i] = 0.0f;
    float m_a = NEG_INF, m_b = NEG_INF;  // running max of the (unscaled) scores of rows g, g + 8
    float l_a = 0.0f, l_b = 0.0f;        // this lane's part of their running sums
    const float sl2 = scale * 1.4426950408889634f;
    const int pos_a = pos + q0 + row0 + g, pos_b = pos_a + 8;
    const int warp_first = pos + q0 + row0;  // the warp's first query position
    const u32 q_addr = smem_addr(q_s + wg * (D / 64) * BLK);
    for (int tile = 0; tile < n_tiles; tile++) {
        cp_async_wait<0>();  // this thread's copies of tile `tile`
        fence_proxy_async();
        __syncthreads();  // tile `tile` in place; every warpgroup is done with tile − 1's stage
        if (tile + 1 < n_tiles) stage(tile + 1, (tile + 1) & 1);
        cp_async_commit();
        const u32 k_addr = smem_addr(ring + (tile & 1) * 2 * TILE), v_addr = k_addr + TILE;
        float s[32];
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < D / 16; ks++) {
            u32 off = (ks >> 2) * BLK + (ks & 3) * 32;
            wgmma_qk(s, wg_desc(q_addr + off), wg_desc(k_addr + off), ks);
        }
        wgmma_commit();
        wgmma_wait0();
#pragma unroll
        for (int i = 0; i < 32; i++) asm volatile("" : "+f"(s[i])::"memory");
        // Element e of n-tile j: row g (e < 2) or g + 8, key k0 + 8j + 2t + (e & 1). Scores stay
        // unscaled until the exponent (scale > 0 keeps the order): p = 2^(s·sl2 − m·sl2).
        const int k0 = tile * WGA_KEYS;
        if (k0 + WGA_KEYS - 1 > warp_first) {  // the tile crosses the warp's diagonal
#pragma unroll
            for (int j = 0; j < 8; j++) {
#pragma unroll
                for (int e = 0; e < 4; e++)
                    if (k0 + 8 * j + 2 * t + (e & 1) > (e < 2 ? pos_a : pos_b)) s[4 * j + e] = NEG_INF;
            }
        }
        float mx_a = m_a, mx_b = m_b;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            mx_a = fmaxf(mx_a, fmaxf(s[4 * j], s[4 * j + 1]));
            mx_b = fmaxf(mx_b, fmaxf(s[4 * j + 2], s[4 * j + 3]));
        }
#pragma unroll
        for (int x = 1; x < 4; x <<= 1) {
            mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, x));
            mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, x));
        }
        // O and l are rescaled only where a row's maximum moved (most tiles past the first few
        // leave every row's maximum where it was: the 128 multiplies a thread are skipped).
        if (__any_sync(0xffffffffu, mx_a != m_a || mx_b != m_b)) {
            const float corr_a = exp2f((m_a - mx_a) * sl2), corr_b = exp2f((m_b - mx_b) * sl2);
            l_a *= corr_a;
            l_b *= corr_b;
#pragma unroll
            for (int j = 0; j < 32; j++) {
                o[4 * j] *= corr_a;
                o[4 * j + 1] *= corr_a;
                o[4 * j + 2] *= corr_b;
                o[4 * j + 3] *= corr_b;
            }
        }
        m_a = mx_a;
        m_b = mx_b;
        const float ms_a = m_a * sl2, ms_b = m_b * sl2;
        u32 p[4][4];  // k-step kk: keys 16kk .. 16kk + 15 (n-tiles 2kk, 2kk + 1)
#pragma unroll
        for (int j = 0; j < 8; j++) {
            float p0 = exp2f(fmaf(s[4 * j], sl2, -ms_a)), p1 = exp2f(fmaf(s[4 * j + 1], sl2, -ms_a));
            float p2 = exp2f(fmaf(s[4 * j + 2], sl2, -ms_b)), p3 = exp2f(fmaf(s[4 * j + 3], sl2, -ms_b));
            l_a += p0 + p1;
            l_b += p2 + p3;
            p[j >> 1][2 * (j & 1)] = pack_bf16x2(p0, p1);
            p[j >> 1][2 * (j & 1) + 1] = pack_bf16x2(p2, p3);
        }
        wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < WGA_KEYS / 16; kk++) wgmma_pv(o, p[kk], wg_desc_mn(v_addr + kk * 2048, WGA_KEYS * 128));
        wgmma_commit();
        wgmma_wait0();
#pragma unroll
        for (int i = 0; i < 128; i++) asm volatile("" : "+f"(o[i])::"memory");
    }

    quad_sums(l_a, l_b);
    const int t_a = q0 + row0 + g, t_b = t_a + 8;
#pragma unroll
    for (int j = 0; j < 32; j++) {
        int c = 8 * j + 2 * t;
        if (t_a < n_tok) attn_store2(qg, out, t_a, h, n_q, D, c, o[4 * j], o[4 * j + 1], l_a);
        if (t_b < n_tok) attn_store2(qg, out, t_b, h, n_q, D, c, o[4 * j + 2], o[4 * j + 3], l_b);
    }
#else
    __trap();
#endif
}

// ---- attn_prefill_wg_pipe: attn_prefill_wg with a tile's softmax under the previous tile's P·V ----
// The plan's `wgmma_attention_pipelined` (FA3's intra-warpgroup pipelining, its §3.2): the same
// inputs, blocks, S per tile, online softmax and P·V order as attn_prefill_wg, so the same output
// bit for bit. At iteration j a warpgroup issues S_{j+1} = Q·K_{j+1}ᵀ, then O += P_j·V_j (two
// wgmma groups), waits for S_{j+1} alone, and runs its mask and softmax (P_{j+1}; the factors that
// rescale O) while P_j·V_j runs on the tensor cores; then it waits for P_j·V_j and rescales O.
// K_{j+1} and V_j are read in the same iteration, so K and V have rings of their own, two stages
// each (the same 128 KB as attn_prefill_wg's ring): at iteration j, once its wgmmas are issued,
// the copies of K_{j+2} (into K_j's stage: S_j is done) and V_{j+1} (into V_{j−1}'s: P_{j−1}·V_{j−1}
// is done) go out and land during the iteration. One __syncthreads an iteration, as before.
// Registers: O 128 + S 32 floats (the scores, then the weights) + P 16 words a thread (248 in all).
// When this kernel wins its A/B, attn_prefill_wg (its reference) leaves with its switch.
extern "C" __global__ void __launch_bounds__(256, 1)
attn_prefill_wg_pipe(const float* __restrict__ q, const float* __restrict__ qg, const kv_t* __restrict__ k_cache,
                     const kv_t* __restrict__ v_cache, float* __restrict__ out, const int* __restrict__ pos_ptr,
                     int n_tok, int n_q, int n_kv, int d, float scale) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && defined(LILY_BF16_ACT)
    constexpr int D = 256, BLK = WGA_Q * 128, TILE = WGA_KEYS * 128 * (D / 64);  // bytes
    static_assert(WGA_Q == 64 && WGA_KEYS == 64, "one m64 warpgroup tile of queries, S of 64 keys");
    extern __shared__ __align__(16) char wga_raw[];
    char* q_s = wga_raw + ((1024 - (smem_addr(wga_raw) & 1023)) & 1023);  // [2 heads][4 blocks][64][128 B]
    char* k_ring = q_s + 2 * (D / 64) * BLK;                               // [2 stages][4 blocks][64][128 B]
    char* v_ring = k_ring + 2 * TILE;                                      // the same for V
    const int pos = *pos_ptr;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int wg = warp >> 2, row0 = (warp & 3) * 16;  // the warpgroup (head of the pair), the warp's rows
    const int h0 = blockIdx.y * 2, h = h0 + wg;
    const int q0 = (gridDim.x - 1 - blockIdx.x) * WGA_Q;
    const int kvh = h0 / (n_q / n_kv);
    const int kmax = pos + min(q0 + WGA_Q, n_tok) - 1;
    const int n_tiles = kmax / WGA_KEYS + 1;
    const u32 kv_stride = (u32)n_kv * D;
    const kv_t* k_head = k_cache + (long long)kvh * D;
    const kv_t* v_head = v_cache + (long long)kvh * D;
    (void)d;

    // Q of both heads as bf16 (exact in bf16 mode), zero rows past the chunk.
#pragma unroll 4
    for (int it = 0; it < 2 * WGA_Q * (D / 8) / 256; it++) {
        int i = tid + it * 256;
        int hw = i >> 11, r = (i >> 5) & 63, c = i & 31;
        uint4 w = make_uint4(0u, 0u, 0u, 0u);
        if (q0 + r < n_tok) {
            const float* src = q + ((long long)(q0 + r) * n_q + h0 + hw) * D + 8 * c;
            float4 a = *reinterpret_cast<const float4*>(src);
            float4 b = *reinterpret_cast<const float4*>(src + 4);
            w = make_uint4(pack_bf16x2(a.x, a.y), pack_bf16x2(a.z, a.w), pack_bf16x2(b.x, b.y), pack_bf16x2(b.z, b.w));
        }
        *reinterpret_cast<uint4*>(q_s + hw * (D / 64) * BLK + (c >> 3) * BLK + r * 128 + (((c & 7) ^ (r & 7)) << 4)) = w;
    }
    // The K or V rows of tile `tile` (from `head`) into the stage at `dst`; zero rows past kmax.
    // This thread copies chunk c (16 bytes) of rows r + 8i of a tile: one shared offset and one
    // element offset a thread (32 bits: a layer's cache holds < 2^32 elements, 8M tokens of two
    // kv heads), not hoisted addresses for each copy (they held registers the softmax needs to
    // run under the P·V).
    const int st_r = tid >> 5, st_c = tid & 31;
    const u32 st_dst = (st_c >> 3) * (WGA_KEYS * 128) + st_r * 128 + (((st_c & 7) ^ st_r) << 4);
    const u32 st_src = (u32)(st_r * kv_stride + 8 * st_c);
    auto stage = [&](const kv_t* head, char* dst, int tile) {
        const int rows = kmax - tile * WGA_KEYS - st_r;  // this thread's rows r + 8i ≤ kmax: 8i ≤ rows
        const kv_t* src = head + (u32)(tile * WGA_KEYS * kv_stride) + st_src;
        char* d = dst + st_dst;
#pragma unroll
        for (int it = 0; it < WGA_KEYS * (D / 8) / 256; it++) {
            if (8 * it <= rows)
                cp_async16(d + it * 1024, src + it * 8 * kv_stride);
            else
                *reinterpret_cast<uint4*>(d + it * 1024) = make_uint4(0u, 0u, 0u, 0u);
        }
    };
    stage(k_head, k_ring, 0);  // group: K_0
    cp_async_commit();
    if (n_tiles > 1) stage(k_head, k_ring + TILE, 1);  // group: K_1, V_0
    stage(v_head, v_ring, 0);
    cp_async_commit();

    float o[128];
#pragma unroll
    for (int i = 0; i < 128; i++) o[i] = 0.0f;
    float m_a = NEG_INF, m_b = NEG_INF;  // running max of the (unscaled) scores of rows g, g + 8
    float l_a = 0.0f, l_b = 0.0f;        // this lane's part of their running sums
    const float sl2 = scale * 1.4426950408889634f;
    const int pos_a = pos + q0 + row0 + g, pos_b = pos_a + 8;
    const int warp_first = pos + q0 + row0;  // the warp's first query position
    const u32 q_addr = smem_addr(q_s + wg * (D / 64) * BLK);
    float s[32];  // S, then the softmax weights
    // S of tile `tile` from the K stage at shared address `k_addr` (issued, not committed).
    auto issue_qk = [&](u32 k_addr) {
#pragma unroll
        for (int ks = 0; ks < D / 16; ks++) {
            u32 off = (ks >> 2) * BLK + (ks & 3) * 32;
            if (ks == 0)
                wgmma_qk_first(s, wg_desc(q_addr + off), wg_desc(k_addr + off));
            else
                wgmma_qk(s, wg_desc(q_addr + off), wg_desc(k_addr + off), ks);
        }
    };
    // attn_prefill_wg's mask and online softmax of S (tile `tile`), its weights (fp32) in place
    // of the scores, l and m. O's rescale by (corr_a, corr_b) where `resc`, and P's rounding to
    // bf16, are left to the caller, after the P·V that reads O and P: P's registers must not be
    // written while a wgmma that reads them is in flight, else ptxas serialises every wgmma of
    // the kernel (C7513).
    bool resc;
    float corr_a = 1.0f, corr_b = 1.0f;
    auto softmax = [&](int tile) {
        // Element e of n-tile j: row g (e < 2) or g + 8, key k0 + 8j + 2t + (e & 1).
        const int k0 = tile * WGA_KEYS;
        if (k0 + WGA_KEYS - 1 > warp_first) {  // the tile crosses the warp's diagonal
#pragma unroll
            for (int j = 0; j < 8; j++) {
#pragma unroll
                for (int e = 0; e < 4; e++)
                    if (k0 + 8 * j + 2 * t + (e & 1) > (e < 2 ? pos_a : pos_b)) s[4 * j + e] = NEG_INF;
            }
        }
        float mx_a = m_a, mx_b = m_b;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            mx_a = fmaxf(mx_a, fmaxf(s[4 * j], s[4 * j + 1]));
            mx_b = fmaxf(mx_b, fmaxf(s[4 * j + 2], s[4 * j + 3]));
        }
#pragma unroll
        for (int x = 1; x < 4; x <<= 1) {
            mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, x));
            mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, x));
        }
        // The weights first, then the running sums' rescale (a branch) and sums: ptxas hoists
        // the wait for the P·V over any instruction of its basic block, so the exponents sit in
        // one before it. l's operations keep attn_prefill_wg's order.
        const float ms_a = mx_a * sl2, ms_b = mx_b * sl2;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            s[4 * j] = exp2f(fmaf(s[4 * j], sl2, -ms_a));
            s[4 * j + 1] = exp2f(fmaf(s[4 * j + 1], sl2, -ms_a));
            s[4 * j + 2] = exp2f(fmaf(s[4 * j + 2], sl2, -ms_b));
            s[4 * j + 3] = exp2f(fmaf(s[4 * j + 3], sl2, -ms_b));
        }
#pragma unroll
        for (int i = 0; i < 32; i++) asm volatile("" : "+f"(s[i])::"memory");
        resc = __any_sync(0xffffffffu, mx_a != m_a || mx_b != m_b);
        if (resc) {
            corr_a = exp2f((m_a - mx_a) * sl2);
            corr_b = exp2f((m_b - mx_b) * sl2);
            l_a *= corr_a;
            l_b *= corr_b;
        }
        m_a = mx_a;
        m_b = mx_b;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            l_a += s[4 * j] + s[4 * j + 1];
            l_b += s[4 * j + 2] + s[4 * j + 3];
        }
    };
    u32 p[4][4];  // P as bf16, k-step kk: keys 16kk .. 16kk + 15 (n-tiles 2kk, 2kk + 1)
    // O rescaled where some row's maximum moved, then P rounded to bf16 (no wgmma in flight).
    auto rescale_and_round = [&]() {
        if (resc) {
#pragma unroll
            for (int j = 0; j < 32; j++) {
                o[4 * j] *= corr_a;
                o[4 * j + 1] *= corr_a;
                o[4 * j + 2] *= corr_b;
                o[4 * j + 3] *= corr_b;
            }
        }
#pragma unroll
        for (int j = 0; j < 8; j++) {
            p[j >> 1][2 * (j & 1)] = pack_bf16x2(s[4 * j], s[4 * j + 1]);
            p[j >> 1][2 * (j & 1) + 1] = pack_bf16x2(s[4 * j + 2], s[4 * j + 3]);
        }
    };

    // S_0 and P_0 before the loop.
    cp_async_wait<1>();  // this thread's copies of K_0
    fence_proxy_async();
    __syncthreads();
    wgmma_fence();
    issue_qk(smem_addr(k_ring));
    wgmma_commit();
    wgmma_wait0();
    softmax(0);
    rescale_and_round();
    // O += P_tile·V_tile from the V stage of `tile` (issued, not committed).
    auto issue_pv = [&](int tile) {
        const u32 v_addr = smem_addr(v_ring + (tile & 1) * TILE);
#pragma unroll
        for (int kk = 0; kk < WGA_KEYS / 16; kk++) wgmma_pv(o, p[kk], wg_desc_mn(v_addr + kk * 2048, WGA_KEYS * 128));
    };
    // Every wgmma outside a branch (ptxas serialises the wgmmas of a kernel that has one in a
    // divergent path): the tiles with a successor here, the last one's P·V after the loop.
    int tile = 0;
    for (; tile + 1 < n_tiles; tile++) {
        cp_async_wait<0>();  // this thread's copies of K_{tile+1} and V_tile
        fence_proxy_async();
        __syncthreads();  // in place; every warpgroup is done with S_tile and P_{tile−1}·V_{tile−1}
        wgmma_fence();
        issue_qk(smem_addr(k_ring + ((tile + 1) & 1) * TILE));
        wgmma_commit();
        issue_pv(tile);
        wgmma_commit();
        if (tile + 2 < n_tiles) stage(k_head, k_ring + (tile & 1) * TILE, tile + 2);
        stage(v_head, v_ring + ((tile + 1) & 1) * TILE, tile + 1);
        cp_async_commit();
        wgmma_wait1();  // S_{tile+1}; P_tile·V_tile may still run
        softmax(tile + 1);
#pragma unroll
        for (int i = 0; i < 32; i++) asm volatile("" : "+f"(s[i])::"memory");  // the weights before the wait
        wgmma_wait0();
#pragma unroll
        for (int i = 0; i < 128; i++) asm volatile("" : "+f"(o[i])::"memory");
        rescale_and_round();
    }
    cp_async_wait<0>();  // V of the last tile
    fence_proxy_async();
    __syncthreads();
    wgmma_fence();
    issue_pv(tile);
    wgmma_commit();
    wgmma_wait0();
#pragma unroll
    for (int i = 0; i < 128; i++) asm volatile("" : "+f"(o[i])::"memory");

    quad_sums(l_a, l_b);
    const int t_a = q0 + row0 + g, t_b = t_a + 8;
#pragma unroll
    for (int j = 0; j < 32; j++) {
        int c = 8 * j + 2 * t;
        if (t_a < n_tok) attn_store2(qg, out, t_a, h, n_q, D, c, o[4 * j], o[4 * j + 1], l_a);
        if (t_b < n_tok) attn_store2(qg, out, t_b, h, n_q, D, c, o[4 * j + 2], o[4 * j + 3], l_b);
    }
#else
    __trap();
#endif
}
