#!/usr/bin/env bash
# One device call for `wgmma_attention_pipelined` (issue 31, session 24, branch s24att; ≤ 330 s):
# prefill attention on attn_prefill_wg_pipe (attn_prefill_wg's arithmetic in the same order, a key
# tile's softmax run while the tensor cores do the previous tile's P·V). Modelled on
# scripts/gpu_s23pre_ab.sh. Staged by scripts/stage_gpu.sh (which copies gpu_ab_common.sh beside):
#   CARGO_TARGET_DIR=$PWD/target bash scripts/stage_gpu.sh /work/main/.carry/s24att
#   gzip -9 /work/main/.carry/s24att/bin/*; cp scripts/gpu_s24att_ab.sh /work/main/.carry/s24att/
#   bash .carry/s24att/gpu_s24att_ab.sh     (run's carry: .carry/s24att; timeout_s 340)
#   1. GPU tests, beside the synth: attention::attn_prefill_wg_pipe_gives_attn_prefill_wg_bits
#      (the model's heads; chunks of 1,024 / 4,096 at 0, 1,100 at 3,000, 4,096 at 28,672 and
#      126,976: every output bit for bit attn_prefill_wg's, an f64 reference on sampled tokens,
#      each kernel's µs and TFLOP/s — lines `KERNEL attn_prefill_wg{,_pipe} …`) and
#      attention::attn_prefill_matches_attn_decode (both against attn_decode, 100 … 4,096 tokens);
#   2. on the full-size synthetic checkpoint `bench --prefill 4K,32K,128K --decode-ctx 1
#      --decode-tokens 1 --repeat REPEAT (2)`, OFF (LILY_WGMMA_ATTENTION_PIPELINED=0) / ON (=1)
#      alternated ROUNDS (2) times.
# The summary comes back in $OUT/summary.txt with the tests' log; the benches' logs stay in
# /tmp/s24att-logs. Knobs: OFF / ON (environments), SKIP_TESTS=1, TEST_S (100), BENCH_S (70),
# REPEAT (2), ROUNDS (2), DEADLINE (270: no run starts later), HARD (320: none reaches past it).
set -u
R=${OUT:-$PWD/gpu-logs}; mkdir -p "$R"
L=/tmp/s24att-logs; mkdir -p "$L"; OUT=$L
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-270}"
AB_HARD=${HARD:-320}
S=$R/summary.txt
OFF=${OFF:-LILY_WGMMA_ATTENTION_PIPELINED=0}
ON=${ON:-LILY_WGMMA_ATTENTION_PIPELINED=1}
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
  env "$@" timeout "$(cap "${BENCH_S:-70}")" "$B/lily-engine" bench --model "$M" --device cuda \
    --prefill 4K,32K,128K --decode-ctx 1 --decode-tokens 1 --repeat "${REPEAT:-2}" > "$L/bench-$name.log" 2>&1
  say "bench $name rc=$? at $(el)s: $(grep -E '^ +[0-9]+[KM]? +[0-9.]+ +[0-9.]+' "$L/bench-$name.log" | tr -s ' ' | tr '\n' '|')"
  grep -h -m1 -oE "(pipelined )?wgmma prefill attention (on|off)" "$L/bench-$name.log" | tr '\n' ' ' >> "$S"; echo >> "$S"
}
for r in $(seq 1 "${ROUNDS:-2}"); do
  # shellcheck disable=SC2086
  bench "off-$r" $OFF
  # shellcheck disable=SC2086
  bench "on-$r" $ON
done
say "done at $(el)s"
