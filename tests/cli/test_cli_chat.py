"""`lily chat`: one-shot and conversation, reasoning shown or hidden, own server or a running one."""

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from lily_harness import LilyProcess, free_port, process_alive
from typer.testing import CliRunner

from lilycli import cli
from lilycli.cli import app

runner = CliRunner()


def start_fake_server(fake_engine, tmp_path, load_seconds="0.5", token_delay="0"):
    port = free_port()
    process = subprocess.Popen(
        [str(fake_engine), "serve", "--model", str(tmp_path), "--port", str(port), "--api-key", "k3y"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "FAKE_LOAD_SECONDS": load_seconds, "FAKE_TOKEN_DELAY": token_delay},
    )
    return process, f"http://127.0.0.1:{port}"


@pytest.fixture
def fake_server(fake_engine, tmp_path):
    """The fake engine serving on a free port; yields its base URL."""
    process, url = start_fake_server(fake_engine, tmp_path)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    yield url
    process.terminate()
    process.wait(timeout=10)


def chat(*args: str, input: str | None = None):
    return runner.invoke(app, ["chat", *args, "--api-key", "k3y"], input=input)


def test_one_shot_streams_the_answer_to_stdout_and_the_reasoning_to_stderr(fake_server):
    result = chat("hello there", "--url", fake_server)
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "You said: hello there (turn 1, 1 messages)\n"
    assert "Thinking about it." in result.stderr


def test_hide_reasoning_drops_the_thinking(fake_server):
    result = chat("hello", "--url", fake_server, "--hide-reasoning")
    assert result.exit_code == 0
    assert "Thinking" not in result.stderr
    assert result.stdout.startswith("You said: hello")


def test_no_think_asks_the_server_not_to_think(fake_server):
    # The fake engine thinks unless chat_template_kwargs.enable_thinking is false.
    result = chat("hello", "--url", f"{fake_server}/v1", "--no-think")
    assert result.exit_code == 0
    assert "Thinking" not in result.stderr


def test_system_prompt_and_max_tokens_reach_the_server(fake_server):
    result = chat("hi", "--url", fake_server, "--system", "Be brief", "--max-tokens", "2")
    assert result.exit_code == 0
    assert result.stdout == "You said:\n"
    assert "[stopped: max tokens reached]" in result.stderr
    full = chat("hi", "--url", fake_server, "--system", "Be brief")
    assert "(turn 1, 2 messages, system='Be brief')" in full.stdout


def test_dash_reads_the_prompt_from_stdin(fake_server):
    result = chat("-", "--url", fake_server, input="from a pipe")
    assert result.exit_code == 0
    assert result.stdout.startswith("You said: from a pipe")


def test_repl_keeps_the_conversation_until_reset(fake_server):
    result = chat("--url", fake_server, input="first\nsecond\n/reset\nthird\n/exit\nnever sent\n")
    assert result.exit_code == 0, result.stderr
    answers = [line for line in result.stdout.split(">>> ") if "You said" in line]
    assert [a.strip() for a in answers] == [
        "You said: first (turn 1, 1 messages)",
        "You said: second (turn 2, 3 messages)",  # the first question and answer went along
        "You said: third (turn 1, 1 messages)",
    ]
    assert "(conversation cleared)" in result.stderr


def test_repl_ends_on_end_of_input(fake_server):
    result = chat("--url", fake_server, input="only one\n")
    assert result.exit_code == 0
    assert "You said: only one" in result.stdout


def test_a_refused_request_is_reported(fake_server):
    result = runner.invoke(app, ["chat", "hi", "--url", fake_server, "--api-key", "wrong"])
    assert result.exit_code == 1
    assert "the server refused the request: HTTP 401: invalid api key" in result.stderr


def test_an_unreachable_url_is_reported():
    url = f"http://127.0.0.1:{free_port()}"
    result = chat("hi", "--url", url)
    assert result.exit_code == 1
    assert f"cannot reach a server at {url}" in result.stderr


def test_without_url_or_model_it_needs_a_running_server(monkeypatch):
    monkeypatch.setattr(cli, "DEFAULT_URL", f"http://127.0.0.1:{free_port()}")
    result = chat("hi")
    assert result.exit_code == 1
    assert "no Lily server answers" in result.stderr and "lily serve" in result.stderr


def test_without_url_it_uses_the_server_at_the_default_address(fake_server, monkeypatch):
    monkeypatch.setattr(cli, "DEFAULT_URL", fake_server)
    result = chat("hi")
    assert result.exit_code == 0
    assert result.stdout.startswith("You said: hi")


def test_model_starts_a_server_for_the_call_and_stops_it(fake_engine, tmp_path, monkeypatch):
    pid_file = tmp_path / "engine.pid"
    monkeypatch.setenv("FAKE_PID_FILE", str(pid_file))
    model = tmp_path / "model"
    model.mkdir()
    result = chat("hello", "--model", str(model))
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "You said: hello (turn 1, 1 messages)\n"
    assert not process_alive(int(pid_file.read_text()))


def test_url_and_model_together_are_refused(fake_server, tmp_path):
    result = chat("hi", "--url", fake_server, "--model", str(tmp_path))
    assert result.exit_code == 2
    # This refusal, not another usage error; and nothing was asked of the server.
    assert "--url" in result.stderr and "--model" in result.stderr and "not both" in result.stderr, result.stderr
    assert result.stdout == ""


def test_the_lily_command_runs_as_a_module():
    checkout = cli.__file__.rsplit("/lilycli/", 1)[0]
    out = subprocess.run(
        [sys.executable, "-m", "lilycli", "--version"], check=False, capture_output=True, text=True, cwd=checkout
    )
    assert out.returncode == 0 and out.stdout.startswith("lily ")


def test_a_server_still_loading_is_waited_for(fake_engine, tmp_path):
    process, url = start_fake_server(fake_engine, tmp_path, load_seconds="2")
    try:
        time.sleep(0.5)  # listening, not ready yet
        result = chat("hello", "--url", url)
        assert result.exit_code == 0, result.stderr
        assert "loading" in result.stderr
        assert result.stdout.startswith("You said: hello")
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_ctrl_c_in_the_repl_stops_the_reply_and_keeps_the_conversation(fake_engine, tmp_path):
    process, url = start_fake_server(fake_engine, tmp_path, token_delay="0.15")
    lily = LilyProcess("chat", "--url", url, "--api-key", "k3y", stdin=subprocess.PIPE)
    try:
        lily.process.stdin.write("first\n")
        lily.process.stdin.flush()
        deadline = time.monotonic() + 20
        while "Thinking" not in lily.err and time.monotonic() < deadline:
            time.sleep(0.05)
        lily.process.send_signal(signal.SIGINT)
        while "[interrupted]" not in lily.err and time.monotonic() < deadline:
            time.sleep(0.05)
        lily.process.stdin.write("second\n")
        lily.process.stdin.close()
        assert lily.wait() == 0
        # The interrupted turn was forgotten: the next one is turn 1 again.
        assert "You said: second (turn 1, 1 messages)" in lily.out
        assert "You said: first" not in lily.out
    finally:
        lily.kill()
        process.terminate()
        process.wait(timeout=10)
