#!/usr/bin/env bash
# The device call session 17 left owing (≤ 9 minutes on an H100 / H200), for main as it ships:
#   1. GPU tests of the int8 MoE and of the shipping configuration (moe_int8_matches_cpu,
#      batched_decode_moe_rows_match_one_token_at_a_time, shipping_configuration_matches_cpu,
#      fused_decode_blocks_match_cpu), while the full-size checkpoint is synthesised;
#   2. one-token decode at 256 / 4K (and 32K once), `moe_int8` on (the default) / off
#      (LILY_MOE_INT8=0), alternated twice: on ≈ +8 %, off = main's before session 17 (H100:
#      466 / 461 tok/s), which says whether the one-token f32 kernels' restoration (decode.cu's
#      LEAN flag) holds;
#   3. agreement over LEN (1,024) teacher-forced positions, **one position a step** (`score
#      --piece 1`: the path the int8 MoE kernels serve; a 64-token piece would run prefill's),
#      CUDA bf16 with `moe_int8` on and off against CUDA fp32 (the CPU's stand-in at full size),
#      scripts/agreement_table.py's rel. L2 and top-1; HF transformers bf16's bar from session 5
#      (0.246 / 48.8 % over 1,024 positions) is printed beside: `moe_int8` stays on only at or
#      under it (issue 30's "must hold");
#   4. served 1 / 4 / 8 clients (scripts/concurrent_bench.py against `lily-engine serve`: a
#      1,024-token prompt each, 256 greedy tokens, the default --max-batch), issue 32's figures.
# Summary on stdout and in $OUT/summary.txt, logs beside. No step starts past DEADLINE (460 s);
# no run's timeout reaches past HARD (530 s).
# Here: `CARGO_TARGET_DIR=/work/main/target bash scripts/stage_gpu.sh /work/main/.carry/next`,
# `gzip -9 /work/main/.carry/next/bin/*`, then copy this script, concurrent_bench.py and
# serve_bench.py into .carry/next/, and the packed tokenizer into .carry/tokenizer/ (as
# gpu_ship_check.sh's staging). There:
#   bash .carry/next/gpu_next.sh   (carry: .carry/next .carry/tokenizer; timeout_s 560)
# Knobs: SKIP="tests sweep agree served" (parts left out), LEN (1024), STEPS (64), DEADLINE,
# HARD, DRY=1 (no GPU: the commands are written to $OUT/dry.log instead of run).
set -u
AB_TOKENIZER=1
if [ "${DRY:-0}" = 1 ]; then
  HERE="$(cd "$(dirname "$0")" && pwd)"; B=$HERE/bin; M=/dev/shm/full-mlx
  OUT=${OUT:-$(mktemp -d)}; mkdir -p "$OUT"; S=$OUT/summary.txt; say() { echo "$*" | tee -a "$S"; }
  t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }; AB_DEADLINE=${DEADLINE:-460}
  left() { [ "$(el)" -lt "$AB_DEADLINE" ]; }
  skipped() { case " ${SKIP:-} " in *" $1 "*) return 0 ;; esac; return 1; }
  run() { echo "RUN $*" >> "$OUT/dry.log"; }
  sleep 0 & SYN=$!
else
  . "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-460}"
  run() { "$@"; }
fi
HARD=${HARD:-530}
tmo() {  # tmo N: N seconds, or what is left before HARD if less (at least 1)
  local rest=$(( HARD - $(el) ))
  [ "$rest" -lt "$1" ] && { [ "$rest" -lt 1 ] && echo 1 || echo "$rest"; } || echo "$1"
}
E=$B/lily-engine
OFF=LILY_MOE_INT8=0
ON=LILY_MOE_INT8=1

# 1. The GPU tests, beside the checkpoint's synth (CPU-bound).
if ! skipped tests; then
  run timeout "$(tmo "${TEST_S:-150}")" "$B/gpu" --ignored --test-threads=1 --nocapture \
    moe_int8_matches_cpu batched_decode_moe_rows_match_one_token_at_a_time \
    shipping_configuration_matches_cpu fused_decode_blocks_match_cpu > "$OUT/tests.log" 2>&1
  say "tests rc=$? at $(el)s"
  grep -hE "^test .*(ok|FAILED)$|^test result|panicked|^KERNEL dec_glu4_q8|moe int8 true" "$OUT/tests.log" \
    2>/dev/null | cut -c1-220 | head -30 | tee -a "$S"
fi
wait "$SYN"; say "synth full rc=$? at $(el)s"

# 2. One-token decode, int8 on / off alternated twice (32K in the first round only).
sweep() {  # sweep NAME CTX ENV...
  local name=$1 ctx=$2; shift 2
  if skipped sweep; then return; fi
  if ! left; then say "sweep $name: skipped (deadline) at $(el)s"; return; fi
  run env "$@" timeout "$(tmo 90)" "$E" bench --model "$M" --device cuda --prefill 256 \
    --decode-ctx "$ctx" --decode-tokens "${STEPS:-64}" --repeat 1 > "$OUT/sweep-$name.log" 2>&1
  say "sweep $name ($*) rc=$? at $(el)s: $(grep -E '^ +[0-9]|error|Error' "$OUT/sweep-$name.log" 2>/dev/null \
    | tr -s ' ' | tr '\n' '|' | cut -c1-400)"
}
sweep on-1 256,4K,32K $ON
sweep off-1 256,4K,32K $OFF
sweep on-2 256,4K $ON
sweep off-2 256,4K $OFF

# 3. Agreement over LEN one-token steps against CUDA fp32.
if ! skipped agree; then
  if left; then
    W=/tmp/agree-next; mkdir -p "$W"
    len=${LEN:-1024}
    run env LILY_CUDA_FP32=1 timeout "$(tmo 120)" "$E" score --model "$M" --len "$len" --piece 64 \
      --device cuda --out "$W/fp32" > "$OUT/agree-fp32.log" 2>&1
    for mode in on off; do
      left || break
      e=$ON; [ $mode = off ] && e=$OFF
      run env $e timeout "$(tmo 120)" "$E" score --model "$M" --len "$len" --piece 1 --device cuda \
        --out "$W/bf16-int8-$mode" > "$OUT/agree-$mode.log" 2>&1
      say "score bf16 int8 $mode rc=$? at $(el)s"
    done
    run timeout "$(tmo 60)" python3 scripts/agreement_table.py --ref "$W/fp32" \
      --other "$W/bf16-int8-on" --other "$W/bf16-int8-off" --out "$OUT/agreement.md" > "$OUT/agree-table.log" 2>&1
    say "agreement ($len positions, one a step, against CUDA fp32; HF transformers bf16's bar: 0.246 rel. L2, 48.8 % top-1) at $(el)s:"
    grep -vE '^\s*$' "$OUT/agreement.md" 2>/dev/null | head -20 | tee -a "$S"
  else
    say "agreement: skipped (deadline) at $(el)s"
  fi
fi

# 4. Served 1 / 4 / 8 clients with the shipping defaults.
if ! skipped served; then
  if left; then
    export PYTHONUNBUFFERED=1
    run env LILY_ENGINE_BIN="$E" timeout "$(tmo 160)" python3 "$HERE/concurrent_bench.py" --model "$M" \
      --device cuda --prompt-tokens 1024 --max-tokens "${MAX_TOKENS:-256}" --clients 1,4,8 \
      > "$OUT/concurrent.log" 2>&1
    say "served 1,4,8 rc=$? at $(el)s:"
    grep -E "clients:|^server:|Error|error" "$OUT/concurrent.log" 2>/dev/null | cut -c1-220 | head -6 | tee -a "$S"
  else
    say "served: skipped (deadline) at $(el)s"
  fi
fi
say "done at $(el)s"
