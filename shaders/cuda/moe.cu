// Mixture of experts glue (MODEL.md §2.6); the expert matmuls themselves are linear/linear_gather.
//
// moe_route:   p = softmax(router_logits) over all E experts (fp32), top-k, renormalise:
//              ids [T, K] (expert index), weights [T, K]. One warp per token; ties go to the lower
//              expert index. Routing metadata never leaves the device.
// silu_mul:    h = silu(g) ⊙ u (expert and shared-expert activations).
// moe_combine: x += Σ_k w_k · y_k + sigmoid(shared_gate) · y_shared (the residual add included).

#ifndef MOE_MAX_E
#error "MOE_MAX_E comes from the launcher module (crates/lily-cuda/src/kernels/moe.rs)"
#endif

extern "C" __global__ void __launch_bounds__(32)
moe_route(const float* __restrict__ logits, int* __restrict__ ids, float* __restrict__ weights, int n_tok,
          int n_experts, int top_k) {
    __shared__ float p[MOE_MAX_E];
    int t = blockIdx.x, lane = threadIdx.x;
    if (t >= n_tok) return;
    route_top_k(logits + (long long)t * n_experts, n_experts, top_k, p, ids + t * top_k, weights + t * top_k);
}

extern "C" __global__ void silu_mul(const float* __restrict__ g, const float* __restrict__ u, float* __restrict__ h,
                                    long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) h[i] = act(act(siluf(g[i])) * u[i]);
}

extern "C" __global__ void moe_combine(float* __restrict__ x, const float* __restrict__ y_experts,
                                       const float* __restrict__ weights, const float* __restrict__ y_shared,
                                       const float* __restrict__ shared_gate, int n_tok, int hidden, int top_k) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)n_tok * hidden) return;
    int t = (int)(i / hidden), c = (int)(i % hidden);
    float y = 0.0f;
    for (int k = 0; k < top_k; k++)
        y += weights[t * top_k + k] * y_experts[((long long)t * top_k + k) * hidden + c];
    y += act(act(sigmoidf(shared_gate[t])) * y_shared[i]);
    x[i] = act(x[i] + act(y));
}

// moe_group: groups the n_items = T·K routed (token, slot) items by expert for linear_grouped
// (tile = GROUP_TILE = 16) or gemm_grouped32/64 (tile = 32 or 64): perm [n_items] lists items
// expert by expert; tiles [≤ n_items/16 + E][3] holds (expert, start, count) per run of up to
// `tile` items; *n_tiles their number. One block. The order of items inside an expert does not
// matter: each item's result is its own row.
// tail > 0 (the plan's `wgmma_tail_tiles`): an expert's runs of `tile` stop once at most `tail`
// items are left, and those go to a second list, tail_tiles [≤ E][3] (one run an expert, count ≤
// tail), n_tiles[1] its number; an expert of tile + 5 items is one run of `tile` and one of 5
// there, one of tail + 5 a single run of `tile`.

extern "C" __global__ void __launch_bounds__(1024)
moe_group(const int* __restrict__ ids, int n_items, int n_experts, int tile, int* __restrict__ perm,
          int* __restrict__ tiles, int* __restrict__ n_tiles, int tail, int* __restrict__ tail_tiles) {
    __shared__ int cnt[MOE_MAX_E], off[MOE_MAX_E], fill[MOE_MAX_E];
    for (int e = threadIdx.x; e < n_experts; e += blockDim.x) {
        cnt[e] = 0;
        fill[e] = 0;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n_items; i += blockDim.x) atomicAdd(&cnt[ids[i]], 1);
    __syncthreads();
    if (threadIdx.x == 0) {
        int run = 0, nt = 0, n_tail = 0;
        for (int e = 0; e < n_experts; e++) {
            off[e] = run;
            int s = 0;
            for (; s < cnt[e] && cnt[e] - s > tail; s += tile) {
                tiles[3 * nt] = e;
                tiles[3 * nt + 1] = run + s;
                tiles[3 * nt + 2] = min(tile, cnt[e] - s);
                nt++;
            }
            if (s < cnt[e]) {  // tail > 0 only: the last ≤ tail items
                tail_tiles[3 * n_tail] = e;
                tail_tiles[3 * n_tail + 1] = run + s;
                tail_tiles[3 * n_tail + 2] = cnt[e] - s;
                n_tail++;
            }
            run += cnt[e];
        }
        n_tiles[0] = nt;
        if (tail > 0) n_tiles[1] = n_tail;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n_items; i += blockDim.x) {
        int e = ids[i];
        perm[off[e] + atomicAdd(&fill[e], 1)] = i;
    }
}
