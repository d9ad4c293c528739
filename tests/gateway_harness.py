"""A real ``python -m hmad_openai`` (on 127.0.0.1, a free port, an API key) in front of a real hmad on a
tiny random GGUF (daemon_harness.py, tiny_gguf.py), for the tests of the gateway's APIs.

A test module takes the fixtures by importing them (``from gateway_harness import daemon, gateway, hmad``):
one daemon and one gateway per module; ``hmad`` checks after each test that both still run and that nothing
still runs in hmad. The tiny model repeats a raw prompt's last token ("x b" -> " b b b ..."), so answers
are known without being hard-coded: each test compares with what hmaclient gets for the same request.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import Daemon
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from tiny_gguf import MIXED, make_tiny_gguf

from hmaclient import Client

KEY = "sk-test-0123456789"
TINY_NAME = "tiny-gemma3-seed5"
CLEAN_EXIT = (0, -signal.SIGTERM)


class Gateway:
    """A running ``python -m hmad_openai`` with its log; ``url`` once it listens."""

    def __init__(self, socket: str, tmp: Path, *args: str, env: dict[str, str] | None = None):
        self.log_path = tmp / "gateway.log"
        self.log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        cmd = [sys.executable, "-m", "hmad_openai", "--socket", socket, "--port", "0", *args]
        env = {**{k: v for k, v in os.environ.items() if k != "HMAD_OPENAI_API_KEY"}, **(env or {})}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.url = self._wait_listening()

    def _wait_listening(self, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(r"serving (http://127\.0\.0\.1:\d+)/v1", self.log_path.read_text())
            if m:
                return m.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"the gateway did not start:\n{self.log_path.read_text()}")

    def stop(self) -> int:
        """SIGTERM; the exit status (0 or -SIGTERM are both clean: uvicorn dies of the signal it caught)."""
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            code = self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.log.close()
        return code


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    path = make_tiny_gguf(tmp_path_factory.mktemp("model") / "tiny.gguf", seed=5, types=MIXED)
    # a default of 8 tokens keeps the fuzz's well-formed requests short; tests name their max_tokens
    d = Daemon(path, tmp_path_factory.mktemp("hmad"), "engine.max_seqs=2", "sampling.max_tokens=8")
    yield d.wait_ready()
    assert d.stop() == 0, d.log_text()


@pytest.fixture(scope="module")
def gateway(daemon, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gateway")
    (tmp / "key").write_text(KEY + "\n")
    g = Gateway(daemon.socket, tmp, "--api-key-file", str(tmp / "key"))
    yield g
    assert g.stop() in CLEAN_EXIT, g.log_path.read_text()


@pytest.fixture
def hmad(daemon, gateway):
    """The module's daemon; after the test both processes still run and nothing still runs in hmad (every
    generation ended or was cancelled)."""
    yield daemon
    assert_serving(daemon, gateway)


def assert_serving(daemon: Daemon, gateway: Gateway) -> None:
    assert daemon.proc.poll() is None, daemon.log_text()
    assert gateway.proc.poll() is None, gateway.log_path.read_text()
    with Client(daemon.socket) as c:
        wait(lambda: load(c) == (0, 0, 0))


def load(c: Client) -> tuple[int, int, int]:
    st = c.status()
    return st["running"], st["queued"], st["in_flight"]


def wait(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.02)


# -- fuzz --------------------------------------------------------------------------------------------------

FUZZ = settings(
    max_examples=30,
    derandomize=True,
    deadline=None,
    database=None,
    phases=[Phase.generate],
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 3)
    | st.floats(-2, 200, allow_nan=False)
    | st.text(max_size=6)
    | st.sampled_from(["user", "system", "assistant", "tool", "json", "text", "input_text"]),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=6), kids, max_size=3),
    max_leaves=6,
)


def malformed(valid: dict[str, Any], fields: dict[str, Any]) -> st.SearchStrategy[bytes]:
    """Bodies around ``valid``: its fields (and an unknown one) replaced by random JSON values or by shapes
    the API knows (``fields``: name -> strategy), fields left out, JSON that is no object, no JSON at all."""
    names = sorted({*valid, *fields, "zz"})
    value = st.one_of(JSON_VALUES, *fields.values())
    changed = st.builds(
        lambda new, gone: {**{k: v for k, v in valid.items() if k not in gone}, **new},
        st.dictionaries(st.sampled_from(names), value, min_size=1, max_size=3),
        st.sets(st.sampled_from(sorted(valid)), max_size=2),
    )
    return st.one_of(
        changed.map(lambda b: json.dumps(b).encode()),
        JSON_VALUES.map(lambda v: json.dumps(v).encode()),
        st.binary(max_size=12),
    )
