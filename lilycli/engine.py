"""Find the `lily-engine` binary, run it, and watch it: log tail, /health wait, signals, shutdown.

Everything the engine does stays in the engine; this module only starts the process and reports on
it. The binary is looked up, in order, at:
  1. $LILY_ENGINE (an explicit path wins, and a wrong one is an error, not a fallback);
  2. the interpreter's scripts directory, where the wheel installs it (maturin "bin" bindings);
  3. a development build: $CARGO_TARGET_DIR or <checkout>/target, release before debug;
  4. `lily-engine` on PATH.
"""

import collections
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from lilycli.errors import LilyError
from lilycli.health import read_health

BINARY = "lily-engine" + (".exe" if os.name == "nt" else "")
CHECKOUT = Path(__file__).resolve().parent.parent  # the repo root when running from a checkout
LOG_TAIL_LINES = 40
# The engine drains in-flight requests for up to 10 s on SIGTERM/SIGINT; a little more before SIGKILL.
STOP_GRACE_S = 15.0
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def _candidates() -> list[Path]:
    found = []
    for scheme in (None, f"{os.name}_user"):
        try:
            scripts = sysconfig.get_path("scripts", scheme) if scheme else sysconfig.get_path("scripts")
        except KeyError:
            continue
        if scripts:
            found.append(Path(scripts) / BINARY)
    found.append(Path(sys.executable).parent / BINARY)
    if (CHECKOUT / "Cargo.toml").is_file():
        target = Path(os.environ.get("CARGO_TARGET_DIR") or CHECKOUT / "target")
        found += [target / "release" / BINARY, target / "debug" / BINARY]
    on_path = shutil.which(BINARY)
    if on_path:
        found.append(Path(on_path))
    return found


def find_engine() -> Path:
    """The lily-engine binary to run, or a LilyError saying where we looked and how to build it."""
    explicit = os.environ.get("LILY_ENGINE")
    if explicit:
        path = Path(explicit).expanduser()
        if path.is_file() and os.access(path, os.X_OK):
            return path
        raise LilyError(f"LILY_ENGINE={explicit} is not an executable file")
    candidates = _candidates()
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return path
    looked = "\n".join(f"  {p}" for p in dict.fromkeys(candidates))
    raise LilyError(
        f"cannot find the {BINARY} binary. Looked at:\n{looked}\n"
        "Install the package with `pipx install .` (builds it with cargo), or build it with "
        "`cargo build --release -p lily-server`, or point LILY_ENGINE at it."
    )


def engine_version(binary: Path) -> str:
    """`lily-engine --version`, used to key caches of what the engine generates."""
    try:
        out = subprocess.run([str(binary), "--version"], check=False, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise LilyError(f"cannot run {binary} --version: {e}") from e
    return out.stdout.strip() or "unknown"


def port_in_use(host: str, port: int) -> bool:
    """True when something already listens on host:port (binds the way the engine will: SO_REUSEADDR)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror:
        return False  # an unresolvable host is the engine's error to report
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(address)
            except OSError:
                return True
    return False


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def client_url(host: str, port: int) -> str:
    """The base URL a client on this machine uses to reach a server bound to host:port."""
    reach = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    if ":" in reach:
        reach = f"[{reach}]"
    return f"http://{reach}:{port}"


def _load_prctl():
    if sys.platform != "linux":
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when `lily` dies, even by SIGKILL (Linux PR_SET_PDEATHSIG).

    The engine runs in its own session (so a terminal's Ctrl-C reaches only us), which also means
    nothing else would stop it: a killed `lily chat --model ...` must not leave a loaded model behind.
    """
    _PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)


class EngineDied(LilyError):
    pass


class EngineProcess:
    """One running lily-engine: its output kept in a tail (and echoed when asked), stopped on exit.

    The engine runs in its own session so a terminal's Ctrl-C reaches only us; we forward it
    (`stop`), which lets the engine shut down cleanly and us report what happened.
    """

    def __init__(self, binary: Path, args: list[str], echo: bool = False):
        self.command = [str(binary), *args]
        self.echo = echo
        self.tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self.process: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        try:
            self.process = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                bufsize=1,
                start_new_session=True,
                # Safe here: lily starts the engine before any thread of its own, and the hook
                # makes one C call prepared in the parent (no import, no lock taken after fork).
                preexec_fn=_die_with_parent if _PRCTL is not None else None,  # noqa: PLW1509
            )
        except OSError as e:
            raise LilyError(f"cannot start {self.command[0]}: {e}") from e
        self._reader = threading.Thread(target=self._read_output, daemon=True)
        self._reader.start()

    def _read_output(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        for raw in self.process.stdout:
            raw = raw.rstrip("\n")
            plain = ANSI_ESCAPE.sub("", raw)  # the engine colours its log even into a pipe
            self.tail.append(plain)
            if self.echo:
                print(raw if sys.stderr.isatty() else plain, file=sys.stderr, flush=True)

    def last_lines(self) -> list[str]:
        if self._reader is not None:
            self._reader.join(timeout=1.0)  # let the reader drain what a dead process left behind
        return list(self.tail)

    def returncode(self) -> int | None:
        return None if self.process is None else self.process.poll()

    def died(self, what: str) -> EngineDied:
        code = self.returncode()
        reason = f"exit code {code}" if code is not None and code >= 0 else f"signal {-(code or 0)}"
        lines = self.last_lines()
        hint = ""
        if any("address already in use" in line.lower() for line in lines):
            hint = " (its port is taken: choose another with --port)"
        return EngineDied(
            f"lily-engine {what} ({reason}){hint}. Its last log lines:",
            details=lines or ["(no output)"],
        )

    def wait_ready(
        self,
        url: str,
        timeout: float,
        api_key: str | None = None,
        on_progress: Callable[[dict, float], None] | None = None,
    ) -> None:
        """Poll GET /health until it answers 200; report the loading body via `on_progress`."""
        start = time.monotonic()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        with httpx.Client(timeout=2.0, headers=headers) as client:
            while True:
                if self.returncode() is not None:
                    raise self.died("exited while loading")
                elapsed = time.monotonic() - start
                if elapsed > timeout:
                    raise LilyError(
                        f"lily-engine was not ready after {timeout:.0f} s (raise --timeout for big models). "
                        "Its last log lines:",
                        details=self.last_lines() or ["(no output)"],
                    )
                try:
                    body = read_health(client, url)
                except httpx.TransportError:
                    body = {"status": "starting"}  # not listening yet
                if body is None:
                    return
                if on_progress is not None:
                    on_progress(body, elapsed)
                time.sleep(0.2)

    def send(self, signum: int) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                self.process.send_signal(signum)
            except ProcessLookupError:
                pass

    def stop(self, signum: int = signal.SIGTERM, grace: float = STOP_GRACE_S) -> int | None:
        """Ask the engine to stop with `signum`; kill it if it is still there after `grace` seconds."""
        if self.process is None:
            return None
        self.send(signum)
        try:
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        except BaseException:  # a second Ctrl-C or SIGTERM while waiting: stop waiting, never leave it behind
            self.process.kill()
            self.process.wait()
            raise
        self.last_lines()
        return self.process.returncode

    def wait(self) -> int:
        """Block until the engine exits; short waits so Python can run signal handlers meanwhile."""
        assert self.process is not None
        while True:
            try:
                return self.process.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                continue
