#!/usr/bin/env bash
# Session 26's device call, when only one could be had: the shipping binary's tests and sweep
# (gpu_s26a.sh: tests beside the synth, the sweep), the two helpers' A/Bs (gpu_s26dec_ab.sh, CUDA
# decode; gpu_s26wdec_ab.sh, wgpu decode), then gpu_s26a.sh's served first token and chunk steps,
# each given what is left of the call's budget BUDGET (seconds, default 570) in turn. The synth is
# shared (gpu_ab_common.sh reuses it). Staged by scripts/stage_gpu.sh, the scripts copied beside:
#   bash .carry/NAME/gpu_s26b.sh   (carry: .carry/NAME .carry/tokenizer .gl; timeout_s 595)
# $OUT/summary.txt (tests, sweep, first token, chunk), $OUT/dec/, $OUT/wdec/.
set -u
H="$(cd "$(dirname "$0")" && pwd)"
R=${OUT:-$PWD/gpu-logs}; mkdir -p "$R/dec" "$R/wdec"
T0=$(date +%s); BUDGET=${BUDGET:-570}
left_s() { echo $(( BUDGET - ($(date +%s) - T0) )); }
OUT=$R SKIP="ttft served chunk wgpu concurrent" TEST_S=${TEST_S:-90} DEADLINE=200 HARD=230 bash "$H/gpu_s26a.sh"
l=$(left_s); m=$(( l * ${DEC_SHARE:-40} / 100 ))
echo "dec: ${m}s of ${l}s left" >> "$R/summary.txt"
[ -f "$H/gpu_s26dec_ab.sh" ] && OUT=$R/dec DEADLINE=$(( m - 25 )) HARD=$m bash "$H/gpu_s26dec_ab.sh"
l=$(left_s); m=$(( l * ${WDEC_SHARE:-65} / 100 ))
echo "wdec: ${m}s of ${l}s left" >> "$R/summary.txt"
[ -f "$H/gpu_s26wdec_ab.sh" ] && [ "$m" -gt 60 ] && OUT=$R/wdec DEADLINE=$(( m - 25 )) HARD=$m bash "$H/gpu_s26wdec_ab.sh"
l=$(left_s); echo "ttft/chunk: ${l}s left" >> "$R/summary.txt"
[ "$l" -gt 40 ] && OUT=$R/rest SKIP="tests sweep served wgpu concurrent" DEADLINE=$(( l - 30 )) HARD=$(( l - 5 )) bash "$H/gpu_s26a.sh"
cp "$R/rest/summary.txt" "$R/summary-rest.txt" 2>/dev/null; rm -rf "$R/rest"
echo "all done at $(( $(date +%s) - T0 ))s" >> "$R/summary.txt"
