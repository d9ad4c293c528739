"""The int8 mat-vec (shaders/mul_mat_vec_q8.comp): y (T, N) = x · Wᵀ for T ≤ 8 tokens with x as q8
activations (q8act.glsl), one plane (``mul_mat_vec_q8x_*``) or three (``mul_mat_vec_x3_*``: the exact
path). Kernels ``mul_mat_vec_{q8x,x3}_<t>[_geglu][<layout>][_t1]``, <t> in UNIT_TYPES; the layouts
(:data:`Q8_LAYOUTS`: rows per lane group, lane groups per row) picked per shape by :func:`q8_matvec_layout`,
and fused tails (:data:`Q8_TAILS`). The variants built are variants.py's.
"""

from __future__ import annotations

import numpy as np

from hmad.backends.vulkan.kernels_matmul import MATVEC_MAX_T, UNIT_TYPES, row_ranges, weight_row_bytes
from hmad.backends.vulkan.push import MatMulPush
from hmad.backends.vulkan.variants import (  # noqa: F401 (Q8_T1_LAYOUTS: read here by the benchmarks)
    Q8_LANES,
    Q8_LAYOUT_TYPES,
    Q8_LAYOUTS,
    Q8_T1_LAYOUTS,
    Q8_TAILS,
    q8_matvec_variants,
    q8_tail_variants,
)
from hmad.core.tensors import QType

Q8_MATVEC_LANES = 32  # invocations per row (LANES in mul_mat_vec_q8.comp)
Q8_MATVEC_BLOCK = 128  # workgroup size: 4 lane groups
Q8_MATVEC_ROWS = 2  # rows per lane group (NR) of the default layout: 8 rows per workgroup
#: one-lane layouts (CPU implementations): 8 rows an invocation from this many rows (the LM head, a GeGLU
#: pair), else 4: each x block an invocation loads then serves more rows, where a load costs tens of
#: products; on fewer rows 8 would leave too few workgroups for the host threads (docs/tuning.md)
ONE_LANE_WIDE_ROWS = 2048
#: ... and 16 rows an invocation from this many (a vocabulary's LM head; never a GeGLU pair): fewer loads of
#: x again, where on 8 rows they took two thirds of the LM head's time (docs/tuning.md)
ONE_LANE_HEAD_ROWS = 65536


def xq_word_order(k: int) -> np.ndarray:
    """Where each word of an XQ row of ``k`` values is stored (shaders/q8act.glsl, ``xq_word``): word w
    (values 4w..4w+3) at quarter (w / 4) % 4 of 64-value group w / 16, every group's quarter 0 first."""
    if k % 64:
        raise ValueError(f"K={k}: XQ rows are whole groups of 64 values")
    w = np.arange(k // 4)
    return (((w >> 2) & 3) * (k // 64) + (w >> 4)) * 4 + (w & 3)


def xq_natural(q: np.ndarray) -> np.ndarray:
    """XQ rows (..., K) int8 as the GPU stores them -> values in K order."""
    k = q.shape[-1]
    words = np.ascontiguousarray(q).view(np.uint32)
    return np.ascontiguousarray(words[..., xq_word_order(k)]).view(np.int8).reshape(q.shape)


def q8_tail_suffixes() -> list[str]:
    """The name suffixes (after the weight type) of the int8 mat-vec variants with a fused tail."""
    return [suffix for suffix, _, _ in q8_tail_variants()]  # q8 out: after a GeGLU


def q8_matvec_suffixes(t_name: str) -> list[str]:
    """The name suffixes (after the weight type) of weight type ``t_name``'s int8 mat-vec variants:
    [_geglu] layout [_t1]."""
    return [suffix for suffix, _ in q8_matvec_variants(t_name)]


def q8_matvec_layout(
    t: int, n: int, k: int, geglu: bool = False, one_lane: bool = False, t_name: str = ""
) -> str:
    """The layout (a :data:`Q8_LAYOUTS` suffix) of the int8 mat-vec for ``t`` tokens of an N × K weight:
    the fastest measured at the 27B and 270M layer shapes (bench/bench_vulkan_matvec_layouts.py; the times
    are in docs/tuning.md). At one token 2 rows a lane group on one lane group, unless that leaves under 128
    workgroups (then K split over two lane groups). At 2..8 tokens, where the per-token work bounds the
    kernel: 4 rows a lane group from N = 4096, and K split over two lane groups when K >= 1024 and the
    workgroups would be under 512. A GeGLU pair stays at 2 rows (its NR 4 variants are not built).
    ``one_lane`` (policy.q8_one_lane: a CPU implementation's mat-vecs): "_l16" from ONE_LANE_HEAD_ROWS rows
    (not a GeGLU pair; weight types ``t_name`` it is built for: Q8_LAYOUT_TYPES), "_l8" from
    ONE_LANE_WIDE_ROWS, else "_l4": each invocation 16, 8 or 4 whole rows (of both weights for a GeGLU
    pair), whatever ``t``."""
    if one_lane:
        if n >= ONE_LANE_HEAD_ROWS and not geglu and t_name in Q8_LAYOUT_TYPES["_l16"]:
            return "_l16"
        return "_l8" if n >= ONE_LANE_WIDE_ROWS else "_l4"
    nr = 4 if t > 1 and n >= 4096 and not geglu else 2
    groups = n / (Q8_MATVEC_BLOCK // Q8_MATVEC_LANES * nr)
    split = groups < 128 if t == 1 else groups < 512 and k >= 1024
    return {(2, False): "", (2, True): "_k2", (4, False): "_r4", (4, True): "_r4k2"}[nr, split]


def q8_lanes(name: str) -> int:
    """Invocations per lane group (LANES) of an int8 mat-vec kernel name."""
    return next((lanes for lay, lanes in Q8_LANES.items() if lay in name), Q8_MATVEC_LANES)


def q8_matvec_variant(name: str) -> tuple[QType, tuple[int, int]]:
    """(weight type, (NR, KS) layout) of an int8 mat-vec kernel name."""
    base = name.removeprefix("mul_mat_vec_q8x_").removeprefix("mul_mat_vec_x3_")
    for tail in (*Q8_TAILS, "_t1"):
        base = base.removesuffix(tail)
    base = base.replace("_geglu", "")
    lay = next(s for s in sorted(Q8_LAYOUTS, key=len, reverse=True) if base.endswith(s))
    return UNIT_TYPES[base.removesuffix(lay) if lay else base], Q8_LAYOUTS[lay]


def record_matvec_q8(
    rec,
    kernel,
    w,
    xq,
    xd,
    y,
    k: int,
    n: int,
    t: int,
    y_stride: int | None = None,
    w_up=None,
    max_range: int | None = None,
    tail=(),
) -> int:
    """Record y[:t, :n] = x · Wᵀ with x as q8 activations (``xq`` words, ``xd`` block scales: q8act.glsl;
    one plane for ``mul_mat_vec_q8x_*``, three for ``mul_mat_vec_x3_*``) into ``rec``; a ``_geglu`` kernel
    also takes ``w_up`` and writes gelu(x · Wᵀ) * (x · W_upᵀ). One dispatch per bind range of W (and the
    same range of W_up); returns the dispatch count. A fused-tail variant (:data:`Q8_TAILS`) takes its
    bindings after those as ``tail``; its W must be one range and y whole rows (``y_stride`` N)."""
    qtype, (nr, ks) = q8_matvec_variant(kernel.name)
    rb = weight_row_bytes(qtype, k)
    max_t = 1 if "_t1" in kernel.name else MATVEC_MAX_T
    if not 1 <= t <= max_t:
        raise ValueError(f"{kernel.name}: T={t} tokens, this q8 mat-vec takes 1..{max_t}")
    ws = [w] if w_up is None else [w, w_up]
    pieces = row_ranges(kernel, ws, rb, n, max_range)
    rows_per_group = kernel.block_size // (q8_lanes(kernel.name) * ks) * nr
    if tail:
        _check_tail(kernel, len(pieces), n, y_stride or n, rows_per_group)
    for binds, rows, row0 in pieces:
        push = MatMulPush(k, rows, t, k, y_stride or n, rb, row0)
        groups = kernel.groups_for(-(-rows // rows_per_group))
        rec.dispatch(kernel, [binds[0], xq, xd, y, *binds[1:], *tail], push, groups)
    return len(pieces)


def _check_tail(kernel, n_pieces: int, n: int, y_stride: int, rows_per_group: int) -> None:
    """What a fused tail of mul_mat_vec_q8.comp requires (see its header)."""
    if n_pieces != 1 or y_stride != n or n % 64 or 32 % rows_per_group:
        raise ValueError(
            f"{kernel.name}: a fused tail needs W in one bind range, y_stride == N, N % 64 == 0 and a "
            f"workgroup's {rows_per_group} rows dividing 32 (N={n}, y_stride={y_stride}, {n_pieces} ranges)"
        )
