#!/usr/bin/env bash
# One device call for `moe_bulk` (issue 30: one-token decode; session 25, branch s25moe; ≤ 240 s):
# the one-token MoE gate/up kernel on dec_glu4_x8x2_bulk (dec_glu4_x8x2's tiles and arithmetic,
# every tile of a block bulk-copied into shared memory, one mbarrier each, before any is summed).
# Modelled on scripts/gpu_s24att2_ab.sh. Staged by scripts/stage_gpu.sh (which copies
# gpu_ab_common.sh beside):
#   CARGO_TARGET_DIR=$PWD/target bash scripts/stage_gpu.sh /work/main/.carry/s25moe
#   gzip -9 /work/main/.carry/s25moe/bin/*; cp scripts/gpu_s25moe_ab.sh /work/main/.carry/s25moe/
#   bash .carry/s25moe/gpu_s25moe_ab.sh     (run's carry: .carry/s25moe; timeout_s 250)
#   1. GPU test, beside the synth: decode::glu_bulk_gives_dec_glu4_x8x2_bits (routing and every
#      hidden row of dec_glu4_x8x2_bulk bit for bit dec_glu4_x8x2's: the model's shapes with 32
#      experts, and routed experts of 516 rows beside a shared expert of 1,024; bf16 mode only:
#      one mode's kernels to compile, most of them already in LILY_CACHE_DIR after a bench; lines
#      `KERNEL dec_glu4_x8x2_bulk …`). A deadlock (an mbarrier that never completes) shows
#      as the test's timeout (rc 124) with no `test result` line.
#   2. on the full-size synthetic checkpoint `bench --prefill 512 --decode-ctx 4K,32K
#      --decode-tokens 64 --repeat 1`, OFF (LILY_MOE_BULK=0) / ON (=1) alternated ROUNDS (2)
#      times; each run's plan label goes into the summary ("bulk-copied MoE gate/up tiles on"
#      under ON).
#   3. one LILY_PROFILE=1 decode at 4K each way (graphs off: each launch timed alone): the MoE
#      kernels' rows (dec_glu4_x8x2 or dec_glu4_x8x2_bulk, dec_down_combine_x8x2_r96) into the
#      summary.
# The summary comes back in $OUT/summary.txt with the test's log; the benches' logs stay in
# /tmp/s25moe-logs. Knobs: OFF / ON (environments), SKIP_TESTS=1, SKIP_PROFILE=1, TEST_S (60),
# BENCH_S (45), PROFILE_S (40), ROUNDS (2), DEADLINE (215: no run starts later), HARD (238: none
# reaches past it). Under a smaller DEADLINE (gpu_s25final.sh passes its share) the last runs are
# the ones skipped: round 2, then the profiles.
set -u
R=${OUT:-$PWD/gpu-logs}; mkdir -p "$R"
L=/tmp/s25moe-logs; mkdir -p "$L"; OUT=$L
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-215}"
AB_HARD=${HARD:-238}
S=$R/summary.txt
OFF=${OFF:-LILY_MOE_BULK=0}
ON=${ON:-LILY_MOE_BULK=1}
say "OFF: $OFF | ON: $ON"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "$(cap "${TEST_S:-60}")" "$B/gpu" --ignored --test-threads=1 --nocapture \
    decode::glu_bulk_gives_dec_glu4_x8x2_bits > "$L/tests.log" 2>&1
  say "tests rc=$? at $(el)s"
  grep -E "^KERNEL dec_glu4_x8x2_bulk|^test .*(ok|FAILED)$|^test result|panicked" "$L/tests.log" | cut -c1-220 | tee -a "$S"
  cp "$L/tests.log" "$R/"
fi
wait "$SYN"; say "synth full rc=$? at $(el)s"
plan() {  # plan LOG NAME: the run's moe_bulk label into the summary
  { printf '  %s plan: ' "$2"
    grep -h -m1 -oE "bulk-copied MoE gate/up tiles (on|off)" "$1" | tr '\n' ' '
    echo; } >> "$S"
}
bench() {  # bench NAME ENV...: the sweep, under the environment ENV
  local name=$1; shift
  if ! left; then say "bench $name: skipped (deadline) at $(el)s"; return; fi
  env "$@" timeout "$(cap "${BENCH_S:-45}")" "$B/lily-engine" bench --model "$M" --device cuda \
    --prefill 512 --decode-ctx 4K,32K --decode-tokens 64 --repeat 1 > "$L/bench-$name.log" 2>&1
  say "bench $name rc=$? at $(el)s: $(grep -E '^ +[0-9]+[KM]? +[0-9.]+ +[0-9.]+' "$L/bench-$name.log" | tr -s ' ' | tr '\n' '|')"
  plan "$L/bench-$name.log" "$name"
}
for r in $(seq 1 "${ROUNDS:-2}"); do
  # shellcheck disable=SC2086
  bench "off-$r" $OFF
  # shellcheck disable=SC2086
  bench "on-$r" $ON
done
if [ "${SKIP_PROFILE:-0}" != 1 ]; then
  for v in off on; do
    if ! left; then say "profile $v: skipped (deadline) at $(el)s"; continue; fi
    envs=$OFF; [ "$v" = on ] && envs=$ON
    # shellcheck disable=SC2086
    env LILY_PROFILE=1 $envs timeout "$(cap "${PROFILE_S:-40}")" "$B/lily-engine" bench --model "$M" --device cuda \
      --prefill 16 --decode-ctx 4K --decode-tokens 16 --repeat 1 > "$L/profile-$v.log" 2>&1
    say "profile $v (4K, graphs off) rc=$? at $(el)s:"
    grep -E "kernel profile|dec_glu4|dec_down_combine" "$L/profile-$v.log" | head -6 | tr -s ' ' | tee -a "$S"
    plan "$L/profile-$v.log" "profile-$v"
    cp "$L/profile-$v.log" "$R/"
  done
fi
say "done at $(el)s"
