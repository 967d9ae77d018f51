#!/usr/bin/env bash
# Session 24, branch s24win2 (≤ 240 s by its own clock, Vulkan on the device's GPU):
# `rows_wide_grid`, the persistent linear_q4_rows grid twice the adapter's kind's count with the
# one-word kernel (a discrete GPU: 1,024 workgroups instead of 512; on the full model lm_head
# alone: in_proj's 772 and q/k/v's 576 row blocks stay one workgroup a block).
# Modelled on gpu_s24win_ab.sh; staged by scripts/stage_gpu.sh with gpu_ab_common.sh
# (bin/lily-engine, bin/wgpu_model):
#   bash scripts/stage_gpu.sh /work/main/.carry/s24win2 && cp scripts/gpu_s24win2_ab.sh /work/main/.carry/s24win2/
#   rm /work/main/.carry/s24win2/bin/{gpu,kernels_compile}; gzip -9 /work/main/.carry/s24win2/bin/*
#   device: bash .carry/s24win2/gpu_s24win2_ab.sh      (carry: .carry/s24win2 .gl; timeout_s 300)
# 1. beside the synth: lily-wgpu's `wide_rows_grid_decodes_the_same_bits` on the GPU (small
#    preset: lm_head on 512 and 1,024 workgroups, the logits bit for bit; it sets the switch in
#    its cases: run without LILY_WGPU_ROWS_WIDE_GRID, which would override them);
# 2. `bench --device wgpu --prefill 512 --decode-ctx 4K,32K --decode-tokens 64 --repeat 1`,
#    OFF / ON, then LILY_PROFILE=1 at 4K OFF / ON (decode's rows of lm_head, in_proj, q/k/v into
#    the summary: lm_head moves, the other two must not), then OFF / ON again.
# Logs in /tmp/s24win2-logs (outside $OUT); $OUT gets summary.txt and the profiles' tails.
set -u
R=${OUT:-$PWD/gpu-logs}; mkdir -p "$R"
L=/tmp/s24win2-logs; mkdir -p "$L"; rm -f "$L/summary.txt"
export OUT=$L
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-225}"
S=$R/summary.txt; cat "$L/summary.txt" >> "$S"
AB_HARD=${HARD:-240}
OFF=${OFF:-LILY_WGPU_ROWS_WIDE_GRID=0}
ON=${ON:-LILY_WGPU_ROWS_WIDE_GRID=1}
K='linear_q4_rows persistent grid doubled (on|off)|rows workers [0-9]+|persistent on ≤ [0-9]+ workgroups|rows_wide_grid without rows_one_word'
P='lin.lm_head|lin.dn.in_proj|lin.attn.qkv'
wgpu_setup
env -u LILY_WGPU_ROWS_WIDE_GRID timeout "$(cap 70)" "$B/wgpu_model" --test-threads=1 --nocapture \
  wide_rows_grid_decodes_the_same_bits > "$OUT/wtests.log" 2>&1
say "wgpu tests rc=$? at $(el)s"
grep -hE "^test .*(ok|FAILED)$|^test result|panicked|wide rows grid" "$OUT/wtests.log" | cut -c1-250 | head -8 | tee -a "$S"
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
cp "$L"/bench-prof-*.log "$R"/ 2>/dev/null
say "done at $(el)s"
