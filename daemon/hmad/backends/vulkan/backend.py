"""VulkanBackend: the Gemma 3 forward pass recorded into a command buffer once per batch-size bucket.

Design (why not "ops become no-ops on replay"): :meth:`Backend.run` is the step entry point
(``Model.forward`` calls ``backend.run(net, batch)``; the CPU backend's ``run`` is just ``net.forward``).
Here ``run`` does, per step:

1. **bucket**: T tokens -> ``T_b`` (1, 2, 4 ... 512, then multiples of 512), S_out logit rows -> ``O_b``
   (the same ladder, at least 1); the key ``(T_b, O_b)`` names one recording;
2. **metadata**: :class:`StepMetaLayout` ``(T_b, T_b, max_table)`` packs the real batch into a host-visible
   metadata buffer, one of two ("Pipelining" below); rows past T are padding (token 0, slots NONE, so
   kv_write skips them and attention writes zeros; logit rows past S_out point at row 0, never read back);
3. **record once**: with no recording for the key, ``net.forward`` runs *once* on a shape-only batch of
   ``T_b`` rows while the ops append dispatches to a :class:`CommandRecorder` instead of computing
   (activations are :class:`Act` handles = a scratch range + a shape; ``reshape`` is a view). Later steps of
   the bucket skip ``net.forward`` entirely: no Python per op on the hot path;
4. ``to_numpy(logits)`` / ``greedy(logits)`` submit the step's command buffer between a tiny *head* (the
   metadata into device memory) and a tiny per-bucket *tail* (copy the logits rows into a host-visible
   readback buffer, or argmax them into a mapped id buffer) in **one** vkQueueSubmit with one fence wait,
   and read back only S_out × V floats or S_out ids (``launch_greedy`` + ``collect``: the same, split).

Every per-step value (token ids, positions, slots, block tables) is read by the shaders from the metadata
buffer at word offsets baked into the recorded push constants, so a recording is valid for any batch of its
bucket. Scratch: each recording allocates its activations from a shared pool of device-local buffers
(:class:`ScratchPool`); a buffer returns to the pool when the last handle to it dies (CPython reference
counting during the straight-line forward pass), so the live set stays a few activations, and recordings
share buffers (steps never overlap: each step's *head* command buffer starts with a barrier after everything
submitted before it).

Pipelining (``launch_greedy`` / ``collect``; engine/scheduler.py, "Pipelining"): the scheduler may submit
step n + 1 before it has read step n's token ids. So the host side of a step comes in two parities: two
mapped metadata buffers, two id buffers, two fences, and per recording two heads and two argmax tails. A
step's head copies its parity's metadata into the device-local copy every kernel reads, then (when the
batch has ``feed`` rows) runs feed_tokens.comp, which writes into the tokens section the ids the step
before it (the other parity) computed. The recorded forward pass itself is one command buffer per bucket,
begun with SIMULTANEOUS_USE, since two steps of one bucket can be pending at once. A step whose requests
sample (``launch_sampled``) ends with a *sample tail* instead of the argmax: topk.comp into its parity's
candidates buffer, then sample_topk.comp, which draws each row's token from them with the row's sampling
and uniform (the metadata's ``sample`` section) into the parity's ids; the host reads the candidates too
(``candidates``) and checks each token against its own draw.

Memory plan (``load_weights``): 1-D tensors (norms), the token embedding and the output projection are
*hot* and placed first; the other weights follow in file (= forward) order into the device-local pool while
it has room (``device_local_bytes`` caps it), the rest spill to the host-visible pool (an APU's GTT, a dGPU's
system heap). The KV pools are planned in ``alloc_kv`` into what the weights left, device-local first.
Norm weights are uploaded as float32; a 2-D weight of a type no matmul shader reads is dequantized to
float16 on the host first (the only case where a second copy of a tensor exists in RAM, briefly).
Matmul: decode-sized steps (T_b <= 32, 8 tokens a dispatch) on the mat-vec chosen by ``matvec``: "exact"
(default; activations as three int8 planes, shaders/q8act.glsl: float32-class), "int8" (one plane) or
"float" (float32); exact-path steps of ``mmq_min_tokens`` (3) or more on big Q4_K weights on the int8
cooperative-matrix GEMM where the device has int8 products (``mmq="auto"``, kernels_mmq.py: the same
arithmetic, the three planes' products on the matrix units); steps of ``coopmat_min_tokens`` or more on big
weights, and prefill, on the
cooperative-matrix mat-mat where the device offers float16 cooperative matrices (``coopmat="auto"``), else
the tiled float32 mat-mat. Weights beyond maxStorageBufferRange are bound in ranges (record_matmul, and
embed's row_begin/n_rows).
Fused (the ops of backends/base.py that Gemma3 calls): residual_norm (post-norm + residual + next pre-norm,
one dispatch that also writes h as the mat-vec's int8 planes), normed_attention (per-head q/k norm + RoPE +
the KV-cache write in one dispatch, norm_rope_kv.comp), geglu_matmul (gate and up projections + GeGLU in one
mat-vec dispatch; at one token its last workgroups also quantize the output for the down projection,
matvec_qout.glsl); attention's reduce pass also writes its output as int8 planes; the GEMMs' K-split partial
sums go unsummed into the op reading them, which adds them (q, k, v: norm_rope_kv; o, down: residual_norm;
matmuls_for_attention, matmul_for_residual). ``fuse`` (FUSIONS) turns the norm_rope_kv, q8-tail and
split-sum fusions off (to measure them, or on a driver where cross-workgroup reads misbehave). Activations
are quantized once per input (Act.q8), the GEMM's float16 copy made once per input (Act.scale), and
independent dispatches (q, k, v; the 8-token chunks) carry no barrier between them (CommandRecorder).
Deterministic (``deterministic``, engine.deterministic; docs/determinism.md): one kernel and one reduction
order per row whatever the step's row count, so a sequence's logits are bit-identical alone or in any mix:
every matmul on the mat-vec (the int8 one in one fixed layout, else the float one), 8 tokens a dispatch,
never the cooperative-matrix or tiled mat-mat; the int8 planes of x always made by the op before (the
residual norm, attention's reduce pass); attention in DETERMINISTIC_SPLITS splits for every bucket (a
split's keys then depend on the row's position only) and never the prefill tiles.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import vulkan as vk

from hmad.backends.base import Backend
from hmad.backends.vulkan import policy
from hmad.backends.vulkan.device import Device, check, ffi, lib, new
from hmad.backends.vulkan.kernels_matmul import (
    MATMUL_TYPES,
    MATVEC_MAX_T,
    UNIT_TYPES,
    coopmat_kernel_name,
    coopmat_q4k_layout,
    q8_matvec_layout,
    record_coopmat,
    record_coopmat_geglu,
    record_matmul,
    record_matvec_q8,
    record_row_scale,
    record_split_sums,
)
from hmad.backends.vulkan.kernels_mmq import (
    mmq_pick,
    record_mmq,
    record_mmq_geglu,
)
from hmad.backends.vulkan.memory import (
    BufferView,
    MemoryPlan,
    PlanItem,
    ResidentMemory,
    Uploader,
    create_buffer,
    plan_memory,
)
from hmad.backends.vulkan.options import FUSIONS, KV_DTYPES, VulkanOptions
from hmad.backends.vulkan.pipelines import (
    ARGMAX_CHUNKS,
    ATTENTION_PREFILL_TILE,
    KERNELS,
    RESIDUAL_MAX_COLS,
    AddPush,
    ArgmaxPush,
    AttentionPrefillPush,
    AttentionReducePush,
    AttentionSplitPush,
    CommandRecorder,
    CopyPush,
    DescriptorAllocator,
    EmbedDqPush,
    EmbedPush,
    FeedPush,
    GegluPush,
    Kernel,
    KvWritePush,
    NormRopeKvPush,
    NormRopePush,
    QuantizeQ8Push,
    ResidualNormPush,
    RmsNormPush,
    RopePush,
    SampleTopkPush,
    TopkPush,
    attention_prefill_groups,
    residual_block,
    topk_chunk,
    topk_chunks,
)
from hmad.backends.vulkan.policy import (
    ATTENTION_MAX_SPLITS,
    Q8_MAX_T,
)
from hmad.backends.vulkan.residency import probe_residency
from hmad.backends.vulkan.stepmeta import StepMetaLayout
from hmad.core.batch import SeqSlice, StepBatch
from hmad.core.kv_layout import KVLayout
from hmad.core.tensors import QType, WeightTensor

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
# the embedding gather reads every type a weight is uploaded in (embed.comp: float and Q8_0 tables;
# embed_dq.comp: the other block types through dequant.glsl), so no table is ever converted for it
EMBED_TYPES = {q: name for name, q in MATMUL_TYPES.items()}
MIB = 1 << 20
# the attention kernels' limits: a head's values (a multiple of 4: vec4s) and query heads per KV head
ATTENTION_MAX_HEAD_DIM = 256
ATTENTION_MAX_GROUP = 8
# deterministic mode: the split count of every bucket (the partials are T x H x splits x (Dh + 4) floats: at
# 512 tokens of the 27B, 136 MB)
DETERMINISTIC_SPLITS = 16
# attention_prefill.comp (tiles of a step's prefill rows, K/V chunks shared by a tile) in buckets of at least
# this many rows, for sequences with at least this many rows in the step; the others keep the per-row kernels.
# Not in decode-batch buckets (<= 32): its dispatch costs even when no row is in a tile (docs/tuning.md)
ATTENTION_TILE_MIN_BUCKET = 64
ATTENTION_TILE_MIN_ROWS = 8
# candidates per row of the on-device top-k (topk.comp): Gemma's top_k 64 plus up to 64 penalized tokens
TOPK_CANDIDATES = 128
# the workgroup size of the kernels that take a row a workgroup (row_scale, geglu_row_scale), where the device
# allows it: few rows (decode batches) leave few workgroups, each with a whole row to read (docs/tuning.md)
ROW_BLOCK = 1024
# the arrival counters of the fused kernels' tails (shaders/arrive.glsl): a ring of ranges, one a dispatch
COUNTER_BYTES = 256 << 10


def across_bus(dev: Device, view: BufferView) -> bool:
    """Whether ``view`` lives in memory the GPU reads across the bus: host memory of a discrete GPU without a
    host-visible VRAM window (ReBAR); an APU's memory is all device-local."""
    return not dev.memory_types[view.arena.memory_type].flags & vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT


def _attention_limits(head_dim: int, group: int) -> str | None:
    """Why the attention kernels cannot take heads of ``head_dim`` values with ``group`` query heads per KV
    head, or None where they can."""
    if head_dim <= ATTENTION_MAX_HEAD_DIM and head_dim % 4 == 0 and group <= ATTENTION_MAX_GROUP:
        return None
    return (
        f"heads of {head_dim} values with {group} query heads per KV head; its attention kernels take "
        f"heads of at most {ATTENTION_MAX_HEAD_DIM} values (a multiple of 4) and at most "
        f"{ATTENTION_MAX_GROUP} query heads per KV head (the cpu backend runs any)"
    )


def bucket(n: int) -> int:
    """The padded size of ``n`` rows: the next of :data:`BUCKETS`, then multiples of the largest."""
    for b in BUCKETS:
        if n <= b:
            return b
    return -(-n // BUCKETS[-1]) * BUCKETS[-1]


def buckets_upto(top: int) -> list[int]:
    """Every bucket a step of at most ``top`` tokens can fall in, ascending."""
    return sorted({b for b in BUCKETS if b <= top} | set(range(BUCKETS[-1], top + 1, BUCKETS[-1])) | {top})


@dataclass
class VkWeight:
    """A resident weight: its bytes on the GPU as stored in the file (or converted, see the docstring)."""

    name: str
    view: BufferView
    qtype: QType
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.view.nbytes


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
        ring, nbytes = self.whole(), -(-nbytes // self.align) * self.align
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


@dataclass
class Graph:
    """One bucket's recording: the forward pass, its logits handle, and the two readback tails."""

    key: tuple[int, int]
    layout: StepMetaLayout
    rec: CommandRecorder
    logits: Act
    argmax_tails: tuple[CommandRecorder, CommandRecorder]  # into ids[0], ids[1]
    heads: dict[tuple[int, bool], CommandRecorder] = field(default_factory=dict)  # (parity, feed): _head
    copy_tail: CommandRecorder | None = None
    copy_into: BufferView | None = None  # the readback buffer copy_tail writes (re-record when it changed)
    topk_tail: CommandRecorder | None = None
    topk_into: BufferView | None = None  # likewise for topk_tail
    # per parity: the sample tail (launch_sampled) and the candidates buffer it writes
    sample_tails: dict[int, tuple[CommandRecorder, BufferView]] = field(default_factory=dict)
    # the top-k's first-stage candidates (device-local), shared by its tails: they run one after another
    topk_chunks: BufferView | None = None
    argmax_chunks: BufferView | None = None  # likewise for the argmax tails (argmax.comp's two stages)

    def close(self) -> None:
        tails = [t for t, _ in self.sample_tails.values()]
        for r in (self.rec, *self.argmax_tails, *self.heads.values(), self.copy_tail, self.topk_tail, *tails):
            if r is not None:
                r.close()
        for buf in (self.topk_chunks, self.argmax_chunks):
            if buf is not None:
                buf.arena.close()
        self.topk_chunks = self.argmax_chunks = None


class StepOutput:
    """What ``run`` returns: the step's logits handle, the real row count and the graph to submit; ``used``
    metadata words packed, ``feed``: whether rows take their token from the step before (launch_greedy)."""

    __slots__ = ("graph", "n_out", "shape", "used", "feed")

    def __init__(self, graph: Graph, n_out: int, vocab: int, used: int = 0, feed: bool = False):
        self.graph, self.n_out, self.shape = graph, n_out, (n_out, vocab)
        self.used, self.feed = used, feed


@dataclass(frozen=True)
class Launched:
    """A submitted step (``launch_greedy``, ``launch_sampled``): its parity, the id rows ``collect`` reads
    back, and whether it sampled (its candidates are readable: ``candidates``)."""

    parity: int
    n_out: int
    graph: Graph
    sampled: bool = False


def _option(name: str) -> property:
    """A read-only attribute of the backend that is its resolved option ``name``."""
    return property(lambda self: getattr(self.options, name), doc=f"options.{name} (read-only)")


class VulkanBackend(Backend):
    """The forward pass on a Vulkan device; see the module docstring for the recording scheme."""

    name = "vulkan"
    greedy_on_device = True
    sample_on_device = True
    #: engine.deterministic auto: off until its price on a GPU is measured (bench/bench_determinism.py;
    #: docs/determinism.md): on if it costs at most 10 % at decode 1/8/32 and prefill 512 on both shapes
    deterministic_auto = False
    topk_max = TOPK_CANDIDATES

    def __init__(self, options: VulkanOptions | None = None, **changes):
        """``options`` (else the defaults) with ``changes`` (VulkanOptions' field names: the config's
        vulkan section passes its keys this way); every auto resolved for the device (policy.resolve)."""
        opts = replace(options, **changes) if options is not None else VulkanOptions(**changes)
        self.dev = Device(opts.device)
        self.caps = policy.caps_of(self.dev)
        self.options = policy.resolve(opts, self.caps, self.deterministic_auto)
        self.device = self.dev.name
        self.caps_bytes = (opts.device_local_bytes, opts.host_visible_bytes)
        self.max_range = self.dev.limits["maxStorageBufferRange"]
        self.align = max(256, self.dev.limits["minStorageBufferOffsetAlignment"])
        self.kernels: dict[str, Kernel] = {}
        # One allocator for every kernel, large pools: a model's recordings make thousands of sets.
        bindings = max(spec.n_buffers for spec in KERNELS.values())
        self.descriptors = DescriptorAllocator(self.dev, sets_per_pool=4096, max_bindings=bindings)
        self.scratch = ScratchPool(self.dev)
        self.graphs: dict[tuple[int, int], Graph] = {}
        self.recordings = 0  # forward passes recorded (a replay test counts them)
        self.steps = 0  # steps submitted
        self.topk_steps = 0  # of which sampled from on-device top-k candidates
        self.sampled_steps = 0  # of which drawn on the device (launch_sampled)
        self.logit_rows_b = 1  # logit rows a step computes at least (prepare: the scheduler's sequences)
        self._uploading: threading.Thread | None = None  # load_weights(background=True)
        self._upload_error: BaseException | None = None
        self.weights_plan: MemoryPlan | None = None
        self.weights_mem: ResidentMemory | None = None
        self.kv_plan: MemoryPlan | None = None
        self.kv_mem: ResidentMemory | None = None
        self.kv_layout: KVLayout | None = None
        self.kv_views: dict[tuple[str, int], tuple[BufferView, BufferView]] = {}
        # per parity (module docstring, "Pipelining"): the mapped buffer the host writes a step's metadata
        # into, the ids its argmax writes, its fence, and the step in flight on it
        self.metas: list[BufferView] = []
        self.meta_gpu: BufferView | None = None  # the device-local copy every kernel reads
        self.ids: list[BufferView] = []
        self.fences = [self.dev.create_fence() for _ in range(2)]
        self._fences = [ffi.new("VkFence[]", [f]) for f in self.fences]
        self._in_flight: list[Launched | None] = [None, None]
        self._parity = 0  # of the next launch
        # a step's metadata packed here, then copied into its parity's mapped buffer at launch
        self._meta_host = np.zeros(0, np.uint32)
        self.readback: BufferView | None = None
        self.topk_buf: BufferView | None = None  # mapped: ids (rows, k) uint32, then values (rows, k)
        self.cands: list[BufferView | None] = [None, None]  # likewise, per parity, for the sample tails
        # the workgroup size of row_scale and geglu_row_scale: ROW_BLOCK, or the device's most (a power of 2)
        most = self.dev.limits["maxComputeWorkGroupInvocations"]
        self.row_block = min(ROW_BLOCK, 1 << (most.bit_length() - 1))
        self.residency: dict[str, int] = {}  # coopmat kernel -> workgroups resident at once (0: unknown)
        # the fused tails' arrival counters (zero between uses), and the prefetches' few bytes of output
        self.counters = Ring(self.dev, COUNTER_BYTES, self.align, "arrival counters")
        self.sinks = Ring(self.dev, 64 << 10, self.align, "prefetch sinks")
        self.vocab = 0
        self.last_gpu_ns: float | None = None
        self._rec: CommandRecorder | None = None
        self._layout: StepMetaLayout | None = None
        self._t_b = 0  # the token bucket being recorded
        self._norm = "rms_norm_f32_subgroup" if self.caps.subgroup_arithmetic else "rms_norm_f32"

    def set_options(self, options: VulkanOptions) -> None:
        """Record later graphs with ``options`` (resolved for the device; the device, memory caps and KV
        dtype stay as constructed): every recording is dropped. Benchmarks sweep a knob this way."""
        self.options = policy.resolve(options, self.caps, self.deterministic_auto)
        self._drop_graphs()

    # -- the options the recording code reads (resolved: policy.resolve) --------------------------------
    matvec = _option("matvec")
    planes = _option("planes")  # int8 planes of x on the int8 mat-vec path: 3, 1, or 0 (not taken)
    kv_dtype = _option("kv_dtype")
    timestamps = _option("timestamps")
    fuse = _option("fuse")
    prefetch_bytes = _option("prefetch_bytes")
    step_timeout_s = _option("step_timeout_s")
    mmq_min_weights = _option("mmq_min_weights")
    mmq_target = _option("mmq_target")
    topk_groups = _option("topk_groups")
    attention_min_keys = _option("attention_min_keys")
    attention_target = _option("attention_target")
    attention_prefill_target = _option("attention_prefill_target")
    attention_kl = _option("attention_kl")
    attention_cm = _option("attention_cm")
    geglu_xh = _option("geglu_xh")
    coopmat_layout = _option("coopmat_layout")
    coopmat_decode_layout = _option("coopmat_decode_layout")
    coopmat_waves = _option("coopmat_waves")
    coopmat_prefill_target = _option("coopmat_prefill_target")
    coopmat_decode_target = _option("coopmat_decode_target")

    @property
    def deterministic(self) -> bool:
        return self.options.deterministic

    @deterministic.setter
    def deterministic(self, on: bool) -> None:  # bench/bench_determinism.py sets it this way
        self.set_options(replace(self.options, deterministic=on))

    @property
    def coopmat(self) -> bool:
        """The cooperative-matrix GEMM at all (policy.coopmat_on)."""
        return policy.coopmat_on(self.options, self.caps)

    @property
    def coopmat_min_t(self) -> int:
        return max(2, self.options.coopmat_min_tokens)

    @property
    def mmq_k(self) -> int | None:
        """The int8 GEMM's product K where the device has it and the options allow it, else None."""
        return self.caps.mmq_k if self.options.mmq == "auto" else None

    @property
    def mmq_n8(self) -> bool:
        return bool(self.mmq_k) and self.caps.mmq_n8

    @property
    def mmq_min_t(self) -> int:
        return max(2, self.options.mmq_min_tokens)

    # -- residency -------------------------------------------------------------------------------------
    def load_weights(
        self,
        tensors: dict[str, WeightTensor],
        progress: Callable[..., None] | None = None,
        background: bool = False,
    ) -> dict[str, VkWeight]:
        """Plan, allocate and upload every weight. ``background``: the upload runs in a thread and this
        returns once the memory is allocated, so the caller can allocate the KV pools and record the steps
        meanwhile (the daemon's load: the upload has its own command pool and is the queue's only user
        until ``wait_resident``, which every submit calls first)."""
        forms = {name: _upload_form(t) for name, t in tensors.items()}  # name -> (array, qtype)
        items = [
            PlanItem(name, int(data.nbytes), _is_hot(name, data), "weight", _row_bytes(data))
            for name, (data, _) in forms.items()
        ]
        dev_cap, host_cap = self.caps_bytes
        self.dev.refresh_heaps()
        plan = plan_memory(
            items,
            self.dev.heaps,
            self.dev.memory_types,
            alignment=self.align,
            device_local_bytes=dev_cap,
            host_visible_bytes=host_cap,
        )
        self.weights_plan, self.weights_mem = plan, ResidentMemory(self.dev, plan)
        pairs = [(self.weights_mem[n], data) for n, (data, _) in forms.items()]
        if background:
            self._uploading = threading.Thread(
                target=self._upload, args=(pairs, progress), name="hmad-upload"
            )
            self._uploading.start()
        else:
            self._upload(pairs, progress)
        return {n: VkWeight(n, self.weights_mem[n], forms[n][1], tuple(t.shape)) for n, t in tensors.items()}

    def _upload(self, pairs, progress: Callable[[str], None] | None) -> None:
        last = [0.0]

        def report(done: int, total: int) -> None:
            now = time.monotonic()
            if progress and (now - last[0] >= 1.0 or done == total):
                last[0] = now
                progress(
                    f"uploading weights to {self.device}: {done / MIB:.0f}/{total / MIB:.0f} MiB", done, total
                )

        up = Uploader(self.dev)
        try:
            up.upload_all(pairs, report)
        except BaseException as e:  # noqa: BLE001 - raised again by wait_resident, in the caller's thread
            self._upload_error = e
        finally:
            up.close()

    def wait_resident(self) -> None:
        """Until a background upload is done (raises its error, if it failed)."""
        if self._uploading is not None:
            self._uploading.join()
            self._uploading = None
        if self._upload_error is not None:
            raise self._upload_error

    def unsupported(self, cfg) -> str | None:
        return _attention_limits(cfg.head_dim, cfg.n_heads // cfg.n_kv_heads)

    def alloc_kv(self, layout: KVLayout) -> None:
        """Plan and allocate the paged pools (one K and one V range per layer) where the weights left room.

        The same layout again (a new Scheduler of the same configuration) keeps the pools and the recorded
        graphs: a new scheduler starts with every block free, and a position is written before it is read.
        """
        if layout == self.kv_layout and self.kv_mem is not None:
            return
        self._drop_graphs()
        if self.kv_mem is not None:
            self.kv_mem.close()
        self.kv_layout, self.kv_views = layout, {}
        _, itemsize = KV_DTYPES[self.kv_dtype]
        items = []
        for pool, layers, blocks in (
            ("global", layout.global_layers, layout.n_global_blocks),
            ("local", layout.local_layers, layout.n_local_blocks),
        ):
            n = blocks * layout.block_size * layout.n_kv_heads * layout.head_dim * itemsize
            for slot in range(len(layers) if n else 0):
                items += [PlanItem(f"kv.{pool}.{slot}.{kv}", n, kind="kv") for kv in "kv"]
        wp = self.weights_plan
        left = {p: (wp.pools[p].capacity - wp.pools[p].used) if wp else None for p in ("device", "host")}
        self.kv_plan = plan_memory(
            items,
            self.dev.heaps,
            self.dev.memory_types,
            alignment=self.align,
            device_local_bytes=left["device"],
            host_visible_bytes=left["host"],
        )
        self.kv_mem = ResidentMemory(self.dev, self.kv_plan)
        for it in items[::2]:
            _, pool, slot, _ = it.name.split(".")
            base = f"kv.{pool}.{slot}."
            self.kv_views[(pool, int(slot))] = (self.kv_mem[base + "k"], self.kv_mem[base + "v"])
        self._ensure_meta(BUCKETS[-1])

    def _max_table(self, t_b: int) -> int:
        """Block-table words of bucket ``t_b``'s metadata (it holds at most ``t_b`` sequences)."""
        return self.kv_layout.max_table_entries(t_b)

    def _meta_layout(self, t_b: int) -> StepMetaLayout:
        """The metadata layout of bucket ``t_b``: with prefill-attention tiles from ATTENTION_TILE_MIN_BUCKET
        rows (sequences of at least ATTENTION_TILE_MIN_ROWS rows go in tiles)."""
        tiles = ATTENTION_TILE_MIN_ROWS if t_b >= ATTENTION_TILE_MIN_BUCKET and not self.deterministic else 0
        return StepMetaLayout(t_b, t_b, self._max_table(t_b), tile_min_rows=tiles)

    def _ensure_meta(self, t_b: int) -> None:
        """The metadata buffer holds the layout of bucket ``t_b``; growing it drops every recording."""
        words = self._meta_layout(t_b).words
        if self.meta_gpu is not None and self.meta_gpu.nbytes >= 4 * words:
            return
        self._drop_graphs()  # (waits for the steps in flight: their ids stay readable, below)
        for b in (*self.metas, self.meta_gpu):
            if b is not None:
                b.arena.close()
        # Two mapped buffers (one per parity) and the device-local copy the kernels read: on a dGPU every
        # kernel's read of mapped memory would pay the bus latency, on the dependent chain of slot -> KV row;
        # and a step's head copies its parity's few KiB there after the step before it is done reading
        self.metas = [create_buffer(self.dev, 4 * words, "mapped", f"step metadata {p}") for p in range(2)]
        self.meta_gpu = create_buffer(self.dev, 4 * words, "device", "step metadata (device copy)")
        if not self.ids or self.ids[0].nbytes < 4 * t_b:
            old = self.ids
            self.ids = [create_buffer(self.dev, 4 * t_b, "readback", f"token ids {p}") for p in range(2)]
            for a, b in zip(old, self.ids, strict=False):  # a step collected after this still finds its ids
                b.array(np.uint32)[: a.nbytes // 4] = a.array(np.uint32)
                a.arena.close()

    def _close_meta(self) -> None:
        for b in (*self.metas, self.meta_gpu, *self.ids):
            if b is not None:
                b.arena.close()
        self.metas, self.meta_gpu, self.ids = [], None, []

    def describe(self) -> dict[str, Any]:
        mem: dict[str, int] = {}
        for what, plan in (("weights", self.weights_plan), ("KV cache", self.kv_plan)):
            for pool in plan.pools.values() if plan else []:
                kind = "device-local" if pool.name == "device" else "host-visible"
                if pool.used:
                    mem[f"heap {pool.heap} {kind}: {what}"] = pool.used
        mem["device-local: scratch activations"] = self.scratch.nbytes
        return {
            "backend": self.name,
            "device": self.device,
            "memory": mem,
            "matmul": {
                "matvec": self.matvec,
                "coopmat": f">= {self.coopmat_min_t} tokens"
                if self.coopmat
                else "off (device lacks it or config)",
                "int8 gemm": self._mmq_status(),
                "fused": [f for f in FUSIONS if self.options.fused(f)],
                "prefetch": f"{self.prefetch_bytes} bytes a matmul at decode"
                if self.prefetch_bytes
                else "off",
            },
            "deterministic": self.deterministic,
            "recordings": self.recordings,
            "buckets": sorted(self.graphs),
        }

    def _mmq_status(self) -> str:
        """What ``hmactl status`` says of the int8 GEMM (policy.mmq_for)."""
        if not self.mmq_k:
            return "off (device lacks int8 cooperative matrices, or config)"
        if self.planes != 3 or self.deterministic:
            return "off (matvec is not exact, or deterministic mode)"
        top = self.coopmat_min_t - 1 if self.coopmat else Q8_MAX_T  # the float16 GEMM takes the rest
        takes = [b for b in BUCKETS if self.mmq_min_t <= b <= min(top, Q8_MAX_T)]  # steps run padded to these
        if not takes:
            return f"not used: the float16 GEMM takes steps of {self.coopmat_min_t}+ tokens"
        return f"steps of {takes[0]}..{takes[-1]} tokens on Q4_K weights of {self.mmq_min_weights}+ elements"

    def set_timestamps(self, on: bool) -> None:
        """Record later graphs with (or without) a GPU timestamp after every command (profiling; it costs
        time per dispatch). Drops the existing recordings."""
        self.set_options(replace(self.options, timestamps=on))

    def close(self) -> None:
        with contextlib.suppress(Exception):  # an upload that failed: its error was the caller's to see
            self.wait_resident()
        self.dev.wait_idle()
        self._drop_graphs()
        for k in self.kernels.values():
            k.close()
        self.kernels = {}
        self.descriptors.close()
        self.scratch.close()
        for m in (self.weights_mem, self.kv_mem):
            if m is not None:
                m.close()
        self._close_meta()
        for b in (self.readback, self.topk_buf, *self.cands):
            if b is not None:
                b.arena.close()
        self.counters.close()
        self.sinks.close()
        self.weights_mem = self.kv_mem = self.readback = self.topk_buf = None
        self.cands = [None, None]
        for f in self.fences:
            lib.vkDestroyFence(self.dev.handle, f, ffi.NULL)
        self.fences, self._in_flight = [], [None, None]
        self.dev.close()

    # -- the step: bucket, metadata, record once, replay ----------------------------------------------
    def prepare(self, net, max_tokens: int, max_rows: int) -> None:
        """Record every bucket a step of up to ``max_tokens`` tokens can fall in, largest first (so the
        metadata and candidate buffers are sized once), each with its top-k tail. From here on a step
        computes the logits of min(tokens, bucket(max_rows)) rows whatever its own count: one recording per
        token bucket, not one per (tokens, rows) pair (the extra rows cost the output projection a few
        rows more: noise beside a step)."""
        self.logit_rows_b = bucket(max(1, max_rows))
        top = bucket(max(1, max_tokens))
        self._ensure_meta(top)
        for t_b in reversed(buckets_upto(top)):
            o_b = min(t_b, self.logit_rows_b)
            graph = self.graphs.get((t_b, o_b)) or self._record(net, t_b, o_b)
            self._topk_tail(graph)
            for parity in (0, 1):
                self._sample_tail(graph, parity)
        if self.dev.info.is_cpu:  # lavapipe: no first-submit cost to hide, and each replay a whole prefill
            return
        for t_b in buckets_upto(top):  # each replayed once: no request pays a recording's first submit
            self.greedy(self.run(net, self._warm_up_batch(t_b)))

    def _warm_up_batch(self, n: int) -> StepBatch:
        """One sequence of ``n`` prompt tokens in the first blocks of the pools: a step that replays a bucket
        before any request runs (nothing is cached yet: the blocks it writes belong to no sequence)."""
        lay = self.kv_layout
        glob = np.arange(min(-(-n // lay.block_size), lay.n_global_blocks), dtype=np.int32)
        loc = np.arange(min(lay.ring_blocks, lay.n_local_blocks), dtype=np.int32)
        s = SeqSlice(0, 0, n, 0, glob, loc)
        return StepBatch.build([(s, [0] * n, True)], lay.block_size)

    def run(self, net, batch: StepBatch) -> StepOutput:
        assert self.kv_layout is not None, "alloc_kv() before the first step"
        t_b = bucket(max(1, batch.n_tokens))
        o_b = min(bucket(max(self.logit_rows_b, len(batch.logit_rows))), t_b)
        graph = self.graphs.get((t_b, o_b))
        if graph is None:  # (a recording's metadata fits: growing the buffer drops every recording)
            self._ensure_meta(t_b)
            graph = self._record(net, t_b, o_b)
        lay = graph.layout
        if self._meta_host.size < lay.words:
            self._meta_host = np.zeros(lay.words, np.uint32)
        lay.pack(batch, out=self._meta_host[: lay.words])
        feed = batch.feed is not None and bool((batch.feed >= 0).any())
        return StepOutput(graph, len(batch.logit_rows), graph.logits.shape[1], lay.used_words(batch), feed)

    def _record(self, net, t_b: int, o_b: int) -> Graph:
        layout = self._meta_layout(t_b)
        for k in self.kernels.values():  # sets of buffers closed since (KV pools re-planned, metadata grown)
            k.forget_closed()
        rec = CommandRecorder(self.dev, timestamps=self.timestamps, max_commands=8192).begin(
            simultaneous=True
        )
        if self.options.fused(
            "qout"
        ):  # the counters are zero already, unless a step was cut off mid-dispatch
            rec.fill(self.counters.whole(), 0, label="arrival counters")
        shape_batch = StepBatch(
            tokens=np.zeros(t_b, np.int32),
            positions=np.zeros(t_b, np.int32),
            seqs=[],
            logit_rows=np.zeros(o_b, np.int32),
            block_size=self.kv_layout.block_size,
        )
        self.scratch.begin()
        self._rec, self._layout, self._t_b = rec, layout, t_b
        try:
            logits = net.forward(shape_batch)
            rec.end()
        except BaseException:
            rec.close()
            raise
        finally:
            self._rec = self._layout = None
        chunks = self._argmax_chunks(logits)
        tails = (self._argmax_tail(logits, 0, chunks), self._argmax_tail(logits, 1, chunks))
        graph = Graph((t_b, o_b), layout, rec, logits, tails, argmax_chunks=chunks)
        self.graphs[graph.key] = graph
        self.recordings += 1
        return graph

    def _pair(self, nbytes: int, name: str) -> BufferView:
        """A device-local buffer of two parts of ``nbytes`` (``_parts``): a two-stage tail's first-stage
        indices and values."""
        return create_buffer(self.dev, -(-nbytes // self.align) * self.align + nbytes, "device", name)

    def _parts(self, buf: BufferView, nbytes: int) -> tuple[BufferView, BufferView]:
        """The two parts of a ``_pair`` buffer (the second at the next aligned offset)."""
        at = -(-nbytes // self.align) * self.align
        assert buf.nbytes >= at + nbytes, f"{buf.name}: {buf.nbytes} bytes, {at + nbytes} needed"
        return tuple(BufferView(buf.arena, buf.offset + o, nbytes, name=buf.name) for o in (0, at))

    def _argmax_chunks(self, logits: Act) -> BufferView | None:
        """The first stage's (rows, chunks) indices then values, where a row takes two (argmax.comp)."""
        rows, vocab = logits.shape
        chunks = -(-vocab // topk_chunk(vocab, ARGMAX_CHUNKS))
        return None if chunks == 1 else self._pair(4 * rows * chunks, "argmax per chunk")

    def _argmax_tail(self, logits: Act, parity: int, scratch: BufferView | None) -> CommandRecorder:
        """argmax.comp over ``logits`` into ``ids[parity]``: one stage, or each chunk's best into ``scratch``
        (shared by both parities' tails: steps run one after another) then theirs."""
        rows, vocab = logits.shape
        tail = CommandRecorder(self.dev).begin()
        tail.barrier()  # after the forward pass's command buffer in the same submit
        if scratch is None:
            k = self._kernel("argmax_f32")
            push = ArgmaxPush(rows, vocab, vocab, vocab)
            tail.dispatch(k, [logits.view, self.ids[parity]], push, k.groups_for(rows))
            return tail.end()
        chunk = topk_chunk(vocab, ARGMAX_CHUNKS)
        n = -(-vocab // chunk)
        c_ids, c_vals = self._parts(scratch, 4 * rows * n)
        first, merge = self._kernel("argmax_chunks_f32"), self._kernel("argmax_merge_f32")
        push = ArgmaxPush(rows, vocab, vocab, chunk)
        tail.dispatch(first, [logits.view, c_ids, c_vals], push, first.groups_for(rows * n))
        push = ArgmaxPush(rows, n, n, n)
        tail.dispatch(merge, [c_vals, self.ids[parity], c_ids], push, merge.groups_for(rows))
        return tail.end()

    def _head(self, graph: Graph, parity: int, feed: bool) -> CommandRecorder:
        """The command buffer before ``graph``'s in a submit of ``parity``: after the steps before it, copy
        that parity's metadata into the device-local copy; with ``feed``, fill the fed rows' tokens from the
        other parity's ids (feed_tokens.comp)."""
        head = graph.heads.get((parity, feed))
        if head is None:
            lay = graph.layout
            head = CommandRecorder(self.dev).begin()
            head.barrier()  # the steps submitted before this one have read meta_gpu and written their ids
            head.copy(self.metas[parity], self.meta_gpu, lay.nbytes, label="step metadata to VRAM")
            if feed:
                k = self._kernel("feed_tokens")
                push = FeedPush(lay.tokens, lay.feed, lay.max_tokens, graph.logits.shape[1])
                head.dispatch(k, [self.meta_gpu, self.ids[1 - parity]], push, k.groups_for(1))
            head.barrier()  # before the forward pass reads it
            graph.heads[(parity, feed)] = head = head.end()
        return head

    def _copy_tail(self, graph: Graph) -> CommandRecorder:
        """The logits -> host-visible readback copy of ``graph`` (re-made when the readback buffer grew)."""
        need = graph.logits.view.nbytes
        self.readback = self._readback_buffer(self.readback, need, "logits readback")
        if graph.copy_into is not self.readback:
            if graph.copy_tail is not None:
                graph.copy_tail.close()
            tail = CommandRecorder(self.dev).begin()
            tail.barrier()
            tail.copy(graph.logits.view, self.readback, need)
            graph.copy_tail, graph.copy_into = tail.end(), self.readback
        return graph.copy_tail

    def _readback_buffer(self, current: BufferView | None, need: int, label: str) -> BufferView:
        """``current`` if it holds ``need`` bytes, else a new host-visible readback buffer (``current``
        closed; the tails recorded against it are re-recorded by their owners)."""
        if current is not None and current.nbytes >= need:
            return current
        if current is not None:
            current.arena.close()
        return create_buffer(self.dev, need, "readback", label)

    def _topk_layout(self, rows: int, vocab: int) -> tuple[int, int]:
        """(k, byte offset of the values) in the candidates buffer: ids (rows, k) first, values aligned."""
        k = min(TOPK_CANDIDATES, vocab)
        return k, -(-4 * rows * k // self.align) * self.align

    def _topk_tail(self, graph: Graph) -> CommandRecorder:
        """The top-k tail of ``graph`` (re-made when the candidates buffer grew)."""
        rows, vocab = graph.logits.shape
        k, half = self._topk_layout(rows, vocab)
        self.topk_buf = self._readback_buffer(self.topk_buf, half + 4 * rows * k, "top-k candidates")
        if graph.topk_into is not self.topk_buf:
            if graph.topk_tail is not None:
                graph.topk_tail.close()
            tail = CommandRecorder(self.dev).begin()
            self._record_topk(tail, graph, self.topk_buf)
            graph.topk_tail, graph.topk_into = tail.end(), self.topk_buf
        return graph.topk_tail

    def _record_topk(
        self, tail: CommandRecorder, graph: Graph, into: BufferView
    ) -> tuple[BufferView, BufferView]:
        """Append topk.comp over ``graph``'s logits (after a barrier) writing the candidates buffer ``into``
        (``_topk_layout``); returns its (ids, values) views. A row longer than ``topk_chunk()`` takes two
        stages (the shader's header): its chunks' best into the graph's ``topk_chunks``, then their best."""
        rows, vocab = graph.logits.shape
        k, half = self._topk_layout(rows, vocab)
        ids = _rows(into, 0, 1, 4 * rows * k)
        vals = BufferView(into.arena, into.offset + half, 4 * rows * k, name="top-k values")
        first, merge = self._kernel("topk_f32"), self._kernel("topk_merge_f32")
        chunk = topk_chunk(vocab, topk_chunks(rows, self.topk_groups))
        chunks = -(-vocab // chunk)
        tail.barrier()
        if chunks == 1:
            push = TopkPush(rows, vocab, vocab, k, vocab)
            tail.dispatch(first, [graph.logits.view, ids, vals], push, first.groups_for(rows))
            return ids, vals
        if graph.topk_chunks is None:  # (rows, chunks, k) ids, then values: the first stage's candidates
            graph.topk_chunks = self._pair(4 * rows * chunks * k, "top-k per chunk")
        c_ids, c_vals = self._parts(graph.topk_chunks, 4 * rows * chunks * k)
        push = TopkPush(rows, vocab, vocab, k, chunk)
        tail.dispatch(first, [graph.logits.view, c_ids, c_vals], push, first.groups_for(rows * chunks))
        tail.barrier()
        n = chunks * k
        tail.dispatch(merge, [c_vals, ids, vals, c_ids], TopkPush(rows, n, n, k, n), merge.groups_for(rows))
        return ids, vals

    def _sample_tail(self, graph: Graph, parity: int) -> CommandRecorder:
        """``graph``'s sample tail on ``parity`` (re-made when that parity's candidates buffer grew)."""
        rows, vocab = graph.logits.shape
        k, half = self._topk_layout(rows, vocab)
        buf = self.cands[parity] = self._readback_buffer(
            self.cands[parity], half + 4 * rows * k, f"sampled candidates {parity}"
        )
        tail, into = graph.sample_tails.get(parity, (None, None))
        if into is not buf:
            if tail is not None:
                tail.close()
            sample = self._kernel("sample_topk")
            assert k <= sample.block_size, "sample_topk takes a row's candidates one an invocation"
            tail = CommandRecorder(self.dev).begin()
            ids, vals = self._record_topk(tail, graph, buf)
            tail.barrier()
            push = SampleTopkPush(rows, k, graph.layout.sample)
            tail.dispatch(sample, [self.meta_gpu, ids, vals, self.ids[parity]], push, sample.groups_for(rows))
            tail = tail.end()
            graph.sample_tails[parity] = (tail, buf)
        return tail

    @property
    def pipelined(self) -> bool:
        """Whether ``launch_greedy`` may be called with a step still in flight (not while profiling: two
        pending submits of one recording would share its timestamp queries)."""
        return not self.timestamps

    def _launch(self, x: StepOutput, tail: CommandRecorder, sampled: bool = False) -> Launched:
        """Submit step ``x`` (head, forward pass, ``tail``) on the next parity; no wait."""
        self.wait_resident()
        p = self._parity
        if self._in_flight[p] is not None:
            raise RuntimeError("two steps in flight already: collect the older one first")
        # into the mapped buffer in one sequential write, not a store per section (it may be uncached,
        # write-combined memory across the bus)
        self.metas[p].array(np.uint32)[: x.used] = self._meta_host[: x.used]
        graph = x.graph
        cmds = ffi.new("VkCommandBuffer[]", [self._head(graph, p, x.feed).cmd, graph.rec.cmd, tail.cmd])
        si = new(
            "VkSubmitInfo", sType=vk.VK_STRUCTURE_TYPE_SUBMIT_INFO, commandBufferCount=3, pCommandBuffers=cmds
        )
        check(lib.vkResetFences(self.dev.handle, 1, self._fences[p]), "vkResetFences")
        check(lib.vkQueueSubmit(self.dev.queue, 1, si, self.fences[p]), "vkQueueSubmit(step)")
        self._in_flight[p] = done = Launched(p, x.n_out, graph, sampled)
        self._parity = 1 - p
        return done

    def _wait(self, done: Launched) -> None:
        """Until ``done``'s fence (raises Timeout past ``step_timeout_s``: a GPU hang)."""
        if self._in_flight[done.parity] is not done:
            raise RuntimeError("collect(): that step is not in flight (collected already?)")
        self._in_flight[done.parity] = None
        fence = self._fences[done.parity]
        r = lib.vkWaitForFences(self.dev.handle, 1, fence, 1, int(self.step_timeout_s * 1e9))
        check(r, f"vkWaitForFences(step of bucket {done.graph.key}, {self.step_timeout_s:g} s)")
        self.steps += 1
        if done.graph.rec.query_pool is not None:
            done.graph.rec.submits += 1
            self.last_gpu_ns = done.graph.rec.gpu_times()["total_ns"]

    def _run_alone(self, x: StepOutput, tail: CommandRecorder) -> None:
        """Submit step ``x`` with ``tail`` (which writes a buffer of one parity only) and wait for it."""
        if any(self._in_flight):
            raise RuntimeError("a pipelined step is in flight: collect it before a step that reads logits")
        if x.feed:
            raise ValueError("only launch_greedy takes a batch with fed rows")
        self._wait(self._launch(x, tail))

    def launch_greedy(self, x: StepOutput) -> Launched:
        """Submit step ``x`` with the argmax on the GPU and return without waiting; ``collect`` reads its
        ids. Rows of its batch with a ``feed`` entry take their token from the ids of the step launched
        just before it (which may still be running). At most two steps in flight."""
        return self._launch(x, x.graph.argmax_tails[self._parity])

    def launch_sampled(self, x: StepOutput) -> Launched:
        """As ``launch_greedy``, each row's token drawn on the GPU from its top-k candidates with the
        batch's ``sampling`` (sample_topk.comp); ``collect`` reads the ids, then ``candidates`` the
        candidates they were drawn from."""
        done = self._launch(x, self._sample_tail(x.graph, self._parity), sampled=True)
        self.sampled_steps += 1
        return done

    def collect(self, done: Launched) -> np.ndarray:
        """Wait for a launched step and read back its token ids (S_out,) int64."""
        self._wait(done)
        return self.ids[done.parity].array(np.uint32)[: done.n_out].astype(np.int64)

    def candidates(self, done: Launched) -> tuple[np.ndarray, np.ndarray]:
        """A collected ``launch_sampled`` step's candidates, as ``topk`` returns them; read before the next
        launch on its parity."""
        if not done.sampled or self._in_flight[done.parity] is done:
            raise RuntimeError("candidates(): a sampled step, once collected")
        return self._read_candidates(self.cands[done.parity], done.graph, done.n_out)

    def to_numpy(self, x) -> np.ndarray:
        """Run the step and read back its logits rows (S_out, V) float32."""
        if not isinstance(x, StepOutput):
            raise TypeError("VulkanBackend.to_numpy reads a step's logits (what run() returns)")
        self._run_alone(x, self._copy_tail(x.graph))
        vocab = x.shape[1]
        return self.readback.array(np.float32)[: x.n_out * vocab].reshape(x.n_out, vocab).copy()

    def greedy(self, x) -> np.ndarray:
        """Run the step with the argmax on the GPU; read back one token id per logits row."""
        if x.feed:
            raise ValueError("only launch_greedy takes a batch with fed rows")
        return self.collect(self.launch_greedy(x))

    def topk(self, x) -> tuple[np.ndarray, np.ndarray]:
        """Run the step with topk.comp on the GPU; read back the best TOPK_CANDIDATES (id, value) pairs of
        each logits row (8 bytes each, not the row's V floats)."""
        self._run_alone(x, self._topk_tail(x.graph))
        self.topk_steps += 1
        return self._read_candidates(self.topk_buf, x.graph, x.n_out)

    def _read_candidates(self, into: BufferView, graph: Graph, n_out: int) -> tuple[np.ndarray, np.ndarray]:
        rows, vocab = graph.logits.shape
        k, half = self._topk_layout(rows, vocab)
        buf = into.array(np.uint8)
        ids = buf[: 4 * rows * k].view(np.uint32).reshape(rows, k)[:n_out].astype(np.int64)
        vals = buf[half : half + 4 * rows * k].view(np.float32).reshape(rows, k)[:n_out].copy()
        return ids, vals

    def _drop_graphs(self) -> None:
        if self.graphs:
            self.dev.wait_idle()
        for g in self.graphs.values():
            g.close()
        self.graphs = {}

    # -- recording helpers -----------------------------------------------------------------------------
    def _kernel(self, name: str, block: int | None = None) -> Kernel:
        """The kernel ``name`` (at workgroup size ``block``, else its spec's), built once."""
        key = name if block is None else f"{name}@{block}"
        k = self.kernels.get(key)
        if k is None:
            k = self.kernels[key] = Kernel(self.dev, name, block_size=block, descriptors=self.descriptors)
        return k

    def _new(self, shape: tuple[int, ...]) -> Act:
        return Act(self.scratch.take(4 * math.prod(shape)), shape)

    def _new_q8(self, t: int, k: int, planes: int = 1) -> tuple[Act, Act]:
        """Scratch for (T, K) values quantized for the int8 mat-vec: xq (T, planes * K/4) words,
        xd (T, K/32, 2)."""
        return self._new((t, planes * k // 4)), self._new((t, k // 32, 2))

    def _new_row_scales(self, t: int, k: int) -> tuple[Act, Act]:
        """Scratch for (T, K) values as the cooperative-matrix GEMM reads them (row_scale.comp): the row
        scales (T,), xh (T, K/2) words of two float16."""
        return self._new((t,)), self._new((t, k // 2))

    def _dispatch(self, name: str, buffers, push, groups, block: int | None = None) -> None:
        assert self._rec is not None, "VulkanBackend ops run only while recording (through run())"
        k = self._kernel(name, block)
        self._rec.dispatch(k, buffers, push, groups if isinstance(groups, tuple) else k.groups_for(groups))

    @staticmethod
    def _grid(n: int, block: int = 256, cap: int = 4096) -> int:
        """Workgroups for a grid-stride loop over ``n`` items."""
        return max(1, min(cap, -(-n // block)))

    # -- ops: append dispatches --------------------------------------------------------------------------
    def embed(self, table: VkWeight, tokens, scale: float) -> Act:
        t_b, dim = len(tokens), table.shape[1]
        view, name = table.view, f"embed_{EMBED_TYPES[table.qtype]}"
        rb = view.row_bytes or view.nbytes // table.shape[0]
        y = self._new((t_b, dim))
        for off, nbytes in view.ranges(self.max_range, self.align):
            r0, binding = (off - view.offset) // rb, (view, off - view.offset, nbytes)
            if KERNELS[name].push is EmbedDqPush:  # the file's blocks through dequant.glsl: table at 0
                push = EmbedDqPush(t_b, dim, self._layout.tokens, r0, nbytes // rb, dim, rb, scale)
                self._dispatch(name, [binding, self.meta_gpu, y.view], push, t_b)
            else:
                push = EmbedPush(t_b, dim, self._layout.tokens, r0, nbytes // rb, dim, scale)
                self._dispatch(name, [self.meta_gpu, binding, y.view], push, t_b)
        return y

    def rms_norm(self, x: Act, w: VkWeight, eps: float) -> Act:
        cols = x.shape[-1]
        assert w.shape == (cols,), f"{w.name}: shape {w.shape}, normalising rows of {cols}"
        rows = x.size // cols
        y = self._new(x.shape)
        self._dispatch(self._norm, [x.view, w.view, y.view], RmsNormPush(cols, rows, cols, cols, eps), rows)
        return y

    def matmul(self, x: Act, w: VkWeight, keep: bool = False) -> Act:
        """y = x · wᵀ; ``keep``: a K-split GEMM's partial sums stay unsummed (y.parts), for the op that reads
        y to add (residual_norm, normed_attention)."""
        t, k = x.shape
        n = w.shape[0]
        assert w.shape[1] == k, f"{w.name}: shape {w.shape}, x has {k} columns"
        y = self._new((t, n))
        assert self._rec is not None, "VulkanBackend ops run only while recording (through run())"
        if policy.q8_path(self.options, self.caps, t, w):
            self._matvec_q8(x, [w], y, keep=keep)
            return y
        if policy.coopmat_for(self.options, self.caps, t, w):
            self._coopmat(x, w, y, keep=keep)
            return y
        if self.deterministic:
            self._matvec_chunks(x, w, y)
            return y
        record_matmul(
            self._rec,
            self._kernel(policy.matvec_name(self.options, self.caps, t, w)),
            w.view,
            x.view,
            y.view,
            k,
            n,
            t,
        )
        return y

    def ffn(self, x: Act, gate: VkWeight, up: VkWeight, down: VkWeight) -> Act:
        """The feed-forward block. Where gate, up and down all run the cooperative-matrix GEMM, the GeGLU
        goes straight into the float16 copy and row scales the down GEMM reads (geglu_row_scale.comp: what
        split_reduce_geglu then row_scale make, bit for bit, without the float32 GeGLU written and read)."""
        t = x.shape[0]
        if not policy.geglu_xh(self.options, self.caps, t, gate, up, down):
            return super().ffn(x, gate, up, down)
        f = self._new((t, gate.shape[0]))  # (T, F) never written: only its row scales and float16 copy are
        f.scale = self._new_row_scales(t, gate.shape[0])
        self._coopmat(x, [gate, up], f, geglu_xh=True)
        return self.matmul_for_residual(f, down)

    def matmuls_for_attention(self, x: Act, ws: list[VkWeight]) -> list[Act]:
        """matmuls whose K-split partial sums norm_rope_kv adds as it reads them (where normed_attention runs
        it): the three projections' split_reduce dispatches fewer."""
        keep = self.options.fused("split_sums") and self.options.fused("norm_rope_kv")
        return [self.matmul(x, w, keep=keep) for w in ws]

    def matmul_for_residual(self, x: Act, w: VkWeight) -> Act:
        """matmul whose K-split partial sums (the cooperative-matrix or int8 GEMM's, W in one bind range)
        residual_norm adds as it reads them: no split_reduce dispatch, and y's floats not written."""
        return self.matmul(x, w, keep=self.options.fused("split_sums"))

    def _matvec_chunks(self, x: Act, w: VkWeight, y: Act) -> None:
        """Deterministic mode's float path: the mat-vec of MATVEC_MAX_T tokens (never ``_t1``) for every
        row count, MATVEC_MAX_T rows a dispatch."""
        (t, k), n = x.shape, w.shape[0]
        kern = self._kernel(policy.matvec_name(self.options, self.caps, MATVEC_MAX_T, w))
        align = self.dev.limits["minStorageBufferOffsetAlignment"]
        if t > MATVEC_MAX_T and any(b % align for b in (MATVEC_MAX_T * 4 * k, MATVEC_MAX_T * 4 * n)):
            raise ValueError(
                f"{w.name}: deterministic mode needs {MATVEC_MAX_T}-row chunks of x ({k} columns) and y "
                f"({n}) at offsets aligned to {align} bytes"
            )
        for t0 in range(0, t, MATVEC_MAX_T):
            tc = min(MATVEC_MAX_T, t - t0)
            xv, yv = _rows(x.view, t0, tc, 4 * k), _rows(y.view, t0, tc, 4 * n)
            record_matmul(self._rec, kern, w.view, xv, yv, k, n, tc)

    def geglu_matmul(self, x: Act, gate: VkWeight, up: VkWeight) -> Act:
        """One mat-vec dispatch for both projections and the GeGLU (decode: int8 or float), else the
        plain ops."""
        t, k = x.shape
        n = gate.shape[0]
        if not (gate.qtype == up.qtype and gate.shape == up.shape):
            return super().geglu_matmul(x, gate, up)
        if policy.q8_path(self.options, self.caps, t, gate):
            y = self._new((t, n))
            if self.options.fused("qout") and policy.fused_tail(
                self.options, self.caps, t, gate
            ):  # y's q8 form, too
                y.q8 = self._new_q8(t, n, self.planes)
                tail = [y.q8[0].view, y.q8[1].view, self.counters.take(4 * n // 32), y.view]  # y again: vec4
                self._matvec_q8(x, [gate, up], y, tail, suffix="_qo")
            else:
                self._matvec_q8(x, [gate, up], y)
            return y
        if policy.coopmat_for(self.options, self.caps, t, gate):
            y = self._new((t, n))
            self._coopmat(x, [gate, up], y)
            return y
        if self.deterministic or t > MATVEC_MAX_T or gate.qtype not in UNIT_TYPES.values():
            return super().geglu_matmul(x, gate, up)
        y = self._new((t, n))
        kern = self._kernel(policy.matvec_name(self.options, self.caps, t, gate, geglu=True))
        record_matmul(self._rec, kern, gate.view, x.view, y.view, k, n, t, w_up=up.view)
        return y

    def _matvec_q8(
        self, x: Act, ws: list[VkWeight], y: Act, tail=(), suffix: str = "", keep: bool = False
    ) -> None:
        """y = x · Wᵀ (or the GeGLU of two weights) on the int8 mat-vec (three planes of x for ``exact``,
        one for ``int8``) in the layout of its shape (q8_matvec_layout), MATVEC_MAX_T tokens a dispatch
        (the chunks read the same weights back to back; no barrier between them). ``suffix`` "_qo": the
        one-token variant with that fused tail (``tail`` its bindings). ``keep``: as :meth:`matmul`'s, where
        the int8 GEMM takes the step."""
        if not tail and policy.mmq_for(self.options, self.caps, x.shape[0], ws[0]):
            self._mmq(x, ws, y, keep)
            return
        (t, k), n = x.shape, ws[0].shape[0]
        xq, xd = self._q8(x)
        planes = self.planes
        x_name = "x3" if planes == 3 else "q8x"
        base = f"mul_mat_vec_{x_name}_{_type_name(ws[0].qtype, UNIT_TYPES)}" + (
            "_geglu" if len(ws) > 1 else ""
        )
        fixed = self.deterministic  # one layout, never _t1: the same reduction order for every row count
        for t0 in range(0, t, MATVEC_MAX_T):
            tc = min(MATVEC_MAX_T, t - t0)
            lay = q8_matvec_layout(MATVEC_MAX_T if fixed else tc, n, k, geglu=len(ws) > 1)
            kern = self._kernel(base + lay + ("" if fixed else _t1(tc)) + suffix)
            xq_rows = _rows(xq.view, t0, tc, planes * k)
            rows = [xq_rows, _rows(xd.view, t0, tc, k // 4), _rows(y.view, t0, tc, 4 * n)]
            up = ws[1].view if len(ws) > 1 else None
            record_matvec_q8(self._rec, kern, ws[0].view, *rows, k, n, tc, w_up=up, tail=tail)

    def _scratch_maker(self, held: list[Act]) -> Callable[[int], BufferView]:
        """``nbytes -> BufferView`` of new float32 scratch (a GEMM's K-split partial sums), each kept in
        ``held`` so that it stays alive until the caller's dispatches are recorded."""

        def part(nbytes: int) -> BufferView:
            held.append(self._new((nbytes // 4,)))
            return held[-1].view

        return part

    @staticmethod
    def _keeper(y: Act, held: list[Act]) -> Callable[[BufferView, int], None]:
        """``keep`` for record_split_sums: a GEMM's partial sums left on y (``parts``), their scratch
        ``held`` with them until their reader is recorded."""

        def keep(part: BufferView, splits: int) -> None:
            y.parts = (part, splits, held)

        return keep

    def _mmq(self, x: Act, ws: list[VkWeight], y: Act, keep: bool = False) -> None:
        """y = x · Wᵀ (or the GeGLU of [gate, up]) on the int8 cooperative-matrix GEMM, x as its three
        int8 planes; K split into partial sums (scratch held until recorded) as kernels_mmq says;
        ``keep`` as :meth:`matmul`'s."""
        (t, k), n = x.shape, ws[0].shape[0]
        xq, xd = (a.view for a in self._q8(x))
        kern = self._kernel(mmq_pick(self.mmq_k, t, self.mmq_n8))
        held: list[Act] = []  # the partial-sum scratch, alive until its dispatches are recorded
        part = self._scratch_maker(held)
        if len(ws) == 2:
            reduce = self._kernel("split_reduce_geglu")
            views = (ws[0].view, ws[1].view)
            record_mmq_geglu(
                self._rec, kern, reduce, *views, xq, xd, y.view, k, n, t, part, target=self.mmq_target
            )
        else:
            reduce, kept = self._kernel("split_reduce"), self._keeper(y, held) if keep else None
            views = (ws[0].view, xq, xd, y.view)
            record_mmq(self._rec, kern, reduce, *views, k, n, t, part, target=self.mmq_target, keep=kept)

    def _coopmat(
        self, x: Act, ws: VkWeight | list[VkWeight], y: Act, geglu_xh: bool = False, keep: bool = False
    ) -> None:
        """y = x · Wᵀ on the cooperative-matrix mat-mat, or the GeGLU of two weights ([gate, up]: their
        partial sums added and the GeGLU applied in one pass); x's row scales and float16 copy made on first
        use. ``geglu_xh``: the GeGLU written only as y's row scales and float16 copy (``y.scale``, made by
        the caller; :meth:`ffn`). ``keep`` (one weight): as :meth:`matmul`'s."""
        ws = ws if isinstance(ws, list) else [ws]
        (t, k), n = x.shape, ws[0].shape[0]
        qtype = ws[0].qtype
        layout = coopmat_q4k_layout(t, qtype, n, k)
        if self.coopmat_layout is not None and qtype == QType.Q4_K and t > 128:
            layout = self.coopmat_layout  # a benchmark's choice
        if self.coopmat_decode_layout is not None and qtype == QType.Q4_K and t <= Q8_MAX_T:
            layout = self.coopmat_decode_layout
        kern = self._kernel(coopmat_kernel_name(t, qtype, layout))
        held: list[Act] = []  # the partial-sum scratch, alive until its dispatches are recorded
        part = self._scratch_maker(held)
        if x.scale is None:
            x.scale = self._new_row_scales(t, k)
            rs = self._kernel("row_scale", self.row_block)
            record_row_scale(self._rec, rs, x.view, *(a.view for a in x.scale), k, t)
        scale, xh = (a.view for a in x.scale)
        target = self.coopmat_prefill_target if t > Q8_MAX_T else self.coopmat_decode_target
        split = {"target": target, "slots": self._coopmat_slots(kern) if self.coopmat_waves else 0}
        if len(ws) == 2:
            name, block = ("geglu_row_scale", self.row_block) if geglu_xh else ("split_reduce_geglu", None)
            reduce = self._kernel(name, block)
            views = (ws[0].view, ws[1].view)
            out = {"xh_out": tuple(a.view for a in y.scale)} if geglu_xh else {}
            record_coopmat_geglu(
                self._rec, kern, reduce, *views, xh, y.view, scale, k, n, t, part, **split, **out
            )
        else:
            reduce, kept = self._kernel("split_reduce"), self._keeper(y, held) if keep else None
            views = (ws[0].view, xh, y.view, scale)
            record_coopmat(self._rec, kern, reduce, *views, k, n, t, part, **split, keep=kept)

    def _coopmat_slots(self, kern: Kernel) -> int:
        """How many workgroups of the coopmat ``kern`` the device holds at once, probed on its first use
        (residency.py); 0 where the probe failed (logged): its K split then follows the targets."""
        slots = self.residency.get(kern.name)
        if slots is None:
            try:
                slots = probe_residency(kern)
            except Exception:
                log.exception("%s: residency probe failed; K split for the workgroup targets", kern.name)
                slots = 0
            self.residency[kern.name] = slots
        return slots

    def _q8(self, x: Act) -> tuple[Act, Act]:
        """x's q8 form, one or three planes (quantized here on first use, then kept on the Act)."""
        if x.q8 is None:
            t, k = x.shape
            xq, xd = self._new_q8(t, k, self.planes)
            self._dispatch(
                "quantize_x3" if self.planes == 3 else "quantize_q8",
                [x.view, xq.view, xd.view],
                QuantizeQ8Push(k, t, k),
                self._grid(t * k // 4, 128),  # one XQ word an invocation: every word in one round
            )
            x.q8 = (xq, xd)
        return x.q8

    def residual_norm(self, x: Act, a: Act, w_a: VkWeight, w_next: VkWeight | None, eps: float):
        t, d = x.shape
        if d % 4 or d > RESIDUAL_MAX_COLS:
            return super().residual_norm(x, self._summed(a), w_a, w_next, eps)
        xo = self._new(x.shape)
        a_view, splits = self._sums(a)
        push, block = ResidualNormPush(d, t, eps, splits), residual_block(d)
        if w_next is None:
            self._dispatch("residual_norm", [x.view, a_view, w_a.view, xo.view], push, t, block)
            return xo, None
        h = self._new(x.shape)
        binds, name = [x.view, a_view, w_a.view, xo.view, w_next.view, h.view], "residual_norm_next"
        if self.planes and (t <= Q8_MAX_T or self.deterministic) and d % 64 == 0:
            # int8 mat-vecs may follow (K % 64 == 0: XQ's order): quantize h here too (one plane or three)
            h.q8 = self._new_q8(t, d, self.planes)
            name += "_x3" if self.planes == 3 else "_q8"
            binds += [h.q8[0].view, h.q8[1].view]
        if policy.coopmat_steps(self.options, self.caps, t) and d % 8 == 0:
            # the cooperative-matrix GEMM may follow: h's row scales and float16 copy (row_scale's) too
            h.scale = self._new_row_scales(t, d)
            name += "_xh"
            binds += [a.view for a in h.scale]
        self._dispatch(name, binds, push, t, block)
        return xo, h

    def _summed(self, a: Act) -> Act:
        """a with its values in its buffer: partial sums left unsummed added (split_reduce)."""
        if a.parts:
            (part, splits, _), t, n = a.parts, a.shape[0], math.prod(a.shape[1:])
            record_split_sums(self._rec, self._kernel("split_reduce"), part, a.buf.view, n, t, splits, n, 0)
            a.parts = None
        return a

    @staticmethod
    def _sums(a: Act) -> tuple[BufferView, int]:
        """(a's values, 1), or (its partial sums, how many) where a GEMM left them unsummed."""
        return a.parts[:2] if a.parts else (a.view, 1)

    def norm_rope(self, x: Act, w: VkWeight, eps: float, positions, base: float, scale: float) -> Act:
        t, h, dh = x.shape
        assert w.shape == (dh,), f"{w.name}: shape {w.shape}, heads of {dh}"
        y = self._new(x.shape)
        push = NormRopePush(t, h, dh, h * dh, h * dh, self._layout.positions, base, scale, eps)
        self._dispatch("norm_rope_f32", [x.view, w.view, self.meta_gpu, y.view], push, t * h)
        return y

    def rope(self, x: Act, positions, base: float, scale: float) -> Act:
        t, h, dh = x.shape
        y = self._new(x.shape)
        push = RopePush(t, h, dh, h * dh, h * dh, self._layout.positions, base, scale)
        self._dispatch("rope_f32", [x.view, self.meta_gpu, y.view], push, self._grid(t * h * dh // 2))
        return y

    def attention(self, q: Act, k: Act, v: Act, layer: int, batch, window: int | None, scale: float) -> Act:
        t, hkv = k.shape[0], k.shape[1]
        pool, kp, vp, slot_off = self._kv_pool(layer)
        row = hkv * k.shape[2]
        write = KvWritePush(t, row, row, row, slot_off)
        pool_t, _ = KV_DTYPES[self.kv_dtype]
        self._dispatch(
            f"kv_write_{pool_t}", [k.view, v.view, self.meta_gpu, kp, vp], write, self._grid(t * row)
        )
        return self._attend(q, hkv, layer, window, scale)

    def normed_attention(self, q, k, v, wq, wk, eps: float, batch, rope, layer: int, window, scale: float):
        """The q and k norms, RoPE and the cache write in one dispatch (norm_rope_kv.comp: three dispatches
        and a barrier fewer), then the attention passes."""
        if not self.options.fused("norm_rope_kv"):
            q, k, v = (self._summed(a) for a in (q, k, v))
            return super().normed_attention(q, k, v, wq, wk, eps, batch, rope, layer, window, scale)
        (t, h, dh), hkv = q.shape, k.shape[1]
        assert wq.shape == wk.shape == (dh,), f"{wq.name}, {wk.name}: heads of {dh}"
        pool, kp, vp, slot_off = self._kv_pool(layer)
        qn = self._new(q.shape)
        (qv, qs), (kv, ks), (vv, vs) = (self._sums(a) for a in (q, k, v))  # values, or partial sums
        splits = (qs, ks, vs)
        push = NormRopeKvPush(t, h, hkv, dh, self._layout.positions, slot_off, *rope, eps, splits=splits)
        binds = [qv, kv, vv, wq.view, wk.view, self.meta_gpu, qn.view, kp, vp]
        self._dispatch(f"norm_rope_kv_{KV_DTYPES[self.kv_dtype][0]}", binds, push, t * (h + 2 * hkv))
        return self._attend(qn, hkv, layer, window, scale)

    def _kv_pool(self, layer: int) -> tuple[str, BufferView, BufferView, int]:
        """(pool, K view, V view, the metadata offset of the step's slots in it) of ``layer``'s cache."""
        pool, slot = self.kv_layout.pool_of(layer)
        kp, vp = self.kv_views[(pool, slot)]
        return pool, kp, vp, self._layout.slot_global if pool == "global" else self._layout.slot_local

    def _attend(self, q: Act, hkv: int, layer: int, window: int | None, scale: float) -> Act:
        """Split-K attention of q (T, H, Dh) over ``layer``'s cache (this step's k, v written): pass 1 (with
        the prefill tiles in big buckets), then pass 2. -> (T, H * Dh), with its int8 planes for the output
        projection when the int8 mat-vec takes it."""
        lay, meta = self.kv_layout, self._layout
        t, h, dh = q.shape
        g = h // hkv
        assert _attention_limits(dh, g) is None, _attention_limits(dh, g)  # load_model refused such models
        pool, kp, vp, _ = self._kv_pool(layer)
        info_off = meta.info_global if pool == "global" else meta.info_local
        pool_t, _ = KV_DTYPES[self.kv_dtype]
        # split-K: about attention_target workgroups at small batches (a split takes at least min_keys keys,
        # so splits past the sequence's length / min_keys exit at once); the partials stay ~attention_target
        # * G * Dh floats.
        # With tiles, as many as the tiles want (a tile's workgroup per 32 query vectors and split, for about
        # attention_prefill_target workgroups: the long causal rows of a prompt's last tiles spread)
        tiles = policy.prefill_kernel(self.options, self.caps, pool_t, dh, g) if meta.max_tiles else None
        splits = -(-self.attention_target // (t * hkv))
        if tiles:
            splits = max(splits, -(-self.attention_prefill_target // max(1, t * h // ATTENTION_PREFILL_TILE)))
        splits = max(1, min(ATTENTION_MAX_SPLITS, splits))
        if self.deterministic:  # a row's split boundaries then depend on its position only
            splits = DETERMINISTIC_SPLITS
        part = self._new((t, h, splits, dh + 4))  # (m, l, padding, acc): shaders/attention_part.glsl
        binds = [q.view, kp, vp, self.meta_gpu, part.view]
        push = AttentionSplitPush(
            *(t, h, hkv, dh, h * dh, splits, lay.block_size, window or 0),
            *(meta.positions, meta.seq, info_off, scale, meta.tiled if tiles else 0, self.attention_min_keys),
        )
        self._dispatch(
            policy.attention_kernel(self.options, self.caps, pool_t, dh, g), binds, push, t * hkv * splits
        )
        if tiles:  # the tiles' rows (the kernel above skipped them), into the same partials
            push = AttentionPrefillPush(
                *(meta.max_tiles, h, hkv, dh, h * dh, splits, lay.block_size, window or 0),
                *(meta.positions, info_off, meta.tiles, scale),
            )
            self._dispatch(tiles, binds, push, attention_prefill_groups(meta.max_tiles, g, hkv, splits))
        o = self._new((t, h * dh))
        reduce = AttentionReducePush(t, h, dh, splits, h * dh)
        # the output projection's int8 input too (a head is whole q8 blocks; K % 64 == 0: XQ's order)
        if self.planes and (t <= Q8_MAX_T or self.deterministic) and dh % 32 == 0 and h * dh % 64 == 0:
            o.q8 = self._new_q8(t, h * dh, self.planes)
            binds = [part.view, o.view, o.q8[0].view, o.q8[1].view]
            name = "attention_reduce_f32_x3" if self.planes == 3 else "attention_reduce_f32_q8"
            self._dispatch(name, binds, reduce, t * h)
        else:
            self._dispatch("attention_reduce_f32", [part.view, o.view], reduce, t * h)
        return o

    def geglu(self, gate: Act, up: Act) -> Act:
        t, f = gate.shape
        y = self._new(gate.shape)
        self._dispatch("geglu_f32", [gate.view, up.view, y.view], GegluPush(f, t, f, f, f), self._grid(t * f))
        return y

    def add(self, a: Act, b: Act) -> Act:
        assert a.size == b.size
        y = self._new(a.shape)
        self._dispatch("add_f32", [a.view, b.view, y.view], AddPush(a.size), self._grid(a.size))
        return y

    def prefetch(self, ws: list[VkWeight]) -> None:
        """At decode sizes (buckets of up to MATVEC_MAX_T tokens), read the first ``prefetch_bytes`` of
        ``ws`` (shared in proportion to their sizes) beside the last op recorded (prefetch_vec4: loads kept
        only in the cache), so that the next matmul finds them in the GPU's last-level cache."""
        if not self.prefetch_bytes or self._t_b > MATVEC_MAX_T:
            return
        ws = [w for w in ws if not across_bus(self.dev, w.view)]  # a dGPU's host heap: no L2 to fill
        total = sum(w.view.nbytes for w in ws)
        for w in ws:
            nbytes = min(w.view.nbytes, self.prefetch_bytes * w.view.nbytes // total) // 16 * 16
            if nbytes:
                groups = min(1024, -(-nbytes // (16 * 256 * 4)))  # 4 loads an invocation a round
                binds = [(w.view, 0, nbytes), self.sinks.take(4)]
                self._dispatch("prefetch_vec4", binds, CopyPush(nbytes // 16), groups)

    def rows(self, x: Act, idx) -> Act:
        """Gather the step's logit rows (indices from the metadata) with the float32 embed kernel."""
        t, d = x.shape
        y = self._new((len(idx), d))
        push = EmbedPush(len(idx), d, self._layout.logit_rows, 0, t, d, 1.0)
        self._dispatch("embed_f32", [self.meta_gpu, x.view, y.view], push, len(idx))
        return y

    def reshape(self, x: Act, shape: tuple[int, ...]) -> Act:
        assert math.prod(shape) == x.size, f"reshape {x.shape} -> {shape}"
        y = Act(x.buf, shape)
        y.parts = x.parts  # partial sums (split s at s * size) keep their layout
        return y


# -- weight forms and placement ------------------------------------------------------------------------------
def _rows(v: BufferView, t0: int, n: int, row_bytes: int) -> BufferView:
    """Rows t0 .. t0+n-1 of an activation whose rows are ``row_bytes`` apart."""
    return BufferView(v.arena, v.offset + t0 * row_bytes, n * row_bytes, name=v.name)


def _t1(t: int) -> str:
    """The suffix of the int8 mat-vec variant built for one token."""
    return "_t1" if t == 1 else ""


def _type_name(qtype: QType, table: dict[str, QType]) -> str:
    """The variant suffix of ``qtype`` in a kernel table (MATMUL_TYPES, UNIT_TYPES)."""
    return next(s for s, q in table.items() if q == qtype)


def _upload_form(t: WeightTensor) -> tuple[np.ndarray, QType]:
    """The array uploaded for ``t`` and its type: the file's bytes when a shader reads them, else float."""
    if len(t.shape) == 1:
        data = t.data if t.qtype == QType.F32 else t.dequantize()
        return np.ascontiguousarray(data, dtype=np.float32), QType.F32
    if t.qtype in MATMUL_TYPES.values():
        return t.data, t.qtype
    return t.dequantize().astype(np.float16), QType.F16


def _row_bytes(data: np.ndarray) -> int:
    return int(data.nbytes // data.shape[0]) if data.ndim > 1 else 0


def _is_hot(name: str, data: np.ndarray) -> bool:
    """Norms, and the token embedding / output projection (read every step)."""
    return data.ndim == 1 or name.split("@")[0] in ("token_embd.weight", "output.weight")
