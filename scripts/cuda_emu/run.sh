#!/usr/bin/env bash
# Runs deltanet.cu's tensor-core scan (dn_wy_prep + dn_wy_scan) on the CPU, without a GPU: the
# kernels' own source compiled as C++ against shim.h (a block = 256 threads with real barriers,
# mma.sync m16n8k8 tf32 and shuffles as warp-collective functions over the PTX fragment layouts,
# cvt.rna.tf32 as its bit rounding, cp.async deferred until cp.async.wait_group, shared memory and
# every input the kernels must not read filled with NaN), against an f64 token-by-token
# recurrence (driver.cpp). A check of the kernels' indexing, fragments, masks, barriers and
# waits while no GPU is lent; it says nothing of speed, and real hardware may still race where
# the emulation's scheduling did not.
#   bash scripts/cuda_emu/run.sh            (≈ 3 minutes on 2 cores; the full-shape case dominates)
# Each line: heads, dk, tokens, decay scale, tf32 on/off, outputs' and final state's rel. L2;
# the script fails if one is above the GPU test's tolerance (3e-3 with tf32, 1e-5 without).
# Measured 2026-12-05 (session 12): fp32 products ≤ 2.3e-6, tf32 products 3.6e-4 … 8.0e-4.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$HERE/../.."
W="$(mktemp -d)"
trap 'rm -rf "$W"' EXIT
python3 - "$ROOT" "$W" <<'PY'
import sys
root, w = sys.argv[1], sys.argv[2]
common = open(f'{root}/shaders/cuda/common.cuh').read()
dn = open(f'{root}/shaders/cuda/deltanet.cu').read()
frags = common[common.index('// Fragments of m16n8k8 tf32 operands'):common.index('// Two floats rounded to nearest-even bf16')]
wy = dn[dn.index('// ---- dn_wy_prep + dn_wy_scan'):dn.index('extern "C" __global__ void dn_gated_norm(')]
wy = wy.replace('extern __shared__ __align__(16) float dn_wy_smem[];', 'float* dn_wy_smem = g_smem;')
# The launcher's constants (crates/lily-cuda/src/kernels/deltanet.rs).
rs = open(f'{root}/crates/lily-cuda/src/kernels/deltanet.rs').read()
import re
def const(name):
    return re.search(rf'pub const {name}: usize = (\d+);', rs).group(1)
defs = ''.join(f'#define {n} {const(n)}\n' for n in ['DN_MAX_DK', 'DN_WY_C', 'DN_WY_COLS', 'DN_WY_PREP_THREADS', 'DN_WY_SCAN_THREADS'])
open(f'{w}/emu.cpp', 'w').write(f'#include "{root}/scripts/cuda_emu/shim.h"\n' + defs + frags + wy + f'\n#include "{root}/scripts/cuda_emu/driver.cpp"\n')
PY
g++ -std=c++20 -O2 -pthread "$W/emu.cpp" -o "$W/emu"
# k heads, v heads, dk (= dv), tokens, decay scale (g uniform in [−scale, 0]), tf32
for args in "2 4 32 1 8.0 1" "2 4 32 63 8.0 1" "2 4 32 64 8.0 1" "2 4 32 65 8.0 1" \
            "2 4 32 200 1.0 0" "2 4 32 200 1.0 1" "2 4 32 1000 0.05 1" "2 4 32 1000 20 1" \
            "16 32 128 130 10.0 0" "16 32 128 200 1.0 1"; do
  "$W/emu" $args || fail=1
done
exit "${fail:-0}"
