// Host emulation of what gemm.cu's wgmma kernels use beyond shim.h (included after it by
// run.sh's GEMM part): bf16 conversions, prmt, the shared-memory window, and Hopper's warpgroup
// MMA `wgmma.mma_async.m64nNk16.f32.bf16.bf16` with A from registers and B from shared memory
// through a descriptor, asynchronous as on the device: an MMA is recorded at its issue and
// computed at the `wgmma.wait_group` that retires it, reading its A registers and its B tile
// then (so a kernel that overwrites either before the wait computes garbage here).
// Layouts, from the PTX ISA (9.7.15 "Asynchronous Warpgroup Level Matrix Multiply-Accumulate":
// the register fragments of A and D for .m64nNk16, and the shared-memory matrix layouts):
//   A (64 × 16 bf16): warp w of the warpgroup holds rows 16w … 16w + 15 as mma.m16n8k16's A:
//     lane (g = lane / 4, t = lane % 4), registers 0..3 = (row g, cols 2t, 2t+1), (g + 8, 2t),
//     (g, 2t + 8), (g + 8, 2t + 8), the lower column in the lower half;
//   D (64 × N f32): d[4j + e] = row 16w + g + 8 (e / 2), column 8j + 2t + e % 2;
//   B (16 × N, K-major, 128-byte swizzle, descriptor layout type 1): element (k, n) at the
//     logical byte start + (n / 8)·SBO + (n % 8)·128 + 2k, stored at that address with bits 4–6
//     XORed by bits 7–9 (CUTLASS's Swizzle<3, 4, 3>, on the shared-memory address itself; the
//     window below is 1024-aligned as the kernels align their ring), start = desc[0:14] << 4,
//     SBO = desc[32:46] << 4.
// What this cannot show: timing, bank conflicts, and races real hardware may run into where
// this emulation's scheduling did not.
#pragma once
#include <cstdlib>
typedef unsigned short u16;
struct uint4 { u32 x, y, z, w; };
inline uint4 make_uint4(u32 a, u32 b, u32 c, u32 d) { return {a, b, c, d}; }
inline float __uint_as_float(u32 u) { return as_f(u); }
inline u32 __float_as_uint(float f) { return as_u(f); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline u32 __byte_perm(u32 x, u32 y, u32 s) {
    unsigned long long v = ((unsigned long long)y << 32) | x;
    u32 r = 0;
    for (int i = 0; i < 4; i++) r |= (u32)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
    return r;
}
inline void __trap() { fprintf(stderr, "__trap\n"); abort(); }
inline u16 emu_bf16(float f) {  // round to nearest even (the kernels' f32_to_bf16, NaN aside)
    u32 x = as_u(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)((x >> 16) | 0x40);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (u16)(x >> 16);
}
inline u32 pack_bf16x2(float lo, float hi) { return (u32)emu_bf16(lo) | ((u32)emu_bf16(hi) << 16); }
inline float emu_f32(u16 h) { return as_f((u32)h << 16); }
// The block's shared memory is g_smem (shim.h's launch); shared addresses are offsets into it.
inline u32 smem_addr(const void* p) { return (u32)((const char*)p - (const char*)g_smem); }
inline void cp_async16_s(u32 dst, const void* src) { cp_async16((char*)g_smem + dst, src); }
inline void fence_proxy_async() {}
inline void wgmma_fence() {}

// An MMA as issued: `a` the A registers, or (attention.cu's Q·Kᵀ) `a_desc` A's K-major
// descriptor; `acc` false: D = A·B (scale-d 0, the first k-step); `mn_b`: B MN-major through
// the transpose bit (attention.cu's V).
struct WgOp {
    float* d; const u32* a; unsigned long long desc; int tok;
    unsigned long long a_desc = 0; bool acc = true; bool mn_b = false;
};
thread_local std::vector<WgOp> t_wg_open;
thread_local std::deque<std::vector<WgOp>> t_wg_groups;
std::deque<std::vector<WgOp>>* g_wg_pub[2][128];
std::atomic<int> g_wg_errors{0};

template <int TOK>
inline void wgmma_tok(float (&d)[TOK / 2], const u32 (&a)[4], unsigned long long desc) {
    t_wg_open.push_back({d, a, desc, TOK});
}
inline void wgmma_commit() { t_wg_groups.push_back(t_wg_open); t_wg_open.clear(); }

// One MMA of the warpgroup: op j of the group at the front of every thread's queue.
inline void wg_compute(int wg, size_t j) {
    const WgOp& o0 = g_wg_pub[wg][0]->front()[j];
    int tok = o0.tok;
    unsigned long long desc = o0.desc;
    for (int l = 0; l < 128; l++) {
        const auto& grp = g_wg_pub[wg][l]->front();
        if (grp.size() <= j || grp[j].desc != desc || grp[j].tok != tok || grp[j].a_desc != o0.a_desc ||
            grp[j].acc != o0.acc || grp[j].mn_b != o0.mn_b) { g_wg_errors++; return; }
    }
    if ((desc >> 62) != 1) { g_wg_errors++; return; }
    u32 start = (u32)(desc & 0x3fff) << 4, sbo = (u32)((desc >> 32) & 0x3fff) << 4;
    float A[64][16];
    if (o0.a_desc) {  // K-major A in shared memory: element (m, k) as B's (n, k) below
        u32 a_start = (u32)(o0.a_desc & 0x3fff) << 4, a_sbo = (u32)((o0.a_desc >> 32) & 0x3fff) << 4;
        if ((o0.a_desc >> 62) != 1) { g_wg_errors++; return; }
        for (int m = 0; m < 64; m++)
            for (int k = 0; k < 16; k++) {
                u32 logical = a_start + (m / 8) * a_sbo + (m % 8) * 128 + 2 * k;
                u32 phys = logical ^ (((logical >> 7) & 7) << 4);
                u16 h;
                memcpy(&h, (const char*)g_smem + phys, 2);
                A[m][k] = emu_f32(h);
            }
    } else
    for (int l = 0; l < 128; l++) {
        const u32* a = g_wg_pub[wg][l]->front()[j].a;
        int w = l >> 5, g = (l & 31) >> 2, t = l & 3, r = 16 * w + g;
        int rr[4] = {r, r + 8, r, r + 8}, cc[4] = {2 * t, 2 * t, 2 * t + 8, 2 * t + 8};
        for (int i = 0; i < 4; i++) {
            A[rr[i]][cc[i]] = emu_f32((u16)(a[i] & 0xffff));
            A[rr[i]][cc[i] + 1] = emu_f32((u16)(a[i] >> 16));
        }
    }
    const char* sm = (const char*)g_smem;
    std::vector<float> B((size_t)16 * tok);
    for (int n = 0; n < tok; n++)
        for (int k = 0; k < 16; k++) {
            // K-major: rows of 8 n a 1024-byte atom; MN-major (mn_b): a 128-byte row per k, 8 k
            // an atom (SBO), the next 64 n the leading byte offset on.
            u32 lbo = (u32)((desc >> 16) & 0x3fff) << 4;
            u32 logical = o0.mn_b ? start + (n / 64) * lbo + (k / 8) * sbo + (k % 8) * 128 + 2 * (n % 64)
                                  : start + (n / 8) * sbo + (n % 8) * 128 + 2 * k;
            u32 phys = logical ^ (((logical >> 7) & 7) << 4);
            u16 h;
            memcpy(&h, sm + phys, 2);
            B[(size_t)k * tok + n] = emu_f32(h);
        }
    for (int l = 0; l < 128; l++) {
        float* d = g_wg_pub[wg][l]->front()[j].d;
        int w = l >> 5, g = (l & 31) >> 2, t = l & 3;
        for (int jj = 0; jj < tok / 8; jj++)
            for (int e = 0; e < 4; e++) {
                int m = 16 * w + g + 8 * (e >> 1), n = 8 * jj + 2 * t + (e & 1);
                float s = o0.acc ? d[4 * jj + e] : 0.0f;
                for (int k = 0; k < 16; k++) s += A[m][k] * B[(size_t)k * tok + n];
                d[4 * jj + e] = s;
            }
    }
}

// wgmma.wait_group N: every group of the warpgroup but the newest N computed, in issue order.
template <int N>
inline void wgmma_wait() {
    int wg = threadIdx.x >> 7, l = threadIdx.x & 127;
    g_wg_pub[wg][l] = &t_wg_groups;
    g_wg_bar[wg]->arrive_and_wait();
    if (l == 0) {
        for (int l2 = 0; l2 < 128; l2++)
            if (g_wg_pub[wg][l2]->size() != t_wg_groups.size()) g_wg_errors++;
        while ((int)g_wg_pub[wg][0]->size() > N) {
            size_t ops = g_wg_pub[wg][0]->front().size();
            for (size_t j = 0; j < ops; j++) wg_compute(wg, j);
            for (int l2 = 0; l2 < 128; l2++) g_wg_pub[wg][l2]->pop_front();
        }
    }
    g_wg_bar[wg]->arrive_and_wait();
}
inline void wgmma_wait0() { wgmma_wait<0>(); }
inline void wgmma_wait1() { wgmma_wait<1>(); }
