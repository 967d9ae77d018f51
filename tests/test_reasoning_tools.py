"""Reasoning and tool-call output through the full HTTP stack, driven by the scripted backend
(a random-weight model never writes `</think>` or a tool call)."""

import json

from tokenizers import Tokenizer

from conftest import SCRIPT, TOKENIZER_DIR, WEATHER_TOOL


def ask(server, text, **kw):
    return server.client().chat.completions.create(
        model="any", messages=[{"role": "user", "content": text}], **kw
    )


def stream(server, text, **kw):
    return list(server.client().chat.completions.create(
        model="any", messages=[{"role": "user", "content": text}], stream=True, **kw
    ))


def test_reasoning_goes_to_reasoning_content(scripted_server):
    r = ask(scripted_server, "a riddle for you")
    msg = r.choices[0].message
    assert msg.content == "The answer is 42."
    assert msg.reasoning_content == "Let me think step by step."
    assert r.choices[0].finish_reason == "stop"


def test_streamed_reasoning_then_content(scripted_server):
    chunks = stream(scripted_server, "a riddle for you")
    first = chunks[0].choices[0].delta
    assert first.role == "assistant"
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert reasoning == "Let me think step by step."
    assert content == "The answer is 42."
    # All reasoning deltas come before the first content delta.
    kinds = [("r" if getattr(c.choices[0].delta, "reasoning_content", None) else "c")
             for c in chunks[1:] if c.choices and (c.choices[0].delta.content or getattr(c.choices[0].delta, "reasoning_content", None))]
    assert kinds == sorted(kinds, key=lambda k: k == "c")
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_thinking_off_is_all_content(scripted_server):
    r = ask(scripted_server, "plain please", extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content == "Just an answer, no thinking."
    assert getattr(r.choices[0].message, "reasoning_content", None) is None


def test_preserve_thinking_is_accepted(scripted_server):
    r = ask(scripted_server, "a riddle", extra_body={"chat_template_kwargs": {"preserve_thinking": True}})
    assert r.choices[0].message.content == "The answer is 42."


def test_tool_call_non_streaming(scripted_server):
    r = ask(scripted_server, "what is the weather in Paris?", tools=[WEATHER_TOOL])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    assert choice.message.reasoning_content == "The user asks about the weather in Paris."


def test_tool_call_streaming_deltas(scripted_server):
    chunks = stream(scripted_server, "weather in Paris?", tools=[WEATHER_TOOL], tool_choice="auto")
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas and {tc.index for tc in deltas} == {0}
    # OpenAI's shape: the first delta names the call, the rest carry pieces of the arguments.
    first, rest = deltas[0], deltas[1:]
    assert first.id.startswith("call_") and first.type == "function"
    assert first.function.name == "get_weather" and first.function.arguments == ""
    for tc in rest:
        assert tc.id is None and tc.type is None and tc.function.name is None
    # Two parameters: one fragment per parameter as it closes, then the closing brace.
    fragments = [tc.function.arguments for tc in rest]
    assert len(fragments) >= 3, fragments
    assert json.loads("".join(fragments)) == {"city": "Paris", "days": 3}
    # The name comes out before the arguments are known, in an earlier chunk.
    at = {id(tc): i for i, c in enumerate(chunks) if c.choices for tc in (c.choices[0].delta.tool_calls or [])}
    assert at[id(first)] < at[id(rest[-1])]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_openai_client_assembles_the_streamed_call(scripted_server):
    """The official client's stream helper puts the deltas back together into the same call a
    non-streamed request gets."""
    client = scripted_server.client()
    completions = getattr(client.chat.completions, "stream", None) or client.beta.chat.completions.stream
    # The helper only takes `strict` tools (it parses their arguments); the server ignores the flag.
    tool = {**WEATHER_TOOL, "function": {**WEATHER_TOOL["function"], "strict": True}}
    with completions(model="any", messages=[{"role": "user", "content": "weather in Paris?"}],
                     tools=[tool]) as s:
        events = list(s)
        final = s.get_final_completion()
    arg_deltas = [e.arguments_delta for e in events if e.type == "tool_calls.function.arguments.delta"]
    assert len(arg_deltas) >= 3, arg_deltas
    [done] = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert done.name == "get_weather" and done.parsed_arguments == {"city": "Paris", "days": 3}
    [call] = final.choices[0].message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}
    assert final.choices[0].finish_reason == "tool_calls"


def test_two_streamed_calls_keep_their_indices(scripted_server):
    chunks = stream(scripted_server, "weather for two cities", tools=[WEATHER_TOOL])
    calls = {}
    for c in chunks:
        for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            entry = calls.setdefault(tc.index, {"id": tc.id, "arguments": ""})
            entry["arguments"] += tc.function.arguments or ""
    assert sorted(calls) == [0, 1]
    assert [json.loads(calls[i]["arguments"]) for i in (0, 1)] == [{"city": "Oslo"}, {"city": "Rome"}]
    assert calls[0]["id"] != calls[1]["id"]


def streamed_answer(chunks):
    """What the openai SDK accumulates from a stream: content, reasoning, calls by index."""
    content, reasoning, calls = "", "", {}
    for c in chunks:
        if not c.choices:
            continue
        d = c.choices[0].delta
        content += d.content or ""
        reasoning += getattr(d, "reasoning_content", None) or ""
        for tc in d.tool_calls or []:
            entry = calls.setdefault(tc.index, {"name": "", "arguments": ""})
            entry["name"] += (tc.function.name or "") if tc.function else ""
            entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
    calls = [calls[i] for i in sorted(calls)]
    return content, reasoning, calls, chunks[-1].choices[0].finish_reason


def whole_answer(r):
    m = r.choices[0].message
    calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in m.tool_calls or []]
    return m.content or "", getattr(m, "reasoning_content", None) or "", calls, r.choices[0].finish_reason


def test_call_cut_by_max_tokens_degrades_to_content(scripted_server):
    """Output that ends inside a call: streamed or not, the answer has the raw text as content and
    no call (the stream sends a call's deltas only once the call is complete)."""
    [reply] = [r["text"] for r in SCRIPT["replies"] if r["when"] == "weather"]
    tok = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    ids = tok.encode(reply, add_special_tokens=False).ids
    # One token past the first `</parameter>`: `city` is complete, `days` is not.
    n = next(n for n in range(len(ids)) if "</parameter>" in tok.decode(ids[:n])) + 1
    shown = tok.decode(ids[:n])
    raw = shown[shown.index("<tool_call>"):]
    assert "<parameter=days>" not in raw

    r = ask(scripted_server, "weather in Paris?", tools=[WEATHER_TOOL], max_tokens=n)
    assert whole_answer(r)[0] == raw and whole_answer(r)[2:] == ([], "length")
    chunks = stream(scripted_server, "weather in Paris?", tools=[WEATHER_TOOL], max_tokens=n)
    assert streamed_answer(chunks)[0] == raw and streamed_answer(chunks)[2:] == ([], "length")


def test_streamed_and_whole_answers_agree_at_every_cut(scripted_server):
    """Every max_tokens from 1 to past the end of a reply with two calls: the stream, put together
    as the openai SDK does, is the non-streamed answer (no call that the other lacks, no call with
    arguments the other does not have)."""
    [reply] = [r["text"] for r in SCRIPT["replies"] if r["when"] == "two cities"]
    tok = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    total = len(tok.encode(reply, add_special_tokens=False).ids) + 1
    seen_calls = set()
    for n in range(1, total + 2):
        whole = whole_answer(ask(scripted_server, "weather for two cities", tools=[WEATHER_TOOL], max_tokens=n))
        streamed = streamed_answer(stream(scripted_server, "weather for two cities", tools=[WEATHER_TOOL],
                                          max_tokens=n))
        assert streamed == whole, n
        seen_calls.add(len(whole[2]))
    assert seen_calls == {0, 1, 2}, seen_calls


def test_call_to_an_undeclared_function_is_text(scripted_server):
    """The model calls get_weather, which this request does not declare: not a tool call."""
    other = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}}
    r = ask(scripted_server, "weather in Paris?", tools=[other])
    content, _, calls, reason = whole_answer(r)
    assert calls == [] and reason == "stop"
    assert content.startswith("<tool_call>\n<function=get_weather>") and content.endswith("</tool_call>")
    assert streamed_answer(stream(scripted_server, "weather in Paris?", tools=[other])) == whole_answer(r)


def test_two_tool_calls_get_two_indices(scripted_server):
    r = ask(scripted_server, "weather for two cities", tools=[WEATHER_TOOL])
    msg = r.choices[0].message
    assert msg.content == "Checking both."
    assert [json.loads(c.function.arguments)["city"] for c in msg.tool_calls] == ["Oslo", "Rome"]
    assert len({c.id for c in msg.tool_calls}) == 2


def test_tool_choice_none_leaves_text_alone(scripted_server):
    r = ask(scripted_server, "weather in Paris?", tools=[WEATHER_TOOL], tool_choice="none")
    msg = r.choices[0].message
    assert not msg.tool_calls
    assert "<tool_call>" in msg.content
    assert r.choices[0].finish_reason == "stop"


def test_tool_results_round_trip(scripted_server):
    """A full agent turn: the assistant's call and the tool's answer go back in; the template
    renders them (arguments given as a JSON string) and the model answers. The scripted model
    answers on words that only the rendered tool result, or the rendered call's arguments, hold."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Lisbon\"}"}}

    def turn(result):
        messages = [
            {"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": result},
        ]
        r = scripted_server.client().chat.completions.create(model="any", messages=messages, tools=[WEATHER_TOOL],
                                                             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        return r.choices[0].message.content

    assert turn("sunny, 21C") == "It is 21C and sunny."
    # Without a trigger in the result, the call's rendered arguments are the last one.
    assert turn("ok") == "The call was for Lisbon."
