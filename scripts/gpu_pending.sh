#!/usr/bin/env bash
# The first device call after session 7, whose device budget ran out after it split the
# one-token attention into general and _long kernels chosen by the host (two decode graphs a
# sequence): that split has not run on a GPU (each kernel body has). In one call (≈ 6 minutes):
#   tests    gpu_check.sh on the shipping defaults (kernel tests with a sync after each launch, the
#            model and decode tests, the new decode_across_the_long_attention_threshold_*) beside
#            the synthetic checkpoint's synth
#   bench    the one sweep (prefill 512…128K, decode 256…128K) twice, alternated with
#            LILY_SPLIT_LONG_KEYS=1000000000 (session 6's kernel at every context); predictions in
#            docs/perf-notes.md, session 7, "What is on main after the calls"
#   prefill  `--chunked-scan` (now dn_chunk_wu + dn_chunk_scan, never run on a GPU) against the
#            default sequential scan at 512, 4K and 32K, two rounds
#   served   decode and time to first token through `lily-engine serve` at 4K and 128K
# All four do not fit one 600 s call: ONLY="tests bench", then ONLY="prefill served" at once (the
# machine stays warm 30 s, so the second call finds the checkpoint in /dev/shm).
#
# Here: scripts/stage_gpu.sh (copies this script too); carry .carry/cuda and the tokenizer
# (.carry/tokenizer, or .carry/tokgz/tokenizer.tgz: `tar czf .carry/tokgz/tokenizer.tgz -C .carry
# tokenizer` keeps the carry under 64 MiB when a baseline binary travels too).
# There: OUT=$OUT/p bash .carry/cuda/gpu_pending.sh   (ONLY="tests bench served" picks parts)
set -u
HERE="$(cd "$(dirname "$0")" && pwd)"
OUT="${OUT:-$PWD/gpu-logs}"
mkdir -p "$OUT/run" "$OUT/check"
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
say() { echo "$* (at $(el) s)" | tee -a "$OUT/pending.txt"; }
want() { [[ " ${ONLY:-tests bench prefill served} " == *" $1 "* ]]; }
[ -f "$HERE/../tokgz/tokenizer.tgz" ] && [ ! -f "$HERE/../tokenizer/tokenizer.json" ] &&
  tar xzf "$HERE/../tokgz/tokenizer.tgz" -C "$HERE/.."
export SKIP_CHECK=1 SKIP_PROFILE=1 SKIP_PARITY=1

if want tests; then
  ( SKIP_COMPILE=1 OUT="$OUT/check" timeout 330 bash "$HERE/gpu_check.sh" > "$OUT/check/stdout" 2>&1
    say "gpu_check rc=$?" ) &
  TESTS=$!
fi
OUT=$OUT/run VARIANTS="" bash "$HERE/gpu_session.sh" > "$OUT/run/synth.out" 2>&1
say "synth done"
if want tests; then
  wait $TESTS
  grep -E "test result|FAILED|panicked|^MODEL long|ENGINE cuda" "$OUT/check/summary.txt" >> "$OUT/pending.txt"
fi

M=/dev/shm/full-mlx; [ -f "$M/config.json" ] || M=/tmp/full-mlx
if want bench; then
  for round in 1 2; do
    for long in default 1000000000; do
      envs=(); [ "$long" = default ] || envs=(LILY_SPLIT_LONG_KEYS=$long)
      echo "===== round $round LILY_SPLIT_LONG_KEYS=$long" >> "$OUT/bench.log"
      env "${envs[@]}" timeout 200 "$HERE/bin/lily-engine" bench --model "$M" --device cuda \
        --prefill 512,4K,32K,128K --decode-ctx 256,4K,32K,128K --decode-tokens 128 --repeat 1 \
        2>&1 | grep -vE "INFO|^\s*$" >> "$OUT/bench.log"
    done
  done
  say "bench done"
fi

if want prefill; then
  OUT=$OUT/run VARIANTS="new new-chunked" ROUNDS=2 PREFILL=512,4K,32K DECODE=256 REPEAT=1 \
    bash "$HERE/gpu_session.sh" > "$OUT/run/prefill.out" 2>&1
  grep -v "^KERNEL" "$OUT/run/bench.log" | grep -E "=====|tok/s|^ +[0-9]" > "$OUT/prefill.log"
  say "prefill A/B done"
fi

if want served && [ "$(el)" -lt 420 ]; then
  OUT=$OUT/run VARIANTS="" SERVED=new SERVED_TTFT="4096 131072" TTFT_REPEAT=2 \
    bash "$HERE/gpu_session.sh" > "$OUT/run/served.out" 2>&1
  grep -hE "^(served|SERVED_TTFT)" "$OUT/run/session.txt" | cut -c1-400 >> "$OUT/pending.txt"
  say "served done"
fi
