"""Quantized matmul shaders (mul_mat_vec.comp, mul_mat.comp over dequant.glsl) against gguf's dequantize.

For every weight type: fresh random valid blocks (``random_blocks``), random x, the output poisoned with NaN,
and y compared with ``gguf.quants.dequantize(W) @ xᵀ`` computed in float64. Shapes are odd on purpose: N not a
multiple of the rows per workgroup or of the 64-row tile, strides with padding (the padding must stay NaN),
T = 1, 3, 8 for mat-vec and 17, 64 for mat-mat, K = 256..2048, and a W bound as several ranges.

Tolerance: max |y − ref| ≤ ``RTOL_SCALE`` = 1e-5 × the output scale (max |ref|), K ≤ 2048. The GPU sums in
float32 in another order than the float64 reference (and may fuse a decode's multiply-add, one rounding of a
weight); seen on lavapipe: mat-vec ≤ 2e-7 (short per-invocation sums, then a tree), mat-mat ≤ 1.2e-6 (one
sequential sum over K per output).
Small shapes: the whole file runs in well under 30 s on lavapipe with 2 cores.
"""

from __future__ import annotations

import zlib

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize
from vk_harness import shader_build

from hmad.core.quants import random_blocks
from hmad.core.tensors import QType

RTOL_SCALE = 1e-5
TYPES = ["f32", "f16", "bf16", "q8_0", "q4_0", "q5_0", "q4_k", "q6_k"]

pytestmark = pytest.mark.gpu


def _weights(t: str, n: int, k: int, rng) -> tuple[np.ndarray, np.ndarray]:
    """(stored bytes (n, row_bytes) uint8, dequantized float64 (n, k)) of a random valid W."""
    q = QType[t.upper()]
    w = random_blocks(q, (n, k), rng)
    raw = np.ascontiguousarray(w).view(np.uint8).reshape(n, -1)
    ref = gguf_dequantize(w if q == QType.F32 else raw, gguf.GGMLQuantizationType[t.upper()])
    return raw, ref.astype(np.float64)


def _run(dev, gpu, kernel, t, k, n, ntok, rng, max_range=None, pad_x=4, pad_y=3):
    from hmad.backends.vulkan.kernels_matmul import record_matmul
    from hmad.backends.vulkan.recorder import CommandRecorder

    raw, wref = _weights(t, n, k, rng)
    xs, ys = k + pad_x, n + pad_y
    x = np.full((ntok, xs), np.nan, np.float32)  # padding of x is NaN too: it must never be read
    x[:, :k] = rng.standard_normal((ntok, k))
    bw, bx = gpu.put(raw), gpu.put(x)
    by = gpu.poison(gpu.alloc(ntok * ys * 4))
    rec = CommandRecorder(dev).begin()
    dispatches = record_matmul(rec, kernel, bw, bx, by, k, n, ntok, xs, ys, max_range=max_range)
    rec.end()
    rec.submit()
    rec.close()
    y = gpu.get(by, shape=(ntok, ys))
    assert np.isnan(y[:, n:]).all(), "wrote past N into the padding of y"
    ref = x[:, :k].astype(np.float64) @ wref.T
    err = np.abs(y[:, :n] - ref).max() / np.abs(ref).max()
    assert err <= RTOL_SCALE, f"{kernel.name} K={k} N={n} T={ntok}: max error {err:.2e} of the output scale"
    return err, dispatches


# mul_mat_vec.comp (float weights: shared-memory or subgroup reduction), mul_mat_vec_unit.comp (quantized
# weights: up to 8 tokens, or built for one); the fused GeGLU variants: test_vulkan_fused.py
VEC_VARIANTS = [
    (t, s) for t in TYPES for s in (("", "_subgroup") if t in ("f32", "f16", "bf16") else ("", "_t1"))
]


@pytest.mark.parametrize(("t", "variant"), VEC_VARIANTS)
def test_mul_mat_vec(dev, kernels, gpu, t, variant):
    rng = np.random.default_rng()
    k = kernels(f"mul_mat_vec_{t}{variant}")
    for kk, n, ntok in [(256, 37, 1), (768, 20, 3), (2048, 11, 8), (512, 5, 2)]:
        ntok = 1 if variant == "_t1" else ntok
        err, _ = _run(dev, gpu, k, t, kk, n, ntok, rng)
        print(f"{k.name} K={kk} N={n} T={ntok}: {err:.1e}")


# shared-memory tiles; register tiles (CPU drivers), W and x as storage buffers or as storage texel buffers
@pytest.mark.parametrize("reg", ["", "_reg", "_reg_texel"])
@pytest.mark.parametrize("t", TYPES)
def test_mul_mat(dev, kernels, gpu, t, reg):
    rng = np.random.default_rng(zlib.crc32(t.encode()))
    k = kernels(f"mul_mat_reg_{t}_texel" if reg == "_reg_texel" else f"mul_mat{reg}_{t}")
    for kk, n, ntok in [(256, 67, 17), (512, 130, 64), (1024, 33, 3)]:
        err, _ = _run(dev, gpu, k, t, kk, n, ntok, rng)
        print(f"{k.name} K={kk} N={n} T={ntok}: {err:.1e}")


@pytest.mark.parametrize(
    "name",
    ["mul_mat_vec_q4_k", "mul_mat_vec_q8_0_t1", "mul_mat_vec_q6_k", "mul_mat_q6_k", "mul_mat_q5_0"]
    + ["mul_mat_reg_q5_0", "mul_mat_reg_q4_k_texel"],
)
def test_weight_bound_as_several_ranges(dev, kernels, gpu, name):
    """W split over bind ranges of whole rows: one dispatch per range, each writing its own y columns."""
    from hmad.backends.vulkan.kernels_matmul import MATMUL_TYPES, weight_row_bytes

    base = name.removesuffix("_subgroup").removesuffix("_t1").removesuffix("_texel")
    t = next(s for s in MATMUL_TYPES if base.endswith("_" + s))
    k = 256
    rb = weight_row_bytes(MATMUL_TYPES[t], k)
    max_range = int(np.lcm(rb, 256))  # ranges hold whole rows and start aligned (16 or 128 rows here)
    n = 2 * (max_range // rb) + 5  # three ranges, the last a short one
    ntok = (1 if name.endswith("_t1") else 3) if "vec" in name else 20
    _, dispatches = _run(
        dev, gpu, kernels(name), t, k, n, ntok, np.random.default_rng(5), max_range=max_range
    )
    assert dispatches == 3


def test_registries_agree():
    """The build list makes exactly the variants kernels_matmul registers (names, sources, defines)."""
    from hmad.backends.vulkan.kernels_matmul import build_entries
    from hmad.backends.vulkan.registry import KERNELS

    mine = {e[0]: e for e in build_entries()}
    assert {e[0]: e for e in shader_build().BUILD if e[0] in mine} == mine
    assert all(KERNELS[name].source == src for name, src, _ in mine.values())


def test_q8_matvec_layouts():
    """The int8 mat-vec variants built are the ones registered, each name parses back to the layout it was
    built with, and the layout picked for any step of the models' shapes names a built variant (the picks
    of the measured shapes as kernels_q8.q8_matvec_layout says)."""
    from hmad.backends.vulkan.kernels_matmul import UNIT_TYPES
    from hmad.backends.vulkan.kernels_q8 import (
        Q8_MATVEC_BLOCK,
        q8_matvec_layout,
        q8_matvec_suffixes,
        q8_matvec_variant,
        q8_tail_suffixes,
    )
    from hmad.backends.vulkan.registry import KERNELS

    built = {name: d for name, src, d in shader_build().BUILD if src == "mul_mat_vec_q8.comp"}
    suffixes = {t: q8_matvec_suffixes(t) + q8_tail_suffixes() for t in UNIT_TYPES}
    names = {f"mul_mat_vec_{x}_{t}{s}" for x in ("q8x", "x3") for t in UNIT_TYPES for s in suffixes[t]}
    assert set(built) == names and all(KERNELS[n].source == "mul_mat_vec_q8.comp" for n in names)
    for name, d in built.items():
        qtype, (nr, ks) = q8_matvec_variant(name)
        assert (d.get("NR", "2u"), d.get("KS", "1u")) == (f"{nr}u", f"{ks}u"), name
        assert f"_{qtype.name.lower()}" in name and ("MAX_T" in d) == ("_t1" in name)
        assert ("QOUT" in d) == name.endswith("_qo"), name
        # the lanes' partial sums in shared memory (red[LANES][GROUPS * NACC + 1] floats) fit the 32 KiB
        # that lavapipe and some GPUs allow (the one-lane layouts have none: each invocation its rows)
        nacc = (2 if "GEGLU" in d else 1) * nr * (1 if "MAX_T" in d else 8)
        assert "ONE_LANE" in d or 32 * (Q8_MATVEC_BLOCK // 32 * nacc + 1) * 4 <= 32768, name
    shapes = [(8192, 5376), (5376, 4096), (21504, 5376), (5376, 21504), (1536, 640), (2048, 640), (640, 2048)]
    shapes += [(640, 1024)]
    for t in range(1, 9):
        for n, k in shapes:
            t1 = "_t1" if t == 1 else ""
            assert f"mul_mat_vec_x3_q4_k{q8_matvec_layout(t, n, k)}{t1}" in built
            assert f"mul_mat_vec_x3_q4_k_geglu{q8_matvec_layout(t, n, k, geglu=True)}{t1}" in built
    picks = {(n, k): (q8_matvec_layout(1, n, k), q8_matvec_layout(8, n, k)) for n, k in shapes}
    assert picks == {
        (8192, 5376): ("", "_r4"),
        (5376, 4096): ("", "_r4k2"),
        (21504, 5376): ("", "_r4"),
        (5376, 21504): ("", "_r4k2"),
        (1536, 640): ("", ""),
        (2048, 640): ("", ""),
        (640, 2048): ("_k2", "_k2"),
        (640, 1024): ("_k2", "_k2"),
    }
    assert q8_matvec_layout(8, 21504, 5376, geglu=True) == ""  # the 27B's gate/up: GeGLU stays at NR 2


COOPMAT_CASES = [(256, 67, 17), (512, 300, 130), (1024, 129, 32), (2048, 128, 64), (5376, 200, 9)]


def _run_coopmat(dev, kernels, gpu, name, t, k, n, ntok, rng, max_range=None, big_rows=(), slots=0):
    """y of mul_mm_coopmat ``name`` (K split as the recorder decides, rows scaled by row_scale) against
    float64 products of the float16 roundings it multiplies; rows ``big_rows`` of x are scaled past
    float16's range (by 2^20, a power of two, so the reference's roundings stay the same relative ones);
    ``slots``: K split for whole waves of that many resident workgroups. Returns (error over the output
    scale, dispatches)."""
    from hmad.backends.vulkan.kernels_coopmat import record_coopmat, record_row_scale

    raw, wref = _weights(t, n, k, rng)
    xs, ys = k + 4, n + 3
    x = np.full((ntok, xs), np.nan, np.float32)
    x[:, :k] = rng.standard_normal((ntok, k))
    x[list(big_rows), :k] *= 2.0**20
    bw, bx = gpu.put(raw), gpu.put(x)
    by = gpu.poison(gpu.alloc(ntok * ys * 4))
    parts = []

    def part(nbytes):
        parts.append(gpu.poison(gpu.alloc(nbytes)))
        return parts[-1]

    from hmad.backends.vulkan.recorder import CommandRecorder

    scale = gpu.poison(gpu.alloc(ntok * 4))
    rec = CommandRecorder(dev).begin()
    xh = gpu.poison(gpu.alloc(ntok * k * 2))  # x goes in as the float16 copy row_scale makes
    record_row_scale(rec, kernels("row_scale"), bx, scale, xh, k, ntok, xs)
    dispatches = record_coopmat(
        rec,
        kernels(name),
        kernels("split_reduce"),
        bw,
        xh,
        by,
        scale,
        k,
        n,
        ntok,
        part,
        k,
        ys,
        max_range,
        slots=slots,
    )
    rec.end()
    rec.submit()
    rec.close()
    y = gpu.get(by, shape=(ntok, ys))
    assert np.isnan(y[:, n:]).all(), "wrote past N into the padding of y"
    s = np.ones((ntok, 1))
    s[list(big_rows)] = 2.0**20
    rw = _q4k_as_float16(raw, n, k) if t == "q4_k" else wref.astype(np.float32).astype(np.float16)
    rx = (x[:, :k] / s).astype(np.float16)
    ref = s * (rx.astype(np.float64) @ rw.astype(np.float64).T)
    exact = x[:, :k].astype(np.float64) @ wref.T  # and the float16 roundings stay small against float32
    err = 0.0
    for rows in (list(big_rows), [r for r in range(ntok) if r not in big_rows]):  # each at its own scale
        if rows:
            e = np.abs(y[rows, :n] - ref[rows]).max() / np.abs(ref[rows]).max()
            assert e <= RTOL_SCALE, f"{name} K={k} N={n} T={ntok}: max error {e:.2e} of the output scale"
            assert np.abs(y[rows, :n] - exact[rows]).max() / np.abs(exact[rows]).max() <= RTOL_F16
            err = max(err, e)
    return err, dispatches


def _q4k_as_float16(raw: np.ndarray, n: int, k: int) -> np.ndarray:
    """W (n, k) as mul_mm_coopmat's Q4_K decode makes it: dl = float16(d * sc), ml = float16(dmin * m), then
    w = float16(q * dl - ml) rounded once (its float16 fma), scales unpacked by gguf's Q4_K.get_scale_min."""
    b = raw.reshape(-1, 144)
    d, dmin = (b[:, o : o + 2].copy().view(np.float16).astype(np.float32) for o in (0, 2))
    sc, m = (v.astype(np.float32) for v in gguf.quants.Q4_K.get_scale_min(b[:, 4:16].copy()))
    dl, ml = ((a * v).astype(np.float16).astype(np.float64)[:, :, None] for a, v in ((d, sc), (dmin, m)))
    q = (b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    return (q.reshape(-1, 8, 32) * dl - ml).astype(np.float16).reshape(n, k)


RTOL_F16 = 2e-3  # coopmat vs the unrounded product: float16 x and W (2^-11 each), K ≤ 5376 random terms


@pytest.mark.parametrize("t", ["f16", "q8_0", "q4_0", "q5_0", "q4_k", "q6_k"])
def test_mul_mm_coopmat(dev, kernels, gpu, t):
    """The cooperative-matrix mat-mat against float64 products of the float16 roundings it multiplies (1e-5
    of the output scale: float32 accumulation only; RTOL_F16 against the unrounded product), every tile
    variant, K split or not, rows of x beyond float16's range included; runs where the device offers
    float16 cooperative matrices (not lavapipe: skipped in CI, run on the device machine)."""
    from hmad.backends.vulkan.kernels_coopmat import COOPMAT_TILES, coopmat_usable

    if not coopmat_usable(dev.info):
        pytest.skip(f"{dev.info.name}: no float16 16x16x16 cooperative matrix with 32-wide subgroups")
    rng = np.random.default_rng(zlib.crc32(f"coopmat{t}".encode()))
    for bt, bn in COOPMAT_TILES:
        name = f"mul_mm_coopmat_{t}_{bt}x{bn}"
        for kk, n, ntok in COOPMAT_CASES:
            if kk % 256 and t in ("q4_k", "q6_k"):
                continue
            big = (0, ntok - 1) if ntok > 9 else ()  # rows past float16's range: scaled, not inf
            err, d = _run_coopmat(dev, kernels, gpu, name, t, kk, n, ntok, rng, big_rows=big)
            print(f"{name} K={kk} N={n} T={ntok}: {err:.1e} ({d} dispatches)")


def test_mul_mm_coopmat_several_ranges(dev, kernels, gpu):
    from hmad.backends.vulkan.kernels_coopmat import coopmat_usable
    from hmad.backends.vulkan.kernels_matmul import weight_row_bytes

    if not coopmat_usable(dev.info):
        pytest.skip(f"{dev.info.name}: no float16 cooperative matrix")
    rng = np.random.default_rng(6)
    for t, tile in (("q4_k", "64x128"), ("q6_k", "64x64")):  # Q4_K's own loader, and dq8's
        rb = weight_row_bytes(QType[t.upper()], 256)
        max_range = int(np.lcm(rb, 256)) * 8  # 128 rows or more a range
        n = 2 * (max_range // rb) + 5
        _, d = _run_coopmat(dev, kernels, gpu, f"mul_mm_coopmat_{t}_{tile}", t, 256, n, 40, rng, max_range)
        assert d >= 3


COOPMAT_VARIANTS = [
    "mul_mm_coopmat_q4_k_128x128_s2x2",
    "mul_mm_coopmat_q4_k_128x128_s2x2_bk32_db",
    "mul_mm_coopmat_q4_k_64x128_s2x2",
    "mul_mm_coopmat_q4_k_128x128_s2x4_bk32_db",
    "mul_mm_coopmat_q4_k_256x128_s4x2_bk32",
    "mul_mm_coopmat_q4_k_128x256_s2x4_bk32",
    "mul_mm_coopmat_q4_k_128x128_s2x2_bk32",
    "mul_mm_coopmat_q4_k_32x128_s2x4_w",
    "mul_mm_coopmat_q4_k_16x128_s1x4_w",
    "mul_mm_coopmat_q4_k_128x128_s2x2_w",
    "mul_mm_coopmat_q4_k_64x128_s2x2_w",
    "mul_mm_coopmat_q4_k_128x128_s2x2_w2",
    "mul_mm_coopmat_q4_k_64x128_s2x2_w2",
    "mul_mm_coopmat_q4_k_32x128_s2x2_w2",
    "mul_mm_coopmat_q4_k_32x128_s1x4_w2",
    "mul_mm_coopmat_q4_k_16x128_s1x4_w2",
    "mul_mm_coopmat_q4_k_32x256_s1x4_w2",
]


@pytest.mark.parametrize("name", COOPMAT_VARIANTS)
def test_mul_mm_coopmat_variants(dev, kernels, gpu, name):
    """The Q4_K-only layouts (subgroup grids, BK 32, two tile sets) as test_mul_mm_coopmat checks the others:
    against float64 products of the float16 roundings (1e-5 of the output scale), partial tiles of tokens
    and rows, K split and not, rows of x past float16's range, W in three bind ranges; where the device has
    the float16 cooperative matrix and the layout's shared memory (not lavapipe: skipped in CI)."""
    from hmad.backends.vulkan.kernels_coopmat import coopmat_fits, coopmat_usable
    from hmad.backends.vulkan.kernels_matmul import weight_row_bytes

    if not coopmat_usable(dev.info):
        pytest.skip(f"{dev.info.name}: no float16 16x16x16 cooperative matrix with 32-wide subgroups")
    if not coopmat_fits(name, dev.limits):
        pytest.skip(f"{dev.info.name}: {name} needs more shared memory than the device's")
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    for kk, n, ntok in [c for c in COOPMAT_CASES if c[0] % 256 == 0] + [(2304, 250, 300)]:
        big = (0, ntok - 1) if ntok > 9 else ()
        err, d = _run_coopmat(dev, kernels, gpu, name, "q4_k", kk, n, ntok, rng, big_rows=big)
        print(f"{name} K={kk} N={n} T={ntok}: {err:.1e} ({d} dispatches)")
    max_range = int(np.lcm(weight_row_bytes(QType.Q4_K, 256), 256)) * 8
    n = 2 * (max_range // weight_row_bytes(QType.Q4_K, 256)) + 5
    _, d = _run_coopmat(dev, kernels, gpu, name, "q4_k", 256, n, 40, rng, max_range)
    assert d >= 3


def test_mul_mm_coopmat_bk32_splits(dev, kernels, gpu, monkeypatch):
    """The BK 32 layouts with K split at odd multiples of 32 (a split starting in the second half of a
    64-weight chunk, which the backend's 64-weight split granularity never makes): each k still counted once
    (coopmat_splits made to split K = 768 into 8 splits of 96)."""
    from hmad.backends.vulkan import kernels_coopmat as km

    if not km.coopmat_usable(dev.info):
        pytest.skip(f"{dev.info.name}: no float16 16x16x16 cooperative matrix with 32-wide subgroups")
    monkeypatch.setattr(km, "COOPMAT_BK", 32)
    monkeypatch.setattr(km, "COOPMAT_MIN_STEPS", 3)
    rng = np.random.default_rng(32)
    for name in (v for v in COOPMAT_VARIANTS if "_bk32" in v and km.coopmat_fits(v, dev.limits)):
        lay = km.coopmat_variant(name)[1]
        assert km.coopmat_splits(768, 300, 40, (lay.bt, lay.bn)) == (8, 96)
        err, d = _run_coopmat(dev, kernels, gpu, name, "q4_k", 768, 300, 40, rng, big_rows=(0,))
        print(f"{name} K=768 in splits of 96: {err:.1e} ({d} dispatches)")


def _shared_bytes(code: bytes) -> int:
    """Bytes of the Workgroup (shared) variables of a SPIR-V module: arrays of scalars and vectors."""
    import struct

    words = struct.unpack(f"<{len(code) // 4}I", code)
    size, consts, ptrs, total, i = {}, {}, {}, 0, 5
    while i < len(words):
        op, n = words[i] & 0xFFFF, words[i] >> 16
        a = words[i + 1 : i + n]
        if op in (21, 22):  # OpTypeInt, OpTypeFloat
            size[a[0]] = a[1] // 8
        elif op == 23:  # OpTypeVector
            size[a[0]] = size[a[1]] * a[2]
        elif op == 43:  # OpConstant
            consts[a[1]] = a[2]
        elif op == 28 and a[1] in size:  # OpTypeArray (of a scalar or vector: not cooperative matrices)
            size[a[0]] = size[a[1]] * consts[a[2]]
        elif op == 32:  # OpTypePointer
            ptrs[a[0]] = (a[1], a[2])
        elif op == 59 and a[2] == 4:  # OpVariable, Workgroup
            total += size[ptrs[a[0]][1]]
        i += max(n, 1)
    return total


def test_coopmat_layouts():
    """Every mul_mm_coopmat kernel (no device needed): its name parses back to the layout it was built with
    (defines), KERNELS gives it the layout's workgroup size, the SPIR-V's bindings and push block are
    CoopMatPush's and its shared memory is CoopmatLayout.shared_bytes, within the 48 KiB of NVIDIA's
    driver; the first layout's names are all still there."""
    from hmad.backends.vulkan.kernels_coopmat import COOPMAT_TILES, COOPMAT_TYPES, coopmat_variant
    from hmad.backends.vulkan.kernels_matmul import build_entries
    from hmad.backends.vulkan.program import load_spirv, reflect
    from hmad.backends.vulkan.push import CoopMatPush
    from hmad.backends.vulkan.registry import KERNELS

    built = {n: d for n, src, d in build_entries() if src == "mul_mm_coopmat.comp"}
    assert {f"mul_mm_coopmat_{t}_{bt}x{bn}" for t in COOPMAT_TYPES for bt, bn in COOPMAT_TILES} <= set(built)
    assert set(COOPMAT_VARIANTS) == {n for n in built if not coopmat_variant(n)[1].plain}
    offsets = tuple(getattr(CoopMatPush, f).offset for f, _ in CoopMatPush._fields_)
    for name, d in built.items():
        qtype, lay = coopmat_variant(name)
        assert d == {f"TYPE_{qtype.name}": "1", **lay.defines()} and name.endswith("_" + lay.suffix)
        assert not lay.problems(qtype), (name, lay.problems(qtype))
        assert KERNELS[name].block_size == lay.block and KERNELS[name].push is CoopMatPush
        code = load_spirv(name)
        iface = reflect(code)
        assert iface.bindings == (0, 1, 2, 3) and iface.written == (2,) and iface.push_offsets == offsets
        assert _shared_bytes(code) == lay.shared_bytes() <= 49152, name
    with pytest.raises(ValueError):
        coopmat_variant("mul_mm_coopmat_q4_k_64x128_s2")


def test_coopmat_kernel_name():
    """coopmat_kernel_name names coopmat_tile's pick (the backend's) unless a layout is given."""
    from hmad.backends.vulkan import kernels_coopmat as km

    for qtype in km.COOPMAT_TYPES.values():
        for t in (8, 32, 33, 128, 129, 512):
            bt, bn = km.coopmat_tile(t, qtype)
            assert km.coopmat_kernel_name(t, qtype) == f"mul_mm_coopmat_{qtype.name.lower()}_{bt}x{bn}"
    assert km.coopmat_kernel_name(512, QType.Q4_K, "128x128_s2x2") == "mul_mm_coopmat_q4_k_128x128_s2x2"
    name = km.coopmat_kernel_name(32, QType.Q4_K, "64x128_s2x2")
    assert name == "mul_mm_coopmat_q4_k_64x128_s2x2"


def test_split_k_waves():
    """The K split for whole waves (splitk.split_k_waves) picks what the H200 measured fastest on the
    27B's shapes (docs/performance.md, ninth session: 528 resident workgroups of the decode layouts, 264 of
    128x128_s2x2_w2), and on any shape a split the shader can run: k_split a multiple of 64 covering K in
    `splits` pieces of at least COOPMAT_MIN_STEPS steps (or one); one resident workgroup never splits, a
    resident count past every split takes the most splits."""
    from hmad.backends.vulkan import kernels_coopmat as km

    def splits(n, k, t, tile, slots):
        return km.coopmat_splits(k, n, t, tile, slots=slots, row_bytes=k // 256 * 144)[0]

    gate, down, q, kv, o = (21504, 5376), (5376, 21504), (4096, 5376), (2048, 5376), (5376, 4096)
    for t, tile in ((16, (16, 128)), (32, (32, 128))):
        assert [splits(*s, t, tile, 528) for s in (gate, down, kv)] == [3, 12, 21]
    assert [splits(*s, 512, (128, 128), 264) for s in (gate, down, q, kv, o)] == [1, 3, 2, 4, 1]
    assert [splits(*s, 64, (64, 128), 264) for s in (gate, down, q, kv, o)] == [3, 6, 8, 14, 6]
    assert [splits(*s, 128, (128, 128), 264) for s in (gate, down)] == [3, 6]
    assert [splits(*s, 128, (64, 128), 264) for s in (q, kv, o)] == [4, 8, 3]
    rng = np.random.default_rng(7)
    for _ in range(300):
        k = 256 * int(rng.integers(1, 100))
        n, t = int(rng.integers(1, 30000)), int(rng.integers(1, 600))
        tile = ((16, 128), (32, 128), (64, 128), (128, 128))[rng.integers(4)]
        slots = int(rng.integers(1, 2000))
        s, ks = km.coopmat_splits(k, n, t, tile, slots=slots, row_bytes=k // 256 * 144)
        steps = k // 64
        assert ks % 64 == 0 and s == -(-k // ks) and (s == 1 or ks // 64 >= min(km.COOPMAT_MIN_STEPS, steps))
        assert km.coopmat_splits(k, n, t, tile, slots=1, row_bytes=k // 256 * 144)[0] == 1
        most = -(-steps // min(km.COOPMAT_MIN_STEPS, steps))  # one wave whatever the split: fewest steps
        assert km.coopmat_splits(k, n, t, tile, slots=10**9, row_bytes=k // 256 * 144)[0] == most
    assert km.coopmat_splits(5376, 21504, 32, (32, 128))[0] == 3  # no residency: the 384 workgroups' target


@pytest.mark.gpu
def test_residency_probe(dev, kernels, gpu):
    """The cooperative-matrix kernels' residency probe (residency.py, push K == 0): the same count twice,
    between 1 and the workgroups dispatched; the kernels then give the same products with K split for
    whole waves of that count, of a single workgroup (no split) and of more than any split fills."""
    from hmad.backends.vulkan.kernels_coopmat import coopmat_usable
    from hmad.backends.vulkan.residency import PROBE_GROUPS, probe_residency

    if not coopmat_usable(dev.info):
        pytest.skip(f"{dev.info.name}: no float16 16x16x16 cooperative matrix with 32-wide subgroups")
    rng = np.random.default_rng(5)
    for lay in ("16x128_s1x4_w2", "32x128_s1x4_w2", "64x128_s2x2_w2", "128x128_s2x2_w2", "64x128"):
        name = f"mul_mm_coopmat_q4_k_{lay}"
        slots = probe_residency(kernels(name))
        assert 1 <= slots < PROBE_GROUPS and probe_residency(kernels(name)) == slots, (name, slots)
        print(f"{name}: {slots} workgroups resident")
        for each in (slots, 1, 10**6):
            _run_coopmat(dev, kernels, gpu, name, "q4_k", 2048, 300, 40, rng, big_rows=(0,), slots=each)


def test_coopmat_q4k_layout():
    """The measured picks for Q4_K (COOPMAT_Q4K_LAYOUTS): whole-chunk W pieces on 4 subgroups at 16 and 32
    tokens; from 33 to 64 64x128_s2x2_w2; from 65 to 128 128x128_s2x2_w2 on the big weights (the 27B's gate,
    up and down projections) and 64x128_s2x2_w2 on the others; over 128 128x128_s2x2_w2; coopmat_tile's for
    every other weight type."""
    from hmad.backends.vulkan.kernels_coopmat import coopmat_q4k_layout

    big, small = [(21504, 5376), (5376, 21504)], [(4096, 5376), (2048, 5376), (5376, 4096), (640, 2048)]
    picks = {9: "16x128_s1x4_w2", 16: "16x128_s1x4_w2", 17: "32x128_s1x4_w2", 32: "32x128_s1x4_w2"}
    for t, lay in picks.items():
        assert all(coopmat_q4k_layout(t, QType.Q4_K, n, k) == lay for n, k in big + small)
    for t in (33, 64):
        assert all(coopmat_q4k_layout(t, QType.Q4_K, n, k) == "64x128_s2x2_w2" for n, k in big + small)
    for t in (65, 128):
        assert all(coopmat_q4k_layout(t, QType.Q4_K, n, k) == "128x128_s2x2_w2" for n, k in big)
        assert all(coopmat_q4k_layout(t, QType.Q4_K, n, k) == "64x128_s2x2_w2" for n, k in small)
    for t in (129, 512, 4096):
        assert all(coopmat_q4k_layout(t, QType.Q4_K, n, k) == "128x128_s2x2_w2" for n, k in big + small)
    for t in (9, 32, 512):
        assert all(coopmat_q4k_layout(t, QType.Q6_K, n, k) is None for n, k in big + small)


@pytest.mark.parametrize("block", [256, 1024])
def test_row_scale(dev, kernels, gpu, block):
    """row_scale.comp (runs everywhere, lavapipe included; workgroups of ``block``, the backend's 1024 where
    the device allows): 1 for rows within 2^14, else the smallest power
    of two bringing the row's max |x| to at most 2^14; a NaN row gives NaN. Exact (powers of two). Its
    float16 copy of x / s equals numpy's rounding (round to nearest even, both), its columns within every 8
    in the tiles' order XH_ORDER."""
    from hmad.backends.vulkan.kernels_coopmat import XH_ORDER, record_row_scale
    from hmad.backends.vulkan.recorder import CommandRecorder

    rng = np.random.default_rng()
    t, k, xs = 7, 1000, 1004
    x = np.full((t, xs), np.nan, np.float32)
    x[:, :k] = rng.standard_normal((t, k))
    x[1, :k] *= 16384.0 / np.abs(x[1, :k]).max()  # exactly at the limit: 1
    x[2, 17] = -70000.0  # one big value (negative): 2^ceil(log2(70000 / 16384)) = 8
    x[3, :k] *= 2.0**30
    x[5, 3] = np.nan
    bx, bs = gpu.put(x), gpu.poison(gpu.alloc(4 * t))
    bh = gpu.poison(gpu.alloc(2 * t * k))
    rec = CommandRecorder(dev).begin()
    record_row_scale(rec, kernels("row_scale", block), bx, bs, bh, k, t, xs)
    rec.end()
    rec.submit()
    rec.close()
    s = gpu.get(bs, shape=(t,))
    xh = gpu.get(bh, np.float16, (t, k))  # the float16 copy: x / s rounded, row 5 NaN
    with np.errstate(invalid="ignore"):
        want_h = (x[:, :k] / s[:, None]).astype(np.float16)
    want_h = want_h.reshape(t, k // 8, 8)[:, :, list(XH_ORDER)].reshape(t, k)
    np.testing.assert_array_equal(np.delete(xh, 5, 0), np.delete(want_h, 5, 0))
    m = np.abs(x[:, :k]).max(axis=1)
    want = np.where(m <= 16384.0, 1.0, 2.0 ** np.ceil(np.log2(m / 16384.0)))
    assert np.isnan(s[5]) and not np.isnan(np.delete(s, 5)).any()
    np.testing.assert_array_equal(np.delete(s, 5), np.delete(want, 5))
    assert s[2] == 8.0 and s[1] == 1.0


def test_split_reduce(dev, kernels, gpu):
    """split_reduce.comp (runs everywhere): y rows = the sum of the splits' partial rows, in split order,
    written at row_offset with y_stride; the rest of y untouched (poisoned)."""
    from hmad.backends.vulkan.push import SplitReducePush
    from hmad.backends.vulkan.recorder import CommandRecorder

    rng = np.random.default_rng()
    splits, t, n, ys, off = 5, 9, 37, 50, 6
    part = rng.standard_normal((splits, t, n)).astype(np.float32)
    bp, by = gpu.put(part), gpu.poison(gpu.alloc(4 * t * ys))
    k = kernels("split_reduce")
    rec = CommandRecorder(dev).begin()
    rec.dispatch(k, [bp, by], SplitReducePush(n, t, splits, ys, off), k.groups_for(2))
    rec.end()
    rec.submit()
    rec.close()
    y = gpu.get(by, shape=(t, ys))
    want = part[0].copy()
    for s in range(1, splits):
        want += part[s]  # float32, split order: the shader's order
    np.testing.assert_array_equal(y[:, off : off + n], want)
    assert np.isnan(y[:, :off]).all() and np.isnan(y[:, off + n :]).all()


def test_split_reduce_geglu(dev, kernels, gpu):
    """split_reduce.comp with GEGLU (runs everywhere): y = gelu_tanh(sum of the gate partials) * (sum of
    the up partials), each sum in split order, against float64 gelu of those float32 sums (1e-6 relative
    to the largest |y|: the shader's exp-based gelu in float32); the rest of y untouched (poisoned)."""
    from hmad.backends.vulkan.push import SplitReducePush
    from hmad.backends.vulkan.recorder import CommandRecorder

    rng = np.random.default_rng()
    splits, t, n, ys, off = 3, 7, 41, 60, 9
    pg, pu = (rng.standard_normal((splits, t, n)).astype(np.float32) * 2 for _ in range(2))
    bg, bu, by = gpu.put(pg), gpu.put(pu), gpu.poison(gpu.alloc(4 * t * ys))
    k = kernels("split_reduce_geglu")
    rec = CommandRecorder(dev).begin()
    rec.dispatch(k, [bg, by, bu], SplitReducePush(n, t, splits, ys, off), k.groups_for(2))
    rec.end()
    rec.submit()
    rec.close()
    y = gpu.get(by, shape=(t, ys))
    g, u = pg[0].copy(), pu[0].copy()
    for s in range(1, splits):
        g, u = g + pg[s], u + pu[s]  # float32, split order
    g64 = g.astype(np.float64)
    want = 0.5 * g64 * (1 + np.tanh(np.sqrt(2 / np.pi) * (g64 + 0.044715 * g64**3))) * u
    assert np.abs(y[:, off : off + n] - want).max() <= 1e-6 * np.abs(want).max()
    assert np.isnan(y[:, :off]).all() and np.isnan(y[:, off + n :]).all()


@pytest.mark.parametrize("block", [64, 1024])
def test_geglu_row_scale(dev, kernels, gpu, block):
    """geglu_row_scale.comp (runs everywhere) at workgroup sizes ``block`` (the backend's: 1024 where the
    device allows): the row scales and float16 copy of the GeGLU of split-K partial sums, bit for bit what
    split_reduce_geglu then row_scale make (fresh random partials; a row past float16's range, made again at
    its scale; a NaN row: NaN scale and copy), the float32 GeGLU never written. The composed pair is itself
    checked against numpy (test_split_reduce_geglu, test_row_scale)."""
    from hmad.backends.vulkan.push import RowScalePush, SplitReducePush
    from hmad.backends.vulkan.recorder import CommandRecorder

    rng = np.random.default_rng()
    splits, t, n = 3, 6, 1000
    pg, pu = (rng.standard_normal((splits, t, n)).astype(np.float32) * 2 for _ in range(2))
    pg[:, 2], pu[:, 2] = pg[:, 2] * 300, pu[:, 2] * 300  # |f| up to ~10^6: scale 64 or more
    pg[1, 4, 17] = np.nan
    bg, bu = gpu.put(pg), gpu.put(pu)
    fused, plain = [tuple(gpu.poison(gpu.alloc(b)) for b in (4 * t, 2 * t * n)) for _ in range(2)]
    by = gpu.poison(gpu.alloc(4 * t * n))
    push = SplitReducePush(n, t, splits, n, 0)
    k_fused, k_geglu = kernels("geglu_row_scale", block), kernels("split_reduce_geglu")
    k_scale = kernels("row_scale", block)
    rec = CommandRecorder(dev).begin()
    rec.dispatch(k_fused, [bg, fused[0], bu, fused[1]], push, k_fused.groups_for(t))
    rec.dispatch(k_geglu, [bg, by, bu], push, k_geglu.groups_for(8))
    rec.dispatch(k_scale, [by, *plain], RowScalePush(n, t, n), k_scale.groups_for(t))
    rec.end()
    rec.submit()
    rec.close()
    (s, xh), (ws, wxh) = ((gpu.get(a, shape=(t,)), gpu.get(b, np.uint16, (t, n))) for a, b in (fused, plain))
    assert s[2] >= 64.0 and s[0] == 1.0 and np.isnan(s[4]) and np.isnan(ws[4])
    np.testing.assert_array_equal(np.delete(s, 4), np.delete(ws, 4))
    np.testing.assert_array_equal(np.delete(xh, 4, 0), np.delete(wxh, 4, 0))  # the bits
    assert np.isnan(xh[4].view(np.float16)).all() and np.isnan(wxh[4].view(np.float16)).all()


@pytest.mark.parametrize("t", ["q4_k", "q8_0"])
def test_coopmat_geglu(dev, kernels, gpu, t):
    """record_coopmat_geglu (the gate and up matmuls into partial sums, then split_reduce_geglu) against
    float64 gelu(x · Gᵀ) * (x · Uᵀ) of the float16 roundings the kernel multiplies: 1e-5 of the output's
    rounding scale (max gelu' ≈ 1.13 times |x||G| |u|, plus |gelu(g)| |x||U|: float32 accumulation); K
    split and not, one bind range and three; coopmat devices only (not lavapipe: skipped in CI, run on the
    device machine)."""
    from hmad.backends.vulkan.kernels_coopmat import (
        coopmat_tile,
        coopmat_usable,
        record_coopmat_geglu,
        record_row_scale,
    )
    from hmad.backends.vulkan.kernels_matmul import weight_row_bytes
    from hmad.backends.vulkan.recorder import CommandRecorder

    if not coopmat_usable(dev.info):
        pytest.skip(f"{dev.info.name}: no float16 16x16x16 cooperative matrix with 32-wide subgroups")
    rng = np.random.default_rng()
    qt = QType[t.upper()]
    rb = weight_row_bytes(qt, 256)
    max_range = int(np.lcm(rb, 256)) * 8  # 128 rows or more a range
    three = 2 * (max_range // rb) + 5
    for k, n, ntok, cap in [(512, 300, 32, None), (256, three, 40, max_range), (2048, 96, 9, None)]:
        (rg, wg), (ru, wu) = _weights(t, n, k, rng), _weights(t, n, k, rng)
        x = rng.standard_normal((ntok, k)).astype(np.float32)
        bx, by = gpu.put(x), gpu.poison(gpu.alloc(ntok * n * 4))
        scale, xh = gpu.poison(gpu.alloc(ntok * 4)), gpu.poison(gpu.alloc(ntok * k * 2))

        def part(nbytes):
            return gpu.poison(gpu.alloc(nbytes))

        bt, bn = coopmat_tile(ntok, qt)
        kern, red = kernels(f"mul_mm_coopmat_{t}_{bt}x{bn}"), kernels("split_reduce_geglu")
        rec = CommandRecorder(dev).begin()
        record_row_scale(rec, kernels("row_scale"), bx, scale, xh, k, ntok)
        args = (gpu.put(rg), gpu.put(ru), xh, by, scale, k, n, ntok, part)
        d = record_coopmat_geglu(rec, kern, red, *args, max_range=cap)
        rec.end()
        rec.submit()
        rec.close()
        assert d == (9 if cap else 3)
        y = gpu.get(by, shape=(ntok, n))
        hg, hu = (
            (_q4k_as_float16(r, n, k) if t == "q4_k" else w.astype(np.float32).astype(np.float16)).astype(
                np.float64
            )
            for r, w in ((rg, wg), (ru, wu))
        )
        xs = x.astype(np.float16).astype(np.float64)
        g, u = xs @ hg.T, xs @ hu.T
        gelu = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3)))
        bound = 1.13 * (np.abs(xs) @ np.abs(hg).T) * np.abs(u) + np.abs(gelu) * (np.abs(xs) @ np.abs(hu).T)
        err = np.abs(y - gelu * u).max() / bound.max()
        print(f"{t} K={k} N={n} T={ntok} {bt}x{bn}: error {err:.1e} of the rounding scale ({d} dispatches)")
        assert err <= 1e-5, f"{t} K={k} N={n} T={ntok}: error {err:.1e} of the rounding scale"


def test_texel_kernels_refused_on_a_device_without_texel_buffers(dev, monkeypatch):
    """A kernel that declares storage texel buffers is refused, with the reason, on a device whose buffers
    are not made as texel buffers (Device.texel_loads: GPUs), before any descriptor is written."""
    from hmad.backends.vulkan.pipelines import Kernel

    monkeypatch.setattr(dev, "texel_loads", False)
    with pytest.raises(ValueError, match="texel buffers"):
        Kernel(dev, "mul_mat_reg_q8_0_texel")
