#!/usr/bin/env python3
"""Drives `lily-engine serve` through an agent-like trace and prints, per turn, the time to first
token and the prompt tokens reused (issue 14's measurement: with prefix reuse a later turn should
cost only its new tokens).

The trace: a system prompt with tools, a user task, then turns that each send back the previous
answer (as a tool call) and append a tool result (a synthetic source file), sized so the context
grows evenly to --context tokens over --turns requests. Answers are streamed with max_tokens
--answer-tokens; the time to first token is measured by the client (request sent → first
generated text) and read from the server's /metrics (the engine's own, from the start of the job).

  # against a server already running (its --prefix-cache-mib decides reuse):
  python3 scripts/agent_trace.py --url http://127.0.0.1:8000 --context 65536 --turns 12
  # or start one (twice: reuse on, then off), passing serve options after --:
  python3 scripts/agent_trace.py --engine target/release/lily-engine --model DIR --reuse both \\
      --context 65536 --turns 12 --json trace.json -- --device cuda

Standard library only, so it runs wherever Python 3.10 does.
"""

import argparse
import json
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run the test suite, optionally filtered.",
        "parameters": {"type": "object", "properties": {"filter": {"type": "string"}}}}},
]


def post_stream(url, body, timeout):
    """POSTs a streaming chat request; yields (seconds since sent, chunk) per SSE event."""
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    sent = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            yield time.perf_counter() - sent, json.loads(data)


def metrics(url):
    out = {}
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        for line in resp.read().decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
    return out


def source_file(turn, chars, rng):
    """A synthetic Rust file of about `chars` characters."""
    lines, n = [f"// src/agent/module_{turn}.rs"], 0
    while n < chars:
        k = rng.randrange(1 << 30)
        line = f"pub fn step_{turn}_{len(lines)}(x: u64) -> u64 {{ x.wrapping_mul({k}).rotate_left({k % 63}) ^ {k >> 7} }}"
        lines.append(line)
        n += len(line) + 1
    return "\n".join(lines)


def run_trace(url, args):
    rng = random.Random(args.seed)
    kwargs = {"enable_thinking": args.thinking}
    messages = [
        {"role": "system", "content": "You are a coding agent working in a Rust repository. "
                                      "Read files with the tools before changing anything."},
        {"role": "user", "content": "The test `parse_empty_array` fails. Find the cause and fix it."},
    ]
    tokens_per_char = 0.3  # refined after each turn from the server's own counts
    rows, previous = [], None
    for turn in range(args.turns):
        if turn > 0:
            # Tokens this turn should add so the context reaches --context at the last turn.
            target = args.context * turn // (args.turns - 1)
            want = max(64, target - previous["prompt"] - previous["completion"] - 2 * args.answer_tokens)
            call = previous["tool_calls"] or [{
                "id": f"call_{turn}", "type": "function",
                "function": {"name": "read_file", "arguments": json.dumps({"path": f"src/agent/module_{turn}.rs"})}}]
            answer = {"role": "assistant", "content": previous["content"], "tool_calls": call}
            if args.thinking and previous["reasoning"]:
                answer["reasoning_content"] = previous["reasoning"]
            messages.append(answer)
            result = source_file(turn, int(want / tokens_per_char), rng)
            messages.append({"role": "tool", "tool_call_id": call[0]["id"], "content": result})
        before = metrics(url)
        body = {"model": "any", "messages": messages, "tools": TOOLS, "stream": True,
                "stream_options": {"include_usage": True}, "max_tokens": args.answer_tokens,
                "temperature": 0, "chat_template_kwargs": kwargs}
        first, usage, content, reasoning, calls = None, None, "", "", {}
        for t, chunk in post_stream(url, body, args.timeout):
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                piece = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
                if first is None and (piece or delta.get("tool_calls")):
                    first = t
                content += delta.get("content") or ""
                reasoning += delta.get("reasoning_content") or ""
                for c in delta.get("tool_calls") or []:
                    slot = calls.setdefault(c["index"], {"id": c.get("id"), "type": "function",
                                                         "function": {"name": "", "arguments": ""}})
                    slot["function"]["name"] += c.get("function", {}).get("name") or ""
                    slot["function"]["arguments"] += c.get("function", {}).get("arguments") or ""
        if usage is None:
            sys.exit(f"turn {turn}: the server sent no usage chunk")
        after = metrics(url)
        server_ttft = (after.get("lily_time_to_first_token_seconds_sum", 0)
                       - before.get("lily_time_to_first_token_seconds_sum", 0))
        prompt, cached = usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
        if previous is not None:
            added = prompt - previous["prompt"] - previous["completion"]
            if added > 0 and len(messages[-1]["content"]) > 0:
                tokens_per_char = max(0.05, added / len(messages[-1]["content"]))
        row = {"turn": turn + 1, "prompt": prompt, "cached": cached, "prefilled": prompt - cached,
               "completion": usage["completion_tokens"], "ttft_client_s": first, "ttft_server_s": server_ttft,
               "content": content, "reasoning": reasoning,
               "tool_calls": [calls[i] for i in sorted(calls)
                              if calls[i]["id"] and calls[i]["function"]["name"]] or None}
        rows.append(row)
        previous = row
        print(f"{row['turn']:>4} {prompt:>9} {cached:>9} {row['prefilled']:>9} "
              f"{(first or float('nan')):>10.3f} {server_ttft:>10.3f}", flush=True)
    return rows


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, reuse):
    port = free_port()
    cmd = [args.engine, "serve", "--model", args.model, "--port", str(port),
           "--ctx-size", str(args.context + 4 * args.answer_tokens + 4096)]
    if not reuse:
        cmd += ["--prefix-cache-mib", "0"]
    cmd += args.serve_args
    print("starting:", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + args.load_timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"lily-engine exited with {proc.returncode} while loading")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    proc.kill()
    sys.exit("lily-engine did not become ready")


def stop_server(proc):
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (else --engine and --model start one)")
    p.add_argument("--engine", default="target/release/lily-engine")
    p.add_argument("--model", help="model directory, to start a server")
    p.add_argument("--reuse", choices=["on", "off", "both"], default="on",
                   help="prefix reuse for a started server (off: --prefix-cache-mib 0); with --url it is "
                        "checked against the server's lily_prefix_cache_budget_bytes")
    p.add_argument("--context", type=int, default=65536, help="prompt tokens at the last turn")
    p.add_argument("--turns", type=int, default=12)
    p.add_argument("--answer-tokens", type=int, default=32, help="max_tokens of each answer")
    p.add_argument("--thinking", action="store_true", help="enable_thinking (reasoning is sent back)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per request")
    p.add_argument("--load-timeout", type=float, default=1800)
    p.add_argument("--json", help="write the rows here")
    p.add_argument("serve_args", nargs="*", help="after --: more `serve` options for a started server")
    args = p.parse_args()
    if args.turns < 2:
        p.error("--turns must be at least 2")
    if args.url and args.reuse == "both":
        p.error("--reuse both starts the server twice: give --model, not --url")
    if not args.url and not args.model:
        p.error("give --url of a running server, or --model to start one")
    results = {}
    for mode in (["on", "off"] if args.reuse == "both" else [args.reuse]):
        proc = None
        if args.url:
            url = args.url.rstrip("/")
            budget = metrics(url).get("lily_prefix_cache_budget_bytes", 0)
            if (budget > 0) != (mode == "on"):
                sys.exit(f"the server at {url} has prefix reuse {'on' if budget > 0 else 'off'}, "
                         f"not {mode} (restart it with --prefix-cache-mib 0 to turn it off)")
        else:
            proc, url = start_server(args, mode == "on")
        try:
            print(f"\nprefix reuse {mode}: {args.turns} turns to {args.context} tokens")
            print(f"{'turn':>4} {'prompt':>9} {'cached':>9} {'prefilled':>9} {'ttft_cli_s':>10} {'ttft_srv_s':>10}")
            rows = run_trace(url, args)
            m = metrics(url)
            print("prefix cache: hits {:.0f}, misses {:.0f}, evictions {:.0f}, {:.1f} MB held".format(
                m.get("lily_prefix_cache_hits_total", 0), m.get("lily_prefix_cache_misses_total", 0),
                m.get("lily_prefix_cache_evictions_total", 0), m.get("lily_prefix_cache_bytes", 0) / 1e6))
            results[mode] = [{k: v for k, v in r.items() if k not in ("content", "reasoning", "tool_calls")}
                             for r in rows]
        finally:
            if proc is not None:
                stop_server(proc)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"context": args.context, "turns": args.turns, "answer_tokens": args.answer_tokens,
                       "thinking": args.thinking, "runs": results}, f, indent=1)
        print("wrote", args.json)


if __name__ == "__main__":
    main()
