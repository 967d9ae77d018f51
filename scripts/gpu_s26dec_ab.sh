#!/usr/bin/env bash
# One device call for `moe_down_prefetch` (issue 30: one-token decode; session 26, branch s26dec;
# ≤ 200 s): the one-token MoE gate/up kernel as dec_glu4_x8x2_bulk_pf (dec_glu4_x8x2_bulk's bits,
# its blocks also pulling the token's picked experts' down projections toward L2 once their own
# tiles are requested, so dec_down_combine_x8x2_r96's routed loads find them there).
# Modelled on scripts/gpu_s25chunk.sh and gpu_s25moe_ab.sh (commit c086b49). Staged by
# scripts/stage_gpu.sh (which copies gpu_ab_common.sh beside); this script must be copied beside
# the binaries:
#   CARGO_TARGET_DIR=$PWD/target bash scripts/stage_gpu.sh /work/main/.carry/s26dec
#   gzip -9 /work/main/.carry/s26dec/bin/*; cp scripts/gpu_s26dec_ab.sh /work/main/.carry/s26dec/
#   bash .carry/s26dec/gpu_s26dec_ab.sh     (run's carry: .carry/s26dec; timeout_s 210)
#   1. GPU test, beside the synth: decode::glu_down_prefetch_gives_the_bulk_kernels_bits (routing
#      and every hidden row of dec_glu4_x8x2_bulk_pf bit for bit dec_glu4_x8x2_bulk's, then the
#      down kernel's residual rows after each bit for bit; bf16 mode; lines `KERNEL …`).
#   2. on the full-size synthetic checkpoint `bench --prefill 512 --decode-ctx 4K,32K
#      --decode-tokens 64 --repeat 1`, OFF (LILY_MOE_DOWN_PREFETCH=0) / ON (=1) alternated ROUNDS
#      (2) times; each run's plan label goes into the summary ("MoE down weights prefetched to L2
#      on" under ON).
#   3. if time is left, one LILY_PROFILE=1 decode at 4K each way (graphs off: each launch timed
#      alone): the MoE kernels' rows (dec_glu4_x8x2_bulk or _bulk_pf, dec_down_combine_x8x2_r96).
# The summary comes back in $OUT/summary.txt with the test's log; the benches' logs stay in
# /tmp/s26dec-logs. Knobs: OFF / ON (environments), SKIP_TESTS=1, SKIP_PROFILE=1, TEST_S (55),
# BENCH_S (40), PROFILE_S (25), ROUNDS (2), DEADLINE (170: no run starts later), HARD (198: none
# reaches past it).
set -u
R=${OUT:-$PWD/gpu-logs}; mkdir -p "$R"
L=/tmp/s26dec-logs; mkdir -p "$L"; OUT=$L
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-170}"
AB_HARD=${HARD:-198}
S=$R/summary.txt
OFF=${OFF:-LILY_MOE_DOWN_PREFETCH=0}
ON=${ON:-LILY_MOE_DOWN_PREFETCH=1}
say "OFF: $OFF | ON: $ON"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "$(cap "${TEST_S:-55}")" "$B/gpu" --ignored --test-threads=1 --nocapture \
    decode::glu_down_prefetch_gives_the_bulk_kernels_bits > "$L/tests.log" 2>&1
  say "tests rc=$? at $(el)s"
  grep -E "^KERNEL dec_|^test .*(ok|FAILED)$|^test result|panicked" "$L/tests.log" | cut -c1-220 | tee -a "$S"
  cp "$L/tests.log" "$R/"
fi
wait "$SYN"; say "synth full rc=$? at $(el)s"
plan() {  # plan LOG NAME: the run's moe_down_prefetch and moe_bulk labels into the summary
  { printf '  %s plan: ' "$2"
    grep -h -m1 -oE "MoE down weights prefetched to L2 (on|off)|bulk-copied MoE gate/up tiles (on|off)" "$1" | tr '\n' ' '
    echo; } >> "$S"
}
bench() {  # bench NAME ENV...: the sweep, under the environment ENV
  local name=$1; shift
  if ! left; then say "bench $name: skipped (deadline) at $(el)s"; return; fi
  env "$@" timeout "$(cap "${BENCH_S:-40}")" "$B/lily-engine" bench --model "$M" --device cuda \
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
    env LILY_PROFILE=1 $envs timeout "$(cap "${PROFILE_S:-25}")" "$B/lily-engine" bench --model "$M" --device cuda \
      --prefill 16 --decode-ctx 4K --decode-tokens 16 --repeat 1 > "$L/profile-$v.log" 2>&1
    say "profile $v (4K, graphs off) rc=$? at $(el)s:"
    grep -E "kernel profile|dec_glu4|dec_down_combine" "$L/profile-$v.log" | head -6 | tr -s ' ' | tee -a "$S"
    plan "$L/profile-$v.log" "profile-$v"
    cp "$L/profile-$v.log" "$R/"
  done
fi
say "done at $(el)s"
