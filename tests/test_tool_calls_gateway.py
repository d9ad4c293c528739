"""Tool calling through hmad-openai with the official ``openai`` client, against a real gateway and a real
hmad on a tiny random GGUF (random weights: the call grammar is what makes the calls valid): a two-turn
agent loop (call -> tool result -> answer), streamed tool_calls deltas that reassemble to the call the
whole answer gives, the refusals (legacy functions, a tool message without its call's id, a tool whose
schema cannot be compiled), each a 400 with the daemon serving on, and a short fuzz of the tool fields
(one reply each: 200 or 400, never a 500)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from daemon_harness import Daemon
from gateway_harness import CLEAN_EXIT, FUZZ, Gateway, assert_serving, malformed
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_gguf import make_tiny_gguf

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["Paris", "Oslo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 3},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
SCHEMA = WEATHER["function"]["parameters"]
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    model = make_tiny_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf", seed=5)
    d = Daemon(model, tmp_path_factory.mktemp("hmad"), "engine.max_seqs=2").wait_ready()
    yield d
    assert d.stop() == 0, d.log_text()


@pytest.fixture(scope="module")
def gateway(daemon, tmp_path_factory):
    g = Gateway(daemon.socket, tmp_path_factory.mktemp("gateway"))
    yield g
    assert g.stop() in CLEAN_EXIT, g.log_path.read_text()


@pytest.fixture(scope="module")
def oai(gateway):
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0, timeout=60)


def _valid_call(call) -> dict:
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMA)
    return args


def test_a_two_turn_agent_loop(oai, daemon):
    first = oai.chat.completions.create(
        model="any",
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=0,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    _valid_call(call)
    history = [
        *ASK,
        choice.message.model_dump(exclude_none=True),  # what agent frameworks send back: content null
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": -3})},
    ]
    second = oai.chat.completions.create(
        model="any", messages=history, tools=[WEATHER], max_tokens=24, temperature=0
    )
    answer = second.choices[0]
    if answer.finish_reason == "tool_calls":  # "auto": the random model may call again; then validly
        _valid_call(answer.message.tool_calls[0])
    else:
        assert answer.message.tool_calls is None and answer.message.content
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its result are in the prompt
    final = oai.chat.completions.create(
        model="any", messages=history, tools=[WEATHER], tool_choice="none", max_tokens=4, temperature=0
    )
    assert (
        final.choices[0].finish_reason in ("stop", "length") and final.choices[0].message.tool_calls is None
    )


def test_streamed_deltas_reassemble_to_the_whole_answers_call(oai, daemon):
    named = {"type": "function", "function": {"name": "get_weather"}}
    kw = {
        "model": "any",
        "messages": ASK,
        "tools": [WEATHER],
        "tool_choice": named,
        "max_tokens": 200,
        "parallel_tool_calls": False,
    }
    whole = oai.chat.completions.create(**kw, temperature=0).choices[0]
    calls: dict[int, dict] = {}
    content, finish = "", None
    for chunk in oai.chat.completions.create(**kw, temperature=0, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or ():
            c = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            c["id"] += d.id or ""
            c["name"] += d.function.name or ""
            c["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == ""  # a call's text is not content
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (t.function.name, json.loads(t.function.arguments)) for t in whole.message.tool_calls
    ]
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMA)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"functions": [WEATHER["function"]]}, "functions"),
        ({"messages": [*ASK, {"role": "tool", "content": "3"}]}, "messages[1].tool_call_id"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]}, None),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, None),
    ],
)
def test_bad_tool_requests_are_400(oai, daemon, body, param):
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(**{"model": "any", "messages": ASK, "max_tokens": 2, **body})
    assert info.value.status_code == 400 and (param is None or info.value.body["param"] == param)
    assert oai.chat.completions.create(model="any", messages=ASK, max_tokens=1).choices[0].finish_reason


CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
SHAPES = {
    "tools": st.lists(
        st.fixed_dictionaries(
            {
                "type": st.sampled_from(["function", "x"]),
                "function": st.fixed_dictionaries({"name": st.text(max_size=4)}),
            }
        ),
        max_size=2,
    ),
    "tool_choice": st.sampled_from(
        ["auto", "none", "required", "any", {"type": "function", "function": {"name": "f"}}]
    ),
    "parallel_tool_calls": st.sampled_from([True, False, 1]),
    "messages": st.lists(
        st.sampled_from(
            [
                ASK[0],
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
                {"role": "tool", "tool_call_id": "c1", "content": "3"},
                {"role": "tool", "content": "3"},
                {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "3"}]},
            ]
        ),
        min_size=1,
        max_size=3,
    ),
}


@settings(FUZZ, max_examples=8)
@given(body=st.data(), stream=st.booleans())
def test_fuzz_of_tool_fields_one_reply_each(gateway, daemon, body, stream):
    valid = {"model": "any", "messages": ASK, "tools": [WEATHER], "max_tokens": 2, "stream": stream}
    data = body.draw(malformed(valid, SHAPES))
    r = httpx.post(
        gateway.url + "/v1/chat/completions",
        content=data,
        headers={"Content-Type": "application/json"},
        timeout=60,
    )
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert r.json()["error"]["message"]
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.endswith("data: [DONE]\n\n") and '"finish_reason":' in r.text, r.text
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length", "tool_calls")
    assert_serving(daemon, gateway)
