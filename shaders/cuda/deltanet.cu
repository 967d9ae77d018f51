// Gated DeltaNet (MODEL.md §2.5), between the in_proj_* projections and out_proj.
//
// dn_conv:      c_t = silu(causal depthwise conv_K(m)_t) over all conv_dim channels (q, k, v);
//               conv_state [K-1, conv_dim] holds the last K-1 pre-conv rows and is updated.
// dn_recurrent: per V head hv (Q/K head hv / (Hv/Hk)), fp32 state S [dk, dv]:
//               S ← α S;  u = Sᵀk;  δ = β (v − u);  S ← S + k δᵀ;  o = Sᵀq
//               with q = l2norm(q)/sqrt(dk), k = l2norm(k), β = sigmoid(b),
//               α = exp(−exp(A_log) · softplus(a + dt_bias)). Tokens run in order inside.
// dn_gated_norm: y = w ⊙ rmsnorm(o_h) ⊙ silu(z_h) per V head.
//
// Recurrent layout: state [Hv, dk, dv] fp32, row i of head hv at (hv·dk + i)·dv. A block owns
// 32 value columns of one head (columns are independent given q, k, β, α), DN_PARTS threads per
// column, and keeps them in registers for all tokens, so the state is read and written once per
// launch.

#define DN_MAX_K 8
#define DN_MAX_DK 128
#define DN_PARTS 4  // threads sharing one value column, each holding DN_MAX_DK / DN_PARTS rows

extern "C" __global__ void dn_conv(const float* __restrict__ m, int m_stride, float* __restrict__ conv_state,
                                   const float* __restrict__ w, float* __restrict__ c, int n_tok, int conv_dim,
                                   int k) {
    int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= conv_dim) return;
    float hist[DN_MAX_K];
    float wk[DN_MAX_K];
#pragma unroll
    for (int j = 0; j < DN_MAX_K; j++) {
        hist[j] = (j < k - 1) ? conv_state[(long long)j * conv_dim + ch] : 0.0f;
        wk[j] = j < k - 1 ? w[(long long)ch * k + j] : 0.0f;
    }
    float w_cur = w[(long long)ch * k + k - 1];
    for (int t = 0; t < n_tok; t++) {
        float cur = m[(long long)t * m_stride + ch];
        float acc = 0.0f;
#pragma unroll
        for (int j = 0; j < DN_MAX_K - 1; j++)
            if (j < k - 1) acc += wk[j] * hist[j];
        acc += w_cur * cur;
        c[(long long)t * conv_dim + ch] = act(siluf(act(acc)));
#pragma unroll
        for (int j = 0; j < DN_MAX_K - 1; j++)
            if (j < k - 2) hist[j] = hist[j + 1];
        if (k >= 2) {
#pragma unroll
            for (int j = 0; j < DN_MAX_K - 1; j++)
                if (j == k - 2) hist[j] = cur;
        }
    }
#pragma unroll
    for (int j = 0; j < DN_MAX_K - 1; j++)
        if (j < k - 1) conv_state[(long long)j * conv_dim + ch] = hist[j];
}

extern "C" __global__ void __launch_bounds__(32 * DN_PARTS)
dn_recurrent(const float* __restrict__ c, const float* __restrict__ b, const float* __restrict__ a,
             int ba_stride, const float* __restrict__ a_log, const float* __restrict__ dt_bias,
             float* __restrict__ state, float* __restrict__ o, int n_tok, int n_k_heads, int n_v_heads, int dk,
             int dv, float eps) {
    __shared__ float qs[DN_MAX_DK], ks[DN_MAX_DK];
    const int ROWS = DN_MAX_DK / DN_PARTS;
    int hv = blockIdx.x;
    int col = threadIdx.x / DN_PARTS, part = threadIdx.x % DN_PARTS;
    int j = blockIdx.y * 32 + col;
    bool live = j < dv;
    int hk = hv / (n_v_heads / n_k_heads);
    int key_dim = n_k_heads * dk;
    int conv_dim = 2 * key_dim + n_v_heads * dv;
    float* sp = state + (long long)hv * dk * dv;
    float s[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; r++) {
        int i = part + DN_PARTS * r;
        s[r] = (live && i < dk) ? sp[(long long)i * dv + j] : 0.0f;
    }
    float decay_rate = expf(a_log[hv]);
    float q_scale = rsqrtf((float)dk);
    for (int t = 0; t < n_tok; t++) {
        const float* ct = c + (long long)t * conv_dim;
        float qq = 0.0f, kk = 0.0f;
        for (int i = threadIdx.x; i < dk; i += blockDim.x) {
            float qi = ct[hk * dk + i], ki = ct[key_dim + hk * dk + i];
            qq += qi * qi;
            kk += ki * ki;
        }
        qq = block_sum(qq);  // its barriers also end the previous token's reads of qs/ks
        kk = block_sum(kk);
        float qn = rsqrtf(qq + eps) * q_scale, kn = rsqrtf(kk + eps);
        for (int i = threadIdx.x; i < dk; i += blockDim.x) {
            qs[i] = ct[hk * dk + i] * qn;
            ks[i] = ct[key_dim + hk * dk + i] * kn;
        }
        __syncthreads();
        float beta = act(sigmoidf(b[(long long)t * ba_stride + hv]));
        float g = -decay_rate * softplusf(a[(long long)t * ba_stride + hv] + dt_bias[hv]);
        float alpha = expf(g);
        float v = live ? ct[2 * key_dim + hv * dv + j] : 0.0f;
        float u = 0.0f;
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            int i = part + DN_PARTS * r;
            if (i < dk) {
                s[r] *= alpha;
                u += s[r] * ks[i];
            }
        }
        for (int off = 1; off < DN_PARTS; off <<= 1) u += __shfl_xor_sync(0xffffffffu, u, off);
        float delta = beta * (v - u);
        float out = 0.0f;
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            int i = part + DN_PARTS * r;
            if (i < dk) {
                s[r] += ks[i] * delta;
                out += s[r] * qs[i];
            }
        }
        for (int off = 1; off < DN_PARTS; off <<= 1) out += __shfl_xor_sync(0xffffffffu, out, off);
        if (live && part == 0) o[(long long)t * n_v_heads * dv + (long long)hv * dv + j] = act(out);
    }
    if (live) {
#pragma unroll
        for (int r = 0; r < ROWS; r++) {
            int i = part + DN_PARTS * r;
            if (i < dk) sp[(long long)i * dv + j] = s[r];
        }
    }
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
