"""`lily serve` (and the server `lily chat` starts for one call): resolve the model, launch the engine,
wait until /health says ready, and stop it cleanly whatever happens (Ctrl-C, SIGTERM, an error)."""

import contextlib
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from lilycli.engine import EngineProcess, client_url, find_engine, port_in_use
from lilycli.errors import LilyError
from lilycli.health import LoadingLine
from lilycli.models import resolve_model


@dataclass
class ServeOptions:
    model: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    ctx_size: int | None = None
    max_queue: int | None = None
    device: str | None = None
    timeout: float = 1800.0
    extra: list[str] = field(default_factory=list)  # passed to `lily-engine serve` untouched


class Terminated(BaseException):
    """SIGTERM reached us. A BaseException, like KeyboardInterrupt, so no `except Exception` swallows it."""


@contextlib.contextmanager
def terminate_raises() -> Iterator[None]:
    """Turn SIGTERM into `Terminated` so cleanup code runs (by default SIGTERM kills Python outright).

    Ctrl-C already arrives as KeyboardInterrupt; both end up in `running_engine`'s cleanup, which
    forwards the same signal to the engine.
    """

    def handler(_signum, _frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def engine_args(model_dir: Path, opts: ServeOptions) -> list[str]:
    args = ["serve", "--model", str(model_dir), "--host", opts.host, "--port", str(opts.port)]
    for flag, value in (("--api-key", opts.api_key), ("--ctx-size", opts.ctx_size),
                        ("--max-queue", opts.max_queue), ("--device", opts.device)):  # fmt: skip
        if value is not None:
            args += [flag, str(value)]
    return args + list(opts.extra)


@contextlib.contextmanager
def running_engine(opts: ServeOptions, log=print) -> Iterator[tuple[EngineProcess, str]]:
    """A ready engine serving `opts.model`, and its base URL; stopped when the block exits."""
    binary = find_engine()
    # The port before the model: no point generating or downloading one for a port we cannot have.
    if port_in_use(opts.host, opts.port):
        raise LilyError(
            f"port {opts.port} on {opts.host} is already in use (another `lily serve`?); "
            "stop it or choose another port with --port"
        )
    model_dir = resolve_model(opts.model, binary, log=log)
    url = client_url(opts.host, opts.port)
    engine = EngineProcess(binary, engine_args(model_dir, opts))
    log(f"starting {binary} with model {model_dir}")
    engine.start()
    stop_signal = signal.SIGTERM
    try:
        loading = LoadingLine()
        try:
            engine.wait_ready(url, opts.timeout, opts.api_key, on_progress=loading)
        finally:
            loading.done()
        yield engine, url
    except KeyboardInterrupt:
        stop_signal = signal.SIGINT
        raise
    finally:
        was_running = engine.returncode() is None
        code = engine.stop(stop_signal)
        if was_running and code == -signal.SIGKILL:
            log("lily-engine did not stop in time and was killed")
        elif was_running and code not in (0, -stop_signal, 128 + stop_signal):
            log(f"lily-engine exited with code {code} while stopping")
