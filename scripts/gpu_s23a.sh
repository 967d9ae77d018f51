#!/usr/bin/env bash
# Session 23, call 2 (≤ 7 minutes): the shipping binary after the session's two flips
# (wgmma_lean_dequant, wgpu coop_rows 128), on whichever card comes. Staged beside
# gpu_ab_common.sh, serve_bench.py and concurrent_bench.py (scripts/stage_gpu.sh):
#   bash .carry/s23a/gpu_s23a.sh   (carry: .carry/s23a .carry/tokenizer .gl; timeout_s 590)
#   1. GPU tests `shipping_configuration_*`, beside the synth;
#   2. CUDA's sweep (prefill 512 / 4K / 32K / 128K, decode 256 / 4K / 32K / 128K);
#   3. served at 4K: decode (serve_bench.py, 256 greedy tokens, twice) and time to first token
#      (three 4,096-token prompts);
#   4. Nsight Compute on the one-token step's products at 4K (ncu-decode.txt: issue 30);
#   5. wgpu through Vulkan: prefill 512 / 4K with `--repeat 3`, coop_rows 64 / 128, and 128 with
#      chunks of 4,096 tokens (LILY_WGPU_CHUNK).
# Only the summary, ncu-decode.txt and a few logs come back ($OUT holds ≤ 8 files).
set -u
AB_TOKENIZER=1
R=${OUT:-$PWD/gpu-logs}; mkdir -p "$R"
L=/tmp/s23a-logs; mkdir -p "$L"; OUT=$L
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-440}"
AB_HARD=${HARD:-540}
S=$R/summary.txt
E=$B/lily-engine
( while sleep 20; do cp "$S" "$R/summary.txt" 2>/dev/null; done ) &
timeout "$(cap "${TEST_S:-100}")" "$B/gpu" --ignored --test-threads=1 --nocapture shipping_configuration \
  > "$L/tests-ship.log" 2>&1
say "tests (shipping_configuration_*) rc=$? at $(el)s"
grep -hE "^test .*(ok|FAILED)$|^test result|panicked" "$L/tests-ship.log" | cut -c1-300 | head -12 | tee -a "$S"
wait "$SYN"; say "synth full rc=$? at $(el)s"
if left; then
  timeout "$(cap 150)" "$E" bench --model "$M" --device cuda --prefill 512,4K,32K,128K \
    --decode-ctx 256,4K,32K,128K --decode-tokens 128 --repeat 1 > "$L/sweep.log" 2>&1
  say "cuda sweep rc=$? at $(el)s:"
  grep -E "^ +[0-9]|tok/s|error|Error" "$L/sweep.log" | grep -v INFO | tee -a "$S"
fi
export PYTHONUNBUFFERED=1 LILY_ENGINE_BIN="$E"
if left; then
  timeout "$(cap 90)" python3 "$HERE/serve_bench.py" --model "$M" --device cuda --prompt-tokens 4096 \
    --max-tokens 256 --repeat 2 > "$L/served.log" 2>&1
  say "served 4K rc=$? at $(el)s: $(grep -E '^(completions|chat)|rror' "$L/served.log" | tail -2 | tr '\n' '|' | cut -c1-400)"
  cp "$L/served.log" "$R/"
fi
if left; then
  timeout "$(cap 70)" python3 "$HERE/serve_bench.py" --model "$M" --device cuda --prompt-tokens 4096 \
    --ttft-only --ttft-repeat 3 > "$L/ttft.log" 2>&1
  say "served TTFT 4K rc=$? at $(el)s"
  grep -v INFO "$L/ttft.log" | tail -12 | tee -a "$S"
fi
NC=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
keys='^  [a-z_0-9]+.*\(|^    (Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|L2 Hit Rate|Achieved Occupancy|Theoretical Occupancy|Registers Per Thread|Eligible Warps Per Scheduler|Issued Warp Per Scheduler|No Eligible|Warp Cycles Per Issued Instruction|Grid Size|Block Size|Waves Per SM|Dynamic Shared Memory Per Block|Static Shared Memory Per Block|Executed Instructions  |Elapsed Cycles)|spends|Block Limit|stall|Stall'
if left; then
  timeout "$(cap 110)" "$NC" --clock-control none --set full \
    --kernel-name regex:"^(dec_glu4_x8x2|dec_down_combine_x8x2|dec_gemv4w_x8x2|dec_gemv4_x8x2|dec_gemv8)$" \
    --launch-skip 40 --launch-count 11 "$E" bench --model "$M" --device cuda --prefill 256 --decode-ctx 4K \
    --decode-tokens 4 --repeat 1 > "$L/ncu-decode-full.txt" 2>&1
  say "ncu decode rc=$? at $(el)s"
  grep -E "$keys" "$L/ncu-decode-full.txt" | sed -E 's/ {2,}/ /g' | cut -c1-240 > "$R/ncu-decode.txt"
fi
if left; then
  wgpu_setup > /dev/null 2>&1
  for cfg in "LILY_WGPU_COOP_ROWS=64" "LILY_WGPU_COOP_ROWS=128" "LILY_WGPU_COOP_ROWS=128 LILY_WGPU_CHUNK=4096"; do
    left || break
    # shellcheck disable=SC2086
    env $cfg timeout "$(cap 60)" "$E" bench --model "$M" --device wgpu --prefill 512,4K --decode-ctx 1 \
      --decode-tokens 1 --repeat 3 > "$L/w.log" 2>&1
    say "wgpu $cfg rc=$? at $(el)s: $(grep -E '^ +[0-9]+[KM]? +[0-9.]+ +[0-9.]+' "$L/w.log" | tr -s ' ' | tr '\n' '|')"
  done
fi
say "done at $(el)s"
cp "$S" "$R/summary.txt"; cp "$L/sweep.log" "$L/tests-ship.log" "$R/" 2>/dev/null
kill %1 2>/dev/null
