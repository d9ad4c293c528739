"""Descriptor sets of storage buffers (and storage texel buffers): what a binding is, what caches key on,
and the pools sets come from.

A binding is a whole :class:`BufferView` or one range ``(view, offset inside the view, nbytes)`` of a big
tensor. Kernels cache one descriptor set per distinct tuple of bindings (:func:`key_of`), so a recorded
graph binds the same sets on every replay; the recorder places barriers from the same keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import vulkan as vk

from hmad.backends.vulkan.device import Device
from hmad.backends.vulkan.memory import BufferView
from hmad.backends.vulkan.vkerrors import (
    VK_ERROR_FRAGMENTED_POOL,
    VK_ERROR_OUT_OF_POOL_MEMORY,
    OutOfPoolMemory,
    check,
)
from hmad.backends.vulkan.vkffi import ffi, lib, new

# A binding: a whole view, or (view, offset inside the view, nbytes) for one range of a big tensor.
Binding = BufferView | tuple[BufferView, int, int]


def range_of(b: Binding) -> tuple[Any, int, int]:
    """(VkBuffer, offset, nbytes) of a binding: what a descriptor is written with."""
    if isinstance(b, BufferView):
        return b.buffer, b.offset, b.nbytes
    view, off, n = b
    return view.buffer, view.offset + off, n


def key_of(b: Binding) -> tuple[int, int, int]:
    """(arena serial, offset, nbytes) of a binding: what caches key on. Not the VkBuffer handle: a driver
    gives a destroyed buffer's handle to the next one, and a descriptor set cached under it would bind the
    freed memory (the likely cause of a step whose fence was never signalled)."""
    view, off, n = (b, 0, b.nbytes) if isinstance(b, BufferView) else b
    return view.arena.serial, view.offset + off, n


def arenas_of(buffers: Sequence[Binding]) -> tuple:
    """The arenas the bindings lie in (a cached set is dropped when one of them is closed)."""
    return tuple(b.arena if isinstance(b, BufferView) else b[0].arena for b in buffers)


def handle_key(h) -> int:
    """A Vulkan handle as an int (to key a dict on, or to compare)."""
    return int(ffi.cast("uintptr_t", h))


class DescriptorAllocator:
    """Descriptor pools of storage-buffer sets (storage texel buffers too where the device reads them:
    ``Device.texel_loads``), a new pool whenever the current one is full."""

    def __init__(self, device: Device, sets_per_pool: int = 256, max_bindings: int = 8):
        self.device, self.sets_per_pool, self.max_bindings = device, sets_per_pool, max_bindings
        self.pools: list[Any] = []
        self._new_pool()

    def _new_pool(self) -> None:
        types = [vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER]
        if self.device.texel_loads:
            types.append(vk.VK_DESCRIPTOR_TYPE_STORAGE_TEXEL_BUFFER)
        sizes = ffi.new("VkDescriptorPoolSize[]", len(types))
        for size, kind in zip(sizes, types, strict=True):
            size.type, size.descriptorCount = kind, self.sets_per_pool * self.max_bindings
        ci = new(
            "VkDescriptorPoolCreateInfo",
            sType=vk.VK_STRUCTURE_TYPE_DESCRIPTOR_POOL_CREATE_INFO,
            maxSets=self.sets_per_pool,
            poolSizeCount=len(types),
            pPoolSizes=sizes,
        )
        out = ffi.new("VkDescriptorPool*")
        check(lib.vkCreateDescriptorPool(self.device.handle, ci, ffi.NULL, out), "vkCreateDescriptorPool")
        self.pools.append(out[0])
        self.in_pool = 0  # sets allocated from the newest pool

    def allocate(self, layout) -> Any:
        """One set of ``layout``. A pool holds ``sets_per_pool`` sets: counted here, so a new pool is made
        before the driver has to refuse (lavapipe never refuses; NVIDIA does, with
        VK_ERROR_OUT_OF_POOL_MEMORY, which the ``vulkan`` package spells with the wrong sign)."""
        if self.in_pool >= self.sets_per_pool:
            self._new_pool()
        layouts = ffi.new("VkDescriptorSetLayout[]", [layout])
        for attempt in range(2):
            ai = new(
                "VkDescriptorSetAllocateInfo",
                sType=vk.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO,
                descriptorPool=self.pools[-1],
                descriptorSetCount=1,
                pSetLayouts=layouts,
            )
            out = ffi.new("VkDescriptorSet*")
            r = lib.vkAllocateDescriptorSets(self.device.handle, ai, out)
            if r in (VK_ERROR_OUT_OF_POOL_MEMORY, VK_ERROR_FRAGMENTED_POOL) and attempt == 0:
                self._new_pool()
                continue
            check(r, "vkAllocateDescriptorSets")
            self.in_pool += 1
            return out[0]
        raise OutOfPoolMemory("vkAllocateDescriptorSets", VK_ERROR_OUT_OF_POOL_MEMORY)

    def close(self) -> None:
        for p in self.pools:
            lib.vkDestroyDescriptorPool(self.device.handle, p, ffi.NULL)
        self.pools = []
