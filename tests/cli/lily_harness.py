"""Helpers for the CLI tests: a `lily` child process with its output collected, ports, process checks."""

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
