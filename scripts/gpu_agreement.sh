#!/usr/bin/env bash
# Teacher-forced agreement on the full-size synthetic checkpoint, in one device call (issues 11/12
# deliverable 3, issue 13 deliverable 4). Run from the repo root on the GPU machine:
#
#     OUT=$OUT LEN=1024 bash scripts/gpu_agreement.sh
#
# Steps, each under its own `timeout` cut to what is left of BUDGET seconds (default 420):
#   synth      the full checkpoint (`synth --preset qwen3.6-35b-a3b --format mlx --seed 7`), reused
#              when $M already holds one; meanwhile a tiny model warms the kernel caches (warm)
#   cpu-fp32   Lily's CPU backend, fp32 (the reference; equal to HF transformers fp32 on small
#              models in the test suite), niced, in the background from the end of synth to the
#              end; it flushes every piece of CPU_PIECE positions, so when it cannot finish all
#              LEN positions its first rows still count
#   cuda-bf16  Lily CUDA's production path (bf16 activations and KV cache)
#   cuda-fp32  Lily CUDA with fp32 activations (LILY_CUDA_FP32=1)
#   hf-bf16    HF transformers' bf16 path on the same dequantised weights (scripts/hf_agreement.py),
#              in the background beside
#   wgpu       Lily's wgpu backend through Vulkan as it ships (f16 activations and KV cache on
#              NVIDIA since session 19, `plan::f16_rule`; fp32 before); the Vulkan loader comes from
#              the carried .gl debs (as scripts/gpu_session.sh)
#   table      scripts/agreement_table.py: every path against cpu-fp32 (over the positions it
#              reached) and against cuda-fp32 (over all LEN positions; the fp32 reference when
#              the CPU could not finish, itself checked against the CPU on the CPU's positions)
# $OUT gets summary.md (the tables, with the wall time of each step), agreement.json, steps.tsv
# and logs.txt (each step's last lines). Knobs: LEN (1024), BUDGET (420), LILY_ENGINE (the binary,
# .carry/cuda/bin/lily-engine), SKIP="wgpu hf-bf16 ..." (steps left out), CPU_PIECE (256), PIECE
# (64: positions per call on the GPU paths, as gpu_full_check.sh), CPU=0 (no CPU reference).
set -uo pipefail
OUT=${OUT:-/tmp/out}
LEN=${LEN:-1024}
BUDGET=${BUDGET:-420}
B=${LILY_ENGINE:-.carry/cuda/bin/lily-engine}
W=${WORK:-/tmp/agree}
T0=$(date +%s)
M=${MODEL:-/tmp/full-mlx}
[ -z "${MODEL:-}" ] && [ "$(df --output=avail -B1G /dev/shm 2>/dev/null | tail -1)" -ge 40 ] 2>/dev/null && M=/dev/shm/full-mlx
export LILY_CACHE_DIR="${LILY_CACHE_DIR:-/tmp/lily-cache}" PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$W"
STEPS="$OUT/steps.tsv"
LOGS="$OUT/logs.txt"
: > "$STEPS"
: > "$LOGS"
left() { echo $((T0 + BUDGET - $(date +%s))); }
skipped() { case " ${SKIP:-} " in *" $1 "*) return 0 ;; esac; return 1; }
note() { echo "== $*" | tee -a "$LOGS"; }

# step NAME CAP RESERVE CMD...: runs CMD under timeout min(CAP, time left - RESERVE), its output
# in $W/NAME.log; one row of steps.tsv (name, exit status, seconds, last log line).
step() {
  local name=$1 cap=$2 reserve=$3; shift 3
  if skipped "$name"; then printf '%s\tskipped\t0\tSKIP\n' "$name" >> "$STEPS"; return 0; fi
  local t=$(( $(left) - reserve )); [ "$t" -gt "$cap" ] && t=$cap
  if [ "$t" -lt 5 ]; then printf '%s\tno time\t0\t\n' "$name" >> "$STEPS"; note "$name: no time left"; return 0; fi
  local s=$(date +%s)
  timeout -k 5 "$t" "$@" > "$W/$name.log" 2>&1
  local rc=$? secs=$(( $(date +%s) - s ))
  { [ $rc = 124 ] || [ $rc = 137 ]; } && rc="timeout ${t}s"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$secs" "$(grep -v '^\s*$' "$W/$name.log" | tail -1 | cut -c1-160 | tr '\t' ' ')" >> "$STEPS"
  { echo "== $name rc=$rc ${secs}s (limit ${t}s)"; [ "$name" = table ] ||
      grep -v -i -E "falling back|XDG_RUNTIME_DIR" "$W/$name.log" | tail -"${TAIL:-10}" | cut -c1-300; } >> "$LOGS"
}

note "$(date -u) $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null) cores $(nproc) LEN=$LEN BUDGET=$BUDGET model $M"
"$B" --version >> "$LOGS" 2>&1
git log -1 --format='commit %h %s' >> "$LOGS" 2>/dev/null

# The Vulkan loader for the wgpu step (not installed on the device machine): Debian's libvulkan1
# and friends carried as .gl/*.deb, unpacked here.
if ! skipped wgpu; then
  if ! ldconfig -p | grep -q libvulkan && [ -d .gl ]; then
    for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
  fi
  [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ] &&
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
fi

# While the checkpoint is written (CPU-bound), a tiny model fills the CUDA kernel cache (both
# activation modes) and the driver's shader cache, so the full-size steps time loading, not NVRTC.
warm() {
  rm -rf "$W/tiny"
  "$B" synth --preset tiny --seed 3 --out "$W/tiny" || return 1
  "$B" score --model "$W/tiny" --len 8 --device cuda --out "$W/warm-cuda"
  LILY_CUDA_FP32=1 "$B" score --model "$W/tiny" --len 8 --device cuda --out "$W/warm-cuda"
  skipped wgpu || "$B" score --model "$W/tiny" --len 8 --device wgpu --out "$W/warm-wgpu"
  rm -f "$W"/warm-*.f32
}
export -f warm skipped
export B W SKIP="${SKIP:-}"
if ! skipped warm && ! skipped cuda-bf16; then
  ( step warm 100 0 bash -c warm ) &
  WARM=$!
fi
if [ -f "$M/config.json" ]; then
  printf 'synth\treused\t0\t%s\n' "$M" >> "$STEPS"
else
  rm -rf "$M"
  step synth 200 60 "$B" synth --preset qwen3.6-35b-a3b --format mlx --seed 7 --out "$M"
fi
note "model: $(du -sb "$M" 2>/dev/null | cut -f1) bytes in $M"

# The CPU reference from now to the end (its own limit leaves TABLE_S for the table), niced so
# that the GPU steps' host work (loading 19.5 GB, Python) goes first; all cores.
TABLE_S=${TABLE_S:-40}
if [ "${CPU:-1}" != 0 ]; then
  ( step cpu-fp32 100000 "$TABLE_S" nice -n 10 "$B" score --model "$M" --len "$LEN" --device cpu \
      --piece "${CPU_PIECE:-256}" --out "$W/cpu-fp32" ) &
  CPU_PID=$!
fi

# The GPU steps: Lily CUDA in both modes one after the other, then HF transformers (≈ 75 GB of
# bf16 weights on the GPU) beside the wgpu backend (≈ 25 GB): both spend most of their time
# loading. Reserves keep time for what follows each step.
P=(--model "$M" --len "$LEN" --piece "${PIECE:-64}" --device)
[ -n "${WARM:-}" ] && wait "$WARM"
# Reserves from the H200 run of session 5 (LEN 1024): each CUDA score ≈ 10 s with loading, HF
# bf16 35 s, wgpu 31 s side by side; a BUDGET of 230 s with the earlier reserves (180, 150 s)
# had left the CUDA steps out.
step cuda-bf16 120 $((TABLE_S + 80)) "$B" score "${P[@]}" cuda --out "$W/cuda-bf16"
step cuda-fp32 120 $((TABLE_S + 65)) env LILY_CUDA_FP32=1 "$B" score "${P[@]}" cuda --out "$W/cuda-fp32"
( step hf-bf16 240 "$TABLE_S" python3 scripts/hf_agreement.py --model "$M" --len "$LEN" --save "$W/hf-bf16" --out "$W/hf.json" ) &
HF_PID=$!
step wgpu 240 "$TABLE_S" "$B" score "${P[@]}" wgpu --out "$W/wgpu"
wait "$HF_PID"
[ -n "${CPU_PID:-}" ] && wait "$CPU_PID"

# Every path against the CPU (the positions it reached) and against CUDA fp32 (all positions).
step table 60 0 python3 scripts/agreement_table.py --ref "$W/cpu-fp32" --ref "$W/cuda-fp32" \
  --other "$W/cuda-fp32" --other "$W/cuda-bf16" --other "$W/hf-bf16" --other "$W/wgpu" \
  --steps "$STEPS" --out "$OUT/summary.md" --json "$OUT/agreement.json"
# The table step's own row arrives after summary.md was written: append the final steps.
{ echo; tail -1 "$STEPS" | awk -F'\t' '{print "step " $1 ": exit " $2 ", " $3 " s"}'
  echo "total wall time: $(( $(date +%s) - T0 )) s (budget $BUDGET s)"; } >> "$OUT/summary.md"
cat "$OUT/summary.md"
