"""A slow peer dropped while its own requests still wait unread in the daemon cannot take the daemon down.

libzmq (4.3) aborts the process (``!_io_error`` in ``stream_engine_base_t::out_event``) when a connection
ends while its engine has stopped reading for want of room in the socket's inbound pipe and a heartbeat
falls due before the socket reads that pipe down. Here heartbeats come every few tens of milliseconds and
silent peers flood status requests until they are dropped for the replies they do not read, round after
round: the daemon must serve on and stop cleanly. (A peer that ends its own connection in that state can
still trip libzmq: see hmad/peers.py.)"""

from __future__ import annotations

import pytest
import zmq
from daemon_harness import Daemon
from test_daemon import raw_socket, recv
from test_hostile_memory import ask_without_reading
from test_hostile_signals import silent_socket
from tiny_gguf import MIXED, make_tiny_gguf

from hmaclient import protocol as P

CAP = 1 << 20  # server.max_reply_bytes (its minimum)
ROUNDS = 4


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf", seed=5, types=MIXED)


def test_dropping_flooding_peers_with_fast_heartbeats_keeps_the_daemon_up(tiny_path, tmp_path):
    sets = (f"server.max_reply_bytes={CAP}", "service.heartbeat_ivl_s=0.03", "service.heartbeat_timeout_s=60")
    d = Daemon(tiny_path, tmp_path, *sets).wait_ready()
    with zmq.Context() as ctx:
        try:
            served = raw_socket(ctx, d.socket)
            silent = [silent_socket(ctx, d.socket) for _ in range(3)]
            for i, s in enumerate(silent):
                s.send(P.pack(P.generate_request(i, "the cat", raw=True, max_tokens=100000, temperature=0)))
            for _ in range(ROUNDS):
                for s in silent:  # a dropped one reconnects
                    ask_without_reading(s, 3000)
                    served.send(P.pack(P.status_request("st")))
                    assert recv(served, timeout=10)["status"], d.log_text()
        finally:  # the silent peers stay connected till the daemon stops: every end is the daemon's doing
            assert d.stop() == 0, d.log_text()
    assert d.log_text().count("over its share of server.max_reply_bytes") >= 2, d.log_text()
