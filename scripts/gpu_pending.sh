#!/usr/bin/env bash
# The next device call after session 8, whose budget ran out after its last A/B: the shipping
# build's defaults (wgmma GEMMs from 512-token chunks, 256-token dense blocks from 2,048, the
# routed experts' tiles of 128) were each measured in call 9 through environment variables, never
# as one binary's defaults. In one call (≈ 7 minutes):
#   tests    gpu_check.sh on the shipping defaults (kernel tests with a sync after each launch, the
#            model and decode tests, model_prefill_chunks_through_each_gemm_path_* among them)
#            beside the synthetic checkpoint's synth
#   bench    the one sweep (prefill 512…128K, decode 256…128K), twice; predicted (docs/perf-notes.md,
#            session 8): prefill ≈ 8,716 / 20,040 / 16,731 / 10,630, decode ≈ 495 / 491 / 435 / 359
#   served   decode and time to first token through `lily-engine serve` at 4K and 128K (issue 12:
#            ≤ 1.10× the bench's prefill; 1.012× / 1.006× before this session's GEMMs)
#   profile  LILY_PROFILE=1 prefill of 512 and 4K (device time per kernel: what 512 still lacks)
# Here: scripts/stage_gpu.sh; carry .carry/cuda and .carry/tokgz (or .carry/tokenizer).
# There: OUT=$OUT/p bash .carry/cuda/gpu_pending.sh   (ONLY="tests bench served profile" picks parts)
set -u
HERE="$(cd "$(dirname "$0")" && pwd)"
B="$HERE/bin/lily-engine"
OUT="${OUT:-$PWD/gpu-logs}"
mkdir -p "$OUT/run" "$OUT/check"
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
say() { echo "$* (at $(el) s)" | tee -a "$OUT/pending.txt"; }
want() { [[ " ${ONLY:-tests bench served profile} " == *" $1 "* ]]; }
[ -f "$HERE/../tokgz/tokenizer.tgz" ] && [ ! -f "$HERE/../tokenizer/tokenizer.json" ] &&
  tar xzf "$HERE/../tokgz/tokenizer.tgz" -C "$HERE/.."
export SKIP_CHECK=1 SKIP_PROFILE=1 SKIP_PARITY=1 LILY_CACHE_DIR="${LILY_CACHE_DIR:-/tmp/lily-cache}"

if want tests; then
  ( SKIP_COMPILE=1 OUT="$OUT/check" timeout 330 bash "$HERE/gpu_check.sh" > "$OUT/check/stdout" 2>&1
    say "gpu_check rc=$?" ) &
  TESTS=$!
fi
OUT=$OUT/run VARIANTS="" bash "$HERE/gpu_session.sh" > "$OUT/run/synth.out" 2>&1
say "synth done"
if want tests; then
  wait $TESTS
  grep -E "test result|FAILED|panicked|^MODEL 3,100|^ENGINE cuda" "$OUT/check/summary.txt" >> "$OUT/pending.txt"
fi

M=/dev/shm/full-mlx; [ -f "$M/config.json" ] || M=/tmp/full-mlx
if want bench; then
  for round in 1 2; do
    echo "===== round $round" >> "$OUT/bench.log"
    timeout 200 "$B" bench --model "$M" --device cuda --prefill 512,4K,32K,128K \
      --decode-ctx 256,4K,32K,128K --decode-tokens 128 --repeat 1 2>&1 | grep -vE "INFO|^\s*$" >> "$OUT/bench.log"
  done
  say "bench done"
fi

if want served && [ "$(el)" -lt 420 ]; then
  OUT=$OUT/run VARIANTS="" SERVED=new SERVED_TTFT="4096 131072" TTFT_REPEAT=2 \
    bash "$HERE/gpu_session.sh" > "$OUT/run/served.out" 2>&1
  grep -hE "^(served|SERVED_TTFT)" "$OUT/run/session.txt" | cut -c1-400 >> "$OUT/pending.txt"
  say "served done"
fi

if want profile && [ "$(el)" -lt 520 ]; then
  LILY_PROFILE=1 timeout 60 "$B" bench --model "$M" --device cuda --prefill 512,4K --decode-ctx 256 \
    --decode-tokens 4 --repeat 1 > "$OUT/profile.log" 2>&1
  say "profile rc=$?"
fi
