"""A real daemon started with ``--model hf:REPO:QUANT``: it pulls the model from a stand-in for the hub
(tests/fake_hub.py) on first use, loads it from the store and answers; started again with the hub gone, it
loads the same files from the store."""

from __future__ import annotations

from pathlib import Path

import pytest
from daemon_harness import Daemon
from fake_hub import FakeHub, FakeRepo
from gguf import GGMLQuantizationType as Q
from tiny_gguf import MIXED, make_tiny_gguf

from hmaclient import Client

REPO = "tiny-org/tiny-gemma3-GGUF"


@pytest.fixture(scope="module")
def model_bytes(tmp_path_factory) -> bytes:
    path = make_tiny_gguf(
        tmp_path_factory.mktemp("blob") / "m.gguf", seed=5, types={k: Q.Q8_0 for k in MIXED}
    )
    return path.read_bytes()


def folder(p: Path) -> Path:
    p.mkdir()
    return p


def answer(d: Daemon) -> tuple[list[int], str]:
    with Client(d.socket, timeout=60) as c:
        r = c.generate("hello world", max_tokens=4, temperature=0)
        return r.token_ids, c.status()["model"]


def test_daemon_pulls_on_first_use_then_runs_offline(tmp_path: Path, model_bytes):
    store = tmp_path / "models"
    with FakeHub() as hub:
        hub.repos[REPO] = FakeRepo({"tiny-gemma3-Q8_0.gguf": model_bytes, "tiny-gemma3-F16.gguf": b"x" * 64})
        env = {"HF_ENDPOINT": hub.url, "HMAD_MODELS_DIR": str(store)}
        d = Daemon(f"hf:{REPO}:Q8_0", folder(tmp_path / "first"), env=env).wait_ready(60)
        try:
            ids, model = answer(d)
        finally:
            assert d.stop() == 0, d.log_text()
    path = store / REPO / "Q8_0" / "tiny-gemma3-Q8_0.gguf"
    assert path.read_bytes() == model_bytes and len(ids) >= 1
    assert model == str(path), model  # status names the file loaded from the store
    offline = {"HF_ENDPOINT": "http://127.0.0.1:9", "HMAD_MODELS_DIR": str(store)}  # nothing listens there
    d = Daemon(f"{REPO}:Q8_0", folder(tmp_path / "again"), env=offline).wait_ready(60)
    try:
        assert answer(d)[0] == ids  # the same file, greedy: the same tokens
    finally:
        assert d.stop() == 0, d.log_text()
