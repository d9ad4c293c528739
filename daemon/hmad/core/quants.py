"""GGML block formats: vectorized numpy decoders, reference quantizers and random valid blocks.

Every decoder reproduces ggml's reference ``dequantize_row_*`` (and ``gguf.quants``) bit for bit: the same
float32 operations in the same order. A quantized row of ``K`` weights is ``K // block_elems`` blocks laid end
to end; each block's byte layout is written beside its decoder. Multi-byte fields are little-endian.

Decoders work on ``(n_blocks, block_bytes)`` uint8 and write ``(n_blocks, block_elems)`` float32 in place;
:func:`dequantize` feeds them bounded row chunks so temporaries stay a few MiB whatever the tensor size.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from hmad.core.qtypes import PLAIN_TYPES, QType, block_layout

#: Weights decoded per chunk: bounds the temporaries of a decoder to a few MiB.
_CHUNK_WEIGHTS = 1 << 18

_SHIFT_NIBBLES = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
_SHIFT_CRUMBS = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
_SHIFT_BITS = np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The f16 field at byte ``offset`` of every block, as float32 ``(n, 1)``."""
    return blocks[:, offset : offset + 2].view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``(n, B)`` bytes → ``(n, 2B)``: all low nibbles, then all high nibbles (the Q4_0/Q5_0 order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


# Q8_0: 32 weights in 34 bytes: d f16, qs int8[32].   w = d * q
def _decode_q8_0(b: np.ndarray, out: np.ndarray) -> None:
    np.multiply(b[:, 2:].view(np.int8), _f16(b, 0), out=out)


# Q4_0: 32 weights in 18 bytes: d f16, qs 16 (weight j in the low nibble of byte j, weight 16+j in the
#       high nibble).   w = d * (q - 8)
def _decode_q4_0(b: np.ndarray, out: np.ndarray) -> None:
    np.multiply(_nibbles(b[:, 2:]).view(np.int8) - 8, _f16(b, 0), out=out)


# Q4_1: 32 weights in 20 bytes: d f16, m f16, qs 16 (nibbles as Q4_0).   w = d * q + m
def _decode_q4_1(b: np.ndarray, out: np.ndarray) -> None:
    np.multiply(_nibbles(b[:, 4:]), _f16(b, 0), out=out)
    out += _f16(b, 2)


def _q5_values(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """5-bit values ``(n, 32)`` from qh (bit j of the little-endian u32 = bit 4 of weight j) and nibbles."""
    return _nibbles(qs) | (np.unpackbits(qh, axis=1, bitorder="little") << 4)


# Q5_0: 32 weights in 22 bytes: d f16, qh 4 (u32, bit j = 5th bit of weight j), qs 16 (nibbles as Q4_0).
#       w = d * (q - 16)
def _decode_q5_0(b: np.ndarray, out: np.ndarray) -> None:
    np.multiply(_q5_values(b[:, 2:6], b[:, 6:]).view(np.int8) - 16, _f16(b, 0), out=out)


# Q5_1: 32 weights in 24 bytes: d f16, m f16, qh 4, qs 16 (as Q5_0).   w = d * q + m
def _decode_q5_1(b: np.ndarray, out: np.ndarray) -> None:
    np.multiply(_q5_values(b[:, 4:8], b[:, 8:]), _f16(b, 0), out=out)
    out += _f16(b, 2)


# Q2_K: 256 weights in 84 bytes: scales 16 (per 16 weights: low nibble scale, high nibble min), qs 64
#       (2-bit: two halves of 128 weights, each 32 bytes read at shifts 0,2,4,6), d f16, dmin f16.
#       w = d * sc * q - dmin * m
def _decode_q2_k(b: np.ndarray, out: np.ndarray) -> None:
    n = len(b)
    scales = b[:, :16]
    dl = _f16(b, 80) * (scales & 0x0F)  # (n, 16)
    ml = _f16(b, 82) * (scales >> 4)
    q = ((b[:, 16:80].reshape(n, 2, 1, 32) >> _SHIFT_CRUMBS) & 3).reshape(n, 16, 16)
    o = out.reshape(n, 16, 16)
    np.multiply(q, dl[:, :, None], out=o)
    o -= ml[:, :, None]


def _q3_k_scales(s: np.ndarray) -> np.ndarray:
    """Q3_K's 16 signed 6-bit scales ``(n, 16)`` int8: low 4 bits in bytes 0-7, high 2 bits in bytes 8-11."""
    n = len(s)
    lo = (s[:, :8].reshape(n, 1, 8) >> _SHIFT_NIBBLES.reshape(1, 2, 1)).reshape(n, 16) & 0x0F
    hi = (s[:, 8:].reshape(n, 1, 4) >> _SHIFT_CRUMBS.reshape(1, 4, 1)).reshape(n, 16) & 3
    return (lo | (hi << 4)).view(np.int8) - 32


# Q3_K: 256 weights in 110 bytes: hmask 32 (bit i of byte l: 3rd bit of weight 32i+l), qs 64 (low 2 bits,
#       laid out as Q2_K), scales 12 (16 6-bit, offset 32), d f16.
#       w = d * (sc - 32) * (q - (4 if the hmask bit is clear else 0))
def _decode_q3_k(b: np.ndarray, out: np.ndarray) -> None:
    n = len(b)
    dl = _f16(b, 108) * _q3_k_scales(b[:, 96:108])  # (n, 16)
    low = ((b[:, 32:96].reshape(n, 2, 1, 32) >> _SHIFT_CRUMBS) & 3).reshape(n, 16, 16).view(np.int8)
    high = ((b[:, :32].reshape(n, 1, 1, 32) >> _SHIFT_BITS) & 1).reshape(n, 16, 16)
    q = low - ((high ^ 1) << 2).view(np.int8)
    np.multiply(q, dl[:, :, None], out=out.reshape(n, 16, 16))


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 8 scales and 8 mins, 6 bits each, ``(n, 8)`` uint8 apiece, unpacked from 12 bytes:

    bytes 0-3: scales 0-3 (low 6 bits), bits 6-7 = high bits of scales 4-7
    bytes 4-7: mins 0-3 (low 6 bits),   bits 6-7 = high bits of mins 4-7
    bytes 8-11: low nibble = low 4 bits of scales 4-7, high nibble = low 4 bits of mins 4-7
    """
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc, mn


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K qs 128 → ``(n, 8, 32)``: chunk c of 32 bytes holds sub-block 2c (low) and 2c+1 (high)."""
    n = len(qs)
    return ((qs.reshape(n, 4, 1, 32) >> _SHIFT_NIBBLES) & 0x0F).reshape(n, 8, 32)


def _apply_k_scales(b: np.ndarray, q: np.ndarray, out: np.ndarray) -> None:
    """w = d * sc[j] * q - dmin * m[j] over 8 sub-blocks of 32 (``q`` is ``(n, 8, 32)``)."""
    sc, mn = _k_scales(b[:, 4:16])
    o = out.reshape(q.shape)
    np.multiply(q, (_f16(b, 0) * sc)[:, :, None], out=o)
    o -= (_f16(b, 2) * mn)[:, :, None]


# Q4_K: 256 weights in 144 bytes: d f16, dmin f16, scales 12 (6-bit packed, see _k_scales), qs 128
#       (4-bit, see _k_low_nibbles). 8 sub-blocks of 32.   w = d * sc[j] * q - dmin * m[j]
def _decode_q4_k(b: np.ndarray, out: np.ndarray) -> None:
    _apply_k_scales(b, _k_low_nibbles(b[:, 16:]), out)


# Q5_K: 256 weights in 176 bytes: d f16, dmin f16, scales 12, qh 32 (bit j of byte l: 5th bit of weight l of
#       sub-block j), qs 128 (as Q4_K).   w = d * sc[j] * q - dmin * m[j]
def _decode_q5_k(b: np.ndarray, out: np.ndarray) -> None:
    n = len(b)
    high = ((b[:, 16:48].reshape(n, 1, 1, 32) >> _SHIFT_BITS) & 1).reshape(n, 8, 32)
    _apply_k_scales(b, _k_low_nibbles(b[:, 48:]) | (high << 4), out)


# Q6_K: 256 weights in 210 bytes: ql 128 (low 4 bits), qh 64 (high 2 bits), scales 16 int8, d f16.
#       Two halves of 128 weights; half h uses ql[64h:64h+64] (low nibbles: weights 0-63, high: 64-127)
#       and qh[32h:32h+32] (shift 2s: weights 32s..32s+31). 16 sub-blocks of 16.   w = d * sc[j] * (q - 32)
def _decode_q6_k(b: np.ndarray, out: np.ndarray) -> None:
    n = len(b)
    low = ((b[:, :128].reshape(n, 2, 1, 64) >> _SHIFT_NIBBLES) & 0x0F).reshape(n, 8, 32)
    high = ((b[:, 128:192].reshape(n, 2, 1, 32) >> _SHIFT_CRUMBS) & 3).reshape(n, 8, 32)
    q = ((low | (high << 4)).view(np.int8) - 32).reshape(n, 16, 16)
    d = _f16(b, 208) * b[:, 192:208].view(np.int8)  # (n, 16)
    np.multiply(q, d[:, :, None], out=out.reshape(n, 16, 16))


_DECODERS: dict[QType, Callable[[np.ndarray, np.ndarray], None]] = {
    QType.Q8_0: _decode_q8_0,
    QType.Q4_0: _decode_q4_0,
    QType.Q4_1: _decode_q4_1,
    QType.Q5_0: _decode_q5_0,
    QType.Q5_1: _decode_q5_1,
    QType.Q2_K: _decode_q2_k,
    QType.Q3_K: _decode_q3_k,
    QType.Q4_K: _decode_q4_k,
    QType.Q5_K: _decode_q5_k,
    QType.Q6_K: _decode_q6_k,
}

#: Every type :func:`dequantize` reads; the GGUF loader rejects tensors of any other type.
SUPPORTED_TYPES = frozenset(PLAIN_TYPES) | frozenset(_DECODERS)

#: Byte offsets of each block's f16 scale fields (d, dmin or m), for :func:`random_blocks`.
_F16_FIELDS = {
    QType.Q8_0: (0,),
    QType.Q4_0: (0,),
    QType.Q4_1: (0, 2),
    QType.Q5_0: (0,),
    QType.Q5_1: (0, 2),
    QType.Q2_K: (80, 82),
    QType.Q3_K: (108,),
    QType.Q4_K: (0, 2),
    QType.Q5_K: (0, 2),
    QType.Q6_K: (208,),
}


def row_bytes(qtype: QType, n_cols: int) -> int:
    """Bytes of one row of ``n_cols`` weights; ValueError when ``n_cols`` is not whole blocks."""
    block_elems, block_bytes = block_layout(qtype)
    if n_cols % block_elems:
        raise ValueError(
            f"row length {n_cols} is not a multiple of the {qtype.name} block size {block_elems}"
        )
    return n_cols // block_elems * block_bytes


def dequantize(data: np.ndarray, qtype: QType, shape: tuple[int, ...]) -> np.ndarray:
    """Decode a tensor as stored in its file into a new float32 array of ``shape``.

    ``data`` is uint8 ``(*shape[:-1], row_bytes)`` for quantized types (any layout with that many bytes is
    accepted), or float32 / float16 / uint16 (bf16 bit patterns) for plain types. Raises ValueError when
    ``data`` does not hold ``shape`` and NotImplementedError for a type without a decoder.
    """
    qtype = QType(qtype)
    shape = tuple(int(s) for s in shape)
    if qtype in PLAIN_TYPES:
        return _dequantize_plain(data, qtype, shape)
    decode = _DECODERS.get(qtype)
    if decode is None:
        raise NotImplementedError(f"no decoder for {qtype.name}")
    n_cols = shape[-1]
    n_rows = int(np.prod(shape[:-1], dtype=np.int64))
    rb = row_bytes(qtype, n_cols)
    if data.dtype != np.uint8 or data.size != n_rows * rb:
        raise ValueError(
            f"{qtype.name} {shape} needs {n_rows * rb} uint8 bytes, got {data.dtype} {data.shape}"
        )
    rows = data.reshape(n_rows, rb)  # (rows, row_bytes); a view unless data was strided
    out = np.empty((n_rows, n_cols), dtype=np.float32)
    block_elems, block_bytes = block_layout(qtype)
    step = max(1, _CHUNK_WEIGHTS // n_cols)
    with np.errstate(all="ignore"):  # garbage scales may hold inf/nan, exactly as ggml would read them
        for r in range(0, n_rows, step):
            decode(rows[r : r + step].reshape(-1, block_bytes), out[r : r + step].reshape(-1, block_elems))
    return out.reshape(shape)


def _dequantize_plain(data: np.ndarray, qtype: QType, shape: tuple[int, ...]) -> np.ndarray:
    stored = np.dtype(PLAIN_TYPES[qtype])
    if data.dtype == np.uint8:  # raw file bytes
        data = np.ascontiguousarray(data).view(stored)
    if data.dtype != stored or data.size != int(np.prod(shape, dtype=np.int64)):
        raise ValueError(f"{qtype.name} {shape} needs {stored} data, got {data.dtype} {data.shape}")
    if qtype == QType.BF16:  # bf16 is the top half of an f32
        return (data.astype(np.uint32) << 16).view(np.float32).reshape(shape)
    return data.astype(np.float32).reshape(shape)


# --- quantizers: ggml's quantize_row_*_ref, bit for bit ---------------------------------------------------


def _round_half_away(x: np.ndarray) -> np.ndarray:
    """C ``roundf``: halves round away from zero (``np.round`` rounds them to even)."""
    a = np.abs(x)
    whole = np.floor(a)
    return np.sign(x) * (whole + np.floor(2 * (a - whole)))  # a - whole and 2*(...) are exact in float32


def _quantize_rows(
    x: np.ndarray, qtype: QType, encode: Callable[[np.ndarray, np.ndarray], None]
) -> np.ndarray:
    """float32 ``(..., K)`` → uint8 ``(..., K // block_elems * block_bytes)``, encoding bounded row chunks."""
    x = np.asarray(x, dtype=np.float32)
    block_elems, block_bytes = block_layout(qtype)
    rb = row_bytes(qtype, x.shape[-1])
    rows = x.reshape(-1, x.shape[-1])
    out = np.empty((len(rows), rb), dtype=np.uint8)
    step = max(1, _CHUNK_WEIGHTS // max(1, x.shape[-1]))
    with np.errstate(all="ignore"):
        for r in range(0, len(rows), step):
            encode(rows[r : r + step].reshape(-1, block_elems), out[r : r + step].reshape(-1, block_bytes))
    return out.reshape(*x.shape[:-1], rb)


def _inverse(d: np.ndarray) -> np.ndarray:
    """``d ? 1.0f / d : 0.0f`` elementwise, float32."""
    return np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)


def _signed_absmax(x: np.ndarray) -> np.ndarray:
    """The value of largest magnitude per block (first one on ties, as ggml's loop), ``(n, 1)``."""
    return np.take_along_axis(x, np.abs(x).argmax(axis=1, keepdims=True), axis=1)


def _encode_q8_0(x: np.ndarray, out: np.ndarray) -> None:
    d = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)
    out[:, :2] = d.astype(np.float16).view(np.uint8)
    out[:, 2:] = _round_half_away(x * _inverse(d)).astype(np.int8).view(np.uint8)


def _encode_q4_0(x: np.ndarray, out: np.ndarray) -> None:
    d = _signed_absmax(x) / np.float32(-8)
    q = np.minimum(np.trunc(x * _inverse(d) + np.float32(8.5)), 15).astype(np.uint8)  # (n, 32) in 0..15
    out[:, :2] = d.astype(np.float16).view(np.uint8)
    out[:, 2:] = q[:, :16] | (q[:, 16:] << 4)


def _encode_q5_0(x: np.ndarray, out: np.ndarray) -> None:
    d = _signed_absmax(x) / np.float32(-16)
    q = np.minimum(np.trunc(x * _inverse(d) + np.float32(16.5)), 31).astype(np.uint8)  # (n, 32) in 0..31
    out[:, :2] = d.astype(np.float16).view(np.uint8)
    out[:, 2:6] = np.packbits(q >> 4, axis=1, bitorder="little")
    out[:, 6:] = (q[:, :16] & 0x0F) | (q[:, 16:] << 4)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """float32 ``(..., K)`` → Q8_0 blocks, uint8 ``(..., K // 32 * 34)``; as ggml's quantize_row_q8_0_ref."""
    return _quantize_rows(x, QType.Q8_0, _encode_q8_0)


def quantize_q4_0(x: np.ndarray) -> np.ndarray:
    """float32 ``(..., K)`` → Q4_0 blocks, uint8 ``(..., K // 32 * 18)``; as ggml's quantize_row_q4_0_ref."""
    return _quantize_rows(x, QType.Q4_0, _encode_q4_0)


def quantize_q5_0(x: np.ndarray) -> np.ndarray:
    """float32 ``(..., K)`` → Q5_0 blocks, uint8 ``(..., K // 32 * 22)``; as ggml's quantize_row_q5_0_ref."""
    return _quantize_rows(x, QType.Q5_0, _encode_q5_0)


def random_blocks(qtype: QType, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random valid storage for a tensor of logical ``shape``: the ``data`` a file would hold.

    Quantized types: uint8 ``(*shape[:-1], row_bytes)``, random quant bits with finite f16 scales of
    magnitude 2^-12..2^-7 (positive where ggml keeps them positive: K-quant d/dmin). Plain types: values
    ~ N(0, 0.1) stored as float32 / float16 / bf16 bits (uint16).
    """
    qtype = QType(qtype)
    shape = tuple(int(s) for s in shape)
    if qtype in PLAIN_TYPES:
        values = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if qtype == QType.BF16:  # truncate to the top half of the f32 bits
            return (values.view(np.uint32) >> 16).astype(np.uint16)
        return values.astype(PLAIN_TYPES[qtype])
    if qtype not in _F16_FIELDS:
        raise NotImplementedError(f"no random blocks for {qtype.name}")
    block_elems, block_bytes = block_layout(qtype)
    rb = row_bytes(qtype, shape[-1])
    n_blocks = int(np.prod(shape, dtype=np.int64)) // block_elems
    blocks = rng.integers(0, 256, size=(n_blocks, block_bytes), dtype=np.uint8)
    signed = qtype in (QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1)
    for offset in _F16_FIELDS[qtype]:
        scale = np.exp2(rng.uniform(-12, -7, size=n_blocks))
        if signed:
            scale *= rng.choice([-1.0, 1.0], size=n_blocks)
        blocks[:, offset : offset + 2] = scale.astype(np.float16).reshape(-1, 1).view(np.uint8)
    return blocks.reshape(*shape[:-1], rb)
