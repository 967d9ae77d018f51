#!/usr/bin/env bash
# One device call (≤ 9 minutes on an H200 / H100 through Vulkan) for the f16 options' default on
# NVIDIA (issue 29 deliverable 2; docs/perf-notes.md, "session 18, branch wgpu-f16"), with `coop`
# on as it ships (linear_q4_coop's f16 operands in every run):
#   0. while the full-size checkpoint is synthesised: `selftest` on a 4-layer full-width model
#      with f16 activations and KV cache asked for (`--wgpu-f16-acts on --wgpu-f16-kv on`): its
#      fp32 check (bound 1e-3) and its f16 check (bound `--f16-tolerance`, 1e-1), the numbers a Mac's report gives;
#   1. `bench --prefill 512,4K --decode-ctx 4K,32K --decode-tokens 64` for
#        f32      LILY_WGPU_F16_ACTS=off LILY_WGPU_F16_KV=off   (before session 19 the default)
#        acts     LILY_WGPU_F16_ACTS=on  (LILY_WGPU_F16_KV=off)
#        acts-kv  LILY_WGPU_F16_ACTS=on LILY_WGPU_F16_KV=on   (Apple's default)
#      alternated twice (f32, acts, acts-kv, f32-2, acts-2, acts-kv-2);
#   2. agreement over LEN (1,024) teacher-forced positions (`score --piece 64`) of wgpu acts-kv
#      against CUDA fp32 (LILY_CUDA_FP32=1, the CPU's stand-in at full size), then, while time
#      is left, of wgpu in f32 (f32 activations and KV cache, coop): scripts/agreement_table.py's
#      rel. L2 and top-1, HF transformers bf16's bar beside (0.246 / 48.8 %, session 5; f16
#      activations without coop measured 0.0569 / 88.2 % in session 12's call).
# Reading it: f16 goes on for NVIDIA (the `f16_rule` in crates/lily-wgpu/src/plan.rs) where acts /
# acts-kv beat f32 in both rounds at 4K decode without losing prefill beyond noise, and their
# agreement stays far inside HF bf16's bar. It did (session 19, an H100 through Vulkan: acts-kv
# decode +1.9 % at 4K, +7.6 % at 32K, prefill −0.8 % at 4K, 0.0619 rel. L2 against f32's 0.0594):
# `auto` now follows this A/B, on for NVIDIA, so the f32 runs ask for f32 explicitly.
# Summary on stdout and in $OUT/summary.txt, each run's last lines in $OUT/bench-NAME.log. No step
# starts past DEADLINE (450 s); no run's timeout reaches past HARD (530 s).
# Here (do not commit binaries): `cargo build --release -j2 -p lily-server`, then
#   mkdir -p /work/main/.carry/wgpu-f16/bin && gzip -9c target/release/lily-engine \
#     > /work/main/.carry/wgpu-f16/bin/lily-engine.gz
#   cp scripts/wgpu_f16_ab.sh scripts/gpu_ab_common.sh /work/main/.carry/wgpu-f16/
# There, from the repo root (the Vulkan loader debs in .gl: ../.library/device/README.md):
#   bash .carry/wgpu-f16/wgpu_f16_ab.sh   (carry: .carry/wgpu-f16 .gl; timeout_s 560)
# Knobs: SKIP (parts left out: selftest f32 acts acts-kv f32-2 acts-2 acts-kv-2 agree ship-agree),
# LEN (1024), BENCH_S (a bench's timeout, 100), DEADLINE, HARD, DRY=1 (no GPU: the commands are
# written to $OUT/dry.log instead of run).
set -u
if [ "${DRY:-0}" = 1 ]; then
  HERE="$(cd "$(dirname "$0")" && pwd)"; B=$HERE/bin; M=/dev/shm/full-mlx; M4=/dev/shm/full4-mlx
  OUT=${OUT:-$(mktemp -d)}; mkdir -p "$OUT"; S=$OUT/summary.txt; say() { echo "$*" | tee -a "$S"; }
  t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }; AB_DEADLINE=${DEADLINE:-450}
  left() { [ "$(el)" -lt "$AB_DEADLINE" ]; }
  skipped() { case " ${SKIP:-} " in *" $1 "*) return 0 ;; esac; return 1; }
  cap() { echo "$1"; }
  run() { echo "RUN $*" >> "$OUT/dry.log"; }
  sleep 0 & SYN=$!; sleep 0 & SYN4=$!
else
  . "$(dirname "$0")/gpu_ab_common.sh" "${DEADLINE:-450}"
  run() { "$@"; }
  wgpu_setup
  wgpu_synth4
fi
AB_HARD=${HARD:-530}
E=$B/lily-engine

# 0. selftest, f16 asked for, on the 4-layer full-width model (prefill in chunks of 64: its
#    32-token prompt then runs prefill's kernels as a long prompt's first chunk would).
if skipped selftest; then say "skip selftest"; else
  wait "$SYN4" 2>/dev/null
  run env LILY_WGPU_CHUNK=64 timeout "$(cap 120)" "$E" selftest --model "$M4" --prompt-len 32 \
    --steps 16 --bench-prefill 32 --bench-decode 8 --wgpu-f16-acts on --wgpu-f16-kv on \
    > "$OUT/selftest.log" 2>&1
  say "selftest rc=$? at $(el)s: $(grep -E '^device:|agreement|shipping|FAIL|PASS|rror' "$OUT/selftest.log" \
    2>/dev/null | grep -v XDG | head -14 | tr -s ' ' | tr '\n' '|' | cut -c1-1200)"
fi
wait "$SYN"; say "synth full rc=$? at $(el)s"

# 1. The A/B, alternated twice. KEYS: the plan line's precision choices and their reasons.
KEYS="(fp32|f16) activations,|f16 (activations|KV cache): [a-z]+ \([^)]*\)|f16 (activations|KV cache) [a-z]+|cooperative matrices [a-z]+|linear_q4_coop (checked|refused)[^;]*"
ab() {  # ab NAME ENV...
  local name=$1; shift
  if [ "${DRY:-0}" = 1 ]; then
    run env "$@" "$E" bench --model "$M" --device wgpu --prefill 512,4K --decode-ctx 4K,32K \
      --decode-tokens 64 --repeat 1
  else
    PREFILL=512,4K wgpu_bench "$name" 4K,32K "$KEYS" "$@"
  fi
}
SHIP=LILY_WGPU_COOP=1
F32="LILY_WGPU_F16_ACTS=off LILY_WGPU_F16_KV=off"
ACTS="LILY_WGPU_F16_ACTS=on LILY_WGPU_F16_KV=off"
ACTS_KV="LILY_WGPU_F16_ACTS=on LILY_WGPU_F16_KV=on"
# shellcheck disable=SC2086
{
  ab f32 $SHIP $F32
  ab acts $SHIP $ACTS
  ab acts-kv $SHIP $ACTS_KV
  ab f32-2 $SHIP $F32
  ab acts-2 $SHIP $ACTS
  ab acts-kv-2 $SHIP $ACTS_KV
}

# 2. Agreement over LEN positions against CUDA fp32.
score() {  # score NAME DEVICE ENV...: LEN teacher-forced positions' logits into $W/NAME
  local name=$1 device=$2; shift 2
  if skipped "$name"; then say "skip $name"; return 1; fi
  if ! left; then say "skip $name: past the deadline at $(el)s"; return 1; fi
  run env "$@" timeout "$(cap 120)" "$E" score --model "$M" --len "$LEN" --piece 64 \
    --device "$device" --out "$W/$name" > "$OUT/score-$name.log" 2>&1
  local rc=$?
  say "score $name rc=$rc at $(el)s: $(grep -v XDG_RUNTIME_DIR "$OUT/score-$name.log" 2>/dev/null | tail -1 | cut -c1-200)"
  return $rc
}
LEN=${LEN:-1024}
W=/tmp/wgpu-f16-agree; mkdir -p "$W"
if skipped agree; then say "skip agree"; else
  if score cuda-fp32 cuda LILY_CUDA_FP32=1; then
    others=()
    # shellcheck disable=SC2086
    score acts-kv wgpu $SHIP $ACTS_KV && others+=(--other "$W/acts-kv")
    # shellcheck disable=SC2086
    score ship-agree wgpu $SHIP $F32 && others+=(--other "$W/ship-agree")
    if [ ${#others[@]} -gt 0 ]; then
      run timeout "$(cap 60)" python3 scripts/agreement_table.py --ref "$W/cuda-fp32" "${others[@]}" \
        --out "$OUT/agreement.md" --json "$OUT/agreement.json" > "$OUT/agree-table.log" 2>&1
      say "agreement ($LEN positions, pieces of 64, against CUDA fp32; HF transformers bf16's bar: 0.246 rel. L2, 48.8 % top-1) at $(el)s:"
      grep -vE '^\s*$' "$OUT/agreement.md" 2>/dev/null | head -12 | tee -a "$S"
    fi
  fi
fi
say "done at $(el)s"
