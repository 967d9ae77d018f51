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
                                          float* __restrict__ y, int y_stride, int accumulate, u16* smem,
                                          int s0, int s1) {
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
    x_load<BM>(x, x_stride, src_rows, s0 * GEMM_BK, xs);
    w_load<BITS>(w, b_row, b_live, s0 * GEMM_BK + b_c, ws);
    x_store<BM>(xs, a_buf[0]);
    w_store<BITS, EXACT>(ws, b_buf[0] + b_r * GEMM_LDS + b_c, b_lo[0] + b_r * GEMM_LDS + b_c);
    __syncthreads();

    for (int s = s0; s < s1; s++) {
        int cur = (s - s0) & 1;
        bool more = s + 1 < s1;
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

// k-steps s0 .. s1 − 1 (of BK columns); by default all of them.
template <int BM, bool EXACT = false>
__device__ __forceinline__ void gemm_dispatch(const QWeight& w, long long w_row0, int n0, const float* x, int x_stride,
                                              const int* src_rows, const int* dst_rows, float* y, int y_stride,
                                              int accumulate, u16* smem, int s0 = 0, int s1 = -1) {
    if (s1 < 0) s1 = w.cols / GEMM_BK;
    if (w.bits == 4)
        gemm_tile<BM, 4, EXACT>(w, w_row0, n0, x, x_stride, src_rows, dst_rows, y, y_stride, accumulate, smem, s0, s1);
    else if (w.bits == 8)
        gemm_tile<BM, 8, EXACT>(w, w_row0, n0, x, x_stride, src_rows, dst_rows, y, y_stride, accumulate, smem, s0, s1);
    else
        gemm_tile<BM, 16, EXACT>(w, w_row0, n0, x, x_stride, src_rows, dst_rows, y, y_stride, accumulate, smem, s0,
                                 s1);
}

// grid (ceil(rows / BN), ceil(n_tok / 64)); 64 tokens per block. (128-token tiles were measured
// slower on the H200: fewer blocks per SM and a ragged last wave.)
template <bool EXACT>
__device__ __forceinline__ void gemm_dense_body(const QWeight& w, const float* __restrict__ x, int x_stride,
                                                float* __restrict__ y, int y_stride, int n_tok, int accumulate,
                                                int s0 = 0, int s1 = -1) {
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
                             gemm_smem, s0, s1);
}

extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
gemm_dense(QWeight w, const float* __restrict__ x, int x_stride, float* __restrict__ y, int y_stride, int n_tok,
           int accumulate) {
    gemm_dense_body<false>(w, x, x_stride, y, y_stride, n_tok, accumulate);
}

// The MoE router: y = W x with the weights as hi + lo bf16 pairs (two mma per fragment) and the
// sums stored unrounded. x must be bf16-valued (it is in this mode), so the products are those
// of the fp32 weights to ~2⁻¹⁶: routing as in the fp32 model, on tensor cores.
// Split over the columns (the plan's `router_split_k`) when the grid is deep (gridDim.z parts):
// part z takes an equal run of the k-steps and writes its unrounded partial sums to
// y + z · part_stride (rows of y_stride); gemm_sum_parts then adds the parts in order. A chunk of
// 512 tokens has only 16 blocks of 64 tokens × 128 experts, each stepping through all 2,048
// columns in sequence; in parts, more blocks share the k-steps.
extern "C" __global__ void __launch_bounds__(GEMM_THREADS)
gemm_dense_exact(QWeight w, const float* __restrict__ x, int x_stride, float* __restrict__ y, int y_stride,
                 int n_tok, long long part_stride) {
    int steps = w.cols / GEMM_BK, per = (steps + gridDim.z - 1) / gridDim.z;
    int s0 = min(steps, (int)blockIdx.z * per), s1 = min(steps, s0 + per);
    gemm_dense_body<true>(w, x, x_stride, y + blockIdx.z * part_stride, y_stride, n_tok, 0, s0, s1);
}

// y[n, r] = Σ_z parts[z · part_stride + n · cols + r] for n < n_tok, r < cols, z in order.
extern "C" __global__ void gemm_sum_parts(const float* __restrict__ parts, int n_parts, long long part_stride,
                                          float* __restrict__ y, int y_stride, int cols, int n_tok) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n_tok * cols) return;
    int n = (int)(i / cols), r = (int)(i % cols);
    float s = parts[i];
    for (int z = 1; z < n_parts; z++) s += parts[z * part_stride + i];
    y[(long long)n * y_stride + r] = s;
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

// ---- Hopper (sm_90a): warpgroup MMA --------------------------------------------------------------
// gemm_dense_wgb (TOK = 128), gemm_dense_wgb256 (TOK = 256) / gemm_grouped_wgb32, _wgb64, _wgb128
// (TOK = 32, 64, 128):
// gemm_dense and gemm_grouped for 4-bit weights with wgmma (the plan's `wgmma_gemm`, sm_90a), on
// activations the forward pass staged as bf16 rows (`to_bf16` below; bf16-valued in this mode, so
// exactly). A block computes WG_ROWS = 128 weight rows × TOK tokens (items) with two warpgroups
// (256 threads), each 64 rows: per 16 columns one wgmma.m64n{TOK}k16 with
//   A = the weights, dequantised straight into the MMA's register fragments (bf16(scale·q + bias), as
//     gemm_dense's w_store makes them): thread (g, t) of warp w holds, per 16-column slice s, columns
//     16s + 2t, +1 (byte t of the step's packed word 2s) and 16s + 2t + 8, +9 (byte t of word 2s + 1)
//     of rows 16w + g and + 8; it reads its rows' 32 bytes and picks the bytes with prmt, and a
//     4-bit value becomes a float by its exponent (0x4B000000 | q is 2^23 + q), with no
//     integer-to-float conversion (the _lean variants, `wgmma_lean_dequant`: the same values from
//     fewer instructions, wgb_dequant's LEAN);
//   B = the tokens' activations, K-major in shared memory with the 128-byte swizzle (a token's 64
//     columns of a k-step are one 128-byte row), copied by cp.async straight into that layout
//     (16-byte chunk c of token n at chunk c ^ (n % 8)) and read by the MMA through a descriptor.
// Pipeline: a ring of STAGES k-steps (WGB_STAGES; WGB32_STAGES for TOK = 32) of activations and
// packed weights, issued STAGES − 1 steps ahead; step st + 1's MMAs are issued while step st's
// run (wait_group 1), step st + 1's fragments are dequantised meanwhile, and the ring slot of step
// st − 1 is refilled once both warpgroups have passed it: one barrier a step. Scales and biases of the block's rows sit in
// shared memory group-major (consecutive rows in consecutive banks). The epilogue is
// gemm_dense's / gemm_grouped's: act(sum), or act(y + act(sum)) with accumulate (dense only).
// Limits (the launcher checks, `wg_fits`): bits 4, cols % 128 == 0 (an even number of k-steps: the
// main loop takes two a turn with no branch between the MMAs, which would make ptxas serialise
// them), a group of a power of two ≥ 16 (a slice's group by a shift), cols / group ≤ 64.
// Dynamic shared memory (wgb_smem in the launcher): 1 KB of alignment slack, the ring STAGES ×
// (TOK × 128 + 128 × 32 bytes), the (scale, bias) pairs 128 × (cols / group) × 4.
// History: session 6's gemm_dense_wg converted fp32 activations inside each block and waited for
// each step's MMAs: 141 TFLOP/s on the H200 where these reach 252 (TOK 128) and 335 (TOK 256).
#ifndef WGB_STAGES
#error "WGB_STAGES comes from the launcher module (crates/lily-cuda/src/kernels/gemm.rs)"
#endif
#define WG_ROWS 128

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The kernels' dynamic shared memory (wgb_tile aligns it to 1024 bytes).
extern __shared__ __align__(16) char wg_raw[];

// d (64 × TOK f32, the warpgroup's accumulator fragment) += A (64 × 16 bf16, registers) · B (16 ×
// TOK bf16, shared memory through `desc`).
template <int TOK>
__device__ __forceinline__ void wgmma_tok(float (&d)[TOK / 2], const u32 (&a)[4], unsigned long long desc);
template <>
__device__ __forceinline__ void wgmma_tok<32>(float (&d)[16], const u32 (&a)[4], unsigned long long desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
        "{%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
template <>
__device__ __forceinline__ void wgmma_tok<64>(float (&d)[32], const u32 (&a)[4], unsigned long long desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}
template <>
__device__ __forceinline__ void wgmma_tok<128>(float (&d)[64], const u32 (&a)[4], unsigned long long desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
        "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

template <>
__device__ __forceinline__ void wgmma_tok<256>(float (&d)[128], const u32 (&a)[4], unsigned long long desc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
        "{%128, %129, %130, %131}, %132, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
}

// The block's sums out: d[4j + e] is row 16·warp + lane/4 (+ 8 for e ≥ 2) of the warpgroup's 64,
// token slot 8j + 2·(lane % 4) + e % 2; act(sum), or act(y + act(sum)) with accumulate.
template <int TOK>
__device__ __forceinline__ void wg_store(const float (&d)[TOK / 2], int m0, int rows, const int* dst,
                                         float* __restrict__ y, int y_stride, int accumulate) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int r0 = m0 + (warp >> 2) * 64 + (warp & 3) * 16 + (lane >> 2);
#pragma unroll
    for (int j = 0; j < TOK / 8; j++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
            int r = r0 + 8 * (e >> 1), out = dst[8 * j + 2 * (lane & 3) + (e & 1)];
            if (r < rows && out >= 0) {
                float* yp = y + (long long)out * y_stride + r;
                float v = act(d[4 * j + e]);
                *yp = accumulate ? act(*yp + v) : v;
            }
        }
    }
}

#endif

// y[r, c] = bf16(x[r, c]) for r < rows, c < cols (cols % 8 == 0); y's rows are cols long.
extern "C" __global__ void to_bf16(const float* __restrict__ x, int x_stride, u16* __restrict__ y, int cols,
                                   int rows) {
    int per_row = cols / 8;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)per_row * rows) return;
    int r = (int)(i / per_row), c = (int)(i % per_row) * 8;
    const float4* src = reinterpret_cast<const float4*>(x + (long long)r * x_stride + c);
    float4 a = src[0], b = src[1];
    *reinterpret_cast<uint4*>(y + (long long)r * cols + c) =
        make_uint4(pack_bf16x2(a.x, a.y), pack_bf16x2(a.z, a.w), pack_bf16x2(b.x, b.y), pack_bf16x2(b.z, b.w));
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
template <int TOK>
struct Wgb {
    static const int XB = TOK * 128;              // a stage's activations
    static const int STAGE = XB + WG_ROWS * 32;   // ... and packed weights
};

// Step `st` (activations and packed weights) into ring slot `slot`; the caller commits the group.
template <int TOK>
__device__ __forceinline__ void wgb_issue(const QWeight& w, long long w_row0, int m0, const u16* __restrict__ x,
                                          int x_stride, const int* src, char* ring, int st, int slot) {
    char* xs = ring + slot * Wgb<TOK>::STAGE;
    int k0 = st * 64;
#pragma unroll
    for (int it = 0; it < TOK / 32; it++) {
        int i = threadIdx.x + it * 256;
        int n = i >> 3, c = i & 7;
        int sr = src[n];
        if (sr >= 0) cp_async16(xs + n * 128 + ((c ^ (n & 7)) << 4), x + (long long)sr * x_stride + k0 + 8 * c);
    }
    int r = threadIdx.x >> 1, h = threadIdx.x & 1;
    long long row = w_row0 + min(m0 + r, w.rows - 1);
    const char* wsrc = reinterpret_cast<const char*>(w.q) + row * (w.cols / 2) + k0 / 2 + 16 * h;
    cp_async16(xs + Wgb<TOK>::XB + r * 32 + 16 * h, wsrc);
}

// wgb_issue's per-thread sources and destinations, the same every k-step: the _lean variants
// compute them once a block (wgb_src) where wgb_issue recomputes them a step (src[n] from shared
// memory, the swizzle, 64-bit row addresses).
template <int TOK>
struct WgbSrc {
    const u16* xp[TOK / 32];  // the activation row's 8 columns this thread copies (k-step 0), or null
    int xo[TOK / 32];         // their 16-byte chunk in a stage
    const char* wp;           // the weight row's 16 bytes this thread copies (k-step 0)
    int wo;
};

template <int TOK>
__device__ __forceinline__ void wgb_src(const QWeight& w, long long w_row0, int m0, const u16* __restrict__ x,
                                        int x_stride, const int* src, WgbSrc<TOK>& p) {
#pragma unroll
    for (int it = 0; it < TOK / 32; it++) {
        int i = threadIdx.x + it * 256;
        int n = i >> 3, c = i & 7;
        int sr = src[n];
        p.xp[it] = sr >= 0 ? x + (long long)sr * x_stride + 8 * c : nullptr;
        p.xo[it] = n * 128 + ((c ^ (n & 7)) << 4);
    }
    int r = threadIdx.x >> 1, h = threadIdx.x & 1;
    long long row = w_row0 + min(m0 + r, w.rows - 1);
    p.wp = reinterpret_cast<const char*>(w.q) + row * (w.cols / 2) + 16 * h;
    p.wo = Wgb<TOK>::XB + r * 32 + 16 * h;
}

// wgb_issue from wgb_src's addresses.
template <int TOK>
__device__ __forceinline__ void wgb_issue_at(const WgbSrc<TOK>& p, char* ring, int st, int slot) {
    char* xs = ring + slot * Wgb<TOK>::STAGE;
#pragma unroll
    for (int it = 0; it < TOK / 32; it++)
        if (p.xp[it]) cp_async16(xs + p.xo[it], p.xp[it] + st * 64);
    cp_async16(xs + p.wo, p.wp + st * 32);
}

// The float 2^23 + (v & MASK) (MASK: one nibble of bits 0-15) in one LOP3: written out,
// `(v & MASK) | 0x4B000000` takes two (a LOP3 has one immediate); here the exponent is a register.
template <u32 MASK>
__device__ __forceinline__ float wgb_magic(u32 v, u32 exponent) {
#if defined(__CUDA_ARCH__)
    u32 d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(v), "n"(MASK), "r"(exponent));  // (a & b) | c
    return __uint_as_float(d);
#else
    return __uint_as_float((v & MASK) | exponent);
#endif
}

// A 4-bit value q (bits 0-3 of v) as a float.
__device__ __forceinline__ float wgb_q(u32 v) { return __uint_as_float(0x4B000000u | (v & 15u)) - 8388608.0f; }

// Step `st`'s weight fragments from ring slot `slot` into a[4][4] (slice s: a[s]). sb: the
// block's (scale, bias) pairs, group-major; gsh: log2 of the 16-column slices a group.
// LEAN (the plan's `wgmma_lean_dequant`; groups of ≥ 64 columns, so a k-step is one group a row):
// the same bf16(fma(scale, q, bias)) from fewer instructions: the row's (scale, bias) pair is
// read and unpacked once a step, not once a slice; nibble k of the picked word stays in place, as
// the float 2^23 + q·16^k (one LOP3: mask and exponent), and one FFMA by 16^-k less 2^(23−4k)
// makes q exactly (the product is exact, the difference is q) where the old path shifted, masked
// and subtracted 2^23 (SHF + LOP3 + FADD).
template <int TOK, bool LEAN>
__device__ __forceinline__ void wgb_dequant(const char* ring, const u32* sb, int gsh, int st, int slot,
                                            u32 (&a)[4][4]) {
    const char* ws = ring + slot * Wgb<TOK>::STAGE + Wgb<TOK>::XB;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    int r0 = (warp >> 2) * 64 + (warp & 3) * 16 + g;
    u32 sel = (u32)t | ((u32)(t + 4) << 4);  // byte t of the first word, then byte t of the second
    u32 ex = 0x4B000000u;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        int r = r0 + 8 * h;
        uint4 lo = *reinterpret_cast<const uint4*>(ws + r * 32);
        uint4 hi = *reinterpret_cast<const uint4*>(ws + r * 32 + 16);
        u32 wd[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        if (LEAN) {
            u32 p = sb[(st >> (gsh - 2)) * WG_ROWS + r];
            float sc = __uint_as_float(p << 16), bi = __uint_as_float(p & 0xffff0000u);
#pragma unroll
            for (int s = 0; s < 4; s++) {
                u32 b = __byte_perm(wd[2 * s], wd[2 * s + 1], sel);
                float q0 = wgb_magic<0xfu>(b, ex) - 8388608.0f;
                float q1 = fmaf(wgb_magic<0xf0u>(b, ex), 0.0625f, -524288.0f);
                float q2 = fmaf(wgb_magic<0xf00u>(b, ex), 0.00390625f, -32768.0f);
                float q3 = fmaf(wgb_magic<0xf000u>(b, ex), 0.000244140625f, -2048.0f);
                a[s][h] = pack_bf16x2(fmaf(sc, q0, bi), fmaf(sc, q1, bi));      // 2t, 2t + 1
                a[s][2 + h] = pack_bf16x2(fmaf(sc, q2, bi), fmaf(sc, q3, bi));  // 2t + 8, + 9
            }
        } else {
#pragma unroll
            for (int s = 0; s < 4; s++) {
                u32 p = sb[((st * 4 + s) >> gsh) * WG_ROWS + r];
                float sc = bf16_to_f32((u16)(p & 0xffffu)), bi = bf16_to_f32((u16)(p >> 16));
                u32 b = __byte_perm(wd[2 * s], wd[2 * s + 1], sel);
                a[s][h] = pack_bf16x2(fmaf(sc, wgb_q(b), bi), fmaf(sc, wgb_q(b >> 4), bi));           // 2t, 2t + 1
                a[s][2 + h] = pack_bf16x2(fmaf(sc, wgb_q(b >> 8), bi), fmaf(sc, wgb_q(b >> 12), bi));  // 2t + 8, + 9
            }
        }
    }
}

// One k-step: its four wgmma from ring slot st % STAGES and fragments `a`; then, while they run,
// the ring's next request and step st + 1's fragments into `an`.
template <int TOK, int STAGES, bool LEAN>
__device__ __forceinline__ void wgb_step(const QWeight& w, long long w_row0, int m0, const u16* __restrict__ x,
                                         int x_stride, const int* src, char* ring, const u32* sb, int gsh, int st,
                                         int steps, float (&d)[TOK / 2], u32 (&a)[4][4], u32 (&an)[4][4],
                                         const WgbSrc<TOK>& pre) {
    u32 cur = smem_addr(ring + (st % STAGES) * Wgb<TOK>::STAGE);
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < 4; s++) wgmma_tok<TOK>(d, a[s], wg_desc(cur + 32 * s));
    wgmma_commit();
    cp_async_wait<STAGES - 3>();  // this thread's copies of step st + 1
    fence_proxy_async();
    wgmma_wait1();  // this warpgroup's step st − 1: `an` and slot (st − 1) % STAGES are free
    __syncthreads();
    int ahead = st + STAGES - 1;
    if (ahead < steps) {
        if (LEAN)
            wgb_issue_at<TOK>(pre, ring, ahead, ahead % STAGES);
        else
            wgb_issue<TOK>(w, w_row0, m0, x, x_stride, src, ring, ahead, ahead % STAGES);
    }
    cp_async_commit();
    if (st + 1 < steps) wgb_dequant<TOK, LEAN>(ring, sb, gsh, st + 1, (st + 1) % STAGES, an);
}

// The block: rows m0 .. m0 + 127 of the matrix at w_row0 (an expert's first row, or 0), token slots
// src / dst (shared, TOK each: the activation row each slot reads and the output row it writes, -1:
// none; the caller fills them, the first barrier below publishes them); a ring of STAGES k-steps.
template <int TOK, int STAGES, bool LEAN>
__device__ __forceinline__ void wgb_tile(const QWeight& w, long long w_row0, int m0, const u16* __restrict__ x,
                                         int x_stride, const int* src, const int* dst, float* __restrict__ y,
                                         int y_stride, int accumulate, char* raw) {
    char* ring = raw + ((1024 - (smem_addr(raw) & 1023)) & 1023);
    u32* sb = reinterpret_cast<u32*>(ring + STAGES * Wgb<TOK>::STAGE);
    int groups = w.cols / w.group, steps = w.cols / 64, gsh = __ffs(w.group >> 4) - 1;
    for (int i = threadIdx.x; i < WG_ROWS * groups; i += blockDim.x) {
        int r = i & (WG_ROWS - 1), gi = i / WG_ROWS;
        long long at = (w_row0 + min(m0 + r, w.rows - 1)) * groups + gi;
        sb[i] = (u32)w.scales[at] | ((u32)w.biases[at] << 16);
    }
    __syncthreads();  // src (the caller's) before the first requests
    WgbSrc<TOK> pre;
    if (LEAN) wgb_src<TOK>(w, w_row0, m0, x, x_stride, src, pre);
    for (int st = 0; st < STAGES - 1; st++) {
        if (st < steps) {
            if (LEAN)
                wgb_issue_at<TOK>(pre, ring, st, st);
            else
                wgb_issue<TOK>(w, w_row0, m0, x, x_stride, src, ring, st, st);
        }
        cp_async_commit();
    }
    float d[TOK / 2];
#pragma unroll
    for (int i = 0; i < TOK / 2; i++) d[i] = 0.0f;
    u32 a0[4][4], a1[4][4];
    cp_async_wait<STAGES - 2>();
    fence_proxy_async();
    __syncthreads();
    wgb_dequant<TOK, LEAN>(ring, sb, gsh, 0, 0, a0);
    for (int st = 0; st < steps; st += 2) {  // steps is even: no branch between the MMAs
        wgb_step<TOK, STAGES, LEAN>(w, w_row0, m0, x, x_stride, src, ring, sb, gsh, st, steps, d, a0, a1, pre);
        wgb_step<TOK, STAGES, LEAN>(w, w_row0, m0, x, x_stride, src, ring, sb, gsh, st + 1, steps, d, a1, a0, pre);
    }
    wgmma_wait0();
#pragma unroll
    for (int i = 0; i < TOK / 2; i++) asm volatile("" : "+f"(d[i])::"memory");
    wg_store<TOK>(d, m0, w.rows, dst, y, y_stride, accumulate);
}

// ---- HOIST: the _lean k-step with its addresses held in registers (the plan's
// `wgmma_hoisted_addrs`; the _hoist kernels below) ----
// The _lean loop's SASS (session 23) spends ≈ 130 of its 265 instructions a thread a k-step
// (gemm_grouped_wgb64_lean) outside the dequantisation: ptxas rematerialises wgb_src's swizzled
// offsets and the fragments' row address from the thread index every step (S2R, shifts, masks),
// makes the copies' shared destinations 64-bit generic addresses, the ring slot `st % STAGES`
// three times a step by a multiply-shift, each of the four wgmma descriptors by mask-shift-or,
// and the dequantisation's constants by moves. Here, with the same copies, MMAs and arithmetic
// in the same order (bit-identical outputs):
// - every per-thread value (the copies' sources and their destinations in a stage as 32-bit
//   shared addresses; the fragments' row in a stage, their prmt selector; the row's (scale,
//   bias) index) is computed once a block and pinned (wgb_pin: an empty asm NVVM cannot see
//   through, so the loop reuses the register instead of recomputing it from the thread index;
//   ptxas still rematerialises the dequantisation's four constants, 4 moves a step);
// - the ring slots are byte offsets rotated by an add and a wrap (the slot read, the slot being
//   refilled = the one read a step ago, the slot dequantised next);
// - a descriptor is the ring's descriptor plus (slot offset + 32·s) / 16: the same 64 bits as
//   wg_desc(address), whose 14-bit address field cannot carry (shared addresses < 2^18);
// - a copy's "slot has a token" test is one bit of a mask (one LOP3 to a predicate), not a
//   64-bit null compare.
__device__ __forceinline__ void wgb_pin(u32& v) {
#if defined(__CUDA_ARCH__)
    asm volatile("" : "+r"(v));
#endif
}
template <typename T>
__device__ __forceinline__ void wgb_pin(const T*& v) {
#if defined(__CUDA_ARCH__)
    asm volatile("" : "+l"(v));
#endif
}

template <int TOK>
struct WgbHoist {
    const u16* xp[TOK / 32];  // the activation row's 8 columns this thread copies (k-step 0)
    u32 xo[TOK / 32];         // their 16-byte chunk's shared address in stage 0
    u32 live;                 // bit it: copy it has a token (xp[it] is valid)
    const char* wp;           // the weight row's 16 bytes this thread copies (k-step 0)
    u32 wo;                   // their shared address in stage 0
    u32 frag;                 // the byte offset in a stage of this thread's first fragment row
    u32 sbr;                  // its (scale, bias) pair's index in sb (group 0)
    u32 sel;                  // its bytes of a packed word pair (prmt's selector)
};

template <int TOK>
__device__ __forceinline__ void wgb_hoist(const QWeight& w, long long w_row0, int m0, const u16* __restrict__ x,
                                          int x_stride, const int* src, u32 ring_s, WgbHoist<TOK>& p) {
    p.live = 0;
#pragma unroll
    for (int it = 0; it < TOK / 32; it++) {
        int i = threadIdx.x + it * 256;
        int n = i >> 3, c = i & 7;
        int sr = src[n];
        p.xp[it] = x + (long long)max(sr, 0) * x_stride + 8 * c;
        p.live |= (u32)(sr >= 0) << it;
        p.xo[it] = ring_s + n * 128 + ((c ^ (n & 7)) << 4);
        wgb_pin(p.xp[it]);
        wgb_pin(p.xo[it]);
    }
    wgb_pin(p.live);
    int r = threadIdx.x >> 1, h = threadIdx.x & 1;
    long long row = w_row0 + min(m0 + r, w.rows - 1);
    p.wp = reinterpret_cast<const char*>(w.q) + row * (w.cols / 2) + 16 * h;
    p.wo = ring_s + Wgb<TOK>::XB + r * 32 + 16 * h;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int r0 = (warp >> 2) * 64 + (warp & 3) * 16 + (lane >> 2);
    p.frag = Wgb<TOK>::XB + r0 * 32;
    p.sbr = r0;
    u32 t = lane & 3;
    p.sel = t | ((t + 4) << 4);
    wgb_pin(p.wp);
    wgb_pin(p.wo);
    wgb_pin(p.frag);
    wgb_pin(p.sbr);
    wgb_pin(p.sel);
}

// Step `st`'s copies into the stage at shared-offset `so` from the ring (wgb_issue_at's).
template <int TOK>
__device__ __forceinline__ void wgb_issue_h(const WgbHoist<TOK>& p, u32 so, int st) {
#pragma unroll
    for (int it = 0; it < TOK / 32; it++)
        if (p.live & (1u << it)) cp_async16_s(p.xo[it] + so, p.xp[it] + st * 64);
    cp_async16_s(p.wo + so, p.wp + st * 32);
}

// wgb_dequant<TOK, true> from the stage at byte offset `so` of the ring: the same fragments.
template <int TOK>
__device__ __forceinline__ void wgb_dequant_h(const char* ring, const u32* sb, const WgbHoist<TOK>& p, int gsh,
                                              int st, u32 so, u32 (&a)[4][4]) {
    const char* ws = ring + so + p.frag;
    const u32* sbs = sb + p.sbr + (st >> (gsh - 2)) * WG_ROWS;
    u32 ex = 0x4B000000u;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        uint4 lo = *reinterpret_cast<const uint4*>(ws + 256 * h);
        uint4 hi = *reinterpret_cast<const uint4*>(ws + 256 * h + 16);
        u32 wd[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        u32 pr = sbs[8 * h];
        float sc = __uint_as_float(pr << 16), bi = __uint_as_float(pr & 0xffff0000u);
#pragma unroll
        for (int s = 0; s < 4; s++) {
            u32 b = __byte_perm(wd[2 * s], wd[2 * s + 1], p.sel);
            float q0 = wgb_magic<0xfu>(b, ex) - 8388608.0f;
            float q1 = fmaf(wgb_magic<0xf0u>(b, ex), 0.0625f, -524288.0f);
            float q2 = fmaf(wgb_magic<0xf00u>(b, ex), 0.00390625f, -32768.0f);
            float q3 = fmaf(wgb_magic<0xf000u>(b, ex), 0.000244140625f, -2048.0f);
            a[s][h] = pack_bf16x2(fmaf(sc, q0, bi), fmaf(sc, q1, bi));      // 2t, 2t + 1
            a[s][2 + h] = pack_bf16x2(fmaf(sc, q2, bi), fmaf(sc, q3, bi));  // 2t + 8, + 9
        }
    }
}

// The ring slot after the one at byte offset `o`.
template <int TOK, int STAGES>
__device__ __forceinline__ u32 wgb_next_slot(u32 o) {
    return o == (STAGES - 1) * Wgb<TOK>::STAGE ? 0u : o + Wgb<TOK>::STAGE;
}

// wgb_step's k-step: MMAs from the slot at `o_cur`, the refill of the slot at `o_prev` (step
// st − 1's, = (st + STAGES − 1) % STAGES), step st + 1's fragments from the slot at `o_next`.
template <int TOK, int STAGES>
__device__ __forceinline__ void wgb_step_h(const WgbHoist<TOK>& p, const char* ring, const u32* sb, u32 desc0,
                                           int gsh, int st,
                                           int steps, u32 o_prev, u32 o_cur, u32 o_next, float (&d)[TOK / 2],
                                           u32 (&a)[4][4], u32 (&an)[4][4]) {
    const unsigned long long hi = ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
    u32 dl = desc0 + (o_cur >> 4);
    wgmma_fence();
#pragma unroll
    for (int s = 0; s < 4; s++) wgmma_tok<TOK>(d, a[s], hi | (dl + 2 * s));
    wgmma_commit();
    cp_async_wait<STAGES - 3>();  // this thread's copies of step st + 1
    fence_proxy_async();
    wgmma_wait1();  // this warpgroup's step st − 1: `an` and the slot at o_prev are free
    __syncthreads();
    int ahead = st + STAGES - 1;
    if (ahead < steps) wgb_issue_h<TOK>(p, o_prev, ahead);
    cp_async_commit();
    if (st + 1 < steps) wgb_dequant_h<TOK>(ring, sb, p, gsh, st + 1, o_next, an);
}

// wgb_tile<TOK, STAGES, true> with HOIST's k-step: the same copies, MMAs and outputs.
template <int TOK, int STAGES>
__device__ __forceinline__ void wgb_tile_h(const QWeight& w, long long w_row0, int m0, const u16* __restrict__ x,
                                           int x_stride, const int* src, const int* dst, float* __restrict__ y,
                                           int y_stride, int accumulate, char* raw) {
    char* ring = raw + ((1024 - (smem_addr(raw) & 1023)) & 1023);
    u32* sb = reinterpret_cast<u32*>(ring + STAGES * Wgb<TOK>::STAGE);
    int groups = w.cols / w.group, steps = w.cols / 64, gsh = __ffs(w.group >> 4) - 1;
    for (int i = threadIdx.x; i < WG_ROWS * groups; i += blockDim.x) {
        int r = i & (WG_ROWS - 1), gi = i / WG_ROWS;
        long long at = (w_row0 + min(m0 + r, w.rows - 1)) * groups + gi;
        sb[i] = (u32)w.scales[at] | ((u32)w.biases[at] << 16);
    }
    __syncthreads();  // src (the caller's) before the first requests
    u32 ring_s = smem_addr(ring);
    u32 desc0 = (u32)wg_desc(ring_s);  // the descriptor's low word; its high word is constant
    WgbHoist<TOK> p;
    wgb_hoist<TOK>(w, w_row0, m0, x, x_stride, src, ring_s, p);
    for (int st = 0; st < STAGES - 1; st++) {
        if (st < steps) wgb_issue_h<TOK>(p, st * Wgb<TOK>::STAGE, st);
        cp_async_commit();
    }
    float d[TOK / 2];
#pragma unroll
    for (int i = 0; i < TOK / 2; i++) d[i] = 0.0f;
    u32 a0[4][4], a1[4][4];
    cp_async_wait<STAGES - 2>();
    fence_proxy_async();
    __syncthreads();
    wgb_dequant_h<TOK>(ring, sb, p, gsh, 0, 0, a0);
    u32 o_prev = (STAGES - 1) * Wgb<TOK>::STAGE, o_cur = 0;  // step −1's slot, step 0's
    for (int st = 0; st < steps; st += 2) {  // steps is even: no branch between the MMAs
        u32 o1 = wgb_next_slot<TOK, STAGES>(o_cur), o2 = wgb_next_slot<TOK, STAGES>(o1);
        wgb_step_h<TOK, STAGES>(p, ring, sb, desc0, gsh, st, steps, o_prev, o_cur, o1, d, a0, a1);
        wgb_step_h<TOK, STAGES>(p, ring, sb, desc0, gsh, st + 1, steps, o_cur, o1, o2, d, a1, a0);
        o_prev = o1;
        o_cur = o2;
    }
    wgmma_wait0();
#pragma unroll
    for (int i = 0; i < TOK / 2; i++) asm volatile("" : "+f"(d[i])::"memory");
    wg_store<TOK>(d, m0, w.rows, dst, y, y_stride, accumulate);
}
#endif

// grid (ceil(rows / 128), ceil(n_tok / TOK)); x: bf16 rows.
template <int TOK, bool LEAN>
__device__ __forceinline__ void dense_wg_body(const QWeight& w, const u16* __restrict__ x, int x_stride,
                                              float* __restrict__ y, int y_stride, int n_tok, int accumulate) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    __shared__ int rows[TOK];
    if (threadIdx.x < TOK) {
        int n = blockIdx.y * TOK + threadIdx.x;
        rows[threadIdx.x] = n < n_tok ? n : -1;
    }
    wgb_tile<TOK, WGB_STAGES, LEAN>(w, 0, blockIdx.x * WG_ROWS, x, x_stride, rows, rows, y, y_stride, accumulate,
                                    wg_raw);
#else
    __trap();
#endif
}

// 128 tokens a block.
extern "C" __global__ void __launch_bounds__(256, 1)
gemm_dense_wgb(QWeight w, const u16* __restrict__ x, int x_stride, float* __restrict__ y, int y_stride, int n_tok,
               int accumulate) {
    dense_wg_body<128, false>(w, x, x_stride, y, y_stride, n_tok, accumulate);
}

// gemm_dense_wgb with 256 tokens a block (wgmma.m64n256k16; the plan's `wgb_tok` = 256): half the
// weight dequantisation and weight traffic a product, 128 accumulators a thread.
extern "C" __global__ void __launch_bounds__(256, 1)
gemm_dense_wgb256(QWeight w, const u16* __restrict__ x, int x_stride, float* __restrict__ y, int y_stride,
                  int n_tok, int accumulate) {
    dense_wg_body<256, false>(w, x, x_stride, y, y_stride, n_tok, accumulate);
}

// grid (ceil(rows / 128), max_tiles); tiles [..][3] = (expert, start in perm, count ≤ TOK) as
// moe_group made them with tiles of TOK; blocks past *n_tiles exit.
template <int TOK, int STAGES, bool LEAN, bool HOIST = false>
__device__ __forceinline__ void grouped_wg_body(const QWeight& w, const int* __restrict__ perm,
                                                const int* __restrict__ tiles, const int* __restrict__ n_tiles,
                                                const u16* __restrict__ x, int x_stride, int x_div,
                                                float* __restrict__ y, int y_stride) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    __shared__ int src[TOK], dst[TOK];
    int t = blockIdx.y;
    if (t >= *n_tiles) return;  // uniform over the block
    int e = tiles[3 * t], start = tiles[3 * t + 1], cnt = tiles[3 * t + 2];
    if (threadIdx.x < TOK) {
        int item = threadIdx.x < cnt ? perm[start + threadIdx.x] : -1;
        src[threadIdx.x] = item < 0 ? -1 : item / x_div;
        dst[threadIdx.x] = item;
    }
    if (HOIST)
        wgb_tile_h<TOK, STAGES>(w, (long long)e * w.rows, blockIdx.x * WG_ROWS, x, x_stride, src, dst, y, y_stride, 0,
                                wg_raw);
    else
        wgb_tile<TOK, STAGES, LEAN>(w, (long long)e * w.rows, blockIdx.x * WG_ROWS, x, x_stride, src, dst, y,
                                    y_stride, 0, wg_raw);
#else
    __trap();
#endif
}

extern "C" __global__ void __launch_bounds__(256, 1)
gemm_grouped_wgb64(QWeight w, const int* __restrict__ perm, const int* __restrict__ tiles,
                   const int* __restrict__ n_tiles, const u16* __restrict__ x, int x_stride, int x_div,
                   float* __restrict__ y, int y_stride) {
    grouped_wg_body<64, WGB_STAGES, false>(w, perm, tiles, n_tiles, x, x_stride, x_div, y, y_stride);
}

// Tiles of 128 items (`wgmma_group_tile` = 128, where experts average ≥ 96 items a chunk).
extern "C" __global__ void __launch_bounds__(256, 1)
gemm_grouped_wgb128(QWeight w, const int* __restrict__ perm, const int* __restrict__ tiles,
                    const int* __restrict__ n_tiles, const u16* __restrict__ x, int x_stride, int x_div,
                    float* __restrict__ y, int y_stride) {
    grouped_wg_body<128, WGB_STAGES, false>(w, perm, tiles, n_tiles, x, x_stride, x_div, y, y_stride);
}

// Tiles of 32 items (wgmma.m64n32k16) for few items an expert: the plan's `wgmma_narrow_tiles`
// (chunks whose experts average at most gemm::NARROW_MAX_AVG items) and the remainder launch of
// `wgmma_tail_tiles` (each expert's last ≤ 32 items past its tiles of 128, moe_group's second
// list). A stage's activations are 4 KB, as much as its weights, so the ring is WGB32_STAGES (7)
// deep and three blocks share a multiprocessor (≤ 85 registers a thread: 80 with 16
// accumulators; 73 KB of shared memory a block at 32 groups a row) where gemm_grouped_wgb64 fits
// two (96 registers, 79 KB, 5 stages): 3 × 6 k-steps of weights in flight an SM against 2 × 4,
// and 24 warps to issue from against 16.
#ifndef WGB32_STAGES
#error "WGB32_STAGES comes from the launcher module (crates/lily-cuda/src/kernels/gemm.rs)"
#endif
extern "C" __global__ void __launch_bounds__(256, 3)
gemm_grouped_wgb32(QWeight w, const int* __restrict__ perm, const int* __restrict__ tiles,
                   const int* __restrict__ n_tiles, const u16* __restrict__ x, int x_stride, int x_div,
                   float* __restrict__ y, int y_stride) {
    grouped_wg_body<32, WGB32_STAGES, false>(w, perm, tiles, n_tiles, x, x_stride, x_div, y, y_stride);
}

// The five above with the lean dequantisation (wgb_dequant's LEAN; the plan's
// `wgmma_lean_dequant`, weights in groups of ≥ 64 columns): bit-identical outputs.
extern "C" __global__ void __launch_bounds__(256, 1)
gemm_dense_wgb_lean(QWeight w, const u16* __restrict__ x, int x_stride, float* __restrict__ y, int y_stride,
                    int n_tok, int accumulate) {
    dense_wg_body<128, true>(w, x, x_stride, y, y_stride, n_tok, accumulate);
}
extern "C" __global__ void __launch_bounds__(256, 1)
gemm_dense_wgb256_lean(QWeight w, const u16* __restrict__ x, int x_stride, float* __restrict__ y, int y_stride,
                       int n_tok, int accumulate) {
    dense_wg_body<256, true>(w, x, x_stride, y, y_stride, n_tok, accumulate);
}
extern "C" __global__ void __launch_bounds__(256, 1)
gemm_grouped_wgb64_lean(QWeight w, const int* __restrict__ perm, const int* __restrict__ tiles,
                        const int* __restrict__ n_tiles, const u16* __restrict__ x, int x_stride, int x_div,
                        float* __restrict__ y, int y_stride) {
    grouped_wg_body<64, WGB_STAGES, true>(w, perm, tiles, n_tiles, x, x_stride, x_div, y, y_stride);
}
extern "C" __global__ void __launch_bounds__(256, 1)
gemm_grouped_wgb128_lean(QWeight w, const int* __restrict__ perm, const int* __restrict__ tiles,
                         const int* __restrict__ n_tiles, const u16* __restrict__ x, int x_stride, int x_div,
                         float* __restrict__ y, int y_stride) {
    grouped_wg_body<128, WGB_STAGES, true>(w, perm, tiles, n_tiles, x, x_stride, x_div, y, y_stride);
}
extern "C" __global__ void __launch_bounds__(256, 3)
gemm_grouped_wgb32_lean(QWeight w, const int* __restrict__ perm, const int* __restrict__ tiles,
                        const int* __restrict__ n_tiles, const u16* __restrict__ x, int x_stride, int x_div,
                        float* __restrict__ y, int y_stride) {
    grouped_wg_body<32, WGB32_STAGES, true>(w, perm, tiles, n_tiles, x, x_stride, x_div, y, y_stride);
}

// The three grouped _lean kernels with HOIST's k-step (wgb_tile_h; the plan's
// `wgmma_hoisted_addrs`, on top of `wgmma_lean_dequant`): bit-identical outputs.
extern "C" __global__ void __launch_bounds__(256, 1)
gemm_grouped_wgb64_hoist(QWeight w, const int* __restrict__ perm, const int* __restrict__ tiles,
                         const int* __restrict__ n_tiles, const u16* __restrict__ x, int x_stride, int x_div,
                         float* __restrict__ y, int y_stride) {
    grouped_wg_body<64, WGB_STAGES, true, true>(w, perm, tiles, n_tiles, x, x_stride, x_div, y, y_stride);
}
extern "C" __global__ void __launch_bounds__(256, 1)
gemm_grouped_wgb128_hoist(QWeight w, const int* __restrict__ perm, const int* __restrict__ tiles,
                          const int* __restrict__ n_tiles, const u16* __restrict__ x, int x_stride, int x_div,
                          float* __restrict__ y, int y_stride) {
    grouped_wg_body<128, WGB_STAGES, true, true>(w, perm, tiles, n_tiles, x, x_stride, x_div, y, y_stride);
}
extern "C" __global__ void __launch_bounds__(256, 3)
gemm_grouped_wgb32_hoist(QWeight w, const int* __restrict__ perm, const int* __restrict__ tiles,
                         const int* __restrict__ n_tiles, const u16* __restrict__ x, int x_stride, int x_div,
                         float* __restrict__ y, int y_stride) {
    grouped_wg_body<32, WGB32_STAGES, true, true>(w, perm, tiles, n_tiles, x, x_stride, x_div, y, y_stride);
}
