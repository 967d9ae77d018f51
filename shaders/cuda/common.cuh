// Shared helpers for every Lily CUDA kernel. NVRTC 13 ships no cuda_bf16.h, so bf16 is plain
// 16-bit storage with our own conversions. Prepended to each kernel file before compilation.
//
// Activation mode: by default every activation is fp32. With LILY_BF16_ACT defined, values are
// rounded to bf16 wherever the reference model (HF, bf16) stores an activation, and the KV cache
// is stored in bf16; accumulation is fp32 in both modes.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

// Programmatic dependent launch (sm_90+; no-ops before). pdl_trigger lets the next kernel in the
// stream start now (its blocks do their independent prologue), else it starts when this one's
// blocks have exited; the weight-streaming kernels call it after their last tile, so the next
// kernel's blocks do not sit on the SMs while this one works. pdl_wait blocks until the kernel
// before this one has finished and its writes are visible. A kernel the launcher marks
// `waits_for_predecessor` calls pdl_wait in every block before touching anything but weights.
__device__ __forceinline__ void pdl_trigger() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

// Round to nearest even; NaN stays NaN.
__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)((x >> 16) | 0x40);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (u16)(x >> 16);
}

__device__ __forceinline__ float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#ifdef LILY_BF16_ACT
__device__ __forceinline__ float act(float f) { return round_bf16(f); }
typedef u16 kv_t;
__device__ __forceinline__ float kv_load(kv_t v) { return bf16_to_f32(v); }
__device__ __forceinline__ kv_t kv_store(float f) { return f32_to_bf16(f); }
#else
__device__ __forceinline__ float act(float f) { return f; }
typedef float kv_t;
__device__ __forceinline__ float kv_load(kv_t v) { return v; }
__device__ __forceinline__ kv_t kv_store(float f) { return f; }
#endif

#define NEG_INF __int_as_float(0xff800000u)

__device__ __forceinline__ float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float siluf(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float softplusf(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// The larger of (value, index) pairs over a warp, the lower index on ties; every lane gets it.
__device__ __forceinline__ void warp_argmax(float& best, int& best_i) {
    for (int o = 16; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
        if (ov > best || (ov == best && oi < best_i)) {
            best = ov;
            best_i = oi;
        }
    }
}

// One value over the block (blockDim.x a multiple of 32) by `warp_reduce` within each warp, then
// over the warps' partials (lanes past the last warp read `idle`); every thread gets it.
template <class WarpReduce>
__device__ __forceinline__ float block_reduce(float v, float idle, WarpReduce warp_reduce) {
    __shared__ float partial[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_reduce(v);
    __syncthreads();  // partial[] may still be read by a previous call
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    float t = lane < nwarps ? partial[lane] : idle;
    return warp_reduce(t);
}
__device__ __forceinline__ float block_sum(float v) {
    return block_reduce(v, 0.0f, [](float x) { return warp_sum(x); });
}
// The largest of values ≥ 0 (the idle lanes read 0).
__device__ __forceinline__ float block_max(float v) {
    return block_reduce(v, 0.0f, [](float x) { return warp_max(x); });
}

// A weight matrix as the checkpoint stores it (MODEL.md §3.4): MLX affine 4-bit or 8-bit,
// group 64 along the input dim, w = scale * q + bias, element j of each u32 at bit offset bits*j;
// or plain bf16 (bits == 16, `q` then holds bf16 pairs). A stack of experts is `experts`
// consecutive [rows, cols] matrices.
struct QWeight {
    const u32* q;       // [experts, rows, cols * bits / 32]
    const u16* scales;  // [experts, rows, cols / group] (affine only)
    const u16* biases;  // same
    int bits;           // 4, 8, or 16 (bf16)
    int rows;
    int cols;
    int group;
};

__device__ __forceinline__ int qw_words_per_row(const QWeight& w) { return w.cols * w.bits / 32; }

// Dequantises the 32/bits elements of word `wi` of row `row` (of expert `e`) into out[].
// Returns how many elements were written (8, 4 or 2).
__device__ __forceinline__ int qw_unpack(const QWeight& w, long long row, int wi, float* out) {
    int wpr = qw_words_per_row(w);
    u32 word = w.q[row * wpr + wi];
    if (w.bits == 16) {
        out[0] = bf16_to_f32((u16)(word & 0xffffu));
        out[1] = bf16_to_f32((u16)(word >> 16));
        return 2;
    }
    int per = 32 / w.bits;
    int col0 = wi * per;
    long long g = row * (long long)(w.cols / w.group) + col0 / w.group;
    float s = bf16_to_f32(w.scales[g]);
    float b = bf16_to_f32(w.biases[g]);
    u32 mask = (1u << w.bits) - 1u;
    for (int j = 0; j < per; j++) out[j] = s * (float)((word >> (w.bits * j)) & mask) + b;
    return per;
}

// ---- tensor cores and asynchronous copies (sm_80+): mma.sync, ldmatrix, cp.async -----------

// The shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// Four 8x8 b16 matrices; lanes 8i..8i+7 give the row addresses of matrix i, and register i of
// lane L gets row L/4, columns 2(L%4), 2(L%4)+1 of matrix i (.trans: of its transpose).
__device__ __forceinline__ void ldsm_x4(u32 addr, u32 (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(u32 addr, u32 (&r)[4]) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// c (16x8 fp32) += a (16x16 bf16, row major) · b (16x8 bf16, "col": b0/b1 hold k pairs).
__device__ __forceinline__ void mma_bf16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A float rounded to tf32 (10-bit mantissa, to nearest, ties away), in a 32-bit register.
__device__ __forceinline__ u32 to_tf32(float f) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(f));
    return r;
}

// c (16x8 fp32) += a (16x8 tf32, row major) · b (8x8 tf32, "col"). Lane L (g = L/4, t = L%4)
// holds a = (g, t), (g+8, t), (g, t+4), (g+8, t+4); b = (k t, n g), (k t+4, n g); c = (g, 2t),
// (g, 2t+1), (g+8, 2t), (g+8, 2t+1).
__device__ __forceinline__ void mma_tf32(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Fragments of m16n8k8 tf32 operands read from fp32 values anywhere addressable (strides in
// elements, so a transposed operand is the same call with the strides swapped), rounded on the way.
// A: the 16×8 tile whose element (row r, col k) is p[r·rs + k·ks].
__device__ __forceinline__ void frag_a_tf32(u32 (&a)[4], const float* p, int rs, int ks) {
    int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    a[0] = to_tf32(p[g * rs + t * ks]);
    a[1] = to_tf32(p[(g + 8) * rs + t * ks]);
    a[2] = to_tf32(p[g * rs + (t + 4) * ks]);
    a[3] = to_tf32(p[(g + 8) * rs + (t + 4) * ks]);
}
// The same tile with column k multiplied by sc[k] first (a diagonal matrix on the right).
__device__ __forceinline__ void frag_a_tf32_cols(u32 (&a)[4], const float* p, int rs, int ks, const float* sc) {
    int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    float s0 = sc[t], s1 = sc[t + 4];
    a[0] = to_tf32(p[g * rs + t * ks] * s0);
    a[1] = to_tf32(p[(g + 8) * rs + t * ks] * s0);
    a[2] = to_tf32(p[g * rs + (t + 4) * ks] * s1);
    a[3] = to_tf32(p[(g + 8) * rs + (t + 4) * ks] * s1);
}
// B: the 8×8 tile whose element (k, n) is p[k·ks + n·ns].
__device__ __forceinline__ void frag_b_tf32(u32& b0, u32& b1, const float* p, int ks, int ns) {
    int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
    b0 = to_tf32(p[t * ks + g * ns]);
    b1 = to_tf32(p[(t + 4) * ks + g * ns]);
}

// Two floats rounded to nearest-even bf16, `lo` in the low half (the lower column / k index).
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// 16 bytes global → shared without passing through registers (sm_80+); then commit / wait.
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
// cp_async16 to a shared address (smem_addr's) the caller computed.
__device__ __forceinline__ void cp_async16_s(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// ---- Hopper (sm_90a): warpgroup MMA (gemm.cu's wgb kernels, attention.cu's attn_prefill_wg) ----
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }
// Generic-proxy writes to shared memory, made visible to the MMA's (async-proxy) reads.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// The descriptor of a K-major bf16 operand with the 128-byte swizzle at shared address `addr`
// (1024-byte aligned atoms of 8 rows × 128 bytes): start address, leading byte offset (unused with
// this swizzle: 1), stride byte offset 1024 (8 rows), layout 1 (128-byte swizzle).
__device__ __forceinline__ unsigned long long wg_desc(u32 addr) {
    return (unsigned long long)((addr & 0x3ffffu) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) |
           (1ull << 62);
}

// The descriptor of an MN-major bf16 operand with the 128-byte swizzle (read with the transpose
// bit): rows of 64 MN-consecutive elements (128 bytes), a row per k index, 8 k indices an atom
// (stride byte offset 1024), the next 64 MN elements `mn_stride` bytes on (leading byte offset).
__device__ __forceinline__ unsigned long long wg_desc_mn(u32 addr, u32 mn_stride) {
    return (unsigned long long)((addr & 0x3ffffu) >> 4) | ((unsigned long long)((mn_stride & 0x3ffffu) >> 4) << 16) |
           ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}
#endif

// ---- Hopper (sm_90+): the bulk-copy engine (decode.cu's dec_glu4_x8x2_bulk) -----------------
// One-phase mbarriers that one thread's arrival and the bytes of bulk copies complete (the
// kernel's use: each barrier waited on once, parity 0). Below sm_90 each traps (the plan names
// their kernel on sm_90a only). scripts/cuda_emu/shim_decode.h emulates them.
__device__ __forceinline__ void bulk_bar_init(unsigned long long* bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"((u32)__cvta_generic_to_shared(bar)) : "memory");
#else
    __trap();
#endif
}
// The inits visible to the copies (the async proxy) that complete on them.
__device__ __forceinline__ void bulk_bar_fence() {
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#else
    __trap();
#endif
}
// The barrier's one arrival, with the bytes its phase must also see land.
__device__ __forceinline__ void bulk_expect(unsigned long long* bar, u32 bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(
                     (u32)__cvta_generic_to_shared(bar)),
                 "r"(bytes)
                 : "memory");
#else
    __trap();
#endif
}
// `bytes` (a multiple of 16; both ends 16-byte aligned) from global `src` to shared `dst` by the
// copy engine, counted on `bar` as they land.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, u32 bytes, unsigned long long* bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     (u32)__cvta_generic_to_shared(dst)),
                 "l"(src), "r"(bytes), "r"((u32)__cvta_generic_to_shared(bar))
                 : "memory");
#else
    __trap();
#endif
}
// Until the barrier's first phase (its arrival and every byte expected) has completed.
__device__ __forceinline__ void bulk_wait(unsigned long long* bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile(
        "{\n.reg .pred p;\nLILY_BULK_WAIT:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], 0;\n"
        "@!p bra LILY_BULK_WAIT;\n}\n" ::"r"((u32)__cvta_generic_to_shared(bar))
        : "memory");
#else
    __trap();
#endif
}

// ---- pieces two kernel files share ----------------------------------------------------------

// One token of the gated delta rule for one value column, as dn_recurrent and the decode step
// (dec_dn_step) run it: PARTS adjacent lanes share the column, each holding `rows` (≤ ROWS) state
// rows i = part + PARTS·r in s[]. S ← αS; u = Sᵀk; δ = β(v − u); S ← S + kδᵀ; returns o = Sᵀq
// (summed over the PARTS lanes). qs, ks: the token's normalised q and k.
template <int ROWS, int PARTS>
__device__ __forceinline__ float dn_column_step(float (&s)[ROWS], const float* qs, const float* ks, int part,
                                               int rows, float alpha, float beta, float v) {
    float kr[ROWS];
    float u0 = 0.0f, u1 = 0.0f, u2 = 0.0f, u3 = 0.0f;
#pragma unroll
    for (int r = 0; r < ROWS; r += 4) {
        if (r < rows) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                kr[r + e] = ks[part + PARTS * (r + e)];
                s[r + e] *= alpha;
            }
            u0 += s[r] * kr[r];
            u1 += s[r + 1] * kr[r + 1];
            u2 += s[r + 2] * kr[r + 2];
            u3 += s[r + 3] * kr[r + 3];
        }
    }
    float u = (u0 + u1) + (u2 + u3);
#pragma unroll
    for (int off = 1; off < PARTS; off <<= 1) u += __shfl_xor_sync(0xffffffffu, u, off);
    float delta = beta * (v - u);
    float o0 = 0.0f, o1 = 0.0f, o2 = 0.0f, o3 = 0.0f;
#pragma unroll
    for (int r = 0; r < ROWS; r += 4) {
        if (r < rows) {
#pragma unroll
            for (int e = 0; e < 4; e++) s[r + e] += kr[r + e] * delta;
            o0 += s[r] * qs[part + PARTS * r];
            o1 += s[r + 1] * qs[part + PARTS * (r + 1)];
            o2 += s[r + 2] * qs[part + PARTS * (r + 2)];
            o3 += s[r + 3] * qs[part + PARTS * (r + 3)];
        }
    }
    float out = (o0 + o1) + (o2 + o3);
#pragma unroll
    for (int off = 1; off < PARTS; off <<= 1) out += __shfl_xor_sync(0xffffffffu, out, off);
    return out;
}

// The MoE routing of one token, by one warp (moe_route, and dec_glu in the decode step):
// p = softmax(logits) over n_experts, the top_k (ties to the lower expert index) into ids[], their
// probabilities renormalised over the top_k (rounded by act) into w[]. Up to 256 experts the
// probabilities stay in registers (ROUTE_REG per lane) and each pick is two warp reductions
// (redux.sync: the largest probability, then the lowest index holding it); more experts go
// through p[] (scratch) with a shuffle argmax per pick, as do kernels that ask (IN_REGS = false:
// short of registers). Both give the same picks and weights.
#define ROUTE_REG 8
template <bool IN_REGS = true>
__device__ __forceinline__ void route_top_k(const float* __restrict__ lt, int n_experts, int top_k, float* p,
                                            int* ids, float* w) {
    int lane = threadIdx.x & 31;
    if (IN_REGS && n_experts <= 32 * ROUTE_REG) {
        float v[ROUTE_REG];
        float mx = NEG_INF;
#pragma unroll
        for (int j = 0; j < ROUTE_REG; j++) {
            int e = lane + 32 * j;
            v[j] = e < n_experts ? lt[e] : NEG_INF;
            mx = fmaxf(mx, v[j]);
        }
        mx = warp_max(mx);
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < ROUTE_REG; j++) {
            v[j] = lane + 32 * j < n_experts ? expf(v[j] - mx) : 0.0f;
            sum += v[j];
        }
        sum = warp_sum(sum);
        // key = bits of p + 1 (p >= 0, so the bits order like the values); 0 = taken or absent.
        u32 key[ROUTE_REG];
#pragma unroll
        for (int j = 0; j < ROUTE_REG; j++) {
            v[j] = v[j] / sum;
            key[j] = lane + 32 * j < n_experts ? __float_as_uint(v[j]) + 1u : 0u;
        }
        float picked_sum = 0.0f, mine = 0.0f;
        for (int k = 0; k < top_k; k++) {
            u32 best = 0;
            int best_j = 0;
#pragma unroll
            for (int j = 0; j < ROUTE_REG; j++)
                if (key[j] > best) {  // strict: the lower index wins ties within a lane
                    best = key[j];
                    best_j = j;
                }
            u32 top = __reduce_max_sync(0xffffffffu, best);
            u32 at = __reduce_min_sync(0xffffffffu, best == top ? (u32)(lane + 32 * best_j) : 0xffffffffu);
            float pv = __uint_as_float(top - 1u);
            if (lane == (int)(at & 31)) {
#pragma unroll
                for (int j = 0; j < ROUTE_REG; j++)
                    if (j == best_j) key[j] = 0u;
            }
            if (lane == k) mine = pv;
            if (lane == 0) ids[k] = (int)at;
            picked_sum += pv;
        }
        if (lane < top_k) w[lane] = act(mine / picked_sum);
        __syncwarp();
        return;
    }
    float mx = NEG_INF;
    for (int e = lane; e < n_experts; e += 32) mx = fmaxf(mx, lt[e]);
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int e = lane; e < n_experts; e += 32) {
        float v = expf(lt[e] - mx);
        p[e] = v;
        sum += v;
    }
    sum = warp_sum(sum);
    for (int e = lane; e < n_experts; e += 32) p[e] = p[e] / sum;
    __syncwarp();
    float picked_sum = 0.0f;
    for (int k = 0; k < top_k; k++) {
        float best = -1.0f;
        int best_e = 0x7fffffff;
        for (int e = lane; e < n_experts; e += 32)
            if (p[e] > best) {  // strict: the lower index wins ties within a lane
                best = p[e];
                best_e = e;
            }
        warp_argmax(best, best_e);
        if (lane == 0) {
            ids[k] = best_e;
            w[k] = best;
            p[best_e] = -2.0f;  // taken
        }
        picked_sum += best;
        __syncwarp();
    }
    if (lane < top_k) w[lane] = act(w[lane] / picked_sum);
}

