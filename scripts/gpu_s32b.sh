#!/usr/bin/env bash
# Session 32's second call (≤ 540 s by its own clock): the GPU tests with the int8 KV cache as the
# default (4a6701b), and served clients with it.
#   1. three test processes at once (cold NVRTC caches take 60–100 s; cache writes are atomic):
#      `gpu model::` (without the checkpoint-from-env test), `gpu batch::`, and
#      `gpu pipeline:: sample:: attention::` (attention.cu's block_max is common.cuh's template now);
#   2. served 1 / 4 / 8 clients (concurrent_bench.py: a 1,024-token prompt each, 256 greedy tokens).
#   bash .carry/NAME/gpu_s32b.sh   (carry: .carry/NAME .carry/tokenizer .gl; timeout_s 590)
# Knobs: SKIP=concurrent leaves part 2 out; TEST_S (380), DEADLINE (420), HARD (540).
set -u
AB_TOKENIZER=1
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-420}"
AB_HARD=${HARD:-540}
E=$B/lily-engine
T=${TEST_S:-380}
timeout "$(cap $T)" "$B/gpu" --ignored --test-threads=1 --nocapture model:: \
  --skip model_matches_cpu_on_checkpoint_from_env > "$OUT/tests-model.log" 2>&1 &
P1=$!
timeout "$(cap $T)" "$B/gpu" --ignored --test-threads=1 --nocapture batch:: > "$OUT/tests-batch.log" 2>&1 &
P2=$!
timeout "$(cap $T)" "$B/gpu" --ignored --test-threads=1 --nocapture pipeline:: sample:: attention:: \
  > "$OUT/tests-rest.log" 2>&1 &
P3=$!
wait "$SYN"; say "synth full rc=$? at $(el)s"
for p in "$P1:model" "$P2:batch" "$P3:rest"; do
  wait "${p%%:*}"; rc=$?
  f="$OUT/tests-${p##*:}.log"
  say "tests ${p##*:} rc=$rc at $(el)s: $(grep -cE '\.\.\. .*ok$|^ok$' "$f") ok; $(grep -E 'test result|FAILED|panicked' "$f" | tr '\n' '|' | cut -c1-600)"
done
export PYTHONUNBUFFERED=1 LILY_ENGINE_BIN="$E"
if left && ! skipped concurrent; then
  timeout "$(cap 130)" python3 "$HERE/concurrent_bench.py" --model "$M" --device cuda --prompt-tokens 1024 \
    --max-tokens 256 --clients 1,4,8 > "$OUT/concurrent.log" 2>&1
  say "served 1,4,8 clients rc=$? at $(el)s:"
  grep -E "clients:|rror" "$OUT/concurrent.log" | cut -c1-220 | head -5 | tee -a "$S"
fi
say "done at $(el)s"
