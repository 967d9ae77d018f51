// Host emulation of what decode.cu's kernels use beyond shim.h (scripts/cuda_emu/run_batch.sh):
// shim.h's types and bit helpers, a block's threads run as fibers (below) instead of shim.h's
// std::threads, the intrinsics decode.cu uses, and per-block static __shared__ arrays. Each
// replacement says what it assumes; checked against the PTX ISA (prmt, shfl.sync, redux.sync,
// griddepcontrol, ld.global.nc). cp.async: each fiber keeps its own queues (shim.h's, swapped in
// while it runs).
//
// shim.h defines act() for deltanet.cu's tf32 section; decode.cu takes common.cuh's own act()
// (fp32, or bf16 with LILY_BF16_ACT), so shim.h's is renamed out of the way here.
#define SHIM_FIBERS
#define SHIM_MAX_WARPS_D 32  // warps a block may have here (dec_down_combine has 12)
#define act shim_act_unused
#include "shim.h"
#undef act
#include <csetjmp>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <tuple>
#include <ucontext.h>

// ---- a block's threads as fibers ----------------------------------------------------------------
// Why: with one OS thread per CUDA thread every warp shuffle is 32 futex sleeps and wakes (about
// 150 µs on this 2-core machine), minutes for one GEMV. Here a block's threads are fibers of one
// OS thread (two OS threads take alternate blocks): each runs until it reaches a barrier, then the
// next one runs, in an order shuffled every round, so a thread reading what another has not
// written yet (a missing barrier) reads it before the writer ran, some of the time (NaN-filled
// shared memory shows it). A barrier (__syncthreads, __syncwarp and the warp collectives built on
// it) releases when every thread of the block / warp has arrived; a round in which no fiber
// arrives anywhere, is released or ends is a deadlock (a thread skipping a barrier or collective
// the others wait in): reported, and the program ends.
struct Fiber {
    jmp_buf jb;
    ucontext_t uc;
    std::unique_ptr<char[]> stack;  // not zero-filled: only the pages a fiber touches are resident
    bool started = false, done = false;
    std::deque<std::vector<Copy>> groups;  // its cp.async groups (shim.h's t_groups while it runs)
    std::vector<Copy> open;
};
thread_local std::vector<Fiber> t_fibers;
thread_local jmp_buf t_sched;
thread_local Fiber* t_cur;
thread_local const std::function<void()>* t_kernel;
thread_local unsigned long t_progress;
thread_local int t_block_arrived, t_warp_arrived[SHIM_MAX_WARPS_D];
thread_local unsigned t_block_gen, t_warp_gen[SHIM_MAX_WARPS_D];
// The running fiber's warp: the index of its warp's collective slots.
inline int wslot() { return threadIdx.x >> 5; }
thread_local float* t_smem;  // the block's dynamic shared memory (decode.cu's dec_smem)
thread_local std::mt19937 t_order_rng(7);

inline void fiber_yield() {
    if (!_setjmp(t_cur->jb)) _longjmp(t_sched, 1);
}
static void fiber_main() {
    (*t_kernel)();
    t_cur->done = true;
    t_progress++;
    _longjmp(t_sched, 1);
}
inline void fiber_barrier(int& arrived, unsigned& gen, int n) {
    unsigned g = gen;
    t_progress++;
    if (++arrived == n) {
        arrived = 0;
        gen++;
        return;
    }
    while (gen == g) fiber_yield();
}
inline void __syncthreads() { fiber_barrier(t_block_arrived, t_block_gen, blockDim.x); }
inline void __syncwarp() { fiber_barrier(t_warp_arrived[wslot()], t_warp_gen[wslot()], 32); }

// One block's threads as fibers of one scheduler (blockIdx and t_smem as the caller set them),
// resumed in a shuffled order until all have ended.
static void run_block(int threads) {
    int n = threads;
    if ((int)t_fibers.size() < n) t_fibers.resize(n);
    t_block_arrived = 0;
    for (int w = 0; w < SHIM_MAX_WARPS_D; w++) t_warp_arrived[w] = 0;
    for (int i = 0; i < n; i++) {
        t_fibers[i].started = t_fibers[i].done = false;
        t_fibers[i].groups.clear();
        t_fibers[i].open.clear();
    }
    std::vector<int> order(n);
    for (int i = 0; i < n; i++) order[i] = i;
    volatile int live = n;
    while (live > 0) {
        unsigned long before = t_progress;
        std::shuffle(order.begin(), order.end(), t_order_rng);
        for (int j = 0; j < n; j++) {
            Fiber& f = t_fibers[order[j]];
            if (f.done) continue;
            t_cur = &f;
            threadIdx = {order[j], 0, 0};
            std::swap(t_groups, f.groups);
            std::swap(t_open, f.open);
            if (!_setjmp(t_sched)) {
                if (!f.started) {
                    f.started = true;
                    if (!f.stack) f.stack.reset(new char[256 * 1024]);
                    getcontext(&f.uc);
                    f.uc.uc_stack.ss_sp = f.stack.get();
                    f.uc.uc_stack.ss_size = 256 * 1024;
                    f.uc.uc_link = nullptr;
                    makecontext(&f.uc, fiber_main, 0);
                    ucontext_t from;
                    swapcontext(&from, &f.uc);  // never resumed: the fiber comes back by _longjmp
                } else {
                    _longjmp(f.jb, 1);
                }
            }
            std::swap(t_groups, f.groups);
            std::swap(t_open, f.open);
            if (f.done) {
                live = live - 1;
                // Groups left committed but never waited for are harmless when empty (a pipeline's
                // tail); copies still queued would land after the thread's block has ended.
                size_t queued = f.open.size();
                for (auto& grp : f.groups) queued += grp.size();
                if (queued) {
                    fprintf(stderr, "block (%d, %d, %d) thread %d ended with %zu cp.async copies never waited for\n",
                            blockIdx.x, blockIdx.y, blockIdx.z, (int)threadIdx.x, queued);
                    g_unwaited++;
                }
            }
        }
        if (live > 0 && t_progress == before) {
            fprintf(stderr, "deadlock: %d threads of block (%d, %d, %d) wait at a barrier no other thread reaches\n",
                    (int)live, blockIdx.x, blockIdx.y, blockIdx.z);
            exit(3);
        }
    }
}

struct uint4 { u32 x, y, z, w; };
struct uint2 { u32 x, y; };
typedef unsigned short u16;

// Bit casts (the CUDA intrinsics of the same names).
inline float __uint_as_float(u32 u) { return as_f(u); }
inline u32 __float_as_uint(float f) { return as_u(f); }
inline float __int_as_float(u32 u) { return as_f(u); }

// Math. expf / log1pf / fmaf / fmaxf / sqrtf: the C++ library's, correctly rounded or within an
// ulp (CUDA's full-precision expf is within 2 ulp, so a value can differ from the GPU's in its
// last bit; both kernels of a bit-for-bit comparison here call the same function). fmaf is a true
// fused multiply-add on both (PTX fma.rn.f32). rsqrtf: CUDA's is rsqrt.approx.f32 (max 2 ulp
// relative error); here 1/sqrt rounded twice, so values that go through it match the GPU to a
// few ulp only, never bit for bit. g++ is run with -ffp-contract=off: no a·b + c written in the
// source becomes an FMA here, while NVRTC (--fmad=true by default) may fuse them on the GPU.
// (::expf, ::log1pf, ::fmaf, ::fmaxf, ::sqrtf of <cmath>.)
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

// Mixed-width min/max as CUDA's overloads resolve them.
inline long long min(long long a, int b) { return a < b ? a : b; }
inline long long min(int a, long long b) { return a < b ? a : b; }

// __byte_perm(x, y, s) = prmt.b32 d, x, y, s (generic mode): source bytes {y, x} numbered 0..7
// (x's bytes 0..3), result byte n = source byte (s >> 4n) & 7, or that byte's sign bit replicated
// when bit 3 of the nibble is set (PTX ISA, prmt). decode.cu's selectors (0x7440 | k,
// 0x7044 | k << 8) never set it.
inline u32 __byte_perm(u32 x, u32 y, u32 s) {
    unsigned long long v = ((unsigned long long)y << 32) | x;
    u32 r = 0;
    for (int n = 0; n < 4; n++) {
        u32 c = (s >> (4 * n)) & 0xfu;
        u32 b = (u32)(v >> (8 * (c & 7))) & 0xffu;
        if (c & 8) b = (b & 0x80u) ? 0xffu : 0u;
        r |= b << (8 * n);
    }
    return r;
}

// dp4a.u32.s32 (decode.cu's dp4a_us; run_batch.sh swaps its asm for this): c + Σ_k a.byte_k
// (unsigned) · b.byte_k (signed), in 32-bit two's complement as the PTX ISA defines it.
inline int emu_dp4a_us(u32 a, u32 b, int c) {
    for (int k = 0; k < 4; k++) c += (int)((a >> (8 * k)) & 0xffu) * (int)(int8_t)((b >> (8 * k)) & 0xffu);
    return c;
}
// Bit counts, and shared-memory atomicOr: a block's threads are fibers of one OS thread, switched
// only at barriers and warp collectives, so a read-modify-write is atomic.
inline int __popc(u32 v) { return __builtin_popcount(v); }
inline int __ffs(u32 v) { return v ? __builtin_ctz(v) + 1 : 0; }
inline u32 atomicOr(u32* p, u32 v) {
    u32 old = *p;
    *p = old | v;
    return old;
}
// cvt.rni.s32.f32: to nearest, ties to even (the default rounding mode here).
inline int __float2int_rn(float f) { return (int)std::nearbyint(f); }

// Loads. __ldg (ld.global.nc) and decode.cu's ld_stream / ld_stream2
// (ld.global.nc.L1::no_allocate.v4 / .v2.u32; run_batch.sh swaps their asm for this) read memory no kernel writes during the launch (weights):
// a plain load. The L2 prefetch of stage_prefetch is a hint: dropped.
inline uint4 __ldg(const uint4* p) { return *p; }
inline uint2 __ldg(const uint2* p) { return *p; }
// ld.global.cg (dec_dn_step's reads of c, b and a): a plain load; this emulation has no caches.
template <class T>
inline T __ldcg(const T* p) { return *p; }

// Warp collectives (shfl.sync.bfly, redux.sync .max/.min .u32): every lane of the warp writes its
// value to a slot, meets the others at the warp barrier, reads its partner's (or the reduction),
// meets them again so the slots can be reused. The PTX requires every lane named in the mask
// (always 0xffffffff here) to execute the same instruction; a lane that skips one leaves the
// others waiting at the barrier: the emulation then hangs (run_batch.sh's alarm ends it) where
// the GPU's result would be undefined.
thread_local u32 g_lane_slot[SHIM_MAX_WARPS_D][32];
inline u32 shfl_xor_bits(u32 v, int mask) {
    u32* s = g_lane_slot[wslot()];
    int l = lane_id();
    s[l] = v;
    __syncwarp();
    u32 r = s[(l ^ mask) & 31];
    __syncwarp();
    return r;
}
inline float __shfl_xor_sync(unsigned, float v, int mask) { return as_f(shfl_xor_bits(as_u(v), mask)); }
inline int __shfl_xor_sync(unsigned, int v, int mask) { return (int)shfl_xor_bits((u32)v, mask); }
template <class Op>
inline u32 redux_u32(u32 v, Op op) {
    u32* s = g_lane_slot[wslot()];
    s[lane_id()] = v;
    __syncwarp();
    u32 r = s[0];
    for (int i = 1; i < 32; i++) r = op(r, s[i]);
    __syncwarp();
    return r;
}
inline u32 __reduce_max_sync(unsigned, u32 v) { return redux_u32(v, [](u32 a, u32 b) { return a > b ? a : b; }); }
inline u32 __reduce_min_sync(unsigned, u32 v) { return redux_u32(v, [](u32 a, u32 b) { return a < b ? a : b; }); }

// Static __shared__ arrays: run_batch.sh rewrites `__shared__ T name[N];` into
// `T* name = shared_arr<T>("name", N);` (and `T name[M][N]` into a pointer to rows of N): one
// array per (launch, block, name), its bytes 0xff (a float or bf16 NaN, an int −1) when the
// block's first thread reaches the declaration, so a read of an element no thread of the block
// wrote shows up. (On the GPU static shared memory holds whatever the SM's last block left there.)
int g_launch_id = 0;
std::mutex g_shared_mu;
std::map<std::tuple<int, int, int, int, std::string>, std::vector<unsigned long long>> g_shared;
template <class T>
inline T* shared_arr(const char* name, size_t n) {
    std::lock_guard<std::mutex> g(g_shared_mu);
    auto& v = g_shared[{g_launch_id, blockIdx.x, blockIdx.y, blockIdx.z, name}];
    size_t words = (n * sizeof(T) + 7) / 8;
    if (v.empty()) v.assign(words, ~0ull);
    if (v.size() != words) { fprintf(stderr, "shared array %s declared with two sizes\n", name); abort(); }
    return reinterpret_cast<T*>(v.data());
}

// ---- attention.cu's tensor-core helpers (common.cuh's inline PTX) ------------------------------
inline float __shfl_sync(unsigned, float v, int src) {
    u32* s = g_lane_slot[wslot()];
    int l = lane_id();
    s[l] = as_u(v);
    __syncwarp();
    u32 r = s[src & 31];
    __syncwarp();
    return as_f(r);
}
inline uint4 make_uint4(u32 a, u32 b, u32 c, u32 d) { return {a, b, c, d}; }
inline uint2 make_uint2(u32 a, u32 b) { return {a, b}; }
[[noreturn]] inline void __trap() { fprintf(stderr, "__trap()\n"); abort(); }
// pack_bf16x2 (cvt.rn.bf16x2.f32 d, hi, lo): both rounded to nearest even, lo in the low half;
// NaN stays NaN (as common.cuh's f32_to_bf16 does it).
inline u16 bf16_rn(float f) {
    u32 x = as_u(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)((x >> 16) | 0x40);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (u16)(x >> 16);
}
inline u32 pack_bf16x2(float lo, float hi) { return (u32)bf16_rn(lo) | ((u32)bf16_rn(hi) << 16); }
inline float bf16_f(u16 h) { return as_f((u32)h << 16); }
// smem_addr (cvta.to.shared): here the byte offset into the block's dynamic shared memory, the only
// shared memory attention.cu's ldmatrix calls read; a pointer outside it is reported.
thread_local size_t t_smem_bytes;
inline u32 smem_addr(const void* p) {
    long long off = (const char*)p - (const char*)t_smem;
    if (off < 0 || off >= (long long)t_smem_bytes) { fprintf(stderr, "smem_addr: not dynamic shared memory\n"); abort(); }
    return (u32)off;
}
// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16 (PTX ISA, ldmatrix): lanes 8i .. 8i+7 give the
// addresses of rows 0..7 of matrix i (each row 16 bytes, 16-byte aligned: checked); lane L receives
// in r[i] row L/4, elements 2(L%4), 2(L%4)+1 of matrix i (the lower element in the low half), or
// with .trans the elements (2(L%4), L/4) and (2(L%4)+1, L/4): row L/4 of the transpose.
inline void ldsm(u32 addr, u32 (&r)[4], bool trans) {
    u32* s = g_lane_slot[wslot()];
    int l = lane_id();
    if (addr % 16 || addr + 16 > t_smem_bytes) { fprintf(stderr, "ldmatrix: row address %u misaligned or outside shared memory\n", addr); abort(); }
    s[l] = addr;
    __syncwarp();
    const char* base = (const char*)t_smem;
    int g = l >> 2, t = l & 3;
    for (int i = 0; i < 4; i++) {
        if (!trans) {
            memcpy(&r[i], base + s[8 * i + g] + 4 * t, 4);
        } else {
            u16 lo, hi;
            memcpy(&lo, base + s[8 * i + 2 * t] + 2 * g, 2);
            memcpy(&hi, base + s[8 * i + 2 * t + 1] + 2 * g, 2);
            r[i] = (u32)lo | ((u32)hi << 16);
        }
    }
    __syncwarp();
}
inline void ldsm_x4(u32 addr, u32 (&r)[4]) { ldsm(addr, r, false); }
inline void ldsm_x4_trans(u32 addr, u32 (&r)[4]) { ldsm(addr, r, true); }
// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (PTX ISA, "Matrix Fragments for
// mma.m16n8k16 with floating point type"), lane L, g = L/4, t = L%4: a[0] = A(g, 2t..2t+1),
// a[1] = A(g+8, 2t..), a[2] = A(g, 2t+8..), a[3] = A(g+8, 2t+8..); b0 = B(k 2t..2t+1, n g),
// b1 = B(k 2t+8.., n g); c = C(g, 2t), C(g, 2t+1), C(g+8, 2t), C(g+8, 2t+1). The PTX leaves the
// order and internal precision of the sum unspecified: here the exact products (bf16 × bf16 fits
// a float) summed in double with C, rounded once to float.
thread_local u32 t_mma_a[SHIM_MAX_WARPS_D][32][4], t_mma_b[SHIM_MAX_WARPS_D][32][2];
thread_local float t_mma_c[SHIM_MAX_WARPS_D][32][4];
inline void mma_bf16(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    int w = wslot(), l = lane_id();
    for (int i = 0; i < 4; i++) { t_mma_a[w][l][i] = a[i]; t_mma_c[w][l][i] = c[i]; }
    t_mma_b[w][l][0] = b0;
    t_mma_b[w][l][1] = b1;
    __syncwarp();
    if (l == 0) {
        float A[16][16], B[16][8];
        double C[16][8];
        for (int L = 0; L < 32; L++) {
            int g = L >> 2, t = L & 3;
            const u32* ra = t_mma_a[w][L];
            for (int e = 0; e < 2; e++) {
                A[g][2 * t + e] = bf16_f((u16)(ra[0] >> (16 * e)));
                A[g + 8][2 * t + e] = bf16_f((u16)(ra[1] >> (16 * e)));
                A[g][2 * t + 8 + e] = bf16_f((u16)(ra[2] >> (16 * e)));
                A[g + 8][2 * t + 8 + e] = bf16_f((u16)(ra[3] >> (16 * e)));
                B[2 * t + e][g] = bf16_f((u16)(t_mma_b[w][L][0] >> (16 * e)));
                B[2 * t + 8 + e][g] = bf16_f((u16)(t_mma_b[w][L][1] >> (16 * e)));
            }
            C[g][2 * t] = t_mma_c[w][L][0]; C[g][2 * t + 1] = t_mma_c[w][L][1];
            C[g + 8][2 * t] = t_mma_c[w][L][2]; C[g + 8][2 * t + 1] = t_mma_c[w][L][3];
        }
        for (int m = 0; m < 16; m++)
            for (int n = 0; n < 8; n++)
                for (int k = 0; k < 16; k++) C[m][n] += (double)A[m][k] * B[k][n];
        for (int L = 0; L < 32; L++) {
            int g = L >> 2, t = L & 3;
            t_mma_c[w][L][0] = (float)C[g][2 * t]; t_mma_c[w][L][1] = (float)C[g][2 * t + 1];
            t_mma_c[w][L][2] = (float)C[g + 8][2 * t]; t_mma_c[w][L][3] = (float)C[g + 8][2 * t + 1];
        }
    }
    __syncwarp();
    for (int i = 0; i < 4; i++) c[i] = t_mma_c[w][l][i];
    __syncwarp();
}

// A kernel launch: the grid's blocks shared by two OS threads, each block's dynamic shared memory
// (smem_floats) filled with NaN first; this launch's static shared arrays freed afterwards.
inline void launch_k(dim3e grid, int threads, size_t smem_floats, std::function<void()> kernel) {
    if (threads % 32 || threads / 32 > SHIM_MAX_WARPS_D) { fprintf(stderr, "launch: %d threads\n", threads); abort(); }
    g_launch_id++;
    if (grid.z < 1) grid.z = 1;
    blockDim = {threads, 1, 1};
    gridDim = grid;
    long blocks = (long)grid.x * grid.y * grid.z;
    std::atomic<long> next{0};
    auto worker = [&] {
        std::vector<float> smem(smem_floats);
        t_kernel = &kernel;
        for (long b; (b = next++) < blocks;) {
            blockIdx = {(int)(b % grid.x), (int)(b / grid.x % grid.y), (int)(b / ((long)grid.x * grid.y)), };
            std::fill(smem.begin(), smem.end(), NAN);
            t_smem = smem.data();
            t_smem_bytes = smem_floats * 4;
            run_block(threads);
        }
    };
    std::thread other(worker);
    worker();
    other.join();
    g_shared.clear();
    if (g_unwaited.exchange(0)) { fprintf(stderr, "cp.async copies never waited for\n"); exit(3); }
}
// ---- common.cuh's bulk copies and mbarriers (dec_glu4_x8x2_bulk, moe_bulk) ----------------------
// cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes, mbarrier.init (count 1),
// mbarrier.arrive.expect_tx and mbarrier.try_wait.parity 0, as the kernel uses them: one phase a
// barrier, completed once its one arrival has come and the bytes of the copies on it equal the
// bytes it expects (PTX ISA, mbarrier: tx-count). The copies land as late as they may: all of a
// barrier's at once, when a thread first waits on it and it can complete (a read of a slot that
// skips its wait finds the NaN launch_k filled it with). Checked: a barrier used before its init
// or arrived on twice; a copy not in 16-byte units at both ends (the ISA's requirement), outside
// the block's dynamic shared memory, on a completed barrier, or past the bytes expected. A wait
// that never completes (too few bytes) is run_block's deadlock. Barriers are keyed by launch,
// block and address (static shared arrays are per block here).
struct EmuBulkBar {
    int arrivals = 1;
    long long expected = 0, copied = 0;
    bool done = false;
    std::vector<std::tuple<char*, const char*, u32>> copies;
};
thread_local std::map<std::tuple<int, int, int, const void*>, EmuBulkBar> t_bulk_bars;
[[noreturn]] inline void bulk_fail(const char* what) {
    fprintf(stderr, "FAIL: block (%d, %d, %d) thread %d: %s\n", blockIdx.x, blockIdx.y, blockIdx.z, (int)threadIdx.x, what);
    fflush(stderr);
    std::_Exit(3);  // at once: the other OS thread's block is mid-run
}
inline EmuBulkBar& bulk_bar(unsigned long long* bar) {
    auto it = t_bulk_bars.find({g_launch_id, blockIdx.x, blockIdx.y, bar});
    if (it == t_bulk_bars.end()) bulk_fail("an mbarrier used before its init");
    return it->second;
}
inline void bulk_bar_init(unsigned long long* bar) { t_bulk_bars[{g_launch_id, blockIdx.x, blockIdx.y, bar}] = EmuBulkBar{}; }
inline void bulk_bar_fence() {}
inline void bulk_expect(unsigned long long* bar, u32 bytes) {
    auto& b = bulk_bar(bar);
    if (b.arrivals == 0) bulk_fail("a second arrival on a one-arrival mbarrier");
    b.arrivals--;
    b.expected += bytes;
    if (b.copied > b.expected) bulk_fail("more bytes copied than the mbarrier expects");
}
inline void bulk_copy(void* dst, const void* src, u32 bytes, unsigned long long* bar) {
    auto& b = bulk_bar(bar);
    char* d = (char*)dst;
    const char* base = (const char*)t_smem;
    if ((uintptr_t)d % 16 || (uintptr_t)src % 16 || bytes % 16 || bytes == 0) bulk_fail("a bulk copy not in 16-byte units");
    if (d < base || d + bytes > base + t_smem_bytes) bulk_fail("a bulk copy outside the dynamic shared memory");
    if (b.done) bulk_fail("a bulk copy on a completed mbarrier");
    b.copied += bytes;
    if (b.arrivals == 0 && b.copied > b.expected) bulk_fail("more bytes copied than the mbarrier expects");
    b.copies.emplace_back(d, (const char*)src, bytes);
}
inline void bulk_wait(unsigned long long* bar) {
    for (;;) {
        auto& b = bulk_bar(bar);
        if (!b.done && b.arrivals == 0 && b.copied == b.expected) {
            for (auto& [d, s, n] : b.copies) memcpy(d, s, n);
            b.copies.clear();
            b.done = true;
            t_progress++;
        }
        if (b.done) return;
        fiber_yield();
    }
}
