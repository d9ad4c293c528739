"""logit_bias, presence_penalty and frequency_penalty through a real hmad on a real socket: bad values are
refused on the wire with one-line bad_request errors (frames sent as they are, past the client's own
check) and the daemon answers the next request; a logit_bias forces the tokens of a greedy answer; an id
past the model's vocabulary fails that request alone."""

from __future__ import annotations

import pytest
from daemon_harness import Daemon
from tiny_gguf import make_tiny_gguf

from hmaclient import Client, RequestError
from hmaclient import protocol as P


@pytest.fixture(scope="module")
def hmad(tmp_path_factory):
    path = make_tiny_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf", seed=5)
    d = Daemon(path, tmp_path_factory.mktemp("hmad")).wait_ready()
    yield d
    assert d.stop() == 0, d.log_text()


ASK = dict(prompt="hello there", raw=True, temperature=0.0, max_tokens=6)
BAD = [
    ("presence_penalty", "high", "presence_penalty must be a number in [-2, 2], got 'high'"),
    ("frequency_penalty", 2.5, "frequency_penalty must be a number in [-2, 2], got 2.5"),
    ("logit_bias", {"7": 101}, "logit_bias['7'] must be a number in [-100, 100], got 101"),
    ("logit_bias", {"7": "up"}, "logit_bias['7'] must be a number in [-100, 100], got 'up'"),
    (
        "logit_bias",
        {"seven": 1},
        "logit_bias keys must be token ids (integers from 0 to 2^31-1), got 'seven'",
    ),
    ("logit_bias", {str(i): 1 for i in range(301)}, "logit_bias has 301 entries, over the limit of 300"),
    ("logit_bias", [7, 1], "logit_bias must be a map of at most 300 token ids (decimal strings) to numbers"),
]


def test_bad_values_are_refused_in_one_line_and_the_next_request_is_answered(hmad):
    for i, (name, value, says) in enumerate(BAD):
        msg = {"v": 3, "type": "generate", "id": f"bad{i}", "prompt": "hi", name: value}
        reply = P.parse_reply(hmad._ask(msg, 10.0))
        assert isinstance(reply, P.Error) and reply.code == P.BAD_REQUEST, reply
        assert reply.message.startswith(says) and "\n" not in reply.message, reply.message
        with Client(hmad.socket, timeout=60) as c:
            assert c.generate(**ASK).token_ids


def test_a_logit_bias_forces_and_bans_greedy_tokens(hmad):
    """The tiny model repeats its last token by a margin of ~90 or more: +100 on a token and -100 on the
    plain answer's tokens make the answer that token throughout (a ban alone is tests/test_penalties.py's:
    here the margin can exceed 100); an empty map and zero penalties give the plain answer."""
    with Client(hmad.socket, timeout=60) as c:
        plain = c.generate(**ASK).token_ids
        pick = next(t for t in (300, 301, 302) if t not in plain)
        ban = {str(t): -100 for t in set(plain)}
        forced = c.generate(**ASK, logit_bias={str(pick): 100, **ban}, presence_penalty=0.5)
        assert forced.token_ids == [pick] * len(forced.token_ids) and forced.token_ids
        again = c.generate(**ASK, frequency_penalty=0.0, logit_bias={})
        assert again.token_ids == plain


def test_an_id_past_the_vocabulary_fails_that_request_only(hmad):
    with Client(hmad.socket, timeout=60) as c:
        with pytest.raises(RequestError) as e:
            c.generate(**ASK, logit_bias={"100000": 5})
        assert "logit_bias token 100000 is outside" in e.value.message and "\n" not in e.value.message
        assert c.generate(**ASK).token_ids
