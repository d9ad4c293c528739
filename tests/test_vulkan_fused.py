"""The decode-path kernels: q8 activation quantization, the int8 mat-vec (plain and fused with GeGLU), the
fused residual + norm step and the fused per-head norm + RoPE, each against an independent numpy reference
on fresh random inputs with the outputs poisoned (NaN) first.

References and tolerances:
- quantize_q8.comp vs a numpy q8_1 quantizer written here: the int8 values equal (a value exactly halfway
  between two steps may round either way in float32: at most 1 step on at most 1 in 1000 values), d and s
  within 1e-6 relative.
- mul_mat_vec_q8.comp vs gguf's dequantize(W) in float64 times the *dequantized* q8 activations the GPU
  made (d * q, read back): the int8 dots are exact, the float scale products round once per block and the
  block sums add in float32, so max |y - ref| <= 1e-5 of the rounding scale (max of sum |x| |w| over an
  output; for GeGLU the same propagated through gelu(g) * u: ``_rounding_scale``) + 1e-12. Against the
  float x itself (a sanity bound on the scheme, plain variants: GeGLU computes the same dots, and gelu's
  steep tail below 0 makes a relative bound on its output meaningless) the q8 rounding (up to max|x| / 254
  per value, random signs: ~1 % of a K = 256 dot) keeps the RMS error under 3e-2 of the RMS output.
  Random Q4_K gates can all sit far below 0 (every GeGLU output ~0): the 1e-12 floor covers that case.
- residual_norm.comp vs float64 numpy: 2e-5 relative (float32 sums over <= 5376 values).
- norm_rope.comp vs CpuBackend(numerics="f32"): the rope tolerance of test_vulkan_ops.py (float32 angles on
  the GPU: atol 4e-5 (1 + position / 64) per unit of value scale, rtol 1e-5).
"""

from __future__ import annotations

import zlib

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize as gguf_dequantize
from vk_harness import assert_x3_planes

from hmad.backends.vulkan.kernels_q8 import q8_matvec_suffixes, q8_tail_suffixes
from hmad.core.quants import random_blocks
from hmad.core.tensors import QType, block_layout

pytestmark = pytest.mark.gpu
Q8_TYPES = ["q8_0", "q4_0", "q5_0", "q4_k", "q6_k"]
#: (weight type, variant suffix [_geglu] layout [_t1]) of every int8 mat-vec built
Q8_CASES = [(t, v) for t in Q8_TYPES for v in q8_matvec_suffixes(t)]


def q8_reference(x: np.ndarray):
    """(q int8 (T, K), d, s (T, K/32)) as ggml's quantize_row_q8_1: d = amax / 127, q = roundf(x / d)."""
    t, k = x.shape
    blocks = x.astype(np.float32).reshape(t, k // 32, 32)
    d = (np.abs(blocks).max(axis=-1) / np.float32(127)).astype(np.float32)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    r = blocks * inv[..., None]
    q = (np.sign(r) * np.floor(np.abs(r) + np.float32(0.5))).astype(np.int8)
    return q.reshape(t, k), d, d * q.astype(np.float32).sum(axis=-1)


def _quantize(dev, kernels, gpu, x, planes: int = 1):
    """Quantize x on the GPU (quantize_q8, or quantize_x3 for three planes); returns the (xq, xd) views."""
    from hmad.backends.vulkan.push import QuantizeQ8Push
    from hmad.backends.vulkan.recorder import CommandRecorder

    t, k = x.shape
    bx = gpu.put(x)
    bq, bd = gpu.poison(gpu.alloc(planes * t * k)), gpu.poison(gpu.alloc(t * k // 32 * 8))
    rec = CommandRecorder(dev).begin()
    name = "quantize_x3" if planes == 3 else "quantize_q8"
    rec.dispatch(kernels(name), [bx, bq, bd], QuantizeQ8Push(k, t, k), 7)
    rec.end()
    rec.submit()
    rec.close()
    return bq, bd


def test_quantize_q8_matches_reference(dev, kernels, gpu):
    rng = np.random.default_rng()
    x = (rng.standard_normal((5, 640)) * rng.uniform(0.01, 30, (5, 1))).astype(np.float32)
    x[2, 64:96] = 0.0  # an all-zero block: d = 0, q = 0
    bq, bd = _quantize(dev, kernels, gpu, x)
    q_ref, d_ref, s_ref = q8_reference(x)
    q = gpu.get_xq(bq, (5, 640))
    ds = gpu.get(bd, np.float32, (5, 20, 2))
    diff = np.abs(q.astype(np.int32) - q_ref)
    assert diff.max() <= 1 and (diff > 0).mean() <= 1e-3
    np.testing.assert_allclose(ds[..., 0], d_ref, rtol=1e-6)
    np.testing.assert_allclose(ds[..., 1], d_ref * q.astype(np.float32).reshape(5, 20, 32).sum(-1), rtol=1e-5)
    assert (q[2, 64:96] == 0).all() and ds[2, 2, 0] == 0


def _weights(t: str, n: int, k: int, rng):
    q = QType[t.upper()]
    raw = np.ascontiguousarray(random_blocks(q, (n, k), rng)).view(np.uint8).reshape(n, -1)
    return raw, gguf_dequantize(raw, gguf.GGMLQuantizationType[t.upper()]).astype(np.float64)


def _rounding_scale(xs, w, u=None):
    """What float32 rounding of the dots is relative to: sum |x| |w| per output (not |sum x w|: Q4_K's
    offsets make the dots cancel), and for GeGLU gelu'(g) * that * |u| + |gelu(g)| * sum |x| |u|."""
    abs_g = np.abs(xs) @ np.abs(w).T
    if u is None:
        return abs_g
    g, up, abs_u = xs @ w.T, xs @ u.T, np.abs(xs) @ np.abs(u).T
    slope = np.abs(_gelu(g + 1e-3) - _gelu(g - 1e-3)) / 2e-3
    return slope * abs_g * np.abs(up) + np.abs(_gelu(g)) * abs_u


def _gelu(g):
    return 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g**3)))


def _run_q8_matvec(dev, gpu, kern, raw, raw_u, bq, bd, k: int, n: int, ntok: int) -> np.ndarray:
    """y (ntok, n) of an int8 mat-vec kernel over the quantized x (bq, bd) and W (raw; raw_u: GeGLU's up
    projection); y's padding columns must stay poisoned."""
    from hmad.backends.vulkan.kernels_q8 import record_matvec_q8
    from hmad.backends.vulkan.recorder import CommandRecorder

    ys = n + 3
    by = gpu.poison(gpu.alloc(ntok * ys * 4))
    rec = CommandRecorder(dev).begin()
    up = gpu.put(raw_u) if raw_u is not None else None
    record_matvec_q8(rec, kern, gpu.put(raw), bq, bd, by, k, n, ntok, ys, w_up=up)
    rec.end()
    rec.submit()
    rec.close()
    y = gpu.get(by, shape=(ntok, ys))
    assert np.isnan(y[:, n:]).all(), "wrote past N"
    return y[:, :n]


def _matvec_ref(xs, w, u=None):
    """x · Wᵀ in float64, or gelu(x · Wᵀ) * (x · Uᵀ)."""
    return xs @ w.T if u is None else _gelu(xs @ w.T) * (xs @ u.T)


@pytest.mark.parametrize(("t", "variant"), Q8_CASES)
def test_mul_mat_vec_q8(dev, kernels, gpu, t, variant):
    """Every variant: plain or GeGLU, each layout (kernels_q8.Q8_LAYOUTS), up to 8 tokens or one; the
    shapes leave partial workgroups and lanes without a unit."""
    rng = np.random.default_rng()
    geglu, one = "_geglu" in variant, variant.endswith("_t1")
    kern = kernels(f"mul_mat_vec_q8x_{t}{variant}")
    shapes = [(256, 37, 1), (768, 22, 3), (2048, 9, 8), (256, 300, 5)]  # the last: over one workgroup's rows
    for k, n, ntok in [(k, n, 1) for k, n, _ in shapes] if one else shapes:
        raw, wref = _weights(t, n, k, rng)
        raw_u, uref = _weights(t, n, k, rng)
        x = rng.standard_normal((ntok, k)).astype(np.float32)
        bq, bd = _quantize(dev, kernels, gpu, x)
        # the exact reference takes the GPU's own q8 values (the quantizer is checked on its own above)
        q = gpu.get_xq(bq, (ntok, k)).astype(np.float64)
        d = gpu.get(bd, np.float32, (ntok, k // 32, 2))[..., 0].astype(np.float64)
        xhat = (q.reshape(ntok, -1, 32) * d[..., None]).reshape(ntok, k)
        y = _run_q8_matvec(dev, gpu, kern, raw, raw_u if geglu else None, bq, bd, k, n, ntok)
        for xs, exact in ((xhat, True), (x.astype(np.float64), False)):
            ref = _matvec_ref(xs, wref, uref if geglu else None)
            if exact:  # (+1e-12: every gate of a GeGLU case can be far below 0, all outputs ~0, scale 0)
                err = np.abs(y - ref).max()
                scale = _rounding_scale(xs, wref, uref if geglu else None).max()
                assert err <= 1e-5 * scale + 1e-12, (
                    f"{kern.name} K={k} N={n} T={ntok}: error {err:.2e}, scale {scale:.2e}"
                )
            elif not geglu:
                err = np.sqrt(np.mean((y - ref) ** 2) / np.mean(ref**2))
                assert err <= 3e-2, f"{kern.name} K={k} N={n} T={ntok}: RMS error {err:.2e} vs float x"


def test_quantize_x3_planes(dev, kernels, gpu):
    """quantize_q8.comp with three planes (vk_harness.assert_x3_planes: x back within d / 32768 per value)."""
    rng = np.random.default_rng()
    t, k = 5, 640
    x = (rng.standard_normal((t, k)) * rng.uniform(0.01, 300, (t, 1))).astype(np.float32)
    x[2, 64:96] = 0.0  # an all-zero block
    x[3, :32] = np.linspace(-1, 1, 32)  # values at exact fractions of d
    bq, bd = _quantize(dev, kernels, gpu, x, planes=3)
    q = gpu.get_xq(bq, (t, 3, k))
    ds = gpu.get(bd, np.float32, (t, k // 32, 2))
    assert_x3_planes(q, ds, x)
    assert (q[2, :, 64:96] == 0).all() and ds[2, 2, 0] == 0


@pytest.mark.parametrize(("t", "variant"), Q8_CASES)
def test_mul_mat_vec_x3(dev, kernels, gpu, t, variant):
    """The exact decode path (mul_mat_vec_q8.comp with three planes) against float64 on the float x itself
    (not on the quantized x): 5e-6 of the rounding scale (``_rounding_scale``): the planes leave at most
    max|x| * 2.4e-7 per value of a block, the rest is float32 summation (the float mat-vec gets ~1e-7)."""

    rng = np.random.default_rng()
    geglu, one = "_geglu" in variant, variant.endswith("_t1")
    kern = kernels(f"mul_mat_vec_x3_{t}{variant}")
    for k, n, ntok in [(256, 37, 1), (768, 22, 3), (2048, 9, 8)]:
        ntok = 1 if one else ntok
        raw, wref = _weights(t, n, k, rng)
        raw_u, uref = _weights(t, n, k, rng)
        x = (rng.standard_normal((ntok, k)) * rng.uniform(0.1, 100, (ntok, 1))).astype(np.float32)
        bq, bd = _quantize(dev, kernels, gpu, x, planes=3)
        y = _run_q8_matvec(dev, gpu, kern, raw, raw_u if geglu else None, bq, bd, k, n, ntok)
        xs = x.astype(np.float64)
        ref = _matvec_ref(xs, wref, uref if geglu else None)
        err = np.abs(y - ref).max()
        scale = _rounding_scale(xs, wref, uref if geglu else None).max()
        assert err <= 5e-6 * scale + 1e-12, (
            f"{kern.name} K={k} N={n} T={ntok}: error {err:.2e}, scale {scale:.2e}"
        )
        print(f"{kern.name} K={k} N={n} T={ntok}: error {err:.1e}, rounding scale {scale:.1e}")


#: per type, the byte range of a block's quant bits and the byte that puts every int8 lane (dq_int8.glsl) at
#: its extreme (Q4_K's nibbles at 15; the others' at their most negative offset lane, Q8_0's at -128)
EXTREME_QUANTS = {
    "q8_0": (2, 34, 0x80),
    "q4_0": (2, 18, 0x00),
    "q5_0": (2, 22, 0x00),
    "q4_k": (16, 144, 0xFF),
    "q6_k": (0, 192, 0x00),
}


@pytest.mark.parametrize("t", Q8_TYPES)
@pytest.mark.parametrize("variant", ["", "_t1", "_r4k2", "_k2_t1"])
def test_mul_mat_vec_x3_extreme_lanes(dev, kernels, gpu, t, variant):
    """The exact path at the ends of its integer ranges: every weight lane at its extreme and every x block
    at full scale with one sign (q1 = 126..127 everywhere, q2 and q3 nonzero), so the int8 dots are as large
    as they get and nothing cancels; the same 5e-6 of the rounding scale as above."""
    rng = np.random.default_rng()
    ntok = 1 if variant.endswith("_t1") else 3
    k, n = 2048, 9
    q = QType[t.upper()]
    raw = np.ascontiguousarray(random_blocks(q, (n, k), rng)).view(np.uint8).reshape(n, -1).copy()
    lo, hi, byte = EXTREME_QUANTS[t]
    blocks = raw.reshape(n, -1, block_layout(q)[1])  # a view: writing it writes raw
    blocks[:, :, lo:hi] = byte
    wref = gguf_dequantize(raw, gguf.GGMLQuantizationType[t.upper()]).astype(np.float64)
    x = (rng.uniform(0.99, 1.0, (ntok, k)) * rng.uniform(0.1, 100, (ntok, 1))).astype(np.float32)
    bq, bd = _quantize(dev, kernels, gpu, x, planes=3)
    assert (gpu.get_xq(bq, (ntok, 3, k))[:, 0] >= 126).all()
    y = _run_q8_matvec(dev, gpu, kernels(f"mul_mat_vec_x3_{t}{variant}"), raw, None, bq, bd, k, n, ntok)
    xs = x.astype(np.float64)
    err, scale = np.abs(y - xs @ wref.T).max(), _rounding_scale(xs, wref).max()
    assert err <= 5e-6 * scale, f"{t}{variant}: error {err:.2e}, scale {scale:.2e}"


@pytest.mark.parametrize("t", Q8_TYPES)
@pytest.mark.parametrize("one", [False, True])
def test_mul_mat_vec_unit_geglu(dev, kernels, gpu, t, one):
    """The float mat-vec fused with GeGLU (mul_mat_vec_unit.comp, GEGLU): gelu(x · gate) * (x · up) from one
    dispatch, against float64 on the float x itself (no quantization on this path): 1e-5 of the rounding
    scale (``_rounding_scale``), W bound as two ranges in one case."""
    from hmad.backends.vulkan.kernels_matmul import UNIT_TYPES, record_matmul, weight_row_bytes
    from hmad.backends.vulkan.recorder import CommandRecorder

    rng = np.random.default_rng()
    kern = kernels(f"mul_mat_vec_{t}_geglu" + ("_t1" if one else ""))
    max_split = int(np.lcm(weight_row_bytes(UNIT_TYPES[t], 768), 256))
    for k, n, ntok, max_range in [(256, 37, 1, None), (768, 22, 3, max_split), (2048, 9, 8, None)]:
        ntok = 1 if one else ntok
        raw, wref = _weights(t, n, k, rng)
        raw_u, uref = _weights(t, n, k, rng)
        x = rng.standard_normal((ntok, k)).astype(np.float32)
        ys = n + 3
        by = gpu.poison(gpu.alloc(ntok * ys * 4))
        rec = CommandRecorder(dev).begin()
        record_matmul(
            rec,
            kern,
            gpu.put(raw),
            gpu.put(x),
            by,
            k,
            n,
            ntok,
            y_stride=ys,
            max_range=max_range,
            w_up=gpu.put(raw_u),
        )
        rec.end()
        rec.submit()
        rec.close()
        y = gpu.get(by, shape=(ntok, ys))
        assert np.isnan(y[:, n:]).all(), "wrote past N"
        y, xs = y[:, :n], x.astype(np.float64)
        ref = _matvec_ref(xs, wref, uref)
        err = np.abs(y - ref).max()
        scale = _rounding_scale(xs, wref, uref).max()
        assert err <= 1e-5 * scale + 1e-12, (
            f"{kern.name} K={k} N={n} T={ntok}: error {err:.2e}, scale {scale:.2e}"
        )
        print(f"{kern.name} K={k} N={n} T={ntok}: error {err:.1e}, rounding scale {scale:.1e}")


def test_mul_mat_vec_q8_over_several_ranges(dev, kernels, gpu):
    from hmad.backends.vulkan.kernels_matmul import weight_row_bytes
    from hmad.backends.vulkan.kernels_q8 import record_matvec_q8
    from hmad.backends.vulkan.recorder import CommandRecorder

    rng = np.random.default_rng(7)
    k, ntok = 256, 2
    rb = weight_row_bytes(QType.Q6_K, k)
    max_range = int(np.lcm(rb, 256))
    n = 2 * (max_range // rb) + 5
    raw, wref = _weights("q6_k", n, k, rng)
    x = rng.standard_normal((ntok, k)).astype(np.float32)
    bq, bd = _quantize(dev, kernels, gpu, x)
    by = gpu.poison(gpu.alloc(ntok * n * 4))
    rec = CommandRecorder(dev).begin()
    got = record_matvec_q8(
        rec, kernels("mul_mat_vec_q8x_q6_k"), gpu.put(raw), bq, bd, by, k, n, ntok, max_range=max_range
    )
    rec.end()
    rec.submit()
    rec.close()
    assert got == 3
    ref = x.astype(np.float64) @ wref.T
    assert np.abs(gpu.get(by, shape=(ntok, n)) - ref).max() / np.abs(ref).max() < 2e-2


def _rms(v, w, eps):
    v = v.astype(np.float64)
    return v / np.sqrt(np.mean(v * v, axis=-1, keepdims=True) + eps) * w


@pytest.mark.parametrize(
    "variant", ["residual_norm", "residual_norm_next", "residual_norm_next_q8", "residual_norm_next_x3"]
)
@pytest.mark.parametrize("d", [640, 1152, 5376])  # 5376 (27B): some invocations hold two groups of 4
@pytest.mark.parametrize("fit", [False, True])  # the spec's 1024 invocations, or residual_block(d)
def test_residual_norm(dev, kernels, gpu, variant, d, fit):
    from hmad.backends.vulkan.push import ResidualNormPush
    from hmad.backends.vulkan.recorder import CommandRecorder
    from hmad.backends.vulkan.shapes import residual_block

    rng = np.random.default_rng([zlib.crc32(variant.encode()), rng_seed()])
    t, eps = 3, 1e-6
    x, a = (rng.standard_normal((t, d)).astype(np.float32) * 3 for _ in range(2))
    wa, wh = (rng.uniform(0.5, 2, d).astype(np.float32) for _ in range(2))
    bx, ba, bwa, bwh = gpu.put(x), gpu.put(a), gpu.put(wa), gpu.put(wh)
    bxo, bh = gpu.poison(gpu.alloc(t * d * 4)), gpu.poison(gpu.alloc(t * d * 4))
    bq, bd = gpu.poison(gpu.alloc(3 * t * d)), gpu.poison(gpu.alloc(t * d // 32 * 8))
    quantized = variant.endswith(("_q8", "_x3"))
    binds = [bx, ba, bwa, bxo] + ([bwh, bh] if "next" in variant else []) + ([bq, bd] if quantized else [])
    rec = CommandRecorder(dev).begin()
    rec.dispatch(kernels(variant, residual_block(d) if fit else None), binds, ResidualNormPush(d, t, eps), t)
    rec.end()
    rec.submit()
    rec.close()
    x_ref = x + _rms(a, wa, eps)
    np.testing.assert_allclose(gpu.get(bxo, shape=(t, d)), x_ref, rtol=2e-5, atol=2e-5 * np.abs(x_ref).max())
    if "next" in variant:
        h_ref = _rms(x_ref, wh, eps)
        h = gpu.get(bh, shape=(t, d))
        np.testing.assert_allclose(h, h_ref, rtol=2e-5, atol=2e-5 * np.abs(h_ref).max())
    if "q8" in variant:
        q_ref, d_ref, _ = q8_reference(h)
        q = gpu.get_xq(bq, (t, d)).astype(np.int32)
        assert np.abs(q - q_ref).max() <= 1 and (q != q_ref).mean() <= 1e-3
        np.testing.assert_allclose(gpu.get(bd, np.float32, (t, d // 32, 2))[..., 0], d_ref, rtol=1e-6)
    if variant.endswith("_x3"):  # the planes of h as the GPU wrote it
        assert_x3_planes(gpu.get_xq(bq, (t, 3, d)), gpu.get(bd, np.float32, (t, d // 32, 2)), h)


@pytest.mark.parametrize(
    "variant", ["residual_norm_next_xh", "residual_norm_next_q8_xh", "residual_norm_next_x3_xh"]
)
@pytest.mark.parametrize("d", [640, 5376])
def test_residual_norm_xh_is_row_scale(dev, kernels, gpu, variant, d):
    """The _xh variants also write h's row scales and float16 copy for the cooperative-matrix GEMM: bit for
    bit what row_scale.comp makes of the h they wrote (a row within float16's range: scale 1; rows past it
    through big norm weights: a power of two; a NaN row: NaN), and h (with its q8 form) bit for bit as the
    variant without _xh writes it. Outputs poisoned first."""
    from hmad.backends.vulkan.kernels_coopmat import record_row_scale
    from hmad.backends.vulkan.push import ResidualNormPush
    from hmad.backends.vulkan.recorder import CommandRecorder
    from hmad.backends.vulkan.shapes import residual_block

    rng = np.random.default_rng([zlib.crc32(variant.encode()), d, rng_seed()])
    t, eps = 4, 1e-6
    x, a = (rng.standard_normal((t, d)).astype(np.float32) * 3 for _ in range(2))
    x[3, 5] = np.nan
    wa, wh = (rng.uniform(0.5, 2, d).astype(np.float32) for _ in range(2))
    wh[rng.choice(d, 3, replace=False)] = [3e4, -2e5, 7e6]  # every row past 2^14: scales 2^k > 1
    wh0 = wh.copy()  # ... and without those: every scale 1
    wh0[np.abs(wh0) > 2] = 1.0
    plain = variant.removesuffix("_xh")
    q8 = variant != "residual_norm_next_xh"
    outs = {}
    for name, w_next in ((variant, wh), (plain, wh), (variant, wh0)):
        bxo, bh = gpu.poison(gpu.alloc(t * d * 4)), gpu.poison(gpu.alloc(t * d * 4))
        bq, bd = gpu.poison(gpu.alloc(3 * t * d)), gpu.poison(gpu.alloc(t * d // 32 * 8))
        bs, bxh = gpu.poison(gpu.alloc(4 * t)), gpu.poison(gpu.alloc(2 * t * d))
        rs, rxh = gpu.poison(gpu.alloc(4 * t)), gpu.poison(gpu.alloc(2 * t * d))  # row_scale's, from h
        binds = [gpu.put(x), gpu.put(a), gpu.put(wa), bxo, gpu.put(w_next), bh] + ([bq, bd] if q8 else [])
        binds += [bs, bxh] if name.endswith("_xh") else []
        rec = CommandRecorder(dev).begin()
        rec.dispatch(kernels(name, residual_block(d)), binds, ResidualNormPush(d, t, eps), t)
        record_row_scale(rec, kernels("row_scale"), bh, rs, rxh, d, t)
        rec.end()
        rec.submit()
        rec.close()
        got = [gpu.get(b, np.uint32) for b in (bxo, bh) + ((bq, bd) if q8 else ())]
        outs[name, w_next is wh] = got, [gpu.get(b, np.uint32) for b in (bs, bxh, rs, rxh)]
    for w_big in (True, False):  # the same values; a NaN's bits may differ (NVIDIA's 0x7FFFFFFF, 0x7FC00000)
        _, (s, xh, want_s, want_xh) = outs[variant, w_big]
        scales = s.view(np.float32)
        np.testing.assert_array_equal(scales, want_s.view(np.float32))
        np.testing.assert_array_equal(xh.view(np.float16), want_xh.view(np.float16))
        assert np.isnan(scales[3]) and not np.isnan(scales[:3]).any()
        assert (scales[:3] > 1).all() if w_big else (scales[:3] == 1).all()
    for got, want in zip(outs[variant, True][0], outs[plain, True][0], strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("variant", ["residual_norm", "residual_norm_next_x3", "residual_norm_next_xh"])
@pytest.mark.parametrize("splits", [2, 5])
def test_residual_norm_adds_split_sums(dev, kernels, gpu, variant, splits):
    """``a`` as a GEMM's K-split partial sums (push splits): every output bit for bit as split_reduce.comp
    then the same variant on the sum (the composition it replaces); and within float32 rounding of float64
    on the sum. Outputs poisoned first."""
    from hmad.backends.vulkan.push import ResidualNormPush
    from hmad.backends.vulkan.recorder import CommandRecorder
    from hmad.backends.vulkan.shapes import residual_block
    from hmad.backends.vulkan.splitk import record_split_sums

    rng = np.random.default_rng([zlib.crc32(variant.encode()), splits, rng_seed()])
    t, d, eps = 5, 1152, 1e-6
    x = rng.standard_normal((t, d)).astype(np.float32) * 3
    parts = rng.standard_normal((splits, t, d)).astype(np.float32)
    wa, wh = (rng.uniform(0.5, 2, d).astype(np.float32) for _ in range(2))
    ins = [gpu.put(x), gpu.put(parts), gpu.put(wa)]
    outs = {}
    for fused in (True, False):
        got = [gpu.poison(gpu.alloc(t * d * 4)) for _ in range(2)]  # x', h
        if variant.endswith("_x3"):
            got += [gpu.poison(gpu.alloc(3 * t * d)), gpu.poison(gpu.alloc(t * d // 32 * 8))]
        if variant.endswith("_xh"):
            got += [gpu.poison(gpu.alloc(4 * t)), gpu.poison(gpu.alloc(2 * t * d))]
        summed = gpu.poison(gpu.alloc(t * d * 4))
        rec = CommandRecorder(dev).begin()
        if not fused:
            assert record_split_sums(rec, kernels("split_reduce"), ins[1], summed, d, t, splits, d, 0) == 1
        binds = [ins[0], ins[1] if fused else summed, ins[2], got[0]]
        binds += [gpu.put(wh), *got[1:]] if "next" in variant else []
        push = ResidualNormPush(d, t, eps, splits if fused else 1)
        rec.dispatch(kernels(variant, residual_block(d)), binds, push, t)
        rec.end()
        rec.submit()
        rec.close()
        outs[fused] = [gpu.get(b, np.uint32) for b in (got if "next" in variant else got[:1])]
    for one, other in zip(outs[True], outs[False], strict=True):
        np.testing.assert_array_equal(one, other)
    x_ref = x + _rms(parts.astype(np.float64).sum(0), wa, eps)
    xo = outs[True][0].view(np.float32).reshape(t, d)
    np.testing.assert_allclose(xo, x_ref, rtol=2e-5, atol=2e-5 * np.abs(x_ref).max())


def test_split_sums_left_only_for_a_whole_result(dev, kernels, gpu):
    """record_split_sums hands the partial sums to ``keep`` (recording nothing) only where they are the whole
    of y; a column slice of a wider y (row0, y_stride) is added into y by split_reduce, bit for bit as
    float32 adds them in split order."""
    from hmad.backends.vulkan.recorder import CommandRecorder
    from hmad.backends.vulkan.splitk import record_split_sums

    rng = np.random.default_rng(rng_seed())
    t, rows, splits = 3, 40, 3
    parts = rng.standard_normal((splits, t, rows)).astype(np.float32)
    kept = []
    rec = CommandRecorder(dev).begin()
    bp, y = gpu.put(parts), gpu.poison(gpu.alloc(t * 2 * rows * 4))
    keep = lambda part, n: kept.append((part, n))  # noqa: E731
    whole = record_split_sums(rec, kernels("split_reduce"), bp, y, rows, t, splits, rows, 0, keep)
    sliced = (rows, t, splits, 2 * rows, rows)  # columns rows..2 rows of a (t, 2 rows) y
    rec_n = record_split_sums(rec, kernels("split_reduce"), bp, y, *sliced, keep)
    rec.end()
    rec.submit()
    rec.close()
    assert (whole, rec_n, kept) == (0, 1, [(bp, splits)])
    want = (np.float32(0) + parts[0]) + parts[1] + parts[2]
    np.testing.assert_array_equal(gpu.get(y, shape=(t, 2 * rows))[:, rows:], want)


def rng_seed() -> int:
    return np.random.SeedSequence().entropy % (1 << 32)


def test_norm_rope_matches_cpu_reference(dev, kernels, gpu):
    from hmad.backends.cpu import CpuBackend
    from hmad.backends.vulkan.push import NormRopePush
    from hmad.backends.vulkan.recorder import CommandRecorder

    rng = np.random.default_rng()
    t, h, dh, eps = 5, 4, 256, 1e-6
    x = rng.standard_normal((t, h, dh)).astype(np.float32) * 4
    w = rng.uniform(0.5, 2, dh).astype(np.float32)
    pos = np.array([0, 17, 1000, 4095, rng.integers(0, 30000)], np.uint32)
    meta = np.concatenate([np.zeros(3, np.uint32), pos])
    by = gpu.poison(gpu.alloc(t * h * dh * 4))
    rec = CommandRecorder(dev).begin()
    push = NormRopePush(t, h, dh, h * dh, h * dh, 3, 1e6, 8.0, eps)
    rec.dispatch(kernels("norm_rope_f32"), [gpu.put(x), gpu.put(w), gpu.put(meta), by], push, t * h)
    rec.end()
    rec.submit()
    rec.close()
    cpu = CpuBackend(numerics="f32")
    ref = cpu.rope(_rms(x, w, eps).astype(np.float32), pos.astype(np.int64), 1e6, 8.0)
    got = gpu.get(by, shape=(t, h, dh))
    atol = 4e-5 * (1 + pos.astype(np.float32) / 64)[:, None, None] * np.abs(ref).max()
    assert np.all(np.abs(got - ref) <= atol + 1e-5 * np.abs(ref)), np.abs(got - ref).max()


@pytest.mark.parametrize("dh", [128, 256])
@pytest.mark.parametrize("pool", ["f32", "f16"])
def test_norm_rope_kv_matches_reference(dev, kernels, gpu, pool, dh):
    """norm_rope_kv.comp: q's heads normed and rotated as norm_rope.comp (the same tolerance against the
    CPU reference), k's likewise and written to each row's cache slot in the pool's type, v's copied there;
    a padding row (slot 0xFFFFFFFF) writes nothing, and no other slot changes (the pools poisoned first).
    Bit for bit what norm_rope.comp (+ kv_write's cast) gives: the same code through norm_rope.glsl. Heads of
    128 values (27B) and 256 (the smaller Gemma 3 models: two values an invocation)."""
    from hmad.backends.cpu import CpuBackend
    from hmad.backends.vulkan.push import NormRopeKvPush, NormRopePush
    from hmad.backends.vulkan.recorder import CommandRecorder

    rng = np.random.default_rng()
    t, h, hkv, eps, n_slots = 4, 4, 2, 1e-6, 16
    q, k, v = (rng.standard_normal((t, n, dh)).astype(np.float32) * 4 for n in (h, hkv, hkv))
    wq, wk = (rng.uniform(0.5, 2, dh).astype(np.float32) for _ in range(2))
    pos = np.array([0, 17, 1000, rng.integers(0, 30000)], np.uint32)
    slots = np.array([5, 0xFFFFFFFF, 11, 2], np.uint32)
    meta = np.concatenate([np.zeros(3, np.uint32), pos, slots])
    dtype = np.float16 if pool == "f16" else np.float32
    b_qo = gpu.poison(gpu.alloc(q.nbytes))
    b_kp, b_vp = (gpu.poison(gpu.alloc(n_slots * hkv * dh * np.dtype(dtype).itemsize)) for _ in range(2))
    poison = gpu.get(b_kp, np.uint8).reshape(n_slots, -1)
    binds = [gpu.put(a) for a in (q, k, v, wq, wk, meta)] + [b_qo, b_kp, b_vp]
    b_sep = [gpu.poison(gpu.alloc(x.nbytes)) for x in (q, k)]  # norm_rope.comp's q and k
    rec = CommandRecorder(dev).begin()
    push = NormRopeKvPush(t, h, hkv, dh, 3, 3 + t, 1e6, 8.0, eps)
    rec.dispatch(kernels(f"norm_rope_kv_{pool}"), binds, push, t * (h + 2 * hkv))
    for i, n in ((0, h), (1, hkv)):
        push = NormRopePush(t, n, dh, n * dh, n * dh, 3, 1e6, 8.0, eps)
        rec.dispatch(kernels("norm_rope_f32"), [binds[i], binds[3 + i], binds[5], b_sep[i]], push, t * n)
    rec.end()
    rec.submit()
    rec.close()
    live = slots != 0xFFFFFFFF
    got_q, got_k = gpu.get(b_qo, shape=q.shape), gpu.get(b_kp, dtype, (n_slots, hkv, dh))[slots[live]]
    cpu = CpuBackend(numerics="f32")
    atol = 4e-5 * (1 + pos.astype(np.float32) / 64)[:, None, None]
    rtol = 1e-3 if pool == "f16" else 1e-5  # k as float16: one rounding of 2^-11
    for got, x, w, rows, rt in ((got_q, q, wq, slice(None), 1e-5), (got_k, k, wk, live, rtol)):
        ref = cpu.rope(_rms(x, w, eps).astype(np.float32), pos.astype(np.int64), 1e6, 8.0)[rows]
        lim = atol[rows] * np.abs(ref).max() + rt * np.abs(ref)
        assert np.all(np.abs(got.astype(np.float32) - ref) <= lim), np.abs(got - ref).max()
    np.testing.assert_array_equal(got_q, gpu.get(b_sep[0], shape=q.shape))
    np.testing.assert_array_equal(got_k, gpu.get(b_sep[1], shape=k.shape)[live].astype(dtype))
    np.testing.assert_array_equal(
        gpu.get(b_vp, dtype, (n_slots, hkv, dh))[slots[live]], v[live].astype(dtype)
    )
    untouched = np.setdiff1d(np.arange(n_slots), slots[live])
    for b in (b_kp, b_vp):
        np.testing.assert_array_equal(gpu.get(b, np.uint8).reshape(n_slots, -1)[untouched], poison[untouched])


def test_norm_rope_kv_head_limit():
    """Heads past the shader's shared copy (MAX_HEAD_DIM) are refused with the limit named."""
    from hmad.backends.vulkan.push import NormRopeKvPush

    NormRopeKvPush(1, 1, 1, NormRopeKvPush.MAX_HEAD_DIM, 0, 0, 1e4, 1.0, 1e-6)
    with pytest.raises(ValueError, match="at most 512"):
        NormRopeKvPush(1, 1, 1, 2 * NormRopeKvPush.MAX_HEAD_DIM, 0, 0, 1e4, 1.0, 1e-6)


@pytest.mark.parametrize("splits", [(3, 2, 4), (1, 5, 1)])
def test_norm_rope_kv_adds_split_sums(dev, kernels, gpu, splits):
    """q, k and v as their GEMMs' K-split partial sums (push q_splits, k_splits, v_splits; 1: the values):
    qo and both pools bit for bit as split_reduce.comp then norm_rope_kv on the sums (the composition it
    replaces); a padding row writes nothing. Outputs poisoned first."""
    from hmad.backends.vulkan.push import NormRopeKvPush
    from hmad.backends.vulkan.recorder import CommandRecorder
    from hmad.backends.vulkan.splitk import record_split_sums

    rng = np.random.default_rng([sum(splits), rng_seed()])
    t, h, hkv, dh, eps, n_slots = 4, 4, 2, 128, 1e-6, 8
    parts = [
        rng.standard_normal((s, t, n * dh)).astype(np.float32) * 2
        for s, n in zip(splits, (h, hkv, hkv), strict=True)
    ]
    wq, wk = (rng.uniform(0.5, 2, dh).astype(np.float32) for _ in range(2))
    meta = np.concatenate([np.zeros(3, np.uint32), [0, 9, 300, 4000], [5, 0xFFFFFFFF, 1, 2]]).astype(
        np.uint32
    )
    ins, weights = [gpu.put(a) for a in parts], [gpu.put(a) for a in (wq, wk, meta)]
    outs = {}
    for fused in (True, False):
        got = [gpu.poison(gpu.alloc(t * h * dh * 4))]
        got += [gpu.poison(gpu.alloc(n_slots * hkv * dh * 4)) for _ in range(2)]
        rec = CommandRecorder(dev).begin()
        xs = ins
        if not fused:  # split_reduce first, into (T, n Dh) values
            xs = [gpu.poison(gpu.alloc(a[0].nbytes)) for a in parts]
            for a, b, x in zip(parts, ins, xs, strict=True):
                record_split_sums(
                    rec, kernels("split_reduce"), b, x, a.shape[2], t, a.shape[0], a.shape[2], 0
                )
        push = NormRopeKvPush(t, h, hkv, dh, 3, 3 + t, 1e6, 8.0, eps, splits=splits if fused else (1, 1, 1))
        rec.dispatch(kernels("norm_rope_kv_f32"), [*xs, *weights, *got], push, t * (h + 2 * hkv))
        rec.end()
        rec.submit()
        rec.close()
        outs[fused] = [gpu.get(b, np.uint32) for b in got]
    for one, other in zip(outs[True], outs[False], strict=True):
        np.testing.assert_array_equal(one, other)
    v_sum = (np.float32(0) + parts[2].sum(0, dtype=np.float64)).astype(np.float32).reshape(t, hkv, dh)
    v_pool = outs[True][2].view(np.float32).reshape(n_slots, hkv, dh)
    np.testing.assert_allclose(v_pool[[5, 1, 2]], v_sum[[0, 2, 3]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t", Q8_TYPES)
@pytest.mark.parametrize("tail", q8_tail_suffixes())
@pytest.mark.parametrize("x", ["q8x", "x3"])
def test_mul_mat_vec_q8_fused_tail(dev, kernels, gpu, t, tail, x):
    """The one-token GeGLU int8 mat-vec with the q8 tail (``_t1_qo``, matvec_qout.glsl: the last workgroup
    writing a block of y quantizes it): y is what the variant without the tail writes, bit for bit (the same
    code up to there), and y's q8 planes and block scales are bit for bit what quantize_q8.comp makes of y;
    the counters are back at 0 after. N's of 64 (the 27B's ffn, 21504 = 336 blocks; the 270M's, 2048) over
    partial workgroups of lanes."""
    from hmad.backends.vulkan.kernels_q8 import record_matvec_q8
    from hmad.backends.vulkan.recorder import CommandRecorder

    rng = np.random.default_rng()
    planes = 3 if x == "x3" else 1
    fused, plain = kernels(f"mul_mat_vec_{x}_{t}{tail}"), kernels(f"mul_mat_vec_{x}_{t}{tail[:-3]}")
    for k, n in ((256, 64), (768, 2048), (256, 21504)):
        raw, _ = _weights(t, n, k, rng)
        up = gpu.put(_weights(t, n, k, rng)[0])
        x_in = (rng.standard_normal((1, k)) * 3).astype(np.float32)
        bq, bd = _quantize(dev, kernels, gpu, x_in, planes)
        bw = gpu.put(raw)
        by_plain, by = (gpu.poison(gpu.alloc(4 * n)) for _ in range(2))
        yq, yd = gpu.poison(gpu.alloc(planes * n)), gpu.poison(gpu.alloc(n // 32 * 8))
        cnt = gpu.put(np.zeros(n // 32 + 4, np.uint32))
        rec = CommandRecorder(dev).begin()
        record_matvec_q8(rec, plain, bw, bq, bd, by_plain, k, n, 1, w_up=up)
        record_matvec_q8(rec, fused, bw, bq, bd, by, k, n, 1, w_up=up, tail=[yq, yd, cnt, by])
        rec.end()
        rec.submit()
        rec.close()
        y = gpu.get(by, shape=(1, n))
        np.testing.assert_array_equal(y, gpu.get(by_plain, shape=(1, n)), err_msg=f"{fused.name} N={n}")
        assert not gpu.get(cnt, np.uint32).any(), f"{fused.name}: counters not back at 0"
        bq2, bd2 = _quantize(dev, kernels, gpu, y, planes)
        for got, want in ((yq, bq2), (yd, bd2)):
            np.testing.assert_array_equal(gpu.get(got, np.uint8), gpu.get(want, np.uint8), err_msg=fused.name)


@pytest.mark.slow  # every one-lane layout of a type compiled: 20-40 s each on lavapipe's 2 cores
@pytest.mark.parametrize("t", Q8_TYPES)
def test_one_lane_layouts_write_the_same_bits(dev, kernels, gpu, t):
    """The one-lane layouts (``_l4``, ``_l8``, ``_l16`` where built: CPU implementations,
    kernels_q8.q8_matvec_layout) add each row's units in the same order whatever their rows an invocation
    and whatever the tokens a variant holds, so a weight's layout may follow its row count, and
    deterministic mode may run ``_t1`` for one token (ops_matmul.matvec_q8), without changing a bit: plain
    and GeGLU, eight tokens, five, and one on both the eight-token and the ``_t1`` variants."""
    rng = np.random.default_rng()
    k, n = 768, 45
    raw, _ = _weights(t, n, k, rng)
    raw_u, _ = _weights(t, n, k, rng)
    built = q8_matvec_suffixes(t)
    for ntok in (8, 5, 1):
        x = (rng.standard_normal((ntok, k)) * rng.uniform(0.1, 100, (ntok, 1))).astype(np.float32)
        bq, bd = _quantize(dev, kernels, gpu, x, planes=3)
        for geglu in ("", "_geglu"):
            names = [f"{geglu}{lay}{t1}" for lay in ("_l4", "_l8", "_l16") for t1 in ("", "_t1")]
            names = [v for v in names if v in built and (ntok == 1 or not v.endswith("_t1"))]
            ys = {
                v: _run_q8_matvec(
                    dev,
                    gpu,
                    kernels(f"mul_mat_vec_x3_{t}{v}"),
                    raw,
                    raw_u if geglu else None,
                    bq,
                    bd,
                    k,
                    n,
                    ntok,
                )
                for v in names
            }
            first = names[0]
            differ = [v for v in names if not np.array_equal(ys[v], ys[first])]
            assert not differ, f"{t} T={ntok}: {differ} differ from {first}"
