"""Activations while a step is recorded: scratch ranges, and the handles the forward pass hands between ops.

An :class:`Act` is a scratch range and a (padded) shape; the forward pass never reads its values, it only
hands it from op to op while the ops append dispatches. Scratch comes from a :class:`ScratchPool` of
device-local buffers: a range returns to the pool when the last handle to it dies (CPython reference counting
during the straight-line forward pass), so the live set stays a few activations, and recordings share buffers
(steps never overlap). A :class:`Ring` hands out small per-dispatch ranges (the fused tails' arrival
counters, the prefetches' sinks) whose reuse the recorder's barriers order.
"""

from __future__ import annotations

import math
import weakref

from hmad.backends.vulkan.device import Device
from hmad.backends.vulkan.memory import BufferView, create_buffer
from hmad.backends.vulkan.memory_plan import align_up


class _Buf:
    """A scratch range owned by one recording epoch; returned to the pool when the last Act drops it."""

    __slots__ = ("view", "__weakref__")

    def __init__(self, view: BufferView):
        self.view = view


class Act:
    """A recorded activation: a scratch range and its (padded) shape. ``reshape`` shares the range.

    ``q8``: the same values quantized for the int8 mat-vec (xq words, xd block scales: shaders/q8act.glsl),
    once some op made them (residual_norm writes them with h; matmul quantizes on first use and keeps them).
    ``scale``: (its rows' float16-range scales, the float16 copy x / scale) for the cooperative-matrix
    mat-mat (row_scale.comp), made on first use and kept, so q, k and v (or gate and up) share them.
    ``parts``: (a GEMM's K-split partial sums of the values, how many, their scratch) where they were left
    unsummed (``matmul_for_residual``, ``matmuls_for_attention``): the values are not in ``buf``, and only
    the op they were left for reads them (residual_norm, normed_attention).
    """

    __slots__ = ("buf", "shape", "q8", "scale", "parts")

    def __init__(self, buf: _Buf, shape: tuple[int, ...]):
        self.buf, self.shape, self.q8, self.scale, self.parts = buf, tuple(shape), None, None, None

    @property
    def view(self) -> BufferView:
        assert self.parts is None, "an Act left as partial sums is read only by the op they were left for"
        return self.buf.view

    @property
    def size(self) -> int:
        return math.prod(self.shape)


class Ring:
    """Small aligned ranges of one device buffer, handed out in turn and wrapping: per-dispatch scratch whose
    reuse the recorder's barriers order (a range is reused only after its last dispatch is done with it)."""

    def __init__(self, device: Device, nbytes: int, align: int, name: str):
        self.device, self.nbytes, self.align, self.name = device, nbytes, align, name
        self.buffer: BufferView | None = None  # made on first use
        self.at = 0

    def whole(self) -> BufferView:
        if self.buffer is None:
            self.buffer = create_buffer(self.device, self.nbytes, "device", self.name)
        return self.buffer

    def take(self, nbytes: int) -> BufferView:
        ring, nbytes = self.whole(), align_up(nbytes, self.align)
        assert nbytes <= ring.nbytes, f"{nbytes} bytes: more than {self.name}'s {ring.nbytes}"
        if self.at + nbytes > ring.nbytes:
            self.at = 0
        view = BufferView(ring.arena, ring.offset + self.at, nbytes, name=self.name)
        self.at += nbytes
        return view

    def close(self) -> None:
        if self.buffer is not None:
            self.buffer.arena.close()
        self.buffer = None


class ScratchPool:
    """Device-local activation buffers, reused across and within recordings (best fit by size)."""

    def __init__(self, device: Device, min_bytes: int = 64 << 10):
        self.device, self.min_bytes = device, min_bytes
        self.buffers: list[BufferView] = []
        self.free: list[BufferView] = []
        self.epoch = 0

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buffers)

    def begin(self) -> None:
        """A new recording: every buffer is free again (recordings never run at the same time)."""
        self.epoch += 1
        self.free = list(self.buffers)

    def take(self, nbytes: int) -> _Buf:
        fits = [b for b in self.free if b.nbytes >= nbytes]
        if fits:
            whole = min(fits, key=lambda b: b.nbytes)
            self.free.remove(whole)
        else:
            cap = self.device.limits["maxStorageBufferRange"]
            if nbytes > cap:
                raise ValueError(f"an activation of {nbytes} bytes exceeds maxStorageBufferRange {cap}")
            size = min(max(self.min_bytes, 1 << (nbytes - 1).bit_length()), cap)
            whole = create_buffer(self.device, size, "device", "scratch")
            self.buffers.append(whole)
        buf = _Buf(BufferView(whole.arena, whole.offset, nbytes, name="scratch"))
        weakref.finalize(buf, self._give, whole, self.epoch)
        return buf

    def _give(self, whole: BufferView, epoch: int) -> None:
        if epoch == self.epoch:
            self.free.append(whole)

    def close(self) -> None:
        for b in self.buffers:
            b.arena.close()
        self.buffers, self.free = [], []


def rows(v: BufferView, t0: int, n: int, row_bytes: int) -> BufferView:
    """Rows t0 .. t0+n-1 of an activation whose rows are ``row_bytes`` apart."""
    return BufferView(v.arena, v.offset + t0 * row_bytes, n * row_bytes, name=v.name)
