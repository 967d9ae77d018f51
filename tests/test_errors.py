"""Every bad request gets an OpenAI error object with the right status, and the server keeps
serving afterwards."""

import httpx
import openai
import pytest

from conftest import Server, assert_error

MSG = [{"role": "user", "content": "hello"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def post(server, path, body, **kw):
    if isinstance(body, (dict, list)):
        return httpx.post(server.url + path, json=body, timeout=30, **kw)
    return httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=30, **kw)


@pytest.mark.parametrize("body", [b"{\"messages\": [", b"not json", b"", b"[1, 2]"])
def test_malformed_json_is_400(scripted_server, body):
    assert_error(post(scripted_server, "/v1/chat/completions", body), 400)


@pytest.mark.parametrize("body,param", [
    ({"messages": "hello"}, "messages"),
    ({"messages": MSG, "temperature": "hot"}, "temperature"),
    ({"messages": MSG, "max_tokens": "ten"}, "max_tokens"),
    ({"messages": MSG, "stream": "yes"}, "stream"),
    ({"messages": MSG, "stop": 5}, "stop"),
    ({"messages": MSG, "seed": 1.5}, "seed"),
])
def test_wrong_types_are_400(scripted_server, body, param):
    assert_error(post(scripted_server, "/v1/chat/completions", body), 400, param)


@pytest.mark.parametrize("messages,param", [
    ([], "messages"),
    ([{"role": "wizard", "content": "hi"}], "messages[0].role"),
    ([{"content": "hi"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content[0]"),
    ([{"role": "system", "content": "only a system prompt"}], "messages"),
])
def test_empty_or_invalid_messages_are_400(scripted_server, messages, param):
    assert_error(post(scripted_server, "/v1/chat/completions", {"messages": messages}), 400, param)


def test_missing_messages_with_the_official_client(scripted_server):
    with pytest.raises(openai.BadRequestError) as e:
        scripted_server.client().chat.completions.create(model="any", messages=[])
    assert e.value.status_code == 400


@pytest.mark.parametrize("extra,param", [
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -1}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -5}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"999999999": 5}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"top_logprobs": 30, "logprobs": True}, "top_logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
])
def test_out_of_range_sampling_values_are_400(scripted_server, extra, param):
    assert_error(post(scripted_server, "/v1/chat/completions", {"messages": MSG, **extra}), 400, param)


@pytest.mark.parametrize("extra,param", [
    ({"n": 2}, "n"),
    ({"tool_choice": "required", "tools": []}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 5}}},
     "response_format.json_schema.schema"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
])
def test_unsupported_modes_are_clear_400s(scripted_server, extra, param):
    err = assert_error(post(scripted_server, "/v1/chat/completions", {"messages": MSG, **extra}), 400, param)
    assert "support" in err["message"] or "must" in err["message"]


def test_supported_modes_and_unknown_fields_are_accepted(scripted_server):
    r = post(scripted_server, "/v1/chat/completions", {
        "messages": MSG, "n": 1, "response_format": {"type": "json_object"}, "tool_choice": "auto",
        "user": "someone", "metadata": {"a": "b"}, "some_future_field": [1, 2, 3], "max_tokens": 5,
    })
    assert r.status_code == 200, r.text


def test_prompt_longer_than_the_context_is_400(scripted_server):
    long = "word " * 5000  # about 5000 tokens; the scripted server holds 4096
    with pytest.raises(openai.BadRequestError) as e:
        scripted_server.client().chat.completions.create(model="any", messages=[{"role": "user", "content": long}])
    assert e.value.code == "context_length_exceeded"


def test_max_tokens_that_cannot_fit_is_400(scripted_server):
    err = assert_error(post(scripted_server, "/v1/chat/completions", {"messages": MSG, "max_tokens": 4096}), 400,
                       "max_tokens", "context_length_exceeded")
    assert "4096" in err["message"]


def test_unknown_route_is_a_404_error_object(scripted_server):
    assert_error(httpx.get(scripted_server.url + "/v1/nothing"), 404)


def test_completions_errors(scripted_server):
    assert_error(post(scripted_server, "/v1/completions", {}), 400, "prompt")
    assert_error(post(scripted_server, "/v1/completions", {"prompt": ["a", "b"]}), 400, "prompt")
    assert_error(post(scripted_server, "/v1/completions", {"prompt": [999999999]}), 400, "prompt")
    assert_error(post(scripted_server, "/v1/completions", {"prompt": "x", "logprobs": 50}), 400, "logprobs")
    assert_error(post(scripted_server, "/v1/completions", {"prompt": "x", "suffix": "y"}), 400, "suffix")
    assert_error(post(scripted_server, "/v1/completions", {"prompt": "x", "best_of": 3}), 400, "best_of")


def test_internal_failure_is_500_and_the_server_keeps_serving(scripted_server):
    for trigger in ["explode now", "panic now"]:
        with pytest.raises(openai.InternalServerError) as e:
            scripted_server.client().chat.completions.create(model="any", messages=[{"role": "user", "content": trigger}])
        assert e.value.status_code == 500
        r = scripted_server.client().chat.completions.create(model="any", messages=[{"role": "user", "content": "a riddle"}])
        assert r.choices[0].message.content == "The answer is 42."


def test_internal_failure_mid_stream_ends_the_stream_with_an_error(scripted_server):
    with httpx.stream("POST", scripted_server.url + "/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "explode"}], "stream": True}, timeout=30) as r:
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert '"error"' in events[-2]


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory, small_model):
    from conftest import scripted_model
    server = Server(scripted_model(tmp_path_factory, small_model), api_key="sekrit").wait_ready()
    yield server
    server.stop()


def test_api_key_missing_or_wrong_is_401(keyed_server):
    err = assert_error(post(keyed_server, "/v1/chat/completions", {"messages": MSG}), 401)
    assert err["code"] == "invalid_api_key"
    wrong = openai.OpenAI(base_url=keyed_server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model="any", messages=MSG)
    ok = keyed_server.client().chat.completions.create(model="any", messages=MSG, extra_body=NO_THINKING)
    assert ok.choices[0].message.content
    assert httpx.get(keyed_server.url + "/health").status_code == 200
    assert keyed_server.client().models.list().data[0].id


def test_queue_full_is_429(slow_scripted):
    """--max-queue 2: one running + two waiting; the rest are refused at once with 429."""
    import concurrent.futures as cf

    def one(_):
        return post(slow_scripted, "/v1/chat/completions", {"messages": [{"role": "user", "content": "short story"}], **NO_THINKING})

    with cf.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(one, range(8)))
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(200) >= 3, codes
    assert codes.count(429) >= 1, codes
    assert_error(next(r for r in responses if r.status_code == 429), 429, code="queue_full")
    # The refused ones did not disturb the accepted ones, and the server still serves.
    for r in responses:
        if r.status_code == 200:
            assert r.json()["choices"][0]["message"]["content"].endswith("word59")
    assert post(slow_scripted, "/v1/chat/completions", {"messages": MSG}).status_code == 200


def test_error_statuses_are_counted_in_metrics(scripted_server):
    post(scripted_server, "/v1/chat/completions", b"{")
    m = scripted_server.metrics()
    assert m['lily_requests_total{endpoint="/v1/chat/completions",status="400"}'] >= 1
