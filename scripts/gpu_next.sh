#!/usr/bin/env bash
# Session 15's first waiting device call (≤ 9.5 minutes), two host-side or wgpu A/Bs that need no
# full-checkpoint CUDA run, one after the other, each with its own summary:
#   1. scripts/gpu_served_batch.sh (issue 32; $OUT/served): the batched step's GPU tests (kept
#      device samplers, the pipelined step), bench --batch 1,4,8 plain / penalised / penalised
#      and pipelined, served 1/4/8 clients with the pipelined batched step on and 4/8 off, the
#      base binary's 4/8 beside (bin/lily-engine-base, main 121fc36);
#   2. scripts/wgpu_all_ab.sh (issue 29; $OUT/wgpu): the wgpu defaults against dn_early, the last
#      wgpu decode switch waiting for its A/B.
# Staged (scripts/stage_gpu.sh DEST, `gzip -9` DEST/bin/*, bin/lily-engine-base.gz beside) with
# this script, gpu_served_batch.sh, wgpu_all_ab.sh, gpu_ab_common.sh,
# concurrent_bench.py, serve_bench.py and agreement_table.py in DEST. There:
#   bash .carry/next/gpu_next.sh   (carry: .carry/next .carry/tokenizer .gl; timeout_s 600)
# Knobs: SERVED_DEADLINE (200), WGPU_DEADLINE (200): each script's own DEADLINE.
set -u
H="$(cd "$(dirname "$0")" && pwd)"
R=${OUT:-$PWD/gpu-logs}
mkdir -p "$R/served" "$R/wgpu"
echo "==== served batched step"
OUT=$R/served DEADLINE=${SERVED_DEADLINE:-200} bash "$H/gpu_served_batch.sh" 2>&1 | grep -v "server log"
echo "==== wgpu dn_early"
OUT=$R/wgpu DEADLINE=${WGPU_DEADLINE:-200} bash "$H/wgpu_all_ab.sh" 2>&1
