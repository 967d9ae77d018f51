# The preamble of the one-call device A/B scripts (gpu_scan_ab.sh and the like), sourced
# from their staged folder (.carry/NAME, beside bin/): unpacks the binaries, goes to the
# checkout's root, sets B (binaries), M (the synthetic checkpoint in /dev/shm), OUT, the summary
# S with `say`, the clock `el` and `left` (false past DEADLINE seconds, default $1), prints the
# GPU, and starts synthesising the full checkpoint into $M in the background (its pid: SYN).
HERE="$(cd "$(dirname "${BASH_SOURCE[1]}")" && pwd)"
cd "$HERE/../.."
for f in "$HERE"/bin/*.gz; do [ -f "$f" ] && gunzip -kf "$f"; done
chmod +x "$HERE"/bin/*
B=$HERE/bin; M=/dev/shm/full-mlx; export LILY_CACHE_DIR=/tmp/lily-cache
OUT=${OUT:-$PWD/gpu-logs}; mkdir -p "$OUT"
S=$OUT/summary.txt; say() { echo "$*" | tee -a "$S"; }
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
AB_DEADLINE=${DEADLINE:-$1}
left() { [ "$(el)" -lt "$AB_DEADLINE" ]; }
say "== $(date -u) $(nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader)"
"$B/lily-engine" synth --preset qwen3.6-35b-a3b --format mlx --seed 7 --out "$M" > "$OUT/synth.log" 2>&1 &
SYN=$!
