#!/usr/bin/env bash
# Session 21's second measuring call (≤ 9 minutes): gpu_next.sh's wgpu A/B (decode and prefill,
# WGPU_ON against WGPU_OFF, PREFILL=512,4K), the served wgpu path with WGPU_ON
# (scripts/serve_bench.py, a 4K prompt, 128 greedy tokens), then Nsight Compute on prefill's
# routed-expert grouped GEMMs at 512 and 4K (issue 31's next kernel). Staged beside gpu_next.sh;
#   WGPU_ON="LILY_A=1 LILY_B=1" WGPU_OFF="LILY_A=0 LILY_B=0" bash .carry/next/gpu_wgpu_ncu.sh
# (carry: .carry/next .carry/tokenizer .gl; timeout_s 590).
# WTESTS: lily-wgpu model tests (the staged bin/wgpu_model) run first on the Vulkan GPU under
# WGPU_ON, beside the synth.
set -u
HERE="$(cd "$(dirname "$0")" && pwd)"
AB_TOKENIZER=1
. "$HERE/gpu_ab_common.sh" 470
AB_HARD=560
wgpu_setup > /dev/null 2>&1
if [ -n "${WTESTS:-}" ]; then
  # shellcheck disable=SC2086
  env ${WGPU_ON:-LILY_NOTHING=1} timeout 120 "$B/wgpu_model" --test-threads=1 --nocapture $WTESTS > "$OUT/wtests.log" 2>&1
  say "wgpu tests ($WTESTS) rc=$? at $(el)s"
  grep -hE "^test .*(ok|FAILED)$|^test result|panicked|refused|linear_q4_coop" "$OUT/wtests.log" | cut -c1-250 | head -20 | tee -a "$S"
fi
wait "$SYN"
export PREFILL=${PREFILL:-512,4K}
SKIP="tests cuda agree served prefill" DEADLINE=$((${DEADLINE:-300} - $(el))) HARD=$((330 - $(el))) bash "$HERE/gpu_next.sh"
export PYTHONUNBUFFERED=1 LILY_ENGINE_BIN="$B/lily-engine"
if left && ! skipped served; then
  # shellcheck disable=SC2086
  env ${WGPU_ON:-LILY_NOTHING=1} timeout "$(cap 150)" python3 "$HERE/serve_bench.py" --model "$M" --device wgpu \
    --prompt-tokens 4096 --max-tokens 128 --repeat 2 > "$OUT/served-wgpu.log" 2>&1
  say "served wgpu rc=$? at $(el)s:"; grep -iE "tok/s|rror" "$OUT/served-wgpu.log" | cut -c1-200 | head -6 | tee -a "$S"
fi
NC=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
keys='^  [a-z_0-9]+ *\(|^    (Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|L2 Hit Rate|Achieved Occupancy|Theoretical Occupancy|Registers Per Thread|Eligible Warps Per Scheduler|Issued Warp Per Scheduler|Warp Cycles Per Issued Instruction|Grid Size|Block Size|Waves Per SM|Dynamic Shared Memory Per Block|Executed Instructions  )|spends|Block Limit'
for n in 512 4K; do
  left || break
  timeout "$(cap 100)" "$NC" --clock-control none --set full --kernel-name regex:"gemm_grouped_wgb" \
    --launch-count 3 "$B/lily-engine" bench --model "$M" --device cuda --prefill $n --decode-ctx 1 \
    --decode-tokens 1 --repeat 1 > "$OUT/ncu-grouped-$n.txt" 2>&1
  say "ncu grouped GEMM $n rc=$? at $(el)s"
  grep -E "$keys" "$OUT/ncu-grouped-$n.txt" | sed -E 's/ {2,}/ /g' | cut -c1-200 >> "$OUT/ncu-gemm-keys.txt"
  gzip -f "$OUT/ncu-grouped-$n.txt"
done
say "done at $(el)s"
