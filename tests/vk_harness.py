"""Shared helpers of the Vulkan tests: the device (skip with the reason when none is usable), kernels built on
demand, and device buffers filled and read through the Uploader."""

from __future__ import annotations

import numpy as np
import pytest

MIB = 1 << 20


def open_device():
    """A Vulkan device, or a pytest skip that says why (and how CI gets lavapipe)."""
    from hmad.backends.vulkan import device as vkdev

    try:
        return vkdev.Device()
    except (vkdev.NoVulkanDeviceError, vkdev.DeviceUnsuitableError, OSError) as e:
        pytest.skip(f"no usable Vulkan device ({e}); apt-get install mesa-vulkan-drivers provides lavapipe")


class Kernels:
    """Kernels by variant name, built on first use: ``kernels("add_f32")`` or ``kernels["add_f32"]``.

    Made per test: a Kernel caches descriptor sets by raw VkBuffer handle, and a later test's buffer may
    reuse a freed buffer's handle with the same offset and size, which would bind a stale set (seen on
    NVIDIA).
    """

    def __init__(self, dev):
        self.dev, self.made = dev, {}

    def __call__(self, name: str):
        from hmad.backends.vulkan.pipelines import Kernel

        if name not in self.made:
            self.made[name] = Kernel(self.dev, name)
        return self.made[name]

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

    def close(self):
        self.dev.wait_idle()
        self.up.close()
        for b in self.made:
            b.arena.close()
