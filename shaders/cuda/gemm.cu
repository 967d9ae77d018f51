// Tensor-core linear layers for prefill chunks (bf16 activation mode): the same maps as
// linear_wide and linear_grouped in linear.cu, computed with mma.sync m16n8k16 (bf16 inputs,
// fp32 accumulation; sm_80 and later).
//
//   gemm_dense:   y[n, r] (+)= Σ_c W[r, c] x[n, c] for n < n_tok.
//   gemm_grouped: y[item, r] = Σ_c W_e[r, c] x[item / x_div, c] for the items of each tile
//                 (expert e, start, count) that moe_group built with tiles of up to BM items.
//
// A block computes a BM × BN tile of y (BM = 32 or 64 tokens or items, BN = 128 output rows)
// with 8 warps,
// stepping through the input dimension BK = 64 columns at a time:
//   - the activations of its BM rows (fp32 in memory, bf16-valued in this mode, so the conversion
//     is exact) are converted to bf16 into shared memory;
//   - the BN weight rows are read packed (4 or 8 bits, or bf16) and dequantised once per block to
//     bf16(scale · q + bias), i.e. the bf16 weight a bf16 reference model holds;
//   - warps (BM/32 along M × 8/(BM/32) along N) each own a 32 × WN piece: ldmatrix fragments,
//     MT × NT mma per 16 columns;
//   - the next k-step's global loads are issued before the current step's mma (registers), and
//     shared memory is double-buffered, so there is one barrier per k-step.
// The epilogue writes act(sum) (or act(y + act(sum)) with accumulate), as linear_rows does.
// Shapes: cols % 64 == 0, group % 32 == 0, bits ∈ {4, 8, 16}; the plan (plan.rs, gemm::fits) checks and otherwise uses
// the CUDA-core kernels. Dynamic shared memory: 2 · (BM + BN) · (BK + 8) · 2 bytes, and
// 2 · BN · (BK + 8) · 2 more for gemm_dense_exact's residue tiles.

#ifndef GEMM_BN
#error "GEMM_BN comes from the launcher module (crates/lily-cuda/src/kernels/gemm.rs)"
#endif
#ifndef GEMM_BK
#error "GEMM_BK comes from the launcher module (crates/lily-cuda/src/kernels/gemm.rs)"
#endif
#ifndef GEMM_THREADS
#error "GEMM_THREADS comes from the launcher module (crates/lily-cuda/src/kernels/gemm.rs)"
#endif
// GEMM_LDS: bf16 per shared row: 144 bytes, ldmatrix without bank conflicts
#ifndef GEMM_LDS
#error "GEMM_LDS comes from the launcher module (crates/lily-cuda/src/kernels/gemm.rs)"
#endif

// One thread's share of a k-step's weights: half a row (32 columns) of one output row.
// WORDS = 32 · bits / 32 packed u32 words; scale and bias of the group they fall in.
template <int BITS>
struct WSlice {
    static const int WORDS = BITS;  // 32 values · BITS bits / 32 bits per word
    uint4 v[WORDS / 4];
    float s, b;
};

template <int BITS>
__device__ __forceinline__ void w_load(const QWeight& w, long long row, bool live, int k0, WSlice<BITS>& ws) {
    if (!live) {
#pragma unroll
        for (int i = 0; i < WSlice<BITS>::WORDS / 4; i++) ws.v[i] = make_uint4(0, 0, 0, 0);
        ws.s = 0.0f;
        ws.b = 0.0f;
        return;
    }
    long long wpr = (long long)w.cols * BITS / 32;
    const uint4* src = reinterpret_cast<const uint4*>(w.q + row * wpr + (long long)k0 * BITS / 32);
#pragma unroll
    for (int i = 0; i < WSlice<BITS>::WORDS / 4; i++) ws.v[i] = src[i];
    if (BITS != 16) {
        long long g = row * (long long)(w.cols / w.group) + k0 / w.group;
        ws.s = bf16_to_f32(w.scales[g]);
        ws.b = bf16_to_f32(w.biases[g]);
    }
}

// Dequantises the slice to 32 bf16 (16 u32 pairs) and stores them at dst (16-byte aligned).
// EXACT: also the rounding residue bf16(w − bf16(w)) at lo, so hi + lo carries w to ~2⁻¹⁶.
template <int BITS, bool EXACT>
__device__ __forceinline__ void w_store(const WSlice<BITS>& ws, u16* dst, u16* lo) {
    u32 out[16], res[16];
    if (BITS == 16) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            out[4 * i] = ws.v[i].x;
            out[4 * i + 1] = ws.v[i].y;
            out[4 * i + 2] = ws.v[i].z;
            out[4 * i + 3] = ws.v[i].w;
        }
#pragma unroll
        for (int p = 0; p < 16; p++) res[p] = 0u;
    } else {
        const u32* words = reinterpret_cast<const u32*>(ws.v);
        const int PER = 32 / BITS;  // values per word
        const u32 MASK = (1u << BITS) - 1u;
#pragma unroll
        for (int p = 0; p < 16; p++) {
            int j0 = 2 * p, j1 = 2 * p + 1;
            u32 q0 = (words[j0 / PER] >> (BITS * (j0 % PER))) & MASK;
            u32 q1 = (words[j1 / PER] >> (BITS * (j1 % PER))) & MASK;
            float w0 = fmaf(ws.s, (float)q0, ws.b), w1 = fmaf(ws.s, (float)q1, ws.b);
            out[p] = pack_bf16x2(w0, w1);
            if (EXACT)
                res[p] = pack_bf16x2(w0 - bf16_to_f32((u16)(out[p] & 0xffffu)), w1 - bf16_to_f32((u16)(out[p] >> 16)));
        }
    }
    uint4* d = reinterpret_cast<uint4*>(dst);
#pragma unroll
    for (int i = 0; i < 4; i++) d[i] = make_uint4(out[4 * i], out[4 * i + 1], out[4 * i + 2], out[4 * i + 3]);
    if (EXACT) {
        uint4* l = reinterpret_cast<uint4*>(lo);
#pragma unroll
        for (int i = 0; i < 4; i++) l[i] = make_uint4(res[4 * i], res[4 * i + 1], res[4 * i + 2], res[4 * i + 3]);
    }
}

// The block's activations: BM rows × BK floats per k-step, F = BM · BK / THREADS per thread.
template <int BM>
struct XSlice {
    static const int F = BM * GEMM_BK / GEMM_THREADS;  // 16 or 8 for BM 64, 32
    float4 v[F / 4];
};

template <int BM>
__device__ __forceinline__ void x_load(const float* __restrict__ x, int x_stride, const int* src_rows, int k0,
                                       XSlice<BM>& xs) {
    const int F = XSlice<BM>::F;
    int t = threadIdx.x;
    int r = t / (GEMM_BK / F), c = (t % (GEMM_BK / F)) * F;
    int src = src_rows[r];
    if (src < 0) {
#pragma unroll
        for (int i = 0; i < F / 4; i++) xs.v[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        return;
    }
    const float4* p = reinterpret_cast<const float4*>(x + (long long)src * x_stride + k0 + c);
#pragma unroll
    for (int i = 0; i < F / 4; i++) xs.v[i] = p[i];
}

template <int BM>
__device__ __forceinline__ void x_store(const XSlice<BM>& xs, u16* a_tile) {
    const int F = XSlice<BM>::F;
    int t = threadIdx.x;
    int r = t / (GEMM_BK / F), c = (t % (GEMM_BK / F)) * F;
    uint4* d = reinterpret_cast<uint4*>(a_tile + r * GEMM_LDS + c);
#pragma unroll
    for (int i = 0; i < F / 8; i++) {
        float4 a = xs.v[2 * i], b = xs.v[2 * i + 1];
        d[i] = make_uint4(pack_bf16x2(a.x, a.y), pack_bf16x2(a.z, a.w), pack_bf16x2(b.x, b.y), pack_bf16x2(b.z, b.w));
    }
}

// The block body. src_rows / dst_rows (shared, BM entries): the activation row each tile row
// reads and the output row it writes (-1: padding). w_row0: the first weight row of this
// expert's matrix; n0: the block's first output row (within the matrix).
template <int BM, int BITS, bool EXACT>
__device__ __forceinline__ void gemm_tile(const QWeight& w, long long w_row0, int n0, const float* __restrict__ x,
                                          int x_stride, const int* src_rows, const int* dst_rows,
                                          float* __restrict__ y, int y_stride, int accumulate, u16* smem) {
    const int WARPS_M = BM / 32, WARPS_N = 8 / WARPS_M;
    const int WN = GEMM_BN / WARPS_N;  // 32 or 16 for BM 64, 32
    const int MT = 2, NT = WN / 8;
    u16* a_buf[2] = {smem, smem + BM * GEMM_LDS};
    u16* b_buf[2] = {smem + 2 * BM * GEMM_LDS, smem + 2 * BM * GEMM_LDS + GEMM_BN * GEMM_LDS};
    // EXACT: the weights' bf16 residues, two more B tiles after the first two.
    u16* b_lo[2] = {smem + 2 * BM * GEMM_LDS + 2 * GEMM_BN * GEMM_LDS,
                    smem + 2 * BM * GEMM_LDS + 3 * GEMM_BN * GEMM_LDS};
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int warp_m = warp / WARPS_N, warp_n = warp % WARPS_N;

    // This thread's weight slice: row n0 + t/2, columns (t%2)·32 .. +32 of each k-step.
    int b_r = threadIdx.x >> 1, b_c = (threadIdx.x & 1) * 32;
    bool b_live = n0 + b_r < w.rows;
    long long b_row = w_row0 + n0 + b_r;

    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; i++)
#pragma unroll
        for (int j = 0; j < NT; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0f;

    XSlice<BM> xs;
    WSlice<BITS> ws;
    x_load<BM>(x, x_stride, src_rows, 0, xs);
    w_load<BITS>(w, b_row, b_live, b_c, ws);
    x_store<BM>(xs, a_buf[0]);
    w_store<BITS, EXACT>(ws, b_buf[0] + b_r * GEMM_LDS + b_c, b_lo[0] + b_r * GEMM_LDS + b_c);
    __syncthreads();

    int steps = w.cols / GEMM_BK;
    for (int s = 0; s < steps; s++) {
        int cur = s & 1;
        bool more = s + 1 < steps;
        if (more) {
            int k1 = (s + 1) * GEMM_BK;
            x_load<BM>(x, x_stride, src_rows, k1, xs);
            w_load<BITS>(w, b_row, b_live, k1 + b_c, ws);
        }
        const u16* at = a_buf[cur];
        const u16* bt = b_buf[cur];
#pragma unroll
        for (int kk = 0; kk < GEMM_BK; kk += 16) {
            u32 af[MT][4];
#pragma unroll
            for (int i = 0; i < MT; i++) {
                int row = warp_m * 32 + i * 16 + (lane & 15);
                int col = kk + (lane >> 4) * 8;
                ldsm_x4(smem_addr(at + row * GEMM_LDS + col), af[i]);
            }
#pragma unroll
            for (int j = 0; j < NT; j += 2) {
                int row = warp_n * WN + j * 8 + (lane & 7) + ((lane >> 4) << 3);
                int col = kk + ((lane >> 3) & 1) * 8;
                u32 bf[4];
                ldsm_x4(smem_addr(bt + row * GEMM_LDS + col), bf);
#pragma unroll
                for (int i = 0; i < MT; i++) {
                    mma_bf16(acc[i][j], af[i], bf[0], bf[1]);
                    mma_bf16(acc[i][j + 1], af[i], bf[2], bf[3]);
                }
                if (EXACT) {
                    ldsm_x4(smem_addr(b_lo[cur] + row * GEMM_LDS + col), bf);
#pragma unroll
                    for (int i = 0; i < MT; i++) {
                        mma_bf16(acc[i][j], af[i], bf[0], bf[1]);
                        mma_bf16(acc[i][j + 1], af[i], bf[2], bf[3]);
                    }
                }
            }
        }
        if (more) {
            x_store<BM>(xs, a_buf[cur ^ 1]);
            w_store<BITS, EXACT>(ws, b_buf[cur ^ 1] + b_r * GEMM_LDS + b_c, b_lo[cur ^ 1] + b_r * GEMM_LDS + b_c);
        }
        __syncthreads();
    }

    // Epilogue: acc[i][j][0..1] at (row lane/4, cols 2·(lane%4) + 0..1), [2..3] eight rows down.
#pragma unroll
    for (int i = 0; i < MT; i++) {
#pragma unroll
        for (int half = 0; half < 2; half++) {
            int tr = warp_m * 32 + i * 16 + (lane >> 2) + half * 8;
            int dst = dst_rows[tr];
            if (dst < 0) continue;
            float* yr = y + (long long)dst * y_stride;
#pragma unroll
            for (int j = 0; j < NT; j++) {
                int r = n0 + warp_n * WN + j * 8 + 2 * (lane & 3);
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    if (r + e < w.rows) {
                        float v = EXACT ? acc[i][j][2 * half + e] : act(acc[i][j][2 * half + e]);
                        yr[r + e] = accumulate ? act(yr[r + e] + v) : v;
                    }
                }
            }
        }
    }
}

template <int BM, bool EXACT = false>
__device__ __forceinline__ void gemm_dispatch(const QWeight& w, long long w_row0, int n0, const float* x, int x_stride,
                                              const int* src_rows, const int* dst_rows, float* y, int y_stride,
                                              int accumulate, u16* smem) {
    if (w.bits == 4)
        gemm_tile<BM, 4, EXACT>(w, w_row0, n0, x, x_stride, src_rows, dst_rows, y, y_stride, accumulate, smem);
    else if (w.bits == 8)
        gemm_tile<BM, 8, EXACT>(w, w_row0, n0, x, x_stride, src_rows, dst_rows, y, y_stride, accumulate, smem);
    else
        gemm_tile<BM, 16, EXACT>(w, w_row0, n0, x, x_stride, src_rows, dst_rows, y, y_stride, accumulate, smem);
}

// grid (ceil(rows / BN), ceil(n_tok / 64)); 64 tokens per block. (128-token tiles were measured
// slower on the H200: fewer blocks per SM and a ragged last wave.)
template <bool EXACT>
__device__ __forceinline__ void gemm_dense_body(const QWeight& w, const float* __restrict__ x, int x_stride,
                                                float* __restrict__ y, int y_stride, int n_tok, int accumulate) {
    extern __shared__ __align__(16) u16 gemm_smem[];
    __shared__ int src_rows[64], dst_rows[64];
    int m0 = blockIdx.y * 64;
    if (threadIdx.x < 64) {
        int n = m0 + threadIdx.x;
        src_rows[threadIdx.x] = n < n_tok ? n : -1;
        dst_rows[threadIdx.x] = n < n_tok ? n : -1;
    }
    __syncthreads();
    gemm_dispatch<64, EXACT>(w, 0, blockIdx.x * GEMM_BN, x, x_stride, src_rows, dst_rows, y, y_stride, accumulate,
                             gemm_smem);
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
gemm_dense(QWeight w, const float* __restrict__ x, int x_stride, float* __restrict__ y, int y_stride, int n_tok,
           int accumulate) {
    gemm_dense_body<false>(w, x, x_stride, y, y_stride, n_tok, accumulate);
}

// The MoE router: y = W x with the weights as hi + lo bf16 pairs (two mma per fragment) and the
// sums stored unrounded. x must be bf16-valued (it is in this mode), so the products are those
// of the fp32 weights to ~2⁻¹⁶: routing as in the fp32 model, on tensor cores.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
gemm_dense_exact(QWeight w, const float* __restrict__ x, int x_stride, float* __restrict__ y, int y_stride,
                 int n_tok) {
    gemm_dense_body<true>(w, x, x_stride, y, y_stride, n_tok, 0);
}

// grid (ceil(rows / BN), max_tiles); tiles [..][3] = (expert, start in perm, count ≤ bm), bm = 32
// or 64 (the tile size moe_group was given); blocks past *n_tiles exit.
template <int BM>
__device__ __forceinline__ void gemm_grouped_body(const QWeight& w, const int* __restrict__ perm,
                                                  const int* __restrict__ tiles, const int* __restrict__ n_tiles,
                                                  const float* __restrict__ x, int x_stride, int x_div,
                                                  float* __restrict__ y, int y_stride) {
    extern __shared__ __align__(16) u16 gemm_smem[];
    __shared__ int src_rows[BM], dst_rows[BM];
    int t = blockIdx.y;
    if (t >= *n_tiles) return;
    int e = tiles[3 * t], start = tiles[3 * t + 1], cnt = tiles[3 * t + 2];
    if (threadIdx.x < BM) {
        int item = threadIdx.x < cnt ? perm[start + threadIdx.x] : -1;
        src_rows[threadIdx.x] = item < 0 ? -1 : item / x_div;
        dst_rows[threadIdx.x] = item;
    }
    __syncthreads();
    gemm_dispatch<BM>(w, (long long)e * w.rows, blockIdx.x * GEMM_BN, x, x_stride, src_rows, dst_rows, y, y_stride,
                      0, gemm_smem);
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
gemm_grouped64(QWeight w, const int* __restrict__ perm, const int* __restrict__ tiles,
               const int* __restrict__ n_tiles, const float* __restrict__ x, int x_stride, int x_div,
               float* __restrict__ y, int y_stride) {
    gemm_grouped_body<64>(w, perm, tiles, n_tiles, x, x_stride, x_div, y, y_stride);
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
gemm_grouped32(QWeight w, const int* __restrict__ perm, const int* __restrict__ tiles,
               const int* __restrict__ n_tiles, const float* __restrict__ x, int x_stride, int x_div,
               float* __restrict__ y, int y_stride) {
    gemm_grouped_body<32>(w, perm, tiles, n_tiles, x, x_stride, x_div, y, y_stride);
}
