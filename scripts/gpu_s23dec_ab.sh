#!/usr/bin/env bash
# One device call for session 23's one-token decode switches (issue 30, branch s23dec):
# `gemv4w_sm_grid` (dec_gemv4w_x8x2 — DeltaNet's out_proj with its gated norm, attention's
# o_proj — on ceil(tiles / 2) blocks, one an SM, both tiles of a block requested before its
# wait, LILY_GEMV4W_SM_GRID=1) and `down_96_regs` (the MoE's down kernel held to 96 registers so
# that one block of the next layer's first projection fits beside it, LILY_DOWN_96_REGS=1); ON
# is both. First the GPU tests by name (both kernels against the CPU and bit for bit against
# the shipping kernels; the decode of a full-width 4-layer model with each switch and both, bit
# for bit the shipping tokens and log-probabilities; OLD_TESTS=1: existing decode and shipping
# tests too, ≈ +1 minute), while the checkpoint is synthesised; then on the
# full-size synthetic checkpoint `bench --prefill 256 --decode-ctx 256,4K,32K --decode-tokens
# 128 --repeat 1` OFF / ON alternated twice (ALONE=1: each switch alone too, in every round),
# then one LILY_PROFILE=1 decode at 4K under ON: the decode kernels' rows into the summary.
# Summary: $OUT/summary.txt (logs beside it). ≤ 6 minutes: no run starts past DEADLINE seconds
# (default 320) and none reaches past HARD (370).
#
# Here: `CARGO_TARGET_DIR=$PWD/target bash scripts/stage_gpu.sh /work/main/.carry/s23dec`, then
# `gzip -9 /work/main/.carry/s23dec/bin/*` and copy this script into that folder (stage_gpu.sh
# copies gpu_ab_common.sh, the preamble it sources). There:
#   bash .carry/s23dec/gpu_s23dec_ab.sh          (run's carry: .carry/s23dec; timeout_s 420)
# Knobs: OFF / ON (environments), ALONE=1, SKIP_TESTS=1, TEST_S (the new tests' timeout, 150),
# OLD_TESTS=1 and OLD_TEST_S (their timeout, 90), BENCH_S (60), ROUNDS (2), SKIP_PROFILE=1,
# DEADLINE (320), HARD (370).
set -u
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-320}"
AB_HARD=${HARD:-370}
OFF=${OFF:-LILY_GEMV4W_SM_GRID=0 LILY_DOWN_96_REGS=0}
ON=${ON:-LILY_GEMV4W_SM_GRID=1 LILY_DOWN_96_REGS=1}
say "OFF: $OFF | ON: $ON${ALONE:+ | ALONE: each switch alone too}"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  # The new and changed tests: they set their options themselves.
  timeout "$(cap "${TEST_S:-150}")" "$B/gpu" --ignored --test-threads=1 --nocapture \
    ${G_TESTS:-decode::gemv_int8_matches_cpu decode::moe_int8_matches_cpu \
    decode_with_session_23_switches_gives_the_same_tokens_and_logprobs} > "$OUT/tests-new.log" 2>&1
  say "tests (new) rc=$? at $(el)s"
  grep -E "^test .*(ok|FAILED)$|panicked" "$OUT/tests-new.log" | cut -c1-220 | tee -a "$S"
  grep -E "^KERNEL dec_(gemv4_x8x2 4096 wide.*TwoTiles|down_combine_x8x2_r96 Int8Pairs, Small)|^MODEL gemv4w" \
    "$OUT/tests-new.log" | cut -c1-220 | head -12 | tee -a "$S"
  if [ "${OLD_TESTS:-0}" = 1 ]; then
    # The decode kernels' existing tests and the shipping configuration (a check that nothing
    # else moved: the switches act on int8-pair launches only, which these fp32 and
    # default-option tests do not take; the tests above cover the switches).
    timeout "$(cap "${OLD_TEST_S:-90}")" "$B/gpu" --ignored --test-threads=1 \
      fused_decode_blocks_match_cpu wide_decode_gemvs_match_cpu shipping_configuration_ \
      > "$OUT/tests-old.log" 2>&1
    say "tests (fused_decode_blocks…, wide_decode_gemvs…, shipping_configuration_*) rc=$? at $(el)s"
    grep -E "^test .*FAILED$|^test result|panicked" "$OUT/tests-old.log" | head -20 | tee -a "$S"
  fi
fi
wait "$SYN"; say "synth full rc=$? at $(el)s"
bench() {  # bench NAME ENV...: the sweep, under the environment ENV
  local name=$1; shift
  if ! left; then say "bench $name: skipped (deadline) at $(el)s"; return; fi
  env "$@" timeout "$(cap "${BENCH_S:-60}")" "$B/lily-engine" bench --model "$M" --device cuda \
    --prefill 256 --decode-ctx 256,4K,32K --decode-tokens 128 --repeat 1 > "$OUT/bench-$name.log" 2>&1
  say "bench $name rc=$? at $(el)s: $(grep -E '^ +[0-9]+[KM]? +[0-9.]+ +[0-9.]+' "$OUT/bench-$name.log" | tr -s ' ' | tr '\n' '|')"
  grep -h -m1 -oE "(4096-column projections one block an SM|MoE down kernel at 96 registers) (on|off)" \
    "$OUT/bench-$name.log" | tr '\n' ' ' >> "$S"; echo >> "$S"
}
for r in $(seq 1 "${ROUNDS:-2}"); do
  # shellcheck disable=SC2086
  bench "off-$r" $OFF
  # shellcheck disable=SC2086
  bench "on-$r" $ON
  if [ -n "${ALONE:-}" ]; then
    bench "grid-$r" LILY_GEMV4W_SM_GRID=1 LILY_DOWN_96_REGS=0
    bench "regs-$r" LILY_GEMV4W_SM_GRID=0 LILY_DOWN_96_REGS=1
  fi
done
if [ "${SKIP_PROFILE:-0}" != 1 ] && left; then
  # (graphs off, each launch timed alone: the switches' co-residence does not show here, the
  # grid's staging and tile count do)
  # shellcheck disable=SC2086
  env LILY_PROFILE=1 $ON timeout "$(cap 60)" "$B/lily-engine" bench --model "$M" --device cuda \
    --prefill 256 --decode-ctx 4K --decode-tokens 32 --repeat 1 > "$OUT/profile-on-4K.log" 2>&1
  say "profile on 4K rc=$? at $(el)s:"
  grep -E "kernel profile|dec_gemv4w|dec_down_combine|dec_glu4|dec_gemv4_x8x2|dec_gemv8|dec_dn_step" \
    "$OUT/profile-on-4K.log" | head -16 | tr -s ' ' | tee -a "$S"
fi
say "done at $(el)s"
