"""On a real Ryzen AI NPU (marked npu; skipped, with the reason, where /dev/accel has no NPU): the kernels
built by npu_kernels/build.py, through hmad's runtime and the real pyxrt, against numpy.

NEVER RUN YET: no NPU was available where this was written. To run it on a Ryzen AI machine (after building
and installing the kernels, npu_kernels/README.md):

    source /opt/xilinx/xrt/setup.sh
    HMAD_NPU_XCLBIN_DIR=/usr/local/share/hmad/npu_kernels .venv/bin/python -m pytest -m npu -v -s \
        tests/test_npu_hardware.py

(-s shows the per-run timings it prints: Phoenix is expected at ~45-150 us per run, ~120 ms after 10 s idle.)
"""

from __future__ import annotations

import glob
import os
import time

import numpy as np
import pytest

from hmad.backends.npu import ops, xrt
from hmad.backends.npu.context import KernelContext
from hmad.backends.npu.errors import NpuError
from hmad.backends.npu.host import bf16_to_f32, f32_to_bf16, prepare_weight
from hmad.backends.npu.kernels import CATALOGUE, find_kernels

pytestmark = [
    pytest.mark.npu,
    pytest.mark.skipif(not glob.glob("/dev/accel/accel*"), reason="no NPU: /dev/accel/accel* is absent"),
]


@pytest.fixture(scope="module")
def kernels():
    os.environ.pop(xrt.PYXRT_ENV, None)  # the real pyxrt, never the stand-in
    os.environ.pop(xrt.ACCEL_DIR_ENV, None)
    xrt.forget_device()
    try:
        dev = xrt.open_device()
        files = find_kernels(dev.family, os.environ.get("HMAD_NPU_XCLBIN_DIR"), list(CATALOGUE))
    except NpuError as e:
        pytest.skip(f"NPU present but not usable: {e}")
    assert dev.xrt_module == "pyxrt"
    yield {name: KernelContext(dev, f) for name, f in files.items()}
    xrt.forget_device()


def timed_runs(ctx: KernelContext, n: int = 20) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        ctx.run(ctx.sets[0])
    return (time.perf_counter() - t0) / n * 1e6


def test_gemm_int8_kernel_is_exact(kernels):
    ctx = kernels["gemm_int8"]
    rng = np.random.default_rng(0)
    a = rng.integers(-127, 128, (256, 256), dtype=np.int8)
    b = rng.integers(-127, 128, (512, 256), dtype=np.int8)
    ctx.sets[0].views[0][...], ctx.sets[0].views[1][...] = a, b
    (c,) = ctx.run(ctx.sets[0])
    np.testing.assert_array_equal(c, a.astype(np.int64) @ b.astype(np.int64).T)
    print(f"\ngemm_int8: {timed_runs(ctx):.0f} us per run")


def test_gemm_bf16_kernel(kernels):
    ctx = kernels["gemm_bf16"]
    rng = np.random.default_rng(1)
    a = f32_to_bf16(rng.standard_normal((256, 256)).astype(np.float32))
    b = f32_to_bf16(rng.standard_normal((256, 256)).astype(np.float32))
    ctx.sets[0].views[0][...], ctx.sets[0].views[1][...] = a, b
    (c,) = ctx.run(ctx.sets[0])
    np.testing.assert_allclose(c, bf16_to_f32(a).astype(np.float64) @ bf16_to_f32(b).T, rtol=1e-3, atol=1e-2)
    print(f"\ngemm_bf16: {timed_runs(ctx):.0f} us per run")


def test_softmax_kernel(kernels):
    ctx = kernels["softmax_bf16"]
    rng = np.random.default_rng(2)
    s = rng.standard_normal((256, 2048)).astype(np.float32) * 3
    lim = np.stack([rng.integers(0, 100, 256), rng.integers(101, 2049, 256)], 1).astype(np.int32)
    p = bf16_to_f32(ops.softmax_rows(ctx, s, lim))
    cols = np.arange(2048)
    inside = (cols >= lim[:, :1]) & (cols < lim[:, 1:])
    e = np.where(inside, np.exp(s - np.where(inside, s, -np.inf).max(1, keepdims=True)), 0)
    np.testing.assert_allclose(p, e / e.sum(1, keepdims=True), atol=1e-2)
    assert not p[~inside].any()


def test_tiled_gemm_odd_shapes(kernels):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((37, 640)).astype(np.float32)
    w = rng.standard_normal((1000, 640)).astype(np.float32)
    out = ops.gemm(kernels["gemm_int8"], x, prepare_weight("gemm_int8", w, 512, 256))
    assert np.linalg.norm(out - x @ w.T) / np.linalg.norm(x @ w.T) < 0.02


def test_first_run_after_idle(kernels):
    """Measures (prints) what Phoenix is said to do after ~10 s idle; asserts nothing about the time."""
    ctx = kernels["gemm_int8"]
    ctx.run(ctx.sets[0])
    time.sleep(11)
    t0 = time.perf_counter()
    ctx.run(ctx.sets[0])
    print(f"\nfirst run after 11 s idle: {(time.perf_counter() - t0) * 1e3:.1f} ms")
