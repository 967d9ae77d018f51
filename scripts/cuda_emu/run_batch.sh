#!/usr/bin/env bash
# Runs the batched decode step's CUDA kernels (issue 32) on the CPU, without a GPU: decode.cu's
# dec_gemv_rows, dec_gemv_rows_split (and its lean staging, with norm.cu's rms_norm_rows against
# rms_norm: batch_lean_glue; and its cp.async staging, router_async_stage), dec_mma_rows (and dec_mma_rows_deep, and its staging in rounds, mma_stage_rounds), dec_glu4_rows + dec_down_combine_rows, the
# int8 dec_glu4_q8_rows + dec_down_combine_q8_rows and their one-token forms (moe_int8), the
# one-token int8-pair projections dec_gemv4_x8x2 + dec_gemv4w_x8x2 (gemv_int8), the MoE's int8-pair
# kernels dec_glu4_x8x2(_rows) + dec_down_combine_x8x2(_rows) (moe_int8_pairs) and their forms
# grouped by expert, dec_glu4_x8x2_grouped + dec_down_combine_x8x2_grouped (moe_grouped_rows),
# dec_glu4_x8x2_bulk against dec_glu4_x8x2 (moe_bulk: bulk copies and mbarriers emulated),
# dec_dn_conv_rows + dec_dn_step_rows and attention.cu's attn_split_mma_prep(_long)_rows +
# attn_split_combine_rows, and (attn_int8) the same file built with LILY_KV_INT8 (`kv_cache int8`,
# issue 30: int8-row caches) as kv8::, its writers and readers against the rule and the bf16 kernels.
# The kernels' own
# source (with common.cuh's helpers) compiled as C++ against shim_decode.h (shim.h's types; a
# block's threads as fibers with real barriers, run in a shuffled order; NaN-filled shared
# memory; warp shuffles, redux, ldmatrix and mma.sync m16n8k16 bf16 as warp collectives over the
# PTX layouts; cp.async deferred until its wait), checked by driver_batch.cpp against f64
# references and, where the GPU tests claim bit equality, against the one-sequence kernels
# emulated the same way. A check of indexing, per-sequence pointers, strides, fragments, barriers
# and store modes while no GPU is lent; nothing about speed; driver_batch.cpp's header says what
# it cannot show.
#   bash scripts/cuda_emu/run_batch.sh                     (every part; fp32, then bf16 activations)
#   bash scripts/cuda_emu/run_batch.sh gemv|gemv_x8|mma|split|lean|moe|moe_q8|moe_x8x2|moe_grouped|moe_bulk|dn [bf16]   (one part; attn, attn_int8: bf16 only)
#   bash scripts/cuda_emu/run_batch.sh mutants             (46 known bugs put in: each must be caught;
#                                                           ONLY="6 7" runs   those of the list alone)
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$HERE/../.."
W="$(mktemp -d)"
trap 'rm -rf "$W"' EXIT
gen() {  # writes $W/emu.cpp: shim_decode.h, the kernels' source as C++, driver_batch.cpp
python3 - "$ROOT" "$W" <<'PY'
import re, sys
root, w = sys.argv[1], sys.argv[2]
common = open(f'{root}/shaders/cuda/common.cuh').read()
dec = open(f'{root}/shaders/cuda/decode.cu').read()
norm = open(f'{root}/shaders/cuda/norm.cu').read()
# common.cuh without its inline-PTX tensor-core / cp.async / Hopper helpers (decode.cu uses none).
common = common[:common.index('// ---- tensor cores and asynchronous copies')] + \
    common[common.index('// ---- pieces two kernel files share'):]
def swap(src, old, new, count=1):
    if src.count(old) != count:
        sys.exit(f'run_batch.sh: expected {count} of {old!r} in the kernel source; it changed')
    return src.replace(old, new)
# `run_batch.sh mutants`: one known bug put into the kernels (EMU_MUTANT = its index), which the
# emulation must catch: the proof that a pass means something.
MUTANTS = [
    ('dec', '= v;\n    }\n    __syncthreads();\n    // Each (row, group)', '= v;\n    }\n    // Each (row, group)',
     'dec_gemv_rows without the barrier after staging x'),
    ('dec', 'xsum_g[b * G]', 'xsum_g[b]', "dec_gemv_rows reading row 0's group sums at the wrong stride"),
    ('dec', 'LEAN ? sgate.rows : 0);', '0);', 'dec_glu4_rows writing every token\'s shared expert to row 0'),
    ('dec', 'dt_bias, states[r],', 'dt_bias, states[0],', 'dec_dn_step_rows updating sequence 0\'s state for every row'),
    ('att', 'mma_bf16(sc, a1, kb[2], kb[3]);', 'mma_bf16(sc, a1, kb[3], kb[2]);', 'attn_split_mma: the second k-step\'s B fragments swapped'),
    ('att', 'positions[b], n_q', 'positions[0], n_q', "attn_split_mma_prep_rows taking sequence 0's position for every row"),
    ('dec', 'w[2 * j] = pack_bf16x2(v[m], v[m + 4]);', 'w[2 * j] = pack_bf16x2(v[m + 4], v[m]);',
     "dec_mma_rows staging x in another k order than its weight operands'"),
    ('dec', 'o0 = bf16_to_f32(it.b[0]) - 128.0f * s0', 'o0 = bf16_to_f32(it.b[0])',
     "dec_mma_rows without the 128 offset in its bias term"),
    ('dec', 'for (int w = 0; w < ks; w++) s +=', 'for (int w = 0; w < 1; w++) s +=',
     "dec_mma_rows (and _deep: mma_tile_end) keeping only warp 0's share of a split tile"),
    ('dec', 'for (int b = 0; b < DEC_B_MAX; b++) acc[b] = warp_sum(acc[b]);',
     'for (int b = 0; b < DEC_B_MAX; b++) acc[b] += __shfl_xor_sync(0xffffffffu, acc[b], 16);',
     "dec_gemv_rows_split meeting only two lanes' sums"),
    ('dec', 'x.e[4 * v + i], lo)', 'x.o[4 * v + i], lo)', "dec_glu4_q8 dotting the low nibbles with the odd columns' int8"),
    ('dec', 'float2 sc = xqs[sl];\n    x.scale16', 'float2 sc = xqs[0];\n    x.scale16', "dec_glu4_q8 taking group 0's int8 scale for every group"),
    ('dec', 'x8_load(hq, hqs, i * G + sl)', 'x8_load(hq, hqs, sl)', "dec_down_combine_q8 dotting every item with item 0's int8 rows"),
    ('dec', 'return 254 * (16 * lh + hh) + (16 * ll + hl);', 'return 254 * (16 * lh + hh);', "dec_gemv4_x8x2 dropping x_lo"),
    ('dec', 'float unit = scale * (1.0f / 254.0f);', 'float unit = scale * (1.0f / 256.0f);', "dec_gemv4_x8x2 with x_lo's step scale / 256, not / 254"),
    ('dec', 'sum += 254 * hi[j] + lo[j];', 'sum += 254 * hi[j];', "dec_gemv4_x8x2's bias term on x_hi's sum alone"),
    ('dec', 'lo[j] = __float2int_rn(fmaf(-scale, (float)hi[j], v[j]) * inv_lo);', 'lo[j] = __float2int_rn(fmaf(-scale, (float)hi[j], v[j]) * inv);',
     "dec_gemv4_x8x2 rounding the residual to steps of scale, not scale / 254"),
    ('dec', 'xp[j] = x8x2_load(xq, xqs, tg.sl + j * tg.lpr);', 'xp[j] = x8x2_load(xq, xqs, tg.sl + j);',
     "dec_gemv4w_x8x2 holding groups sl and sl + 1, not sl + 32"),
    ('dec', 'x8x2_load(hq, hqs, i * G + sl)', 'x8x2_load(hq, hqs, sl)', "dec_down_combine_x8x2 dotting every item with item 0's pairs"),
    ('dec', 'x = x8x2_load(xq, xqs, sl);', 'x = x8x2_load(xq, xqs, 0);', "dec_glu4_x8x2 taking group 0's pairs in every lane"),
    ('dec', 'cp_async_wait<S - 1>();\n        __syncwarp();\n        mma_deep_dot(segs, c, cpt',
     'cp_async_wait<S - 1>();\n        mma_deep_dot(segs, c, cpt', "dec_mma_rows_deep reading a stage before the warp's other lanes' copies landed"),
    ('dec', 'cp_async_wait<S - 1>();\n        __syncwarp();\n        mma_deep_dot(segs, c + 1,',
     'cp_async_wait<S>();\n        __syncwarp();\n        mma_deep_dot(segs, c + 1,', "dec_mma_rows_deep waiting for one chunk too few"),
    ('dec', 'pipe + ((c + S - 1) % S) * DEC_MMA_STAGE', 'pipe + ((c + S) % S) * DEC_MMA_STAGE',
     "dec_mma_rows_deep requesting a chunk into the stage about to be read"),
    ('dec', 'sb.b[k][1] = sg.w.biases[r1 * G + gi];', 'sb.b[k][1] = sg.w.biases[r0 * G + gi];',
     "dec_mma_rows_deep taking row g's bias for row g + 8"),
    ('dec', 'return a.j0 * ks + kw * DEC_MMA_CHUNK + k;', 'return a.j0 + kw * DEC_MMA_CHUNK + k;',
     "dec_mma_rows_deep's split warps overlapping their chunks of groups"),
    ('dec', 'x.load(nullptr, nullptr, xq + b * tg.G * DEC_X8X2PAD, xqs + b * tg.G, tg.sl);',
     'x.load(nullptr, nullptr, xq, xqs, tg.sl);', "dec_glu4_x8x2_grouped dotting every row's picks with row 0's pairs"),
    ('dec', 'hs + 64 * (long long)(g - routed)', 'hs + 64 * (long long)((g - routed) % G)',
     "dec_down_combine_x8x2_grouped staging row 0's shared-expert input for every row"),
    ('dec', 'for (int i = kk; i < top_k; i += DEC_DOWN_KSPLIT) y +=', 'for (int i = kk == 0 ? 0 : top_k; i < top_k; i++) y +=',
     "dec_down_combine_x8x2_grouped summing a row's items in rank order, not dec_down_combine_x8x2's chunks"),
    ('dec', 'for (int i = 0; i < w; i++) item += __popc(bits[i]);', 'for (int i = 0; i < w - 1; i++) item += __popc(bits[i]);',
     "group_picks missing the experts of the word before an expert's: items of different experts folded into one"),
    ('dec', 'if (b % KCOLS == kc) spread_rows |= 1u << b;', 'if (b % KCOLS == 0) spread_rows |= 1u << b;',
     "dec_down_combine_x8x2_grouped_wide giving every column the shared expert's rows of column 0"),
    ('dec', 'bulk_expect(bar, 2u * qb + 4u * sb);', 'bulk_expect(bar, 2u * qb + 3u * sb);',
     "dec_glu4_x8x2_bulk expecting one run of scales too few bytes"),
    ('dec', '        bulk_wait(bars + i);\n', '',
     "dec_glu4_x8x2_bulk reading a slot without waiting for its copies"),
    ('dec', 'bulk_read(slots + i * DEC_BULK_SLOT, rows, tg, r);', 'bulk_read(slots, rows, tg, r);',
     "dec_glu4_x8x2_bulk summing every tile of a block from its first slot"),
    ('dec', 'if (requester && mine.item == 0)', 'if (requester && mine.item == 0 && tg.warp > 0)',
     "dec_glu4_x8x2_bulk never requesting the shared expert's tiles (waits that never complete)"),
    ('dec', 'if (l < o) t[l] = t[l] + t[l + o];', 'if (l < o) t[l] = t[l] + t[2 * o - 1 - l];',
     "rows_stage_lean pairing its group sums' terms in another tree than warp_sum's (the same sum, other bits)"),
    ('norm', 'for (int k = 0; k < RMS_ROWS_REG; k++)\n        if (t + k * RMS_ROWS_THREADS < cols) ss +=',
     'for (int k = RMS_ROWS_REG - 1; k >= 0; k--)\n        if (t + k * RMS_ROWS_THREADS < cols) ss +=',
     "rms_norm_rows summing a thread's squares in reverse order (the same sum, other bits)"),
    ('dec', 'int next = item_at(p0 + j + DEC_GRP_GLU_RING);', 'int next = item_at(p0 + j + DEC_GRP_GLU_RING - 1);',
     "dec_glu4_x8x2_grouped_ring refilling a slot with the item the next slot holds (items skipped)"),
    ('dec', 'if (b % step == (int)blockIdx.y) spread |= 1u << b;', 'if (b % step == 0) spread |= 1u << b;',
     "dec_glu4_x8x2_grouped_ring giving every chunk the shared expert's rows of chunk 0"),
    ('att', 'int q = __float2int_rn(x / s);', 'int q = (int)(x / s);',
     "kv8_quant (the int8 cache's writes) truncating x / s instead of rounding half to even"),
    ('att', 'sc[0] * (scale * ksc[0])', 'sc[0] * scale', "int8 attn_split_mma leaving key j's scale out of its score"),
    ('att', 'pack_bf16x2(p0 * vsc[0], p1 * vsc[4])', 'pack_bf16x2(p0 * vsc[0], p1 * vsc[0])',
     "int8 attn_split_mma weighting value j + 1 with value j's scale"),
    ('att', 'cp_async16(kd, ksc_g + (long long)j * row);', 'cp_async16(kd, ksc_g);',
     "int8 attn_split_mma staging position 0's key scales for every key"),
    ('att', 'u32 x = w.x ^ 0x80808080u, y = w.y ^ 0x80808080u;', 'u32 x = w.x, y = w.y;',
     "kv8_bf16x8 without the sign flip (each value read as its unsigned byte − 128)"),
    ('att', 'o[k] = (u32)kv_store(lo) | ((u32)kv_store(hi) << 16);', 'o[k] = (u32)kv_store(hi) | ((u32)kv_store(lo) << 16);',
     "kv_int8_dequant swapping each pair of values"),
    ('dec', 'cp_async_wait<0>();\n    __syncwarp();\n    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, per_round',
     'cp_async_wait<0>();\n    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, per_round',
     "rows_stage_async summing a (row, group) before the warp's other lanes' copies landed"),
    ('dec', 'int bg = 2 * warp + (m >> 1) * per_round + (m & 1);', 'int bg = 2 * warp + (m >> 1) * per_round;',
     "rows_stage_async summing the first of its warp's two (row, group)s of a round twice, the second never"),
    ('dec', 'v[4 * e + 1] = round_bf16(f[u][e].y);', 'v[4 * e + 1] = round_bf16(f[0][e].y);',
     "dec_mma_rows_deep_rounds converting a round's first item's loads in every item of the round"),
]
import os
att = open(f'{root}/shaders/cuda/attention.cu').read()
if os.environ.get('EMU_MUTANT'):
    f, old, new, what = MUTANTS[int(os.environ['EMU_MUTANT'])]
    print(f'mutant: {what}')
    if f == 'dec':
        dec = swap(dec, old, new)
    elif f == 'norm':
        norm = swap(norm, old, new)
    else:
        att = swap(att, old, new)
# The inline-PTX pieces of decode.cu (shim_decode.h says what replaces them).
dec = swap(dec, '''    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;''', '    return __ldg(p);')
dec = swap(dec, '''    uint2 r;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    return r;''', '    return __ldg(p);')
dec = swap(dec, 'asm volatile("prefetch.global.L2 [%0];" ::"l"(norm_w + c));', '(void)c;')
dec = swap(dec, 'asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));', 'd = emu_dp4a_us(a, b, c);')
dec = swap(dec, 'extern __shared__ __align__(16) float dec_smem[];', 'float* dec_smem = t_smem;', 6)
# dec_glu4_x8x2_bulk's slots (dynamic) and mbarriers (static; common.cuh's bulk_* helpers sit in
# the section taken out above: shim_decode.h emulates them).
dec = swap(dec, 'extern __shared__ __align__(128) char glu_slots[];', 'char* glu_slots = (char*)t_smem;')
dec = swap(dec, '__shared__ __align__(8) unsigned long long bars[DEC_BULK_SLOTS];',
           'unsigned long long* bars = shared_arr<unsigned long long>("bars", DEC_BULK_SLOTS);')
# dec_gemv_rows' block as for sm_90 (6 warps; its launcher's rows_warps).
dec = swap(dec, '#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900', '#if EMU_CUDA_ARCH == 900')
# attention.cu's split-KV decode kernels (the prefill kernels after them are not taken), built
# as for sm_90 (the _long kernels' head dim 256 compiled in) but with griddepcontrol (common.cuh)
# a no-op.
att = att[:att.index('// ---- split-KV decode')] + att[att.index('// ---- split-KV decode'):att.index('// attn_split: the split')] + \
    att[att.index('// attn_split_mma: attn_split for one token'):att.index('// ---- prefill on tensor cores')]
att = att.replace('__CUDA_ARCH__', 'EMU_CUDA_ARCH')
att = swap(att, 'extern __shared__ __align__(16) float split_smem[];', 'float* split_smem = t_smem;')
# Static shared arrays: one per block (shim_decode.h's shared_arr).
def shared(m):
    ty, decls = m.group(1), m.group(2)
    out = []
    for d in decls.split(','):
        name, dims = re.fullmatch(r'\s*(\w+)((?:\[[^\]]+\])+)\s*', d).groups()
        dims = re.findall(r'\[([^\]]+)\]', dims)
        if len(dims) == 1:
            out.append(f'{ty}* {name} = shared_arr<{ty}>("{name}", {dims[0]});')
        else:
            inner = ''.join(f'[{x}]' for x in dims[1:])
            total = '*'.join(f'({x})' for x in dims)
            out.append(f'{ty} (*{name}){inner} = reinterpret_cast<{ty} (*){inner}>(shared_arr<{ty}>("{name}", {total}));')
    return ' '.join(out)
pat = re.compile(r'__shared__\s+(?:__align__\(16\)\s+)?(float2|float|int|u16|u32)\s+([^;]+);')
common, dec, att = pat.sub(shared, common), pat.sub(shared, dec), pat.sub(shared, att)
# The same kernels built with LILY_KV_INT8 (the plan's `kv_cache int8`: int8-row caches) in a
# namespace of their own, kv8::, so the driver runs both forms side by side (attn_int8).
# (bf16 builds only, as the plan: an int8 cache needs bf16 activations, and attention.cu says so with #error)
att8 = ('#ifdef LILY_BF16_ACT\nnamespace kv8 {\n#define LILY_KV_INT8 1\n' + att.replace('extern "C" ', '')
        + '\n#undef LILY_KV_INT8\n}  // namespace kv8\n#endif\n')
for src in (common, norm, dec, att):
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
ars = open(f'{root}/crates/lily-cuda/src/kernels/attention.rs').read()
def aconst(name):
    return re.search(r'pub const ' + name + r': usize = (\d+);', ars).group(1)
defs += ''.join(f'#define {d} {aconst(c)}\n' for d, c in re.findall(r'\("(\w+)", (\w+) as i64\)', ars))
nrs = open(f'{root}/crates/lily-cuda/src/kernels/norm.rs').read()
def nconst(name):
    return re.search(r'pub const ' + name + r': usize = (\d+);', nrs).group(1)
defs += ''.join(f'#define {d} {nconst(c)}\n' for d, c in re.findall(r'\("(\w+)", (\w+) as i64\)', nrs))
defs += '#define EMU_CUDA_ARCH 900\n'
open(f'{w}/emu.cpp', 'w').write(f'#include "{root}/scripts/cuda_emu/shim_decode.h"\n' + defs + common + norm + dec + att + att8 +
                                f'\n#include "{root}/scripts/cuda_emu/driver_batch.cpp"\n')
PY
}
build() {  # build FLAGS...: the emulator with these compiler flags (and EMU_FLAGS') into $W/emu
  g++ -std=c++20 -O2 -ffp-contract=off -U_FORTIFY_SOURCE -D_FORTIFY_SOURCE=0 -Wno-unknown-pragmas -pthread ${EMU_FLAGS:-} "$@" \
    "$W/emu.cpp" -o "$W/emu"
}
if [ "${1:-}" = mutants ]; then
  # (index, part that must fail, build flags)
  for m in "0 gemv" "1 gemv" "2 moe" "3 dn" "4 attn -DLILY_BF16_ACT" "5 attn -DLILY_BF16_ACT" \
           "6 mma" "7 mma" "8 mma" "9 split" "10 moe_q8" "11 moe_q8 -DLILY_BF16_ACT" "12 moe_q8" \
           "13 gemv_x8 -DLILY_BF16_ACT" "14 gemv_x8" "15 gemv_x8 -DLILY_BF16_ACT" "16 gemv_x8" "17 gemv_x8 -DLILY_BF16_ACT" \
           "18 moe_x8x2" "19 moe_x8x2 -DLILY_BF16_ACT" "20 mma" "21 mma -DLILY_BF16_ACT" "22 mma" "23 mma" "24 mma" \
           "25 moe_grouped" "26 moe_grouped -DLILY_BF16_ACT" "27 moe_grouped" "28 moe_grouped" \
           "29 moe_grouped" "30 moe_bulk" "31 moe_bulk" "32 moe_bulk" "33 moe_bulk" "34 lean" "35 lean" \
           "36 moe_grouped" "37 moe_grouped" \
           "38 attn_int8 -DLILY_BF16_ACT" "39 attn_int8 -DLILY_BF16_ACT" "40 attn_int8 -DLILY_BF16_ACT" \
           "41 attn_int8 -DLILY_BF16_ACT" "42 attn_int8 -DLILY_BF16_ACT" "43 attn_int8 -DLILY_BF16_ACT" \
           "44 lean" "45 lean -DLILY_BF16_ACT" "46 mma"; do
    set -- $m
    if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $1 "* ]]; then continue; fi
    EMU_MUTANT=$1 gen
    build ${3:-}
    if "$W/emu" "$2" >"$W/log" 2>&1; then
      echo "  NOT CAUGHT"; fail=1
    else
      echo "  caught: $(grep -m1 -E 'FAIL|deadlock|abort|never' "$W/log" | sed 's/  */ /g')"
    fi
  done
  exit "${fail:-0}"
fi
gen
if [ "${1:-}" = "" ]; then
  # everything: fp32 activations, then bf16 (and the attention kernels, bf16 only)
  build; for p in gemv gemv_x8 mma split lean moe moe_q8 moe_x8x2 moe_grouped moe_bulk dn; do "$W/emu" "$p" || fail=1; done
  build -DLILY_BF16_ACT; for p in gemv gemv_x8 mma split lean moe moe_q8 moe_x8x2 moe_grouped moe_bulk dn attn attn_int8; do "$W/emu" "$p" || fail=1; done
else
  if [ "${2:-}" = bf16 ]; then build -DLILY_BF16_ACT; else build; fi
  "$W/emu" "$1" || fail=1
fi
exit "${fail:-0}"
