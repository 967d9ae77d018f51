"""Hardening (issue 16): big prompts in bounded memory and off the async workers, slow and idle
clients, authentication, error bodies on every status, empty prompts, host names, checkpoint
validation, and what `lily-engine generate` accepts. Scripted backend unless the real one is needed."""

import os
import socket
import subprocess

import httpx
import pytest

from conftest import Server, assert_error, engine_binary, free_port, scripted_model

MSG = [{"role": "user", "content": "hello"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


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


# --- item 6: every error is an OpenAI error object ---------------------------------------------


def test_queue_full_429_says_when_to_retry(slow_scripted):
    """--max-queue 2: one running + two waiting; the rest get 429 with Retry-After."""
    import concurrent.futures as cf

    def one(_):
        return httpx.post(slow_scripted.url + "/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "short story"}], **NO_THINKING})

    with cf.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(one, range(8)))
    refused = [r for r in responses if r.status_code == 429]
    assert refused, [r.status_code for r in responses]
    for r in refused:
        assert_error(r, 429, code="queue_full")
        assert int(r.headers["retry-after"]) >= 1, r.headers


@pytest.mark.parametrize("method,path", [
    ("GET", "/v1/chat/completions"),
    ("GET", "/v1/completions"),
    ("POST", "/v1/models"),
    ("DELETE", "/v1/models/anything"),
    ("POST", "/health"),
    ("PUT", "/metrics"),
])
def test_wrong_method_is_a_405_error_object(scripted_server, method, path):
    r = httpx.request(method, scripted_server.url + path, timeout=10)
    err = assert_error(r, 405, code="method_not_allowed")
    assert method in err["message"] and path in err["message"]
    assert r.headers.get("allow"), r.headers


def raw_request(server, data: bytes, timeout: float = 10) -> tuple[int, dict, bytes]:
    """Sends raw bytes, returns (status, headers, body) of the response (read to EOF or length)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as s:
        s.sendall(data)
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = s.recv(65536)
            if not chunk:
                break
            buf += chunk
        head, _, body = buf.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
        length = int(headers.get("content-length", "-1"))
        while length < 0 or len(body) < length:
            try:
                chunk = s.recv(65536)
            except (ConnectionResetError, socket.timeout):
                break
            if not chunk:
                break
            body += chunk
        return status, headers, body


class Raw:
    def __init__(self, status, headers, body):
        self.status_code, self.headers, self.text = status, headers, body.decode()

    def json(self):
        import json
        return json.loads(self.text)


def test_body_over_the_limit_is_a_413_error_object(scripted_server):
    req = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: 1000000000\r\nConnection: close\r\n\r\n{\"messages\": [")
    r = Raw(*raw_request(scripted_server, req))
    err = assert_error(r, 413, code="request_too_large")
    assert "bytes" in err["message"]


def test_chunked_body_over_the_limit_is_a_413_error_object(scripted_server):
    """No Content-Length: the limit is hit while reading the chunks (64 MiB + a bit, loopback)."""
    piece = b"x" * (1 << 20)

    def body():
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(65):
            yield piece

    try:
        r = httpx.post(scripted_server.url + "/v1/chat/completions", content=body(),
                       headers={"content-type": "application/json"}, timeout=60)
    except httpx.HTTPError:
        pytest.fail("the connection broke instead of answering 413")
    assert_error(r, 413, code="request_too_large")


def test_malformed_chunked_body_is_a_400_error_object(scripted_server):
    req = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\nZZZ\r\n{}\r\n0\r\n\r\n")
    r = Raw(*raw_request(scripted_server, req))
    assert_error(r, 400)
    # and the server still serves
    assert httpx.get(scripted_server.url + "/health").status_code == 200


# --- item 3: slow and idle clients, connection cap, keep-alive limit ----------------------------


@pytest.fixture(scope="module")
def timeouts_server(tmp_path_factory, small_model):
    """Header and body deadlines of one second."""
    server = Server(scripted_model(tmp_path_factory, small_model), "--header-timeout", "1",
                    "--body-timeout", "1").wait_ready()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def capped_server(tmp_path_factory, small_model):
    """Four connections at most, three requests per keep-alive connection."""
    server = Server(scripted_model(tmp_path_factory, small_model), "--max-connections", "4",
                    "--keep-alive-requests", "3").wait_ready()
    yield server
    server.stop()


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` within `seconds` (what it sent before is discarded)."""
    import time
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            if not sock.recv(65536):
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except socket.timeout:
            return False
    return False


def test_half_sent_headers_are_dropped_after_the_header_timeout(timeouts_server):
    with socket.create_connection(("127.0.0.1", timeouts_server.port)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
        assert closed_within(s, 10), "a request whose headers never end is held open"
    with socket.create_connection(("127.0.0.1", timeouts_server.port)) as s:
        assert closed_within(s, 10), "a connection that sends nothing is held open"


def test_idle_keep_alive_connection_is_closed_after_the_header_timeout(timeouts_server):
    with socket.create_connection(("127.0.0.1", timeouts_server.port), timeout=10) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
        assert closed_within(s, 10), "an idle keep-alive connection is held open"


def test_body_shorter_than_its_length_is_a_408_error_object(timeouts_server):
    req = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: 100\r\n\r\n{\"messages\": [")
    r = Raw(*raw_request(timeouts_server, req, timeout=10))
    err = assert_error(r, 408, code="request_timeout")
    assert "1 seconds" in err["message"], err
    assert httpx.get(timeouts_server.url + "/health").status_code == 200


def test_a_slow_but_complete_body_within_the_deadline_is_served(timeouts_server):
    import json
    import time
    body = json.dumps({"messages": [{"role": "user", "content": "plain"}], "max_tokens": 4}).encode()
    with socket.create_connection(("127.0.0.1", timeouts_server.port), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n")
        half = len(body) // 2
        s.sendall(body[:half])
        time.sleep(0.3)
        s.sendall(body[half:])
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


def test_connections_over_the_limit_are_refused_with_503_and_released(capped_server):
    import time
    def hold():
        """A keep-alive connection that has been served once: it holds a slot (None if refused,
        as happens while a connection the previous test closed is still being let go)."""
        s = socket.create_connection(("127.0.0.1", capped_server.port), timeout=10)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        head = b""
        while b"\r\n\r\n" not in head and (chunk := s.recv(65536)):
            head += chunk
        if head.startswith(b"HTTP/1.1 200"):
            return s
        s.close()
        time.sleep(0.1)

    held = []
    deadline = time.monotonic() + 20
    while len(held) < 4:
        assert time.monotonic() < deadline, "could not open four connections"
        if s := hold():
            held.append(s)
    try:
        for _ in range(20):
            r = httpx.get(capped_server.url + "/health", timeout=10)
            err = assert_error(r, 503)
            assert "4 connections" in err["message"], err
            assert r.headers["retry-after"] == "1"
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10
    while httpx.get(capped_server.url + "/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "closed connections did not give their slots back"
        time.sleep(0.05)


def test_keep_alive_connection_closes_after_the_request_limit(capped_server):
    with socket.create_connection(("127.0.0.1", capped_server.port), timeout=10) as s:
        for i in range(3):
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            head = b""
            while b"\r\n\r\n" not in head:
                head += s.recv(65536)
            assert head.startswith(b"HTTP/1.1 200"), head
            assert (b"connection: close" in head.lower()) == (i == 2), (i, head)
        assert closed_within(s, 10)


@pytest.mark.parametrize("option", ["--max-connections", "--header-timeout", "--body-timeout",
                                    "--keep-alive-requests"])
def test_zero_connection_limits_refuse_to_start(small_model, option):
    done = serve_exits(str(small_model), option, "0")
    assert done.returncode != 0
    assert option in done.stderr, done.stderr


# --- item 8: empty chat prompt, `generate --max-tokens` ----------------------------------------


@pytest.fixture(scope="module")
def empty_template_server(tmp_path_factory, small_model):
    """A scripted server whose chat template renders every conversation to nothing."""
    text = tmp_path_factory.mktemp("empty-template")
    for name in ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
        (text / name).symlink_to(small_model / name)
    (text / "chat_template.jinja").write_text("{%- if false %}never{% endif %}")
    server = Server(scripted_model(tmp_path_factory, text)).wait_ready()
    yield server
    server.stop()


def test_chat_prompt_rendered_empty_is_400(empty_template_server):
    for stream in [False, True]:
        r = httpx.post(empty_template_server.url + "/v1/chat/completions", timeout=30,
                       json={"messages": MSG, "stream": stream})
        assert_error(r, 400, param="messages")
    assert httpx.get(empty_template_server.url + "/health").status_code == 200


def generate(model, *args, **kw):
    cmd = [str(engine_binary()), "generate", "--model", str(model), "--device", "cpu", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)


@pytest.mark.parametrize("max_tokens", ["1000000000000", "262142", "262144"])
def test_generate_max_tokens_is_bounded_by_the_context(small_model, max_tokens):
    """The small model's context is 262,144 tokens: 3 prompt ids + these do not fit."""
    done = generate(small_model, "--prompt-ids", "1,2,3", "--max-tokens", max_tokens)
    assert done.returncode != 0
    assert "--max-tokens" in done.stderr and "262144" in done.stderr, done.stderr


def test_generate_fills_the_context_exactly(small_model):
    """The bound is prompt + max_tokens <= context, not stricter (run on a tiny max to stay cheap)."""
    done = generate(small_model, "--prompt-ids", "1,2,3", "--max-tokens", "4")
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.strip().split(",")) == 4


def test_generate_streams_ids_as_they_come(small_model):
    import time
    cmd = [str(engine_binary()), "generate", "--model", str(small_model), "--device", "cpu",
           "--prompt-ids", "1,2,3", "--max-tokens", "120"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        first = proc.stdout.read(1)
        t_first = time.monotonic()
        rest = proc.stdout.read()
        proc.wait(timeout=120)
        t_end = time.monotonic()
    finally:
        proc.kill()
    assert proc.returncode == 0
    ids = (first + rest).decode().strip().split(",")
    assert len(ids) == 120 and all(i.isdigit() for i in ids), ids
    # 120 tokens take seconds on the CPU; the first id came out long before the end.
    assert t_end - t_first > 0.5, t_end - t_first


# --- item 9: host names and bare IPv6 ----------------------------------------------------------


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.parametrize("host,url_host", [
    ("localhost", "127.0.0.1"),
    pytest.param("::1", "[::1]", marks=pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback")),
    pytest.param("[::1]", "[::1]", marks=pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback")),
])
def test_host_names_and_bare_ipv6_are_served(tmp_path_factory, small_model, host, url_host):
    server = Server(scripted_model(tmp_path_factory, small_model), "--host", host)
    server.url = f"http://{url_host}:{server.port}"
    try:
        server.wait_ready(timeout=30)
        assert httpx.get(server.url + "/health").json()["status"] == "ok"
    finally:
        assert server.stop() == 0


def test_unresolvable_host_is_a_clear_error(small_model):
    done = serve_exits(str(small_model), "--host", "no-such-host.invalid")
    assert done.returncode != 0
    assert "--host no-such-host.invalid" in done.stderr, done.stderr


# --- item 7: checkpoint validation (the details are lily-core's tests) --------------------------


@pytest.mark.parametrize("field,value", [
    ("max_position_embeddings", 0),
    ("num_hidden_layers", 0),
    ("eos_token_id", 1e9),
    ("rms_norm_eps", -1),
    ("quantization.bits", 3),
    ("quantization.group_size", 0),
])
def test_invalid_config_refuses_to_serve_naming_the_field(tmp_path, small_model, field, value):
    import json
    model = tmp_path / "model"
    model.mkdir()
    for f in small_model.iterdir():
        if f.name != "config.json":
            (model / f.name).symlink_to(f)
    config = json.loads((small_model / "config.json").read_text())
    if field.startswith("quantization."):
        config["quantization"][field.split(".")[1]] = value
    else:
        config["text_config"][field] = value
        if field == "num_hidden_layers":
            config["text_config"].pop("layer_types", None)
    (model / "config.json").write_text(json.dumps(config))
    done = serve_exits(str(model), "--device", "cpu")
    assert done.returncode != 0
    assert field in done.stderr, done.stderr


# --- item 1 (first part): oversized prompts are refused before they are tokenized ---------------


def test_oversized_chat_prompt_is_refused_by_size_before_tokenizing(scripted_server):
    """The scripted server holds 4096 tokens; no token is longer than 128 bytes, so more than
    4096 × 128 bytes of message text cannot fit, whatever it is."""
    big = "x" * (4096 * 128 + 1)
    r = httpx.post(scripted_server.url + "/v1/chat/completions", timeout=30,
                   json={"messages": [{"role": "system", "content": "be brief"},
                                      {"role": "user", "content": [{"type": "text", "text": big}]}]})
    err = assert_error(r, 400, param="messages", code="context_length_exceeded")
    assert str(4096 * 128) in err["message"] and "bytes" in err["message"], err
    r = httpx.post(scripted_server.url + "/v1/completions", timeout=30, json={"prompt": big})
    err = assert_error(r, 400, param="prompt", code="context_length_exceeded")
    assert str(4096 * 128) in err["message"] and "bytes" in err["message"], err


def test_prompt_just_under_the_size_bound_is_still_tokenized(scripted_server):
    """Under the byte bound the token count decides (this one is too long in tokens)."""
    r = httpx.post(scripted_server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "word " * 5000}]})
    err = assert_error(r, 400, code="context_length_exceeded")
    assert "tokens" in err["message"] and "bytes" not in err["message"], err


def test_body_limit_follows_the_context(scripted_server):
    """4096 tokens × 128 bytes of text, twice over plus a megabyte: 2 MiB; a body over it is a 413
    naming the limit, before the handler reads it."""
    limit = 2 * 4096 * 128 + (1 << 20)
    big = "x" * (limit + 1)
    r = httpx.post(scripted_server.url + "/v1/chat/completions", timeout=30,
                   content=big.encode(), headers={"content-type": "application/json"})
    err = assert_error(r, 413, code="request_too_large")
    assert str(limit) in err["message"], err


def memory_mb(pid: int) -> dict[str, int]:
    """VmRSS (now) and VmHWM (peak) of a process, in MiB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) // 1024
    return out


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs /proc")
@pytest.mark.parametrize("unit", ["word ", "x"])
def test_a_30_mb_prompt_is_refused_in_bounded_memory_and_the_memory_returned(tmp_path_factory, small_model, unit):
    """A 262,144-token context: 30 MB of words is under its byte bound, so the prompt is rendered
    and tokenized — a piece at a time, given up once past the context (encoded whole it took
    gigabytes, 110-170 times the body, and kept most of it). 30 MB of one letter cannot be cut into
    pieces and is refused without being encoded."""
    server = Server(scripted_model(tmp_path_factory, small_model), "--ctx-size", "262144").wait_ready()
    try:
        before = memory_mb(server.proc.pid)
        text = unit * (30_000_000 // len(unit))
        r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                       json={"messages": [{"role": "user", "content": text}]})
        err = assert_error(r, 400, param="messages")
        del text
        after = memory_mb(server.proc.pid)
        # The body, its JSON and the rendered prompt are ~30 MB each; the encoder's pieces 64 KiB.
        assert after["VmHWM"] - before["VmRSS"] < 600, (before, after, err)
        assert after["VmRSS"] - before["VmRSS"] < 200, (before, after, err)
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        server.stop()


# --- item 2: rendering and tokenizing stay off the async workers ---------------------------------


def test_health_stays_responsive_while_a_big_prompt_is_tokenized(tmp_path_factory, small_model):
    """One async worker (TOKIO_WORKER_THREADS=1): a 30 MB prompt (under the byte bound of a
    262,144-token context, over its token count) takes most of a second to parse, render and
    tokenize up to the context; on the worker, /health would wait for all of it."""
    import threading
    import time

    server = Server(scripted_model(tmp_path_factory, small_model), "--ctx-size", "262144",
                    env={"TOKIO_WORKER_THREADS": "1"}).wait_ready()
    try:
        big = "word " * 6_000_000
        took = {}

        def one():
            t = time.monotonic()
            r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                           json={"messages": [{"role": "user", "content": big}]})
            took["request"] = time.monotonic() - t
            took["status"] = r.status_code

        worker = threading.Thread(target=one)
        worker.start()
        time.sleep(0.15)  # the body is in; the template and tokenizer are at work
        latencies = []
        while worker.is_alive():
            t = time.monotonic()
            assert httpx.get(server.url + "/health", timeout=60).status_code == 200
            latencies.append(time.monotonic() - t)
            time.sleep(0.02)
        worker.join()
        assert took["status"] == 400
        assert latencies, "the request finished before /health was asked"
        # Blocked behind the tokenizer, a /health would wait for most of the request (≥ 0.6 of
        # it: it starts 0.15 s in); answered beside it, a small fraction, whatever the machine's
        # load (0.07-0.21 s of a 0.93 s request on a busy 2-core machine).
        assert max(latencies) < 0.5 * took["request"], (max(latencies), took)
    finally:
        server.stop()
