"""hmad-openai's Responses API (stateless) through the official ``openai`` client (and raw HTTP through httpx)
against a real gateway in front of a real hmad (gateway_harness.py): answers equal hmaclient's for the same
request."""

from __future__ import annotations

import json

import gateway_harness as harness
import httpx
import openai
import pytest
from gateway_harness import FUZZ, KEY, TINY_NAME, assert_serving, malformed
from hypothesis import given
from hypothesis import strategies as st

from hmaclient import Client

daemon, gateway, hmad = harness.daemon, harness.gateway, harness.hmad  # the module's fixtures

INSTRUCTIONS = "Answer briefly."
INPUT = [
    {"role": "user", "content": [{"type": "input_text", "text": "x"}, {"type": "input_text", "text": "b"}]}
]
HMAD_MESSAGES = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": "x\nb"}]
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Oslo", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}

SCHEMA = {"type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"],
          "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}  # fmt: skip


@pytest.fixture
def oai(gateway):
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture
def http(gateway):
    with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as h:
        yield h


def _ref(socket: str, **kw):
    with Client(socket) as c:
        return c.generate(**kw)


def test_response_equals_hmad(oai, hmad):
    kw = {"model": "any", "instructions": INSTRUCTIONS, "input": INPUT, "temperature": 0}
    r = oai.responses.create(**kw, max_output_tokens=6)
    ref = _ref(hmad.socket, messages=HMAD_MESSAGES, max_tokens=6, temperature=0)
    assert r.output_text == ref.text and (r.status, r.model, r.object) == (
        "incomplete",
        TINY_NAME,
        "response",
    )
    assert r.incomplete_details.reason == "max_output_tokens" and r.id.startswith("resp_")
    assert (r.usage.input_tokens, r.usage.output_tokens) == (ref.prompt_tokens, 6)
    done = oai.responses.create(model="any", input="x b", max_output_tokens=16, temperature=0)
    ref = _ref(hmad.socket, messages=[{"role": "user", "content": "x b"}], max_tokens=16, temperature=0)
    assert done.output_text == ref.text and done.status == (
        "completed" if ref.finish_reason == "stop" else "incomplete"
    )


def test_stream_events_and_text(oai, hmad):
    kw = {
        "model": "any",
        "instructions": INSTRUCTIONS,
        "input": INPUT,
        "temperature": 0,
        "max_output_tokens": 6,
    }
    events = list(oai.responses.create(**kw, stream=True))
    ref = _ref(hmad.socket, messages=HMAD_MESSAGES, max_tokens=6, temperature=0)
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type.endswith(".delta")) == ref.text
    assert events[-1].response.output_text == ref.text and events[-1].response.usage.output_tokens == 6
    text = {
        "format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}
    }  # a finite answer: completed
    with oai.responses.stream(model="any", input="x b", max_output_tokens=64, temperature=0, text=text) as s:
        final = s.get_final_response()
    ref = _ref(hmad.socket, messages=[{"role": "user", "content": "x b"}], max_tokens=64, temperature=0,
               json_schema=SCHEMA)  # fmt: skip
    assert final.output_text == ref.text and final.status == "completed" and ref.finish_reason == "stop"


def test_text_format_is_hmads_json_schema(oai, hmad):
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}}
    r = oai.responses.create(model="any", input="x b", max_output_tokens=32, text=fmt)
    assert json.loads(r.output_text)["x"] in (1, 2) and r.status == "completed"


def test_function_call_and_its_output(oai, hmad):
    kw = {"model": "any", "tools": [WEATHER], "temperature": 0, "parallel_tool_calls": False}
    ask = [{"role": "user", "content": "weather in Oslo?"}]
    r = oai.responses.create(input=ask, tool_choice="required", max_output_tokens=64, **kw)
    [call] = r.output
    assert (call.type, call.name, r.status) == ("function_call", "get_weather", "completed")
    assert json.loads(call.arguments)["city"] in ("Oslo", "Rome")
    with oai.responses.stream(input=ask, tool_choice="required", max_output_tokens=64, **kw) as s:
        streamed = s.get_final_response()
    assert [(o.type, o.arguments) for o in streamed.output] == [("function_call", call.arguments)]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    history = [
        *ask,
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
    ]
    answer = oai.responses.create(input=[*history, output], tool_choice="none", max_output_tokens=6, **kw)
    hmad_history = [
        *ask,
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.call_id, "name": call.name, "arguments": json.loads(call.arguments)}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
    ]  # fmt: skip
    tool = {k: WEATHER[k] for k in ("name", "description", "parameters")}
    ref = _ref(
        hmad.socket, messages=hmad_history, tools=[tool], tool_choice="none", max_tokens=6, temperature=0
    )
    assert answer.output_text == ref.text


# -- errors ------------------------------------------------------------------------------------------------

BODY = {"model": "any", "input": "hi", "max_output_tokens": 2}
IMAGE = {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}


@pytest.mark.parametrize(
    ("change", "param", "says"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "keeps no responses"),
        ({"conversation": "conv_1"}, "conversation", "keeps no responses"),
        ({"background": True}, "background", "background"),
        ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens must be an integer from 1"),
        ({"temperature": -1}, "temperature", "temperature must be"),
        ({"input": None}, "input", "input"),
        ({"input": [{"role": "user", "content": [IMAGE]}]}, "input[0].content", "decoded image is 3 bytes"),
        ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role", "role must be"),
        ({"input": [{"type": "web_search_call"}]}, "input[0].type", "not supported"),
        ({"tools": [{"type": "web_search"}]}, "tools", "not supported"),
        ({"top_logprobs": 21}, "top_logprobs", "top_logprobs"),
        ({"text": {"format": {"type": "json_schema"}}}, "text.format", "json_schema with a schema"),
    ],
)  # fmt: skip
def test_bad_requests_are_400(http, hmad, change, param, says):
    body = {k: v for k, v in {**BODY, **change}.items() if v is not None}
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and says in err["message"], err


def test_store_is_ignored_and_the_client_raises_errors(oai, hmad):
    r = oai.responses.create(model="any", input="x b", max_output_tokens=2, store=True, metadata={"a": "b"})
    assert r.store is False and r.usage.output_tokens <= 2
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(model="any", input="x b", previous_response_id=r.id)
    assert info.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)


# -- fuzz --------------------------------------------------------------------------------------------------

SHAPES = {
    "input": st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "x"])},
            optional={"role": st.sampled_from(["user", "developer", "tool"]), "content": st.text(max_size=3)},
        ),
        max_size=3,
    ),
    "text": st.fixed_dictionaries(
        {"format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_schema"])})}
    ),
    "tools": st.lists(
        st.fixed_dictionaries({"type": st.just("function"), "name": st.text(max_size=4)}), max_size=2
    ),
    "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function"}]),
    "top_logprobs": st.integers(-1, 21),
    "include": st.lists(st.sampled_from(["message.output_text.logprobs", "reasoning.encrypted_content", 5])),
}


@FUZZ
@given(body=st.data(), stream=st.booleans())
def test_fuzz_one_reply_each(gateway, daemon, body, stream):
    data = body.draw(malformed({**BODY, "stream": stream}, SHAPES))
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(gateway.url + "/v1/responses", content=data, headers=headers, timeout=60)
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert r.json()["error"]["message"]
    elif r.headers["content-type"].startswith("text/event-stream"):
        last = [line for line in r.text.splitlines() if line.startswith("event: ")][-1]
        assert last in ("event: response.completed", "event: response.incomplete", "event: error"), r.text
    else:
        assert r.json()["object"] == "response"
    assert_serving(daemon, gateway)
