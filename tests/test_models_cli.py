"""hmactl's model commands as real processes against a real hmad whose store pulls from a stand-in for the
hub (tests/fake_hub.py): pull (progress on stderr; a second pull of the same model joins the first; a
repository without a GGUF refused with the store's message), models (table and --json, the loaded one
marked), load by name and by a relative path, rm (the loaded model refused with model_in_use, then
removed, then not found), unload, and ``ping --wait`` drawing a load's progress (a load that pulls
``hf:REPO:QUANT`` first)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from daemon_harness import Daemon
from fake_hub import FakeHub, FakeRepo
from gguf import GGMLQuantizationType as Q
from tiny_gguf import MIXED, make_tiny_gguf

from hmaclient import Client

REPO, OTHER, EMPTY = "tiny-org/tiny-gemma3-GGUF", "tiny-org/other-GGUF", "tiny-org/no-gguf"
FILE = "tiny-gemma3-Q8_0.gguf"


class SlowFiles(dict):
    """A repository's files, each read by the hub after a pause: a pull that lasts long enough to join."""

    def __getitem__(self, key):
        time.sleep(0.5)
        return super().__getitem__(key)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path | bytes]:
    root = tmp_path_factory.mktemp("models")
    local = make_tiny_gguf(root / "local.gguf", seed=1)
    pulled = make_tiny_gguf(root / "pulled.gguf", seed=5, types={k: Q.Q8_0 for k in MIXED})
    return {"local": local, "pulled": pulled.read_bytes()}


def hmactl(
    d: Daemon, *args: str, cwd: Path | None = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hmaclient.cli", "--socket", d.socket, "--timeout", "30", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=cwd)


def test_pull_models_load_rm_unload(tmp_path: Path, files):
    store = tmp_path / "models"
    with FakeHub() as hub:
        hub.repos[REPO] = FakeRepo(SlowFiles({FILE: files["pulled"]}))
        hub.repos[EMPTY] = FakeRepo({"README.md": b"no weights here\n"})
        env = {"HF_ENDPOINT": hub.url, "HMAD_MODELS_DIR": str(store)}
        (tmp_path / "d").mkdir()
        d = Daemon(files["local"], tmp_path / "d", env=env).wait_ready(60)
        try:
            _pulls(d)
            _models_load_rm(d, files["local"])
        finally:
            assert d.stop() == 0, d.log_text()


def _pulls(d: Daemon) -> None:
    cmd = [sys.executable, "-m", "hmaclient.cli", "--socket", d.socket, "pull", f"{REPO}:Q8_0"]
    first = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)
    second = hmactl(d, "pull", f"{REPO}:q8_0")  # the same model, spelled otherwise: joins
    out, err = first.communicate(timeout=60)
    assert first.returncode == 0, err
    assert f"{REPO}:Q8_0: pulled" in out and "load it: hmactl load" in out
    assert "pulling" in err or "verifying" in err  # the phases, drawn on stderr
    assert second.returncode == 0 and "joining the pull" in second.stderr, second.stderr
    again = hmactl(d, "pull", f"{REPO}:Q8_0")
    assert again.returncode == 0 and "already in the store" in again.stdout
    none = hmactl(d, "pull", EMPTY)
    assert none.returncode == 1 and "has no GGUF" in none.stderr, none.stderr
    bad = hmactl(d, "pull", "not a reference")
    assert bad.returncode == 1 and "bad_request" in bad.stderr


def _models_load_rm(d: Daemon, local: Path) -> None:
    name = f"{REPO}:Q8_0"
    table = hmactl(d, "models")
    assert table.returncode == 0 and name in table.stdout and "gemma3" in table.stdout, table.stdout
    listed = json.loads(hmactl(d, "models", "--json").stdout)
    assert [e["loaded"] for e in listed["models"] if e["name"] == name] == [False]
    loaded = hmactl(d, "load", name)
    assert loaded.returncode == 0 and f"serving {name}" in loaded.stdout, loaded.stderr
    listed = json.loads(hmactl(d, "models", "--json").stdout)
    assert listed["loaded"] == name and [e["loaded"] for e in listed["models"] if e["name"] == name] == [True]
    refused = hmactl(d, "rm", name)
    assert refused.returncode == 1 and "model_in_use" in refused.stderr, refused.stderr
    back = hmactl(d, "load", local.name, cwd=local.parent)  # a relative path: hmactl makes it absolute
    assert back.returncode == 0, back.stderr
    removed = hmactl(d, "rm", name)
    assert removed.returncode == 0 and f"removed {name}" in removed.stdout, removed.stderr
    gone = hmactl(d, "rm", name)
    assert gone.returncode == 1 and "model_not_found" in gone.stderr
    unloaded = hmactl(d, "unload")
    assert unloaded.returncode == 0 and "unloaded" in unloaded.stdout
    with Client(d.socket, timeout=30) as c:
        assert c.status()["state"] == "idle"


def test_ping_wait_draws_a_load_that_pulls(tmp_path: Path, files):
    store = tmp_path / "models"
    with FakeHub() as hub:
        hub.repos[OTHER] = FakeRepo(SlowFiles({FILE: files["pulled"]}))
        env = {"HF_ENDPOINT": hub.url, "HMAD_MODELS_DIR": str(store)}
        (tmp_path / "d").mkdir()
        d = Daemon(files["local"], tmp_path / "d", env=env).wait_ready(60)
        try:
            started = hmactl(d, "load", "--no-wait", f"hf:{OTHER}:Q8_0")
            assert started.returncode == 0 and "switching to" in started.stdout, started.stderr
            waited = hmactl(d, "ping", "--wait", "60")
            assert waited.returncode == 0 and "hmad is running" in waited.stdout, waited.stderr
            assert "pulling" in waited.stderr or "loading" in waited.stderr, waited.stderr
            with Client(d.socket, timeout=30) as c:
                st = c.status()
                assert st["switch"]["model"] == f"hf:{OTHER}:Q8_0" and st["state"] == "ready"
                assert st["model"] == str(store / OTHER / "Q8_0" / FILE)
        finally:
            assert d.stop() == 0, d.log_text()
