"""Reasoning and tool-call output through the full HTTP stack, driven by the scripted backend
(a random-weight model never writes `</think>` or a tool call)."""

import json

from conftest import WEATHER_TOOL


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
    calls = {}
    for c in chunks:
        for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            entry = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id:
                assert entry["id"] is None, "id is sent once, in the first delta of a call"
                entry["id"] = tc.id
            if tc.function and tc.function.name:
                entry["name"] = tc.function.name
            if tc.function and tc.function.arguments:
                entry["arguments"] += tc.function.arguments
    assert list(calls) == [0]
    assert calls[0]["id"] and calls[0]["name"] == "get_weather"
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "days": 3}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


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
    renders them (arguments given as a JSON string) and the model answers."""
    messages = [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
        {"role": "user", "content": "and a riddle"},
    ]
    r = scripted_server.client().chat.completions.create(model="any", messages=messages, tools=[WEATHER_TOOL])
    assert r.choices[0].message.content == "The answer is 42."
