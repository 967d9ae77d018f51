#!/usr/bin/env bash
# Session 23, branch s23wdec (≤ 6 minutes, Vulkan on the device's GPU): `in_rows`, the ≥ 8,192-row
# decode products the persistent grid does not stream (DeltaNet's in_proj, attention's q/k/v) on
# fewer rows a workgroup. Modelled on gpu_wgpu_ab3.sh; staged by scripts/stage_gpu.sh with
# gpu_ab_common.sh (bin/lily-engine, bin/wgpu_model):
#   bash .carry/NAME/gpu_s23wdec_ab.sh      (carry: .carry/NAME .carry/tokenizer .gl; timeout_s 400)
# 1. beside the synth: lily-wgpu's `in_rows_kernels_match_the_host` on the GPU (it sets the knob
#    in each of its cases: run without LILY_WGPU_IN_ROWS, which would override them), then
#    `out_rows_kernels_match_the_host` (the 8-row kernel's other role);
# 2. `bench --device wgpu --prefill 512 --decode-ctx 4K,32K --decode-tokens 64 --repeat 1`,
#    OFF / ON alternated twice, ON2 after ON in round 1 (ON2=none leaves it out; its second
#    round runs last, if the clock allows);
# 3. one LILY_PROFILE=1 decode at 4K under ON (the products' rows into the summary);
# 4. `selftest` on a 4-layer full-width model under ON (in_proj and q/k/v at their full rows:
#    the forward path's check against the CPU);
# 5. if the clock allows: ON2's second round, then a profile under ON with 1,024 persistent
#    workers (lm_head's grid: with in_rows on, the 16-row kernel's only product).
set -u
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-330}"
AB_HARD=${HARD:-355}
OFF=${OFF:-LILY_WGPU_IN_ROWS=0}
ON=${ON:-LILY_WGPU_IN_ROWS=8}
ON2=${ON2:-LILY_WGPU_IN_ROWS=4}
K='in rows [0-9]+|rows workers [0-9]+|products it does not stream on its [0-9]+-row kernel[^;)]*'
R='lin.dn.in_proj|lin.attn.qkv|lin.lm_head|lin.dn.out|lin.router|lin.experts.glu'
wgpu_setup
wgpu_synth4
env -u LILY_WGPU_IN_ROWS timeout "$(cap 110)" "$B/wgpu_model" --test-threads=1 --nocapture \
  in_rows_kernels_match_the_host out_rows_kernels_match_the_host > "$OUT/wtests.log" 2>&1
say "wgpu tests rc=$? at $(el)s"
grep -hE "^test .*(ok|FAILED)$|^test result|panicked|^subgroups |refused" "$OUT/wtests.log" | cut -c1-250 | head -16 | tee -a "$S"
wait "$SYN"; say "synth full rc=$? at $(el)s"
export PREFILL=512
# OFF / ON twice (ON2 in round 1 only; its second round last, if the clock allows).
for round in 1 2; do
  # shellcheck disable=SC2086
  BENCH_S=75 wgpu_bench "off-$round" 4K,32K "$K" $OFF
  # shellcheck disable=SC2086
  BENCH_S=75 wgpu_bench "on-$round" 4K,32K "$K" $ON
  if [ "$ON2" != none ] && [ "$round" = 1 ]; then
    # shellcheck disable=SC2086
    BENCH_S=75 wgpu_bench "on2-1" 4K,32K "$K" $ON2
  fi
done
# shellcheck disable=SC2086
BENCH_S=75 wgpu_bench_rows prof-on 4K "$K" "$R" LILY_PROFILE=1 $ON
# shellcheck disable=SC2086
wgpu_selftest selftest-on $ON LILY_WGPU_CHUNK=64
if [ "$ON2" != none ]; then
  # shellcheck disable=SC2086
  BENCH_S=75 wgpu_bench "on2-2" 4K,32K "$K" $ON2
fi
# If the clock still allows: lm_head (with in_rows on, the 16-row kernel's only product on the
# full model) streamed by 1,024 workgroups instead of 512 (the existing rows_workers knob).
# shellcheck disable=SC2086
BENCH_S=60 wgpu_bench_rows prof-on-w1k 4K "$K" "$R" LILY_PROFILE=1 $ON LILY_WGPU_ROWS_WORKERS=1024
say "done at $(el)s"
