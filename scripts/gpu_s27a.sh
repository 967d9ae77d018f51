#!/usr/bin/env bash
# Session 27, call 1 (≤ 7.5 minutes): why chunk 8,192's log-probabilities differed from 4,096's
# (issue 31), the shipping configuration's GPU tests, and chunk 16,384 beside 8,192.
# Staged by scripts/stage_gpu.sh with gpu_ab_common.sh beside:
#   bash .carry/s27a/gpu_s27a.sh      (carry: .carry/s27a; timeout_s 460)
# 1. beside the synth: model_prefill_chunks_past_8191_tokens_give_the_same_logits (a 9,000-token
#    prompt, 4 full-width layers: the router unsplit bit for bit across chunks 4,096 / 8,192 /
#    8,992, grouped and gathered experts; fp32 mode at 4,096 against 8,192; the shipping options
#    at each chunk against fp32 mode), TEST_S (170) seconds;
# 2. the shipping configuration's tests against the CPU (shipping_configuration_*), SHIP_S (110);
# 3. `bench --prefill 32K,128K --decode-ctx 1 --decode-tokens 1` at LILY_PREFILL_CHUNK 8,192 and
#    16,384, once each (CHUNKS: the chunks to bench).
set -u
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-400}"
AB_HARD=${HARD:-440}
timeout "$(cap "${TEST_S:-170}")" "$B/gpu" --ignored --test-threads=1 --nocapture \
  model_prefill_chunks_past_8191_tokens > "$OUT/tests-chunk.log" 2>&1
say "chunk test rc=$? at $(el)s"
grep -E '^MODEL|^test .*(ok|FAILED)$|panicked|differs|rel. L2' "$OUT/tests-chunk.log" | cut -c1-300 | head -24 | tee -a "$S"
wait "$SYN"; say "synth full rc=$? at $(el)s"
if left; then
  timeout "$(cap "${SHIP_S:-110}")" "$B/gpu" --ignored --test-threads=1 --nocapture shipping_configuration \
    > "$OUT/tests-ship.log" 2>&1
  say "shipping_configuration tests rc=$? at $(el)s"
  grep -hE "^test .*(ok|FAILED)$|^test result|panicked|^MODEL" "$OUT/tests-ship.log" | cut -c1-300 | head -12 | tee -a "$S"
fi
for c in ${CHUNKS:-8192 16384}; do
  if ! left; then say "bench $c: skipped (deadline) at $(el)s"; continue; fi
  LILY_PREFILL_CHUNK=$c timeout "$(cap 50)" "$B/lily-engine" bench --model "$M" --device cuda \
    --prefill 32K,128K --decode-ctx 1 --decode-tokens 1 --repeat 1 > "$OUT/bench-$c.log" 2>&1
  say "bench chunk $c rc=$? at $(el)s: $(grep -E '^ +[0-9]+[KM]? +[0-9.]+ +[0-9.]+' "$OUT/bench-$c.log" | tr -s ' ' | tr '\n' '|') $(grep -h -m1 -oE 'prefill chunk [0-9]+' "$OUT/bench-$c.log")"
done
say "done at $(el)s"
