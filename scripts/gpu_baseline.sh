#!/usr/bin/env bash
# Session 22's first call (≤ 9 minutes): today's main as it ships, the numbers the session's
# branches start from, on whichever card comes. Staged beside gpu_ab_common.sh:
#   bash .carry/next/gpu_baseline.sh   (carry: .carry/next .carry/tokenizer .gl; timeout_s 590)
#   1. wgpu through Vulkan: selftest on a 4-layer full-width model (a first Mac user's report);
#      `bench --prefill 512,4K --decode-ctx 4K,32K`; one LILY_PROFILE=1 run (prefill 4K, decode
#      4K) whose per-kernel tables come back as wgpu-profile.txt;
#   2. CUDA: `bench --prefill 512,4K,32K --decode-ctx 4K`; per-kernel prefill profiles at 512
#      and 4K (cuda-prof-N.txt);
#   3. Nsight Compute on prefill's routed-expert grouped GEMMs at 512 and 4K (ncu-keys.txt).
# Only the summary and those tables come back ($OUT holds ≤ 8 files); the logs stay in $L.
set -u
AB_TOKENIZER=1
OUT_KEEP=${OUT:-$PWD/gpu-logs}
L=/tmp/baseline-logs; mkdir -p "$L"
OUT=$L
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-500}"
AB_HARD=${HARD:-575}
R=$OUT_KEEP; mkdir -p "$R"
S=$R/summary.txt
E=$B/lily-engine
wgpu_setup > /dev/null 2>&1
"$E" --version >> "$S" 2>&1
wgpu_synth4
wait "$SYN4"
wgpu_selftest selftest-wgpu
grep -v XDG "$L/selftest-wgpu.log" | tail -60 > "$R/selftest-wgpu.txt"
wait "$SYN"; say "synth full rc=$? at $(el)s"
PREFILL=512,4K BENCH_S=120 wgpu_bench wgpu 4K,32K "[^;]*" LILY_NOTHING=1
if left; then
  LILY_PROFILE=1 timeout "$(cap 90)" "$E" bench --model "$M" --device wgpu --prefill 4K \
    --decode-ctx 4K --decode-tokens 16 --repeat 1 > "$L/wgpu-prof.log" 2>&1
  say "wgpu profile rc=$? at $(el)s"
  grep -v -E "XDG|INFO" "$L/wgpu-prof.log" | tail -150 > "$R/wgpu-profile.txt"
fi
if left; then
  timeout "$(cap 90)" "$E" bench --model "$M" --device cuda --prefill 512,4K,32K --decode-ctx 4K \
    --decode-tokens 64 --repeat 1 > "$L/cuda.log" 2>&1
  say "cuda rc=$? at $(el)s: $(grep -E '^ +[0-9]+[KM]? +[0-9.]+ +[0-9.]+' "$L/cuda.log" | tr -s ' ' | tr '\n' '|')"
fi
for n in 512 4K; do
  left || break
  LILY_PROFILE=1 timeout "$(cap 60)" "$E" bench --model "$M" --device cuda --prefill $n --decode-ctx 1 \
    --decode-tokens 1 --repeat 1 > "$L/cuda-prof-$n.log" 2>&1
  say "cuda prefill profile $n rc=$? at $(el)s"
  grep -v INFO "$L/cuda-prof-$n.log" | tail -60 > "$R/cuda-prof-$n.txt"
done
NC=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
keys='^  [a-z_0-9]+ *\(|^    (Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|L2 Hit Rate|Achieved Occupancy|Theoretical Occupancy|Registers Per Thread|Eligible Warps Per Scheduler|Issued Warp Per Scheduler|Warp Cycles Per Issued Instruction|Grid Size|Block Size|Waves Per SM|Dynamic Shared Memory Per Block|Executed Instructions  )|spends|Block Limit|stall|Stall'
for n in 512 4K; do
  left || break
  timeout "$(cap 100)" "$NC" --clock-control none --set full --kernel-name regex:"gemm_grouped_wgb" \
    --launch-count 3 "$E" bench --model "$M" --device cuda --prefill $n --decode-ctx 1 \
    --decode-tokens 1 --repeat 1 > "$L/ncu-grouped-$n.txt" 2>&1
  say "ncu grouped GEMM $n rc=$? at $(el)s"
  { echo "== $n"; grep -E "$keys" "$L/ncu-grouped-$n.txt" | sed -E 's/ {2,}/ /g' | cut -c1-220; } >> "$R/ncu-keys.txt"
done
say "done at $(el)s"
