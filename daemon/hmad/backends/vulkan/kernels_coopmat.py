"""The cooperative-matrix GEMM (shaders/mul_mm_coopmat.comp): y (T, N) = x (T, K) · Wᵀ on
VK_KHR_cooperative_matrix (float16 16×16×16 products, float32 accumulators; x as the float16 copy that
row_scale.comp makes with its row scales), BT tokens × BN rows a workgroup, loads pipelined, K split over
workgroups when the tiles alone are too few (partial sums in a scratch, added by ``split_reduce``: splitk.py);
only on devices offering that shape with 32-wide subgroups (:func:`coopmat_usable`).

Kernels ``mul_mm_coopmat_<t>_<BT>x<BN>`` (<t> in :data:`COOPMAT_TYPES`, tiles :data:`COOPMAT_TILES`), and for
Q4_K the layouts of :data:`COOPMAT_Q4K_VARIANTS`,
``mul_mm_coopmat_q4_k_<BT>x<BN>_s<SG_T>x<SG_N>[_bk32][_db][_w|_w2]`` (:class:`CoopmatLayout`: subgroup
grid, K step, one or two tile sets, W pieces), :func:`coopmat_q4k_layout` picking among them. The variants
built are variants.py's. Bindings: 0 = W, 1 = xh, 2 = y (or the partial sums), 3 = x's row scales.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hmad.backends.vulkan import variants
from hmad.backends.vulkan.kernels_matmul import row_ranges, weight_row_bytes
from hmad.backends.vulkan.push import CoopMatPush, RowScalePush, SplitReducePush
from hmad.backends.vulkan.splitk import (
    check_part,
    part_scratch,
    record_split_sums,
    reduce_groups,
    split_k,
    split_k_waves,
)
from hmad.core.tensors import QType

#: Weight types of the cooperative-matrix mat-mat (float16 tiles: not F32/BF16, whose range float16 lacks).
COOPMAT_TYPES: dict[str, QType] = {t: QType[t.upper()] for t in variants.COOPMAT_TYPE_NAMES}
XH_ORDER = (0, 2, 1, 3, 4, 6, 5, 7)  # xh[t, 8g + i] = x[t, 8g + XH_ORDER[i]]: pairs as Q4_K decodes them
COOPMAT_TILES = variants.COOPMAT_TILES  # (BT tokens, BN rows) variants
COOPMAT_BK = 64  # K per step of mul_mm_coopmat.comp
# Without a measured residency (split_k_waves), split K until a dispatch has about this many workgroups: one
# wave of the decode-batch kernels on the GPU it was tuned on (docs/tuning.md)
COOPMAT_TARGET_GROUPS = 384
COOPMAT_MIN_STEPS = 4  # ... but keep at least this many BK steps per split


@dataclass(frozen=True)
class CoopmatLayout:
    """A layout of mul_mm_coopmat.comp: a BT × BN tile of y per workgroup, SG_T × SG_N subgroups of 32
    invocations each multiplying a (BT / SG_T) × (BN / SG_N) part of it, BK weights of K a step, one tile set
    in shared memory or two (``dbuf``: the next step stored while this one multiplies, one barrier a step);
    Q4_K only: ``wide`` W pieces (1: 16 quant bytes, 2: 32, not 8). The defaults are the first layout, the
    one every type is built with (:data:`COOPMAT_TILES`)."""

    bt: int
    bn: int
    sg_t: int = 2
    sg_n: int = 4
    bk: int = 64
    dbuf: bool = False
    wide: int = 0

    @property
    def plain(self) -> bool:
        return (self.sg_t, self.sg_n, self.bk, self.dbuf, self.wide) == (2, 4, 64, False, 0)

    @property
    def suffix(self) -> str:
        """The kernel name after its type: ``<BT>x<BN>`` (the first layout), else ``<BT>x<BN>_s<SG_T>x<SG_N>``
        then ``_bk32``, ``_db``, ``_w`` or ``_w2`` where they apply (variants.coopmat_layout_variant)."""
        return self._variant()[0]

    @property
    def block(self) -> int:
        """The workgroup size (BLOCK_SIZE = NINV in the shader)."""
        return 32 * self.sg_t * self.sg_n

    def defines(self) -> dict[str, str]:
        """The layout's defines in the build list (the first layout: BT and BN only)."""
        return self._variant()[1]

    def _variant(self) -> tuple[str, dict[str, str]]:
        lay = (self.bt, self.bn, self.sg_t, self.sg_n, self.bk, self.dbuf, self.wide)
        return variants.coopmat_layout_variant(*lay)

    def shared_bytes(self) -> int:
        """Shared memory the kernel declares: per tile set (BN + BT) rows of BK + 8 float16 (the write-out's
        16 × 16 float32 staging tiles, 1 KiB a subgroup, reuse the W tile)."""
        sets = 2 if self.dbuf else 1
        return sets * (self.bn + self.bt) * (self.bk + 8) * 2

    def problems(self, qtype: QType) -> list[str]:
        """Why mul_mm_coopmat.comp could not run this layout for ``qtype`` (empty: it can): whole 16 × 16
        fragments per subgroup, whole loads per invocation (its XPT and WPT), BK 32 or 64; wide W pieces
        (Q4_K) with BK 64."""
        out = []
        if self.bt % (16 * self.sg_t) or self.bn % (16 * self.sg_n):
            grid = f"{self.sg_t}x{self.sg_n}"
            out.append(f"{self.bt}x{self.bn} over {grid} subgroups: not whole 16x16 fragments")
        if self.bk not in (32, 64):
            out.append(f"BK {self.bk}: the shader steps 64 or 32 (BK32) weights")
        if self.wide and (qtype != QType.Q4_K or self.bk == 32):
            out.append("wide W pieces: Q4_K with BK 64 only")
        if self.bn * (self.bk + 8) // 8 < 64 * self.sg_t * self.sg_n:
            out.append(f"{self.bn} W rows of BK {self.bk}: too few for the subgroups' staging tiles")
        if self.wide not in (0, 1, 2):
            out.append(f"wide {self.wide}: W pieces of 8 (0), 16 (1) or 32 (2) quant bytes")
        # weights a W piece covers (Q4_K: 8, 16 or 32 bytes of quants)
        per_w = 16 << self.wide if qtype == QType.Q4_K else 8
        for what, n in (("x", self.bt * self.bk // 8), ("W", self.bn * self.bk // per_w)):
            if n % self.block:
                out.append(f"{what}: {n} loads a step over {self.block} invocations")
        return out


#: The Q4_K-only layouts (variants.COOPMAT_Q4K_VARIANTS), next to the first (2 × 4 subgroups, BK 64, one
#: tile set; 64×128 is the prefill's): 4 subgroups each owning 64 × 64 of a 128 × 128 tile (16 products per
#: 8 fragment loads from shared memory, against 4 per 4 at 64×128), the same with BK 32 and two tile sets,
#: 4 subgroups of 32 × 64 on 64×128, and the first 128×128 grid (8 subgroups of 64 × 32) with BK 32 and two
#: tile sets (48 KiB: exactly NVIDIA's limit); then 8 subgroups of 64 × 64 on 256 tokens or 256 rows, and
#: 128x128_s2x2 with BK 32 (which ranked first at the big shapes: docs/tuning.md); then the wide W pieces.
COOPMAT_Q4K_VARIANTS = tuple(CoopmatLayout(*v) for v in variants.COOPMAT_Q4K_VARIANTS)
_COOPMAT_NAME = re.compile(
    r"mul_mm_coopmat_(?P<t>[a-z0-9_]+?)_(?P<bt>\d+)x(?P<bn>\d+)(?:_s(?P<sgt>\d+)x(?P<sgn>\d+))?"
    r"(?P<bk32>_bk32)?(?P<db>_db)?(?:_w(?P<w>2?))?"
)


def coopmat_variant(name: str) -> tuple[QType, CoopmatLayout]:
    """(weight type, layout) of a ``mul_mm_coopmat_<type>_<layout suffix>`` kernel name."""
    m = _COOPMAT_NAME.fullmatch(name)
    if m is None or m["t"] not in COOPMAT_TYPES:
        raise ValueError(f"{name}: not a mul_mm_coopmat_<type>_<BT>x<BN>[_s<T>x<N>][_bk32][_db][_w|_w2] name")
    sg = (int(m["sgt"]), int(m["sgn"])) if m["sgt"] else (2, 4)
    wide = 0 if m["w"] is None else int(m["w"] or 1)
    lay = CoopmatLayout(int(m["bt"]), int(m["bn"]), *sg, 32 if m["bk32"] else 64, bool(m["db"]), wide)
    return COOPMAT_TYPES[m["t"]], lay


def coopmat_fits(name: str, limits: dict) -> bool:
    """Whether the device's shared memory (``limits``: Device.limits) holds what kernel ``name`` declares."""
    return coopmat_variant(name)[1].shared_bytes() <= limits["maxComputeSharedMemorySize"]


def coopmat_usable(info) -> bool:
    """Whether mul_mm_coopmat runs on a device (a DeviceInfo): the float16 16×16×16 -> float32 subgroup
    shape of VK_KHR_cooperative_matrix, 32-wide subgroups (its 8-subgroup layout) and Vulkan 1.3 (SPIR-V
    1.6)."""
    shape = {"M": 16, "N": 16, "K": 16, "A": "f16", "B": "f16", "C": "f32", "result": "f32"}
    has = any(
        all(s.get(k) == v for k, v in shape.items()) and s.get("subgroup_scope") for s in info.coopmat_shapes
    )
    return has and info.subgroup.get("size") == 32 and tuple(info.api_version[:2]) >= (1, 3)


#: "Big" Q4_K weights (elements; the 27B's gate, up and down projections) take the first layout of a
#: COOPMAT_Q4K_LAYOUTS row: over 128 tokens 4 subgroups each owning 64 × 64 of a 128 × 128 tile, which wins
#: on big weights and loses on small ones (docs/tuning.md).
COOPMAT_BIG_WEIGHTS = 64 << 20
#: The Q4_K layouts by step size: (most tokens, layout of big weights, of the others), the first row that
#: holds a step's token count; None: :func:`coopmat_tile`'s. They read W as whole 64-weight chunks (``_w2``:
#: 32 quant bytes and the block header a piece): the fastest per step size of one 27B layer's matmuls, with
#: the K split for whole waves (split_k_waves); the per-layout times are in docs/tuning.md.
COOPMAT_Q4K_LAYOUTS = (
    (16, "16x128_s1x4_w2", "16x128_s1x4_w2"),
    (32, "32x128_s1x4_w2", "32x128_s1x4_w2"),
    (64, "64x128_s2x2_w2", "64x128_s2x2_w2"),
    (128, "128x128_s2x2_w2", "64x128_s2x2_w2"),
    (1 << 30, "128x128_s2x2_w2", "128x128_s2x2_w2"),
)


def coopmat_q4k_layout(t: int, qtype: QType, n: int, k: int) -> str | None:
    """The mul_mm_coopmat layout (a name suffix) of a step of ``t`` tokens on an (n, k) weight, where it is
    not :func:`coopmat_tile`'s (None): :data:`COOPMAT_Q4K_LAYOUTS` for Q4_K."""
    if qtype != QType.Q4_K:
        return None
    _, big, other = next(row for row in COOPMAT_Q4K_LAYOUTS if t <= row[0])
    return big if n * k >= COOPMAT_BIG_WEIGHTS else other


def coopmat_tile(t: int, qtype: QType = QType.Q4_K) -> tuple[int, int]:
    """The (BT, BN) variant of mul_mm_coopmat for a step of ``t`` tokens of a ``qtype`` weight: the fastest
    measured at the 27B shapes (bench_vulkan_matmul.py; docs/tuning.md): at 8..32 tokens 32x128 for Q4_K
    and 32x64 for the others; at 512, 64x128 for Q4_K and 64x64 for the types decoded 8 weights at a time."""
    if t <= 32:
        return (32, 128) if qtype == QType.Q4_K else (32, 64)
    return (64, 128) if t > 128 and qtype == QType.Q4_K else (64, 64)


def coopmat_kernel_name(t: int, qtype: QType, layout: str | None = None) -> str:
    """The mul_mm_coopmat kernel for a step of ``t`` tokens of a ``qtype`` weight: ``<BT>x<BN>`` of
    :func:`coopmat_tile`, unless ``layout`` (a name suffix) is given."""
    tname = next(n for n, q in COOPMAT_TYPES.items() if q == qtype)
    if layout is None:
        layout = "{}x{}".format(*coopmat_tile(t, qtype))
    name = f"mul_mm_coopmat_{tname}_{layout}"
    coopmat_variant(name)  # a name that parses
    return name


def coopmat_splits(
    k: int,
    n: int,
    t: int,
    tile: tuple[int, int],
    target: int | None = None,
    slots: int = 0,
    row_bytes: int = 0,
) -> tuple[int, int]:
    """(splits, k_split): how a coopmat dispatch of an (n, k) weight and t tokens divides K: for whole
    waves of ``slots`` resident workgroups when known (:func:`split_k_waves`; ``row_bytes``: W's row, for
    the partial sums' share), else for about ``target`` workgroups (default COOPMAT_TARGET_GROUPS; the
    module's settings are read at each call)."""
    if slots > 0 and row_bytes > 0:
        part_steps = 4 * tile[0] * k / (row_bytes * COOPMAT_BK)  # BT x BN float32 / a BN x BK step of W
        return split_k_waves(k, n, t, tile, COOPMAT_BK, slots, COOPMAT_MIN_STEPS, part_steps)
    return split_k(k, n, t, tile, COOPMAT_BK, target or COOPMAT_TARGET_GROUPS, COOPMAT_MIN_STEPS)


def record_row_scale(rec, kernel, x, scale, xh, k: int, t: int, x_stride: int | None = None) -> None:
    """Record scale[:t] = the float16-range power of two of each row of x and xh (t, k) float16 = x / scale
    (row_scale.comp): the inputs of the coopmat kernels, made once for every matmul reading the same x.
    Within every 8 columns xh holds k in the coopmat tiles' order (:data:`XH_ORDER`); k % 8 == 0."""
    if k % 8:
        raise ValueError(f"K={k}: row_scale writes xh in groups of 8 (K % 8 == 0)")
    rec.dispatch(kernel, [x, scale, xh], RowScalePush(k, t, x_stride or k), kernel.groups_for(t))


def record_coopmat(
    rec,
    kernel,
    reduce_kernel,
    w,
    xh,
    y,
    scale,
    k: int,
    n: int,
    t: int,
    part=None,
    x_stride: int | None = None,
    y_stride: int | None = None,
    max_range: int | None = None,
    target: int | None = None,
    slots: int = 0,
    keep=None,
) -> int:
    """Record y[:t, :n] = x[:t, :k] · Wᵀ on the cooperative-matrix kernel ``kernel``
    (``mul_mm_coopmat_<type>_<BT>x<BN>``), ``xh`` the float16 copy of x and ``scale`` its row scales
    (:func:`record_row_scale`, recorded before; ``x_stride`` in halves): per bind range of W one dispatch,
    K split as :func:`coopmat_splits` says (for whole waves of ``slots`` resident workgroups when given,
    else for about ``target`` workgroups); with several splits the
    partial sums go to ``part`` (a BufferView, or a callable ``nbytes -> BufferView`` asked once for the
    largest range's need) and ``reduce_kernel`` (split_reduce) adds them into y, or ``keep`` takes them
    (:func:`record_split_sums`). Returns the dispatch count."""
    lay, rb = _coopmat_layout(kernel, k, x_stride or k)
    tile = (lay.bt, lay.bn)
    x_stride, y_stride = x_stride or k, y_stride or n
    count = 0
    pieces = row_ranges(kernel, [w], rb, n, max_range)
    splits_of = lambda rows: coopmat_splits(k, rows, t, tile, target, slots, rb)  # noqa: E731
    part = part_scratch(part, pieces, t, lambda rows: splits_of(rows)[0], split_only=True)
    for (wb,), rows, row0 in pieces:
        splits, k_split = splits_of(rows)
        groups = (-(-t // tile[0]), -(-rows // tile[1]), splits)  # token tiles fastest
        if splits == 1:
            push = CoopMatPush(k, rows, t, x_stride, y_stride, rb, row0, k)
            rec.dispatch(kernel, [wb, xh, y, scale], push, groups)
            count += 1
            continue
        check_part(kernel, part, splits * t * rows * 4)
        push = CoopMatPush(k, rows, t, x_stride, rows, rb, 0, k_split)
        rec.dispatch(kernel, [wb, xh, part, scale], push, groups)
        sums = (rows, t, splits, y_stride, row0)
        count += 1 + record_split_sums(rec, reduce_kernel, part, y, *sums, keep if len(pieces) == 1 else None)
    return count


def record_coopmat_geglu(
    rec,
    kernel,
    reduce_kernel,
    w_gate,
    w_up,
    xh,
    y,
    scale,
    k: int,
    n: int,
    t: int,
    part,
    x_stride: int | None = None,
    y_stride: int | None = None,
    max_range: int | None = None,
    target: int | None = None,
    slots: int = 0,
    xh_out: tuple | None = None,
) -> int:
    """Record y[:t, :n] = gelu_tanh(x · W_gateᵀ) * (x · W_upᵀ) on the cooperative-matrix kernel: per bind
    range of the two weights (same type and shape) one dispatch for each into its partial sums (K split as
    for :func:`record_coopmat`, one "split" when K is not), then ``reduce_kernel`` (split_reduce_geglu) adds
    both and writes their GeGLU into y: three dispatches where the plain ops take five (two matmuls with
    their reductions, then geglu). ``part`` a callable ``nbytes -> BufferView``, asked twice (gate, up)
    for the largest range's need. Returns the dispatch count.

    ``xh_out`` = (scale, xh): ``reduce_kernel`` is geglu_row_scale, which writes the GeGLU as the next
    coopmat GEMM reads it (the row scales and float16 copy of :func:`record_row_scale`, bit for bit) and y
    not at all (``y`` unused); the weights in one bind range, n % 8 == 0."""
    if not callable(part):
        raise TypeError(
            f"{kernel.name}: part must be a callable nbytes -> BufferView (one for gate, one for up)"
        )
    lay, rb = _coopmat_layout(kernel, k, x_stride or k)
    tile = (lay.bt, lay.bn)
    x_stride, y_stride = x_stride or k, y_stride or n
    pieces = row_ranges(kernel, [w_gate, w_up], rb, n, max_range)
    if xh_out is not None and (len(pieces) > 1 or n % 8):
        raise ValueError(f"{reduce_kernel.name}: rows of {n} in {len(pieces)} bind ranges (one, n % 8 == 0)")
    splits_of = lambda rows: coopmat_splits(k, rows, t, tile, target, slots, rb)  # noqa: E731
    parts = [part_scratch(part, pieces, t, lambda r: splits_of(r)[0], split_only=False) for _ in range(2)]
    for (wg, wu), rows, row0 in pieces:
        splits, k_split = splits_of(rows)
        groups = (-(-t // tile[0]), -(-rows // tile[1]), splits)
        push = CoopMatPush(k, rows, t, x_stride, rows, rb, 0, k_split)
        for wb, pb in zip((wg, wu), parts, strict=True):
            check_part(kernel, pb, splits * t * rows * 4)
            rec.dispatch(kernel, [wb, xh, pb, scale], push, groups)
        push = SplitReducePush(rows, t, splits, y_stride, row0)
        if xh_out is not None:  # one workgroup a row
            bufs = [parts[0], xh_out[0], parts[1], xh_out[1]]
            rec.dispatch(reduce_kernel, bufs, push, reduce_kernel.groups_for(t))
        else:
            rec.dispatch(reduce_kernel, [parts[0], y, parts[1]], push, reduce_groups(reduce_kernel, t, rows))
    return 3 * len(pieces)


def _coopmat_layout(kernel, k: int, x_stride: int) -> tuple[CoopmatLayout, int]:
    """(layout, W's row bytes) of a mul_mm_coopmat kernel (:func:`coopmat_variant`), checked: built
    at its layout's workgroup size, its shared memory within the device's."""
    qtype, lay = coopmat_variant(kernel.name)
    if kernel.block_size != lay.block:
        raise ValueError(f"{kernel.name}: workgroup size {kernel.block_size}, its layout needs {lay.block}")
    if not coopmat_fits(kernel.name, kernel.device.limits):
        have = kernel.device.limits["maxComputeSharedMemorySize"]
        raise ValueError(f"{kernel.name}: {lay.shared_bytes()} B of shared memory, the device has {have}")
    if x_stride % 8:
        raise ValueError(f"x_stride {x_stride} must be a multiple of 8 (xh is read 8 float16 at a time)")
    return lay, weight_row_bytes(qtype, k)
