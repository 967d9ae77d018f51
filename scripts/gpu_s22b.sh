#!/usr/bin/env bash
# Session 22, call 2b (≤ 9.5 minutes): the wgpu branches (wpre: coop_rows 128 and the experts'
# fused gate/up in prefill; wdec: chain_router in decode) through Vulkan with
# scripts/gpu_wgpu_ab3.sh (OFF / ON1 / ON2 twice, profiles, selftest), chain_router's kernel test
# five times, then branch ggemm's dequantisation switch (CUDA prefill, OFF / ON twice) where G_ON
# is set. Staged beside gpu_ab_common.sh / gpu_wgpu_ab3.sh:
#   bash .carry/s22b/gpu_s22b.sh   (carry: .carry/s22b .carry/tokenizer .gl; timeout_s 590)
H="$(cd "$(dirname "$0")" && pwd)"
export AB_TOKENIZER=1
OUTD=${OUT:-$PWD/gpu-logs}
# chain_router's kernel test, five times in a row (it reads its environment), beside nothing else.
(
  . "$H/gpu_ab_common.sh" 100 > /dev/null 2>&1
  wgpu_setup > /dev/null 2>&1
  for i in 1 2 3 4 5; do
    timeout 40 "$B/wgpu_model" --include-ignored --test-threads=1 \
      chain_router_kernel_matches_the_host_and_the_unchained_kernels > "$OUT/chain-$i.log" 2>&1
    say "chain_router kernel test run $i rc=$? $(grep -E '^test result' "$OUT/chain-$i.log")"
  done
)
# OFF: as main shipped; ON1: everything (the GPU tests run under it); ON2: coop_rows 128 alone
# (prefill OFF → ON2 → ON1 separates the row count from the fusion; decode ON1 against both the
# chained router).
OFF="LILY_WGPU_COOP_ROWS=64 LILY_WGPU_EXPERTS_GLU_FUSED=0 LILY_WGPU_CHAIN_ROUTER=0" \
ON1="LILY_WGPU_COOP_ROWS=128 LILY_WGPU_EXPERTS_GLU_FUSED=1 LILY_WGPU_CHAIN_ROUTER=1" \
ON2="LILY_WGPU_COOP_ROWS=128 LILY_WGPU_EXPERTS_GLU_FUSED=0 LILY_WGPU_CHAIN_ROUTER=0" \
WTESTS="${WTESTS:-coop_products_and_logits_match_cpu coop_kernel_emulated_matches_the_host coop_glu_emulated_matches_the_unfused_and_the_host}" \
DEADLINE=${W_DEADLINE:-300} HARD=${W_HARD:-360} bash "$H/gpu_wgpu_ab3.sh"
if [ -n "${G_ON:-}" ]; then
  if [ -n "${G_TESTS:-}" ]; then
    # shellcheck disable=SC2086
    timeout 90 "$H/bin/gpu" --ignored --test-threads=1 --nocapture $G_TESTS > "$OUTD/g-tests.log" 2>&1
    echo "ggemm tests ($G_TESTS) rc=$?" | tee -a "$OUTD/summary.txt"
    grep -E "^KERNEL|^test .*(ok|FAILED)$|panicked" "$OUTD/g-tests.log" | cut -c1-200 | tail -30 | tee -a "$OUTD/summary.txt"
  fi
  OFF="$G_OFF" ON="$G_ON" SKIP_PROFILE=1 SKIP_TESTS=1 DEADLINE=${G_DEADLINE:-120} HARD=${G_HARD:-150} \
    bash "$H/gpu_ggemm_ab.sh"
fi
