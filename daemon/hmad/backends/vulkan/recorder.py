"""Recorded, replayable command buffers (:class:`CommandRecorder`) and the hazards that place their barriers.

The forward pass is recorded once per batch-size bucket into a :class:`CommandRecorder` and replayed every
step (one queue submit + one fence wait), with the per-step values (token ids, positions, sequence
lengths, block tables) written into a small host-visible buffer the shaders read.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import vulkan as vk

from hmad.backends.vulkan.descriptors import Binding, key_of
from hmad.backends.vulkan.device import Device
from hmad.backends.vulkan.memory import BufferView
from hmad.backends.vulkan.vkerrors import check
from hmad.backends.vulkan.vkffi import ffi, lib, new

if TYPE_CHECKING:
    from hmad.backends.vulkan.pipelines import Kernel


class Hazards:
    """Buffer ranges ``(arena serial, offset, nbytes)`` read and written since the last barrier."""

    def __init__(self):
        self.reads: list[tuple[int, int, int]] = []
        self.writes: list[tuple[int, int, int]] = []

    @staticmethod
    def _key(r) -> tuple[int, int, int]:
        serial, off, n = r
        return serial, off, off + n

    @staticmethod
    def _overlap(a: list, b: list) -> bool:
        return any(x[0] == y[0] and x[1] < y[2] and y[1] < x[2] for x in a for y in b)

    def conflicts(self, reads: list[tuple], writes: list[tuple]) -> bool:
        """Read-after-write, write-after-write or write-after-read against the pending ranges."""
        r, w = [self._key(x) for x in reads], [self._key(x) for x in writes]
        return self._overlap(self.writes, r + w) or self._overlap(self.reads, w)

    def add(self, reads: list[tuple], writes: list[tuple]) -> None:
        self.reads += [self._key(x) for x in reads]
        self.writes += [self._key(x) for x in writes]

    def clear(self) -> None:
        self.reads, self.writes = [], []


_ALL_ACCESS = (
    vk.VK_ACCESS_SHADER_READ_BIT
    | vk.VK_ACCESS_SHADER_WRITE_BIT
    | vk.VK_ACCESS_TRANSFER_READ_BIT
    | vk.VK_ACCESS_TRANSFER_WRITE_BIT
)
_WORK_STAGES = vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | vk.VK_PIPELINE_STAGE_TRANSFER_BIT


class CommandRecorder:
    """Dispatches and copies recorded into one command buffer, separated by barriers; submitted many times.

    ``begin()``, then ``dispatch()``/``copy()`` any number of times, ``end()``; then ``submit()`` as often as
    wanted (one vkQueueSubmit + one fence wait each; the host writes inputs into mapped buffers in between).
    With ``timestamps=True`` a timestamp is written before the first and after every command;
    :meth:`gpu_times` returns the GPU nanoseconds of each (label, ns) and of the whole submit.

    Barriers are placed from buffer ranges (:class:`Hazards`): a command waits for the earlier ones only
    when it reads or writes a range written since the last barrier, or writes a range read since then; so
    independent dispatches (q, k and v projections of one input) run back to back and may overlap on the
    GPU. A kernel's writes are the bindings its SPIR-V does not declare ``readonly``.
    """

    def __init__(self, device: Device, timestamps: bool = False, max_commands: int = 4096):
        self.device = device
        self.timestamps = timestamps and device.caps["timestamps"]
        self.max_queries = max_commands + 1
        self.labels: list[str] = []
        cba = new(
            "VkCommandBufferAllocateInfo",
            sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO,
            commandPool=device.command_pool,
            level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY,
            commandBufferCount=1,
        )
        self._cmds = ffi.new("VkCommandBuffer[]", 1)
        check(lib.vkAllocateCommandBuffers(device.handle, cba, self._cmds), "vkAllocateCommandBuffers")
        self.cmd = self._cmds[0]
        self.fence = device.create_fence()
        self._fences = ffi.new("VkFence[]", [self.fence])
        self._submit_info = new(
            "VkSubmitInfo",
            sType=vk.VK_STRUCTURE_TYPE_SUBMIT_INFO,
            commandBufferCount=1,
            pCommandBuffers=self._cmds,
        )
        self.query_pool = self._create_query_pool() if self.timestamps else None
        self._recording = False
        self.submits = 0
        self.hazards = Hazards()
        self.barriers = 0  # placed by the last recording (a test and the benchmarks read it)

    def _create_query_pool(self):
        ci = new(
            "VkQueryPoolCreateInfo",
            sType=vk.VK_STRUCTURE_TYPE_QUERY_POOL_CREATE_INFO,
            queryType=vk.VK_QUERY_TYPE_TIMESTAMP,
            queryCount=self.max_queries,
        )
        out = ffi.new("VkQueryPool*")
        check(lib.vkCreateQueryPool(self.device.handle, ci, ffi.NULL, out), "vkCreateQueryPool")
        return out[0]

    def begin(self, simultaneous: bool = False) -> CommandRecorder:
        """Start recording. ``simultaneous``: the buffer may be submitted again while an earlier submit of it
        is still pending (a pipelined step of the same bucket as the one before it)."""
        check(lib.vkResetCommandBuffer(self.cmd, 0), "vkResetCommandBuffer")
        flags = vk.VK_COMMAND_BUFFER_USAGE_SIMULTANEOUS_USE_BIT if simultaneous else 0
        bi = new(
            "VkCommandBufferBeginInfo", sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO, flags=flags
        )
        check(lib.vkBeginCommandBuffer(self.cmd, bi), "vkBeginCommandBuffer")
        self.labels, self._recording = [], True
        self.hazards, self.barriers = Hazards(), 0
        if self.query_pool is not None:
            lib.vkCmdResetQueryPool(self.cmd, self.query_pool, 0, self.max_queries)
            lib.vkCmdWriteTimestamp(self.cmd, vk.VK_PIPELINE_STAGE_TOP_OF_PIPE_BIT, self.query_pool, 0)
        return self

    def barrier(self, dst_stage: int = _WORK_STAGES, dst_access: int = _ALL_ACCESS) -> None:
        mb = new(
            "VkMemoryBarrier",
            sType=vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER,
            srcAccessMask=vk.VK_ACCESS_SHADER_WRITE_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT,
            dstAccessMask=dst_access,
        )
        lib.vkCmdPipelineBarrier(self.cmd, _WORK_STAGES, dst_stage, 0, 1, mb, 0, ffi.NULL, 0, ffi.NULL)
        self.hazards.clear()
        self.barriers += 1

    def _order(self, reads: list[tuple], writes: list[tuple]) -> None:
        """A barrier first when this command depends on, or overwrites, work since the last one."""
        if self.hazards.conflicts(reads, writes):
            self.barrier()
        self.hazards.add(reads, writes)

    def _after(self, label: str) -> None:
        self.labels.append(label)
        if self.query_pool is not None:  # a timestamp after every command: the pool bounds their count
            if len(self.labels) >= self.max_queries:
                raise ValueError(f"more than {self.max_queries - 1} timestamped commands: raise max_commands")
            stage = vk.VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT
            lib.vkCmdWriteTimestamp(self.cmd, stage, self.query_pool, len(self.labels))

    def dispatch(self, kernel: Kernel, buffers: Sequence[Binding], push, groups, label: str = "") -> None:
        assert self._recording, "begin() first"
        kernel.check_args(buffers, push)
        keys = [key_of(b) for b in buffers]
        writes = [keys[i] for i in kernel.written]
        self._order([r for i, r in enumerate(keys) if i not in kernel.written], writes)
        kernel.record(self.cmd, buffers, push, groups)
        self._after(label or kernel.name)

    def copy(self, src: BufferView, dst: BufferView, nbytes: int | None = None, label: str = "copy") -> None:
        assert self._recording, "begin() first"
        n = src.nbytes if nbytes is None else nbytes
        self._order([key_of((src, 0, n))], [key_of((dst, 0, n))])
        region = new("VkBufferCopy", srcOffset=src.offset, dstOffset=dst.offset, size=n)
        lib.vkCmdCopyBuffer(self.cmd, src.buffer, dst.buffer, 1, region)
        self._after(label)

    def fill(self, dst: BufferView, value: int = 0, label: str = "fill") -> None:
        """Set every 32-bit word of ``dst`` to ``value`` (vkCmdFillBuffer; ``dst``'s size a multiple of 4)."""
        assert self._recording, "begin() first"
        self._order([], [key_of(dst)])
        lib.vkCmdFillBuffer(self.cmd, dst.buffer, dst.offset, dst.nbytes, value)
        self._after(label)

    def end(self) -> CommandRecorder:
        # Make the last writes visible to the host (mapped readback) after the fence.
        self.barrier(vk.VK_PIPELINE_STAGE_HOST_BIT, vk.VK_ACCESS_HOST_READ_BIT)
        check(lib.vkEndCommandBuffer(self.cmd), "vkEndCommandBuffer")
        self._recording = False
        return self

    def submit(self, wait: bool = True, timeout_s: float = 60.0) -> float:
        """Run the recorded buffer once; returns host seconds from submit to fence (when ``wait``)."""
        assert not self._recording, "end() first"
        t0 = time.perf_counter()
        check(lib.vkResetFences(self.device.handle, 1, self._fences), "vkResetFences")
        check(lib.vkQueueSubmit(self.device.queue, 1, self._submit_info, self.fence), "vkQueueSubmit")
        self.submits += 1
        if wait:
            self.wait(timeout_s)
        return time.perf_counter() - t0

    def wait(self, timeout_s: float = 60.0) -> None:
        r = lib.vkWaitForFences(self.device.handle, 1, self._fences, 1, int(timeout_s * 1e9))
        check(r, "vkWaitForFences(recorded step)")

    def gpu_times(self) -> dict[str, Any]:
        """GPU ns per command and for the whole buffer, from the last submit's timestamps."""
        if self.query_pool is None:
            return {}
        n = len(self.labels) + 1
        data = np.zeros(n, np.uint64)
        flags = vk.VK_QUERY_RESULT_64_BIT | vk.VK_QUERY_RESULT_WAIT_BIT
        r = lib.vkGetQueryPoolResults(
            self.device.handle, self.query_pool, 0, n, data.nbytes, ffi.from_buffer(data), 8, flags
        )
        check(r, "vkGetQueryPoolResults")
        bits = self.device.info.timestamp_valid_bits
        if bits < 64:
            data &= np.uint64((1 << bits) - 1)
        ns = np.diff(data.astype(np.int64)) * self.device.limits["timestampPeriod"]
        return {
            "total_ns": float(ns.sum()),
            "commands": [(lab, float(t)) for lab, t in zip(self.labels, ns, strict=True)],
        }

    def close(self) -> None:
        d = self.device.handle
        if self.submits:
            lib.vkWaitForFences(d, 1, self._fences, 1, 10**10)
        lib.vkFreeCommandBuffers(d, self.device.command_pool, 1, self._cmds)
        lib.vkDestroyFence(d, self.fence, ffi.NULL)
        if self.query_pool is not None:
            lib.vkDestroyQueryPool(d, self.query_pool, ffi.NULL)
