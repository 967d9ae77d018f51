"""Forced tool calls and structured outputs on the `small` synthetic model, whose raw output is
noise: constrained decoding alone must make every call and every JSON answer valid. Checked with
the official `openai` and `anthropic` clients, and every generated object is validated against its
schema by `jsonschema`, a peer validator."""

import json

import anthropic
import jsonschema
import openai
import pytest

import json_prefix
from conftest import Server

NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}

WEATHER = {
    "name": "get_weather",
    "description": "Weather",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 24},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "hourly": {"type": "boolean"},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}
SEARCH = {
    "name": "search",
    "description": "Search",
    "parameters": {
        "type": "object",
        "properties": {
            "query": {"type": "string", "maxLength": 24},
            "filters": {"type": "array", "maxItems": 2,
                        "items": {"type": "object", "properties": {"year": {"type": "integer", "minimum": 1990,
                                                                             "maximum": 2030}},
                                  "required": ["year"], "additionalProperties": False}},
        },
        "required": ["query"],
        "additionalProperties": False,
    },
}
TOOLS = [{"type": "function", "function": f} for f in (WEATHER, SEARCH)]
SCHEMAS = {f["name"]: f["parameters"] for f in (WEATHER, SEARCH)}

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "active"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def cpu_server(small_model):
    """The small model with room for the tool definitions in the prompt (the shared CPU server's
    context is kept tiny on purpose)."""
    server = Server(str(small_model), "--ctx-size", "1024", "--device", "cpu").wait_ready()
    yield server
    server.stop()


def chat(server, **kw):
    kw.setdefault("extra_body", NO_THINKING)
    return server.client().chat.completions.create(
        model="small", messages=[{"role": "user", "content": "Go."}], **kw)


def validate(instance, schema):
    jsonschema.Draft202012Validator(schema).validate(instance)


@pytest.mark.parametrize("seed", [1, 2])
def test_required_tool_choice_makes_valid_calls(cpu_server, seed):
    r = chat(cpu_server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, seed=seed,
             max_tokens=160)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    [call] = choice.message.tool_calls
    validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_tool_choice_streams_a_valid_call_to_that_tool(cpu_server):
    chunks = list(cpu_server.client().chat.completions.create(
        model="small", messages=[{"role": "user", "content": "Go."}], tools=TOOLS, seed=3, max_tokens=160,
        tool_choice={"type": "function", "function": {"name": "search"}}, stream=True, extra_body=NO_THINKING))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert {tc.index for tc in deltas} == {0}
    assert deltas[0].function.name == "search"
    arguments = "".join(tc.function.arguments or "" for tc in deltas)
    validate(json.loads(arguments), SCHEMAS["search"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_answers_parse_and_validate(cpu_server, seed):
    r = chat(cpu_server, seed=seed, max_tokens=120,
             response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                     "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    validate(json.loads(r.choices[0].message.content), PERSON)


def test_streamed_json_schema_answer_validates(cpu_server):
    chunks = list(cpu_server.client().chat.completions.create(
        model="small", messages=[{"role": "user", "content": "Go."}], seed=4, max_tokens=120, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        extra_body=NO_THINKING))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    validate(json.loads(text), PERSON)


def test_json_object_answers_are_objects(cpu_server):
    r = chat(cpu_server, seed=5, max_tokens=30, response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.lstrip().startswith("{")
    # Free-form objects can run past a small max_tokens: a cut answer must still be a prefix some
    # continuation completes, a finished one a whole object.
    finished = r.choices[0].finish_reason == "stop"
    assert r.choices[0].finish_reason in ("stop", "length")
    json_prefix.check(text, complete=finished)
    if finished:
        assert isinstance(json.loads(text), dict)


def test_the_json_prefix_check_refuses_what_no_continuation_completes():
    for text in ['{"a": [1, 2', '{"name": "Al\\', '{"x": -', '{"ok": tr']:
        json_prefix.check(text, complete=False)
    for text in ['{"a" 1', '{"a": tx', '{"a": 1}}', '{"a": [1,,', '{"a": 01']:
        with pytest.raises(json_prefix.Invalid):
            json_prefix.check(text, complete=False)
    with pytest.raises(json_prefix.Invalid):
        json_prefix.check('{"a": 1', complete=True)


def test_reasoning_stays_free_until_it_closes(cpu_server):
    # Thinking on: a random model never writes </think>, so everything is unconstrained reasoning.
    r = chat(cpu_server, seed=6, max_tokens=6, extra_body={},
             response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    msg = r.choices[0].message
    assert msg.reasoning_content and not msg.content
    assert r.choices[0].finish_reason == "length"


def test_schemas_that_cannot_be_enforced_are_400s_naming_them(cpu_server):
    bad = {"type": "object", "properties": {"a": {"type": "strin"}}}
    with pytest.raises(openai.BadRequestError) as e:
        chat(cpu_server, max_tokens=5,
             response_format={"type": "json_schema", "json_schema": {"name": "bad", "schema": bad}})
    assert e.value.body["param"] == "response_format.json_schema.schema"
    assert "strin" in e.value.body["message"]
    broken = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 5, "maximum": 1}}, "required": ["x"]}}}]
    with pytest.raises(openai.BadRequestError) as e:
        chat(cpu_server, max_tokens=5, tools=broken, tool_choice="required")
    assert e.value.body["param"] == "tools"
    with pytest.raises(openai.BadRequestError) as e:
        chat(cpu_server, max_tokens=5, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice" and "nope" in e.value.body["message"]


def anthropic_client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


ANTHROPIC_TOOLS = [{"name": f["name"], "description": f["description"], "input_schema": f["parameters"]}
                   for f in (WEATHER, SEARCH)]


def test_anthropic_any_tool_choice_makes_a_valid_tool_use(cpu_server):
    r = anthropic_client(cpu_server).messages.create(
        model="small", max_tokens=160, tools=ANTHROPIC_TOOLS, thinking={"type": "disabled"},
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "Go."}], extra_body={"seed": 7})
    assert r.stop_reason == "tool_use"
    [use] = [b for b in r.content if b.type == "tool_use"]
    validate(use.input, SCHEMAS[use.name])


def test_anthropic_named_tool_after_a_thinking_budget_streams_valid_input(cpu_server):
    # A random model never ends its reasoning: the budget closes it, then the call is forced.
    with anthropic_client(cpu_server).messages.stream(
            model="small", max_tokens=200, tools=ANTHROPIC_TOOLS,
            thinking={"type": "enabled", "budget_tokens": 5}, tool_choice={"type": "tool", "name": "get_weather"},
            messages=[{"role": "user", "content": "Go."}], extra_body={"seed": 8}) as s:
        partial = "".join(e.delta.partial_json for e in s
                          if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.stop_reason == "tool_use" and final.content[1].name == "get_weather"
    validate(json.loads(partial), SCHEMAS["get_weather"])
    assert final.content[1].input == json.loads(partial)


def test_anthropic_output_format_json_schema(cpu_server):
    r = anthropic_client(cpu_server).messages.create(
        model="small", max_tokens=120, thinking={"type": "disabled"}, messages=[{"role": "user", "content": "Go."}],
        extra_body={"seed": 9, "output_config": {"format": {"type": "json_schema", "schema": PERSON}}})
    assert r.stop_reason == "end_turn"
    validate(json.loads(r.content[0].text), PERSON)


def test_mask_time_is_a_metric(cpu_server):
    m = cpu_server.metrics()
    assert m["lily_constraint_masks_total"] > 0
    assert m["lily_constraint_mask_seconds_total"] > 0
