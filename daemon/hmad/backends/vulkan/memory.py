"""GPU memory: arenas with sub-allocated tensors, the plan made real, and upload/readback.

Scheme (why arenas): a model has hundreds of tensors and drivers cap the number of allocations, so each pool
allocates a few large *arenas* (one VkDeviceMemory + one VkBuffer spanning it, at most ``arena_bytes`` each,
a tensor bigger than that gets an arena of its own) and tensors are sub-allocated inside at offsets aligned to
``alignment`` (>= minStorageBufferOffsetAlignment, and 256 so vec4/block reads stay aligned). A buffer can be
larger than ``maxStorageBufferRange`` (128 MiB on lavapipe), a descriptor range cannot: a tensor larger than
that is bound as several ranges, each a whole number of rows (:meth:`BufferView.ranges`), and an op over it is
recorded as one dispatch per range. Quantized matmul shaders will read the GGUF blocks from these ranges as
they lie in the file (no repacking on upload).

The plan (which pool each tensor goes to, and where in which arena) is memory_plan.py's; this module makes
it real (:class:`ResidentMemory`).

Upload: weights go from the memory-mapped file straight into a mapped arena (host-visible memory), or
through a ring of staging buffers (``np.frombuffer`` view of the mapped staging memory, one memcpy from the
file's pages, vkCmdCopyBuffer, fence) into device-local memory: no second copy of the model in RAM.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import vulkan as vk

from hmad.backends.vulkan.device import Device
from hmad.backends.vulkan.memory_plan import (
    DEFAULT_ALIGNMENT,
    HOST_VISIBLE,
    MIB,
    MemoryPlan,
    MemoryPlanError,
    align_up,
    choose_memory_type,
)
from hmad.backends.vulkan.vkerrors import check
from hmad.backends.vulkan.vkffi import ffi, lib, new

BUFFER_USAGE = (
    vk.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT
    | vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT
    | vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT
)


# -- device-side buffers -------------------------------------------------------------------------------------
# Arena serial numbers: unlike VkBuffer handles, which drivers hand out again once a buffer is destroyed
# (NVIDIA's and lavapipe both do), a serial is never reused: caches keyed by it cannot outlive their buffer.
_SERIALS = itertools.count(1)


class Arena:
    """One VkDeviceMemory with one VkBuffer over all of it; persistently mapped when host-visible.

    ``serial`` names it for caches (descriptor sets, barrier tracking): never reused in the process.
    """

    def __init__(self, device: Device, nbytes: int, memory_type: int):
        self.device, self.nbytes, self.memory_type = device, nbytes, memory_type
        self.serial = next(_SERIALS)
        self.flags = device.memory_types[memory_type].flags
        self.buffer = self.memory = None
        self.mapped: np.ndarray | None = None
        self._texel_views: dict[tuple[int, int, int], Any] = {}  # (offset, nbytes, VkFormat) -> VkBufferView
        d = device.handle
        bci = new(
            "VkBufferCreateInfo",
            sType=vk.VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO,
            size=nbytes,
            usage=BUFFER_USAGE | (vk.VK_BUFFER_USAGE_STORAGE_TEXEL_BUFFER_BIT if device.texel_loads else 0),
            sharingMode=vk.VK_SHARING_MODE_EXCLUSIVE,
        )
        buf = ffi.new("VkBuffer*")
        check(lib.vkCreateBuffer(d, bci, ffi.NULL, buf), "vkCreateBuffer")
        self.buffer = buf[0]
        req = new("VkMemoryRequirements")
        lib.vkGetBufferMemoryRequirements(d, self.buffer, req)
        if not req.memoryTypeBits & (1 << memory_type):
            self.close()
            raise MemoryPlanError(f"memory type {memory_type} cannot back a storage buffer on this device")
        mai = new(
            "VkMemoryAllocateInfo",
            sType=vk.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO,
            allocationSize=req.size,
            memoryTypeIndex=memory_type,
        )
        mem = ffi.new("VkDeviceMemory*")
        try:
            check(
                lib.vkAllocateMemory(d, mai, ffi.NULL, mem),
                f"vkAllocateMemory({nbytes} bytes, type {memory_type})",
            )
        except BaseException:
            self.close()
            raise
        self.memory = mem[0]
        check(lib.vkBindBufferMemory(d, self.buffer, self.memory, 0), "vkBindBufferMemory")
        if self.flags & HOST_VISIBLE:
            ptr = ffi.new("void**")
            check(lib.vkMapMemory(d, self.memory, 0, (1 << 64) - 1, 0, ptr), "vkMapMemory")
            self.mapped = np.frombuffer(ffi.buffer(ptr[0], nbytes), dtype=np.uint8)

    @property
    def host_visible(self) -> bool:
        return self.mapped is not None

    @property
    def closed(self) -> bool:
        return self.buffer is None

    def texel_view(self, offset: int, nbytes: int, vk_format: int):
        """The VkBufferView of ``nbytes`` at ``offset`` as texels of ``vk_format`` (a storage texel buffer's
        descriptor), made once and destroyed with the arena."""
        key = (offset, nbytes, vk_format)
        view = self._texel_views.get(key)
        if view is None:
            ci = new(
                "VkBufferViewCreateInfo",
                sType=vk.VK_STRUCTURE_TYPE_BUFFER_VIEW_CREATE_INFO,
                buffer=self.buffer,
                format=vk_format,
                offset=offset,
                range=nbytes,
            )
            out = ffi.new("VkBufferView*")
            check(lib.vkCreateBufferView(self.device.handle, ci, ffi.NULL, out), "vkCreateBufferView")
            view = self._texel_views[key] = out[0]
        return view

    def close(self) -> None:
        d = self.device.handle
        for view in self._texel_views.values():
            lib.vkDestroyBufferView(d, view, ffi.NULL)
        self._texel_views = {}
        if self.mapped is not None:
            self.mapped = None
            lib.vkUnmapMemory(d, self.memory)
        if self.buffer is not None:
            lib.vkDestroyBuffer(d, self.buffer, ffi.NULL)
            self.buffer = None
        if self.memory is not None:
            lib.vkFreeMemory(d, self.memory, ffi.NULL)
            self.memory = None


@dataclass
class BufferView:
    """A tensor's bytes: ``nbytes`` at ``offset`` in ``arena``. What a descriptor binds."""

    arena: Arena
    offset: int
    nbytes: int
    row_bytes: int = 0
    name: str = ""

    @property
    def buffer(self):
        return self.arena.buffer

    @property
    def host(self) -> np.ndarray | None:
        """The mapped bytes (uint8) when the arena is host-visible, else None."""
        m = self.arena.mapped
        return None if m is None else m[self.offset : self.offset + self.nbytes]

    def array(self, dtype, shape=None) -> np.ndarray:
        """A typed numpy view of the mapped bytes (host-visible arenas only)."""
        h = self.host
        if h is None:
            raise ValueError(f"{self.name or 'buffer'} is not host-visible; use Uploader.download()")
        a = h.view(dtype)
        return a if shape is None else a.reshape(shape)

    def ranges(self, max_range: int, alignment: int = DEFAULT_ALIGNMENT) -> list[tuple[int, int]]:
        """(offset, nbytes) pieces of at most ``max_range`` bytes, each aligned and holding whole rows."""
        if self.nbytes <= max_range:
            return [(self.offset, self.nbytes)]
        unit = math.lcm(self.row_bytes or 1, alignment)
        step = max_range // unit * unit
        if step == 0:
            raise MemoryPlanError(
                f"{self.name}: a row of {self.row_bytes} bytes exceeds the bind range {max_range}"
            )
        return [(self.offset + s, min(step, self.nbytes - s)) for s in range(0, self.nbytes, step)]


def create_buffer(device: Device, nbytes: int, kind: str = "device", name: str = "") -> BufferView:
    """A standalone buffer (its own arena) of ``kind`` device | host | upload | mapped | readback."""
    t = choose_memory_type(device.memory_types, kind, device.heaps)
    return BufferView(Arena(device, max(nbytes, 4), t.index), 0, nbytes, name=name)


class ResidentMemory:
    """A :class:`MemoryPlan` made real: its arenas allocated, one :class:`BufferView` per placed name."""

    def __init__(self, device: Device, plan: MemoryPlan):
        self.device, self.plan = device, plan
        self.arenas: dict[str, list[Arena]] = {}
        self.views: dict[str, BufferView] = {}
        try:
            for pool in plan.pools.values():
                self.arenas[pool.name] = [Arena(device, n, pool.memory_type) for n in pool.arenas]
        except BaseException:
            self.close()
            raise
        for name, p in plan.placements.items():
            self.views[name] = BufferView(self.arenas[p.pool][p.arena], p.offset, p.nbytes, p.row_bytes, name)

    def __getitem__(self, name: str) -> BufferView:
        return self.views[name]

    def close(self) -> None:
        for arenas in self.arenas.values():
            for a in arenas:
                a.close()
        self.arenas = {}


# -- upload and readback -------------------------------------------------------------------------------------
def _flat_bytes(src: np.ndarray) -> np.ndarray:
    """A uint8 view of a C-contiguous array (a memory-mapped tensor stays mapped: no copy)."""
    if not src.flags.c_contiguous:
        raise ValueError("upload source must be C-contiguous (tensors are views of their file)")
    return src.reshape(-1).view(np.uint8)


COPY_PIECE = 8 * MIB  # a host copy of more than this is split over COPY_THREADS threads
COPY_THREADS = min(8, os.cpu_count() or 1)
_copy_pool: ThreadPoolExecutor | None = None


def host_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[:] = src`` (uint8 arrays of one length), in pieces over a few threads when large.

    One thread's copy out of the page cache bounds a large model's load (docs/tuning.md); numpy releases
    the GIL while it copies, so the pieces run in parallel."""
    global _copy_pool
    n = src.nbytes
    if n <= COPY_PIECE or COPY_THREADS == 1:
        dst[:] = src
        return
    if _copy_pool is None:
        _copy_pool = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="hmad-copy")
    step = max(COPY_PIECE // 4, -(-n // COPY_THREADS))

    def piece(s: int) -> None:
        dst[s : s + step] = src[s : s + step]

    list(_copy_pool.map(piece, range(0, n, step)))


class _Slot:
    def __init__(self, device: Device, nbytes: int, pool):
        self.staging = create_buffer(device, nbytes, "upload", "staging")
        self.fence = device.create_fence(signaled=True)
        cba = new(
            "VkCommandBufferAllocateInfo",
            sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO,
            commandPool=pool,
            level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY,
            commandBufferCount=1,
        )
        cb = ffi.new("VkCommandBuffer*")
        check(lib.vkAllocateCommandBuffers(device.handle, cba, cb), "vkAllocateCommandBuffers")
        self.cmd = cb[0]
        self.used = 0
        self.copies: list[tuple[Any, int, int, int]] = []  # (dst buffer, src offset, dst offset, n)


class Uploader:
    """A ring of staging buffers for host -> device copies, and readback through a staging buffer.

    ``upload(view, src)`` writes straight into ``view`` when it is mapped (host-visible arena) unless
    ``force_staging``; otherwise it copies ``chunk_bytes`` at a time into the next free slot and submits a
    vkCmdCopyBuffer with that slot's fence. Small tensors share a slot (one submit for many copies).
    ``progress(done_bytes, total_bytes)`` is called after each chunk when given to :meth:`upload_all`.
    """

    def __init__(
        self, device: Device, chunk_bytes: int = 64 * MIB, slots: int = 3, force_staging: bool = False
    ):
        self.device, self.chunk, self.force_staging = device, chunk_bytes, force_staging
        self.pool = device.create_command_pool()  # its own: it may record while another thread does
        self.slots = [_Slot(device, chunk_bytes, self.pool) for _ in range(slots)]
        self.next = 0
        self.bytes_staged = 0

    def upload(
        self, view: BufferView, src: np.ndarray, on_chunk: Callable[[int], None] | None = None
    ) -> None:
        data = _flat_bytes(src)
        if data.nbytes > view.nbytes:
            raise ValueError(f"{view.name}: {data.nbytes} bytes do not fit {view.nbytes}")
        if view.host is not None and not self.force_staging:
            for s in range(0, data.nbytes, self.chunk):
                e = min(data.nbytes, s + self.chunk)
                host_copy(view.host[s:e], data[s:e])
                if on_chunk:
                    on_chunk(e - s)
            return
        for s in range(0, data.nbytes, self.chunk):
            e = min(data.nbytes, s + self.chunk)
            slot = self._slot_with_room(e - s)
            host_copy(slot.staging.host[slot.used : slot.used + e - s], data[s:e])
            slot.copies.append((view.buffer, slot.used, view.offset + s, e - s))
            slot.used += align_up(e - s, 16)
            self.bytes_staged += e - s
            if on_chunk:
                on_chunk(e - s)

    def upload_all(
        self,
        pairs: Iterable[tuple[BufferView, np.ndarray]],
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        """Upload every (view, source) pair, then wait; ``progress(done, total)`` after each chunk."""
        pairs = list(pairs)
        total, done = sum(int(a.nbytes) for _, a in pairs), 0

        def step(n: int) -> None:
            nonlocal done
            done += n
            if progress:
                progress(done, total)

        for view, src in pairs:
            self.upload(view, src, step)
        self.flush()

    def _slot_with_room(self, n: int) -> _Slot:
        slot = self.slots[self.next]
        if slot.used + n > self.chunk:
            self._submit(slot)
            self.next = (self.next + 1) % len(self.slots)
            slot = self.slots[self.next]
            self._wait(slot)
        return slot

    def _wait(self, slot: _Slot) -> None:
        f = ffi.new("VkFence*", slot.fence)
        check(lib.vkWaitForFences(self.device.handle, 1, f, 1, 60 * 10**9), "vkWaitForFences(staging)")
        slot.used, slot.copies = 0, []

    def _submit(self, slot: _Slot) -> None:
        if not slot.copies:
            return
        copies = [(slot.staging.buffer, dst, src_off, dst_off, n) for dst, src_off, dst_off, n in slot.copies]
        self._record_and_submit(slot, copies, "staging")
        slot.copies = []  # recorded; `used` stays until the fence says the bytes were read

    def _record_and_submit(self, slot: _Slot, copies: list, what: str) -> None:
        """Record (src buffer, dst buffer, src offset, dst offset, bytes) copies into the slot's command
        buffer and submit it with the slot's fence (the caller waits on it when it needs the bytes)."""
        cmd = slot.cmd
        begin = new(
            "VkCommandBufferBeginInfo",
            sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO,
            flags=vk.VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT,
        )
        check(lib.vkBeginCommandBuffer(cmd, begin), f"vkBeginCommandBuffer({what})")
        for src, dst, src_off, dst_off, n in copies:
            region = new("VkBufferCopy", srcOffset=src_off, dstOffset=dst_off, size=n)
            lib.vkCmdCopyBuffer(cmd, src, dst, 1, region)
        check(lib.vkEndCommandBuffer(cmd), f"vkEndCommandBuffer({what})")
        f = ffi.new("VkFence*", slot.fence)
        check(lib.vkResetFences(self.device.handle, 1, f), "vkResetFences")
        cmds = ffi.new("VkCommandBuffer[]", [cmd])
        si = new(
            "VkSubmitInfo", sType=vk.VK_STRUCTURE_TYPE_SUBMIT_INFO, commandBufferCount=1, pCommandBuffers=cmds
        )
        check(lib.vkQueueSubmit(self.device.queue, 1, si, slot.fence), f"vkQueueSubmit({what})")

    def flush(self) -> None:
        """Submit what is pending and wait for every slot (then the uploaded data is visible on the GPU)."""
        self._submit(self.slots[self.next])
        for slot in self.slots:
            self._wait(slot)

    def download(self, view: BufferView) -> np.ndarray:
        """A host copy (uint8) of ``view``'s bytes, through the staging ring when not mapped."""
        if view.host is not None and not self.force_staging:
            return view.host.copy()
        self.flush()
        out = np.empty(view.nbytes, np.uint8)
        slot = self.slots[self.next]
        for s in range(0, view.nbytes, self.chunk):
            n = min(self.chunk, view.nbytes - s)
            self._copy_to_slot(slot, view, s, n)
            out[s : s + n] = slot.staging.host[:n]
        return out

    def _copy_to_slot(self, slot: _Slot, view: BufferView, start: int, n: int) -> None:
        slot.copies = []
        copy = (view.buffer, slot.staging.buffer, view.offset + start, 0, n)
        self._record_and_submit(slot, [copy], "readback")
        self._wait(slot)

    def close(self) -> None:
        self.flush()
        for slot in self.slots:
            lib.vkFreeCommandBuffers(self.device.handle, self.pool, 1, ffi.new("VkCommandBuffer*", slot.cmd))
            lib.vkDestroyFence(self.device.handle, slot.fence, ffi.NULL)
            slot.staging.arena.close()
        self.slots = []
        if self.pool is not None:
            lib.vkDestroyCommandPool(self.device.handle, self.pool, ffi.NULL)
            self.pool = None
