// Linear layers straight from the packed checkpoint weights (MODEL.md §3.4), no dequantised copy.
//
//   linear / linear_wide: y[n, r] (+)= Σ_c W[r, c] x[n, c] for n < n_tok; one weight, many tokens;
//                         a warp reuses each dequantised word for 4 (linear) or 16 (linear_wide)
//                         tokens, so prefill reads the weight n_tok/16 times instead of n_tok.
//   linear_gather:        y[n, r] = Σ_c W_{ids[n]}[r, c] x[n / x_div, c]: MoE decode, one expert per item.
//   linear_grouped:       the same map for items grouped by expert into tiles of up to 16 items
//                         (moe_group builds perm + tiles on the device), so a routed expert's
//                         weights are read once per tile during prefill.
//
// Shapes: W [rows, cols] (or [E, rows, cols]); x [n, cols] fp32 with row stride x_stride;
// y [n, rows] fp32 with row stride y_stride. FLOPs 2·rows·cols per token.
// Simple version: one warp per output row, lanes stride over packed words, fp32 accumulation.

#ifndef LINEAR_WARPS
#error "LINEAR_WARPS comes from the launcher module (crates/lily-cuda/src/kernels/linear.rs)"
#endif
// GROUP_TILE: the tile moe_group is given for this kernel (kernels/linear.rs)
#ifndef GROUP_TILE
#error "GROUP_TILE comes from the launcher module (crates/lily-cuda/src/kernels/linear.rs)"
#endif

// The `per` activations x[c0 .. c0+per) that meet one packed word, as 16-byte (or 8-byte for bf16)
// vector loads: scalar loads 32 bytes apart across the warp made every linear kernel L1-bound.
// c0 is a multiple of per and rows are 16-byte aligned (kernels/mod.rs check_x checks the strides).
__device__ __forceinline__ void load_x(const float* __restrict__ xr, int per, float* xv) {
    if (per == 8) {
        float4 a = *reinterpret_cast<const float4*>(xr);
        float4 b = *reinterpret_cast<const float4*>(xr + 4);
        xv[0] = a.x; xv[1] = a.y; xv[2] = a.z; xv[3] = a.w;
        xv[4] = b.x; xv[5] = b.y; xv[6] = b.z; xv[7] = b.w;
    } else if (per == 4) {
        float4 a = *reinterpret_cast<const float4*>(xr);
        xv[0] = a.x; xv[1] = a.y; xv[2] = a.z; xv[3] = a.w;
    } else {
        float2 a = *reinterpret_cast<const float2*>(xr);
        xv[0] = a.x; xv[1] = a.y;
    }
}

template <int TOK>
__device__ __forceinline__ void linear_rows(const QWeight& w, const float* __restrict__ x, int x_stride,
                                            float* __restrict__ y, int y_stride, int n_tok, int accumulate) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int r = blockIdx.x * LINEAR_WARPS + warp;
    int n0 = blockIdx.y * TOK;
    if (r >= w.rows) return;
    float acc[TOK];
#pragma unroll
    for (int i = 0; i < TOK; i++) acc[i] = 0.0f;
    int wpr = qw_words_per_row(w);
    float vals[8];
    // Unrolled so each lane has several independent weight loads in flight (decode is latency-bound);
    // the 16-token variant has enough independent work per word and would spill.
#pragma unroll(TOK >= 16 ? 1 : 4)
    for (int wi = lane; wi < wpr; wi += 32) {
        int per = qw_unpack(w, r, wi, vals);
        int c0 = wi * per;
#pragma unroll
        for (int i = 0; i < TOK; i++) {
            if (n0 + i < n_tok) {
                float xv[8];
                load_x(x + (long long)(n0 + i) * x_stride + c0, per, xv);
                float s = 0.0f;
#pragma unroll
                for (int j = 0; j < 8; j++)
                    if (j < per) s += vals[j] * xv[j];
                acc[i] += s;
            }
        }
    }
#pragma unroll
    for (int i = 0; i < TOK; i++) {
        float s = warp_sum(acc[i]);
        if (lane == 0 && n0 + i < n_tok) {
            float* yp = y + (long long)(n0 + i) * y_stride + r;
            // accumulate: 0 store act(s), 1 add into y, 2 store s unrounded (the router's logits)
            *yp = accumulate == 1 ? act(*yp + act(s)) : accumulate == 2 ? s : act(s);
        }
    }
}

extern "C" __global__ void __launch_bounds__(LINEAR_WARPS * 32)
linear(QWeight w, const float* __restrict__ x, int x_stride, float* __restrict__ y, int y_stride,
       int n_tok, int accumulate) {
    linear_rows<4>(w, x, x_stride, y, y_stride, n_tok, accumulate);
}

extern "C" __global__ void __launch_bounds__(LINEAR_WARPS * 32)
linear_wide(QWeight w, const float* __restrict__ x, int x_stride, float* __restrict__ y, int y_stride,
            int n_tok, int accumulate) {
    linear_rows<16>(w, x, x_stride, y, y_stride, n_tok, accumulate);
}

extern "C" __global__ void __launch_bounds__(LINEAR_WARPS * 32)
linear_gather(QWeight w, const int* __restrict__ ids, const float* __restrict__ x, int x_stride,
              int x_div, float* __restrict__ y, int y_stride, int n_items) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int r = blockIdx.x * LINEAR_WARPS + warp;
    if (r >= w.rows) return;
    int wpr = qw_words_per_row(w);
    // grid.y is at most GRID_Y_MAX (kernels/linear.rs): past it (a prefill chunk of more than
    // 65,535 / top_k tokens) each block row takes items gridDim.y apart; one pass below it.
    for (int n = blockIdx.y; n < n_items; n += gridDim.y) {
        long long row = (long long)ids[n] * w.rows + r;
        const float* xr = x + (long long)(n / x_div) * x_stride;
        float vals[8];
        float acc = 0.0f;
#pragma unroll 4
        for (int wi = lane; wi < wpr; wi += 32) {
            int per = qw_unpack(w, row, wi, vals);
            float xv[8];
            load_x(xr + wi * per, per, xv);
#pragma unroll
            for (int j = 0; j < 8; j++)
                if (j < per) acc += vals[j] * xv[j];
        }
        acc = warp_sum(acc);
        if (lane == 0) y[(long long)n * y_stride + r] = act(acc);
    }
}

// tiles: [max_tiles][3] = (expert, start in perm, count ≤ GROUP_TILE); blocks past *n_tiles exit.
extern "C" __global__ void __launch_bounds__(LINEAR_WARPS * 32)
linear_grouped(QWeight w, const int* __restrict__ perm, const int* __restrict__ tiles,
               const int* __restrict__ n_tiles, const float* __restrict__ x, int x_stride, int x_div,
               float* __restrict__ y, int y_stride) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int r = blockIdx.x * LINEAR_WARPS + warp;
    int t = blockIdx.y;
    if (r >= w.rows || t >= *n_tiles) return;
    int e = tiles[3 * t], start = tiles[3 * t + 1], cnt = tiles[3 * t + 2];
    long long row = (long long)e * w.rows + r;
    int items[GROUP_TILE];
    float acc[GROUP_TILE];
#pragma unroll
    for (int i = 0; i < GROUP_TILE; i++) {
        items[i] = i < cnt ? perm[start + i] : 0;
        acc[i] = 0.0f;
    }
    int wpr = qw_words_per_row(w);
    float vals[8];
    for (int wi = lane; wi < wpr; wi += 32) {
        int per = qw_unpack(w, row, wi, vals);
        int c0 = wi * per;
#pragma unroll
        for (int i = 0; i < GROUP_TILE; i++) {
            if (i < cnt) {
                float xv[8];
                load_x(x + (long long)(items[i] / x_div) * x_stride + c0, per, xv);
                float s = 0.0f;
#pragma unroll
                for (int j = 0; j < 8; j++)
                    if (j < per) s += vals[j] * xv[j];
                acc[i] += s;
            }
        }
    }
#pragma unroll
    for (int i = 0; i < GROUP_TILE; i++) {
        float s = warp_sum(acc[i]);
        if (lane == 0 && i < cnt) y[(long long)items[i] * y_stride + r] = act(s);
    }
}
