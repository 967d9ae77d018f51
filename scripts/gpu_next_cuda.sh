#!/usr/bin/env bash
# The first CUDA call of a session with little device time (≤ 9.5 minutes), on the full-size
# synthetic checkpoint: the shipping default that has never run on a GPU first, then the
# one-launch decode MoE's A/B (issue 30). It folds session 14's gpu_moe_ab.sh (now gone) and the tc_scan half of
# gpu_batch_diag.sh into one call:
#   1. GPU tests: `tc_scan`'s redesigned two (the scan's changed-gate check; the model's prefill
#      through the scan against fp32 beside the recurrence's) with the scan's kernel tests, and
#      dec_moe's (against the three launches and the CPU, graph replays; the model on vs off; not
#      the batched model test, batch::…, which call 2 runs);
#   2. `bench` decode at 256 / 4K / 32K (prefill 512), LILY_FUSED_MOE 0 and 1 alternated ROUNDS
#      (2) times, graphs on;
#   3. one LILY_PROFILE=1 decode at 4K of each (graphs off);
#   4. teacher-forced `score` over LEN (1,024) positions against fp32, in two tables:
#      prefill pieces of 256 (the chunk path: bf16 with `tc_scan`, the default, and with the
#      recurrence, LILY_TC_SCAN=0), and one token a call (the decode path: bf16 with the three
#      MoE launches and with dec_moe);
# Summary: $OUT/summary.txt. No step starts past DEADLINE seconds (480).
# Here: the binaries of a CUDA staging (scripts/stage_gpu.sh, gzip -9), this script,
# gpu_ab_common.sh and agreement_table.py beside them. There:
#   bash .carry/NAME/gpu_next_cuda.sh     (carry: .carry/NAME; timeout_s 600)
# Knobs: SKIP_TESTS=1, TEST_S (240), ROUNDS (2), LEN (1024), DEADLINE (480).
set -u
. "$(dirname "$0")/gpu_ab_common.sh" 480
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "${TEST_S:-240}" "$B/gpu" --ignored --test-threads=1 --nocapture tensor_core_scan \
    model_prefill_through_the_tensor_core_scan one_launch_moe --skip batch:: > "$OUT/tests.log" 2>&1
  say "tests (tc_scan, dec_moe) rc=$? at $(el)s"
  grep -E "^test .*(ok|FAILED)$|^test result|panicked|bit for bit|graph replays|^MODEL|dec_moe vs CPU" \
    "$OUT/tests.log" | cut -c1-300 | head -60 | tee -a "$S"
fi
wait $SYN; say "synth rc=$? at $(el)s"; tail -2 "$OUT/synth.log" >> "$S"
bench() {  # bench NAME FUSED_MOE
  if ! left; then say "bench $1: skipped (deadline) at $(el)s"; return; fi
  LILY_FUSED_MOE=$2 timeout 100 "$B/lily-engine" bench --model $M --device cuda \
    --prefill 512 --decode-ctx 256,4K,32K --decode-tokens 128 --repeat 1 > "$OUT/bench-$1.log" 2>&1
  say "bench $1 (LILY_FUSED_MOE=$2) rc=$? at $(el)s:"; grep -v INFO "$OUT/bench-$1.log" | tail -8 | tee -a "$S"
}
for r in $(seq 1 "${ROUNDS:-2}"); do bench "off-$r" 0; bench "on-$r" 1; done
for f in 0 1; do
  if ! left; then say "profile $f: skipped (deadline) at $(el)s"; continue; fi
  LILY_FUSED_MOE=$f LILY_PROFILE=1 timeout 90 "$B/lily-engine" bench --model $M --device cuda --prefill 512 \
    --decode-ctx 4K --decode-tokens 36 --repeat 1 > "$OUT/profile-$f.log" 2>&1
  say "profile (decode 4K, LILY_FUSED_MOE=$f) rc=$? at $(el)s:"
  grep -E "kernel profile|decode moe|dec_moe|dec_glu4|dec_down|dec_gemv8|in all" "$OUT/profile-$f.log" | head -12 | tee -a "$S"
done
W=/tmp/next-score; mkdir -p "$W"
score() {  # score NAME PIECE ENV...
  local name=$1 piece=$2; shift 2
  if ! left; then say "score $name: skipped (deadline) at $(el)s"; return; fi
  env "$@" timeout 75 "$B/lily-engine" score --model $M --len "${LEN:-1024}" --piece "$piece" --device cuda \
    --out "$W/$name" > "$W/$name.log" 2>&1
  say "score $name (piece $piece, $*) rc=$? at $(el)s: $(tail -1 "$W/$name.log" | cut -c1-160)"
}
table() {  # table NAME REF OTHER...
  local name=$1 ref=$2; shift 2
  local others=(); for o in "$@"; do others+=(--other "$W/$o"); done
  timeout 30 python3 "$HERE/agreement_table.py" --ref "$W/$ref" "${others[@]}" --out "$OUT/$name.md" \
    --json "$OUT/$name.json" > "$W/$name-table.log" 2>&1
  say "table $name rc=$? at $(el)s"; grep -E "^\| " "$OUT/$name.md" | cut -c1-400 | head -8 | tee -a "$S"
}
score fp32-256 256 LILY_CUDA_FP32=1
score tc-scan-256 256
score recurrent-256 256 LILY_TC_SCAN=0
table agreement-prefill fp32-256 tc-scan-256 recurrent-256
score fp32-1 1 LILY_CUDA_FP32=1
score three-1 1 LILY_FUSED_MOE=0
score one-1 1 LILY_FUSED_MOE=1
table agreement-decode fp32-1 three-1 one-1
say "done at $(el)s"
