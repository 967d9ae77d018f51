#!/usr/bin/env bash
# Runs decode.cu's batched decode kernels (issue 32: dec_gemv_rows, dec_glu4_rows +
# dec_down_combine_rows, dec_dn_conv_rows + dec_dn_step_rows) on the CPU, without a GPU: the
# kernels' own source (shaders/cuda/decode.cu, with common.cuh's helpers) compiled as C++ against
# shim_decode.h (shim.h's block of std::threads with real barriers and NaN-filled shared memory,
# warp shuffles and redux as warp collectives, byte permutes as PTX prmt), checked against f64
# references (driver_batch.cpp) and, where the GPU tests claim bit equality, against the
# one-sequence kernels emulated the same way. A check of indexing, per-row pointers, strides,
# barriers and store modes while no GPU is lent; it says nothing of speed, and the GPU may still
# race where this scheduling did not (see driver_batch.cpp's header for what it cannot show).
#   bash scripts/cuda_emu/run_batch.sh           (all three parts, fp32 activations)
#   bash scripts/cuda_emu/run_batch.sh gemv|moe|dn [bf16]
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$HERE/../.."
W="$(mktemp -d)"
trap 'rm -rf "$W"' EXIT
python3 - "$ROOT" "$W" <<'PY'
import re, sys
root, w = sys.argv[1], sys.argv[2]
common = open(f'{root}/shaders/cuda/common.cuh').read()
dec = open(f'{root}/shaders/cuda/decode.cu').read()
# common.cuh without its inline-PTX tensor-core / cp.async / Hopper helpers (decode.cu uses none).
common = common[:common.index('// ---- tensor cores and asynchronous copies')] + \
    common[common.index('// ---- pieces two kernel files share'):]
def swap(src, old, new, count=1):
    if src.count(old) != count:
        sys.exit(f'run_batch.sh: expected {count} of {old!r} in decode.cu; the kernel source changed')
    return src.replace(old, new)
# The two inline-PTX pieces of decode.cu (shim_decode.h says what replaces them).
dec = swap(dec, '''    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;''', '    return __ldg(p);')
dec = swap(dec, 'asm volatile("prefetch.global.L2 [%0];" ::"l"(norm_w + c));', '(void)c;')
dec = swap(dec, 'extern __shared__ __align__(16) float dec_smem[];', 'float* dec_smem = t_smem;', 2)
# Static shared arrays: one per block (shim_decode.h's shared_arr).
def shared(m):
    ty, decls = m.group(1), m.group(2)
    out = []
    for d in decls.split(','):
        name, size = re.fullmatch(r'\s*(\w+)\[([^\]]+)\]\s*', d).groups()
        out.append(f'{ty}* {name} = shared_arr<{ty}>("{name}", {size});')
    return ' '.join(out)
pat = re.compile(r'__shared__\s+(?:__align__\(16\)\s+)?(float|int)\s+([^;]+);')
common, dec = pat.sub(shared, common), pat.sub(shared, dec)
for src in (common, dec):
    # (griddepcontrol sits under __CUDA_ARCH__ >= 900, which is 0 here: pdl_wait and pdl_trigger
    # compile to nothing, kernels running one after another.)
    code = re.sub(r'#if __CUDA_ARCH__ >= 900.*?#endif', '', re.sub(r'//[^\n]*', '', src), flags=re.S)
    if 'asm' in code or '__shared__' in src:
        sys.exit('run_batch.sh: inline PTX or a shared declaration left unreplaced')
# The launcher's constants (crates/lily-cuda/src/kernels/decode.rs), as FILE.defines passes them.
rs = open(f'{root}/crates/lily-cuda/src/kernels/decode.rs').read()
def const(name):
    return re.search(r'pub const ' + name + r': usize = (\d+);', rs).group(1)
defs = ''.join(f'#define {d} {const(c)}\n' for d, c in re.findall(r'\("(DEC_\w+)", (\w+) as i64\)', rs))
defs += f'#define LAUNCH_BLOCKS_PER_SM {const("BLOCKS_PER_SM")}\n'
open(f'{w}/emu.cpp', 'w').write(f'#include "{root}/scripts/cuda_emu/shim_decode.h"\n' + defs + common + dec +
                                f'\n#include "{root}/scripts/cuda_emu/driver_batch.cpp"\n')
PY
parts="${1:-gemv moe dn}"
flags=""
if [ "${2:-}" = bf16 ]; then flags="-DLILY_BF16_ACT"; fi
g++ -std=c++20 -O2 -ffp-contract=off -U_FORTIFY_SOURCE -D_FORTIFY_SOURCE=0 -Wno-unknown-pragmas -pthread $flags "$W/emu.cpp" -o "$W/emu"
for p in $parts; do
  "$W/emu" "$p" || fail=1
done
exit "${fail:-0}"
