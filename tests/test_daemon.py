"""hmad as a real process on a real ipc:// socket: concurrency, cancellation, dead clients, bad input,
shutdown. Tiny random GGUF models keep most of it fast; the embedded 270M serves the concurrency test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import zmq
from daemon_harness import Daemon
from tiny_gguf import MIXED, make_tiny_gguf

from hmaclient import Client, RequestError
from hmaclient import protocol as P


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf", seed=5, types=MIXED)


@pytest.fixture
def daemon(tiny_path, tmp_path):
    d = Daemon(
        tiny_path,
        tmp_path,
        "engine.max_seqs=8",
        "engine.max_queue=32",
        "service.drain_grace_s=2",
        "service.heartbeat_ivl_s=0.5",
        "service.heartbeat_timeout_s=1.5",
    ).wait_ready()
    yield d
    assert d.stop() == 0, d.log_text()


def raw_socket(ctx, path):
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(P.endpoint(path))
    return s


def recv(s, timeout=10.0):
    assert s.poll(int(timeout * 1000)), "no reply"
    return P.unpack(s.recv(), max_size=P.MAX_REPLY_BYTES)


def wait_idle(c: Client, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = c.status()
        if st["running"] == 0 and st["queued"] == 0 and st["in_flight"] == 0:
            return st
        time.sleep(0.1)
    raise AssertionError(f"daemon not idle: {st}")


def test_concurrent_clients_get_their_own_answers(embedded_model_path, tmp_path):
    """16 clients at once, temperature 0: each answer equals the one it gets alone; batches > 1."""
    d = Daemon(embedded_model_path, tmp_path, "engine.max_seqs=16").wait_ready()
    try:
        prompts = [
            f"Question {i}: name a colour that starts with the letter {'ABCDEFGHIJKLMNOP'[i]}."
            for i in range(16)
        ]
        with Client(d.socket, timeout=120) as c:
            alone = [c.generate(p, max_tokens=8, temperature=0).token_ids for p in prompts]
            c.status()
        together: dict[int, list[int]] = {}

        def ask(i):
            with Client(d.socket, timeout=300) as ci:
                together[i] = ci.generate(prompts[i], max_tokens=8, temperature=0).token_ids

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with Client(d.socket) as c:
            st = c.status()
        assert together == dict(enumerate(alone))
        assert max(st["recent_batch_sizes"]) > 1, st
    finally:
        assert d.stop() == 0, d.log_text()


def test_cancel_mid_stream_frees_the_slot(daemon):
    with Client(daemon.socket, timeout=30) as c:
        stream = c.stream("hello world", id="long", max_tokens=100000, temperature=0)
        pieces = [next(stream) for _ in range(3)]
        assert len(pieces) == 3
        stream.close()  # leaving the stream early sends cancel
        wait_idle(c)
        assert c.generate("hello", max_tokens=3, temperature=0).generated_tokens >= 1


def test_cancel_by_id_gets_cancelled_reply(daemon):
    with zmq.Context() as ctx:
        s = raw_socket(ctx, daemon.socket)
        s.send(P.pack(P.generate_request(prompt="the cat", id=7, max_tokens=100000, temperature=0)))
        assert recv(s)["type"] == "accepted"
        assert recv(s)["type"] == "token"
        s.send(P.pack(P.cancel_request(7)))
        kinds = []
        while not kinds or kinds[-1] not in P.TERMINAL_TYPES:
            kinds.append(recv(s)["type"])
        assert kinds[-1] == "cancelled"
        s.send(P.pack(P.cancel_request(7)))
        assert recv(s)["code"] == P.NOT_FOUND


CLIENT_THEN_HANG = """
import sys, zmq
from hmaclient import protocol as P
s = zmq.Context().socket(zmq.DEALER); s.connect(P.endpoint(sys.argv[1]))
s.send(P.pack(P.generate_request("k", prompt="the dog", max_tokens=100000, temperature=0)))
while True:  # print "streaming" once a token arrives, else the refusal's code (e.g. busy), never hang
    if not s.poll(60000):
        sys.exit("no reply in 60 s")
    msg = P.unpack(s.recv())
    if msg["type"] == "token":
        break
    if msg["type"] in P.TERMINAL_TYPES:
        print(msg.get("code", msg["type"]), flush=True)
        sys.exit(1)
print("streaming", flush=True)
s.recv()
import time; time.sleep(3600)
"""


def test_killed_client_frees_its_slot(daemon):
    proc = subprocess.Popen(
        [sys.executable, "-c", CLIENT_THEN_HANG, daemon.socket], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "streaming"
    with Client(daemon.socket, timeout=30) as c:
        assert c.status()["running"] == 1
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        wait_idle(c, timeout=5.0)  # one step + heartbeat timeout (1.5 s here)
        assert c.generate("the cat", max_tokens=3, temperature=0).generated_tokens >= 1


MALFORMED = [
    os.urandom(64),
    msgpack.packb({"v": 1, "type": "generate", "prompt": "x"})[:-1],  # truncated
    msgpack.packb({"v": 1, "type": "generate", "prompt": 5}),  # wrong type
    b"\xdd\x7f\xff\xff\xff",  # array32 declaring 2^31 items, no data
    b"\xdb\xff\xff\xff\xff",  # str32 declaring 4 GiB
    b"\x91" * 1000 + b"\xc0",  # 1000 levels of nesting
    msgpack.packb({"v": 1, "type": "launch"}),  # unknown request type
    msgpack.packb({"v": 9, "type": "ping"}),  # wrong protocol version
    msgpack.packb({"type": "ping"}),  # no version
    msgpack.packb({"v": 1, "type": "generate", "prompt": "x", "temperature": -1}),
    msgpack.packb({"v": 1, "type": "generate", "prompt": "x", "bogus": 1}),
    msgpack.packb(msgpack.ExtType(1, b"x")),
    msgpack.packb({1: 2}),
    b"",
]


def test_malformed_input_gets_errors_and_daemon_carries_on(daemon):
    rss0 = None
    with zmq.Context() as ctx:
        s = raw_socket(ctx, daemon.socket)
        for round_ in range(20):
            for frame in MALFORMED:
                s.send(frame)
                reply = recv(s)
                assert reply["type"] == "error" and reply["code"] in P.ERROR_CODES, (frame[:20], reply)
            if round_ == 1:
                rss0 = daemon.rss_kib()
        s.send_multipart([b"two", b"frames"])  # not one frame: the documented bad_request
        reply = recv(s)
        assert (reply["type"], reply["code"], reply["id"]) == ("error", P.BAD_REQUEST, None), reply
        assert "one frame" in reply["message"]
        big = ctx.socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 0)
        big.connect(P.endpoint(daemon.socket))
        big.send(b"\x00" * (P.MAX_FRAME_BYTES + 1))  # over ZMQ_MAXMSGSIZE: that peer is disconnected
        time.sleep(0.3)
        s.send(P.pack(P.ping_request(1)))
        assert recv(s)["type"] == "pong"
    assert daemon.rss_kib() - rss0 < 20 * 1024, "memory grew under malformed input"
    assert daemon.ping()


def test_busy_when_queue_full(tiny_path, tmp_path):
    d = Daemon(tiny_path, tmp_path, "engine.max_seqs=1", "engine.max_queue=1").wait_ready()
    try:
        with zmq.Context() as ctx:
            s = raw_socket(ctx, d.socket)
            for i in range(3):
                s.send(P.pack(P.generate_request(prompt="a", id=i, max_tokens=100000, temperature=0)))
            replies = [recv(s) for _ in range(3)]
            busy = [r for r in replies if r["type"] == "error"]
            assert [r["code"] for r in busy] == [P.BUSY] and busy[0]["id"] == 2
    finally:
        assert d.stop() == 0


def test_sigterm_during_generation_answers_everyone(tiny_path, tmp_path):
    d = Daemon(tiny_path, tmp_path, "service.drain_grace_s=1").wait_ready()
    with zmq.Context() as ctx:
        s = raw_socket(ctx, d.socket)
        for i in range(4):
            s.send(
                P.pack(P.generate_request(prompt="the", id=i, max_tokens=[5, 100000][i % 2], temperature=0))
            )
        terminal, accepted = {}, set()
        while len(accepted) < 4:
            r = recv(s)
            accepted |= {r["id"]} if r["type"] == "accepted" else set()
            terminal |= {r["id"]: r} if r["type"] in P.TERMINAL_TYPES else {}
        d.proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        s.send(P.pack(P.generate_request(prompt="late", id=99, max_tokens=3)))
        while len(terminal) < 5:
            r = recv(s, 20)
            if r["type"] in P.TERMINAL_TYPES:
                assert r["id"] not in terminal
                terminal[r["id"]] = r
        assert d.proc.wait(20) == 0, d.log_text()
    assert terminal[99]["code"] == P.SHUTTING_DOWN
    assert {terminal[i]["type"] for i in (1, 3)} == {"cancelled"}
    assert {terminal[i]["type"] for i in (0, 2)} <= {"done", "cancelled"}
    assert not os.path.exists(d.socket)


def test_second_daemon_on_same_socket_refuses(daemon, tiny_path):
    proc = subprocess.run(
        [sys.executable, "-m", "hmad", "--model", str(tiny_path), "--socket", daemon.socket],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "HMAD_CONFIG": ""},
    )
    assert proc.returncode != 0 and "already serving" in proc.stderr, proc.stderr
    assert daemon.ping()


def test_socket_mode_and_runtime_dir(daemon):
    assert oct(os.stat(daemon.socket).st_mode & 0o777) == oct(0o660)
    assert oct(os.stat(os.path.dirname(daemon.socket)).st_mode & 0o777) == oct(0o750)


def test_request_errors_reach_the_client(daemon):
    with Client(daemon.socket, timeout=10) as c, pytest.raises(RequestError) as e:
        c.generate("x" * 5000, max_tokens=10, raw=True)
    assert e.value.code in (P.BAD_REQUEST, P.PROMPT_TOO_LONG)


def test_sd_notify_sequence(tiny_path, tmp_path):
    """STATUS/EXTEND_TIMEOUT while loading, READY=1 once serving, WATCHDOG=1 while the engine runs,
    STOPPING=1 on SIGTERM — read from a real AF_UNIX datagram socket standing where systemd's would."""
    import socket as so

    notify_path = str(tmp_path / "notify.sock")
    listener = so.socket(so.AF_UNIX, so.SOCK_DGRAM)
    listener.bind(notify_path)
    listener.settimeout(30)
    os.environ["NOTIFY_SOCKET"], os.environ["WATCHDOG_USEC"] = notify_path, "400000"
    try:
        d = Daemon(tiny_path, tmp_path)
    finally:
        del os.environ["NOTIFY_SOCKET"], os.environ["WATCHDOG_USEC"]
    lines: list[str] = []

    def until(prefix: str) -> None:
        while not any(x.startswith(prefix) for x in lines):
            lines.extend(listener.recv(4096).decode().split("\n"))

    until("READY=1")
    before_ready = lines[: lines.index("READY=1")]
    assert any(x.startswith("STATUS=loading") for x in before_ready), lines
    assert any(x.startswith("EXTEND_TIMEOUT_USEC=") for x in before_ready), lines
    until("WATCHDOG=1")
    d.proc.send_signal(signal.SIGTERM)
    until("STOPPING=1")
    assert d.proc.wait(30) == 0, d.log_text()
    listener.close()


def test_slow_reader_does_not_stall_others(daemon):
    """A client that never reads its stream: its replies fill its own pipe and outbox while others are
    served; once it has answered no heartbeat for heartbeat_timeout_s (1.5 s here) its request is
    cancelled. Nothing here depends on how fast the machine is."""
    with zmq.Context() as ctx:
        slow = ctx.socket(zmq.DEALER)
        slow.setsockopt(zmq.LINGER, 0)
        slow.setsockopt(zmq.RCVHWM, 1)  # before connect: the pipe's limit is set when it is made
        slow.connect(P.endpoint(daemon.socket))
        slow.send(P.pack(P.generate_request("slow", prompt="the cat", max_tokens=100000, temperature=0)))
        with Client(daemon.socket, timeout=120) as c:
            for _ in range(3):
                assert c.generate("the dog", max_tokens=20, temperature=0, raw=True).generated_tokens >= 1
            assert c.status()["in_flight"] <= 1  # the slow one at most
            wait_idle(c, timeout=60)  # its connection dropped: its request cancelled, its slot freed


def test_socket_answers_while_loading(embedded_model_path, tmp_path):
    """The socket is bound before the model loads: status shows the phase (and, on a GPU, bytes uploaded of
    the total), ping says state loading, a generate gets one error with code ``loading``; then READY."""
    d = Daemon(embedded_model_path, tmp_path, "engine.max_seqs=2")
    seen: dict = {}
    try:
        with zmq.Context() as ctx:
            deadline = time.monotonic() + 120
            while "loading" not in seen and time.monotonic() < deadline:
                assert d.proc.poll() is None, d.log_text()
                if not os.path.exists(d.socket):
                    time.sleep(0.02)
                    continue
                s = raw_socket(ctx, d.socket)
                s.send(P.pack(P.status_request("st")))
                st = recv(s)["status"]
                if st["state"] == "loading":
                    s.send(P.pack(P.ping_request("p")))
                    pong = P.parse_reply(s.recv())
                    s.send(P.pack(P.generate_request("g", prompt="hi", max_tokens=2)))
                    seen = {"loading": st, "pong": pong, "generate": recv(s)}
                s.close()
        assert "loading" in seen, "never saw the loading state"
        assert seen["loading"]["phase"] and seen["loading"]["model"] == str(embedded_model_path)
        assert seen["pong"].state == "loading"
        gen = seen["generate"]
        assert gen["type"] == "error" and gen["code"] == P.LOADING and "loading" in gen["message"]
        d.wait_ready()
        with Client(d.socket, timeout=120) as c:
            st = c.status()
            assert st["state"] == "ready" and st["load"]["ready_s"] > 0
            assert c.ready()
            assert c.generate("The sky is", raw=True, max_tokens=2, temperature=0).generated_tokens >= 1
    finally:
        assert d.stop() == 0, d.log_text()
