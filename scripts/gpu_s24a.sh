#!/usr/bin/env bash
# Session 24, first device call (≤ 9.5 minutes): what session 23 left unmeasured.
#   1. `wgmma_hoisted_addrs` (branch s23pre, off): its GPU tests while the checkpoint is
#      synthesised, then `bench --prefill 512,4K,32K` OFF / ON alternated twice (as
#      scripts/gpu_s23pre_ab.sh, whose knobs it passes on: ROUNDS, BENCH_S).
#   2. wgpu's prefill chunk 2,048 against 4,096 (the default since session 23) twice at 4K.
#   3. The shipping CUDA sweep: prefill 512 / 4K / 32K / 128K, decode 256 / 4K / 32K.
#   4. If time is left: the model test of session 23's decode switches (≈ 2–3 minutes).
# Staged by scripts/stage_gpu.sh with this script and gpu_s23pre_ab.sh beside it:
#   bash .carry/NAME/gpu_s24a.sh     (carry: .carry/NAME .gl; timeout_s 590)
set -u
H="$(cd "$(dirname "$0")" && pwd)"
R=${OUT:-$PWD/gpu-logs}; mkdir -p "$R"; export OUT=$R
T0=$(date +%s)
DEADLINE=250 HARD=300 bash "$H/gpu_s23pre_ab.sh"
used=$(( $(date +%s) - T0 ))
L=/tmp/s24a-logs; mkdir -p "$L"
OUT=$L
. "$H/gpu_ab_common.sh" $(( ${END:-500} - used ))
S=$R/summary.txt
AB_HARD=$(( ${HARD_END:-575} - used ))
E=$B/lily-engine
wgpu_setup > /dev/null 2>&1
wait "$SYN"; say "synth (reused) rc=$? at $(el)s"
for r in 1 2; do
  for ch in 2048 4096; do
    left || break
    LILY_WGPU_CHUNK=$ch timeout "$(cap 40)" "$E" bench --model "$M" --device wgpu --prefill 4K \
      --decode-ctx 1 --decode-tokens 1 --repeat 2 > "$L/w-$ch-$r.log" 2>&1
    say "wgpu chunk $ch round $r rc=$? at $(el)s: $(grep -E '^ +[0-9]+[KM]? +[0-9.]+ +[0-9.]+' "$L/w-$ch-$r.log" | head -1 | tr -s ' ')"
  done
done
if left; then
  timeout "$(cap 110)" "$E" bench --model "$M" --device cuda --prefill 512,4K,32K,128K \
    --decode-ctx 256,4K,32K --decode-tokens 128 --repeat 1 > "$L/cuda-sweep.log" 2>&1
  say "cuda sweep rc=$? at $(el)s: $(grep -E '^ +[0-9]+[KM]? +[0-9.]+ +[0-9.]+' "$L/cuda-sweep.log" | tr -s ' ' | tr '\n' '|')"
  grep -m1 -E "^cuda|plan" "$L/cuda-sweep.log" | cut -c1-600 >> "$S"
fi
if left; then
  timeout "$(cap 200)" "$B/gpu" --ignored --test-threads=1 \
    decode_with_session_23_switches_gives_the_same_tokens_and_logprobs > "$L/model-test.log" 2>&1
  say "model test rc=$? at $(el)s"
  grep -E "^test .*(ok|FAILED)$|^test result|panicked" "$L/model-test.log" | cut -c1-220 | tee -a "$S"
  cp "$L/model-test.log" "$R/"
fi
say "done at $(el)s"
