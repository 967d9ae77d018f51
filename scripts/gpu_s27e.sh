#!/usr/bin/env bash
# Session 27, call e (≤ 6.5 minutes): branch s27bat's A/B (gpu_s27bat_ab.sh: `batch_lean_glue`,
# issue 32) with the tokenizer in the checkpoint, then served first tokens at 4K and 128K with
# the shipping defaults (prefill chunk 8,192; the server's save points every 8,192 tokens).
#   bash .carry/s27e/gpu_s27e.sh      (carry: .carry/s27e .carry/tokenizer; timeout_s 400)
set -u
H="$(cd "$(dirname "$0")" && pwd)"
R=${OUT:-$PWD/gpu-logs}; mkdir -p "$R"
AB_TOKENIZER=1 OUT=$R bash "$H/gpu_s27bat_ab.sh"
export OUT=$R
AB_TOKENIZER=1
. "$H/gpu_ab_common.sh" "${DEADLINE:-180}"
AB_HARD=${HARD:-190}
wait "$SYN"
export PYTHONUNBUFFERED=1 LILY_ENGINE_BIN="$B/lily-engine"
timeout "$(cap 110)" python3 "$HERE/serve_bench.py" --model "$M" --device cuda --prompt-tokens 4096 \
  --ctx-size 0 --ttft-only --ttft-tokens 4096,131072 --ttft-repeat 2 > "$OUT/ttft.log" 2>&1
say "served first tokens (shipping defaults) rc=$? at $(el)s:"
grep -vE 'INFO|^$' "$OUT/ttft.log" | tail -8 | cut -c1-300 | tee -a "$S"
say "done at $(el)s"
