// Host emulation of the CUDA features dn_wy_prep / dn_wy_scan use: a block = 256 std::threads,
// barriers for __syncthreads / __syncwarp, warp-collective mma and shuffles through shared slots,
// cp.async deferred until cp_async_wait (so reading staged data before the wait shows up).
#include <barrier>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <thread>
#include <vector>
#include <deque>
#include <algorithm>
#include <functional>
#include <atomic>
#include <cstdio>
std::atomic<int> g_unwaited{0};
typedef unsigned int u32;
struct dim3e { int x, y, z; };
thread_local dim3e threadIdx, blockIdx;
dim3e blockDim, gridDim;
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
inline float2 make_float2(float a, float b) { return {a, b}; }
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
using std::min; using std::max;
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)
#define __maxnreg__(...)
#define __align__(x)
#ifdef EMU_ACT_BF16  // bf16 activation mode (gemm.cu's wgmma kernels run only there): act rounds to bf16
inline float act(float f) {
    unsigned int x; memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) <= 0x7f800000u) x = (x + 0x7fffu + ((x >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &x, 4);
    return f;
}
#else
inline float act(float f) { return f; }
#endif

bool g_tf32 = true;
inline u32 as_u(float f) { u32 u; memcpy(&u, &f, 4); return u; }
inline float as_f(u32 u) { float f; memcpy(&f, &u, 4); return f; }
inline u32 to_tf32(float f) {
    if (!g_tf32) return as_u(f);
    u32 b = as_u(f);
    b += 0x1000u; b &= 0xffffe000u;
    return b;
}

std::barrier<>* g_block_bar;
std::barrier<>* g_warp_bar[8];
std::barrier<>* g_wg_bar[2];  // the two warpgroups of a 256-thread block (wgmma.h)
float* g_smem;
inline int lane_id() { return threadIdx.x & 31; }
inline int warp_id() { return threadIdx.x >> 5; }
inline void __syncthreads();
// warp-shared slots
struct WarpSlots { u32 a[32][4]; u32 b[32][2]; float c[32][4]; float v[32]; };
WarpSlots g_ws[8];
#ifndef SHIM_FIBERS  // shim_decode.h brings its own barriers (a block's threads as fibers)
inline void __syncwarp() { g_warp_bar[warp_id()]->arrive_and_wait(); }
#else
inline void __syncwarp();
#endif
inline float __shfl_up_sync(unsigned, float v, int off) {
    auto& w = g_ws[warp_id()]; int l = lane_id();
    w.v[l] = v; __syncwarp();
    float r = l >= off ? w.v[l - off] : v; __syncwarp();
    return r;
}
inline void mma_tf32(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    auto& w = g_ws[warp_id()]; int l = lane_id();
    for (int i = 0; i < 4; i++) { w.a[l][i] = a[i]; w.c[l][i] = c[i]; }
    w.b[l][0] = b0; w.b[l][1] = b1;
    __syncwarp();
    if (l == 0) {
        float A[16][8], B[8][8], C[16][8];
        for (int L = 0; L < 32; L++) {
            int g = L >> 2, t = L & 3;
            A[g][t] = as_f(w.a[L][0]); A[g + 8][t] = as_f(w.a[L][1]);
            A[g][t + 4] = as_f(w.a[L][2]); A[g + 8][t + 4] = as_f(w.a[L][3]);
            B[t][g] = as_f(w.b[L][0]); B[t + 4][g] = as_f(w.b[L][1]);
            C[g][2 * t] = w.c[L][0]; C[g][2 * t + 1] = w.c[L][1];
            C[g + 8][2 * t] = w.c[L][2]; C[g + 8][2 * t + 1] = w.c[L][3];
        }
        for (int m = 0; m < 16; m++) for (int n = 0; n < 8; n++) {
            float s = C[m][n];
            for (int k = 0; k < 8; k++) s += A[m][k] * B[k][n];
            C[m][n] = s;
        }
        for (int L = 0; L < 32; L++) {
            int g = L >> 2, t = L & 3;
            w.c[L][0] = C[g][2 * t]; w.c[L][1] = C[g][2 * t + 1];
            w.c[L][2] = C[g + 8][2 * t]; w.c[L][3] = C[g + 8][2 * t + 1];
        }
    }
    __syncwarp();
    for (int i = 0; i < 4; i++) c[i] = w.c[l][i];
    __syncwarp();
}
// cp.async: copies queued per thread, grouped by commit, done at the wait.
struct Copy { void* dst; const void* src; };
thread_local std::deque<std::vector<Copy>> t_groups;
thread_local std::vector<Copy> t_open;
inline void cp_async16(void* dst, const void* src) { t_open.push_back({dst, src}); }
inline void cp_async_commit() { t_groups.push_back(t_open); t_open.clear(); }
template <int N> inline void cp_async_wait() {
    while ((int)t_groups.size() > N) {
        for (auto& c : t_groups.front()) memcpy(c.dst, c.src, 16);
        t_groups.pop_front();
    }
}
#ifndef SHIM_FIBERS
inline void __syncthreads() { g_block_bar->arrive_and_wait(); }
#endif

// Runs `kernel` over the grid, a block at a time, `threads` threads, `smem_floats` of shared memory
// filled with NaN first.
inline void launch(dim3e grid, int threads, size_t smem_floats, std::function<void()> kernel) {
    blockDim = {threads, 1, 1}; gridDim = grid;
    std::vector<float> smem(smem_floats);
    for (int by = 0; by < grid.y; by++) for (int bx = 0; bx < grid.x; bx++) {
        std::fill(smem.begin(), smem.end(), NAN);
        g_smem = smem.data();
        std::barrier<> bb(threads);
        std::barrier<> wb[8] = {std::barrier<>(32), std::barrier<>(32), std::barrier<>(32), std::barrier<>(32),
                                std::barrier<>(32), std::barrier<>(32), std::barrier<>(32), std::barrier<>(32)};
        std::barrier<> gb[2] = {std::barrier<>(128), std::barrier<>(128)};
        g_block_bar = &bb;
        for (int i = 0; i < 8; i++) g_warp_bar[i] = &wb[i];
        for (int i = 0; i < 2; i++) g_wg_bar[i] = &gb[i];
        std::vector<std::thread> ts;
        for (int t = 0; t < threads; t++)
            ts.emplace_back([&, t, bx, by] {
                threadIdx = {t, 0, 0}; blockIdx = {bx, by, 0};
                t_groups.clear(); t_open.clear();
                kernel();
                // Groups left with copies in them (empty trailing commits are harmless).
                bool left = !t_open.empty();
                for (auto& g : t_groups) left = left || !g.empty();
                if (left) g_unwaited++;
            });
        for (auto& t : ts) t.join();
    }
    if (g_unwaited.exchange(0)) fprintf(stderr, "threads ended with copies never waited for\n");
}
