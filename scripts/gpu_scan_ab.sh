#!/usr/bin/env bash
# One device call for the tensor-core DeltaNet scan (issue 31, `tc_scan`: dn_wy_prep +
# dn_wy_scan): its GPU tests with the existing DeltaNet and model tests, then on the full-size
# synthetic checkpoint the bench with the switch off and on, alternated, and one profile of a 4K
# prefill with it on. Summary: $OUT/summary.txt (logs beside it). ≤ 9 minutes: no run starts
# past DEADLINE seconds (default 450) that could not end by 540.
#
# Here: `CARGO_TARGET_DIR=$PWD/target bash scripts/stage_gpu.sh /work/main/.carry/NAME`, then
# `gzip -9 /work/main/.carry/NAME/bin/*` and copy this script into that folder
# (stage_gpu.sh copies gpu_ab_common.sh, the preamble it sources). There:
#   bash .carry/NAME/gpu_scan_ab.sh          (run's carry: .carry/NAME; timeout_s 600)
# Knobs: SKIP_TESTS=1, TEST_S (the new tests' timeout, 200), MODEL_TEST_S (the other model tests',
# 120), BENCH_S (90), DEADLINE (450),
# ROUNDS (bench rounds of off + on, 2), SKIP_PROFILE=1.
set -u
. "$(dirname "$0")/gpu_ab_common.sh" 450
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  # The new tests first (the kernel against dn_recurrent and the CPU, the model with the switch on
  # and off), then every other DeltaNet and model test.
  timeout "${TEST_S:-200}" "$B/gpu" --ignored --test-threads=1 --nocapture deltanet:: \
    model_prefill_through_the_tensor_core_scan > "$OUT/tests-scan.log" 2>&1
  say "tests (scan) rc=$? at $(el)s"
  grep -E "^test .*(ok|FAILED)$|^test result|panicked|rel_l2|MODEL" "$OUT/tests-scan.log" | grep -v " ok$" | head -60 | tee -a "$S"
  grep -E "^test .* ok$" "$OUT/tests-scan.log" | tee -a "$S"
  timeout "${MODEL_TEST_S:-120}" "$B/gpu" --ignored --test-threads=1 model_ --skip model_matches_cpu_on_checkpoint_from_env \
    --skip model_prefill_through_the_tensor_core_scan > "$OUT/tests-model.log" 2>&1
  say "tests (model) rc=$? at $(el)s"
  grep -E "^test .*(ok|FAILED)$|^test result|panicked" "$OUT/tests-model.log" | grep -v " ok$" | head -20 | tee -a "$S"
  grep -c " ok$" "$OUT/tests-model.log" | sed 's/^/model tests ok: /' | tee -a "$S"
fi
wait $SYN; say "synth rc=$? at $(el)s"; tail -2 "$OUT/synth.log" >> "$S"
bench() {  # bench NAME TC_SCAN: the sweep the issue asks for, with the switch off (0) or on (1)
  if ! left; then say "bench $1: skipped (deadline) at $(el)s"; return; fi
  LILY_TC_SCAN=$2 timeout "${BENCH_S:-90}" "$B/lily-engine" bench --model $M --device cuda \
    --prefill 512,4K,32K --decode-ctx 4K --decode-tokens 32 > "$OUT/bench-$1.log" 2>&1
  say "bench $1 (LILY_TC_SCAN=$2) rc=$? at $(el)s:"; grep -v INFO "$OUT/bench-$1.log" | tail -8 | tee -a "$S"
}
for r in $(seq 1 "${ROUNDS:-2}"); do
  bench "off-$r" 0
  bench "on-$r" 1
  if [ "$r" = 1 ] && [ "${SKIP_PROFILE:-0}" != 1 ] && left; then
    LILY_TC_SCAN=1 LILY_PROFILE=1 timeout 90 "$B/lily-engine" bench --model $M --device cuda --prefill 4K \
      --decode-ctx 64 --decode-tokens 1 --repeat 1 > "$OUT/profile-on.log" 2>&1
    say "profile (4K prefill, tc_scan on) rc=$? at $(el)s:"
    grep -E "kernel profile|deltanet|dn_" "$OUT/profile-on.log" | head -14 | tee -a "$S"
  fi
done
say "done at $(el)s"
