"""Protocol version 5's model messages (hmaclient.request, .reply): the builders stamp the lowest version,
the daemon's parse refuses them in an older version naming the version they need, a model name is a
non-empty str of at most MAX_MODEL_CHARS, and ``result`` round-trips."""

from __future__ import annotations

import msgpack
import pytest

from hmaclient import protocol as P


def parsed(msg: dict):
    return P.parse_request(msgpack.packb(msg, use_bin_type=True))


def test_builders_stamp_version_5_only_when_needed():
    assert P.generate_request(1, "hi")["v"] == 1  # an older daemon still takes it
    msg = P.generate_request(1, "hi", model="owner/repo:Q8_0")
    assert msg["v"] == 5 and parsed(msg).model == "owner/repo:Q8_0"
    for kind, model in (
        ("models", None),
        ("unload", None),
        ("load", "a.gguf"),
        ("remove", "o/r:Q"),
        ("pull", "o/r"),
    ):
        msg = P.model_request(kind, 7, model)
        req = parsed(msg)
        assert msg["v"] == 5 and req == P.ModelRequest(kind, 7, model)


@pytest.mark.parametrize(
    "msg, says",
    [
        (
            {"v": 4, "type": "generate", "prompt": "x", "model": "m"},
            "field 'model' of generate needs protocol version 5",
        ),
        ({"v": 4, "type": "load", "model": "m"}, "request type 'load' needs protocol version 5"),
        ({"v": 5, "type": "load"}, "load.model must be"),
        ({"v": 5, "type": "pull", "model": ""}, "pull.model must be"),
        ({"v": 5, "type": "remove", "model": 3}, "remove.model must be"),
        ({"v": 5, "type": "models", "model": "m"}, "unknown field"),
        (
            {"v": 5, "type": "generate", "prompt": "x", "model": "m" * (P.MAX_MODEL_CHARS + 1)},
            "model must be",
        ),
        ({"v": 5, "type": "generate", "prompt": "x", "model": "a\x00b"}, "model must be"),
    ],
)
def test_refused(msg, says):
    with pytest.raises(P.ProtocolError) as e:
        parsed(msg)
    assert e.value.code == P.BAD_REQUEST and says in e.value.message


def test_result_and_the_new_codes_round_trip():
    reply = P.parse_reply(P.pack(P.result(3, {"switch_id": 2, "state": "draining"}, v=5)))
    assert reply == P.Result(3, {"switch_id": 2, "state": "draining"})
    for code in (P.MODEL_NOT_FOUND, P.SWITCH_REFUSED, P.MODEL_IN_USE, P.NO_MODEL):
        assert P.parse_reply(P.pack(P.error(1, code, "why", v=1))) == P.Error(1, code, "why")
    assert P.parse_reply(P.pack(P.pong(1, 0.0, "no_model"))).state == "no_model"
