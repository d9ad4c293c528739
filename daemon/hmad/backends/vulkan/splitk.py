"""K split over workgroups, shared by the GEMMs (kernels_coopmat.py, kernels_mmq.py): how a dispatch
divides K, the partial-sum scratch the splits write, and adding the sums back (split_reduce.comp).
"""

from __future__ import annotations

import math

from hmad.backends.vulkan.push import SplitReducePush


def split_k(
    k: int, n: int, t: int, tile: tuple[int, int], bk: int, target: int, min_steps: int
) -> tuple[int, int]:
    """(splits, k_split): how a GEMM dispatch of (bt, bn) ``tile``s over an (n, k) weight and t tokens, BK
    ``bk`` a step, divides K: until it has about ``target`` workgroups, keeping ``min_steps`` steps a
    split (k_split % bk == 0)."""
    bt, bn = tile
    tiles = -(-n // bn) * -(-t // bt)
    steps = -(-k // bk)
    splits = max(1, min(-(-target // tiles), steps // min_steps))
    k_split = -(-steps // splits) * bk
    return -(-k // k_split), k_split


def split_k_waves(
    k: int, n: int, t: int, tile: tuple[int, int], bk: int, slots: int, min_steps: int, part_steps: float
) -> tuple[int, int]:
    """(splits, k_split) for whole waves: the GPU holds ``slots`` workgroups of the kernel at once (its
    residency, measured: backends/vulkan/residency.py), so a dispatch of G workgroups of S steps each takes
    about ceil(G / slots) waves of S steps, whatever part of the last wave is filled (each workgroup's
    steps wait on memory: a wave's time hardly depends on how full it is). With splits, each workgroup also
    writes a tile of partial sums that split_reduce reads back: ``part_steps``, that tile's bytes as steps
    of W (counted once: the writes leave as the workgroup ends and hold it up little), a cost of bandwidth,
    so spread over the slots (G / slots of it: a dispatch of a few tiles splits far, as latency, not
    bandwidth, bounds it). Of the K steps a split may take (``min_steps`` or more), the one of least
    predicted time; ties to fewer splits. The picks at 32, 64 and 128 tokens of the 27B shapes are the
    fastest of the split counts measured (docs/tuning.md)."""
    bt, bn = tile
    tiles = -(-n // bn) * -(-t // bt)
    steps = -(-k // bk)
    best = (math.inf, 0, 0)
    for per in range(steps, min(min_steps, steps) - 1, -1):  # steps a split: unsplit first
        splits = -(-steps // per)
        groups = tiles * splits
        cost = -(-groups // slots) * per + (part_steps * groups / slots if splits > 1 else 0.0)
        if cost < best[0]:
            best = (cost, splits, per)
    return best[1], best[2] * bk


def record_split_sums(
    rec, reduce_kernel, part, y, rows: int, t: int, splits: int, y_stride: int, row0: int, keep=None
) -> int:
    """After a GEMM of ``splits`` K-split partial sums of y[:t, row0:row0 + rows] in ``part`` ((splits, t,
    rows) float32): ``reduce_kernel`` (split_reduce) adds them into y; or, where ``keep`` is given and they
    are all of y (row0 0, y_stride == rows), ``keep(part, splits)`` takes them and the reader adds them
    (residual_norm.comp, norm_rope_kv.comp: one dispatch, and y's floats, fewer). Returns the dispatches
    recorded."""
    if keep is not None and row0 == 0 and y_stride == rows:
        keep(part, splits)
        return 0
    push = SplitReducePush(rows, t, splits, y_stride, row0)
    rec.dispatch(reduce_kernel, [part, y], push, reduce_groups(reduce_kernel, t, rows))
    return 1


def part_scratch(part, pieces, t: int, splits_of, split_only: bool):
    """A GEMM's partial-sum scratch: ``part`` itself, or asked of it (a callable) once for the largest need
    of the bind ranges ``pieces`` at t tokens, ``splits_of(rows)`` splits each (only ranges whose K is
    split need one when ``split_only``)."""
    if not callable(part):
        return part
    needs = [0]
    for _, rows, _ in pieces:
        splits = splits_of(rows)
        if splits > 1 or not split_only:
            needs.append(splits * t * rows * 4)
    return part(max(needs)) if max(needs) else None


def check_part(kernel, part, nbytes: int) -> None:
    """That ``part`` holds a dispatch's ``nbytes`` of partial sums (a clear error if not)."""
    if part is None or part.nbytes < nbytes:
        raise ValueError(f"{kernel.name}: its K splits need a partial-sum scratch of {nbytes} B")


def reduce_groups(reduce_kernel, t: int, rows: int):
    """split_reduce's workgroups for t tokens of ``rows`` rows."""
    return reduce_kernel.groups_for(min(-(-t * rows // 256), 4096))
