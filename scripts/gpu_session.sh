#!/usr/bin/env bash
# One device call for a change to lily-cuda: the kernel and model tests of this build
# (gpu_check.sh), then, on the full-size synthetic checkpoint, the bench of a baseline binary and
# of this build with and without the fused decode path (alternated, same machine, same run), the
# per-kernel decode profile at 4K, and CUDA-vs-CPU parity over teacher-forced positions.
#
# Here: scripts/stage_gpu.sh (this build into .carry/cuda), a baseline lily-engine in
# .carry/old/ (e.g. main's, built from a clean worktree). There: bash .carry/cuda/gpu_session.sh.
# Knobs: PREFILL, DECODE (bench lists), REPEAT, ROUNDS (alternations), VARIANTS (old old-pipeprep
# (session 6's binary with the switches it had off) new-unfused
# new-nopdl new-late
# new-noattn new-noprep new-nowgmma new-nopipe new-session6 (session 6's defaults:
# none of the three) new-sampled new-sampledwalk new-sampled1 new-sampled-nopipe new;
# LILY_STEP_TIMING=1 on any variant logs the device's wait for the host), SERVED (old new:
# served decode at 4K), SERVED_TTFT (prompt
# lengths, e.g. "4096 131072": time to first token through `serve` with its default settings beside
# the bench's prefill of the same lengths; TTFT_REPEAT), PROFILE_CTX (contexts of the per-kernel decode
# profile), AGENT_TRACE ("CONTEXT TURNS": scripts/agent_trace.py, reuse on and off), CONSTRAIN=1
# (served chat at 4K with and without a json_schema constraint: the token-mask cost), WGPU (bench
# lists "PREFILL DECODE" for `--device wgpu` through Vulkan; needs .gl carried, see below),
# SELFTEST=1 (`lily-engine selftest`), SKIP_CHECK=1, SKIP_PROFILE=1, SKIP_PARITY=1.
# VARIANTS="" runs no bench.
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
OUT="${OUT:-$PWD/gpu-logs}"
mkdir -p "$OUT"
NEW="$HERE/bin/lily-engine"
OLD="${OLD:-$HERE/../old/lily-engine}"
# The synthetic checkpoint: in /dev/shm when it has room (no disk writes; synth itself is CPU-bound,
# ≈ 135–165 s either way), else /tmp.
M=/tmp/full-mlx
[ "$(df --output=avail -B1G /dev/shm 2>/dev/null | tail -1)" -ge 40 ] 2>/dev/null && M=/dev/shm/full-mlx
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
  for v in ${VARIANTS-old new-unfused new}; do
    case $v in
      old) cmd=("$OLD" bench "${B[@]}") ;;
      old-pipeprep) cmd=("$OLD" bench "${B[@]}" --pipelined-decode --fused-attn-prep) ;;
      new-unfused) cmd=("$NEW" bench "${B[@]}" --no-fused-decode) ;;
      new-nopdl) cmd=("$NEW" bench "${B[@]}" --no-dependent-launch) ;;
      new-late) cmd=("$NEW" bench "${B[@]}" --no-early-trigger) ;;
      new-noattn) cmd=("$NEW" bench "${B[@]}" --no-mma-attention) ;;
      new-noprep) cmd=("$NEW" bench "${B[@]}" --no-fused-attn-prep) ;;
      new-nowgmma) cmd=("$NEW" bench "${B[@]}" --no-wgmma-gemm) ;;
      new-nopipe) cmd=("$NEW" bench "${B[@]}" --no-pipelined-decode) ;;
      new-session6) cmd=("$NEW" bench "${B[@]}" --no-pipelined-decode --no-fused-attn-prep --no-wgmma-gemm) ;;
      new-sampled-nopipe) cmd=("$NEW" bench "${B[@]}" --temperature 0.6 --top-k 20 --top-p 0.95 --no-pipelined-decode) ;;
      new-sampled1) cmd=("$NEW" bench "${B[@]}" --temperature 0.6 --top-k 20 --top-p 0.95 --one-block-sampling) ;;
      new-sampled) cmd=("$NEW" bench "${B[@]}" --temperature 0.6 --top-k 20 --top-p 0.95) ;;
      new-sampledwalk) cmd=("$NEW" bench "${B[@]}" --temperature 0.6 --top-k 20 --top-p 0.95 --no-warp-scan-sampling) ;;
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
    --prompt-tokens 4096 --max-tokens 256 --repeat 3 --ttft-repeat 3 --extra "${SERVED_EXTRA:-{\}}" >> "$OUT/served.log" 2>&1
  rc=$?
  say "served $v ${SERVED_EXTRA:-} rc=$rc: $(grep -E '^(completions|ttft: )' "$OUT/served.log" | tail -2 | tr '\n' ' ')"
  grep -E '^ttft run ' "$OUT/served.log" | tail -"${TTFT_REPEAT:-3}" | cut -c1-600 >> "$LOG"
done

# SERVED_TTFT="4096 131072": issue 12's served target. The bench's prefill of these lengths, then
# one `serve` of this build with its default settings (no --ctx-size: the model's whole context
# when the device holds it) timing the first token of TTFT_REPEAT (3) prompts of each length that
# share no prefix, each with the engine's timing line (scripts/serve_bench.py --ttft-only), then
# served / bench per length (the issue asks <= 1.10).
if [ -n "${SERVED_TTFT:-}" ]; then
  lens=$(echo $SERVED_TTFT | tr ' ' ',')
  timeout "${TTFT_BENCH_TIMEOUT:-300}" "$NEW" bench --model "$M" --device cuda --prefill "$lens" --decode-ctx 256 \
    --decode-tokens 4 --repeat "${TTFT_REPEAT:-3}" > "$OUT/ttft-bench.log" 2>&1
  say "ttft bench prefill $lens rc=$?"
  LILY_ENGINE_BIN="$NEW" timeout "${TTFT_SERVED_TIMEOUT:-450}" python3 scripts/serve_bench.py --model "$M" --device cuda \
    --ctx-size 0 --ttft-only --ttft-tokens "$lens" --ttft-repeat "${TTFT_REPEAT:-3}" --extra "${SERVED_EXTRA:-{\}}" \
    > "$OUT/ttft-served.log" 2>&1
  say "ttft served rc=$?"
  grep -E "^(server|ttft)" "$OUT/ttft-served.log" | cut -c1-600 | tee -a "$LOG"
  python3 - "$OUT/ttft-bench.log" "$OUT/ttft-served.log" <<'PY' | tee -a "$LOG"
import re, sys
bench, served = (open(p, errors="replace").read() for p in sys.argv[1:3])
# The bench's prefill rows: "len tok/s ms" (the decode rows have five columns).
rows = {int(m[1]): float(m[3]) / 1e3 for m in re.finditer(r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s*$", bench, re.M)}
for m in re.finditer(r"^ttft: (\d+) prompt tokens, median of \d+: ([\d.]+) s", served, re.M):
    n, t = int(m[1]), float(m[2])
    b = rows.get(n)
    print(f"SERVED_TTFT {n}: served {t:.3f} s, bench prefill {b:.3f} s: {t / b:.3f}x" if b else
          f"SERVED_TTFT {n}: served {t:.3f} s, no bench row")
PY
fi

# CONSTRAIN=1: the same served decode through /v1/chat/completions, free then constrained to a
# json_schema (scripts/serve_bench.py --constrain json; issue 15's mask cost).
# CONSTRAIN=json: the constrained run only.
if [ "${CONSTRAIN:-0}" != 0 ]; then
  runs=("" "--constrain json"); [ "$CONSTRAIN" = json ] && runs=("--constrain json")
  for c in "${runs[@]}"; do
    LILY_ENGINE_BIN="$NEW" timeout 150 python3 scripts/serve_bench.py --model "$M" --device cuda --endpoint chat \
      --prompt-tokens 4096 --max-tokens 256 --repeat 3 $c >> "$OUT/constrain.log" 2>&1
    say "served chat ${c:-free} rc=$?: $(tail -1 "$OUT/constrain.log")"
  done
fi

# WGPU="PREFILL DECODE": the wgpu backend on this GPU through Vulkan (issue 13). The Vulkan loader
# is not installed on the device machine: carry .gl (Debian's libvulkan1 and friends, see
# ../.library/device/README.md); it is unpacked here. WGPU_BIN: another lily-engine for this bench
# (e.g. a wgpu branch's build in .carry/wgpu/, gzipped or not), WGPU_PROFILE=1: its per-kernel profile.
# WGPU_ENV2="NAME=VALUE ...", WGPU_ENV3: the same bench again with those variables set (A/B/C of
# wgpu experiments in one call; logs wgpu2.log, wgpu3.log, their tails in the session log).
if [ -n "${WGPU:-}" ] || [ "${SELFTEST:-0}" = 1 ]; then
  if ! ldconfig -p | grep -q libvulkan && [ -d .gl ]; then
    for f in .gl/*.deb; do dpkg -x "$f" /; done; ldconfig
  fi
  [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ] &&
    export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
fi
if [ "${SELFTEST:-0}" = 1 ]; then
  rm -rf /tmp/lily-tiny; "$NEW" synth --preset tiny --seed 3 --out /tmp/lily-tiny > /dev/null 2>&1
  timeout 120 "$NEW" selftest --model /tmp/lily-tiny > "$OUT/selftest.log" 2>&1
  say "selftest rc=$?"; tail -25 "$OUT/selftest.log" >> "$LOG"
fi
if [ -n "${WGPU:-}" ]; then
  read -r wp wd <<< "$WGPU"
  WB="${WGPU_BIN:-$NEW}"
  [ -f "$WB.gz" ] && [ ! -x "$WB" ] && gunzip -kf "$WB.gz" && chmod +x "$WB"
  [ -x "$WB" ] || WB="$NEW"
  say "wgpu bench binary: $WB"
  LILY_PROFILE="${WGPU_PROFILE:-0}" timeout "${WGPU_TIMEOUT:-240}" "$WB" bench --model "$M" --device wgpu --prefill "$wp" --decode-ctx "$wd" \
    --decode-tokens 64 --repeat 1 > "$OUT/wgpu.log" 2>&1
  say "wgpu bench rc=$?"; grep -v "^\s*$" "$OUT/wgpu.log" | tail -20 >> "$LOG"
  # WGPU_ENV2, WGPU_ENV3: the same bench again with those variables set (logs wgpu2/3.log).
  for n in 2 3; do
    envs=$(eval echo "\${WGPU_ENV$n:-}")
    [ -n "$envs" ] || continue
    say "wgpu bench $n with: $envs"
    # shellcheck disable=SC2086  # the assignments are meant to split on spaces
    env $envs LILY_PROFILE="${WGPU_PROFILE:-0}" timeout "${WGPU_TIMEOUT:-240}" "$WB" bench --model "$M" \
      --device wgpu --prefill "$wp" --decode-ctx "$wd" --decode-tokens 64 --repeat 1 > "$OUT/wgpu$n.log" 2>&1
    say "wgpu bench $n rc=$?"; grep -v "^\s*$" "$OUT/wgpu$n.log" | tail -20 >> "$LOG"
  done
fi

# NSYS=CTX: Nsight Systems (when the machine has it) over 64 decode steps at context CTX, the CUDA
# graph traced per kernel node: each kernel's real in-graph duration (nsys-kern.csv).
if [ -n "${NSYS:-}" ]; then
  NS=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems*/bin/nsys 2>/dev/null | head -1)
  if [ -n "$NS" ]; then
    timeout 200 "$NS" profile --cuda-graph-trace=node -o /tmp/lily-nsys -f true "$NEW" bench --model "$M" \
      --device cuda --prefill 16 --decode-ctx "$NSYS" --decode-tokens 64 --repeat 1 > /tmp/nsys.log 2>&1
    say "nsys rc=$?"
    "$NS" stats --report cuda_gpu_kern_sum --format csv /tmp/lily-nsys.nsys-rep > "$OUT/nsys-kern.csv" 2>>/tmp/nsys.log
    tail -5 /tmp/nsys.log >> "$LOG"
  else
    say "no nsys here: $(ls /usr/local/cuda*/bin 2>/dev/null | tr '\n' ' ')"
  fi
fi

# NCU=CTX: Nsight Compute over the first decode steps at context CTX (each kernel node of the graph
# profiled alone, caches flushed, clocks left alone): duration, DRAM bytes and throughput per
# launch (ncu.csv, raw page; aggregate with scripts/ncu_summary.py). NCU_ARGS: more bench flags
# (e.g. --no-mma-attention), NCU_OUT: another file name.
if [ -n "${NCU:-}" ]; then
  NC=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  timeout "${NCU_TIMEOUT:-150}" "$NC" --graph-profiling node --clock-control none --csv --page raw \
    --kernel-name regex:'^(dec_|attn_split|attn_qk|lm_|sample|argmax|advance)' --launch-count "${NCU_COUNT:-700}" \
    --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__registers_per_thread \
    "$NEW" bench --model "$M" --device cuda --prefill 16 --decode-ctx "$NCU" --decode-tokens 2 --repeat 1 ${NCU_ARGS:-} \
    > "$OUT/${NCU_OUT:-ncu.csv}" 2> /tmp/ncu.err
  say "ncu rc=$?: $(tail -2 /tmp/ncu.err | tr '\n' ' ')"
fi

# AGENT_TRACE="CONTEXT TURNS": scripts/agent_trace.py through a started `serve` of this build, prefix
# reuse on then off (time to first token and cached tokens per turn; issue 14).
if [ -n "${AGENT_TRACE:-}" ]; then
  read -r trace_ctx trace_turns <<< "$AGENT_TRACE"
  timeout 300 python3 scripts/agent_trace.py --engine "$NEW" --model "$M" --reuse both \
    --context "$trace_ctx" --turns "$trace_turns" --json "$OUT/trace.json" \
    -- --device cuda >> "$OUT/trace.log" 2>&1
  say "agent trace $AGENT_TRACE rc=$?"
fi

# NCU_FULL="REGEX": Nsight Compute's full set (stall reasons, memory chart, occupancy) on one launch
# of each kernel matching REGEX at decode context 4K or NCU_FULL_CTX (ncu-full.txt).
if [ -n "${NCU_FULL:-}" ]; then
  NC=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  timeout "${NCU_FULL_TIMEOUT:-120}" "$NC" --graph-profiling node --clock-control none --set full \
    --kernel-name regex:"$NCU_FULL" --launch-skip "${NCU_FULL_SKIP:-60}" --launch-count "${NCU_FULL_COUNT:-2}" \
    "$NEW" bench --model "$M" --device cuda --prefill 16 --decode-ctx "${NCU_FULL_CTX:-4096}" --decode-tokens 2 --repeat 1 \
    > "$OUT/ncu-full.txt" 2>&1
  say "ncu full rc=$?"
fi

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
