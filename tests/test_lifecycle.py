"""Loading, cancellation on disconnect, graceful shutdown (scripted backend: deterministic timing)."""

import json
import signal
import time

import httpx
import pytest

from conftest import SCRIPT, Server


def wait_for(predicate, timeout=10.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError


def test_health_is_503_while_loading_then_200(tmp_path, small_model):
    path = tmp_path / "script.json"
    path.write_text(json.dumps({"tokenizer": str(small_model), "load_delay_ms": 1500, **SCRIPT}))
    server = Server(f"scripted:{path}")
    try:
        r = wait_for(lambda: _get(server.url + "/health"))
        assert r.status_code == 503
        assert r.json()["status"] == "loading" and r.json()["stage"]
        # Requests meanwhile get a 503 error object, not a hang.
        chat = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 503 and chat.json()["error"]["code"] == "model_loading"
        server.wait_ready(timeout=30)
        r = httpx.get(server.url + "/health")
        assert r.status_code == 200 and r.json()["status"] == "ok"
    finally:
        assert server.stop() == 0


def _get(url):
    try:
        return httpx.get(url, timeout=1)
    except httpx.HTTPError:
        return None


def test_client_disconnect_cancels_generation(slow_scripted):
    """A 1500-word reply at 10 ms/token would take ~30 s; closing the stream after a few chunks
    must end the generation at once (the engine is free for the next request)."""
    before = slow_scripted.metrics()
    with httpx.stream("POST", slow_scripted.url + "/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "a long story"}], "stream": True}, timeout=30) as r:
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
            if seen == 5:
                break
    closed_at = time.time()

    def cancelled():
        m = slow_scripted.metrics()
        return m.get('lily_generations_total{finish_reason="cancelled"}', 0) > before.get('lily_generations_total{finish_reason="cancelled"}', 0) and m

    m = wait_for(cancelled, timeout=5)
    assert time.time() - closed_at < 2
    generated = m["lily_generated_tokens_total"] - before.get("lily_generated_tokens_total", 0)
    assert generated < 100, f"generation ran on after the disconnect: {generated} tokens"
    # The engine is free again: a short request completes promptly.
    start = time.time()
    r = httpx.post(slow_scripted.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "plain"}]}, timeout=30)
    assert r.status_code == 200 and time.time() - start < 3


def test_non_streaming_client_that_gives_up_cancels_too(slow_scripted):
    before = slow_scripted.metrics()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow_scripted.url + "/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "a long story"}]}, timeout=0.5)
    key = 'lily_generations_total{finish_reason="cancelled"}'
    m = wait_for(lambda: (lambda m: m.get(key, 0) > before.get(key, 0) and m)(slow_scripted.metrics()), timeout=5)
    assert m["lily_generated_tokens_total"] - before.get("lily_generated_tokens_total", 0) < 150


def test_sigterm_drains_in_flight_streams_and_exits_cleanly(slow_scripted):
    with httpx.stream("POST", slow_scripted.url + "/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "a short story"}], "stream": True,
                            "chat_template_kwargs": {"enable_thinking": False}}, timeout=30) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert "assistant" in first
        slow_scripted.proc.send_signal(signal.SIGTERM)
        rest = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert rest[-1] == "[DONE]"
    content = "".join(json.loads(e)["choices"][0]["delta"].get("content") or "" for e in rest[:-1] if json.loads(e)["choices"])
    assert content.endswith("word59"), "the in-flight answer was completed"
    assert json.loads(rest[-2])["choices"][0]["finish_reason"] == "stop"
    assert slow_scripted.proc.wait(timeout=15) == 0


def test_ctrl_c_stops_an_idle_server_cleanly(slow_scripted):
    slow_scripted.proc.send_signal(signal.SIGINT)
    assert slow_scripted.proc.wait(timeout=15) == 0
