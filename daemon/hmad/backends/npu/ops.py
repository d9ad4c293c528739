"""The ops run on the NPU: tiled GEMMs (int8, bf16) and prefill attention, written over KernelContexts.

Every kernel has a fixed problem size (kernels.py); the host pads each operand to whole tiles and loops over
the tiles, accumulating partial products over K blocks itself. Runs are pipelined two deep: while run b is
on the NPU the host fills the other buffer set with block b+1 and accumulates block b-1, so the engine
thread's wait() overlaps host work instead of idling.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from hmad.backends.npu.context import BufferSet, KernelContext, Pending
from hmad.backends.npu.errors import NpuError, NpuUnsupportedShape
from hmad.backends.npu.host import GemmWeight, f32_to_bf16, pad2, quantize_blocks, round_up, spans


def pipelined(
    ctx: KernelContext,
    jobs: Iterable[Any],
    fill: Callable[[BufferSet, Any], None],
    take: Callable[[list[np.ndarray], Any], None],
) -> None:
    """Run ``jobs`` on ``ctx``: ``fill(bufs, job)`` writes a job's inputs, ``take(outputs, job)`` consumes its
    outputs (views of the BOs: copy what is kept). Two buffer sets alternate so host and NPU overlap."""
    assert len(ctx.sets) >= 2, "pipelining needs two buffer sets"
    inflight: list[tuple[Pending, Any]] = []
    try:
        for i, job in enumerate(jobs):
            bufs = ctx.sets[i % len(ctx.sets)]
            fill(bufs, job)  # this set's previous run was taken one iteration ago
            inflight.append((ctx.submit(bufs), job))
            if len(inflight) == 2:
                p, prev = inflight.pop(0)
                take(ctx.wait(p), prev)  # run i-1, while run i is queued behind it
        while inflight:
            p, prev = inflight.pop(0)
            take(ctx.wait(p), prev)
    except NpuError:
        _drain(ctx, [p for p, _ in inflight])
        raise


def _drain(ctx: KernelContext, pending: list[Pending]) -> None:
    """Wait out runs still in flight after a failure, so no later call refills their buffers under them."""
    for p in pending:
        with contextlib.suppress(NpuError):
            ctx.wait(p)


def tiled_gemm(
    ctx: KernelContext,
    a: np.ndarray,
    b: np.ndarray,
    a_scale: np.ndarray | None = None,
    b_scale: np.ndarray | None = None,
) -> np.ndarray:
    """a (Mp, Kp) @ b (Np, Kp).T on ``ctx``'s gemm kernel; operands already padded to its tiles.

    Returns (Mp, Np) float32, summed over K blocks on the host. With scales (int8: ``a_scale`` (Mp, Kp/tk),
    ``b_scale`` (Np, Kp/tk), one per row per K tile), each block's int32 product is dequantized with its
    own row scales before it is added."""
    tm, tk, tn = ctx.spec.gemm_tile()
    c = np.zeros((a.shape[0], b.shape[0]), dtype=np.float32)
    jobs = [
        (rm, rn, rk)  # consecutive jobs share an output tile and walk K
        for rm in spans(a.shape[0], tm)
        for rn in spans(b.shape[0], tn)
        for rk in spans(a.shape[1], tk)
    ]

    def fill(bufs: BufferSet, job) -> None:
        (m0, m1), (n0, n1), (k0, k1) = job
        np.copyto(bufs.views[0], a[m0:m1, k0:k1])
        np.copyto(bufs.views[1], b[n0:n1, k0:k1])

    def take(outs: list[np.ndarray], job) -> None:
        (m0, m1), (n0, n1), (k0, _) = job
        if a_scale is None:
            c[m0:m1, n0:n1] += outs[0]
        else:
            kb = k0 // tk
            c[m0:m1, n0:n1] += (outs[0].astype(np.float32) * a_scale[m0:m1, kb, None]) * b_scale[
                None, n0:n1, kb
            ]

    pipelined(ctx, jobs, fill, take)
    return c


def gemm(ctx: KernelContext, x: np.ndarray, w: GemmWeight) -> np.ndarray:
    """x (T, K) float32 @ w.T -> (T, N) float32 on the weight's kernel (int8: x quantized per token and
    K tile, as the weight is per row and K tile)."""
    tm, tk, _ = ctx.spec.gemm_tile()
    t = x.shape[0]
    rows, cols = round_up(t, tm), w.data.shape[1]
    if w.kernel == "gemm_int8":
        q, sx = quantize_blocks(pad2(np.asarray(x, np.float32), rows, cols), tk)
        return tiled_gemm(ctx, q, w.data, sx, w.scale)[:t, : w.n]
    return tiled_gemm(ctx, pad2(f32_to_bf16(x), rows, cols), w.data)[:t, : w.n]


def gemm_bf16_bits(ctx: KernelContext, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a (R, K) @ b (N, K).T, both bf16 bits, on the bf16 gemm: (R, N) float32 (padding done here)."""
    tm, tk, tn = ctx.spec.gemm_tile()
    k = round_up(a.shape[1], tk)
    c = tiled_gemm(ctx, pad2(a, round_up(a.shape[0], tm), k), pad2(b, round_up(b.shape[0], tn), k))
    return c[: a.shape[0], : b.shape[0]]


def softmax_rows(ctx: KernelContext, s: np.ndarray, lim: np.ndarray) -> np.ndarray:
    """Masked row softmax on the NPU: s (R, L) float32, lim (R, 2) int32 [lo, hi) -> (R, L) bf16 bits."""
    tr, tl = ctx.spec.args[0].shape
    r, n_keys = s.shape
    if n_keys > tl:
        raise NpuUnsupportedShape(f"{n_keys} keys: the softmax kernel takes at most {tl}")
    p = np.empty((r, n_keys), dtype=np.uint16)

    def fill(bufs: BufferSet, job) -> None:
        r0, r1 = job
        bufs.views[0][: r1 - r0, :n_keys] = s[r0:r1]
        bufs.views[1][: r1 - r0] = lim[r0:r1]
        bufs.views[1][r1 - r0 :] = 0  # padding rows: empty range, all-zero output

    def take(outs: list[np.ndarray], job) -> None:
        r0, r1 = job
        p[r0:r1] = outs[0][: r1 - r0, :n_keys]

    pipelined(ctx, [(r0, min(r, r0 + tr)) for r0 in range(0, r, tr)], fill, take)
    return p


def key_limits(n: int, pos0: int, k0: int, window: int | None) -> np.ndarray:
    """(n, 2) int32: for query i at position pos0+i, the keys (indices into positions k0, k0+1, ...) it
    attends: causal, and within the last ``window`` positions when given."""
    p = pos0 + np.arange(n)
    hi = p - k0 + 1
    lo = np.zeros(n, dtype=np.int64) if window is None else np.maximum(0, p - window + 1 - k0)
    return np.stack([lo, hi], axis=1).astype(np.int32)


def attention_prefill(
    gemm_ctx: KernelContext,
    softmax_ctx: KernelContext,
    q: np.ndarray,
    keys: np.ndarray,
    vals: np.ndarray,
    pos0: int,
    kpos: np.ndarray,
    window: int | None,
    scale: float,
) -> np.ndarray:
    """One sequence's causal GQA attention, as CpuBackend.attend: q (n, H, Dh) at positions pos0..,
    keys/vals (L, Hkv, Dh) at positions kpos (consecutive) -> (n, H * Dh) float32.

    Per KV head: S = (q * scale) K^T on the bf16 gemm, P = masked softmax(S) on the softmax kernel, O = P V
    on the bf16 gemm; the G = H / Hkv query heads sharing a KV head are stacked as rows g * n + i."""
    n, h, dh = q.shape
    hkv = keys.shape[1]
    g = h // hkv
    if len(kpos) > softmax_ctx.spec.args[0].shape[1]:
        raise NpuUnsupportedShape(f"{len(kpos)} keys: the softmax kernel takes at most its row length")
    lim = np.tile(key_limits(n, pos0, int(kpos[0]), window), (g, 1))  # (G*n, 2)
    qb = f32_to_bf16(q * np.float32(scale))  # (n, H, Dh)
    out = np.empty((n, h, dh), dtype=np.float32)
    for kv in range(hkv):
        rows = qb[:, kv * g : (kv + 1) * g].transpose(1, 0, 2).reshape(g * n, dh)  # (G*n, Dh)
        s = gemm_bf16_bits(gemm_ctx, rows, f32_to_bf16(keys[:, kv].astype(np.float32)))  # (G*n, L)
        p = softmax_rows(softmax_ctx, s, lim)  # (G*n, L) bf16
        vt = f32_to_bf16(np.ascontiguousarray(vals[:, kv].astype(np.float32).T))  # (Dh, L)
        o = gemm_bf16_bits(gemm_ctx, p, vt)  # (G*n, Dh)
        out[:, kv * g : (kv + 1) * g] = o.reshape(g, n, dh).transpose(1, 0, 2)
    return out.reshape(n, h * dh)
