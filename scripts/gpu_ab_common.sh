# The preamble of the one-call device A/B scripts (gpu_scan_ab.sh and the like), sourced
# from their staged folder (.carry/NAME, beside bin/): unpacks the binaries, goes to the
# checkout's root, sets B (binaries), M (the synthetic checkpoint in /dev/shm), OUT, the summary
# S with `say`, the clock `el` and `left` (false past DEADLINE seconds, default $1), prints the
# GPU, and starts synthesising the full checkpoint into $M in the background (its pid: SYN).
# With AB_LAYERS set: a checkpoint of that many layers, with the tokenizer of .carry/tokenizer
# (carried beside; what `serve` needs), in /dev/shm/lN; AB_TOKENIZER=1 puts that tokenizer into
# the full checkpoint too. AB_HARD (seconds): no run's timeout reaches past it (`cap`).
HERE="$(cd "$(dirname "${BASH_SOURCE[1]}")" && pwd)"
cd "$HERE/../.."
AB_TOK=${AB_LAYERS:-${AB_TOKENIZER:-}}
for f in "$HERE"/bin/*.gz ${AB_TOK:+"$HERE"/../tokenizer/*.gz}; do [ -f "$f" ] && gunzip -kf "$f"; done
chmod +x "$HERE"/bin/*
B=$HERE/bin; M=/dev/shm/${AB_LAYERS:+l$AB_LAYERS}; M=${M%/}; [ "$M" = /dev/shm ] && M=/dev/shm/full-mlx
export LILY_CACHE_DIR=/tmp/lily-cache
OUT=${OUT:-$PWD/gpu-logs}; mkdir -p "$OUT"
S=$OUT/summary.txt; say() { echo "$*" | tee -a "$S"; }
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
AB_DEADLINE=${DEADLINE:-$1}
left() { [ "$(el)" -lt "$AB_DEADLINE" ]; }
# cap S: S seconds, or fewer where AB_HARD would pass first (at least 1).
cap() { local s=$1; [ -n "${AB_HARD:-}" ] && [ $((AB_HARD - $(el))) -lt "$s" ] && s=$((AB_HARD - $(el))); [ "$s" -lt 1 ] && s=1; echo "$s"; }
say "== $(date -u) $(nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader)"
# ab_synth DIR LAYERS TOK LOG: synthesise the checkpoint (LAYERS layers, or all where empty; with
# .carry/tokenizer where TOK is non-empty) into DIR in the background, its pid in AB_PID. A warm
# machine keeps /dev/shm between calls: a checkpoint an earlier call finished (its marker names
# the binary's checksum and the layers) is reused instead of synthesised again.
ab_synth() {
  local dir=$1 layers=$2 tok=$3 log=$4
  local key; key="$(md5sum < "$B/lily-engine" | cut -c1-16) ${layers:-full}"
  if [ -f "$dir/.lily-synth-done" ] && [ "$(cat "$dir/.lily-synth-done")" = "$key" ] \
    && { [ -z "$tok" ] || [ -f "$dir/tokenizer.json" ]; }; then
    echo "reusing $dir (synthesised by an earlier call)" > "$log"; sleep 0 &
  else
    rm -f "$dir/.lily-synth-done"
    { "$B/lily-engine" synth --preset qwen3.6-35b-a3b --format mlx --seed 7 --out "$dir" \
        ${layers:+--layers "$layers"} ${tok:+--tokenizer "$HERE/../tokenizer"} \
        && echo "$key" > "$dir/.lily-synth-done"; } > "$log" 2>&1 &
  fi
  AB_PID=$!
}
ab_synth "$M" "${AB_LAYERS:-}" "$AB_TOK" "$OUT/synth.log"; SYN=$AB_PID

# wgpu_setup: the Vulkan loader from the debs in .gl (../.library/device/README.md), the NVIDIA
# ICD where the machine has it, and the binary's version into the summary.
wgpu_setup() {
  for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
  export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
  [ -f "$VK_DRIVER_FILES" ] || unset VK_DRIVER_FILES
  "$B/lily-engine" --version >> "$S" 2>&1
}

# skipped NAME: whether SKIP (names of runs left out) holds NAME.
skipped() { case " ${SKIP:-} " in *" $1 "*) return 0 ;; esac; return 1; }

# wgpu_bench NAME CTX KEYS ENV...: one wgpu sweep of the full model, `bench --prefill PREFILL
# (512) --decode-ctx CTX --decode-tokens 64`, under the environment ENV (timeout BENCH_S, 100 s),
# unless SKIP names it or the deadline passed. The summary gets the bench's rows and the parts of
# the plan line that match the extended regex KEYS (the switches' labels); $OUT/bench-NAME.log the
# run's last 80 lines (a profile's tables).
wgpu_bench() {
  local name=$1 ctx=$2 keys=$3; shift 3
  if skipped "$name"; then say "skip $name"; return 1; fi
  if ! left; then say "skip $name: past the deadline at $(el)s"; return 1; fi
  env "$@" timeout "$(cap "${BENCH_S:-100}")" "$B/lily-engine" bench --model $M --device wgpu --prefill "${PREFILL:-512}" \
    --decode-ctx "$ctx" --decode-tokens 64 --repeat 1 > "$OUT/full-$name.log" 2>&1
  local rc=$?
  # The bench's rows: prefill (len, tok/s, ms), then decode (ctx, tok/s, ms/tok, GB/tok, floor %).
  say "$name rc=$rc at $(el)s: $(grep -E '^ +[0-9]+[KM]? +[0-9.]+ +[0-9.]+' "$OUT/full-$name.log" | tr -s ' ' | tr '\n' '|')"
  grep -h -m1 "wgpu: " "$OUT/full-$name.log" | grep -oE "$keys" | tr '\n' ' ' >> "$S"; echo >> "$S"
  grep -v XDG_RUNTIME_DIR "$OUT/full-$name.log" | tail -80 > "$OUT/bench-$name.log"
}

# wgpu_bench_rows NAME CTX KEYS ROWS ENV...: wgpu_bench, then the rows of the per-kernel profile
# (a LILY_PROFILE=1 run's; decode's table comes last) whose labels match the extended regex ROWS
# (one row a name) into the summary.
wgpu_bench_rows() {
  local name=$1 ctx=$2 keys=$3 rows=$4; shift 4
  wgpu_bench "$name" "$ctx" "$keys" "$@" || return
  grep -E "^  ($rows) " "$OUT/bench-$name.log" | tr -s " " \
    | tail -"$(echo "$rows" | tr '|' '\n' | wc -l)" >> "$S"
}

# wgpu_synth4: a 4-layer model of the full widths (where decode takes the full model's kernels;
# the small presets' widths do not) synthesised into M4 in the background (its pid: SYN4).
wgpu_synth4() {
  M4=/dev/shm/full4-mlx
  "$B/lily-engine" synth --preset qwen3.6-35b-a3b --layers 4 --format mlx --seed 11 --out "$M4" \
    > "$OUT/synth4.log" 2>&1 &
  SYN4=$!
}

# wgpu_selftest NAME ENV...: `selftest` (wgpu, and CUDA, against the CPU) on wgpu_synth4's model
# under the environment ENV, unless SKIP names it or the deadline passed; its lines on the
# device, agreement and greedy tokens into the summary, the whole into $OUT/NAME.log.
wgpu_selftest() {
  local name=$1; shift
  if skipped "$name"; then say "skip $name"; return; fi
  if ! left; then say "skip $name: past the deadline at $(el)s"; return; fi
  wait "$SYN4" 2>/dev/null
  env "$@" timeout "$(cap 120)" "$B/lily-engine" selftest --model "$M4" --prompt-len 32 --steps 16 \
    --bench-prefill 32 --bench-decode 8 > "$OUT/$name.log" 2>&1
  say "$name rc=$? at $(el)s: $(grep -iE '^device:|agreement|greedy|FAIL|error' "$OUT/$name.log" | grep -v XDG | head -12 | tr -s ' ' | tr '\n' '|' | cut -c1-900)"
}
