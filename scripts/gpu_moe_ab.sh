#!/usr/bin/env bash
# One device call for the one-launch decode MoE (issue 30, `fused_moe`: decode.cu's dec_moe):
#   1. its GPU tests (the kernel against the three launches and the CPU at the full widths, graph
#      replays; the model with the switch on and off); the other decode and MoE kernel tests come
#      last (5.), while time is left;
#   2. on the full-size synthetic checkpoint, `bench` decode at 256 / 4K / 32K with the switch off
#      and on, alternated ROUNDS (2) times (graphs on, the shipping configuration otherwise);
#   3. one `LILY_PROFILE=1` decode at 4K of each (graphs off: every launch between events);
#   4. teacher-forced `score` over LEN (1,024) positions fed one token a call (`--piece 1`: every
#      position a one-token step, so every MoE block runs the kernel under test): fp32 (the
#      reference), bf16 with the switch off, bf16 on, fp32 on; scripts/agreement_table.py
#      against fp32;
#   5. the other decode and MoE kernel tests.
# Summary: $OUT/summary.txt (logs beside it). ≤ 9.5 minutes: no step starts past DEADLINE
# seconds (default 480).
#
# Here: `CARGO_TARGET_DIR=$PWD/target bash scripts/stage_gpu.sh /work/main/.carry/fused-moe`,
# then `gzip -9 /work/main/.carry/fused-moe/bin/*` and copy this script and agreement_table.py
# into that folder (stage_gpu.sh copies gpu_ab_common.sh, the preamble it sources). There:
#   bash .carry/fused-moe/gpu_moe_ab.sh      (run's carry: .carry/fused-moe; timeout_s 600)
# Knobs: SKIP_TESTS=1, TEST_S (the new tests' timeout, 200), KERNEL_TEST_S (the other decode and
# MoE tests', 90), BENCH_S (100), ROUNDS (2), SKIP_PROFILE=1, LEN (1024), SKIP_SCORE=1,
# DEADLINE (480).
set -u
. "$(dirname "$0")/gpu_ab_common.sh" 480
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_S:-200}" "$B/gpu" --ignored --test-threads=1 --nocapture one_launch_moe \
    > "$OUT/tests-moe.log" 2>&1
  say "tests (dec_moe) rc=$? at $(el)s"
  grep -E "^test .*(ok|FAILED)$|^test result|panicked|bit for bit|graph replays|MODEL|dec_moe vs CPU" \
    "$OUT/tests-moe.log" | cut -c1-300 | head -60 | tee -a "$S"
fi
wait $SYN; say "synth rc=$? at $(el)s"; tail -2 "$OUT/synth.log" >> "$S"
bench() {  # bench NAME FUSED_MOE: decode at 256 / 4K / 32K with the switch off (0) or on (1)
  if ! left; then say "bench $1: skipped (deadline) at $(el)s"; return; fi
  LILY_FUSED_MOE=$2 timeout "${BENCH_S:-100}" "$B/lily-engine" bench --model $M --device cuda \
    --prefill 512 --decode-ctx 256,4K,32K --decode-tokens 128 --repeat 1 > "$OUT/bench-$1.log" 2>&1
  say "bench $1 (LILY_FUSED_MOE=$2) rc=$? at $(el)s:"; grep -v INFO "$OUT/bench-$1.log" | tail -8 | tee -a "$S"
}
for r in $(seq 1 "${ROUNDS:-2}"); do
  bench "off-$r" 0
  bench "on-$r" 1
done
if [ "${SKIP_PROFILE:-0}" != 1 ]; then
  for f in 0 1; do
    if ! left; then say "profile $f: skipped (deadline) at $(el)s"; continue; fi
    LILY_FUSED_MOE=$f LILY_PROFILE=1 timeout 90 "$B/lily-engine" bench --model $M --device cuda --prefill 512 \
      --decode-ctx 4K --decode-tokens 36 --repeat 1 > "$OUT/profile-$f.log" 2>&1
    say "profile (decode 4K, LILY_FUSED_MOE=$f) rc=$? at $(el)s:"
    grep -E "kernel profile|decode moe|dec_moe|dec_glu4|dec_down|dec_gemv8|in all" "$OUT/profile-$f.log" | head -12 | tee -a "$S"
  done
fi
if [ "${SKIP_SCORE:-0}" != 1 ]; then
  W=/tmp/moe-score; mkdir -p "$W"
  score() {  # score NAME ENV...: LEN positions, one token a call
    local name=$1; shift
    if ! left; then say "score $name: skipped (deadline) at $(el)s"; return; fi
    env "$@" timeout 75 "$B/lily-engine" score --model $M --len "${LEN:-1024}" --piece 1 --device cuda \
      --out "$W/$name" > "$W/$name.log" 2>&1
    say "score $name ($*) rc=$? at $(el)s: $(tail -1 "$W/$name.log" | cut -c1-160)"
  }
  score fp32 LILY_CUDA_FP32=1 LILY_FUSED_MOE=0
  score bf16-three LILY_FUSED_MOE=0
  score bf16-one LILY_FUSED_MOE=1
  score fp32-one LILY_CUDA_FP32=1 LILY_FUSED_MOE=1
  timeout 30 python3 "$HERE/agreement_table.py" --ref "$W/fp32" --other "$W/bf16-three" --other "$W/bf16-one" \
    --other "$W/fp32-one" --out "$OUT/agreement.md" --json "$OUT/agreement.json" > "$W/table.log" 2>&1
  say "table rc=$? at $(el)s"; grep -E "^\| " "$OUT/agreement.md" | cut -c1-400 | head -12 | tee -a "$S"
fi
# Last, while time is left: the other decode and MoE kernel tests (dec_down_combine's input
# staging is now stage_items, shared with dec_moe).
if [ "${SKIP_TESTS:-0}" != 1 ] && left; then
  timeout "${KERNEL_TEST_S:-90}" "$B/gpu" --ignored --test-threads=1 decode:: moe:: --skip one_launch_moe \
    > "$OUT/tests-decode.log" 2>&1
  say "tests (decode, moe) rc=$? at $(el)s"
  grep -E "^test .*(ok|FAILED)$|^test result|panicked" "$OUT/tests-decode.log" | head -20 | tee -a "$S"
fi
say "done at $(el)s"
