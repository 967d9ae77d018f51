#!/usr/bin/env bash
# One device call for `wgmma_attention_pingpong` (issue 31's 128K cell, session 24, branch s24att2;
# ≤ 300 s): prefill attention on attn_prefill_wg_pp (attn_prefill_wg_pipe's arithmetic in the same
# order, its two warpgroups decoupled by per-stage mbarriers and their wgmmas issued in turns).
# Modelled on scripts/gpu_s24att_ab.sh. Staged by scripts/stage_gpu.sh (which copies
# gpu_ab_common.sh beside):
#   CARGO_TARGET_DIR=$PWD/target bash scripts/stage_gpu.sh /work/main/.carry/s24att2
#   gzip -9 /work/main/.carry/s24att2/bin/*; cp scripts/gpu_s24att2_ab.sh /work/main/.carry/s24att2/
#   bash .carry/s24att2/gpu_s24att2_ab.sh     (run's carry: .carry/s24att2; timeout_s 310)
#   1. GPU tests, beside the synth: attention::attn_prefill_wg_pipe_gives_attn_prefill_wg_bits
#      (the model's heads; chunks of 64 / 130 at 0, 200 at 10 — blocks of 1 … 4 key tiles — then
#      1,024 / 4,096 at 0, 1,100 at 3,000, 4,096 at 28,672 and 126,976: attn_prefill_wg_pipe bit
#      for bit attn_prefill_wg's, attn_prefill_wg_pp bit for bit attn_prefill_wg_pipe's, an f64
#      reference on sampled tokens, each kernel's µs and TFLOP/s — lines
#      `KERNEL attn_prefill_wg{,_pipe,_pp} …`) and attention::attn_prefill_matches_attn_decode
#      (all three against attn_decode, 100 … 4,096 tokens). A deadlock would show as the tests'
#      timeout (rc 124) with no `test result` line.
#   2. on the full-size synthetic checkpoint `bench --prefill 32K,128K --decode-ctx 1
#      --decode-tokens 1 --repeat REPEAT (2)`, OFF (LILY_WGMMA_ATTENTION_PINGPONG=0) / ON (=1)
#      alternated ROUNDS (2) times; each run's plan label goes into the summary, so it shows what
#      ran ("ping-pong wgmma prefill attention on" under ON).
# The summary comes back in $OUT/summary.txt with the tests' log; the benches' logs stay in
# /tmp/s24att2-logs. Knobs: OFF / ON (environments), SKIP_TESTS=1, TEST_S (100), BENCH_S (55),
# REPEAT (2), ROUNDS (2), DEADLINE (250: no run starts later), HARD (295: none reaches past it).
set -u
R=${OUT:-$PWD/gpu-logs}; mkdir -p "$R"
L=/tmp/s24att2-logs; mkdir -p "$L"; OUT=$L
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-250}"
AB_HARD=${HARD:-295}
S=$R/summary.txt
OFF=${OFF:-LILY_WGMMA_ATTENTION_PINGPONG=0}
ON=${ON:-LILY_WGMMA_ATTENTION_PINGPONG=1}
say "OFF: $OFF | ON: $ON"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "$(cap "${TEST_S:-100}")" "$B/gpu" --ignored --test-threads=1 --nocapture \
    attention::attn_prefill_wg_pipe_gives_attn_prefill_wg_bits attention::attn_prefill_matches_attn_decode \
    > "$L/tests.log" 2>&1
  say "tests rc=$? at $(el)s"
  grep -E "^KERNEL attn_prefill_wg|^test .*(ok|FAILED)$|^test result|panicked|differ" "$L/tests.log" | cut -c1-220 | tee -a "$S"
  cp "$L/tests.log" "$R/"
fi
wait "$SYN"; say "synth full rc=$? at $(el)s"
bench() {  # bench NAME ENV...: the sweep, under the environment ENV
  local name=$1; shift
  if ! left; then say "bench $name: skipped (deadline) at $(el)s"; return; fi
  env "$@" timeout "$(cap "${BENCH_S:-55}")" "$B/lily-engine" bench --model "$M" --device cuda \
    --prefill 32K,128K --decode-ctx 1 --decode-tokens 1 --repeat "${REPEAT:-2}" > "$L/bench-$name.log" 2>&1
  say "bench $name rc=$? at $(el)s: $(grep -E '^ +[0-9]+[KM]? +[0-9.]+ +[0-9.]+' "$L/bench-$name.log" | tr -s ' ' | tr '\n' '|')"
  { printf '  %s plan: ' "$name"
    grep -h -m1 -oE "(ping-pong|pipelined) wgmma prefill attention (on|off)" "$L/bench-$name.log" | tr '\n' ' '
    echo; } >> "$S"
}
for r in $(seq 1 "${ROUNDS:-2}"); do
  # shellcheck disable=SC2086
  bench "off-$r" $OFF
  # shellcheck disable=SC2086
  bench "on-$r" $ON
done
say "done at $(el)s"
