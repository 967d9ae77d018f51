#!/usr/bin/env bash
# Session 30 (≤ 200 s by its own clock), branch s30down: `grouped_down_sectors` (issue 32) — the
# batched decode step's grouped down kernel with whole 32-byte sectors a load:
# dec_down_combine_x8x2_grouped_sectors (the ring kernel's blocks, items and ring; each load
# instruction of a warp over 512 contiguous bytes, a 64-column group split over a lane pair); the
# same outputs bit for bit. Staged by scripts/stage_gpu.sh with gpu_ab_common.sh beside (copy this
# script into the staged folder too):
#   bash .carry/s30down/gpu_s30down_ab.sh      (carry: .carry/s30down; timeout_s 240)
# 1. beside the synth: the GPU test grouped_down_sectors_gives_the_ring_kernels_bits (the sectors
#    kernel against the shipping ring kernel, 2 / 4 / 8 rows, small and full widths with 32 and 64
#    experts, both activation modes, outputs over NaN), then
#    decode_batched_steps_down_sectors_match_each_sequence_alone (the whole batched step as it
#    ships with the switch on, tiny and small, 3 and 8 sequences, against each sequence alone);
# 2. `bench --prefill 1K --decode-ctx 1K --decode-tokens 64 --batch 1,4,8 --repeat 1`, OFF
#    (LILY_GROUPED_DOWN_SECTORS=0) / ON (=1) alternated twice; each run's rows and the plan line's
#    switch into the summary;
# 3. time left: one LILY_PROFILE=1 `--batch 8` run each way (profile-off.txt / profile-on.txt:
#    dec_down_combine_x8x2_grouped_ring vs _sectors, µs a launch; dec_glu4_x8x2_grouped_ring, the
#    untouched neighbour, as the control).
set -u
R=${OUT:-$PWD/gpu-logs}; mkdir -p "$R"
L=/tmp/s30down-logs; mkdir -p "$L"; OUT=$L
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-175}"
AB_HARD=${HARD:-200}
S=$R/summary.txt
timeout "$(cap "${TEST_S:-60}")" "$B/gpu" --ignored --test-threads=1 --nocapture \
  grouped_down_sectors_gives_the_ring_kernels_bits > "$L/tests.log" 2>&1
say "gpu test rc=$? at $(el)s: $(grep -E '^test |test result|panicked' "$L/tests.log" | tr '\n' '|' | cut -c1-600)"
if left && [ -z "${NO_STEP_TEST:-}" ]; then
  timeout "$(cap "${STEP_TEST_S:-40}")" "$B/gpu" --ignored --test-threads=1 --nocapture \
    decode_batched_steps_down_sectors_match_each_sequence_alone > "$L/tests-step.log" 2>&1
  say "gpu step test rc=$? at $(el)s: $(grep -E '^test |test result|panicked' "$L/tests-step.log" | tr '\n' '|' | cut -c1-600)"
fi
wait "$SYN"; say "synth full rc=$? at $(el)s"
bench() {  # bench NAME VALUE [BATCH]
  if ! left; then say "bench $1: skipped (deadline) at $(el)s"; return; fi
  LILY_GROUPED_DOWN_SECTORS=$2 timeout "$(cap 45)" "$B/lily-engine" bench --model "$M" --device cuda \
    --prefill 1K --decode-ctx 1K --decode-tokens 64 --repeat 1 --batch "${3:-1,4,8}" > "$L/bench-$1.log" 2>&1
  say "bench $1 (LILY_GROUPED_DOWN_SECTORS=$2) rc=$? at $(el)s: $(grep -E '^ +[0-9]+[K]? +[0-9]+ +[0-9.]+' "$L/bench-$1.log" | tr -s ' ' | tr '\n' '|') $(grep -h -m1 -oE "grouped MoE down kernel's whole-sector loads (on|off)" "$L/bench-$1.log")"
  grep -h -m1 -E "refused|out of memory|Error|panicked" "$L/bench-$1.log" >> "$S"
}
bench off-1 0; bench on-1 1; bench off-2 0; bench on-2 1
for v in off on; do
  if ! left; then say "profile $v: skipped (deadline)"; continue; fi
  val=0; [ $v = on ] && val=1
  LILY_PROFILE=1 LILY_GROUPED_DOWN_SECTORS=$val timeout "$(cap 40)" "$B/lily-engine" bench --model "$M" --device cuda \
    --prefill 1K --decode-ctx 1K --decode-tokens 16 --repeat 1 --batch 8 > "$L/profile-$v.log" 2>&1
  say "profile $v rc=$? at $(el)s: $(grep -E 'dec_glu4_x8x2_grouped|dec_down_combine_x8x2_grouped' "$L/profile-$v.log" | tr -s ' ' | tr '\n' '|' | cut -c1-400)"
  grep -v INFO "$L/profile-$v.log" | tail -80 > "$R/profile-$v.txt"
done
cp "$L"/tests.log "$L"/tests-step.log "$L"/bench-on-1.log "$R"/ 2>/dev/null
say "done at $(el)s"
