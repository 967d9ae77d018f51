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

// dn_chunked: dn_recurrent's result for a prefill chunk by the chunked form of the gated delta rule
// (MODEL.md §2.5; the plan's `chunked_scan`), chunks of DNC_C = 64 tokens, fp32 throughout, on the
// CUDA cores. Per V head hv and chunk (tokens i, j in 0..63; g = log α, Γ_i = Σ_{j ≤ i} g_j,
// D_ij = exp(Γ_i − Γ_j) for j ≤ i):
//   A_ij = β_i (k_i·k_j) D_ij (j < i),  P_ij = (q_i·k_j) D_ij (j ≤ i);
//   W = (I + A)⁻¹ (β ⊙ K ⊙ e^Γ),  U = (I + A)⁻¹ (β ⊙ V)     (forward substitution);
//   V' = U − W S;  O = (Q ⊙ e^Γ) S + P V';  S ← e^{Γ_last} S + (K ⊙ e^{Γ_last − Γ})ᵀ V'.
// The state's value columns are independent, so a block owns DNC_COLS = 32 columns of one head
// (grid (Hv, dv / 32), block 256): it redoes A and P for its head (4× over the head's blocks) and
// walks the chunks in order; its 128 × 32 slice of S stays in shared memory. Tokens past the
// chunk's end are zero with β = 0 and g = 0, so they change nothing. α from dn_prep's ab: g = log α,
// clamped at −88 where α underflowed to 0 (e^−88 is below every fp32 normal).
// Thread maps: A and P one (i, j) pair per thread in turn (K and Q rows padded to DNC_LD floats
// so the float4 reads of 32 consecutive j fall in distinct banks); the solves one column per thread
// (threads 0..dk−1 a column of W, DN_MAX_DK..DN_MAX_DK+31 of U, in place over β ⊙ V), each its
// own chain over the rows, no barrier;
// V', O and S one value column per lane, rows strided by warp.
// Limits (the launcher checks): dk ≤ 128, dk % 4 == 0, dv % 32 == 0.
#define DNC_C 64
#define DNC_COLS 32
#define DNC_LD 132  // floats per shared K / Q / W row (128 + 4)

// The steps dn_chunked, dn_chunk_wu and dn_chunk_scan share, for a block of 256 threads.

// The chunk's q and k rows (zero past its end, `n` tokens from t0) into shared [DNC_C][DNC_LD].
__device__ __forceinline__ void dnc_load_qk(float* sq, float* sk, const float* __restrict__ qk, int t0, int n,
                                            int hk, int n_k_heads, int dk) {
    int per4 = dk / 4;
    for (int idx = threadIdx.x; idx < DNC_C * per4; idx += blockDim.x) {
        int i = idx / per4, f = 4 * (idx % per4);
        float4 qv = make_float4(0.0f, 0.0f, 0.0f, 0.0f), kv = qv;
        if (i < n) {
            const float* src = qk + ((long long)(t0 + i) * n_k_heads + hk) * 2 * dk;
            qv = *reinterpret_cast<const float4*>(src + f);
            kv = *reinterpret_cast<const float4*>(src + dk + f);
        }
        *reinterpret_cast<float4*>(sq + i * DNC_LD + f) = qv;
        *reinterpret_cast<float4*>(sk + i * DNC_LD + f) = kv;
    }
}

// β and g = log α (clamped at −88 where α underflowed) of the chunk's tokens (β = 0, g = 0 past
// its end), then Γ, the inclusive prefix sum of g (two warps' scans joined). Ends synchronised.
__device__ __forceinline__ void dnc_gamma(float* gam, float* bet, const float* __restrict__ ab, int t0, int n,
                                          int hv, int n_v_heads) {
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    if (tid < DNC_C) {
        float alpha = 1.0f, beta = 0.0f;
        if (tid < n) {
            alpha = ab[((long long)(t0 + tid) * n_v_heads + hv) * 2];
            beta = ab[((long long)(t0 + tid) * n_v_heads + hv) * 2 + 1];
        }
        bet[tid] = beta;
        gam[tid] = alpha > 0.0f ? fmaxf(logf(alpha), -88.0f) : -88.0f;
    }
    __syncthreads();
    if (warp < 2) {
        float g = gam[tid];
#pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            float y = __shfl_up_sync(0xffffffffu, g, off);
            if (lane >= off) g += y;
        }
        gam[tid] = g;  // each warp's own prefix, joined below
    }
    __syncthreads();
    if (tid >= 32 && tid < DNC_C) gam[tid] += gam[31];
    __syncthreads();
}

// A_ij = β_i (k_i·k_j) D_ij (j < i, else 0) and P_ij = (q_i·k_j) D_ij (j ≤ i, else 0), [DNC_C][DNC_C + 1],
// one (i, j) pair per thread in turn.
__device__ __forceinline__ void dnc_a_p(float* sa, float* sp, const float* sk, const float* sq, const float* gam,
                                        const float* bet, int dk) {
    for (int pr = threadIdx.x; pr < DNC_C * DNC_C; pr += blockDim.x) {
        int i = pr / DNC_C, j = pr % DNC_C;
        float kk = 0.0f, qq = 0.0f;
        if (j <= i) {
            const float* ki = sk + i * DNC_LD;
            const float* qi = sq + i * DNC_LD;
            const float* kj = sk + j * DNC_LD;
            for (int m = 0; m < dk; m += 4) {
                float4 a4 = *reinterpret_cast<const float4*>(kj + m);
                float4 k4 = *reinterpret_cast<const float4*>(ki + m);
                float4 q4 = *reinterpret_cast<const float4*>(qi + m);
                kk += k4.x * a4.x + k4.y * a4.y + k4.z * a4.z + k4.w * a4.w;
                qq += q4.x * a4.x + q4.y * a4.y + q4.z * a4.z + q4.w * a4.w;
            }
            float dij = expf(gam[i] - gam[j]);
            kk *= bet[i] * dij;
            qq *= dij;
        }
        sa[i * (DNC_C + 1) + j] = j < i ? kk : 0.0f;
        sp[i * (DNC_C + 1) + j] = qq;
    }
}

// One column of (I + A)⁻¹ R by forward substitution, in place at x (stride ld): R's column is
// β ⊙ e^Γ ⊙ K's column `kcol` (W) when is_w, else x itself (U, over β ⊙ V).
__device__ __forceinline__ void dnc_solve_column(float* x, int ld, bool is_w, int kcol, const float* sa,
                                                 const float* sk, const float* gam, const float* bet) {
    for (int i = 0; i < DNC_C; i++) {
        float rhs = is_w ? bet[i] * expf(gam[i]) * sk[i * DNC_LD + kcol] : x[i * ld];
        const float* ai = sa + i * (DNC_C + 1);
        float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
        int j = 0;
        for (; j + 4 <= i; j += 4) {
            s0 += ai[j] * x[j * ld];
            s1 += ai[j + 1] * x[(j + 1) * ld];
            s2 += ai[j + 2] * x[(j + 2) * ld];
            s3 += ai[j + 3] * x[(j + 3) * ld];
        }
        for (; j < i; j++) s0 += ai[j] * x[j * ld];
        x[i * ld] = rhs - ((s0 + s1) + (s2 + s3));
    }
}

// With W, P, U (over the state's DNC_COLS columns j0.., [DNC_C][DNC_COLS + 1]), e^Γ and
// e^{Γ_last − Γ} in shared memory: V' = U − W S in place over U, O = (Q ⊙ e^Γ) S + P V' for the
// chunk's n tokens, S ← e^{Γ_last} S + (K ⊙ e^{Γ_last − Γ})ᵀ V' (P's entries past row n are zero;
// Γ_last is Γ at the chunk's last token, the padded tokens having g = 0). Lane = value column,
// rows strided by warp. Starts and ends synchronised.
__device__ __forceinline__ void dnc_state_step(float* su, float* ss, const float* sw, const float* sq,
                                               const float* sk, const float* sp, const float* eg, const float* kd,
                                               float* __restrict__ o, int t0, int n, int hv, int n_v_heads,
                                               int dk, int dv, int j0) {
    int cc = threadIdx.x & 31, warp = threadIdx.x >> 5;
    {
        float acc[DNC_C / 8];
#pragma unroll
        for (int r = 0; r < DNC_C / 8; r++) acc[r] = 0.0f;
        for (int m = 0; m < dk; m++) {
            float sv = ss[m * DNC_COLS + cc];
#pragma unroll
            for (int r = 0; r < DNC_C / 8; r++) acc[r] += sw[(warp + 8 * r) * DNC_LD + m] * sv;
        }
#pragma unroll
        for (int r = 0; r < DNC_C / 8; r++) su[(warp + 8 * r) * (DNC_COLS + 1) + cc] -= acc[r];
    }
    __syncthreads();
    {
        float acc[DNC_C / 8], intra[DNC_C / 8];
#pragma unroll
        for (int r = 0; r < DNC_C / 8; r++) acc[r] = intra[r] = 0.0f;
        for (int m = 0; m < dk; m++) {
            float sv = ss[m * DNC_COLS + cc];
#pragma unroll
            for (int r = 0; r < DNC_C / 8; r++) acc[r] += sq[(warp + 8 * r) * DNC_LD + m] * sv;
        }
        for (int j = 0; j < DNC_C; j++) {
            float vj = su[j * (DNC_COLS + 1) + cc];
#pragma unroll
            for (int r = 0; r < DNC_C / 8; r++) intra[r] += sp[(warp + 8 * r) * (DNC_C + 1) + j] * vj;
        }
#pragma unroll
        for (int r = 0; r < DNC_C / 8; r++) {
            int i = warp + 8 * r;
            if (i < n)
                o[(long long)(t0 + i) * n_v_heads * dv + (long long)hv * dv + j0 + cc] = act(eg[i] * acc[r] + intra[r]);
        }
    }
    __syncthreads();  // S is read above and rewritten below
    {
        float decay = eg[DNC_C - 1];
        for (int m = warp; m < dk; m += 8) {
            float acc = 0.0f;
            for (int i = 0; i < DNC_C; i++) acc += sk[i * DNC_LD + m] * kd[i] * su[i * (DNC_COLS + 1) + cc];
            ss[m * DNC_COLS + cc] = decay * ss[m * DNC_COLS + cc] + acc;
        }
    }
    __syncthreads();
}

// e^Γ and e^{Γ_last − Γ} from Γ (threads < DNC_C).
__device__ __forceinline__ void dnc_decays(float* eg, float* kd, const float* gam) {
    int tid = threadIdx.x;
    if (tid < DNC_C) {
        eg[tid] = expf(gam[tid]);
        kd[tid] = expf(gam[DNC_C - 1] - gam[tid]);
    }
}

struct DncSmem {
    float* k;   // [DNC_C][DNC_LD]
    float* q;   // [DNC_C][DNC_LD]
    float* w;   // [DNC_C][DNC_LD]  W
    float* a;   // [DNC_C][DNC_C + 1]  A (strict lower)
    float* p;   // [DNC_C][DNC_C + 1]  P (lower, diagonal included)
    float* u;   // [DNC_C][DNC_COLS + 1]  β ⊙ V, solved in place into U, then V'
    float* s;   // [DN_MAX_DK][DNC_COLS]  the state's slice
    float* gam;   // [DNC_C]  Γ
    float* beta;  // [DNC_C]
    float* eg;    // [DNC_C]  e^Γ
    float* kd;    // [DNC_C]  e^{Γ_last − Γ}
};

extern "C" __global__ void __launch_bounds__(256)
dn_chunked(const float* __restrict__ c, const float* __restrict__ qk, const float* __restrict__ ab,
           float* __restrict__ state, float* __restrict__ o, int n_tok, int n_k_heads, int n_v_heads, int dk,
           int dv) {
    extern __shared__ __align__(16) float dnc_smem[];
    DncSmem sm;
    sm.k = dnc_smem;
    sm.q = sm.k + DNC_C * DNC_LD;
    sm.w = sm.q + DNC_C * DNC_LD;
    sm.a = sm.w + DNC_C * DNC_LD;
    sm.p = sm.a + DNC_C * (DNC_C + 1);
    sm.u = sm.p + DNC_C * (DNC_C + 1);
    sm.s = sm.u + DNC_C * (DNC_COLS + 1);
    sm.gam = sm.s + DN_MAX_DK * DNC_COLS;
    sm.beta = sm.gam + DNC_C;
    sm.eg = sm.beta + DNC_C;
    sm.kd = sm.eg + DNC_C;
    int hv = blockIdx.x, j0 = blockIdx.y * DNC_COLS;
    int tid = threadIdx.x;
    int hk = hv / (n_v_heads / n_k_heads);
    int key_dim = n_k_heads * dk;
    int conv_dim = 2 * key_dim + n_v_heads * dv;
    float* sp = state + (long long)hv * dk * dv + j0;
    for (int i = tid; i < dk * DNC_COLS; i += blockDim.x) sm.s[i] = sp[(long long)(i / DNC_COLS) * dv + i % DNC_COLS];
    for (int t0 = 0; t0 < n_tok; t0 += DNC_C) {
        int n = min(DNC_C, n_tok - t0);
        // 1. The chunk's q, k, β ⊙ v (its DNC_COLS columns), β, Γ.
        dnc_load_qk(sm.q, sm.k, qk, t0, n, hk, n_k_heads, dk);
        for (int idx = tid; idx < DNC_C * DNC_COLS; idx += blockDim.x) {
            int i = idx / DNC_COLS, cc = idx % DNC_COLS;
            float v = 0.0f, beta = 0.0f;
            if (i < n) {
                v = c[(long long)(t0 + i) * conv_dim + 2 * key_dim + (long long)hv * dv + j0 + cc];
                beta = ab[((long long)(t0 + i) * n_v_heads + hv) * 2 + 1];
            }
            sm.u[i * (DNC_COLS + 1) + cc] = beta * v;
        }
        dnc_gamma(sm.gam, sm.beta, ab, t0, n, hv, n_v_heads);
        // 2. A and P.
        dnc_a_p(sm.a, sm.p, sm.k, sm.q, sm.gam, sm.beta, dk);
        __syncthreads();
        // 3. W (threads 0..dk−1, a column each) and U (DN_MAX_DK..DN_MAX_DK+31), no barrier.
        if (tid < dk) dnc_solve_column(sm.w + tid, DNC_LD, true, tid, sm.a, sm.k, sm.gam, sm.beta);
        if (tid >= DN_MAX_DK && tid < DN_MAX_DK + DNC_COLS)
            dnc_solve_column(sm.u + tid - DN_MAX_DK, DNC_COLS + 1, false, 0, sm.a, sm.k, sm.gam, sm.beta);
        dnc_decays(sm.eg, sm.kd, sm.gam);
        __syncthreads();
        // 4. V', O and the state.
        dnc_state_step(sm.u, sm.s, sm.w, sm.q, sm.k, sm.p, sm.eg, sm.kd, o, t0, n, hv, n_v_heads, dk, dv, j0);
    }
    for (int i = tid; i < dk * DNC_COLS; i += blockDim.x) sp[(long long)(i / DNC_COLS) * dv + i % DNC_COLS] = sm.s[i];
}

// dn_chunk_wu + dn_chunk_scan: dn_chunked's arithmetic (the same equations, fp32, chunks of DNC_C
// tokens) in two launches, so the work that does not depend on the state runs for every chunk at
// once. dn_chunked walks the chunks in order in 128 blocks and redoes each chunk's A, P and
// triangular solves in every block of a head; here
//   dn_chunk_wu   grid (chunks, Hv), block 256: one chunk of one head: Γ, A and P, then W and U by
//                 forward substitution, one column per thread (dk + dv ≤ 256 columns); writes the
//                 chunk's record [W (DNC_C × dk) | U (DNC_C × dv) | P (DNC_C × DNC_C) | Γ (DNC_C)];
//   dn_chunk_scan grid (Hv, dv / DNC_COLS), block 256: walks the chunks in order, loading each
//                 record's W, P, Γ and its U columns with the chunk's q and k, for V', O and the
//                 state (dnc_state_step, as dn_chunked; the state's dk × 32 slice in shared memory).
// The records: `rec` holds Hv × chunks of them (forward.rs sizes it for the prefill chunk).
// Limits as dn_chunked's, and dv ≤ 128 (dk + dv ≤ 256 threads).
__device__ __forceinline__ long long dnc_rec_floats(int dk, int dv) {
    return (long long)DNC_C * (dk + dv + DNC_C + 1);
}

extern "C" __global__ void __launch_bounds__(256)
dn_chunk_wu(const float* __restrict__ c, const float* __restrict__ qk, const float* __restrict__ ab,
            float* __restrict__ rec, int n_tok, int n_k_heads, int n_v_heads, int dk, int dv) {
    extern __shared__ __align__(16) float dnc_smem[];
    // k, q, w [DNC_C][DNC_LD]; u [DNC_C][dv + 1]; a, p [DNC_C][DNC_C + 1]; gam, beta [DNC_C].
    float* sk = dnc_smem;
    float* sq = sk + DNC_C * DNC_LD;
    float* sw = sq + DNC_C * DNC_LD;
    float* su = sw + DNC_C * DNC_LD;
    int ldu = dv + 1;
    float* sa = su + DNC_C * ldu;
    float* sp = sa + DNC_C * (DNC_C + 1);
    float* gam = sp + DNC_C * (DNC_C + 1);
    float* bet = gam + DNC_C;
    int chunk = blockIdx.x, hv = blockIdx.y, t0 = chunk * DNC_C;
    int tid = threadIdx.x;
    int hk = hv / (n_v_heads / n_k_heads);
    int key_dim = n_k_heads * dk;
    int conv_dim = 2 * key_dim + n_v_heads * dv;
    int n = min(DNC_C, n_tok - t0);
    // 1. q, k, β ⊙ v (every value column), β, Γ.
    dnc_load_qk(sq, sk, qk, t0, n, hk, n_k_heads, dk);
    for (int idx = tid; idx < DNC_C * dv; idx += blockDim.x) {
        int i = idx / dv, cc = idx % dv;
        float v = 0.0f, beta = 0.0f;
        if (i < n) {
            v = c[(long long)(t0 + i) * conv_dim + 2 * key_dim + (long long)hv * dv + cc];
            beta = ab[((long long)(t0 + i) * n_v_heads + hv) * 2 + 1];
        }
        su[i * ldu + cc] = beta * v;
    }
    dnc_gamma(gam, bet, ab, t0, n, hv, n_v_heads);
    // 2. A and P.
    dnc_a_p(sa, sp, sk, sq, gam, bet, dk);
    __syncthreads();
    // 3. W (thread t < dk: column t) and U (dk ≤ t < dk + dv: column t − dk).
    if (tid < dk) dnc_solve_column(sw + tid, DNC_LD, true, tid, sa, sk, gam, bet);
    else if (tid < dk + dv) dnc_solve_column(su + tid - dk, ldu, false, 0, sa, sk, gam, bet);
    __syncthreads();
    // 4. The record.
    float* r = rec + ((long long)hv * gridDim.x + chunk) * dnc_rec_floats(dk, dv);
    float* rw = r;
    float* ru = rw + DNC_C * dk;
    float* rp = ru + DNC_C * dv;
    float* rg = rp + DNC_C * DNC_C;
    for (int idx = tid; idx < DNC_C * dk; idx += blockDim.x) rw[idx] = sw[(idx / dk) * DNC_LD + idx % dk];
    for (int idx = tid; idx < DNC_C * dv; idx += blockDim.x) ru[idx] = su[(idx / dv) * ldu + idx % dv];
    for (int idx = tid; idx < DNC_C * DNC_C; idx += blockDim.x)
        rp[idx] = sp[(idx / DNC_C) * (DNC_C + 1) + idx % DNC_C];
    if (tid < DNC_C) rg[tid] = gam[tid];
}

extern "C" __global__ void __launch_bounds__(256)
dn_chunk_scan(const float* __restrict__ qk, const float* __restrict__ rec, float* __restrict__ state,
              float* __restrict__ o, int n_tok, int n_k_heads, int n_v_heads, int dk, int dv) {
    extern __shared__ __align__(16) float dnc_smem[];
    // k, q, w [DNC_C][DNC_LD]; p [DNC_C][DNC_C + 1]; u [DNC_C][DNC_COLS + 1]; s [DN_MAX_DK][DNC_COLS];
    // eg, kd [DNC_C].
    float* sk = dnc_smem;
    float* sq = sk + DNC_C * DNC_LD;
    float* sw = sq + DNC_C * DNC_LD;
    float* sp = sw + DNC_C * DNC_LD;
    float* su = sp + DNC_C * (DNC_C + 1);
    float* ss = su + DNC_C * (DNC_COLS + 1);
    float* eg = ss + DN_MAX_DK * DNC_COLS;
    float* kd = eg + DNC_C;
    int hv = blockIdx.x, j0 = blockIdx.y * DNC_COLS;
    int tid = threadIdx.x;
    int hk = hv / (n_v_heads / n_k_heads);
    int n_chunks = (n_tok + DNC_C - 1) / DNC_C;
    float* stp = state + (long long)hv * dk * dv + j0;
    for (int i = tid; i < dk * DNC_COLS; i += blockDim.x) ss[i] = stp[(long long)(i / DNC_COLS) * dv + i % DNC_COLS];
    int per4 = dk / 4;
    for (int chunk = 0; chunk < n_chunks; chunk++) {
        int t0 = chunk * DNC_C, n = min(DNC_C, n_tok - t0);
        const float* r = rec + ((long long)hv * n_chunks + chunk) * dnc_rec_floats(dk, dv);
        const float* rw = r;
        const float* ru = rw + DNC_C * dk;
        const float* rp = ru + DNC_C * dv;
        const float* rg = rp + DNC_C * DNC_C;
        // 1. The chunk's q and k, its W, P and U columns, the decays.
        dnc_load_qk(sq, sk, qk, t0, n, hk, n_k_heads, dk);
        for (int idx = tid; idx < DNC_C * per4; idx += blockDim.x) {
            int i = idx / per4, f = 4 * (idx % per4);
            *reinterpret_cast<float4*>(sw + i * DNC_LD + f) = *reinterpret_cast<const float4*>(rw + i * dk + f);
        }
        for (int idx = tid; idx < DNC_C * DNC_C; idx += blockDim.x)
            sp[(idx / DNC_C) * (DNC_C + 1) + idx % DNC_C] = rp[idx];
        for (int idx = tid; idx < DNC_C * DNC_COLS; idx += blockDim.x)
            su[(idx / DNC_COLS) * (DNC_COLS + 1) + idx % DNC_COLS] = ru[(idx / DNC_COLS) * dv + j0 + idx % DNC_COLS];
        dnc_decays(eg, kd, rg);
        __syncthreads();
        // 2. V', O and the state.
        dnc_state_step(su, ss, sw, sq, sk, sp, eg, kd, o, t0, n, hv, n_v_heads, dk, dv, j0);
    }
    for (int i = tid; i < dk * DNC_COLS; i += blockDim.x) stp[(long long)(i / DNC_COLS) * dv + i % DNC_COLS] = ss[i];
}
