"""The NPU ops' host side on the XRT stand-in: bf16 and int8 numerics, padding and tiling of odd shapes to the
kernels' tiles, K blocks summed on the host, two-deep pipelining, and prefill attention against the CPU's.

Tolerances against the float reference, on these random inputs: int8 GEMM ||err|| / ||ref|| < 2% (one scale
per row per 256-wide K tile on both sides); bf16 GEMM < 0.5%; attention < 1%. Against the same quantized or
rounded inputs computed in float64 on the host, the tiled results agree to float32 rounding (1e-5)."""

from __future__ import annotations

import numpy as np
import pytest

from hmad.backends.cpu import _attend
from hmad.backends.npu import ops
from hmad.backends.npu.context import KernelContext
from hmad.backends.npu.errors import NpuRunError, NpuUnsupportedShape
from hmad.backends.npu.host import (
    bf16_to_f32,
    f32_to_bf16,
    prepare_weight,
    quantize_blocks,
    quantize_rows,
)
from hmad.backends.npu.kernels import CATALOGUE, find_kernels
from hmad.backends.npu.xrt import open_device


@pytest.fixture
def kernels(fake_npu) -> dict[str, KernelContext]:
    dev = open_device()
    files = find_kernels(dev.family, str(fake_npu.kernels), list(CATALOGUE))
    return {name: KernelContext(dev, f) for name, f in files.items()}


def rel(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


# -- numerics ----------------------------------------------------------------------------------------------
def test_bf16_rounds_to_nearest_even():
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -2.5, 1e-40, np.inf, 3.0e38], np.float32)
    back = bf16_to_f32(f32_to_bf16(x))
    np.testing.assert_array_equal(back[[0, 3, 5]], [1.0, -2.5, np.inf])
    assert back[1] == 1.0  # halfway: to the even mantissa
    assert back[2] == 1.0 + 4 * 2**-8  # halfway: up to the even one
    assert np.isnan(bf16_to_f32(f32_to_bf16(np.array([np.nan], np.float32))))[0]
    r = np.random.default_rng(1).standard_normal(1000).astype(np.float32)
    assert np.max(np.abs(bf16_to_f32(f32_to_bf16(r)) - r) / np.abs(r)) <= 2**-8


def test_int8_quantization_is_symmetric_and_in_range():
    x = np.random.default_rng(2).standard_normal((7, 512)).astype(np.float32) * 3
    x[3] = 0
    q, s = quantize_rows(x)
    assert q.dtype == np.int8 and np.abs(q).max() == 127 and s[3] == 1 and not q[3].any()
    assert np.max(np.abs(q * s[:, None] - x)) <= s.max() / 2 + 1e-6
    qb, sb = quantize_blocks(x, 256)
    assert sb.shape == (7, 2)
    np.testing.assert_allclose(qb.reshape(7, 2, 256) * sb[..., None], x.reshape(7, 2, 256), atol=sb.max())


# -- GEMMs on odd shapes -----------------------------------------------------------------------------------
@pytest.mark.parametrize("t, k, n", [(1, 64, 8), (5, 300, 700), (257, 513, 129)])
def test_gemm_int8_odd_shapes(kernels, fake_npu, t, k, n):
    rng = np.random.default_rng(t + k + n)
    x = rng.standard_normal((t, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    g = prepare_weight("gemm_int8", w, 512, 256)
    assert g.data.shape == (-(-n // 512) * 512, -(-k // 256) * 256)
    out = ops.gemm(kernels["gemm_int8"], x, g)
    assert out.shape == (t, n) and out.dtype == np.float32
    # exactly the tiles' int32 sums, dequantized per tile: the padding and K loop lose nothing
    qx, sx = quantize_blocks(np.pad(x, ((0, 0), (0, g.data.shape[1] - k))), 256)
    blocks = [(qx[:, b * 256 : (b + 1) * 256].astype(np.float64) @ g.data[:n, b * 256 : (b + 1) * 256].T)
              * sx[:, b, None] * g.scale[None, :n, b] for b in range(sx.shape[1])]  # fmt: skip
    np.testing.assert_allclose(out, sum(blocks), rtol=1e-5, atol=1e-4)
    assert rel(out, x.astype(np.float64) @ w.T) < 0.02
    assert fake_npu.state.misuse == []


@pytest.mark.parametrize("t, k, n", [(3, 100, 50), (300, 260, 257)])
def test_gemm_bf16_odd_shapes(kernels, t, k, n):
    rng = np.random.default_rng(t * k)
    x = rng.standard_normal((t, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    out = ops.gemm(kernels["gemm_bf16"], x, prepare_weight("gemm_bf16", w, 256, 256))
    rounded = bf16_to_f32(f32_to_bf16(x)).astype(np.float64) @ bf16_to_f32(f32_to_bf16(w)).T
    np.testing.assert_allclose(out, rounded, rtol=1e-5, atol=1e-4)
    assert rel(out, x.astype(np.float64) @ w.T) < 0.005


def test_runs_are_pipelined_two_deep(kernels, fake_npu):
    """Run b+1 is started before run b is waited for: the host works while the NPU does."""
    x = np.ones((2, 1024), np.float32)
    w = prepare_weight("gemm_int8", np.ones((1024, 1024), np.float32), 512, 256)
    fake_npu.state.events.clear()
    ops.gemm(kernels["gemm_int8"], x, w)
    ev = fake_npu.state.events
    first = ev[0][1]
    assert ev[:3] == [("start", first), ("start", first + 1), ("done", first)]
    assert len(ev) == 2 * 8 and fake_npu.state.misuse == []  # 2 N tiles x 4 K tiles


def test_failure_mid_gemm_leaves_no_run_in_flight(kernels, fake_npu):
    fake_npu.state.run_error_at = len(fake_npu.state.runs) + 3
    w = prepare_weight("gemm_int8", np.ones((1024, 1024), np.float32), 512, 256)
    with pytest.raises(NpuRunError, match="state ERROR"):
        ops.gemm(kernels["gemm_int8"], np.ones((2, 1024), np.float32), w)
    starts = sum(e[0] == "start" for e in fake_npu.state.events)
    assert starts == sum(e[0] == "done" for e in fake_npu.state.events)


# -- attention ---------------------------------------------------------------------------------------------
def test_key_limits():
    lim = ops.key_limits(3, pos0=10, k0=4, window=5)  # queries at 10, 11, 12 over keys at 4..
    np.testing.assert_array_equal(lim, [[2, 7], [3, 8], [4, 9]])
    np.testing.assert_array_equal(ops.key_limits(2, 0, 0, None), [[0, 1], [0, 2]])


def test_softmax_rows(kernels):
    rng = np.random.default_rng(3)
    s = rng.standard_normal((300, 40)).astype(np.float32) * 4
    lim = np.stack([rng.integers(0, 10, 300), rng.integers(11, 41, 300)], 1).astype(np.int32)
    p = bf16_to_f32(ops.softmax_rows(kernels["softmax_bf16"], s, lim))
    cols = np.arange(40)
    inside = (cols >= lim[:, :1]) & (cols < lim[:, 1:])
    e = np.where(inside, np.exp(s - np.where(inside, s, -np.inf).max(1, keepdims=True)), 0)
    np.testing.assert_allclose(p, e / e.sum(1, keepdims=True), atol=4e-3)
    assert not p[~inside].any()
    with pytest.raises(NpuUnsupportedShape, match="2049 keys"):
        ops.softmax_rows(kernels["softmax_bf16"], np.zeros((1, 2049), np.float32), lim[:1])


@pytest.mark.parametrize("n, pos0, n_keys, window", [(7, 13, 20, None), (7, 13, 20, 8), (33, 0, 33, None)])
def test_attention_prefill_matches_cpu(kernels, fake_npu, n, pos0, n_keys, window):
    rng = np.random.default_rng(n + pos0)
    q = rng.standard_normal((n, 4, 64)).astype(np.float32)
    k = rng.standard_normal((n_keys, 2, 64)).astype(np.float32)
    v = rng.standard_normal((n_keys, 2, 64)).astype(np.float32)
    kpos = np.arange(pos0 + n - n_keys, pos0 + n)
    out = ops.attention_prefill(
        kernels["gemm_bf16"], kernels["softmax_bf16"], q, k, v, pos0, kpos, window, 0.125
    )
    ref = _attend(q, k, v, pos0, kpos, window, 0.125, True)
    assert out.shape == (n, 256) and rel(out, ref) < 0.01
    assert fake_npu.state.misuse == []
