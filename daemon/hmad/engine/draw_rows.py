"""The host's draw for a step's candidate rows at once: each row's token as its request's
``Sampler.sample_candidates`` would pick it, vectorised over the rows.

A step sampled from on-device candidates (engine/scheduler.py) hands the host one row of candidates per
sampling request: the M best logits and their ids (shaders/topk.comp, M = 128 on the Vulkan backend).
``sample_candidates`` draws a row in ~40 numpy calls on arrays of 64-128 values, ~150 µs a row, mostly
call overhead: 4-5 ms at 32 rows, beside a small model's GPU step of 2-3 ms. Here each stage runs once for
the rows that share a top-k size (one group under the default settings), and every sort is one
``np.sort`` of int64 keys (the value's order, then the column: what a stable sort gives, at a third of
its cost).

Exactness: the token must be the one ``sample_candidates`` picks, bit for bit, since the per-row path (a
step run alone, or with the pipeline off) is the reference. So every float operation is the per-row one,
on the same elements in the same order: the float32 softmax weights element-wise; pairwise float64 sums
over rows of the same length (the draw's total: its 1024-entry padded block's, as ``_draw`` sums it); bucket
masses accumulated in element order (one ``bincount`` over the rows laid end to end); cumulative sums
along the row. The selections (top-k, top-p's kept set, min-p) are sets and orders, built from sort keys
that give exactly the per-row result. ``tests/test_draw_rows.py`` checks the tokens and the uniforms used
against ``sample_candidates`` on fresh random rows and settings.

The candidates are of the adjusted rows (the device adds each request's logit_bias and presence/frequency
deltas before its top-k: engine/sampling.py, step 0), so nothing here adds them again.

Rows left to the per-row path (``None``): a repetition penalty (it needs the request's recent tokens), a
candidate that is not finite, an id given twice, more than 128 candidates, a top-p boundary bucket holding
equal weights among unequal ones (the per-row path orders those with numpy's unstable sort), and top-p's
rounding corner where no bucket reaches the target.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hmad.engine.sampling import (
    _NUCLEUS_BUCKETS_PER_OCTAVE,
    _NUCLEUS_LAST_BUCKET,
    Sampler,
    _last_positive_at_most,
)

# Candidates a row at most: the draw's padded sum is then its first 128-entry leaf (below), and a column
# fits a sort key's low byte.
_MAX_CANDIDATES = 128
_COL_BITS = 8
_LAST_KEY = 1 << 32  # after every _descending key
# Fewer rows than this are drawn faster one by one (the stages' fixed cost: ~2 rows' worth).
DRAW_ROWS_MIN = 3


def draw_rows(samplers: Sequence[Sampler], ids: np.ndarray, values: np.ndarray) -> list[int | None]:
    """Row i's token as ``samplers[i].sample_candidates(ids[i], values[i])`` picks it with no recent tokens,
    or None for a row left to that per-row call (module docstring). ``ids`` and ``values``: (R, M).

    A row given a token has used its sampler's next uniform (when it samples); a None row has not.
    """
    out: list[int | None] = [None] * len(samplers)
    ids, values = np.asarray(ids), np.asarray(values, dtype=np.float32)
    if ids.ndim != 2 or ids.shape != values.shape or ids.shape[0] != len(samplers) or not ids.size:
        return out
    if ids.shape[1] > _MAX_CANDIDATES:
        return out
    order = np.argsort(ids, axis=1)  # the per-row path works in id order
    r = np.arange(ids.shape[0])[:, None]
    ids, values = ids[r, order], values[r, order]
    ok = np.isfinite(values).all(axis=1) & (ids[:, 1:] != ids[:, :-1]).all(axis=1)
    taken = [i for i, s in enumerate(samplers) if ok[i] and _unpenalized(s)]
    greedy = [i for i in taken if samplers[i].params.temperature == 0]
    for i, j in zip(greedy, np.argmax(values[greedy], axis=1).tolist(), strict=True):
        out[i] = int(ids[i, j])
    m = ids.shape[1]
    groups: dict[int, list[int]] = {}
    for i in taken:
        k = samplers[i].params.top_k
        if samplers[i].params.temperature > 0:
            groups.setdefault(k if 0 < k < m else m, []).append(i)
    used = []
    for k, rows in groups.items():
        toks = _draw_group([samplers[i] for i in rows], ids[rows], values[rows], k)
        for i, tok in zip(rows, toks, strict=True):
            if tok is not None:
                out[i] = tok
                used.append(samplers[i])
    for s in used:  # the uniforms are used up only now that every row's token is known
        s.draw_uniform()
    return out


def _unpenalized(s: Sampler) -> bool:
    return s.params.repetition_penalty == 1.0 or s.params.repeat_last_n == 0


def _draw_group(samplers: list[Sampler], ids: np.ndarray, values: np.ndarray, k: int) -> list[int | None]:
    """Tokens of rows (G, M) in id order that keep k candidates each, as ``Sampler._draw_from`` after
    ``_top_k`` (None: the row's result would not be exact)."""
    g = values.shape[0]
    col, r = np.arange(k), np.arange(g)[:, None]
    pos = np.sort(_sorted_cols(_descending(values))[:, :k], axis=1)  # top-k, lowest ids on ties; id order
    kept = values[r, pos]  # (G, k) logits
    temps = np.array([s.params.temperature for s in samplers], dtype=np.float32)
    with np.errstate(over="ignore"):
        w = np.exp((kept - kept.max(axis=1, keepdims=True)) / temps[:, None])  # (G, k) float32, max 1
    top_p = np.array([s.params.top_p for s in samplers])
    if (top_p < 1.0).all():  # the usual case: every row's top-p on
        order, n, ok = _nucleus_rows(w, top_p)
    else:
        order, n, ok = np.empty((g, k), np.intp), np.full(g, k), np.ones(g, bool)
        order[:] = col
        nuc = np.nonzero(top_p < 1.0)[0]
        if nuc.size:
            order[nuc], n[nuc], ok[nuc] = _nucleus_rows(w[nuc], top_p[nuc])
    min_p = np.array([s.params.min_p for s in samplers], dtype=np.float32)
    if min_p.any():
        order, n = _min_p_rows(w[r, order], order, n, min_p)
    final = np.where(col < n[:, None], w[r, order], np.float32(0))
    choice = _inverse_cdf_rows(final, np.array([s.upcoming(0) for s in samplers]))
    toks = ids[r[:, 0], pos[r[:, 0], order[r[:, 0], choice]]]
    return [int(t) if o else None for t, o in zip(toks.tolist(), ok.tolist(), strict=True)]


def _descending(x: np.ndarray) -> np.ndarray:
    """int64 keys that order float32 ``x`` (no NaN) from largest to smallest; equal values (-0 and +0
    too) get equal keys."""
    bits = (x + np.float32(0)).view(np.int32).astype(np.int64)  # + 0: -0 becomes +0
    return -np.where(bits >= 0, bits, -(bits & 0x7FFFFFFF) - 1)


def _sorted_cols(keys: np.ndarray) -> np.ndarray:
    """Each row's columns ordered by ``keys`` (G, n), equal keys by column: a stable argsort."""
    col = np.arange(keys.shape[1])
    return np.sort((keys << _COL_BITS) | col, axis=1) & ((1 << _COL_BITS) - 1)


def _nucleus_rows(w: np.ndarray, top_p: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``sampling._nucleus`` on each row of ``w`` (G, k): (positions kept first, in its order (G, k); how
    many (G,); whether the row's result is exact).

    Its bucket masses go by dense bucket rank (the buckets a row has, in order) rather than bucket number:
    the buckets between add zeros to its running sum, which leaves it unchanged.
    """
    g, k = w.shape
    col, rows = np.arange(k), np.arange(g)
    r = rows[:, None]
    target = top_p * w.sum(axis=1, dtype=np.float64)
    with np.errstate(divide="ignore"):
        key = np.minimum(np.log2(w) * np.float32(-_NUCLEUS_BUCKETS_PER_OCTAVE), _NUCLEUS_LAST_BUCKET)
    key = key.astype(np.intp)
    by_key = _sorted_cols(key)
    key_sorted = key[r, by_key]
    rank_sorted = np.zeros((g, k), np.intp)
    (key_sorted[:, 1:] != key_sorted[:, :-1]).cumsum(axis=1, out=rank_sorted[:, 1:])
    dense = np.empty_like(by_key)
    dense[r, by_key] = rank_sorted
    n_buckets = rank_sorted[:, -1] + 1
    flat = (dense + k * rows[:, None]).ravel()  # rows end to end: each bucket sums in its row's order
    mass = np.bincount(flat, weights=w.astype(np.float64).ravel(), minlength=g * k).reshape(g, k)
    cum = np.cumsum(mass, axis=1)
    b = ((cum < target[:, None]) & (col < n_buckets[:, None])).sum(axis=1)  # searchsorted, side left
    reached = b < n_buckets  # else the per-row path takes its last bucket number (rounding): not here
    need = target - np.where(b > 0, cum[rows, np.maximum(b - 1, 0)], 0.0)
    below, edge = dense < b[:, None], dense == b[:, None]
    n_edge = edge.sum(axis=1)
    by_weight = _sorted_cols(np.where(edge, _descending(w), _LAST_KEY))  # edge heaviest first
    edge_w = w[r, by_weight]  # (G, k): the edge's weights, then the rest
    in_edge = col < n_edge[:, None]
    ties = ((edge_w[:, 1:] == edge_w[:, :-1]) & in_edge[:, 1:]).any(axis=1)
    all_tied = edge_w[:, 0] == edge_w[rows, np.maximum(n_edge - 1, 0)]  # the per-row path sorts none
    edge_cum = np.cumsum(np.where(in_edge, edge_w, np.float32(0)), axis=1, dtype=np.float64)
    cut = np.minimum(((edge_cum < need[:, None]) & in_edge).sum(axis=1) + 1, n_edge)
    rank = np.empty_like(by_weight)
    rank[r, by_weight] = col
    sort_key = np.where(below, col, np.where(edge & (rank < cut[:, None]), k + rank, 2 * k + col))
    return np.argsort(sort_key, axis=1), below.sum(axis=1) + cut, reached & (~ties | all_tied)


def _min_p_rows(
    w: np.ndarray, order: np.ndarray, n: np.ndarray, min_p: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Drop, keeping the order, the first ``n`` entries of each row's ``w`` (in ``order``) below its
    ``min_p`` (float32, as numpy compares a float32 array with a Python float); min_p 0 keeps them all."""
    keep = (np.arange(w.shape[1]) < n[:, None]) & (w >= min_p[:, None])
    r = np.arange(w.shape[0])[:, None]
    return order[r, _sorted_cols((~keep).astype(np.int64))], keep.sum(axis=1)


def _inverse_cdf_rows(w: np.ndarray, u01: np.ndarray) -> np.ndarray:
    """``sampling._draw`` on each row of ``w`` (G, k <= 128), zeros past a row's kept entries.

    ``_draw`` sums its 1024-entry block pairwise: numpy's pairwise sum splits 1024 entries into 128-entry
    leaves, and past the first they hold zeros here, so the block's sum is its first leaf's. Its cumulative
    sum past the k entries stays at the total, so the search needs the k entries only.
    """
    g, k = w.shape
    leaf = np.zeros((g, _MAX_CANDIDATES), dtype=np.float32)
    leaf[:, :k] = w
    u = u01 * leaf.sum(axis=1, dtype=np.float64)
    cdf = np.cumsum(w, axis=1, dtype=np.float64)
    i = (cdf <= u[:, None]).sum(axis=1)  # searchsorted, side right (k: at or past the end of the mass)
    lower = np.where(i > 0, cdf[np.arange(g), np.maximum(i - 1, 0)], 0.0)
    fine = (i < k) & (cdf[np.arange(g), np.minimum(i, k - 1)] > lower)
    picks = zip(i.tolist(), fine.tolist(), cdf, strict=True)
    return np.array([j if f else _last_positive_at_most(c, j) for j, f, c in picks])
