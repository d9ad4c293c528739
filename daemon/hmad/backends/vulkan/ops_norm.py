"""The element-wise and row ops, recorded: embed, norms (the fused residual norm too), RoPE, GeGLU, add, the
logit rows' gather, reshape.

Each function appends its dispatches to the context's recorder (:class:`~.context.RecordContext`) and
returns the new :class:`~.activations.Act`. Every per-step value (token ids, positions) is read by the shaders
from the step metadata at the word offsets of the bucket's layout (``ctx.layout``). ``residual_norm`` returns
None where its fused kernel cannot take the rows: the facade then composes it from the plain ops
(backends/base.py).
"""

from __future__ import annotations

import math

from hmad.backends.vulkan import policy
from hmad.backends.vulkan.activations import Act
from hmad.backends.vulkan.context import RecordContext
from hmad.backends.vulkan.kernels_matmul import MATMUL_TYPES
from hmad.backends.vulkan.memory import BufferView
from hmad.backends.vulkan.pipelines import KERNELS
from hmad.backends.vulkan.placement import VkWeight
from hmad.backends.vulkan.policy import Q8_MAX_T
from hmad.backends.vulkan.push import (
    AddPush,
    EmbedDqPush,
    EmbedPush,
    GegluPush,
    NormRopePush,
    ResidualNormPush,
    RmsNormPush,
    RopePush,
)
from hmad.backends.vulkan.shapes import RESIDUAL_MAX_COLS, residual_block
from hmad.backends.vulkan.splitk import record_split_sums
from hmad.backends.vulkan.stepmeta import EMBEDS_ROW0

# the embedding gather reads every type a weight is uploaded in (embed.comp: float and Q8_0 tables;
# embed_dq.comp: the other block types through dequant.glsl), so no table is ever converted for it
EMBED_TYPES = {q: name for name, q in MATMUL_TYPES.items()}


def embed(ctx: RecordContext, table: VkWeight, tokens, scale: float) -> Act:
    """The token embeddings (T, D) times ``scale``, except the rows the step gives as input embeddings (an
    image's soft tokens: the metadata's embed_src rows take their vector from the embeds buffer, unscaled),
    through the ``_in`` variants of the gather; so put_rows records nothing (VulkanBackend.put_rows)."""
    t_b, dim = len(tokens), table.shape[1]
    view, name = table.view, f"embed_{EMBED_TYPES[table.qtype]}_in"
    rb = view.row_bytes or view.nbytes // table.shape[0]
    y = ctx.new((t_b, dim))
    inputs, lay = ctx.input_embeds(dim), ctx.layout
    src = (lay.embed_src, EMBEDS_ROW0)
    for off, nbytes in view.ranges(ctx.max_range, ctx.align):
        r0, binding = (off - view.offset) // rb, (view, off - view.offset, nbytes)
        if KERNELS[name].push is EmbedDqPush:  # the file's blocks through dequant.glsl: table at 0
            push = EmbedDqPush(t_b, dim, lay.tokens, r0, nbytes // rb, dim, rb, scale, *src)
            ctx.dispatch(name, [binding, ctx.meta_gpu, y.view, inputs], push, t_b)
        else:
            push = EmbedPush(t_b, dim, lay.tokens, r0, nbytes // rb, dim, scale, *src)
            ctx.dispatch(name, [ctx.meta_gpu, binding, y.view, inputs], push, t_b)
    return y


def rms_norm(ctx: RecordContext, x: Act, w: VkWeight, eps: float) -> Act:
    cols = x.shape[-1]
    assert w.shape == (cols,), f"{w.name}: shape {w.shape}, normalising rows of {cols}"
    rows = x.size // cols
    y = ctx.new(x.shape)
    ctx.dispatch(ctx.norm, [x.view, w.view, y.view], RmsNormPush(cols, rows, cols, cols, eps), rows)
    return y


def residual_norm(
    ctx: RecordContext, x: Act, a: Act, w_a: VkWeight, w_next: VkWeight | None, eps: float
) -> tuple[Act, Act | None] | None:
    """x' = x + norm(a), and h = norm(x') (with h's int8 planes and float16 copy where the next matmuls
    read them) in one dispatch; ``a`` may be a GEMM's unsummed partial sums. None where rows of x's width
    are not the kernel's (nothing recorded)."""
    t, d = x.shape
    if d % 4 or d > RESIDUAL_MAX_COLS:
        return None
    xo = ctx.new(x.shape)
    a_view, splits = sums(a)
    push, block = ResidualNormPush(d, t, eps, splits), residual_block(d)
    if w_next is None:
        ctx.dispatch("residual_norm", [x.view, a_view, w_a.view, xo.view], push, t, block)
        return xo, None
    h = ctx.new(x.shape)
    binds, name = [x.view, a_view, w_a.view, xo.view, w_next.view, h.view], "residual_norm_next"
    planes = ctx.options.planes
    if planes and (t <= Q8_MAX_T or ctx.options.deterministic) and d % 64 == 0:
        # int8 mat-vecs may follow (K % 64 == 0: XQ's order): quantize h here too (one plane or three)
        h.q8 = ctx.new_q8(t, d, planes)
        name += "_x3" if planes == 3 else "_q8"
        binds += [h.q8[0].view, h.q8[1].view]
    if policy.coopmat_steps(ctx.options, ctx.caps, t) and d % 8 == 0:
        # the cooperative-matrix GEMM may follow: h's row scales and float16 copy (row_scale's) too
        h.scale = ctx.new_row_scales(t, d)
        name += "_xh"
        binds += [a.view for a in h.scale]
    ctx.dispatch(name, binds, push, t, block)
    return xo, h


def summed(ctx: RecordContext, a: Act) -> Act:
    """a with its values in its buffer: partial sums left unsummed added (split_reduce)."""
    if a.parts:
        (part, splits, _), t, n = a.parts, a.shape[0], math.prod(a.shape[1:])
        record_split_sums(ctx.rec, ctx.kernel("split_reduce"), part, a.buf.view, n, t, splits, n, 0)
        a.parts = None
    return a


def sums(a: Act) -> tuple[BufferView, int]:
    """(a's values, 1), or (its partial sums, how many) where a GEMM left them unsummed."""
    return a.parts[:2] if a.parts else (a.view, 1)


def norm_rope(ctx: RecordContext, x: Act, w: VkWeight, eps: float, base: float, scale: float) -> Act:
    t, h, dh = x.shape
    assert w.shape == (dh,), f"{w.name}: shape {w.shape}, heads of {dh}"
    y = ctx.new(x.shape)
    push = NormRopePush(t, h, dh, h * dh, h * dh, ctx.layout.positions, base, scale, eps)
    ctx.dispatch("norm_rope_f32", [x.view, w.view, ctx.meta_gpu, y.view], push, t * h)
    return y


def rope(ctx: RecordContext, x: Act, base: float, scale: float) -> Act:
    t, h, dh = x.shape
    y = ctx.new(x.shape)
    push = RopePush(t, h, dh, h * dh, h * dh, ctx.layout.positions, base, scale)
    ctx.dispatch("rope_f32", [x.view, ctx.meta_gpu, y.view], push, ctx.grid(t * h * dh // 2))
    return y


def geglu(ctx: RecordContext, gate: Act, up: Act) -> Act:
    t, f = gate.shape
    y = ctx.new(gate.shape)
    ctx.dispatch("geglu_f32", [gate.view, up.view, y.view], GegluPush(f, t, f, f, f), ctx.grid(t * f))
    return y


def add(ctx: RecordContext, a: Act, b: Act) -> Act:
    assert a.size == b.size
    y = ctx.new(a.shape)
    ctx.dispatch("add_f32", [a.view, b.view, y.view], AddPush(a.size), ctx.grid(a.size))
    return y


def gather_rows(ctx: RecordContext, x: Act, idx) -> Act:
    """Gather the step's logit rows (indices from the metadata) with the float32 embed kernel."""
    t, d = x.shape
    y = ctx.new((len(idx), d))
    push = EmbedPush(len(idx), d, ctx.layout.logit_rows, 0, t, d, 1.0)
    ctx.dispatch("embed_f32", [ctx.meta_gpu, x.view, y.view], push, len(idx))
    return y


def reshape(x: Act, shape: tuple[int, ...]) -> Act:
    assert math.prod(shape) == x.size, f"reshape {x.shape} -> {shape}"
    y = Act(x.buf, shape)
    y.parts = x.parts  # partial sums (split s at s * size) keep their layout
    return y
