#!/usr/bin/env bash
# One device call for the routed experts' tiles by load (issue 31, `group_tiles_by_load`:
# gemm_grouped_wgb_load) and the GLU in the up projection's epilogue (`experts_glu_epilogue`),
# with and without the tensor-core DeltaNet scan (`tc_scan`; the two together are what issue 31's
# must-reach needs): the new GPU tests with the GEMM kernels' and the MoE's, then on the full-size
# synthetic checkpoint `lily-engine bench --prefill 512,4K,32K` for four variants alternated twice
# (off / moe / scan / scan+moe; moe = both new switches), then one run of scan + tiles by load
# alone (the GLU's own share) and one profile of a 4K prefill with everything on. Summary:
# $OUT/summary.txt (logs beside it). ≤ 9 minutes: no run starts past DEADLINE seconds (default
# 460) that could not end by 540.
#
# Here: `CARGO_TARGET_DIR=$PWD/target bash scripts/stage_gpu.sh /work/main/.carry/prefill-moe`,
# then `gzip -9 /work/main/.carry/prefill-moe/bin/*` and copy this script into that folder
# (stage_gpu.sh copies gpu_ab_common.sh, the preamble it sources). There:
#   bash .carry/prefill-moe/gpu_prefill_ab.sh   (run's carry: .carry/prefill-moe; timeout_s 600)
# Knobs: SKIP_TESTS=1, TEST_S (the tests' timeout, 180), BENCH_S (75), DEADLINE (460),
# ROUNDS (rounds of the four variants, 2), SKIP_PROFILE=1.
set -u
. "$(dirname "$0")/gpu_ab_common.sh" 460
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  # The kernel test (runs of every width against the exact bf16 product and bit for bit against
  # the fixed tiles; the GLU epilogue against silu_mul + to_bf16; 4K expert shapes timed), every
  # other GEMM kernel test (the shared epilogue), the MoE kernels' tests, and the model test
  # (logits and greedy tokens with the switches on vs off).
  timeout "${TEST_S:-180}" "$B/gpu" --ignored --test-threads=1 --nocapture gemm:: moe:: \
    model_prefill_with_the_experts_tiles_by_load > "$OUT/tests.log" 2>&1
  say "tests rc=$? at $(el)s"
  grep -E "^test .*(ok|FAILED)$|^test result|panicked|differ in bits|wgb_load|WgbLoad|Wgb128|MODEL" "$OUT/tests.log" \
    | grep -v " ok$" | head -60 | tee -a "$S"
  grep -E "^test .* ok$" "$OUT/tests.log" | tee -a "$S"
fi
wait $SYN; say "synth rc=$? at $(el)s"; tail -2 "$OUT/synth.log" >> "$S"
# bench NAME TC_SCAN BY_LOAD GLU: the sweep the issue asks for with the switches as given.
bench() {
  if ! left; then say "bench $1: skipped (deadline) at $(el)s"; return; fi
  LILY_TC_SCAN=$2 LILY_GROUP_TILES_BY_LOAD=$3 LILY_EXPERTS_GLU_EPILOGUE=$4 timeout "${BENCH_S:-75}" \
    "$B/lily-engine" bench --model $M --device cuda --prefill 512,4K,32K --decode-ctx 64 --decode-tokens 1 \
    > "$OUT/bench-$1.log" 2>&1
  say "bench $1 (LILY_TC_SCAN=$2 LILY_GROUP_TILES_BY_LOAD=$3 LILY_EXPERTS_GLU_EPILOGUE=$4) rc=$? at $(el)s:"
  grep -v INFO "$OUT/bench-$1.log" | sed -n '/prefill/,/ctx/p' | grep -v ctx | tee -a "$S"
}
for r in $(seq 1 "${ROUNDS:-2}"); do
  bench "off-$r" 0 0 0
  bench "moe-$r" 0 1 1
  bench "scan-$r" 1 0 0
  bench "scan-moe-$r" 1 1 1
done
bench "scan-load" 1 1 0
if [ "${SKIP_PROFILE:-0}" != 1 ] && left; then
  LILY_TC_SCAN=1 LILY_GROUP_TILES_BY_LOAD=1 LILY_EXPERTS_GLU_EPILOGUE=1 LILY_PROFILE=1 timeout 60 \
    "$B/lily-engine" bench --model $M --device cuda --prefill 4K --decode-ctx 64 --decode-tokens 1 --repeat 1 \
    > "$OUT/profile-on.log" 2>&1
  say "profile (4K prefill, everything on) rc=$? at $(el)s:"
  sed -n '/kernel profile/,$p' "$OUT/profile-on.log" | head -28 | tee -a "$S"
fi
say "done at $(el)s"
