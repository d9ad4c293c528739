"""One request's failure is that request's error, never the daemon's end (issue 15), on a real hmad:

- text the model's vocabulary cannot encode (a GGUF without byte-fallback tokens) is that request's
  ``bad_request``, and the daemon serves on;
- a fault injected into the backend's forward pass (the test-only HMAD_TEST_FAULT of hmad/faults.py): a
  recoverable one fails only the requests of that step, and the daemon serves everyone else and exits 0 on
  SIGTERM; an unusable-backend one answers every request and exits 1.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import zmq
from daemon_harness import Daemon
from test_daemon import raw_socket, recv, wait_idle
from tiny_gguf import MIXED, make_tiny_gguf

from hmaclient import Client, RequestError
from hmaclient import protocol as P

PROMPT = "the cat and the dog"  # raw: 20 greedy tokens on tiny(seed 5) without an end of turn


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf", seed=5, types=MIXED)


@pytest.fixture(scope="module")
def no_bytes_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "nobytes.gguf"
    return make_tiny_gguf(path, seed=5, types=MIXED, byte_tokens=False)


def replies_until_terminal(s, ids: set, timeout: float = 30.0) -> dict:
    """Every reply to ``ids`` on raw socket ``s`` until each has its terminal one, then 0.3 s more."""
    got: dict = {i: [] for i in ids}
    while any(not k or k[-1]["type"] not in P.TERMINAL_TYPES for k in got.values()):
        r = recv(s, timeout)
        got.setdefault(r["id"], []).append(r)
    while s.poll(300):
        r = P.unpack(s.recv(), max_size=P.MAX_REPLY_BYTES)
        got.setdefault(r["id"], []).append(r)
    return got


def one_terminal(replies: list) -> dict:
    kinds = [r["type"] for r in replies]
    assert [k for k in kinds if k in P.TERMINAL_TYPES] == [kinds[-1]], kinds
    return replies[-1]


def test_unencodable_text_is_a_bad_request_and_the_daemon_serves_on(no_bytes_path, tmp_path):
    d = Daemon(no_bytes_path, tmp_path).wait_ready()
    try:
        with Client(d.socket, timeout=30) as c:
            for text, char in (("Hello", "U+0048"), ("caf\u00e9", "U+00E9"), ("a \U0001f600", "U+1F600")):
                with pytest.raises(RequestError) as e:
                    c.generate(text, max_tokens=2, raw=True)
                assert e.value.code == P.BAD_REQUEST and char in e.value.message, e.value
                assert "byte-fallback" in e.value.message
            with pytest.raises(RequestError) as e:  # through the chat template too
                c.generate(messages=[{"role": "user", "content": "Why?"}], max_tokens=2)
            assert e.value.code == P.BAD_REQUEST and "U+0057" in e.value.message
            r = c.generate(PROMPT, max_tokens=3, temperature=0, raw=True)
            assert r.generated_tokens >= 1
            c.generate(messages=[{"role": "user", "content": "the cat"}], max_tokens=2, temperature=0)
            wait_idle(c)
    finally:
        assert d.stop() == 0, d.log_text()
    assert "Traceback" not in d.log_text()  # an expected refusal, not an internal error


def test_recoverable_forward_fault_fails_only_that_step(tiny_path, tmp_path):
    """forward:25: the reference answer uses forward passes 1-20; A and B run (max_seqs=2) when pass 25
    raises, so both get ``error``; C and D, waiting, are served after them; later requests are unchanged."""
    d = Daemon(
        tiny_path,
        tmp_path,
        "engine.max_seqs=2",
        "service.drain_grace_s=5",
        env={"HMAD_TEST_FAULT": "forward:25"},
    ).wait_ready()
    try:
        with Client(d.socket, timeout=60) as c:
            ref = c.generate(PROMPT, max_tokens=20, temperature=0, raw=True)
            assert (ref.finish_reason, len(ref.token_ids)) == ("length", 20)
            st = c.status()
            assert st["test_fault"] == "forward:25"
            with zmq.Context() as ctx:
                s = raw_socket(ctx, d.socket)
                for rid in "ABCD":
                    s.send(P.pack(P.generate_request(rid, PROMPT, raw=True, max_tokens=20, temperature=0)))
                got = replies_until_terminal(s, set("ABCD"))
            ends = {rid: one_terminal(got[rid]) for rid in "ABCD"}
            for rid in "AB":
                assert ends[rid]["type"] == "error" and ends[rid]["code"] == P.INTERNAL, ends[rid]
                assert "InjectedFault" in ends[rid]["message"] and "step 25" in ends[rid]["message"]
            for rid in "CD":
                assert ends[rid]["type"] == "done" and ends[rid]["generated_tokens"] == 20, ends[rid]
            assert c.generate(PROMPT, max_tokens=20, temperature=0, raw=True).token_ids == ref.token_ids
            assert wait_idle(c)["kv"]["sequences"] == 0  # the failed step's blocks were freed
    finally:
        code = d.stop()
    log = d.log_text()
    assert code == 0, log
    assert log.count("Traceback") == 1 and "step 25 failed; failing its 2 request(s)" in log, log


def test_unusable_backend_answers_everyone_and_exits_nonzero(tiny_path, tmp_path):
    """forward:3:unusable: the running and the waiting requests each get one ``error``; later ones are
    refused; the process exits 1 (its supervisor restarts it)."""
    d = Daemon(
        tiny_path, tmp_path, "engine.max_seqs=2", env={"HMAD_TEST_FAULT": "forward:3:unusable"}
    ).wait_ready()
    ids = set(range(6))
    with zmq.Context() as ctx:
        s = raw_socket(ctx, d.socket)
        for i in ids:
            s.send(P.pack(P.generate_request(i, PROMPT, raw=True, max_tokens=50, temperature=0)))
        got = replies_until_terminal(s, ids)
        s.send(P.pack(P.generate_request(99, PROMPT, raw=True, max_tokens=5)))
        late = recv(s) if s.poll(5000) else None
        code = d.proc.wait(30)
    for i in ids:
        end = one_terminal(got[i])
        assert end["type"] == "error" and end["code"] == P.INTERNAL, end
        assert "InjectedDeviceLoss" in end["message"] or "engine failure" in end["message"], end
    assert late is None or (late["type"] == "error" and late["code"] in (P.SHUTTING_DOWN, P.INTERNAL)), late
    log = d.log_text()
    assert code == 1, log
    assert "stopped after an engine failure" in log
    d.stop()


def test_malformed_fault_spec_refuses_to_start(tiny_path, tmp_path):
    env = {"HMAD_TEST_FAULT": "forward:soon", "HMAD_CONFIG": str(tmp_path / "none.yaml")}
    (tmp_path / "none.yaml").write_text("{}\n")
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "hmad", "--model", str(tiny_path), "--socket", str(tmp_path / "s" / "h.sock")],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **env},
    )
    assert proc.returncode != 0 and "HMAD_TEST_FAULT" in proc.stderr, proc.stderr
    assert time.monotonic() - t0 < 30
