#!/usr/bin/env bash
# Session 29 (≤ 200 s), branch s29dn: `dn_rows_loop` (issue 32) — the batched decode step's DeltaNet
# recurrence in dec_dn_step_rows_loop: one block a (V head, column block) and up to 4 sequences
# (grid.z ceil(B / 4): 512 blocks at 8 rows, one wave at 4 blocks an SM, 110 registers), every
# sequence's state rows requested before the dependency wait, q / k / v read once into registers,
# the norm sums through one exchange, then each sequence's column step in turn; the states and
# outputs bit for bit dec_dn_step_rows'. Staged by scripts/stage_gpu.sh with gpu_ab_common.sh
# beside (copy this script into the staged folder too):
#   bash .carry/s29dn/gpu_s29dn_ab.sh      (carry: .carry/s29dn; timeout_s 240)
# 1. beside the synth: the GPU test batched_decode_deltanet_scans_match_one_sequence_at_a_time
#    (dec_dn_step_rows_loop against dec_dn_step_rows bit for bit through the real launchers at
#    1 / 2 / 3 / 5 / 8 sequences, full and small head shapes, both activation modes, two steps;
#    both against dec_dn_step a sequence at a time), then
#    decode_batched_steps_dn_rows_loop_match_each_sequence_alone (the whole batched step as it
#    ships with the switch on, tiny and small, 3 and 8 sequences, against each sequence alone);
# 2. `bench --prefill 1K --decode-ctx 1K --decode-tokens 64 --batch 1,4,8 --repeat 1`, OFF
#    (LILY_DN_ROWS_LOOP=0) / ON (=1) alternated twice; each run's rows and the plan line's switch
#    into the summary;
# 3. time left: one LILY_PROFILE=1 `--batch 8` run each way (profile-off.txt / profile-on.txt:
#    dec_dn_step_rows vs dec_dn_step_rows_loop, µs a launch; predicted 24.6 → 11–14).
set -u
R=${OUT:-$PWD/gpu-logs}; mkdir -p "$R"
L=/tmp/s29dn-logs; mkdir -p "$L"; OUT=$L
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-175}"
AB_HARD=${HARD:-200}
S=$R/summary.txt
timeout "$(cap "${TEST_S:-50}")" "$B/gpu" --ignored --test-threads=1 --nocapture \
  batched_decode_deltanet_scans_match_one_sequence_at_a_time > "$L/tests.log" 2>&1
say "gpu test rc=$? at $(el)s: $(grep -E '^test |test result|panicked|KERNEL' "$L/tests.log" | tr '\n' '|' | cut -c1-600)"
if left && [ -z "${NO_STEP_TEST:-}" ]; then
  timeout "$(cap "${STEP_TEST_S:-40}")" "$B/gpu" --ignored --test-threads=1 --nocapture \
    decode_batched_steps_dn_rows_loop_match_each_sequence_alone > "$L/tests-step.log" 2>&1
  say "gpu step test rc=$? at $(el)s: $(grep -E '^test |test result|panicked' "$L/tests-step.log" | tr '\n' '|' | cut -c1-600)"
fi
wait "$SYN"; say "synth full rc=$? at $(el)s"
bench() {  # bench NAME VALUE [BATCH]
  if ! left; then say "bench $1: skipped (deadline) at $(el)s"; return; fi
  LILY_DN_ROWS_LOOP=$2 timeout "$(cap 45)" "$B/lily-engine" bench --model "$M" --device cuda \
    --prefill 1K --decode-ctx 1K --decode-tokens 64 --repeat 1 --batch "${3:-1,4,8}" > "$L/bench-$1.log" 2>&1
  say "bench $1 (LILY_DN_ROWS_LOOP=$2) rc=$? at $(el)s: $(grep -E '^ +[0-9]+[K]? +[0-9]+ +[0-9.]+' "$L/bench-$1.log" | tr -s ' ' | tr '\n' '|') $(grep -h -m1 -oE "batched DeltaNet step looping over sequences (on|off)" "$L/bench-$1.log")"
  grep -h -m1 -E "refused|out of memory|Error|panicked" "$L/bench-$1.log" >> "$S"
}
bench off-1 0; bench on-1 1; bench off-2 0; bench on-2 1
for v in off on; do
  if ! left; then say "profile $v: skipped (deadline)"; continue; fi
  val=0; [ $v = on ] && val=1
  LILY_PROFILE=1 LILY_DN_ROWS_LOOP=$val timeout "$(cap 40)" "$B/lily-engine" bench --model "$M" --device cuda \
    --prefill 1K --decode-ctx 1K --decode-tokens 16 --repeat 1 --batch 8 > "$L/profile-$v.log" 2>&1
  say "profile $v rc=$? at $(el)s: $(grep -E 'dec_dn_step_rows|dec_dn_conv_rows' "$L/profile-$v.log" | tr -s ' ' | tr '\n' '|' | cut -c1-400)"
  grep -v INFO "$L/profile-$v.log" | tail -80 > "$R/profile-$v.txt"
done
cp "$L"/tests.log "$L"/tests-step.log "$L"/bench-on-1.log "$R"/ 2>/dev/null
say "done at $(el)s"
