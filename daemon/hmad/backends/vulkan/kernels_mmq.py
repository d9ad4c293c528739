"""The exact int8 cooperative-matrix GEMM of decode batches (shaders/mul_mmq_coopmat.comp): its layouts, when
a device can run it, how a dispatch splits K, and recording it.

The kernel multiplies Q4_K weights by activations in the exact path's three int8 planes (q8act.glsl: XQ and
XD, the same inputs as the x3 mat-vec) on int8 × int8 -> int32 cooperative matrices: each 32-value block's
three plane products join exactly in int32 before one conversion to float, so its error is the x3
mat-vec's class (float32 roundings of the block sums), whatever the token count. Kernels are
``mul_mmq_coopmat_q4_k_m<MR>n<NT>k<MK>j<JB>[_n8][_fb]``: MR 16-row fragments a subgroup (4 subgroups: 64 MR
rows a workgroup), NT token fragments of NB tokens (16, or 8: ``_n8``), MK the device's int8 product K, JB
blocks whose sums a subgroup stores and scales together, and ``_fb`` for all MR fragments' at once.

Kernels with NB 8 (``_n8``) run 16 × 8 products where the device has them (NVIDIA does): at up to 8 tokens
half the products and half the sums to scale. The backend runs it for exact-path steps of
``vulkan.mmq_min_tokens`` (default 2) tokens up to those the float16 GEMM takes, on big Q4_K weights
(policy.mmq_for): about half the x3 mat-vec's time at 3-8 tokens of the 27B shapes, even at 2
(docs/tuning.md).

The float16 GEMM is faster at these sizes (docs/tuning.md), so ``coopmat_min_tokens`` defaults to 4 and
this kernel runs only
where a device lacks float16 cooperative matrices or the config asks for the exact arithmetic at up to 8
sequences (``coopmat_min_tokens: 9``).
"""

from __future__ import annotations

import re

from hmad.backends.vulkan.kernels_matmul import row_ranges, weight_row_bytes
from hmad.backends.vulkan.push import CoopMatPush, SplitReducePush
from hmad.backends.vulkan.splitk import check_part, part_scratch, record_split_sums, reduce_groups, split_k
from hmad.backends.vulkan.variants import MMQ_LAYOUTS, mmq_kernel_name
from hmad.core.tensors import QType

#: the layout the backend runs, per NB (tokens of a product), with the device's MK: (MR, NT, JB, FB), the
#: fastest of the layouts built at the 27B shapes (docs/tuning.md)
MMQ_PICK = {16: (2, 1, 2, True), 8: (2, 1, 2, True)}
MMQ_BLOCK = 128  # 4 subgroups of 32
MMQ_BK = 128  # K per step
MMQ_TARGET_GROUPS = 1024  # split K until a dispatch has about this many workgroups
MMQ_MIN_STEPS = 4  # ... keeping at least this many steps a split
_NAME = re.compile(
    r"mul_mmq_coopmat_q4_k_m(?P<mr>\d+)n(?P<nt>\d+)k(?P<mk>\d+)j(?P<jb>\d+)(?:_n(?P<nb>8))?(?P<fb>_fb)?"
)


def mmq_layout(name: str) -> tuple[int, int, int, int, int, bool]:
    """(MR, NT, MK, JB, NB, FB) of a ``mul_mmq_coopmat_q4_k_m<MR>n<NT>k<MK>j<JB>[_n8][_fb]`` kernel name."""
    m = _NAME.fullmatch(name)
    if not m:
        raise ValueError(f"{name}: not a mul_mmq_coopmat_q4_k_m<MR>n<NT>k<MK>j<JB>[_n8][_fb] name")
    return int(m["mr"]), int(m["nt"]), int(m["mk"]), int(m["jb"]), int(m["nb"] or 16), bool(m["fb"])


def mmq_tile(name: str) -> tuple[int, int]:
    """(tokens, rows) of a workgroup's tile."""
    mr, nt, _, _, nb, _ = mmq_layout(name)
    return nb * nt, 64 * mr


def mmq_shape_k(info) -> int | None:
    """The K of the device's int8 16 × 16 × K -> int32 subgroup product (32 or 16) where it has one, 32-wide
    subgroups and Vulkan 1.3; else None (the kernel does not run there)."""
    if info.subgroup.get("size") != 32 or tuple(info.api_version[:2]) < (1, 3):
        return None
    ks = [
        s["K"]
        for s in info.coopmat_shapes
        if s.get("subgroup_scope")
        and (s["M"], s["N"]) == (16, 16)
        and s["K"] in (16, 32)
        and (s["A"], s["B"], s["C"], s["result"]) == ("s8", "s8", "s32", "s32")
    ]
    return max(ks) if ks else None


def mmq_shared_bytes(name: str) -> int:
    """Shared memory a kernel declares (mul_mmq_coopmat.comp's xs, ws, wf, xf and cs)."""
    mr, nt, _, jb, nb, fb = mmq_layout(name)
    nsg, tt, row = MMQ_BLOCK // 32, nt * nb, (MMQ_BK // 16 + 1) * 16  # a shared row: BK bytes + 16 of pad
    xs, ws = 3 * tt * row, nsg * mr * 16 * row
    wf, xf = nsg * mr * 16 * 4 * 8, tt * 4 * 8
    cs = nsg * (mr if fb else 1) * jb * 16 * nb * 4
    return xs + ws + wf + xf + cs


def mmq_usable(info, limits: dict) -> int | None:
    """The device's int8 product K (:func:`mmq_shape_k`) if it runs the kernels the backend picks (their
    shared memory within ``limits``: Device.limits); else None."""
    mk = mmq_shape_k(info)
    if mk is None:
        return None
    names = {mmq_pick(mk, 8, mmq_has_n8(info, mk)), mmq_pick(mk, 16)}
    fits = all(mmq_shared_bytes(n) <= limits["maxComputeSharedMemorySize"] for n in names)
    return mk if fits else None


def mmq_has_n8(info, mk: int) -> bool:
    """Whether the device also has the int8 16 × 8 × ``mk`` product (NVIDIA: yes; RDNA3: no)."""
    want = (16, 8, mk, "s8", "s8", "s32", "s32")
    return any(
        s.get("subgroup_scope") and (s["M"], s["N"], s["K"], s["A"], s["B"], s["C"], s["result"]) == want
        for s in info.coopmat_shapes
    )


def mmq_pick(mk: int, t: int = 16, n8: bool = False) -> str:
    """The kernel the backend runs for ``t`` tokens on a device whose int8 product has K = ``mk`` (and
    16 × 8 products: ``n8``, taken at up to 8 tokens where built)."""
    mr, nt, jb, fb = MMQ_PICK[8]
    if n8 and t <= 8 and (mr, nt, mk, jb, 8, fb) in MMQ_LAYOUTS:
        return mmq_kernel_name(mr, nt, mk, jb, 8, fb)
    mr, nt, jb, fb = MMQ_PICK[16]
    return mmq_kernel_name(mr, nt, mk, jb, 16, fb)


def mmq_splits(
    k: int, n: int, t: int, tile: tuple[int, int], target: int = MMQ_TARGET_GROUPS
) -> tuple[int, int]:
    """(splits, k_split): how a dispatch of an (n, k) weight and t tokens divides K (k_split % 128 == 0)."""
    return split_k(k, n, t, tile, MMQ_BK, target, MMQ_MIN_STEPS)


def record_mmq(
    rec,
    kernel,
    reduce_kernel,
    w,
    xq,
    xd,
    y,
    k: int,
    n: int,
    t: int,
    part=None,
    y_stride: int | None = None,
    max_range: int | None = None,
    target: int = MMQ_TARGET_GROUPS,
    keep=None,
) -> int:
    """Record y[:t, :n] = x[:t, :k] · Wᵀ for a Q4_K weight on ``kernel`` (``mul_mmq_coopmat_q4_k_...``), x
    as its three int8 planes (``xq``, ``xd``: quantize_x3 or the op before): per bind range of W one
    dispatch, K split as :func:`mmq_splits` says; with several splits the partial sums go to ``part`` (a
    BufferView, or a callable ``nbytes -> BufferView`` asked once for the largest range's need) and
    ``reduce_kernel`` (split_reduce) adds them into y, or ``keep`` takes them (:func:`record_split_sums`).
    Returns the dispatch count."""
    if k % 256:
        raise ValueError(f"{kernel.name}: K={k} is not whole Q4_K superblocks")
    tile, rb = mmq_tile(kernel.name), weight_row_bytes(QType.Q4_K, k)
    y_stride = y_stride or n
    count = 0
    pieces = row_ranges(kernel, [w], rb, n, max_range)
    part = part_scratch(
        part, pieces, t, lambda rows: mmq_splits(k, rows, t, tile, target)[0], split_only=True
    )
    for (wb,), rows, row0 in pieces:
        splits, k_split = mmq_splits(k, rows, t, tile, target)
        groups = (-(-t // tile[0]), -(-rows // tile[1]), splits)
        if splits == 1:
            rec.dispatch(kernel, [wb, xq, xd, y], CoopMatPush(k, rows, t, k, y_stride, rb, row0, k), groups)
            count += 1
            continue
        check_part(kernel, part, splits * t * rows * 4)
        rec.dispatch(kernel, [wb, xq, xd, part], CoopMatPush(k, rows, t, k, rows, rb, 0, k_split), groups)
        sums = (rows, t, splits, y_stride, row0)
        count += 1 + record_split_sums(rec, reduce_kernel, part, y, *sums, keep if len(pieces) == 1 else None)
    return count


def record_mmq_geglu(
    rec,
    kernel,
    reduce_kernel,
    w_gate,
    w_up,
    xq,
    xd,
    y,
    k: int,
    n: int,
    t: int,
    part,
    max_range: int | None = None,
    target: int = MMQ_TARGET_GROUPS,
) -> int:
    """Record y[:t, :n] = gelu_tanh(x · W_gateᵀ) * (x · W_upᵀ) (Q4_K, same shape) on ``kernel``: per bind
    range, each weight's partial sums (one "split" when K is not split) into its scratch, then
    ``reduce_kernel`` (split_reduce_geglu) adds both and applies the GeGLU. ``part`` a callable ``nbytes ->
    BufferView``, asked twice (gate, up) for the largest range's need. Returns the dispatch count."""
    tile, rb = mmq_tile(kernel.name), weight_row_bytes(QType.Q4_K, k)
    pieces = row_ranges(kernel, [w_gate, w_up], rb, n, max_range)
    splits_of = lambda rows: mmq_splits(k, rows, t, tile, target)[0]  # noqa: E731
    parts = [part_scratch(part, pieces, t, splits_of, split_only=False) for _ in range(2)]
    for (wg, wu), rows, row0 in pieces:
        splits, k_split = mmq_splits(k, rows, t, tile, target)
        push = CoopMatPush(k, rows, t, k, rows, rb, 0, k_split)
        groups = (-(-t // tile[0]), -(-rows // tile[1]), splits)
        for wb, pb in zip((wg, wu), parts, strict=True):
            rec.dispatch(kernel, [wb, xq, xd, pb], push, groups)
        push = SplitReducePush(rows, t, splits, n, row0)
        rec.dispatch(reduce_kernel, [parts[0], y, parts[1]], push, reduce_groups(reduce_kernel, t, rows))
    return 3 * len(pieces)
