"""Shared helpers of the Vulkan tests: the device (skip with the reason when none is usable), kernels built on
demand, and device buffers filled and read through the Uploader."""

from __future__ import annotations

import numpy as np
import pytest

MIB = 1 << 20


def open_device():
    """A Vulkan device, or a pytest skip that says why (and how CI gets lavapipe)."""
    from hmad.backends.vulkan import device as vkdev
    from hmad.backends.vulkan import vkerrors

    try:
        return vkdev.Device()
    except (vkerrors.NoVulkanDeviceError, vkerrors.DeviceUnsuitableError, OSError) as e:
        pytest.skip(f"no usable Vulkan device ({e}); apt-get install mesa-vulkan-drivers provides lavapipe")


def require_vulkan() -> None:
    """Skip the calling test (or module fixture) unless a Vulkan device opens (``open_device``)."""
    with open_device():
        pass


def run(dev, *dispatches) -> None:
    """Record (kernel, buffers, push, groups) dispatches into one command buffer, submit once, wait."""
    from hmad.backends.vulkan.recorder import CommandRecorder

    rec = CommandRecorder(dev).begin()
    for k, bufs, push, groups in dispatches:
        rec.dispatch(k, bufs, push, groups)
    rec.end()
    rec.submit()
    rec.close()


class Kernels:
    """Kernels by variant name, built on first use: ``kernels("add_f32")`` or ``kernels["add_f32"]``.

    Made per test: a Kernel caches descriptor sets by raw VkBuffer handle, and a later test's buffer may
    reuse a freed buffer's handle with the same offset and size, which would bind a stale set (seen on
    NVIDIA).
    """

    def __init__(self, dev):
        self.dev, self.made = dev, {}

    def __call__(self, name: str, block: int | None = None):
        """The kernel ``name`` at workgroup size ``block`` (else its spec's), built once. The test is skipped
        where the kernel reads storage texel buffers and the device makes none (GPUs: those kernels are for
        CPU implementations, physical.texel_loads; the refusal itself is tested in test_vulkan_matmul)."""
        from hmad.backends.vulkan.pipelines import Kernel
        from hmad.backends.vulkan.program import load_spirv, reflect

        key = (name, block)
        if key not in self.made:
            if not self.dev.texel_loads and reflect(load_spirv(name)).texels:
                pytest.skip(f"{name} reads storage texel buffers, which only CPU implementations get")
            self.made[key] = Kernel(self.dev, name, block_size=block)
        return self.made[key]

    __getitem__ = __call__

    def close(self) -> None:
        for k in self.made.values():
            k.close()


class Gpu:
    """Device buffers filled and read through the Uploader (staging on a dGPU, direct on UMA)."""

    def __init__(self, dev):
        from hmad.backends.vulkan.memory import Uploader

        self.dev, self.made = dev, []
        self.up = Uploader(dev, chunk_bytes=4 * MIB, slots=2)

    def alloc(self, nbytes, kind="device"):
        from hmad.backends.vulkan.memory import create_buffer

        b = create_buffer(self.dev, nbytes, kind)
        self.made.append(b)
        return b

    def put(self, arr: np.ndarray, view=None):
        """Upload ``arr`` into ``view`` (a new device-local buffer if None); returns the view."""
        view = view or self.alloc(arr.nbytes)
        self.up.upload(view, np.ascontiguousarray(arr))
        self.up.flush()
        return view

    def poison(self, view):
        return self.put(np.full(view.nbytes // 4, np.nan, np.float32), view)

    def get(self, view, dtype=np.float32, shape=None):
        a = self.up.download(view).view(dtype)
        return a if shape is None else a.reshape(shape)

    def get_xq(self, view, shape):
        """q8 activations (XQ, rows of K int8 in the GPU's order: shaders/q8act.glsl) in K order."""
        from hmad.backends.vulkan.kernels_q8 import xq_natural

        return xq_natural(self.get(view, np.int8)[: int(np.prod(shape))].reshape(shape))

    def close(self):
        self.dev.wait_idle()
        self.up.close()
        for b in self.made:
            b.arena.close()


def assert_x3_planes(q: np.ndarray, ds: np.ndarray, x: np.ndarray) -> None:
    """Three-plane q8 activations (shaders/q8act.glsl) of float x (T, K): q (T, 3, K) int8, ds (T, K/32, 2).
    Per block of 32: d = max|x| / 127 (float32), |q2|, |q3| <= 65, d (q1 + q2/128 + q3/16384) within
    d / 32768 of x (+ one float32 rounding of x), s = the block's sum of x (1e-6 of max|x|)."""
    t, k = x.shape
    q, ds = q.astype(np.float64), ds.astype(np.float64)
    d = np.repeat(ds[..., 0], 32, axis=1)
    assert np.abs(q[:, 1:]).max() <= 65
    xr = d * (q[:, 0] + q[:, 1] / 128 + q[:, 2] / 16384)
    over = np.abs(xr - x) - (d / 32768 + np.abs(x) * 2.0**-23)
    assert over.max() <= 0, f"planes off by {over.max():.2e} past the bound"
    np.testing.assert_allclose(ds[..., 0], np.abs(x.reshape(t, -1, 32)).max(-1) / np.float32(127), rtol=1e-6)
    sums = x.astype(np.float64).reshape(t, -1, 32).sum(-1)
    assert np.abs(ds[..., 1] - sums).max() <= 1e-6 * max(np.abs(x).max(), 1e-30)


def shader_build():
    """shaders/build.py as a module (its build list, to check the registries against)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "shaders" / "build.py"
    spec = importlib.util.spec_from_file_location("shader_build", path)
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    return build
