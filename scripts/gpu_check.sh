#!/usr/bin/env bash
# One command for the GPU machine: kernel tests, whole-model parity (and later the bench).
# The machine has no Rust: build here first and stage the binaries with scripts/stage_gpu.sh,
# then run `bash .carry/cuda/gpu_check.sh` there. Logs go to $OUT (or ./gpu-logs).
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
BIN="${LILY_GPU_BIN:-$HERE/bin}"
OUT="${OUT:-$PWD/gpu-logs}"
# The device tool returns at most 8 files: per-step logs stay in $LOGS, and $OUT gets all.log
# (every step's log, appended as it finishes), engine.txt and summary.txt.
LOGS=/tmp/lily-gpu-logs
mkdir -p "$OUT" "$LOGS"
export LILY_CACHE_DIR="${LILY_CACHE_DIR:-/tmp/lily-cache}"
export RUST_BACKTRACE=1
status=0

{
  echo "== machine"; date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv 2>&1
  ls -d /usr/local/cuda* 2>/dev/null; python3 -c 'import nvidia, os; print("nvidia pkg:", list(nvidia.__path__))' 2>&1
} | tee -a "$OUT/all.log"

run() {  # name, command...
  local name="$1"; shift
  echo "== $name: $*"
  local t0=$(date +%s)
  "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "   rc=$rc in $(( $(date +%s) - t0 ))s"
  { echo "===== $name (rc=$rc): $*"; cat "$LOGS/$name.log"; } >> "$OUT/all.log"
  [ $rc -ne 0 ] && status=1 && tail -40 "$LOGS/$name.log"
  return 0
}

# 1. Every kernel compiles through NVRTC for every supported arch (what CI does, here with the
#    machine's NVRTC).
#    SKIP_COMPILE=1 leaves it out (the same test runs on the CPU machine with pip's NVRTC).
[ "${SKIP_COMPILE:-0}" = 1 ] || run kernels_compile "$BIN/kernels_compile" --include-ignored --nocapture
# 2. Kernel-by-kernel vs the CPU step, synchronising after each launch so a fault names its kernel.
run gpu_kernels env LILY_CUDA_SYNC=1 "$BIN/gpu" --ignored --test-threads=1 --nocapture \
  --skip model_ --skip decode_
# 3. Whole model CUDA vs CPU (tiny, small; fp32 and bf16 activations; the shipping configuration
#    with graphs, split-KV and device sampling), decode/chunking/snapshots. The checkpoint test
#    needs LILY_PARITY_MODEL and fails without it: step 5 runs it.
run gpu_model "$BIN/gpu" --ignored --test-threads=1 --nocapture model_ decode_ \
  --skip model_matches_cpu_on_checkpoint_from_env

# 4. The one binary end to end: synth a tiny model, greedy generation on CUDA and on the CPU.
if [ -x "$BIN/lily-engine" ]; then
  M=/tmp/lily-tiny-e2e; rm -rf "$M"
  run engine_synth "$BIN/lily-engine" synth --preset tiny --format mlx --seed 3 --out "$M"
  run engine_cuda env LILY_CUDA_FP32=1 "$BIN/lily-engine" generate --model "$M" --prompt-ids 1,2,3,4,5,6,7,8 --max-tokens 24 --device cuda
  run engine_cuda_bf16 "$BIN/lily-engine" generate --model "$M" --prompt-ids 1,2,3,4,5,6,7,8 --max-tokens 24 --device cuda
  run engine_cpu "$BIN/lily-engine" generate --model "$M" --prompt-ids 1,2,3,4,5,6,7,8 --max-tokens 24 --device cpu
  run engine_auto_without_gpu env CUDA_VISIBLE_DEVICES= "$BIN/lily-engine" generate --model "$M" --prompt-ids 1,2,3 --max-tokens 4 --device auto
  cu=$(grep -E '^[0-9,]+$' "$LOGS/engine_cuda.log"); cp=$(grep -E '^[0-9,]+$' "$LOGS/engine_cpu.log")
  echo "ENGINE generate cuda fp32: $cu" | tee -a "$OUT/engine.txt"; echo "ENGINE generate cpu:       $cp" | tee -a "$OUT/engine.txt"
  if [ -n "$cu" ] && [ "$cu" = "$cp" ]; then echo "ENGINE cuda (fp32 activations) == cpu greedy tokens" | tee -a "$OUT/engine.txt"
  else echo "ENGINE cuda (fp32 activations) and cpu tokens DIFFER" | tee -a "$OUT/engine.txt"; status=1; fi
  grep -h "tok/s\|device auto" "$LOGS"/engine_*.log | tee -a "$OUT/engine.txt"
fi

# 5. Optional (LILY_GPU_FULL=1): the full-size synthetic MLX checkpoint: production-path
#    generation speed, and teacher-forced parity with the CPU backend over a few positions.
if [ "${LILY_GPU_FULL:-0}" = "1" ] && [ $status -eq 0 ] && [ -x "$BIN/lily-engine" ]; then
  F=/tmp/lily-full-mlx
  [ -f "$F/config.json" ] || run full_synth "$BIN/lily-engine" synth --preset qwen3.6-35b-a3b --format mlx --seed 1 --out "$F"
  P=$(python3 -c 'import random; r=random.Random(7); print(",".join(str(r.randrange(248000)) for _ in range(256)))')
  run full_generate_bf16 "$BIN/lily-engine" generate --model "$F" --prompt-ids "$P" --max-tokens 128 --device cuda
  run full_generate_bf16_nograph env LILY_CUDA_GRAPH=0 "$BIN/lily-engine" generate --model "$F" --prompt-ids "$P" --max-tokens 128 --device cuda
  run full_generate_bf16_no_split_kv env LILY_SPLIT_KV=0 "$BIN/lily-engine" generate --model "$F" --prompt-ids "$P" --max-tokens 128 --device cuda
  run full_generate_bf16_ungrouped env LILY_MOE_GROUPED=0 "$BIN/lily-engine" generate --model "$F" --prompt-ids "$P" --max-tokens 128 --device cuda
  for f in "$LOGS"/full_generate_*.log; do echo "FULL $(basename "$f" .log): $(grep -h "tok/s" "$f")"; done | tee -a "$OUT/engine.txt"
  run full_parity env LILY_PARITY_MODEL="$F" LILY_PARITY_POSITIONS="${LILY_PARITY_POSITIONS:-16}" \
    "$BIN/gpu" --ignored --test-threads=1 --nocapture model_matches_cpu_on_checkpoint_from_env
  grep -h "^MODEL\|^loaded" "$LOGS/full_parity.log" | sed 's/^/FULL /' | tee -a "$OUT/engine.txt"
fi

echo "== summary"
grep -h -E "^(KERNEL|MODEL|CACHE)|test result|FAILED|panicked" "$LOGS"/kernels_compile.log "$LOGS"/gpu_kernels.log "$LOGS"/gpu_model.log 2>/dev/null | tee "$OUT/summary.txt"
cat "$OUT/engine.txt" 2>/dev/null | tee -a "$OUT/summary.txt"
exit $status
