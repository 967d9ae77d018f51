"""Hardening (issue 16): authentication, error bodies on every status, empty prompts, host names,
and what `lily-engine generate` accepts. Scripted backend unless the real one is needed."""

import socket
import subprocess

import httpx
import pytest

from conftest import Server, engine_binary, free_port, scripted_model

MSG = [{"role": "user", "content": "hello"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def assert_error(resp, status, param=None, code=None):
    assert resp.status_code == status, (resp.status_code, resp.headers, resp.text)
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def serve_exits(model: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """Runs `serve` expecting it to refuse to start (a hang is a failure, not a wait)."""
    cmd = [str(engine_binary()), "serve", "--model", model, "--port", str(free_port()), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


# --- item 4: authentication -------------------------------------------------------------------


@pytest.mark.parametrize("key", ["", "   ", "\t"])
def test_empty_api_key_refuses_to_start(small_model, key):
    done = serve_exits(str(small_model), "--api-key", key)
    assert done.returncode != 0
    assert "--api-key" in done.stderr and "empty" in done.stderr, done.stderr


@pytest.fixture(scope="module")
def padded_key_server(tmp_path_factory, small_model):
    server = Server(scripted_model(tmp_path_factory, small_model), "--api-key", "  sekrit \n").wait_ready()
    yield server
    server.stop()


def test_configured_key_is_trimmed_like_the_clients(padded_key_server):
    r = httpx.get(padded_key_server.url + "/v1/models", headers={"Authorization": "Bearer sekrit"})
    assert r.status_code == 200, r.text
    r = httpx.get(padded_key_server.url + "/v1/models", headers={"Authorization": "Bearer   sekrit"})
    assert r.status_code == 200, r.text
    assert_error(httpx.get(padded_key_server.url + "/v1/models",
                           headers={"Authorization": "Bearer sekri"}), 401, code="invalid_api_key")
    assert_error(httpx.get(padded_key_server.url + "/v1/models"), 401, code="invalid_api_key")


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_bearer_scheme_is_case_insensitive(padded_key_server, scheme):
    r = httpx.get(padded_key_server.url + "/v1/models", headers={"Authorization": f"{scheme} sekrit"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("value", ["Basic sekrit", "sekrit", "Bearersekrit", "Bearer"])
def test_other_schemes_are_401(padded_key_server, value):
    assert_error(httpx.get(padded_key_server.url + "/v1/models", headers={"Authorization": value}), 401)
