"""An invariant checker over a run of >= 200 mixed requests against a real hmad: concurrent clients,
pipelined requests, cancels mid-stream, clients killed mid-stream. Every accepted request of a surviving
client must get exactly one terminal reply and nothing after it; afterwards the daemon is idle."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict

import pytest
import zmq
from daemon_harness import Daemon
from test_daemon import CLIENT_THEN_HANG, raw_socket
from tiny_gguf import MIXED, make_tiny_gguf

from hmaclient import Client
from hmaclient import protocol as P

N_THREADS, ROUNDS = 8, 10  # 8 threads x 10 rounds x 1..4 pipelined requests (~200) + killed clients
SENT_CANCEL = "sent cancel"  # a client's own log entry (not a reply): it cancelled that id


def run_client(path: str, seed: int, log: list) -> None:
    """Send rounds of 1..4 pipelined generates, cancelling some after their first token; log every reply."""
    rng = random.Random(seed)
    with zmq.Context() as ctx:
        s = raw_socket(ctx, path)
        n, streaming = 0, {}
        for _ in range(ROUNDS):
            batch = []
            for _ in range(rng.randint(1, 4)):
                n += 1
                rid = f"{seed}-{n}"
                cancel, stream = rng.random() < 0.3, rng.random() < 0.8
                s.send(
                    P.pack(
                        P.generate_request(
                            rid,
                            prompt="the cat and the dog",
                            temperature=0,
                            max_tokens=100000 if cancel else rng.randint(1, 8),
                            stream=stream,
                        )
                    )
                )
                batch.append((rid, cancel))
                streaming[rid] = stream
            open_ids = {rid for rid, _ in batch}
            to_cancel = {rid for rid, c in batch if c}
            while open_ids:
                assert s.poll(30000), f"client {seed}: no reply for {open_ids}"
                msg = P.unpack(s.recv(), max_size=P.MAX_REPLY_BYTES)
                log.append(msg)
                # cancel a streaming request after its first token, a non-streaming one once accepted
                trigger = "token" if streaming.get(msg["id"]) else "accepted"
                if msg["type"] == trigger and msg["id"] in to_cancel:
                    s.send(P.pack(P.cancel_request(msg["id"])))
                    log.append({"type": SENT_CANCEL, "id": msg["id"]})  # what the client sent, for check()
                    to_cancel.discard(msg["id"])
                if msg["type"] in P.TERMINAL_TYPES:
                    open_ids.discard(msg["id"])
        while s.poll(300):  # anything after the last terminal reply is a violation, caught by check()
            log.append(P.unpack(s.recv(), max_size=P.MAX_REPLY_BYTES))


def check(log: list) -> int:
    """Exactly one terminal reply per accepted request, nothing after it but, for a request this client
    cancelled, the ``not_found`` answer of a cancel that came after its end (docs/protocol.md: the client
    drops it; e.g. a request that ended ``busy`` right after ``accepted``); returns requests seen."""
    seen: dict = defaultdict(list)
    cancelled = {msg["id"] for msg in log if msg["type"] == SENT_CANCEL}
    for msg in log:
        if msg["type"] == SENT_CANCEL:
            continue
        kinds = seen[msg["id"]]
        if msg["type"] == "error" and msg.get("code") == P.NOT_FOUND:  # answers a cancel, never a generate
            ended = any(k in P.TERMINAL_TYPES for k in kinds)
            assert msg["id"] in cancelled and ended, f"{msg['id']}: not_found while in flight: {kinds}"
            continue  # the late cancel's answer
        kinds.append(msg["type"])
    for rid, kinds in seen.items():
        terminals = [k for k in kinds if k in P.TERMINAL_TYPES]
        assert len(terminals) == 1, f"{rid}: {kinds}"
        assert kinds[-1] in P.TERMINAL_TYPES, f"{rid}: replies after the terminal one: {kinds}"
        if kinds[0] == "accepted":
            assert all(k == "token" for k in kinds[1:-1]), f"{rid}: {kinds}"
        else:
            assert kinds == ["error"], f"{rid}: refused requests get one error: {kinds}"
    return len(seen)


@pytest.fixture
def daemon(tmp_path):
    model = make_tiny_gguf(tmp_path / "tiny.gguf", seed=11, types=MIXED)
    d = Daemon(
        model,
        tmp_path,
        "engine.max_seqs=6",
        "engine.max_queue=16",
        "service.heartbeat_ivl_s=0.5",
        "service.heartbeat_timeout_s=1.5",
    ).wait_ready()
    yield d
    assert d.stop() == 0, d.log_text()


def test_every_accepted_request_gets_exactly_one_terminal_reply(daemon):
    logs = [[] for _ in range(N_THREADS)]
    threads = [
        threading.Thread(target=run_client, args=(daemon.socket, i, logs[i])) for i in range(N_THREADS)
    ]
    for t in threads:
        t.start()
    killed = 0
    while any(t.is_alive() for t in threads):  # meanwhile, clients that die mid-stream
        p = subprocess.Popen(
            [sys.executable, "-c", CLIENT_THEN_HANG, daemon.socket], stdout=subprocess.PIPE, text=True
        )
        streaming = p.stdout.readline().strip() == "streaming"  # else refused (busy): nothing to kill
        p.send_signal(signal.SIGKILL)
        p.wait()
        killed += streaming
        time.sleep(0.2)
    for t in threads:
        t.join()
    total = sum(check(log) for log in logs)
    assert total + killed >= 200, (total, killed)
    with Client(daemon.socket, timeout=30) as c:
        deadline = time.monotonic() + 10
        while (st := c.status())["in_flight"] or st["running"] or st["queued"]:
            assert time.monotonic() < deadline, f"killed clients' requests not freed: {st}"
            time.sleep(0.1)
        assert st["kv"]["sequences"] == 0
        assert st["kv"]["global_blocks_used"] == st["kv"]["local_blocks_used"] == 0  # cached at most
