"""`/v1/completions` on the real CPU backend: raw prompts, echo, and teacher-forced log-probabilities
(what lm-evaluation-harness uses for log-likelihood scoring)."""

import httpx
import pytest

from reference import encode


def complete(server, **body):
    r = httpx.post(server.url + "/v1/completions", json={"model": "small", **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_raw_prompt_completion(cpu_server):
    r = cpu_server.client().completions.create(model="small", prompt="The capital of France is", max_tokens=4, temperature=0)
    assert r.object == "text_completion"
    assert r.usage.prompt_tokens == len(encode("The capital of France is"))
    assert 1 <= r.usage.completion_tokens <= 4
    assert r.choices[0].finish_reason in ("stop", "length")


def test_token_id_prompt_equals_text_prompt(cpu_server):
    text = complete(cpu_server, prompt="Once upon a time", max_tokens=4, temperature=0)
    ids = complete(cpu_server, prompt=encode("Once upon a time"), max_tokens=4, temperature=0)
    assert ids["choices"][0]["text"] == text["choices"][0]["text"]


def test_echo_prepends_the_prompt(cpu_server):
    r = complete(cpu_server, prompt="Hello world", max_tokens=3, temperature=0, echo=True)
    plain = complete(cpu_server, prompt="Hello world", max_tokens=3, temperature=0)
    assert r["choices"][0]["text"] == "Hello world" + plain["choices"][0]["text"]


def test_echo_logprobs_score_the_prompt_like_generation_does(cpu_server):
    """Teacher forcing: the distribution echo reports at prompt position k is the one generation
    sees after the first k tokens."""
    ids = encode("The quick brown fox jumps over the lazy dog")
    k = len(ids) - 1
    gen = complete(cpu_server, prompt=ids[:k], max_tokens=1, temperature=0, logprobs=5)["choices"][0]["logprobs"]
    [token_lp] = gen["token_logprobs"]
    assert max(gen["top_logprobs"][0].values()) == pytest.approx(token_lp, abs=1e-5)

    scored = complete(cpu_server, prompt=ids, max_tokens=0, echo=True, logprobs=5)["choices"][0]["logprobs"]
    assert len(scored["tokens"]) == len(ids)
    assert scored["token_logprobs"][0] is None and scored["top_logprobs"][0] is None
    assert all(x <= 0 for x in scored["token_logprobs"][1:])
    want, got = gen["top_logprobs"][0], scored["top_logprobs"][k]
    assert set(got) == set(want)
    for token in want:
        assert got[token] == pytest.approx(want[token], abs=2e-3)
    assert scored["text_offset"][0] == 0 and scored["text_offset"] == sorted(scored["text_offset"])


def test_echo_with_zero_max_tokens_only_scores(cpu_server):
    ids = encode("A short sentence to score.")
    r = complete(cpu_server, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids)
    assert r["usage"]["completion_tokens"] == 0
    assert r["choices"][0]["finish_reason"] == "length"


def test_streaming_completion(cpu_server):
    chunks = list(cpu_server.client().completions.create(
        model="small", prompt="Once upon a time", max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    want = complete(cpu_server, prompt="Once upon a time", max_tokens=5, temperature=0)
    assert text == want["choices"][0]["text"]
    assert chunks[-1].usage.completion_tokens == want["usage"]["completion_tokens"]
