#!/usr/bin/env bash
# Session 28, branch s28wmoe (≤ 200 s by its own clock, Vulkan on the device's GPU): decode's MoE
# with every item's reads in flight together (switch `moe_wide_reads`, LILY_WGPU_MOE_WIDE_READS;
# with moe_rounds). linear_q4_glu_rows' items form routes all k ranks first (k barriers, no memory
# trip between them) and then requests all 8 routed items' gate/up words and scales at once (its
# `WIDE`; today item r + 1's reads wait on item r − 1's sums: ≈ k / 2 dependent trips a call);
# moe_down_rows requests a slot's ≤ 3 items' reads together and the residual's old value at the
# start (its `WIDE`; today slot 0's third item waits on its first's sums, and the residual's read
# is a trip after the reduction). Outputs bit for bit moe_rounds' own.
# Predicted (H100, 4K): lin.experts.glu 26.9 → 23–25 µs a call, moe_down 16.6 → 15–16 µs
# (× 40: −100…−250 µs a token of ≈ 4.2 ms): decode +2.5…+6 % at 4K, +2…+5 % at 32K.
# Modelled on gpu_s27wrec_ab.sh; staged by scripts/stage_gpu.sh with gpu_ab_common.sh
# (bin/lily-engine, bin/wgpu_model):
#   CARGO_TARGET_DIR=/work/wt-s28wmoe/target bash scripts/stage_gpu.sh /work/main/.carry/s28wmoe
#   cp scripts/gpu_s28wmoe_ab.sh /work/main/.carry/s28wmoe/
#   device: bash .carry/s28wmoe/gpu_s28wmoe_ab.sh      (carry: .carry/s28wmoe .gl; timeout_s 240)
# 1. beside the synth: lily-wgpu's `moe_wide_reads_kernels_match_the_host` (the GLU's WIDE form
#    against the host's f64, ids exact, and bit for bit its ITEMS form; moe_down_rows' three
#    forms against the host and bit for bit each other; both reduction forms, f32 and f16
#    activations), `moe_rounds_kernels_match_the_host` (the shipping kernels) and
#    `decode_with_moe_wide_reads_matches_cpu` (tiny, 24 greedy steps against the CPU, and bit for
#    bit the run without the switch); they set the switch in their cases: run without the
#    variable;
# 2. `bench --device wgpu --prefill 512 --decode-ctx 4K,32K --decode-tokens 64 --repeat 1`,
#    OFF / ON twice;
# 3. if the clock allows: LILY_PROFILE=1 at 4K OFF / ON (lin.experts.glu and moe_down's rows;
#    lin.router and lin.dn.in_proj beside them as rows that must not move) into the summary.
# Logs in /tmp/s28wmoe-logs (outside $OUT); $OUT gets summary.txt and the profiles' tails.
set -u
R=${OUT:-$PWD/gpu-logs}; mkdir -p "$R"
L=/tmp/s28wmoe-logs; mkdir -p "$L"; rm -f "$L/summary.txt"
export OUT=$L
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-185}"
S=$R/summary.txt; cat "$L/summary.txt" >> "$S"
AB_HARD=${HARD:-198}
OFF=${OFF:-LILY_WGPU_MOE_WIDE_READS=0}
ON=${ON:-LILY_WGPU_MOE_WIDE_READS=1}
K="decode MoE reads all in flight (on|off)"
P='lin.experts.glu|moe_down|lin.router|lin.dn.in_proj'
wgpu_setup
env -u LILY_WGPU_MOE_WIDE_READS timeout "$(cap 85)" \
  "$B/wgpu_model" --test-threads=1 --nocapture moe_wide_reads moe_rounds_kernels \
  > "$OUT/wtests.log" 2>&1
say "wgpu tests rc=$? at $(el)s"
grep -hE "^test .*(ok|FAILED)$|^test result|panicked|WIDE / ITEMS|rounds bit for bit|identical tokens" "$OUT/wtests.log" | cut -c1-250 | head -16 | tee -a "$S"
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
