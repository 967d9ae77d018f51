#!/usr/bin/env bash
# One command for the GPU machine: kernel tests, whole-model parity (and later the bench).
# The machine has no Rust: build here first and stage the binaries with scripts/stage_gpu.sh,
# then run `bash .carry/cuda/gpu_check.sh` there. Logs go to $OUT (or ./gpu-logs).
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
BIN="${LILY_GPU_BIN:-$HERE/bin}"
OUT="${OUT:-$PWD/gpu-logs}"
mkdir -p "$OUT"
export LILY_CACHE_DIR="${LILY_CACHE_DIR:-/tmp/lily-cache}"
export RUST_BACKTRACE=1
status=0

{
  echo "== machine"; date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv 2>&1
  ls -d /usr/local/cuda* 2>/dev/null; python3 -c 'import nvidia, os; print("nvidia pkg:", list(nvidia.__path__))' 2>&1
} | tee "$OUT/machine.log"

run() {  # name, command...
  local name="$1"; shift
  echo "== $name: $*"
  local t0=$(date +%s)
  "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  echo "   rc=$rc in $(( $(date +%s) - t0 ))s (log $OUT/$name.log)"
  [ $rc -ne 0 ] && status=1 && tail -40 "$OUT/$name.log"
  return 0
}

# 1. Every kernel compiles through NVRTC for every supported arch (what CI does, here with the
#    machine's NVRTC).
run kernels_compile env CI=true "$BIN/kernels_compile" --nocapture
# 2. Kernel-by-kernel vs the CPU step, synchronising after each launch so a fault names its kernel.
run gpu_kernels env LILY_CUDA_SYNC=1 "$BIN/gpu" --ignored --test-threads=1 --nocapture \
  --skip model_ --skip decode_
# 3. Whole model CUDA vs CPU (tiny, small; fp32 and bf16 activations), decode/chunking/snapshots.
run gpu_model "$BIN/gpu" --ignored --test-threads=1 --nocapture model_ decode_

# 4. The one binary end to end: synth a tiny model, greedy generation on CUDA and on the CPU.
if [ -x "$BIN/lily-engine" ]; then
  M=/tmp/lily-tiny-e2e; rm -rf "$M"
  run engine_synth "$BIN/lily-engine" synth --preset tiny --format mlx --seed 3 --out "$M"
  run engine_cuda "$BIN/lily-engine" generate --model "$M" --prompt-ids 1,2,3,4,5,6,7,8 --max-tokens 24 --device cuda
  run engine_cpu "$BIN/lily-engine" generate --model "$M" --prompt-ids 1,2,3,4,5,6,7,8 --max-tokens 24 --device cpu
  run engine_auto_without_gpu env CUDA_VISIBLE_DEVICES= "$BIN/lily-engine" generate --model "$M" --prompt-ids 1,2,3 --max-tokens 4 --device auto
  cu=$(grep -E '^[0-9,]+$' "$OUT/engine_cuda.log"); cp=$(grep -E '^[0-9,]+$' "$OUT/engine_cpu.log")
  echo "ENGINE generate cuda: $cu"; echo "ENGINE generate cpu:  $cp"
  [ -n "$cu" ] && [ "$cu" = "$cp" ] && echo "ENGINE cuda == cpu greedy tokens" | tee -a "$OUT/engine.txt" \
    || { echo "ENGINE cuda and cpu tokens differ" | tee -a "$OUT/engine.txt"; }
  grep -h "tok/s\|device auto" "$OUT"/engine_*.log | tee -a "$OUT/engine.txt"
fi

echo "== summary"
grep -h -E "^(KERNEL|MODEL|CACHE)|test result|FAILED|panicked" "$OUT"/kernels_compile.log "$OUT"/gpu_kernels.log "$OUT"/gpu_model.log 2>/dev/null | tee "$OUT/summary.txt"
cat "$OUT/engine.txt" 2>/dev/null | tee -a "$OUT/summary.txt"
exit $status
