#!/usr/bin/env bash
# One device call for `wgmma_hoisted_addrs` (issue 31, session 23, branch s23pre; ≤ 5 minutes):
# the routed experts' grouped _lean GEMMs on their _hoist variants (a k-step's addresses held in
# registers: 195 against 265 instructions a thread a k-step in gemm_grouped_wgb64). Modelled on
# scripts/gpu_ggemm_ab.sh. Staged by scripts/stage_gpu.sh (which copies gpu_ab_common.sh beside):
#   CARGO_TARGET_DIR=$PWD/target bash scripts/stage_gpu.sh /work/main/.carry/s23pre
#   gzip -9 /work/main/.carry/s23pre/bin/*; cp scripts/gpu_s23pre_ab.sh /work/main/.carry/s23pre/
#   bash .carry/s23pre/gpu_s23pre_ab.sh     (run's carry: .carry/s23pre; timeout_s 330)
#   1. GPU tests, beside the synth: gemm::wgmma_hoisted_addrs_gives_the_same_bits (the _hoist
#      kernels against the plain ones bit for bit, and the bf16 product) and
#      gemm::grouped_narrow_and_tail_tiles_match_the_fixed_tiles (the model's shapes at 512 /
#      768 / 4,096 tokens: each launch's µs plain, _lean and _hoist — lines `KERNEL grouped fixed
#      hoist …`, `new hoist …` — with every _hoist output asserted bit-identical);
#   2. on the full-size synthetic checkpoint `bench --prefill 512,4K,32K --decode-ctx 1
#      --decode-tokens 1`, OFF (LILY_WGMMA_HOISTED_ADDRS=0) / ON (=1) alternated ROUNDS (2) times.
# The summary comes back in $OUT/summary.txt with the tests' log; the benches' logs stay in
# /tmp/s23pre-logs. Knobs: OFF / ON (environments), SKIP_TESTS=1, TEST_S (120), BENCH_S (60),
# ROUNDS (2), DEADLINE (230: no run starts later), HARD (290: none reaches past it).
set -u
R=${OUT:-$PWD/gpu-logs}; mkdir -p "$R"
L=/tmp/s23pre-logs; mkdir -p "$L"; OUT=$L
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-230}"
AB_HARD=${HARD:-290}
S=$R/summary.txt
OFF=${OFF:-LILY_WGMMA_HOISTED_ADDRS=0}
ON=${ON:-LILY_WGMMA_HOISTED_ADDRS=1}
say "OFF: $OFF | ON: $ON"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  timeout "$(cap "${TEST_S:-120}")" "$B/gpu" --ignored --test-threads=1 --nocapture \
    gemm::wgmma_hoisted_addrs_gives_the_same_bits gemm::grouped_narrow_and_tail_tiles_match_the_fixed_tiles \
    > "$L/tests.log" 2>&1
  say "tests rc=$? at $(el)s"
  grep -E "^KERNEL|^test .*(ok|FAILED)$|^test result|panicked" "$L/tests.log" | cut -c1-220 | tee -a "$S"
  cp "$L/tests.log" "$R/"
fi
wait "$SYN"; say "synth full rc=$? at $(el)s"
bench() {  # bench NAME ENV...: the sweep, under the environment ENV
  local name=$1; shift
  if ! left; then say "bench $name: skipped (deadline) at $(el)s"; return; fi
  env "$@" timeout "$(cap "${BENCH_S:-60}")" "$B/lily-engine" bench --model "$M" --device cuda \
    --prefill 512,4K,32K --decode-ctx 1 --decode-tokens 1 > "$L/bench-$name.log" 2>&1
  say "bench $name rc=$? at $(el)s: $(grep -E '^ +[0-9]+[KM]? +[0-9.]+ +[0-9.]+' "$L/bench-$name.log" | tr -s ' ' | tr '\n' '|')"
  grep -h -m1 -oE "wgmma (GEMMs' lean dequantisation|grouped GEMMs' hoisted addresses) (on|off)" \
    "$L/bench-$name.log" | tr '\n' ' ' >> "$S"; echo >> "$S"
}
for r in $(seq 1 "${ROUNDS:-2}"); do
  # shellcheck disable=SC2086
  bench "off-$r" $OFF
  # shellcheck disable=SC2086
  bench "on-$r" $ON
done
say "done at $(el)s"
