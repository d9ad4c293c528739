"""The wire protocol: every message round-trips; every malformed frame gets its error code, fast and small."""

from __future__ import annotations

import random
import struct
import time
import tracemalloc

import msgpack
import pytest

from hmaclient import protocol as P


def raw(obj) -> bytes:
    """Pack without pack()'s help (no v added), to build malformed messages."""
    return msgpack.packb(obj, use_bin_type=True)


USER = {"role": "user", "content": "a"}


def gen(**fields) -> dict:
    return {"v": 1, "type": "generate", "id": "r1", "prompt": "hi", **fields}


def refused(frame: bytes, code: str, id=None, match: str = "") -> P.ProtocolError:
    """parse_request refuses ``frame`` with ``code`` (and ``id``), quickly and without big allocations."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(P.ProtocolError) as info:
            P.parse_request(frame)
    finally:
        elapsed = time.perf_counter() - t0
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    e = info.value
    assert e.code == code, e
    assert e.id == id
    assert match in e.message
    assert elapsed < 0.5
    assert peak < 4 * len(frame) + (1 << 20), f"peak {peak} bytes for a {len(frame)}-byte frame"
    reply = P.parse_reply(P.pack(e.reply()))  # the daemon's answer is itself a valid reply
    assert (reply.code, reply.id) == (code, id)
    return e


# -- round trips -------------------------------------------------------------------------------------------


def test_generate_roundtrip_every_field():
    msg = P.generate_request(
        "abc",
        "Why?",
        raw=True,
        stream=False,
        max_tokens=10,
        temperature=0.7,
        top_k=40,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.1,
        repeat_last_n=32,
        seed=2**64 - 1,
        stop=["\n\n", "END"],
    )
    req = P.parse_request(P.pack(msg))
    assert req == P.GenerateRequest(
        id="abc",
        prompt="Why?",
        raw=True,
        stream=False,
        max_tokens=10,
        temperature=0.7,
        top_k=40,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.1,
        repeat_last_n=32,
        seed=2**64 - 1,
        stop=["\n\n", "END"],
    )
    assert req.sampling() == {
        "max_tokens": 10,
        "temperature": 0.7,
        "top_k": 40,
        "top_p": 0.9,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "repeat_last_n": 32,
        "seed": 2**64 - 1,
        "stop": ["\n\n", "END"],
    }


def test_generate_defaults_and_messages():
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
    ]
    req = P.parse_request(P.pack(P.generate_request(7, messages=msgs)))
    assert req.id == 7 and req.messages == msgs and req.prompt is None
    assert (req.raw, req.stream, req.sampling()) == (False, True, {})
    # Integers are accepted for float fields and come out as floats; nil means "default".
    req = P.parse_request(raw(gen(temperature=1, top_p=1, seed=None, stop=None)))
    assert req.temperature == 1.0 and isinstance(req.temperature, float) and req.seed is None
    assert P.parse_request(raw({"v": 1, "type": "generate", "prompt": ""})).id is None


@pytest.mark.parametrize(
    "msg, cls",
    [
        (P.cancel_request("x"), P.CancelRequest("x")),
        (P.cancel_request(-5), P.CancelRequest(-5)),
        (P.status_request(3), P.StatusRequest(3)),
        (P.status_request(), P.StatusRequest(None)),
        (P.ping_request("p"), P.PingRequest("p")),
        (P.ping_request(), P.PingRequest(None)),
        (P.metrics_request(7), P.MetricsRequest(7)),
        (P.metrics_request(), P.MetricsRequest(None)),
    ],
)
def test_small_requests_roundtrip(msg, cls):
    assert P.parse_request(P.pack(msg)) == cls


@pytest.mark.parametrize(
    "msg, expected",
    [
        (P.accepted("a", 12), P.Accepted("a", 12)),
        (P.token("a", "Hel", [1, 2]), P.Token("a", "Hel", [1, 2])),
        (P.token(3, "", []), P.Token(3, "", [])),
        (
            P.done("a", "stop", 5, 3, 0.25, 10.0, 0.5),
            P.Done("a", "stop", 5, 3, 0.25, 10.0, 0.5),
        ),
        (
            P.done(2, "length", 5, 2, 0.1, 3, 1, text="ab", token_ids=[4, 5], seed=9),
            P.Done(2, "length", 5, 2, 0.1, 3.0, 1.0, text="ab", token_ids=[4, 5], extra={"seed": 9}),
        ),
        (P.error("a", P.BUSY, "queue full"), P.Error("a", "busy", "queue full")),
        (P.error(None, P.BAD_REQUEST, "?"), P.Error(None, "bad_request", "?")),
        (P.cancelled("a", 4), P.Cancelled("a", 4)),
        (P.status(1, {"model": "g", "memory": {"heaps": [{"used_bytes": 1}]}}), None),
        (P.pong(None, 1.5), P.Pong(None, 1.5)),
    ],
)
def test_replies_roundtrip(msg, expected):
    reply = P.parse_reply(P.pack(msg))
    if expected is None:
        expected = P.Status(1, msg["status"])
    assert reply == expected
    assert msg["v"] == P.PROTOCOL_VERSION


def test_metrics_reply_roundtrip_keeps_families_clients_can_show():
    families = [
        {"name": "requests", "type": "counter", "help": "h", "samples": [{"labels": {"a": "b"}, "value": 3}]},
        {
            "name": "ttft_seconds",
            "type": "histogram",
            "help": "h",
            "samples": [{"labels": {}, "bounds": [0.1, 1.0], "buckets": [1, 2], "count": 3, "sum": 2.5}],
        },
    ]
    odd = [{"name": "x", "type": "summary", "samples": []}, {"type": "gauge", "samples": []}, "text"]
    reply = P.parse_reply(P.pack(P.metrics("m", families + odd)))
    assert reply == P.Metrics("m", families)  # a type or shape this client does not know is dropped
    assert "metrics" in P.REQUEST_TYPES and "metrics" in P.REPLY_TYPES


@pytest.mark.skipif(
    not hasattr(P, "ADDED_IN"), reason="the protocol's version table (ADDED_IN) is not here yet"
)
def test_metrics_is_version_2():
    assert P.ADDED_IN[("metrics", None)] == 2
    assert P.parse_request(P.pack(P.metrics_request(1))) == P.MetricsRequest(1)
    with pytest.raises(P.ProtocolError) as info:
        P.parse_request(raw({"v": 1, "type": "metrics", "id": 1}))
    assert info.value.code == P.BAD_REQUEST and "2" in info.value.message


def test_replies_ignore_unknown_fields():
    assert P.parse_reply(raw({**P.accepted(1, 2), "queue_position": 3})) == P.Accepted(1, 2)


def test_pack_adds_version_and_refuses_non_messages():
    assert P.unpack(P.pack({"type": "ping"})) == {"v": 1, "type": "ping"}
    with pytest.raises(TypeError):
        P.pack({"no": "type"})


def test_error_builder_refuses_unknown_codes():
    with pytest.raises(ValueError):
        P.error(1, "oops", "x")
    assert {P.BAD_REQUEST, P.INTERNAL, P.NOT_FOUND, P.PROMPT_TOO_LONG} <= P.ERROR_CODES


@pytest.mark.parametrize(
    "frame, kind",
    [
        (raw({"v": 1, "type": "done", "id": 1}), P.BAD_REQUEST),  # fields missing
        (raw({"v": 1, "type": "token", "id": 1, "text": 3, "token_ids": []}), P.BAD_REQUEST),
        (raw({"v": 1, "type": "accepted", "id": 1, "rid": True}), P.BAD_REQUEST),
        (raw({"v": 1, "type": "surprise", "id": 1}), P.UNKNOWN_TYPE),
        (raw({"v": 6, "type": "pong", "time": 1.0}), P.UNSUPPORTED_VERSION),
    ],
)
def test_bad_replies(frame, kind):
    with pytest.raises(P.ProtocolError) as info:
        P.parse_reply(frame)
    assert info.value.code == kind


# -- malformed frames ------------------------------------------------------------------------------------


def test_random_bytes():
    rng = random.Random(1)
    for _ in range(2000):
        frame = rng.randbytes(rng.randrange(0, 64))
        with pytest.raises(P.ProtocolError) as info:
            P.parse_request(frame)
        assert info.value.code in (P.BAD_REQUEST, P.TOO_LARGE, P.UNSUPPORTED_VERSION, P.UNKNOWN_TYPE)


def test_empty_and_truncated():
    refused(b"", P.BAD_REQUEST)
    full = P.pack(P.generate_request("id", "some prompt", max_tokens=5))
    for n in range(1, len(full)):
        with pytest.raises(P.ProtocolError) as info:
            P.parse_request(full[:n])
        assert info.value.code == P.BAD_REQUEST


@pytest.mark.parametrize(
    "frame",
    [
        b"\xdd" + struct.pack(">I", 2**31),  # array32 of 2^31 items, no data
        b"\xdf" + struct.pack(">I", 2**31),  # map32 of 2^31 pairs, no data
        b"\xdb" + struct.pack(">I", 2**32 - 1),  # str32 of 4 GiB, no data
        b"\xc6" + struct.pack(">I", 2**32 - 1),  # bin32 of 4 GiB
        b"\x81\xa1k\xdd" + struct.pack(">I", 2**31),  # the same inside a map
    ],
)
def test_huge_declared_lengths(frame):
    refused(frame, P.BAD_REQUEST)  # the frame cannot hold what the header declares: truncated


def test_counts_over_protocol_limits():
    refused(raw({**gen(), **{f"k{i}": 0 for i in range(P.MAX_MAP_LEN + 1)}}), P.TOO_LARGE, match="map")
    refused(raw({**gen(), "stop": [[0]] * 1_000_000}), P.TOO_LARGE, match="arrays and maps")  # stops early
    with pytest.raises(P.ProtocolError, match="too_large: array"):  # replies may be big enough to try
        P.parse_reply(raw({**P.token(1, "", []), "token_ids": [0] * (P.MAX_ARRAY_LEN + 1)}))


def test_deep_nesting():
    refused(b"\x91" * 1000 + b"\xc0", P.TOO_LARGE, match="nesting")
    refused(b"\x91" * 100_000 + b"\xc0", P.TOO_LARGE)
    deep = 1
    for _ in range(P.MAX_DEPTH - 1):  # with the top-level map: MAX_DEPTH + 1 containers deep
        deep = [deep]
    refused(raw({**gen(), "stop": {"a": deep}}), P.TOO_LARGE, match="nesting")
    # Depth MAX_DEPTH itself is fine at the unpack level (the schema then refuses it).
    ok = 1
    for _ in range(P.MAX_DEPTH):
        ok = [ok]
    assert P.unpack(raw(ok)) == ok


def test_ext_types():
    refused(raw(msgpack.ExtType(5, b"abc")), P.BAD_REQUEST, match="ext")
    refused(raw({**gen(), "prompt": msgpack.ExtType(1, b"")}), P.BAD_REQUEST, match="ext")
    timestamp = b"\xd6\xff" + struct.pack(">I", 5)  # ext -1: msgpack decodes it without ext_hook
    refused(raw({"v": 1, "type": "ping"})[:-5] + b"\xa4type" + timestamp, P.BAD_REQUEST)
    refused(b"\x81\xa1t" + timestamp, P.BAD_REQUEST)


def test_non_str_map_keys():
    refused(raw({1: 2}), P.BAD_REQUEST)
    refused(raw({b"v": 1}), P.BAD_REQUEST, match="keys")
    refused(raw({**gen(), "messages": None, "prompt": {b"x": 1}}), P.BAD_REQUEST)


def test_two_objects_in_one_frame():
    refused(P.pack(P.ping_request(1)) + P.pack(P.ping_request(2)), P.BAD_REQUEST, match="trailing")
    refused(P.pack(P.ping_request(1)) + b"\x00", P.BAD_REQUEST, match="trailing")


def test_oversized_frame():
    big = P.pack(gen(prompt="x" * (P.MAX_FRAME_BYTES + 1)))
    refused(big, P.TOO_LARGE, match="frame")  # refused before unpacking: no id known
    assert P.parse_reply(P.pack(P.token(1, "x" * P.MAX_FRAME_BYTES, []))).text  # replies may be bigger


def test_not_a_map():
    for obj in (None, 1, "generate", [1, 2], 1.5, True):
        refused(raw(obj), P.BAD_REQUEST, match="map")


def test_version():
    refused(raw({"type": "ping", "id": 4}), P.BAD_REQUEST, id=4, match="'v'")
    refused(raw({"v": "1", "type": "ping"}), P.BAD_REQUEST, match="'v'")
    refused(raw({"v": True, "type": "ping"}), P.BAD_REQUEST)
    e = refused(raw(gen(v=6)), P.UNSUPPORTED_VERSION, id="r1")
    assert "6" in e.message and "1, 2, 3, 4, 5" in e.message
    assert e.reply()["v"] == 1  # an unsupported version is answered in 1, which every client reads
    refused(raw(gen(v=0)), P.UNSUPPORTED_VERSION, id="r1")


# -- versions ------------------------------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}


def test_version_1_without_new_fields_is_served_and_answered_in_1():
    req = P.parse_request(raw(gen(max_tokens=3)))
    assert (req.v, req.max_tokens, req.json_schema) == (1, 3, None)
    for mtype, cls in (("ping", P.PingRequest), ("status", P.StatusRequest)):
        assert P.parse_request(raw({"v": 1, "type": mtype, "id": 5})) == cls(5)
    # a v1 client reads the replies to it: they say v 1
    assert P.parse_reply(P.pack(P.pong(5, 1.0, v=req.v))) == P.Pong(5, 1.0)
    assert P.unpack(P.pack(P.done(1, "stop", 1, 1, 0, 0, 0, v=req.v)))["v"] == 1


def test_version_1_with_a_version_2_field_is_refused_naming_both():
    e = refused(raw(gen(json_schema=SCHEMA)), P.BAD_REQUEST, id="r1", match="'json_schema'")
    assert "version 2" in e.message and "not 1" in e.message
    assert e.reply()["v"] == 1  # answered in the version the client speaks


def test_version_2_with_the_field_is_served():
    req = P.parse_request(raw(gen(v=2, json_schema=SCHEMA)))
    assert (req.v, req.json_schema) == (2, SCHEMA)
    e = refused(raw(gen(v=2, json_schema="{}")), P.BAD_REQUEST, id="r1", match="json_schema must be a map")
    assert e.reply()["v"] == 2


def test_builders_stamp_the_lowest_version_needed():
    assert P.generate_request(1, "hi")["v"] == 1  # an old daemon still serves it
    assert P.generate_request(1, "hi", json_schema=SCHEMA)["v"] == 2
    assert P.required_version({"type": "generate", "json_schema": None}) == 2  # present, even as nil
    refused(raw(gen(json_schema=None)), P.BAD_REQUEST, id="r1", match="needs protocol version 2")
    assert [P.ping_request()["v"], P.status_request(1)["v"], P.cancel_request(1)["v"]] == [1, 1, 1]
    assert P.unpack(P.pack({"type": "generate", "prompt": "x", "json_schema": {}}))["v"] == 2


def test_added_in_table_drives_the_check(monkeypatch):
    """A request type added in a later version is refused in an older message, as a field is."""
    monkeypatch.setitem(P.ADDED_IN, ("status", None), 2)
    refused(
        raw({"v": 1, "type": "status", "id": 1}),
        P.BAD_REQUEST,
        id=1,
        match="'status' needs protocol version 2",
    )
    assert P.status_request(1)["v"] == 2
    assert P.parse_request(P.pack(P.status_request(1))) == P.StatusRequest(1)


@pytest.mark.parametrize(
    "field",
    ["tools", "tool_choice", "parallel_tool_calls", "logprobs", "prompt_logprobs", "presence_penalty",
     "frequency_penalty", "logit_bias"],
)  # fmt: skip
def test_version_3_fields_are_refused_in_version_2_and_stamped_3(field):
    e = refused(raw(gen(v=2, **{field: None})), P.BAD_REQUEST, id="r1", match=f"'{field}'")
    assert "needs protocol version 3, not 2" in e.message and e.reply()["v"] == 2
    assert P.required_version({"type": "generate", field: None}) == 3


def test_replies_of_every_supported_version_parse():
    for v in sorted(P.SUPPORTED_VERSIONS):
        assert P.parse_reply(P.pack(P.accepted("a", 1, v=v))) == P.Accepted("a", 1)


def test_deep_json_schema_within_the_limits():
    schema: dict = {"type": "string"}
    for _ in range(10):  # ten nested objects: 20 map levels under the envelope
        schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    assert P.parse_request(P.pack(P.generate_request(1, "hi", json_schema=schema))).json_schema == schema


def test_type():
    refused(raw({"v": 1, "id": 1}), P.BAD_REQUEST, id=1, match="'type'")
    refused(raw({"v": 1, "type": 5}), P.BAD_REQUEST)
    refused(raw({"v": 1, "type": "explode", "id": "z"}), P.UNKNOWN_TYPE, id="z", match="explode")
    refused(raw({"v": 1, "type": "done", "id": "z"}), P.UNKNOWN_TYPE, id="z")  # a reply is no request


def test_unknown_fields_named():
    refused(raw(gen(temprature=0.5)), P.BAD_REQUEST, id="r1", match="temprature")
    refused(raw({"v": 1, "type": "ping", "extra": 1}), P.BAD_REQUEST, match="extra")
    refused(raw({"v": 1, "type": "cancel", "id": 1, "prompt": "x"}), P.BAD_REQUEST, id=1, match="prompt")


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", 100.5),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", "hot"),
        ("temperature", True),
        ("top_k", -1),
        ("top_k", 1.5),
        ("top_p", 0),
        ("top_p", 1.01),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("repetition_penalty", 0),
        ("repetition_penalty", -1.0),
        ("max_tokens", 0),
        ("max_tokens", 1_000_001),
        ("max_tokens", 10.0),
        ("max_tokens", False),
        ("seed", -1),
        ("seed", 1.0),
        ("seed", "7"),
        ("repeat_last_n", -1),
        ("raw", 1),
        ("stream", "no"),
        ("stop", "END"),
        ("stop", ["ok", 3]),
        ("stop", [""]),
        ("stop", ["x" * (P.MAX_STOP_CHARS + 1)]),
        ("stop", ["s"] * (P.MAX_STOP_STRINGS + 1)),
    ],
)
def test_out_of_range_or_wrong_type(field, value):
    e = refused(raw(gen(**{field: value})), P.BAD_REQUEST, id="r1")
    assert field in e.message


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"prompt": None}, "exactly one"),
        ({"messages": [{"role": "user", "content": "x"}]}, "exactly one"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": None, "messages": []}, "messages"),
        ({"prompt": None, "messages": "hi"}, "messages"),
        ({"prompt": None, "messages": [{"role": "user"}]}, "messages[0]"),
        ({"prompt": None, "messages": [{"role": "user", "content": "a", "name": "b"}]}, "messages[0]"),
        ({"prompt": None, "messages": [{"role": "robot", "content": "a"}]}, "role"),
        ({"prompt": None, "messages": [{"role": ["user"], "content": "a"}]}, "role"),
        ({"prompt": None, "messages": [{"role": "user", "content": 1}]}, "content"),
        (
            {
                "prompt": None,
                "messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}],
            },
            "system",
        ),
        ({"prompt": None, "messages": [{"role": "user", "content": "a"}], "raw": True}, "raw"),
    ],
)
def test_prompt_and_messages_schema(fields, match):
    msg = {k: v for k, v in gen(**fields).items() if v is not None}
    e = refused(raw(msg), P.BAD_REQUEST, id="r1")
    assert match in e.message


def test_prompt_limits():
    refused(raw(gen(prompt="x" * (P.MAX_PROMPT_CHARS + 1))), P.TOO_LARGE, id="r1", match="prompt")
    assert P.parse_request(raw(gen(prompt="x" * P.MAX_PROMPT_CHARS))).prompt
    half = {"role": "user", "content": "x" * (P.MAX_PROMPT_CHARS // 2 + 1)}
    refused(raw(gen(prompt=None, messages=[half, half])), P.TOO_LARGE, id="r1")
    many = [{"role": "user", "content": ""}] * (P.MAX_MESSAGES + 1)
    refused(raw({**gen(), "prompt": None, "messages": many}), P.TOO_LARGE, id="r1")


def test_ids():
    assert P.parse_request(raw(gen(id="x" * P.MAX_ID_CHARS))).id == "x" * P.MAX_ID_CHARS
    assert P.parse_request(raw(gen(id=2**64 - 1))).id == 2**64 - 1
    assert P.parse_request(raw(gen(id=-(2**63)))).id == -(2**63)
    for bad in ("x" * (P.MAX_ID_CHARS + 1), "", 1.5, True, [1], {"a": 1}):
        refused(raw(gen(id=bad)), P.BAD_REQUEST, id=None, match="id")
    refused(raw({"v": 1, "type": "cancel"}), P.BAD_REQUEST, match="id")
    # A valid id rides along on errors found later in the request.
    refused(raw(gen(id=42, top_k=-1)), P.BAD_REQUEST, id=42)


def test_generate_request_validates_on_the_client_side():
    with pytest.raises(P.ProtocolError) as info:
        P.generate_request(1, "hi", temperature=-1)
    assert isinstance(info.value, ValueError) and info.value.code == P.BAD_REQUEST


def test_socket_path(tmp_path):
    """One rule for daemon and client: $HMAD_SOCKET, the system service's directory (root, or whoever may
    enter it), $XDG_RUNTIME_DIR, then $TMPDIR (else /tmp)/hmad-<uid>."""
    none = str(tmp_path / "no-such-dir")
    xdg, tmp = {"XDG_RUNTIME_DIR": str(tmp_path)}, {"TMPDIR": "/var/tmp"}
    assert P.default_socket_path({"HMAD_SOCKET": "/x/y.sock", **xdg}, euid=0) == "/x/y.sock"
    assert P.default_socket_path(xdg, euid=0, system_dir=none) == none + "/hmad.sock"  # root makes it
    assert P.default_socket_path(xdg, euid=1000, system_dir=str(tmp_path)) == str(tmp_path / "hmad.sock")
    assert P.default_socket_path(xdg, euid=1000, system_dir=none) == str(tmp_path / "hmad" / "hmad.sock")
    assert (
        P.default_socket_path({"XDG_RUNTIME_DIR": "rel"}, euid=7, system_dir=none) == "/tmp/hmad-7/hmad.sock"
    )
    assert P.default_socket_path(tmp, euid=7, system_dir=none) == "/var/tmp/hmad-7/hmad.sock"
    assert P.default_socket_path({}, euid=7, system_dir=none) == "/tmp/hmad-7/hmad.sock"
    assert P.endpoint("/run/hmad/hmad.sock") == "ipc:///run/hmad/hmad.sock"
    with pytest.raises(ValueError, match="107"):
        P.endpoint("/" + "x" * 200)


def test_sampling_fields_are_the_one_tables():
    """The wire's sampling fields, their ranges and their words come from hmaclient.sampling."""
    import dataclasses

    from hmaclient import sampling

    assert P.SAMPLING_FIELDS == sampling.NAMES
    assert set(sampling.NAMES) <= {f.name for f in dataclasses.fields(P.GenerateRequest)}
    for f in sampling.FIELDS:
        v = P.required_version({"type": "generate", f.name: None})  # the penalties and logit_bias: 3
        if f.kind == "bias":  # a map: one entry over the count limit, then the limit at the bound
            past = {str(i): f.hi for i in range(sampling.MAX_LOGIT_BIAS_ENTRIES + 1)}
        else:
            past = ["s"] * (int(f.hi) + 1) if f.kind == "strings" else f.hi + (1 if f.kind == "int" else 0.5)
        with pytest.raises(P.ProtocolError) as e:  # the check itself: 2^64 does not fit msgpack
            P.validate_request({k: x for k, x in gen(v=v, **{f.name: past}).items() if x is not None}, "r1")
        assert (e.value.code, e.value.message) == (P.BAD_REQUEST, sampling.problem(f.name, past))
        if f.kind == "bias":
            at = {str(i): f.hi for i in range(sampling.MAX_LOGIT_BIAS_ENTRIES)}
        else:
            at = ["s"] * int(f.hi) if f.kind == "strings" else f.hi
        assert getattr(P.parse_request(raw(gen(v=v, **{f.name: at}))), f.name) == sampling.stored(f.name, at)
    assert "temperature" in P.__doc__ and sampling.describe(sampling.BY_NAME["top_p"]) in P.__doc__


# -- images (version 4) --------------------------------------------------------------------------------------

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(64))  # the protocol reads the signature; the daemon decodes the rest
IMAGES = {  # one signature of each format the wire takes
    "png": PNG,
    "jpeg": b"\xff\xd8\xff\xe0" + b"\0" * 16,
    "gif": b"GIF89a" + b"\0" * 16,
    "webp": b"RIFF\x10\0\0\0WEBPVP8 " + b"\0" * 8,
    "bmp": b"BM" + b"\0" * 16,
}


def user(*parts) -> dict:
    return {"role": "user", "content": list(parts)}


def text(t: str) -> dict:
    return {"type": "text", "text": t}


def image(data: bytes = PNG) -> dict:
    return {"type": "image", "image": data}


def test_images_round_trip_as_bin_and_stamp_version_4():
    msg = P.generate_request(1, "what is this?", images=[PNG, IMAGES["jpeg"]])
    assert msg["v"] == 4
    frame = P.pack(msg)
    assert msgpack.unpackb(frame, raw=True)[b"images"][0] == PNG  # bin on the wire, not str
    req = P.parse_request(frame)
    assert (req.prompt, req.images, req.v) == ("what is this?", [PNG, IMAGES["jpeg"]], 4)
    messages = [{"role": "system", "content": [text("be brief")]}, user(image(), text("and this?"), image())]
    req = P.parse_request(P.pack(P.generate_request(2, messages=messages)))
    assert req.messages == messages and req.images is None and req.v == 4  # part lists stay lists
    assert P.generate_request(3, messages=[user(text("only text"))])["v"] == 4


@pytest.mark.parametrize("kind", sorted(IMAGES))
def test_every_image_format_the_wire_names_is_taken(kind):
    assert P.parse_request(P.pack(P.generate_request(1, "x", images=[IMAGES[kind]]))).images == [IMAGES[kind]]
    assert P.image_format(IMAGES[kind]) == kind


def test_images_and_parts_are_refused_before_version_4_naming_the_field():
    e = refused(raw(gen(v=3, images=[PNG])), P.BAD_REQUEST, id="r1", match="'images'")
    assert "needs protocol version 4, not 3" in e.message and e.reply()["v"] == 3
    msg = {**gen(v=3), "prompt": None, "messages": [user(text("hi"))]}
    del msg["prompt"]
    e = refused(raw(msg), P.BAD_REQUEST, id="r1", match="messages[].content as a list of parts")
    assert "needs protocol version 4, not 3" in e.message
    refused(raw({**msg, "v": 1}), P.BAD_REQUEST, id="r1", match="version 4, not 1")
    assert P.required_version({"type": "generate", "messages": [user(image())]}) == 4
    assert P.required_version({"type": "generate", "messages": [USER]}) == 1


def msgs(*messages) -> bytes:
    return raw({"v": 4, "type": "generate", "id": "r1", "messages": list(messages)})


@pytest.mark.parametrize(
    "frame, match",
    [
        (raw(gen(v=4, images=[PNG], raw=True)), "images need the chat template"),
        (msgs(USER), None),  # the control: valid
        (raw({k: v for k, v in gen(v=4, images=[PNG]).items() if k != "prompt"} | {"messages": [USER]}),
         "images go with 'prompt'"),
        (raw(gen(v=4, images=[])), "non-empty list"),
        (raw(gen(v=4, images=PNG)), "non-empty list"),
        (raw(gen(v=4, images=["a png as str"])), "images[0] must be bin"),
        (raw(gen(v=4, images=[b"GIF87"])), "images[0] is not an image file"),
        (raw(gen(v=4, images=[b"RIFF\0\0\0\0WAVEfmt "])), "not an image file"),
        (raw(gen(v=4, images=[b""])), "not an image file"),
        (msgs({"role": "assistant", "content": [image()]}), "only a user message may hold images"),
        (msgs({"role": "system", "content": [image()]}), "only a user message may hold images"),
        (msgs({"role": "model", "content": [text("a"), image()]}), "content[1]: only a user message"),
        (msgs(user()), "1..64 parts"),
        (msgs(user(*[text("a")] * (P.MAX_PARTS + 1))), "1..64 parts"),
        (msgs(user({"type": "image", "image": "data:image/png;base64,AAAA"})), "image must be bin"),
        (msgs(user({"type": "image"})), "must be {type: 'text'"),
        (msgs(user({"type": "image_url", "image_url": {"url": "x"}})), "must be {type: 'text'"),
        (msgs(user({"type": "text", "text": "a", "image": PNG})), "content[0].image is msgpack bin"),
        (msgs(user({"type": "text", "text": b"bytes"})), "content[0].text is msgpack bin"),
        (msgs(user({"type": "text", "text": 5})), "text must be a str"),
        (msgs(user("just a str")), "must be {type: 'text'"),
        (msgs({"role": "user", "content": PNG}), "messages[0].content is msgpack bin"),
        (msgs({"role": "user", "content": 5}), "content must be a str or a list of parts"),
        (msgs({"role": "tool", "content": [text("a")], "tool_call_id": "c"}), "must be a str"),
    ],
)  # fmt: skip
def test_image_shapes_refused(frame, match):
    if match is None:
        assert P.parse_request(frame).messages == [USER]
        return
    assert match in refused(frame, P.BAD_REQUEST, id="r1").message


@pytest.mark.parametrize(
    "where, fields",
    [
        ("prompt", {"prompt": b"hi"}),
        ("stop[0]", {"stop": [b"x"]}),
        ("json_schema.properties.a.enum[1]", {"json_schema": {"properties": {"a": {"enum": ["x", b"y"]}}}}),
        ("tools[0].parameters.description", {"tools": [{"name": "f", "parameters": {"description": b"d"}}]}),
    ],
)
def test_bin_is_refused_everywhere_but_an_images_bytes(where, fields):
    e = refused(raw(gen(v=4, **fields)), P.BAD_REQUEST, id="r1")
    assert where in e.message and ("bin" in e.message or "str" in e.message), e.message
    call = {"id": "c1", "name": "f", "arguments": {"x": b"raw"}}
    turn = {"role": "assistant", "content": "", "tool_calls": [call]}
    e = refused(msgs(USER, turn, user(image(), text("b"))), P.BAD_REQUEST, id="r1", match="bin")
    assert "messages[1].tool_calls[0].arguments.x" in e.message
    refused(msgs(user(text("a"), {"type": "text", "text": "b"}), {"role": "user", "content": b"x"}),
            P.BAD_REQUEST, id="r1", match="content")  # fmt: skip


def test_image_counts_and_text_limits():
    n = P.MAX_IMAGES
    assert len(P.parse_request(raw(gen(v=4, images=[PNG] * n))).images) == n
    refused(raw(gen(v=4, images=[PNG] * (n + 1))), P.TOO_LARGE, id="r1", match=f"limit of {n}")
    split = msgs(
        user(*[image()] * (n // 2)), {"role": "model", "content": "ok"}, user(*[image()] * (n // 2 + 1))
    )
    refused(split, P.TOO_LARGE, id="r1", match="images")  # every message's images count together
    half = text("x" * (P.MAX_PROMPT_CHARS // 2 + 1))
    refused(
        msgs(user(half, image()), user(half)), P.TOO_LARGE, id="r1", match="characters"
    )  # text parts count
    whole = P.parse_request(msgs(user(text("x" * P.MAX_PROMPT_CHARS), image())))
    assert len(whole.messages[0]["content"]) == 2  # the image bytes are not characters


def test_a_frame_of_images_at_the_frame_limit_is_taken_and_one_byte_more_is_not():
    def frame(size: int) -> bytes:
        return P.pack(P.generate_request(1, "x", images=[PNG + b"\0" * (size - len(PNG))]))

    overhead = len(frame(1 << 20)) - (1 << 20)  # the envelope and a bin32 header
    at = frame(P.MAX_FRAME_BYTES - overhead)
    assert len(at) == P.MAX_FRAME_BYTES and len(P.parse_request(at).images[0]) == P.MAX_FRAME_BYTES - overhead
    refused(frame(P.MAX_FRAME_BYTES - overhead + 1), P.TOO_LARGE, match="frame")


def test_a_frame_at_the_limit_of_tiny_scalars_is_refused_early_and_small():
    """The frame limit grew for images; the work of an unpack is bounded by its items, not its bytes: a frame
    of MAX_FRAME_BYTES of one-byte ints stops past MAX_REQUEST_ITEMS, in the time and memory ``refused``
    allows (a multiple of the frame, 0.5 s)."""
    per = 1 << 20
    body = {
        "v": 4,
        "type": "generate",
        "prompt": "x",
        **{f"k{i}": [1] * per for i in range(P.MAX_FRAME_BYTES // per)},
    }
    frame = raw(body)[: P.MAX_FRAME_BYTES]
    assert len(frame) == P.MAX_FRAME_BYTES
    refused(frame, P.TOO_LARGE, match="array items and map entries")
    refused(raw(gen(v=4, stop=[0] * (P.MAX_REQUEST_ITEMS + 1))), P.TOO_LARGE, match="items")
    assert P.unpack(raw({"a": [0] * (P.MAX_REQUEST_ITEMS + 1)}), P.MAX_REPLY_BYTES)  # replies: MAX_ARRAY_LEN


def test_unsupported_is_an_error_code():
    assert P.UNSUPPORTED == "unsupported" and P.UNSUPPORTED in P.ERROR_CODES
    r = P.parse_reply(P.pack(P.error(1, P.UNSUPPORTED, "this model has no vision tower", v=4)))
    assert (r.code, r.message) == (P.UNSUPPORTED, "this model has no vision tower")
    assert "unsupported" in P.__doc__ and "version 4" in P.__doc__.lower()
