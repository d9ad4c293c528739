"""No number of connections can abort hmad: past the cap (server.max_connections, lowered to what the
open-file limit can hold) new connections are closed at once, those already served carry on, status and
metrics count them. The daemon runs under a low RLIMIT_NOFILE set in its own process."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest
import zmq
from daemon_harness import Daemon
from test_daemon import raw_socket, recv
from tiny_gguf import MIXED, make_tiny_gguf

from hmaclient import Client
from hmaclient import protocol as P

# the daemon's open-file limit: soft as low as systemd's default (relative to these floods), hard higher
SOFT, HARD = 256, 2048


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf", seed=5, types=MIXED)


def flood(path: str, n: int) -> list[socket.socket]:
    """``n`` plain Unix-socket connections that never speak ZMTP (a refused connect ends the flood)."""
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
        except OSError:
            s.close()
            break
        socks.append(s)
    return socks


def closed_by_peer(s: socket.socket, timeout: float = 0.0) -> bool:
    s.settimeout(timeout)
    try:
        return s.recv(64) == b""
    except (TimeoutError, BlockingIOError):
        return False
    except OSError:
        return True


def test_a_flood_of_connections_is_capped_and_served_clients_carry_on(tiny_path, tmp_path):
    d = Daemon(tiny_path, tmp_path, nofile=(SOFT, HARD)).wait_ready()
    socks: list[socket.socket] = []
    try:
        with zmq.Context() as ctx:
            served = raw_socket(ctx, d.socket)  # connected before the flood
            long = P.generate_request("s", "the cat", raw=True, max_tokens=100000, temperature=0)
            served.send(P.pack(long))
            assert [recv(served)["type"] for _ in range(2)] == ["accepted", "token"]
            cap = d.status()["max_connections"]
            assert SOFT < cap < HARD / 2, cap  # 1024 lowered to fit the limit raised to HARD
            socks += flood(d.socket, HARD)
            assert len(socks) > SOFT and d.proc.poll() is None, d.log_text()
            deadline, closed = time.monotonic() + 15, set()
            while time.monotonic() < deadline and len(closed) < len(socks) - cap:
                closed |= {i for i, s in enumerate(socks) if i not in closed and closed_by_peer(s)}
                time.sleep(0.1)
            assert len(closed) >= len(socks) - cap, f"{len(closed)} of the excess closed"
            served.send(P.pack(P.status_request("st")))  # the served connection carries on
            replies = [recv(served) for _ in range(200)]
            st = next(r["status"] for r in replies if r["type"] == "status")
            assert st["connections"] <= cap and st["connections_refused"] >= len(socks) - cap, st
            assert [r["type"] for r in replies].count("token") >= 150
            served.send(P.pack(P.metrics_request("m")))
            fams = next(r["metrics"] for r in iter(lambda: recv(served), None) if r["type"] == "metrics")
            fams = {f["name"]: f for f in fams}
            assert fams["connections"]["samples"][0]["value"] >= 2
            assert fams["connections_refused"]["samples"][0]["value"] >= len(socks) - cap
            for s in socks:
                s.close()
            time.sleep(0.5)
            with Client(d.socket, timeout=30) as c:  # once the flood is gone, new clients are served
                assert c.generate("the dog", max_tokens=3, temperature=0, raw=True).generated_tokens >= 1
    finally:
        for s in socks:
            s.close()
        code = d.stop()
    assert code == 0, d.log_text()
    assert not os.path.exists(d.socket)


def test_the_soft_open_file_limit_is_raised_to_the_hard_one(tiny_path, tmp_path):
    d = Daemon(tiny_path, tmp_path, "server.max_connections=100000", nofile=(SOFT, HARD)).wait_ready()
    try:
        limits = Path(f"/proc/{d.proc.pid}/limits").read_text()
        line = next(x for x in limits.splitlines() if x.startswith("Max open files"))
        assert line.split()[3:5] == [str(HARD)] * 2, line
        assert SOFT < d.status()["max_connections"] < HARD / 2
        assert "server.max_connections 100000 lowered to" in d.log_text()
    finally:
        assert d.stop() == 0, d.log_text()


def test_one_users_connections_are_capped(tiny_path, tmp_path):
    """server.max_connections_per_uid 4: this user's fifth connection on is closed at once; once theirs
    end, the user is served again."""
    d = Daemon(tiny_path, tmp_path, "server.max_connections_per_uid=4").wait_ready()
    try:
        socks = flood(d.socket, 12)
        deadline, closed = time.monotonic() + 15, set()
        while time.monotonic() < deadline and len(closed) < len(socks) - 4:
            closed |= {i for i, s in enumerate(socks) if i not in closed and closed_by_peer(s)}
            time.sleep(0.1)
        assert len(closed) == len(socks) - 4, f"{len(closed)} closed"
        for s in socks:
            s.close()
        time.sleep(0.5)
        with Client(d.socket, timeout=30) as c:
            assert c.generate("the dog", max_tokens=3, temperature=0, raw=True).generated_tokens >= 1
            assert c.status()["connections_refused"] == len(socks) - 4
    finally:
        assert d.stop() == 0, d.log_text()
    assert "(server.max_connections_per_uid): refusing new connections" in d.log_text()
