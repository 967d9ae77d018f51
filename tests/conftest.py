"""End-to-end fixtures: the `lily-engine` binary serving a model, driven over HTTP.

The binary is target/release/lily-engine (honouring CARGO_TARGET_DIR; LILY_ENGINE_BIN overrides).
Models:
- `small`: the synthetic `small` preset (real 248,320 vocabulary, random weights) generated once per
  session by `lily-engine synth`, served by the real CPU backend;
- `scripted`: the test-only scripted backend (`--model scripted:FILE`), which replies with fixed text
  so the reasoning / tool-call / failure paths can be driven through the full HTTP stack.
The tokenizer and chat template are the copy the repository ships (lilycli/tokenizer/): a checkout
needs nothing beside it.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # the checkout's lilycli, installed or not

from lilycli.bundled_tokenizer import tokenizer_dir  # noqa: E402


def target_dir() -> Path:
    """Cargo's build directory: $CARGO_TARGET_DIR, else target/ in the checkout."""
    target = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
    return target if target.is_absolute() else REPO / target


def engine_binary() -> Path:
    if os.environ.get("LILY_ENGINE_BIN"):
        return Path(os.environ["LILY_ENGINE_BIN"])
    return target_dir() / "release" / "lily-engine"


#: The bundled tokenizer (lilycli/tokenizer/), unpacked and checked against its SHA256SUMS in the
#: build tree's tmp/, where the Rust tests unpack it too (crates/lily-core/tests/common/mod.rs).
TOKENIZER_DIR = tokenizer_dir(target_dir() / "tmp" / "lily-test-cache")


def assert_error(resp, status, param=None, code=None) -> dict:
    """`resp` is an OpenAI error object with this status (and param / code, when given)."""
    assert resp.status_code == status, (resp.status_code, resp.headers, resp.text)
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A running `lily-engine serve`; stopped with SIGTERM."""

    def __init__(self, model: str, *extra: str, api_key: str | None = None, env: dict | None = None,
                 log_path: Path | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        args = [str(engine_binary()), "serve", "--model", model, "--port", str(self.port), *extra]
        if api_key:
            args += ["--api-key", api_key]
        self.log = open(os.devnull, "w") if not os.environ.get("LILY_TEST_LOGS") else None
        if log_path is not None:
            self.log = open(log_path, "w")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=self.log,
                                     env={**os.environ, **env} if env else None)

    def wait_ready(self, timeout: float = 120.0) -> "Server":
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lily-engine exited with {self.proc.returncode} while loading")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError("lily-engine did not become ready")

    def client(self, **kw) -> OpenAI:
        return OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "unused", max_retries=0, **kw)

    def metrics(self) -> dict[str, float]:
        """The /metrics page as {series: value}."""
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=5).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log:
            self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="session")
def small_model(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("models") / "small"
    subprocess.run(
        [str(engine_binary()), "synth", "--preset", "small", "--format", "mlx", "--seed", "1",
         "--out", str(out), "--tokenizer", str(TOKENIZER_DIR)],
        check=True,
    )
    return out


#: Context of the CPU test server: small, so "prompt longer than the context" is cheap to hit.
CTX = 512


@pytest.fixture(scope="session")
def cpu_server(small_model):
    server = Server(str(small_model), "--ctx-size", str(CTX), "--max-queue", "64", "--device", "cpu").wait_ready()
    yield server
    server.stop()


# Scripted replies, picked by a trigger word in the prompt (the latest occurrence wins).
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
SCRIPT = {
    "replies": [
        {"when": "weather", "text": "The user asks about the weather in Paris.\n</think>\n\n"
                                    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"},
        {"when": "two cities", "text": "Two calls.\n</think>\n\nChecking both.\n\n"
                                       "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>\n"
                                       "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>"},
        {"when": "riddle", "text": "Let me think step by step.\n</think>\n\nThe answer is 42."},
        # Words only a rendered tool result / a rendered call's arguments hold (test_tool_results_round_trip).
        {"when": "21C", "text": "It is 21C and sunny."},
        {"when": "<parameter=city>\nLisbon", "text": "The call was for Lisbon."},
        {"when": "plain", "text": "Just an answer, no thinking."},
        {"when": "long story", "text": " ".join(f"word{i}" for i in range(1500))},
        {"when": "short story", "text": " ".join(f"word{i}" for i in range(60))},
        {"when": "explode", "fail": "scripted backend failure"},
        {"when": "panic", "panic": "scripted backend panic"},
    ],
    "default": "Hello! How can I help?",
}


def scripted_model(tmp_path_factory, text_dir: Path, delay_ms: int = 0) -> str:
    """A scripted model file. Its "tokenizer" directory must hold the tokenizer files and a config.json
    (vocabulary, end-of-turn ids, context length): the `small_model` directory has both."""
    path = tmp_path_factory.mktemp("scripted") / "script.json"
    path.write_text(json.dumps({"tokenizer": str(text_dir), "delay_ms": delay_ms, **SCRIPT}))
    return f"scripted:{path}"


@pytest.fixture(scope="session")
def scripted_server(tmp_path_factory, small_model):
    server = Server(scripted_model(tmp_path_factory, small_model, delay_ms=2), "--ctx-size", "4096").wait_ready()
    yield server
    server.stop()


@pytest.fixture
def slow_scripted(tmp_path_factory, small_model):
    """A fresh scripted server at 10 ms per token, for cancellation, queueing and shutdown."""
    server = Server(scripted_model(tmp_path_factory, small_model, delay_ms=10), "--ctx-size", "4096",
                    "--max-queue", "2").wait_ready()
    yield server
    server.stop()
