#!/usr/bin/env bash
# Full-size checks on the GPU machine (run from the repo root there, binary carried in .carry/):
#   1. write the full synthetic MLX checkpoint (size, time)
#   2. fp32 CPU reference logits over 192 teacher-forced positions
#   3. Lily CUDA's production path over the same positions (when the binary has CUDA)
#   4. HF transformers' bf16 path on the same weights; agreement of each with the reference
#   5. optionally the bench sweep on CUDA (BENCH_PREFILL / BENCH_DECODE lists)
# Logs and results go to $OUT. For the agreement alone at 1,024 positions with every path (wgpu
# too) and a summary table, in one bounded call: scripts/gpu_agreement.sh.
set -uo pipefail
OUT=${OUT:-/tmp/out}
B=${LILY_ENGINE:-.carry/cuda/bin/lily-engine}
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
  if [ "${SKIP_FP32:-0}" != 1 ]; then
    LILY_CUDA_FP32=1 $B score --model $M --len $LEN --device cuda --out /tmp/lily-cuda-fp32 2>&1 | tail -5 | tee -a "$OUT/score-cuda.log" && OTHER+=(--other /tmp/lily-cuda-fp32)
  fi
fi
HF=(); [ "${SKIP_HF:-0}" = 1 ] && HF=(--skip-hf)
python3 scripts/hf_agreement.py --model $M --ref /tmp/ref-cpu "${OTHER[@]}" "${HF[@]}" --out "$OUT/agreement.json" 2>&1 | grep -v -i "falling back" | tail -40 | tee "$OUT/agreement.log"

# 5. the sweep (PERFORMANCE.md §1): BENCH_PREFILL / BENCH_DECODE at BENCH_REPEAT, then the long
#    end LONG_PREFILL / LONG_DECODE once each, GPU memory polled every second into gpu-mem.csv.
if [ "${SKIP_CUDA:-0}" != 1 ] && [ -n "${BENCH_PREFILL:-}" ]; then
  nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader -l 1 > "$OUT/gpu-mem.csv" 2>/dev/null &
  POLL=$!
  timeout ${BENCH_TIMEOUT:-240} $B bench --model $M --device cuda --prefill "$BENCH_PREFILL" --decode-ctx "$BENCH_DECODE" \
    --decode-tokens 128 --repeat ${BENCH_REPEAT:-3} --json "$OUT/bench-cuda.json" 2>&1 | tee "$OUT/bench.log"
  if [ -n "${LONG_PREFILL:-}" ]; then
    timeout ${LONG_TIMEOUT:-300} $B bench --model $M --device cuda --prefill "$LONG_PREFILL" --decode-ctx "$LONG_DECODE" \
      --decode-tokens 64 --repeat 1 --json "$OUT/bench-cuda-long.json" 2>&1 | tee "$OUT/bench-long.log"
  fi
  kill $POLL 2>/dev/null
fi

# 6. Per-kernel device time on the full model (PROFILE=1): a 4K prefill, then decode at 4K.
if [ "${SKIP_CUDA:-0}" != 1 ] && [ "${PROFILE:-0}" = 1 ]; then
  LILY_PROFILE=1 timeout 200 $B bench --model $M --device cuda --prefill 4096 --decode-ctx 64 --decode-tokens 1 --repeat 1 2>&1 | tee "$OUT/profile-prefill.log" | tail -26
  LILY_PROFILE=1 timeout 200 $B bench --model $M --device cuda --prefill 16 --decode-ctx 4096 --decode-tokens 32 --repeat 1 2>&1 | tee "$OUT/profile-decode.log" | tail -26
fi
