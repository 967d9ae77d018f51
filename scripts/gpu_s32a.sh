#!/usr/bin/env bash
# Session 32's first call (≤ 560 s by its own clock): the shipping binary's GPU tests, which
# session 31 could not finish on cold caches, then the bf16 / int8 KV-cache decision's numbers.
#   1. beside the synth, in parallel (cold NVRTC and Vulkan caches take 60–100 s each): wgpu
#      `down_item_lanes_kernel` / `moe_rounds_kernels`; CUDA `shipping_configuration_`,
#      `decode_batched_steps_match_each_sequence_alone`, `batched_decode_mma_rows_match_cpu` and
#      the int8 cache's two tests;
#   2. CUDA's sweep as it ships (bf16 cache): `bench --prefill 512,4K,32K,128K --decode-ctx
#      256,4K,32K,128K --decode-tokens 128 --repeat 1`;
#   3. the same decode contexts with LILY_KV_CACHE=int8 (prefill 512 only);
#   4. served 4K (serve_bench.py, 256 greedy tokens) with the bf16 cache, then with int8;
#   5. the 8-row step's per-kernel profile at 1K (LILY_PROFILE=1 --batch 8).
#   bash .carry/NAME/gpu_s32a.sh   (carry: .carry/NAME .carry/tokenizer .gl; timeout_s 590)
set -u
AB_TOKENIZER=1
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-480}"
AB_HARD=${HARD:-560}
E=$B/lily-engine
wgpu_setup
timeout "$(cap 240)" "$B/wgpu_model" --test-threads=1 --nocapture down_item_lanes_kernel moe_rounds_kernels \
  > "$OUT/tests-wgpu.log" 2>&1 &
WT=$!
timeout "$(cap 260)" "$B/gpu" --ignored --test-threads=1 --nocapture shipping_configuration_ \
  decode_batched_steps_match_each_sequence_alone batched_decode_mma_rows_match_cpu \
  model_with_int8_kv_cache_matches_cpu_on_ decode_batched_steps_int8_kv_cache > "$OUT/tests-cuda.log" 2>&1
say "cuda tests rc=$? at $(el)s: $(grep -E '^test .*(ok|FAILED)$|test result|panicked' "$OUT/tests-cuda.log" | tr '\n' '|' | cut -c1-900)"
wait "$WT"
say "wgpu tests rc=$? at $(el)s: $(grep -E '^test .*(ok|FAILED)$|test result|panicked' "$OUT/tests-wgpu.log" | tr '\n' '|' | cut -c1-400)"
wait "$SYN"; say "synth full rc=$? at $(el)s"
if left; then
  timeout "$(cap 170)" "$E" bench --model "$M" --device cuda --prefill 512,4K,32K,128K \
    --decode-ctx 256,4K,32K,128K --decode-tokens 128 --repeat 1 > "$OUT/sweep-bf16.log" 2>&1
  say "cuda sweep (bf16 cache) rc=$? at $(el)s: $(grep -E '^ +[0-9]+[KM]? +[0-9.]+ +[0-9.]+' "$OUT/sweep-bf16.log" | tr -s ' ' | tr '\n' '|')"
fi
if left; then
  LILY_KV_CACHE=int8 timeout "$(cap 110)" "$E" bench --model "$M" --device cuda --prefill 512 \
    --decode-ctx 256,4K,32K,128K --decode-tokens 128 --repeat 1 > "$OUT/sweep-int8.log" 2>&1
  say "cuda decode (int8 cache) rc=$? at $(el)s: $(grep -E '^ +[0-9]+[KM]? +[0-9.]+ +[0-9.]+' "$OUT/sweep-int8.log" | tr -s ' ' | tr '\n' '|') $(grep -h -m1 -oE 'int8 KV cache' "$OUT/sweep-int8.log")"
fi
export PYTHONUNBUFFERED=1 LILY_ENGINE_BIN="$E"
for kv in bf16 int8; do
  left || { say "served $kv: skipped (deadline) at $(el)s"; continue; }
  LILY_KV_CACHE=$kv timeout "$(cap 80)" python3 "$HERE/serve_bench.py" --model "$M" --device cuda \
    --prompt-tokens 4096 --max-tokens 256 --repeat 2 > "$OUT/served-$kv.log" 2>&1
  say "served 4K ($kv cache) rc=$? at $(el)s: $(grep -E '^(completions|chat)|rror' "$OUT/served-$kv.log" | tail -2 | tr '\n' '|' | cut -c1-400)"
done
if left; then
  LILY_PROFILE=1 timeout "$(cap 60)" "$E" bench --model "$M" --device cuda --prefill 1K --decode-ctx 1K \
    --decode-tokens 16 --repeat 1 --batch 8 > "$OUT/profile-8rows.log" 2>&1
  say "profile 8 rows at 1K rc=$? at $(el)s:"
  grep -A40 -E "kernel profile" "$OUT/profile-8rows.log" | grep -v INFO | cut -c1-160 | tail -34 | tee -a "$S"
fi
say "done at $(el)s"
