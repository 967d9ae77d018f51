// Shared helpers for every Lily CUDA kernel. NVRTC 13 ships no cuda_bf16.h, so bf16 is plain
// 16-bit storage with our own conversions. Prepended to each kernel file before compilation.
//
// Activation mode: by default every activation is fp32. With LILY_BF16_ACT defined, values are
// rounded to bf16 wherever the reference model (HF, bf16) stores an activation, and the KV cache
// is stored in bf16; accumulation is fp32 in both modes.

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;

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

// Sum over the whole block (blockDim.x a multiple of 32, at most 1024). Every thread gets the sum.
__device__ __forceinline__ float block_sum(float v) {
    __shared__ float partial[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // partial[] may still be read by a previous call
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    float t = lane < nwarps ? partial[lane] : 0.0f;
    return warp_sum(t);
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
