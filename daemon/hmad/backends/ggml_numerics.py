"""llama.cpp's (ggml CPU) roundings, reproduced in numpy so the reference backend agrees with llama.cpp.

ggml does not compute in plain float32 everywhere, and Gemma 3 amplifies every difference: its post-norms
have large gains, and a difference of one float32 ulp before an activation quantization can move a value
across an int8 rounding boundary (one quantum, ~1e-2 relative), which the next layers carry to the logits.
So where ggml's arithmetic is cheap to reproduce, it is reproduced as exactly as numpy allows (checked
against tensors dumped from llama-cpp-python 0.3.36 / ggml 0.25.3 through llama.cpp's eval callback, fed
the same inputs: RMS norm and GELU are bit-exact, RoPE differs only where glibc's sinf/cosf are not
correctly rounded, softmax within ~1e-7):
- RMS norm (ops.cpp ggml_compute_forward_rms_norm_f32): the sum of float32 squares is accumulated in
  double (ggml_float), mean = (float)(sum / n), scale = 1.0f / sqrtf(mean + eps), y = x * scale, then the
  weight multiply (a separate GGML_OP_MUL, or fused as x * scale * w: the same roundings);
- matmul with a quantized weight first quantizes the activations to the weight's "vec_dot type":
  Q8_0 (32-wide blocks, f16 scale amax/127) for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, Q8_K (256-wide blocks, f32 scale
  from the signed absmax, -127/max) for the K-quants; the dot product then sums those int8 values;
- GELU reads a table indexed by the float16 of its input and returns a float16 (GGML_GELU_FP16), built by
  ggml_cpu_init from ggml_gelu_f32 (vec.h) with glibc tanhf and a compiler-contracted fma;
- RoPE angles are built by repeated float32 multiplication, theta_i = p * theta_scale^i
  (ops.cpp ggml_rope_cache_init), and the rotation is contracted to fmas (rotate_pairs);
- softmax sums in double and multiplies by the float32 reciprocal (vec.cpp ggml_vec_soft_max_f32);
  Q is scaled after RoPE, before QK^T (llama.cpp's gemma3 graph), not the scores.
What is not reproduced is the summation order inside ggml's SIMD dot products (vec_dot, repacked gemv/gemm,
llamafile sgemm: each has its own lane layout, and llama.cpp picks a different one per batch shape); that
leaves ~1e-7 relative noise per matmul, the same size as llama.cpp's own difference between batch shapes.
"""

from __future__ import annotations

import math

import numpy as np

from hmad.core.tensors import QType

_Q8_0_DOT = {QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0}
_Q8_K_DOT = {QType.Q2_K, QType.Q3_K, QType.Q4_K, QType.Q5_K, QType.Q6_K}


def round_activations(x: np.ndarray, weight_type: QType) -> np.ndarray:
    """x (T, K) as ggml's dot product sees it against a weight of ``weight_type``."""
    if weight_type in _Q8_0_DOT:
        return _q8_0_roundtrip(x)
    if weight_type in _Q8_K_DOT:
        return _q8_k_roundtrip(x)
    if weight_type == QType.F16:
        return x.astype(np.float16).astype(np.float32)
    return x


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """ggml_rms_norm followed by ggml_mul with the weight (ops.cpp ggml_compute_forward_rms_norm_f32)."""
    ss = np.square(x).sum(axis=-1, keepdims=True, dtype=np.float64)  # f32 squares, double accumulator
    mean = (ss / x.shape[-1]).astype(np.float32)
    scale = np.float32(1) / np.sqrt(mean + np.float32(eps))  # 1.0f / sqrtf(mean + eps), all float32
    return (x * scale) * w


def _fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 fma(a, b, c): the product of two float32 is exact in double, then one rounding (a double
    rounding through float64 differs from a true fma only in vanishingly rare halfway cases)."""
    return (a.astype(np.float64) * b + c).astype(np.float32)


def _q8_0_roundtrip(x: np.ndarray) -> np.ndarray:
    # block_q8_0: d = amax / 127 stored as f16; q = round(x * 127 / amax) (round half to even, AVX path)
    b = x.reshape(-1, 32)
    amax = np.abs(b).max(axis=1, keepdims=True)
    safe = np.where(amax > 0, amax, 1)
    q = np.round(b * (np.float32(127) / safe))
    d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    return (q * d).reshape(x.shape)


def _q8_k_roundtrip(x: np.ndarray) -> np.ndarray:
    # block_q8_K: iscale = -127 / max (max = the element of largest magnitude, signed); q = min(127,
    # nearest(iscale * x)); d = 1 / iscale as f32
    b = x.reshape(-1, 256)
    mx = np.take_along_axis(b, np.abs(b).argmax(axis=1)[:, None], axis=1)
    iscale = np.where(mx != 0, np.float32(-127) / np.where(mx != 0, mx, 1), 0).astype(np.float32)
    q = np.minimum(127, np.round(iscale * b))
    d = np.where(iscale != 0, np.float32(1) / np.where(iscale != 0, iscale, 1), 0).astype(np.float32)
    return (q * d).reshape(x.shape)


def _gelu_table() -> np.ndarray:
    """ggml_table_gelu_f16 (ggml-cpu.c ggml_cpu_init): f16(ggml_gelu_f32(x)) for every float16 x, where
    ggml_gelu_f32 = 0.5f*x*(1.0f + tanhf(SQRT_2_OVER_PI*x*(1.0f + GELU_COEF_A*x*x))) as compiled: the
    inner 1 + (a*x)*x is contracted to an fma, tanhf is glibc's (float64 tanh rounded to float32 agrees
    with it on every table entry). Identical to the table in libggml-cpu.so on all 65536 entries."""
    x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    c, a, half = np.float32(math.sqrt(2.0 / math.pi)), np.float32(0.044715), np.float32(0.5)
    with np.errstate(over="ignore", invalid="ignore"):
        inner = _fma(a * x, x, np.float64(1))
        t = np.tanh((c * x * inner).astype(np.float64)).astype(np.float32)
        return (half * x * (np.float32(1) + t)).astype(np.float16)


_GELU_F16: np.ndarray | None = None


def gelu(x: np.ndarray) -> np.ndarray:
    """ggml_vec_gelu_f32 with GGML_GELU_FP16: 0 below -10, identity above 10, else the f16 table."""
    global _GELU_F16
    if _GELU_F16 is None:
        _GELU_F16 = _gelu_table()
    y = _GELU_F16[x.astype(np.float16).view(np.uint16)].astype(np.float32)
    return np.where(x <= -10, np.float32(0), np.where(x >= 10, x, y))


def rope_angles(positions: np.ndarray, dh: int, base: float, scale: float) -> np.ndarray:
    """(T, Dh/2) float32 angles as ggml_rope_cache_init builds them: theta = p, then theta *= theta_scale
    per pair, theta_scale = powf(base, -2.0f/Dh); each angle times freq_scale = 1/scale (rope_yarn)."""
    theta_scale = np.float32(np.float64(np.float32(base)) ** np.float64(np.float32(-2.0 / dh)))
    theta = np.empty((len(positions), dh // 2), np.float32)
    theta[:, 0] = np.asarray(positions, np.float32)
    for i in range(1, dh // 2):
        theta[:, i] = theta[:, i - 1] * theta_scale
    return theta * np.float32(1.0 / scale)


_ROPE_TABLES: dict[tuple[int, float, float], tuple[np.ndarray, np.ndarray]] = {}


def rope_cos_sin(positions: np.ndarray, dh: int, base: float, scale: float) -> tuple[np.ndarray, np.ndarray]:
    """(T, Dh/2) float32 cos and sin of rope_angles, as ggml_rope_cache_init stores them.

    cos/sin: glibc cosf/sinf of the float32 angle; float64 cos/sin rounded to float32 is the same value
    except in rare cases (glibc's are not correctly rounded). An angle depends only on (position, pair),
    so the tables are built once per (Dh, base, scale), for positions 0..N-1, N doubling as needed."""
    pos = np.asarray(positions)
    need = int(pos.max()) + 1 if pos.size else 1
    key = (dh, float(base), float(scale))
    table = _ROPE_TABLES.get(key)
    if table is None or table[0].shape[0] < need:
        n = max(1024, 1 << (need - 1).bit_length())
        a64 = rope_angles(np.arange(n), dh, base, scale).astype(np.float64)
        table = _ROPE_TABLES[key] = (np.cos(a64).astype(np.float32), np.sin(a64).astype(np.float32))
    return table[0][pos], table[1][pos]


def rope_neox(x: np.ndarray, positions: np.ndarray, base: float, scale: float) -> np.ndarray:
    """x (T, H, Dh) at ``positions`` rotated in NEOX layout (pairs i, i + Dh/2), as ggml's rope does it:
    x0*cos - x1*sin, x0*sin + x1*cos, compiled to fma(x0, cos, -(x1*sin)) and fma(x0, sin, x1*cos)
    (ops.cpp rotate_pairs)."""
    cos, sin = rope_cos_sin(positions, x.shape[-1], base, scale)
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    x0, x1 = x[..., :half], x[..., half:]
    return np.concatenate([_fma(x0, cos, -(x1 * sin)), _fma(x0, sin, x1 * cos)], axis=-1)


def softmax_rows(s: np.ndarray) -> np.ndarray:
    """Row softmax as ops.cpp ggml_compute_forward_soft_max_f32 does it: exp(s - max), the sum in double,
    then y *= (float)(1.0 / sum) (ggml_vec_scale_f32).

    Masked entries are -inf. Not bit-exact: ggml's exp is ggml_v_expf (a SIMD polynomial within ~1 ulp of
    expf), for which numpy's float32 exp stands in, and vec.cpp ggml_vec_soft_max_f32 reduces each 16-wide
    chunk in float32 before adding it to the double sum."""
    s = s - s.max(axis=-1, keepdims=True)
    p = np.exp(s)
    inv = (1.0 / p.sum(axis=-1, keepdims=True, dtype=np.float64)).astype(np.float32)
    return p * inv
