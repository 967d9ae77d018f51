#!/usr/bin/env bash
# Session 32 (≤ 200 s), branch s32rt: `router_async_stage` (issue 32) — the batched decode step's
# router launch (router + shared-expert gate, 257 rows of 8-bit × 2,048) in
# dec_gemv_rows_split_async: the input rows copied into shared memory by cp.async (every thread's
# 16-byte copies in flight at once, one wait: one round trip to L2 instead of
# dec_gemv_rows_split_lean's four at 8 rows), each (row, group) sum taken by the warp that copied
# it after a warp barrier, one block barrier instead of two; the outputs bit for bit the lean
# kernel's. Staged by scripts/stage_gpu.sh with gpu_ab_common.sh beside (copy this script into
# the staged folder too):
#   bash .carry/s32rt/gpu_s32rt_ab.sh      (carry: .carry/s32rt; timeout_s 240)
# 1. beside the synth: the GPU test router_async_stage_gives_the_lean_routers_bits (the async
#    kernel against dec_gemv_rows_split_lean bit for bit through the real launcher: the router's
#    shape and four mixed weights, 64 to 4,096 columns, 1–8 and 11 rows, both activation modes),
#    then decode_batched_steps_router_async_stage_match_each_sequence_alone (the whole batched
#    step as it ships with the switch on, tiny and small, 3 and 8 sequences, against each alone);
# 2. `bench --prefill 1K --decode-ctx 1K --decode-tokens 64 --batch 1,4,8 --repeat 1`, OFF
#    (LILY_ROUTER_ASYNC_STAGE=0) / ON (=1) alternated twice; each run's rows and the plan line's
#    switch into the summary;
# 3. time left: one LILY_PROFILE=1 `--batch 8` run with the switch on (profile-on.txt: the router
#    row dec_gemv_rows_split_async, µs a launch; predicted 18.0 → 15–16.5), then one off if time
#    is still left (profile-off.txt: dec_gemv_rows_split_lean, the same call's baseline).
set -u
R=${OUT:-$PWD/gpu-logs}; mkdir -p "$R"
L=/tmp/s32rt-logs; mkdir -p "$L"; OUT=$L
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-175}"
AB_HARD=${HARD:-200}
S=$R/summary.txt
timeout "$(cap "${TEST_S:-50}")" "$B/gpu" --ignored --test-threads=1 --nocapture \
  router_async_stage_gives_the_lean_routers_bits > "$L/tests.log" 2>&1
say "gpu test rc=$? at $(el)s: $(grep -E '^test |test result|panicked|KERNEL' "$L/tests.log" | tr '\n' '|' | cut -c1-600)"
if left && [ -z "${NO_STEP_TEST:-}" ]; then
  timeout "$(cap "${STEP_TEST_S:-40}")" "$B/gpu" --ignored --test-threads=1 --nocapture \
    decode_batched_steps_router_async_stage_match_each_sequence_alone > "$L/tests-step.log" 2>&1
  say "gpu step test rc=$? at $(el)s: $(grep -E '^test |test result|panicked' "$L/tests-step.log" | tr '\n' '|' | cut -c1-600)"
fi
wait "$SYN"; say "synth full rc=$? at $(el)s"
bench() {  # bench NAME VALUE [BATCH]
  if ! left; then say "bench $1: skipped (deadline) at $(el)s"; return; fi
  LILY_ROUTER_ASYNC_STAGE=$2 timeout "$(cap 45)" "$B/lily-engine" bench --model "$M" --device cuda \
    --prefill 1K --decode-ctx 1K --decode-tokens 64 --repeat 1 --batch "${3:-1,4,8}" > "$L/bench-$1.log" 2>&1
  say "bench $1 (LILY_ROUTER_ASYNC_STAGE=$2) rc=$? at $(el)s: $(grep -E '^ +[0-9]+[K]? +[0-9]+ +[0-9.]+' "$L/bench-$1.log" | tr -s ' ' | tr '\n' '|') $(grep -h -m1 -oE "batched router staged by cp.async (on|off)" "$L/bench-$1.log")"
  grep -h -m1 -E "refused|out of memory|Error|panicked" "$L/bench-$1.log" >> "$S"
}
bench off-1 0; bench on-1 1; bench off-2 0; bench on-2 1
for v in on off; do
  if ! left; then say "profile $v: skipped (deadline)"; continue; fi
  val=0; [ $v = on ] && val=1
  LILY_PROFILE=1 LILY_ROUTER_ASYNC_STAGE=$val timeout "$(cap 40)" "$B/lily-engine" bench --model "$M" --device cuda \
    --prefill 1K --decode-ctx 1K --decode-tokens 16 --repeat 1 --batch 8 > "$L/profile-$v.log" 2>&1
  say "profile $v rc=$? at $(el)s: $(grep -E 'dec_gemv_rows_split|rms_norm_rows|dec_glu4_x8x2_grouped' "$L/profile-$v.log" | tr -s ' ' | tr '\n' '|' | cut -c1-400)"
  grep -v INFO "$L/profile-$v.log" | tail -80 > "$R/profile-$v.txt"
done
cp "$L"/tests.log "$L"/tests-step.log "$L"/bench-on-1.log "$R"/ 2>/dev/null
say "done at $(el)s"
