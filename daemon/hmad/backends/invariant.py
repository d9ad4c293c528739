"""Batch-invariant numpy kernels: a row's result does not depend on what else shares the step.

The CPU backend's plain ops hand numpy whatever the step holds, and OpenBLAS then picks its summation
order by the call's shape: one row goes to sgemv, several to sgemm, whose micro-kernels treat rows
differently by their place in the call (on this machine's Zen build, rows 0-5 and 6-11 of a 16-row call
sum in different orders) and split the work between threads by the row count. So the same sequence
computed alone and in a batch of 8 gets logits that differ in the last bits, and a near-tie in the
logits then turns into a different token. The kernels here fix one reduction order per output element:

- ``matmul``: one BLAS call per row, ``W (N, K) @ x_row (K,)`` (sgemv): every call has the same shape and
  sees only its own row, so each output element is reduced in the same order whatever the batch, on any
  BLAS and any thread count (sgemv splits the outputs between threads, never one dot product). A large
  weight is walked in fixed chunks of CHUNK_ROWS rows, all the step's rows per chunk, so that the chunk is
  read from memory once and from cache for the other rows; the chunks do not depend on the batch either.
  (Fixed-shape sgemm tiles were measured too: OpenBLAS's Zen/Haswell sgemm sums a row in an order that
  depends on its place in the tile for tiles over 8 rows, and at one row they cost 9x the sgemv.)
- ``attend_rows``: attention one query row at a time, over exactly the keys that row may see (its
  position and the window fix them), so its shapes depend on the row's position only, not on how many
  rows its chunk of the prompt had (which a causal mask over a chunk-wide key range would).

Cost: nothing at one row; a prefill or a large batch runs a mat-vec per row instead of one sgemm
(docs/determinism.md has the measured price).
"""

from __future__ import annotations

import numpy as np

from hmad.backends import ggml_numerics as ggml

#: rows of a weight one chunk of the row loop covers when the weight is larger (the output projection:
#: 262144 rows), ~5 MB of float32 at the 270M's width
CHUNK_ROWS = 2048


def matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x (M, K) @ w (N, K)ᵀ -> (M, N) float32, each row's result independent of M and of the other rows."""
    m, n = x.shape[0], w.shape[0]
    out = np.empty((m, n), np.float32)
    step = n if n <= 2 * CHUNK_ROWS else CHUNK_ROWS
    for s in range(0, n, step):
        wc = w[s : s + step]  # (n_c, K), contiguous rows
        for i in range(m):
            np.matmul(wc, x[i], out=out[i, s : s + step])  # sgemv: (n_c, K) @ (K,)
    return out


def attend_rows(
    q, keys, vals, pos0: int, kpos, window: int | None, scale: float, ggml_order: bool, visible=None
):
    """One sequence's causal (optionally windowed) GQA attention, row by row (see _attend in cpu.py for the
    math): q (n, H, Dh) at positions pos0.., keys/vals (L, Hkv, Dh) at positions ``kpos`` -> (n, H*Dh);
    ``visible`` (n,) or None: the last position each row sees, else its own."""
    n, h, dh = q.shape
    hkv = keys.shape[1]
    if ggml_order:
        q = q * np.float32(scale)
    # (Hkv, L, Dh) each: a row's slice of keys is then (Hkv, L_p, Dh) with rows Dh apart, the same
    # operand layout for BLAS whatever L (the chunk's key count) is
    ks = np.ascontiguousarray(keys.astype(np.float32).transpose(1, 0, 2))
    vs = np.ascontiguousarray(vals.astype(np.float32).transpose(1, 0, 2))
    out = np.empty((n, h * dh), np.float32)
    for i in range(n):
        p = pos0 + i
        lo = 0 if window is None else p - window + 1
        last = p if visible is None else int(visible[i])
        sel = slice(np.searchsorted(kpos, lo), np.searchsorted(kpos, last, side="right"))  # keys lo..last
        qi = np.ascontiguousarray(q[i].reshape(hkv, h // hkv, dh))  # (Hkv, G, Dh)
        s = qi @ ks[:, sel].transpose(0, 2, 1)  # (Hkv, G, L_p)
        if ggml_order:
            pr = ggml.softmax_rows(s)
        else:
            s *= np.float32(scale)
            s -= s.max(axis=-1, keepdims=True)
            pr = np.exp(s)
            pr /= pr.sum(axis=-1, keepdims=True)
        out[i] = (pr @ vs[:, sel]).reshape(h * dh)  # (Hkv, G, Dh)
    return out
