#!/usr/bin/env bash
# One device call for session 13's wgpu decode attention (issue 29 deliverable 4; docs/perf-notes.md
# "session 13, branch wgpu-decode"): wgpu through Vulkan on the full-size synthetic checkpoint,
# `bench --prefill 512 --decode-ctx 4K,32K --decode-tokens 64` with the session's switches off
# and on, alternated so that drift shows:
#   off    the defaults (all off)
#   all    LILY_WGPU_ATTN_FLAT=1 LILY_WGPU_ATTN_SPLIT=1 LILY_WGPU_LM_ROWS=64
#   flat   LILY_WGPU_ATTN_FLAT=1   (attend_gqa's reads unconditional, constant trip counts)
#   split  LILY_WGPU_ATTN_SPLIT=1  (decode attention's keys split by the plan: 258 workgroups at 4K)
#   lm     LILY_WGPU_LM_ROWS=64    (lm_head 64 rows a workgroup: 3,880 workgroups, not 15,520)
#   prof   all, LILY_PROFILE=1     (per-kernel table: attend_gqa, attend_merge, lin.lm_head)
# then, while time is left, off and all again (the second pair of the alternation).
#
# Here: the binary as DIR/bin/lily-engine(.gz), this script beside it, the Vulkan loader debs in
# .gl (../.library/device/README.md). There, from the repo root:
#   bash .carry/wgpu-decode/wgpu_decode_ab.sh        (carry: .carry/wgpu-decode .gl)
# Logs: $OUT/summary.txt (every run's rows and plan line), $OUT/bench-NAME.log (the last lines of
# each run; prof's holds the per-kernel table).
# Knobs: BUDGET (s, default 530: no run starts that cannot end by then), SKIP (names of runs left
# out), CAP (s a run may take, default 100).
set -u
HERE="$(cd "$(dirname "$0")" && pwd)"
cd "$HERE/../.."
OUT="${OUT:-/tmp/wgpu-decode-ab}"; mkdir -p "$OUT"
BUDGET="${BUDGET:-530}"
CAP="${CAP:-100}"
W=/tmp/decab; mkdir -p "$W"
t0=$(date +%s); at() { echo "$(( $(date +%s) - t0 ))"; }
left() { echo "$(( BUDGET - $(at) ))"; }
LOG=$OUT/summary.txt; say() { echo "$*" | tee -a "$LOG"; }
skipped() { case " ${SKIP:-} " in *" $1 "*) return 0 ;; esac; return 1; }
for f in "$HERE"/bin/*.gz; do [ -f "$f" ] && gunzip -f "$f"; done
chmod +x "$HERE"/bin/* 2>/dev/null
B="$HERE/bin/lily-engine"
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
[ -f "$VK_DRIVER_FILES" ] || unset VK_DRIVER_FILES
export LILY_CACHE_DIR=/tmp/lily-cache
M=/dev/shm/full-mlx
say "== $(date -u) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader) budget ${BUDGET}s"
"$B" --version >> "$LOG" 2>&1
if [ ! -f "$M/config.json" ]; then
  timeout 240 "$B" synth --preset qwen3.6-35b-a3b --format mlx --seed 7 --out $M > "$W/synth.log" 2>&1
  say "synth rc=$? at $(at)s"
fi

# bench NAME ENV...: one sweep under the environment ENV, where CAP seconds are left.
bench() {
  local name=$1; shift
  if skipped "$name"; then say "skip $name"; return; fi
  if [ "$(left)" -lt "$CAP" ]; then say "skip $name: $(left)s left, it needs ${CAP}s"; return; fi
  env "$@" timeout "$CAP" "$B" bench --model $M --device wgpu --prefill 512 --decode-ctx 4K,32K \
    --decode-tokens 64 --repeat 1 > "$W/$name.log" 2>&1
  local rc=$?
  # The bench's rows: prefill (len, tok/s, ms), then decode (ctx, tok/s, ms/tok, GB/tok, floor %).
  say "$name rc=$rc at $(at)s: $(grep -E '^ +[0-9]+[KM]? +[0-9.]+ +[0-9.]+' "$W/$name.log" | tr -s ' ' | tr '\n' '|')"
  grep -h -m1 "wgpu: " "$W/$name.log" \
    | grep -oE "attend_gqa flat reads [a-z]+|decode attention split [a-z]+|lm_head rows [0-9]+|decode attention attend[^)]*\)" \
    | tr '\n' ' ' >> "$LOG"; echo >> "$LOG"
  grep -v XDG_RUNTIME_DIR "$W/$name.log" | tail -80 > "$OUT/bench-$name.log"
}
ON="LILY_WGPU_ATTN_FLAT=1 LILY_WGPU_ATTN_SPLIT=1 LILY_WGPU_LM_ROWS=64"
OFF="LILY_WGPU_ATTN_FLAT=0 LILY_WGPU_ATTN_SPLIT=0 LILY_WGPU_LM_ROWS=0"
bench off $OFF
bench all $ON
bench flat $OFF LILY_WGPU_ATTN_FLAT=1
bench split $OFF LILY_WGPU_ATTN_SPLIT=1
bench lm $OFF LILY_WGPU_LM_ROWS=64
bench prof $ON LILY_PROFILE=1
bench off2 $OFF
bench all2 $ON
grep -h -m1 "wgpu: " "$W/off.log" 2>/dev/null | cut -c1-1500 >> "$LOG"
say "done at $(at)s"
