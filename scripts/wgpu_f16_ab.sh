#!/usr/bin/env bash
# One device call for f16 activations between kernels (issue 29 deliverable 2; docs/perf-notes.md
# "session 12, branch wgpu-f16act"): wgpu through Vulkan on the full-size synthetic checkpoint,
# `bench --prefill 4K --decode-ctx 4K,32K --decode-tokens 64` with
#   f32        the defaults (f32 activations, f32 KV cache, f32 tiles)
#   acts       LILY_WGPU_F16_ACTS=1
#   acts-kv    LILY_WGPU_F16_ACTS=1 LILY_WGPU_F16_KV=1
#   acts-kv-t  LILY_WGPU_F16_ACTS=1 LILY_WGPU_F16_KV=1 LILY_WGPU_F16_TILES=1
# then, while time is left, teacher-forced agreement over LEN (1,024) positions: `score` of
# CUDA fp32 (LILY_CUDA_FP32=1, the reference), wgpu with f16 activations, wgpu f32, and HF
# transformers bf16 beside them (scripts/hf_agreement.py, where torch is installed), the table by
# scripts/agreement_table.py against CUDA fp32.
#
# Here: the binary as DIR/bin/lily-engine(.gz), this script beside it, the Vulkan loader debs in
# .gl (../.library/device/README.md). There, from the repo root:
#   bash .carry/wgpu-f16act/wgpu_f16_ab.sh        (carry: .carry/wgpu-f16act .gl)
# Logs: $OUT/summary.txt (every run's rows, the plans, the agreement table), $OUT/agreement.md,
# $OUT/agreement.json, $OUT/bench-NAME.log (the last lines of each run).
# Knobs: BUDGET (s, default 520: no step starts that cannot end by then), LEN (1024), SKIP (names
# of runs or steps left out: f32 acts acts-kv acts-kv-t cuda-fp32 wgpu-f16 wgpu-f32 hf-bf16).
set -u
HERE="$(cd "$(dirname "$0")" && pwd)"
cd "$HERE/../.."
OUT="${OUT:-/tmp/wgpu-f16-ab}"; mkdir -p "$OUT"
BUDGET="${BUDGET:-520}"
LEN="${LEN:-1024}"
W=/tmp/f16ab; mkdir -p "$W"
t0=$(date +%s); at() { echo "$(( $(date +%s) - t0 ))"; }
left() { echo "$(( BUDGET - $(at) ))"; }
LOG=$OUT/summary.txt; say() { echo "$*" | tee -a "$LOG"; }
skipped() { case " ${SKIP:-} " in *" $1 "*) return 0 ;; esac; return 1; }
for f in "$HERE"/bin/*.gz; do [ -f "$f" ] && gunzip -f "$f"; done
chmod +x "$HERE"/bin/* 2>/dev/null
B="$HERE/bin/lily-engine"
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
[ -f "$VK_DRIVER_FILES" ] || unset VK_DRIVER_FILES
export LILY_CACHE_DIR=/tmp/lily-cache
M=/dev/shm/full-mlx
say "== $(date -u) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader) budget ${BUDGET}s"
"$B" --version >> "$LOG" 2>&1
if [ ! -f "$M/config.json" ]; then
  timeout 240 "$B" synth --preset qwen3.6-35b-a3b --format mlx --seed 7 --out $M > "$W/synth.log" 2>&1
  say "synth rc=$? at $(at)s"
fi

# bench NAME CAP ENV...: one sweep under the environment ENV, where CAP seconds are left.
bench() {
  local name=$1 cap=$2; shift 2
  if skipped "$name"; then say "skip $name"; return; fi
  if [ "$(left)" -lt "$cap" ]; then say "skip $name: $(left)s left, it needs ${cap}s"; return; fi
  env "$@" timeout "$cap" "$B" bench --model $M --device wgpu --prefill 4K --decode-ctx 4K,32K \
    --decode-tokens 64 --repeat 1 > "$W/$name.log" 2>&1
  local rc=$?
  say "$name rc=$rc at $(at)s: $(grep -E '^ +[0-9]+[KM]? +[0-9.]+ +[0-9.]+' "$W/$name.log" | tr -s ' ' | tr '\n' '|')"
  grep -h -m1 "wgpu: " "$W/$name.log" | cut -c1-700 >> "$LOG"
  grep -v XDG_RUNTIME_DIR "$W/$name.log" | tail -30 > "$OUT/bench-$name.log"
}
bench f32 110 LILY_WGPU_F16_ACTS=0 LILY_WGPU_F16_KV=0 LILY_WGPU_F16_TILES=0
bench acts 110 LILY_WGPU_F16_ACTS=1 LILY_WGPU_F16_KV=0 LILY_WGPU_F16_TILES=0
bench acts-kv 110 LILY_WGPU_F16_ACTS=1 LILY_WGPU_F16_KV=1 LILY_WGPU_F16_TILES=0
bench acts-kv-t 110 LILY_WGPU_F16_ACTS=1 LILY_WGPU_F16_KV=1 LILY_WGPU_F16_TILES=1

# score NAME CAP DEVICE ENV...: LEN teacher-forced positions' logits into $W/NAME.
score() {
  local name=$1 cap=$2 device=$3; shift 3
  if skipped "$name"; then say "skip $name"; return 1; fi
  if [ "$(left)" -lt "$cap" ]; then say "skip $name: $(left)s left, it needs ${cap}s"; return 1; fi
  env "$@" timeout "$cap" "$B" score --model $M --len "$LEN" --piece 64 --device "$device" \
    --out "$W/$name" > "$W/$name.log" 2>&1
  local rc=$?
  say "$name rc=$rc at $(at)s: $(grep -v XDG_RUNTIME_DIR "$W/$name.log" | tail -1 | cut -c1-200)"
  return $rc
}
# The table needs the reference and one wgpu run; HF bf16 (≈ 75 GB of bf16 weights on the GPU)
# runs beside the wgpu scores where time allows (it took ≈ 35 s in session 5).
if score cuda-fp32 60 cuda LILY_CUDA_FP32=1; then
  others=()
  if ! skipped hf-bf16 && [ "$(left)" -gt 150 ] && python3 -c "import torch, transformers" 2>/dev/null; then
    timeout $(( $(left) - 30 )) python3 scripts/hf_agreement.py --model $M --len "$LEN" \
      --save "$W/hf-bf16" --out "$W/hf.json" > "$W/hf-bf16.log" 2>&1 &
    HF=$!
  fi
  score wgpu-f16 90 wgpu LILY_WGPU_F16_ACTS=1 && others+=(--other "$W/wgpu-f16")
  score wgpu-f32 90 wgpu LILY_WGPU_F16_ACTS=0 && others+=(--other "$W/wgpu-f32")
  if [ -n "${HF:-}" ]; then
    wait "$HF"; say "hf-bf16 rc=$? at $(at)s"
    [ -f "$W/hf-bf16.f32" ] && others+=(--other "$W/hf-bf16")
  fi
  if [ ${#others[@]} -gt 0 ]; then
    timeout 60 python3 scripts/agreement_table.py --ref "$W/cuda-fp32" "${others[@]}" \
      --out "$OUT/agreement.md" --json "$OUT/agreement.json" > "$W/table.log" 2>&1
    say "table rc=$? at $(at)s"
    cat "$OUT/agreement.md" >> "$LOG" 2>/dev/null
  fi
fi
say "done at $(at)s"
