#!/usr/bin/env bash
# Session 28, branch s28wrows (≤ 200 s by its own clock, Vulkan on the device's GPU): decode's
# plain 4-bit products on linear_q4_rows' persistent one-word 16-row kernel (DeltaNet's in_proj,
# attention's q/k/v, lm_head) in rounds of 8 rows instead of 4 (its `RI` 8; switch `rows_deep`,
# LILY_WGPU_ROWS_DEEP): the two rounds in flight are the block's 16 rows, so a workgroup of one
# block (in_proj's 772, q/k/v's 576 on a discrete GPU) has every word it reads requested before
# its first round's sums (two DRAM round trips on its chain, not three), and lm_head's streaming
# workgroups hold twice the bytes in flight; the same sums in the same order: bit for bit.
# Predicted (H100, 4K, µs a call): in_proj 24.9 → 20–23, q/k/v 23.3 → 19–22, lm_head 193 →
# 155–175; −90…−210 µs a token of ≈ 3.95 ms: decode +2…+5 % at 4K, +2…+4 % at 32K. DeltaNet's
# out_proj and attention's o (the 2-row kernel) must not move.
# Modelled on gpu_s27wrec_ab.sh; staged by scripts/stage_gpu.sh with gpu_ab_common.sh
# (bin/lily-engine, bin/wgpu_model):
#   CARGO_TARGET_DIR=/work/wt-s28wrows/target bash scripts/stage_gpu.sh /work/main/.carry/s28wrows
#   cp scripts/gpu_s28wrows_ab.sh /work/main/.carry/s28wrows/
#   device: bash .carry/s28wrows/gpu_s28wrows_ab.sh      (carry: .carry/s28wrows .gl; timeout_s 240)
# 1. beside the synth: lily-wgpu's `rows_deep_kernel_matches_the_host_and_todays` (the kernel in
#    rounds of 8 bit for bit the rounds of 4 and within the kernel bound of the host's f64: 181
#    rows on 1 / 2 / 5 / 12 workers, and the full model's in_proj with its conv and q/k/v, one
#    workgroup a block and streamed; both reduction forms, f16 activations; every product probe;
#    a tiny decode against the CPU); it sets the switch itself: run without the variable;
# 2. `bench --device wgpu --prefill 512 --decode-ctx 4K,32K --decode-tokens 64 --repeat 1`,
#    OFF / ON twice;
# 3. if the clock allows: LILY_PROFILE=1 at 4K OFF / ON, the rows lin.dn.in_proj, lin.attn.qkv,
#    lin.lm_head (must move) and lin.dn.out, lin.attn.o (must not) into the summary.
# Logs in /tmp/s28wrows-logs (outside $OUT); $OUT gets summary.txt and the profiles' tails.
set -u
R=${OUT:-$PWD/gpu-logs}; mkdir -p "$R"
L=/tmp/s28wrows-logs; mkdir -p "$L"; rm -f "$L/summary.txt"
export OUT=$L
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-185}"
S=$R/summary.txt; cat "$L/summary.txt" >> "$S"
AB_HARD=${HARD:-198}
OFF=${OFF:-LILY_WGPU_ROWS_DEEP=0}
ON=${ON:-LILY_WGPU_ROWS_DEEP=1}
K="linear_q4_rows deep rounds (on|off)|in rounds of 8[^)]*|rows_deep without[^;]*"
P='lin.dn.in_proj|lin.attn.qkv|lin.lm_head|lin.dn.out|lin.attn.o'
wgpu_setup
env -u LILY_WGPU_ROWS_DEEP timeout "$(cap 80)" \
  "$B/wgpu_model" --test-threads=1 --nocapture rows_deep_kernel \
  > "$OUT/wtests.log" 2>&1
say "wgpu tests rc=$? at $(el)s"
grep -hE "^test .*(ok|FAILED)$|^test result|panicked|rounds of 8 [0-9]" "$OUT/wtests.log" | cut -c1-250 | head -12 | tee -a "$S"
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
