"""hmad-openai's Anthropic Messages API through the official ``anthropic`` client (and raw HTTP through httpx)
against a real gateway in front of a real hmad (gateway_harness.py): answers equal hmaclient's for the same
request."""

from __future__ import annotations

import json

import anthropic
import gateway_harness as harness
import httpx
import pytest
from gateway_harness import FUZZ, KEY, TINY_NAME, assert_serving, malformed
from hypothesis import given
from hypothesis import strategies as st

from hmaclient import Client

daemon, gateway, hmad = harness.daemon, harness.gateway, harness.hmad  # the module's fixtures

SYSTEM = "Answer briefly."
MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "b"}]}]
GREEDY = {"temperature": 0}
HMAD_MESSAGES = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "x\nb"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"enum": ["Oslo", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}

ANY = {"type": "any", "disable_parallel_tool_use": True}  # one call: the tiny model may not close a list


@pytest.fixture
def client(gateway):
    return anthropic.Anthropic(base_url=gateway.url, api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture
def http(gateway):
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    with httpx.Client(base_url=gateway.url, headers=headers, timeout=60) as h:
        yield h


def _ref(socket: str, **kw):
    with Client(socket) as c:
        return c.generate(**kw)


def test_message_equals_hmad(client, hmad):
    r = client.messages.create(model="any", system=SYSTEM, messages=MESSAGES, max_tokens=6, extra_body=GREEDY)
    ref = _ref(hmad.socket, messages=HMAD_MESSAGES, max_tokens=6, temperature=0)
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == ref.text
    assert (r.role, r.model, r.type, r.stop_reason) == ("assistant", TINY_NAME, "message", "max_tokens")
    assert r.id.startswith("msg_") and r.stop_sequence is None
    u = r.usage
    assert (u.input_tokens + u.cache_read_input_tokens, u.output_tokens) == (ref.prompt_tokens, 6)


def test_stream_events_and_text(client, http, hmad):
    kw = {"model": "any", "messages": MESSAGES, "max_tokens": 6}
    system = [{"type": "text", "text": SYSTEM}]  # blocks, as the str
    with client.messages.stream(system=system, **kw, extra_body=GREEDY) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    ref = _ref(hmad.socket, messages=HMAD_MESSAGES, max_tokens=6, temperature=0)
    assert text == final.content[0].text == ref.text and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 6 and final.usage.input_tokens > 0
    r = http.post("/v1/messages", json={**kw, **GREEDY, "system": SYSTEM, "stream": True})
    names = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
    deltas = names.count("content_block_delta")
    assert names == [
        "message_start",
        "content_block_start",
        "ping",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert deltas >= 1 and r.headers["content-type"].startswith("text/event-stream")


def test_end_turn_and_sampling_fields(client, hmad):
    ask = [{"role": "user", "content": "x b"}]
    sampled = {"temperature": 1.5, "top_p": 0.9, "top_k": 40}  # not in this client's signature: sent as is
    r = client.messages.create(model="any", messages=ask, max_tokens=8, extra_body=sampled)
    assert r.stop_reason in ("end_turn", "max_tokens") and r.usage.output_tokens <= 8
    cut = client.messages.create(
        model="any", messages=ask, max_tokens=8, stop_sequences=["\n"], extra_body=GREEDY
    )
    ref = _ref(hmad.socket, messages=ask, max_tokens=8, temperature=0, stop=["\n"])
    assert cut.content[0].text == ref.text and ref.finish_reason == "stop"
    named = ref.extra.get("stop_sequence")  # hmad's done names the stop string that cut the answer
    assert (cut.stop_reason, cut.stop_sequence) == (("stop_sequence", "\n") if named else ("end_turn", None))


STOPS = ["zzz", "\n\n"]  # the tiny model answers a chat with newlines (the template's last token repeated)


def test_stop_sequence_is_named(client, http, hmad):
    """Of two stop sequences, the one that cut the answer is named, whole and streamed (message_delta)."""
    ask = [{"role": "user", "content": "x b"}]
    ref = _ref(hmad.socket, messages=ask, max_tokens=8, temperature=0, stop=STOPS)
    assert ref.finish_reason == "stop" and ref.extra["stop_sequence"] == "\n\n"
    kw = {"model": "any", "messages": ask, "max_tokens": 8, "stop_sequences": STOPS}
    r = client.messages.create(**kw, extra_body=GREEDY)
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", "\n\n")
    assert "".join(b.text for b in r.content) == ref.text
    streamed = http.post("/v1/messages", json={**kw, **GREEDY, "stream": True})
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: ")]
    [delta] = [e["delta"] for e in events if e["type"] == "message_delta"]
    assert (delta["stop_reason"], delta["stop_sequence"]) == ("stop_sequence", "\n\n")


def test_an_empty_answer_streams_through_the_client(client, hmad):
    kw = {"model": "any", "messages": [{"role": "user", "content": "x b"}], "max_tokens": 8}
    with client.messages.stream(**kw, stop_sequences=STOPS, extra_body=GREEDY) as s:
        r = s.get_final_message()
    assert (r.stop_reason, r.stop_sequence, r.content[0].text) == ("stop_sequence", "\n\n", "")


def test_output_config_format_is_hmads_json_schema(client, hmad):
    schema = {"type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"],
              "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}  # fmt: skip
    config = {"output_config": {"format": {"type": "json_schema", "schema": schema}}}
    r = client.messages.create(model="any", messages=MESSAGES, max_tokens=32, extra_body=config)
    assert json.loads(r.content[0].text)["x"] in (1, 2) and r.stop_reason == "end_turn"


def test_tool_use_and_its_result(client, hmad):
    """A call under tool_choice any (the grammar guarantees one), then the tool's result sent back."""
    ask = [{"role": "user", "content": "weather in Oslo?"}]
    kw = {"model": "any", "max_tokens": 64, "tools": [WEATHER], "extra_body": GREEDY}
    r = client.messages.create(messages=ask, tool_choice=ANY, **kw)
    [call] = r.content
    assert (r.stop_reason, call.type, call.name) == ("tool_use", "tool_use", "get_weather")
    assert call.input["city"] in ("Oslo", "Rome")
    with client.messages.stream(messages=ask, tool_choice=ANY, **kw) as s:
        streamed = s.get_final_message()
    assert [(b.type, b.input) for b in streamed.content] == [("tool_use", call.input)]
    used = {"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}
    history = [*ask, {"role": "assistant", "content": [used]}, {"role": "user", "content": [result]}]
    answer = client.messages.create(messages=history, tool_choice={"type": "none"}, **{**kw, "max_tokens": 6})
    hmad_call = {"id": call.id, "name": call.name, "arguments": call.input}
    hmad_history = [
        *ask,
        {"role": "assistant", "content": "", "tool_calls": [hmad_call]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    tool = {
        "name": WEATHER["name"],
        "description": WEATHER["description"],
        "parameters": WEATHER["input_schema"],
    }
    ref = _ref(
        hmad.socket, messages=hmad_history, tools=[tool], tool_choice="none", max_tokens=6, temperature=0
    )
    assert answer.content[0].text == ref.text and answer.stop_reason == "max_tokens"


# -- errors ------------------------------------------------------------------------------------------------

BODY = {"model": "any", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"max_tokens": None}, "max_tokens is required"),
        ({"max_tokens": 0}, "max_tokens must be an integer from 1"),
        ({"temperature": -1}, "temperature must be"),
        ({"top_k": -1}, "top_k must be"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}, "prefill"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image blocks"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools"),
        ({"tool_choice": {"type": "maybe"}}, "tool_choice type"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ],
)
def test_bad_requests_are_400_in_anthropics_shape(http, hmad, change, says):
    body = {k: v for k, v in {**BODY, **change}.items() if v is not None}
    r = http.post("/v1/messages", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"
    assert says in r.json()["error"]["message"], r.json()


def test_client_errors_key_and_unknown_paths(gateway, client, http, hmad):
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(
            model="any", messages=BODY["messages"], max_tokens=2, extra_body={"temperature": 200}
        )
    assert "temperature" in info.value.body["error"]["message"]
    wrong = anthropic.Anthropic(base_url=gateway.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        wrong.messages.create(model="any", messages=BODY["messages"], max_tokens=2)
    assert info.value.body["error"]["type"] == "authentication_error"
    r = http.post("/v1/messages/count_tokens", json=BODY)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_disconnect_mid_stream_cancels_in_hmad(http, hmad):
    body = {**BODY, "messages": [{"role": "user", "content": "x b"}], "max_tokens": 100000, "stream": True}
    with Client(hmad.socket) as c:
        with http.stream("POST", "/v1/messages", json=body) as r:
            lines = r.iter_lines()  # one iterator kept open (see test_openai_gateway's disconnect test)
            while "content_block_delta" not in next(lines):
                pass
            assert harness.load(c)[0] == 1  # generating
        harness.wait(lambda: harness.load(c) == (0, 0, 0))  # the connection closed: cancelled in hmad


# -- fuzz --------------------------------------------------------------------------------------------------

SHAPES = {
    "messages": st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "assistant"]),
                "content": st.text(max_size=3)
                | st.lists(
                    st.fixed_dictionaries({"type": st.sampled_from(["text", "tool_result", "image"])})
                ),
            }
        ),
        max_size=2,
    ),
    "system": st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=3)})),
    "tools": st.lists(st.fixed_dictionaries({"name": st.text(max_size=4)}), max_size=2),
    "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(["auto", "any", "tool", "x"])}),
}


@FUZZ
@given(body=st.data(), stream=st.booleans())
def test_fuzz_one_reply_each(gateway, daemon, body, stream):
    data = body.draw(malformed({**BODY, "stream": stream}, SHAPES))
    headers = {"x-api-key": KEY, "Content-Type": "application/json"}
    r = httpx.post(gateway.url + "/v1/messages", content=data, headers=headers, timeout=60)
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        assert r.json()["type"] == "error" and r.json()["error"]["message"]
    elif r.headers["content-type"].startswith("text/event-stream"):
        last = [line for line in r.text.splitlines() if line.startswith("event: ")][-1]
        assert last in ("event: message_stop", "event: error"), r.text
    else:
        assert r.json()["type"] == "message" and json.dumps(r.json())
    assert_serving(daemon, gateway)
