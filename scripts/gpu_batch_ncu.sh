#!/usr/bin/env bash
# One device call (≈ 3 minutes): Nsight Compute's full set (stall reasons, memory chart,
# occupancy) on the batched step's kernels at 4 rows and on one-token decode's MoE, a 4-layer
# full-width checkpoint, to see why the batched MoE kernels run at ≈ 1 TB/s (issue 32).
# Staged: scripts/stage_gpu.sh DEST, `gzip -9` DEST/bin/*, this script beside. There:
#   bash .carry/NAME/gpu_batch_ncu.sh   (carry .carry/NAME; timeout_s 300)
# Knobs: ROWS (4), SKIP (launches skipped, 24), COUNT (launches profiled a run, 10).
set -u
AB_LAYERS=4
. "$(dirname "$0")/gpu_ab_common.sh" 250
NC=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
wait "$SYN"; say "synth rc=$? at $(el)s"
export LILY_BATCHED_DECODE=1
keys='^  [a-z_0-9]+ *\(|^    (Duration|DRAM Throughput|Memory Throughput|L2 Hit Rate|L1/TEX Hit Rate|Achieved Occupancy|Theoretical Occupancy|Registers Per Thread|Eligible Warps Per Scheduler|Issued Warp Per Scheduler|No Eligible|Warp Cycles Per Issued Instruction|Grid Size|Waves Per SM|Executed Instructions  )|spends|stalled|Block Limit Registers'
prof() {  # NAME REGEX ROWS
  timeout 100 "$NC" --graph-profiling node --clock-control none --set full --kernel-name regex:"$2" \
    --launch-skip "${SKIP:-24}" --launch-count "${COUNT:-10}" "$B/lily-engine" bench --model "$M" --device cuda \
    --prefill 16 --decode-ctx 1K --decode-tokens 4 --repeat 1 --batch "$3" > "$OUT/ncu-$1.txt" 2>&1
  say "ncu $1 rc=$? at $(el)s"
  grep -E "$keys" "$OUT/ncu-$1.txt" | sed -E 's/ {2,}/ /g' | cut -c1-170 | tee -a "$S"
}
prof rows "dec_glu4_rows|dec_down_combine_rows|dec_mma_rows|dec_gemv_rows" "${ROWS:-4}"
left && prof one "^dec_glu4$|^dec_down_combine$" 1
say "done at $(el)s"
