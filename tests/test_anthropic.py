"""The Anthropic Messages API (`/v1/messages`, `/v1/messages/count_tokens`) driven by the official
`anthropic` client: content blocks, thinking on and off, tool use round trips, streaming events,
stop sequences, limits, errors and keys. The scripted backend gives fixed replies (a random model
never writes `</think>` or a tool call); the `small` CPU model checks real generation."""

import json

import anthropic
import httpx
import pytest

from conftest import Server, scripted_model
from reference import count_tokens, render

WEATHER = {
    "name": "get_weather",
    "description": "Current weather for a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"],
    },
}
# The same tool as the template sees it (OpenAI shape), for reference renders.
WEATHER_OPENAI = {"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"],
                                                   "parameters": WEATHER["input_schema"]}}
THINKING_OFF = {"type": "disabled"}


def client(server, **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=server.api_key or "unused", max_retries=0, **kw)


def ask(server, text, **kw):
    kw.setdefault("max_tokens", 256)
    return client(server).messages.create(model="any", messages=[{"role": "user", "content": text}], **kw)


def raw_events(server, body):
    """The SSE stream as (event name, data) pairs, exactly as sent."""
    out, name = [], None
    with httpx.stream("POST", server.url + "/v1/messages", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data = json.loads(line[len("data: "):])
                assert data["type"] == name, (name, data)
                out.append((name, data))
    return out


def test_thinking_and_text_blocks(scripted_server):
    r = ask(scripted_server, "a riddle for you")
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].thinking == "Let me think step by step."
    assert r.content[1].text == "The answer is 42."
    assert r.stop_reason == "end_turn" and r.stop_sequence is None
    messages = [{"role": "user", "content": "a riddle for you"}]
    assert r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0) == count_tokens(render(messages))
    assert r.usage.output_tokens > 0


def test_thinking_disabled_renders_the_no_thinking_prompt(scripted_server):
    r = ask(scripted_server, "plain please", thinking=THINKING_OFF, system="Be brief.")
    assert [b.type for b in r.content] == ["text"]
    assert r.content[0].text == "Just an answer, no thinking."
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "plain please"}]
    want = count_tokens(render(messages, enable_thinking=False))
    assert r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0) == want


def test_thinking_enabled_with_a_budget(scripted_server):
    r = ask(scripted_server, "a riddle", thinking={"type": "enabled", "budget_tokens": 1024}, max_tokens=2048)
    assert [b.type for b in r.content] == ["thinking", "text"]


def test_tool_use_round_trip(scripted_server):
    c = client(scripted_server)
    first = [{"role": "user", "content": "what is the weather in Paris?"}]
    r = c.messages.create(model="any", max_tokens=256, messages=first, tools=[WEATHER])
    assert r.stop_reason == "tool_use"
    assert [b.type for b in r.content] == ["thinking", "tool_use"]
    use = r.content[1]
    assert use.name == "get_weather" and use.input == {"city": "Paris", "days": 3}
    assert use.id.startswith("toolu_")
    # The answer goes back as it came, with the result; the model gets the whole conversation.
    second = first + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": [{"type": "text", "text": "sunny, 21 C"}]}]},
    ]
    r2 = c.messages.create(model="any", max_tokens=256, messages=second, tools=[WEATHER])
    # (The scripted model answers the latest trigger word in the prompt: "weather" again.)
    assert r2.stop_reason == "tool_use"
    reference = [
        first[0],
        {"role": "assistant", "content": "", "reasoning_content": r.content[0].thinking,
         "tool_calls": [{"id": use.id, "type": "function",
                         "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]},
        {"role": "tool", "content": "sunny, 21 C"},
    ]
    want = count_tokens(render(reference, tools=[WEATHER_OPENAI]))
    assert r2.usage.input_tokens + (r2.usage.cache_read_input_tokens or 0) == want
    counted = c.messages.count_tokens(model="any", messages=second, tools=[WEATHER])
    assert counted.input_tokens == want


def test_tool_error_results_are_marked(scripted_server):
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Oslo"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "timeout",
                                      "is_error": True}]},
    ]
    counted = client(scripted_server).messages.count_tokens(model="any", messages=messages, tools=[WEATHER])
    reference = [
        messages[0],
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "toolu_1", "type": "function", "function": {"name": "get_weather",
                                                                           "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "Error: timeout"},
    ]
    assert counted.input_tokens == count_tokens(render(reference, tools=[WEATHER_OPENAI]))


def test_streamed_event_sequence(scripted_server):
    body = {"model": "any", "max_tokens": 256, "tools": [WEATHER],
            "messages": [{"role": "user", "content": "two cities please"}]}
    events = raw_events(scripted_server, body)
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    # Blocks: start, deltas of that index, stop; in order, never interleaved.
    blocks, open_index = [], None
    for name, data in events[2:-2]:
        if name == "content_block_start":
            assert open_index is None and data["index"] == len(blocks)
            open_index = data["index"]
            blocks.append({"block": data["content_block"], "deltas": []})
        elif name == "content_block_delta":
            assert data["index"] == open_index
            blocks[open_index]["deltas"].append(data["delta"])
        elif name == "content_block_stop":
            assert data["index"] == open_index
            open_index = None
        else:
            assert name == "ping", name
    assert open_index is None
    kinds = [b["block"]["type"] for b in blocks]
    assert kinds == ["thinking", "text", "tool_use", "tool_use"]
    delta_types = {"thinking": "thinking_delta", "text": "text_delta", "tool_use": "input_json_delta"}
    for b in blocks:
        assert {d["type"] for d in b["deltas"]} == {delta_types[b["block"]["type"]]}
    inputs = [json.loads("".join(d["partial_json"] for d in b["deltas"])) for b in blocks[2:]]
    assert inputs == [{"city": "Oslo"}, {"city": "Rome"}]
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] > 0


def test_stream_helper_matches_the_plain_answer(scripted_server):
    want = ask(scripted_server, "two cities please", tools=[WEATHER])
    with client(scripted_server).messages.stream(
            model="any", max_tokens=256, tools=[WEATHER],
            messages=[{"role": "user", "content": "two cities please"}]) as s:
        texts = list(s.text_stream)
        got = s.get_final_message()
    assert "".join(texts) == "Checking both."
    strip = lambda blocks: [{k: v for k, v in b.model_dump().items() if k != "id"} for b in blocks]
    assert strip(got.content) == strip(want.content)
    assert got.stop_reason == want.stop_reason == "tool_use"
    assert got.usage.output_tokens == want.usage.output_tokens


def test_stop_sequences(scripted_server):
    r = ask(scripted_server, "a short story", thinking=THINKING_OFF, stop_sequences=["never", "word5 "])
    assert r.content[0].text == "word0 word1 word2 word3 word4 "
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "word5 "
    events = raw_events(scripted_server, {"model": "any", "max_tokens": 256, "thinking": THINKING_OFF,
                                          "stop_sequences": ["word5 "],
                                          "messages": [{"role": "user", "content": "a short story"}]})
    assert events[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "word5 "}


def test_max_tokens_stop_reason(scripted_server):
    r = ask(scripted_server, "a short story", thinking=THINKING_OFF, max_tokens=5)
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 5


def test_max_tokens_beyond_the_context_gets_the_room_left(scripted_server):
    # Agents send a fixed large max_tokens; the scripted server's context is 4096 tokens. (The
    # client insists on streaming for so large a max_tokens.)
    with client(scripted_server).messages.stream(model="any", max_tokens=100_000, thinking=THINKING_OFF,
                                                 messages=[{"role": "user", "content": "a long story"}]) as s:
        r = s.get_final_message()
    assert r.stop_reason == "max_tokens"
    assert r.usage.input_tokens + (r.usage.cache_read_input_tokens or 0) + r.usage.output_tokens == 4096


def test_count_tokens_matches_the_reference_render(scripted_server):
    system = [{"type": "text", "text": "You are terse."}, {"type": "text", "text": "Answer in English."}]
    messages = [{"role": "user", "content": [{"type": "text", "text": "Name three colours."}]}]
    r = client(scripted_server).messages.count_tokens(model="any", system=system, messages=messages)
    reference = [{"role": "system", "content": "You are terse.\n\nAnswer in English."},
                 {"role": "user", "content": "Name three colours."}]
    assert r.input_tokens == count_tokens(render(reference))


@pytest.mark.parametrize("body,field", [
    ({"messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
    ({"max_tokens": 5, "messages": []}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0]"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "temperature": 1.5}, "temperature"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "tools": [{"name": "f"}]},
     "tools[0].input_schema"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x " * 5000}]}, "context"),
])
def test_bad_requests_are_anthropic_400s(scripted_server, body, field):
    # The client's low-level post: its messages.create would refuse some of these bodies itself.
    with pytest.raises(anthropic.BadRequestError) as e:
        client(scripted_server).post("/v1/messages", cast_to=object, body={"model": "any", **body})
    assert e.value.status_code == 400
    err = e.value.body
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert field in err["error"]["message"]


def test_malformed_json_and_unknown_routes(scripted_server):
    r = httpx.post(scripted_server.url + "/v1/messages", content=b"{\"max_tokens\": ", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(scripted_server.url + "/v1/messages/batches", json={}, timeout=10)
    assert r.status_code == 404 and r.json() == {"type": "error", "error": {
        "type": "not_found_error", "message": "no route for POST /v1/messages/batches"}}


def test_failure_is_a_500_api_error_and_mid_stream_an_error_event(scripted_server):
    with pytest.raises(anthropic.InternalServerError) as e:
        ask(scripted_server, "explode")
    assert e.value.body["error"]["type"] == "api_error"
    events = raw_events(scripted_server, {"model": "any", "max_tokens": 64,
                                          "messages": [{"role": "user", "content": "explode"}]})
    assert events[0][0] == "message_start" and events[-1][0] == "error"
    assert events[-1][1]["error"]["type"] == "api_error"


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory, small_model):
    server = Server(scripted_model(tmp_path_factory, small_model), api_key="sekrit").wait_ready()
    yield server
    server.stop()


def test_x_api_key_and_bearer_are_both_accepted(keyed_server):
    # The anthropic client sends `x-api-key`; `auth_token` sends `Authorization: Bearer`.
    r = client(keyed_server).messages.create(model="any", max_tokens=64, thinking=THINKING_OFF,
                                             messages=[{"role": "user", "content": "plain"}])
    assert r.content[0].text == "Just an answer, no thinking."
    bearer = anthropic.Anthropic(base_url=keyed_server.url, auth_token="sekrit", max_retries=0)
    assert bearer.messages.count_tokens(model="any", messages=[{"role": "user", "content": "x"}]).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=keyed_server.url, api_key="wrong", max_retries=0).messages.create(
            model="any", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert e.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(keyed_server.url + "/v1/messages", json={"max_tokens": 5, "messages": []}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


def test_real_generation_streamed_equals_plain(cpu_server):
    # (This client version has no `temperature` argument; the API field is sent as it is.)
    body = dict(model="small", max_tokens=8, extra_body={"temperature": 0}, thinking=THINKING_OFF,
                messages=[{"role": "user", "content": "Tell me a story."}])
    want = client(cpu_server).messages.create(**body)
    with client(cpu_server).messages.stream(**body) as s:
        got = s.get_final_message()
    assert [b.model_dump() for b in got.content] == [b.model_dump() for b in want.content]
    assert got.stop_reason == want.stop_reason and got.stop_reason in ("end_turn", "max_tokens")
    assert got.usage.output_tokens == want.usage.output_tokens
    # The second request resumed from the conversation state the first one saved.
    assert (got.usage.cache_read_input_tokens or 0) > 0
    assert got.usage.input_tokens + got.usage.cache_read_input_tokens == \
        count_tokens(render(body["messages"], enable_thinking=False))
