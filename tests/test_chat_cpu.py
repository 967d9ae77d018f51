"""Chat completions on the real CPU backend (synthetic `small` model, real tokenizer)."""

import concurrent.futures as cf

import pytest

from reference import count_tokens, render

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def chat(server, content, **kw):
    return server.client().chat.completions.create(model="small", messages=[{"role": "user", "content": content}], **kw)


def greedy(server, content, max_tokens=8, **kw):
    return chat(server, content, temperature=0, max_tokens=max_tokens, extra_body=NO_THINKING, **kw)


def test_non_streaming_chat_and_usage(cpu_server):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]
    r = cpu_server.client().chat.completions.create(model="small", messages=messages, max_tokens=6)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.id and r.created
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    # Thinking is on by default and a random model never closes it: the text is reasoning.
    text = (choice.message.content or "") + (choice.message.reasoning_content or "")
    assert text
    u = r.usage
    assert u.prompt_tokens == count_tokens(render(messages))
    assert 1 <= u.completion_tokens <= 6
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens == 0


def test_thinking_off_prompt_is_the_template_s(cpu_server):
    r = greedy(cpu_server, "Hello there", max_tokens=2)
    messages = [{"role": "user", "content": "Hello there"}]
    assert r.usage.prompt_tokens == count_tokens(render(messages, enable_thinking=False))


def test_streaming_matches_non_streaming_and_reports_usage(cpu_server):
    want = greedy(cpu_server, "Tell me a story.", max_tokens=10)
    chunks = list(cpu_server.client().chat.completions.create(
        model="small", messages=[{"role": "user", "content": "Tell me a story."}], temperature=0, max_tokens=10,
        stream=True, stream_options={"include_usage": True}, extra_body=NO_THINKING))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.choices[0].message.content
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == want.choices[0].finish_reason
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    got_usage = usage_chunk.usage
    assert (got_usage.prompt_tokens, got_usage.completion_tokens, got_usage.total_tokens) == \
        (want.usage.prompt_tokens, want.usage.completion_tokens, want.usage.total_tokens)
    # The streamed request resumed from the conversation state the first one saved.
    assert got_usage.prompt_tokens_details.cached_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_max_tokens_ends_with_length(cpu_server):
    for field in ("max_tokens", "max_completion_tokens"):
        # The end-of-turn ids are banned, so the random-weight model cannot stop before the limit.
        r = chat(cpu_server, "Count to ten.", temperature=0, extra_body=NO_THINKING,
                 logit_bias={"248046": -100, "248044": -100}, **{field: 3})
        assert r.usage.completion_tokens == 3
        assert r.choices[0].finish_reason == "length"


def test_stop_string_cuts_the_output(cpu_server):
    full = greedy(cpu_server, "Write something.", max_tokens=16).choices[0].message.content
    # A stop string from the middle of what greedy decoding writes anyway.
    start = max(1, len(full) // 2)
    stop = full[start:start + 2]
    assert stop.strip(), f"need visible text to stop on: {full!r}"
    r = greedy(cpu_server, "Write something.", max_tokens=16, stop=[stop, "\u2603never"])
    assert r.choices[0].message.content == full[:full.find(stop)]
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 16


def test_seed_reproducibility(cpu_server):
    kw = dict(temperature=1.0, top_p=1.0, max_tokens=8, extra_body=NO_THINKING)
    a = chat(cpu_server, "Pick a word.", seed=1234, **kw).choices[0].message.content
    b = chat(cpu_server, "Pick a word.", seed=1234, **kw).choices[0].message.content
    assert a == b
    others = {chat(cpu_server, "Pick a word.", seed=s, **kw).choices[0].message.content for s in (1, 2, 3)}
    assert len(others | {a}) > 1, "different seeds should sample differently"


def test_logprobs_report_the_chosen_token(cpu_server):
    r = greedy(cpu_server, "Hi", max_tokens=4, logprobs=True, top_logprobs=3)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 3
        # Greedy picks the most likely token (no penalties at temperature 0 with defaults off).
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-5)
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
        assert bytes(e.bytes).decode("utf-8", "replace") == e.token


def test_twenty_simultaneous_clients_get_their_own_answers(cpu_server):
    prompts = [f"Question number {i}: what is {i} plus {i}?" for i in range(5)]
    reference = {p: greedy(cpu_server, p, max_tokens=5).choices[0].message.content for p in prompts}
    jobs = [prompts[i % 5] for i in range(20)]
    with cf.ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(lambda p: (p, greedy(cpu_server, p, max_tokens=5, stream=False)), jobs))
    for prompt, r in answers:
        assert r.choices[0].message.content == reference[prompt]
        assert r.usage.completion_tokens <= 5


def test_twenty_simultaneous_streams_do_not_interleave(cpu_server):
    prompts = [f"Stream {i}, please." for i in range(4)]
    reference = {p: greedy(cpu_server, p, max_tokens=4).choices[0].message.content for p in prompts}

    def run(p):
        chunks = list(chat(cpu_server, p, temperature=0, max_tokens=4, stream=True, extra_body=NO_THINKING))
        assert len({c.id for c in chunks}) == 1
        return p, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    with cf.ThreadPoolExecutor(20) as pool:
        for p, text in pool.map(run, [prompts[i % 4] for i in range(20)]):
            assert text == reference[p]


def test_models_and_metrics(cpu_server):
    models = cpu_server.client().models.list()
    assert [m.id for m in models.data] == ["small"]
    greedy(cpu_server, "Metrics, please.", max_tokens=3)
    m = cpu_server.metrics()
    assert m["lily_model_ready"] == 1
    assert m['lily_requests_total{endpoint="/v1/chat/completions",status="200"}'] >= 1
    assert m["lily_prompt_tokens_total"] > 0 and m["lily_generated_tokens_total"] > 0
    assert m["lily_decode_tokens_per_second"] > 0 and m["lily_prefill_tokens_per_second"] > 0
    assert m['lily_time_to_first_token_seconds_bucket{le="+Inf"}'] == m["lily_time_to_first_token_seconds_count"] > 0
    assert m["lily_queue_depth"] == 0


def test_later_turns_reuse_the_conversation_prefix(cpu_server):
    """The state at the end of a conversation (before the generation prompt) is kept; the next
    request that starts with it resumes there — and answers exactly as a fresh prefill would."""
    turn1 = [{"role": "system", "content": "Prefix reuse test."}, {"role": "user", "content": "First question, unique 7c1f."}]
    kw = dict(model="small", temperature=0, max_tokens=4, extra_body=NO_THINKING)
    first = cpu_server.client().chat.completions.create(messages=turn1, **kw)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    conversation = count_tokens(render(turn1, add_generation_prompt=False))
    again = cpu_server.client().chat.completions.create(messages=turn1, **kw)
    assert again.usage.prompt_tokens_details.cached_tokens == conversation
    assert again.choices[0].message.content == first.choices[0].message.content
    turn2 = turn1 + [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "And a second one?"}]
    second = cpu_server.client().chat.completions.create(messages=turn2, **kw)
    assert second.usage.prompt_tokens_details.cached_tokens == conversation
    assert second.usage.prompt_tokens == count_tokens(render(turn2, enable_thinking=False))
    m = cpu_server.metrics()
    assert m["lily_cached_prompt_tokens_total"] >= 2 * conversation


def test_streamed_logprobs_cover_every_token(cpu_server):
    chunks = list(chat(cpu_server, "Logprobs please.", temperature=0, max_tokens=5, logprobs=True, top_logprobs=2,
                       stream=True, stream_options={"include_usage": True}, extra_body=NO_THINKING))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == chunks[-1].usage.completion_tokens
    want = greedy(cpu_server, "Logprobs please.", max_tokens=5, logprobs=True, top_logprobs=2)
    assert [(e.token, e.bytes) for e in entries] == [(e.token, e.bytes) for e in want.choices[0].logprobs.content]
    assert all(len(e.top_logprobs) == 2 for e in entries)


def test_model_retrieve(cpu_server):
    import openai
    assert cpu_server.client().models.retrieve("small").id == "small"
    with pytest.raises(openai.NotFoundError):
        cpu_server.client().models.retrieve("gpt-4")
