#!/usr/bin/env bash
# One device call for prefill's f16 product tiles (issue 29 deliverable 5; docs/perf-notes.md
# "session 11, branch wgpu-prefill"): wgpu through Vulkan on the full-size synthetic checkpoint,
# prefill at 512 / 4K / 32K for main and for this branch with its f16 tiles off (the default:
# f32 tiles, the same kernel as main's), off with dense tiles of 64 (`LILY_WGPU_DENSE_TILE=64`:
# the tile size's effect alone) and on (`LILY_WGPU_F16_TILES=1`: dense tiles of 64, each
# expert's by its load), then per-kernel profiles at 4K (`LILY_PROFILE=1`: the lin.* rows), then `selftest` on
# the small model with the f16 tiles on and off (agreement with the CPU; its bound is 1e-3).
#
# Here: the binaries as DIR/bin/lily-engine-NAME(.gz) for NAME in main (main 901c269: the
# wgpu-speed head's binary) and head (this branch), this script beside them, the Vulkan loader
# debs in .gl (../.library/device/README.md). There:
#   bash .carry/wgpu-prefill/wgpu_prefill_ab.sh        (carry: .carry/wgpu-prefill .gl)
# Logs: $OUT/summary.txt (the table), $OUT/prof-NAME.log (LILY_PROFILE=1 runs), $OUT/selftest-*.log.
# Knobs: PREFILL (lengths), PROFILE (runs profiled, of main off off64 on; default off on), DEADLINE (s: no new
# run starts after it). ≈ 7–8 minutes of device time.
set -u
HERE="$(cd "$(dirname "$0")" && pwd)"
cd "$HERE/../.."
OUT="${OUT:-/tmp/wgpu-prefill-ab}"; mkdir -p "$OUT"
PREFILL="${PREFILL:-512,4K,32K}"
PROFILE="${PROFILE:-off on}"
t0=$(date +%s); at() { echo "$(( $(date +%s) - t0 ))"; }
LOG=$OUT/summary.txt; say() { echo "$*" | tee -a "$LOG"; }
for f in "$HERE"/bin/*.gz; do [ -f "$f" ] && gunzip -f "$f"; done
chmod +x "$HERE"/bin/* 2>/dev/null
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
[ -f "$VK_DRIVER_FILES" ] || unset VK_DRIVER_FILES
export LILY_CACHE_DIR=/tmp/lily-cache
M=/dev/shm/full-mlx
S=/dev/shm/small-mlx
say "== $(date -u) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
timeout 240 "$HERE/bin/lily-engine-head" synth --preset qwen3.6-35b-a3b --format mlx --seed 7 --out $M > /tmp/synth.log 2>&1
say "synth rc=$? at $(at)s"
# A run: binary (main or head), tag, environment; the bench's prefill rows (len, tok/s, ms).
run() {
  local v=$1 tag=$2; shift 2
  if [ "$(at)" -gt "${DEADLINE:-480}" ]; then say "skip $v $tag: past the deadline"; return; fi
  env "$@" timeout 150 "$HERE/bin/lily-engine-$v" bench --model $M --device wgpu --prefill "$PREFILL" \
    --decode-ctx 256 --decode-tokens 16 --repeat 1 > "/tmp/$tag.log" 2>&1
  say "$tag rc=$? at $(at)s: $(grep -E '^ +[0-9]+[KM]? +[0-9.]+ +[0-9.]+$' /tmp/$tag.log | tr -s ' ' | tr '\n' '|')"
}
run main main LILY_X=0
run head off LILY_WGPU_F16_TILES=0
run head off64 LILY_WGPU_F16_TILES=0 LILY_WGPU_DENSE_TILE=64
run head on LILY_WGPU_F16_TILES=1
# The plan's line (tiles, by load) for each form.
grep -h -m1 "wgpu: " /tmp/off.log | cut -c1-900 >> "$LOG"
grep -h -m1 "wgpu: " /tmp/on.log | cut -c1-900 >> "$LOG"
for p in $PROFILE; do
  case $p in main) v=main f=0 d=0 ;; off) v=head f=0 d=0 ;; off64) v=head f=0 d=64 ;;
    on) v=head f=1 d=0 ;; *) continue ;; esac
  PREFILL=4K run $v prof-$p LILY_PROFILE=1 LILY_WGPU_F16_TILES=$f LILY_WGPU_DENSE_TILE=$d
  cp "/tmp/prof-$p.log" "$OUT/prof-$p.log" 2>/dev/null
done
# Agreement with the CPU on the small model (selftest: teacher-forced logits, greedy tokens).
timeout 120 "$HERE/bin/lily-engine-head" synth --preset small --format mlx --seed 7 --out $S > /tmp/synth-small.log 2>&1
for f in 0 1; do
  if [ "$(at)" -gt "${DEADLINE:-480}" ]; then say "skip selftest f16 tiles $f: past the deadline"; continue; fi
  LILY_WGPU_F16_TILES=$f timeout 120 "$HERE/bin/lily-engine-head" selftest --model $S --prompt-len 256 \
    > "$OUT/selftest-f16tiles$f.log" 2>&1
  say "selftest f16 tiles $f rc=$? at $(at)s: $(grep -E '^device:|agreement:' "$OUT/selftest-f16tiles$f.log" | tr -s ' ' | tr '\n' '|')"
done
say "done at $(at)s"
