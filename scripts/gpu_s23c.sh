#!/usr/bin/env bash
# Session 23, call 4 (≤ 4 minutes, the session's last device seconds): wgpu's prefill chunk
# 2,048 against 4,096 (the new default) alternated twice at a 4K prompt, then the shipping CUDA
# sweep. Staged by scripts/stage_gpu.sh with this script beside it:
#   bash .carry/s23c/gpu_s23c.sh     (carry: .carry/s23c .gl; timeout_s as the budget allows)
set -u
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-200}"
AB_HARD=${HARD:-230}
E=$B/lily-engine
wgpu_setup > /dev/null 2>&1
wait "$SYN"; say "synth full rc=$? at $(el)s"
for r in 1 2; do
  for ch in 2048 4096; do
    left || break
    LILY_WGPU_CHUNK=$ch timeout "$(cap 40)" "$E" bench --model "$M" --device wgpu --prefill 4K \
      --decode-ctx 1 --decode-tokens 1 --repeat 2 > "$OUT/w-$ch-$r.log" 2>&1
    say "wgpu chunk $ch round $r rc=$? at $(el)s: $(grep -E '^ +[0-9]+[KM]? +[0-9.]+ +[0-9.]+' "$OUT/w-$ch-$r.log" | head -1 | tr -s ' ')"
  done
done
if left; then
  timeout "$(cap 40)" "$E" bench --model "$M" --device cuda --prefill 512,4K,32K \
    --decode-ctx 256,4K,32K --decode-tokens 128 --repeat 1 > "$OUT/cuda-sweep.log" 2>&1
  say "cuda sweep rc=$? at $(el)s: $(grep -E '^ +[0-9]+[KM]? +[0-9.]+ +[0-9.]+' "$OUT/cuda-sweep.log" | tr -s ' ' | tr '\n' '|')"
fi
say "done at $(el)s"
