#!/usr/bin/env bash
# Session 28's first device call (≤ 540 s): the shipping binary's GPU tests (both session-27
# defaults built in), served 4K and served 1 / 4 / 8 clients (gpu_current.sh without the sweep,
# the profiles and wgpu), then s27wrec's A/B (gpu_s27wrec_ab.sh, prefill 512 and 4K beside its
# decode rows). At most 8 files come back: the logs stay in /tmp/s28a-logs, $OUT gets the summary
# and the served and concurrent logs.
#   bash .carry/s28a/gpu_s28a.sh   (carry: .carry/s28a .carry/tokenizer .gl; timeout_s 560)
set -u
H="$(cd "$(dirname "$0")" && pwd)"
R=${OUT:-$PWD/gpu-logs}; mkdir -p "$R"
L=/tmp/s28a-logs; mkdir -p "$L"
OUT=$L SKIP="sweep profile wgpu" DEADLINE=${DEADLINE_A:-300} HARD=${HARD_A:-330} bash "$H/gpu_current.sh"
cat "$L/summary.txt" > "$R/summary.txt"
cp "$L/served.log" "$L/concurrent.log" "$R/" 2>/dev/null
tail -60 "$L/tests-ship.log" > "$R/tests-ship-tail.log" 2>/dev/null
echo "== s27wrec A/B" | tee -a "$R/summary.txt"
OUT=$R PREFILL=512,4K bash "$H/gpu_s27wrec_ab.sh" > /tmp/s28a-wrec.out 2>&1
tail -30 /tmp/s28a-wrec.out
