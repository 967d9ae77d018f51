#!/usr/bin/env bash
# Session 27, the shipping call (≤ 9.5 minutes on a warm card whose /dev/shm holds the full
# checkpoint; else the synth first): issue 31's sweep and served first tokens, issue 32's served
# clients, issue 30's served decode, with the defaults chosen after call b (CHUNK: the prefill
# chunk to measure, 8192 unless told; EXTRA_ENV: switches to set, e.g. "LILY_X=1").
#   bash .carry/s27b/gpu_s27c.sh      (carry: .carry/s27b .carry/tokenizer; timeout_s 580)
# 1. `bench --prefill 512,4K,32K,128K --decode-ctx 256,4K,32K,128K --decode-tokens 128`;
# 2. served first tokens at 4K and 128K (serve_bench.py --ttft-only, two each, no shared prefix);
# 3. served decode at 4K (a 4,096-token prompt, 256 greedy tokens, twice);
# 4. served 1 / 4 / 8 clients (concurrent_bench.py: 1,024-token prompts, 256 greedy tokens).
set -u
AB_TOKENIZER=1
. "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-470}"
AB_HARD=${HARD:-560}
E=$B/lily-engine
export LILY_PREFILL_CHUNK=${CHUNK:-8192}
for kv in ${EXTRA_ENV:-}; do export "$kv"; done
say "chunk $LILY_PREFILL_CHUNK, extra: ${EXTRA_ENV:-none}"
wait "$SYN"; say "synth full rc=$? at $(el)s"
step() { if skipped "$1"; then say "$1: skipped (SKIP)"; return 1; fi; left || { say "$1: skipped (deadline) at $(el)s"; return 1; }; }
if step sweep; then
  timeout "$(cap 170)" "$E" bench --model "$M" --device cuda --prefill 512,4K,32K,128K \
    --decode-ctx 256,4K,32K,128K --decode-tokens 128 --repeat 1 > "$OUT/sweep.log" 2>&1
  say "cuda sweep rc=$? at $(el)s: $(grep -h -m1 -oE 'prefill chunk [0-9]+' "$OUT/sweep.log")"
  grep -E "^ +[0-9]|tok/s|error|Error" "$OUT/sweep.log" | grep -v INFO | tee -a "$S"
fi
export PYTHONUNBUFFERED=1 LILY_ENGINE_BIN="$E"
if step ttft; then
  timeout "$(cap 120)" python3 "$HERE/serve_bench.py" --model "$M" --device cuda --prompt-tokens 4096 \
    --ctx-size 0 --ttft-only --ttft-tokens 4096,131072 --ttft-repeat 2 > "$OUT/ttft.log" 2>&1
  say "served first tokens rc=$? at $(el)s:"
  grep -vE 'INFO|^$' "$OUT/ttft.log" | tail -8 | cut -c1-300 | tee -a "$S"
fi
if step served; then
  timeout "$(cap 90)" python3 "$HERE/serve_bench.py" --model "$M" --device cuda --prompt-tokens 4096 \
    --max-tokens 256 --repeat 2 > "$OUT/served.log" 2>&1
  say "served 4K rc=$? at $(el)s: $(grep -E '^(completions|chat)|rror' "$OUT/served.log" | tail -2 | tr '\n' '|' | cut -c1-400)"
fi
if step concurrent; then
  timeout "$(cap 120)" python3 "$HERE/concurrent_bench.py" --model "$M" --device cuda --prompt-tokens 1024 \
    --max-tokens 256 --clients 1,4,8 > "$OUT/concurrent.log" 2>&1
  say "served 1,4,8 clients rc=$? at $(el)s:"
  grep -E "clients:|rror" "$OUT/concurrent.log" | cut -c1-220 | head -5 | tee -a "$S"
fi
say "done at $(el)s"
