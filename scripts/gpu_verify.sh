#!/usr/bin/env bash
# One device call for a merged main (session 10): this build's GPU tests (kernels and models vs the
# CPU), `selftest` (CUDA and wgpu through Vulkan against the CPU on a tiny model), then on the
# full-size synthetic checkpoint: wgpu through Vulkan, old vs new; CUDA's bench; the served path at
# 4K (greedy, and greedy with 20 top log-probabilities); concurrent clients with --max-batch 4.
#
# Here: `bash scripts/stage_gpu.sh .carry/final` (this build), a baseline lily-engine in
# .carry/old/, the bundled tokenizer unpacked into .carry/tokenizer, the Vulkan loader debs in .gl
# (../.library/device/README.md). Binaries may be gzipped (X.gz). There:
#   bash .carry/final/gpu_verify.sh        (carry: .carry .gl). Logs: $OUT/verify.txt and others.
# Knobs: CHECK_S (GPU tests' time limit, s), SKIP_CHECK=1, SKIP_WGPU=1, SKIP_SERVED=1.
set -u
HERE="$(cd "$(dirname "$0")" && pwd)"
cd "$HERE/../.."
for f in "$HERE"/bin/*.gz "$HERE"/../old/*.gz "$HERE"/../tokenizer/*.gz; do [ -f "$f" ] && gunzip -f "$f"; done
chmod +x "$HERE"/bin/* "$HERE"/../old/* 2>/dev/null
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
[ -f "$VK_DRIVER_FILES" ] || unset VK_DRIVER_FILES
NEW=$HERE/bin/lily-engine; OLD=$HERE/../old/lily-engine
OUT="${OUT:-/tmp/verify-out}"; mkdir -p "$OUT"
M=/dev/shm/full-mlx; export LILY_CACHE_DIR=/tmp/lily-cache
TOK=(); [ -f "$HERE/../tokenizer/tokenizer.json" ] && TOK=(--tokenizer "$HERE/../tokenizer")
LOG=$OUT/verify.txt; say() { echo "$*" | tee -a "$LOG"; }
t0=$(date +%s); at() { echo "$(( $(date +%s) - t0 ))s"; }
say "== $(date -u) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
"$NEW" synth --preset qwen3.6-35b-a3b --format mlx --seed 7 --out "$M" "${TOK[@]}" > /tmp/synth.log 2>&1 &
SYN=$!
# selftest: every device against the CPU on a tiny model (agreement, greedy tokens).
for p in tiny small; do
  "$NEW" synth --preset $p --format mlx --seed 3 --out /tmp/st-$p "${TOK[@]}" > /dev/null 2>&1
  timeout 90 "$NEW" selftest --model /tmp/st-$p > "$OUT/selftest-$p.txt" 2>&1
  say "selftest $p rc=$? at $(at): $(grep -iE 'wgpu|cuda|agree|FAIL|error' "$OUT/selftest-$p.txt" | head -8 | tr '\n' ' ' | cut -c1-900)"
done
if [ "${SKIP_CHECK:-0}" != 1 ]; then
  mkdir -p /tmp/chk
  SKIP_COMPILE=1 OUT=/tmp/chk timeout "${CHECK_S:-200}" bash "$HERE/gpu_check.sh" > /tmp/check.log 2>&1
  say "gpu_check rc=$? at $(at)"
  cp /tmp/chk/all.log "$OUT/check-all.log" 2>/dev/null
  grep -h "^test result\|FAILED\|panicked\|rc=" /tmp/chk/all.log /tmp/check.log 2>/dev/null | head -24 | tee -a "$LOG"
fi
wait $SYN; say "synth rc=$? at $(at)"
if [ "${SKIP_WGPU:-0}" != 1 ]; then
  for v in old new; do
    bin=$NEW; [ $v = old ] && bin=$OLD
    timeout 110 "$bin" bench --model $M --device wgpu --prefill 4K --decode-ctx 4K --decode-tokens 64 --repeat 1 > "$OUT/wgpu-$v.log" 2>&1
    say "wgpu $v rc=$? at $(at): $(grep -E 'prefill|decode' "$OUT/wgpu-$v.log" | grep -v INFO | tail -4 | tr '\n' ' ' | cut -c1-500)"
    grep -m2 -E "wgpu .*plan|plan:" "$OUT/wgpu-$v.log" | cut -c1-600 >> "$LOG"
  done
fi
timeout 90 "$NEW" bench --model $M --device cuda --prefill 512,4K,32K --decode-ctx 256,4K --decode-tokens 128 --repeat 1 > "$OUT/cuda-bench.log" 2>&1
say "cuda bench rc=$? at $(at)"; grep -v INFO "$OUT/cuda-bench.log" | grep -E "^\s*[0-9]|prefill|decode" | tail -12 >> "$LOG"
if [ "${SKIP_SERVED:-0}" != 1 ]; then
  export LILY_ENGINE_BIN=$NEW
  for extra in '{}' '{"logprobs": 20}'; do
    timeout 80 python3 scripts/serve_bench.py --model $M --device cuda --prompt-tokens 4096 --max-tokens 256 --repeat 2 --extra "$extra" > /tmp/served.log 2>&1
    say "served 4K $extra rc=$? at $(at): $(grep -E '^(completions|chat)' /tmp/served.log | tail -1)"
    cat /tmp/served.log >> "$OUT/served.log"
  done
  timeout 100 python3 scripts/concurrent_bench.py --model $M --device cuda --prompt-tokens 1024 --max-tokens 128 \
    --clients 1,4 --check --serve-arg=--max-batch=4 > "$OUT/concurrent.log" 2>&1
  say "concurrent --max-batch 4 rc=$? at $(at):"; cat "$OUT/concurrent.log" | tail -4 | tee -a "$LOG"
fi
say "done at $(at)"
