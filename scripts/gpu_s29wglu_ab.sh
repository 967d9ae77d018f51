#!/usr/bin/env bash
# Session 29, branch s29wglu (≤ 200 s by its own clock, Vulkan on the device's GPU): decode's
# routed-experts gate/up (linear_q4_glu_rows' items form, `lin.experts.glu`) on two workgroups a
# row and token instead of one (its `SPLIT` 2; switch `glu_split`, LILY_WGPU_GLU_SPLIT): each
# workgroup routes all 8 ranks as today but takes every other item (the shared expert and ranks
# 1, 3, 5, 7; ranks 0, 2, 4, 6), so a routing round's barrier waits on sums whose reads were
# issued two rounds before (not one), and the GPU holds 1,024 workgroups (15.5 warps an SM, not
# 7.75) with no more reads in flight a lane; the same sums in the same slots: bit for bit.
# Predicted (H100, 4K): lin.experts.glu 27.1 → 22.5–25.5 µs a call (−60…−180 µs a token of
# ≈ 3.95 ms): decode +1.5…+4.5 % at 4K, +1.2…+3.5 % at 32K. moe_down must not move.
# Modelled on gpu_s28wrows_ab.sh; staged by scripts/stage_gpu.sh with gpu_ab_common.sh
# (bin/lily-engine, bin/wgpu_model):
#   CARGO_TARGET_DIR=/work/wt-s29wglu/target bash scripts/stage_gpu.sh /work/main/.carry/s29wglu
#   cp scripts/gpu_s29wglu_ab.sh /work/main/.carry/s29wglu/
#   device: bash .carry/s29wglu/gpu_s29wglu_ab.sh      (carry: .carry/s29wglu .gl; timeout_s 240)
# 1. beside the synth: lily-wgpu's `glu_split_kernel_matches_the_host_and_todays` (SPLIT 2 and 3
#    bit for bit the items form and within the kernel bound of the host's f64, E = 130, k = 8,
#    planted ties; both reduction forms, f16 and f32 activations) and `moe_rounds_kernels` (the
#    shipping form); they set the switch themselves: run without the variable;
# 2. `bench --device wgpu --prefill 512 --decode-ctx 4K,32K --decode-tokens 64 --repeat 1`,
#    OFF / ON twice;
# 3. if the clock allows: LILY_PROFILE=1 at 4K OFF / ON, the rows lin.experts.glu (must move),
#    moe_down and lin.router (must not) into the summary.
# Logs in /tmp/s29wglu-logs (outside $OUT); $OUT gets summary.txt and the profiles' tails.
set -u
R=${OUT:-$PWD/gpu-logs}; mkdir -p "$R"
L=/tmp/s29wglu-logs; mkdir -p "$L"; rm -f "$L/summary.txt"
export OUT=$L
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-185}"
S=$R/summary.txt; cat "$L/summary.txt" >> "$S"
AB_HARD=${HARD:-198}
OFF=${OFF:-LILY_WGPU_GLU_SPLIT=0}
ON=${ON:-LILY_WGPU_GLU_SPLIT=1}
K="linear_q4_glu_rows split items (on|off)|one row of every[^)]*|glu_split without[^;]*"
P='lin.experts.glu|moe_down|lin.router'
wgpu_setup
env -u LILY_WGPU_GLU_SPLIT timeout "$(cap 80)" \
  "$B/wgpu_model" --test-threads=1 --nocapture glu_split_kernel moe_rounds_kernels \
  > "$OUT/wtests.log" 2>&1
say "wgpu tests rc=$? at $(el)s"
grep -hE "^test .*(ok|FAILED)$|^test result|panicked|bit for bit: " "$OUT/wtests.log" | cut -c1-250 | head -14 | tee -a "$S"
wait "$SYN"; say "synth full rc=$? at $(el)s"
export PREFILL=${PREFILL:-512}
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
