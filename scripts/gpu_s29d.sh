#!/usr/bin/env bash
# Session 29, the second call (one command, ≤ 560 s): the A/Bs of branches s29dn (CUDA
# `dn_rows_loop`, issue 32), s29wout (wgpu `out_lean`) and s29wglu (wgpu `glu_split`, issue 29),
# all merged off, one staging of main, each script cut to DEADLINE 140 / HARD 165 (its tests and
# two OFF / ON rounds; the profiles only where time is left); then, if the clock allows, served
# 1 / 4 / 8 clients with `dn_rows_loop` on.
#   bash .carry/NAME/gpu_s29d.sh   (carry: .carry/NAME .carry/tokenizer .gl; timeout_s 590)
# gpu_s29dn_ab.sh, gpu_s29wout_ab.sh and gpu_s29wglu_ab.sh are copied beside it.
H="$(cd "$(dirname "$0")" && pwd)"
T0=$(date +%s)
export DEADLINE=${DEADLINE:-140} HARD=${HARD:-165}
AB_TOKENIZER=1 bash "$H/gpu_s29dn_ab.sh"
bash "$H/gpu_s29wout_ab.sh"
bash "$H/gpu_s29wglu_ab.sh"
S=${OUT:-$PWD/gpu-logs}/summary.txt
if [ $(( $(date +%s) - T0 )) -lt 500 ]; then
  LILY_DN_ROWS_LOOP=1 PYTHONUNBUFFERED=1 LILY_ENGINE_BIN="$H/bin/lily-engine" timeout 50 \
    python3 "$H/concurrent_bench.py" --model /dev/shm/full-mlx --device cuda --prompt-tokens 1024 \
    --max-tokens 256 --clients 1,4,8 > /tmp/conc-dn-on.log 2>&1
  echo "served 1,4,8 clients with dn_rows_loop on rc=$?" | tee -a "$S"
  grep -E "clients:|rror" /tmp/conc-dn-on.log | cut -c1-220 | tee -a "$S"
fi
echo "all done at $(( $(date +%s) - T0 ))s" | tee -a "$S"
