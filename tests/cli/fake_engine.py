"""A stand-in for `lily-engine`, for tests of the CLI's own logic (launching, waiting, failing, streaming).

It speaks the engine's command-line and HTTP contract just far enough: `--version`, `synth`,
`bench` and `serve` (/health loading then ready, /v1/models, streaming /v1/chat/completions with
`reasoning_content`). Its answers say what it received, so tests can check what the CLI sent.
Behaviour switches (environment): FAKE_LOAD_SECONDS, FAKE_DIE_LOADING, FAKE_DIE_AFTER_READY,
FAKE_SYNTH_FAIL, FAKE_TOKEN_DELAY, FAKE_PID_FILE (the serving process writes its pid there).
"""

import argparse
import json
import os
import shutil
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def log(message: str) -> None:
    print(f"[fake-engine] {message}", flush=True)


def synth(args) -> int:
    if os.environ.get("FAKE_SYNTH_FAIL"):
        log("error: synth failed on purpose")
        return 5
    out = Path(args.out)
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps({"preset": args.preset, "format": args.format, "seed": args.seed}))
    (out / "model.safetensors").write_bytes(b"fake")
    for name in os.listdir(args.tokenizer):
        shutil.copyfile(Path(args.tokenizer) / name, out / name)
    log(f"wrote {args.preset} ({args.format}) to {out}")
    return 0


def bench(args) -> int:
    lengths = [int(n) for n in (args.prefill or "256,512").split(",")]
    contexts = [int(n) for n in (args.decode_ctx or "256,512").split(",")]
    run = {
        "engine": "fake-engine",
        "version": "0.0.0",
        "gpu": "none",
        "model": args.model,
        "format": "mlx",
        "prefill": [{"len": n, "tok_s": 1000.0 + n, "ms": n / (1000.0 + n) * 1000} for n in lengths],
        "decode": [{"ctx": n, "tok_s": 100.0 - n / 100, "ms_per_tok": 1000 / (100.0 - n / 100)} for n in contexts],
    }
    Path(args.json).write_text(json.dumps(run))
    log(f"bench done: {len(lengths)} prefill points, {len(contexts)} decode points")
    return 0


class Handler(BaseHTTPRequestHandler):
    ready_at = 0.0
    api_key: str | None = None
    model = ""

    def log_message(self, fmt, *a):
        log(fmt % a)

    def _json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        if self.api_key and self.headers.get("Authorization") != f"Bearer {self.api_key}":
            self._json(401, {"error": {"message": "invalid api key", "type": "invalid_request_error"}})
            return False
        return True

    def do_GET(self):
        if self.path == "/health":
            now = time.monotonic()
            if now < self.ready_at:
                load = float(os.environ.get("FAKE_LOAD_SECONDS", "0.5")) or 1.0
                done = 1 - (self.ready_at - now) / load
                self._json(503, {"status": "loading", "progress": round(done, 2), "stage": "weights"})
            else:
                self._json(200, {"status": "ok", "model": self.model})
        elif self.path == "/v1/models":
            if self._authorized():
                self._json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        else:
            self._json(404, {"error": {"message": f"no route {self.path}"}})

    def do_POST(self):
        if self.path != "/v1/chat/completions":
            return self._json(404, {"error": {"message": f"no route {self.path}"}})
        if not self._authorized():
            return
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        messages = body.get("messages") or []
        if not messages:
            return self._json(
                400, {"error": {"message": "messages must not be empty", "type": "invalid_request_error"}}
            )
        think = (body.get("chat_template_kwargs") or {}).get("enable_thinking", True)
        users = [m["content"] for m in messages if m["role"] == "user"]
        system = [m["content"] for m in messages if m["role"] == "system"]
        answer = f"You said: {users[-1]} (turn {len(users)}, {len(messages)} messages"
        answer += f", system={system[0]!r})" if system else ")"
        pieces = answer.split(" ")
        limit = body.get("max_tokens")
        finish = "stop"
        if limit is not None and limit < len(pieces):
            pieces, finish = pieces[:limit], "length"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()

        delay = float(os.environ.get("FAKE_TOKEN_DELAY", "0"))

        def send(delta, finish_reason=None):
            time.sleep(delay)
            chunk = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": body.get("model"),
                     "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}  # fmt: skip
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()

        send({"role": "assistant"})
        if think:
            for piece in ["Thinking ", "about ", "it."]:
                send({"reasoning_content": piece})
        for i, piece in enumerate(pieces):
            send({"content": piece + (" " if i + 1 < len(pieces) else "")})
        send({}, finish)
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 10, "completion_tokens": len(pieces), "total_tokens": 10 + len(pieces)}
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


def serve(args) -> int:
    pid_file = os.environ.get("FAKE_PID_FILE")
    if pid_file:
        Path(pid_file).write_text(str(os.getpid()))
    log(f"loading {args.model}")
    if os.environ.get("FAKE_DIE_LOADING"):
        # Coloured like tracing's output, which keeps its escape codes even into a pipe.
        log("\x1b[31mERROR\x1b[0m cannot load the model")
        log("error: tensor language_model.model.layers.0.mlp.gate.weight has shape [1, 2], expected [256, 512]")
        return 3
    Handler.ready_at = time.monotonic() + float(os.environ.get("FAKE_LOAD_SECONDS", "0.5"))
    Handler.api_key = args.api_key
    Handler.model = args.model
    try:
        server = ThreadingHTTPServer((args.host, args.port), Handler)
    except OSError as e:
        log(f"error: cannot bind {args.host}:{args.port}: {e}")
        return 2
    stop = threading.Event()

    def on_signal(signum, _frame):
        log(f"received {signal.Signals(signum).name}, shutting down")
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    log(f"listening on http://{args.host}:{args.port}")
    die_after = os.environ.get("FAKE_DIE_AFTER_READY")
    deadline = Handler.ready_at + float(die_after) if die_after else None
    while not stop.wait(0.05):
        if deadline is not None and time.monotonic() > deadline:
            log("error: CUDA error: an illegal memory access was encountered")
            return 4
    server.shutdown()
    log("stopped")
    return 0


def main() -> int:
    if sys.argv[1:] == ["--version"]:
        print("lily-engine 0.0.0-fake")
        return 0
    parser = argparse.ArgumentParser(prog="fake-lily-engine")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve")
    p.add_argument("--model", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key")
    p.add_argument("--ctx-size", type=int)
    p.add_argument("--max-queue", type=int)
    p.add_argument("--device")
    p.add_argument("--no-webui", action="store_true")
    p = sub.add_parser("synth")
    p.add_argument("--preset", required=True)
    p.add_argument("--format", required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--tokenizer", required=True)
    p = sub.add_parser("bench")
    p.add_argument("--model", required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--prefill")
    p.add_argument("--decode-ctx")
    p.add_argument("--decode-tokens", type=int)
    p.add_argument("--repeat", type=int)
    p.add_argument("--device")
    args = parser.parse_args()
    return {"serve": serve, "synth": synth, "bench": bench}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
