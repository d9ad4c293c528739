"""Switching and unloading the model without a restart (hmad/switching.py), through a real hmad on a real
socket with two tiny GGUFs of different weights (tests/tiny_gguf.py): a load switches and the answers
become the new model's (greedy tokens and their logprob equal an offline run of that model on the numpy
backend, within TOL); models.keep_alive_s unloads after an idle second and the next request loads it
back; a switch while a request streams, under each policy (finish, cancel), gives that stream its one
terminal reply and serves the request that waited meanwhile with the new model; a generate naming
another model switches to it, or is refused when models.allow_switch is false; a file that is not a model
leaves the old model serving; each unloaded model object is released (a weakref, in the daemon, after its
backend closed: status ``switch.previous_released``)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from daemon_harness import Daemon
from tiny_gguf import make_tiny_gguf

from hmaclient import Client, RequestError
from hmaclient import protocol as P
from hmad.composition import load_model
from hmad.engine.generate import forward_full, generate
from hmad.engine.sampling import SamplingParams

PROMPT = "the cat and the dog"
ASK = dict(prompt=PROMPT, raw=True, max_tokens=4, temperature=0.0, logprobs=2)
# relative, on a logprob: float32 rows of the same numpy backend, a decode step vs one pass; the tiny
# models' logits reach ~100 (their greedy token's logprob rounds to 0: the runner-up tells them apart)
TOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[Path, list[int], float]]:
    """Two tiny models (seed 1, seed 2): path, greedy tokens and the first token's runner-up's logprob,
    computed offline on the cpu backend."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    for name, seed in (("a", 1), ("b", 2)):
        path = make_tiny_gguf(root / f"{name}.gguf", seed=seed)
        model = load_model(path, "cpu")
        ids = generate(model, [PROMPT], SamplingParams(max_tokens=4, temperature=0.0))[0].token_ids
        row = forward_full(model, model.tokenizer.encode(PROMPT))[-1].astype(np.float64)
        logprob = np.sort(row - row.max() - np.log(np.exp(row - row.max()).sum()))[-2]
        out[name] = (path, ids, float(logprob))
    assert abs(out["a"][2] - out["b"][2]) > 100 * TOL, "the two models must answer apart"
    (root / "junk.gguf").write_bytes(b"GGUF" + b"\x00" * 60)  # a file that is not a model
    return out


def start(tmp: Path, model: Path, *sets: str) -> Daemon:
    return Daemon(model, tmp, *sets).wait_ready(60)


def answer(c: Client, **kw) -> tuple[list[int], float]:
    r = c.generate(**{**ASK, **kw})
    return r.token_ids, r.logprobs[0].top[1][1]


def assert_model(got: tuple[list[int], float], ref: tuple[Path, list[int], float]) -> None:
    ids, logprob = got
    assert ids == ref[1] and abs(logprob - ref[2]) <= TOL * max(1.0, abs(ref[2])), (got, ref[1:])


def wait_switch(c: Client, switch_id: int, timeout: float = 60.0) -> tuple[dict, set[str]]:
    """Poll status until switch ``switch_id`` ended: the switch map, and every state status showed."""
    seen, deadline = set(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        st = c.status()
        seen.add(st["state"])
        sw = st["switch"]
        if sw["id"] >= switch_id and sw["state"] in ("ready", "idle", "failed"):
            return sw, seen
        time.sleep(0.02)
    raise TimeoutError(f"switch {switch_id} did not end: {st}")


def load(c: Client, model: str | Path) -> tuple[dict, set[str]]:
    got = c.model_request("load", str(model))
    return wait_switch(c, got["switch_id"])


def test_load_switches_the_answers_and_frees_the_old_model(tmp_path, models):
    d = start(tmp_path, models["a"][0])
    try:
        with Client(d.socket, timeout=60) as c:
            assert_model(answer(c), models["a"])
            sw, seen = load(c, models["b"][0])
            assert sw["state"] == "ready" and sw["model"] == str(models["b"][0]) and "error" not in sw
            assert sw["previous_released"] is True  # the old Model object is gone (weakref in hmad)
            st = c.status()
            assert st["model"] == str(models["b"][0]) and st["state"] == "ready"
            assert_model(answer(c), models["b"])
            again = c.model_request("load", str(models["b"][0]))
            assert again["unchanged"] is True
            sw, _ = load(c, models["a"][0])
            assert_model(answer(c), models["a"])
    finally:
        assert d.stop() == 0, d.log_text()
    assert "switching to" in d.log_text() and "still referenced" not in d.log_text()


def test_keep_alive_unloads_when_idle_and_the_next_request_reloads(tmp_path, models):
    d = start(tmp_path, models["a"][0], "models.keep_alive_s=1")
    try:
        with Client(d.socket, timeout=60) as c:
            assert_model(answer(c), models["a"])
            deadline = time.monotonic() + 15
            while c.status()["state"] != "idle":
                assert time.monotonic() < deadline, c.status()
                time.sleep(0.1)
            st = c.status()
            assert st["switch"]["previous_released"] is True and "memory" not in st
            assert st["backend"] == "cpu" and st["chat_template"] is False  # what hmactl fits defaults to
            assert c.ready()  # idle still takes requests: ping says ready
            assert_model(answer(c), models["a"])  # loaded back for this one
            assert c.status()["state"] == "ready"
            assert d.log_text().count("unloaded") >= 1
    finally:
        assert d.stop() == 0, d.log_text()


def _stream_then_switch(d: Daemon, to: Path) -> tuple[object, list, tuple]:
    """A long stream; once it yields, a load of ``to`` and, while it drains, a generate from another
    connection: (the stream's end: result or exception, its pieces, that generate's answer)."""
    pieces, waited, end = [], {}, {}
    with Client(d.socket, timeout=120) as c, Client(d.socket, timeout=120) as other:
        stream = c.stream(PROMPT, raw=True, max_tokens=500, temperature=0.0)
        pieces.append(next(stream))
        c2 = Client(d.socket, timeout=60)
        got = c2.model_request("load", str(to))
        assert got["state"] == "draining", got
        t = threading.Thread(target=lambda: waited.update(r=answer(other)))
        t.start()
        while "r" not in end:
            try:
                pieces.append(next(stream))
            except StopIteration as stop:
                end["r"] = stop.value  # the Result: its finish_reason says how it ended
        t.join(60)
        wait_switch(c2, got["switch_id"])
        c2.close()
    return end["r"], pieces, waited["r"]


def test_switch_while_streaming_finish_lets_it_end(tmp_path, models):
    d = start(tmp_path, models["a"][0], "models.switch=finish", "models.switch_grace_s=60")
    try:
        end, pieces, waited = _stream_then_switch(d, models["b"][0])
        assert end.finish_reason == "length" and end.generated_tokens == 500  # whole, on the old model
        assert sum(len(p.token_ids) for p in pieces) == 500
        assert_model(waited, models["b"])  # the request that came meanwhile: the new model's answer
    finally:
        assert d.stop() == 0, d.log_text()


def test_switch_while_streaming_cancel_cancels_it(tmp_path, models):
    d = start(tmp_path, models["a"][0], "models.switch=cancel")
    try:
        end, pieces, waited = _stream_then_switch(d, models["b"][0])
        assert sum(len(p.token_ids) for p in pieces) < 500
        assert end.finish_reason == "cancelled", end
        assert_model(waited, models["b"])
    finally:
        assert d.stop() == 0, d.log_text()


def test_a_request_naming_another_model_switches_or_is_refused(tmp_path, models):
    (tmp_path / "on").mkdir()
    d = start(tmp_path / "on", models["a"][0])
    try:
        with Client(d.socket, timeout=60) as c:
            assert_model(answer(c, model=str(models["b"][0])), models["b"])  # switched for it
            assert c.status()["model"] == str(models["b"][0])
            assert_model(answer(c, model=str(models["b"][0])), models["b"])  # no switch: already loaded
            with pytest.raises(RequestError) as e:
                answer(c, model=str(tmp_path / "nowhere.gguf"))
            assert e.value.code == P.MODEL_NOT_FOUND
            assert_model(answer(c), models["b"])  # an older client's request (no model): the loaded one
    finally:
        assert d.stop() == 0, d.log_text()
    (tmp_path / "off").mkdir()
    d = start(tmp_path / "off", models["a"][0], "models.allow_switch=false")
    try:
        with Client(d.socket, timeout=60) as c:
            with pytest.raises(RequestError) as e:
                answer(c, model=str(models["b"][0]))
            assert e.value.code == P.SWITCH_REFUSED and str(models["a"][0]) in e.value.message
            assert_model(answer(c, model=str(models["a"][0])), models["a"])
    finally:
        assert d.stop() == 0, d.log_text()


def test_loading_a_file_that_is_not_a_model_keeps_the_old_one(tmp_path, models):
    junk = models["a"][0].parent / "junk.gguf"
    d = start(tmp_path, models["a"][0])
    try:
        with Client(d.socket, timeout=60) as c:
            sw, _ = load(c, junk)
            assert sw["state"] == "ready" and sw["model"] == str(models["a"][0])
            assert "junk.gguf" in sw["error"], sw
            assert_model(answer(c), models["a"])
            with pytest.raises(RequestError) as e:  # named by a request: refused with the load's error
                answer(c, model=str(junk))
            assert e.value.code == P.MODEL_NOT_FOUND and "could not be loaded" in e.value.message
            with pytest.raises(RequestError) as e:
                c.model_request("load", str(tmp_path / "missing.gguf"))
            assert e.value.code == P.MODEL_NOT_FOUND
            assert_model(answer(c), models["a"])
    finally:
        assert d.stop() == 0, d.log_text()


def test_unload_then_a_request_reloads(tmp_path, models):
    d = start(tmp_path, models["b"][0])
    try:
        with Client(d.socket, timeout=60) as c:
            got = c.model_request("unload")
            sw, _ = wait_switch(c, got["switch_id"])
            assert sw["state"] == "idle" and sw["previous_released"] is True
            assert c.model_request("unload")["unchanged"] is True
            assert c.model_request("models")["loaded"] is None
            assert_model(answer(c), models["b"])
    finally:
        assert d.stop() == 0, d.log_text()


def test_sigterm_during_a_switch_answers_every_request(tmp_path, models):
    """SIGTERM while a switch drains: the running stream ends (the service's drain), the request waiting
    for the new model gets shutting_down, and hmad exits 0."""
    d = start(tmp_path, models["a"][0], "models.switch_grace_s=60", "service.drain_grace_s=0.2")
    refused = {}

    def wait_for_model(other: Client) -> None:
        try:
            answer(other)
        except RequestError as e:
            refused["code"] = e.code

    with Client(d.socket, timeout=60) as c, Client(d.socket, timeout=60) as other:
        stream = c.stream(PROMPT, raw=True, max_tokens=500, temperature=0.0)
        next(stream)
        assert c.model_request("load", str(models["b"][0]))["state"] == "draining"
        t = threading.Thread(target=wait_for_model, args=(other,))
        t.start()
        deadline = time.monotonic() + 10
        while c.status()["switch"]["waiting"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        code = d.stop()
        ends = []
        while not ends:
            try:
                next(stream)
            except StopIteration as stop:
                ends.append(stop.value)
        t.join(30)
    assert code == 0, d.log_text()
    assert ends[0].finish_reason in ("length", "cancelled") and refused["code"] == P.SHUTTING_DOWN


def test_when_the_previous_model_cannot_come_back_hmad_stays_up_without_one(tmp_path, models):
    """The new model fails and the previous one's file is gone: state failed with both errors, generates
    get no_model, ping says no_model (hmactl ping --wait stops at once), and a load that works serves."""
    x = tmp_path / "x.gguf"
    x.write_bytes(models["a"][0].read_bytes())
    (tmp_path / "d").mkdir()
    d = start(tmp_path / "d", x)
    try:
        x.unlink()
        with Client(d.socket, timeout=60) as c:
            sw, _ = load(c, models["a"][0].parent / "junk.gguf")
            assert sw["state"] == "failed" and "junk.gguf" in sw["error"] and "x.gguf" in sw["error"], sw
            assert c.status()["state"] == "failed" and not c.ready()
            with pytest.raises(RequestError) as e:
                answer(c)
            assert e.value.code == P.NO_MODEL
            cmd = [sys.executable, "-m", "hmaclient.cli", "--socket", d.socket, "ping", "--wait", "30"]
            t0 = time.monotonic()
            ping = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            assert ping.returncode == 1 and "no_model" in ping.stderr and time.monotonic() - t0 < 15
            sw, _ = load(c, models["b"][0])
            assert sw["state"] == "ready" and "error" not in sw
            assert_model(answer(c), models["b"])
    finally:
        assert d.stop() == 0, d.log_text()
