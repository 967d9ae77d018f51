#!/usr/bin/env bash
# Session 26, first call (≤ 590 s): the shipping binary of main 78e30f6 (moe_bulk and attn_v_early
# on) on whatever card comes, for the four issues' tables, most important first:
#   1. GPU tests of the shipping configuration and the batched step, beside the synth (TEST_S 100);
#   2. CUDA's one sweep: `bench --prefill 512,4K,32K,128K --decode-ctx 256,4K,32K,128K
#      --decode-tokens 128 --repeat 1`;
#   3. served first token at 4K and 128K (serve_bench.py --ttft-only --ttft-tokens 4096,131072
#      --ttft-repeat 2 --ctx-size 0: two warm-ups, then two prompts of each length sharing no prefix);
#   4. served decode at 4K (a 4,096-token prompt, 256 greedy tokens, twice);
#   5. the prefill chunk: `bench --prefill 32K,128K` at LILY_PREFILL_CHUNK 8191 / 4096 / 8191
#      (the sweep's own run is the first 4,096 round);
#   6. wgpu through Vulkan as it ships: `bench --device wgpu --prefill 512,4K --decode-ctx 4K,32K`;
#   7. served 1 / 4 / 8 clients (concurrent_bench.py: 1,024-token prompts, 256 greedy tokens).
# Staged: stage_gpu.sh into .carry/NAME, this script copied beside, `gzip -9 bin/*`; the tokenizer
# in .carry/tokenizer (tokenizer.json gzipped), the Vulkan loader debs in .gl. There:
#   bash .carry/NAME/gpu_s26a.sh   (carry: .carry/NAME .carry/tokenizer .gl; timeout_s 595)
set -u
AB_TOKENIZER=1
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-500}"
AB_HARD=${HARD:-580}
E=$B/lily-engine
step() { if skipped "$1"; then say "$1: skipped (SKIP)"; return 1; fi
  if ! left; then say "$1: skipped (deadline) at $(el)s"; return 1; fi; }
rows() { grep -E '^ +[0-9]+[KM]? +[0-9.]+ +[0-9.]+' "$1" | tr -s ' ' | tr '\n' '|'; }

if step tests; then
  t=${TEST_S:-100}
  timeout "$(cap $(( t / 2 )))" "$B/gpu" --ignored --test-threads=1 --nocapture shipping_configuration \
    > "$OUT/tests-ship.log" 2>&1
  say "tests (shipping_configuration_*) rc=$? at $(el)s"
  rest=$(( t - $(el) )); [ "$rest" -lt 20 ] && rest=20
  timeout "$(cap "$rest")" "$B/gpu" --ignored --test-threads=1 --nocapture \
    decode_batched_steps_match_each_sequence_alone batched_decode_mma_rows_match_cpu glu_bulk_gives > "$OUT/tests-batch.log" 2>&1
  say "tests (batched step, dec_mma_rows, glu_bulk) rc=$? at $(el)s"
  grep -hE "^test .*(ok|FAILED)$|^test result|panicked|rel_l2 [0-9]" "$OUT/tests-ship.log" "$OUT/tests-batch.log" \
    2>/dev/null | grep -v "^MODEL" | cut -c1-300 | head -20 | tee -a "$S"
fi
wait "$SYN"; say "synth full rc=$? at $(el)s"

if step sweep; then
  timeout "$(cap 170)" "$E" bench --model "$M" --device cuda --prefill 512,4K,32K,128K \
    --decode-ctx 256,4K,32K,128K --decode-tokens 128 --repeat 1 > "$OUT/sweep.log" 2>&1
  say "cuda sweep rc=$? at $(el)s:"
  grep -E "^ +[0-9]|tok/s|error|Error|prefill chunk" "$OUT/sweep.log" | grep -v INFO | tee -a "$S"
fi

export PYTHONUNBUFFERED=1 LILY_ENGINE_BIN="$E"
if step ttft; then
  timeout "$(cap 120)" python3 "$HERE/serve_bench.py" --model "$M" --device cuda --prompt-tokens 4096 \
    --ctx-size 0 --ttft-only --ttft-tokens 4096,131072 --ttft-repeat 2 > "$OUT/ttft.log" 2>&1
  say "served ttft 4K,128K rc=$? at $(el)s:"
  grep -vE "^\s*$" "$OUT/ttft.log" | tail -12 | cut -c1-300 | tee -a "$S"
fi

if step served; then
  timeout "$(cap 80)" python3 "$HERE/serve_bench.py" --model "$M" --device cuda --prompt-tokens 4096 \
    --max-tokens 256 --repeat 2 > "$OUT/served.log" 2>&1
  say "served 4K rc=$? at $(el)s: $(grep -E '^(completions|chat)|rror' "$OUT/served.log" | tail -2 | tr '\n' '|' | cut -c1-400)"
fi

if step chunk; then
  for c in 8191 4096 8191; do
    left || { say "chunk $c: skipped (deadline)"; continue; }
    LILY_PREFILL_CHUNK=$c timeout "$(cap 60)" "$E" bench --model "$M" --device cuda --prefill 32K,128K \
      --decode-ctx 1 --decode-tokens 1 --repeat 1 > "$OUT/chunk-$c.log" 2>&1
    say "chunk $c rc=$? at $(el)s: $(rows "$OUT/chunk-$c.log") $(grep -h -m1 -oE 'prefill chunk [0-9]+' "$OUT/chunk-$c.log")"
  done
fi

if step wgpu; then
  wgpu_setup
  PREFILL=512,4K BENCH_S=100 wgpu_bench wgpu 4K,32K "f16 (activations|KV cache): [a-z]+ \([^)]*\)"
fi

if step concurrent; then
  timeout "$(cap 110)" python3 "$HERE/concurrent_bench.py" --model "$M" --device cuda --prompt-tokens 1024 \
    --max-tokens 256 --clients 1,4,8 > "$OUT/concurrent.log" 2>&1
  say "served 1,4,8 clients rc=$? at $(el)s:"
  grep -E "clients:|rror" "$OUT/concurrent.log" | cut -c1-220 | head -5 | tee -a "$S"
fi
rm -f "$OUT"/full-*.log "$OUT"/synth.log "$OUT"/chunk-*.log 2>/dev/null   # at most 8 files come back
say "done at $(el)s"
