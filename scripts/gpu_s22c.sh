#!/usr/bin/env bash
# Session 22, call 3 (≤ 9 minutes): the last two switches of the session, then the shipping
# binary's numbers. Staged beside gpu_ab_common.sh and gpu_ggemm_ab.sh:
#   G_OFF=LILY_NOTHING=0 G_ON=LILY_WGMMA_LEAN_DEQUANT=1 W_OFF=LILY_WGPU_COOP_ROWS=64 W_ON=LILY_WGPU_COOP_ROWS=128 \
#     bash .carry/s22c/gpu_s22c.sh    (carry: .carry/s22c .carry/tokenizer .gl; timeout_s 590)
#   1. CUDA: gpu_ggemm_ab.sh's new GPU tests (the lean dequantisation's), then its prefill sweep
#      G_OFF / G_ON twice;
#   2. wgpu through Vulkan: coop_products_and_logits_match_cpu under W_ON, then `bench --prefill
#      512,4K --decode-ctx 4K` W_OFF / W_ON twice, a LILY_PROFILE=1 prefill of 4K under W_ON and
#      `selftest` as it ships;
#   3. the shipping CUDA sweep (prefill 512 / 4K / 32K, decode 256 / 4K / 32K).
H="$(cd "$(dirname "$0")" && pwd)"
export AB_TOKENIZER=1
OUTD=${OUT:-$PWD/gpu-logs}; mkdir -p "$OUTD"
if [ -n "${G_ON:-}" ]; then
  # gpu_ggemm_ab.sh's new tests (the lean kernels bit for bit, each launch's µs) beside the synth,
  # then its sweep OFF / ON twice (ON2=none: two configurations).
  OFF="$G_OFF" ON="$G_ON" ON2=none TEST_S=${G_TEST_S:-130} OLD_TEST_S=1 SKIP_PROFILE=1 DEADLINE=${G_DEADLINE:-230} HARD=${G_HARD:-260} \
    bash "$H/gpu_ggemm_ab.sh"
fi
(
  . "$H/gpu_ab_common.sh" "${W_DEADLINE:-250}"
  AB_HARD=${W_HARD:-300}
  wgpu_setup > /dev/null 2>&1
  wgpu_synth4
  # shellcheck disable=SC2086
  env ${W_ON:-LILY_NOTHING=1} timeout 100 "$B/wgpu_model" --test-threads=1 --nocapture ${W_TEST:-coop_products_and_logits_match_cpu} > "$OUT/wtests.log" 2>&1
  say "wgpu test coop_products_and_logits_match_cpu (${W_ON:-}) rc=$? at $(el)s"
  grep -hE "^test .*(ok|FAILED)$|panicked|refused|big" "$OUT/wtests.log" | cut -c1-250 | head -8 | tee -a "$S"
  wait "$SYN"
  export PREFILL=512,4K
  for r in 1 2; do
    # shellcheck disable=SC2086
    BENCH_S=70 wgpu_bench "w-off-$r" 4K "coop rows [0-9]+" ${W_OFF:-LILY_NOTHING=0}
    # shellcheck disable=SC2086
    BENCH_S=70 wgpu_bench "w-on-$r" 4K "coop rows [0-9]+" ${W_ON:-LILY_NOTHING=1}
  done
  if left; then
    # shellcheck disable=SC2086
    env LILY_PROFILE=1 ${W_ON:-LILY_NOTHING=1} timeout "$(cap 60)" "$B/lily-engine" bench --model "$M" --device wgpu \
      --prefill 4K --decode-ctx 1 --decode-tokens 1 --repeat 1 > "$OUT/w-prof.log" 2>&1
    say "wgpu prefill profile rc=$? at $(el)s"
    grep -A12 -E '^\[prefill\]' "$OUT/w-prof.log" | tr -s ' ' >> "$S"
  fi
  wgpu_selftest selftest-shipping
  if left; then
    timeout "$(cap 100)" "$B/lily-engine" bench --model "$M" --device cuda --prefill 512,4K,32K \
      --decode-ctx 256,4K,32K --decode-tokens 128 --repeat 1 > "$OUT/cuda-sweep.log" 2>&1
    say "cuda sweep (shipping) rc=$? at $(el)s: $(grep -E '^ +[0-9]+[KM]? +[0-9.]+ +[0-9.]+' "$OUT/cuda-sweep.log" | tr -s ' ' | tr '\n' '|')"
  fi
  say "done at $(el)s"
)
