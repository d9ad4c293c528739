"""The numpy reference backend: every op eager, in float32, written for clarity first.

``numerics="ggml"`` (the default) rounds where llama.cpp's CPU backend rounds (RMS norm with a double
accumulator, activation quantization before quantized matmuls, float16 GELU table, float32 RoPE angles and
fma rotation, Q scaled before QK^T, softmax summed in double: see ggml_numerics.py), so greedy output
follows llama.cpp; ``numerics="f32"`` computes everything in plain float32 (used against transformers).

Quantized weights are dequantized to float32 once and kept while they fit ``weight_cache_bytes``; a
weight beyond that budget is dequantized in row chunks on every use (slow, but a 27B file still runs
without holding 108 GB of float32). Every other backend is tested against this one.

``deterministic=True`` computes every row independently of the batch (matmuls in fixed-shape row tiles,
attention row by row: backends/invariant.py), so a sequence's logits are bit-identical alone or in any mix.
"""

from __future__ import annotations

import math
import os

import numpy as np

from hmad.backends import ggml_numerics as ggml
from hmad.backends import invariant
from hmad.backends.base import Backend
from hmad.core.batch import BIAS_DTYPE, StepBatch, add_bias
from hmad.core.kv_layout import KVLayout
from hmad.core.quants import dequantize
from hmad.core.tensors import WeightTensor

_ROW_CHUNK = 8192  # rows dequantized at a time for weights outside the cache


def _resident(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A zeroed array with every page written now (np.zeros maps pages lazily): the KV cache is resident
    from load on, so the daemon's memory does not creep up as blocks are first used under load, and a
    machine short of memory fails at load rather than in the middle of a request."""
    a = np.empty(shape, dtype)
    a.fill(0)
    return a


class CpuWeight:
    """A weight as stored in the file, plus its float32 form when the cache budget allows."""

    def __init__(self, t: WeightTensor, keep_f32: bool):
        self.tensor = t
        self.shape = t.shape
        self.f32 = t.dequantize() if keep_f32 else None
        self.npu = None  # the npu backend's copy for its GEMM kernels (backends/npu/host.py GemmWeight)

    def rows(self, idx: np.ndarray) -> np.ndarray:
        if self.f32 is not None:
            return self.f32[idx]
        t = self.tensor
        return dequantize(np.asarray(t.data[idx]), t.qtype, (len(idx), *t.shape[1:]))

    def row_chunks(self):
        """Yield (start, float32 rows) covering the whole weight."""
        if self.f32 is not None:
            yield 0, self.f32
            return
        n = self.shape[0]
        for s in range(0, n, _ROW_CHUNK):
            e = min(n, s + _ROW_CHUNK)
            yield s, self.rows(np.arange(s, e))


class CpuBackend(Backend):
    """Eager numpy ops; KV pools are float32 (or float16 with ``kv_dtype``) numpy arrays."""

    name = "cpu"
    #: engine.deterministic auto: off, by its cost (one mat-vec per row, 270M: +18 % at 32 streams, 2x for a
    #: 512-token prefill, ~free at 1-8 streams: docs/determinism.md)
    deterministic_auto = False

    def __init__(
        self,
        weight_cache_bytes: int = 16 << 30,
        kv_dtype: str = "float32",
        numerics: str = "ggml",
        deterministic: bool | str = "auto",
    ):
        if numerics not in ("ggml", "f32"):
            raise ValueError(f"numerics must be 'ggml' or 'f32', got {numerics!r}")
        self.ggml = numerics == "ggml"
        self.deterministic = self.resolve_deterministic(deterministic)
        self.weight_cache_bytes = weight_cache_bytes
        self.kv_dtype = np.dtype(kv_dtype)
        self.device = f"numpy on {os.cpu_count()} CPU cores"
        self.pools: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.layout: KVLayout | None = None
        self.cached_bytes = 0
        self.loaded: dict[str, CpuWeight] = {}

    # -- residency -------------------------------------------------------------------------------------
    def load_weights(
        self, tensors: dict[str, WeightTensor], progress=None, background=False
    ) -> dict[str, CpuWeight]:
        out = {}
        for name, t in tensors.items():
            f32_bytes = 4 * t.n_elements
            keep = len(t.shape) == 1 or self.cached_bytes + f32_bytes <= self.weight_cache_bytes
            self.cached_bytes += f32_bytes if keep else 0
            out[name] = CpuWeight(t, keep)
        self.loaded.update(out)
        return out

    def alloc_kv(self, layout: KVLayout) -> None:
        self.layout = layout
        per = (layout.block_size, layout.n_kv_heads, layout.head_dim)
        for pool, layers, blocks in (
            ("global", layout.global_layers, layout.n_global_blocks),
            ("local", layout.local_layers, layout.n_local_blocks),
        ):
            shape = (len(layers), blocks * per[0], per[1], per[2])  # (L, slots, Hkv, Dh)
            self.pools[pool] = (_resident(shape, self.kv_dtype), _resident(shape, self.kv_dtype))

    def describe(self) -> dict:
        kv = sum(a.nbytes + b.nbytes for a, b in self.pools.values())
        mapped = sum(w.tensor.nbytes for w in self.loaded.values())
        return {
            "backend": self.name,
            "device": self.device,
            "memory": {
                "host RAM: float32 weights": self.cached_bytes,
                "host RAM: KV cache": kv,
                "page cache: mapped model file": mapped,
            },
        }

    # -- ops ---------------------------------------------------------------------------------------------
    def embed(self, table: CpuWeight, tokens, scale: float):
        return table.rows(np.asarray(tokens)) * np.float32(scale)

    def rms_norm(self, x, w: CpuWeight, eps: float):
        if self.ggml:
            return ggml.rms_norm(x, w.f32, eps)
        ms = np.mean(np.square(x), axis=-1, keepdims=True)
        return (x / np.sqrt(ms + np.float32(eps))) * w.f32

    def matmul(self, x, w: CpuWeight):
        if self.ggml:
            x = ggml.round_activations(x, w.tensor.qtype)
        mm = invariant.matmul if self.deterministic else _plain_matmul
        if w.f32 is not None:
            return mm(x, w.f32)
        out = np.empty((x.shape[0], w.shape[0]), np.float32)
        for s, rows in w.row_chunks():
            out[:, s : s + rows.shape[0]] = mm(x, rows)
        return out

    def rope(self, x, positions, base: float, scale: float):
        if self.ggml:
            return ggml.rope_neox(x, positions, base, scale)
        half = x.shape[-1] // 2
        inv = base ** (-np.arange(0, half, dtype=np.float64) * 2.0 / x.shape[-1])
        ang = (np.asarray(positions, np.float64)[:, None] / scale) * inv[None, :]
        cos = np.cos(ang).astype(np.float32)[:, None, :]
        sin = np.sin(ang).astype(np.float32)[:, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    def attention(self, q, k, v, layer: int, batch: StepBatch, window: int | None, scale: float):
        pool, slot = self.layout.pool_of(layer)
        kc, vc = self.pools[pool][0][slot], self.pools[pool][1][slot]  # (slots, Hkv, Dh)
        out = np.empty((q.shape[0], q.shape[1] * q.shape[2]), np.float32)
        for s in batch.seqs:
            table = s.global_table if pool == "global" else s.local_table
            rows = slice(s.start, s.start + s.n)
            new = _slots(table, np.arange(s.pos0, s.end_pos), batch.block_size)
            kc[new], vc[new] = k[rows], v[rows]
            lo = 0 if window is None else max(0, s.pos0 - window + 1)
            kpos = np.arange(lo, s.end_pos)
            ks = _slots(table, kpos, batch.block_size)
            seen = None if batch.visible is None else batch.visible[rows]
            out[rows] = self.attend(q[rows], kc[ks], vc[ks], s.pos0, kpos, window, scale, seen)
        return out

    def attend(self, q, keys, vals, pos0: int, kpos, window: int | None, scale: float, visible=None):
        """One sequence's attention over its cached keys (see _attend); the npu backend offloads prefill."""
        if self.deterministic:
            return invariant.attend_rows(q, keys, vals, pos0, kpos, window, scale, self.ggml, visible)
        return _attend(q, keys, vals, pos0, kpos, window, scale, self.ggml, visible)

    def geglu(self, gate, up):
        if self.ggml:
            return ggml.gelu(gate) * up
        c = np.float32(math.sqrt(2.0 / math.pi))
        g = 0.5 * gate * (1.0 + np.tanh(c * (gate + np.float32(0.044715) * gate * gate * gate)))
        return g * up

    def add(self, a, b):
        return a + b

    def rows(self, x, idx):
        return x[np.asarray(idx)]

    def put_rows(self, x, idx, values):
        out = np.array(x, np.float32, copy=True)
        out[np.asarray(idx)] = values
        return out

    def reshape(self, x, shape):
        return x.reshape(shape)

    def to_numpy(self, x):
        return np.asarray(x)

    # -- the step's token picks ------------------------------------------------------------------------
    def run(self, net, batch: StepBatch):
        """``net.forward(batch)``; the batch's logit adjustments kept for :meth:`greedy`."""
        self._bias = batch.bias
        return net.forward(batch)

    def greedy(self, logits) -> np.ndarray:
        """Argmax of each row plus the last step's ``batch.bias`` (the reference of a device's argmax: the
        engine picks this backend's tokens from whole rows, where its sampler adds them itself)."""
        rows = add_bias(self.to_numpy(logits), getattr(self, "_bias", np.zeros(0, BIAS_DTYPE)))
        return np.argmax(rows, axis=-1).astype(np.int64)


def _plain_matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x (M, K) @ w (N, K)ᵀ in one BLAS call (its summation order depends on M: see invariant.py)."""
    return x @ w.T


def _slots(table: np.ndarray, pos: np.ndarray, block_size: int) -> np.ndarray:
    """Cache slot of each position: block table[(p // B) % len(table)], offset p % B."""
    return table[(pos // block_size) % len(table)] * block_size + pos % block_size


def _attend(
    q, keys, vals, pos0: int, kpos, window: int | None, scale: float, ggml_order: bool = False, visible=None
):
    """Causal (optionally windowed) GQA attention of one sequence.

    q (n, H, Dh) at positions pos0..pos0+n-1; keys/vals (L, Hkv, Dh) at positions kpos -> (n, H*Dh).
    ``visible`` (n,) or None: the last position each row sees (Backend.attention), else its own.
    ``ggml_order``: llama.cpp's gemma3 graph scales Q (ggml_scale after RoPE) and runs soft_max_ext with
    scale 1, rather than scaling the scores; the softmax is ggml's (ggml_numerics.softmax_rows).
    """
    n, h, dh = q.shape
    hkv = keys.shape[1]
    if ggml_order:
        q = q * np.float32(scale)
    qg = q.reshape(n, hkv, h // hkv, dh).transpose(1, 2, 0, 3)  # (Hkv, G, n, Dh)
    kt = keys.astype(np.float32).transpose(1, 2, 0)[:, None]  # (Hkv, 1, Dh, L)
    scores = qg @ kt  # (Hkv, G, n, L)
    if not ggml_order:
        scores *= np.float32(scale)
    qpos = np.arange(pos0, pos0 + n)[:, None]
    masked = kpos[None, :] > (qpos if visible is None else np.asarray(visible)[:, None])
    if window is not None:
        masked |= qpos - kpos[None, :] >= window
    scores = np.where(masked, -np.inf, scores)
    if ggml_order:
        p = ggml.softmax_rows(scores)
    else:
        scores -= scores.max(axis=-1, keepdims=True)
        p = np.exp(scores)
        p /= p.sum(axis=-1, keepdims=True)
    out = p @ vals.astype(np.float32).transpose(1, 0, 2)[:, None]  # (Hkv, G, n, Dh)
    return out.transpose(2, 0, 1, 3).reshape(n, h * dh)
