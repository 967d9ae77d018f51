#!/usr/bin/env bash
# Full-size checks on the GPU machine (run from the repo root there, binary carried in .carry/):
#   1. write the full synthetic MLX checkpoint (size, time)
#   2. fp32 CPU reference logits over 192 teacher-forced positions
#   3. Lily CUDA's production path over the same positions (when the binary has CUDA)
#   4. HF transformers' bf16 path on the same weights; agreement of each with the reference
#   5. optionally the bench sweep on CUDA (BENCH_PREFILL / BENCH_DECODE lists)
# Logs and results go to $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
B=${LILY_ENGINE:-.carry/lily-engine}
M=/tmp/full-mlx
LEN=${LEN:-192}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
nproc | tee -a "$OUT/gpu.txt"
rm -rf $M
/usr/bin/time -v $B synth --preset qwen3.6-35b-a3b --format mlx --seed 7 --out $M 2>&1 | tee "$OUT/synth.log" | grep -E "wrote|Elapsed|Maximum resident"
du -sb $M | tee -a "$OUT/synth.log"
$B score --model $M --len $LEN --device cpu --out /tmp/ref-cpu 2>&1 | tail -2 | tee "$OUT/score-cpu.log"
OTHER=()
if [ "${SKIP_CUDA:-0}" != 1 ]; then
  $B score --model $M --len $LEN --device cuda --out /tmp/lily-cuda 2>&1 | tail -5 | tee "$OUT/score-cuda.log" && OTHER+=(--other /tmp/lily-cuda)
  LILY_CUDA_FP32=1 $B score --model $M --len $LEN --device cuda --out /tmp/lily-cuda-fp32 2>&1 | tail -5 | tee -a "$OUT/score-cuda.log" && OTHER+=(--other /tmp/lily-cuda-fp32)
fi
python3 scripts/hf_agreement.py --model $M --ref /tmp/ref-cpu "${OTHER[@]}" --out "$OUT/agreement.json" 2>&1 | grep -v -i "falling back" | tail -40 | tee "$OUT/agreement.log"

# 5. the sweep (PERFORMANCE.md §1), as far as BENCH_MAX allows within the call's time
if [ "${SKIP_CUDA:-0}" != 1 ] && [ -n "${BENCH_PREFILL:-}" ]; then
  timeout ${BENCH_TIMEOUT:-240} $B bench --model $M --device cuda --prefill "$BENCH_PREFILL" --decode-ctx "$BENCH_DECODE" \
    --decode-tokens 128 --repeat ${BENCH_REPEAT:-3} --json "$OUT/bench-cuda.json" 2>&1 | tee "$OUT/bench.log"
fi
