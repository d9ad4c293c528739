"""hmad.core.quants against gguf.quants (the Python port of ggml's reference code), on fresh random blocks.

Each test draws a new seed and puts it in its assert messages; set HMAD_TEST_SEED to replay one.
Decoders must match gguf.quants bit for bit: both do the same float32 operations in the same order, so no
tolerance is needed (NaN where both read a NaN/inf scale counts as equal).
"""

from __future__ import annotations

import os

import gguf.quants as gq
import numpy as np
import pytest

from hmad.core.quants import (
    SUPPORTED_TYPES,
    dequantize,
    quantize_q4_0,
    quantize_q5_0,
    quantize_q8_0,
    random_blocks,
)
from hmad.core.tensors import QType, block_layout

QUANT_TYPES = [
    QType.Q8_0,
    QType.Q4_0,
    QType.Q4_1,
    QType.Q5_0,
    QType.Q5_1,
    QType.Q2_K,
    QType.Q3_K,
    QType.Q4_K,
    QType.Q5_K,
    QType.Q6_K,
]
PLAIN = [QType.F32, QType.F16, QType.BF16]


@pytest.fixture
def seeded() -> tuple[np.random.Generator, int]:
    seed = int(os.environ.get("HMAD_TEST_SEED", np.random.SeedSequence().entropy))
    return np.random.default_rng(seed), seed


def shapes_for(qtype: QType) -> list[tuple[int, ...]]:
    """A single row, odd row counts, a row of several blocks and multi-dim shapes."""
    k = block_layout(qtype)[0]
    return [(k,), (1, k), (7, 3 * k), (3, 5, 2 * k), (2, 3, 1, k)]


def reference(data: np.ndarray, qtype: QType, shape: tuple[int, ...]) -> np.ndarray:
    with np.errstate(all="ignore"):
        return gq.dequantize(data, qtype).reshape(shape)


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
def test_dequantize_matches_gguf_on_random_blocks(qtype, seeded):
    rng, seed = seeded
    for shape in shapes_for(qtype):
        data = random_blocks(qtype, shape, rng)
        got = dequantize(data, qtype, shape)
        assert got.dtype == np.float32 and got.shape == shape, f"seed={seed} shape={shape}"
        assert np.isfinite(got).all(), f"random_blocks gave non-finite weights: seed={seed} shape={shape}"
        np.testing.assert_array_equal(got, reference(data, qtype, shape), err_msg=f"seed={seed} {shape}")


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
def test_dequantize_matches_gguf_on_arbitrary_bytes(qtype, seeded):
    """Any bit pattern (inf/nan scales included) decodes exactly as ggml would decode it."""
    rng, seed = seeded
    shape = (5, 2 * block_layout(qtype)[0])
    data = rng.integers(0, 256, size=random_blocks(qtype, shape, rng).shape, dtype=np.uint8)
    np.testing.assert_array_equal(
        dequantize(data, qtype, shape), reference(data, qtype, shape), err_msg=f"seed={seed}"
    )


@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda q: q.name)
def test_dequantize_spans_several_chunks(qtype, seeded, monkeypatch):
    """Row chunking (here 1 row per chunk, then 3) must not change a single value."""
    import hmad.core.quants as quants

    rng, seed = seeded
    shape = (11, 2 * block_layout(qtype)[0])
    data = random_blocks(qtype, shape, rng)
    want = reference(data, qtype, shape)
    for chunk in (1, 3 * shape[1]):
        monkeypatch.setattr(quants, "_CHUNK_WEIGHTS", chunk)
        np.testing.assert_array_equal(dequantize(data, qtype, shape), want, err_msg=f"seed={seed}")


@pytest.mark.parametrize("qtype", PLAIN, ids=lambda q: q.name)
def test_plain_types(qtype, seeded):
    rng, seed = seeded
    shape = (3, 5, 64)
    data = random_blocks(qtype, shape, rng)
    got = dequantize(data, qtype, shape)
    want = gq.dequantize(data.view(np.uint8), qtype).reshape(shape)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want, err_msg=f"seed={seed}")
    raw = dequantize(data.reshape(3, 5, -1).view(np.uint8), qtype, shape)  # raw file bytes also accepted
    np.testing.assert_array_equal(raw, want, err_msg=f"seed={seed}")
    assert not np.shares_memory(got, data), "dequantize must return a new array"


QUANTIZERS = [(QType.Q8_0, quantize_q8_0), (QType.Q4_0, quantize_q4_0), (QType.Q5_0, quantize_q5_0)]


def quantizer_inputs(rng: np.random.Generator) -> np.ndarray:
    """(3, 4, 128) float32: normals, an all-zero block, exact halves (roundf ties), a max-magnitude tie."""
    x = rng.standard_normal((3, 4, 128)).astype(np.float32) * np.float32(rng.uniform(0.01, 10))
    x[0, 0, :32] = 0
    x[0, 1, :32] = np.arange(-16, 16) + np.float32(0.5)
    x[0, 1, 0] = -127  # Q8_0: d = 1, so the halves above are exact ties
    x[0, 2, :32] = rng.choice([-3.0, 3.0], size=32)  # Q4_0/Q5_0: the first of equal magnitudes sets d's sign
    x[1, 3, 5] = 1e-30  # tiny values next to normal ones
    return x


@pytest.mark.parametrize("qtype,quantize", QUANTIZERS, ids=lambda q: getattr(q, "name", ""))
def test_quantizer_matches_gguf(qtype, quantize, seeded):
    rng, seed = seeded
    x = quantizer_inputs(rng)
    got = quantize(x)
    assert got.dtype == np.uint8 and got.shape == (3, 4, 128 // 32 * block_layout(qtype)[1])
    np.testing.assert_array_equal(got, gq.quantize(x, qtype), err_msg=f"seed={seed}")


@pytest.mark.parametrize("qtype,quantize", QUANTIZERS, ids=lambda q: getattr(q, "name", ""))
def test_quantize_round_trip_error_is_bounded(qtype, quantize, seeded):
    rng, seed = seeded
    x = rng.standard_normal((9, 256)).astype(np.float32)
    y = dequantize(quantize(x), qtype, x.shape)
    amax = np.abs(x.reshape(-1, 32)).max(axis=1, keepdims=True)
    # half a step, but a full step where Q4_0/Q5_0 clip -max to the top level (their range is -8..7 / -16..15)
    # plus the f16 rounding of d (relative 2^-11) times the largest level
    levels = {QType.Q8_0: 127, QType.Q4_0: 8, QType.Q5_0: 16}[qtype]
    step = amax / levels
    bound = step * ((0.5 if qtype == QType.Q8_0 else 1.0) + levels / 2048)
    err = np.abs((y - x).reshape(-1, 32))
    assert (err <= bound).all(), f"seed={seed} max err {err.max()}"


def test_dequantize_rejects_wrong_sizes():
    data = np.zeros((2, 34), dtype=np.uint8)
    with pytest.raises(ValueError, match="needs 102 uint8 bytes"):
        dequantize(data, QType.Q8_0, (3, 32))
    with pytest.raises(ValueError, match="not a multiple of the Q8_0 block size 32"):
        dequantize(data, QType.Q8_0, (2, 48))
    with pytest.raises(ValueError, match="not a multiple"):
        quantize_q8_0(np.zeros((2, 40), dtype=np.float32))
    with pytest.raises(NotImplementedError, match="IQ2_XXS"):
        dequantize(np.zeros((1, 66), dtype=np.uint8), QType.IQ2_XXS, (1, 256))


def test_supported_types_all_decode(seeded):
    rng, seed = seeded
    for qtype in SUPPORTED_TYPES:
        shape = (2, 256)
        assert dequantize(random_blocks(qtype, shape, rng), qtype, shape).shape == shape, f"{qtype.name}"
