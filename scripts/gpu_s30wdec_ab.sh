#!/usr/bin/env bash
# Session 30, branch s30wdec (≤ 200 s by its own clock, Vulkan on the device's GPU): decode's MoE
# down projections and weighted sum into the residual (`moe_down`) on moe_down_lanes.wgsl, one
# item a lane (switch `down_item_lanes`, LILY_WGPU_DOWN_ITEM_LANES): a workgroup of 160 lanes
# (9 items × 16 quads, 5 warps; today 64 lanes, slot 0 taking items 0, 4 and 8), so every item's
# words are requested in one trip after its id, and the residual's element read at the start, not
# after the row totals; the same additions in the same order: bit for bit where the driver
# contracts neither kernel.
# Predicted (H100, 4K): moe_down 16.6 → 13.5–15.5 µs a call (−45…−125 µs a token of ≈ 4.0 ms):
# decode +1…+3 % at 4K, +1…+2.5 % at 32K. lin.experts.glu and lin.router must not move.
# Modelled on gpu_s28wrows_ab.sh; staged by scripts/stage_gpu.sh with gpu_ab_common.sh
# (bin/lily-engine, bin/wgpu_model):
#   CARGO_TARGET_DIR=/work/wt-s30wdec/target bash scripts/stage_gpu.sh /work/main/.carry/s30wdec
#   cp scripts/gpu_s30wdec_ab.sh /work/main/.carry/s30wdec/
#   device: bash .carry/s30wdec/gpu_s30wdec_ab.sh      (carry: .carry/s30wdec .gl; timeout_s 240)
# 1. beside the synth: lily-wgpu's `down_item_lanes_kernel_matches_the_host_and_todays` (9 items
#    of 512 columns on 160 lanes, 9 of 256, 5 of 64; bit for bit moe_down_rows in rounds and
#    within the kernel bound of the host's f64; both reduction forms, f16 and f32 activations,
#    2 and 8 rows a workgroup; tiny's greedy decode against the CPU) and `moe_rounds_kernels`
#    (the shipping form); they set the switch themselves: run without the variable;
# 2. `bench --device wgpu --prefill 512 --decode-ctx 4K,32K --decode-tokens 64 --repeat 1`,
#    OFF / ON twice;
# 3. if the clock allows: LILY_PROFILE=1 at 4K OFF / ON, the rows moe_down (must move),
#    lin.experts.glu and lin.router (must not) into the summary.
# Logs in /tmp/s30wdec-logs (outside $OUT); $OUT gets summary.txt and the profiles' tails.
set -u
R=${OUT:-$PWD/gpu-logs}; mkdir -p "$R"
L=/tmp/s30wdec-logs; mkdir -p "$L"; rm -f "$L/summary.txt"
export OUT=$L
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-185}"
S=$R/summary.txt; cat "$L/summary.txt" >> "$S"
AB_HARD=${HARD:-198}
OFF=${OFF:-LILY_WGPU_DOWN_ITEM_LANES=0}
ON=${ON:-LILY_WGPU_DOWN_ITEM_LANES=1}
K="moe_down one item a lane (on|off)|moe_down_lanes [(][^)]*|down_item_lanes: [^,]*"
P='lin.experts.glu|moe_down|lin.router'
wgpu_setup
env -u LILY_WGPU_DOWN_ITEM_LANES timeout "$(cap 80)" \
  "$B/wgpu_model" --test-threads=1 --nocapture down_item_lanes_kernel moe_rounds_kernels \
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
