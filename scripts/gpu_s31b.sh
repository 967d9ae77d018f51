#!/usr/bin/env bash
# Session 31's check of main before CI (≤ 275 s by its own clock): the merged wgpu flip and the int8
# cache's long-kernel rule on one staging of main.
#   1. beside the synth: wgpu `down_item_lanes_kernel` and `moe_rounds_kernels` (down_item_lanes on
#      by default, its test within rounding), then the CUDA int8 GPU tests and the shipping
#      configuration's (`shipping_configuration_`, `model_with_int8_kv_cache_matches_cpu_on_`);
#   2. `bench --prefill 512,32K --decode-ctx 4K,32K,128K --decode-tokens 64`, LILY_KV_CACHE=bf16 /
#      int8 (the long bodies from 4,096 keys by the plan's rule), twice while the clock allows;
#   3. wgpu as it ships: `bench --device wgpu --prefill 512 --decode-ctx 4K --decode-tokens 64`.
#   bash .carry/NAME/gpu_s31b.sh   (carry: .carry/NAME .gl; timeout_s 290)
set -u
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-235}"
AB_HARD=${HARD:-275}
wgpu_setup
timeout "$(cap 60)" "$B/wgpu_model" --test-threads=1 --nocapture down_item_lanes_kernel moe_rounds_kernels \
  > "$OUT/tests-wgpu.log" 2>&1
say "wgpu tests rc=$? at $(el)s: $(grep -E '^test .*(ok|FAILED)$|test result|panicked' "$OUT/tests-wgpu.log" | tr '\n' '|' | cut -c1-400)"
timeout "$(cap 120)" "$B/gpu" --ignored --test-threads=1 --nocapture shipping_configuration_ \
  model_with_int8_kv_cache_matches_cpu_on_ decode_batched_steps_int8_kv_cache > "$OUT/tests-cuda.log" 2>&1
say "cuda tests rc=$? at $(el)s: $(grep -E '^test .*(ok|FAILED)$|test result|panicked' "$OUT/tests-cuda.log" | tr '\n' '|' | cut -c1-600)"
wait "$SYN"; say "synth full rc=$? at $(el)s"
for round in 1 2; do
  for kv in bf16 int8; do
    left || { say "bench $kv-$round: skipped (deadline)"; continue; }
    LILY_KV_CACHE=$kv timeout "$(cap 45)" "$B/lily-engine" bench --model "$M" --device cuda --prefill 512,32K \
      --decode-ctx 4K,32K,128K --decode-tokens 64 --repeat 1 > "$OUT/bench-$kv-$round.log" 2>&1
    say "bench $kv-$round rc=$? at $(el)s: $(grep -E '^ +[0-9]+ +[0-9.]+ +[0-9.]+' "$OUT/bench-$kv-$round.log" | tr -s ' ' | tr '\n' '|') $(grep -h -m1 -oE "KV cache (bf16|int8)|long decode attention past keys [0-9]+" "$OUT/bench-$kv-$round.log" | tr '\n' ' ')"
  done
done
BENCH_S=30 wgpu_bench ship 4K "moe_down one item a lane (on|off)"
say "done at $(el)s"
