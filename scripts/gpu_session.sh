#!/usr/bin/env bash
# One device call for a change to lily-cuda: the kernel and model tests of this build
# (gpu_check.sh), then, on the full-size synthetic checkpoint, the bench of a baseline binary and
# of this build with and without the fused decode path (alternated, same machine, same run), the
# per-kernel decode profile at 4K, and CUDA-vs-CPU parity over teacher-forced positions.
#
# Here: scripts/stage_gpu.sh (this build into .carry/cuda), a baseline lily-engine in
# .carry/old/ (e.g. main's, built from a clean worktree). There: bash .carry/cuda/gpu_session.sh.
# Knobs: PREFILL, DECODE (bench lists), REPEAT, ROUNDS (alternations), VARIANTS (old new-unfused
# new), SERVED (old new: served decode at 4K), PROFILE_CTX (contexts of the per-kernel decode
# profile), SKIP_CHECK=1, SKIP_PROFILE=1, SKIP_PARITY=1.
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
OUT="${OUT:-$PWD/gpu-logs}"
mkdir -p "$OUT"
NEW="$HERE/bin/lily-engine"
OLD="${OLD:-$HERE/../old/lily-engine}"
M=/tmp/full-mlx
export LILY_CACHE_DIR="${LILY_CACHE_DIR:-/tmp/lily-cache}"
LOG="$OUT/session.txt"
say() { echo "$*" | tee -a "$LOG"; }

say "== $(date -u) $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader)"
# The served measurement needs a tokenizer in the model folder: an unpacked copy of the bundled
# one (lilycli/bundled_tokenizer.py) carried in .carry/tokenizer, when there.
TOK=(); [ -f "$HERE/../tokenizer/tokenizer.json" ] && TOK=(--tokenizer "$HERE/../tokenizer")
[ -f "$M/config.json" ] || ( "$NEW" synth --preset qwen3.6-35b-a3b --format mlx --seed 7 --out "$M" "${TOK[@]}" > /tmp/synth.log 2>&1 ) &
SYNTH=$!
if [ "${SKIP_CHECK:-0}" != 1 ]; then
  t0=$(date +%s)
  mkdir -p "$OUT/check"
  OUT="$OUT/check" timeout 420 bash "$HERE/gpu_check.sh" > /tmp/gpu_check.log 2>&1
  say "gpu_check rc=$? in $(( $(date +%s) - t0 ))s"
fi
wait $SYNTH
say "synth: $(tail -1 /tmp/synth.log) $(du -sb $M | cut -f1) bytes"

B=(--model "$M" --device cuda --prefill "${PREFILL:-512,4K,32K}" --decode-ctx "${DECODE:-256,4K}"
   --decode-tokens 128 --repeat "${REPEAT:-2}")
for round in $(seq "${ROUNDS:-1}"); do
  for v in ${VARIANTS:-old new-unfused new}; do
    case $v in
      old) cmd=("$OLD" bench "${B[@]}") ;;
      new-unfused) cmd=("$NEW" bench "${B[@]}" --no-fused-decode) ;;
      new) cmd=("$NEW" bench "${B[@]}") ;;
    esac
    [ -x "${cmd[0]}" ] || { say "no binary for $v"; continue; }
    echo "===== round $round $v: ${cmd[*]}" >> "$OUT/bench.log"
    timeout 240 "${cmd[@]}" >> "$OUT/bench.log" 2>&1
    say "bench $v round $round rc=$?"
  done
done
grep -E "^=====|tok/s|prefill|decode" "$OUT/bench.log" | grep -v "^\s*$" | tail -60 >> "$LOG"

# Served decode at 4K through `lily-engine serve` + a streaming client (scripts/serve_bench.py),
# for each binary in SERVED (old, new).
# SERVED_EXTRA: a JSON body merged into each request (e.g. '{"presence_penalty": 0}': the model
# card's default presence penalty applies to temperature-0 requests too).
for v in ${SERVED:-}; do
  bin=$NEW; [ "$v" = old ] && bin=$OLD
  LILY_ENGINE_BIN="$bin" timeout 200 python3 scripts/serve_bench.py --model "$M" --device cuda \
    --prompt-tokens 4096 --max-tokens 256 --repeat 3 --extra "${SERVED_EXTRA:-{\}}" >> "$OUT/served.log" 2>&1
  say "served $v ${SERVED_EXTRA:-} rc=$?: $(tail -1 "$OUT/served.log")"
done

if [ "${SKIP_PROFILE:-0}" != 1 ]; then
  for ctx in ${PROFILE_CTX:-4096}; do
    echo "===== decode profile at context $ctx" >> "$OUT/profile.log"
    LILY_PROFILE=1 timeout 150 "$NEW" bench --model "$M" --device cuda --prefill 16 --decode-ctx "$ctx" \
      --decode-tokens 32 --repeat 1 >> "$OUT/profile.log" 2>&1
    say "profile $ctx rc=$?"
  done
fi
if [ "${SKIP_PARITY:-0}" != 1 ]; then
  LILY_PARITY_MODEL="$M" LILY_PARITY_POSITIONS="${POSITIONS:-16}" timeout 300 "$HERE/bin/gpu" --ignored \
    --test-threads=1 --nocapture model_matches_cpu_on_checkpoint_from_env > "$OUT/parity.log" 2>&1
  say "parity rc=$?"
  grep -E "^MODEL|^loaded|test result" "$OUT/parity.log" | tee -a "$LOG"
fi
grep -h -E "^(KERNEL|MODEL)|test result|FAILED|panicked" /tmp/lily-gpu-logs/*.log 2>/dev/null | tail -60 >> "$LOG"
