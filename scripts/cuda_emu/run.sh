#!/usr/bin/env bash
# Runs CUDA kernels on the CPU, without a GPU: the kernels' own source compiled as C++ against
# shim.h (a block = 256 threads with real barriers, warp-collective functions over the PTX
# fragment layouts, cp.async deferred until cp.async.wait_group, shared memory and every input
# the kernels must not read filled with NaN). A check of the kernels' indexing, fragments, masks,
# barriers and waits while no GPU is lent; it says nothing of speed, and real hardware may still
# race where the emulation's scheduling did not.
#   bash scripts/cuda_emu/run.sh [scan|gemm|attn|gather]   (all by default; ≈ 3 + 1 + 0.5 + 0.2 minutes on 2 cores)
# scan: deltanet.cu's tensor-core scan (dn_wy_prep + dn_wy_scan; mma.sync m16n8k8 tf32,
#   cvt.rna.tf32 as its bit rounding) against an f64 token-by-token recurrence (driver.cpp).
#   Each line: heads, dk, tokens, decay scale, tf32 on/off, outputs' and final state's rel. L2;
#   fails above the GPU test's tolerance (3e-3 with tf32, 1e-5 without).
#   Measured 2026-12-05 (session 12): fp32 products ≤ 2.3e-6, tf32 products 3.6e-4 … 8.0e-4.
# gemm: gemm.cu's routed-experts kernels gemm_grouped_wgb32, _wgb64 and _wgb128 (and _wgb128 with
#   its remainders in _wgb32, the plan's `wgmma_tail_tiles`) through
#   wgmma.h (warpgroup MMA with A in registers and B through a 128-byte-swizzled descriptor,
#   retired at wait_group as on the device) against an f64 product of the same bf16 operands
#   (gemm_driver.cpp); fails above 5e-3 (the GPU test's tolerance) or on any unwritten output,
#   or where the kernels' _lean variants (`wgmma_lean_dequant`; groups of ≥ 64) or their _hoist
#   variants (`wgmma_hoisted_addrs`) give any output that is not bit-identical.
# attn: attention.cu's attn_prefill_wg and attn_prefill_wg_pipe (`wgmma_attention_pipelined`)
#   through wgmma.h (also A from a K-major descriptor, Q·Kᵀ, and B MN-major, V) against an f64
#   softmax·V gated by sigmoid (attn_driver.cpp): fails above 1e-2 (the GPU test's tolerance), on
#   any unwritten output, or where the pipelined kernel's outputs are not bit-identical to
#   attn_prefill_wg's. Session 24: 2.9e-3 … 3.1e-3, 0 outputs differing on every case; a planted
#   bug (P rounded and O rescaled before the P·V's wait) fails the 4 cases of two or more tiles.
# gather: linear.cu's linear_gather with grid.y below its items (each block row looping over items
#   gridDim.y apart, as past GRID_Y_MAX = 65,535 items on the device: prefill chunks above 8,191
#   tokens) against an f64 product of the same weights (gather_driver.cpp): fails above 1e-5, on
#   any unwritten output, or where the looped launch's outputs are not the one-pass launch's bits.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$HERE/../.."
W="$(mktemp -d)"
trap 'rm -rf "$W"' EXIT
WHAT="${1:-all}"
# Whether this run emulates the kernels `$1` (scan, gemm, attn or gather).
wants() { [ "$WHAT" = all ] || [ "$WHAT" = "$1" ]; }
# Runs the Python on stdin (a writer of one emulation's C++ source into $W) after what every
# writer uses: `root` (the repository), `w` (the work folder), `between(text, start, end)` (text
# from `start` up to the next `end`) and `launcher_defines(rs, names)` (a `#define` for each of
# `names`, its value from `pub const NAME: usize = N;` in the launcher `rs`, a path under root).
PRELUDE='import re, sys
root, w = sys.argv[1], sys.argv[2]
def between(text, start, end):
    i = text.index(start)
    return text[i:text.index(end, i)]
def launcher_defines(rs, names):
    text = open(f"{root}/{rs}").read()
    const = lambda name: re.search(rf"pub const {name}: usize = (\d+);", text).group(1)
    return "".join(f"#define {n} {const(n)}\n" for n in names)
'
emu_python() { { printf '%s' "$PRELUDE"; cat; } | python3 - "$ROOT" "$W"; }
if wants scan; then
emu_python <<'PY'
common = open(f'{root}/shaders/cuda/common.cuh').read()
dn = open(f'{root}/shaders/cuda/deltanet.cu').read()
frags = common[common.index('// Fragments of m16n8k8 tf32 operands'):common.index('// Two floats rounded to nearest-even bf16')]
wy = dn[dn.index('// ---- dn_wy_prep + dn_wy_scan'):dn.index('extern "C" __global__ void dn_gated_norm(')]
wy = wy.replace('extern __shared__ __align__(16) float dn_wy_smem[];', 'float* dn_wy_smem = g_smem;')
# The launcher's constants.
defs = launcher_defines('crates/lily-cuda/src/kernels/deltanet.rs', ['DN_MAX_DK', 'DN_WY_C', 'DN_WY_COLS', 'DN_WY_PREP_THREADS', 'DN_WY_SCAN_THREADS'])
open(f'{w}/emu.cpp', 'w').write(f'#include "{root}/scripts/cuda_emu/shim.h"\n' + defs + frags + wy + f'\n#include "{root}/scripts/cuda_emu/driver.cpp"\n')
PY
g++ -std=c++20 -O2 -pthread "$W/emu.cpp" -o "$W/emu"
# k heads, v heads, dk (= dv), tokens, decay scale (g uniform in [−scale, 0]), tf32
for args in "2 4 32 1 8.0 1" "2 4 32 63 8.0 1" "2 4 32 64 8.0 1" "2 4 32 65 8.0 1" \
            "2 4 32 200 1.0 0" "2 4 32 200 1.0 1" "2 4 32 1000 0.05 1" "2 4 32 1000 20 1" \
            "16 32 128 130 10.0 0" "16 32 128 200 1.0 1"; do
  "$W/emu" $args || fail=1
done
fi
if wants gemm; then
emu_python <<'PY'
common = open(f'{root}/shaders/cuda/common.cuh').read()
gemm = open(f'{root}/shaders/cuda/gemm.cu').read()
helpers = (between(common, 'struct QWeight {', '};') + '};\n'
           + between(common, '__device__ __forceinline__ float bf16_to_f32', '\n') + '\n'
           + between(common, '__device__ __forceinline__ unsigned long long wg_desc(', '}\n') + '}\n')
# The epilogue (wg_store) and everything from the wgmma tiles on; the asm-only
# wgmma_tok specialisations come from wgmma.h instead.
stores = between(gemm, "// The block's sums out:", '#endif\n\n// y[r, c] = bf16(x[r, c])')
tiles = gemm[gemm.index('#if defined(__CUDA_ARCH_FEAT_SM90_ALL)\ntemplate <int TOK>\nstruct Wgb {'):]
tiles = tiles.replace('asm volatile("" : "+f"(d[i])::"memory");', ';')
defs = launcher_defines('crates/lily-cuda/src/kernels/gemm.rs', ['WGB_STAGES', 'WGB32_STAGES', 'WG_ROWS'])
src = ('#define EMU_ACT_BF16\n'
       f'#include "{root}/scripts/cuda_emu/shim.h"\n#include "{root}/scripts/cuda_emu/wgmma.h"\n'
       '#define __CUDA_ARCH_FEAT_SM90_ALL 1\n#define __shared__ static\n#define wg_raw ((char*)g_smem)\n'
       + defs + helpers + 'template <int TOK> void wgmma_tok(float (&d)[TOK / 2], const u32 (&a)[4], unsigned long long desc);\n'
       + stores + '\n' + tiles + f'\n#include "{root}/scripts/cuda_emu/gemm_driver.cpp"\n')
open(f'{w}/emu_gemm.cpp', 'w').write(src)
PY
g++ -std=c++20 -O2 -pthread "$W/emu_gemm.cpp" -o "$W/emu_gemm"
# rows cols group x_div tile counts…: loads at both tiles' edges (an expert of 600 items: four
# runs of 128 + 88, or nine of 64 + 24), rows off the block's 128, gate/up-like (x_div 2, many
# k-steps) and down-like (x_div 1, groups of 32) shapes, tiles of 32, 64, 128 and 128 + 32 on
# the same loads (remainders of 1, 32 and 33 past a tile of 128: 129, 160, 161); groups of 128
# (two k-steps a group: the _lean variants' group index by a shift); 16 k-steps (the ring of 5 or
# 7 stages wrapping three or two times: the _hoist variants' rotated slots).
LOADS="0 20 64 65 128 129 192 193 256 257 300 600"
TAILS="0 20 32 33 128 129 160 161 281"
for args in "136 256 64 2 128 $LOADS" "136 256 64 2 64 $LOADS" "264 512 32 1 128 7 130 250 1" \
            "136 128 64 2 64 2 62 200" "136 256 64 2 32 $LOADS" "264 512 32 1 32 7 33 1 40" \
            "136 128 64 2 32 2 62 200" \
            "136 256 64 2 128+32 $TAILS" "264 512 32 1 128+32 $TAILS" \
            "136 512 128 2 64 2 62 200" "136 512 128 1 128+32 7 33 161" \
            "136 1024 64 2 64 2 62 200" "136 1024 64 1 128+32 7 33 161"; do
  "$W/emu_gemm" $args || fail=1
done
fi
if wants attn; then
emu_python <<'PY'
common = open(f'{root}/shaders/cuda/common.cuh').read()
attn = open(f'{root}/shaders/cuda/attention.cu').read()
helpers = (between(common, '__device__ __forceinline__ float sigmoidf', '\n') + '\n'
           + between(common, '__device__ __forceinline__ unsigned long long wg_desc(', '#endif'))
pieces = (between(attn, '__device__ __forceinline__ void attn_store2(', '\n}\n') + '\n}\n'
          + between(attn, '__device__ __forceinline__ void quad_sums(', '\n}\n') + '\n}\n')
kernels = attn[attn.index("// ---- attn_prefill_wg: flash attention on Hopper's"):]
# The asm-only wgmma wrappers come from the emulation below; empty asm fences are no-ops here.
asm = between(kernels, '#if defined(__CUDA_ARCH_FEAT_SM90_ALL) && defined(LILY_BF16_ACT)\n// S (64', '#endif\n')
kernels = kernels.replace(asm + '#endif\n', '')
kernels = re.sub(r'asm volatile\(""\s*:\s*"\+f"\(\w+\[i\]\)\s*::\s*"memory"\);', ';', kernels)
assert 'asm' not in kernels, 'attention.cu: an asm statement the emulation does not know'
kernels = kernels.replace('extern __shared__ __align__(16) char wga_raw[];', 'char* wga_raw = (char*)g_smem;')
defs = launcher_defines('crates/lily-cuda/src/kernels/attention.rs', ['WGA_Q', 'WGA_KEYS'])
defs += '#define WGA_SMEM (1024 + 2 * WGA_Q * 256 * 2 + 2 * 2 * WGA_KEYS * 256 * 2)\n'
emu = r"""
typedef u16 kv_t;
#define NEG_INF (-INFINITY)
inline float __shfl_xor_sync(unsigned, float v, int x) {
    auto& w = g_ws[warp_id()]; int l = lane_id();
    w.v[l] = v; __syncwarp();
    float r = w.v[l ^ x]; __syncwarp();
    return r;
}
inline bool __any_sync(unsigned, bool p) {
    auto& w = g_ws[warp_id()]; int l = lane_id();
    w.a[l][0] = p; __syncwarp();
    bool r = false;
    for (int i = 0; i < 32; i++) r = r || w.a[i][0];
    __syncwarp();
    return r;
}
inline void wgmma_qk(float (&d)[32], unsigned long long qd, unsigned long long kd, int acc) {
    t_wg_open.push_back({d, nullptr, kd, 64, qd, acc != 0, false});
}
inline void wgmma_qk_first(float (&d)[32], unsigned long long qd, unsigned long long kd) {
    t_wg_open.push_back({d, nullptr, kd, 64, qd, false, false});
}
inline void wgmma_pv(float (&d)[128], const u32 (&a)[4], unsigned long long vd) {
    t_wg_open.push_back({d, a, vd, 256, 0, true, true});
}
"""
src = ('#define EMU_ACT_BF16\n'
       f'#include "{root}/scripts/cuda_emu/shim.h"\n#include "{root}/scripts/cuda_emu/wgmma.h"\n'
       '#define __CUDA_ARCH_FEAT_SM90_ALL 1\n#define LILY_BF16_ACT 1\n'
       + defs + emu + helpers + pieces + kernels + f'\n#include "{root}/scripts/cuda_emu/attn_driver.cpp"\n')
open(f'{w}/emu_attn.cpp', 'w').write(src)
PY
g++ -std=c++20 -O2 -pthread "$W/emu_attn.cpp" -o "$W/emu_attn"
# n_q n_kv pos T: one tile (the pipelined kernel's loop runs no iteration), two, a chunk of 64
# exactly, chunks not a multiple of 64 at position 0 and past a prefix of whole and part tiles,
# the model's GQA group (8 query heads a kv head) over 10 tiles.
for args in "2 1 0 30" "2 1 0 64" "2 1 10 100" "4 2 0 130" "4 2 300 77" "8 1 500 150"; do
  "$W/emu_attn" $args || fail=1
done
fi
if wants gather; then
emu_python <<'PY'
common = open(f'{root}/shaders/cuda/common.cuh').read()
lin = open(f'{root}/shaders/cuda/linear.cu').read()
helpers = (between(common, '__device__ __forceinline__ float bf16_to_f32', '\n') + '\n'
           + between(common, '__device__ __forceinline__ float warp_sum(', '\n}\n') + '\n}\n'
           + between(common, 'struct QWeight {', '// ---- tensor cores'))
kernel = (between(lin, '__device__ __forceinline__ void load_x(', '\n}\n') + '\n}\n'
          + between(lin, 'extern "C" __global__ void __launch_bounds__(LINEAR_WARPS * 32)\nlinear_gather(', '\n}\n') + '\n}\n')
emu = r"""
typedef unsigned short u16;
inline float __uint_as_float(u32 u) { return as_f(u); }
inline float __shfl_xor_sync(unsigned, float v, int x) {
    auto& w = g_ws[warp_id()]; int l = lane_id();
    w.v[l] = v; __syncwarp();
    float r = w.v[l ^ x]; __syncwarp();
    return r;
}
"""
defs = launcher_defines('crates/lily-cuda/src/kernels/linear.rs', ['LINEAR_WARPS'])
src = (f'#include "{root}/scripts/cuda_emu/shim.h"\n' + defs + emu + helpers + kernel
       + f'\n#include "{root}/scripts/cuda_emu/gather_driver.cpp"\n')
open(f'{w}/emu_gather.cpp', 'w').write(src)
PY
g++ -std=c++20 -O2 -pthread "$W/emu_gather.cpp" -o "$W/emu_gather"
# rows cols bits n_items x_div grid_y: one pass (grid.y = the items), 2, 3 and 5 passes with a
# last partial one, rows off the block's 4, 4-, 8-bit and bf16 weights, x_div 8 (gate/up at
# top-8) and 1 (down).
for args in "12 128 4 24 8 24" "12 128 4 25 8 12" "10 128 4 37 8 8" "9 256 8 41 1 9" \
            "12 128 16 30 2 7" "6 192 4 70 8 16"; do
  "$W/emu_gather" $args || fail=1
done
fi
exit "${fail:-0}"
