"""Helpers for the CLI tests: a `lily` child process with its output collected, ports, process checks."""

import json
import os
import queue
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED_TOKENIZER = REPO.parent / "shared" / "qwen3.6-tokenizer"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it has exited all the same.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


class LilyProcess:
    """`python -m lilycli ARGS` as a child process (for what needs real signals), its output collected."""

    def __init__(self, *args: str, env: dict | None = None, stdin=subprocess.DEVNULL):
        full_env = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "lilycli", *args],
            cwd=REPO,
            env=full_env,
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, args=(self.process.stdout, self.stdout, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.process.stderr, self.stderr, False), daemon=True).start()

    def _pump(self, stream, sink, announce):
        for line in stream:
            sink.append(line)
            if announce:
                self._lines.put(line)

    def wait_for_url(self, timeout: float = 60.0) -> str:
        """The base URL from `lily serve`'s "serving ... at URL/v1" line."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._lines.get(timeout=0.2)
            except queue.Empty:
                if self.process.poll() is not None:
                    break
                continue
            match = re.search(r"at (http://\S+)/v1", line)
            if match:
                return match.group(1)
        raise AssertionError(
            f"lily serve printed no URL; stdout={''.join(self.stdout)!r} stderr={''.join(self.stderr)!r}"
        )

    def wait(self, timeout: float = 30.0) -> int:
        code = self.process.wait(timeout=timeout)
        time.sleep(0.1)  # let the pumps drain
        return code

    @property
    def err(self) -> str:
        return "".join(self.stderr)

    @property
    def out(self) -> str:
        return "".join(self.stdout)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


# Checkpoint layouts on disk, as `lily fetch` and huggingface_hub leave them (contents do not matter
# to the CLI: the engine validates tensors).
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def write_checkpoint(directory: Path, shards=("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")):
    """A checkpoint directory's file set (contents do not matter to fetch: the engine validates them)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe"}))
    (directory / "tokenizer.json").write_text("{}")
    weight_map = {f"tensor.{i}": shard for i, shard in enumerate(shards)}
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    for shard in shards:
        (directory / shard).write_bytes(os.urandom(64))
    return directory


def hub_cache_copy(repo: str) -> Path:
    """Lay out `repo` in the Hugging Face cache the way huggingface_hub does (refs/main -> snapshots/<commit>)."""
    from huggingface_hub import constants  # only after conftest pointed HF_HUB_CACHE at a temp dir

    root = Path(constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(COMMIT)
    return write_checkpoint(root / "snapshots" / COMMIT)
