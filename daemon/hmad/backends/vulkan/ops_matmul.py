"""The matmuls, recorded: y = x · Wᵀ with W in its file's quant format, the GeGLU pair, the FFN, and the
weight prefetch.

Which kernel takes a step is policy.py's (q8_path, coopmat_for, mmq_for, fused_tail, matvec_name, geglu_xh);
this module records what it says. Decode-sized steps (T_b <= 32, 8 tokens a dispatch) run the mat-vec chosen
by ``matvec``: "exact" (default; activations as three int8 planes, shaders/q8act.glsl: float32-class), "int8"
(one plane) or "float" (float32); exact-path steps of ``mmq_min_tokens`` or more on big Q4_K weights run the
int8 cooperative-matrix GEMM where the device has int8 products (kernels_mmq.py: the same arithmetic, the
three planes' products on the matrix units); steps of ``coopmat_min_tokens`` or more on big weights, and
prefill, run the cooperative-matrix mat-mat where the device offers float16 cooperative matrices, else the
tiled float32 mat-mat. Weights beyond maxStorageBufferRange are bound in ranges (record_matmul).

Activations are quantized once per input (``Act.q8``), the GEMM's float16 copy made once per input
(``Act.scale``), and independent dispatches (q, k, v; the 8-token chunks) carry no barrier between them. A
GEMM's K-split partial sums may stay unsummed (``keep``: ``Act.parts``) for the op that reads y to add
(residual_norm, normed_attention). In deterministic mode every matmul runs the mat-vec, 8 tokens a
dispatch, one layout for every row count.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from hmad.backends.vulkan import policy
from hmad.backends.vulkan.activations import Act, rows
from hmad.backends.vulkan.context import RecordContext
from hmad.backends.vulkan.kernels_coopmat import (
    coopmat_kernel_name,
    coopmat_q4k_layout,
    record_coopmat,
    record_coopmat_geglu,
    record_row_scale,
)
from hmad.backends.vulkan.kernels_matmul import MATVEC_MAX_T, UNIT_TYPES, record_matmul
from hmad.backends.vulkan.kernels_mmq import mmq_pick, record_mmq, record_mmq_geglu
from hmad.backends.vulkan.kernels_q8 import q8_matvec_layout, record_matvec_q8
from hmad.backends.vulkan.memory import BufferView
from hmad.backends.vulkan.pipelines import Kernel
from hmad.backends.vulkan.placement import VkWeight, across_bus
from hmad.backends.vulkan.policy import Q8_MAX_T
from hmad.backends.vulkan.push import CopyPush, QuantizeQ8Push
from hmad.backends.vulkan.residency import probe_residency
from hmad.core.tensors import QType

log = logging.getLogger(__name__)


def matmul(ctx: RecordContext, x: Act, w: VkWeight, keep: bool = False) -> Act:
    """y = x · wᵀ; ``keep``: a K-split GEMM's partial sums stay unsummed (y.parts), for the op that reads
    y to add (residual_norm, normed_attention)."""
    t, k = x.shape
    n = w.shape[0]
    assert w.shape[1] == k, f"{w.name}: shape {w.shape}, x has {k} columns"
    y = ctx.new((t, n))
    assert ctx.rec is not None, "VulkanBackend ops run only while recording (through run())"
    if policy.q8_path(ctx.options, ctx.caps, t, w):
        matvec_q8(ctx, x, [w], y, keep=keep)
        return y
    if policy.coopmat_for(ctx.options, ctx.caps, t, w):
        coopmat(ctx, x, w, y, keep=keep)
        return y
    if ctx.options.deterministic:
        matvec_chunks(ctx, x, w, y)
        return y
    kern = ctx.kernel(policy.matvec_name(ctx.options, ctx.caps, t, w))
    record_matmul(ctx.rec, kern, w.view, x.view, y.view, k, n, t)
    return y


def ffn_geglu_xh(ctx: RecordContext, x: Act, gate: VkWeight, up: VkWeight, down: VkWeight) -> Act:
    """The feed-forward block where gate, up and down all run the cooperative-matrix GEMM (policy.geglu_xh):
    the GeGLU goes straight into the float16 copy and row scales the down GEMM reads (geglu_row_scale.comp:
    what split_reduce_geglu then row_scale make, bit for bit, without the float32 GeGLU written and read);
    the down projection's partial sums kept for residual_norm as ``matmul_for_residual``'s."""
    t = x.shape[0]
    f = ctx.new((t, gate.shape[0]))  # (T, F) never written: only its row scales and float16 copy are
    f.scale = ctx.new_row_scales(t, gate.shape[0])
    coopmat(ctx, x, [gate, up], f, geglu_xh=True)
    return matmul(ctx, f, down, keep=ctx.options.fused("split_sums"))


def matvec_chunks(ctx: RecordContext, x: Act, w: VkWeight, y: Act) -> None:
    """Deterministic mode's float path: the mat-vec of MATVEC_MAX_T tokens (never ``_t1``) for every
    row count, MATVEC_MAX_T rows a dispatch."""
    (t, k), n = x.shape, w.shape[0]
    kern = ctx.kernel(policy.matvec_name(ctx.options, ctx.caps, MATVEC_MAX_T, w))
    align = ctx.dev.limits["minStorageBufferOffsetAlignment"]
    if t > MATVEC_MAX_T and any(b % align for b in (MATVEC_MAX_T * 4 * k, MATVEC_MAX_T * 4 * n)):
        raise ValueError(
            f"{w.name}: deterministic mode needs {MATVEC_MAX_T}-row chunks of x ({k} columns) and y "
            f"({n}) at offsets aligned to {align} bytes"
        )
    for t0 in range(0, t, MATVEC_MAX_T):
        tc = min(MATVEC_MAX_T, t - t0)
        xv, yv = rows(x.view, t0, tc, 4 * k), rows(y.view, t0, tc, 4 * n)
        record_matmul(ctx.rec, kern, w.view, xv, yv, k, n, tc)


def geglu_matmul(ctx: RecordContext, x: Act, gate: VkWeight, up: VkWeight) -> Act | None:
    """One dispatch (or GEMM) for both projections and the GeGLU: the int8 mat-vec (with the fused q8 tail
    at one token), the cooperative-matrix GEMM, or the float mat-vec. None where none takes them (nothing
    recorded): the facade then composes the plain ops."""
    t, k = x.shape
    n = gate.shape[0]
    if not (gate.qtype == up.qtype and gate.shape == up.shape):
        return None
    opt = ctx.options
    if policy.q8_path(opt, ctx.caps, t, gate):
        y = ctx.new((t, n))
        if opt.fused("qout") and policy.fused_tail(opt, ctx.caps, t, gate):  # y's q8 form, too
            y.q8 = ctx.new_q8(t, n, opt.planes)
            tail = [y.q8[0].view, y.q8[1].view, ctx.counters.take(4 * n // 32), y.view]  # y again: vec4
            matvec_q8(ctx, x, [gate, up], y, tail, suffix="_qo")
        else:
            matvec_q8(ctx, x, [gate, up], y)
        return y
    if policy.coopmat_for(opt, ctx.caps, t, gate):
        y = ctx.new((t, n))
        coopmat(ctx, x, [gate, up], y)
        return y
    if opt.deterministic or t > MATVEC_MAX_T or gate.qtype not in UNIT_TYPES.values():
        return None
    y = ctx.new((t, n))
    kern = ctx.kernel(policy.matvec_name(opt, ctx.caps, t, gate, geglu=True))
    record_matmul(ctx.rec, kern, gate.view, x.view, y.view, k, n, t, w_up=up.view)
    return y


def matvec_q8(
    ctx: RecordContext, x: Act, ws: list[VkWeight], y: Act, tail=(), suffix: str = "", keep: bool = False
) -> None:
    """y = x · Wᵀ (or the GeGLU of two weights) on the int8 mat-vec (three planes of x for ``exact``,
    one for ``int8``) in the layout of its shape (q8_matvec_layout), MATVEC_MAX_T tokens a dispatch
    (the chunks read the same weights back to back; no barrier between them). ``suffix`` "_qo": the
    one-token variant with that fused tail (``tail`` its bindings). ``keep``: as :func:`matmul`'s, where
    the int8 GEMM takes the step."""
    if not tail and policy.mmq_for(ctx.options, ctx.caps, x.shape[0], ws[0]):
        mmq(ctx, x, ws, y, keep)
        return
    (t, k), n = x.shape, ws[0].shape[0]
    xq, xd = q8(ctx, x)
    planes = ctx.options.planes
    x_name = "x3" if planes == 3 else "q8x"
    t_name = policy.type_name(ws[0].qtype, UNIT_TYPES)
    base = f"mul_mat_vec_{x_name}_{t_name}" + ("_geglu" if len(ws) > 1 else "")
    one_lane = policy.q8_one_lane(ctx.options, n)
    # deterministic: one layout, never _t1, so that a row sums in the same order whatever the row count; a
    # one-lane layout's rows sum their units in order whatever the tokens, so there _t1 keeps the bits
    fixed = ctx.options.deterministic and not one_lane
    for t0 in range(0, t, MATVEC_MAX_T):
        tc = min(MATVEC_MAX_T, t - t0)
        t_lay = MATVEC_MAX_T if fixed else tc
        lay = q8_matvec_layout(t_lay, n, k, geglu=len(ws) > 1, one_lane=one_lane, t_name=t_name)
        kern = ctx.kernel(base + lay + ("" if fixed else policy.t1(tc)) + suffix)
        xq_rows = rows(xq.view, t0, tc, planes * k)
        chunk = [xq_rows, rows(xd.view, t0, tc, k // 4), rows(y.view, t0, tc, 4 * n)]
        up = ws[1].view if len(ws) > 1 else None
        record_matvec_q8(ctx.rec, kern, ws[0].view, *chunk, k, n, tc, w_up=up, tail=tail)


def scratch_maker(ctx: RecordContext, held: list[Act]) -> Callable[[int], BufferView]:
    """``nbytes -> BufferView`` of new float32 scratch (a GEMM's K-split partial sums), each kept in
    ``held`` so that it stays alive until the caller's dispatches are recorded."""

    def part(nbytes: int) -> BufferView:
        held.append(ctx.new((nbytes // 4,)))
        return held[-1].view

    return part


def keeper(y: Act, held: list[Act]) -> Callable[[BufferView, int], None]:
    """``keep`` for record_split_sums: a GEMM's partial sums left on y (``parts``), their scratch
    ``held`` with them until their reader is recorded."""

    def keep(part: BufferView, splits: int) -> None:
        y.parts = (part, splits, held)

    return keep


def mmq(ctx: RecordContext, x: Act, ws: list[VkWeight], y: Act, keep: bool = False) -> None:
    """y = x · Wᵀ (or the GeGLU of [gate, up]) on the int8 cooperative-matrix GEMM, x as its three
    int8 planes; K split into partial sums (scratch held until recorded) as kernels_mmq says;
    ``keep`` as :func:`matmul`'s."""
    (t, k), n = x.shape, ws[0].shape[0]
    xq, xd = (a.view for a in q8(ctx, x))
    k8 = mmq_k(ctx)
    kern = ctx.kernel(mmq_pick(k8, t, bool(k8) and ctx.caps.mmq_n8))
    held: list[Act] = []  # the partial-sum scratch, alive until its dispatches are recorded
    part = scratch_maker(ctx, held)
    target = ctx.options.mmq_target
    if len(ws) == 2:
        reduce = ctx.kernel("split_reduce_geglu")
        views = (ws[0].view, ws[1].view)
        record_mmq_geglu(ctx.rec, kern, reduce, *views, xq, xd, y.view, k, n, t, part, target=target)
    else:
        reduce, kept = ctx.kernel("split_reduce"), keeper(y, held) if keep else None
        views = (ws[0].view, xq, xd, y.view)
        record_mmq(ctx.rec, kern, reduce, *views, k, n, t, part, target=target, keep=kept)


def mmq_k(ctx: RecordContext) -> int | None:
    """The int8 GEMM's product K where the device has it and the options allow it, else None."""
    return ctx.caps.mmq_k if ctx.options.mmq == "auto" else None


def coopmat(
    ctx: RecordContext,
    x: Act,
    ws: VkWeight | list[VkWeight],
    y: Act,
    geglu_xh: bool = False,
    keep: bool = False,
) -> None:
    """y = x · Wᵀ on the cooperative-matrix mat-mat, or the GeGLU of two weights ([gate, up]: their
    partial sums added and the GeGLU applied in one pass); x's row scales and float16 copy made on first
    use. ``geglu_xh``: the GeGLU written only as y's row scales and float16 copy (``y.scale``, made by
    the caller; :func:`ffn_geglu_xh`). ``keep`` (one weight): as :func:`matmul`'s."""
    ws = ws if isinstance(ws, list) else [ws]
    (t, k), n = x.shape, ws[0].shape[0]
    qtype, opt = ws[0].qtype, ctx.options
    layout = coopmat_q4k_layout(t, qtype, n, k)
    if opt.coopmat_layout is not None and qtype == QType.Q4_K and t > 128:
        layout = opt.coopmat_layout  # a benchmark's choice
    if opt.coopmat_decode_layout is not None and qtype == QType.Q4_K and t <= Q8_MAX_T:
        layout = opt.coopmat_decode_layout
    kern = ctx.kernel(coopmat_kernel_name(t, qtype, layout))
    held: list[Act] = []  # the partial-sum scratch, alive until its dispatches are recorded
    part = scratch_maker(ctx, held)
    if x.scale is None:
        x.scale = ctx.new_row_scales(t, k)
        rs = ctx.kernel("row_scale", ctx.row_block)
        record_row_scale(ctx.rec, rs, x.view, *(a.view for a in x.scale), k, t)
    scale, xh = (a.view for a in x.scale)
    target = opt.coopmat_prefill_target if t > Q8_MAX_T else opt.coopmat_decode_target
    split = {"target": target, "slots": coopmat_slots(ctx, kern) if opt.coopmat_waves else 0}
    if len(ws) == 2:
        name, block = ("geglu_row_scale", ctx.row_block) if geglu_xh else ("split_reduce_geglu", None)
        reduce = ctx.kernel(name, block)
        views = (ws[0].view, ws[1].view)
        out = {"xh_out": tuple(a.view for a in y.scale)} if geglu_xh else {}
        record_coopmat_geglu(ctx.rec, kern, reduce, *views, xh, y.view, scale, k, n, t, part, **split, **out)
    else:
        reduce, kept = ctx.kernel("split_reduce"), keeper(y, held) if keep else None
        views = (ws[0].view, xh, y.view, scale)
        record_coopmat(ctx.rec, kern, reduce, *views, k, n, t, part, **split, keep=kept)


def coopmat_slots(ctx: RecordContext, kern: Kernel) -> int:
    """How many workgroups of the coopmat ``kern`` the device holds at once, probed on its first use
    (residency.py); 0 where the probe failed (logged): its K split then follows the targets."""
    slots = ctx.residency.get(kern.name)
    if slots is None:
        try:
            slots = probe_residency(kern)
        except Exception:
            log.exception("%s: residency probe failed; K split for the workgroup targets", kern.name)
            slots = 0
        ctx.residency[kern.name] = slots
    return slots


def q8(ctx: RecordContext, x: Act) -> tuple[Act, Act]:
    """x's q8 form, one or three planes (quantized here on first use, then kept on the Act)."""
    if x.q8 is None:
        t, k = x.shape
        planes = ctx.options.planes
        xq, xd = ctx.new_q8(t, k, planes)
        ctx.dispatch(
            "quantize_x3" if planes == 3 else "quantize_q8",
            [x.view, xq.view, xd.view],
            QuantizeQ8Push(k, t, k),
            ctx.grid(t * k // 4, 128),  # one XQ word an invocation: every word in one round
        )
        x.q8 = (xq, xd)
    return x.q8


def prefetch(ctx: RecordContext, ws: list[VkWeight]) -> None:
    """At decode sizes (buckets of up to MATVEC_MAX_T tokens), read the first ``prefetch_bytes`` of
    ``ws`` (shared in proportion to their sizes) beside the last op recorded (prefetch_vec4: loads kept
    only in the cache), so that the next matmul finds them in the GPU's last-level cache."""
    budget = ctx.options.prefetch_bytes
    if not budget or ctx.t_b > MATVEC_MAX_T:
        return
    ws = [w for w in ws if not across_bus(ctx.dev, w.view)]  # a dGPU's host heap: no L2 to fill
    total = sum(w.view.nbytes for w in ws)
    for w in ws:
        nbytes = min(w.view.nbytes, budget * w.view.nbytes // total) // 16 * 16
        if nbytes:
            groups = min(1024, -(-nbytes // (16 * 256 * 4)))  # 4 loads an invocation a round
            binds = [(w.view, 0, nbytes), ctx.sinks.take(4)]
            ctx.dispatch("prefetch_vec4", binds, CopyPush(nbytes // 16), groups)
