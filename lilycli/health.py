"""The engine's GET /health: 503 {"status": "loading", ...} while the model loads, 200 when ready.

Read by `lily serve` (its own engine) and by `lily chat --url` (someone else's server, which may
still be loading when the chat starts).
"""

import sys
import time
from collections.abc import Callable

import httpx

from lilycli.errors import LilyError


def read_health(client: httpx.Client, url: str) -> dict | None:
    """None when the server is ready, else the body it answered (raises httpx.TransportError if unreachable)."""
    response = client.get(f"{url}/health")
    if response.status_code == 200:
        return None
    try:
        body = response.json()
    except ValueError:
        body = None
    return body if isinstance(body, dict) else {"status": f"HTTP {response.status_code}"}


def wait_for_server(
    url: str, api_key: str | None, timeout: float, on_progress: Callable[[dict, float], None] | None = None
) -> None:
    """Wait until a running server at `url` is ready; fail at once if nothing listens there."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = time.monotonic()
    with httpx.Client(timeout=5.0, headers=headers) as client:
        while True:
            try:
                body = read_health(client, url)
            except httpx.TransportError as e:
                raise LilyError(f"cannot reach a server at {url} ({e}); is `lily serve` running?") from e
            if body is None:
                return
            elapsed = time.monotonic() - start
            if elapsed > timeout:
                raise LilyError(f"the server at {url} was still not ready after {timeout:.0f} s: {body}")
            if on_progress is not None:
                on_progress(body, elapsed)
            time.sleep(0.25)


def describe_loading(body: dict, elapsed: float) -> str:
    """One status line from a /health body while loading, whatever progress fields it carries."""
    parts = [str(body.get("status", "loading"))]
    progress = body.get("progress")
    if isinstance(progress, (int, float)) and not isinstance(progress, bool):
        parts.append(f"{progress * 100:.0f}%" if progress <= 1 else f"{progress:.0f}%")
    for key in ("model", "stage", "phase", "message", "detail"):
        if isinstance(body.get(key), str) and body[key]:
            parts.append(body[key])
    parts.append(f"{elapsed:.0f}s")
    return " · ".join(parts)


class LoadingLine:
    """Shows /health's loading state: one rewritten line on a terminal, a line per change otherwise."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.last = ""

    def __call__(self, body: dict, elapsed: float) -> None:
        text = describe_loading(body, elapsed)
        if self.tty:
            self.stream.write("\r\x1b[2K" + text)
            self.stream.flush()
            return
        state = text.rsplit(" · ", 1)[0]  # without the elapsed time
        if state != self.last:
            print(text, file=self.stream, flush=True)
            self.last = state

    def done(self) -> None:
        if self.tty:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()
