"""Tool calling in hmad's own protocol: the wire checks of tools, tool_choice and tool turns; the prompt
they render to; the call grammar on a tiny vocabulary (a call is the answer when it must be, its arguments
always validate); and a real hmad on a tiny random GGUF: random weights, yet ``required`` and a named tool
always give calls whose arguments validate against the tool's schema, ``none`` gives text, a history of
calls and results is accepted, bad requests get one error each and the daemon serves on."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from daemon_harness import Daemon
from tiny_gguf import make_tiny_gguf, tiny_vocab

from hmaclient import Client, RequestError
from hmaclient import protocol as P
from hmad.engine.tool_calls import ToolCallConstraint, call_schema, closed, tool_grammar
from hmad.model.chat import render_chat
from hmad.model.chat_template import ChatTemplate
from hmad.model.tokenizer import SpmTokenizer
from hmad.model.tools import fold_tools

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city now",
    "parameters": {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}, "unit": {"enum": ["C", "F"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ADD = {
    "name": "add",
    "description": "a + b",
    "parameters": {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 99},
            "b": {"type": "integer", "minimum": -9, "maximum": 9},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["name"]: t["parameters"] for t in TOOLS}
HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'}],
    },
    {"role": "tool", "tool_call_id": "c1", "content": '{"temp": -3}'},
]


def _generate(**fields):
    return P.validate_request({"v": 3, "type": "generate", "id": 1, **fields}, 1)


def _drain(gen, into: list):
    """Every item of a generator into ``into``; its return value."""
    while True:
        try:
            into.append(next(gen))
        except StopIteration as stop:
            return stop.value


def _check_calls(calls, names=tuple(SCHEMAS)):
    assert calls
    for c in calls:
        assert c["id"].startswith("call_") and c["name"] in names
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])


# -- the wire ----------------------------------------------------------------------------------------------


def test_tools_and_tool_turns_take_their_normal_forms():
    openai_style = [
        {"type": "function", "function": WEATHER},
        {"name": "add", "parameters": ADD["parameters"]},
    ]
    req = _generate(
        messages=HISTORY, tools=openai_style, tool_choice={"type": "function", "function": {"name": "add"}}
    )
    assert [t["name"] for t in req.tools] == ["get_weather", "add"] and req.tools[1]["description"] == ""
    assert req.tool_choice == {"name": "add"} and req.parallel_tool_calls and req.calls_tools
    assert req.messages[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "c1", "name": "get_weather", "arguments": {"city": "Oslo"}}],
    }
    assert req.messages[2] == {"role": "tool", "content": '{"temp": -3}', "tool_call_id": "c1"}
    assert not _generate(prompt="x", tools=TOOLS, tool_choice="none").calls_tools
    msg = P.generate_request(
        5, messages=HISTORY, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
    )
    assert msg["tool_choice"] == "required" and msg["parallel_tool_calls"] is False


@pytest.mark.parametrize(
    "fields, problem",
    [
        ({"tools": {"name": "f"}}, "tools must be a list"),
        ({"tools": [{"name": "no spaces"}]}, "tools[0].name must be"),
        ({"tools": [{"name": "f"}, {"name": "f"}]}, "given twice"),
        ({"tools": [{"name": "f", "parameters": []}]}, "tools[0].parameters must be a map"),
        ({"tools": [{"name": "f", "what": 1}]}, "tools[0] must be a map of"),
        ({"tools": [{"name": "f"}] * 129}, "over the limit of 128"),
        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice must be one of"),
        ({"tools": TOOLS, "tool_choice": {"name": "nope"}}, "not among the tools"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": TOOLS, "json_schema": {"type": "object"}}, "not both"),
        ({"tools": TOOLS, "parallel_tool_calls": 1}, "parallel_tool_calls must be a bool"),
    ],
)
def test_bad_tools_are_refused_naming_the_field(fields, problem):
    with pytest.raises(P.ProtocolError) as info:
        _generate(messages=[{"role": "user", "content": "hi"}], **fields)
    assert info.value.code == P.BAD_REQUEST and problem in info.value.message


@pytest.mark.parametrize(
    "message, problem",
    [
        ({"role": "tool", "content": "3"}, "tool_call_id must be"),
        ({"role": "tool", "content": 3, "tool_call_id": "c"}, "content (a tool result) must be a str"),
        ({"role": "tool", "tool_call_id": "c"}, "does not take"),
        ({"role": "user", "content": "", "tool_calls": []}, "does not take"),
        ({"role": "assistant", "content": "", "tool_calls": []}, "list of 1..64 calls"),
        ({"role": "assistant", "tool_calls": [{"id": "c", "name": "f"}]}, "exactly id, name, arguments"),
        ({"role": "assistant", "tool_calls": [{"id": "c", "name": "f", "arguments": "{"}]}, "is not JSON"),
        (
            {"role": "assistant", "tool_calls": [{"id": "c", "name": "f", "arguments": "[1]"}]},
            "a JSON object",
        ),
        ({"role": "assistant", "tool_calls": [{"id": "", "name": "f", "arguments": {}}]}, ".id must be"),
    ],
)
def test_bad_tool_turns_are_refused_naming_the_field(message, problem):
    with pytest.raises(P.ProtocolError) as info:
        _generate(messages=[{"role": "user", "content": "hi"}, message])
    assert info.value.code == P.BAD_REQUEST and problem in info.value.message


# -- the prompt --------------------------------------------------------------------------------------------


def test_the_prompt_holds_the_tools_the_calls_and_the_results():
    req = _generate(messages=[{"role": "system", "content": "Be brief."}, *HISTORY], tools=TOOLS)
    turns = fold_tools(req.messages, req.tools, req.tool_choice)
    assert [m["role"] for m in turns] == ["system", "user", "assistant", "user"]
    assert turns[0]["content"].startswith("You have access to functions.")
    assert json.loads(turns[0]["content"].split("function\n", 1)[1].rsplit("\n\nBe brief.", 1)[0]) == TOOLS
    assert f"[\n{json.dumps(WEATHER)},\n{json.dumps(ADD)}\n]" in turns[0]["content"]  # one per line
    assert json.loads(turns[2]["content"]) == {"name": "get_weather", "parameters": {"city": "Oslo"}}
    assert '"name": "get_weather", "tool_call_id": "c1", "content": "{\\"temp\\": -3}"' in turns[3]["content"]
    text = str(render_chat(turns))
    assert text.count("<start_of_turn>user\nYou have access to functions.") == 1
    assert text.endswith("```<end_of_turn>\n<start_of_turn>model\n")
    named = fold_tools(req.messages, req.tools, {"name": "add"})[0]["content"]
    assert "You MUST call the function add." in named and "JSON list" not in named
    none = fold_tools(req.messages, req.tools, "none")
    assert none[0] == {"role": "system", "content": "Be brief."}


def test_gemma3s_own_template_renders_the_tool_turns_as_the_builtin_does(tok):
    source = (Path(__file__).parent / "fixtures" / "chat_templates" / "gemma3_it.jinja").read_text()
    gemma3 = ChatTemplate(source, tok, "gemma3_it.jinja")
    req = _generate(messages=[*HISTORY, {"role": "assistant", "content": "-3 C."}, HISTORY[0]], tools=TOOLS)
    turns = fold_tools(req.messages, req.tools, req.tool_choice)  # (Gemma 3's roles must alternate)
    assert tok.encode(render_chat(turns, template=gemma3)) == tok.encode(render_chat(turns))


# -- the grammar -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok() -> SpmTokenizer:
    tokens, scores, types = tiny_vocab()
    return SpmTokenizer(tokens, scores, types, bos_id=2, eos_id=1, unk_id=3, add_space_prefix=False)


def _decode(c: ToolCallConstraint, rng, bias: dict[int, float] | None = None, steps: int = 300) -> None:
    for _ in range(steps):
        row = rng.standard_normal(c.classes.text.size).astype(np.float32)
        for t, b in (bias or {}).items():
            row[t] += b
        tok_id = int(np.argmax(c.mask(row)))
        if tok_id == 1:  # eos
            return
        c.accept(tok_id)
        if c.stopped:
            return


@pytest.mark.parametrize("choice", ["required", {"name": "add"}])
def test_forced_choices_always_decode_valid_calls(tok, choice):
    grammar = tool_grammar(TOOLS, choice, parallel=True)
    rng = np.random.default_rng(7)
    complete = 0
    for _ in range(6):
        c = ToolCallConstraint(grammar, tok)
        _decode(c, rng)
        assert c.phase == "call"
        if c.complete:  # (random logits may run out of steps in a long list of calls)
            _check_calls(c.calls(), ["add"] if isinstance(choice, dict) else SCHEMAS)
            complete += 1
    assert complete >= 3


def test_auto_is_text_unless_the_answer_opens_a_call(tok):
    grammar = tool_grammar(TOOLS, "auto", parallel=False)
    rng = np.random.default_rng(3)
    text = ToolCallConstraint(grammar, tok)
    _decode(text, rng, {tok.token_id("a"): 50.0}, steps=5)  # a text answer: never masked
    assert text.phase == "text" and text.calls() is None
    call = ToolCallConstraint(grammar, tok)
    _decode(call, rng, {tok.token_id("<0x7B>"): 50.0, tok.token_id("<0x5B>"): 60.0})  # "{", "[" favoured
    assert call.phase == "call" and call.complete
    _check_calls(call.calls())
    assert len(call.calls()) == 1  # parallel off: "[" never opens a list


def test_a_list_that_repeats_a_call_is_closed(tok):
    c = ToolCallConstraint(tool_grammar(TOOLS, "required", parallel=True), tok)
    call = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    for tok_id in tok.encode(
        f'[{call}, {{"name": "add", "parameters": {{"a": 7, "b": 2}}}}, {call}', add_bos=False
    ):
        assert np.isfinite(c.mask(np.zeros(tok.vocab_size, np.float32))[tok_id])
        c.accept(tok_id)
    allowed = np.isfinite(c.mask(np.zeros(tok.vocab_size, np.float32)))
    assert allowed.any() and not (allowed & ~c.classes.closes).any()  # only "]" may follow
    c.accept(tok.token_id("<0x5D>"))
    assert c.stopped and [json.loads(x["arguments"])["a"] for x in c.calls()] == [1, 7]  # each call once


def test_after_a_repeat_strings_are_not_forced_to_close_the_list(tok):
    """The 270M's loop: a token closes a repeated call and goes on with a comma; the next element's
    strings stay free (the list closes at that element's end, where "]" is allowed)."""
    c = ToolCallConstraint(tool_grammar(TOOLS, "required", parallel=True), tok)
    call = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    for tok_id in tok.encode(f'[{call}, {call}, {{"name": "get_weather", "parameters": {{"city": "', False):
        c.accept(tok_id)
    assert c.elements.repeated and not c.elements.between
    allowed = np.isfinite(c.mask(np.zeros(tok.vocab_size, np.float32)))
    assert (allowed & ~c.classes.closes).any()  # a city's letters, not only "]"
    for tok_id in tok.encode('Oslo"}}', False):
        c.accept(tok_id)
    allowed = np.isfinite(c.mask(np.zeros(tok.vocab_size, np.float32)))
    assert c.elements.between and allowed.any() and not (allowed & ~c.classes.closes).any()


def test_the_call_schema_pins_names_to_their_parameters():
    schema = call_schema(TOOLS, "auto", parallel=True)
    jsonschema.validate([{"name": "add", "parameters": {"a": 1, "b": 2}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "add", "parameters": {"city": "Oslo"}}, schema)
    with pytest.raises(ValueError, match="tool 'bad'"):
        tool_grammar([{"name": "bad", "parameters": {"type": "nope"}}], "auto", True)


def test_objects_that_say_nothing_of_other_keys_are_decoded_closed():
    obj = {"type": "object", "properties": {"city": {"type": "string"}}}
    schema = {
        "type": "object",
        "properties": {
            "where": obj,
            "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},  # a key so named
            "stops": {"type": "array", "items": obj},
            "either": {"anyOf": [obj, {"type": "null"}]},
            "open": {**obj, "additionalProperties": True},
            "tagged": {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x-": {}}},
        },
    }
    out = closed(schema)
    props = out["properties"]
    assert out["additionalProperties"] is False and set(props) == set(schema["properties"])
    assert props["where"]["additionalProperties"] is False
    assert props["properties"]["additionalProperties"] is False
    assert set(props["properties"]["properties"]) == {"x"}
    assert props["stops"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] is True and "additionalProperties" not in props["tagged"]
    assert schema["properties"]["where"] == obj  # the tool's own schema is left as it was
    for merged in (  # subschemas that add keys to the same object: neither side is closed
        {"allOf": [obj, {"properties": {"zip": {"type": "string"}}}]},
        {**obj, "anyOf": [{"properties": {"zip": {}}}, {"required": ["city"]}]},
        {**obj, "$ref": "#/$defs/X", "$defs": {"X": {"properties": {"zip": {"type": "string"}}}}},
    ):
        jsonschema.validate({"city": "Oslo", "zip": "0150"}, closed(merged))
    tool = [{"name": "go", "parameters": schema}]
    call = {"name": "go", "parameters": {"where": {"city": "Oslo"}, "stops": [{"city": "Bergen"}]}}
    jsonschema.validate(call, call_schema(tool, "required", parallel=False))
    for extra in ({"type": "object"}, {"where": {"city": "Oslo", "type": "object"}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"name": "go", "parameters": extra}, call_schema(tool, "required", False))


def test_tools_own_definitions_and_refs_do_not_collide(tok):
    a = {
        "type": "object",
        "properties": {"p": {"$ref": "#/$defs/P"}},
        "required": ["p"],
        "$defs": {"P": {"enum": ["x"]}},
    }
    b = {  # the same def name, a legacy "definitions", and a recursive "#"
        "type": "object",
        "properties": {
            "p": {"$ref": "#/$defs/P"},
            "q": {"$ref": "#/definitions/Q"},
            "k": {"anyOf": [{"type": "null"}, {"$ref": "#"}]},
        },
        "required": ["p", "q", "k"],
        "$defs": {"P": {"type": "integer", "minimum": 0, "maximum": 5}},
        "definitions": {"Q": {"type": "boolean"}},
    }
    tools = [{"name": "a", "parameters": a}, {"name": "b", "parameters": b}]
    schema = call_schema(tools, "required", parallel=False)
    jsonschema.validate(
        {"name": "b", "parameters": {"p": 3, "q": True, "k": {"p": 1, "q": False, "k": None}}}, schema
    )
    for wrong in (
        {"name": "b", "parameters": {"p": "x", "q": True, "k": None}},
        {"name": "a", "parameters": {"p": 3}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    c = ToolCallConstraint(tool_grammar(tools, {"name": "b"}, parallel=False), tok)
    _decode(c, np.random.default_rng(2), {tok.token_id("<0x7D>"): 3.0})  # "}" favoured: short objects
    assert c.complete
    jsonschema.validate(json.loads(c.calls()[0]["arguments"]), b)


# -- a real daemon -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hmad(tmp_path_factory):
    model = make_tiny_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf", seed=5)
    d = Daemon(model, tmp_path_factory.mktemp("hmad"), "engine.max_seqs=4").wait_ready()
    yield d
    assert d.stop() == 0, d.log_text()


def test_required_and_named_choices_answer_with_valid_calls(hmad):
    with Client(hmad.socket) as c:
        for seed, choice in enumerate(["required", "required", {"name": "get_weather"}]):
            r = c.generate(
                messages=HISTORY[:1],
                tools=TOOLS,
                tool_choice=choice,
                parallel_tool_calls=False,
                temperature=1.0,
                seed=seed,
                max_tokens=200,
            )
            assert r.finish_reason == "tool_calls", r
            _check_calls(r.tool_calls, ["get_weather"] if isinstance(choice, dict) else SCHEMAS)
            value = json.loads(r.text)  # the text is the call's JSON
            forms = value if isinstance(value, list) else [value]
            assert [f["name"] for f in forms] == [call["name"] for call in r.tool_calls]


def test_streamed_calls_come_in_done_and_the_tokens_keep_the_text(hmad):
    with Client(hmad.socket) as c:
        stream = c.stream(messages=HISTORY, tools=[ADD], tool_choice="required", parallel_tool_calls=False)
        pieces = []
        r = _drain(stream, pieces)
        text = "".join(p.text for p in pieces)
    assert r.finish_reason == "tool_calls" and len(r.tool_calls) == 1
    assert json.loads(text) == {"name": "add", "parameters": json.loads(r.tool_calls[0]["arguments"])}


def test_none_answers_in_text_and_history_is_accepted(hmad):
    with Client(hmad.socket) as c:
        r = c.generate(messages=HISTORY, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0)
        plain = c.generate(messages=HISTORY, max_tokens=8, temperature=0)
    assert r.finish_reason in ("stop", "length") and r.tool_calls == []
    assert r.text == plain.text  # "none" writes no preamble: the same prompt as without tools


def test_auto_answers_with_a_valid_call_or_with_text_that_opens_none(hmad):
    with Client(hmad.socket) as c:
        for seed in range(3):
            r = c.generate(messages=HISTORY[:1], tools=TOOLS, temperature=1.5, seed=seed, max_tokens=40)
            if r.tool_calls:
                assert r.finish_reason == "tool_calls" and r.text.lstrip()[0] in "{["
                _check_calls(r.tool_calls)
            else:
                assert r.text.strip() == "" or r.text.lstrip()[0] not in "{[", r.text


def test_bad_tool_requests_get_one_error_and_the_daemon_serves_on(hmad):
    bad = [
        {"tools": [{"name": "f", "parameters": {"type": "nope"}}], "tool_choice": "required"},
        {"tools": TOOLS, "tool_choice": "maybe"},
        {"messages": [{"role": "tool", "content": "x"}]},
    ]
    with Client(hmad.socket) as c:
        for fields in bad:
            fields = {"messages": HISTORY[:1], **fields}
            with pytest.raises((RequestError, P.ProtocolError)):
                c.generate(**fields)
        assert c.generate("hi", max_tokens=2).generated_tokens >= 1
