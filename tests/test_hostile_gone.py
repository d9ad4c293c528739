"""A client that goes away is noticed within heartbeat_timeout_s whatever its request is doing: its
requests are cancelled and their slots and KV blocks freed. The client is a real process, killed
(SIGKILL: the kernel closes its socket) or stopped (SIGSTOP: it answers no heartbeat)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from daemon_harness import Daemon
from test_daemon import wait_idle
from tiny_gguf import MIXED, make_tiny_gguf

from hmaclient import Client

CHILD = """
import sys, time, zmq
from hmaclient import protocol as P
s = zmq.Context().socket(zmq.DEALER); s.connect(P.endpoint(sys.argv[1]))
stream = sys.argv[2] == "stream"
s.send(P.pack(P.generate_request("k", prompt="the dog", raw=True, max_tokens=100000, temperature=0,
                                 stream=stream)))
if not s.poll(60000):
    sys.exit("no reply in 60 s")
print(P.unpack(s.recv())["type"], flush=True)
time.sleep(3600)
"""


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf", seed=5, types=MIXED)


@pytest.fixture
def daemon(tiny_path, tmp_path):
    sets = ("engine.max_seqs=1", "service.heartbeat_ivl_s=0.5", "service.heartbeat_timeout_s=1.5")
    d = Daemon(tiny_path, tmp_path, *sets).wait_ready()
    yield d
    assert d.stop() == 0, d.log_text()


def child(d: Daemon, mode: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, d.socket, mode], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "accepted"
    return proc


def gone(proc: subprocess.Popen, sig: int) -> None:
    proc.send_signal(sig)
    if sig == signal.SIGKILL:
        proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "stopped"])
def test_a_gone_client_generating_without_streaming_is_cancelled(daemon, sig):
    proc = child(daemon, "nostream")
    try:
        with Client(daemon.socket, timeout=30) as c:
            assert c.status()["in_flight"] == 1
            gone(proc, sig)
            st = wait_idle(c, timeout=1.5 + 3)  # heartbeat timeout + a step or two
            assert st["kv"]["sequences"] == 0
            assert c.generate("the cat", max_tokens=3, temperature=0, raw=True).generated_tokens >= 1
    finally:
        proc.kill()
        proc.wait()


def test_a_gone_client_waiting_in_the_queue_is_cancelled(daemon):
    """max_seqs 1: this client's stream runs, the other's request waits; the other is killed."""
    with Client(daemon.socket, timeout=30) as c:
        stream = c.stream("the cat", max_tokens=100000, temperature=0, raw=True)
        next(stream)
        proc = child(daemon, "stream")
        try:
            deadline = time.monotonic() + 10  # the engine's snapshot shows it after its next step
            while c.status()["queued"] != 1:
                assert time.monotonic() < deadline, c.status()
                time.sleep(0.05)
            gone(proc, signal.SIGKILL)
            deadline = time.monotonic() + 1.5 + 3  # heartbeat timeout + a step or two
            while (st := c.status())["queued"] and time.monotonic() < deadline:
                time.sleep(0.1)
            assert st["queued"] == 0 and st["in_flight"] == 1, st
        finally:
            proc.kill()
            proc.wait()
        stream.close()
        wait_idle(c)
