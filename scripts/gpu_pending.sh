#!/usr/bin/env bash
# Session 8's device call for the bf16-staged wgmma GEMMs (gemm_dense_wgb, gemm_grouped_wgb64,
# to_bf16; issue 12), written without a GPU. One call (≈ 8 minutes):
#   tests    every model and decode test, then the linear kernels' tests with a sync after each
#            launch (wgmma_linears_match_the_bf16_product among them), beside the synthetic
#            checkpoint's synth; then the wgmma test alone (its timings without the syncs)
#   logits   teacher-forced logits of LEN (2,048) positions in one chunk of that size (the chunk
#            takes the wgmma path) with the default (gemm_*_wgb), --no-wgmma-bf16 (gemm_*_wg) and
#            --no-wgmma-gemm (mma.sync): relative L2 and top-1 agreement between them
#   bench    prefill 512, 4K, 32K, 128K on the default, against --no-wgmma-bf16 and LILY_WGB_TOK=256
#   profile  LILY_PROFILE=1 prefill of 4K and 32K (device time per kernel)
# Here: scripts/stage_gpu.sh; carry .carry/cuda and .carry/tokgz (or .carry/tokenizer).
# There: OUT=$OUT/p bash .carry/cuda/gpu_pending.sh   (ONLY="tests logits bench profile" picks parts)
set -u
HERE="$(cd "$(dirname "$0")" && pwd)"
B="$HERE/bin/lily-engine"
OUT="${OUT:-$PWD/gpu-logs}"
LEN="${LEN:-2048}"
mkdir -p "$OUT/run" "$OUT/check"
T0=$(date +%s)
el() { echo $(( $(date +%s) - T0 )); }
say() { echo "$* (at $(el) s)" | tee -a "$OUT/pending.txt"; }
want() { [[ " ${ONLY:-tests logits bench profile} " == *" $1 "* ]]; }
[ -f "$HERE/../tokgz/tokenizer.tgz" ] && [ ! -f "$HERE/../tokenizer/tokenizer.json" ] &&
  tar xzf "$HERE/../tokgz/tokenizer.tgz" -C "$HERE/.."
export SKIP_CHECK=1 SKIP_PROFILE=1 SKIP_PARITY=1 LILY_CACHE_DIR="${LILY_CACHE_DIR:-/tmp/lily-cache}"

if want tests; then
  # The model and decode tests (the forward pass's staging plumbing and the MoE's new order), then
  # the GEMM kernel tests with a sync after each launch, beside synth; the other kernels did not
  # change since call 1 of this session passed gpu_check.sh.
  ( timeout 300 "$HERE/bin/gpu" --ignored --test-threads=1 --nocapture model_ decode_ \
      --skip model_matches_cpu_on_checkpoint_from_env > "$OUT/check/model.log" 2>&1
    say "model tests rc=$?"
    LILY_CUDA_SYNC=1 timeout 120 "$HERE/bin/gpu" --ignored --test-threads=1 --nocapture linears \
      > "$OUT/check/linears.log" 2>&1
    say "linear kernel tests (synced) rc=$?" ) &
  TESTS=$!
fi
OUT=$OUT/run VARIANTS="" bash "$HERE/gpu_session.sh" > "$OUT/run/synth.out" 2>&1
say "synth done"
if want tests; then
  wait $TESTS
  grep -hE "test result|FAILED|panicked" "$OUT/check/model.log" "$OUT/check/linears.log" >> "$OUT/pending.txt"
  timeout 120 "$HERE/bin/gpu" --ignored --test-threads=1 --nocapture wgmma_linears > "$OUT/wgmma.log" 2>&1
  say "wgmma test rc=$?"
  grep -E "^KERNEL|test result|panicked" "$OUT/wgmma.log" >> "$OUT/pending.txt"
fi

M=/dev/shm/full-mlx; [ -f "$M/config.json" ] || M=/tmp/full-mlx
if want logits; then
  W=/tmp/pending-logits; mkdir -p "$W"
  for v in wgb wg mma; do
    case $v in wgb) f=() ;; wg) f=(--no-wgmma-bf16) ;; mma) f=(--no-wgmma-gemm) ;; esac
    timeout 120 "$B" score --model "$M" --len "$LEN" --piece "$LEN" --device cuda --out "$W/$v" "${f[@]}" \
      > "$OUT/score-$v.log" 2>&1
    say "score $v rc=$?"
  done
  python3 - "$W" "$LEN" >> "$OUT/pending.txt" 2>&1 <<'PY'
import sys, numpy as np
w, n = sys.argv[1], int(sys.argv[2])
L = {v: np.memmap(f"{w}/{v}.f32", dtype=np.float32, mode="r").reshape(n, -1) for v in ("wgb", "wg", "mma")}
for a, b in (("wgb", "mma"), ("wg", "mma"), ("wgb", "wg")):
    x, y = L[a], L[b]
    rel, top = [], 0
    for i in range(0, n, 256):
        xa, ya = np.asarray(x[i:i + 256], np.float64), np.asarray(y[i:i + 256], np.float64)
        rel += list(np.linalg.norm(xa - ya, axis=1) / np.linalg.norm(ya, axis=1))
        top += int((xa.argmax(1) == ya.argmax(1)).sum())
    rel = np.array(rel)
    print(f"LOGITS {a} vs {b} over {n} positions (one chunk of {n}): rel L2 median {np.median(rel):.3e}, "
          f"p99 {np.quantile(rel, 0.99):.3e}, max {rel.max():.3e}; top-1 {top}/{n}")
PY
  rm -rf "$W"
  say "logits done"
fi

if want bench; then
  # The one sweep on the default (twice), the wgmma kernels of session 7 (--no-wgmma-bf16) and the
  # 256-token dense blocks (LILY_WGB_TOK=256, twice), alternated.
  for v in default wgb256 no-wgmma-bf16 default wgb256; do
    f=(); e=(); p=4K,32K,128K
    case $v in default) p=512,4K,32K,128K ;; wgb256) e=(LILY_WGB_TOK=256) ;; *) f=(--$v) ;; esac
    echo "===== $v" >> "$OUT/bench.log"
    env "${e[@]}" timeout 120 "$B" bench --model "$M" --device cuda --prefill "$p" --decode-ctx 256 \
      --decode-tokens 32 --repeat 1 "${f[@]}" 2>&1 | grep -vE "INFO|^\s*$" >> "$OUT/bench.log"
  done
  say "bench done"
fi

if want profile && [ "$(el)" -lt 480 ]; then
  LILY_PROFILE=1 timeout 100 "$B" bench --model "$M" --device cuda --prefill 4K,32K --decode-ctx 256 \
    --decode-tokens 4 --repeat 1 > "$OUT/profile.log" 2>&1
  say "profile rc=$?"
fi
