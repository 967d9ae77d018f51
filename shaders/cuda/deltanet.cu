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
//                β = sigmoid(b), α = exp(−exp(A_log) · softplus(a + dt_bias)) per V head into
//                ab [T, Hv, 2].
// dn_recurrent:  per V head hv (Q/K head hv / (Hv/Hk)), fp32 state S [dk, dv]:
//                S ← α S;  u = Sᵀk;  δ = β (v − u);  S ← S + k δᵀ;  o = Sᵀq.  Tokens in order.
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
            ab[((long long)t * n_v_heads + hv) * 2] = expf(g);
            ab[((long long)t * n_v_heads + hv) * 2 + 1] = beta;
        }
    }
}

// Stages tokens t0 .. t0+nt of what dn_recurrent's block reads into shared memory: q and k of
// its K head (cp.async), v of its 16 columns (cp.async), α and β (plain loads).
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
        ab_s[tt][0] = ab[((long long)(t0 + tt) * n_v_heads + hv) * 2];
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
