"""Peers that never read cannot grow hmad without bound: replies queued for them, all peers together, stay
under server.max_reply_bytes; a peer over its share is disconnected and its requests cancelled; the
others are served. Status replies (about a kilobyte each, for a few bytes asked) fill the outboxes fast."""

from __future__ import annotations

import pytest
import zmq
from daemon_harness import Daemon
from test_daemon import raw_socket, recv, wait_idle
from test_hostile_signals import silent_socket
from tiny_gguf import MIXED, make_tiny_gguf

from hmaclient import Client
from hmaclient import protocol as P

CAP = 1 << 20  # server.max_reply_bytes in these tests (its minimum)


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf", seed=5, types=MIXED)


def test_silent_peers_are_dropped_at_their_share_of_the_reply_cap(tiny_path, tmp_path):
    sets = (f"server.max_reply_bytes={CAP}", "service.heartbeat_timeout_s=60")
    d = Daemon(tiny_path, tmp_path, *sets).wait_ready()
    try:
        with zmq.Context() as ctx:
            served = raw_socket(ctx, d.socket)
            silent = [silent_socket(ctx, d.socket) for _ in range(3)]
            for i, s in enumerate(silent):
                s.send(P.pack(P.generate_request(i, "the cat", raw=True, max_tokens=100000, temperature=0)))
            rss0 = d.rss_kib()
            peak = 0
            for _ in range(3):
                for s in silent:
                    ask_without_reading(s, 3000)  # ~2 MB of replies, never read
                    served.send(P.pack(P.status_request("st")))
                    st = recv(served)["status"]
                    peak = max(peak, st["queued_reply_bytes"])
            with Client(d.socket, timeout=30) as c:
                assert c.generate("the dog", max_tokens=3, temperature=0, raw=True).generated_tokens >= 1
                st = wait_idle(c)  # the dropped peers' generations were cancelled
            assert st["queued_reply_bytes"] <= CAP and peak <= CAP, (st, peak)
            assert d.rss_kib() - rss0 < 64 * 1024, "memory grew with the silent peers"
    finally:
        assert d.stop() == 0, d.log_text()
    log = d.log_text()
    assert log.count("over its share of server.max_reply_bytes") >= 2, log


def ask_without_reading(s: zmq.Socket, n: int) -> None:
    """Up to ``n`` status requests on ``s``, until its own pipe is full (a dropped peer reconnects)."""
    for i in range(n):
        try:
            s.send(P.pack(P.status_request(i)), zmq.NOBLOCK)
        except zmq.Again:
            return
