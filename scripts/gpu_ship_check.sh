#!/usr/bin/env bash
# One device call (≤ 5 minutes): the shipping configuration of CUDA batched decode on the
# full-size checkpoint, as issue 32 measures it. While the checkpoint (with the tokenizer, for
# `serve`) is synthesised: the batched step's GPU tests on the shipping switches. Then
# `bench --batch 1,4,8` at a 1K context, and served 1 / 4 / 8 clients (scripts/concurrent_bench.py:
# a 1,024-token prompt each, MAX_TOKENS (256) greedy tokens, the default --max-batch), the
# summary printed to stdout.
# Staged: scripts/stage_gpu.sh DEST, `gzip -9` DEST/bin/*, this script, concurrent_bench.py and
# serve_bench.py (which it imports) beside. There: bash .carry/NAME/gpu_ship_check.sh (carry .carry/NAME .carry/tokenizer)
set -u
AB_TOKENIZER=1
. "$(dirname "$0")/gpu_ab_common.sh" 280
E=$B/lily-engine
at() { echo "$(el)s"; }
timeout "${TEST_S:-100}" "$HERE/bin/gpu" --ignored --test-threads=1 \
  ${TESTS:-decode_batched_ batched_decode_mma_rows} > "$OUT/tests.log" 2>&1
say "tests rc=$? at $(at)"
grep -E "^test .*(ok|FAILED)$|^test result|panicked" "$OUT/tests.log" | cut -c1-200 | head -30 | tee -a "$S"
wait $SYN; say "synth full rc=$? at $(at)"
timeout 90 "$E" bench --model "$M" --device cuda --prefill 1K --decode-ctx 1K --decode-tokens 64 \
  --repeat 1 --batch 1,4,8 > "$OUT/bench.log" 2>&1
say "bench rc=$? at $(at):"
grep -E "^ +[0-9]|error|Error" "$OUT/bench.log" | cut -c1-200 | tee -a "$S"
grep -m1 -o "batched decode [a-z]*\|batched projections on tensor cores [a-z]*\|pipelined batched step [a-z]*" "$OUT/bench.log" | tee -a "$S"
export PYTHONUNBUFFERED=1
if left; then
  LILY_ENGINE_BIN="$E" timeout 150 python3 "$HERE/concurrent_bench.py" --model "$M" \
    --device cuda --prompt-tokens 1024 --max-tokens "${MAX_TOKENS:-256}" --clients 1,4,8 \
    > "$OUT/concurrent.log" 2>&1
  say "served 1,4,8 rc=$? at $(at):"
  grep -E "clients:|^server:|Error|error" "$OUT/concurrent.log" | cut -c1-220 | head -6 | tee -a "$S"
else say "served: skipped (deadline) at $(at)"; fi
say "done at $(at)"
