"""Fuzzed tool-calling fields (tools, tool_choice, parallel_tool_calls, tool turns in messages): the wire
check only ever raises ProtocolError, and a real hmad on a tiny random GGUF answers each fuzzed generate,
sent as a raw frame, with exactly one terminal reply (an error alone, or accepted ... done), a done's
tool_calls valid against the request's tools, and serves on."""

from __future__ import annotations

import json

import jsonschema
import msgpack
import pytest
import zmq
from daemon_harness import Daemon
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_gguf import make_tiny_gguf

from hmaclient import protocol as P

MSGPACK_INTS = st.integers(-(2**63), 2**64 - 1)  # what msgpack can carry (the wire's ints)
JUNK = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 3), st.text(max_size=6), st.lists(MSGPACK_INTS, max_size=2)
)
GOOD_NAME = st.sampled_from(["f", "get_weather", "a.b-c"])
NAME = GOOD_NAME | GOOD_NAME | st.sampled_from(["", "no spaces", "x" * 65])
GOOD_PARAMS = st.sampled_from(
    [
        {
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["n"],
        },
        {"type": "object", "properties": {"c": {"enum": ["a", "b"]}}, "additionalProperties": False},
        {"type": "object"},
    ]
)
PARAMS = GOOD_PARAMS | GOOD_PARAMS | st.sampled_from([{"type": "nope"}, {"$ref": "#/nowhere"}, []])
GOOD_TOOLS = st.lists(
    st.fixed_dictionaries({"name": GOOD_NAME, "parameters": GOOD_PARAMS}),
    min_size=1,
    max_size=3,
    unique_by=lambda t: t["name"],
)
TOOL = st.one_of(
    st.fixed_dictionaries(
        {"name": NAME}, optional={"description": st.text(max_size=8) | JUNK, "parameters": PARAMS}
    ),
    st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries({"name": NAME})}),
    st.dictionaries(st.sampled_from(["name", "parameters", "extra"]), JUNK, max_size=3),
    JUNK,
)
TOOLS = st.one_of(GOOD_TOOLS, GOOD_TOOLS, st.lists(TOOL, max_size=3), JUNK)
CHOICE = st.one_of(
    st.sampled_from(["auto", "none", "required", "required"]),
    st.sampled_from(["auto", "none", "required", "sometimes"]),
    st.fixed_dictionaries({"name": NAME}),
    st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries({"name": NAME})}),
    JUNK,
)
CALL = st.one_of(
    st.fixed_dictionaries(
        {
            "id": st.sampled_from(["c1", "", 7]),
            "name": NAME,
            "arguments": st.sampled_from(['{"n": 1}', "{", "[1]", {}, 3]),
        }
    ),
    st.dictionaries(st.sampled_from(["id", "name", "arguments", "function", "type"]), JUNK, max_size=4),
)
TOOL_TURN = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.sampled_from(["assistant", "model", "user"]),
            "tool_calls": st.lists(CALL, max_size=2) | JUNK,
        },
        optional={"content": st.none() | st.text(max_size=6) | JUNK},
    ),
    st.fixed_dictionaries(
        {"role": st.just("tool"), "content": st.text(max_size=6) | JUNK},
        optional={"tool_call_id": st.sampled_from(["c1", ""]) | JUNK, "name": NAME | JUNK},
    ),
)
GOOD_TURNS = st.just(
    [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "name": "f", "arguments": "{}"}]},
        {"role": "tool", "content": "3", "tool_call_id": "c1"},
    ]
)
MESSAGES = st.one_of(
    st.just([{"role": "user", "content": "hi"}]),
    GOOD_TURNS,
    GOOD_TURNS,
    st.lists(st.just({"role": "user", "content": "hi"}) | TOOL_TURN, min_size=1, max_size=4),
)


@st.composite
def generate(draw) -> dict:
    """A generate with tool fields: half of them well-formed (so they reach the engine), half fuzzed."""
    msg = {"v": 3, "type": "generate", "id": 1, "stream": draw(st.booleans()), "max_tokens": 3}
    if draw(st.booleans()):
        msg["messages"] = draw(GOOD_TURNS | st.just([{"role": "user", "content": "hi"}]))
        msg["tools"] = draw(GOOD_TOOLS)
        msg["tool_choice"] = draw(st.sampled_from(["auto", "none", "required"]))
        msg["parallel_tool_calls"] = draw(st.booleans())
        return msg
    msg["messages"] = draw(MESSAGES)
    for name, values in (
        ("tools", TOOLS),
        ("tool_choice", CHOICE),
        ("parallel_tool_calls", st.sampled_from([True, False, True, False, 1, "no"])),
    ):
        if draw(st.booleans()):
            msg[name] = draw(values)
    return msg


@settings(max_examples=300, deadline=None, derandomize=True)
@given(generate())
def test_the_wire_check_raises_only_protocol_errors(msg):
    try:
        req = P.validate_request(msg, 1)
    except P.ProtocolError as e:
        assert e.code in (P.BAD_REQUEST, P.TOO_LARGE) and "\n" not in e.message
        return
    assert all(isinstance(m["content"], str) for m in req.messages)


@pytest.fixture(scope="module")
def hmad(tmp_path_factory):
    model = make_tiny_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf", seed=5)
    d = Daemon(model, tmp_path_factory.mktemp("hmad"), "engine.max_seqs=4").wait_ready()
    yield d
    assert d.stop() == 0, d.log_text()


@pytest.fixture(scope="module")
def dealer(hmad):
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(P.endpoint(hmad.socket))
        yield sock


def _replies(sock, timeout_ms: int = 30_000) -> list:
    """Replies to the one request in flight, through its terminal one, then a short wait for strays."""
    out = []
    while not (out and out[-1].__class__.__name__ in ("Done", "Error", "Cancelled")):
        assert sock.poll(timeout_ms), f"no terminal reply, got {out}"
        out.append(P.parse_reply(sock.recv()))
    assert not sock.poll(50), "a reply after the terminal one"
    return out


@settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(msg=generate())
def test_each_fuzzed_request_gets_one_terminal_reply(dealer, hmad, msg):
    dealer.send(msgpack.packb(msg, use_bin_type=True))
    replies = _replies(dealer)
    kinds = [type(r).__name__ for r in replies]
    assert kinds == ["Error"] or (kinds[0] == "Accepted" and kinds[-1] == "Done"), kinds
    if kinds[-1] == "Done" and replies[-1].tool_calls:
        req = P.validate_request(msg, 1)
        schemas = {t["name"]: t["parameters"] for t in req.tools}
        for call in replies[-1].tool_calls:
            jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])
    assert hmad.proc.poll() is None, hmad.log_text()
