#!/usr/bin/env bash
# One device call (≤ 9 minutes on an H100 / H200) for docs/perf-notes.md's current-numbers table
# with the shipping binary, in order of what matters when time runs short:
#   1. while the full-size checkpoint is synthesised: the GPU tests of the shipping batched step
#      and one-token configuration (decode_batched_steps_match_each_sequence_alone_on_*,
#      batched_decode_mma_rows_match_cpu, shipping_configuration_*), TEST_S (110) seconds;
#   2. CUDA's one sweep: `bench --prefill 512,4K,32K,128K --decode-ctx 256,4K,32K,128K
#      --decode-tokens 128 --repeat 1` (the table's command);
#   3. served at 4K (scripts/serve_bench.py: a 4,096-token prompt, 256 greedy tokens, twice),
#      beside the bench;
#   4. served 1 / 4 / 8 clients (scripts/concurrent_bench.py: a 1,024-token prompt each, 256
#      greedy tokens, the default --max-batch), issue 32's figures;
#   5. per-kernel profiles (LILY_PROFILE=1): the one-token step at 4K, the 8-row step at 1K;
#   6. wgpu through Vulkan as it ships on this adapter: `bench --prefill 512,4K --decode-ctx 4K,32K
#      --decode-tokens 64`.
# Summary on stdout and in $OUT/summary.txt, logs beside. No step starts past DEADLINE (440 s);
# no run's timeout reaches past HARD (520 s).
# Here: `CARGO_TARGET_DIR=/work/main/target bash scripts/stage_gpu.sh /work/main/.carry/next`
# (it copies this script, concurrent_bench.py and serve_bench.py beside the binaries),
# `gzip -9 /work/main/.carry/next/bin/*`, the tokenizer into .carry/tokenizer/ (its tokenizer.json
# gzipped) and the Vulkan loader debs into .gl (../.library/device/README.md). There:
#   bash .carry/next/gpu_current.sh   (carry: .carry/next .carry/tokenizer .gl; timeout_s 560)
# Knobs: SKIP (parts left out: tests sweep served concurrent profile wgpu), TEST_S, DEADLINE, HARD.
set -u
AB_TOKENIZER=1
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-440}"
AB_HARD=${HARD:-520}
E=$B/lily-engine
step() {  # step NAME: whether NAME runs (not skipped, before the deadline)
  if skipped "$1"; then say "$1: skipped (SKIP)"; return 1; fi
  if ! left; then say "$1: skipped (deadline) at $(el)s"; return 1; fi
}

# 1. GPU tests, beside the synth.
if step tests; then
  t=${TEST_S:-110}
  timeout "$(cap $(( t * 2 / 3 )))" "$B/gpu" --ignored --test-threads=1 --nocapture \
    decode_batched_steps_match_each_sequence_alone batched_decode_mma_rows_match_cpu > "$OUT/tests-batch.log" 2>&1
  say "tests (batched step as it ships, dec_mma_rows / _deep against the CPU) rc=$? at $(el)s"
  rest=$(( t - $(el) )); [ "$rest" -lt 20 ] && rest=20
  timeout "$(cap "$rest")" "$B/gpu" --ignored --test-threads=1 --nocapture shipping_configuration \
    > "$OUT/tests-ship.log" 2>&1
  say "tests (shipping_configuration_*) rc=$? at $(el)s"
  grep -hE "^test .*(ok|FAILED)$|^test result|panicked|rel_l2 [0-9]" "$OUT/tests-batch.log" "$OUT/tests-ship.log" \
    2>/dev/null | grep -v "^MODEL" | cut -c1-300 | head -20 | tee -a "$S"
fi
wait "$SYN"; say "synth full rc=$? at $(el)s"

# 2. CUDA's sweep.
if step sweep; then
  timeout "$(cap 170)" "$E" bench --model "$M" --device cuda --prefill 512,4K,32K,128K \
    --decode-ctx 256,4K,32K,128K --decode-tokens 128 --repeat 1 > "$OUT/sweep.log" 2>&1
  say "cuda sweep rc=$? at $(el)s:"
  grep -E "^ +[0-9]|tok/s|error|Error" "$OUT/sweep.log" | grep -v INFO | tee -a "$S"
fi

# 3. Served at 4K.
export PYTHONUNBUFFERED=1 LILY_ENGINE_BIN="$E"
if step served; then
  timeout "$(cap 90)" python3 "$HERE/serve_bench.py" --model "$M" --device cuda --prompt-tokens 4096 \
    --max-tokens 256 --repeat 2 > "$OUT/served.log" 2>&1
  say "served 4K rc=$? at $(el)s: $(grep -E '^(completions|chat)|rror' "$OUT/served.log" | tail -2 | tr '\n' '|' | cut -c1-400)"
fi

# 4. Concurrent clients.
if step concurrent; then
  timeout "$(cap 120)" python3 "$HERE/concurrent_bench.py" --model "$M" --device cuda --prompt-tokens 1024 \
    --max-tokens 256 --clients 1,4,8 > "$OUT/concurrent.log" 2>&1
  say "served 1,4,8 clients rc=$? at $(el)s:"
  grep -E "clients:|rror" "$OUT/concurrent.log" | cut -c1-220 | head -5 | tee -a "$S"
fi

# 5. The one-token step's per-kernel profile at 4K (graphs off: each launch timed).
if step profile; then
  LILY_PROFILE=1 timeout "$(cap 60)" "$E" bench --model "$M" --device cuda --prefill 256 --decode-ctx 4K \
    --decode-tokens 16 --repeat 1 > "$OUT/profile-4k.log" 2>&1
  say "profile 4K rc=$? at $(el)s:"
  grep -A40 -E "kernel profile" "$OUT/profile-4k.log" | grep -v INFO | cut -c1-160 | head -34 | tee -a "$S"
  if left; then
    LILY_PROFILE=1 timeout "$(cap 60)" "$E" bench --model "$M" --device cuda --prefill 1K --decode-ctx 1K \
      --decode-tokens 16 --repeat 1 --batch 8 > "$OUT/profile-8rows.log" 2>&1
    say "profile 8 rows at 1K rc=$? at $(el)s:"
    grep -A40 -E "kernel profile" "$OUT/profile-8rows.log" | grep -v INFO | cut -c1-160 | tail -34 | tee -a "$S"
  fi
fi

# 6. wgpu through Vulkan.
if step wgpu; then
  wgpu_setup
  PREFILL=512,4K BENCH_S=110 wgpu_bench wgpu 4K,32K "f16 (activations|KV cache): [a-z]+ \([^)]*\)"
fi
say "done at $(el)s"
