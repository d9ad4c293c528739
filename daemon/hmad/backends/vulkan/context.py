"""RecordContext: what every op reads and appends to while a step's forward pass is recorded.

One per backend, alive as long as it. It holds the device and its capabilities, the resolved options (the
kernel choices of policy.py read them), the kernel registry, the scratch pool and the small per-dispatch
rings, and the buffers a recording binds: the device-local step metadata (``meta_gpu``), the per-parity
mapped metadata, logit-adjustment and token-id buffers (the step heads and tails bind them), and the KV
pools' views. While a bucket is recorded (:meth:`recording`) it also holds the command recorder, the
bucket's metadata layout (the word offsets the ops bake into their push constants) and the token bucket.
The op modules (ops_norm, ops_matmul, ops_attention) are functions of a context; the facade (backend.py)
owns one and points them at it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import numpy as np

from hmad.backends.vulkan.activations import Act, Ring, ScratchPool
from hmad.backends.vulkan.bias import BUFFER_WORDS
from hmad.backends.vulkan.device import Device
from hmad.backends.vulkan.memory import BufferView, create_buffer
from hmad.backends.vulkan.options import VulkanOptions
from hmad.backends.vulkan.pipelines import KERNELS, DescriptorAllocator, Kernel
from hmad.backends.vulkan.policy import DeviceCaps
from hmad.backends.vulkan.recorder import CommandRecorder
from hmad.backends.vulkan.stepmeta import StepMetaLayout
from hmad.core.kv_layout import KVLayout

# the workgroup size of the kernels that take a row a workgroup (row_scale, geglu_row_scale), where the device
# allows it: few rows (decode batches) leave few workgroups, each with a whole row to read (docs/tuning.md)
ROW_BLOCK = 1024
# the arrival counters of the fused kernels' tails (shaders/arrive.glsl): a ring of ranges, one a dispatch
COUNTER_BYTES = 256 << 10


class RecordContext:
    """The device, options, kernels, scratch and bound buffers of the recording ops (module docstring)."""

    def __init__(self, dev: Device, caps: DeviceCaps, options: VulkanOptions):
        self.dev, self.caps, self.options = dev, caps, options  # options: resolved (policy.resolve)
        self.max_range = dev.limits["maxStorageBufferRange"]
        self.align = max(256, dev.limits["minStorageBufferOffsetAlignment"])
        self.kernels: dict[str, Kernel] = {}
        # One allocator for every kernel, large pools: a model's recordings make thousands of sets.
        bindings = max(spec.n_buffers for spec in KERNELS.values())
        self.descriptors = DescriptorAllocator(dev, sets_per_pool=4096, max_bindings=bindings)
        self.scratch = ScratchPool(dev)
        # the workgroup size of row_scale and geglu_row_scale: ROW_BLOCK, or the device's most (a power of 2)
        most = dev.limits["maxComputeWorkGroupInvocations"]
        self.row_block = min(ROW_BLOCK, 1 << (most.bit_length() - 1))
        self.residency: dict[str, int] = {}  # coopmat kernel -> workgroups resident at once (0: unknown)
        # the fused tails' arrival counters (zero between uses), and the prefetches' few bytes of output
        self.counters = Ring(dev, COUNTER_BYTES, self.align, "arrival counters")
        self.sinks = Ring(dev, 64 << 10, self.align, "prefetch sinks")
        self.norm = "rms_norm_f32_subgroup" if caps.subgroup_arithmetic else "rms_norm_f32"
        # the KV pools (alloc_kv) and the step buffers (grow_meta) the recordings bind
        self.kv_layout: KVLayout | None = None
        self.kv_views: dict[tuple[str, int], tuple[BufferView, BufferView]] = {}
        # per parity (backend.py, "Pipelining"): the mapped buffer the host writes a step's metadata into and
        # the ids its argmax writes; and the device-local copy of the metadata every kernel reads
        self.metas: list[BufferView] = []
        self.meta_gpu: BufferView | None = None
        self.ids: list[BufferView] = []
        # per parity: the mapped buffer of the step's logit adjustments (bias.py), read by the tails
        self.biases: list[BufferView] = []
        # the steps' input embeddings (an image's soft tokens): one mapped buffer of two halves, one a
        # parity, made when the first recording's embed binds it (:meth:`input_embeds`); rows a half holds
        self.embeds: BufferView | None = None
        self.embeds_rows = self.embeds_dim = 0
        self.meta_tokens = 0  # the token bucket the metadata buffers were grown for
        # while a bucket is recorded: its recorder, metadata layout and token bucket
        self.rec: CommandRecorder | None = None
        self.layout: StepMetaLayout | None = None
        self.t_b = 0

    @contextlib.contextmanager
    def recording(self, rec: CommandRecorder, layout: StepMetaLayout, t_b: int) -> Iterator[None]:
        """The ops append to ``rec`` with ``layout``'s offsets for bucket ``t_b`` inside this block."""
        self.scratch.begin()
        self.rec, self.layout, self.t_b = rec, layout, t_b
        try:
            yield
        finally:
            self.rec = self.layout = None

    # -- kernels and scratch -----------------------------------------------------------------------------
    def kernel(self, name: str, block: int | None = None) -> Kernel:
        """The kernel ``name`` (at workgroup size ``block``, else its spec's), built once."""
        key = name if block is None else f"{name}@{block}"
        k = self.kernels.get(key)
        if k is None:
            k = self.kernels[key] = Kernel(self.dev, name, block_size=block, descriptors=self.descriptors)
        return k

    def new(self, shape: tuple[int, ...]) -> Act:
        return Act(self.scratch.take(4 * math.prod(shape)), shape)

    def new_q8(self, t: int, k: int, planes: int = 1) -> tuple[Act, Act]:
        """Scratch for (T, K) values quantized for the int8 mat-vec: xq (T, planes * K/4) words,
        xd (T, K/32, 2)."""
        return self.new((t, planes * k // 4)), self.new((t, k // 32, 2))

    def new_row_scales(self, t: int, k: int) -> tuple[Act, Act]:
        """Scratch for (T, K) values as the cooperative-matrix GEMM reads them (row_scale.comp): the row
        scales (T,), xh (T, K/2) words of two float16."""
        return self.new((t,)), self.new((t, k // 2))

    def dispatch(self, name: str, buffers, push, groups, block: int | None = None) -> None:
        assert self.rec is not None, "VulkanBackend ops run only while recording (through run())"
        k = self.kernel(name, block)
        self.rec.dispatch(k, buffers, push, groups if isinstance(groups, tuple) else k.groups_for(groups))

    @staticmethod
    def grid(n: int, block: int = 256, cap: int = 4096) -> int:
        """Workgroups for a grid-stride loop over ``n`` items."""
        return max(1, min(cap, -(-n // block)))

    def kv_pool(self, layer: int) -> tuple[str, BufferView, BufferView, int]:
        """(pool, K view, V view, the metadata offset of the step's slots in it) of ``layer``'s cache."""
        pool, slot = self.kv_layout.pool_of(layer)
        kp, vp = self.kv_views[(pool, slot)]
        return pool, kp, vp, self.layout.slot_global if pool == "global" else self.layout.slot_local

    # -- the step buffers --------------------------------------------------------------------------------
    def meta_fits(self, words: int) -> bool:
        return self.meta_gpu is not None and self.meta_gpu.nbytes >= 4 * words

    def grow_meta(self, words: int, t_b: int) -> None:
        """New metadata buffers of ``words`` words, and id buffers of at least ``t_b`` rows (the recordings
        that bound the old ones dropped first: Recordings.ensure_meta)."""
        for b in (*self.metas, self.meta_gpu):
            if b is not None:
                b.arena.close()
        self.close_embeds()  # sized by the token bucket: made again by the next recording's embed
        self.meta_tokens = t_b
        # Two mapped buffers (one per parity) and the device-local copy the kernels read: on a dGPU every
        # kernel's read of mapped memory would pay the bus latency, on the dependent chain of slot -> KV row;
        # and a step's head copies its parity's few KiB there after the step before it is done reading
        self.metas = [create_buffer(self.dev, 4 * words, "mapped", f"step metadata {p}") for p in range(2)]
        self.meta_gpu = create_buffer(self.dev, 4 * words, "device", "step metadata (device copy)")
        if not self.biases:
            self.biases = [
                create_buffer(self.dev, 4 * BUFFER_WORDS, "mapped", f"logit bias {p}") for p in range(2)
            ]
            for b in self.biases:
                b.array(np.uint32)[0] = 0  # no entries until a step writes some
        if not self.ids or self.ids[0].nbytes < 4 * t_b:
            old = self.ids
            self.ids = [create_buffer(self.dev, 4 * t_b, "readback", f"token ids {p}") for p in range(2)]
            for a, b in zip(old, self.ids, strict=False):  # a step collected after this still finds its ids
                b.array(np.uint32)[: a.nbytes // 4] = a.array(np.uint32)
                a.arena.close()

    def input_embeds(self, dim: int) -> BufferView:
        """The mapped buffer of the steps' input embeddings, rows of ``dim`` float32, made on first use: two
        halves (one per parity: a step launched while the other is in flight writes the other half) of
        ``embeds_rows`` rows each, the metadata's token bucket or what one binding range holds. Recordings
        bind it, so it lives until the metadata grows (:meth:`grow_meta`, which drops them first)."""
        if self.embeds is None:
            self.embeds_rows = max(1, min(self.meta_tokens, self.max_range // (2 * 4 * dim)))
            nbytes = 2 * 4 * dim * self.embeds_rows
            self.embeds = create_buffer(self.dev, nbytes, "mapped", "input embeddings")
            self.embeds_dim = dim
        assert self.embeds_dim == dim, "one model a backend: input embeddings of one width"
        return self.embeds

    def close_embeds(self) -> None:
        if self.embeds is not None:
            self.embeds.arena.close()
        self.embeds, self.embeds_rows = None, 0

    def close_meta(self) -> None:
        for b in (*self.metas, self.meta_gpu, *self.ids, *self.biases):
            if b is not None:
                b.arena.close()
        self.metas, self.meta_gpu, self.ids, self.biases = [], None, [], []
        self.close_embeds()

    def close_kernels(self) -> None:
        """The kernels, their descriptor sets and the scratch pool."""
        for k in self.kernels.values():
            k.close()
        self.kernels = {}
        self.descriptors.close()
        self.scratch.close()

    def close_rings(self) -> None:
        self.counters.close()
        self.sinks.close()
