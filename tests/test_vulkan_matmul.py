"""Quantized matmul shaders (mul_mat_vec.comp, mul_mat.comp over dequant.glsl) against gguf's dequantize.

For every weight type: fresh random valid blocks (``random_blocks``), random x, the output poisoned with NaN,
and y compared with ``gguf.quants.dequantize(W) @ xᵀ`` computed in float64. Shapes are odd on purpose: N not a
multiple of the rows per workgroup or of the 64-row tile, strides with padding (the padding must stay NaN),
T = 1, 3, 8 for mat-vec and 17, 64 for mat-mat, K = 256..2048, and a W bound as several ranges.

Tolerance: max |y − ref| ≤ ``RTOL_SCALE`` = 1e-5 × the output scale (max |ref|), K ≤ 2048. The GPU sums in
float32 in another order than the float64 reference (and may fuse a decode's multiply-add, one rounding of a
weight); seen on lavapipe: mat-vec ≤ 2e-7 (short per-invocation sums, then a tree), mat-mat ≤ 1.2e-6 (one
sequential sum over K per output).
Small shapes: the whole file runs in well under 30 s on lavapipe with 2 cores.
"""

from __future__ import annotations

import zlib

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize

from hmad.model.quants import random_blocks
from hmad.model.tensors import QType

RTOL_SCALE = 1e-5
TYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q5_0", "q4_k", "q6_k"]

pytestmark = pytest.mark.gpu


def _weights(t: str, n: int, k: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """(stored bytes (n, row_bytes) uint8, dequantized float64 (n, k)) of a random valid W."""
    q = QType[t.upper()]
    w = random_blocks(q, (n, k), rng)
    raw = np.ascontiguousarray(w).view(np.uint8).reshape(n, -1)
    ref = gguf_dequantize(w if q == QType.F32 else raw, gguf.GGMLQuantizationType[t.upper()])
    return raw, ref.astype(np.float64)


def _run(dev, gpu, kernel, t, k, n, ntok, rng, max_range=None, pad_x=4, pad_y=3):
    from hmad.backends.vulkan.kernels_matmul import record_matmul
    from hmad.backends.vulkan.pipelines import CommandRecorder

    raw, wref = _weights(t, n, k, rng)
    xs, ys = k + pad_x, n + pad_y
    x = np.full((ntok, xs), np.nan, np.float32)  # padding of x is NaN too: it must never be read
    x[:, :k] = rng.standard_normal((ntok, k))
    bw, bx = gpu.put(raw), gpu.put(x)
    by = gpu.poison(gpu.alloc(ntok * ys * 4))
    rec = CommandRecorder(dev).begin()
    dispatches = record_matmul(rec, kernel, bw, bx, by, k, n, ntok, xs, ys, max_range=max_range)
    rec.end()
    rec.submit()
    rec.close()
    y = gpu.get(by, shape=(ntok, ys))
    assert np.isnan(y[:, n:]).all(), "wrote past N into the padding of y"
    ref = x[:, :k].astype(np.float64) @ wref.T
    err = np.abs(y[:, :n] - ref).max() / np.abs(ref).max()
    assert err <= RTOL_SCALE, f"{kernel.name} K={k} N={n} T={ntok}: max error {err:.2e} of the output scale"
    return err, dispatches


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("reduce", ["", "_subgroup"])
def test_mul_mat_vec(dev, kernels, gpu, t, reduce):
    rng = np.random.default_rng(zlib.crc32(f"{t}{reduce}".encode()))
    k = kernels(f"mul_mat_vec_{t}{reduce}")
    for kk, n, ntok in [(256, 37, 1), (768, 20, 3), (2048, 11, 8)]:
        err, _ = _run(dev, gpu, k, t, kk, n, ntok, rng)
        print(f"{k.name} K={kk} N={n} T={ntok}: {err:.1e}")


@pytest.mark.parametrize("t", TYPES)
def test_mul_mat(dev, kernels, gpu, t):
    rng = np.random.default_rng(zlib.crc32(t.encode()))
    k = kernels(f"mul_mat_{t}")
    for kk, n, ntok in [(256, 67, 17), (512, 130, 64), (1024, 33, 3)]:
        err, _ = _run(dev, gpu, k, t, kk, n, ntok, rng)
        print(f"{k.name} K={kk} N={n} T={ntok}: {err:.1e}")


@pytest.mark.parametrize(
    "name", ["mul_mat_vec_q4_k", "mul_mat_vec_q8_0_subgroup", "mul_mat_q6_k", "mul_mat_q5_0"]
)
def test_weight_bound_as_several_ranges(dev, kernels, gpu, name):
    """W split over bind ranges of whole rows: one dispatch per range, each writing its own y columns."""
    from hmad.backends.vulkan.kernels_matmul import MATMUL_TYPES, weight_row_bytes

    t = next(s for s in MATMUL_TYPES if name.removesuffix("_subgroup").endswith("_" + s))
    k = 256
    rb = weight_row_bytes(MATMUL_TYPES[t], k)
    max_range = int(np.lcm(rb, 256))  # ranges hold whole rows and start aligned (16 or 128 rows here)
    n = 2 * (max_range // rb) + 5  # three ranges, the last a short one
    ntok = 3 if "vec" in name else 20
    _, dispatches = _run(
        dev, gpu, kernels(name), t, k, n, ntok, np.random.default_rng(5), max_range=max_range
    )
    assert dispatches == 3


def test_registries_agree():
    """The build list makes exactly the variants kernels_matmul registers (names, sources, defines)."""
    import importlib.util
    from pathlib import Path

    from hmad.backends.vulkan.kernels_matmul import build_entries
    from hmad.backends.vulkan.pipelines import KERNELS

    path = Path(__file__).resolve().parents[1] / "shaders" / "build.py"
    spec = importlib.util.spec_from_file_location("shader_build", path)
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    mine = {e[0]: e for e in build_entries()}
    assert {e[0]: e for e in build.BUILD if e[0] in mine} == mine
    assert all(KERNELS[name].source == src for name, src, _ in mine.values())
