"""Quantized matmul kernels: y (T, N) = x (T, K) · Wᵀ, W (N, K) read as GGUF blocks (shaders/dequant.glsl).

Variants (one per weight type ``<t>`` in :data:`MATMUL_TYPES`):

- ``mul_mat_vec_<t>`` for the quantized types of :data:`UNIT_TYPES` (shaders/mul_mat_vec_unit.comp): T ≤ 8
  tokens (decode, small batches), float32 x and sums (``matvec="float"``); W read one unit (32 or 64
  weights, dq_int8.glsl) a lane, :data:`UNIT_ROWS` rows per lane group sharing each load of x; ``_t1``
  built for one token, ``_geglu`` (+ ``_t1``) reading the gate and up projections and writing their GeGLU.
- ``mul_mat_vec_<t>`` / ``mul_mat_vec_<t>_subgroup`` for f32, f16, bf16 (shaders/mul_mat_vec.comp): the same
  for float weights; one workgroup per :data:`MATVEC_ROWS` rows, the reduction through shared memory, or
  subgroupAdd first in the ``_subgroup`` variant.
- ``mul_mat_<t>`` (shaders/mul_mat.comp): any T (prefill); 64 × 64 output tiles, W tiles dequantized into
  shared memory; workgroup size fixed at 256.
- ``mul_mat_reg_<t>`` (shaders/mul_mat_reg.comp): the same without shared memory or barriers, an
  invocation's :data:`MATMUL_REG_ROWS` × :data:`MATMUL_REG_TOKENS` of y in registers (CPU drivers, where a
  load costs far more than a product: :func:`hmad.backends.vulkan.policy.matmul_kernel`).
- ``mul_mm_coopmat_<t>_<BT>x<BN>`` (shaders/mul_mm_coopmat.comp, <t> in :data:`COOPMAT_TYPES`): the same
  on VK_KHR_cooperative_matrix (float16 16×16×16 products, float32 accumulators; x as the float16 copy
  that row_scale.comp makes with its row scales), BT tokens × BN rows a workgroup, loads pipelined, K split
  over workgroups when the tiles alone are too few (partial sums in a scratch, added by ``split_reduce``);
  only on devices offering that shape with 32-wide subgroups (:func:`coopmat_usable`). For Q4_K also the
  layouts of :data:`COOPMAT_Q4K_VARIANTS`,
  ``mul_mm_coopmat_q4_k_<BT>x<BN>_s<SG_T>x<SG_N>[_bk32][_db][_w|_w2]`` (:class:`CoopmatLayout`: subgroup
  grid, K step, one or two tile sets, W pieces), :func:`coopmat_q4k_layout` picking among them.
- ``mul_mat_vec_{q8x,x3}_<t>[_geglu][<layout>][_t1]`` (shaders/mul_mat_vec_q8.comp): T ≤ 8 on int8
  activations, one plane or three (the exact path), :func:`record_matvec_q8`; the layouts
  (:data:`Q8_LAYOUTS`: rows per lane group, lane groups per row) picked per shape by :func:`q8_matvec_layout`.

Bindings: 0 = W (the raw bytes of its rows, bound whole or as one range of whole rows), 1 = x float32,
2 = y float32. A W bigger than maxStorageBufferRange is bound as several ranges (:meth:`BufferView.ranges`)
and recorded as one dispatch per range, ``row_offset`` telling each which y columns it writes
(:func:`record_matmul`).
This module imports nothing from pipelines.py (pipelines.py imports it to register the variants).
"""

from __future__ import annotations

import ctypes
import math
import re
from dataclasses import dataclass

import numpy as np

from hmad.core.tensors import QType, block_layout

u32 = ctypes.c_uint32

#: Weight types with a decoder in dequant.glsl: variant suffix -> GGUF type.
MATMUL_TYPES: dict[str, QType] = {
    "f32": QType.F32,
    "f16": QType.F16,
    "bf16": QType.BF16,
    "q8_0": QType.Q8_0,
    "q4_0": QType.Q4_0,
    "q5_0": QType.Q5_0,
    "q4_k": QType.Q4_K,
    "q6_k": QType.Q6_K,
}
#: Float weight types of mul_mat_vec.comp (decoded 8 weights at a time by dequant.glsl).
FLOAT_MATVEC_TYPES = ("f32", "f16", "bf16")
#: Weight types with a unit decoder in dq_int8.glsl: the float mat-vec mul_mat_vec_unit.comp and the int8
#: mat-vec (mul_mat_vec_q8.comp, x quantized by quantize_q8.comp) read these.
UNIT_TYPES: dict[str, QType] = {
    "q8_0": QType.Q8_0,
    "q4_0": QType.Q4_0,
    "q5_0": QType.Q5_0,
    "q4_k": QType.Q4_K,
    "q6_k": QType.Q6_K,
}
#: Weight types of the cooperative-matrix mat-mat (float16 tiles: not F32/BF16, whose range float16 lacks).
COOPMAT_TYPES: dict[str, QType] = {
    "f16": QType.F16,
    "q8_0": QType.Q8_0,
    "q4_0": QType.Q4_0,
    "q5_0": QType.Q5_0,
    "q4_k": QType.Q4_K,
    "q6_k": QType.Q6_K,
}
XH_ORDER = (0, 2, 1, 3, 4, 6, 5, 7)  # xh[t, 8g + i] = x[t, 8g + XH_ORDER[i]]: pairs as Q4_K decodes them
COOPMAT_TILES = ((32, 64), (32, 128), (64, 64), (64, 128), (128, 128))  # (BT tokens, BN rows) variants
COOPMAT_BK = 64  # K per step of mul_mm_coopmat.comp
# Without a measured residency (split_k_waves), split K until a dispatch has about this many workgroups: one
# wave of the decode-batch kernels on the GPU it was tuned on (docs/tuning.md)
COOPMAT_TARGET_GROUPS = 384
COOPMAT_MIN_STEPS = 4  # ... but keep at least this many BK steps per split
Q8_MATVEC_LANES = 32  # invocations per row (LANES in mul_mat_vec_q8.comp)
Q8_MATVEC_BLOCK = 128  # workgroup size: 4 lane groups
Q8_MATVEC_ROWS = 2  # rows per lane group (NR) of the default layout: 8 rows per workgroup
#: layouts of mul_mat_vec_q8.comp (shaders/build.py builds the same): name suffix -> (NR rows per lane group,
#: KS lane groups per row group, splitting the rows' K between them); built for T <= 8 tokens, and the
#: Q8_T1_LAYOUTS for one token too (``_t1``); GeGLU variants at NR 2 only (at NR 4 and 8 tokens their
#: reduction would need 32.1 KiB of shared memory, over the 32 KiB lavapipe and some GPUs allow)
Q8_LAYOUTS = {"": (2, 1), "_k2": (2, 2), "_r4": (4, 1), "_r4k2": (4, 2)}
Q8_T1_LAYOUTS = ("", "_k2")
#: fused tails of the one-token int8 mat-vec (mul_mat_vec_q8.comp, in the Q8_T1_LAYOUTS): suffix -> bindings.
#: "_t1_qo" (GeGLU): its output's q8 form for the down projection (XQ, XD, N / 32 counters, y again)
Q8_TAILS = {"_t1_qo": 9}
UNIT_ROWS = 2  # rows per lane group of mul_mat_vec_unit.comp (NR)
UNIT_BLOCK = 128  # its workgroup size: 4 lane groups of 32 (LANES), 8 rows
MATVEC_ROWS = 2  # rows of W per mat-vec workgroup (NUM_ROWS in mul_mat_vec.comp)
MATVEC_MAX_T = 8  # tokens per mat-vec dispatch (MAX_T)
MATMUL_TILE = 64  # BN = BT of mul_mat.comp
MATMUL_BLOCK = 256  # mul_mat.comp's fixed workgroup size
MATMUL_REG_ROWS = 16  # rows of W per invocation of mul_mat_reg.comp (RN) ...
MATMUL_REG_TOKENS = 16  # ... and tokens (RT): docs/tuning.md, "Large steps without cooperative matrices"
MATMUL_REG_BLOCK = 64  # its workgroup size: small, so that a CPU driver's threads share few tiles evenly
MATVEC_BLOCK = 128  # default mat-vec workgroup size (any power of two)
#: mat-vec variants per type (mul_mat_vec_unit.comp, mul_mat_vec_q8.comp): suffix, defines
UNIT_VARIANTS = (
    ("", {}),
    ("_geglu", {"GEGLU": "1"}),
    ("_t1", {"MAX_T": "1u"}),
    ("_geglu_t1", {"GEGLU": "1", "MAX_T": "1u"}),
)


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


class MatMulPush(ctypes.Structure):
    """shaders/mul_mat_vec.comp and shaders/mul_mat.comp"""

    _fields_ = [
        ("K", u32),  # weights per row
        ("N", u32),  # rows of W in the bound range
        ("T", u32),  # tokens
        ("x_stride", u32),  # floats between rows of x (multiple of 4)
        ("y_stride", u32),  # floats between rows of y
        ("row_bytes", u32),  # bytes of one stored W row
        ("row_offset", u32),  # y column of the range's first row
    ]


def build_entries() -> list[tuple[str, str, dict[str, str]]]:
    """The (name, source, defines) rows of shaders/build.py for every variant."""
    out = []
    for t in FLOAT_MATVEC_TYPES:
        d = {f"TYPE_{t.upper()}": "1"}
        out += [
            (f"mul_mat_vec_{t}", "mul_mat_vec.comp", d),
            (f"mul_mat_vec_{t}_subgroup", "mul_mat_vec.comp", {**d, "SUBGROUP": "1"}),
        ]
    for t in UNIT_TYPES:
        for suffix, extra in UNIT_VARIANTS:
            out.append(
                (f"mul_mat_vec_{t}{suffix}", "mul_mat_vec_unit.comp", {f"TYPE_{t.upper()}": "1", **extra})
            )
    out += [(f"mul_mat_{t}", "mul_mat.comp", {f"TYPE_{t.upper()}": "1"}) for t in MATMUL_TYPES]
    out += [(f"mul_mat_reg_{t}", "mul_mat_reg.comp", {f"TYPE_{t.upper()}": "1"}) for t in MATMUL_TYPES]
    for t in COOPMAT_TYPES:
        for bt, bn in COOPMAT_TILES:
            d = {f"TYPE_{t.upper()}": "1", "BT": f"{bt}u", "BN": f"{bn}u"}
            out.append((f"mul_mm_coopmat_{t}_{bt}x{bn}", "mul_mm_coopmat.comp", d))
    for lay in COOPMAT_Q4K_VARIANTS:
        d = {"TYPE_Q4_K": "1", **lay.defines()}
        out.append((f"mul_mm_coopmat_q4_k_{lay.suffix}", "mul_mm_coopmat.comp", d))
    return out


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
        then ``_bk32``, ``_db``, ``_w`` or ``_w2`` where they apply (shaders/build.py's
        ``coopmat_variant``)."""
        if self.plain:
            return f"{self.bt}x{self.bn}"
        tail = ("_bk32" if self.bk == 32 else "") + ("_db" if self.dbuf else "")
        tail += ("", "_w", "_w2")[self.wide]
        return f"{self.bt}x{self.bn}_s{self.sg_t}x{self.sg_n}{tail}"

    @property
    def block(self) -> int:
        """The workgroup size (BLOCK_SIZE = NINV in the shader)."""
        return 32 * self.sg_t * self.sg_n

    def defines(self) -> dict[str, str]:
        """The layout's defines in shaders/build.py (the first layout: BT and BN only)."""
        d = {"BT": f"{self.bt}u", "BN": f"{self.bn}u"}
        if not self.plain:
            d |= {"SG_T": f"{self.sg_t}u", "SG_N": f"{self.sg_n}u"}
            d |= ({"BK32": "1"} if self.bk == 32 else {}) | ({"DBUF": "1"} if self.dbuf else {})
            d |= {"WIDE": str(self.wide)} if self.wide else {}
        return d

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


#: The Q4_K-only layouts (shaders/build.py builds the same), next to the first (2 × 4 subgroups, BK 64, one
#: tile set; 64×128 is the prefill's): 4 subgroups each owning 64 × 64 of a 128 × 128 tile (16 products per
#: 8 fragment loads from shared memory, against 4 per 4 at 64×128), the same with BK 32 and two tile sets,
#: 4 subgroups of 32 × 64 on 64×128, and the first 128×128 grid (8 subgroups of 64 × 32) with BK 32 and two
#: tile sets (48 KiB: exactly NVIDIA's limit); then 8 subgroups of 64 × 64 on 256 tokens or 256 rows, and
#: 128x128_s2x2 with BK 32 (which ranked first at the big shapes: docs/tuning.md).
COOPMAT_Q4K_VARIANTS = (
    CoopmatLayout(128, 128, 2, 2),
    CoopmatLayout(128, 128, 2, 2, 32, True),
    CoopmatLayout(64, 128, 2, 2),
    CoopmatLayout(128, 128, 2, 4, 32, True),
    CoopmatLayout(256, 128, 4, 2, 32),
    CoopmatLayout(128, 256, 2, 4, 32),
    CoopmatLayout(128, 128, 2, 2, 32),
    CoopmatLayout(32, 128, 2, 4, wide=1),
    CoopmatLayout(16, 128, 1, 4, wide=1),
    CoopmatLayout(128, 128, 2, 2, wide=1),
    CoopmatLayout(64, 128, 2, 2, wide=1),
    CoopmatLayout(128, 128, 2, 2, wide=2),
    CoopmatLayout(64, 128, 2, 2, wide=2),
    CoopmatLayout(32, 128, 2, 2, wide=2),
    CoopmatLayout(32, 128, 1, 4, wide=2),
    CoopmatLayout(16, 128, 1, 4, wide=2),
    CoopmatLayout(32, 256, 1, 4, wide=2),
)
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


class CoopMatPush(ctypes.Structure):
    """shaders/mul_mm_coopmat.comp"""

    _fields_ = [*MatMulPush._fields_, ("k_split", u32)]  # weights of K per split (workgroup z)


class RowScalePush(ctypes.Structure):
    """shaders/row_scale.comp"""

    _fields_ = [("K", u32), ("T", u32), ("x_stride", u32)]


class SplitReducePush(ctypes.Structure):
    """shaders/split_reduce.comp"""

    _fields_ = [("N", u32), ("T", u32), ("splits", u32), ("y_stride", u32), ("row_offset", u32)]


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
    rec.dispatch(reduce_kernel, [part, y], push, _reduce_groups(reduce_kernel, t, rows))
    return 1


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
            rec.dispatch(reduce_kernel, [parts[0], y, parts[1]], push, _reduce_groups(reduce_kernel, t, rows))
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


def _reduce_groups(reduce_kernel, t: int, rows: int):
    return reduce_kernel.groups_for(min(-(-t * rows // 256), 4096))


def kernel_specs(spec_type) -> dict:
    """name -> ``spec_type(source, n_buffers, push struct, block)`` for :data:`pipelines.KERNELS`."""
    iface = {  # source -> (bindings, push struct, workgroup size)
        "mul_mat_vec.comp": (3, MatMulPush, MATVEC_BLOCK),
        "mul_mat_vec_unit.comp": (3, MatMulPush, UNIT_BLOCK),  # W, x, y (+ W_up: _geglu)
        "mul_mat.comp": (3, MatMulPush, MATMUL_BLOCK),
        "mul_mat_reg.comp": (3, MatMulPush, MATMUL_REG_BLOCK),
        "mul_mm_coopmat.comp": (4, CoopMatPush, MATMUL_BLOCK),  # W, x float16, y, scales (block: layout)
    }
    specs = {}
    for name, src, _ in build_entries():  # a _geglu variant also binds W_up, after the others
        n_buffers, push, block = iface[src]
        if src == "mul_mm_coopmat.comp":
            block = coopmat_variant(name)[1].block
        specs[name] = spec_type(src, n_buffers + ("_geglu" in name), push, block)
    for t in UNIT_TYPES:  # int8 mat-vecs, x as one plane (q8x) or three (x3): W, XQ, XD, y [, W_up]
        for suffix in q8_matvec_suffixes():
            for x in ("q8x", "x3"):
                n_buffers = 4 + ("_geglu" in suffix)
                specs[f"mul_mat_vec_{x}_{t}{suffix}"] = spec_type(
                    "mul_mat_vec_q8.comp", n_buffers, MatMulPush, Q8_MATVEC_BLOCK
                )
        for suffix in q8_tail_suffixes():
            for x in ("q8x", "x3"):
                n_buffers = next(n for tail, n in Q8_TAILS.items() if suffix.endswith(tail))
                specs[f"mul_mat_vec_{x}_{t}{suffix}"] = spec_type(
                    "mul_mat_vec_q8.comp", n_buffers, MatMulPush, Q8_MATVEC_BLOCK
                )
    return specs


def q8_tail_suffixes() -> list[str]:
    """The name suffixes (after the weight type) of the int8 mat-vec variants with a fused tail."""
    return [f"_geglu{lay}{tail}" for lay in Q8_T1_LAYOUTS for tail in Q8_TAILS]  # q8 out: after a GeGLU


def q8_matvec_suffixes() -> list[str]:
    """The name suffixes (after the weight type) of the int8 mat-vec variants: [_geglu] layout [_t1]."""
    return [
        f"{geglu}{lay}{t1}"
        for lay, (nr, _) in Q8_LAYOUTS.items()
        for geglu in ("", "_geglu")[: 1 if nr > 2 else 2]
        for t1 in (("", "_t1") if lay in Q8_T1_LAYOUTS else ("",))
    ]


def q8_matvec_layout(t: int, n: int, k: int, geglu: bool = False) -> str:
    """The layout (a :data:`Q8_LAYOUTS` suffix) of the int8 mat-vec for ``t`` tokens of an N × K weight:
    the fastest measured at the 27B and 270M layer shapes (bench/bench_vulkan_matvec_layouts.py; the times
    are in docs/tuning.md). At one token 2 rows a lane group on one lane group, unless that leaves under 128
    workgroups (then K split over two lane groups). At 2..8 tokens, where the per-token work bounds the
    kernel: 4 rows a lane group from N = 4096, and K split over two lane groups when K >= 1024 and the
    workgroups would be under 512. A GeGLU pair stays at 2 rows (its NR 4 variants are not built)."""
    nr = 4 if t > 1 and n >= 4096 and not geglu else 2
    groups = n / (Q8_MATVEC_BLOCK // Q8_MATVEC_LANES * nr)
    split = groups < 128 if t == 1 else groups < 512 and k >= 1024
    return {(2, False): "", (2, True): "_k2", (4, False): "_r4", (4, True): "_r4k2"}[nr, split]


def weight_row_bytes(qtype: QType, k: int) -> int:
    elems, nbytes = block_layout(qtype)
    if k % elems or k % 8:
        raise ValueError(f"K={k} is not whole {qtype.name} blocks (and a multiple of 8)")
    return k // elems * nbytes


def record_matmul(
    rec,
    kernel,
    w,
    x,
    y,
    k: int,
    n: int,
    t: int,
    x_stride: int | None = None,
    y_stride: int | None = None,
    max_range: int | None = None,
    w_up=None,
) -> int:
    """Record y[:t, :n] = x[:t, :k] · Wᵀ into ``rec`` (a CommandRecorder); returns the dispatch count.

    ``kernel`` a mul_mat_vec_* (t ≤ 8, or 1 for ``_t1``) or mul_mat_* Kernel; ``w`` the BufferView of W's
    rows (its ``row_bytes`` set, or computed here from the kernel's type); one dispatch per bind range of W
    (``max_range``: the device's maxStorageBufferRange unless given smaller, e.g. to test the split). A
    ``_geglu`` mat-vec also takes ``w_up`` (same type and shape) and writes gelu(x · Wᵀ) * (x · W_upᵀ).
    """
    name = kernel.name
    qtype = _matmul_qtype(name)
    rb = weight_row_bytes(qtype, k)
    x_stride, y_stride = x_stride or k, y_stride or n
    if x_stride % 4:
        raise ValueError(f"x_stride {x_stride} must be a multiple of 4 (x is read as vec4)")
    vec = name.startswith("mul_mat_vec_")
    max_t = 1 if name.endswith("_t1") else MATVEC_MAX_T
    if vec and not 1 <= t <= max_t:
        raise ValueError(f"{name}: T={t} tokens, this mat-vec takes 1..{max_t}")
    if ("_geglu" in name) != (w_up is not None):
        raise ValueError(f"{name}: w_up is for the _geglu variants, and they need it")
    rows_per_group = _matvec_rows_per_group(kernel) if vec else 0
    pieces = row_ranges(kernel, [w] if w_up is None else [w, w_up], rb, n, max_range)
    for binds, rows, row0 in pieces:
        push = MatMulPush(k, rows, t, x_stride, y_stride, rb, row0)
        if vec:
            groups = kernel.groups_for(-(-rows // rows_per_group))
        elif name.startswith("mul_mat_reg_"):
            tiles = -(-rows // MATMUL_REG_ROWS) * -(-t // MATMUL_REG_TOKENS)
            groups = kernel.groups_for(-(-tiles // kernel.block_size))
        else:
            groups = (-(-rows // MATMUL_TILE), -(-t // MATMUL_TILE), 1)
        rec.dispatch(kernel, [binds[0], x, y, *binds[1:]], push, groups)
    return len(pieces)


def _matmul_qtype(name: str) -> QType:
    base = name.removeprefix("mul_mat_vec_").removeprefix("mul_mat_reg_").removeprefix("mul_mat_")
    return MATMUL_TYPES[base.split("_sub")[0].split("_geglu")[0].removesuffix("_t1")]


def _matvec_rows_per_group(kernel) -> int:
    """Rows of W one workgroup of a mat-vec kernel computes."""
    if _matmul_qtype(kernel.name) in UNIT_TYPES.values():
        return kernel.block_size // Q8_MATVEC_LANES * UNIT_ROWS
    return MATVEC_ROWS


def row_ranges(kernel, ws: list, rb: int, n: int, max_range: int | None = None) -> list:
    """The bind ranges of weights ``ws`` (same shape, rows of ``rb`` bytes, ``n`` rows): per range, the
    bindings ``(view, offset, nbytes)`` of each weight, its row count and first row. A weight over the
    device's maxStorageBufferRange (or ``max_range``, to test the split) is several ranges of whole rows."""
    for v in ws:
        v.row_bytes = v.row_bytes or rb
        assert v.row_bytes == rb and v.nbytes >= n * rb, f"{kernel.name}: W has {v.nbytes} B, not {n} × {rb}"
    limits = kernel.device.limits
    align = max(256, limits["minStorageBufferOffsetAlignment"])
    cap = min(max_range or limits["maxStorageBufferRange"], limits["maxStorageBufferRange"])
    out, row0 = [], 0
    for pieces in zip(*(v.ranges(cap, align) for v in ws), strict=True):
        rows = min(pieces[0][1] // rb, n - row0)
        if rows <= 0:
            break
        out.append(
            (tuple((v, off - v.offset, nb) for v, (off, nb) in zip(ws, pieces, strict=True)), rows, row0)
        )
        row0 += rows
    return out


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
    rows_per_group = kernel.block_size // (Q8_MATVEC_LANES * ks) * nr
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
