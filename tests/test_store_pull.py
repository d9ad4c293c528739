"""``hmad pull`` against a stand-in for the Hugging Face hub (tests/fake_hub.py; never the internet): a good
pull with its projector; a dropped connection resumed within the pull; a stopped pull, and a connection
lost for good, resumed by the next pull; a wrong checksum, a missing file, a repository without GGUF, an
unknown quant, too little disk space, a disk that fills; then the models listed, the loaded one refused by
rm, and hmad pull / models / rm as real processes."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_hub import FakeHub, FakeRepo
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from synthetic_mmproj import write_mmproj
from tiny_gguf import MIXED, make_tiny_gguf

from hmad.store import catalog, hub
from hmad.store.errors import StoreError
from hmad.store.paths import part_path
from hmad.store.resolve import resolve_model_ref

REPO = "tiny-org/tiny-gemma3-GGUF"
MODEL, MMPROJ = "tiny-gemma3-Q8_0.gguf", "mmproj-tiny-gemma3-f16.gguf"
TEMPLATE = "{% for m in messages %}<start_of_turn>{{ m['content'] }}<end_of_turn>{% endfor %}"
TOWER = dict(image_size=32, patch_size=8, hidden=32, n_layers=1, n_heads=2, ffn=64)


@pytest.fixture(scope="module")
def blobs(tmp_path_factory) -> dict[str, bytes]:
    """A real tiny Gemma 3 GGUF (Q8_0, a chat template) and a tiny projector GGUF, as bytes."""
    d = tmp_path_factory.mktemp("blobs")
    meta = {"general.file_type": (7, V.UINT32), "tokenizer.chat_template": (TEMPLATE, V.STRING)}
    model = make_tiny_gguf(d / MODEL, seed=3, types={k: Q.Q8_0 for k in MIXED}, metadata=meta)
    mmproj = write_mmproj(d / MMPROJ, 256, tower=TOWER)
    return {MODEL: model.read_bytes(), MMPROJ: mmproj.read_bytes()}


@pytest.fixture
def fake_hub(monkeypatch, blobs):
    with FakeHub() as h:
        h.repos[REPO] = FakeRepo({**blobs, "README.md": b"# tiny\n"})
        monkeypatch.setenv("HF_ENDPOINT", h.url)
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        yield h


@pytest.fixture
def store(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "models"
    monkeypatch.setenv("HMAD_MODELS_DIR", str(root))
    return root


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def leftovers(root: Path) -> list[str]:
    """Every file and folder under ``root`` but the lock files of finished pulls, relative."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name != ".lock")


def test_pull_with_projector(fake_hub, store, blobs):
    seen = []
    res = hub.pull(f"{REPO}:q8_0", progress=lambda msg, done, total: seen.append((msg, done, total)))
    assert res.name == f"{REPO}:Q8_0" and not res.already_present
    assert res.model_path.read_bytes() == blobs[MODEL] and res.mmproj_path.read_bytes() == blobs[MMPROJ]
    m = json.loads((res.folder / "manifest.json").read_text())
    assert {f["name"]: f["sha256"] for f in m["files"]} == {
        MODEL: sha(blobs[MODEL]),
        MMPROJ: sha(blobs[MMPROJ]),
    }
    assert (m["repo"], m["quant"], m["requested"]) == (REPO, "Q8_0", "q8_0")
    assert (f"pulling {MODEL}", len(blobs[MODEL]), len(blobs[MODEL])) in seen
    assert any(msg == f"verifying {MMPROJ}" for msg, _, _ in seen)
    assert not any(p.endswith(".part") for p in leftovers(store))
    n = len(fake_hub.log)
    again = hub.pull(f"hf:{REPO}:Q8_0")  # present: answered from the store, nothing asked of the hub
    assert again.already_present and len(fake_hub.log) == n
    assert hub.pull(REPO).already_present  # the repository's only quant on disk


def test_dropped_connection_resumed_within_the_pull(fake_hub, store, blobs, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.DOWNLOAD_CHUNK_SIZE", 4096)
    fake_hub.repos[REPO].cut_after[MODEL] = 100_000  # the first GET: 100 kB, then the socket closes
    res = hub.pull(f"{REPO}:Q8_0")
    assert sha(res.model_path.read_bytes()) == sha(blobs[MODEL])
    ranges = fake_hub.ranges(MODEL)
    assert ranges[0] is None and len(ranges) == 2, ranges
    assert 0 < int(ranges[1].removeprefix("bytes=").rstrip("-")) <= 100_000  # from where it stopped


def test_stopped_pull_resumed_by_the_next(fake_hub, store, blobs, monkeypatch):
    monkeypatch.setattr("huggingface_hub.constants.DOWNLOAD_CHUNK_SIZE", 4096)

    def ctrl_c(msg, done, total):  # as Ctrl-C arrives in the middle of the model's transfer
        if msg == f"pulling {MODEL}" and done and done > 50_000:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        hub.pull(f"{REPO}:Q8_0", progress=ctrl_c)
    folder = store / REPO / "Q8_0"
    part = part_path(folder / MODEL, sha(blobs[MODEL]))
    kept = part.stat().st_size
    assert 0 < kept < len(blobs[MODEL]) and not (folder / MODEL).exists()
    assert catalog.list_models(store, include_default=False) == []  # unfinished: not a model
    res = hub.pull(f"{REPO}:Q8_0")
    assert fake_hub.ranges(MODEL)[-1] == f"bytes={kept}-"
    assert res.model_path.read_bytes() == blobs[MODEL] and not part.exists()


def test_connection_lost_for_good_then_resumed(fake_hub, store, blobs, monkeypatch):
    """The connection drops at 100 kB and every retry fails: the pull says how far it got and keeps the
    partial file; once the hub answers again, the next pull resumes from there."""
    import huggingface_hub.file_download as fd

    monkeypatch.setattr("huggingface_hub.constants.DOWNLOAD_CHUNK_SIZE", 4096)
    monkeypatch.setattr(fd.time, "sleep", lambda s: None)  # huggingface_hub's 1 s between its retries
    repo = fake_hub.repos[REPO]
    repo.cut_after[MODEL], repo.dead = 100_000, {MODEL}
    with pytest.raises(StoreError, match=f"the download of {MODEL} from .* failed after .* pull again"):
        hub.pull(f"{REPO}:Q8_0")
    part = part_path(store / REPO / "Q8_0" / MODEL, sha(blobs[MODEL]))
    kept = part.stat().st_size
    assert 0 < kept <= 100_000 and len(fake_hub.ranges(MODEL)) == 6  # the first GET, 5 retries
    repo.dead.clear()
    assert hub.pull(f"{REPO}:Q8_0").model_path.read_bytes() == blobs[MODEL]
    assert fake_hub.ranges(MODEL)[-1] == f"bytes={kept}-"


def test_wrong_checksum_refused_and_not_kept(fake_hub, store):
    fake_hub.repos[REPO].lie_sha.add(MODEL)  # huggingface_hub checks sizes only: the sha256 check is ours
    with pytest.raises(StoreError, match=f"{MODEL}: its sha256 is .*the file was removed"):
        hub.pull(f"{REPO}:Q8_0")
    assert leftovers(store) == []  # no model file, partial or manifest


def test_missing_file(fake_hub, store):
    fake_hub.repos[REPO].missing.add(MMPROJ)
    with pytest.raises(StoreError, match=f"lists {MMPROJ} but .* does not serve it"):
        hub.pull(f"{REPO}:Q8_0")
    assert not (store / REPO / "Q8_0" / "manifest.json").exists()
    assert catalog.list_models(store, include_default=False) == []


def test_unknown_repo_no_gguf_unknown_quant(fake_hub, store, blobs):
    fake_hub.repos["o/safetensors-only"] = FakeRepo({"model.safetensors": b"x" * 10, "config.json": b"{}"})
    fake_hub.repos["o/two"] = FakeRepo({"m-Q8_0.gguf": blobs[MODEL], "m-Q4_K_M.gguf": blobs[MODEL]})
    with pytest.raises(StoreError, match="no repository o/nothing-here"):
        hub.pull("o/nothing-here")
    with pytest.raises(StoreError, match="o/safetensors-only has no GGUF file"):
        hub.pull("o/safetensors-only")
    with pytest.raises(StoreError, match="o/two has no Q5_K_M GGUF; it has: Q4_K_M, Q8_0"):
        hub.pull("o/two:Q5_K_M")
    assert leftovers(store) == []


def test_not_enough_disk_space(fake_hub, store, monkeypatch):
    monkeypatch.setattr(hub, "free_bytes", lambda path: 1_000_000)  # the one stand-in: the free-space query
    with pytest.raises(StoreError, match="not enough disk space .* needs 4.0 MB, 1.0 MB is free"):
        hub.pull(f"{REPO}:Q8_0")
    assert fake_hub.ranges(MODEL) == [] and leftovers(store) == []


def test_disk_full_while_writing(fake_hub, store, blobs):
    """The partial file is /dev/full, whose writes fail with ENOSPC as a full disk's do; a model already
    in the store stays whole."""
    fake_hub.repos["o/other"] = FakeRepo({"other-Q8_0.gguf": blobs[MODEL]})
    kept = hub.pull(f"{REPO}:Q8_0")
    folder = store / "o" / "other" / "Q8_0"
    folder.mkdir(parents=True)
    part = part_path(folder / "other-Q8_0.gguf", sha(blobs[MODEL]))
    part.symlink_to("/dev/full")
    with open("/dev/full", "wb", buffering=0) as full, pytest.raises(OSError) as e:
        full.write(b"x")
    assert e.value.errno == errno.ENOSPC  # what a write to a full disk gets
    with pytest.raises(StoreError, match="the disk filled while writing other-Q8_0.gguf"):
        hub.pull("o/other:Q8_0")
    assert not os.path.lexists(part) and not (folder / "other-Q8_0.gguf").exists()
    assert [e.name for e in catalog.list_models(store, include_default=False)] == [kept.name]
    assert kept.model_path.read_bytes() == blobs[MODEL]


def test_models_listing_and_rm(fake_hub, store, blobs):
    res = hub.pull(f"{REPO}:Q8_0")
    (entry,) = catalog.list_models(store, loaded=f"hf:{REPO}:Q8_0", include_default=False)
    assert (entry.name, entry.architecture, entry.quantization) == (f"{REPO}:Q8_0", "gemma3", "Q8_0")
    assert (entry.context_length, entry.chat_template, entry.vision, entry.loaded) == (4096, True, True, True)
    assert entry.size_bytes == len(blobs[MODEL]) + len(blobs[MMPROJ]) and entry.mmproj == str(res.mmproj_path)
    for loaded in (f"hf:{REPO}:Q8_0", f"{REPO}", str(res.model_path)):
        with pytest.raises(StoreError, match="is the loaded model"):
            catalog.remove_model(f"{REPO}:Q8_0", loaded=loaded, root=store)
    with pytest.raises(StoreError, match="cannot be removed"):
        catalog.remove_model("default", root=store)
    with pytest.raises(StoreError, match="no model 'o/absent:Q8_0'"):
        catalog.remove_model("o/absent:Q8_0", root=store)
    gone = catalog.remove_model(f"hf:{REPO}:q8_0", loaded="default", root=store)
    assert gone.freed_bytes >= entry.size_bytes and not (store / "tiny-org").exists()


def test_resolve_pulls_once_then_works_offline(fake_hub, store, blobs, monkeypatch):
    model, mmproj = resolve_model_ref(f"hf:{REPO}:Q8_0")
    assert model.read_bytes() == blobs[MODEL] and mmproj.name == MMPROJ
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: the store answers alone
    assert resolve_model_ref(f"hf:{REPO}:Q8_0") == (model, mmproj)
    assert resolve_model_ref(f"{REPO}:Q8_0") == (model, mmproj)
    with pytest.raises(StoreError, match="cannot reach http://127.0.0.1:9"):
        resolve_model_ref("hf:o/not-pulled")
    with pytest.raises(Exception, match="neither a file nor a model in"):
        resolve_model_ref("o/not-pulled")


def test_cli_pull_and_models(fake_hub, store, blobs):
    env = {**os.environ, "HF_ENDPOINT": fake_hub.url, "HMAD_MODELS_DIR": str(store)}

    def hmad(*args):
        return subprocess.run([sys.executable, "-m", "hmad", *args], env=env, capture_output=True, text=True)

    p = hmad("pull", f"{REPO}:Q8_0")
    assert p.returncode == 0, p.stderr
    assert f"{REPO}:Q8_0: pulled, 4.0 MB in {store / REPO / 'Q8_0'}" in p.stdout
    bad = hmad("pull", f"{REPO}:Q2_K")
    assert bad.returncode == 1 and f"hmad: error: {REPO} has no Q2_K GGUF; it has: Q8_0" in bad.stderr
    listed = hmad("models", "--json")
    assert listed.returncode == 0, listed.stderr
    mine = [e for e in json.loads(listed.stdout) if e["name"] != "default"]
    assert [(e["name"], e["quantization"], e["vision"]) for e in mine] == [(f"{REPO}:Q8_0", "Q8_0", True)]
    table = hmad("models").stdout.splitlines()
    assert table[0].split() == ["NAME", "ARCH", "QUANT", "SIZE", "CONTEXT", "TEMPLATE", "VISION"]
    assert f"{REPO}:Q8_0  gemma3  Q8_0" in "\n".join(table)
    gone = hmad("rm", f"{REPO}:Q8_0")
    assert gone.returncode == 0 and gone.stdout == f"removed {REPO}:Q8_0 (4.0 MB)\n", gone.stderr
