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
"""

import argparse
import json
import os
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
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def one(url: str, endpoint: str, prompt, max_tokens: int, extra: dict, ttft: list | None = None) -> tuple[int, float]:
    """(completion tokens, seconds from the first streamed chunk to the last); the seconds from
    sending the request to its first streamed token are appended to `ttft` when given."""
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
    sent = time.perf_counter()
    with httpx.stream("POST", url + path, json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            choices = chunk.get("choices") or []
            if choices and (choices[0].get("text") or choices[0].get("delta", {}).get("content")
                            or choices[0].get("delta", {}).get("reasoning_content")):
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
    a = ap.parse_args()

    proc = None
    url = a.url
    if not url:
        model = a.model
        if a.script_spin_us is not None:
            reply = " ".join(f"word{i}" for i in range(4000))
            path = Path(tempfile.mkdtemp()) / "script.json"
            path.write_text(json.dumps({"tokenizer": str(TOKENIZER_DIR), "cheap": True,
                                        "spin_us": a.script_spin_us, "default": reply}))
            model = f"scripted:{path}"
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen([engine_binary(), "serve", "--model", model, "--port", str(port),
                                 "--device", a.device, "--ctx-size", "16384"],
                                stdout=subprocess.DEVNULL,
                                stderr=None if os.environ.get("LILY_TEST_LOGS") else subprocess.DEVNULL)
        deadline = time.time() + 600
        while True:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                print("server did not start", file=sys.stderr)
                return 1
            time.sleep(0.2)
    try:
        prompt = a.prompt
        if a.prompt_tokens and a.endpoint == "chat":
            prompt = " hello" * a.prompt_tokens  # one token per word, plus the template's few
        elif a.prompt_tokens:
            prompt = [(i * 7919) % 100_000 + 1000 for i in range(a.prompt_tokens)]
        extra = json.loads(a.extra)
        if a.constrain == "json":
            extra = {"response_format": {"type": "json_schema", "json_schema": {"name": "bench", "schema": BENCH_SCHEMA}},
                     "chat_template_kwargs": {"enable_thinking": False}, **extra}
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
        if a.ttft_repeat and a.prompt_tokens and a.endpoint == "completions":
            firsts: list = []
            for r in range(a.ttft_repeat):
                fresh = [(i * 7919 + 104_729 * (r + 1)) % 100_000 + 1000 for i in range(a.prompt_tokens)]
                one(url, a.endpoint, fresh, 1, extra, firsts)
            firsts.sort()
            t = firsts[len(firsts) // 2]
            print(f"ttft: {a.prompt_tokens} prompt tokens, median of {len(firsts)}: {t:.3f} s "
                  f"({a.prompt_tokens / t:.0f} tok/s)")
    finally:
        if proc:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
