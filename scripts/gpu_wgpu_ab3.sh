#!/usr/bin/env bash
# Session 21's wgpu call (≤ 9 minutes, Vulkan on the device's GPU): three configurations A/B'd at
# once on the full-size checkpoint, `bench --prefill 512,4K --decode-ctx 4K,32K --decode-tokens 64`,
# OFF / ON1 / ON2 twice (environments, e.g. ON1="LILY_WGPU_COOP_BIG=1 LILY_WGPU_MOE_ROUNDS=1"),
# then LILY_PROFILE=1 at 4K of each (rows of decode's profile into the summary), then `selftest`
# (wgpu and CUDA against the CPU) on a 4-layer full-width model under ON1 and ON2. First, beside
# the synth, WTESTS (lily-wgpu model tests, the staged bin/wgpu_model) on the GPU under ON1.
# Staged by scripts/stage_gpu.sh with gpu_ab_common.sh; carry .carry/NAME .carry/tokenizer .gl.
set -u
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-480}"
AB_HARD=${HARD:-570}
OFF=${OFF:-LILY_NOTHING=0}; ON1=${ON1:-LILY_NOTHING=1}; ON2=${ON2:-LILY_NOTHING=2}
wgpu_setup
wgpu_synth4
if [ -n "${WTESTS:-}" ]; then
  # shellcheck disable=SC2086
  env $ON1 timeout "$(cap 150)" "$B/wgpu_model" --test-threads=1 --nocapture $WTESTS > "$OUT/wtests.log" 2>&1
  say "wgpu tests ($WTESTS) rc=$? at $(el)s"
  grep -hE "^test .*(ok|FAILED)$|^test result|panicked|refused" "$OUT/wtests.log" | cut -c1-250 | head -20 | tee -a "$S"
fi
wait "$SYN"; say "synth full rc=$? at $(el)s"
export PREFILL=512,4K
for round in 1 2; do
  # shellcheck disable=SC2086
  BENCH_S=90 wgpu_bench "off-$round" 4K,32K "decode [^;]*" $OFF
  # shellcheck disable=SC2086
  BENCH_S=90 wgpu_bench "on1-$round" 4K,32K "decode [^;]*" $ON1
  # shellcheck disable=SC2086
  BENCH_S=90 wgpu_bench "on2-$round" 4K,32K "decode [^;]*" $ON2
done
for v in off on1 on2; do
  case $v in off) envs=$OFF ;; on1) envs=$ON1 ;; on2) envs=$ON2 ;; esac
  left || break
  # shellcheck disable=SC2086
  env LILY_PROFILE=1 $envs timeout "$(cap 60)" "$B/lily-engine" bench --model "$M" --device wgpu --prefill 4K \
    --decode-ctx 4K --decode-tokens 16 --repeat 1 > "$OUT/prof-$v.log" 2>&1
  say "wgpu profile $v rc=$? at $(el)s:"
  grep -A14 -E '^\[decode\]' "$OUT/prof-$v.log" | tr -s ' ' | tee -a "$S" > /dev/null
  grep -A8 -E '^\[prefill\]' "$OUT/prof-$v.log" | tr -s ' ' | tee -a "$S" > /dev/null
done
# shellcheck disable=SC2086
wgpu_selftest selftest-on1 $ON1
# shellcheck disable=SC2086
wgpu_selftest selftest-on2 $ON2
say "done at $(el)s"
