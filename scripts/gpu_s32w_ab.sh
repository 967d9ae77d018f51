#!/usr/bin/env bash
# Session 32, branch s32w (≤ 200 s by its own clock, Vulkan on the device's GPU): linear_q4_rows'
# storing invocations' tail reads issued at the start with the first rows' words (switch
# `rows_tail_early`, LILY_WGPU_ROWS_TAIL_EARLY; its `TAIL`): DeltaNet in_proj's conv channels read
# their 4 taps and 3 state values, the output projections (dn.out, attn.o) the residual's old
# value, before the row totals' barriers instead of after them; the same values in the same
# arithmetic: bit for bit.
# Predicted (H100, 4K): lin.dn.in_proj 24.8 → 23.0–24.0 µs a call, lin.dn.out 17.8 and
# lin.attn.o 18.1 → 17.1–17.6: −45…−95 µs a token of ≈ 3.8 ms: decode +1…+2.5 % at 4K,
# +1…+2 % at 32K; lin.attn.qkv, lin.router, lin.lm_head unchanged (no tail).
# Modelled on gpu_s30wdec_ab.sh (git show 9b02cf9:scripts/gpu_s30wdec_ab.sh); staged by scripts/stage_gpu.sh with gpu_ab_common.sh
# (bin/lily-engine, bin/wgpu_model):
#   CARGO_TARGET_DIR=/work/tgt-s32w bash scripts/stage_gpu.sh /work/main/.carry/s32w
#   cp scripts/gpu_s32w_ab.sh /work/main/.carry/s32w/
#   device: bash .carry/s32w/gpu_s32w_ab.sh      (carry: .carry/s32w .gl; timeout_s 240)
# 1. beside the synth: lily-wgpu's `rows_tail_early_kernel_matches_the_host_and_todays` (the
#    conv inside in_proj on 16 / 4 / 2 rows a workgroup and one persistent workgroup, the
#    residual adds on 2 / 4 / 8 / 16 / 1 rows; TAIL 1 against TAIL 0 bit for bit — reported on a
#    GPU — and each within the kernel bound of the host's f64; both reduction forms, f16 and f32
#    activations; tiny's greedy decode against the CPU); it sets the switch itself: run without
#    the variable;
# 2. `bench --device wgpu --prefill 512 --decode-ctx 4K,32K --decode-tokens 64 --repeat 1`,
#    OFF / ON twice;
# 3. if the clock allows: LILY_PROFILE=1 at 4K ON (then OFF), the rows lin.dn.in_proj,
#    lin.dn.out, lin.attn.o (must move) and lin.attn.qkv, lin.router (must not) into the summary.
# Logs in /tmp/s32w-logs (outside $OUT); $OUT gets summary.txt and the profiles' tails.
set -u
R=${OUT:-$PWD/gpu-logs}; mkdir -p "$R"
L=/tmp/s32w-logs; mkdir -p "$L"; rm -f "$L/summary.txt"
export OUT=$L
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-185}"
S=$R/summary.txt; cat "$L/summary.txt" >> "$S"
AB_HARD=${HARD:-198}
OFF=${OFF:-LILY_WGPU_ROWS_TAIL_EARLY=0}
ON=${ON:-LILY_WGPU_ROWS_TAIL_EARLY=1}
K="linear_q4_rows early tail reads (on|off)"
P='lin.dn.in_proj|lin.dn.out|lin.attn.o|lin.attn.qkv|lin.router'
wgpu_setup
env -u LILY_WGPU_ROWS_TAIL_EARLY timeout "$(cap 60)" \
  "$B/wgpu_model" --test-threads=1 --nocapture rows_tail_early_kernel \
  > "$OUT/wtests.log" 2>&1
say "wgpu tests rc=$? at $(el)s"
grep -hE "^test .*(ok|FAILED)$|^test result|panicked|same bits as today's" "$OUT/wtests.log" | cut -c1-250 | head -14 | tee -a "$S"
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
BENCH_S=25 wgpu_bench_rows prof-on 4K "$K" "$P" LILY_PROFILE=1 $ON
# shellcheck disable=SC2086
BENCH_S=25 wgpu_bench_rows prof-off 4K "$K" "$P" LILY_PROFILE=1 $OFF
cp "$L"/bench-prof-*.log "$L/wtests.log" "$R"/ 2>/dev/null
say "done at $(el)s"
