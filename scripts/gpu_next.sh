#!/usr/bin/env bash
# The next session's CUDA device call (≤ 9 minutes on an H100 / H200): what session 17 left owing
# (the int8 MoE on the merged main) and session 18's two switches (`gemv_int8`, `moe_int8_pairs`:
# int8 pairs of x, docs/perf-notes.md session 18), on the full-size checkpoint, four variants:
#   ship   the defaults (`moe_int8` on, the projections' f32 products)
#   moeoff LILY_MOE_INT8=0 (the f32 MoE products: main's 466 / 461 tok/s at 256 / 4K on an H100
#          before session 17, which says whether decode.cu's LEAN restoration holds)
#   gemv   LILY_GEMV_INT8=1 (the one-token projections and lm_head on int8 pairs)
#   pairs  LILY_GEMV_INT8=1 LILY_MOE_INT8_PAIRS=1 (the MoE's int8 on pairs too)
# Parts (SKIP="tests sweep agree served" leaves some out; served is off unless SERVED=1):
#   1. tests: the int8 and int8-pair kernels against the CPU (moe_int8_matches_cpu,
#      gemv_int8_matches_cpu, wide_decode_gemvs_match_cpu, fused_decode_blocks_match_cpu,
#      batched_decode_moe_rows_match_one_token_at_a_time), then the shipping configuration end
#      to end (shipping_configuration_*) as it ships and with both pair forms on; beside the
#      full-size checkpoint's synth (CPU-bound);
#   2. sweep, round 1: one-token decode at 256 / 4K / 32K, each variant;
#   3. agree: teacher-forced logits over LEN (1,024) positions, **one position a step** (`score
#      --piece 1`: the path the int8 kernels serve; a 64-token piece would run prefill's) for each
#      variant, against CUDA fp32 (the CPU's stand-in at full size), scripts/agreement_table.py's
#      rel. L2 and top-1, HF transformers bf16's bar beside (0.246 / 48.8 % over 1,024 positions,
#      session 5): a default stays only at or under it (issue 30's "must hold");
#   4. sweep, round 2 at 256 / 4K, while the deadline allows;
#   5. served (SERVED=1; for a second call: `SERVED=1 SKIP="tests sweep agree"`): 1 / 4 / 8
#      clients (scripts/concurrent_bench.py against `lily-engine serve`: a 1,024-token prompt
#      each, 256 greedy tokens, the default --max-batch) under SERVED_ENV (the variant chosen,
#      e.g. "LILY_GEMV_INT8=1"), issue 32's figures.
# Summary on stdout and in $OUT/summary.txt, logs beside. No step starts past DEADLINE (470 s);
# no run's timeout reaches past HARD (540 s).
# Here: `CARGO_TARGET_DIR=/work/main/target bash scripts/stage_gpu.sh /work/main/.carry/next`,
# `gzip -9 /work/main/.carry/next/bin/*`, then copy this script, concurrent_bench.py and
# serve_bench.py into .carry/next/, and the packed tokenizer into .carry/tokenizer/ (as
# gpu_ship_check.sh's staging). There:
#   bash .carry/next/gpu_next.sh   (carry: .carry/next .carry/tokenizer; timeout_s 570)
# Knobs: SKIP, SERVED, SERVED_ENV, VARIANTS (default "ship moeoff gemv pairs"), LEN (1024),
# STEPS (64), TEST_S (170), DEADLINE, HARD, DRY=1 (no GPU: the commands into $OUT/dry.log).
set -u
AB_TOKENIZER=1
if [ "${DRY:-0}" = 1 ]; then
  HERE="$(cd "$(dirname "$0")" && pwd)"; B=$HERE/bin; M=/dev/shm/full-mlx
  OUT=${OUT:-$(mktemp -d)}; mkdir -p "$OUT"; S=$OUT/summary.txt; say() { echo "$*" | tee -a "$S"; }
  t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }; AB_DEADLINE=${DEADLINE:-470}
  left() { [ "$(el)" -lt "$AB_DEADLINE" ]; }
  skipped() { case " ${SKIP:-} " in *" $1 "*) return 0 ;; esac; return 1; }
  run() { echo "RUN $*" >> "$OUT/dry.log"; }
  sleep 0 & SYN=$!
else
  . "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-470}"
  run() { "$@"; }
fi
HARD=${HARD:-540}
tmo() {  # tmo N: N seconds, or what is left before HARD if less (at least 1)
  local rest=$(( HARD - $(el) ))
  [ "$rest" -lt "$1" ] && { [ "$rest" -lt 1 ] && echo 1 || echo "$rest"; } || echo "$1"
}
E=$B/lily-engine
declare -A ENV_OF=([ship]="" [moeoff]="LILY_MOE_INT8=0" [gemv]="LILY_GEMV_INT8=1"
  [pairs]="LILY_GEMV_INT8=1 LILY_MOE_INT8_PAIRS=1")
VARIANTS=${VARIANTS:-ship moeoff gemv pairs}
PAIRS=${ENV_OF[pairs]}

# 1. The GPU tests, beside the checkpoint's synth.
if ! skipped tests; then
  run timeout "$(tmo $(( ${TEST_S:-170} * 2 / 3 )))" "$B/gpu" --ignored --test-threads=1 --nocapture \
    moe_int8_matches_cpu gemv_int8_matches_cpu wide_decode_gemvs_match_cpu fused_decode_blocks_match_cpu \
    batched_decode_moe_rows_match_one_token_at_a_time > "$OUT/tests-kernels.log" 2>&1
  say "tests (int8 and int8-pair kernels, f32 GEMVs, fused blocks, MoE rows) rc=$? at $(el)s"
  rest=$(( ${TEST_S:-170} - $(el) )); [ "$rest" -lt 20 ] && rest=20
  run timeout "$(tmo $(( rest / 2 )))" "$B/gpu" --ignored --test-threads=1 --nocapture \
    shipping_configuration > "$OUT/tests-ship.log" 2>&1
  say "tests (shipping_configuration_*, as it ships) rc=$? at $(el)s"
  run env $PAIRS timeout "$(tmo $(( rest / 2 )))" "$B/gpu" --ignored --test-threads=1 --nocapture \
    shipping_configuration > "$OUT/tests-pairs.log" 2>&1
  say "tests (shipping_configuration_*, $PAIRS) rc=$? at $(el)s"
  grep -hE "^test .*(ok|FAILED)$|^test result|panicked|MODEL shipping" \
    "$OUT/tests-kernels.log" "$OUT/tests-ship.log" "$OUT/tests-pairs.log" 2>/dev/null | cut -c1-220 | head -40 | tee -a "$S"
fi
wait "$SYN"; say "synth full rc=$? at $(el)s"

sweep() {  # sweep NAME CTX VARIANT: one-token decode under the variant's environment
  local name=$1 ctx=$2 v=$3
  if skipped sweep; then return; fi
  if ! left; then say "sweep $name: skipped (deadline) at $(el)s"; return; fi
  run env ${ENV_OF[$v]} timeout "$(tmo 80)" "$E" bench --model "$M" --device cuda --prefill 256 \
    --decode-ctx "$ctx" --decode-tokens "${STEPS:-64}" --repeat 1 > "$OUT/sweep-$name.log" 2>&1
  say "sweep $name (${ENV_OF[$v]:-defaults}) rc=$? at $(el)s: $(grep -E '^ +[0-9]|error|Error' "$OUT/sweep-$name.log" 2>/dev/null \
    | tr -s ' ' | tr '\n' '|' | cut -c1-400)"
}

# 2. One-token decode, round 1 (with 32K).
for v in $VARIANTS; do sweep "$v-1" 256,4K,32K "$v"; done

# 3. Agreement over LEN one-token steps against CUDA fp32.
if ! skipped agree; then
  if left; then
    W=/tmp/agree-next; mkdir -p "$W"
    len=${LEN:-1024}
    run env LILY_CUDA_FP32=1 timeout "$(tmo 120)" "$E" score --model "$M" --len "$len" --piece 64 \
      --device cuda --out "$W/fp32" > "$OUT/agree-fp32.log" 2>&1
    say "score fp32 rc=$? at $(el)s"
    others=()
    for v in $VARIANTS; do
      left || break
      run env ${ENV_OF[$v]} timeout "$(tmo 120)" "$E" score --model "$M" --len "$len" --piece 1 --device cuda \
        --out "$W/bf16-$v" > "$OUT/agree-$v.log" 2>&1
      say "score bf16 $v rc=$? at $(el)s"
      others+=(--other "$W/bf16-$v")
    done
    run timeout "$(tmo 60)" python3 scripts/agreement_table.py --ref "$W/fp32" "${others[@]}" \
      --out "$OUT/agreement.md" > "$OUT/agree-table.log" 2>&1
    say "agreement ($len positions, one a step, against CUDA fp32; others in the order $VARIANTS; HF transformers bf16's bar: 0.246 rel. L2, 48.8 % top-1) at $(el)s:"
    grep -vE '^\s*$' "$OUT/agreement.md" 2>/dev/null | head -24 | tee -a "$S"
  else
    say "agreement: skipped (deadline) at $(el)s"
  fi
fi

# 4. One-token decode, round 2.
for v in $VARIANTS; do sweep "$v-2" 256,4K "$v"; done

# 5. Served 1 / 4 / 8 clients.
if [ "${SERVED:-0}" = 1 ] && ! skipped served; then
  if left; then
    export PYTHONUNBUFFERED=1
    run env ${SERVED_ENV:-} LILY_ENGINE_BIN="$E" timeout "$(tmo 170)" python3 "$HERE/concurrent_bench.py" \
      --model "$M" --device cuda --prompt-tokens 1024 --max-tokens "${MAX_TOKENS:-256}" --clients 1,4,8 \
      > "$OUT/concurrent.log" 2>&1
    say "served 1,4,8 (${SERVED_ENV:-defaults}) rc=$? at $(el)s:"
    grep -E "clients:|^server:|Error|error" "$OUT/concurrent.log" 2>/dev/null | cut -c1-220 | head -6 | tee -a "$S"
  else
    say "served: skipped (deadline) at $(el)s"
  fi
fi
say "done at $(el)s"
