// Gated DeltaNet (MODEL.md §2.5), between the in_proj_* projections and out_proj.
//
// dn_conv:       c_t = silu(causal depthwise conv_K(m)_t) over all conv_dim channels (q, k, v),
//                one thread per (channel, token): the window reads earlier rows of m, or of
//                conv_state [K-1, conv_dim] (the last K-1 pre-conv rows before this chunk) for the
//                first K-1 tokens.
// dn_conv_state: then conv_state ← the last K-1 pre-conv rows of [conv_state; m] (a second launch,
//                so no block overwrites rows another block still reads).
// dn_prep:       per token, everything the recurrence needs that does not depend on the state:
//                q = l2norm(q)/sqrt(dk), k = l2norm(k) per K head into qk [T, Hk, 2, dk], and
//                β = sigmoid(b) and the log-decay g = −exp(A_log) · softplus(a + dt_bias) ≤ 0
//                (α = e^g) per V head into ab [T, Hv, 2] as (g, β).
// dn_recurrent:  per V head hv (Q/K head hv / (Hv/Hk)), fp32 state S [dk, dv]:
//                S ← α S;  u = Sᵀk;  δ = β (v − u);  S ← S + k δᵀ;  o = Sᵀq.  Tokens in order.
// dn_wy_prep + dn_wy_scan: the same recurrence in chunks of DN_WY_C tokens on the tensor cores
//                (the plan's `tc_scan`; the design below dn_recurrent).
// dn_gated_norm: y = w ⊙ rmsnorm(o_h) ⊙ silu(z_h) per V head.
//
// Recurrent layout: state [Hv, dk, dv] fp32, row i of head hv at (hv·dk + i)·dv. Value columns
// are independent given q, k, β, α, so a warp owns 4 columns of one head, DN_PARTS = 8 adjacent
// lanes per column, each lane dk/8 state rows (i ≡ lane mod 8) in registers for the whole chunk
// (the state is read and written once per launch). A token costs each lane two short FMA chains,
// two 3-step shuffle reductions and shared-memory reads (conflict-free: the 8 lanes of a column
// read 8 consecutive words, the 4 columns of a warp the same ones); q, k, v, α, β come in tiles
// of DN_TT tokens by cp.async, two barriers per tile. Limits (kernels/deltanet.rs checks them at load):
// dk % 32 == 0, dk ≤ 128, dv % 16 == 0, K ≤ 8.

#ifndef DN_MAX_K
#error "DN_MAX_K comes from the launcher module (crates/lily-cuda/src/kernels/deltanet.rs)"
#endif
#ifndef DN_MAX_DK
#error "DN_MAX_DK comes from the launcher module (crates/lily-cuda/src/kernels/deltanet.rs)"
#endif
#define DN_PARTS 8                           // lanes sharing one value column
#define DN_ROWS (DN_MAX_DK / DN_PARTS)       // state rows per lane at most (16)
// DN_COLS_PER_BLOCK: 4 warps × 4 columns
#ifndef DN_COLS_PER_BLOCK
#error "DN_COLS_PER_BLOCK comes from the launcher module (crates/lily-cuda/src/kernels/deltanet.rs)"
#endif
#define DN_TT 16                             // tokens per shared-memory tile

// Row `idx` (may be negative: a conv_state row) of the pre-conv sequence [conv_state; m].
__device__ __forceinline__ float conv_row(const float* __restrict__ m, int m_stride, const float* conv_state,
                                          int conv_dim, int k, int idx, int ch) {
    return idx >= 0 ? m[(long long)idx * m_stride + ch] : conv_state[(long long)(idx + k - 1) * conv_dim + ch];
}

extern "C" __global__ void dn_conv(const float* __restrict__ m, int m_stride, const float* __restrict__ conv_state,
                                   const float* __restrict__ w, float* __restrict__ c, int n_tok, int conv_dim,
                                   int k) {
    int ch = blockIdx.x * blockDim.x + threadIdx.x;
    int t = blockIdx.y;
    if (ch >= conv_dim || t >= n_tok) return;
    float acc = 0.0f;
    for (int j = 0; j < k - 1; j++)
        acc += w[(long long)ch * k + j] * conv_row(m, m_stride, conv_state, conv_dim, k, t - (k - 1) + j, ch);
    acc += w[(long long)ch * k + k - 1] * m[(long long)t * m_stride + ch];
    c[(long long)t * conv_dim + ch] = act(siluf(act(acc)));
}

extern "C" __global__ void dn_conv_state(const float* __restrict__ m, int m_stride, float* __restrict__ conv_state,
                                         int n_tok, int conv_dim, int k) {
    int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= conv_dim) return;
    float rows[DN_MAX_K];
#pragma unroll
    for (int j = 0; j < DN_MAX_K - 1; j++)
        if (j < k - 1) rows[j] = conv_row(m, m_stride, conv_state, conv_dim, k, n_tok - (k - 1) + j, ch);
#pragma unroll
    for (int j = 0; j < DN_MAX_K - 1; j++)
        if (j < k - 1) conv_state[(long long)j * conv_dim + ch] = rows[j];
}

// grid (n_tok, n_k_heads), block 128 (threads stride over dk); c rows are conv_dim wide: q at
// [0, key_dim), k at [key_dim, 2·key_dim), v after.
extern "C" __global__ void dn_prep(const float* __restrict__ c, int conv_dim, const float* __restrict__ b,
                                   const float* __restrict__ a, int ba_stride, const float* __restrict__ a_log,
                                   const float* __restrict__ dt_bias, float* __restrict__ qk, float* __restrict__ ab,
                                   int n_tok, int n_k_heads, int n_v_heads, int dk, float eps) {
    int t = blockIdx.x, hk = blockIdx.y;
    if (t >= n_tok) return;
    int key_dim = n_k_heads * dk;
    const float* qt = c + (long long)t * conv_dim + hk * dk;
    const float* kt = qt + key_dim;
    float qq = 0.0f, kk = 0.0f;
    for (int i = threadIdx.x; i < dk; i += blockDim.x) {
        qq += qt[i] * qt[i];
        kk += kt[i] * kt[i];
    }
    qq = block_sum(qq);
    kk = block_sum(kk);
    float qn = rsqrtf(qq + eps) * rsqrtf((float)dk), kn = rsqrtf(kk + eps);
    float* out = qk + ((long long)t * n_k_heads + hk) * 2 * dk;
    for (int i = threadIdx.x; i < dk; i += blockDim.x) {
        out[i] = qt[i] * qn;
        out[dk + i] = kt[i] * kn;
    }
    if (hk == 0) {
        for (int hv = threadIdx.x; hv < n_v_heads; hv += blockDim.x) {
            float beta = act(sigmoidf(b[(long long)t * ba_stride + hv]));
            float g = -expf(a_log[hv]) * softplusf(a[(long long)t * ba_stride + hv] + dt_bias[hv]);
            ab[((long long)t * n_v_heads + hv) * 2] = g;
            ab[((long long)t * n_v_heads + hv) * 2 + 1] = beta;
        }
    }
}

// Stages tokens t0 .. t0+nt of what dn_recurrent's block reads into shared memory: q and k of
// its K head (cp.async), v of its 16 columns (cp.async), α = e^g and β (plain loads: the
// exponential once a token here, off the recurrence's per-token chain).
__device__ __forceinline__ void dn_stage(float (*qk_s)[2 * DN_MAX_DK], float (*v_s)[DN_COLS_PER_BLOCK],
                                         float (*ab_s)[2], const float* __restrict__ qk,
                                         const float* __restrict__ ab, const float* __restrict__ c, int t0, int nt,
                                         int conv_dim, int v_col0, int n_k_heads, int hk, int n_v_heads, int hv,
                                         int dk) {
    int per = 2 * dk / 4;  // float4 per token of q and k
    for (int idx = threadIdx.x; idx < nt * per; idx += blockDim.x) {
        int tt = idx / per, f = idx % per;
        cp_async16(&qk_s[tt][4 * f], qk + ((long long)(t0 + tt) * n_k_heads + hk) * 2 * dk + 4 * f);
    }
    for (int idx = threadIdx.x; idx < nt * (DN_COLS_PER_BLOCK / 4); idx += blockDim.x) {
        int tt = idx / (DN_COLS_PER_BLOCK / 4), f = idx % (DN_COLS_PER_BLOCK / 4);
        cp_async16(&v_s[tt][4 * f], c + (long long)(t0 + tt) * conv_dim + v_col0 + 4 * f);
    }
    cp_async_commit();
    for (int tt = threadIdx.x; tt < nt; tt += blockDim.x) {
        ab_s[tt][0] = expf(ab[((long long)(t0 + tt) * n_v_heads + hv) * 2]);
        ab_s[tt][1] = ab[((long long)(t0 + tt) * n_v_heads + hv) * 2 + 1];
    }
}

// grid (n_v_heads, dv / DN_COLS_PER_BLOCK), block 128: warp w owns columns 4w .. 4w+3 of the
// block's 16, lane L column 4w + L/8 and state rows i = L%8 + 8r. Tokens go through shared
// memory DN_TT at a time, double-buffered: the next tile's copies fly while this one computes.
extern "C" __global__ void __launch_bounds__(128)
dn_recurrent(const float* __restrict__ c, const float* __restrict__ qk, const float* __restrict__ ab,
             float* __restrict__ state, float* __restrict__ o, int n_tok, int n_k_heads, int n_v_heads, int dk,
             int dv) {
    __shared__ __align__(16) float qk_s[2][DN_TT][2 * DN_MAX_DK];
    __shared__ __align__(16) float v_s[2][DN_TT][DN_COLS_PER_BLOCK];
    __shared__ float ab_s[2][DN_TT][2];
    int hv = blockIdx.x;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int part = lane % DN_PARTS;
    int col = warp * (32 / DN_PARTS) + lane / DN_PARTS;
    int j0 = blockIdx.y * DN_COLS_PER_BLOCK, j = j0 + col;
    int hk = hv / (n_v_heads / n_k_heads);
    int key_dim = n_k_heads * dk;
    int conv_dim = 2 * key_dim + n_v_heads * dv;
    int v_col0 = 2 * key_dim + hv * dv + j0;
    int rows = dk / DN_PARTS;
    float* sp = state + (long long)hv * dk * dv;
    float s[DN_ROWS];
#pragma unroll
    for (int r = 0; r < DN_ROWS; r++) s[r] = r < rows ? sp[(long long)(part + DN_PARTS * r) * dv + j] : 0.0f;

    int n_tiles = (n_tok + DN_TT - 1) / DN_TT;
    if (n_tiles > 0)
        dn_stage(qk_s[0], v_s[0], ab_s[0], qk, ab, c, 0, min(DN_TT, n_tok), conv_dim, v_col0, n_k_heads, hk,
                 n_v_heads, hv, dk);
    for (int tile = 0; tile < n_tiles; tile++) {
        int buf = tile & 1;
        int t0 = tile * DN_TT, nt = min(DN_TT, n_tok - t0);
        if (tile + 1 < n_tiles) {
            dn_stage(qk_s[buf ^ 1], v_s[buf ^ 1], ab_s[buf ^ 1], qk, ab, c, t0 + DN_TT, min(DN_TT, n_tok - t0 - DN_TT),
                     conv_dim, v_col0, n_k_heads, hk, n_v_heads, hv, dk);
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        for (int tt = 0; tt < nt; tt++) {
            const float* qs = qk_s[buf][tt];
            const float* ks = qs + dk;
            float alpha = ab_s[buf][tt][0], beta = ab_s[buf][tt][1], v = v_s[buf][tt][col];
            float out = dn_column_step<DN_ROWS, DN_PARTS>(s, qs, ks, part, rows, alpha, beta, v);
            if (part == 0) o[(long long)(t0 + tt) * n_v_heads * dv + (long long)hv * dv + j] = act(out);
        }
        __syncthreads();  // this buffer is restaged two tiles on
    }
#pragma unroll
    for (int r = 0; r < DN_ROWS; r++)
        if (r < rows) sp[(long long)(part + DN_PARTS * r) * dv + j] = s[r];
}

// ---- dn_wy_prep + dn_wy_scan: the chunked gated delta rule on the tensor cores (issue 31) ------
//
// The math is lily_core::cpu::chunked (its module comment derives it; MODEL.md §2.5). Per value
// head and chunk of C = DN_WY_C tokens, with G_t = g_1 + … + g_t the cumulative log-decay inside
// the chunk and D(t, s) = e^{G_t − G_s} ≤ 1 for s ≤ t (only such differences are ever
// exponentiated, so nothing overflows however strong the decay):
//   A = strict_lower(diag(β) (K Kᵀ ∘ D)),  T = (I + A)⁻¹,
//   W = T diag(β e^G) K  [C, dk],  U = T diag(β) V  [C, dv],  P = (Q Kᵀ) ∘ D, lower  [C, C],
// then, in chunk order from the carried state S [dk, dv]:
//   Δ = U − W S,  O = diag(e^G) Q S + P Δ,  S ← e^{G_C} S + (diag(e^{G_C − G}) K)ᵀ Δ.
// Padded tokens of a last, short chunk get q = k = v = 0, β = 0, g = 0: their rows of A, W, U, P,
// Δ are zero and G_C is the last real token's, so the padding changes nothing.
//
// dn_wy_prep: everything that does not depend on the state, for every chunk at once. Grid
// (chunks, Hv), DN_WY_PREP_THREADS threads, DN_WY_PREP_SMEM bytes of dynamic shared memory (two
// blocks an SM on sm_90). Stages K and Q of the chunk ([C][dk] fp32, rows padded to DN_WY_LD
// floats: conflict-free fragment reads), the gates (g, β) and G (a warp's prefix sum); A = K Kᵀ
// and Q Kᵀ on mma.sync m16n8k8 tf32 (8 warps: 16 rows × 32 columns each), masked and scaled in
// registers; then V over Q's space (cp.async, in flight during the solve and W); T in fp32 on the
// CUDA cores in 16×16 blocks: the diagonal blocks by forward substitution (a lane a column), then
// block row i from the rows above it, T_ij = −T_ii Σ_{k=j..i−1} A_ik T_kj (a warp a block, fp32
// FMAs); W and U as tf32 products of T (its columns scaled by β e^G or β) with K and V. Writes a
// record per (chunk, value head): W [C][dk], U [C][dv], P [C][C], G [C] (fp32, dn_wy_rec_floats:
// 82 KB at dk = dv = 128; 168 MB for a 4,096-token chunk of Qwen3.6's 32 heads).
// Work per (chunk, head) at dk = dv = 128: 1.7 M tensor-core multiply-adds, ≈ 10 K fp32 FMAs of
// the solve; reads 96 KB (q, k, v), writes 82 KB.
//
// dn_wy_scan: the chunks in order. Grid (Hv, dv / DN_WY_COLS) = 128 blocks for Qwen3.6,
// DN_WY_SCAN_THREADS threads (8 warps), DN_WY_SCAN_SMEM bytes. The block's state slice [dk, 32]
// stays in registers as mma accumulators for the whole launch (warp w rows 16w..16w+15, fp32),
// copied to shared memory once a chunk as the B operand of W S and Q S. Per chunk: W, Q, K, P, G
// in shared memory (cp.async; W is restaged for the next chunk while O is computed, Q and P while
// S is updated, K and G after), U straight into registers; Δ = U − W S and O = e^G Q S + P Δ (warp
// (w % 4, w / 4): 16 rows × 16 columns), S ← e^{G_C} S + (K ∘ decay)ᵀ Δ, each on mma.sync tf32.
// Work per chunk and block: 3.5 M multiply-adds (W S, Q S, Kᵀ Δ: 64 × 128 × 32 each; P Δ), ≈ 145 KB
// of records and q/k read from L2; the sequential chain is T / C chunks instead of T tokens.
//
// Rounding: operands of every product are rounded to tf32 (10-bit mantissa, relative 2⁻¹¹) as they
// are read into fragments; every sum is fp32 (the tensor cores' accumulators). S, T, G and the
// decays stay fp32 throughout; S is rounded only as an operand of W S and Q S, never where it is
// kept. Limits (kernels/deltanet.rs checks them): dk, dv multiples of 32 up to DN_MAX_DK.

#define DN_WY_LD (DN_MAX_DK + 4)    // row stride of [C][dk] tiles (floats)
#define DN_WY_LDC (DN_WY_C + 4)     // row stride of [C][C] tiles
#define DN_WY_LDV (DN_WY_COLS + 8)  // row stride of the scan's [·][32] B-operand tiles
#if DN_WY_C != 64 || DN_WY_COLS != 32
#error "dn_wy_prep / dn_wy_scan assign warps to 64-token chunks and 32-column slices"
#endif

// f32 of one (chunk, value head) record: W [C][dk], U [C][dv], P [C][C], G [C].
__device__ __forceinline__ long long dn_wy_rec_floats(int dk, int dv) {
    return (long long)DN_WY_C * (dk + dv + DN_WY_C + 1);
}

// Copies rows 0..nrows-1 of `width` floats (global, `stride` apart) into dst's rows (ld floats
// apart) by cp.async and zeroes rows nrows..C-1. The caller commits.
__device__ __forceinline__ void dn_wy_stage_rows(float* dst, int ld, const float* __restrict__ src,
                                                 long long stride, int nrows, int width) {
    int per = width / 4;
    for (int idx = threadIdx.x; idx < DN_WY_C * per; idx += blockDim.x) {
        int r = idx / per, f = idx % per;
        if (r < nrows)
            cp_async16(dst + r * ld + 4 * f, src + r * stride + 4 * f);
        else
            *reinterpret_cast<float4*>(dst + r * ld + 4 * f) = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
}

extern "C" __global__ void __launch_bounds__(DN_WY_PREP_THREADS)
dn_wy_prep(const float* __restrict__ c, const float* __restrict__ qk, const float* __restrict__ ab,
           float* __restrict__ rec, int n_tok, int n_k_heads, int n_v_heads, int dk, int dv) {
    extern __shared__ __align__(16) float dn_wy_smem[];
    float* ks = dn_wy_smem;               // K [C][LD]
    float* qvs = ks + DN_WY_C * DN_WY_LD;  // Q [C][LD], then V
    float* as = qvs + DN_WY_C * DN_WY_LD;  // A [C][LDC]
    float* ts = as + DN_WY_C * DN_WY_LDC;  // T [C][LDC]
    float* gs = ts + DN_WY_C * DN_WY_LDC;  // G [C]
    float* bs = gs + DN_WY_C;              // β [C]
    float* wsc = bs + DN_WY_C;             // β e^G [C]
    int chunk = blockIdx.x, hv = blockIdx.y;
    int hk = hv / (n_v_heads / n_k_heads);
    int t0 = chunk * DN_WY_C, nt = min(DN_WY_C, n_tok - t0);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int g = lane >> 2, tq = lane & 3;
    long long key_dim = (long long)n_k_heads * dk;
    long long conv_dim = 2 * key_dim + (long long)n_v_heads * dv;
    long long qk_stride = 2 * key_dim;
    const float* qsrc = qk + ((long long)t0 * n_k_heads + hk) * 2 * dk;
    float* out = rec + ((long long)chunk * n_v_heads + hv) * dn_wy_rec_floats(dk, dv);

    dn_wy_stage_rows(qvs, DN_WY_LD, qsrc, qk_stride, nt, dk);
    dn_wy_stage_rows(ks, DN_WY_LD, qsrc + dk, qk_stride, nt, dk);
    cp_async_commit();
    if (warp == 0) {
        // The gates of tokens 2·lane and 2·lane + 1, then G by a prefix sum over the lanes' pairs.
        float gl[2];
#pragma unroll
        for (int e = 0; e < 2; e++) {
            int i = 2 * lane + e;
            const float* abt = ab + ((long long)(t0 + i) * n_v_heads + hv) * 2;
            gl[e] = i < nt ? abt[0] : 0.0f;
            bs[i] = i < nt ? abt[1] : 0.0f;
        }
        float pair = gl[0] + gl[1], run = pair;
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            float up = __shfl_up_sync(0xffffffffu, run, off);
            if (lane >= off) run += up;
        }
        gs[2 * lane] = run - pair + gl[0];
        gs[2 * lane + 1] = run;
    }
    cp_async_wait<0>();
    __syncthreads();

    // A and P: warp (mb, nh) rows 16mb.., columns 32nh.. (4 tiles of 8).
    int mb = warp & 3, nh = warp >> 2;
    {
        float acc_a[4][4] = {}, acc_p[4][4] = {};
        for (int k0 = 0; k0 < dk; k0 += 8) {
            u32 fk[4], fq[4];
            frag_a_tf32(fk, ks + 16 * mb * DN_WY_LD + k0, DN_WY_LD, 1);
            frag_a_tf32(fq, qvs + 16 * mb * DN_WY_LD + k0, DN_WY_LD, 1);
#pragma unroll
            for (int n = 0; n < 4; n++) {
                u32 b0, b1;  // (k = dim i, n = token s) = K[s][i]
                frag_b_tf32(b0, b1, ks + (32 * nh + 8 * n) * DN_WY_LD + k0, 1, DN_WY_LD);
                mma_tf32(acc_a[n], fk, b0, b1);
                mma_tf32(acc_p[n], fq, b0, b1);
            }
        }
        float* p_out = out + (long long)DN_WY_C * (dk + dv);
#pragma unroll
        for (int n = 0; n < 4; n++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int r = 16 * mb + g + 8 * h, s0 = 32 * nh + 8 * n + 2 * tq;
                float pv[2];
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    int s = s0 + e;
                    float d = s <= r ? expf(gs[r] - gs[s]) : 0.0f;
                    as[r * DN_WY_LDC + s] = s < r ? bs[r] * d * acc_a[n][2 * h + e] : 0.0f;
                    pv[e] = d * acc_p[n][2 * h + e];
                }
                *reinterpret_cast<float2*>(p_out + r * DN_WY_C + s0) = make_float2(pv[0], pv[1]);
            }
    }
    __syncthreads();  // Q's space is free, A complete
    dn_wy_stage_rows(qvs, DN_WY_LD, c + (long long)t0 * conv_dim + 2 * key_dim + (long long)hv * dv, conv_dim, nt,
                     dv);
    cp_async_commit();
    if (threadIdx.x < DN_WY_C) wsc[threadIdx.x] = bs[threadIdx.x] * expf(gs[threadIdx.x]);
    if (threadIdx.x < DN_WY_C) out[(long long)DN_WY_C * (dk + dv + DN_WY_C) + threadIdx.x] = gs[threadIdx.x];

    // T = (I + A)⁻¹: the upper triangle 0; diagonal blocks T_ii = (I + A_ii)⁻¹, warp i, lane j < 16
    // its column (T[t][j] = −Σ_{s=j..t−1} A[t][s] T[s][j]).
    for (int idx = threadIdx.x; idx < DN_WY_C * DN_WY_C; idx += blockDim.x) {
        int r = idx / DN_WY_C, s = idx % DN_WY_C;
        if (s > r) ts[r * DN_WY_LDC + s] = 0.0f;
    }
    if (warp < DN_WY_C / 16 && lane < 16) {
        float* tb = ts + 16 * warp * (DN_WY_LDC + 1);
        const float* ab_ = as + 16 * warp * (DN_WY_LDC + 1);
        int j = lane;
        tb[j * DN_WY_LDC + j] = 1.0f;
        for (int t = j + 1; t < 16; t++) {
            float acc = 0.0f;
            for (int s = j; s < t; s++) acc += ab_[t * DN_WY_LDC + s] * tb[s * DN_WY_LDC + j];
            tb[t * DN_WY_LDC + j] = -acc;
        }
    }
    __syncthreads();
    // Block rows 1.. in order; block (i, j) by warp j: lane L row L/2, columns 8(L%2) .. +7.
    for (int i = 1; i < DN_WY_C / 16; i++) {
        if (warp < i) {
            int j = warp, r = lane >> 1, c0 = (lane & 1) * 8;
            float x[8] = {};
            const float* arow = as + (16 * i + r) * DN_WY_LDC;
            for (int s = 16 * j; s < 16 * i; s++) {
                float a = arow[s];
                const float* tr = ts + s * DN_WY_LDC + 16 * j + c0;
#pragma unroll
                for (int e = 0; e < 8; e++) x[e] += a * tr[e];
            }
            float* blk = ts + 16 * i * DN_WY_LDC + 16 * j;  // X = Σ A_ik T_kj here first
#pragma unroll
            for (int e = 0; e < 8; e++) blk[r * DN_WY_LDC + c0 + e] = x[e];
            __syncwarp();
            const float* tii = ts + 16 * i * (DN_WY_LDC + 1);
            float y[8] = {};
            for (int u = 0; u <= r; u++) {
                float tv = tii[r * DN_WY_LDC + u];
#pragma unroll
                for (int e = 0; e < 8; e++) y[e] += tv * blk[u * DN_WY_LDC + c0 + e];
            }
            __syncwarp();
#pragma unroll
            for (int e = 0; e < 8; e++) blk[r * DN_WY_LDC + c0 + e] = -y[e];
        }
        __syncthreads();
    }

    // W = (T diag(β e^G)) K, then U = (T diag(β)) V: warp (mb, nh) rows 16mb.., the 32-column groups
    // g32 ≡ nh (mod 2); T is lower triangular, so k stops at the warp's last row.
    for (int which = 0; which < 2; which++) {
        if (which == 1) {
            cp_async_wait<0>();
            __syncthreads();
        }
        const float* src = which ? qvs : ks;
        const float* sc = which ? bs : wsc;
        int width = which ? dv : dk;
        float* dst = out + (which ? (long long)DN_WY_C * dk : 0);
        for (int n0 = 32 * nh; n0 < width; n0 += 64) {
            float acc[4][4] = {};
            for (int k0 = 0; k0 < 16 * (mb + 1); k0 += 8) {
                u32 fa[4];
                frag_a_tf32_cols(fa, ts + 16 * mb * DN_WY_LDC + k0, DN_WY_LDC, 1, sc + k0);
#pragma unroll
                for (int n = 0; n < 4; n++) {
                    u32 b0, b1;
                    frag_b_tf32(b0, b1, src + k0 * DN_WY_LD + n0 + 8 * n, DN_WY_LD, 1);
                    mma_tf32(acc[n], fa, b0, b1);
                }
            }
#pragma unroll
            for (int n = 0; n < 4; n++)
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    int r = 16 * mb + g + 8 * h;
                    *reinterpret_cast<float2*>(dst + (long long)r * width + n0 + 8 * n + 2 * tq) =
                        make_float2(acc[n][2 * h], acc[n][2 * h + 1]);
                }
        }
    }
}

// acc (two m16n8 tiles: 16 rows × 16 columns) += A · B over k (a multiple of 8): A's 16 rows at
// a (rows lda apart), B's k rows of 16 columns at b (ldb apart); tf32 operands, fp32 sums.
__device__ __forceinline__ void dn_wy_mma_16x16(float (&acc)[2][4], const float* a, int lda, const float* b, int ldb,
                                                int k) {
    for (int k0 = 0; k0 < k; k0 += 8) {
        u32 fa[4];
        frag_a_tf32(fa, a + k0, lda, 1);
#pragma unroll
        for (int n = 0; n < 2; n++) {
            u32 b0, b1;
            frag_b_tf32(b0, b1, b + k0 * ldb + 8 * n, ldb, 1);
            mma_tf32(acc[n], fa, b0, b1);
        }
    }
}

// Stores a warp's 16 × 32 block of accumulators (four m16n8 tiles: rows g, g + 8, columns 8n +
// 2t, + 1) at p, rows ld floats apart.
__device__ __forceinline__ void dn_wy_store_16x32(const float (&acc)[4][4], float* p, long long ld) {
    int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
#pragma unroll
    for (int n = 0; n < 4; n++)
#pragma unroll
        for (int h = 0; h < 2; h++)
            *reinterpret_cast<float2*>(p + (g + 8 * h) * ld + 8 * n + 2 * t) = make_float2(acc[n][2 * h], acc[n][2 * h + 1]);
}

extern "C" __global__ void __launch_bounds__(DN_WY_SCAN_THREADS)
dn_wy_scan(const float* __restrict__ qk, const float* __restrict__ rec, float* __restrict__ state,
           float* __restrict__ o, int n_tok, int n_k_heads, int n_v_heads, int dk, int dv) {
    extern __shared__ __align__(16) float dn_wy_smem[];
    float* wsm = dn_wy_smem;                 // W [C][LD]
    float* qs = wsm + DN_WY_C * DN_WY_LD;    // Q [C][LD]
    float* ks = qs + DN_WY_C * DN_WY_LD;     // K [C][LD]
    float* ps = ks + DN_WY_C * DN_WY_LD;     // P [C][LDC]
    float* ss = ps + DN_WY_C * DN_WY_LDC;    // S's slice [dk][LDV] (B operand)
    float* ds = ss + DN_MAX_DK * DN_WY_LDV;  // Δ [C][LDV]
    float* gs = ds + DN_WY_C * DN_WY_LDV;    // G [C]
    float* dec = gs + DN_WY_C;               // e^{G_C − G_s} [C]
    int hv = blockIdx.x, j0 = blockIdx.y * DN_WY_COLS;
    int hk = hv / (n_v_heads / n_k_heads);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int g = lane >> 2, tq = lane & 3;
    int mb = warp & 3, nh = warp >> 2;  // Δ and O: rows 16mb.., columns 16nh.. (2 tiles of 8)
    long long rec_n = dn_wy_rec_floats(dk, dv);
    long long qk_stride = 2LL * n_k_heads * dk;
    long long o_stride = (long long)n_v_heads * dv;
    int n_chunks = (n_tok + DN_WY_C - 1) / DN_WY_C;
    float* sp = state + (long long)hv * dk * dv + j0;  // row i at sp + i·dv
    bool has_rows = 16 * warp < dk;                    // warp w keeps S rows 16w..16w+15

    float acc_s[4][4];
#pragma unroll
    for (int n = 0; n < 4; n++)
#pragma unroll
        for (int h = 0; h < 2; h++) {
            float2 v = has_rows ? *reinterpret_cast<const float2*>(sp + (long long)(16 * warp + g + 8 * h) * dv + 8 * n +
                                                                   2 * tq)
                                : make_float2(0.0f, 0.0f);
            acc_s[n][2 * h] = v.x;
            acc_s[n][2 * h + 1] = v.y;
        }

    // Chunk 0's operands; later chunks' are staged as the buffers free up (below).
    {
        const float* qsrc = qk + (long long)hk * 2 * dk;
        int nt = min(DN_WY_C, n_tok);
        dn_wy_stage_rows(wsm, DN_WY_LD, rec + hv * rec_n, dk, DN_WY_C, dk);
        dn_wy_stage_rows(qs, DN_WY_LD, qsrc, qk_stride, nt, dk);
        dn_wy_stage_rows(ps, DN_WY_LDC, rec + hv * rec_n + DN_WY_C * (dk + dv), DN_WY_C, DN_WY_C, DN_WY_C);
        dn_wy_stage_rows(ks, DN_WY_LD, qsrc + dk, qk_stride, nt, dk);
        if (threadIdx.x < DN_WY_C / 4)
            cp_async16(gs + 4 * threadIdx.x, rec + hv * rec_n + DN_WY_C * (dk + dv + DN_WY_C) + 4 * threadIdx.x);
        cp_async_commit();
    }
    for (int ch = 0; ch < n_chunks; ch++) {
        int t0 = ch * DN_WY_C, nt = min(DN_WY_C, n_tok - t0);
        const float* rc = rec + ((long long)ch * n_v_heads + hv) * rec_n;
        // The next chunk's sources (used only when there is one).
        const float* rn = rc + (long long)n_v_heads * rec_n;
        const float* qn = qk + ((long long)(t0 + DN_WY_C) * n_k_heads + hk) * 2 * dk;
        int nt_next = min(DN_WY_C, n_tok - t0 - DN_WY_C);
        bool more = ch + 1 < n_chunks;
        // U's slice in the accumulator layout, loaded early so its latency overlaps the wait.
        float u[2][4];
#pragma unroll
        for (int n = 0; n < 2; n++)
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int r = 16 * mb + g + 8 * h;
                float2 v = *reinterpret_cast<const float2*>(rc + (long long)DN_WY_C * dk + (long long)r * dv + j0 +
                                                            16 * nh + 8 * n + 2 * tq);
                u[n][2 * h] = v.x;
                u[n][2 * h + 1] = v.y;
            }
        // S into shared memory for the products that read it.
        if (has_rows) dn_wy_store_16x32(acc_s, ss + 16 * warp * DN_WY_LDV, DN_WY_LDV);
        cp_async_wait<0>();
        __syncthreads();
        if (threadIdx.x < DN_WY_C) dec[threadIdx.x] = expf(gs[DN_WY_C - 1] - gs[threadIdx.x]);

        // Δ = U − W S.
        {
            float x[2][4] = {};
            dn_wy_mma_16x16(x, wsm + 16 * mb * DN_WY_LD, DN_WY_LD, ss + 16 * nh, DN_WY_LDV, dk);
#pragma unroll
            for (int n = 0; n < 2; n++)
#pragma unroll
                for (int h = 0; h < 2; h++)
                    *reinterpret_cast<float2*>(ds + (16 * mb + g + 8 * h) * DN_WY_LDV + 16 * nh + 8 * n + 2 * tq) =
                        make_float2(u[n][2 * h] - x[n][2 * h], u[n][2 * h + 1] - x[n][2 * h + 1]);
        }
        __syncthreads();  // Δ complete; W free
        if (more) {
            dn_wy_stage_rows(wsm, DN_WY_LD, rn, dk, DN_WY_C, dk);
            cp_async_commit();
        }

        // O = diag(e^G) Q S + P Δ (P is lower triangular: k stops at the warp's last row).
        {
            float acc[2][4] = {};
            dn_wy_mma_16x16(acc, qs + 16 * mb * DN_WY_LD, DN_WY_LD, ss + 16 * nh, DN_WY_LDV, dk);
#pragma unroll
            for (int h = 0; h < 2; h++) {
                float e = expf(gs[16 * mb + g + 8 * h]);
#pragma unroll
                for (int n = 0; n < 2; n++) {
                    acc[n][2 * h] *= e;
                    acc[n][2 * h + 1] *= e;
                }
            }
            dn_wy_mma_16x16(acc, ps + 16 * mb * DN_WY_LDC, DN_WY_LDC, ds + 16 * nh, DN_WY_LDV, 16 * (mb + 1));
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int r = 16 * mb + g + 8 * h;
                if (r < nt) {
                    float* orow = o + (long long)(t0 + r) * o_stride + (long long)hv * dv + j0 + 16 * nh + 2 * tq;
#pragma unroll
                    for (int n = 0; n < 2; n++)
                        *reinterpret_cast<float2*>(orow + 8 * n) =
                            make_float2(act(acc[n][2 * h]), act(acc[n][2 * h + 1]));
                }
            }
        }
        __syncthreads();  // Q, P and S's copy free
        if (more) {
            dn_wy_stage_rows(qs, DN_WY_LD, qn, qk_stride, nt_next, dk);
            dn_wy_stage_rows(ps, DN_WY_LDC, rn + DN_WY_C * (dk + dv), DN_WY_C, DN_WY_C, DN_WY_C);
            cp_async_commit();
        }

        // S ← e^{G_C} S + (diag(dec) K)ᵀ Δ: A (row i, column s) = K[s][i] · dec[s].
        if (has_rows) {
            float el = expf(gs[DN_WY_C - 1]);
#pragma unroll
            for (int n = 0; n < 4; n++)
#pragma unroll
                for (int e = 0; e < 4; e++) acc_s[n][e] *= el;
            for (int k0 = 0; k0 < DN_WY_C; k0 += 8) {
                u32 fa[4];
                frag_a_tf32_cols(fa, ks + k0 * DN_WY_LD + 16 * warp, 1, DN_WY_LD, dec + k0);
#pragma unroll
                for (int n = 0; n < 4; n++) {
                    u32 b0, b1;
                    frag_b_tf32(b0, b1, ds + k0 * DN_WY_LDV + 8 * n, DN_WY_LDV, 1);
                    mma_tf32(acc_s[n], fa, b0, b1);
                }
            }
        }
        __syncthreads();  // K, G, Δ and the decays free
        if (more) {
            dn_wy_stage_rows(ks, DN_WY_LD, qn + dk, qk_stride, nt_next, dk);
            if (threadIdx.x < DN_WY_C / 4)
                cp_async16(gs + 4 * threadIdx.x, rn + DN_WY_C * (dk + dv + DN_WY_C) + 4 * threadIdx.x);
            cp_async_commit();
        }
    }
    if (has_rows) dn_wy_store_16x32(acc_s, sp + (long long)16 * warp * dv, dv);
}

extern "C" __global__ void dn_gated_norm(const float* __restrict__ o, const float* __restrict__ z, int z_stride,
                                         const float* __restrict__ w, float* __restrict__ y, int n_tok,
                                         int n_v_heads, int dv, float eps) {
    int t = blockIdx.x, hv = blockIdx.y;
    if (t >= n_tok) return;
    const float* oh = o + (long long)t * n_v_heads * dv + (long long)hv * dv;
    const float* zh = z + (long long)t * z_stride + (long long)hv * dv;
    float* yh = y + (long long)t * n_v_heads * dv + (long long)hv * dv;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dv; i += blockDim.x) ss += oh[i] * oh[i];
    ss = block_sum(ss);
    float inv = rsqrtf(ss / (float)dv + eps);
    for (int i = threadIdx.x; i < dv; i += blockDim.x) yh[i] = act(act(w[i] * act(oh[i] * inv)) * siluf(zh[i]));
}
