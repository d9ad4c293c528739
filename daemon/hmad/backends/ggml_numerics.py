"""llama.cpp's (ggml CPU) roundings, reproduced in numpy so the reference backend agrees with llama.cpp.

ggml does not compute in plain float32 everywhere; three of its roundings move Gemma 3's logits by ~0.1:
- matmul with a quantized weight first quantizes the activations to the weight's "vec_dot type":
  Q8_0 (32-wide blocks, f16 scale amax/127) for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, Q8_K (256-wide blocks,
  f32 scale from the signed absmax, -127/max) for the K-quants; the dot product sums those int8 values;
- GELU reads a table indexed by the float16 of its input and returns a float16 (GGML_GELU_FP16);
- RoPE angles come from repeated float32 multiplication, theta_i = p * theta_scale^i (rope cache init).
Each function is the float32 result of ggml's arithmetic, not a bit-exact copy of its SIMD kernels.
"""

from __future__ import annotations

import math

import numpy as np

from hmad.model.tensors import QType

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
    """ggml_table_gelu_f16: gelu_tanh of every float16 value, stored as float16."""
    x = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    c = np.float32(math.sqrt(2.0 / math.pi))
    with np.errstate(over="ignore", invalid="ignore"):
        return (0.5 * x * (1.0 + np.tanh(c * x * (1.0 + np.float32(0.044715) * x * x)))).astype(np.float16)


_GELU_F16: np.ndarray | None = None


def gelu(x: np.ndarray) -> np.ndarray:
    """ggml_vec_gelu_f32 with GGML_GELU_FP16: 0 below -10, identity above 10, else the f16 table."""
    global _GELU_F16
    if _GELU_F16 is None:
        _GELU_F16 = _gelu_table()
    y = _GELU_F16[x.astype(np.float16).view(np.uint16)].astype(np.float32)
    return np.where(x <= -10, np.float32(0), np.where(x >= 10, x, y))


def rope_angles(positions: np.ndarray, dh: int, base: float, scale: float) -> np.ndarray:
    """(T, Dh/2) float32 angles: theta = p, then theta *= base^(-2/Dh) per pair, times 1/scale."""
    theta_scale = np.float32(base) ** np.float32(-2.0 / dh)
    theta = np.empty((len(positions), dh // 2), np.float32)
    theta[:, 0] = np.asarray(positions, np.float32)
    for i in range(1, dh // 2):
        theta[:, i] = theta[:, i - 1] * theta_scale
    return theta * np.float32(1.0 / scale)
