#!/usr/bin/env python3
"""Served decode speed: streams greedy completions from a `lily-engine serve` and reports tokens/s as
a client sees them (from the second token on), next to the engine's own decode time and the part
of it spent handing tokens to the request (`lily_decode_sink_seconds_total`).

    python3 scripts/serve_bench.py --model scripted:/tmp/script.json [--endpoint completions|chat]
    python3 scripts/serve_bench.py --model /path/to/model --device cuda --prompt-tokens 4096

`--script-spin-us N` writes a scripted model (cheap tokens, N µs of busy-wait per token: a stand-in
for a device step) and serves that; `--url` measures a server that is already running. Scripted
models need a lily-engine built with `--features scripted` (scripts/test.sh builds one).

`--constrain json` (chat) asks for a `json_schema` answer with thinking off, so every decode step
computes a grammar mask; the report then gives the mask time per step and its share of the decode
step (`lily_constraint_mask_seconds_total`):

    python3 scripts/serve_bench.py --model DIR --device cuda --endpoint chat --prompt-tokens 4096 --constrain json

`--ttft-repeat N` then times the first token of N prompts of `--prompt-tokens` ids that share no
prefix (nothing to reuse), and prints, beside the client's time, the server's own timing line for
each (the engine logs one per request: preparation, queue, sequence, each prefill call, snapshots,
the first pick; read from the server's log, so only for a server this script starts). With
`--ttft-only` the decode measurement is skipped; `--ctx-size 0` serves with the server's default
context (on a GPU the model's maximum when memory allows), as the issue's served target asks:

    python3 scripts/serve_bench.py --model DIR --device cuda --prompt-tokens 131072 --ctx-size 0 \
        --ttft-only --ttft-repeat 3

`--ttft-tokens 4096,131072` (with `--ttft-only`) measures several lengths with one server, each
after two warm-up requests of its length.
"""

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = (REPO / ".." / "shared" / "qwen3.6-tokenizer").resolve()


def tokenizer_dir() -> Path:
    """The shared tokenizer beside the checkout, else the one the repository ships (unpacked)."""
    if (TOKENIZER_DIR / "tokenizer.json").is_file():
        return TOKENIZER_DIR
    sys.path.insert(0, str(REPO))
    from lilycli.bundled_tokenizer import tokenizer_dir as bundled
    return Path(bundled())


#: A schema with the usual parts (strings, numbers, enums, arrays of objects); no bounds, so a
#: noisy model keeps writing until max_tokens.
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "year": {"type": "integer"},
        "kind": {"enum": ["book", "film", "game"]},
        "items": {"type": "array", "items": {"type": "object", "properties": {
            "name": {"type": "string"}, "score": {"type": "number"}}, "required": ["name", "score"]}},
    },
    "required": ["title", "year", "kind", "items"],
}


def engine_binary() -> str:
    if os.environ.get("LILY_ENGINE_BIN"):
        return os.environ["LILY_ENGINE_BIN"]
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    return str(target / "release" / "lily-engine")


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in client().get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


class ServerLog:
    """The started server's stderr, in a file; `timing()` waits for the next engine timing line
    (`timing: key=value ...`, one per finished request) and returns its numbers."""

    def __init__(self):
        self.file = tempfile.NamedTemporaryFile(prefix="lily-serve-", suffix=".log", delete=False)
        self.path = Path(self.file.name)
        self.seen = 0

    def timing(self, wait: float = 5.0) -> dict | None:
        deadline = time.time() + wait
        while True:
            lines = [l for l in self.path.read_text(errors="replace").splitlines() if "timing: " in l]
            if len(lines) > self.seen:
                self.seen = len(lines)
                return parse_timing(lines[-1])
            if time.time() > deadline:
                return None
            time.sleep(0.05)

    def skip(self):
        """Forgets the timing lines written so far."""
        self.seen = len([l for l in self.path.read_text(errors="replace").splitlines() if "timing: " in l])


def wait_ready(url: str, proc: subprocess.Popen, log: "ServerLog", timeout: float) -> bool:
    """Polls the server's /health until it answers 200. False, with the tail of its log printed,
    if the process exits or `timeout` seconds pass first."""
    deadline = time.time() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            print("server did not start", file=sys.stderr)
            print(log.path.read_text(errors="replace")[-4000:], file=sys.stderr)
            return False
        time.sleep(0.2)


def parse_timing(line: str) -> dict:
    out = {}
    for key, value in re.findall(r"(\w+)=(\S+)", line.split("timing: ", 1)[1]):
        try:
            out[key] = float(value)
        except ValueError:
            out[key] = value
    return out


def describe_timing(t: dict) -> str:
    """The server's timing line in words (milliseconds)."""
    g = lambda k: t.get(k, float("nan"))
    parts = [f"cached {int(g('cached'))}"] if g("cached") else []
    if "prepare_ms" in t:
        parts.append(f"prepare {g('prepare_ms'):.1f}")
    parts += [f"queue {g('queue_ms'):.1f}", f"sequence {g('acquire_ms'):.1f} ({t.get('seq', '?')})",
              f"prefill {g('prefill_ms'):.1f} in {int(g('chunks'))} call(s) [{t.get('chunk_ms', '')}]",
              f"snapshots {g('snapshot_ms'):.1f} ({int(g('snapshots'))})", f"first pick {g('first_pick_ms'):.1f}",
              f"engine ttft {g('engine_ttft_ms'):.1f}"]
    if "ttft_ms" in t:
        parts.append(f"arrival to first token {g('ttft_ms'):.1f}")
    parts.append(f"release {g('release_ms'):.1f}")
    return ", ".join(parts) + " ms"


#: One client for every request, as a real client keeps one: making an httpx.Client (its SSL
#: context) takes 25-30 ms of CPU on a small machine, which `httpx.stream` pays per call and which
#: used to be counted in the time to first token.
_CLIENT: httpx.Client | None = None


def client() -> httpx.Client:
    global _CLIENT
    if _CLIENT is None:
        _CLIENT = httpx.Client(timeout=httpx.Timeout(5.0, read=None))
    return _CLIENT


def fresh_prompt(length: int, tag: str) -> list[int]:
    """`length` token ids drawn from [1000, 101000) by a generator seeded with `tag`: prompts of
    different tags share no prefix (their first ids differ, but for a 1e-5 chance), so nothing is
    reused from the prefix cache."""
    rng = random.Random(f"{length}-{tag}")
    return [rng.randrange(1000, 101_000) for _ in range(length)]


def one(url: str, endpoint: str, prompt, max_tokens: int, extra: dict, ttft: list | None = None) -> tuple[int, float]:
    """(completion tokens, seconds from the first streamed chunk to the last); the seconds from
    sending the request (its body already encoded) to its first streamed token are appended to
    `ttft` when given."""
    body = {"model": "m", "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    if endpoint == "chat":
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        path = "/v1/completions"
        body["prompt"] = prompt
    first = last = None
    tokens = 0
    content = json.dumps(body).encode()
    http = client()
    sent = time.perf_counter()
    with http.stream("POST", url + path, content=content, headers={"content-type": "application/json"}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            choices = chunk.get("choices") or []
            if choices and (choices[0].get("text") or choices[0].get("delta", {}).get("content")
                            or choices[0].get("delta", {}).get("reasoning_content")
                            or (choices[0].get("logprobs") and choices[0].get("finish_reason") is None)):
                now = time.perf_counter()
                first = first or now
                last = now
    if ttft is not None and first:
        ttft.append(first - sent)
    return tokens, (last - first) if first else 0.0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", help="model directory or scripted:FILE")
    ap.add_argument("--script-spin-us", type=int, help="serve a cheap scripted model spinning N µs per token")
    ap.add_argument("--url", help="an already running server")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    ap.add_argument("--prompt", default="long story")
    ap.add_argument("--prompt-tokens", type=int, help="a prompt of this many token ids (completions)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--extra", default="{}", help="JSON merged into each request body")
    ap.add_argument("--constrain", choices=["json"], help="constrained decoding: a json_schema answer (chat)")
    ap.add_argument("--ttft-repeat", type=int, default=0,
                    help="then time to first token over this many prompts of --prompt-tokens ids that share "
                         "no prefix (completions; nothing to reuse), median")
    ap.add_argument("--ttft-only", action="store_true",
                    help="skip the decode measurement (warm-up: two one-token requests of each length)")
    ap.add_argument("--ttft-tokens", help="with --ttft-only: comma-separated prompt lengths, one server for all")
    ap.add_argument("--ctx-size", type=int, default=16384,
                    help="the started server's --ctx-size; 0: the server's default (default 16384)")
    ap.add_argument("--start-timeout", type=float, default=600, help="seconds the started server may take to load")
    a = ap.parse_args()
    lengths = [a.prompt_tokens] if a.prompt_tokens else []
    if a.ttft_tokens:
        if not a.ttft_only:
            ap.error("--ttft-tokens needs --ttft-only")
        try:
            lengths = [int(x) for x in a.ttft_tokens.split(",") if x.strip()]
        except ValueError:
            ap.error("--ttft-tokens takes comma-separated integers")
        if not lengths or min(lengths) < 1:
            ap.error("--ttft-tokens needs positive lengths")
    if a.ttft_only and not (lengths and a.ttft_repeat and a.endpoint == "completions"):
        ap.error("--ttft-only needs --prompt-tokens (or --ttft-tokens), --ttft-repeat and the completions endpoint")

    proc = None
    log = None
    url = a.url
    if not url:
        model = a.model
        if a.script_spin_us is not None:
            reply = " ".join(f"word{i}" for i in range(4000))
            path = Path(tempfile.mkdtemp()) / "script.json"
            path.write_text(json.dumps({"tokenizer": str(tokenizer_dir()), "cheap": True,
                                        "spin_us": a.script_spin_us, "default": reply}))
            model = f"scripted:{path}"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        cmd = [engine_binary(), "serve", "--model", model, "--port", str(port), "--device", a.device]
        if a.ctx_size:
            cmd += ["--ctx-size", str(a.ctx_size)]
        log = ServerLog()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log.file)
        if not wait_ready(url, proc, log, a.start_timeout):
            proc.kill()
            return 1
        ready = [l for l in log.path.read_text(errors="replace").splitlines() if "ready (context" in l]
        if ready:
            print("server: " + ready[-1].split("model ", 1)[-1].strip())
    try:
        if a.ttft_only:
            extra = json.loads(a.extra)
            for n in lengths:
                # Two warm-ups: the first request after start-up allocates its sequence; later
                # ones reuse a freed one's buffers once the prefix cache evicts (lily-cuda).
                for w in range(2):
                    one(url, a.endpoint, fresh_prompt(n, f"warm-up {w}"), 1, extra)
                ttft_run(a, n, url, extra, log)
            return 0
        prompt = a.prompt
        if a.prompt_tokens and a.endpoint == "chat":
            prompt = " hello" * a.prompt_tokens  # one token per word, plus the template's few
        elif a.prompt_tokens:
            prompt = [(i * 7919) % 100_000 + 1000 for i in range(a.prompt_tokens)]
        extra = json.loads(a.extra)
        if a.constrain == "json":
            extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "bench", "schema": BENCH_SCHEMA}},
                     "chat_template_kwargs": {"enable_thinking": False}, **extra}
        decode_run(a, url, prompt, extra)
        if a.ttft_repeat and a.prompt_tokens and a.endpoint == "completions":
            ttft_run(a, a.prompt_tokens, url, extra, log)
    finally:
        if proc:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        if log:
            if os.environ.get("LILY_TEST_LOGS"):
                sys.stderr.write(log.path.read_text(errors="replace"))
            log.path.unlink(missing_ok=True)
    return 0


def decode_run(a, url: str, prompt, extra: dict):
    """Streams --repeat completions and prints the client's and the engine's decode speed."""
    one(url, a.endpoint, prompt, 8, extra)  # warm-up
    m0 = metrics(url)
    rates = []
    total_tokens = 0
    for _ in range(a.repeat):
        n, s = one(url, a.endpoint, prompt, a.max_tokens, extra)
        total_tokens += n
        rates.append((n - 1) / s if s > 0 else float("nan"))
    m1 = metrics(url)
    d = lambda k: m1.get(k, 0.0) - m0.get(k, 0.0)
    gen = d("lily_generated_tokens_total")
    engine_ms = 1e3 * d("lily_decode_seconds_total") / max(gen, 1)
    sink_us = 1e6 * d("lily_decode_sink_seconds_total") / max(gen, 1)
    masks = d("lily_constraint_masks_total")
    mask_us = 1e6 * d("lily_constraint_mask_seconds_total") / max(masks, 1)
    rates.sort()
    client = rates[len(rates) // 2]
    constrained = (f"; mask {mask_us:.1f} µs/step over {masks:.0f} steps "
                   f"({100 * mask_us / (1e3 * engine_ms):.1f} % of a decode step)") if masks else ""
    print(f"{a.endpoint}: client {client:.1f} tok/s ({1e3 / client:.3f} ms/token, median of {a.repeat}); "
          f"engine decode {1e3 / engine_ms if engine_ms else float('nan'):.1f} tok/s ({engine_ms:.3f} ms/token), "
          f"sink {sink_us:.1f} µs/token; {total_tokens} tokens{constrained}")


def ttft_run(a, length: int, url: str, extra: dict, log: ServerLog | None):
    """Time to first token of --ttft-repeat prompts that share no prefix with each other or the
    earlier ones; each with the server's timing line when this script started the server."""
    if log:
        log.skip()
    runs = []
    for r in range(a.ttft_repeat):
        fresh = fresh_prompt(length, f"ttft {r}")
        firsts: list = []
        # `logprobs: 0` streams a chunk for every token, also one whose text is held back (part
        # of a UTF-8 character), so the first token is seen when it is sent, not at the end.
        one(url, a.endpoint, fresh, 1, {"logprobs": 0, **extra}, firsts)
        if not firsts:
            print(f"ttft run {r + 1}: no text came back", file=sys.stderr)
            continue
        t = log.timing() if log else None
        runs.append((firsts[0], t))
        line = f"ttft run {r + 1}: client {1e3 * firsts[0]:.1f} ms"
        if t:
            line += f"; server: {describe_timing(t)}"
            if "ttft_ms" in t:
                line += f"; client minus server {1e3 * firsts[0] - t['ttft_ms']:.1f}"
        print(line)
    if not runs:
        return
    runs.sort(key=lambda x: x[0])
    t, timing = runs[len(runs) // 2]
    print(f"ttft: {length} prompt tokens, median of {len(runs)}: {t:.3f} s "
          f"({length / t:.0f} tok/s)"
          + (f"; that run's server prefill {timing['prefill_ms'] / 1e3:.3f} s, "
             f"engine ttft {timing.get('engine_ttft_ms', float('nan')) / 1e3:.3f} s" if timing else ""))


if __name__ == "__main__":
    sys.exit(main())
