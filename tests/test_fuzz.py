"""Request fuzzer (issue 16): 10,000 generated requests against `lily-engine serve` on loopback —
well-formed requests with fields of every wrong type and out-of-range value, broken and hostile
JSON, unknown paths and methods — and the server must answer every one of them: no 5xx, no hang,
no panic, and every error an OpenAI error object.

The generator is seeded (LILY_FUZZ_SEED, default 16) so a failure names the request that caused it;
LILY_FUZZ_REQUESTS changes the count. The server is the scripted backend (no reply fails on
purpose), so generation is cheap and the run takes about a minute.
"""

import concurrent.futures as cf
import json
import os
import random
import threading
import time

import httpx
import pytest

from conftest import Server

SEED = int(os.environ.get("LILY_FUZZ_SEED", "16"))
REQUESTS = int(os.environ.get("LILY_FUZZ_REQUESTS", "10000"))
#: A request that takes longer than this is a hang.
HANG_SECONDS = 30

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
SCRIPT = {
    "replies": [
        {"when": "weather", "text": "Checking.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
                                    "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"},
        {"when": "riddle", "text": "Hmm.\n</think>\n\n42"},
    ],
    "default": "Hello! How can I help?",
}

STRINGS = ["", " ", "hi", "weather in Paris?", "riddle", "\u0000", "\ud7ff\u00e9\u4e2d\U0001F600", "<|im_start|>",
           "<|im_end|>", "<think>", "</think>", "<tool_call>", "<function=get_weather>", "{{ 7*7 }}",
           "{% for x in range(9) %}", "\\", "\"", "a" * 5000, "word " * 2000, "\n" * 300, "\t\r\n",
           "user", "assistant", "system", "tool", "developer", "function", "auto", "none", "required",
           "json_object", "json_schema", "text", "-1", "1e309", "NaN", "null", "true"]
NUMBERS = [0, 1, -1, 2, 3, 16, 20, 21, 100, 4095, 4096, 4097, 2**31, 2**53 + 1, 2**63, -2**63, 2**64, 10**30,
           0.0, 0.5, -0.5, 1.5, 2.0, 2.0001, 1e-300, 1e300, -1e300, 248319, 248320, 248046]


def scalar(rng):
    kind = rng.randrange(5)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.choice(NUMBERS)
    return rng.choice(STRINGS)


def value(rng, depth=0):
    """Any JSON value, shallow."""
    r = rng.random()
    if depth > 2 or r < 0.6:
        return scalar(rng)
    if r < 0.8:
        return [value(rng, depth + 1) for _ in range(rng.randrange(4))]
    return {rng.choice(STRINGS + ["role", "content", "type", "text", "name"]): value(rng, depth + 1)
            for _ in range(rng.randrange(4))}


def maybe(rng, good, weight=1.0):
    """`good()`, or now and then any value at all: how often is the request's `rng.badness` (so
    some requests are entirely well-formed, others wrong in one place or in many) times `weight`."""
    return value(rng) if rng.random() < rng.badness * weight else good()


def message(rng):
    role = maybe(rng, lambda: rng.choice(["system", "developer", "user", "assistant", "tool"]), 0.5)
    m = {"role": role}
    r = rng.random()
    if r < 0.6:
        m["content"] = rng.choice(STRINGS)
    elif r < 0.75:
        m["content"] = [maybe(rng, lambda: {"type": rng.choice(["text", "image_url", "input_audio"]),
                                             "text": maybe(rng, lambda: rng.choice(STRINGS))})
                        for _ in range(rng.randrange(3))]
    elif r < 0.9:
        m["content"] = value(rng)
    if role == "assistant" and rng.random() < 0.4:
        m["tool_calls"] = [maybe(rng, lambda: {
            "id": "call_1", "type": "function",
            "function": {"name": maybe(rng, lambda: "get_weather"),
                         "arguments": maybe(rng, lambda: rng.choice(['{"city": "Paris"}', "{", "[]", "", "null"]))}})
            for _ in range(rng.randrange(3))]
    if role == "assistant" and rng.random() < 0.2:
        m["reasoning_content"] = maybe(rng, lambda: rng.choice(STRINGS))
    if role == "tool" and rng.random() < 0.5:
        m["tool_call_id"] = maybe(rng, lambda: "call_1")
    if rng.random() < 0.1:
        m[rng.choice(STRINGS)] = value(rng)
    return m


def conversation(rng):
    """A conversation the template accepts: a system message or not, then turns that alternate,
    the assistant's perhaps calling the tool and the tool answering, ending with the user."""
    text = lambda: rng.choice(STRINGS[1:])  # noqa: E731
    msgs = [{"role": "system", "content": text()}] if rng.random() < 0.3 else []
    msgs.append({"role": "user", "content": text()})
    for _ in range(rng.randrange(3)):
        if rng.random() < 0.3:
            msgs.append({"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": text()})}}]})
            msgs.append({"role": "tool", "tool_call_id": "call_1", "content": text()})
        else:
            msgs.append({"role": "assistant", "content": text()})
        msgs.append({"role": "user", "content": text()})
    return msgs


def sampling(rng, body):
    for field, good in [
        ("temperature", lambda: rng.choice([0, 0.7, 1.0, 2.0])),
        ("top_p", lambda: rng.choice([0.1, 0.95, 1.0])),
        ("top_k", lambda: rng.choice([-1, 0, 1, 20])),
        ("min_p", lambda: rng.choice([0.0, 0.05])),
        ("presence_penalty", lambda: rng.choice([0.0, 1.5, -2.0])),
        ("frequency_penalty", lambda: rng.choice([0.0, 1.0])),
        ("repetition_penalty", lambda: rng.choice([1.0, 1.1])),
        ("seed", lambda: rng.choice([0, 1, 2**63 - 1])),
        ("logit_bias", lambda: {str(rng.choice([0, 1, 248046, 248319])): rng.choice([-100, 0, 5])}),
        ("stop", lambda: rng.choice(["!", ["\n", "lo"], [], ["x"] * 20])),
        ("max_tokens", lambda: rng.choice([1, 2, 4, 8])),
        ("n", lambda: 1),
        ("stream", lambda: rng.random() < 0.5),
        ("stream_options", lambda: {"include_usage": rng.random() < 0.5}),
        ("user", lambda: "fuzz"),
    ]:
        if rng.random() < 0.25:
            body[field] = maybe(rng, good)
    # Generation stays short: a request without a bound would run to the end of the reply.
    if not isinstance(body.get("max_tokens"), int) or rng.random() < 0.5:
        body.setdefault("max_tokens", rng.choice([1, 3, 6]))


def chat_body(rng):
    body = {"messages": maybe(rng, lambda: conversation(rng) if rng.random() < 0.7
                              else [message(rng) for _ in range(rng.randrange(1, 5))], 0.3)}
    if rng.random() < 0.3:
        body["model"] = maybe(rng, lambda: "any")
    if rng.random() < 0.3:
        body["tools"] = maybe(rng, lambda: [maybe(rng, lambda: WEATHER) for _ in range(rng.randrange(3))])
    if rng.random() < 0.2:
        body["tool_choice"] = maybe(rng, lambda: rng.choice(["auto", "none", "required"]))
    if rng.random() < 0.2:
        body["chat_template_kwargs"] = maybe(rng, lambda: {"enable_thinking": rng.random() < 0.5,
                                                           rng.choice(STRINGS): value(rng)})
    if rng.random() < 0.15:
        body["response_format"] = maybe(rng, lambda: {"type": rng.choice(["text", "json_object", "json_schema"])})
    if rng.random() < 0.15:
        body["logprobs"] = maybe(rng, lambda: True)
        body["top_logprobs"] = maybe(rng, lambda: rng.choice([0, 2, 20, 21]))
    if rng.random() < 0.1:
        body["max_completion_tokens"] = maybe(rng, lambda: rng.choice([1, 4]))
    sampling(rng, body)
    return body


def completion_body(rng):
    prompt = maybe(rng, lambda: rng.choice([
        rng.choice(STRINGS),
        [rng.choice(NUMBERS[:12]) for _ in range(rng.randrange(5))],
        [rng.choice(STRINGS)],
        [[1, 2], [3]],
    ]), 0.15)
    body = {"prompt": prompt}
    if rng.random() < 0.2:
        body["echo"] = maybe(rng, lambda: True)
    if rng.random() < 0.2:
        body["logprobs"] = maybe(rng, lambda: rng.choice([0, 1, 5, 21]))
    if rng.random() < 0.1:
        body["suffix"] = value(rng)
    if rng.random() < 0.1:
        body["best_of"] = maybe(rng, lambda: 1)
    sampling(rng, body)
    if body.get("echo") is True and rng.random() < 0.5:
        body["max_tokens"] = 0
    return body


def hostile_bytes(rng) -> bytes:
    """Bodies that are not the JSON an endpoint wants."""
    choices = [
        lambda: b"",
        lambda: b"{",
        lambda: b"null",
        lambda: b"[]",
        lambda: b"\"messages\"",
        lambda: b"[" * rng.choice([10, 200, 5000]) + b"]" * rng.choice([0, 10]),
        lambda: b'{"messages": ' + b"[" * 3000 + b"]" * 3000 + b"}",
        lambda: b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}',
        lambda: b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        lambda: b'{"max_tokens": 1e999, "prompt": "x"}',
        lambda: b'{"prompt": "x", "prompt": 5}',
        lambda: json.dumps(chat_body(rng)).encode()[: rng.randrange(1, 60)],
        lambda: bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))),
        lambda: json.dumps(chat_body(rng)).encode() + b"garbage",
    ]
    return rng.choice(choices)()


def request(rng):
    """(method, path, headers, body bytes) of one generated request."""
    rng.badness = rng.choice([0.0, 0.0, 0.0, 0.05, 0.2, 0.6])
    r = rng.random()
    headers = {"content-type": rng.choice(["application/json"] * 8 + ["text/plain", "application/x-www-form-urlencoded"])}
    if r < 0.45:
        return "POST", "/v1/chat/completions", headers, json.dumps(chat_body(rng)).encode()
    if r < 0.75:
        return "POST", "/v1/completions", headers, json.dumps(completion_body(rng)).encode()
    if r < 0.9:
        path = rng.choice(["/v1/chat/completions", "/v1/completions"])
        return "POST", path, headers, hostile_bytes(rng)
    method = rng.choice(["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
    path = rng.choice(["/", "/health", "/metrics", "/v1/models", "/v1/models/any", "/v1/models/%00",
                       "/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/../etc/passwd",
                       "/v1/models/" + "x" * 3000, "//v1//models"])
    body = json.dumps(value(rng)).encode() if method in ("POST", "PUT", "PATCH") else b""
    return method, path, headers, body


def check(method, status, headers, text) -> str | None:
    """What is wrong with one answer, if anything."""
    if status >= 500:
        return f"status {status}"
    if status >= 400 and method != "HEAD":
        try:
            err = json.loads(text)["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"]
        except Exception:
            return f"status {status} without an OpenAI error object: {text[:200]!r}"
    if headers.get("content-type", "").startswith("text/event-stream"):
        events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return f"stream did not end with [DONE]: {text[-200:]!r}"
        for e in events[:-1]:
            body = json.loads(e)
            if "error" in body and body["error"].get("type") == "server_error":
                return f"stream ended in a server error: {e[:200]}"
    return None


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory, small_model):
    """The scripted server, its log kept to look for panics afterwards."""
    path = tmp_path_factory.mktemp("fuzz") / "script.json"
    path.write_text(json.dumps({"tokenizer": str(small_model), **SCRIPT}))
    log = path.parent / "serve.log"
    server = Server(f"scripted:{path}", "--ctx-size", "4096", env={"LILY_LOG": "warn"}, log_path=log).wait_ready()
    yield server, log
    server.stop()


def test_generated_requests_get_no_5xx_no_hang_no_panic(fuzz_server):
    server, log = fuzz_server
    rng = random.Random(SEED)
    requests = [request(rng) for _ in range(REQUESTS)]
    problems, statuses = [], {}
    started = time.monotonic()

    local = threading.local()

    def send(i_req):
        i, (method, path, headers, body) = i_req
        if not hasattr(local, "client"):
            local.client = httpx.Client(base_url=server.url, timeout=HANG_SECONDS)
        try:
            r = local.client.request(method, path, headers=headers, content=body)
        except httpx.TimeoutException:
            return i, None, f"hang: no answer within {HANG_SECONDS}s"
        except httpx.HTTPError as e:
            return i, None, f"connection error: {e!r}"
        return i, r.status_code, check(method, r.status_code, r.headers, r.text)

    with cf.ThreadPoolExecutor(4) as pool:
        for i, status, problem in pool.map(send, enumerate(requests)):
            statuses[status] = statuses.get(status, 0) + 1
            if problem:
                method, path, _, body = requests[i]
                problems.append(f"request {i} ({method} {path} {body[:300]!r}): {problem}")
    took = time.monotonic() - started
    alive = server.proc.poll() is None
    panics = [line for line in log.read_text(errors="replace").splitlines() if "panicked" in line]
    summary = (f"{REQUESTS} requests (seed {SEED}) in {took:.0f}s: statuses {dict(sorted(statuses.items(), key=str))}, "
               f"{sum(v for k, v in statuses.items() if k and k >= 500)} 5xx, "
               f"{sum('hang' in p for p in problems)} hangs, {len(panics)} panics, {len(problems)} problems")
    print(summary)
    assert alive, "the server died"
    assert not panics, panics[:5]
    assert not problems, "\n".join([summary] + problems[:20])
    assert httpx.get(server.url + "/health").status_code == 200
