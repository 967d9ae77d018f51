// The decode step's (one token's) linears: weight-streaming GEMVs with the glue around them fused
// in, so a layer is a handful of launches instead of two dozen (issue: decode speed).
//
//   dec_gemv:         y_s = W_s · x for up to DEC_MAX_SEGS weights that read the same input (DeltaNet's
//                     in_proj_qkv / z / b / a, attention's q / k / v, the router and the shared-expert
//                     gate), x optionally RMS-normed inside the kernel exactly as rms_norm computes it
//                     (the norm folded into the projection); each output is stored, added into the
//                     residual stream, or kept unrounded (router logits).
//   dec_glu:          the token's routing (softmax, top_k, renormalised weights, as moe_route), then
//                     h_k = silu(gate_k · xn) ⊙ (up_k · xn) for the top_k routed experts and, as one more
//                     item, the shared expert: the MoE's first half in one launch.
//   dec_down_combine: x += Σ_k w_k · down_k · h_k + sigmoid(g_s) · down_s · h_s: the experts' down
//                     projections, routing weights, shared-expert gate, combine and residual add.
//
// Weights: MLX affine 4- or 8-bit with groups of 64 columns (the launcher checks). A lane owns whole
// groups: LPR = min(32, cols / 64) lanes share a row, 32 / LPR rows per warp step, and each lane keeps
// its group of x in registers for the DEC_R rows it streams at once. Per group the dot product is
// s · Σ q_j x_j + b · Σ x_j with Σ x_j computed once per block. Packed values become floats through
// byte permutes into a float's mantissa (no int → float conversion, which runs at quarter rate): a
// 4-bit value costs one permute and one FMA (nib_f), which matters because at 4.8 TB/s a GEMV over
// 4-bit weights needs ~10^13 weights/s, close to what the CUDA cores issue.
// Rounding follows the unfused kernels: act() wherever they store an activation.
//
// Shared memory: x (or h) as groups of 64 floats padded to DEC_XPAD, so the 16-byte reads of the
// eight lanes of a phase fall in distinct banks.

#ifndef DEC_WARPS
#error "DEC_WARPS comes from the launcher module (crates/lily-cuda/src/kernels/decode.rs)"
#endif
#ifndef DEC_DOWN_WARPS
#error "DEC_DOWN_WARPS comes from the launcher module (crates/lily-cuda/src/kernels/decode.rs)"
#endif
#ifndef DEC_GLU_R
#error "DEC_GLU_R comes from the launcher module (crates/lily-cuda/src/kernels/decode.rs)"
#endif
#ifndef DEC_R
#error "DEC_R comes from the launcher module (crates/lily-cuda/src/kernels/decode.rs)"
#endif
#ifndef DEC_MAX_COLS
#error "DEC_MAX_COLS comes from the launcher module (crates/lily-cuda/src/kernels/decode.rs)"
#endif
#ifndef DEC_DOWN_KSPLIT
#error "DEC_DOWN_KSPLIT comes from the launcher module (crates/lily-cuda/src/kernels/decode.rs)"
#endif
#ifndef DEC_DOWN_STAGE
#error "DEC_DOWN_STAGE comes from the launcher module (crates/lily-cuda/src/kernels/decode.rs)"
#endif
#ifndef DEC_GLU_R4
#error "DEC_GLU_R4 comes from the launcher module (crates/lily-cuda/src/kernels/decode.rs)"
#endif
#ifndef DEC_DOWN_BATCH
#error "DEC_DOWN_BATCH comes from the launcher module (crates/lily-cuda/src/kernels/decode.rs)"
#endif
#ifndef DEC_GRP_DOWN_KCOLS
#error "DEC_GRP_DOWN_KCOLS comes from the launcher module (crates/lily-cuda/src/kernels/decode.rs)"
#endif
#ifndef DEC_GRP_DOWN_BATCH
#error "DEC_GRP_DOWN_BATCH comes from the launcher module (crates/lily-cuda/src/kernels/decode.rs)"
#endif
#ifndef DEC_GRP_GLU_RING
#error "DEC_GRP_GLU_RING comes from the launcher module (crates/lily-cuda/src/kernels/decode.rs)"
#endif
#ifndef DEC_GRP_DOWN_RING
#error "DEC_GRP_DOWN_RING comes from the launcher module (crates/lily-cuda/src/kernels/decode.rs)"
#endif
#ifndef DEC_MAX_EXPERTS
#error "DEC_MAX_EXPERTS comes from the launcher module (crates/lily-cuda/src/kernels/decode.rs)"
#endif
#ifndef DEC_MAX_TOPK
#error "DEC_MAX_TOPK comes from the launcher module (crates/lily-cuda/src/kernels/decode.rs)"
#endif
#ifndef DEC_Q8_BLOCKS
#error "DEC_Q8_BLOCKS comes from the launcher module (crates/lily-cuda/src/kernels/decode.rs)"
#endif
#ifndef DEC_R4
#error "DEC_R4 comes from the launcher module (crates/lily-cuda/src/kernels/decode.rs)"
#endif
#ifndef DEC_R4_X8X2
#error "DEC_R4_X8X2 comes from the launcher module (crates/lily-cuda/src/kernels/decode.rs)"
#endif
#ifndef DEC_MAX_SEGS
#error "DEC_MAX_SEGS comes from the launcher module (crates/lily-cuda/src/kernels/decode.rs)"
#endif
#ifndef DEC_DOWN_NEXT_REGS
#error "DEC_DOWN_NEXT_REGS comes from the launcher module (crates/lily-cuda/src/kernels/decode.rs)"
#endif
#ifndef DEC_BULK_SLOTS
#error "DEC_BULK_SLOTS comes from the launcher module (crates/lily-cuda/src/kernels/decode.rs)"
#endif
#ifndef DEC_BULK_SLOT
#error "DEC_BULK_SLOT comes from the launcher module (crates/lily-cuda/src/kernels/decode.rs)"
#endif
#ifndef DEC_GRP_PICKS
#error "DEC_GRP_PICKS comes from the launcher module (crates/lily-cuda/src/kernels/decode.rs)"
#endif

#ifndef DEC_DN_MAX_K
#error "DEC_DN_MAX_K comes from the launcher module (crates/lily-cuda/src/kernels/decode.rs)"
#endif
#ifndef DEC_DN_MAX_DK
#error "DEC_DN_MAX_DK comes from the launcher module (crates/lily-cuda/src/kernels/decode.rs)"
#endif
#ifndef DEC_DN_PARTS
#error "DEC_DN_PARTS comes from the launcher module (crates/lily-cuda/src/kernels/decode.rs)"
#endif
#ifndef DEC_DN_COLS
#error "DEC_DN_COLS comes from the launcher module (crates/lily-cuda/src/kernels/decode.rs)"
#endif

#define DEC_DN_ROWS (DEC_DN_MAX_DK / DEC_DN_PARTS)
#define DEC_XPAD 68
#define DEC_MAX_GROUPS (DEC_MAX_COLS / 64)

// Store modes of an output.
#define DEC_STORE 0     // y = act(s)
#define DEC_RESIDUAL 1  // y = act(y + act(s))
#define DEC_EXACT 2     // y = s

// One weight of a dec_gemv launch and where its rows go; tiles tile0 .. of the launch are its rows.
struct DecSeg {
    QWeight w;
    float* y;
    int mode;
    int tile0;
};

struct DecSegs {
    DecSeg s[DEC_MAX_SEGS];
    int n;
    int tiles;  // tiles of all segments together
};

// When the next kernel may launch (programmatic dependent launch, sm_90+). By default a decode
// kernel lets it start when its blocks have summed their last rows (dec_trigger_late): the
// next kernel's blocks then stream their first weights while this one stores and exits. With
// DEC_EARLY_TRIGGER (the plan's `early_trigger`) every decode kernel lets it start as soon as
// its own early weight loads are issued (dec_wait), so the next kernel's launch and prologue
// overlap this one's tail; their griddepcontrol.wait still waits for this kernel to complete, so
// the order of the data is unchanged.
__device__ __forceinline__ void dec_wait() {
#if defined(DEC_EARLY_TRIGGER) && DEC_EARLY_TRIGGER
    pdl_trigger();
#endif
    pdl_wait();
}

__device__ __forceinline__ void dec_trigger_late() {
#if !(defined(DEC_EARLY_TRIGGER) && DEC_EARLY_TRIGGER)
    pdl_trigger();
#endif
}

// 8-bit values: 2^23 + v for the byte of `v` that `sel` picks (sel = 0x7440 | byte), minus 2^23: the
// byte as a float (two full-rate operations, no int → float conversion).
__device__ __forceinline__ float byte_f(u32 v, u32 sel) {
    return __uint_as_float(__byte_perm(v, 0x4B000000u, sel)) - 8388608.0f;
}

// 4-bit values: byte `k` of `v` holds a nibble at bits 3..6 (the callers shift it there); one byte
// permute puts it at the top of the mantissa of 0.5: 0.5 + n/32, exact. Dot products of these
// offset values are turned back into Σ n x by group_term (Σ n x = 32 Σ f x − 16 Σ x), so a packed
// weight costs a permute and an FMA. (With the nibble lower in the mantissa the offset would
// dominate and the subtraction cost digits: measured 1e-4 against the CPU on the full model.)
__device__ __forceinline__ float nib_f(u32 v, u32 sel) { return __uint_as_float(__byte_perm(v, 0x3F000000u, sel)); }
#define NIB_SEL(k) (0x7044u | ((k) << 8))

// Weight loads: through the read-only path, not kept in L1 (L1::no_allocate). Allocating them in
// L1 lost its A/B (3.6 % slower at 4K on the H200, docs/perf-notes.md, session 3).
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

// The same for 8 bytes (dec_mma_rows: the four lanes of a weight row read its group's 32 bytes).
__device__ __forceinline__ uint2 ld_stream2(const uint2* p) {
    uint2 r;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    return r;
}

// One packed 4-bit word (8 columns, column j at bits 4j: low nibbles the even columns, high
// nibbles the odd ones) against x[0..8): a0 += the even columns' (0.5 + q/32) x, a1 the odd ones'.
__device__ __forceinline__ void nib8_fma(u32 w, const float* x, float& a0, float& a1) {
    u32 lo = (w << 3) & 0x78787878u, hi = (w >> 1) & 0x78787878u;
    a0 = fmaf(nib_f(lo, NIB_SEL(0)), x[0], a0);
    a1 = fmaf(nib_f(hi, NIB_SEL(0)), x[1], a1);
    a0 = fmaf(nib_f(lo, NIB_SEL(1)), x[2], a0);
    a1 = fmaf(nib_f(hi, NIB_SEL(1)), x[3], a1);
    a0 = fmaf(nib_f(lo, NIB_SEL(2)), x[4], a0);
    a1 = fmaf(nib_f(hi, NIB_SEL(2)), x[5], a1);
    a0 = fmaf(nib_f(lo, NIB_SEL(3)), x[6], a0);
    a1 = fmaf(nib_f(hi, NIB_SEL(3)), x[7], a1);
}

// Over one group of 64 columns: BITS = 4 (8 words): Σ_j (0.5 + q_j/32) x_j; BITS = 8 (16 words):
// Σ_j q_j x_j. group_term turns either into the group's share of the row's dot product.
template <int BITS>
__device__ __forceinline__ float dot_group(const uint4 (&q)[BITS / 2], const float (&xv)[64]) {
    float a0 = 0.0f, a1 = 0.0f;
#pragma unroll
    for (int v = 0; v < BITS / 2; v++) {
        u32 words[4] = {q[v].x, q[v].y, q[v].z, q[v].w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 w = words[i];
            if (BITS == 4) {
                // Word 4v+i holds columns 8(4v+i) .. +7, column j at bits 4j: low nibbles are the
                // even columns, high nibbles the odd ones.
                nib8_fma(w, &xv[8 * (4 * v + i)], a0, a1);
            } else {
                const float* x = &xv[4 * (4 * v + i)];
                a0 = fmaf(byte_f(w, 0x7440), x[0], a0);
                a1 = fmaf(byte_f(w, 0x7441), x[1], a1);
                a0 = fmaf(byte_f(w, 0x7442), x[2], a0);
                a1 = fmaf(byte_f(w, 0x7443), x[3], a1);
            }
        }
    }
    return a0 + a1;
}

// The group's share of a row's dot product, Σ (s q_j + b) x_j = s Σ q_j x_j + b Σ x_j, from
// dot_group's d and the group's Σ x_j.
template <int BITS>
__device__ __forceinline__ float group_term(float s, float b, float d, float sx) {
    if (BITS == 4) return (32.0f * s) * d + (b - 16.0f * s) * sx;
    return s * d + b * sx;
}

__device__ __forceinline__ void load_group(const float* xs_group, float (&xv)[64]) {
#pragma unroll
    for (int j = 0; j < 16; j++) {
        float4 t = *reinterpret_cast<const float4*>(xs_group + 4 * j);
        xv[4 * j] = t.x;
        xv[4 * j + 1] = t.y;
        xv[4 * j + 2] = t.z;
        xv[4 * j + 3] = t.w;
    }
}

// ---- int8 x for the 4-bit products (moe_int8) ---------------------------------------------------
// A group of 64 x values as int8: scale = max|x| / 127, x̂_j = rint(x_j · (127 / max|x|)) (ties to
// even), so |scale · x̂_j − x_j| ≤ max|x| / 254 (and f32 rounding). Packed so that a 4-bit word's
// nibbles meet theirs by dp4a without unpacking: word p of e holds the int8 of the group's
// columns 8p, 8p+2, 8p+4, 8p+6 (the word's low nibbles), word p of o those of 8p+1, .., 8p+7 (its
// high nibbles). The bias term takes the dequantised sum scale · Σ x̂_j, so a group's term is
// exactly Σ_j (s q_j + b) · scale · x̂_j: the true weights against the rounded x, whose error is
// Σ w_j δ_j (w centred near 0) rather than s Σ q_j δ_j (q in 0..15, about twice as large) had Σ x_j
// of the f32 x been kept. Integer sums are exact: 16 Σ q x̂ ≤ 16 · 64 · 15 · 127 < 2^24.
#define DEC_X8PAD 20      // u32 words a group in shared memory (16 + 4: conflict-free 16-byte reads)
#define DEC_X8_GROUPS 32  // dec_glu4: one group a lane

struct X8Group {
    u32 e[8], o[8];
    float scale16;  // scale / 16 (dot_group_x8 returns 16 Σ q x̂)
    float sum;      // scale · Σ x̂_j
};

// d = c + Σ_k a.byte_k · b.byte_k, a's bytes unsigned, b's signed (one dp4a; exact).
__device__ __forceinline__ int dp4a_us(u32 a, u32 b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// The block's staged x (xs: G groups padded to DEC_XPAD) as int8 groups into xq / xqs (scale,
// scale · Σ x̂): thread t rounds word t % 8 (8 columns) of group t / 8, the group's max and sum met
// by shuffles over its 8 threads. The caller's barrier publishes them.
__device__ __forceinline__ void stage_x8(const float* xs, int G, u32* xq, float2* xqs) {
    int p = threadIdx.x & 7;
    for (int g0 = 0; g0 < G; g0 += blockDim.x >> 3) {
        int g = g0 + (threadIdx.x >> 3);
        bool live = g < G;
        float v[8];
        const float4* src = reinterpret_cast<const float4*>(xs + (live ? g : 0) * DEC_XPAD + 8 * p);
        float4 a = src[0], b = src[1];
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
        float m = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; j++) m = fmaxf(m, fabsf(v[j]));
#pragma unroll
        for (int o = 1; o < 8; o <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        float inv = m > 0.0f ? 127.0f / m : 0.0f;
        int qi[8], sum = 0;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            qi[j] = __float2int_rn(v[j] * inv);
            sum += qi[j];
        }
#pragma unroll
        for (int o = 1; o < 8; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        u32 e = (u32)(qi[0] & 255) | (u32)(qi[2] & 255) << 8 | (u32)(qi[4] & 255) << 16 | (u32)qi[6] << 24;
        u32 od = (u32)(qi[1] & 255) | (u32)(qi[3] & 255) << 8 | (u32)(qi[5] & 255) << 16 | (u32)qi[7] << 24;
        if (live) {
            xq[g * DEC_X8PAD + p] = e;
            xq[g * DEC_X8PAD + 8 + p] = od;
            if (p == 0) {
                float scale = m / 127.0f;
                xqs[g] = make_float2(scale, scale * (float)sum);
            }
        }
    }
}

// Group sl of the int8 x into registers.
__device__ __forceinline__ X8Group x8_load(const u32* xq, const float2* xqs, int sl) {
    X8Group x;
    const uint4* w = reinterpret_cast<const uint4*>(xq + sl * DEC_X8PAD);
    uint4 w0 = w[0], w1 = w[1], w2 = w[2], w3 = w[3];
    x.e[0] = w0.x, x.e[1] = w0.y, x.e[2] = w0.z, x.e[3] = w0.w, x.e[4] = w1.x, x.e[5] = w1.y, x.e[6] = w1.z, x.e[7] = w1.w;
    x.o[0] = w2.x, x.o[1] = w2.y, x.o[2] = w2.z, x.o[3] = w2.w, x.o[4] = w3.x, x.o[5] = w3.y, x.o[6] = w3.z, x.o[7] = w3.w;
    float2 sc = xqs[sl];
    x.scale16 = sc.x * 0.0625f;
    x.sum = sc.y;
    return x;
}

// 16 Σ_j q_j x̂_j over one 4-bit group (8 words): the low nibbles (w & 0x0F..) against e, the high
// ones in place (w & 0xF0..: 16 q) against o; two dp4a and two masks per 8 weights.
__device__ __forceinline__ int dot_group_x8(const uint4 (&q)[2], const X8Group& x) {
    int lo = 0, hi = 0;
#pragma unroll
    for (int v = 0; v < 2; v++) {
        u32 words[4] = {q[v].x, q[v].y, q[v].z, q[v].w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            lo = dp4a_us(words[i] & 0x0F0F0F0Fu, x.e[4 * v + i], lo);
            hi = dp4a_us(words[i] & 0xF0F0F0F0u, x.o[4 * v + i], hi);
        }
    }
    return 16 * lo + hi;
}

// The group's share of a row's dot product: s · scale · Σ q x̂ + b · scale · Σ x̂.
__device__ __forceinline__ float group_term_x8(float s, float b, int d16, const X8Group& x) {
    return fmaf(s * x.scale16, (float)d16, b * x.sum);
}

// ---- int8 pairs of x for the one-token 4-bit projections (gemv_int8) ----------------------------
// One int8 a value rounds x about 6× coarser than bf16 (moe_int8's agreement cost); two recover
// it. A group of 64 x values: scale = max|x| / 127, x_hi = rint(x · (127 / max|x|)), the residual
// r = x − scale · x_hi (one fmaf; |r| ≤ scale / 2), x_lo = rint(r · (254 · 127 / max|x|)), both in
// [−127, 127]. Then x̃ = (scale / 254) · (254 x_hi + x_lo) and |x̃ − x| ≤ scale / 508 = max|x| /
// 64,516 (and f32 rounding): ≈ 40× finer than bf16's rounding of a typical element, 254× finer
// than one int8, so the products stay at the f32 kernels' agreement. Packed as stage_x8 packs
// (e: the columns of a weight word's low nibbles, o: its high nibbles), x_hi's words then x_lo's:
// a 4-bit word costs two masks and four dp4a (0.75 instructions a weight against nib8_fma's 2.5),
// and a lane holds its group in 32 words and 2 floats instead of 64 + 1 floats. Integer sums are
// exact: 16 Σ q x_hi ≤ 16 · 64 · 15 · 127 < 2^21, and 16 Σ q (254 x_hi + x_lo) < 2^29.
// The bias term takes the dequantised sum (scale / 254) · Σ (254 x_hi + x_lo), so a group's term
// is exactly Σ_j (s q_j + b) · x̃_j: the true weights against the rounded x (error Σ w_j δ_j, w
// centred near 0), not s Σ q_j δ_j (q in 0..15: about twice as large) had the f32 Σ x_j been kept;
// and the kernel's result is then the exact product of x̃, which is what the tests hold it to.
#define DEC_X8X2PAD 36  // u32 words a group in shared memory (32 + 4: conflict-free 16-byte reads)

struct X8x2Group {
    u32 w[4][8];    // x_hi of the even columns, of the odd ones, then x_lo's (xq's order)
    float unit16;   // scale / 254 / 16 (dot_group_x8x2 returns 16 Σ q (254 x_hi + x_lo))
    float sum;      // (scale / 254) · Σ (254 x_hi + x_lo)
};

// Group g's 8 columns 8p .. 8p + 7 (a, b; p = threadIdx.x % 8) as int8 pairs into xq (DEC_X8X2PAD
// words a group) / xqs (scale / 254, the dequantised sum), the group's max and sum met by shuffles
// over its 8 threads (every lane of the warp takes part; `live` false: a lane past the groups,
// which stores nothing).
__device__ __forceinline__ void x8x2_round(float4 a, float4 b, int p, int g, bool live, u32* xq, float2* xqs) {
    float v[8];
    v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    float m = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; j++) m = fmaxf(m, fabsf(v[j]));
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float inv = m > 0.0f ? 127.0f / m : 0.0f, scale = m / 127.0f, inv_lo = 254.0f * inv;
    int hi[8], lo[8], sum = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        hi[j] = __float2int_rn(v[j] * inv);
        lo[j] = __float2int_rn(fmaf(-scale, (float)hi[j], v[j]) * inv_lo);
        sum += 254 * hi[j] + lo[j];
    }
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    auto pack = [](const int* q, int j0) {
        return (u32)(q[j0] & 255) | (u32)(q[j0 + 2] & 255) << 8 | (u32)(q[j0 + 4] & 255) << 16 | (u32)q[j0 + 6] << 24;
    };
    if (live) {
        u32* dst = xq + g * DEC_X8X2PAD + p;
        dst[0] = pack(hi, 0);
        dst[8] = pack(hi, 1);
        dst[16] = pack(lo, 0);
        dst[24] = pack(lo, 1);
        if (p == 0) {
            float unit = scale * (1.0f / 254.0f);
            xqs[g] = make_float2(unit, unit * (float)sum);
        }
    }
}

// The block's staged x (xs: G groups padded to DEC_XPAD) as int8 pairs into xq / xqs: thread t
// rounds word t % 8 (8 columns) of group t / 8 (x8x2_round). The caller's barrier publishes them.
__device__ __forceinline__ void stage_x8x2(const float* xs, int G, u32* xq, float2* xqs) {
    int p = threadIdx.x & 7;
    for (int g0 = 0; g0 < G; g0 += blockDim.x >> 3) {
        int g = g0 + (threadIdx.x >> 3);
        bool live = g < G;
        const float4* src = reinterpret_cast<const float4*>(xs + (live ? g : 0) * DEC_XPAD + 8 * p);
        x8x2_round(src[0], src[1], p, g, live, xq, xqs);
    }
}

// Group sl of the int8 pairs into registers.
__device__ __forceinline__ X8x2Group x8x2_load(const u32* xq, const float2* xqs, int sl) {
    X8x2Group x;
    const uint4* w = reinterpret_cast<const uint4*>(xq + sl * DEC_X8X2PAD);
#pragma unroll
    for (int k = 0; k < 4; k++) {
        uint4 w0 = w[2 * k], w1 = w[2 * k + 1];
        x.w[k][0] = w0.x, x.w[k][1] = w0.y, x.w[k][2] = w0.z, x.w[k][3] = w0.w;
        x.w[k][4] = w1.x, x.w[k][5] = w1.y, x.w[k][6] = w1.z, x.w[k][7] = w1.w;
    }
    float2 sc = xqs[sl];
    x.unit16 = sc.x * 0.0625f;
    x.sum = sc.y;
    return x;
}

// 16 Σ_j q_j (254 x_hi_j + x_lo_j) over one 4-bit group (8 words): as dot_group_x8, the low
// nibbles (w & 0x0F..) against the even columns, the high ones in place (16 q) against the odd,
// each against x_hi and x_lo; two masks and four dp4a per 8 weights.
__device__ __forceinline__ int dot_group_x8x2(const uint4 (&q)[2], const X8x2Group& x) {
    int lh = 0, hh = 0, ll = 0, hl = 0;
#pragma unroll
    for (int v = 0; v < 2; v++) {
        u32 words[4] = {q[v].x, q[v].y, q[v].z, q[v].w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u32 lo = words[i] & 0x0F0F0F0Fu, hi = words[i] & 0xF0F0F0F0u;
            lh = dp4a_us(lo, x.w[0][4 * v + i], lh);
            hh = dp4a_us(hi, x.w[1][4 * v + i], hh);
            ll = dp4a_us(lo, x.w[2][4 * v + i], ll);
            hl = dp4a_us(hi, x.w[3][4 * v + i], hl);
        }
    }
    return 254 * (16 * lh + hh) + (16 * ll + hl);
}

// The group's share of a row's dot product: Σ_j (s q_j + b) x̃_j = s · (scale / 254) · Σ q (254
// x_hi + x_lo) + b · (scale / 254) · Σ (254 x_hi + x_lo).
__device__ __forceinline__ float group_term_x8x2(float s, float b, int d16, const X8x2Group& x) {
    return fmaf(s * x.unit16, (float)d16, b * x.sum);
}

// acc[r] += row (rbase + r) · x for r < R over the lane's groups g = sl, sl + lpr, ... of G.
// Rows at or past `rows` read the last row instead (their sums are never stored).
template <int BITS, int R>
__device__ __forceinline__ void rows_dot(const QWeight& w, int rbase, int G, int lpr, int sl, const float* xs,
                                         const float* xsum, float (&acc)[R]) {
    const int WPG = 2 * BITS;  // u32 words per group
    long long wpr = (long long)G * WPG;
    for (int g = sl; g < G; g += lpr) {
        uint4 q[R][BITS / 2];
        float s[R], b[R];
#pragma unroll
        for (int r = 0; r < R; r++) {
            long long row = min(rbase + r, w.rows - 1);
            const uint4* qp = reinterpret_cast<const uint4*>(w.q + row * wpr + (long long)g * WPG);
#pragma unroll
            for (int v = 0; v < BITS / 2; v++) q[r][v] = ld_stream(qp + v);
            s[r] = bf16_to_f32(w.scales[row * G + g]);
            b[r] = bf16_to_f32(w.biases[row * G + g]);
        }
        float xv[64];
        load_group(xs + g * DEC_XPAD, xv);
        float sx = xsum[g];
#pragma unroll
        for (int r = 0; r < R; r++) acc[r] += group_term<BITS>(s[r], b[r], dot_group<BITS>(q[r], xv), sx);
    }
}

// DEC_LEAN_WHY: LEAN (a template flag of expert, qrows_load, reduce_rows and the MoE kernels' bodies)
// picks the instruction cuts of the MoE's batched and int8 kernels and of the int8-pair GEMVs
// (32-bit offsets, unrolled reductions, tile positions carried, token offsets from blockIdx.y;
// gemv_pipelined's PAIRS takes the first two). The one-token f32 MoE kernels
// (dec_glu4, dec_down_combine) and every other kernel keep the code as it was before the cuts, SASS
// for SASS: built from the cut code (with the rows kernels' bookkeeping) they measured 6 % slower
// in one-token decode (H100, full size: 465.9 -> 438.8 tok/s at 256), though fewer instructions.
// Sum over the lpr lanes (a power of two, at most 32) of each row's sub-warp. LEAN (the MoE's
// rows and int8 kernels): offsets 16 down to 1 unrolled and predicated on o < lpr (a loop over
// lpr costs 6 instructions a step); otherwise the loop, as every other kernel compiled before the
// cuts (see DEC_LEAN_WHY).
template <int R, bool LEAN = false>
__device__ __forceinline__ void reduce_rows(float (&acc)[R], int lpr) {
#pragma unroll
    for (int r = 0; r < R; r++) {
        if (LEAN) {
#pragma unroll
            for (int o = 16; o > 0; o >>= 1)
                if (o < lpr) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
        } else {
            for (int o = lpr >> 1; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
        }
    }
}

// x [cols] → shared memory (groups padded to DEC_XPAD), then the sum of each group. The row is
// taken as it is, or RMS-normed when norm_w is given (rms_norm's arithmetic), or, when gz is
// given, passed through DeltaNet's gated norm per head of head_dim values (dn_gated_norm's
// arithmetic: y = w ⊙ rmsnorm(o_h) ⊙ silu(z_h), w = norm_w). xn_out (if any) gets the staged row
// from block 0.
//
// Fast form (stage_fast, every decode shape): a thread owns V = cols / blockDim.x consecutive
// columns, so x (and z, and the norm's weights) arrive in one round of 16-byte loads, a head's
// norm is a shuffle over its head_dim / V lanes and a group's sum one over 64 / V lanes; the block
// meets once for the RMS and once at the end. The general form (stage_slow) serves other shapes.
template <int V>
struct XRow {
    float4 x[V / 4], z[V / 4];
};

__device__ __forceinline__ bool aligned16(const void* p) { return ((unsigned long long)p & 15ull) == 0; }

// The columns a thread stages in the fast form, or 0 when the shape or the pointers need the
// general form.
__device__ __forceinline__ int stage_width(const float* x, const float* norm_w, int cols, const float* gz,
                                           int head_dim, const float* xn_out) {
    int v = cols / (int)blockDim.x;
    if (v * (int)blockDim.x != cols || (v != 4 && v != 8 && v != 16)) return 0;
    if (!aligned16(x) || !aligned16(norm_w) || !aligned16(gz) || !aligned16(xn_out)) return 0;
    if (gz) {
        int hl = head_dim / v;
        if (hl * v != head_dim || hl > 32 || (hl & (hl - 1)) != 0) return 0;
    }
    return v;
}

// Before pdl_wait: the norm's weights (never written) toward L2, so the staging's one round of
// loads finds them there.
__device__ __forceinline__ void stage_prefetch(const float* norm_w, int cols, int head_dim, bool gated) {
    int n = gated ? head_dim : cols;
    if (norm_w)
        for (int c = threadIdx.x * 32; c < n; c += blockDim.x * 32)
            asm volatile("prefetch.global.L2 [%0];" ::"l"(norm_w + c));
}

template <int V>
__device__ __forceinline__ void stage_load(const float* __restrict__ x, const float* __restrict__ gz, XRow<V>& r) {
    const float4* xp = reinterpret_cast<const float4*>(x + threadIdx.x * V);
#pragma unroll
    for (int i = 0; i < V / 4; i++) r.x[i] = xp[i];
    if (gz) {
        const float4* zp = reinterpret_cast<const float4*>(gz + threadIdx.x * V);
#pragma unroll
        for (int i = 0; i < V / 4; i++) r.z[i] = zp[i];
    }
}

template <int V>
__device__ __forceinline__ void stage_finish(const XRow<V>& r, const float* __restrict__ norm_w, float eps, int cols,
                                             bool gated, int head_dim, float* xs, float* xsum,
                                             float* __restrict__ xn_out) {
    int c0 = threadIdx.x * V, lane = threadIdx.x & 31;
    float v[V];
#pragma unroll
    for (int i = 0; i < V / 4; i++) {
        v[4 * i] = r.x[i].x;
        v[4 * i + 1] = r.x[i].y;
        v[4 * i + 2] = r.x[i].z;
        v[4 * i + 3] = r.x[i].w;
    }
    if (gated) {
        float ss = 0.0f;
#pragma unroll
        for (int i = 0; i < V; i++) ss += v[i] * v[i];
        for (int o = (head_dim / V) >> 1; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        float inv = rsqrtf(ss / (float)head_dim + eps);
        const float4* wp = reinterpret_cast<const float4*>(norm_w + c0 % head_dim);
#pragma unroll
        for (int i = 0; i < V / 4; i++) {
            float4 w = wp[i], z = r.z[i];
            v[4 * i] = act(act(w.x * act(v[4 * i] * inv)) * siluf(z.x));
            v[4 * i + 1] = act(act(w.y * act(v[4 * i + 1] * inv)) * siluf(z.y));
            v[4 * i + 2] = act(act(w.z * act(v[4 * i + 2] * inv)) * siluf(z.z));
            v[4 * i + 3] = act(act(w.w * act(v[4 * i + 3] * inv)) * siluf(z.w));
        }
    } else if (norm_w) {
        float ss = 0.0f;
#pragma unroll
        for (int i = 0; i < V; i++) ss += v[i] * v[i];
        ss = block_sum(ss);
        float inv = rsqrtf(ss / (float)cols + eps);
        const float4* wp = reinterpret_cast<const float4*>(norm_w + c0);
#pragma unroll
        for (int i = 0; i < V / 4; i++) {
            float4 w = wp[i];
            v[4 * i] = act(v[4 * i] * inv * w.x);
            v[4 * i + 1] = act(v[4 * i + 1] * inv * w.y);
            v[4 * i + 2] = act(v[4 * i + 2] * inv * w.z);
            v[4 * i + 3] = act(v[4 * i + 3] * inv * w.w);
        }
    }
    float* dst = xs + (c0 >> 6) * DEC_XPAD + (c0 & 63);
    float gs = 0.0f;
#pragma unroll
    for (int i = 0; i < V / 4; i++) {
        float4 t = make_float4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
        reinterpret_cast<float4*>(dst)[i] = t;
        if (xn_out && blockIdx.x == 0) reinterpret_cast<float4*>(xn_out + c0)[i] = t;
        gs += (t.x + t.y) + (t.z + t.w);
    }
    for (int o = (64 / V) >> 1; o > 0; o >>= 1) gs += __shfl_xor_sync(0xffffffffu, gs, o);
    if ((lane & (64 / V - 1)) == 0) xsum[c0 >> 6] = gs;
    __syncthreads();
}

template <int V>
__device__ __forceinline__ void stage_fast(const float* __restrict__ x, const float* __restrict__ norm_w, float eps,
                                           int cols, const float* __restrict__ gz, int head_dim, float* xs,
                                           float* xsum, float* __restrict__ xn_out) {
    XRow<V> r;
    stage_load<V>(x, gz, r);
    stage_finish<V>(r, norm_w, eps, cols, gz != nullptr, head_dim, xs, xsum, xn_out);
}

__device__ __forceinline__ void stage_slow(const float* __restrict__ x, const float* __restrict__ norm_w, float eps,
                                           int cols, const float* __restrict__ gz, int head_dim, float* xs,
                                           float* xsum, float* __restrict__ xn_out) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    if (gz) {
        // One warp per head: its inverse RMS, then the gated values.
        for (int hh = warp; hh < cols / head_dim; hh += nwarps) {
            const float* oh = x + (long long)hh * head_dim;
            float ss = 0.0f;
            for (int i = lane; i < head_dim; i += 32) {
                float o = oh[i];
                ss += o * o;
            }
            ss = warp_sum(ss);
            float inv = rsqrtf(ss / (float)head_dim + eps);
            for (int i = lane; i < head_dim; i += 32) {
                int c = hh * head_dim + i;
                float v = act(act(norm_w[i] * act(oh[i] * inv)) * siluf(gz[c]));
                xs[(c >> 6) * DEC_XPAD + (c & 63)] = v;
                if (xn_out && blockIdx.x == 0) xn_out[c] = v;
            }
        }
    } else {
        float inv = 1.0f;
        if (norm_w) {
            float ss = 0.0f;
            for (int c = threadIdx.x; c < cols; c += blockDim.x) {
                float v = x[c];
                ss += v * v;
            }
            ss = block_sum(ss);
            inv = rsqrtf(ss / (float)cols + eps);
        }
        for (int c = threadIdx.x; c < cols; c += blockDim.x) {
            float xc = x[c];
            float v = norm_w ? act(xc * inv * norm_w[c]) : xc;
            xs[(c >> 6) * DEC_XPAD + (c & 63)] = v;
            if (xn_out && blockIdx.x == 0) xn_out[c] = v;
        }
    }
    __syncthreads();
    for (int g = warp; g < (cols >> 6); g += nwarps) {
        float s = warp_sum(xs[g * DEC_XPAD + lane] + xs[g * DEC_XPAD + lane + 32]);
        if (lane == 0) xsum[g] = s;
    }
    __syncthreads();
}

__device__ __forceinline__ void stage_x(const float* __restrict__ x, const float* __restrict__ norm_w, float eps,
                                        int cols, const float* __restrict__ gz, int head_dim, float* xs,
                                        float* xsum, float* __restrict__ xn_out) {
    switch (stage_width(x, norm_w, cols, gz, head_dim, xn_out)) {
        case 4: stage_fast<4>(x, norm_w, eps, cols, gz, head_dim, xs, xsum, xn_out); break;
        case 8: stage_fast<8>(x, norm_w, eps, cols, gz, head_dim, xs, xsum, xn_out); break;
        case 16: stage_fast<16>(x, norm_w, eps, cols, gz, head_dim, xs, xsum, xn_out); break;
        default: stage_slow(x, norm_w, eps, cols, gz, head_dim, xs, xsum, xn_out);
    }
}

__device__ __forceinline__ void store_out(float* y, int mode, float s) {
    *y = mode == DEC_RESIDUAL ? act(*y + act(s)) : mode == DEC_EXACT ? s : act(s);
}

// Tiles of DEC_WARPS · (32 / lpr) · DEC_R rows; the launch is persistent: a grid of at most a few
// blocks per SM stages x once per block and strides over the tiles of every segment.
// block DEC_WARPS · 32 (256).
extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32)
dec_gemv(DecSegs segs, const float* __restrict__ x, const float* __restrict__ norm_w, float eps,
         const float* __restrict__ gz, int head_dim, float* __restrict__ xn_out, int cols) {
    __shared__ __align__(16) float xs[DEC_MAX_GROUPS * DEC_XPAD];
    __shared__ float xsum[DEC_MAX_GROUPS];
    dec_wait();
    stage_x(x, norm_w, eps, cols, gz, head_dim, xs, xsum, xn_out);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int G = cols >> 6;
    int lpr = min(32, G), spw = 32 / lpr;
    int sub = lane / lpr, sl = lane % lpr;
    for (int tile = blockIdx.x; tile < segs.tiles; tile += gridDim.x) {
        DecSeg sg = segs.s[0];
#pragma unroll
        for (int i = 1; i < DEC_MAX_SEGS; i++)
            if (i < segs.n && tile >= segs.s[i].tile0) sg = segs.s[i];
        int rbase = ((tile - sg.tile0) * DEC_WARPS * spw + warp * spw + sub) * DEC_R;
        float acc[DEC_R];
#pragma unroll
        for (int r = 0; r < DEC_R; r++) acc[r] = 0.0f;
        if (sg.w.bits == 4)
            rows_dot<4, DEC_R>(sg.w, rbase, G, lpr, sl, xs, xsum, acc);
        else
            rows_dot<8, DEC_R>(sg.w, rbase, G, lpr, sl, xs, xsum, acc);
        reduce_rows<DEC_R>(acc, lpr);
        if (sl == 0) {
#pragma unroll
            for (int r = 0; r < DEC_R; r++)
                if (rbase + r < sg.w.rows) store_out(sg.y + rbase + r, sg.mode, acc[r]);
        }
    }
}

// The pipelined GEMVs: dec_gemv when every weight has the same width BITS and a lane owns GPL
// whole groups of each row (lpr = G / GPL lanes a row): dec_gemv4 (4-bit, up to 32 groups: every
// 2048-wide projection), dec_gemv4w (4-bit, 64 groups: the 4096-wide o_proj / out_proj),
// dec_gemv8 (8-bit, up to 32 groups: the router and the shared-expert gate). A sub-warp streams R
// rows at once into registers, two register buffers deep: the next tile's rows are in flight while
// this tile's are summed. The first two tiles are requested before pdl_wait (weights never
// change), so they stream while the kernel before this one finishes. With GPL = 1 the lane's
// group of x stays in registers for the whole launch; with GPL = 2 it is read from shared memory
// per group (two groups would not fit in registers beside the buffers).
template <int BITS, int GPL, int R>
struct QRows {
    uint4 q[R][GPL][BITS / 2];
    float s[R][GPL], b[R][GPL];
};

__device__ __forceinline__ DecSeg seg_of(const DecSegs& segs, int tile) {
    DecSeg sg = segs.s[0];
#pragma unroll
    for (int i = 1; i < DEC_MAX_SEGS; i++)
        if (i < segs.n && tile >= segs.s[i].tile0) sg = segs.s[i];
    return sg;
}

// Rows rbase .. rbase + R - 1 of w (clamped to its last row) into r: the lane's groups sl + j·lpr.
// LEAN (the MoE's rows and int8 kernels): 32-bit offsets, a matrix's words fitting 31 bits
// (decode::serves); otherwise 64-bit ones (DEC_LEAN_WHY).
template <int BITS, int GPL, int R, bool LEAN = false>
__device__ __forceinline__ void qrows_load(const QWeight& w, int rbase, int G, int lpr, int sl,
                                           QRows<BITS, GPL, R>& r) {
    const int WPG = 2 * BITS;  // u32 words per group
    if (LEAN) {
#pragma unroll
        for (int i = 0; i < R; i++) {
            int row_i = min(rbase + i, w.rows - 1);
#pragma unroll
            for (int j = 0; j < GPL; j++) {
                int g = sl + j * lpr;
                u32 rg32 = (u32)row_i * (u32)G + (u32)g;
                long long rg = rg32;
                const uint4* qp = reinterpret_cast<const uint4*>(w.q + rg32 * (u32)WPG);
#pragma unroll
                for (int v = 0; v < BITS / 2; v++) r.q[i][j][v] = ld_stream(qp + v);
                r.s[i][j] = bf16_to_f32(w.scales[rg]);
                r.b[i][j] = bf16_to_f32(w.biases[rg]);
            }
        }
    } else {
        long long wpr = (long long)G * WPG;
#pragma unroll
        for (int i = 0; i < R; i++) {
            long long row = min(rbase + i, w.rows - 1);
#pragma unroll
            for (int j = 0; j < GPL; j++) {
                int g = sl + j * lpr;
                const uint4* qp = reinterpret_cast<const uint4*>(w.q + row * wpr + (long long)g * WPG);
#pragma unroll
                for (int v = 0; v < BITS / 2; v++) r.q[i][j][v] = ld_stream(qp + v);
                r.s[i][j] = bf16_to_f32(w.scales[row * G + g]);
                r.b[i][j] = bf16_to_f32(w.biases[row * G + g]);
            }
        }
    }
}

// acc[i] = the lane's share of row i · x. GPL == 1: xv holds the lane's group and sx its sum;
// otherwise each group is read from shared memory (xs, xsum) into xv.
template <int BITS, int GPL, int R>
__device__ __forceinline__ void qrows_dot(const QRows<BITS, GPL, R>& r, int sl, int lpr, float (&xv)[64], float sx,
                                          const float* xs, const float* xsum, float (&acc)[R]) {
#pragma unroll
    for (int i = 0; i < R; i++) acc[i] = 0.0f;
#pragma unroll
    for (int j = 0; j < GPL; j++) {
        if (GPL > 1) {
            int g = sl + j * lpr;
            load_group(xs + g * DEC_XPAD, xv);
            sx = xsum[g];
        }
#pragma unroll
        for (int i = 0; i < R; i++) acc[i] += group_term<BITS>(r.s[i][j], r.b[i][j], dot_group<BITS>(r.q[i][j], xv), sx);
    }
}

struct TileGeom {
    int G, lpr, spw, warp, sub, sl;
};

template <int R>
__device__ __forceinline__ int tile_row0(const TileGeom& t, int blk) {
    return (blk * DEC_WARPS * t.spw + t.warp * t.spw + t.sub) * R;
}

template <int BITS, int GPL, int R, bool LEAN = false>
__device__ __forceinline__ void gemv_load(const DecSegs& segs, int tile, const TileGeom& t, QRows<BITS, GPL, R>& r) {
    DecSeg sg = seg_of(segs, tile);
    qrows_load<BITS, GPL, R, LEAN>(sg.w, tile_row0<R>(t, tile - sg.tile0), t.G, t.lpr, t.sl, r);
}

// acc[i] = the lane's share of row i · x̃ from the lane's GPL groups of int8 pairs (gemv_int8).
template <int GPL, int R>
__device__ __forceinline__ void qrows_dot_x8x2(const QRows<4, GPL, R>& r, const X8x2Group (&xp)[GPL],
                                               float (&acc)[R]) {
#pragma unroll
    for (int i = 0; i < R; i++) acc[i] = 0.0f;
#pragma unroll
    for (int j = 0; j < GPL; j++)
#pragma unroll
        for (int i = 0; i < R; i++)
            acc[i] += group_term_x8x2(r.s[i][j], r.b[i][j], dot_group_x8x2(r.q[i][j], xp[j]), xp[j]);
}

// PAIRS (the _x8x2 kernels, gemv_int8): the products on xp's int8 pairs, with the lean loads and
// reductions; otherwise on xv / xs in f32 as the kernels compiled before them (DEC_LEAN_WHY).
template <int BITS, int GPL, int R, bool PAIRS = false>
__device__ __forceinline__ void gemv_finish(const DecSegs& segs, int tile, const TileGeom& t,
                                            const QRows<BITS, GPL, R>& r, float (&xv)[64], float sx,
                                            const float* xs, const float* xsum, const X8x2Group (&xp)[GPL]) {
    DecSeg sg = seg_of(segs, tile);
    int rbase = tile_row0<R>(t, tile - sg.tile0);
    float acc[R];
    if constexpr (PAIRS)
        qrows_dot_x8x2<GPL, R>(r, xp, acc);
    else
        qrows_dot<BITS, GPL, R>(r, t.sl, t.lpr, xv, sx, xs, xsum, acc);
    reduce_rows<R, PAIRS>(acc, t.lpr);
    if (t.sl == 0) {
#pragma unroll
        for (int i = 0; i < R; i++)
            if (rbase + i < sg.w.rows) store_out(sg.y + rbase + i, sg.mode, acc[i]);
    }
}

// Tiles of DEC_WARPS · spw · R rows over a persistent grid (see dec_gemv). PAIRS (gemv_int8,
// 4-bit): the staged x rounded to int8 pairs once a block (stage_x8x2 into xq / xqs), the lane's
// GPL groups of them held in registers for the whole launch, dp4a products (gemv_finish).
template <int BITS, int GPL, int R, bool PAIRS = false>
__device__ __forceinline__ void gemv_pipelined(const DecSegs& segs, const float* __restrict__ x,
                                               const float* __restrict__ norm_w, float eps,
                                               const float* __restrict__ gz, int head_dim,
                                               float* __restrict__ xn_out, int cols, float* xs, float* xsum,
                                               u32* xq = nullptr, float2* xqs = nullptr) {
    int lane = threadIdx.x & 31;
    TileGeom tg;
    tg.G = cols >> 6;
    tg.lpr = tg.G / GPL;
    tg.spw = 32 / tg.lpr;
    tg.warp = threadIdx.x >> 5;
    tg.sub = lane / tg.lpr;
    tg.sl = lane % tg.lpr;
    int step = gridDim.x, tiles = segs.tiles;
    QRows<BITS, GPL, R> ra, rb;
    int t = blockIdx.x;
    if (t < tiles) gemv_load<BITS, GPL, R, PAIRS>(segs, t, tg, ra);
    if (t + step < tiles) gemv_load<BITS, GPL, R, PAIRS>(segs, t + step, tg, rb);
    stage_prefetch(norm_w, cols, head_dim, gz != nullptr);
    dec_wait();
    stage_x(x, norm_w, eps, cols, gz, head_dim, xs, xsum, xn_out);
    float xv[64];
    float sx = 0.0f;
    X8x2Group xp[GPL];
    if (PAIRS) {
        stage_x8x2(xs, tg.G, xq, xqs);
        __syncthreads();
#pragma unroll
        for (int j = 0; j < GPL; j++) xp[j] = x8x2_load(xq, xqs, tg.sl + j * tg.lpr);
    } else if (GPL == 1) {
        load_group(xs + tg.sl * DEC_XPAD, xv);
        sx = xsum[tg.sl];
    }
    for (; t < tiles; t += 2 * step) {
        gemv_finish<BITS, GPL, R, PAIRS>(segs, t, tg, ra, xv, sx, xs, xsum, xp);
        if (t + 2 * step < tiles) gemv_load<BITS, GPL, R, PAIRS>(segs, t + 2 * step, tg, ra);
        int tb = t + step;
        if (tb >= tiles) break;
        gemv_finish<BITS, GPL, R, PAIRS>(segs, tb, tg, rb, xv, sx, xs, xsum, xp);
        if (tb + 2 * step < tiles) gemv_load<BITS, GPL, R, PAIRS>(segs, tb + 2 * step, tg, rb);
    }
    dec_trigger_late();  // the block's last rows are summed: let the next kernel start
}

#define DEC_GEMV_PIPELINED(NAME, BITS, GPL, R)                                                                \
    extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32)                                              \
    NAME(DecSegs segs, const float* __restrict__ x, const float* __restrict__ norm_w, float eps,              \
         const float* __restrict__ gz, int head_dim, float* __restrict__ xn_out, int cols) {                  \
        __shared__ __align__(16) float xs[DEC_MAX_GROUPS * DEC_XPAD];                                         \
        __shared__ float xsum[DEC_MAX_GROUPS];                                                                \
        gemv_pipelined<BITS, GPL, R>(segs, x, norm_w, eps, gz, head_dim, xn_out, cols, xs, xsum);             \
    }

DEC_GEMV_PIPELINED(dec_gemv4, 4, 1, DEC_R4)
DEC_GEMV_PIPELINED(dec_gemv4w, 4, 2, 1)
DEC_GEMV_PIPELINED(dec_gemv8, 8, 1, 1)

// dec_gemv4 / dec_gemv4w with int8-pair products (gemv_int8): x staged as dec_gemv4's, then
// rounded to int8 pairs per 64-column group once a block (stage_x8x2), each 4-bit word dotted by
// four dp4a (dot_group_x8x2). A lane holds its groups in 34 registers each instead of 65 (and
// dec_gemv4w both of its groups, which dec_gemv4w reads from shared memory per tile).
#define DEC_GEMV_X8X2(NAME, GPL, R)                                                                           \
    extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32)                                              \
    NAME(DecSegs segs, const float* __restrict__ x, const float* __restrict__ norm_w, float eps,              \
         const float* __restrict__ gz, int head_dim, float* __restrict__ xn_out, int cols) {                  \
        __shared__ __align__(16) float xs[DEC_MAX_GROUPS * DEC_XPAD];                                         \
        __shared__ float xsum[DEC_MAX_GROUPS];                                                                \
        __shared__ __align__(16) u32 xq[DEC_MAX_GROUPS * DEC_X8X2PAD];                                        \
        __shared__ float2 xqs[DEC_MAX_GROUPS];                                                                \
        gemv_pipelined<4, GPL, R, true>(segs, x, norm_w, eps, gz, head_dim, xn_out, cols, xs, xsum, xq, xqs); \
    }

DEC_GEMV_X8X2(dec_gemv4_x8x2, 1, DEC_R4_X8X2)
DEC_GEMV_X8X2(dec_gemv4w_x8x2, 2, 1)

// The matrix of expert e in a stack (rows × cols each). LEAN (the MoE's rows and int8 kernels):
// decode.cu reads 64-column groups only and a matrix's words fit 31 bits (decode::serves), so
// groups · 2 · bits words a matrix, in 32 bits; otherwise in 64 (DEC_LEAN_WHY).
template <bool LEAN = false>
__device__ __forceinline__ QWeight expert(QWeight w, int e) {
    if (LEAN) {
        u32 groups = (u32)w.rows * (u32)(w.cols >> 6);
        w.q += (long long)e * (groups * 2u * (u32)w.bits);
        w.scales += (long long)e * groups;
        w.biases += (long long)e * groups;
    } else {
        long long groups = (long long)w.rows * (w.cols / w.group);
        w.q += (long long)e * w.rows * (w.cols * w.bits / 32);
        w.scales += e * groups;
        w.biases += e * groups;
    }
    return w;
}

// The first half of dec_glu / dec_glu4 after pdl_wait: warp 0 routes the token (block 0 also
// publishes the routing for dec_down_combine) while the others stage xn; stage_x's barriers
// publish ids_s / w_s to the whole block. In the fast form every thread's loads of xn are in
// flight before warp 0 starts routing.
template <bool FAST_ROUTE>
__device__ __forceinline__ void route_warp(const float* __restrict__ router_logits, int n_experts, int top_k,
                                           int* __restrict__ ids, float* __restrict__ route_w, float* p,
                                           int* ids_s, float* w_s) {
    int lane = threadIdx.x & 31;
    if ((threadIdx.x >> 5) == 0) {
        route_top_k<FAST_ROUTE>(router_logits, n_experts, top_k, p, ids_s, w_s);
        __syncwarp();
        if (blockIdx.x == 0 && lane < top_k) {
            ids[lane] = ids_s[lane];
            route_w[lane] = w_s[lane];
        }
    }
}

template <int V, bool FAST_ROUTE>
__device__ __forceinline__ void route_and_stage_fast(const float* __restrict__ router_logits, int n_experts,
                                                     int top_k, int* __restrict__ ids, float* __restrict__ route_w,
                                                     const float* __restrict__ xn, int cols, float* p, int* ids_s,
                                                     float* w_s, float* xs, float* xsum) {
    XRow<V> r;
    stage_load<V>(xn, nullptr, r);
    route_warp<FAST_ROUTE>(router_logits, n_experts, top_k, ids, route_w, p, ids_s, w_s);
    stage_finish<V>(r, nullptr, 0.0f, cols, false, 1, xs, xsum, nullptr);
}

// FAST_ROUTE: the routing in registers (route_top_k); dec_glu, short of registers, passes false.
template <bool FAST_ROUTE>
__device__ __forceinline__ void route_and_stage(const float* __restrict__ router_logits, int n_experts, int top_k,
                                                int* __restrict__ ids, float* __restrict__ route_w,
                                                const float* __restrict__ xn, int cols, float* p, int* ids_s,
                                                float* w_s, float* xs, float* xsum) {
    switch (stage_width(xn, nullptr, cols, nullptr, 1, nullptr)) {
        case 4: route_and_stage_fast<4, FAST_ROUTE>(router_logits, n_experts, top_k, ids, route_w, xn, cols, p, ids_s, w_s, xs, xsum); break;
        case 8: route_and_stage_fast<8, FAST_ROUTE>(router_logits, n_experts, top_k, ids, route_w, xn, cols, p, ids_s, w_s, xs, xsum); break;
        case 16: route_and_stage_fast<16, FAST_ROUTE>(router_logits, n_experts, top_k, ids, route_w, xn, cols, p, ids_s, w_s, xs, xsum); break;
        default:
            route_warp<FAST_ROUTE>(router_logits, n_experts, top_k, ids, route_w, p, ids_s, w_s);
            stage_slow(xn, nullptr, 0.0f, cols, nullptr, 1, xs, xsum, nullptr);
    }
}

// Items 0 .. top_k-1: routed expert ids[k] of the gate/up stacks, output rows h + k·h_stride;
// item top_k: the shared expert (sgate/sup), output hs. xn [cols] is the normed input. Tiles of
// DEC_WARPS · (32 / lpr) · DEC_GLU_R rows, tiles_per_item per item; persistent grid (see dec_gemv).
extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32)
dec_glu(QWeight gate, QWeight up, const float* __restrict__ router_logits, int n_experts, int top_k,
        int* __restrict__ ids, float* __restrict__ route_w, QWeight sgate, QWeight sup,
        const float* __restrict__ xn, float* __restrict__ h, int h_stride, float* __restrict__ hs,
        int tiles_per_item) {
    __shared__ __align__(16) float xs[DEC_MAX_GROUPS * DEC_XPAD];
    __shared__ float xsum[DEC_MAX_GROUPS];
    __shared__ float p[DEC_MAX_EXPERTS];
    __shared__ int ids_s[DEC_MAX_TOPK];
    __shared__ float w_s[DEC_MAX_TOPK];
    int cols = gate.cols;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    dec_wait();
    // Every block routes the token itself (a few hundred cycles, one launch fewer); block 0 also
    // publishes the routing for dec_down_combine.
    route_and_stage<false>(router_logits, n_experts, top_k, ids, route_w, xn, cols, p, ids_s, w_s, xs, xsum);
    int G = cols >> 6;
    int lpr = min(32, G), spw = 32 / lpr;
    int sub = lane / lpr, sl = lane % lpr;
    int tiles = (top_k + 1) * tiles_per_item;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        int item = tile / tiles_per_item, blk = tile % tiles_per_item;
        QWeight wg, wu;
        float* out;
        if (item < top_k) {
            int e = ids_s[item];
            wg = expert(gate, e);
            wu = expert(up, e);
            out = h + (long long)item * h_stride;
        } else {
            wg = sgate;
            wu = sup;
            out = hs;
        }
        if (blk * DEC_WARPS * spw * DEC_GLU_R >= wg.rows) continue;  // past this item's rows
        int rbase = (blk * DEC_WARPS * spw + warp * spw + sub) * DEC_GLU_R;
        float g[DEC_GLU_R], u[DEC_GLU_R];
#pragma unroll
        for (int r = 0; r < DEC_GLU_R; r++) g[r] = u[r] = 0.0f;
        if (wg.bits == 4) {
            rows_dot<4, DEC_GLU_R>(wg, rbase, G, lpr, sl, xs, xsum, g);
            rows_dot<4, DEC_GLU_R>(wu, rbase, G, lpr, sl, xs, xsum, u);
        } else {
            rows_dot<8, DEC_GLU_R>(wg, rbase, G, lpr, sl, xs, xsum, g);
            rows_dot<8, DEC_GLU_R>(wu, rbase, G, lpr, sl, xs, xsum, u);
        }
        reduce_rows<DEC_GLU_R>(g, lpr);
        reduce_rows<DEC_GLU_R>(u, lpr);
        if (sl == 0) {
#pragma unroll
            for (int r = 0; r < DEC_GLU_R; r++)
                if (rbase + r < wg.rows) out[rbase + r] = act(act(siluf(act(g[r]))) * act(u[r]));
        }
    }
}

// dec_glu4: dec_glu pipelined, for 4-bit gate/up stacks with at most 32 groups per row (one
// group per lane; the lane's group of xn in registers). Item 0 is the shared expert, known before
// the routing, so a block whose first tile is one of its rows loads it before pdl_wait; items
// 1 .. top_k are the routed experts ids[k - 1]. A sub-warp streams DEC_GLU_R4 rows of gate and of
// up at once, two register buffers deep, as the pipelined GEMVs do.
struct GluTile {
    QRows<4, 1, DEC_GLU_R4> g, u;
};

template <bool LEAN>
__device__ __forceinline__ void glu_item(int item, const QWeight& gate, const QWeight& up, const QWeight& sgate,
                                         const QWeight& sup, const int* ids_s, QWeight& wg, QWeight& wu) {
    if (item == 0) {
        wg = sgate;
        wu = sup;
    } else {
        wg = expert<LEAN>(gate, ids_s[item - 1]);
        wu = expert<LEAN>(up, ids_s[item - 1]);
    }
}

// A tile of dec_glu4 as (item, tile of the item): tile = item · per_item + blk, carried from one
// tile of a buffer to its next by glu_next instead of divided out per tile (a division by a
// runtime value costs ≈ 20 instructions).
struct GluPos {
    int item, blk;
};

__device__ __forceinline__ GluPos glu_pos(int tile, int per_item) { return {tile / per_item, tile % per_item}; }

// The position `stride` (glu_pos of the tile stride) after p.
__device__ __forceinline__ GluPos glu_next(GluPos p, GluPos stride, int per_item) {
    p.item += stride.item;
    p.blk += stride.blk;
    if (p.blk >= per_item) {
        p.blk -= per_item;
        p.item++;
    }
    return p;
}

template <bool LEAN>
__device__ __forceinline__ void glu_load(GluPos pos, const TileGeom& t, const QWeight& gate, const QWeight& up,
                                         const QWeight& sgate, const QWeight& sup, const int* ids_s, GluTile& r) {
    QWeight wg, wu;
    glu_item<LEAN>(pos.item, gate, up, sgate, sup, ids_s, wg, wu);
    int rbase = tile_row0<DEC_GLU_R4>(t, pos.blk);
    qrows_load<4, 1, DEC_GLU_R4, LEAN>(wg, rbase, t.G, t.lpr, t.sl, r.g);
    qrows_load<4, 1, DEC_GLU_R4, LEAN>(wu, rbase, t.G, t.lpr, t.sl, r.u);
}

// The lane's group of x as dec_glu4 holds it for the whole launch: 64 floats and their sum, or
// (Q8, moe_int8) the group as int8 for dp4a (X8Group, stage_x8), or (Q8 and PAIRS,
// moe_int8_pairs) as int8 pairs (X8x2Group, stage_x8x2).
template <bool Q8, bool PAIRS = false>
struct GluX {
    float v[64];
    float sum;
    __device__ __forceinline__ void load(const float* xs, const float* xsum, const u32*, const float2*, int sl) {
        load_group(xs + sl * DEC_XPAD, v);
        sum = xsum[sl];
    }
    template <int R>
    __device__ __forceinline__ void dot(const QRows<4, 1, R>& r, float (&acc)[R]) {
        qrows_dot<4, 1, R>(r, 0, 1, v, sum, nullptr, nullptr, acc);
    }
};

template <>
struct GluX<true, true> {
    X8x2Group x;
    __device__ __forceinline__ void load(const float*, const float*, const u32* xq, const float2* xqs, int sl) {
        x = x8x2_load(xq, xqs, sl);
    }
    template <int R>
    __device__ __forceinline__ void dot(const QRows<4, 1, R>& r, float (&acc)[R]) {
#pragma unroll
        for (int i = 0; i < R; i++)
            acc[i] = group_term_x8x2(r.s[i][0], r.b[i][0], dot_group_x8x2(r.q[i][0], x), x);
    }
};

template <>
struct GluX<true> {
    X8Group x;
    __device__ __forceinline__ void load(const float*, const float*, const u32* xq, const float2* xqs, int sl) {
        x = x8_load(xq, xqs, sl);
    }
    template <int R>
    __device__ __forceinline__ void dot(const QRows<4, 1, R>& r, float (&acc)[R]) {
#pragma unroll
        for (int i = 0; i < R; i++) acc[i] = group_term_x8(r.s[i][0], r.b[i][0], dot_group_x8(r.q[i][0], x), x);
    }
};

template <bool Q8, bool LEAN, bool PAIRS = false>
__device__ __forceinline__ void glu_finish(GluPos pos, const TileGeom& t, int g_rows, int s_rows, const GluTile& r,
                                           GluX<Q8, PAIRS>& x, float* __restrict__ h, int h_stride,
                                           float* __restrict__ hs) {
    int item = pos.item;
    int rbase = tile_row0<DEC_GLU_R4>(t, pos.blk);
    int rows = item == 0 ? s_rows : g_rows;
    float* out = item == 0 ? hs : h + (long long)(item - 1) * h_stride;
    float g[DEC_GLU_R4], u[DEC_GLU_R4];
    x.dot(r.g, g);
    x.dot(r.u, u);
    reduce_rows<DEC_GLU_R4, LEAN>(g, t.lpr);
    reduce_rows<DEC_GLU_R4, LEAN>(u, t.lpr);
    if (t.sl == 0) {
#pragma unroll
        for (int i = 0; i < DEC_GLU_R4; i++)
            if (rbase + i < rows) out[rbase + i] = act(act(siluf(act(g[i]))) * act(u[i]));
    }
}

// dec_glu4's work for one token (its shared memory passed in; xq / xqs: the int8 x when Q8, as
// pairs when PAIRS too).
// LEAN (every kernel but the one-token f32 dec_glu4): the tiles' positions carried (GluPos) and
// the cuts of expert / qrows_load / reduce_rows; otherwise the tile loop as dec_glu4 compiled
// before them (DEC_LEAN_WHY).
template <bool Q8, bool LEAN, bool PAIRS = false>
__device__ __forceinline__ void glu4_token(QWeight gate, QWeight up, const float* __restrict__ router_logits,
                                           int n_experts, int top_k, int* __restrict__ ids,
                                           float* __restrict__ route_w, QWeight sgate, QWeight sup,
                                           const float* __restrict__ xn, float* __restrict__ h, int h_stride,
                                           float* __restrict__ hs, int tiles_per_item, float* xs, float* xsum,
                                           float* p, int* ids_s, float* w_s, u32* xq, float2* xqs, int h_tok,
                                           int hs_tok) {
    static_assert(LEAN || !Q8, "the int8 kernels are lean");
    int cols = gate.cols;
    int lane = threadIdx.x & 31;
    TileGeom tg;
    tg.G = cols >> 6;
    tg.lpr = tg.G;
    tg.spw = 32 / tg.lpr;
    tg.warp = threadIdx.x >> 5;
    tg.sub = lane / tg.lpr;
    tg.sl = lane % tg.lpr;
    // Block b takes tiles b, b + step, b + 2 step, ... (step = gridDim.x), alternately into the
    // register buffers ra and rb: each buffer's tiles are 2 step apart.
    int step = gridDim.x, items = top_k + 1, per_item = tiles_per_item;
    GluTile ra, rb;
    if (!LEAN) {
        // The tile index itself, divided into (item, tile of the item) where used (DEC_LEAN_WHY).
        int t = blockIdx.x, tiles = (top_k + 1) * tiles_per_item;
        bool early = t < per_item;  // the shared expert's rows: no routing needed
        if (early) glu_load<LEAN>(glu_pos(t, per_item), tg, gate, up, sgate, sup, ids_s, ra);
        dec_wait();
        route_and_stage<true>(router_logits, n_experts, top_k, ids, route_w, xn, cols, p, ids_s, w_s, xs, xsum);
        if (!early && t < tiles) glu_load<LEAN>(glu_pos(t, per_item), tg, gate, up, sgate, sup, ids_s, ra);
        if (t + step < tiles) glu_load<LEAN>(glu_pos(t + step, per_item), tg, gate, up, sgate, sup, ids_s, rb);
        GluX<Q8> x;
        x.load(xs, xsum, xq, xqs, tg.sl);
        for (; t < tiles; t += 2 * step) {
            glu_finish<Q8, LEAN>(glu_pos(t, per_item), tg, gate.rows, sgate.rows, ra, x,
                                 h + (long long)blockIdx.y * h_tok, h_stride, hs + (long long)blockIdx.y * hs_tok);
            if (t + 2 * step < tiles)
                glu_load<LEAN>(glu_pos(t + 2 * step, per_item), tg, gate, up, sgate, sup, ids_s, ra);
            int tb = t + step;
            if (tb >= tiles) break;
            glu_finish<Q8, LEAN>(glu_pos(tb, per_item), tg, gate.rows, sgate.rows, rb, x,
                                 h + (long long)blockIdx.y * h_tok, h_stride, hs + (long long)blockIdx.y * hs_tok);
            if (tb + 2 * step < tiles)
                glu_load<LEAN>(glu_pos(tb + 2 * step, per_item), tg, gate, up, sgate, sup, ids_s, rb);
        }
    } else {
        GluPos a = glu_pos(blockIdx.x, per_item), b = glu_pos(blockIdx.x + step, per_item);
        const GluPos stride = glu_pos(2 * step, per_item);
        bool early = a.item == 0;  // the shared expert's rows: no routing needed
        if (early) glu_load<LEAN>(a, tg, gate, up, sgate, sup, ids_s, ra);
        dec_wait();
        route_and_stage<true>(router_logits, n_experts, top_k, ids, route_w, xn, cols, p, ids_s, w_s, xs, xsum);
        if (!early && a.item < items) glu_load<LEAN>(a, tg, gate, up, sgate, sup, ids_s, ra);
        if (b.item < items) glu_load<LEAN>(b, tg, gate, up, sgate, sup, ids_s, rb);
        if (Q8) {
            if (PAIRS)
                stage_x8x2(xs, tg.G, xq, xqs);
            else
                stage_x8(xs, tg.G, xq, xqs);
            __syncthreads();
        }
        GluX<Q8, PAIRS> x;
        x.load(xs, xsum, xq, xqs, tg.sl);
        while (a.item < items) {
            glu_finish<Q8, LEAN, PAIRS>(a, tg, gate.rows, sgate.rows, ra, x,
                                 h + (long long)blockIdx.y * h_tok, h_stride, hs + (long long)blockIdx.y * hs_tok);
            a = glu_next(a, stride, per_item);
            if (a.item < items) glu_load<LEAN>(a, tg, gate, up, sgate, sup, ids_s, ra);
            if (b.item >= items) break;
            glu_finish<Q8, LEAN, PAIRS>(b, tg, gate.rows, sgate.rows, rb, x,
                                 h + (long long)blockIdx.y * h_tok, h_stride, hs + (long long)blockIdx.y * hs_tok);
            b = glu_next(b, stride, per_item);
            if (b.item < items) glu_load<LEAN>(b, tg, gate, up, sgate, sup, ids_s, rb);
        }
    }
    dec_trigger_late();
}

#define GLU4_SHARED                                          \
    __shared__ __align__(16) float xs[DEC_MAX_GROUPS * DEC_XPAD]; \
    __shared__ float xsum[DEC_MAX_GROUPS];                   \
    __shared__ float p[DEC_MAX_EXPERTS];                     \
    __shared__ int ids_s[DEC_MAX_TOPK];                      \
    __shared__ float w_s[DEC_MAX_TOPK];

// The int8 x of the _q8 kernels (moe_int8): packed groups and their scales / sums (stage_x8);
// of the _x8x2 kernels (moe_int8_pairs) as int8 pairs (stage_x8x2).
#define GLU4_SHARED_Q8                                              \
    __shared__ __align__(16) u32 xq[DEC_X8_GROUPS * DEC_X8PAD]; \
    __shared__ float2 xqs[DEC_X8_GROUPS];
#define GLU4_SHARED_X8X2                                              \
    __shared__ __align__(16) u32 xq[DEC_X8_GROUPS * DEC_X8X2PAD]; \
    __shared__ float2 xqs[DEC_X8_GROUPS];

// dec_glu4 and its batched form dec_glu4_rows, in f32 products or (the _q8 kernels, moe_int8)
// in int8 ones: xn rounded to int8 per 64-column group once per block, each 4-bit word dotted by
// two dp4a (group_term_x8). The _q8 kernels hold a lane's x in 18 registers instead of 65, so
// DEC_Q8_BLOCKS blocks fit an SM (their launcher's grid takes as many).
// The rows forms take token b in blockIdx.y (each routes its own row and streams its own
// experts): router_logits [B, n_experts], ids and route_w [B, top_k] (written), xn [B, cols], h
// [B, top_k, h_stride], hs [B, sgate.rows]; the shared expert is read once per token; grid
// (blocks per token, B); dec_glu4_q8 is their code with grid.y = 1. The outputs' token
// offsets are taken where they are stored (from blockIdx.y), not held through the tile loop: two
// blocks of dec_glu4_rows fit an SM only below 128 registers. LEAN false (dec_glu4 alone): no
// token offsets and the code before the cuts (DEC_LEAN_WHY). BOUNDS: __launch_bounds__' arguments.
#define DEC_GLU4(NAME, Q8, LEAN, BOUNDS)                                                                      \
    extern "C" __global__ void __launch_bounds__ BOUNDS                                                       \
    NAME(QWeight gate, QWeight up, const float* __restrict__ router_logits, int n_experts, int top_k,         \
         int* __restrict__ ids, float* __restrict__ route_w, QWeight sgate, QWeight sup,                      \
         const float* __restrict__ xn, float* __restrict__ h, int h_stride, float* __restrict__ hs,           \
         int tiles_per_item) {                                                                                \
        GLU4_SHARED                                                                                           \
        GLU4_SHARED_##Q8                                                                                      \
        long long b = LEAN ? blockIdx.y : 0;                                                                  \
        glu4_token<Q8##_ON, LEAN, Q8##_PAIRS>(gate, up, router_logits + b * n_experts, n_experts, top_k,      \
                                               ids + b * top_k, route_w + b * top_k, sgate, sup,              \
                                               xn + b * gate.cols, h, h_stride, hs, tiles_per_item, xs, xsum, \
                                               p, ids_s, w_s, GLU4_XQ_##Q8, LEAN ? top_k * h_stride : 0,      \
                                               LEAN ? sgate.rows : 0);                                        \
    }

#define GLU4_SHARED_F32
#define F32_ON false
#define Q8_ON true
#define X8X2_ON true
#define F32_PAIRS false
#define Q8_PAIRS false
#define X8X2_PAIRS true
#define GLU4_XQ_F32 nullptr, nullptr
#define GLU4_XQ_Q8 xq, xqs
#define GLU4_XQ_X8X2 xq, xqs

DEC_GLU4(dec_glu4, F32, false, (DEC_WARPS * 32))
DEC_GLU4(dec_glu4_q8, Q8, true, (DEC_WARPS * 32, DEC_Q8_BLOCKS))
DEC_GLU4(dec_glu4_rows, F32, true, (DEC_WARPS * 32, DEC_BLOCKS_PER_SM))
DEC_GLU4(dec_glu4_q8_rows, Q8, true, (DEC_WARPS * 32, DEC_Q8_BLOCKS))
// moe_int8_pairs: the _q8 kernels on int8 pairs of xn (stage_x8x2, four dp4a a word; a lane's x
// in 34 registers: 2 blocks an SM).
DEC_GLU4(dec_glu4_x8x2, X8X2, true, (DEC_WARPS * 32, DEC_BLOCKS_PER_SM))
DEC_GLU4(dec_glu4_x8x2_rows, X8X2, true, (DEC_WARPS * 32, DEC_BLOCKS_PER_SM))

// ---- dec_glu4_x8x2_bulk (moe_bulk): dec_glu4_x8x2 with every tile requested before any is used ----
// dec_glu4_x8x2's grid, tiles and arithmetic (glu_finish on the same GluTile values, so the same
// outputs bit for bit), its weights streamed into shared memory instead of registers: each tile
// (DEC_WARPS · spw rows of gate and of up, their scales and biases: six contiguous runs of the
// stacks) goes into a slot of its own through the bulk-copy engine (cp.async.bulk, Hopper),
// completing the slot's mbarrier (its expected bytes set before the copies). Lane 0 of warp w
// requests slot w: the shared expert's tiles before dec_wait, the routed ones right after the
// routing, so a block has all of its tiles (at most DEC_BULK_SLOTS; the launcher's grid sees to
// it) in flight before it computes the first; then each tile is computed as its barrier
// completes, in order, one tile a loop iteration (no unrolling over tiles: a small loop body).
// dec_glu4_x8x2 holds at most two tiles a block in registers (115 registers a thread), so a
// block of three tiles (48 of the 264 at the model's shape) asks for its third only after its
// first is summed: two DRAM round trips after the routing where this kernel has one. Here the
// bytes in flight are bounded by shared memory (DEC_BULK_SLOT bytes a tile: 18 KB at the model's
// shape, 3 tiles a block at 264 blocks, 2 blocks an SM: 108 KB of 228) and the registers hold
// only x and one tile's sums.
// A slot: gate's q words [rows][G][8], then up's, then gate's scales [rows][G], gate's biases,
// up's scales, up's biases (bf16), at fixed offsets for DEC_WARPS · 32 groups (spw · G ≤ 32).
#define DEC_BULK_Q (DEC_WARPS * 32 * 32)  // bytes of one weight's q words in a slot
#define DEC_BULK_S (DEC_WARPS * 32 * 2)   // bytes of one weight's scales (or biases) in a slot
#if DEC_BULK_SLOT != 2 * DEC_BULK_Q + 4 * DEC_BULK_S
#error "DEC_BULK_SLOT (crates/lily-cuda/src/kernels/decode.rs) must be a slot's bytes"
#endif
#if DEC_BULK_SLOTS > DEC_WARPS
#error "dec_glu4_x8x2_bulk: a warp requests each slot (DEC_BULK_SLOTS <= DEC_WARPS)"
#endif

// The rows of tile `pos` that exist (DEC_WARPS · spw from its first, fewer at an item's end, none
// past it: an item of fewer rows than the largest has tiles of none).
__device__ __forceinline__ int bulk_rows(GluPos pos, int tile_rows, int g_rows, int s_rows) {
    return min(tile_rows, (pos.item == 0 ? s_rows : g_rows) - pos.blk * tile_rows);
}

// One thread: tile `pos` into `slot`, completing `bar`.
__device__ __forceinline__ void bulk_request(GluPos pos, int tile_rows, int G, const QWeight& gate,
                                             const QWeight& up, const QWeight& sgate, const QWeight& sup,
                                             const int* ids_s, char* slot, unsigned long long* bar) {
    QWeight wg, wu;
    glu_item<true>(pos.item, gate, up, sgate, sup, ids_s, wg, wu);
    int n = bulk_rows(pos, tile_rows, gate.rows, sgate.rows);
    if (n <= 0) return;
    u32 g0 = (u32)(pos.blk * tile_rows) * (u32)G;  // the tile's first (row, group)
    u32 qb = (u32)n * (u32)G * 32u, sb = (u32)n * (u32)G * 2u;
    bulk_expect(bar, 2u * qb + 4u * sb);
    bulk_copy(slot, wg.q + g0 * 8u, qb, bar);
    bulk_copy(slot + DEC_BULK_Q, wu.q + g0 * 8u, qb, bar);
    bulk_copy(slot + 2 * DEC_BULK_Q, wg.scales + g0, sb, bar);
    bulk_copy(slot + 2 * DEC_BULK_Q + DEC_BULK_S, wg.biases + g0, sb, bar);
    bulk_copy(slot + 2 * DEC_BULK_Q + 2 * DEC_BULK_S, wu.scales + g0, sb, bar);
    bulk_copy(slot + 2 * DEC_BULK_Q + 3 * DEC_BULK_S, wu.biases + g0, sb, bar);
}

// The lane's group of its row of the tile in `slot` (n rows landed) as qrows_load<4, 1, 1> holds
// it: rows past the n clamped to the last, as qrows_load clamps them to the weight's last row.
__device__ __forceinline__ void bulk_read(const char* slot, int n, const TileGeom& t, GluTile& r) {
    int gi = min(t.warp * t.spw + t.sub, n - 1) * t.G + t.sl;
    const uint4* gq = reinterpret_cast<const uint4*>(slot) + 2 * gi;
    const uint4* uq = reinterpret_cast<const uint4*>(slot + DEC_BULK_Q) + 2 * gi;
    const u16* sbv = reinterpret_cast<const u16*>(slot + 2 * DEC_BULK_Q) + gi;
    r.g.q[0][0][0] = gq[0];
    r.g.q[0][0][1] = gq[1];
    r.u.q[0][0][0] = uq[0];
    r.u.q[0][0][1] = uq[1];
    r.g.s[0][0] = bf16_to_f32(sbv[0]);
    r.g.b[0][0] = bf16_to_f32(sbv[DEC_BULK_S / 2]);
    r.u.s[0][0] = bf16_to_f32(sbv[DEC_BULK_S]);
    r.u.b[0][0] = bf16_to_f32(sbv[3 * DEC_BULK_S / 2]);
}

// dec_glu4_x8x2_bulk's work (one token): slots [DEC_BULK_SLOTS][DEC_BULK_SLOT] of dynamic shared
// memory, bars one mbarrier a slot; the rest as glu4_token.
__device__ __forceinline__ void glu4_bulk_token(QWeight gate, QWeight up, const float* __restrict__ router_logits,
                                                int n_experts, int top_k, int* __restrict__ ids,
                                                float* __restrict__ route_w, QWeight sgate, QWeight sup,
                                                const float* __restrict__ xn, float* __restrict__ h, int h_stride,
                                                float* __restrict__ hs, int per_item, float* xs, float* xsum,
                                                float* p, int* ids_s, float* w_s, u32* xq, float2* xqs,
                                                char* slots, unsigned long long* bars) {
    int lane = threadIdx.x & 31;
    TileGeom tg;
    tg.G = gate.cols >> 6;
    tg.lpr = tg.G;
    tg.spw = 32 / tg.lpr;
    tg.warp = threadIdx.x >> 5;
    tg.sub = lane / tg.lpr;
    tg.sl = lane % tg.lpr;
    const int tile_rows = DEC_WARPS * tg.spw, step = gridDim.x;
    // Block b's tiles: b, b + step, ... (< tiles; the launcher keeps b < tiles and their count
    // at most DEC_BULK_SLOTS).
    const int tiles = (top_k + 1) * per_item, n = (tiles - (int)blockIdx.x + step - 1) / step;
    const GluPos first = glu_pos(blockIdx.x, per_item), stride = glu_pos(step, per_item);
    // Warp w's lane 0 requests slot w (tile b + w·step): a block's requests go out side by side
    // from up to DEC_BULK_SLOTS warps (a bulk copy is a loop of uniform-register instructions in
    // SASS; 18 of them from one thread would queue ≈ 300 instructions behind the routing).
    const bool requester = lane == 0 && tg.warp < n;
    const GluPos mine = glu_pos(blockIdx.x + tg.warp * step, per_item);  // (used where tg.warp < n)
    char* const my_slot = slots + tg.warp * DEC_BULK_SLOT;
    if (threadIdx.x == 0) {
#pragma unroll
        for (int i = 0; i < DEC_BULK_SLOTS; i++) bulk_bar_init(bars + i);  // (n ≤ DEC_BULK_SLOTS)
        bulk_bar_fence();
    }
    __syncthreads();  // the inits before any warp's request
    // The shared expert's tiles (item 0): no routing needed.
    if (requester && mine.item == 0)
        bulk_request(mine, tile_rows, tg.G, gate, up, sgate, sup, ids_s, my_slot, bars + tg.warp);
    dec_wait();
    // Its barriers publish ids_s to the block.
    route_and_stage<true>(router_logits, n_experts, top_k, ids, route_w, xn, gate.cols, p, ids_s, w_s, xs, xsum);
    if (requester && mine.item > 0)
        bulk_request(mine, tile_rows, tg.G, gate, up, sgate, sup, ids_s, my_slot, bars + tg.warp);
    stage_x8x2(xs, tg.G, xq, xqs);
    __syncthreads();
    GluX<true, true> x;
    x.load(xs, xsum, xq, xqs, tg.sl);
    GluPos a = first;
#pragma unroll 1
    for (int i = 0; i < n; i++, a = glu_next(a, stride, per_item)) {
        int rows = bulk_rows(a, tile_rows, gate.rows, sgate.rows);
        if (rows <= 0) continue;  // nothing requested, nothing stored
        bulk_wait(bars + i);
        GluTile r;
        bulk_read(slots + i * DEC_BULK_SLOT, rows, tg, r);
        glu_finish<true, true, true>(a, tg, gate.rows, sgate.rows, r, x, h, h_stride, hs);
    }
    dec_trigger_late();
}

// Arguments as dec_glu4_x8x2's (one token); dynamic shared memory: the block's tiles' slots
// (DEC_BULK_SLOT bytes each). Below sm_90 the bulk copies trap (common.cuh); the plan names the
// kernel on sm_90a only.
extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32, DEC_BLOCKS_PER_SM)
dec_glu4_x8x2_bulk(QWeight gate, QWeight up, const float* __restrict__ router_logits, int n_experts, int top_k,
                   int* __restrict__ ids, float* __restrict__ route_w, QWeight sgate, QWeight sup,
                   const float* __restrict__ xn, float* __restrict__ h, int h_stride, float* __restrict__ hs,
                   int tiles_per_item) {
    GLU4_SHARED
    GLU4_SHARED_X8X2
    __shared__ __align__(8) unsigned long long bars[DEC_BULK_SLOTS];
    extern __shared__ __align__(128) char glu_slots[];
    glu4_bulk_token(gate, up, router_logits, n_experts, top_k, ids, route_w, sgate, sup, xn, h, h_stride, hs,
                    tiles_per_item, xs, xsum, p, ids_s, w_s, xq, xqs, glu_slots, bars);
}

// The top_k + 1 rows of the down projections' inputs (h [top_k, h_stride], then hs) into shared
// memory (hsm [items][G][DEC_XPAD]) with their group sums (hsum [items][G]), 16 bytes at a time,
// DEC_DOWN_STAGE loads in flight per thread; a 64-column group is 16 consecutive loads of one
// half-warp (every bound here is a multiple of 16 loads: cols % 64 == 0, blockDim % 32 == 0), so
// its sum is a shuffle over those 16 lanes.
__device__ __forceinline__ void stage_items(const float* __restrict__ h, int h_stride, const float* __restrict__ hs,
                                            int top_k, int cols, float* hsm, float* hsum) {
    int G = cols >> 6, items = top_k + 1;
    int n4 = items * cols / 4;
    for (int i0 = 0; i0 < n4; i0 += DEC_DOWN_STAGE * blockDim.x) {
        float4 v[DEC_DOWN_STAGE];
#pragma unroll
        for (int i = 0; i < DEC_DOWN_STAGE; i++) {
            int idx = i0 + i * blockDim.x + threadIdx.x;
            v[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (idx < n4) {
                int k = (4 * idx) / cols, col = (4 * idx) % cols;
                const float* src = k < top_k ? h + (long long)k * h_stride + col : hs + col;
                v[i] = *reinterpret_cast<const float4*>(src);
            }
        }
#pragma unroll
        for (int i = 0; i < DEC_DOWN_STAGE; i++) {
            int idx = i0 + i * blockDim.x + threadIdx.x;
            int k = (4 * idx) / cols, col = (4 * idx) % cols;
            if (idx < n4) *reinterpret_cast<float4*>(&hsm[(k * G + (col >> 6)) * DEC_XPAD + (col & 63)]) = v[i];
            float gs = (v[i].x + v[i].y) + (v[i].z + v[i].w);
#pragma unroll
            for (int o = 8; o > 0; o >>= 1) gs += __shfl_xor_sync(0xffffffffu, gs, o);
            if (idx < n4 && (threadIdx.x & 15) == 0) hsum[k * G + (col >> 6)] = gs;
        }
    }
}

// x[c] += Σ_k w_k · act(down_{ids[k]}[c] · h_k) + act(act(sigmoid(s_gate)) · act(sdown[c] · hs)), then
// rounded, as moe_combine does. h [top_k, h_stride], hs [inter]. Items i < top_k are the routed
// experts, item top_k the shared one. A block serves DEC_DOWN_WARPS · (32 / lpr) output rows with
// DEC_DOWN_WARPS · DEC_DOWN_KSPLIT warps: warp (rg, kc) takes the rows of row group rg for items
// kc, kc + KSPLIT, ..., so the per-lane work is a KSPLIT-th of the items and an SM has enough warps
// to hide its latencies; the chunks' partial sums meet in shared memory. Dynamic shared memory
// (down_smem in the launcher): the top_k + 1 input rows padded, their group sums, the partials.
// grid ceil(hidden / (DEC_DOWN_WARPS · (32 / lpr))).
// Q8 (the _q8 kernels, moe_int8; 4-bit down weights, one group a lane): the staged rows are
// rounded to int8 per 64-column group (stage_x8, into hq / hqs after the partials) and each
// 4-bit word dotted with them by two dp4a (group_term_x8), as dec_glu4_q8 does; with PAIRS
// (the _x8x2 kernels, moe_int8_pairs) to int8 pairs (stage_x8x2, four dp4a a word).
template <bool Q8, bool LEAN, bool PAIRS = false>
__device__ __forceinline__ void down_combine_token(QWeight down, QWeight sdown, const int* __restrict__ ids,
                                                   const float* __restrict__ route_w, int top_k,
                                                   const float* __restrict__ h, int h_stride,
                                                   const float* __restrict__ hs, const float* __restrict__ s_gate,
                                                   float* __restrict__ x) {
    extern __shared__ __align__(16) float dec_smem[];
    int cols = down.cols, G = cols >> 6;
    int items = top_k + 1;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int rg = warp % DEC_DOWN_WARPS, kc = warp / DEC_DOWN_WARPS;
    int lpr = min(32, G), spw = 32 / lpr;
    int sub = lane / lpr, sl = lane % lpr;
    int rows_per_block = DEC_DOWN_WARPS * spw;
    float* hsm = dec_smem;                           // [items][G][DEC_XPAD]
    float* hsum = hsm + items * G * DEC_XPAD;        // [items][G]
    float* part = hsum + items * G;                  // [KSPLIT][rows_per_block]
    float* shared_part = part + DEC_DOWN_KSPLIT * rows_per_block;  // [rows_per_block]
    // Q8: [items][G][DEC_X8PAD] (PAIRS: DEC_X8X2PAD) words at a 16-byte boundary, then [items][G]
    // (scale, scale · Σ x̂)
    u32* hq = reinterpret_cast<u32*>(dec_smem + ((items * G * (DEC_XPAD + 1) + (DEC_DOWN_KSPLIT + 1) * rows_per_block + 3) & ~3));
    float2* hqs = reinterpret_cast<float2*>(hq + items * G * (PAIRS ? DEC_X8X2PAD : DEC_X8PAD));
    int r_local = rg * spw + sub;
    int c = blockIdx.x * rows_per_block + r_local;
    int cc = min(c, down.rows - 1);
    long long wpr = (long long)G * 8;
    bool fast = down.bits == 4 && sdown.bits == 4 && G <= 32;
    // The fast path (one 4-bit group per lane): the warp's first DEC_DOWN_BATCH items are requested
    // before the inputs are staged (the shared expert's before pdl_wait: it needs no routing).
    uint4 q[DEC_DOWN_BATCH][2];
    float s[DEC_DOWN_BATCH], b[DEC_DOWN_BATCH];
    auto load = [&](int j, int i) {
        QWeight w = i < top_k ? expert<LEAN>(down, ids[i]) : sdown;
        const uint4* qp = reinterpret_cast<const uint4*>(w.q + cc * wpr + (long long)sl * 8);
        q[j][0] = ld_stream(qp);
        q[j][1] = ld_stream(qp + 1);
        s[j] = bf16_to_f32(w.scales[(long long)cc * G + sl]);
        b[j] = bf16_to_f32(w.biases[(long long)cc * G + sl]);
    };
    if (fast) {
#pragma unroll
        for (int j = 0; j < DEC_DOWN_BATCH; j++)
            if (kc + j * DEC_DOWN_KSPLIT == top_k) load(j, top_k);
    }
    dec_wait();
    if (fast) {
#pragma unroll
        for (int j = 0; j < DEC_DOWN_BATCH; j++) {
            int i = kc + j * DEC_DOWN_KSPLIT;
            if (i < top_k) load(j, i);
        }
    }
    stage_items(h, h_stride, hs, top_k, cols, hsm, hsum);
    __syncthreads();
    if (Q8) {
        if (PAIRS)
            stage_x8x2(hsm, items * G, hq, hqs);
        else
            stage_x8(hsm, items * G, hq, hqs);
        __syncthreads();
    }
    float y = 0.0f, ys = 0.0f;
    if (fast) {
        for (int j0 = 0; kc + j0 * DEC_DOWN_KSPLIT < items; j0 += DEC_DOWN_BATCH) {
            if (j0 > 0) {
#pragma unroll
                for (int j = 0; j < DEC_DOWN_BATCH; j++) {
                    int i = kc + (j0 + j) * DEC_DOWN_KSPLIT;
                    if (i < items) load(j, i);
                }
            }
#pragma unroll
            for (int j = 0; j < DEC_DOWN_BATCH; j++) {
                int i = kc + (j0 + j) * DEC_DOWN_KSPLIT;
                if (i < items) {
                    float acc[1];
                    if constexpr (PAIRS) {
                        X8x2Group xq = x8x2_load(hq, hqs, i * G + sl);
                        acc[0] = group_term_x8x2(s[j], b[j], dot_group_x8x2(q[j], xq), xq);
                    } else if (Q8) {
                        X8Group xq = x8_load(hq, hqs, i * G + sl);
                        acc[0] = group_term_x8(s[j], b[j], dot_group_x8(q[j], xq), xq);
                    } else {
                        float xv[64];
                        load_group(hsm + (i * G + sl) * DEC_XPAD, xv);
                        acc[0] = group_term<4>(s[j], b[j], dot_group<4>(q[j], xv), hsum[i * G + sl]);
                    }
                    reduce_rows<1, LEAN>(acc, lpr);
                    if (i < top_k)
                        y += route_w[i] * act(acc[0]);
                    else
                        ys = act(acc[0]);
                }
            }
        }
    } else {
        for (int i = kc; i < items; i += DEC_DOWN_KSPLIT) {
            QWeight w = i < top_k ? expert<LEAN>(down, ids[i]) : sdown;
            float acc[1] = {0.0f};
            if (w.bits == 4)
                rows_dot<4, 1>(w, cc, G, lpr, sl, hsm + i * G * DEC_XPAD, hsum + i * G, acc);
            else
                rows_dot<8, 1>(w, cc, G, lpr, sl, hsm + i * G * DEC_XPAD, hsum + i * G, acc);
            reduce_rows<1, LEAN>(acc, lpr);
            if (i < top_k)
                y += route_w[i] * act(acc[0]);
            else
                ys = act(acc[0]);
        }
    }
    dec_trigger_late();
    if (sl == 0) {
        part[kc * rows_per_block + r_local] = y;
        if (kc == top_k % DEC_DOWN_KSPLIT) shared_part[r_local] = ys;
    }
    __syncthreads();
    if (kc == 0 && sl == 0 && c < down.rows) {
        float yy = part[r_local];
        for (int k = 1; k < DEC_DOWN_KSPLIT; k++) yy += part[k * rows_per_block + r_local];
        yy += act(act(sigmoidf(s_gate[0])) * shared_part[r_local]);
        x[c] = act(x[c] + act(yy));
    }
}

// dec_down_combine and, token b in blockIdx.y, dec_down_combine_rows (the batched step's): ids
// and route_w [B, top_k], h [B, top_k, h_stride], hs [B, sdown.cols], s_gate [B], x [B,
// down.rows]; grid (ceil(hidden / rows a block), B); a one-token launch has grid.y = 1. LEAN false
// (dec_down_combine alone): no token offsets and the code before the cuts (DEC_LEAN_WHY). QUALS:
// the kernel's register qualifier (__launch_bounds__ or __maxnreg__: NVRTC takes one of them).
#define DEC_DOWN_COMBINE(NAME, Q8, LEAN, PAIRS, QUALS)                                                              \
    extern "C" __global__ void QUALS                                                                                \
    NAME(QWeight down, QWeight sdown, const int* __restrict__ ids, const float* __restrict__ route_w, int top_k,    \
         const float* __restrict__ h, int h_stride, const float* __restrict__ hs, const float* __restrict__ s_gate, \
         float* __restrict__ x) {                                                                                   \
        long long b = LEAN ? blockIdx.y : 0;                                                                        \
        down_combine_token<Q8, LEAN, PAIRS>(down, sdown, ids + b * top_k, route_w + b * top_k, top_k,               \
                                            h + b * top_k * h_stride, h_stride, hs + b * sdown.cols, s_gate + b,    \
                                            x + b * down.rows);                                                     \
    }

#define DEC_DOWN_BOUNDS (DEC_DOWN_WARPS * DEC_DOWN_KSPLIT * 32)
DEC_DOWN_COMBINE(dec_down_combine, false, false, false, __launch_bounds__ DEC_DOWN_BOUNDS)
DEC_DOWN_COMBINE(dec_down_combine_q8, true, true, false, __launch_bounds__ DEC_DOWN_BOUNDS)
DEC_DOWN_COMBINE(dec_down_combine_rows, false, true, false, __launch_bounds__ DEC_DOWN_BOUNDS)
DEC_DOWN_COMBINE(dec_down_combine_q8_rows, true, true, false, __launch_bounds__ DEC_DOWN_BOUNDS)
// moe_int8_pairs: the _q8 kernels on int8 pairs of the hidden rows. One block an SM may take up to
// 168 registers (≈ 100: the pairs of an item beside DEC_DOWN_BATCH items' words; held to two
// blocks' 85 they spill): a one-token launch has fewer blocks than SMs anyway (hidden / (rows a
// block): 128 at the full shape).
DEC_DOWN_COMBINE(dec_down_combine_x8x2, true, true, true, __launch_bounds__ (DEC_DOWN_WARPS * DEC_DOWN_KSPLIT * 32, 1))
DEC_DOWN_COMBINE(dec_down_combine_x8x2_rows, true, true, true, __launch_bounds__ (DEC_DOWN_WARPS * DEC_DOWN_KSPLIT * 32, 1))
// down_96_regs: dec_down_combine_x8x2's code held to 96 registers a thread (100 unbounded), so that
// its block (12 warps: 36,864 registers) and one block of the next layer's first projection
// (dec_gemv4_x8x2, 8 warps at 112: 28,672) fill an SM's 65,536 together: with the early trigger
// that block is resident, and its first weight tiles requested, while this one still runs (at
// 100 registers it waits for this block to exit). The same code, so the same outputs bit for bit.
DEC_DOWN_COMBINE(dec_down_combine_x8x2_r96, true, true, true, __maxnreg__(DEC_DOWN_NEXT_REGS))

// ---- the batched MoE grouped by expert (moe_grouped_rows) ---------------------------------------
// A batched step's B rows pick B · top_k experts (≈ 57 distinct of 64 at B = 8 on 256 experts,
// more shared when the rows' picks overlap) and all take the shared expert. The _rows kernels
// stream each pick's weights once per row that picked it (the shared expert B times), each row
// in its own blocks (grid.y); the _grouped forms read each picked expert's weights once a step
// and dot them with every row that picked it: their blocks loop over the union of the rows' picks
// (group_picks: item 0 the shared expert, then the distinct experts by ascending id), the int8
// pairs of all rows' inputs staged once a block. Per (row, expert) the products, reductions and
// roundings are dec_glu4_x8x2's and dec_down_combine_x8x2's, and the down kernel combines a row's
// items in dec_down_combine_x8x2's order, so each row's outputs are bit for bit the one-token pair
// kernels'. Limits (the launcher checks: decode::grouped_serves): rows ≤ DEC_B_MAX, rows · top_k ≤
// DEC_GRP_PICKS, n_experts ≤ 32 · ROUTE_REG (the routing in registers), one 64-column group a lane.
#define DEC_GRP_ITEMS (DEC_GRP_PICKS + 1)
#define DEC_GRP_SHARED                                        \
    __shared__ int ids_s[DEC_GRP_PICKS];                      \
    __shared__ float w_s[DEC_GRP_PICKS];                      \
    __shared__ u32 grp_bits[DEC_MAX_EXPERTS / 32];            \
    __shared__ int grp_expert[DEC_GRP_ITEMS];                 \
    __shared__ u32 grp_rows[DEC_GRP_ITEMS];                   \
    __shared__ int grp_slot[DEC_GRP_ITEMS * DEC_B_MAX];       \
    __shared__ int grp_n[1];

// The items of a step (pointers into the block's shared memory): n[0] of them; item i > 0 is
// expert[i]; rows[i] has bit b set when row b picked it, slot[i · DEC_B_MAX + b] its rank k in
// row b's picks (item 0, the shared expert: every row, slot top_k).
struct GrpTable {
    int* expert;
    u32* rows;
    int* slot;
    int* n;
};

// The table of the picks ids_s [rows][top_k] (each row's top_k distinct), by all threads of the
// block (blockDim ≥ rows · top_k): a bitmap of the picked experts, then each pick's item is 1 + the
// picked experts below it. A function of the picks alone (shared-memory atomicOr only sets bits).
// The caller's barrier publishes the table.
__device__ __forceinline__ void group_picks(const int* ids_s, int rows, int top_k, u32* bits, GrpTable t) {
    int picks = rows * top_k, tid = threadIdx.x;
    for (int i = tid; i < DEC_MAX_EXPERTS / 32; i += blockDim.x) bits[i] = 0u;
    for (int i = tid; i < DEC_GRP_ITEMS; i += blockDim.x) t.rows[i] = 0u;
    __syncthreads();
    if (tid < picks) atomicOr(&bits[ids_s[tid] >> 5], 1u << (ids_s[tid] & 31));
    __syncthreads();
    if (tid < picks) {
        int e = ids_s[tid], w = e >> 5, item = 1 + __popc(bits[w] & ((1u << (e & 31)) - 1u));
        for (int i = 0; i < w; i++) item += __popc(bits[i]);
        int b = tid / top_k;
        t.expert[item] = e;
        t.slot[item * DEC_B_MAX + b] = tid - b * top_k;
        atomicOr(&t.rows[item], 1u << b);
    }
    if (tid < rows) t.slot[tid] = top_k;
    if (tid == 0) {
        int n = 1;
        for (int i = 0; i < DEC_MAX_EXPERTS / 32; i++) n += __popc(bits[i]);
        t.n[0] = n;
        t.expert[0] = -1;
        t.rows[0] = rows >= 32 ? 0xffffffffu : (1u << rows) - 1u;
    }
}

// x8x2_round over n groups of 64 floats, group g at src(g) in global memory (written by an earlier
// kernel: plain loads), into xq / xqs: DEC_GRP_DEEP rounds of a thread's loads in flight at once
// (a step's rows are several rounds of the block: 8 for the gate/up kernel's 8 rows, 12 for the
// down kernel's 72 items). The caller's barrier publishes them.
#define DEC_GRP_DEEP 4
template <class Src>
__device__ __forceinline__ void stage_x8x2_global(Src src, int n, u32* xq, float2* xqs) {
    int p = threadIdx.x & 7, per = blockDim.x >> 3;
    for (int g0 = 0; g0 < n; g0 += DEC_GRP_DEEP * per) {
        float4 a[DEC_GRP_DEEP], b[DEC_GRP_DEEP];
#pragma unroll
        for (int d = 0; d < DEC_GRP_DEEP; d++) {
            int g = g0 + d * per + (threadIdx.x >> 3);
            const float4* s = reinterpret_cast<const float4*>(src(g < n ? g : 0) + 8 * p);
            a[d] = s[0];
            b[d] = s[1];
        }
#pragma unroll
        for (int d = 0; d < DEC_GRP_DEEP; d++) {
            int g = g0 + d * per + (threadIdx.x >> 3);
            x8x2_round(a[d], b[d], p, g, g < n, xq, xqs);
        }
    }
}

// dec_glu4_x8x2 over a batched step's rows, grouped by expert: block (t, c) takes rows tile t
// (tile_row0) of items c, c + gridDim.y, ... of the union (two register buffers deep, as
// glu4_token), each dotted with the pairs of every row that picked the item. Every block routes
// all rows (warp b routes row b) and block (0, 0) publishes the routing: ids, route_w [rows,
// top_k]. router_logits [rows, n_experts], xn [rows, gate.cols], h [rows, top_k, h_stride], hs
// [rows, sgate.rows] as dec_glu4_x8x2_rows'; grid (tiles of an item, item chunks).
// glu_grouped<false> is this kernel, glu_grouped<true> dec_glu4_x8x2_grouped_ring (below): one
// body, the two differing only in how a block's items go through its register buffers.
// grouped_moe_stream: dec_glu4_x8x2_grouped with a ring of DEC_GRP_GLU_RING register buffers a
// warp instead of two, so up to RING of the warp's items are in flight while it waits for one (two
// buffers: 2). A warp's item is one row of gate and one of up (2.25 KB with scales and biases at
// the full shape), a block's chunk ≈ 15 items at 8 rows: ≈ 15 / 2 serial DRAM round trips a warp
// with two buffers, 15 / 3 with three (session 21's ncu: every warp stalled on its own loads,
// 1.6–1.7 TB/s). And the shared expert spread: item 0 is every chunk's first position, each chunk
// taking its share of the rows (dec_glu4_x8x2_grouped gives all 8 of its products to chunk 0's
// blocks), so every block requests a tile before dec_wait. Each (row, item) product is the same
// code on the same values, whole in one warp, each output written once: the outputs are
// dec_glu4_x8x2_grouped's bit for bit.
template <bool RING>
__device__ __forceinline__ void glu_grouped(QWeight gate, QWeight up, const float* __restrict__ router_logits,
                                            int n_experts, int top_k, int* __restrict__ ids,
                                            float* __restrict__ route_w, QWeight sgate, QWeight sup,
                                            const float* __restrict__ xn, float* __restrict__ h, int h_stride,
                                            float* __restrict__ hs, int rows) {
    __shared__ __align__(16) u32 xq[DEC_B_MAX * DEC_X8_GROUPS * DEC_X8X2PAD];
    __shared__ float2 xqs[DEC_B_MAX * DEC_X8_GROUPS];
    DEC_GRP_SHARED
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    TileGeom tg;
    tg.G = gate.cols >> 6;
    tg.lpr = tg.G;
    tg.spw = 32 / tg.lpr;
    tg.warp = warp;
    tg.sub = lane / tg.lpr;
    tg.sl = lane % tg.lpr;
    GrpTable t = {grp_expert, grp_rows, grp_slot, grp_n};
    int rbase = tile_row0<DEC_GLU_R4>(tg, blockIdx.x), step = gridDim.y;
    auto load = [&](int item, GluTile& r) {
        QWeight wg = sgate, wu = sup;
        if (item > 0) {
            wg = expert<true>(gate, t.expert[item]);
            wu = expert<true>(up, t.expert[item]);
        }
        qrows_load<4, 1, DEC_GLU_R4, true>(wg, rbase, tg.G, tg.lpr, tg.sl, r.g);
        qrows_load<4, 1, DEC_GLU_R4, true>(wu, rbase, tg.G, tg.lpr, tg.sl, r.u);
    };
    // The products of item `item` with the rows of `mask` that picked it.
    auto finish = [&](int item, u32 mask, const GluTile& r) {
        int item_rows = item == 0 ? sgate.rows : gate.rows;
        for (u32 m = t.rows[item] & mask; m != 0u; m &= m - 1u) {
            int b = __ffs(m) - 1, k = t.slot[item * DEC_B_MAX + b];
            GluX<true, true> x;
            x.load(nullptr, nullptr, xq + b * tg.G * DEC_X8X2PAD, xqs + b * tg.G, tg.sl);
            float g[DEC_GLU_R4], u[DEC_GLU_R4];
            x.dot(r.g, g);
            x.dot(r.u, u);
            reduce_rows<DEC_GLU_R4, true>(g, tg.lpr);
            reduce_rows<DEC_GLU_R4, true>(u, tg.lpr);
            float* out = item == 0 ? hs + (long long)b * sgate.rows : h + ((long long)b * top_k + k) * h_stride;
            if (tg.sl == 0) {
#pragma unroll
                for (int i = 0; i < DEC_GLU_R4; i++)
                    if (rbase + i < item_rows) out[rbase + i] = act(act(siluf(act(g[i]))) * act(u[i]));
            }
        }
    };
    // RING: the block's positions p = 0, 1, ...: item 0 (the shared expert) at p = 0 in every
    // chunk of items, the chunk taking the rows b ≡ blockIdx.y (mod gridDim.y) of it (spread: its
    // 8 products a step would otherwise lengthen chunk 0's blocks alone, and every block now has a
    // tile to request before dec_wait), then routed item 1 + blockIdx.y + (p − 1) · gridDim.y;
    // position p in slot p % RING. Each (row, item) product is still one warp's, whole. Without
    // RING: items blockIdx.y, blockIdx.y + step, ... in two buffers, the shared expert chunk 0's.
    auto item_at = [&](int p) { return p == 0 ? 0 : 1 + (int)blockIdx.y + (p - 1) * step; };
    u32 spread = 0u;
    if (RING) {
#pragma unroll
        for (int b = 0; b < DEC_B_MAX; b++)
            if (b % step == (int)blockIdx.y) spread |= 1u << b;
        spread &= rows >= 32 ? 0xffffffffu : (1u << rows) - 1u;
    }
    GluTile r[RING ? DEC_GRP_GLU_RING : 2];
    bool early = RING ? spread != 0u : blockIdx.y == 0;
    if (early) load(0, r[0]);  // item 0, the shared expert: no routing needed
    dec_wait();
    if (warp < rows)
        route_top_k<true>(router_logits + (long long)warp * n_experts, n_experts, top_k, nullptr, ids_s + warp * top_k,
                          w_s + warp * top_k);
    __syncthreads();
    if (blockIdx.x == 0 && blockIdx.y == 0 && (int)threadIdx.x < rows * top_k) {
        ids[threadIdx.x] = ids_s[threadIdx.x];
        route_w[threadIdx.x] = w_s[threadIdx.x];
    }
    group_picks(ids_s, rows, top_k, grp_bits, t);
    __syncthreads();
    int items = t.n[0];
    if constexpr (RING) {
#pragma unroll
        for (int j = 1; j < DEC_GRP_GLU_RING; j++)
            if (item_at(j) < items) load(item_at(j), r[j]);
    } else {
        int a = blockIdx.y, b = a + step;
        if (!early && a < items) load(a, r[0]);
        if (b < items) load(b, r[1]);
    }
    // The rows' pairs while the first weights stream (xn [rows, cols] is rows · G groups).
    stage_x8x2_global([=](int g) { return xn + 64 * (long long)g; }, rows * tg.G, xq, xqs);
    __syncthreads();
    if constexpr (RING) {
        for (int p0 = 0; item_at(p0) < items; p0 += DEC_GRP_GLU_RING) {
#pragma unroll
            for (int j = 0; j < DEC_GRP_GLU_RING; j++) {
                int item = item_at(p0 + j);
                if (item >= items) break;
                finish(item, item == 0 ? spread : ~0u, r[j]);
                int next = item_at(p0 + j + DEC_GRP_GLU_RING);
                if (next < items) load(next, r[j]);
            }
        }
    } else {
        int a = blockIdx.y, b = a + step;
        while (a < items) {
            finish(a, ~0u, r[0]);
            a += 2 * step;
            if (a < items) load(a, r[0]);
            if (b >= items) break;
            finish(b, ~0u, r[1]);
            b += 2 * step;
            if (b < items) load(b, r[1]);
        }
    }
    dec_trigger_late();
}

extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32, DEC_BLOCKS_PER_SM)
dec_glu4_x8x2_grouped(QWeight gate, QWeight up, const float* __restrict__ router_logits, int n_experts, int top_k,
                      int* __restrict__ ids, float* __restrict__ route_w, QWeight sgate, QWeight sup,
                      const float* __restrict__ xn, float* __restrict__ h, int h_stride, float* __restrict__ hs,
                      int rows) {
    glu_grouped<false>(gate, up, router_logits, n_experts, top_k, ids, route_w, sgate, sup, xn, h, h_stride, hs, rows);
}

extern "C" __global__ void __launch_bounds__(DEC_WARPS * 32, DEC_BLOCKS_PER_SM)
dec_glu4_x8x2_grouped_ring(QWeight gate, QWeight up, const float* __restrict__ router_logits, int n_experts,
                           int top_k, int* __restrict__ ids, float* __restrict__ route_w, QWeight sgate, QWeight sup,
                           const float* __restrict__ xn, float* __restrict__ h, int h_stride, float* __restrict__ hs,
                           int rows) {
    glu_grouped<true>(gate, up, router_logits, n_experts, top_k, ids, route_w, sgate, sup, xn, h, h_stride, hs, rows);
}

// dec_down_combine_x8x2 over a batched step's rows, grouped by expert: a block owns the output
// rows of dec_down_combine_x8x2's block (DEC_DOWN_WARPS row groups) for every row of the step;
// warp (rg, kc) takes items kc, kc + DEC_DOWN_KSPLIT, ... of the union, DEC_DOWN_BATCH loaded
// ahead, each dotted with every row that picked it, act() of each (row, item) product kept in
// shared memory; then each output is combined in dec_down_combine_x8x2's order (the item chunks'
// weighted sums in rank order, added chunk after chunk, the gated shared expert, the residual).
// ids, route_w [rows, top_k] (dec_glu4_x8x2_grouped's), h [rows, top_k, h_stride], hs [rows,
// sdown.cols], s_gate [rows], x [rows, down.rows]; grid ceil(down.rows / rows a block). Dynamic
// shared memory (decode::grouped_down_smem): the rows · (top_k + 1) inputs as int8 pairs (input
// b · top_k + k routed, rows · top_k + b shared), their scales and sums, the products.
// KCOLS item columns of warps (the block DEC_DOWN_WARPS · KCOLS warps), a ring of BATCH items a
// warp. Column kc's positions p = 0, 1, ...: item kc + p · KCOLS; under SPREAD position 0 is item 0
// (the shared expert) in every column, each column taking the rows b ≡ kc (mod KCOLS) of it (its
// 8 products a step would otherwise lengthen column 0 alone), and position p > 0 routed item
// 1 + kc + (p − 1) · KCOLS. The combine's order (DEC_DOWN_KSPLIT chunks of a row's ranks) is
// dec_down_combine_x8x2's whatever KCOLS and SPREAD, each (row, item) product whole in one warp:
// the outputs do not depend on them.
template <int KCOLS, int BATCH, bool SPREAD>
__device__ __forceinline__ void down_combine_grouped(QWeight down, QWeight sdown, const int* __restrict__ ids,
                                                     const float* __restrict__ route_w, int top_k,
                                                     const float* __restrict__ h, int h_stride,
                                                     const float* __restrict__ hs, const float* __restrict__ s_gate,
                                                     float* __restrict__ x, int rows) {
    extern __shared__ __align__(16) float dec_smem[];
    DEC_GRP_SHARED
    int G = down.cols >> 6, per_row = top_k + 1, n_in = rows * per_row;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int rg = warp % DEC_DOWN_WARPS, kc = warp / DEC_DOWN_WARPS;
    int lpr = min(32, G), spw = 32 / lpr;
    int sub = lane / lpr, sl = lane % lpr;
    int rows_per_block = DEC_DOWN_WARPS * spw;
    u32* hq = reinterpret_cast<u32*>(dec_smem);                    // [n_in][G][DEC_X8X2PAD]
    float2* hqs = reinterpret_cast<float2*>(hq + n_in * G * DEC_X8X2PAD);  // [n_in][G]
    float* prod = reinterpret_cast<float*>(hqs + n_in * G);        // [rows][top_k + 1][rows_per_block]
    GrpTable t = {grp_expert, grp_rows, grp_slot, grp_n};
    int r_local = rg * spw + sub;
    int c = blockIdx.x * rows_per_block + r_local;
    int cc = min(c, down.rows - 1);
    long long wpr = (long long)G * 8;
    uint4 q[BATCH][2];
    float s[BATCH], bias[BATCH];
    auto load = [&](int j, int i) {
        QWeight w = i > 0 ? expert<true>(down, t.expert[i]) : sdown;
        const uint4* qp = reinterpret_cast<const uint4*>(w.q + cc * wpr + (long long)sl * 8);
        q[j][0] = ld_stream(qp);
        q[j][1] = ld_stream(qp + 1);
        s[j] = bf16_to_f32(w.scales[(long long)cc * G + sl]);
        bias[j] = bf16_to_f32(w.biases[(long long)cc * G + sl]);
    };
    auto item_at = [&](int p) { return SPREAD ? (p == 0 ? 0 : 1 + kc + (p - 1) * KCOLS) : kc + p * KCOLS; };
    if (SPREAD || kc == 0) load(0, 0);  // item 0, the shared expert: no routing needed
    dec_wait();
    if ((int)threadIdx.x < rows * top_k) {
        ids_s[threadIdx.x] = ids[threadIdx.x];
        w_s[threadIdx.x] = route_w[threadIdx.x];
    }
    __syncthreads();
    group_picks(ids_s, rows, top_k, grp_bits, t);
    __syncthreads();
    int items = t.n[0];
#pragma unroll
    for (int j = 0; j < BATCH; j++) {
        int i = item_at(j);
        if (i > 0 && i < items) load(j, i);
    }
    int routed = rows * top_k * G;
    stage_x8x2_global(
        [=](int g) {
            return g < routed ? h + (long long)(g / G) * h_stride + 64 * (g % G) : hs + 64 * (long long)(g - routed);
        },
        n_in * G, hq, hqs);
    __syncthreads();
    // A ring of BATCH items: each slot refilled with the warp's item BATCH
    // ahead as soon as it is used, so two or three stay in flight through the whole loop (the
    // one-token kernel requests a batch when the last is used: one round trip a batch, which over
    // a warp's ≈ 20 items here would be ≈ 7).
    u32 spread_rows = 0u;  // under SPREAD, the rows of item 0 this column takes
#pragma unroll
    for (int b = 0; b < DEC_B_MAX; b++)
        if (b % KCOLS == kc) spread_rows |= 1u << b;
    for (int j0 = 0; item_at(j0) < items; j0 += BATCH) {
#pragma unroll
        for (int j = 0; j < BATCH; j++) {
            int i = item_at(j0 + j);
            if (i >= items) continue;
            u32 picked = t.rows[i];
            if (SPREAD && i == 0) picked &= spread_rows;
            for (u32 m = picked; m != 0u; m &= m - 1u) {
                int b = __ffs(m) - 1, k = t.slot[i * DEC_B_MAX + b];
                int in = k < top_k ? b * top_k + k : rows * top_k + b;
                X8x2Group xg = x8x2_load(hq, hqs, in * G + sl);
                float acc[1] = {group_term_x8x2(s[j], bias[j], dot_group_x8x2(q[j], xg), xg)};
                reduce_rows<1, true>(acc, lpr);
                if (sl == 0) prod[(b * per_row + k) * rows_per_block + r_local] = act(acc[0]);
            }
            int ahead = item_at(j0 + j + BATCH);
            if (ahead < items) load(j, ahead);
        }
    }
    dec_trigger_late();
    __syncthreads();
    for (int o = threadIdx.x; o < rows * rows_per_block; o += blockDim.x) {
        int b = o / rows_per_block, r = o - b * rows_per_block, co = blockIdx.x * rows_per_block + r;
        if (co >= down.rows) continue;
        const float* pb = prod + b * per_row * rows_per_block + r;
        const float* wb = w_s + b * top_k;
        float yy = 0.0f;
        for (int kk = 0; kk < DEC_DOWN_KSPLIT; kk++) {
            float y = 0.0f;
            for (int i = kk; i < top_k; i += DEC_DOWN_KSPLIT) y += wb[i] * pb[i * rows_per_block];
            yy = kk == 0 ? y : yy + y;
        }
        yy += act(act(sigmoidf(s_gate[b])) * pb[top_k * rows_per_block]);
        float* xo = x + (long long)b * down.rows + co;
        *xo = act(*xo + act(yy));
    }
}

extern "C" __global__ void __launch_bounds__(DEC_DOWN_WARPS * DEC_DOWN_KSPLIT * 32, 1)
dec_down_combine_x8x2_grouped(QWeight down, QWeight sdown, const int* __restrict__ ids,
                              const float* __restrict__ route_w, int top_k, const float* __restrict__ h, int h_stride,
                              const float* __restrict__ hs, const float* __restrict__ s_gate, float* __restrict__ x,
                              int rows) {
    down_combine_grouped<DEC_DOWN_KSPLIT, DEC_DOWN_BATCH, false>(down, sdown, ids, route_w, top_k, h, h_stride, hs, s_gate,
                                                          x, rows);
}

// dec_down_combine_x8x2_grouped with DEC_GRP_DOWN_KCOLS item columns of warps
// (grouped_down_wide): DEC_DOWN_WARPS · DEC_GRP_DOWN_KCOLS warps a block, one block an SM as
// before (its 92 KB of staged pairs), a third more weight loads in flight an SM and the shared
// expert's rows spread over the columns (SPREAD); the same outputs bit for bit.
extern "C" __global__ void __launch_bounds__(DEC_DOWN_WARPS * DEC_GRP_DOWN_KCOLS * 32, 1)
dec_down_combine_x8x2_grouped_wide(QWeight down, QWeight sdown, const int* __restrict__ ids,
                                   const float* __restrict__ route_w, int top_k, const float* __restrict__ h,
                                   int h_stride, const float* __restrict__ hs, const float* __restrict__ s_gate,
                                   float* __restrict__ x, int rows) {
    down_combine_grouped<DEC_GRP_DOWN_KCOLS, DEC_GRP_DOWN_BATCH, true>(down, sdown, ids, route_w, top_k, h, h_stride, hs,
                                                                s_gate, x, rows);
}

// grouped_moe_stream: dec_down_combine_x8x2_grouped_wide with a ring of DEC_GRP_DOWN_RING items a
// warp instead of DEC_GRP_DOWN_BATCH (the first RING of a warp's items requested before the
// staging, then each slot refilled RING ahead as soon as it is used): a third more weight bytes in
// flight an SM at RING 4, one block an SM as before. The same outputs bit for bit (the ring only
// moves when loads are issued).
extern "C" __global__ void __launch_bounds__(DEC_DOWN_WARPS * DEC_GRP_DOWN_KCOLS * 32, 1)
dec_down_combine_x8x2_grouped_ring(QWeight down, QWeight sdown, const int* __restrict__ ids,
                                   const float* __restrict__ route_w, int top_k, const float* __restrict__ h,
                                   int h_stride, const float* __restrict__ hs, const float* __restrict__ s_gate,
                                   float* __restrict__ x, int rows) {
    down_combine_grouped<DEC_GRP_DOWN_KCOLS, DEC_GRP_DOWN_RING, true>(down, sdown, ids, route_w, top_k, h, h_stride, hs,
                                                               s_gate, x, rows);
}

// ---- DeltaNet, one token ------------------------------------------------------------------------

// One channel's conv output act(silu(act(Σ taps · rows + tap_last · m))): its k - 1 conv-state rows
// first, the token's m last (dn_conv's sum, in its order).
__device__ __forceinline__ float dn_conv_value(const float (&taps)[DEC_DN_MAX_K], const float (&rows)[DEC_DN_MAX_K],
                                               float mv, int k) {
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < DEC_DN_MAX_K - 1; j++)
        if (j < k - 1) acc += taps[j] * rows[j];
#pragma unroll
    for (int j = 0; j < DEC_DN_MAX_K; j++)
        if (j == k - 1) acc += taps[j] * mv;
    return act(siluf(act(acc)));
}

// The channel's conv state [k - 1, conv_dim] shifted by one token: row j takes row j + 1, the last
// row the token's m (dn_conv_state).
__device__ __forceinline__ void dn_conv_shift(float* __restrict__ conv_state, int conv_dim, int ch,
                                              const float (&rows)[DEC_DN_MAX_K], float mv, int k) {
#pragma unroll
    for (int j = 0; j < DEC_DN_MAX_K - 1; j++)
        if (j < k - 1) conv_state[(long long)j * conv_dim + ch] = j + 1 < k - 1 ? rows[j + 1] : mv;
}

// dec_dn_conv: c = silu(conv(m)) for one token and the conv state shifted by it: dn_conv then
// dn_conv_state in one launch (each thread owns its channel, so nothing is read after another
// block wrote it). grid ceil(conv_dim / 128), block 128.
__device__ __forceinline__ void dn_conv_one(const float* __restrict__ m, float* __restrict__ conv_state,
                                            const float* __restrict__ w, float* __restrict__ c, int conv_dim, int k) {
    int ch = blockIdx.x * blockDim.x + threadIdx.x;
    bool live = ch < conv_dim;
    // Before pdl_wait: the conv state (last written by this layer's previous step, long done)
    // and the taps.
    float rows[DEC_DN_MAX_K], taps[DEC_DN_MAX_K];
#pragma unroll
    for (int j = 0; j < DEC_DN_MAX_K; j++)
        if (live && j < k) {
            taps[j] = w[(long long)ch * k + j];
            if (j < k - 1) rows[j] = conv_state[(long long)j * conv_dim + ch];
        }
    dec_wait();
    if (!live) return;
    float mv = m[ch];
    c[ch] = dn_conv_value(taps, rows, mv, k);
    dn_conv_shift(conv_state, conv_dim, ch, rows, mv, k);
}

extern "C" __global__ void __launch_bounds__(128)
dec_dn_conv(const float* __restrict__ m, float* __restrict__ conv_state, const float* __restrict__ w,
            float* __restrict__ c, int conv_dim, int k) {
    dn_conv_one(m, conv_state, w, c, conv_dim, k);
}

// dec_dn_conv_rows: dec_dn_conv for each sequence of a batched decode step, sequence b in
// blockIdx.y: its token at row b of m and c ([B, conv_dim]), its conv state conv_states[b] (a
// table the host writes once per batch composition, read before pdl_wait like the state).
// grid (ceil(conv_dim / 128), B), block 128.
extern "C" __global__ void __launch_bounds__(128)
dec_dn_conv_rows(const float* __restrict__ m, float* const* __restrict__ conv_states, const float* __restrict__ w,
                 float* __restrict__ c, int conv_dim, int k) {
    long long row = (long long)blockIdx.y * conv_dim;
    dn_conv_one(m + row, conv_states[blockIdx.y], w, c + row, conv_dim, k);
}

// dec_dn_step: dn_prep and dn_recurrent for one token. grid (n_v_heads, dv / DEC_DN_COLS), block 128:
// every block normalises q and k of its K head itself (dk values each; dn_prep's arithmetic) and
// computes α, β of its V head, then updates its DEC_DN_COLS state columns as dn_recurrent does.
// A work item (V head hv, column block cb) takes DEC_DN_THREADS threads (a group; a block runs
// one): lanes part, part + DEC_DN_PARTS, ... of state column j hold its rows.
#define DEC_DN_THREADS (DEC_DN_COLS / (32 / DEC_DN_PARTS) * 32)
struct DnCol {
    int hv, j, part, rows;
};

// Thread t (of its group's DEC_DN_THREADS) of work item (hv, cb).
__device__ __forceinline__ DnCol dn_col(int hv, int cb, int t, int dk) {
    int lane = t & 31, warp = t >> 5;
    DnCol q;
    q.hv = hv;
    q.part = lane % DEC_DN_PARTS;
    q.j = cb * DEC_DN_COLS + warp * (32 / DEC_DN_PARTS) + lane / DEC_DN_PARTS;
    q.rows = dk / DEC_DN_PARTS;
    return q;
}

// The thread's rows of its state column (before pdl_wait where the caller can: the state was last
// written by this layer's previous step, long done).
__device__ __forceinline__ void dn_state_load(const float* __restrict__ state, const DnCol& q, int dk, int dv,
                                              float (&s)[DEC_DN_ROWS]) {
    const float* sp = state + (long long)q.hv * dk * dv;
#pragma unroll
    for (int r = 0; r < DEC_DN_ROWS; r++)
        s[r] = r < q.rows ? sp[(long long)(q.part + DEC_DN_PARTS * r) * dv + q.j] : 0.0f;
}

// block_sum over the DEC_DN_THREADS threads of group grp (block_sum's order for a block of that
// size: each warp's sum, then the group's warp sums over one warp's lanes). Every thread of the
// block calls it (its barriers are the block's).
__device__ __forceinline__ float dn_group_sum(float v, int grp) {
    __shared__ float dn_partial[2 * DEC_DN_THREADS / 32];
    const int W = DEC_DN_THREADS / 32;
    int lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) % W;
    v = warp_sum(v);
    __syncthreads();  // dn_partial may still be read by a previous call
    if (lane == 0) dn_partial[grp * W + warp] = v;
    __syncthreads();
    float t = lane < W ? dn_partial[grp * W + lane] : 0.0f;
    return warp_sum(t);
}

// Work item q's step, thread t of group grp (its scratch q_s, k_s [DEC_DN_MAX_DK], ab_s [2]), its
// state rows s loaded: q and k of the item's K head normalised (dn_prep), α and β, the column
// update (dn_recurrent), o[hv · dv + j] = act(out), the state rows stored. c, b and a are read from
// L2 (ld.global.cg: kept so since its device A/B, session 16). Every thread of the block calls it, `live` or not
// (the block's barriers); a thread without an item (!live) only takes part in them.
__device__ __forceinline__ void dn_step_apply(const float* __restrict__ c, const float* __restrict__ b,
                                              const float* __restrict__ a, float a_log_h, float dt_bias_h,
                                              float* __restrict__ state, float* __restrict__ o, int n_k_heads,
                                              int n_v_heads, int dk, int dv, float eps, const DnCol& q, int t,
                                              int grp, bool live, float* q_s, float* k_s, float* ab_s,
                                              float (&s)[DEC_DN_ROWS]) {
    int hv = q.hv;
    int hk = hv / (n_v_heads / n_k_heads);
    int key_dim = n_k_heads * dk;
    const float* qt = c + hk * dk;
    const float* kt = qt + key_dim;
    float qq = 0.0f, kk = 0.0f;
    if (live)
        for (int i = t; i < dk; i += DEC_DN_THREADS) {
            float qv = __ldcg(qt + i), kv = __ldcg(kt + i);
            qq += qv * qv;
            kk += kv * kv;
        }
    qq = dn_group_sum(qq, grp);
    kk = dn_group_sum(kk, grp);
    float qn = rsqrtf(qq + eps) * rsqrtf((float)dk), kn = rsqrtf(kk + eps);
    if (live) {
        for (int i = t; i < dk; i += DEC_DN_THREADS) {
            q_s[i] = __ldcg(qt + i) * qn;
            k_s[i] = __ldcg(kt + i) * kn;
        }
        if (t == 0) {
            float beta = act(sigmoidf(__ldcg(b + hv)));
            float g = -expf(a_log_h) * softplusf(__ldcg(a + hv) + dt_bias_h);
            ab_s[0] = expf(g);
            ab_s[1] = beta;
        }
    }
    __syncthreads();
    if (!live) return;
    float alpha = ab_s[0], beta = ab_s[1];
    int j = q.j;
    float v = __ldcg(c + 2 * key_dim + hv * dv + j);
    float out = dn_column_step<DEC_DN_ROWS, DEC_DN_PARTS>(s, q_s, k_s, q.part, q.rows, alpha, beta, v);
    if (q.part == 0) o[(long long)hv * dv + j] = act(out);
    float* sp = state + (long long)hv * dk * dv;
#pragma unroll
    for (int r = 0; r < DEC_DN_ROWS; r++)
        if (r < q.rows) sp[(long long)(q.part + DEC_DN_PARTS * r) * dv + j] = s[r];
}

// One block of dec_dn_step (one group of DEC_DN_THREADS threads): item (blockIdx.x, blockIdx.y).
__device__ __forceinline__ void dn_step_one(const float* __restrict__ c, const float* __restrict__ b,
                                            const float* __restrict__ a, const float* __restrict__ a_log,
                                            const float* __restrict__ dt_bias, float* __restrict__ state,
                                            float* __restrict__ o, int n_k_heads, int n_v_heads, int dk, int dv,
                                            float eps, float* q_s, float* k_s, float* ab_s) {
    DnCol q = dn_col(blockIdx.x, blockIdx.y, threadIdx.x, dk);
    float s[DEC_DN_ROWS];
    dn_state_load(state, q, dk, dv, s);
    float a_log_h = a_log[q.hv], dt_bias_h = dt_bias[q.hv];
    dec_wait();
    dn_step_apply(c, b, a, a_log_h, dt_bias_h, state, o, n_k_heads, n_v_heads, dk, dv, eps, q, threadIdx.x, 0, true,
                  q_s, k_s, ab_s, s);
}

extern "C" __global__ void __launch_bounds__(128)
dec_dn_step(const float* __restrict__ c, const float* __restrict__ b, const float* __restrict__ a,
            const float* __restrict__ a_log, const float* __restrict__ dt_bias, float* __restrict__ state,
            float* __restrict__ o, int n_k_heads, int n_v_heads, int dk, int dv, float eps) {
    __shared__ float q_s[DEC_DN_MAX_DK], k_s[DEC_DN_MAX_DK];
    __shared__ float ab_s[2];
    dn_step_one(c, b, a, a_log, dt_bias, state, o, n_k_heads, n_v_heads, dk, dv, eps, q_s, k_s, ab_s);
}

// dec_dn_step_rows: dec_dn_step for each sequence of a batched decode step, sequence r in
// blockIdx.z: its token at row r of c [B, conv_dim], b and a [B, n_v_heads], o [B, n_v_heads · dv],
// its recurrent state states[r] (a table the host writes once per batch composition).
// grid (n_v_heads, dv / DEC_DN_COLS, B), block 128.
extern "C" __global__ void __launch_bounds__(128)
dec_dn_step_rows(const float* __restrict__ c, const float* __restrict__ b, const float* __restrict__ a,
                 const float* __restrict__ a_log, const float* __restrict__ dt_bias, float* const* __restrict__ states,
                 float* __restrict__ o, int n_k_heads, int n_v_heads, int dk, int dv, float eps) {
    __shared__ float q_s[DEC_DN_MAX_DK], k_s[DEC_DN_MAX_DK];
    __shared__ float ab_s[2];
    long long r = blockIdx.z;
    long long conv_dim = 2LL * n_k_heads * dk + (long long)n_v_heads * dv;
    dn_step_one(c + r * conv_dim, b + r * n_v_heads, a + r * n_v_heads, a_log, dt_bias, states[r],
                o + r * n_v_heads * dv, n_k_heads, n_v_heads, dk, dv, eps, q_s, k_s, ab_s);
}

// ---- Batched decode (several sequences, one token each) -----------------------------------------

// dec_gemv_rows: y_s[b] = W_s · x[b] for the nb ≤ DEC_B_MAX rows of a batched decode step
// (Forward::run_batch), up to DEC_MAX_SEGS weights reading the same rows (as dec_gemv): each
// weight is read once for all the rows. x [nb, cols] (normed, or normed on the way: rows_stage) is staged in shared memory
// (dynamic: nb · G · DEC_XPAD floats and nb · G group sums, G = cols / 64). L = min(8, G) lanes (a
// power of two) share a weight row, each taking the groups sl, sl + L, ...; per group it turns
// the packed weights into floats once and dots them with every staged row: the lanes of different
// rows read the same x addresses (broadcasts) and the L lanes of a row L distinct groups (distinct
// banks with the DEC_XPAD padding). The next group's weights are in flight while this one's are
// summed. Output row b of a weight is y + b · rows (its rows are the width of its output).
// Persistent grid over tiles of (blockDim.x / 32) · (32 / L) weight rows; block DEC_ROWS_WARPS ·
// 32 at most (the launcher reads the bound back: Kernel::max_threads). The grid is sized for
// DEC_BLOCKS_PER_SM blocks an SM, so on Hopper the block is 6 warps, which lets two blocks of its
// 163 registers a thread be resident together (with 8 warps only one was: the grid ran in two
// waves); elsewhere a bound of two blocks spills, so the block stays 8 warps, unbounded.
template <int BITS>
struct BGroup {
    uint4 q[BITS / 2];
    float s, b;
};

template <int BITS>
__device__ __forceinline__ void bgroup_load(const QWeight& w, long long row, int G, int g, BGroup<BITS>& r) {
    const int WPG = 2 * BITS;  // u32 words per group
    // The lane reads its group's words whole (32 or 64 bytes): through L1, so the second 16 bytes
    // of a sector come from there.
    const uint4* qp = reinterpret_cast<const uint4*>(w.q + row * ((long long)G * WPG) + (long long)g * WPG);
#pragma unroll
    for (int v = 0; v < BITS / 2; v++) r.q[v] = __ldg(qp + v);
    r.s = bf16_to_f32(w.scales[row * G + g]);
    r.b = bf16_to_f32(w.biases[row * G + g]);
}

// acc[b] += group g's share of the weight row · x[b] for b < nb; xg: row 0's group g in shared
// memory, rows `xstride` floats apart; xsum_g: row 0's group sum, rows G apart.
template <int BITS>
__device__ __forceinline__ void bgroup_dot(const BGroup<BITS>& r, const float* xg, int xstride, const float* xsum_g,
                                           int G, int nb, float (&acc)[DEC_B_MAX]) {
    float a0[DEC_B_MAX], a1[DEC_B_MAX];
#pragma unroll
    for (int b = 0; b < DEC_B_MAX; b++) a0[b] = a1[b] = 0.0f;
#pragma unroll
    for (int v = 0; v < BITS / 2; v++) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            if (BITS == 4) {
                // Word 4v+i: columns 8(4v+i) .. +7; low nibbles the even columns, high the odd.
                float we[4], wo[4];
                u32 words[4] = {r.q[v].x, r.q[v].y, r.q[v].z, r.q[v].w};
                u32 w = words[i];
                u32 lo = (w << 3) & 0x78787878u, hi = (w >> 1) & 0x78787878u;
#pragma unroll
                for (int k = 0; k < 4; k++) {
                    we[k] = nib_f(lo, NIB_SEL(k));
                    wo[k] = nib_f(hi, NIB_SEL(k));
                }
                int c = 8 * (4 * v + i);
#pragma unroll
                for (int b = 0; b < DEC_B_MAX; b++) {
                    if (b < nb) {
                        float4 xa = *reinterpret_cast<const float4*>(xg + b * xstride + c);
                        float4 xb = *reinterpret_cast<const float4*>(xg + b * xstride + c + 4);
                        a0[b] = fmaf(we[0], xa.x, a0[b]);
                        a1[b] = fmaf(wo[0], xa.y, a1[b]);
                        a0[b] = fmaf(we[1], xa.z, a0[b]);
                        a1[b] = fmaf(wo[1], xa.w, a1[b]);
                        a0[b] = fmaf(we[2], xb.x, a0[b]);
                        a1[b] = fmaf(wo[2], xb.y, a1[b]);
                        a0[b] = fmaf(we[3], xb.z, a0[b]);
                        a1[b] = fmaf(wo[3], xb.w, a1[b]);
                    }
                }
            } else {
                // Word 4v+i: columns 4(4v+i) .. +3, byte j column j.
                u32 words[4] = {r.q[v].x, r.q[v].y, r.q[v].z, r.q[v].w};
                u32 w = words[i];
                float wb[4] = {byte_f(w, 0x7440), byte_f(w, 0x7441), byte_f(w, 0x7442), byte_f(w, 0x7443)};
                int c = 4 * (4 * v + i);
#pragma unroll
                for (int b = 0; b < DEC_B_MAX; b++) {
                    if (b < nb) {
                        float4 xa = *reinterpret_cast<const float4*>(xg + b * xstride + c);
                        a0[b] = fmaf(wb[0], xa.x, a0[b]);
                        a1[b] = fmaf(wb[1], xa.y, a1[b]);
                        a0[b] = fmaf(wb[2], xa.z, a0[b]);
                        a1[b] = fmaf(wb[3], xa.w, a1[b]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int b = 0; b < DEC_B_MAX; b++)
        if (b < nb) acc[b] += group_term<BITS>(r.s, r.b, a0[b] + a1[b], xsum_g[b * G]);
}

// acc[b] = the lane's share of weight row `row` (clamped to the last row) · x[b]: its groups
// sl + i·L, two deep (the next group's loads in flight while this one is summed).
template <int BITS>
__device__ __forceinline__ void brow_dot(const QWeight& w, int row, int G, int L, int sl, const float* xs,
                                         const float* xsum, int nb, float (&acc)[DEC_B_MAX]) {
    long long r = min(row, w.rows - 1);
    int xstride = G * DEC_XPAD;
    BGroup<BITS> ga, gb;
    int g = sl;
    if (g < G) bgroup_load<BITS>(w, r, G, g, ga);
    for (; g < G; g += 2 * L) {
        if (g + L < G) bgroup_load<BITS>(w, r, G, g + L, gb);
        bgroup_dot<BITS>(ga, xs + g * DEC_XPAD, xstride, xsum + g, G, nb, acc);
        if (g + L >= G) break;
        if (g + 2 * L < G) bgroup_load<BITS>(w, r, G, g + 2 * L, ga);
        bgroup_dot<BITS>(gb, xs + (g + L) * DEC_XPAD, xstride, xsum + g + L, G, nb, acc);
    }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900
#define DEC_ROWS_WARPS 6
#define DEC_ROWS_MIN_BLOCKS DEC_BLOCKS_PER_SM
#else
#define DEC_ROWS_WARPS 8
#define DEC_ROWS_MIN_BLOCKS 1
#endif
// x [nb, cols] (already normed) → xs [nb][G][DEC_XPAD] and each (row, group)'s sum xsum [nb][G]
// (dec_gemv_rows' layout), 16 bytes at a time (cols % 64 == 0: a float4 never straddles a group
// or a row).
__device__ __forceinline__ void rows_stage(const float* __restrict__ x, int nb, int cols, float* xs, float* xsum) {
    int G = cols >> 6, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    int n4 = nb * cols / 4;
    for (int i = threadIdx.x; i < n4; i += blockDim.x) {
        int b = (4 * i) / cols, c = (4 * i) % cols;
        float4 v = *reinterpret_cast<const float4*>(x + (long long)b * cols + c);
        *reinterpret_cast<float4*>(xs + (b * G + (c >> 6)) * DEC_XPAD + (c & 63)) = v;
    }
    __syncthreads();
    // Each (row, group)'s sum, as stage_slow sums a group.
    for (int bg = warp; bg < nb * G; bg += warps) {
        float s = warp_sum(xs[bg * DEC_XPAD + lane] + xs[bg * DEC_XPAD + lane + 32]);
        if (lane == 0) xsum[bg] = s;
    }
    __syncthreads();
}

// rows_stage_lean (`batch_lean_glue`, dec_gemv_rows_split_lean): rows_stage's xs and xsum bit for
// bit, in fewer dependent steps. rows_stage's copy loop asks for one float4 a trip and its group
// sums take a warp a (row, group), 8 · 32 = 256 of them over 4 warps at 8 rows, each a chain of
// five shuffles: at 8 rows its staging is most of the router launch (24 µs against the one-row
// router's 5.7, perf-notes session 21). Here each thread requests DEC_LEAN_STAGE float4 before
// it stores any, and each (row, group) sum is one thread's, added in warp_sum's tree (lane l
// holds x[l] + x[l + 32]; then the pairs l, l ^ 16; l, l ^ 8; ...; l, l ^ 1: the adds a lane
// does, in that order, so the same bits).
#define DEC_LEAN_STAGE 8
// One (row, group)'s sum of its 64 staged values g[0..63] in warp_sum's tree (see rows_stage_lean).
__device__ __forceinline__ float lean_group_sum(const float* g) {
    float t[32];
#pragma unroll
    for (int q = 0; q < 8; q++) {
        float4 a = *reinterpret_cast<const float4*>(g + 4 * q);
        float4 c = *reinterpret_cast<const float4*>(g + 32 + 4 * q);
        t[4 * q] = a.x + c.x;
        t[4 * q + 1] = a.y + c.y;
        t[4 * q + 2] = a.z + c.z;
        t[4 * q + 3] = a.w + c.w;
    }
    // (both loops of fixed trip counts, so that both unroll and t stays in registers)
#pragma unroll
    for (int k = 0; k < 5; k++) {
        const int o = 16 >> k;
#pragma unroll
        for (int l = 0; l < 16; l++)
            if (l < o) t[l] = t[l] + t[l + o];
    }
    return t[0];
}
__device__ __forceinline__ void rows_stage_lean(const float* __restrict__ x, int nb, int cols, float* xs, float* xsum) {
    int G = cols >> 6;
    int n4 = nb * cols / 4;
    for (int i0 = threadIdx.x; i0 < n4; i0 += DEC_LEAN_STAGE * blockDim.x) {
        float4 v[DEC_LEAN_STAGE];
#pragma unroll
        for (int k = 0; k < DEC_LEAN_STAGE; k++) {
            int i = i0 + k * blockDim.x;
            if (i < n4) {
                int b = (4 * i) / cols, c = (4 * i) % cols;
                v[k] = *reinterpret_cast<const float4*>(x + (long long)b * cols + c);
            }
        }
#pragma unroll
        for (int k = 0; k < DEC_LEAN_STAGE; k++) {
            int i = i0 + k * blockDim.x;
            if (i < n4) {
                int b = (4 * i) / cols, c = (4 * i) % cols;
                *reinterpret_cast<float4*>(xs + (b * G + (c >> 6)) * DEC_XPAD + (c & 63)) = v[k];
            }
        }
    }
    __syncthreads();
    for (int bg = threadIdx.x; bg < nb * G; bg += blockDim.x) xsum[bg] = lean_group_sum(xs + bg * DEC_XPAD);
    __syncthreads();
}

// rows_stage_async (`router_async_stage`, dec_gemv_rows_split_async): rows_stage_lean's xs and
// xsum bit for bit, with one round trip to L2 instead of four. rows_stage_lean holds a thread's
// loads in registers, DEC_LEAN_STAGE float4 at a time: at 8 rows × 2,048 columns and 128 threads
// that is four dependent rounds (load 8, store 8, load 8, ...) of ≈ 0.4–0.7 µs each while 65
// blocks read the same 64 KB. cp.async copies global → shared without registers, so every
// thread's 32 copies are issued at once and the block waits once. Float4 i of x (row-major
// [nb][cols], cols % 64 == 0) is column 4(i % 16) of (row, group) pair i / 16 (x's pairs are
// contiguous 256-byte runs: no division by cols). Thread t copies float4s t + k·blockDim.x, so a
// warp's lanes copy two whole pairs a round (pairs 2·warp + k·blockDim.x / 16 and the next): after
// its own wait and a __syncwarp the warp has those pairs whole, and its lanes sum them
// (lean_group_sum, the same adds as rows_stage_lean) without waiting for the other warps; one
// __syncthreads then publishes xs and xsum to the block.
__device__ __forceinline__ void rows_stage_async(const float* __restrict__ x, int nb, int cols, float* xs, float* xsum) {
    int n_pairs = nb * (cols >> 6), n4 = 16 * n_pairs;
    for (int i = threadIdx.x; i < n4; i += blockDim.x)
        cp_async16(xs + (i >> 4) * DEC_XPAD + 4 * (i & 15), x + 4 * (long long)i);
    cp_async_commit();
    cp_async_wait<0>();
    __syncwarp();
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, per_round = blockDim.x >> 4;
    for (int m = lane;; m += 32) {
        int bg = 2 * warp + (m >> 1) * per_round + (m & 1);
        if (bg >= n_pairs) break;
        xsum[bg] = lean_group_sum(xs + bg * DEC_XPAD);
    }
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(DEC_ROWS_WARPS * 32, DEC_ROWS_MIN_BLOCKS)
dec_gemv_rows(DecSegs segs, const float* __restrict__ x, int nb, int cols) {
    extern __shared__ __align__(16) float dec_smem[];
    int G = cols >> 6;
    float* xs = dec_smem;                    // [nb][G][DEC_XPAD]
    float* xsum = xs + nb * G * DEC_XPAD;    // [nb][G]
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int L = G >= 8 ? 8 : G >= 4 ? 4 : G >= 2 ? 2 : 1;
    int rpw = 32 / L, sub = lane / L, sl = lane % L;
    dec_wait();
    rows_stage(x, nb, cols, xs, xsum);
    int warps = blockDim.x >> 5;
    for (int tile = blockIdx.x; tile < segs.tiles; tile += gridDim.x) {
        DecSeg sg = seg_of(segs, tile);
        int row = (tile - sg.tile0) * warps * rpw + warp * rpw + sub;
        float acc[DEC_B_MAX];
#pragma unroll
        for (int b = 0; b < DEC_B_MAX; b++) acc[b] = 0.0f;
        if (sg.w.bits == 4)
            brow_dot<4>(sg.w, row, G, L, sl, xs, xsum, nb, acc);
        else
            brow_dot<8>(sg.w, row, G, L, sl, xs, xsum, nb, acc);
#pragma unroll
        for (int b = 0; b < DEC_B_MAX; b++)
            for (int o = L >> 1; o > 0; o >>= 1) acc[b] += __shfl_xor_sync(0xffffffffu, acc[b], o);
        if (sl == 0 && row < sg.w.rows) {
#pragma unroll
            for (int b = 0; b < DEC_B_MAX; b++)
                if (b < nb) store_out(sg.y + (long long)b * sg.w.rows + row, sg.mode, acc[b]);
        }
    }
    dec_trigger_late();
}

// dec_gemv_rows_split: what dec_gemv_rows computes (the same segments, store modes, output
// layout and staging), for launches of few weight rows (the router's 256 + the shared
// gate's 1: the plan's router_rows_split), where dec_gemv_rows' tiles of 24-32 rows leave most
// SMs idle and each of its lanes walks G / 8 groups for every input row. Here a warp is one weight
// row and its lanes its groups (lane l: groups l, l + 32, ...; a lane past G idles), the lanes'
// sums met by xor shuffles (a fixed order for every row), DEC_SPLIT_WARPS rows a block: 65 blocks
// for the router. The first group's weights are requested before dec_wait. Persistent grid over
// tiles of DEC_SPLIT_WARPS rows; block DEC_SPLIT_WARPS · 32; dynamic shared memory as
// dec_gemv_rows'.
// dec_gemv_rows_split: this lane's first group (group `lane`) of its warp's weight row in
// `tile` (the row clamped to its segment's last), into the buffer of the segment's width.
__device__ __forceinline__ void split_first_load(const DecSegs& segs, int tile, int G, BGroup<4>& g4, BGroup<8>& g8) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (tile >= segs.tiles || lane >= G) return;
    DecSeg sg = seg_of(segs, tile);
    int row = min((tile - sg.tile0) * DEC_SPLIT_WARPS + warp, sg.w.rows - 1);
    if (sg.w.bits == 4)
        bgroup_load<4>(sg.w, row, G, lane, g4);
    else
        bgroup_load<8>(sg.w, row, G, lane, g8);
}

// STAGE: how x is staged: 0 rows_stage, 1 rows_stage_lean, 2 rows_stage_async (the same bits).
template <int STAGE>
__device__ __forceinline__ void gemv_rows_split(const DecSegs& segs, const float* __restrict__ x, int nb, int cols) {
    extern __shared__ __align__(16) float dec_smem[];
    int G = cols >> 6;
    float* xs = dec_smem;                  // [nb][G][DEC_XPAD]
    float* xsum = xs + nb * G * DEC_XPAD;  // [nb][G]
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int xstride = G * DEC_XPAD;
    // The first tile's first group, in flight while the kernel before finishes.
    BGroup<8> g8;
    BGroup<4> g4;
    int tile = blockIdx.x;
    split_first_load(segs, tile, G, g4, g8);
    dec_wait();
    if (STAGE == 2)
        rows_stage_async(x, nb, cols, xs, xsum);
    else if (STAGE == 1)
        rows_stage_lean(x, nb, cols, xs, xsum);
    else
        rows_stage(x, nb, cols, xs, xsum);
    for (; tile < segs.tiles; tile += gridDim.x) {
        DecSeg sg = seg_of(segs, tile);
        int row = (tile - sg.tile0) * DEC_SPLIT_WARPS + warp;
        long long r = min(row, sg.w.rows - 1);
        float acc[DEC_B_MAX];
#pragma unroll
        for (int b = 0; b < DEC_B_MAX; b++) acc[b] = 0.0f;
        for (int g = lane; g < G; g += 32) {
            // The tile's first group was loaded before this loop (above, or at the end of the last tile).
            if (sg.w.bits == 4) {
                if (g != lane) bgroup_load<4>(sg.w, r, G, g, g4);
                bgroup_dot<4>(g4, xs + g * DEC_XPAD, xstride, xsum + g, G, nb, acc);
            } else {
                if (g != lane) bgroup_load<8>(sg.w, r, G, g, g8);
                bgroup_dot<8>(g8, xs + g * DEC_XPAD, xstride, xsum + g, G, nb, acc);
            }
        }
        // The next tile's first group, in flight while this one's sums meet and are stored.
        split_first_load(segs, tile + gridDim.x, G, g4, g8);
#pragma unroll
        for (int b = 0; b < DEC_B_MAX; b++) acc[b] = warp_sum(acc[b]);
        if (lane == 0 && row < sg.w.rows) {
#pragma unroll
            for (int b = 0; b < DEC_B_MAX; b++)
                if (b < nb) store_out(sg.y + (long long)b * sg.w.rows + row, sg.mode, acc[b]);
        }
    }
    dec_trigger_late();
}

extern "C" __global__ void __launch_bounds__(DEC_SPLIT_WARPS * 32)
dec_gemv_rows_split(DecSegs segs, const float* __restrict__ x, int nb, int cols) {
    gemv_rows_split<0>(segs, x, nb, cols);
}

// dec_gemv_rows_split_lean (`batch_lean_glue`): dec_gemv_rows_split with rows_stage_lean's
// staging; the same outputs bit for bit.
extern "C" __global__ void __launch_bounds__(DEC_SPLIT_WARPS * 32)
dec_gemv_rows_split_lean(DecSegs segs, const float* __restrict__ x, int nb, int cols) {
    gemv_rows_split<1>(segs, x, nb, cols);
}

// dec_gemv_rows_split_async (`router_async_stage`): dec_gemv_rows_split_lean with
// rows_stage_async's staging (every copy of x in flight at once, one wait); the same outputs bit
// for bit. Bytes as dec_gemv_rows_split's: the 257 weight rows of 2,048 8-bit columns (0.53 MB
// with scales and biases, requested before dec_wait) once, x (nb × 8 KB) once a block from L2.
extern "C" __global__ void __launch_bounds__(DEC_SPLIT_WARPS * 32)
dec_gemv_rows_split_async(DecSegs segs, const float* __restrict__ x, int nb, int cols) {
    gemv_rows_split<2>(segs, x, nb, cols);
}

// ---- Batched 4-bit projections on the tensor cores (dec_mma_rows) ----------------------------

// dec_mma_rows: what dec_gemv_rows computes for 4-bit weights (the same segments, store modes
// and output layout), on the tensor cores: one mma.sync m16n8k16 (bf16 in, fp32 sums) takes a
// tile of 16 weight rows (A, M) × 16 columns (K) against the nb ≤ 8 input rows (B, N = 8;
// columns past nb are zeros), so a packed weight costs about two instructions for all the rows
// instead of dec_gemv_rows' few per row (perf-notes, branch mma-rows).
//
// Numerics, exact in the checkpoint's representation: MLX 4-bit is w = s·q + b per group of 64
// columns (bf16 s and b). A nibble ORed into 0x4300 is the bf16 of 128 + q (an integer of 128 ..
// 143, exact), two nibbles of a word into a bf16x2 with one shift and one LOP3; so per group the
// tensor core sums acc = Σ (128 + q) x, and y += s·acc + (b − 128 s)·Σ x, with each input row's
// group sums Σ x (of the bf16 values fed to the mma) computed once when x is staged. x is fed as
// bf16: exact in bf16 mode (the activations are bf16 values), so the plan takes this kernel only
// there.
//
// The order of k inside a dot product is free when A and B share it. Lane (g = lane / 4, t =
// lane % 4) holds A rows g and g + 8 at k slots 2t, 2t+1, 2t+8, 2t+9: for a group it loads words
// 2t and 2t + 1 of both rows (8 bytes each; the four lanes of a row read its group's 32 bytes),
// and word i's nibbles m = 0..7 (column 16t + 8i + m of the group) feed mma step j = 2i + h
// (h = 0, 1): slots (2t, 2t+1) ← nibbles (2h, 2h+4), slots (2t+8, 2t+9) ← (2h+1, 2h+5). x is
// staged in shared memory already in that order, as bf16 pairs: for input row n, group gi and
// lane quarter t, eight words (b0, b1 of the four steps) at xb[n · R + gi · 32 + t · 8], R = 32 G
// + 4 words a row (the 4-word pad puts rows n and n + 1 of a quarter-warp's 16-byte loads in
// distinct banks). A group's four mma steps start from zero (each group has its own scale); the
// lane's four outputs, C(g, 2t), C(g, 2t+1), C(g+8, 2t), C(g+8, 2t+1), gather over its groups.
//
// Work: tiles of 16 rows over the segments (tile0 counted in 16-row tiles). Without `split` each
// warp takes whole tiles (DEC_MMA_WARPS a block at once) and stores its outputs; with `split` the
// block's warps share one tile, warp w its groups w, w + DEC_MMA_WARPS, ..., their sums met in
// shared memory (the launcher splits where a launch has too few tiles to occupy the device,
// decode.rs mma_split). A warp streams its (tile, group) items DEC_MMA_CHUNK at a time, the next
// chunk's weights in flight while this one's are summed; the first chunk is requested before
// dec_wait. Persistent grid; dynamic shared memory: xb [nb][R] u32, xsum [G][8], and the split's
// partial sums [2][DEC_MMA_WARPS][32][4] (decode.rs mma_smem).
#if DEC_B_MAX != 8
#error "dec_mma_rows: the input rows are the mma's N = 8 columns (DEC_B_MAX)"
#endif
struct MmaItem {
    uint2 w[2];     // rows g and g + 8: words 2t, 2t + 1 of the group
    u16 s[2], b[2]; // their scales and biases
};
struct MmaChunk {
    MmaItem it[DEC_MMA_CHUNK];
};

// Where chunk c of this warp's stream lies: its tile and the first of its items' group indices.
struct MmaAt {
    int tile, j0, last;  // last: the tile's last chunk
};
__device__ __forceinline__ MmaAt mma_at(int c, int cpt, int ks) {
    int it = c / cpt, cc = c % cpt, tpb = DEC_MMA_WARPS / ks;
    MmaAt a;
    a.tile = (it * (int)gridDim.x + (int)blockIdx.x) * tpb + (int)(threadIdx.x >> 5) / ks;
    a.j0 = cc * DEC_MMA_CHUNK;
    a.last = cc == cpt - 1;
    return a;
}

// Item k of chunk c: group gi = kw + ks · (j0 + k) of the tile, if the tile and the group exist.
__device__ __forceinline__ void mma_chunk_load(const DecSegs& segs, int c, int cpt, int ks, int gpw, int G,
                                               MmaChunk& ch) {
    MmaAt a = mma_at(c, cpt, ks);
    if (a.tile >= segs.tiles) return;
    DecSeg sg = seg_of(segs, a.tile);
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, kw = (int)(threadIdx.x >> 5) % ks;
    int row0 = (a.tile - sg.tile0) * 16;
    long long r0 = min(row0 + g, sg.w.rows - 1), r1 = min(row0 + g + 8, sg.w.rows - 1);
    const uint2* q = reinterpret_cast<const uint2*>(sg.w.q);
    long long wpr = (long long)G * 4;  // uint2 a row
#pragma unroll
    for (int k = 0; k < DEC_MMA_CHUNK; k++) {
        int j = a.j0 + k, gi = kw + ks * j;
        if (j < gpw && gi < G) {
            MmaItem& it = ch.it[k];
            it.w[0] = ld_stream2(q + r0 * wpr + gi * 4 + t);
            it.w[1] = ld_stream2(q + r1 * wpr + gi * 4 + t);
            it.s[0] = sg.w.scales[r0 * G + gi];
            it.s[1] = sg.w.scales[r1 * G + gi];
            it.b[0] = sg.w.biases[r0 * G + gi];
            it.b[1] = sg.w.biases[r1 * G + gi];
        }
    }
}

// acc += group gi's share (item `it`) of the lane's four outputs.
__device__ __forceinline__ void mma_item_dot(const MmaItem& it, const u32* xb, int R, const float* xsum, int G,
                                             int nb, int gi, float (&acc)[4]) {
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    uint4 v0 = make_uint4(0u, 0u, 0u, 0u), v1 = v0;
    if (g < nb) {
        const uint4* p = reinterpret_cast<const uint4*>(xb + g * R + gi * 32 + t * 8);
        v0 = p[0];
        v1 = p[1];
    }
    u32 xw[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w};
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int i = 0; i < 2; i++) {
        u32 wa = i ? it.w[0].y : it.w[0].x, wb = i ? it.w[1].y : it.w[1].x;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            u32 a[4];
            a[0] = ((wa >> (8 * h)) & 0x000F000Fu) | 0x43004300u;
            a[1] = ((wb >> (8 * h)) & 0x000F000Fu) | 0x43004300u;
            a[2] = ((wa >> (8 * h + 4)) & 0x000F000Fu) | 0x43004300u;
            a[3] = ((wb >> (8 * h + 4)) & 0x000F000Fu) | 0x43004300u;
            int j = 2 * i + h;
            mma_bf16(c, a, xw[2 * j], xw[2 * j + 1]);
        }
    }
    float s0 = bf16_to_f32(it.s[0]), s1 = bf16_to_f32(it.s[1]);
    float o0 = bf16_to_f32(it.b[0]) - 128.0f * s0, o1 = bf16_to_f32(it.b[1]) - 128.0f * s1;
    float2 xs = *reinterpret_cast<const float2*>(xsum + gi * DEC_B_MAX + 2 * t);  // input rows 2t, 2t + 1
    float x0 = 2 * t < nb ? xs.x : 0.0f, x1 = 2 * t + 1 < nb ? xs.y : 0.0f;
    acc[0] += s0 * c[0] + o0 * x0;
    acc[1] += s0 * c[1] + o0 * x1;
    acc[2] += s1 * c[2] + o1 * x0;
    acc[3] += s1 * c[3] + o1 * x1;
}

// Output k of lane `lane` of a tile (C fragment order): its row in the tile and its input row.
__device__ __forceinline__ void mma_out(int lane, int k, int& row, int& n) {
    row = (lane >> 2) + 8 * (k >> 1);
    n = 2 * (lane & 3) + (k & 1);
}

// Chunk c ended tile a (a.last): the lane's four sums of it stored — a whole tile's by its warp, a
// split tile's first met in shared memory (`red`, two buffers by the tile's parity) and stored by
// the block's first 128 threads — and acc reset for the next tile. Both mma kernels' tile end.
__device__ __forceinline__ void mma_tile_end(const DecSegs& segs, const MmaAt& a, int c, int cpt, int ks, float* red,
                                             int nb, float (&acc)[4]) {
    int lane = threadIdx.x & 31;
    if (ks == 1) {
        if (a.tile < segs.tiles) {
            DecSeg sg = seg_of(segs, a.tile);
            int row0 = (a.tile - sg.tile0) * 16;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                int row, n;
                mma_out(lane, k, row, n);
                if (n < nb && row0 + row < sg.w.rows)
                    store_out(sg.y + (long long)n * sg.w.rows + row0 + row, sg.mode, acc[k]);
            }
        }
    } else {
        // The block's warps share the tile (uniform: every warp reaches this barrier together).
        float* buf = red + ((c / cpt) & 1) * (DEC_MMA_WARPS * 128);
        *reinterpret_cast<float4*>(buf + (threadIdx.x >> 5) * 128 + lane * 4) = make_float4(acc[0], acc[1], acc[2], acc[3]);
        __syncthreads();
        if (threadIdx.x < 128 && a.tile < segs.tiles) {
            int i = threadIdx.x, src = i >> 2, k = i & 3;
            float s = 0.0f;
            for (int w = 0; w < ks; w++) s += buf[w * 128 + src * 4 + k];
            DecSeg sg = seg_of(segs, a.tile);
            int row0 = (a.tile - sg.tile0) * 16, row, n;
            mma_out(src, k, row, n);
            if (n < nb && row0 + row < sg.w.rows)
                store_out(sg.y + (long long)n * sg.w.rows + row0 + row, sg.mode, s);
        }
    }
#pragma unroll
    for (int k = 0; k < 4; k++) acc[k] = 0.0f;
}

// The chunk's items summed into acc; at the tile's last chunk its outputs stored (and acc reset).
__device__ __forceinline__ void mma_chunk_dot(const DecSegs& segs, int c, int cpt, int ks, int gpw, int G,
                                              const MmaChunk& ch, const u32* xb, int R, const float* xsum,
                                              float* red, int nb, float (&acc)[4]) {
    MmaAt a = mma_at(c, cpt, ks);
    int kw = (int)(threadIdx.x >> 5) % ks;
    if (a.tile < segs.tiles) {
#pragma unroll
        for (int k = 0; k < DEC_MMA_CHUNK; k++) {
            int j = a.j0 + k, gi = kw + ks * j;
            if (j < gpw && gi < G) mma_item_dot(ch.it[k], xb, R, xsum, G, nb, gi, acc);
        }
    }
    if (a.last) mma_tile_end(segs, a, c, cpt, ks, red, nb, acc);
}

// x [nb, cols] → xb (bf16 pairs in the mma's k order, above) and xsum [G][8] (each row's group
// sums of those bf16 values, a group's 8 rows together: a lane reads its two as one float2): item (n, gi, t) is a thread's 16 columns 16t .. 16t + 15 of group gi; the
// four lanes of an (n, gi) add their sums by shuffles (every lane of the block takes part).
// U items a thread a round (`mma_stage_rounds`: U = DEC_MMA_STAGE_ROUND): all of a round's loads
// requested before any item is converted, so a thread's total / blockDim.x items cost
// ceil(that / U) dependent trips to L2 instead of one a item (8 at 8 rows × 2,048 columns on 128
// threads; 4 at 4 rows). Each item's arithmetic and stores are the same whatever U: the same bits.
template <int U>
__device__ __forceinline__ void mma_stage_items(const float* __restrict__ x, int nb, int cols, int G, int R, u32* xb,
                                                float* xsum) {
    int total = nb * G * 4;
    for (int base = 0; base < total; base += U * blockDim.x) {
        float4 f[U][4];
#pragma unroll
        for (int u = 0; u < U; u++) {
            int i = base + u * blockDim.x + threadIdx.x, t = i & 3, q = i >> 2, gi = q % G, n = q / G;
            if (i < total) {
                const float4* p = reinterpret_cast<const float4*>(x + (long long)n * cols + gi * 64 + t * 16);
#pragma unroll
                for (int e = 0; e < 4; e++) f[u][e] = p[e];
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            int i = base + u * blockDim.x + threadIdx.x, t = i & 3, q = i >> 2, gi = q % G, n = q / G;
            bool live = i < total;
            float gs = 0.0f;
            if (live) {
                float v[16];
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    v[4 * e] = round_bf16(f[u][e].x);
                    v[4 * e + 1] = round_bf16(f[u][e].y);
                    v[4 * e + 2] = round_bf16(f[u][e].z);
                    v[4 * e + 3] = round_bf16(f[u][e].w);
                }
                u32 w[8];
#pragma unroll
                for (int wi = 0; wi < 2; wi++)
#pragma unroll
                    for (int h = 0; h < 2; h++) {
                        int j = 2 * wi + h, m = 8 * wi + 2 * h;
                        w[2 * j] = pack_bf16x2(v[m], v[m + 4]);
                        w[2 * j + 1] = pack_bf16x2(v[m + 1], v[m + 5]);
                    }
                uint4* d = reinterpret_cast<uint4*>(xb + n * R + gi * 32 + t * 8);
                d[0] = make_uint4(w[0], w[1], w[2], w[3]);
                d[1] = make_uint4(w[4], w[5], w[6], w[7]);
#pragma unroll
                for (int e = 0; e < 16; e++) gs += v[e];
            }
            gs += __shfl_xor_sync(0xffffffffu, gs, 1);
            gs += __shfl_xor_sync(0xffffffffu, gs, 2);
            if (live && t == 0) xsum[gi * DEC_B_MAX + n] = gs;
        }
    }
}
__device__ __forceinline__ void mma_stage(const float* __restrict__ x, int nb, int cols, int G, int R, u32* xb,
                                          float* xsum) {
    mma_stage_items<1>(x, nb, cols, G, R, xb, xsum);
}

// A launch's work, both mma kernels': ks warps a tile (the block's DEC_MMA_WARPS with `split`, else
// 1), gpw of its G groups a warp in cpt chunks a tile, and `total` chunks in every warp's stream
// (as many tiles a warp as the grid's first warps take: mma_at past segs.tiles is no tile).
struct MmaWork {
    int ks, gpw, cpt, total;
};
__device__ __forceinline__ MmaWork mma_work(const DecSegs& segs, int G, int split) {
    int ks = split ? DEC_MMA_WARPS : 1, tpb = DEC_MMA_WARPS / ks;
    int gpw = (G + ks - 1) / ks, cpt = (gpw + DEC_MMA_CHUNK - 1) / DEC_MMA_CHUNK;
    int per_iter = (int)gridDim.x * tpb;
    return {ks, gpw, cpt, (segs.tiles + per_iter - 1) / per_iter * cpt};
}

extern "C" __global__ void __launch_bounds__(DEC_MMA_WARPS * 32, DEC_MMA_BLOCKS)
dec_mma_rows(DecSegs segs, const float* __restrict__ x, int nb, int cols, int split) {
    extern __shared__ __align__(16) float dec_smem[];
    int G = cols >> 6, R = G * 32 + 4;
    u32* xb = reinterpret_cast<u32*>(dec_smem);  // [nb][R]
    float* xsum = dec_smem + nb * R;             // [G][8]
    float* red = xsum + G * DEC_B_MAX;           // [2][DEC_MMA_WARPS][32][4]
    auto [ks, gpw, cpt, total] = mma_work(segs, G, split);
    MmaChunk ca, cb;
    if (total > 0) mma_chunk_load(segs, 0, cpt, ks, gpw, G, ca);
    dec_wait();
    mma_stage(x, nb, cols, G, R, xb, xsum);
    __syncthreads();
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int c = 0; c < total; c += 2) {
        if (c + 1 < total) mma_chunk_load(segs, c + 1, cpt, ks, gpw, G, cb);
        mma_chunk_dot(segs, c, cpt, ks, gpw, G, ca, xb, R, xsum, red, nb, acc);
        if (c + 1 >= total) break;
        if (c + 2 < total) mma_chunk_load(segs, c + 2, cpt, ks, gpw, G, ca);
        mma_chunk_dot(segs, c + 1, cpt, ks, gpw, G, cb, xb, R, xsum, red, nb, acc);
    }
    dec_trigger_late();
}

// ---- dec_mma_rows_deep: dec_mma_rows with its weights streamed through shared memory ---------
//
// The same tiles (mma_work), item sums (mma_item_dot) and stores (mma_tile_end) as dec_mma_rows —
// whole tiles a warp (lm_head) give its outputs bit for bit; a split tile's warps take its groups a
// chunk at a time (mma_deep_gi), so their outputs differ from dec_mma_rows' in summation order —,
// but a warp's weight nibbles travel by cp.async (16 bytes a lane, global → shared, no registers
// held while they fly) into a ring of `S` chunk stages of its own in shared memory: chunk c + S − 1
// is requested before chunk c is summed, so S − 1 chunks (DEC_MMA_CHUNK items: 16 rows × 32 bytes
// each) are in flight a warp all the time, not dec_mma_rows' one or two in registers, and a chunk
// costs a lane DEC_MMA_CHUNK 16-byte copies instead of 2 · DEC_MMA_CHUNK 8-byte loads (perf-notes,
// session 18, branch mma-deep). A stage is 16 rows of DEC_MMA_CHUNK · 32 bytes + 32 bytes of pad
// (the 160-byte row stride puts a half-warp's four rows of 8-byte reads in distinct banks).
// The scales and biases (2 bytes each) stay ordinary loads, one chunk ahead in registers.
// Dynamic shared memory: dec_mma_rows' (decode.rs mma_smem), then the stages
// [DEC_MMA_WARPS][S][16][DEC_MMA_STAGE_ROW / 4] u32 (decode.rs mma_deep_smem). S is 3, or 2
// where 3 would not fit the launch's shared memory (the launcher's choice, `stages`).
#define DEC_MMA_STAGE_ROW (DEC_MMA_CHUNK * 32 + 32)
#define DEC_MMA_STAGE (16 * DEC_MMA_STAGE_ROW / 4)
struct MmaSb {
    u16 s[DEC_MMA_CHUNK][2], b[DEC_MMA_CHUNK][2];
};

// Group of item k of a chunk: a split tile's warps take its groups a chunk at a time (warp kw the
// chunk slots kw, kw + ks, ...: DEC_MMA_CHUNK consecutive groups, a row's 128 contiguous bytes,
// where dec_mma_rows' warp kw takes groups kw, kw + ks, ...: 32 bytes); whole tiles (ks = 1)
// take groups j0 + k as dec_mma_rows does. As many chunks a tile (cpt) either way.
__device__ __forceinline__ int mma_deep_gi(const MmaAt& a, int k, int kw, int ks) {
    return a.j0 * ks + kw * DEC_MMA_CHUNK + k;
}

// Chunk c's nibbles requested into `stage` (every lane DEC_MMA_CHUNK 16-byte copies: copy
// i · 32 + lane is row (i · 32 + lane) / (2 DEC_MMA_CHUNK), item k, half h of the row's 32 bytes).
__device__ __forceinline__ void mma_deep_issue(const DecSegs& segs, int c, int cpt, int ks, int G, u32* stage) {
    MmaAt a = mma_at(c, cpt, ks);
    if (a.tile >= segs.tiles) return;
    DecSeg sg = seg_of(segs, a.tile);
    int lane = threadIdx.x & 31, kw = (int)(threadIdx.x >> 5) % ks;
    int row0 = (a.tile - sg.tile0) * 16;
    const uint4* q = reinterpret_cast<const uint4*>(sg.w.q);
    long long wpr = (long long)G * 2;  // uint4 a row
#pragma unroll
    for (int i = 0; i < DEC_MMA_CHUNK; i++) {
        int idx = i * 32 + lane, row = idx / (2 * DEC_MMA_CHUNK), k = (idx >> 1) % DEC_MMA_CHUNK, h = idx & 1;
        int gi = mma_deep_gi(a, k, kw, ks);
        if (gi < G) {
            long long r = min(row0 + row, sg.w.rows - 1);
            cp_async16(stage + row * (DEC_MMA_STAGE_ROW / 4) + k * 8 + h * 4, q + r * wpr + gi * 2 + h);
        }
    }
}

// Chunk c's scales and biases (this lane's rows g and g + 8), into registers.
__device__ __forceinline__ void mma_deep_sb(const DecSegs& segs, int c, int cpt, int ks, int G, MmaSb& sb) {
    MmaAt a = mma_at(c, cpt, ks);
    if (a.tile >= segs.tiles) return;
    DecSeg sg = seg_of(segs, a.tile);
    int g = (threadIdx.x & 31) >> 2, kw = (int)(threadIdx.x >> 5) % ks;
    int row0 = (a.tile - sg.tile0) * 16;
    long long r0 = min(row0 + g, sg.w.rows - 1), r1 = min(row0 + g + 8, sg.w.rows - 1);
#pragma unroll
    for (int k = 0; k < DEC_MMA_CHUNK; k++) {
        int gi = mma_deep_gi(a, k, kw, ks);
        if (gi < G) {
            sb.s[k][0] = sg.w.scales[r0 * G + gi];
            sb.s[k][1] = sg.w.scales[r1 * G + gi];
            sb.b[k][0] = sg.w.biases[r0 * G + gi];
            sb.b[k][1] = sg.w.biases[r1 * G + gi];
        }
    }
}

// Chunk c (its nibbles arrived in `stage`, its scales in sb) summed and, at a tile's end, stored:
// mma_chunk_dot's work with mma_deep_gi's groups (mma_item_dot's sums, mma_tile_end's stores).
__device__ __forceinline__ void mma_deep_dot(const DecSegs& segs, int c, int cpt, int ks, int G, const u32* stage,
                                             const MmaSb& sb, const u32* xb, int R, const float* xsum, float* red,
                                             int nb, float (&acc)[4]) {
    MmaAt a = mma_at(c, cpt, ks);
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, kw = (int)(threadIdx.x >> 5) % ks;
    if (a.tile < segs.tiles) {
#pragma unroll
        for (int k = 0; k < DEC_MMA_CHUNK; k++) {
            int gi = mma_deep_gi(a, k, kw, ks);
            if (gi < G) {
                MmaItem it;
                it.w[0] = *reinterpret_cast<const uint2*>(stage + g * (DEC_MMA_STAGE_ROW / 4) + k * 8 + t * 2);
                it.w[1] = *reinterpret_cast<const uint2*>(stage + (g + 8) * (DEC_MMA_STAGE_ROW / 4) + k * 8 + t * 2);
                it.s[0] = sb.s[k][0];
                it.s[1] = sb.s[k][1];
                it.b[0] = sb.b[k][0];
                it.b[1] = sb.b[k][1];
                mma_item_dot(it, xb, R, xsum, G, nb, gi, acc);
            }
        }
    }
    if (a.last) mma_tile_end(segs, a, c, cpt, ks, red, nb, acc);
}

// The stream of S stages: chunk c + S − 1 requested (into the stage chunk c − 1 left; the warp's
// lanes past reading it first) and chunk c + 1's scales loaded before chunk c is summed. Every
// lane commits one cp.async group a chunk, empty or not, so wait_group<S − 1> means chunk c's.
template <int S>
__device__ __forceinline__ void mma_deep_stream(const DecSegs& segs, int total, int cpt, int ks, int G,
                                                u32* pipe, const u32* xb, int R, const float* xsum, float* red,
                                                int nb) {
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    MmaSb sa, sbb;
    if (total > 0) mma_deep_sb(segs, 0, cpt, ks, G, sa);
    for (int c = 0; c < total; c += 2) {
        __syncwarp();
        if (c + S - 1 < total) mma_deep_issue(segs, c + S - 1, cpt, ks, G, pipe + ((c + S - 1) % S) * DEC_MMA_STAGE);
        cp_async_commit();
        if (c + 1 < total) mma_deep_sb(segs, c + 1, cpt, ks, G, sbb);
        cp_async_wait<S - 1>();
        __syncwarp();
        mma_deep_dot(segs, c, cpt, ks, G, pipe + (c % S) * DEC_MMA_STAGE, sa, xb, R, xsum, red, nb, acc);
        if (c + 1 >= total) break;
        __syncwarp();
        if (c + S < total) mma_deep_issue(segs, c + S, cpt, ks, G, pipe + ((c + S) % S) * DEC_MMA_STAGE);
        cp_async_commit();
        if (c + 2 < total) mma_deep_sb(segs, c + 2, cpt, ks, G, sa);
        cp_async_wait<S - 1>();
        __syncwarp();
        mma_deep_dot(segs, c + 1, cpt, ks, G, pipe + ((c + 1) % S) * DEC_MMA_STAGE, sbb, xb, R, xsum, red, nb, acc);
    }
    cp_async_wait<0>();
}

// dec_mma_rows_deep's body; U: mma_stage_items' items a thread a round (1: one load trip an item).
template <int U>
__device__ __forceinline__ void mma_rows_deep_body(DecSegs segs, const float* __restrict__ x, int nb, int cols,
                                                   int split, int stages) {
    extern __shared__ __align__(16) float dec_smem[];
    int G = cols >> 6, R = G * 32 + 4;
    u32* xb = reinterpret_cast<u32*>(dec_smem);  // [nb][R]
    float* xsum = dec_smem + nb * R;             // [G][8]
    float* red = xsum + G * DEC_B_MAX;           // [2][DEC_MMA_WARPS][32][4]
    u32* pipe = reinterpret_cast<u32*>(red + 2 * DEC_MMA_WARPS * 128) + (threadIdx.x >> 5) * stages * DEC_MMA_STAGE;
    auto [ks, gpw, cpt, total] = mma_work(segs, G, split);
    // The first S − 1 chunks requested before dec_wait (weights only), one group each.
    for (int c = 0; c < stages - 1; c++) {
        if (c < total) mma_deep_issue(segs, c, cpt, ks, G, pipe + c * DEC_MMA_STAGE);
        cp_async_commit();
    }
    dec_wait();
    mma_stage_items<U>(x, nb, cols, G, R, xb, xsum);
    __syncthreads();
    if (stages == 3)
        mma_deep_stream<3>(segs, total, cpt, ks, G, pipe, xb, R, xsum, red, nb);
    else
        mma_deep_stream<2>(segs, total, cpt, ks, G, pipe, xb, R, xsum, red, nb);
    dec_trigger_late();
}

extern "C" __global__ void __launch_bounds__(DEC_MMA_WARPS * 32, DEC_MMA_BLOCKS)
dec_mma_rows_deep(DecSegs segs, const float* __restrict__ x, int nb, int cols, int split, int stages) {
    mma_rows_deep_body<1>(segs, x, nb, cols, split, stages);
}

// dec_mma_rows_deep_rounds (`mma_stage_rounds`): dec_mma_rows_deep with its input rows staged
// DEC_MMA_STAGE_ROUND items a thread a round (mma_stage_items): the same outputs bit for bit.
#ifndef DEC_MMA_STAGE_ROUND
#error "DEC_MMA_STAGE_ROUND comes from the launcher module (crates/lily-cuda/src/kernels/decode.rs)"
#endif
extern "C" __global__ void __launch_bounds__(DEC_MMA_WARPS * 32, DEC_MMA_BLOCKS)
dec_mma_rows_deep_rounds(DecSegs segs, const float* __restrict__ x, int nb, int cols, int split, int stages) {
    mma_rows_deep_body<DEC_MMA_STAGE_ROUND>(segs, x, nb, cols, split, stages);
}
