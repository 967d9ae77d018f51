#!/usr/bin/env bash
# The device call of branch mma-deep (issue 32; ≤ 400 s): `mma_rows_deep` (LILY_MMA_ROWS_DEEP; off
# by default, `--mma-rows-deep`) — a batched decode step's 4-bit projections in dec_mma_rows_deep
# (dec_mma_rows' sums, its weight nibbles by 16-byte cp.async through three shared-memory chunk
# stages a warp) — against dec_mma_rows (the shipping default), on the full-size checkpoint
# (synthesised into /dev/shm/full-mlx while the tests run):
#   1. GPU tests: batched_decode_mma_rows_match_cpu (dec_mma_rows and dec_mma_rows_deep against
#      the CPU, both modes, 1-8 and 11 rows, whole and split tiles, 68,000 rows) and
#      batched_decode_gemv_rows_match_cpu (the launcher's refusals, every rows kernel), then
#      decode_batched_steps_match_each_sequence_alone_on_tiny / _small (their cases include the
#      shipping step with `mma_rows_deep`: three and eight sequences on tiny, eight on small),
#      within TEST_S (90) seconds;
#   2. full size, `bench --batch 1,4,8` at a 1K context, off / on alternated twice (ROUNDS);
#   3. a 4-row profile of each (LILY_PROFILE=1, graphs off): the projections' lines (lm_head is
#      the one launch of 248,320 rows; the others per layer).
# Summary on stdout and in $OUT/summary.txt (logs beside it). No step starts past DEADLINE (340 s),
# none runs past HARD (395 s): each step's timeout is cut to what is left.
# Here: `CARGO_TARGET_DIR=/work/wt-mma-deep/target bash scripts/stage_gpu.sh
# /work/main/.carry/mmadeep`, `gzip -9 /work/main/.carry/mmadeep/bin/*`, this script and
# gpu_rows_ab_common.sh + gpu_ab_common.sh beside them (as stage_gpu.sh puts them).
# There:
#   bash .carry/mmadeep/gpu_mma_deep_ab.sh   (carry: .carry/mmadeep .carry/tokenizer; timeout_s 420)
# Knobs: SKIP_TESTS=1, TEST_S (90), ROUNDS (2), SKIP_PROFILES=1, STEPS (64), DEADLINE, HARD,
# DRY=1 (print the commands instead of running them, into $OUT/dry.log).
set -u
AB_LAYERS=4
. "$(dirname "$0")/gpu_rows_ab_common.sh" "${DEADLINE:-340}" "${HARD:-395}"
OFF=LILY_MMA_ROWS_DEEP=0
ON=LILY_MMA_ROWS_DEEP=1

tests() {
  [ "${SKIP_TESTS:-0}" = 1 ] && return
  local test_s=${TEST_S:-90}
  run timeout "$(tmo $(( test_s / 2 )))" "$B/gpu" --ignored --test-threads=1 --nocapture \
    batched_decode_mma_rows_match_cpu batched_decode_gemv_rows_match_cpu > "$OUT/tests-kernels.log" 2>&1
  say "tests (dec_mma_rows + dec_mma_rows_deep against the CPU, the rows launcher) rc=$? at $(el)s"
  local rest=$(( test_s - $(el) )); [ "$rest" -lt 10 ] && rest=10
  run timeout "$(tmo "$rest")" "$B/gpu" --ignored --test-threads=1 --nocapture \
    decode_batched_steps_match_each_sequence_alone > "$OUT/tests-model.log" 2>&1
  say "tests (decode_batched_steps_match_each_sequence_alone_on_*) rc=$? at $(el)s"
  grep -hE "^test .*(ok|FAILED)$|^test result|panicked|KERNEL decode.cu dec_mma" \
    "$OUT/tests-kernels.log" "$OUT/tests-model.log" | cut -c1-220 | head -40 | tee -a "$S"
}
tests
wait "$SYNF"; say "synth full rc=$? at $(el)s"

for r in $(seq 1 "${ROUNDS:-2}"); do
  bench "off-$r" "$FULL" 75 $OFF
  bench "on-$r" "$FULL" 75 $ON
done

profile() {  # profile NAME ENV...: 4 rows, full size, graphs off: the projections' lines
  local name=$1; shift
  if [ "${SKIP_PROFILES:-0}" = 1 ]; then return; fi
  if ! left; then say "profile $name: skipped (deadline) at $(el)s"; return; fi
  run env "$@" LILY_PROFILE=1 timeout "$(tmo 50)" "$B/lily-engine" bench --model "$FULL" --device cuda \
    --prefill 1K --decode-ctx 1K --decode-tokens 16 --repeat 1 --batch 4 > "$OUT/profile-$name.log" 2>&1
  say "profile (full size, 4 rows at 1K, $name: $*) rc=$? at $(el)s:"
  grep -E "kernel profile|dec_mma_rows|dec_gemv_rows|dec_glu4|dec_down_combine|in all" \
    "$OUT/profile-$name.log" | cut -c1-160 | head -12 | tee -a "$S"
}
profile on $ON
profile off $OFF
say "done at $(el)s"
