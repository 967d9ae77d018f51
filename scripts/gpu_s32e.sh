#!/usr/bin/env bash
# Session 32's last call (≤ 575 s by its own clock), on main with both helper switches merged off
# and the int8 KV cache as the default:
#   1. at once, beside the synth (cold NVRTC / Vulkan caches; kernel-cache writes are atomic):
#      `gpu model::` (without the checkpoint-from-env test), `gpu batch::`, `gpu pipeline::
#      sample:: attention::` and s32rt's `router_async_stage_gives_the_lean_routers_bits`, then
#      wgpu's `rows_tail_early_kernel` (s32w);
#   2. the two A/Bs interleaved, each round off then on: `router_async_stage` (CUDA, `bench
#      --prefill 1K --decode-ctx 1K --decode-tokens 64 --batch 1,4,8`) and `rows_tail_early`
#      (wgpu, `bench --device wgpu --prefill 512 --decode-ctx 4K,32K --decode-tokens 64`), two
#      rounds while the clock allows;
#   3. served 1 / 4 / 8 clients with the shipping defaults, if time is left.
#   bash .carry/NAME/gpu_s32e.sh   (carry: .carry/NAME .carry/tokenizer .gl; timeout_s 595)
set -u
AB_TOKENIZER=1
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-500}"
AB_HARD=${HARD:-575}
E=$B/lily-engine
T=${TEST_S:-230}
wgpu_setup
g() { timeout "$(cap $T)" "$B/gpu" --ignored --test-threads=1 --nocapture "$@"; }
g model:: --skip model_matches_cpu_on_checkpoint_from_env > "$OUT/tests-model.log" 2>&1 & P1=$!
g batch:: > "$OUT/tests-batch.log" 2>&1 & P2=$!
g pipeline:: sample:: attention:: router_async_stage_gives_the_lean_routers_bits > "$OUT/tests-rest.log" 2>&1 & P3=$!
env -u LILY_WGPU_ROWS_TAIL_EARLY timeout "$(cap 90)" "$B/wgpu_model" --test-threads=1 --nocapture \
  rows_tail_early_kernel > "$OUT/tests-wgpu.log" 2>&1
say "wgpu test rc=$? at $(el)s: $(grep -hE '^test result|panicked|same bits' "$OUT/tests-wgpu.log" | tr '\n' '|' | cut -c1-300)"
wait "$SYN"; say "synth full rc=$? at $(el)s"
for p in "$P1:model" "$P2:batch" "$P3:rest"; do
  wait "${p%%:*}"; rc=$?
  f="$OUT/tests-${p##*:}.log"
  say "tests ${p##*:} rc=$rc at $(el)s: $(grep -cE '(\.\.\. |^)ok$' "$f") ok; $(grep -E 'test result|FAILED|panicked' "$f" | tr '\n' '|' | cut -c1-700)"
done
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
