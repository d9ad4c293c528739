"""One connection, or one user, cannot take every slot: past server.max_in_flight_per_connection (one
connection) or server.max_in_flight_per_uid (every connection of the peer's uid) a generate is refused
``busy`` naming the limit, before ``accepted``; the others are served, and a slot freed is usable again."""

from __future__ import annotations

import pytest
import zmq
from daemon_harness import Daemon
from test_daemon import raw_socket, recv
from tiny_gguf import MIXED, make_tiny_gguf

from hmaclient import protocol as P


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf", seed=5, types=MIXED)


def ask(s: zmq.Socket, rid: object) -> dict:
    s.send(P.pack(P.generate_request(rid, "the cat", raw=True, max_tokens=100000, temperature=0)))
    while True:  # its accepted or refusal (tokens of earlier requests may come first)
        r = recv(s, 30)
        if r["id"] == rid and r["type"] in ("accepted", "error"):
            return r


def test_per_connection_and_per_user_limits(tiny_path, tmp_path):
    sets = ("server.max_in_flight_per_connection=2", "server.max_in_flight_per_uid=3")
    d = Daemon(tiny_path, tmp_path, *sets).wait_ready()
    try:
        with zmq.Context() as ctx:
            a, b = raw_socket(ctx, d.socket), raw_socket(ctx, d.socket)
            assert [ask(a, i)["type"] for i in (1, 2)] == ["accepted"] * 2
            third = ask(a, 3)
            assert third["code"] == P.BUSY and "max_in_flight_per_connection" in third["message"], third
            assert ask(b, 4)["type"] == "accepted"  # another connection of the same user: its third
            fourth = ask(b, 5)
            assert fourth["code"] == P.BUSY and "max_in_flight_per_uid" in fourth["message"], fourth
            a.send(P.pack(P.cancel_request(1)))
            while recv(a, 30)["type"] != "cancelled":
                pass
            assert ask(b, 6)["type"] == "accepted"  # a slot freed is usable again
    finally:
        assert d.stop() == 0, d.log_text()
