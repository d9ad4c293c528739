"""hmad-openai's Ollama API through the official ``ollama`` client (and raw HTTP through httpx) against a real
gateway in front of a real hmad (gateway_harness.py): answers equal hmaclient's for the same request."""

from __future__ import annotations

import json
import re

import gateway_harness as harness
import httpx
import ollama
import pytest
from gateway_harness import FUZZ, KEY, TINY_NAME, assert_serving, malformed
from hypothesis import given
from hypothesis import strategies as st

import hmad as hmad_package
from hmaclient import Client
from hmad_openai.ollama_api import ollama_name

daemon, gateway, hmad = harness.daemon, harness.gateway, harness.hmad  # the module's fixtures

MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "x b"}]
GREEDY = {"temperature": 0, "num_predict": 6}


@pytest.fixture
def client(gateway):
    return ollama.Client(host=gateway.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


@pytest.fixture
def http(gateway):
    with httpx.Client(base_url=gateway.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as h:
        yield h


def _ref(socket: str, *args, **kw):
    with Client(socket) as c:
        return c.generate(*args, **kw)


# -- probes and the model -----------------------------------------------------------------------------------


def test_probes_and_version(gateway, http, hmad):
    assert httpx.head(gateway.url + "/").status_code == 200  # no key: Ollama's liveness probe
    r = httpx.get(gateway.url + "/")
    assert (r.status_code, r.text) == (200, "Ollama is running")
    assert http.get("/api/version").json() == {"version": hmad_package.__version__}


def test_tags_ps_show(client, hmad):
    [listed] = client.list().models
    assert listed.model == f"{TINY_NAME}:latest" and listed.details.family == "gemma3"
    assert listed.size > 0 and len(listed.digest) == 64
    [running] = client.ps().models
    assert running.model == listed.model and running.size > 0 and running.expires_at.year > 2100
    assert running.size_vram == 0  # the CPU backend: no device-local heap
    with Client(hmad.socket) as c:
        context = c.status()["context_length"]
    assert running.context_length == context
    shown = client.show(TINY_NAME)
    assert shown.modelinfo["gemma3.context_length"] == context and shown.capabilities == [
        "completion",
        "tools",
    ]
    assert client.show(listed.model).details.format == "gguf"
    with pytest.raises(ollama.ResponseError) as info:
        client.show("llama3.2")
    assert info.value.status_code == 404 and "llama3.2" in info.value.error


@pytest.mark.parametrize(
    ("name", "listed"),
    [
        ("Gemma 3 270m", "gemma-3-270m:latest"),  # the embedded model's general.name
        ("gemma3:27b-it-q4_K_M", "gemma3:27b-it-q4_k_m"),
        ("  ", "hmad:latest"),
    ],
)
def test_ollama_names(name, listed):
    assert ollama_name(name) == listed


@given(st.text())
def test_any_model_name_becomes_an_ollama_name(name):
    assert re.fullmatch(r"[a-z0-9._-]+:[a-z0-9._-]+", ollama_name(name))


# -- chat and generate -------------------------------------------------------------------------------------


def test_chat_equals_hmad(client, hmad):
    r = client.chat(model="any", messages=MESSAGES, options=GREEDY, stream=False)
    ref = _ref(hmad.socket, messages=MESSAGES, max_tokens=6, temperature=0)
    assert (r.message.role, r.message.content) == ("assistant", ref.text)
    assert (r.done, r.done_reason, r.model) == (True, ref.finish_reason, TINY_NAME)
    assert (r.prompt_eval_count, r.eval_count) == (ref.prompt_tokens, ref.generated_tokens)
    assert r.total_duration >= r.eval_duration >= 0 and r.prompt_eval_duration > 0


def test_chat_streams_by_default(http, client, hmad):
    parts = list(client.chat(model="any", messages=MESSAGES, options=GREEDY, stream=True))
    ref = _ref(hmad.socket, messages=MESSAGES, max_tokens=6, temperature=0)
    assert "".join(p.message.content for p in parts) == ref.text
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert parts[-1].done_reason == ref.finish_reason and parts[-1].eval_count == ref.generated_tokens
    body = {"model": "any", "messages": MESSAGES, "options": GREEDY}  # no "stream": Ollama streams
    r = http.post("/api/chat", json=body)
    assert r.headers["content-type"] == "application/x-ndjson"
    lines = [json.loads(line) for line in r.text.splitlines()]
    assert "".join(x["message"]["content"] for x in lines) == ref.text and lines[-1]["done"]


@pytest.mark.parametrize("stream", [False, True])
def test_generate_templated_raw_and_system(client, hmad, stream):
    def text(**kw):
        r = client.generate(model="any", options={"temperature": 0, "num_predict": 4}, stream=stream, **kw)
        return "".join(p.response for p in r) if stream else r.response

    with Client(hmad.socket) as c:
        templated = c.generate("x b", max_tokens=4, temperature=0).text
        raw = c.generate("x b", raw=True, max_tokens=4, temperature=0).text
        system = c.generate(messages=MESSAGES, max_tokens=4, temperature=0).text
    assert text(prompt="x b") == templated
    assert text(prompt="x b", raw=True) == raw == " b b b b"
    assert text(prompt="x b", system="Answer briefly.") == system


def test_options_map_to_hmads_fields(client, hmad):
    def gen(**options):
        return client.generate(model="any", prompt="a x b", raw=True, options=options).response

    kw = {"temperature": 1.5, "top_p": 0.9, "top_k": 40, "min_p": 0.01}
    with Client(hmad.socket) as c:
        seeded = c.generate("a x b", raw=True, seed=11, max_tokens=8, **kw).text
        penalised = c.generate("a x b", raw=True, temperature=0, max_tokens=8, repetition_penalty=1.5,
                               repeat_last_n=4).text  # fmt: skip
        present = c.generate("a x b", raw=True, temperature=0, max_tokens=8, presence_penalty=1.5,
                             frequency_penalty=0.5).text  # fmt: skip
    assert gen(seed=11, num_predict=8, **kw) == gen(seed=11.0, num_predict=8.0, **kw) == seeded
    assert gen(temperature=0, num_predict=8, repeat_penalty=1.5, repeat_last_n=4) == penalised
    assert gen(temperature=0, num_predict=8, presence_penalty=1.5, frequency_penalty=0.5) == present
    assert gen(temperature=0, num_predict=-1, stop=["b b"]) == " "  # no limit, cut by the stop string
    assert gen(temperature=0, num_predict=3, num_ctx=8192, num_gpu=99, penalize_newline=True) == " b b b"


def test_format_json_and_schema(client, hmad):
    options = {"temperature": 0, "num_predict": 12}
    r = client.chat(model="any", messages=MESSAGES, format="json", options=options)
    ref = _ref(hmad.socket, messages=MESSAGES, max_tokens=12, temperature=0, json_schema={"type": "object"})
    assert r.message.content == ref.text and ref.text.startswith("{")
    schema = {"type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"],
              "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}  # fmt: skip
    r = client.generate(model="any", prompt="x b", format=schema, options={"num_predict": 32})
    assert json.loads(r.response)["x"] in (1, 2) and r.done_reason == "stop"


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Oslo", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("stream", [False, True])
def test_tool_calls_and_their_results(client, hmad, stream):
    """Ollama has no tool_choice: a call comes when the model's answer opens with { or [ (the grammar then
    makes it a valid call); either way the answer equals hmad's (the tiny model's greedy one is text). The
    call in the history is hmad's under tool_choice required; the answer after its result equals hmad's."""
    ask = [{"role": "user", "content": "weather in Oslo?"}]
    with Client(hmad.socket) as c:
        ref = c.generate(messages=ask, tools=[WEATHER], max_tokens=24, temperature=0)
        call = c.generate(messages=ask, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                          max_tokens=64, temperature=0).tool_calls[0]  # fmt: skip
    options = {"temperature": 0, "num_predict": 24}
    parts = client.chat(model="any", messages=ask, tools=[WEATHER], options=options, stream=stream)
    parts = list(parts) if stream else [parts]
    calls = [c for p in parts for c in p.message.tool_calls or ()]
    if ref.tool_calls:
        assert [(c.function.name, c.function.arguments) for c in calls] == [
            (x["name"], json.loads(x["arguments"])) for x in ref.tool_calls
        ]
    else:
        assert calls == [] and "".join(p.message.content for p in parts) == ref.text
    assert parts[-1].done_reason == ("stop" if ref.finish_reason == "tool_calls" else ref.finish_reason)
    arguments = json.loads(call["arguments"])
    function = {"name": call["name"], "arguments": arguments}
    history = [
        *ask,
        {"role": "assistant", "content": "", "tool_calls": [{"function": function}]},
        {"role": "tool", "content": "sunny", "tool_name": call["name"]},
    ]
    answer = client.chat(
        model="any", messages=history, tools=[WEATHER], options={"temperature": 0, "num_predict": 6}
    )
    with Client(hmad.socket) as c:
        hmad_history = [
            *ask,
            {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1_0", **function}]},
            {"role": "tool", "tool_call_id": "call_1_0", "name": call["name"], "content": "sunny"},
        ]
        ref = c.generate(messages=hmad_history, tools=[WEATHER], max_tokens=6, temperature=0)
    assert answer.message.content == ref.text


def test_empty_request_loads(client, hmad):
    r = client.chat(model="any", messages=[])
    assert (r.done, r.done_reason) == (True, "load")
    assert client.generate(model="any").done_reason == "load"


# -- errors ------------------------------------------------------------------------------------------------

CHAT = {"model": "any", "messages": [{"role": "user", "content": "hi"}], "stream": False}


@pytest.mark.parametrize(
    ("path", "change", "says"),
    [
        ("chat", {"options": {"temperature": -1}}, "temperature must be a number in [0, 100], got -1"),
        ("chat", {"options": {"num_predict": 0}}, "num_predict must be an integer from 1"),
        ("chat", {"options": {"top_p": 1.5}}, "top_p must be"),
        ("chat", {"options": {"typical_p": 0.5}}, "typical_p is not supported"),
        ("chat", {"options": {"mirostat": 2}}, "mirostat is not supported"),
        ("chat", {"options": {"presence_penalty": 3}}, "presence_penalty must be a number in [-2, 2], got 3"),
        ("chat", {"think": True}, "does not support thinking"),
        ("chat", {"tools": [{"type": "function"}]}, "tools[0] must be"),
        (
            "chat",
            {"tools": [{"type": "function", "function": {"name": "no spaces"}}]},
            "tools[0].name must be",
        ),
        (
            "chat",
            {"messages": [{"role": "user", "content": "x", "images": ["aGk="]}]},
            "decoded image is 2 bytes",
        ),
        ("chat", {"messages": [{"role": "tool", "content": "x"}]}, "no tool call before it"),
        ("chat", {"messages": [{"role": "function", "content": "x"}]}, "role 'function' is not supported"),
        ("chat", {"format": "xml"}, "invalid format"),
        ("chat", {"model": ""}, "model"),
        ("chat", {"messages": "hi"}, "messages"),
        ("generate", {"prompt": "x", "suffix": "y"}, "suffix is not supported"),
        ("generate", {"prompt": "x", "context": [1, 2]}, "/api/chat messages"),
        ("generate", {"prompt": "x", "raw": True, "system": "s"}, "raw prompt"),
    ],
)
def test_bad_requests_are_400_in_ollamas_shape(http, hmad, path, change, says):
    r = http.post(f"/api/{path}", json={**CHAT, **change})
    assert r.status_code == 400, r.text
    assert list(r.json()) == ["error"] and says in r.json()["error"], r.json()


def test_ollama_client_raises_them(client, hmad):
    with pytest.raises(ollama.ResponseError) as info:
        client.chat(model="any", messages=MESSAGES, options={"temperature": "hot"})
    assert info.value.status_code == 400 and "temperature" in info.value.error


def test_unknown_paths_and_key_in_ollamas_shape(gateway, http, hmad):
    r = http.post("/api/pull", json={"model": "x"})
    assert r.status_code == 404 and r.json() == {"error": "no such endpoint: POST /api/pull"}
    assert http.get("/api/chat").status_code == 405 and "error" in http.get("/api/chat").json()
    r = httpx.get(gateway.url + "/api/tags")
    assert r.status_code == 401 and "API key" in r.json()["error"]


def test_disconnect_mid_stream_cancels_in_hmad_and_requests_are_counted(http, hmad):
    body = {"model": "any", "prompt": "x b", "raw": True, "options": {"num_predict": 100000}}
    with Client(hmad.socket) as c:
        with http.stream("POST", "/api/generate", json=body) as r:
            lines = r.iter_lines()  # one iterator kept open (see test_openai_gateway's disconnect test)
            assert [json.loads(next(lines))["done"] for _ in range(3)] == [False] * 3
            assert harness.load(c)[0] == 1  # generating
        harness.wait(lambda: harness.load(c) == (0, 0, 0))  # the connection closed: cancelled in hmad
    metrics = http.get("/metrics").text
    assert 'hmad_openai_requests_total{endpoint="/api/generate",status="200"}' in metrics


# -- fuzz --------------------------------------------------------------------------------------------------

SHAPES = {
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "tool"])}), max_size=2),
    "options": st.dictionaries(
        st.sampled_from(["temperature", "top_k", "stop", "seed", "typical_p"]),
        st.integers(-2, 3) | st.text(max_size=3),
        max_size=2,
    ),  # fmt: skip
    "format": st.sampled_from(["json", "", "yaml", {"type": "object"}, {"type": 5}]),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(-1, 21),
}


@FUZZ
@given(path=st.sampled_from(["/api/chat", "/api/generate", "/api/show"]), body=st.data())
def test_fuzz_one_reply_each(gateway, daemon, path, body):
    valid = {**CHAT, "prompt": "x b", "options": {"num_predict": 2}}
    data = body.draw(malformed(valid, SHAPES))
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(gateway.url + path, content=data, headers=headers, timeout=60)
    assert r.status_code in (200, 400, 404), r.text
    if r.status_code != 200:
        assert isinstance(r.json()["error"], str)
    else:
        last = json.loads(r.text.splitlines()[-1])
        assert last.get("done") is True or "details" in last, r.text
    assert_serving(daemon, gateway)
