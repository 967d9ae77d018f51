#!/usr/bin/env bash
# One device call for the routed experts' grouped GEMM (issue 31, session 22, branch ggemm):
# `wgmma_narrow_tiles` (chunks whose experts average ≤ 24 items on gemm_grouped_wgb32's tiles of
# 32, LILY_WGMMA_NARROW_TILES=1), `wgmma_tail_tiles` (each expert's last ≤ 32 items past its
# tiles of 128 in a second launch of gemm_grouped_wgb32, LILY_WGMMA_TAIL_TILES=1) and
# `tile_grid_by_items` (the grouped launches' grid sized by the chunk's items, not by a whole
# chunk's bound in tiles of 16, LILY_TILE_GRID_BY_ITEMS=1); ON is all three; ON2 is ON plus
# `wgmma_lean_dequant` (the wgmma GEMMs' _lean variants: the same bf16 weight fragments from
# fewer instructions, LILY_WGMMA_LEAN_DEQUANT=1). First the GPU tests
# by name (the new kernel against the bf16 product and the fixed tiles, with each launch's µs at
# the model's shapes, again on the _lean variants, bit-identical; the _lean variants against the
# plain kernels bit for bit; the forward pass with all three against the fixed tiles; the existing
# grouped-GEMM and MoE tests), then on the full-size synthetic checkpoint `bench --prefill
# 512,4K,32K --decode-ctx 1 --decode-tokens 1` OFF / ON / ON2 alternated twice, then one
# LILY_PROFILE=1 prefill of 512 and one of 4K under ON2 (ON if ON2=none) on a 4-layer
# full-width checkpoint: the grouped GEMM's rows into the summary. Summary: $OUT/summary.txt
# (logs beside it). ≤ 8 minutes: no run starts past DEADLINE seconds (default 400) and none
# reaches past HARD (460).
#
# Here: `CARGO_TARGET_DIR=$PWD/target bash scripts/stage_gpu.sh /work/main/.carry/ggemm`, then
# `gzip -9 /work/main/.carry/ggemm/bin/*` and copy this script into that folder (stage_gpu.sh
# copies gpu_ab_common.sh, the preamble it sources). There:
#   bash .carry/ggemm/gpu_ggemm_ab.sh          (run's carry: .carry/ggemm; timeout_s 540)
# Knobs: OFF / ON / ON2 (environments; ON defaults to the three switches, ON2 to those and the
# lean dequantisation; ON2=none drops the third configuration of each round), SKIP_TESTS=1,
# TEST_S (the new tests' timeout, 150), OLD_TEST_S (the existing grouped-GEMM and MoE tests',
# 90), BENCH_S (70), ROUNDS (2), SKIP_PROFILE=1, DEADLINE (400), HARD (460).
set -u
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-400}"
AB_HARD=${HARD:-460}
OFF=${OFF:-LILY_WGMMA_NARROW_TILES=0 LILY_WGMMA_TAIL_TILES=0 LILY_TILE_GRID_BY_ITEMS=0}
ON=${ON:-LILY_WGMMA_NARROW_TILES=1 LILY_WGMMA_TAIL_TILES=1 LILY_TILE_GRID_BY_ITEMS=1}
ON2=${ON2:-$ON LILY_WGMMA_LEAN_DEQUANT=1}  # a third configuration, alternated with the two
[ "$ON2" = none ] && ON2=
OFF="$OFF LILY_WGMMA_LEAN_DEQUANT=0"
case $ON in *LILY_WGMMA_LEAN_DEQUANT*) ;; *) ON="$ON LILY_WGMMA_LEAN_DEQUANT=0" ;; esac
say "OFF: $OFF | ON: $ON${ON2:+ | ON2: $ON2}"
wgpu_synth4  # (a plain `synth --layers 4` of the full widths into $M4; nothing of wgpu's)
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  # The new tests (the kernel against the bf16 product and the fixed tiles, with each launch's µs
  # at the model's shapes; the forward pass with both switches against the fixed tiles: they set
  # their options themselves), then the grouped GEMMs' and the MoE's existing tests (moe_group
  # and the stage count became template parameters).
  timeout "$(cap "${TEST_S:-150}")" "$B/gpu" --ignored --test-threads=1 --nocapture \
    ${G_TESTS:-gemm::wgmma_lean_dequant_gives_the_same_bits gemm::grouped_narrow_and_tail_tiles_match_the_fixed_tiles \
    model_prefill_through_narrow_and_tail_tiles_gives_the_same_tokens} > "$OUT/tests-ggemm.log" 2>&1
  say "tests (new) rc=$? at $(el)s"
  grep -E "^KERNEL|^MODEL|^test .*(ok|FAILED)$|panicked" "$OUT/tests-ggemm.log" | cut -c1-220 | tee -a "$S"
  timeout "$(cap "${OLD_TEST_S:-90}")" "$B/gpu" --ignored --test-threads=1 \
    gemm::wgmma_linears_match_the_bf16_product gemm::tensor_core_linears_match_the_bf16_product moe:: \
    > "$OUT/tests-old.log" 2>&1
  say "tests (gemm::wgmma_linears…, gemm::tensor_core_linears…, moe::) rc=$? at $(el)s"
  grep -E "^test .*FAILED$|^test result|panicked" "$OUT/tests-old.log" | head -20 | tee -a "$S"
fi
wait "$SYN"; say "synth full rc=$? at $(el)s"
bench() {  # bench NAME ENV...: the sweep, under the environment ENV
  local name=$1; shift
  if ! left; then say "bench $name: skipped (deadline) at $(el)s"; return; fi
  env "$@" timeout "$(cap "${BENCH_S:-70}")" "$B/lily-engine" bench --model "$M" --device cuda \
    --prefill 512,4K,32K --decode-ctx 1 --decode-tokens 1 > "$OUT/bench-$name.log" 2>&1
  say "bench $name rc=$? at $(el)s: $(grep -E '^ +[0-9]+[KM]? +[0-9.]+ +[0-9.]+' "$OUT/bench-$name.log" | tr -s ' ' | tr '\n' '|')"
  grep -h -m1 -oE "(experts' (wgmma tiles of 32 for few items|last items in tiles of 32|grid by their items)|wgmma GEMMs' lean dequantisation) (on|off)" \
    "$OUT/bench-$name.log" | tr '\n' ' ' >> "$S"; echo >> "$S"
}
for r in $(seq 1 "${ROUNDS:-2}"); do
  # shellcheck disable=SC2086
  bench "off-$r" $OFF
  # shellcheck disable=SC2086
  bench "on-$r" $ON
  # shellcheck disable=SC2086
  [ -n "$ON2" ] && bench "on2-$r" $ON2
done
if [ "${SKIP_PROFILE:-0}" != 1 ]; then
  wait "$SYN4"
  for v in on2-512 on2-4K; do  # (ON's and OFF's: this morning's, s22-cuda-prefill.txt, and the benches)
    left || { say "profile $v: skipped (deadline) at $(el)s"; continue; }
    case $v in on2-*) envs=${ON2:-$ON} ;; on-*) envs=$ON ;; *) envs=$OFF ;; esac
    # shellcheck disable=SC2086
    env LILY_PROFILE=1 $envs timeout "$(cap 60)" "$B/lily-engine" bench --model "$M4" --device cuda \
      --prefill "${v#*-}" --decode-ctx 1 --decode-tokens 1 --repeat 1 > "$OUT/profile-$v.log" 2>&1
    say "profile $v (4 layers) rc=$? at $(el)s:"
    grep -E "kernel profile|gemm_grouped|moe_group" "$OUT/profile-$v.log" | head -12 | tr -s ' ' | tee -a "$S"
  done
fi
say "done at $(el)s"
