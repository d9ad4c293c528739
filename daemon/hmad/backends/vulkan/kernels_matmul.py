"""Quantized matmul kernels: y (T, N) = x (T, K) · Wᵀ, W (N, K) read as GGUF blocks (shaders/dequant.glsl).

Variants (one per weight type ``<t>`` in :data:`MATMUL_TYPES`; the list built is variants.py's):

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

The other matmul kernels have their own modules: the int8 mat-vec (kernels_q8.py), the cooperative-matrix
GEMM (kernels_coopmat.py), the exact int8 GEMM (kernels_mmq.py); the K split they share is splitk.py's.

Bindings: 0 = W (the raw bytes of its rows, bound whole or as one range of whole rows), 1 = x float32,
2 = y float32. A W bigger than maxStorageBufferRange is bound as several ranges (:meth:`BufferView.ranges`)
and recorded as one dispatch per range, ``row_offset`` telling each which y columns it writes
(:func:`record_matmul`, :func:`row_ranges`).
"""

from __future__ import annotations

from hmad.backends.vulkan import variants
from hmad.backends.vulkan.push import MatMulPush
from hmad.core.tensors import QType, block_layout

#: Weight types with a decoder in dequant.glsl: variant suffix -> GGUF type.
MATMUL_TYPES: dict[str, QType] = {t: QType[t.upper()] for t in variants.MATMUL_TYPE_NAMES}
#: Weight types with a unit decoder in dq_int8.glsl: the float mat-vec mul_mat_vec_unit.comp and the int8
#: mat-vec (mul_mat_vec_q8.comp, x quantized by quantize_q8.comp) read these.
UNIT_TYPES: dict[str, QType] = {t: QType[t.upper()] for t in variants.UNIT_TYPE_NAMES}
UNIT_LANES = 32  # invocations per row group of mul_mat_vec_unit.comp (LANES)
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
#: the sources of this module's kernels
MATMUL_SOURCES = ("mul_mat_vec.comp", "mul_mat_vec_unit.comp", "mul_mat.comp", "mul_mat_reg.comp")


def build_entries() -> list[tuple[str, str, dict[str, str]]]:
    """The (name, source, defines) rows of the build list (variants.VARIANTS) of this module's kernels and
    the cooperative-matrix GEMM's."""
    sources = (*MATMUL_SOURCES, "mul_mm_coopmat.comp")
    return [(v.name, v.source, v.defines) for v in variants.VARIANTS if v.source in sources]


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
    return MATMUL_TYPES[base.split("_sub")[0].split("_geglu")[0].removesuffix("_t1").removesuffix("_texel")]


def _matvec_rows_per_group(kernel) -> int:
    """Rows of W one workgroup of a mat-vec kernel computes."""
    if _matmul_qtype(kernel.name) in UNIT_TYPES.values():
        return kernel.block_size // UNIT_LANES * UNIT_ROWS
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
