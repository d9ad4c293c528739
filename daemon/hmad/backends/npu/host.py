"""Host-side numerics of the NPU ops: bf16 conversion, int8 quantization, padding to the kernels' tiles.

int8 GEMM (gemm_int8): symmetric int8 with one scale per weight row and per activation row (token), taken
separately over each K tile of the kernel (256 wide): the weight's once at load, the activations' per call.
The NPU sums int8 products of one K tile in int32 (exact: 256 * 127 * 127 < 2**31); the host dequantizes
each tile's sums with its two scales and adds the tiles in float32::

    y[t, n] = sum over tiles b of  c_b[t, n] * scale_x[t, b] * scale_w[n, b]

A scale per K tile rather than per whole row costs nothing on the NPU (the host adds the K tiles anyway)
and matters: Gemma's FFN-down inputs are heavy-tailed, and with one scale per token the 270M model's
ffn_down output was 5.6% off the CPU result (over the first-use tolerance); 256-wide blocks are also what
llama.cpp's Q8_K activations use.
bf16 GEMM (gemm_bf16): inputs rounded to bf16 (nearest even), products summed in f32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

INT8_MAX = 127


def f32_to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bit patterns (uint16), rounding to nearest even; NaN stays NaN."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((bits.astype(np.uint64) + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def bf16_to_f32(u: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> float32 (exact)."""
    return (np.asarray(u, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per row: (q int8 like x, scale float32 (rows,)) with x ~= q * scale[:, None].

    An all-zero row gets scale 1 (q = 0)."""
    x = np.asarray(x, dtype=np.float32)
    amax = np.max(np.abs(x), axis=-1)
    scale = np.where(amax > 0, amax / np.float32(INT8_MAX), np.float32(1)).astype(np.float32)
    q = np.clip(np.rint(x / scale[:, None]), -INT8_MAX, INT8_MAX).astype(np.int8)
    return q, scale


def quantize_blocks(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per row and per ``block`` columns: x (R, K) with K a multiple of ``block`` ->
    (q int8 (R, K), scale float32 (R, K / block)), x ~= q * scale repeated over each block."""
    r, k = x.shape
    q, scale = quantize_rows(np.asarray(x, np.float32).reshape(r * (k // block), block))
    return q.reshape(r, k), scale.reshape(r, k // block)


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def pad2(x: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """x (r, c) zero-padded to (rows, cols) (a copy; x itself when it already has that shape)."""
    if x.shape == (rows, cols):
        return x
    out = np.zeros((rows, cols), dtype=x.dtype)
    out[: x.shape[0], : x.shape[1]] = x
    return out


def spans(n: int, block: int) -> list[tuple[int, int]]:
    """[(0, block), (block, 2 * block), ...] covering 0..n (n a multiple of block)."""
    return [(s, s + block) for s in range(0, n, block)]


@dataclass
class GemmWeight:
    """A weight (N, K) made ready for an NPU gemm once, at load: padded to the kernel's tiles.

    ``data``: int8 (gemm_int8, with ``scale`` per row and K tile: (N_pad, K_pad / tile_k)) or bf16 bits
    (gemm_bf16), shape (N_pad, K_pad).
    """

    kernel: str
    data: np.ndarray
    scale: np.ndarray | None
    n: int
    k: int

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes) + (0 if self.scale is None else int(self.scale.nbytes))


def prepare_weight(kernel: str, w: np.ndarray, tile_n: int, tile_k: int) -> GemmWeight:
    """w float32 (N, K) -> GemmWeight for ``kernel`` (gemm_int8 or gemm_bf16), padded to (tile_n, tile_k)."""
    n, k = w.shape
    rows, cols = round_up(n, tile_n), round_up(k, tile_k)
    if kernel == "gemm_int8":
        q, scale = quantize_blocks(pad2(np.asarray(w, np.float32), rows, cols), tile_k)
        return GemmWeight(kernel, q, scale, n, k)
    return GemmWeight(kernel, pad2(f32_to_bf16(w), rows, cols), None, n, k)
