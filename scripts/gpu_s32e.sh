#!/usr/bin/env bash
# Session 32's last call (≤ 575 s by its own clock), on main with both helper switches merged off
# and the int8 KV cache as the default:
#   1. beside the full synth, scripts/gpu_s32f.sh: the GPU tests with the int8 default and both
#      switches' kernel tests (s32rt's `router_async_stage_gives_the_lean_routers_bits`, s32w's
#      wgpu `rows_tail_early_kernel`), four processes at once;
#   2. the two A/Bs interleaved, each round off then on: `router_async_stage` (CUDA, `bench
#      --prefill 1K --decode-ctx 1K --decode-tokens 64 --batch 1,4,8`) and `rows_tail_early`
#      (wgpu, `bench --device wgpu --prefill 512 --decode-ctx 4K,32K --decode-tokens 64`), two
#      rounds while the clock allows;
#   3. served 1 / 4 / 8 clients with the shipping defaults, if time is left.
#   bash .carry/NAME/gpu_s32e.sh   (gpu_s32f.sh beside it; carry: .carry/NAME .carry/tokenizer .gl;
#   timeout_s 595)
set -u
AB_TOKENIZER=1
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-500}"
AB_HARD=${HARD:-575}
E=$B/lily-engine
wgpu_setup
# 1. The GPU tests (scripts/gpu_s32f.sh, its own clock: ≤ 250 s) beside the full synth.
DEADLINE=230 HARD=250 TEST_S=230 AB_LAYERS=2 OUT=$OUT bash "$HERE/gpu_s32f.sh"
wait "$SYN"; say "synth full rc=$? at $(el)s"
cuda_ab() {  # cuda_ab NAME VALUE
  left || { say "cuda $1: skipped (deadline) at $(el)s"; return; }
  LILY_ROUTER_ASYNC_STAGE=$2 timeout "$(cap 45)" "$E" bench --model "$M" --device cuda --prefill 1K \
    --decode-ctx 1K --decode-tokens 64 --repeat 1 --batch 1,4,8 > "$OUT/rt-$1.log" 2>&1
  say "cuda $1 (router_async_stage $2) rc=$? at $(el)s: $(grep -E '^ +[0-9]+ +[0-9]+[K]? +[0-9.]+ +[0-9.]+' "$OUT/rt-$1.log" | tr -s ' ' | tr '\n' '|')"
}
K="linear_q4_rows early tail reads (on|off)"
for r in 1 2; do
  cuda_ab off-$r 0; cuda_ab on-$r 1
  BENCH_S=40 wgpu_bench w-off-$r 4K,32K "$K" LILY_WGPU_ROWS_TAIL_EARLY=0
  BENCH_S=40 wgpu_bench w-on-$r 4K,32K "$K" LILY_WGPU_ROWS_TAIL_EARLY=1
done
export PYTHONUNBUFFERED=1 LILY_ENGINE_BIN="$E"
if left; then
  timeout "$(cap 130)" python3 "$HERE/concurrent_bench.py" --model "$M" --device cuda --prompt-tokens 1024 \
    --max-tokens 256 --clients 1,4,8 > "$OUT/concurrent.log" 2>&1
  say "served 1,4,8 clients rc=$? at $(el)s:"
  grep -E "clients:|rror" "$OUT/concurrent.log" | cut -c1-220 | head -5 | tee -a "$S"
fi
say "done at $(el)s"
