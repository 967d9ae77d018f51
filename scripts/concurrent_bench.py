#!/usr/bin/env python3
"""Several conversations at once through `lily-engine serve` (issue 32's measurement): N clients
each stream a greedy completion of a fresh P-token prompt (no shared prefix), all sent at the same
moment, for each N in --clients. Reports per N:

- each client's time to first token (from sending to its first streamed token),
- the steady aggregate decode rate: tokens streamed by all clients while every one of them is past
  its first token and none has finished, divided by that window (the issue's definition),
- whether every client's tokens equal the same prompt's tokens asked alone (greedy answers must not
  depend on what else runs; --check).

    python3 scripts/concurrent_bench.py --model DIR --device cuda --prompt-tokens 1024 \
        --max-tokens 256 --clients 1,4,8 [--serve-arg=--max-batch=8 ...] [--check]

The server is started with `serve_bench.engine_binary()` ($LILY_ENGINE_BIN, else target/release).
"""

import argparse
import json
import socket
import subprocess
import sys
import threading
import time

import httpx

from serve_bench import ServerLog, engine_binary, fresh_prompt, wait_ready


def stream(url, prompt, max_tokens, out, start_at):
    """Streams one greedy completion; `out` gets the send time, each token's arrival time and the
    token texts."""
    body = {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True}
    while time.perf_counter() < start_at:
        pass
    out["sent"] = time.perf_counter()
    out["times"], out["texts"] = [], []
    with httpx.Client(timeout=httpx.Timeout(10.0, read=None)) as http:
        with http.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                out["error"] = f"HTTP {r.status_code}: {r.read()[:300]!r}"
                return
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for c in chunk.get("choices") or []:
                    if c.get("text"):
                        out["times"].append(time.perf_counter())
                        out["texts"].append(c["text"])


def run(url, prompts, max_tokens):
    outs = [{} for _ in prompts]
    start_at = time.perf_counter() + 0.2
    threads = [threading.Thread(target=stream, args=(url, p, max_tokens, o, start_at)) for p, o in zip(prompts, outs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outs


def report(n, outs):
    errors = [o["error"] for o in outs if "error" in o]
    if errors:
        return f"{n} clients: {len(errors)} failed: {errors[0]}"
    ttft = [o["times"][0] - o["sent"] for o in outs]
    lo = max(o["times"][0] for o in outs)   # every client past its first token
    hi = min(o["times"][-1] for o in outs)  # none finished
    steady = sum(sum(1 for t in o["times"] if lo < t <= hi) for o in outs)
    rate = steady / (hi - lo) if hi > lo else float("nan")
    total = sum(len(o["times"]) for o in outs)
    span = max(o["times"][-1] for o in outs) - min(o["sent"] for o in outs)
    return (f"{n} clients: steady aggregate {rate:.1f} tok/s over {hi - lo:.2f} s; "
            f"ttft min {min(ttft):.3f} / max {max(ttft):.3f} s; {total} chunks in {span:.2f} s "
            f"({total / span:.1f} tok/s end to end)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--serve-arg", action="append", default=[], help="one more `serve` argument (repeatable)")
    ap.add_argument("--check", action="store_true", help="compare each answer with the prompt's answer alone")
    ap.add_argument("--start-timeout", type=float, default=300)
    a = ap.parse_args()
    counts = [int(x) for x in a.clients.split(",")]

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [engine_binary(), "serve", "--model", a.model, "--port", str(port), "--device", a.device] + a.serve_arg
    log = ServerLog()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.file)
    try:
        if not wait_ready(url, proc, log, a.start_timeout):
            return 1
        print("server: " + " ".join(cmd[1:]), flush=True)
        run(url, [fresh_prompt(64, "warm")], 8)  # warm-up: graphs, caches
        alone = {}
        for n in counts:
            prompts = [fresh_prompt(a.prompt_tokens, f"c{n}-{i}") for i in range(n)]
            outs = run(url, prompts, a.max_tokens)
            line = report(n, outs)
            if a.check and "failed" not in line:
                same = 0
                for i, (p, o) in enumerate(zip(prompts, outs)):
                    key = (n, i)
                    alone[key] = run(url, [p], a.max_tokens)[0]
                    same += alone[key].get("texts") == o["texts"]
                line += f"; answers equal to alone: {same}/{n}"
            print(line, flush=True)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
        # What the server said beyond its request lines: warnings, errors, graph captures.
        said = [l for l in log.path.read_text(errors="replace").splitlines()
                if any(w in l for w in ("WARN", "ERROR", "graph"))]
        for l in said[:20]:
            print("server log: " + l, flush=True)
        if len(said) > 20:
            print(f"server log: … {len(said) - 20} more such lines", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
