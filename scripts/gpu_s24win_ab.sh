#!/usr/bin/env bash
# Session 24, branch s24win (≤ 240 s by its own clock, Vulkan on the device's GPU): `rows_one_word`,
# linear_q4_rows' 16-row kernel compiled for one-word rows (DeltaNet's in_proj, attention's q/k/v,
# lm_head without the second words' registers the persistent kernel carries since session 21).
# Modelled on gpu_wgpu_ab3.sh; staged by scripts/stage_gpu.sh with gpu_ab_common.sh
# (bin/lily-engine, bin/wgpu_model):
#   bash scripts/stage_gpu.sh /work/main/.carry/s24win && cp scripts/gpu_s24win_ab.sh /work/main/.carry/s24win/
#   rm /work/main/.carry/s24win/bin/{gpu,kernels_compile}; gzip -9 /work/main/.carry/s24win/bin/*
#   device: bash .carry/s24win/gpu_s24win_ab.sh      (carry: .carry/s24win .gl; timeout_s 300)
# 1. beside the synth: lily-wgpu's `one_word_row_kernel_matches_the_host_and_todays` on the GPU
#    (it sets the switch in its cases: run without LILY_WGPU_ROWS_ONE_WORD, which would
#    override them);
# 2. `bench --device wgpu --prefill 512 --decode-ctx 4K,32K --decode-tokens 64 --repeat 1`,
#    OFF / ON, then LILY_PROFILE=1 at 4K OFF / ON (decode's rows of in_proj, q/k/v, lm_head into
#    the summary), then OFF / ON again; last, if the clock allows, the profile under ON with
#    LILY_WGPU_ROWS_WORKERS=1024 (lm_head's grid).
# Logs in /tmp/s24win-logs (outside $OUT); $OUT gets summary.txt and the benches' tails.
set -u
R=${OUT:-$PWD/gpu-logs}; mkdir -p "$R"
L=/tmp/s24win-logs; mkdir -p "$L"; rm -f "$L/summary.txt"
export OUT=$L
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-225}"
S=$R/summary.txt; cat "$L/summary.txt" >> "$S"
AB_HARD=${HARD:-240}
OFF=${OFF:-LILY_WGPU_ROWS_ONE_WORD=0}
ON=${ON:-LILY_WGPU_ROWS_ONE_WORD=1}
K='linear_q4_rows one-word 16-row kernel (on|off)|rows workers [0-9]+|its 16-row kernel compiled for one-word rows'
P='lin.dn.in_proj|lin.attn.qkv|lin.lm_head'
wgpu_setup
env -u LILY_WGPU_ROWS_ONE_WORD timeout "$(cap 70)" "$B/wgpu_model" --test-threads=1 --nocapture \
  one_word_row_kernel_matches_the_host_and_todays > "$OUT/wtests.log" 2>&1
say "wgpu tests rc=$? at $(el)s"
grep -hE "^test .*(ok|FAILED)$|^test result|panicked|one-word" "$OUT/wtests.log" | cut -c1-250 | head -8 | tee -a "$S"
wait "$SYN"; say "synth full rc=$? at $(el)s"
export PREFILL=512
# shellcheck disable=SC2086
BENCH_S=45 wgpu_bench off-1 4K,32K "$K" $OFF
# shellcheck disable=SC2086
BENCH_S=45 wgpu_bench on-1 4K,32K "$K" $ON
# shellcheck disable=SC2086
BENCH_S=30 wgpu_bench_rows prof-off 4K "$K" "$P" LILY_PROFILE=1 $OFF
# shellcheck disable=SC2086
BENCH_S=30 wgpu_bench_rows prof-on 4K "$K" "$P" LILY_PROFILE=1 $ON
# shellcheck disable=SC2086
BENCH_S=45 wgpu_bench off-2 4K,32K "$K" $OFF
# shellcheck disable=SC2086
BENCH_S=45 wgpu_bench on-2 4K,32K "$K" $ON
# Last, if the clock allows: lm_head on 1,024 persistent workers under ON (1,056 resident at
# ≈ 128 registers; its row against prof-on's 512).
# shellcheck disable=SC2086
BENCH_S=30 wgpu_bench_rows prof-on-w1024 4K "$K" "$P" LILY_PROFILE=1 LILY_WGPU_ROWS_WORKERS=1024 $ON
cp "$L"/bench-prof-*.log "$R"/ 2>/dev/null
say "done at $(el)s"
