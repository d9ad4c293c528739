"""VulkanVisionOps: Gemma 3's vision encoder (model/siglip.py's VisionTower) on the GPU.

``VisionTower(cfg, weights, backend.vision_ops()).encode(pixels)`` runs unchanged: each op here appends
dispatches to one command buffer instead of computing, and hands on a :class:`VTensor` (a device range, a
shape, an element format) in place of an array. Activations live in this object's own scratch pool (a range
returns to it when its last handle dies, as the text model's ``Act``); the recorder places barriers where
one dispatch reads what another wrote. Nothing runs until a result is wanted on the host: ``to_host(t)`` (or
``np.asarray(t)``) copies ``t`` into a mapped readback buffer at the end of the command buffer, submits it
once, waits, and returns ``(…)`` float32. So one encode call is one submit; the next op starts a new
command buffer (and frees the scratch again).

Recorded once, replayed: ``VulkanVisionOps.run(tower, pixels)`` (or :func:`encode`) records a tower's
encode once per pixels shape (image count) and replays it: the pixels written into the staging buffer its
first command copies from, one submit, the soft tokens read from the mapped buffer its last command writes.
Recordings share the scratch and staging buffers (encodes never overlap: each is waited for); each has its
own output buffer.

Weights: :meth:`VulkanVisionOps.upload` puts a tower's canonical tensors on the device once, packed in a few
arenas, and returns handles to build the VisionTower with; a numpy array handed straight to an op is
uploaded on first use and kept (by identity) instead. Matrices are stored float16 or float32
(vision_policy.weight_format: float16 where the GEMMs run on cooperative matrices) as the (N, K) rows the
text model's matmul kernels read: the projector's (in, out) weight transposed, the patch embedding's
(D, C, p, p) as (D, C * p * p) padded with zero columns to vision_policy.padded_k, and (uploaded by name)
the FFN's width padded likewise (fc1's rows and bias, fc2's columns: vision_policy.PAD_ROWS_SUFFIXES), so
every GEMM of an uploaded tower has K in whole steps of the text kernels (a handle keeps its given
``shape``; ``nk`` is the stored one); vectors and the position embedding float32.

Kernels (chosen by vision_policy.py): im2col (rows padded to the GEMM's K) + the GEMM for the patch
embedding; every GEMM (patch embedding, q/k/v/out, fc1, fc2, projector) on the text model's kernels where
vision_policy.gemm_kernel says (the cooperative-matrix GEMM after row_scale's float16 copy of x, or the
tiled mat-mat; the bias then added by the op reading the output), else shaders/vision_linear.comp with its
bias in the epilogue; LayerNorm / RMSNorm one workgroup a row; GELU and the (broadcasting) add grid-stride;
dense attention per (image, head) flash style (online softmax, K and V chunks in shared memory), on
cooperative matrices where vision_policy.attention_kernel says (vision_attention_cm.comp, 16 query rows a
subgroup, on float16 heads that vision_qkv_f16.comp writes first); the k x k average pool
(shaders/vision_*.comp).

GPU time: with ``timestamps`` set, an encode (recorded or replayed) writes a timestamp after every command
and ``last_gpu`` holds ``{"total_ns", "commands": [(label, ns)]}``, the label a kernel's name (or "vision
input" / "vision output" for the copies); a replay with ``timestamps`` set uses a recording made with them.

The seam for keeping the soft tokens on the GPU: the projector's output is a VTensor in this object's
scratch until ``to_host``; a later step can bind its view instead of reading it back.
"""

from __future__ import annotations

import ctypes
import math
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np

from hmad.backends.vision_ops import VisionOps
from hmad.backends.vulkan import policy
from hmad.backends.vulkan import vision_policy as vp
from hmad.backends.vulkan.activations import ScratchPool, _Buf
from hmad.backends.vulkan.context import RecordContext
from hmad.backends.vulkan.kernels_coopmat import record_coopmat, record_row_scale
from hmad.backends.vulkan.kernels_matmul import record_matmul
from hmad.backends.vulkan.memory import Arena, BufferView, Uploader, create_buffer
from hmad.backends.vulkan.memory_plan import align_up, choose_memory_type
from hmad.backends.vulkan.ops_matmul import coopmat_slots
from hmad.backends.vulkan.recorder import CommandRecorder
from hmad.backends.vulkan.vision_push import (
    ATTENTION_BLOCK,
    ATTENTION_CM_ROWS,
    VisionAttentionPush,
    VisionEltwisePush,
    VisionIm2colPush,
    VisionLinearPush,
    VisionNormPush,
    VisionPoolPush,
    VisionQkvPush,
)

F32 = np.float32
#: the GEMM's output tile (vision_linear.comp: BN = BT = 64)
GEMM_TILE = 64
#: weights are packed into arenas of about this size (drivers cap the number of allocations)
ARENA_BYTES = 256 << 20
#: the host waits this long for one encode's fence (a CPU driver runs a real tower for minutes)
ENCODE_TIMEOUT_S = 3600.0
_NP = {"f32": np.float32, "f16": np.float16}


class VTensor:
    """A vision-op tensor on the device: ``view`` (its bytes), ``shape``, ``fmt`` ("f32" / "f16").

    ``keep`` holds what must live as long as the handle (an activation's scratch range). ``epoch``: the
    encode (command buffer) an activation belongs to; a handle from an encode already read back is stale.
    ``nk``: a weight's stored shape (a matrix's (N, K): module docstring), None for activations. ``xh``: an
    activation's row scales and float16 copy (row_scale.comp), made by its first cooperative-matrix GEMM
    and kept for the next ones (q, k and v read one input). ``bias``: a GEMM output's bias not yet added
    (a (N,) handle): its value is ``view`` + bias over the last axis; the op that reads it adds it
    (vision_bias_gelu, vision_add3) or has it added first (:meth:`VulkanVisionOps._act`).
    """

    __slots__ = ("view", "keep", "shape", "fmt", "ops", "epoch", "nk", "xh", "bias")

    def __init__(self, view: BufferView, shape, fmt: str, ops: VulkanVisionOps, keep: Any = None, epoch=None):
        self.view, self.shape, self.fmt, self.ops = view, tuple(shape), fmt, ops
        self.keep, self.epoch, self.nk, self.xh, self.bias = keep, epoch, None, None, None

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def reshape(self, *shape) -> VTensor:
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], tuple | list) else shape
        assert math.prod(shape) == self.size, f"reshape {self.shape} -> {shape}"
        src = self
        if self.bias is not None and (not shape or shape[-1] != self.shape[-1]):
            src = self.ops._act(self)  # the bias added: it broadcasts over the last axis only
        out = VTensor(src.view, shape, src.fmt, src.ops, src.keep, src.epoch)
        out.bias = src.bias
        return out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        a = self.ops.to_host(self)
        return a if dtype is None else a.astype(dtype)

    def __repr__(self) -> str:
        return f"VTensor({self.shape}, {self.fmt})"


@dataclass
class VisionGraph:
    """One encode recorded (a tower, a pixels shape): its command buffer, the staging buffer its first command
    copies the pixels from, and the mapped buffer its last command writes the result (``shape``) into."""

    rec: CommandRecorder
    stage: BufferView
    out: BufferView
    shape: tuple[int, ...]


class VulkanVisionOps(VisionOps):
    """The vision ops recorded into one command buffer per encode (module docstring)."""

    def __init__(self, ctx: RecordContext, weight_format: str = "auto"):
        vp.weight_format(weight_format, "", 2, "float32")  # a bad option fails here
        self.ctx, self.dev, self.weight_format = ctx, ctx.dev, weight_format
        self.scratch = ScratchPool(ctx.dev)
        self.arenas: list[Arena] = []  # the uploaded weights'
        self.cache: dict[tuple[int, str], tuple[np.ndarray, VTensor]] = {}  # id(array), fmt -> upload
        self.staging: list[BufferView] = []  # host inputs (pixels), reused by size across encodes
        self.readback: BufferView | None = None
        self.rec: CommandRecorder | None = None
        self.epoch = 0
        self.encodes = 0  # command buffers submitted (tests read it)
        # set: each encode from then on writes a GPU timestamp after every command (a replay takes a
        # recording made with them, recorded on first use)
        self.timestamps = False
        self.last_gpu: dict[str, Any] = {}  # then: the last encode's {"total_ns", "commands": [(label, ns)]}
        self._in_use: list[BufferView] = []  # the staging buffers of the encode being recorded
        self.graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tower -> {shape: VisionGraph}
        self.recordings = 0  # encodes recorded for replay (tests read it)
        self._up = None  # the Uploader of the weights, made on first use

    # -- weights ---------------------------------------------------------------------------------------
    def upload(self, weights: dict[str, np.ndarray]) -> dict[str, VTensor]:
        """Every tensor on the device once (packed in arenas of about ARENA_BYTES), each stored as
        vision_policy.weight_format says; returns name -> handle, to build a VisionTower with."""
        items = []
        for name, a in weights.items():
            a = np.asarray(a)
            fmt = vp.weight_format(self.weight_format, name, a.ndim, a.dtype.name, self._coopmat_on())
            stored = stored_tensor(name, a)
            items.append((name, a.shape, np.ascontiguousarray(stored, dtype=_NP[fmt]), fmt))
        align = self.ctx.align
        out: dict[str, VTensor] = {}
        while items:
            batch, total = [], 0
            while items and (not batch or total + items[0][2].nbytes <= ARENA_BYTES):
                batch.append(items.pop(0))
                total += align_up(batch[-1][2].nbytes, align)
            views = self._pack([i[2] for i in batch])
            for (name, shape, a, fmt), view in zip(batch, views, strict=True):
                out[name] = VTensor(view, shape, fmt, self)
                out[name].nk = a.shape
        return out

    def _pack(self, arrays: list[np.ndarray]) -> list[BufferView]:
        arena, views = pack_arrays(self.dev, self.ctx.align, self._uploader(), arrays)
        self.arenas.append(arena)
        return views

    def _coopmat_on(self) -> bool:
        """Whether the GEMMs run on cooperative matrices on this device (the weights' "auto" format)."""
        return policy.coopmat_on(self.ctx.options, self.ctx.caps)

    def _uploader(self) -> Uploader:
        if self._up is None:
            self._up = Uploader(self.dev, chunk_bytes=16 << 20, slots=2)
        return self._up

    def _weight(self, w: Any, matrix: bool, transposed: bool = False) -> VTensor:
        """A weight as a device handle: given as one, or a numpy array uploaded on first use (kept by its
        identity: the array itself is held, so its id is not reused); a matrix stored as ``upload`` does
        (``transposed``: given (in, out))."""
        if isinstance(w, VTensor):
            return w
        a = np.asarray(w)
        fmt = vp.weight_format(
            self.weight_format, "", a.ndim if matrix else 1, a.dtype.name, self._coopmat_on()
        )
        hit = self.cache.get((id(w), fmt))
        if hit is None:
            stored = stored_matrix(a, transposed) if matrix else a
            (view,) = self._pack([np.ascontiguousarray(stored, dtype=_NP[fmt])])
            t = VTensor(view, a.shape, fmt, self)
            t.nk = stored.shape
            hit = self.cache[(id(w), fmt)] = (w, t)
        return hit[1]

    # -- recording -------------------------------------------------------------------------------------
    def _recorder(self) -> CommandRecorder:
        if self.rec is None:
            self.scratch.begin()
            self._in_use = []
            self.rec = CommandRecorder(self.dev, timestamps=self.timestamps).begin()
        return self.rec

    def _new(self, shape: tuple[int, ...]) -> VTensor:
        self._recorder()
        buf: _Buf = self.scratch.take(4 * math.prod(shape))
        return VTensor(buf.view, shape, "f32", self, keep=buf, epoch=self.epoch)

    def _act(self, x: Any, lazy: bool = False) -> VTensor:
        """An activation handle of this encode; a host array is copied in by the command buffer itself
        (through a mapped staging buffer), so it lands after the dispatches recorded before it. A pending
        bias (VTensor.bias) is added here (vision_add, the handle then holding the sum) unless ``lazy``."""
        if isinstance(x, VTensor):
            if x.epoch is not None and x.epoch != self.epoch:
                raise ValueError("a vision activation of an encode already read back (to_host) is stale")
            if x.bias is not None and not lazy:
                y = self._new(x.shape)
                push = VisionEltwisePush(x.size, x.bias.size)
                self._dispatch("vision_add", [x, x.bias, y], push, self._grid(x.size))
                x.view, x.keep, x.bias, x.xh = y.view, y.keep, None, None
            return x
        a = np.ascontiguousarray(x, dtype=F32)
        self._recorder()
        stage = self._staging(a.nbytes)
        stage.array(np.uint8)[: a.nbytes] = a.reshape(-1).view(np.uint8)
        t = self._new(a.shape)
        self.rec.copy(stage, t.view, a.nbytes, label="vision input")
        return t

    def _staging(self, nbytes: int) -> BufferView:
        free = [s for s in self.staging if s.nbytes >= nbytes and s not in self._in_use]
        if free:
            s = min(free, key=lambda s: s.nbytes)
        else:
            s = create_buffer(self.dev, nbytes, "upload", "vision input")
            self.staging.append(s)
        self._in_use.append(s)
        return s

    def _dispatch(self, name: str, tensors: list[VTensor], push: ctypes.Structure, groups) -> None:
        rec = self._recorder()
        k = self.ctx.kernel(name)
        groups = groups if isinstance(groups, tuple) else k.groups_for(groups)
        rec.dispatch(k, [t.view for t in tensors], push, groups)

    def _grid(self, n: int) -> int:
        return self.ctx.grid(n, 256, cap=65535)

    def to_host(self, x: Any) -> np.ndarray:
        """``x`` on the host (float32, its shape): the command buffer recorded so far, submitted and waited
        for, with ``x`` read back at its end. Every activation of that encode is stale afterwards."""
        if not isinstance(x, VTensor):
            return np.asarray(x, dtype=F32)
        rec = self._recorder()
        x = self._act(x)
        nbytes = 4 * x.size
        if self.readback is None or self.readback.nbytes < nbytes:
            if self.readback is not None:
                self.readback.arena.close()
            self.readback = create_buffer(self.dev, nbytes, "readback", "vision output")
        rec.copy(x.view, self.readback, nbytes, label="vision output")
        rec.end()
        try:
            rec.submit(timeout_s=ENCODE_TIMEOUT_S)
            out = self.readback.array(F32)[: x.size].reshape(x.shape).copy()
            self.last_gpu = rec.gpu_times()
        finally:
            rec.close()
            self.rec, self._in_use = None, []
            self.epoch += 1
        self.encodes += 1
        return out

    def run(self, tower, pixels: np.ndarray) -> np.ndarray:
        """``tower.encode(pixels)`` on the host, (n, mm_tokens, E) float32: as many images a pass as
        vision_policy.images_per_pass lets bind whole, each pass a replay of its recording (``replay``)."""
        c = tower.cfg
        per = vp.activation_bytes(c.n_patches, c.hidden, vp.padded_k(c.ffn), vp.padded_k(3 * c.patch_size**2))
        step = vp.images_per_pass(len(pixels), per, self.ctx.caps)
        parts = [self.replay(tower, pixels[i : i + step]) for i in range(0, len(pixels), step)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def prepare(self, tower) -> None:
        """The weights uploaded (``upload``: stored and padded for the text kernels; the host arrays are
        dropped) and a one-image encode recorded, at load, before the KV cache takes the memory."""
        if any(isinstance(w, np.ndarray) for w in tower.w.values()):
            tower.w = self.upload(tower.w)
        s = tower.cfg.image_size
        self.run(tower, np.zeros((1, 3, s, s), F32))

    def replay(self, tower, pixels: np.ndarray) -> np.ndarray:
        """``tower.encode(pixels)`` on the host, from the tower's recording for this pixels shape (made on
        first use: its ops run once, recording): the pixels into its staging buffer, one submit."""
        px = np.ascontiguousarray(pixels, dtype=F32)
        graphs = self.graphs.setdefault(tower, {})
        key = (px.shape, self.rec_timestamps())
        g = graphs.get(key)
        if g is None:
            g = graphs[key] = self._record(tower, px)
        g.stage.array(np.uint8)[: px.nbytes] = px.reshape(-1).view(np.uint8)
        g.rec.submit(timeout_s=ENCODE_TIMEOUT_S)
        self.last_gpu = g.rec.gpu_times()
        self.encodes += 1
        return g.out.array(F32)[: math.prod(g.shape)].reshape(g.shape).copy()

    def rec_timestamps(self) -> bool:
        """Whether an encode recorded now writes timestamps (``timestamps`` set and the device has them)."""
        return bool(self.timestamps and self.dev.caps["timestamps"])

    def _record(self, tower, px: np.ndarray) -> VisionGraph:
        if self.rec is not None:
            raise RuntimeError("vision ops: an encode is being recorded (read its result first)")
        rec = self._recorder()
        try:
            y = self._act(tower.encode(px))
            assert len(self._in_use) == 1, "a recorded encode takes one host input: the pixels"
            out = create_buffer(self.dev, 4 * y.size, "readback", "vision output (recorded)")
            rec.copy(y.view, out, 4 * y.size, label="vision output")
            rec.end()
            graph = VisionGraph(rec, self._in_use[0], out, y.shape)
        except BaseException:
            rec.close()
            raise
        finally:
            self.rec, self._in_use = None, []
            self.epoch += 1
        self.recordings += 1
        return graph

    # -- the ops (VisionOps' contracts; shapes as there) -----------------------------------------------
    def patch_embed(self, pixels, w, b, patch: int) -> VTensor:
        n, c, s, _ = pixels.shape
        g, kp = s // patch, vp.padded_k(c * patch * patch)
        px = self._act(pixels)  # (n, C, S, S)
        cols = self._new((n * g * g, kp))  # (n*P, C*p*p then zeros)
        total = n * g * g * kp
        push = VisionIm2colPush(total, s, patch, c, kp)
        self._dispatch("vision_im2col", [px, cols], push, self._grid(total))
        wt = self._weight(w, matrix=True)  # stored (D, Kp)
        y = self._gemm(cols, wt, self._weight(b, matrix=False))
        return y.reshape(n, g * g, wt.nk[0])

    def linear(self, x, w, b) -> VTensor:
        wt = self._weight(w, matrix=True)
        return self._gemm(self._act(x), wt, None if b is None else self._weight(b, matrix=False))

    def matmul(self, x, w) -> VTensor:
        return self._gemm(self._act(x), self._weight(w, matrix=True, transposed=True), None)

    def _gemm(self, x: VTensor, w: VTensor, b: VTensor | None) -> VTensor:
        """x (..., K) against w's stored (N, K) matrix, + b (N,) -> (..., N), on vision_policy.gemm_kernel's
        kernel: the text model's (then the bias added by vision_add) or vision_linear.comp (bias fused)."""
        k = x.shape[-1]
        n, wk = w.nk
        if wk != k:
            raise ValueError(f"vision GEMM: x {x.shape} against w {w.shape} (stored {w.nk})")
        rows = x.size // k
        if b is not None and b.nk not in (None, (n,)):
            raise ValueError(f"vision GEMM: bias {b.shape} (stored {b.nk}) against {n} outputs")
        b = None if b is None else VTensor(b.view, (n,), b.fmt, self)  # as stored (padded)
        y = self._new((*x.shape[:-1], n))
        name = vp.gemm_kernel(self.ctx.options, self.ctx.caps, w.fmt, rows, k)
        if name.startswith("mul_mm_coopmat_"):
            self._coopmat(name, x, w, y, rows, k, n)
        elif name.startswith("mul_mat_"):
            record_matmul(self._recorder(), self.ctx.kernel(name), w.view, x.view, y.view, k, n, rows)
        else:
            push = VisionLinearPush(k, n, rows, int(b is not None))
            groups = (-(-n // GEMM_TILE), -(-rows // GEMM_TILE), 1)
            self._dispatch(name, [w, x, b or x, y], push, groups)
            return y
        y.bias = b  # added by the op that reads y
        return y

    def _coopmat(self, name: str, x: VTensor, w: VTensor, y: VTensor, t: int, k: int, n: int) -> None:
        """y = x · Wᵀ on the text model's cooperative-matrix GEMM ``name``: x's row scales and float16 copy
        (row_scale.comp) made on first use (``x.xh``; x has no pending bias), K split as kernels_coopmat
        says (partial sums in this encode's scratch)."""
        rec, ctx = self._recorder(), self.ctx
        if x.xh is None:  # row scales, xh: kept with x (its scratch ranges live as long as the handle)
            x.xh = (self.scratch.take(4 * t), self.scratch.take(2 * t * k))
            scale, xh = (b.view for b in x.xh)
            record_row_scale(rec, ctx.kernel("row_scale", ctx.row_block), x.view, scale, xh, k, t)
        scale, xh = (b.view for b in x.xh)
        held: list = []  # the partial sums: alive until recorded

        def part(nbytes: int) -> BufferView:
            held.append(self.scratch.take(nbytes))
            return held[-1].view

        kern = ctx.kernel(name)
        slots = coopmat_slots(ctx, kern) if ctx.options.coopmat_waves else 0
        target = ctx.options.coopmat_prefill_target
        views = (w.view, xh, y.view, scale)
        record_coopmat(
            rec, kern, ctx.kernel("split_reduce"), *views, k, n, t, part, target=target, slots=slots
        )

    def layer_norm(self, x, w, b, eps: float) -> VTensor:
        return self._norm("vision_layer_norm", x, w, b, eps)

    def rms_norm(self, x, w, eps: float) -> VTensor:
        return self._norm("vision_rms_norm", x, w, None, eps)

    def _norm(self, name: str, x, w, b, eps: float) -> VTensor:
        x = self._act(x)
        d = x.shape[-1]
        wt = self._weight(w, matrix=False)
        bs = [] if b is None else [self._weight(b, matrix=False)]
        y = self._new(x.shape)
        self._dispatch(name, [x, wt, *bs, y], VisionNormPush(d, x.size // d, eps), x.size // d)
        return y

    def gelu_tanh(self, x) -> VTensor:
        """GELU, of x plus its pending bias in one pass (vision_bias_gelu) where it has one."""
        x = self._act(x, lazy=True)
        y = self._new(x.shape)
        if x.bias is None:
            self._dispatch("vision_gelu", [x, y], VisionEltwisePush(x.size, x.size), self._grid(x.size))
        else:
            push = VisionEltwisePush(x.size, x.bias.size)
            self._dispatch("vision_bias_gelu", [x, x.bias, y], push, self._grid(x.size))
        return y

    def add(self, a, b) -> VTensor:
        """a + b, b broadcast over a's leading axes (b's shape a's trailing one: the position embedding);
        a pending bias of either (not both) added in the same pass (vision_add3)."""
        a = self._act(a, lazy=True)
        bt = self._act(b, lazy=True) if isinstance(b, VTensor) else self._weight(b, matrix=False)
        if bt.fmt != "f32" or tuple(a.shape[a.ndim - bt.ndim :]) != bt.shape:
            raise ValueError(f"vision add: {a.shape} + {bt.shape} ({bt.fmt})")
        if a.bias is not None and bt.bias is not None:
            bt = self._act(bt)
        bias = a.bias if a.bias is not None else bt.bias
        y = self._new(a.shape)
        if bias is None:
            self._dispatch("vision_add", [a, bt, y], VisionEltwisePush(a.size, bt.size), self._grid(a.size))
        else:
            push = VisionEltwisePush(a.size, bt.size, bias.size)
            self._dispatch("vision_add3", [a, bt, bias, y], push, self._grid(a.size))
        return y

    def attention(self, q, k, v, n_heads: int, scale: float) -> VTensor:
        """The attention of q, k, v (n, P, W); where all three have a pending bias (the q, k, v GEMMs') the
        kernels add them as they read (``bias``), else each is added first. On cooperative matrices q, k
        and v go through vision_qkv_f16 first (float16 heads, padded: :meth:`_f16_heads`)."""
        q, k, v = (self._act(t, lazy=True) for t in (q, k, v))
        fused = all(t.bias is not None for t in (q, k, v))
        biases = [t.bias for t in (q, k, v)] if fused else [self._act(t) for t in (q, k, v)]
        n, p, width = q.shape
        dh = width // n_heads
        name = vp.attention_kernel(dh, vp.attention_cm(self.ctx.options, self.ctx.caps))
        if name is None or width % 4:
            raise ValueError(vp.unsupported(width, n_heads) or f"vision attention width {width}")
        o = self._new(q.shape)
        push = VisionAttentionPush(p, width, dh, scale, int(fused))
        if name.startswith("vision_attention_cm"):
            heads = self._f16_heads([q, k, v], biases, n_heads, int(name.rsplit("_d", 1)[1]), scale, fused)
            rows = heads[0].shape[2]
            self._dispatch(name, [*heads, o], push, (rows // ATTENTION_CM_ROWS, n_heads, n))
            return o
        groups = (-(-p // ATTENTION_BLOCK), n_heads, n)
        self._dispatch(name, [q, k, v, o, *biases], push, groups)  # unfused: q, k, v again (unread)
        return o

    def _f16_heads(self, qkv: list[VTensor], biases, heads: int, dhp: int, scale: float, fused: bool):
        """q * scale, k, v (+ their biases when ``fused``) as float16 heads (n, heads, PP, dhp) for
        vision_attention_cm (vision_qkv_f16.comp): PP = P in whole ATTENTION_CM_ROWS, zeros past P and dh."""
        n, p, width = qkv[0].shape
        pp = -(-p // ATTENTION_CM_ROWS) * ATTENTION_CM_ROWS
        out = []
        for _ in range(3):
            buf: _Buf = self.scratch.take(2 * n * heads * pp * dhp)
            out.append(VTensor(buf.view, (n, heads, pp, dhp), "f16", self, keep=buf, epoch=self.epoch))
        push = VisionQkvPush(n, p, pp, width, width // heads, dhp, scale, int(fused))
        self._dispatch("vision_qkv_f16", [*qkv, *biases, *out], push, self._grid(n * heads * pp * dhp // 8))
        return out

    def avg_pool(self, x, side: int, k: int) -> VTensor:
        x = self._act(x)
        n, _, d = x.shape
        t = side // k
        y = self._new((n, t * t, d))
        self._dispatch("vision_pool", [x, y], VisionPoolPush(y.size, side, k, d), self._grid(y.size))
        return y

    # -- life cycle ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Every buffer this object made (the device waits for its work first)."""
        self.dev.wait_idle()
        if self.rec is not None:
            self.rec.close()
            self.rec = None
        for graphs in self.graphs.values():
            for g in graphs.values():
                g.rec.close()
                g.out.arena.close()
        self.graphs = weakref.WeakKeyDictionary()
        for v in (*self.staging, self.readback):
            if v is not None:
                v.arena.close()
        for a in self.arenas:
            a.close()
        self.scratch.close()
        if self._up is not None:
            self._up.close()
            self._up = None
        self.arenas, self.staging, self.readback, self.cache = [], [], None, {}


def pack_arrays(dev, align: int, up: Uploader, arrays: list[np.ndarray]) -> tuple[Arena, list[BufferView]]:
    """The arrays uploaded into one new device-local arena, at ``align``-ed offsets: (arena, their views)."""
    offs, at = [], 0
    for a in arrays:
        offs.append(at)
        at += align_up(max(a.nbytes, 4), align)
    t = choose_memory_type(dev.memory_types, "device", dev.heaps)
    arena = Arena(dev, at, t.index)
    views = [BufferView(arena, o, a.nbytes, name="vision weight") for o, a in zip(offs, arrays, strict=True)]
    for v, a in zip(views, arrays, strict=True):
        up.upload(v, a)
    up.flush()
    return arena, views


def stored_matrix(a: np.ndarray, transposed: bool) -> np.ndarray:
    """A matrix weight as the GEMMs read it, (N, K) rows: a (D, C, p, p) convolution as (D, C * p * p)
    padded with zero columns to vision_policy.padded_k; a (K, N) weight given ``transposed`` as its
    transpose; an (N, K) one as is."""
    if a.ndim == 4:
        return pad_axis(a.reshape(a.shape[0], -1), 1)
    return a.T if transposed else a


def stored_tensor(name: str, a: np.ndarray) -> np.ndarray:
    """The tower's tensor ``name`` as uploaded: a matrix as :func:`stored_matrix` (transposed where named
    in vision_policy.TRANSPOSED_NAMES), padded where PAD_ROWS_SUFFIXES / PAD_COLS_SUFFIXES say; vectors and
    the position embedding as given."""
    if name.endswith(vp.PAD_ROWS_SUFFIXES):
        return pad_axis(a, 0)
    if a.ndim < 2 or name in vp.ADDEND_NAMES:
        return a
    m = stored_matrix(a, name in vp.TRANSPOSED_NAMES)
    return pad_axis(m, 1) if name.endswith(vp.PAD_COLS_SUFFIXES) else m


def pad_axis(a: np.ndarray, axis: int) -> np.ndarray:
    """``a`` with zeros appended along ``axis`` up to vision_policy.padded_k of its length."""
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, vp.padded_k(a.shape[axis]) - a.shape[axis])
    return np.pad(a, widths)
