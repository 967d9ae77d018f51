#!/usr/bin/env bash
# Session 27, branch s27wdec (≤ 200 s by its own clock, Vulkan on the device's GPU): the 4-bit
# weights made floats by their exponent (nibble k kept in place under 2^23's exponent, times 16^-k
# less 2^(23 − 4k): exact) instead of an integer → float conversion, which NVIDIA issues at a
# quarter of the FMA rate (the kernels' `LEANQ`; outputs bit for bit the same), behind two switches:
# `moe_lean_dequant` (decode's MoE gate/up, linear_q4_glu_rows, and down, moe_down_rows) and
# `rows_lean_dequant` (linear_q4_rows: in_proj, q/k/v, out_proj, o, lm_head). ON sets both (each
# kernel's profile row says which moved); ON="LILY_WGPU_MOE_LEAN_DEQUANT=1" measures the MoE's
# alone. Predicted (H100, 4K, µs a call): lin.experts.glu 26.9 → 24–25.5, moe_down 16.6 → 15–16,
# lin.dn.in_proj 24.8 → 21–23, lin.attn.qkv 23.2 → 20.5–22, lin.lm_head 193 → 110–150; decode
# +5…+12 % at 4K, +4…+10 % at 32K (both), +2…+5 % at 4K (the MoE's alone).
# Modelled on gpu_s26wdec_ab.sh (kept at 71ed974); staged by scripts/stage_gpu.sh with
# gpu_ab_common.sh (bin/lily-engine, bin/wgpu_model):
#   CARGO_TARGET_DIR=/work/wt-s27wdec/target bash scripts/stage_gpu.sh /work/main/.carry/s27wdec
#   cp scripts/gpu_s27wdec_ab.sh /work/main/.carry/s27wdec/
#   device: bash .carry/s27wdec/gpu_s27wdec_ab.sh      (carry: .carry/s27wdec .gl; timeout_s 240)
# 1. beside the synth: lily-wgpu's `moe_lean_dequant_kernels_give_the_same_bits` (the GLU's
#    outputs and routed weights with LEANQ bit for bit those without, plain and routing its own
#    items; moe_down_rows with LEANQ, one item at a time and in rounds, bit for bit the reference)
#    and `rows_lean_dequant_kernels_give_the_same_bits` (every linear_q4_rows kernel the plan
#    compiles, bit for bit); both reduction forms, f32 and f16 activations, against the host's
#    f64; they set the switches in their cases: run without the two variables;
# 2. `bench --device wgpu --prefill 512 --decode-ctx 4K,32K --decode-tokens 64 --repeat 1`,
#    OFF / ON twice;
# 3. if the clock allows: LILY_PROFILE=1 at 4K OFF / ON (the rows of the kernels changed; the
#    router's 8-bit rows beside them as a row that must not move) into the summary.
# Logs in /tmp/s27wdec-logs (outside $OUT); $OUT gets summary.txt and the profiles' tails.
set -u
R=${OUT:-$PWD/gpu-logs}; mkdir -p "$R"
L=/tmp/s27wdec-logs; mkdir -p "$L"; rm -f "$L/summary.txt"
export OUT=$L
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-185}"
S=$R/summary.txt; cat "$L/summary.txt" >> "$S"
AB_HARD=${HARD:-198}
OFF=${OFF:-LILY_WGPU_MOE_LEAN_DEQUANT=0 LILY_WGPU_ROWS_LEAN_DEQUANT=0}
ON=${ON:-LILY_WGPU_MOE_LEAN_DEQUANT=1 LILY_WGPU_ROWS_LEAN_DEQUANT=1}
K="(decode MoE|linear_q4_rows) lean dequantisation (on|off)"
P='lin.experts.glu|moe_down|lin.dn.in_proj|lin.attn.qkv|lin.dn.out|lin.lm_head|lin.router'
wgpu_setup
env -u LILY_WGPU_MOE_LEAN_DEQUANT -u LILY_WGPU_ROWS_LEAN_DEQUANT timeout "$(cap 85)" \
  "$B/wgpu_model" --test-threads=1 --nocapture lean_dequant_kernels_give_the_same_bits \
  > "$OUT/wtests.log" 2>&1
say "wgpu tests rc=$? at $(el)s"
grep -hE "^test .*(ok|FAILED)$|^test result|panicked|lean bit for bit" "$OUT/wtests.log" | cut -c1-250 | head -12 | tee -a "$S"
wait "$SYN"; say "synth full rc=$? at $(el)s"
export PREFILL=512
# shellcheck disable=SC2086
BENCH_S=35 wgpu_bench off-1 4K,32K "$K" $OFF
# shellcheck disable=SC2086
BENCH_S=35 wgpu_bench on-1 4K,32K "$K" $ON
# shellcheck disable=SC2086
BENCH_S=35 wgpu_bench off-2 4K,32K "$K" $OFF
# shellcheck disable=SC2086
BENCH_S=35 wgpu_bench on-2 4K,32K "$K" $ON
# The profiles last (the deadline may cut them; the two rounds decide, the rows say why).
# shellcheck disable=SC2086
BENCH_S=25 wgpu_bench_rows prof-off 4K "$K" "$P" LILY_PROFILE=1 $OFF
# shellcheck disable=SC2086
BENCH_S=25 wgpu_bench_rows prof-on 4K "$K" "$P" LILY_PROFILE=1 $ON
cp "$L"/bench-prof-*.log "$L/wtests.log" "$R"/ 2>/dev/null
say "done at $(el)s"
