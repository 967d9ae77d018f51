#!/usr/bin/env bash
# Session 24, second device call (≤ 9.5 minutes): the two branches merged off, one after the other
# on one card: scripts/gpu_s24att_ab.sh (`wgmma_attention_pipelined`: its GPU tests, prefill
# 4K / 32K / 128K off / on twice), then scripts/gpu_s24win_ab.sh (`rows_one_word`: its GPU test,
# wgpu decode off / on twice with a profile of each). Staged by scripts/stage_gpu.sh with the three
# scripts beside the binaries:
#   bash .carry/NAME/gpu_s24b.sh     (carry: .carry/NAME .gl; timeout_s 600)
set -u
H="$(cd "$(dirname "$0")" && pwd)"
R=${OUT:-$PWD/gpu-logs}; mkdir -p "$R"; export OUT=$R
T0=$(date +%s)
DEADLINE=${ATT_DEADLINE:-220} HARD=${ATT_HARD:-270} REPEAT=${REPEAT:-1} BENCH_S=55 bash "$H/gpu_s24att_ab.sh"
used=$(( $(date +%s) - T0 ))
echo "== s24win after ${used}s" >> "$R/summary.txt"
OUT=$R DEADLINE=$(( ${END:-520} - used )) HARD=$(( ${HARD_END:-580} - used )) bash "$H/gpu_s24win_ab.sh"
echo "== done after $(( $(date +%s) - T0 ))s" >> "$R/summary.txt"
