"""Signals, shutdown and the lock against careless neighbours, on a real hmad: SIGHUP never ends it; a peer
that stops reading cannot hold a SIGTERM shutdown past the drain grace; deleting the lock file does not let
a second daemon take over a live socket; each request is logged with its peer's credentials."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import zmq
from daemon_harness import Daemon
from test_daemon import raw_socket, recv
from tiny_gguf import MIXED, make_tiny_gguf

from hmaclient import Client
from hmaclient import protocol as P


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf", seed=5, types=MIXED)


def test_sighup_is_logged_and_serving_goes_on(tiny_path, tmp_path):
    d = Daemon(tiny_path, tmp_path).wait_ready()
    try:
        with Client(d.socket, timeout=30) as c:
            stream = c.stream("the cat", max_tokens=100000, temperature=0, raw=True)
            next(stream)
            for _ in range(3):
                d.proc.send_signal(signal.SIGHUP)
                time.sleep(0.2)
            assert d.proc.poll() is None, d.log_text()
            for _ in range(10):  # the request in flight carries on
                next(stream)
            stream.close()
            assert c.generate("the dog", max_tokens=3, temperature=0, raw=True).generated_tokens >= 1
    finally:
        code = d.stop()
    assert code == 0, d.log_text()
    assert "SIGHUP: nothing to reload" in d.log_text()


def silent_socket(ctx: zmq.Context, path: str) -> zmq.Socket:
    """A DEALER that will not read: one frame in its pipe, a small kernel buffer."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVHWM, 1)
    s.setsockopt(zmq.RCVBUF, 4096)
    s.connect(P.endpoint(path))
    return s


def fill_outbox(d: Daemon, s: zmq.Socket, requests: int = 4000) -> int:
    """Send ``requests`` status requests on ``s`` without reading: the replies past its pipe wait in the
    daemon's outbox. Returns the bytes queued there."""
    for i in range(requests):
        s.send(P.pack(P.status_request(i)))
    deadline = time.monotonic() + 30
    while (queued := d.status()["queued_reply_bytes"]) == 0:
        assert time.monotonic() < deadline, "the silent peer's replies never queued"
        time.sleep(0.2)
    return queued


def test_a_peer_that_stops_reading_cannot_hold_shutdown(tiny_path, tmp_path):
    """Its replies fill its pipe and wait in the daemon's outbox (its heartbeats would drop it only after a
    minute); SIGTERM still ends hmad within the drain grace (1 s) and the second after it, exit 0, and a
    reading client's request in flight gets its terminal reply."""
    sets = ("service.drain_grace_s=1", "service.heartbeat_timeout_s=60")
    d = Daemon(tiny_path, tmp_path, *sets).wait_ready()
    with zmq.Context() as ctx, contextlib.ExitStack() as cleanup:
        cleanup.callback(d.stop)
        silent = silent_socket(ctx, d.socket)
        silent.send(P.pack(P.generate_request("g", "the cat", raw=True, max_tokens=100000, temperature=0)))
        fill_outbox(d, silent)
        reader = raw_socket(ctx, d.socket)
        reader.send(P.pack(P.generate_request("r", "the dog", raw=True, max_tokens=100000, temperature=0)))
        assert recv(reader, 60)["type"] == "accepted"  # after the silent peer's statuses (a busy machine)
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        code = d.proc.wait(30)
        took = time.monotonic() - t0
        kinds = []
        while reader.poll(100):
            kinds.append(P.unpack(reader.recv(), max_size=P.MAX_REPLY_BYTES)["type"])
    d.stop()
    assert code == 0, d.log_text()
    assert took < 1 + 3, f"shutdown took {took:.1f} s"
    assert kinds and kinds[-1] == "cancelled", kinds[-5:]


def test_a_deleted_lock_file_does_not_let_a_second_daemon_take_the_socket(tiny_path, tmp_path):
    d = Daemon(tiny_path, tmp_path).wait_ready()
    try:
        os.unlink(d.socket + ".lock")
        proc = subprocess.run(
            [sys.executable, "-m", "hmad", "--model", str(tiny_path), "--socket", d.socket],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "HMAD_CONFIG": ""},
        )
        assert proc.returncode != 0 and "already serving" in proc.stderr, proc.stderr
        assert os.path.exists(d.socket) and d.ping()  # the live daemon's socket is untouched
    finally:
        assert d.stop() == 0, d.log_text()


def test_each_request_is_logged_with_the_peers_credentials(tiny_path, tmp_path):
    d = Daemon(tiny_path, tmp_path).wait_ready()
    try:
        with Client(d.socket, timeout=30) as c:
            c.generate("the dog", max_tokens=2, temperature=0, raw=True)
    finally:
        assert d.stop() == 0
    assert f"from uid {os.getuid()} pid {os.getpid()}" in d.log_text()


def test_extend_timeout_is_sent_only_after_load_progress(tmp_path, monkeypatch):
    """The start timeout is extended only while the load reports progress: a load stuck in one phase
    stops extending, so systemd's TimeoutStartSec= can end it. The service's own extender thread, its
    period shortened, speaking to a real datagram socket standing where systemd's would."""
    import socket as so

    from hmad import service as service_mod
    from hmad.config import Config

    listener = so.socket(so.AF_UNIX, so.SOCK_DGRAM)
    listener.bind(str(tmp_path / "notify.sock"))
    listener.settimeout(0.5)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify.sock"))
    monkeypatch.setattr(service_mod, "EXTEND_EVERY_S", 0.05)
    svc = service_mod.Service(Config())
    svc.loading.set()
    extender = threading.Thread(target=svc._extend_while_loading, daemon=True)
    extender.start()

    def lines(for_s: float) -> list[str]:
        out, deadline = [], time.monotonic() + for_s
        while time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                out += listener.recv(4096).decode().split("\n")
        return out

    try:
        assert not [x for x in lines(0.6) if x.startswith("EXTEND_TIMEOUT_USEC=")]  # stuck: no extension
        svc._progress("reading")  # one progress report: its own line, then one extension from the thread
        got = lines(0.6)
        assert sum(x.startswith("EXTEND_TIMEOUT_USEC=") for x in got) == 2, got
        assert "STATUS=reading" in got
    finally:
        svc.loading.clear()
        extender.join(1)
        listener.close()


def test_sigterm_ends_a_load_stuck_in_one_phase(tiny_path, tmp_path):
    """A load that never reports progress again (HMAD_TEST_FAULT=load:stall: a hung disk or driver) cannot
    hold the process: SIGTERM ends it within the load's stop wait plus a little, the socket is gone, and no
    EXTEND_TIMEOUT_USEC keeps systemd waiting meanwhile (the load reported no progress)."""
    d = Daemon(tiny_path, tmp_path, env={"HMAD_TEST_FAULT": "load:stall"})
    deadline = time.monotonic() + 60
    while not (os.path.exists(d.socket) and d.status(timeout=2).get("state") == "loading"):
        assert d.proc.poll() is None, d.log_text()
        assert time.monotonic() < deadline, d.log_text()
        time.sleep(0.1)
    time.sleep(1.0)  # well inside the stall
    assert d.proc.poll() is None, d.log_text()
    t0 = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    try:
        d.proc.wait(15)
    except subprocess.TimeoutExpired:
        d.proc.kill()
        pytest.fail(f"hmad still running 15 s after SIGTERM during a stuck load:\n{d.log_text()}")
    took = time.monotonic() - t0
    d.stop()
    text = d.log_text()
    assert took < 10, (took, text)
    assert "the model load stalls" in text and "abandoning it" in text, text
    assert not os.path.exists(d.socket)
