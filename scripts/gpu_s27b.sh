#!/usr/bin/env bash
# Session 27, call b (≤ 9.5 minutes): gpu_s27a.sh's chunk and shipping-configuration tests with
# chunk 16,384 benched, then branch s27wdec's A/B (gpu_s27wdec_ab.sh), one after the other; each
# script keeps its own clock. Staged by scripts/stage_gpu.sh, both scripts copied beside:
#   bash .carry/s27b/gpu_s27b.sh      (carry: .carry/s27b .gl; timeout_s 580)
set -u
H="$(cd "$(dirname "$0")" && pwd)"
CHUNKS=16384 DEADLINE=300 HARD=330 bash "$H/gpu_s27a.sh"
bash "$H/gpu_s27wdec_ab.sh"
