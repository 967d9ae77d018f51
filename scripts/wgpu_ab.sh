#!/usr/bin/env bash
# One device call for the wgpu decode work of session 11 (issues 28, 29; docs/perf-notes.md
# "session 11, branch wgpu-speed"): wgpu through Vulkan on the full-size synthetic checkpoint,
# decode at 4K, one binary per step, then per-kernel profiles.
#
# Here: the binaries as DIR/bin/lily-engine-NAME(.gz) for NAME in $VARIANTS (old = main 064c7fc,
# main = 0979a68, fix = b9a7d29, head = the branch's last kernel commit 67964b3; the steps between,
# if staged: recur = 7ed17c4, route = a59e4c3, conv = 041f4a1, prep = 5f8bb0b: see the notes),
# this script beside them, the Vulkan loader debs in .gl (../.library/device/README.md). There:
#   bash .carry/wgpu-speed/wgpu_ab.sh        (carry: .carry/wgpu-speed .gl)
# Logs: $OUT/summary.txt (the table), $OUT/prof-NAME.log (LILY_PROFILE=1 runs).
# Knobs: VARIANTS, PROFILE (names profiled), DEADLINE (s: no new run starts after it).
set -u
HERE="$(cd "$(dirname "$0")" && pwd)"
cd "$HERE/../.."
OUT="${OUT:-/tmp/wgpu-ab}"; mkdir -p "$OUT"
VARIANTS="${VARIANTS:-old main fix head}"
PROFILE="${PROFILE:-old main head}"
t0=$(date +%s); at() { echo "$(( $(date +%s) - t0 ))"; }
LOG=$OUT/summary.txt; say() { echo "$*" | tee -a "$LOG"; }
for f in "$HERE"/bin/*.gz; do [ -f "$f" ] && gunzip -f "$f"; done
chmod +x "$HERE"/bin/* 2>/dev/null
for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
[ -f "$VK_DRIVER_FILES" ] || unset VK_DRIVER_FILES
export LILY_CACHE_DIR=/tmp/lily-cache
M=/dev/shm/full-mlx
last=$(for v in $VARIANTS; do echo $v; done | tail -1)
say "== $(date -u) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
timeout 240 "$HERE/bin/lily-engine-$last" synth --preset qwen3.6-35b-a3b --format mlx --seed 7 --out $M > /tmp/synth.log 2>&1
say "synth rc=$? at $(at)s"
B="--model $M --device wgpu --prefill 4K --decode-ctx 4K --decode-tokens 64 --repeat 1"
run() { # variant tag env... (extra bench args in $EXTRA)
  local v=$1 tag=$2; shift 2
  if [ "$(at)" -gt "${DEADLINE:-420}" ]; then say "skip $v $tag: past the deadline"; return; fi
  env "$@" timeout 90 "$HERE/bin/lily-engine-$v" bench $B ${EXTRA:-} > "/tmp/$v-$tag.log" 2>&1
  # The bench's rows: prefill (len, tok/s, ms), then decode (ctx, tok/s, ms/tok, GB/tok, floor %).
  say "$v $tag rc=$? at $(at)s: $(grep -E '^ +[0-9]+[KM]? +[0-9.]+ ' /tmp/$v-$tag.log | tr -s ' ' | tr '\n' '|')"
}
for v in $VARIANTS; do run $v plain LILY_X=0; done
for v in $PROFILE; do run $v prof LILY_PROFILE=1; cp "/tmp/$v-prof.log" "$OUT/prof-$v.log"; done
run $last wgred LILY_WGPU_SUBGROUPS=0
EXTRA="--decode-ctx 32K" run $last ctx32k LILY_X=0
grep -h -m1 "wgpu: " "/tmp/$last-plain.log" | cut -c1-1200 >> "$LOG"
say "done at $(at)s"
