"""Several conversations at once (issue 32): `lily-engine serve --device cpu --max-batch 4` decodes
concurrent requests together, and each client gets exactly the answer it gets alone (the reference:
the same requests one at a time on the `cpu_server` fixture, which decodes one request at a time).
A client that disconnects or a request that fails does not change the others' answers, and /metrics
shows the batch sizes, running and waiting sequences and queue times."""

import concurrent.futures as cf

import httpx
import pytest

from conftest import CTX, Server

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
PROMPTS = ["Name three colours.", "Write a haiku about rain, please, in the style of an old sailor.",
           "What is 2 + 2?", "Summarise the plot of a story about a lighthouse keeper and a storm."]


@pytest.fixture(scope="module")
def batch_server(small_model):
    server = Server(str(small_model), "--ctx-size", str(CTX), "--device", "cpu", "--max-batch", "4").wait_ready()
    yield server
    server.stop()


def ask(server, content, max_tokens):
    r = server.client().chat.completions.create(
        model="small", messages=[{"role": "user", "content": content}], temperature=0, max_tokens=max_tokens,
        extra_body=NO_THINKING)
    c = r.choices[0]
    return c.message.content, c.finish_reason, r.usage.completion_tokens


def test_concurrent_clients_get_their_one_at_a_time_answers(cpu_server, batch_server):
    jobs = [(p, 10 + 4 * i) for i, p in enumerate(PROMPTS)]
    want = [ask(cpu_server, p, n) for p, n in jobs]
    before = batch_server.metrics()
    for _ in range(2):
        with cf.ThreadPoolExecutor(len(jobs)) as pool:
            got = list(pool.map(lambda job: ask(batch_server, *job), jobs))
        assert got == want
    m = batch_server.metrics()
    assert m["lily_max_batch"] == 4
    steps = m["lily_decode_batch_size_count"] - before.get("lily_decode_batch_size_count", 0)
    single = m['lily_decode_batch_size_bucket{le="1"}'] - before.get('lily_decode_batch_size_bucket{le="1"}', 0)
    assert steps > single, "some decode steps advanced several sequences"
    assert m['lily_decode_batch_size_bucket{le="4"}'] == m["lily_decode_batch_size_count"], "never more than 4"
    assert m["lily_queue_time_seconds_count"] - before.get("lily_queue_time_seconds_count", 0) == 2 * len(jobs)
    assert m["lily_requests_running"] == 0 and m["lily_queue_depth"] == 0


def test_a_disconnect_and_a_failure_leave_the_others_answers_unchanged(cpu_server, batch_server):
    jobs = [(p, 16) for p in PROMPTS[:3]]
    want = [ask(cpu_server, p, n) for p, n in jobs]

    def disconnecting():
        # A streaming client that leaves after a few chunks.
        body = {"model": "small", "messages": [{"role": "user", "content": "Count to one hundred."}],
                "max_tokens": 200, "temperature": 0, "stream": True, **NO_THINKING}
        with httpx.stream("POST", batch_server.url + "/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for i, _ in enumerate(r.iter_lines()):
                if i >= 4:
                    return "left"
        return "ended"

    def too_long():
        # Prompt plus max_tokens beyond the context: refused, nothing else touched.
        r = httpx.post(batch_server.url + "/v1/chat/completions", timeout=60, json={
            "model": "small", "messages": [{"role": "user", "content": "word " * (2 * CTX)}], "max_tokens": 8})
        return r.status_code

    with cf.ThreadPoolExecutor(len(jobs) + 2) as pool:
        answers = [pool.submit(ask, batch_server, *job) for job in jobs]
        left, refused = pool.submit(disconnecting), pool.submit(too_long)
        assert [a.result() for a in answers] == want
        assert left.result() == "left"
        assert refused.result() == 400
