"""The socket loop never waits on heavy work: while a ~1 MB prompt is tokenized, or a large JSON schema is
compiled and the vocabulary indexed for the first constrained request (the embedded model's 262k tokens),
``ping`` is answered within 100 ms. Schema problems that only the model's vocabulary reveals are
``bad_request`` at submission, not ``internal`` mid-request."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import zmq
from daemon_harness import Daemon
from test_daemon import raw_socket, recv, wait_idle

from hmaclient import Client
from hmaclient import protocol as P

PING_BOUND_S = 0.1


@pytest.fixture(scope="module")
def hmad(embedded_model_path, tmp_path_factory):
    d = Daemon(embedded_model_path, tmp_path_factory.mktemp("hmad"), "engine.max_seqs=2").wait_ready()
    yield d
    assert d.stop() == 0, d.log_text()


class Pinger(threading.Thread):
    """Pings every 20 ms on a connection of its own; ``worst`` is the slowest answer."""

    def __init__(self, path: str):
        super().__init__(daemon=True)
        self.path, self.worst, self.count, self.stop = path, 0.0, 0, threading.Event()

    def run(self) -> None:
        with zmq.Context() as ctx:
            s = raw_socket(ctx, self.path)
            while not self.stop.is_set():
                t0 = time.perf_counter()
                s.send(P.pack(P.ping_request(self.count)))
                assert recv(s, 30)["type"] == "pong"
                self.worst = max(self.worst, time.perf_counter() - t0)
                self.count += 1
                time.sleep(0.02)


def while_pinging(path: str, request: dict) -> tuple[list[dict], Pinger]:
    """Send ``request``, ping meanwhile; its replies up to ``accepted`` or its refusal."""
    pinger = Pinger(path)
    pinger.start()
    time.sleep(0.2)
    with zmq.Context() as ctx:
        s = raw_socket(ctx, path)
        s.send(P.pack(request))
        replies = [recv(s, 300)]
        if replies[0]["type"] == "accepted":
            s.send(P.pack(P.cancel_request(request["id"])))
            while replies[-1]["type"] not in P.TERMINAL_TYPES:
                replies.append(recv(s, 60))
    pinger.stop.set()
    pinger.join()
    return replies, pinger


def test_ping_is_answered_while_a_megabyte_prompt_is_tokenized(hmad):
    prompt = "".join(f"w{i % 9973} " for i in range(170_000))  # ~1 MB, more tokens than the context
    assert len(prompt) > 900_000
    replies, pinger = while_pinging(hmad.socket, P.generate_request("big", prompt, raw=True, max_tokens=1))
    assert replies[-1]["type"] == "error" and replies[-1]["code"] == P.PROMPT_TOO_LONG, replies[-1]
    assert pinger.count > 5 and pinger.worst <= PING_BOUND_S, (pinger.count, pinger.worst)


def test_ping_is_answered_while_a_large_schema_is_compiled_and_indexed(hmad):
    pattern = "^[a-z]{{1,{}}}[0-9]*$"
    props = {f"field_{i}": {"type": "string", "pattern": pattern.format(i % 7 + 1)} for i in range(300)}
    schema = {"type": "object", "properties": props, "required": list(props)[:50]}
    request = P.generate_request("schema", "Fill the form.", max_tokens=4, json_schema=schema)
    replies, pinger = while_pinging(hmad.socket, request)
    assert replies[0]["type"] == "accepted", replies
    assert pinger.count > 5 and pinger.worst <= PING_BOUND_S, (pinger.count, pinger.worst)


def test_a_self_referencing_schema_is_a_bad_request_at_submission(hmad):
    with zmq.Context() as ctx:
        s = raw_socket(ctx, hmad.socket)
        schema = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
        s.send(P.pack(P.generate_request("loop", "x", max_tokens=4, json_schema=schema)))
        reply = recv(s, 120)
    assert reply["type"] == "error" and reply["code"] == P.BAD_REQUEST, reply
    assert "json_schema cannot be used" in reply["message"]


PREFILL_CHILD = """
import sys, time, zmq
from hmaclient import Client
from hmaclient import protocol as P
s = zmq.Context().socket(zmq.DEALER); s.connect(P.endpoint(sys.argv[1]))
prompt = " ".join(f"item {i}" for i in range(3000))
s.send(P.pack(P.generate_request("p", prompt=prompt, raw=True, max_tokens=100000, stream=False)))
if not s.poll(120000):
    sys.exit("no reply in 120 s")
print(P.unpack(s.recv())["type"], flush=True)
time.sleep(3600)
"""


def test_a_killed_client_prefilling_a_long_prompt_is_cancelled(hmad):
    """Thousands of prompt tokens take several steps to prefill; the client is killed during them."""
    proc = subprocess.Popen(
        [sys.executable, "-c", PREFILL_CHILD, hmad.socket], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "accepted"
        with Client(hmad.socket, timeout=60) as c:
            st = c.status()
            assert st["in_flight"] == 1, st
            proc.kill()
            proc.wait()
            st = wait_idle(c, timeout=5 + 10)  # heartbeat timeout (5 s) + one prefill step
            assert st["kv"]["sequences"] == 0
    finally:
        proc.kill()
        proc.wait()
