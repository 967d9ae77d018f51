#!/usr/bin/env bash
# Session 9's device calls for issue 12 (prefill), after attn_prefill_wg (prefill attention on
# wgmma, the plan's `wgmma_attention`). Parts, picked by ONLY (default: all, which does not fit one
# 600 s call; the machine stays warm 30 s, so a second call at once finds the checkpoint in
# /dev/shm):
#   tests    gpu_check.sh (kernel tests with a sync after each launch, model and decode tests)
#            beside the synthetic checkpoint's synth
#   kern     the GPU tests named in KTESTS (substrings), beside the synth
#   attn     attn_prefill_matches_attn_decode: attn_prefill and attn_prefill_wg against attn_decode,
#            TFLOP/s of each up to a 32K prompt's last chunk (4,096 queries over 32,768 keys)
#   bench    the one sweep (prefill 512…128K, decode 256…128K), ROUNDS times (default 1)
#   ab       prefill AB_PREFILL (default 4K,32K,128K) with AB_FLAG (default --no-wgmma-attention)
#            and without, alternated twice
#   profile  LILY_PROFILE=1 prefill of 512 and 32K: device time per kernel
#   served   decode and time to first token through `lily-engine serve` at 4K and 128K
# Here: scripts/stage_gpu.sh; carry .carry/cuda and .carry/tokgz. There:
#   ONLY="tests attn bench" OUT=$OUT/p bash .carry/cuda/gpu_pending.sh
set -u
HERE="$(cd "$(dirname "$0")" && pwd)"
B="$HERE/bin/lily-engine"
OUT="${OUT:-$PWD/gpu-logs}"
mkdir -p "$OUT/run" "$OUT/check"
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
say() { echo "$* (at $(el) s)" | tee -a "$OUT/pending.txt"; }
want() { [[ " ${ONLY:-tests kern attn bench ab profile served} " == *" $1 "* ]]; }
[ -f "$HERE/../tokgz/tokenizer.tgz" ] && [ ! -f "$HERE/../tokenizer/tokenizer.json" ] &&
  tar xzf "$HERE/../tokgz/tokenizer.tgz" -C "$HERE/.."
export SKIP_CHECK=1 SKIP_PROFILE=1 SKIP_PARITY=1 LILY_CACHE_DIR="${LILY_CACHE_DIR:-/tmp/lily-cache}"

if want attn; then
  timeout 120 "$HERE/bin/gpu" --ignored --test-threads=1 --nocapture attn_prefill_matches_attn_decode \
    > "$OUT/attn-test.log" 2>&1
  say "attn test rc=$?"
  grep -E "^KERNEL attn_prefill|test result|panicked|error" "$OUT/attn-test.log" | cut -c1-220 >> "$OUT/pending.txt"
fi
if want kern; then
  ( for t in ${KTESTS:-tensor_core_linears}; do
      timeout 200 "$HERE/bin/gpu" --ignored --test-threads=1 --nocapture "$t" >> "$OUT/kern.log" 2>&1
      say "test $t rc=$?"
    done ) &
  KERN=$!
fi
if want tests; then
  ( SKIP_COMPILE=1 OUT="$OUT/check" timeout 330 bash "$HERE/gpu_check.sh" > "$OUT/check/stdout" 2>&1
    say "gpu_check rc=$?" ) &
  TESTS=$!
fi
OUT=$OUT/run VARIANTS="" bash "$HERE/gpu_session.sh" > "$OUT/run/synth.out" 2>&1
say "synth done"
if want tests; then
  wait $TESTS
  grep -E "test result|FAILED|panicked|^MODEL (3,100|700)|^ENGINE cuda" "$OUT/check/summary.txt" >> "$OUT/pending.txt"
fi

if want kern; then
  wait $KERN
  grep -E "router|^MODEL|test result|panicked|FAILED" "$OUT/kern.log" | cut -c1-200 >> "$OUT/pending.txt"
fi

M=/dev/shm/full-mlx; [ -f "$M/config.json" ] || M=/tmp/full-mlx
if want bench; then
  for round in $(seq "${ROUNDS:-1}"); do
    echo "===== round $round" >> "$OUT/bench.log"
    timeout 200 "$B" bench --model "$M" --device cuda --prefill 512,4K,32K,128K \
      --decode-ctx 256,4K,32K,128K --decode-tokens 128 --repeat 1 2>&1 | grep -vE "INFO|^\s*$" >> "$OUT/bench.log"
  done
  say "bench done"
fi

if want ab; then
  for round in 1 2; do
    for f in "${AB_FLAG:---no-wgmma-attention}" ""; do
      echo "===== round $round ${f:-default}" >> "$OUT/ab.log"
      timeout 100 "$B" bench --model "$M" --device cuda --prefill "${AB_PREFILL:-4K,32K,128K}" --decode-ctx 256 --decode-tokens 8 \
        --repeat 1 $f 2>&1 | grep -vE "INFO|^\s*$" >> "$OUT/ab.log"
    done
  done
  say "A/B done"
fi

if want profile; then
  for p in 512 32K; do
    LILY_PROFILE=1 timeout 60 "$B" bench --model "$M" --device cuda --prefill $p --decode-ctx 256 \
      --decode-tokens 4 --repeat 1 > "$OUT/profile-$p.log" 2>&1
    say "profile $p rc=$?"
  done
fi

if want served; then
  OUT=$OUT/run VARIANTS="" SERVED=new SERVED_TTFT="4096 131072" TTFT_REPEAT=2 \
    bash "$HERE/gpu_session.sh" > "$OUT/run/served.out" 2>&1
  grep -hE "^(served|SERVED_TTFT)" "$OUT/run/session.txt" | cut -c1-400 >> "$OUT/pending.txt"
  say "served done"
fi
