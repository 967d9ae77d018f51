#!/usr/bin/env bash
# Session 25's last device call: three A/Bs in one call, each on its own clock, each given what is
# left of the call's budget BUDGET (seconds, default 520) in turn: the CUDA prefill chunk
# (gpu_s25chunk.sh, ≈ 200 s with the synth), the CUDA MoE's bulk copies (gpu_s25moe_ab.sh) and
# wgpu's decode step (gpu_s25wdec_ab.sh). The synth is shared (gpu_ab_common.sh reuses it).
# Staged by scripts/stage_gpu.sh, the three scripts copied beside:
#   bash .carry/NAME/gpu_s25final.sh      (carry: .carry/NAME .gl; timeout_s BUDGET + 10)
# $OUT/summary.txt (chunk), $OUT/moe/, $OUT/wdec/.
set -u
H="$(cd "$(dirname "$0")" && pwd)"
R=${OUT:-$PWD/gpu-logs}; mkdir -p "$R/moe" "$R/wdec"
T0=$(date +%s); BUDGET=${BUDGET:-520}
left_s() { echo $(( BUDGET - ($(date +%s) - T0) )); }
SKIP="${SKIP_CHUNK:-c16384}" DEADLINE=$(( ${CHUNK_S:-200} - 25 )) HARD=${CHUNK_S:-200} bash "$H/gpu_s25chunk.sh"
l=$(left_s); m=$(( l * ${MOE_SHARE:-55} / 100 ))
echo "moe: ${m}s of ${l}s left" >> "$R/summary.txt"
[ -f "$H/gpu_s25moe_ab.sh" ] && OUT=$R/moe DEADLINE=$(( m - 30 )) HARD=$m bash "$H/gpu_s25moe_ab.sh"
l=$(left_s); echo "wdec: ${l}s left" >> "$R/summary.txt"
[ -f "$H/gpu_s25wdec_ab.sh" ] && [ "$l" -gt 60 ] && OUT=$R/wdec DEADLINE=$(( l - 30 )) HARD=$(( l - 5 )) bash "$H/gpu_s25wdec_ab.sh"
echo "all done at $(( $(date +%s) - T0 ))s" >> "$R/summary.txt"
