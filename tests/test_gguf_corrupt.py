"""hmad.model.gguf: a small valid file written with GGUFWriter loads exactly; byte-surgery on it gives a
ModelFormatError that names the file and the problem, at once, for every kind of corruption.

Offsets for the surgery come from gguf.GGUFReader run on the valid file (an independent parser).
"""

from __future__ import annotations

import math
import mmap
import os
import struct
import time
from pathlib import Path

import gguf
import gguf.quants as gq
import numpy as np
import pytest

from hmad.core.errors import ModelFormatError
from hmad.core.quants import random_blocks
from hmad.core.tensors import QType
from hmad.model.gguf import GGUFFile, optional, read_gguf, require, require_tensors

ARRAY_TYPE = int(gguf.GGUFValueType.ARRAY)

# name → (type, numpy shape); names of equal length so surgery can copy one over another
TENSORS = {
    "w.f32": (QType.F32, (8,)),
    "w.f16": (QType.F16, (3, 32)),
    "w.b16": (QType.BF16, (2, 16)),
    "w.q80": (QType.Q8_0, (3, 64)),
    "w.q50": (QType.Q5_0, (1, 2, 32)),
    "w.q4k": (QType.Q4_K, (2, 256)),
    "w.q6k": (QType.Q6_K, (1, 256)),
}


def write_valid(path: Path, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Write the test file; returns each tensor's stored data."""
    w = gguf.GGUFWriter(path, "gemma3")
    w.add_uint32("gemma3.block_count", 2)
    w.add_float32("gemma3.rope.freq_base", 10000.0)
    w.add_bool("test.flag", True)
    w.add_string("test.name", "tiny")
    w.add_array("test.words", ["a", "bb", "ccc", "ünï"])
    w.add_key_value("test.scores", [0.5, -1.0, 2.25], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.FLOAT32)
    w.add_array("test.ids", [1, 2, 3])
    w.add_uint64("test.key01", 1)
    w.add_uint64("test.key02", 2)
    stored = {}
    for name, (qtype, shape) in TENSORS.items():
        data = random_blocks(qtype, shape, rng)
        stored[name] = data
        raw = data.view(np.uint8) if qtype in (QType.BF16,) else data
        w.add_tensor(name, raw, raw_dtype=qtype if raw.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


class Layout:
    """Byte offsets of the valid file's fields, found by gguf.GGUFReader."""

    def __init__(self, path: Path):
        r = gguf.GGUFReader(path)
        self.size = path.stat().st_size
        self.data_offset = int(r.data_offset)
        self.kv = {}  # key → (offset of key length, offset of value type, offset of value)
        for key, f in r.fields.items():
            if not key.startswith("GGUF."):
                klen = len(key.encode())
                self.kv[key] = (f.offset, f.offset + 8 + klen, f.offset + 12 + klen)
        self.tensor = {}  # name → dict of field offsets
        for t in r.tensors:
            o, n = t.field.offset, len(t.name.encode())
            nd = len(t.shape)
            self.tensor[t.name] = {
                "name": o + 8,
                "n_dims": o + 8 + n,
                "ne": o + 12 + n,
                "type": o + 12 + n + 8 * nd,
                "offset": o + 16 + n + 8 * nd,
                "rel_offset": int(t.data_offset) - self.data_offset,
            }


@pytest.fixture(scope="module")
def valid(tmp_path_factory) -> tuple[Path, bytes, dict[str, np.ndarray], Layout, int]:
    seed = int(os.environ.get("HMAD_TEST_SEED", np.random.SeedSequence().entropy))
    path = tmp_path_factory.mktemp("gguf") / "valid.gguf"
    stored = write_valid(path, np.random.default_rng(seed))
    return path, path.read_bytes(), stored, Layout(path), seed


def corrupt(
    tmp_path: Path, blob: bytes, patches: dict[int, bytes] | None = None, cut: int | None = None
) -> Path:
    """A copy of ``blob`` with bytes overwritten at the given offsets and/or cut at ``cut``."""
    buf = bytearray(blob)
    for offset, data in (patches or {}).items():
        buf[offset : offset + len(data)] = data
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(buf[:cut]) if cut is not None else bytes(buf))
    return path


def expect_error(path: Path, phrase: str) -> ModelFormatError:
    start = time.monotonic()
    with pytest.raises(ModelFormatError) as info:
        read_gguf(path)
    assert time.monotonic() - start < 1.0, "a corrupt file must be refused at once"
    message = str(info.value)
    assert str(path) in message and phrase in message, message
    return info.value


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


# --- the valid file ----------------------------------------------------------------------------------


def test_valid_file_loads_and_matches(valid):
    path, _, stored, layout, seed = valid
    f = read_gguf(path)
    assert isinstance(f, GGUFFile) and f.path == str(path)
    assert f.version == 3 and f.alignment == 32 and f.data_offset == layout.data_offset
    m = f.metadata
    assert m["general.architecture"] == "gemma3" and m["gemma3.block_count"] == 2
    assert m["gemma3.rope.freq_base"] == 10000.0 and m["test.flag"] is True and m["test.name"] == "tiny"
    assert m["test.words"] == ["a", "bb", "ccc", "ünï"]
    assert m["test.scores"].dtype == np.float32 and m["test.scores"].tolist() == [0.5, -1.0, 2.25]
    assert m["test.ids"].dtype == np.int32 and m["test.ids"].tolist() == [1, 2, 3]
    assert list(f.tensors) == list(TENSORS)
    for name, (qtype, shape) in TENSORS.items():
        t = f.tensors[name]
        assert (t.qtype, t.shape, t.source) == (qtype, shape, str(path)), name
        np.testing.assert_array_equal(t.data, stored[name], err_msg=f"{name} seed={seed}")
        want = gq.dequantize(stored[name].view(np.uint8), qtype).reshape(shape)
        np.testing.assert_array_equal(t.dequantize(), want, err_msg=f"{name} seed={seed}")


def is_file_view(a: object) -> bool:
    """True when the ``base`` chain (ndarray → memoryview → ...) ends in an mmap: no copy was made."""
    while a is not None:
        if isinstance(a, mmap.mmap):
            return True
        a = a.obj if isinstance(a, memoryview) else getattr(a, "base", None)
    return False


def test_tensor_data_is_a_read_only_view_of_the_mapping(valid):
    f = read_gguf(valid[0])
    for t in f.tensors.values():
        assert is_file_view(t.data) and not t.data.flags.writeable, t.name
        assert not t.data.flags.owndata, t.name


def test_require_and_optional(valid):
    f = read_gguf(valid[0])
    assert require(f, "gemma3.block_count", int) == 2
    assert require(f, "gemma3.block_count", float) == 2.0
    assert require(f, "test.words", list) == ["a", "bb", "ccc", "ünï"]
    assert require(f, "test.scores", np.ndarray).shape == (3,)
    assert optional(f, "gemma3.nope", int, 7) == 7
    with pytest.raises(ModelFormatError, match="missing metadata key 'gemma3.nope'"):
        require(f, "gemma3.nope", int)
    with pytest.raises(ModelFormatError, match="'test.flag' is bool, expected int"):
        require(f, "test.flag", int)
    with pytest.raises(ModelFormatError, match="'test.name' is str, expected int"):
        optional(f, "test.name", int)


def test_require_tensors_lists_missing_names(valid):
    f = read_gguf(valid[0])
    require_tensors(f, ["w.f32", "w.q4k"])
    with pytest.raises(ModelFormatError) as info:
        require_tensors(f, ["w.f32", "blk.0.attn_q.weight", "output.weight"])
    message = str(info.value)
    assert str(valid[0]) in message and "missing tensors (2 of 3)" in message
    assert "blk.0.attn_q.weight" in message and "output.weight" in message and "w.f32" not in message


# --- corrupt files -----------------------------------------------------------------------------------


def test_missing_file_and_not_a_file(tmp_path):
    expect_error(tmp_path / "nope.gguf", "cannot open")
    expect_error(tmp_path, "not a regular file")


@pytest.mark.parametrize("cut", [0, 3, 23])
def test_too_short(valid, tmp_path, cut):
    expect_error(corrupt(tmp_path, valid[1], cut=cut), "too short")


def test_truncated_anywhere(valid, tmp_path):
    """Cut at every byte of the header and a few points in the data: always a named error."""
    _, blob, _, layout, _ = valid
    last_byte = layout.data_offset + layout.tensor["w.q6k"]["rel_offset"] + 210  # Q6_K: 210 bytes per row
    cuts = [*range(24, layout.data_offset + 1), layout.data_offset + 7, last_byte - 1]
    for cut in cuts:
        path = corrupt(tmp_path, blob, cut=cut)
        with pytest.raises(ModelFormatError) as info:
            read_gguf(path)
        phrases = ("truncated", "runs past the end of the file")
        assert any(p in str(info.value) for p in phrases), (cut, str(info.value))


def test_bad_magic(valid, tmp_path):
    expect_error(corrupt(tmp_path, valid[1], {0: b"GGML"}), "bad magic")


@pytest.mark.parametrize(
    "version,phrase",
    [(99, "unsupported GGUF version 99"), (1, "unsupported GGUF version 1"), (3 << 24, "big-endian")],
)
def test_bad_version(valid, tmp_path, version, phrase):
    expect_error(corrupt(tmp_path, valid[1], {4: u32(version)}), phrase)


def test_absurd_counts(valid, tmp_path):
    expect_error(corrupt(tmp_path, valid[1], {8: u64(1 << 40)}), "tensor count 1099511627776")
    expect_error(corrupt(tmp_path, valid[1], {16: u64(1 << 40)}), "kv count 1099511627776")
    # within the limit: tensor infos are then read as metadata until something is wrong
    expect_error(corrupt(tmp_path, valid[1], {16: u64(1000)}), "metadata key")


def test_huge_lengths(valid, tmp_path):
    _, blob, _, layout, _ = valid
    key_at, _, value_at = layout.kv["test.name"]
    expect_error(corrupt(tmp_path, blob, {key_at: u64(1 << 40)}), "over the 65535-byte limit")
    expect_error(corrupt(tmp_path, blob, {value_at: u64(1 << 40)}), "over the 1048576-byte limit")
    _, _, array_at = layout.kv["test.words"]
    expect_error(corrupt(tmp_path, blob, {array_at + 4: u64(1 << 40)}), "over the limit of 16777216")
    expect_error(corrupt(tmp_path, blob, {array_at + 4: u64(1 << 24)}), "of 'test.words'")  # reads past it
    _, _, scores_at = layout.kv["test.scores"]
    expect_error(corrupt(tmp_path, blob, {scores_at + 4: u64(1 << 24)}), "truncated")
    name_len_at = layout.tensor["w.q80"]["name"] - 8
    expect_error(corrupt(tmp_path, blob, {name_len_at: u64(1 << 40)}), "over the 65535-byte limit")


def test_unknown_or_nested_value_types(valid, tmp_path):
    _, blob, _, layout, _ = valid
    _, type_at, value_at = layout.kv["test.name"]
    expect_error(
        corrupt(tmp_path, blob, {type_at: u32(13)}), "unknown metadata value type 13 for key 'test.name'"
    )
    _, _, array_at = layout.kv["test.ids"]
    expect_error(corrupt(tmp_path, blob, {array_at: u32(77)}), "unknown metadata value type 77")
    expect_error(corrupt(tmp_path, blob, {array_at: u32(ARRAY_TYPE)}), "nested arrays are not supported")


def test_duplicate_metadata_key_and_bad_utf8(valid, tmp_path):
    _, blob, _, layout, _ = valid
    key_at = layout.kv["test.key02"][0] + 8
    expect_error(corrupt(tmp_path, blob, {key_at: b"test.key01"}), "duplicate metadata key 'test.key01'")
    expect_error(corrupt(tmp_path, blob, {key_at: b"\xff"}), "not valid UTF-8")


@pytest.mark.parametrize(
    "type_id,phrase", [(99, "unknown ggml type id 99"), (int(QType.IQ2_XXS), "unsupported type IQ2_XXS")]
)
def test_bad_tensor_type(valid, tmp_path, type_id, phrase):
    at = valid[3].tensor["w.q4k"]["type"]
    expect_error(corrupt(tmp_path, valid[1], {at: u32(type_id)}), f"'w.q4k' has {phrase}")


def test_bad_dims(valid, tmp_path):
    _, blob, _, layout, _ = valid
    t = layout.tensor["w.q80"]  # ne = (64, 3)
    expect_error(corrupt(tmp_path, blob, {t["ne"]: u64(0)}), "'w.q80' has a zero dimension")
    expect_error(
        corrupt(tmp_path, blob, {t["ne"]: u64(1 << 40), t["ne"] + 8: u64(1 << 30)}), "overflows int64"
    )
    expect_error(corrupt(tmp_path, blob, {t["ne"] + 8: u64(1 << 40)}), "runs past the end of the file")
    expect_error(corrupt(tmp_path, blob, {t["ne"]: u64(48)}), "row length 48 is not a multiple of the Q8_0")
    expect_error(corrupt(tmp_path, blob, {t["n_dims"]: u32(5)}), "'w.q80' has n_dims 5")
    expect_error(corrupt(tmp_path, blob, {t["n_dims"]: u32(0)}), "'w.q80' has n_dims 0")


def test_bad_offsets(valid, tmp_path):
    _, blob, _, layout, _ = valid
    t = layout.tensor["w.q6k"]
    expect_error(corrupt(tmp_path, blob, {t["offset"]: u64(1 << 40)}), "runs past the end of the file")
    expect_error(corrupt(tmp_path, blob, {t["offset"]: u64(t["rel_offset"] + 4)}), "misaligned")
    first = layout.tensor["w.f32"]["rel_offset"]
    expect_error(corrupt(tmp_path, blob, {t["offset"]: u64(first)}), "overlap")


def test_duplicate_tensor_names(valid, tmp_path):
    at = valid[3].tensor["w.q6k"]["name"]
    expect_error(corrupt(tmp_path, valid[1], {at: b"w.f16"}), "duplicate tensor name 'w.f16'")


def test_bad_alignment(tmp_path):
    path = tmp_path / "aligned.gguf"
    w = gguf.GGUFWriter(path, "gemma3")
    w.add_custom_alignment(64)
    w.add_tensor("w", np.ones(16, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert read_gguf(path).alignment == 64
    blob = path.read_bytes()
    at = blob.index(b"general.alignment") + len("general.alignment") + 4
    expect_error(corrupt(tmp_path, blob, {at: u32(48)}), "not a power of two")


def test_random_byte_flips_never_escape(valid, tmp_path):
    """Flip random header bytes: the file loads or raises ModelFormatError, never anything else."""
    _, blob, _, layout, seed = valid
    rng = np.random.default_rng(seed)
    for _ in range(300):
        positions = rng.integers(0, layout.data_offset, size=rng.integers(1, 4))
        patches = {int(p): bytes([int(rng.integers(0, 256))]) for p in positions}
        try:
            read_gguf(corrupt(tmp_path, blob, patches))
        except ModelFormatError:
            pass
        except Exception as e:  # pragma: no cover - the failure being tested for
            pytest.fail(f"seed={seed} patches={patches}: {type(e).__name__}: {e}")


# --- hyper-parameters and tokenizer metadata of a whole model (hmad.model.hparams via the loader) ---------


def load_tiny(tmp_path: Path, metadata: dict) -> ModelFormatError:
    """The ModelFormatError reading a tiny Gemma 3 GGUF with ``metadata`` ({key: (value, type)}) raises."""
    from tiny_gguf import make_tiny_gguf

    from hmad.model.loader import check_tensors, read_model_files

    path = make_tiny_gguf(tmp_path / "m.gguf", n_layers=3, d_model=64, d_ff=64, metadata=metadata)
    with pytest.raises(ModelFormatError) as e:
        check_tensors(read_model_files(path))
    assert e.value.path == str(path)
    return e.value


V = gguf.GGUFValueType


@pytest.mark.parametrize(
    ("metadata", "phrase"),
    [
        (
            {"gemma3.block_count": (2, V.UINT32)},
            "gemma3.block_count = 2, but the file holds tensors of layers 0-2",
        ),
        (
            {"gemma3.block_count": (4, V.UINT32)},
            "gemma3.block_count = 4, but the file holds tensors of layers 0-2",
        ),
        ({"gemma3.block_count": ("3", V.STRING)}, "gemma3.block_count = '3' is not an integer"),
        ({"gemma3.block_count": (1 << 40, V.UINT64)}, "gemma3.block_count = 1099511627776 is out of range"),
        ({"gemma3.attention.head_count": (3, V.UINT32)}, "head_count_kv = 2 does not divide"),
        ({"gemma3.attention.value_length": (32, V.UINT32)}, "value_length = 32 differs from"),
        (
            {"gemma3.attention.sliding_window": (8192, V.UINT32)},
            "sliding_window = 8192 is longer than the context",
        ),
        (
            {"gemma3.feed_forward_length": (128, V.UINT32)},
            "feed_forward_length = 128, gemma3.embedding_length = 64",
        ),
        ({"tokenizer.ggml.bos_token_id": (100000, V.UINT32)}, "bos_token_id = 100000 is not a token id"),
        (
            {"tokenizer.ggml.model": ("gpt2", V.STRING)},
            "cannot build the tokenizer: ValueError: tokenizer.ggml.model",
        ),
        ({"gemma3.rope.freq_base": (math.nan, V.FLOAT32)}, "freq_base = nan is out of range: must be finite"),
    ],
)
def test_hyperparameters_are_checked(tmp_path, metadata, phrase):
    assert phrase in load_tiny(tmp_path, metadata).problem
