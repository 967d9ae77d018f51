#!/usr/bin/env bash
# Session 29, the second call (≤ 460 s): the A/Bs of branches s29dn (CUDA `dn_rows_loop`, issue 32)
# and s29wout (wgpu `out_lean`, issue 29), both merged off, one staging of main; between them the
# served clients (concurrent_bench.py, 1 / 4 / 8 clients of a 1,024-token prompt, 256 greedy tokens)
# with `dn_rows_loop` on, for issue 32's served figure should it win.
#   bash .carry/NAME/gpu_s29c.sh   (carry: .carry/NAME .carry/tokenizer .gl; timeout_s 480)
# gpu_s29dn_ab.sh and gpu_s29wout_ab.sh are copied beside it; summaries in $OUT/summary.txt.
H="$(cd "$(dirname "$0")" && pwd)"
AB_TOKENIZER=1 bash "$H/gpu_s29dn_ab.sh"
S=${OUT:-$PWD/gpu-logs}/summary.txt
LILY_DN_ROWS_LOOP=1 PYTHONUNBUFFERED=1 LILY_ENGINE_BIN="$H/bin/lily-engine" timeout 60 \
  python3 "$H/concurrent_bench.py" --model /dev/shm/full-mlx --device cuda --prompt-tokens 1024 \
  --max-tokens 256 --clients 1,4,8 > /tmp/conc-dn-on.log 2>&1
echo "served 1,4,8 clients with dn_rows_loop on rc=$?" | tee -a "$S"
grep -E "clients:|rror" /tmp/conc-dn-on.log | cut -c1-220 | tee -a "$S"
bash "$H/gpu_s29wout_ab.sh"
