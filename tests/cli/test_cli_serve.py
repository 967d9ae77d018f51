"""`lily serve`: launch, wait for /health, print the URL, forward signals, and explain every failure."""

import signal
import socket
import time

import httpx
import pytest
from lily_harness import LilyProcess, free_port, hub_cache_copy, process_alive
from typer.testing import CliRunner

from lilycli.cli import app

runner = CliRunner()


def serve_fake(tmp_path, *extra: str, env: dict | None = None) -> tuple[LilyProcess, int]:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    port = free_port()
    pid_file = tmp_path / "engine.pid"
    env = {"FAKE_PID_FILE": str(pid_file), **(env or {})}
    return LilyProcess("serve", "--model", str(model), "--port", str(port), *extra, env=env), port


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_serve_prints_url_when_ready_and_forwards_the_signal(fake_engine, tmp_path, signum):
    lily, port = serve_fake(tmp_path, env={"FAKE_LOAD_SECONDS": "1.0"})
    try:
        url = lily.wait_for_url()
        assert url == f"http://127.0.0.1:{port}"
        # Beside the API's URL, the chat page's.
        deadline = time.monotonic() + 5
        while f"Chat in your browser: {url}/\n" not in lily.out:
            assert time.monotonic() < deadline, lily.out
            time.sleep(0.05)
        # The URL is printed only once the engine is ready.
        assert httpx.get(f"{url}/health").json()["status"] == "ok"
        # While it loaded, the progress the engine reports was shown.
        assert "loading" in lily.err and "weights" in lily.err
        engine_pid = int((tmp_path / "engine.pid").read_text())
        lily.process.send_signal(signum)
        assert lily.wait() == 0
        assert f"received {signal.Signals(signum).name}" in lily.err  # forwarded as is, logged by the engine
        assert not process_alive(engine_pid)
    finally:
        lily.kill()


def test_serve_passes_engine_options_through(fake_engine, tmp_path):
    lily, _ = serve_fake(tmp_path, "--api-key", "sekret", "--ctx-size", "4096", "--device", "cpu")
    try:
        url = lily.wait_for_url()
        assert httpx.get(f"{url}/v1/models").status_code == 401
        ok = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer sekret"})
        assert ok.json()["data"][0]["id"] == "fake-model"
    finally:
        lily.process.send_signal(signal.SIGTERM)
        lily.wait()


def test_serve_with_no_webui_prints_no_chat_page(fake_engine, tmp_path):
    lily, _ = serve_fake(tmp_path, "--no-webui")
    try:
        lily.wait_for_url()
        time.sleep(0.3)  # what would follow the URL line has been printed by now
        assert "Chat in your browser" not in lily.out
    finally:
        lily.process.send_signal(signal.SIGTERM)
        lily.wait()


def test_serve_without_binary_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("LILY_ENGINE", str(tmp_path / "no-such-engine"))
    result = runner.invoke(app, ["serve", "--model", str(tmp_path)])
    assert result.exit_code == 1
    assert "no-such-engine is not an executable file" in result.stderr


def test_serve_reports_a_port_in_use(fake_engine, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = runner.invoke(app, ["serve", "--model", str(tmp_path), "--port", str(port)])
    assert result.exit_code == 1
    assert f"port {port} on 127.0.0.1 is already in use" in result.stderr


def test_serve_reports_an_engine_that_dies_while_loading(fake_engine, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_DIE_LOADING", "1")
    result = runner.invoke(app, ["serve", "--model", str(tmp_path), "--port", str(free_port())])
    assert result.exit_code == 1
    assert "lily-engine exited while loading (exit code 3)" in result.stderr
    # The engine's own last words are shown, so the user sees the cause.
    assert "mlp.gate.weight has shape [1, 2], expected [256, 512]" in result.stderr
    assert "ERROR cannot load the model" in result.stderr and "\x1b" not in result.stderr


def test_serve_reports_an_engine_that_dies_after_ready(fake_engine, tmp_path):
    lily, _ = serve_fake(tmp_path, env={"FAKE_DIE_AFTER_READY": "0.5"})
    try:
        lily.wait_for_url()
        assert lily.wait() == 1
        assert "lily-engine stopped unexpectedly (exit code 4)" in lily.err
        assert "illegal memory access" in lily.err
    finally:
        lily.kill()


def test_serve_gives_up_after_the_timeout_and_stops_the_engine(fake_engine, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_LOAD_SECONDS", "60")
    pid_file = tmp_path / "engine.pid"
    monkeypatch.setenv("FAKE_PID_FILE", str(pid_file))
    started = time.monotonic()
    result = runner.invoke(app, ["serve", "--model", str(tmp_path), "--port", str(free_port()), "--timeout", "1"])
    assert result.exit_code == 1
    assert time.monotonic() - started < 20
    assert "not ready after 1 s" in result.stderr
    assert not process_alive(int(pid_file.read_text()))


def test_serve_rejects_a_model_that_is_neither_directory_nor_repo(fake_engine, tmp_path):
    result = runner.invoke(app, ["serve", "--model", str(tmp_path / "missing")])
    assert result.exit_code == 2
    assert "no such model directory" in result.stderr


def test_serve_rejects_an_unknown_synthetic_preset(fake_engine):
    result = runner.invoke(app, ["serve", "--model", "synthetic:huge"])
    assert result.exit_code == 2
    assert "unknown synthetic model 'synthetic:huge'" in result.stderr


def test_serve_a_repo_uses_its_downloaded_copy(fake_engine, tmp_path):
    snapshot = hub_cache_copy("lily-test/served")
    port = free_port()
    lily = LilyProcess("serve", "--model", "lily-test/served", "--port", str(port))
    try:
        url = lily.wait_for_url()
        assert httpx.get(f"{url}/health").json()["model"] == str(snapshot)
    finally:
        lily.process.send_signal(signal.SIGTERM)
        lily.wait()


def test_serve_a_repo_not_downloaded_offline_explains(fake_engine):
    result = runner.invoke(app, ["serve", "--model", "lily-test/not-here", "--port", str(free_port())])
    assert result.exit_code == 1
    assert "fetching it first" in result.stderr
    assert "cannot reach the Hugging Face Hub" in result.stderr


def test_a_killed_lily_takes_its_engine_along(fake_engine, tmp_path):
    lily, _ = serve_fake(tmp_path)
    try:
        lily.wait_for_url()
        engine_pid = int((tmp_path / "engine.pid").read_text())
        lily.process.kill()  # SIGKILL: no cleanup code of ours runs
        lily.process.wait()
        deadline = time.monotonic() + 10
        while process_alive(engine_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not process_alive(engine_pid)
    finally:
        lily.kill()
