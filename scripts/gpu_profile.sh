#!/usr/bin/env bash
# Speed work on the GPU machine without the full checkpoint's 2.5-minute synth: a full-width
# model with LAYERS layers (default 4 = 3 DeltaNet + 1 attention, ~2 GB), per-kernel device time
# (LILY_PROFILE=1) for a prefill and a decode, then plain timings. Run after stage_gpu.sh:
#   bash .carry/cuda/gpu_profile.sh            (logs and profile tables under $OUT)
# Knobs: LAYERS, PREFILL (default 4096), CHUNKS (prefill chunk sizes to profile, default "256 1024"),
# DECODE_CTX (default 4096), EXTRA (extra `env` settings for the plain timing runs).
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
BIN="${LILY_GPU_BIN:-$HERE/bin}"
OUT="${OUT:-$PWD/gpu-logs}"
mkdir -p "$OUT"
export LILY_CACHE_DIR="${LILY_CACHE_DIR:-/tmp/lily-cache}"
LAYERS="${LAYERS:-4}"
PREFILL="${PREFILL:-4096}"
DECODE_CTX="${DECODE_CTX:-4096}"
M=/tmp/lily-full-$LAYERS
[ -f "$M/config.json" ] || { time "$BIN/lily-engine" synth --preset qwen3.6-35b-a3b --format mlx --seed 1 --layers "$LAYERS" --out "$M"; } 2>&1 | tail -3 | tee -a "$OUT/profile.txt"
for c in ${CHUNKS:-256 1024}; do
  echo "== profile: prefill $PREFILL, chunk $c" | tee -a "$OUT/profile.txt"
  LILY_PREFILL_CHUNK=$c LILY_PROFILE=1 timeout 300 "$BIN/lily-engine" bench --model "$M" --device cuda \
    --prefill "$PREFILL" --decode-ctx 64 --decode-tokens 1 --repeat 1 2>&1 | grep -v "^\s*$" | tee -a "$OUT/profile.txt" | tail -30
done
echo "== profile: decode at $DECODE_CTX" | tee -a "$OUT/profile.txt"
LILY_PROFILE=1 timeout 300 "$BIN/lily-engine" bench --model "$M" --device cuda --prefill 16 \
  --decode-ctx "$DECODE_CTX" --decode-tokens 16 --repeat 1 2>&1 | tee -a "$OUT/profile.txt" | tail -30
echo "== timing (no profiling) ${EXTRA:-}" | tee -a "$OUT/profile.txt"
env ${EXTRA:-} timeout 300 "$BIN/lily-engine" bench --model "$M" --device cuda --prefill "$PREFILL" \
  --decode-ctx "$DECODE_CTX" --decode-tokens 64 --repeat 2 2>&1 | tee -a "$OUT/profile.txt" | tail -20
