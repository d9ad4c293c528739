"""Structured output through a real hmad on a real socket: the embedded 270M (a base model: its free text is
poor, the constraint is what makes it valid JSON) answers a nested schema greedily and sampled, every answer
parsing and validating; a schema that cannot be finished in max_tokens ends "length" with
schema_complete false; bad schemas are bad_request; protocol versions 1 and 2 side by side; hmactl's
--json-schema; a daemon without llguidance refuses json_schema and serves the rest; the 270M's tool calls
carry the arguments the question gives."""

from __future__ import annotations

import asyncio
import json
import os

import jsonschema
import pytest
import zmq
from daemon_harness import Daemon
from tiny_gguf import make_tiny_gguf

from hmaclient import AsyncClient, Client, RequestError, cli
from hmaclient import protocol as P

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "height_m": {"type": "number", "minimum": 0.5, "maximum": 2.5},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "active": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["new", "remote", "lead"]}, "minItems": 1, "maxItems": 2},
        "office": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "height_m", "role", "active", "tags", "office"],
    "additionalProperties": False,
}
PROMPT = "Give a user record for our staff directory as JSON."
YES_NO = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def hmad(embedded_model_path, tmp_path_factory):
    d = Daemon(embedded_model_path, tmp_path_factory.mktemp("hmad"), "engine.max_seqs=8").wait_ready()
    yield d
    assert d.stop() == 0, d.log_text()


@pytest.mark.slow
def test_nested_schema_answers_parse_and_validate(hmad):
    """Greedy, and sampled at two temperatures and seeds, served together in one batch (about 70 steps of
    the 270M; the tiny model's test in test_structured.py runs more seeds)."""
    runs = [{"temperature": 0.0}, {"temperature": 0.8, "seed": 1}, {"temperature": 1.2, "seed": 3}]

    async def ask_all():
        async with AsyncClient(hmad.socket, timeout=None) as c:  # pytest's own timeout bounds it
            asks = [c.generate(PROMPT, json_schema=PERSON, max_tokens=160, **kw) for kw in runs]
            return await asyncio.gather(*asks)

    for kw, r in zip(runs, asyncio.run(ask_all()), strict=True):
        assert (r.finish_reason, r.extra.get("schema_complete")) == ("stop", True), (kw, r.text)
        jsonschema.validate(json.loads(r.text), PERSON)
    with Client(hmad.socket) as c:
        assert c.status()["json_mask_ms"] > 0


def test_a_schema_that_cannot_be_met_in_max_tokens_ends_with_length(hmad):
    schema = {"type": "array", "items": {"type": "integer"}, "minItems": 50}
    with Client(hmad.socket, timeout=300) as c:
        # once first, so that both compared requests reuse the same cached prompt blocks: a prefill that
        # starts from cached blocks sums in another order than a whole one (a near tie may flip)
        c.generate(PROMPT, json_schema=schema, max_tokens=5, temperature=0)
        r = c.generate(PROMPT, json_schema=schema, max_tokens=5, temperature=0)
        pieces = list(c.stream(PROMPT, json_schema=schema, max_tokens=5, temperature=0))
    assert (r.finish_reason, r.extra["schema_complete"], r.generated_tokens) == ("length", False, 5)
    assert r.text.lstrip().startswith("[")
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.text)
    assert "".join(p.text for p in pieces) == r.text  # streamed or not, the same tokens


@pytest.mark.parametrize(
    "schema, problem",
    [
        ({"type": "object", "properties": {"a": {"type": "strng"}}}, "Invalid type: strng"),
        ({"type": "string", "pattern": "[a-"}, "regex parse error"),
        ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum (5) is greater than maximum (1)"),
    ],
)
def test_an_invalid_schema_is_a_bad_request(hmad, schema, problem):
    with Client(hmad.socket, timeout=60) as c:
        with pytest.raises(RequestError) as info:
            c.generate(PROMPT, json_schema=schema, max_tokens=5)
        with pytest.raises(P.ProtocolError, match="json_schema must be a map"):  # refused before sending
            c.generate(PROMPT, json_schema=[schema], max_tokens=5)
        assert c.generate("hi", max_tokens=1, temperature=0).generated_tokens == 1  # nothing else harmed
    assert info.value.code == P.BAD_REQUEST and problem in info.value.message


def test_protocol_versions_1_and_2_side_by_side(hmad):
    """A v1 client's frames (no json_schema) are served in v1; json_schema in a v1 frame is refused naming
    the field and the version; in a v2 frame it is served, every reply in v2."""
    v1 = {"v": 1, "type": "generate", "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": False}
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as s:
        s.setsockopt(zmq.LINGER, 0)
        s.connect(P.endpoint(hmad.socket))

        def replies(msg: dict) -> list[dict]:
            s.send(P.pack(msg))
            out = []
            while not out or out[-1]["type"] not in {*P.TERMINAL_TYPES, "pong"}:
                assert s.poll(300_000), "no reply"
                out.append(P.unpack(s.recv(), max_size=P.MAX_REPLY_BYTES))
            return out

        old = replies({**v1, "id": "a"})
        assert [m["type"] for m in old] == ["accepted", "done"] and {m["v"] for m in old} == {1}
        assert "schema_complete" not in old[-1]
        refused = replies({**v1, "id": "b", "json_schema": YES_NO})
        assert [(m["type"], m["v"], m["code"]) for m in refused] == [("error", 1, P.BAD_REQUEST)]
        assert "'json_schema'" in refused[0]["message"] and "version 2" in refused[0]["message"]
        new = replies({**v1, "v": 2, "id": "c", "json_schema": YES_NO, "max_tokens": 20})
        assert [m["type"] for m in new] == ["accepted", "done"] and {m["v"] for m in new} == {2}
        assert new[-1]["schema_complete"] is True and json.loads(new[-1]["text"])["answer"] in ("yes", "no")
        assert replies({"v": 1, "type": "ping", "id": 9})[0]["v"] == 1


def test_hmactl_query_with_a_json_schema(hmad, tmp_path, capsys):
    schema_file = tmp_path / "yes_no.json"
    schema_file.write_text(json.dumps(YES_NO))
    base = ["--socket", hmad.socket, "--timeout", "300", "query", "--max-tokens", "20", "--temperature", "0"]
    assert cli.main([*base, "--json-schema", str(schema_file), "--json", "Is the sky blue?"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schema_complete"] is True and json.loads(out["text"])["answer"] in ("yes", "no")
    assert cli.main([*base, "--json-schema", json.dumps(YES_NO), "Is the sky blue?"]) == 0  # streamed
    assert json.loads(capsys.readouterr().out) == json.loads(out["text"])  # the same greedy answer
    for bad in ("{not json", str(tmp_path / "missing.json"), "[1]"):
        with pytest.raises(SystemExit) as info:
            cli.main([*base, "--json-schema", bad, "x"])
        assert info.value.code == cli.EXIT_USAGE
    assert "--json-schema" in capsys.readouterr().err


def test_without_llguidance_json_schema_is_refused_and_the_rest_served(tmp_path):
    """An install without the grammar library (hidden here by a package that fails to import)."""
    hide = tmp_path / "hide"
    (hide / "llguidance").mkdir(parents=True)
    (hide / "llguidance" / "__init__.py").write_text("raise ImportError('hidden by the test')\n")
    path = os.pathsep.join(p for p in (str(hide), os.environ.get("PYTHONPATH")) if p)
    model = make_tiny_gguf(tmp_path / "tiny.gguf", seed=5)
    d = Daemon(model, tmp_path, env={"PYTHONPATH": path}).wait_ready()
    try:
        with Client(d.socket, timeout=60) as c:
            with pytest.raises(RequestError) as info:
                c.generate("the cat", json_schema={"type": "object"}, max_tokens=3)
            assert info.value.code == P.BAD_REQUEST and "llguidance" in info.value.message
            assert c.generate("the cat", max_tokens=3, temperature=0).generated_tokens == 3
    finally:
        assert d.stop() == 0, d.log_text()


WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Get the current weather for a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "the city"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city"],
    },
}


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize(
    ("question", "want"),
    [
        ("What is the weather in Paris?", {"city": "Paris"}),
        ("How warm is it in Tokyo right now, in fahrenheit?", {"city": "Tokyo", "unit": "fahrenheit"}),
    ],
)
def test_the_270m_calls_a_tool_with_the_arguments_the_question_gives(hmad, question, want, parallel):
    """The embedded model, greedy, tool_choice required: one call, its arguments the question's (the
    objects decoded closed: no keys copied from the schema; a list of calls ends at its first repeat)."""
    messages = [{"role": "user", "content": question}]
    with Client(hmad.socket) as c:
        r = c.generate(messages=messages, tools=[WEATHER_TOOL], tool_choice="required",
                       parallel_tool_calls=parallel, max_tokens=200, temperature=0)  # fmt: skip
    assert r.finish_reason == "tool_calls" and len(r.tool_calls) == 1, (r.text, r.tool_calls)
    [call] = r.tool_calls
    args = json.loads(call["arguments"])
    jsonschema.validate(args, {**WEATHER_TOOL["parameters"], "additionalProperties": False})
    assert call["name"] == "get_weather" and args.items() >= want.items(), args
