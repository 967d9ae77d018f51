#!/usr/bin/env bash
# Session 28's second device call (≤ 520 s): the two helpers' A/Bs on one binary (main with both
# switches merged off), then two more rounds of dn_one_sync's A/B (wgpu decode at 4K and 32K) with
# the time left. At most 8 files come back: each script's logs stay in /tmp.
#   bash .carry/s28b/gpu_s28b.sh   (carry: .carry/s28b .gl; timeout_s 540)
# Knobs: SKIP_GRP, SKIP_WMOE, SKIP_DN (non-empty: that part left out), DN_BY (no dn round starts
# past this many seconds, 430).
set -u
H="$(cd "$(dirname "$0")" && pwd)"
R=${OUT:-$PWD/gpu-logs}; mkdir -p "$R"
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
[ -z "${SKIP_GRP:-}" ] && { echo "== s28grp A/B"; OUT=$R bash "$H/gpu_s28grp_ab.sh" > /tmp/s28b-grp.out 2>&1; tail -25 /tmp/s28b-grp.out; }
echo "== s28wmoe A/B at $(el)s" | tee -a "$R/summary.txt"
[ -z "${SKIP_WMOE:-}" ] && { OUT=$R bash "$H/gpu_s28wmoe_ab.sh" > /tmp/s28b-wmoe.out 2>&1; tail -25 /tmp/s28b-wmoe.out; }
if [ -z "${SKIP_DN:-}" ]; then
  cd "$H/../.."
  for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
  [ -f "$VK_DRIVER_FILES" ] || unset VK_DRIVER_FILES
  for v in 0 1 0 1; do
    [ "$(el)" -lt "${DN_BY:-430}" ] || { echo "dn $v: skipped at $(el)s" | tee -a "$R/summary.txt"; continue; }
    LILY_WGPU_DN_ONE_SYNC=$v timeout 40 "$H/bin/lily-engine" bench --model /dev/shm/full-mlx --device wgpu \
      --prefill 512 --decode-ctx 4K,32K --decode-tokens 64 --repeat 1 > /tmp/s28b-dn.log 2>&1
    echo "dn_one_sync=$v rc=$? at $(el)s: $(grep -E '^ +[0-9]+[KM]? +[0-9.]+ +[0-9.]+' /tmp/s28b-dn.log | tr -s ' ' | tr '\n' '|')" | tee -a "$R/summary.txt"
  done
fi
echo "done at $(el)s" | tee -a "$R/summary.txt"
