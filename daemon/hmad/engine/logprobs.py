"""Log-probabilities of generated tokens: what a request with ``logprobs`` gets back for each token.

A token's logprob is ``log_softmax`` of the logits row it was drawn from, over the whole vocabulary, as the
sampler sees the row before its temperature: after the grammar's mask, the additive adjustments
(logit_bias, presence and frequency penalties) and the repetition penalty, before temperature, top-k,
top-p and min-p (engine/sampling.py, steps 0-1). That is the model's distribution, as OpenAI and vLLM
report it, not the sampler's truncated one: a temperature-0.5 or top-k draw reports the same values as a
greedy one from the same row.

Numerics: ``logprob(i) = x_i - logsumexp(x)``, the log-sum-exp max-subtracted, ``m + log(sum(exp(x - m)))``,
its exponentials in float32 (no overflow: every ``x - m <= 0``) summed in float64, the subtraction in
float64: within ~1e-6 of a float64 log-softmax, for less than its cost on a 262k-token row. NaN counts as
-inf (as the sampler counts it); tokens at -inf (a grammar's mask) have logprob -inf and are never
alternatives.

Where they are computed: from the row itself on the host (:func:`entry`: the tokens and prompt tokens of
a request that needs its rows: a grammar, a repetition penalty, a backend without an on-device top-k), or
from the device's top-k candidates and the row's log-sum-exp, which the device reduces after adding the
step's adjustments (:func:`entry_from_candidates`; backends/base.py ``topk``, shaders/row_lse.comp, float32:
within ~1e-5 relative of this module's); a prompt token, seldom among its row's candidates, by its logit
which the device gathers from the row too (:func:`entry_from_target`; backends/base.py ``topk_targets``,
shaders/row_gather.comp). engine/planning.py, ``needs_row``, says which.

The wire form of one token (docs/protocol.md, "Logprobs"): ``{"token_id", "text", "logprob", "top"}``,
``top`` the ``n`` most likely tokens of the row as ``[id, logprob, text]``, most likely first, equal
values by lower id; ``text`` is the token's own bytes as UTF-8 (a byte that is part of a character:
U+FFFD).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def _values(row: np.ndarray) -> np.ndarray:
    """``row`` as float32, NaN as -inf (as the sampler counts it)."""
    x = np.asarray(row, dtype=np.float32)
    return np.where(np.isnan(x), np.float32(-np.inf), x) if np.isnan(x.max()) else x


def logsumexp(row: np.ndarray) -> float:
    """``log(sum(exp(row)))`` of a float32 row (V,), max-subtracted (module docstring)."""
    x = _values(row)
    m = x.max()
    if not np.isfinite(m):  # all -inf (nothing allowed) or a +inf: no distribution to report
        raise ValueError(f"logits row has no finite maximum ({m})")
    return float(m) + float(np.log(np.exp(x - m).sum(dtype=np.float64)))


def log_softmax(row: np.ndarray) -> np.ndarray:
    """``row`` (V,) -> its log-softmax (V,) float64, as :func:`entry` reports it; -inf entries stay -inf."""
    return _values(row).astype(np.float64) - logsumexp(row)


def top(row: np.ndarray, n: int) -> list[int]:
    """The ids of the ``n`` largest finite entries of ``row`` (V,), largest first, equal values by lower id
    (a row's order is its logprobs' order)."""
    x = _values(row)
    n = min(n, x.size)
    if n <= 0:
        return []
    if n < x.size:  # every entry at least the n-th largest, so equal values at the edge go by id
        edge = x[np.argpartition(-x, n - 1)[n - 1]]
        ids = np.flatnonzero(x >= edge)
    else:
        ids = np.arange(x.size)
    ids = ids[np.lexsort((ids, -x[ids]))][:n]
    return [int(i) for i in ids if np.isfinite(x[i])]


def entry(row: np.ndarray, tok: int, n: int, text: Callable[[int], str]) -> dict:
    """The wire's entry of token ``tok`` drawn from ``row`` (V,) with ``n`` alternatives (module
    docstring); ``text(id)`` gives a token's text."""
    x = _values(row)
    lse = logsumexp(x)
    return _wire(tok, float(x[tok]) - lse, [(i, float(x[i]) - lse) for i in top(x, n)], text)


def entry_from_candidates(
    ids: np.ndarray, vals: np.ndarray, lse: float, tok: int, n: int, text: Callable[[int], str]
) -> dict:
    """:func:`entry` from a row's best values ``vals`` of tokens ``ids`` (M,) (at least ``n`` of them, and
    ``tok`` among them) and the whole row's log-sum-exp ``lse``, as the device gives them. Raises
    ValueError when ``lse`` is not finite (no finite maximum) or ``tok`` is not a candidate."""
    x, ids = _values(vals), np.asarray(ids, dtype=np.int64)
    at = np.flatnonzero(ids == tok)
    if not at.size:
        raise ValueError(f"token {tok} is not among the row's {ids.size} candidates")
    return entry_from_target(ids, vals, lse, tok, float(x[at[0]]), n, text)


def entry_from_target(
    ids: np.ndarray, vals: np.ndarray, lse: float, tok: int, value: float, n: int, text: Callable[[int], str]
) -> dict:
    """:func:`entry` of token ``tok`` whose logit in the row is ``value`` (a prompt token's, gathered on the
    device whether or not it is a candidate; NaN counts as -inf), its alternatives the row's best ``vals``
    of tokens ``ids`` (M,) (at least ``n``) and the whole row's log-sum-exp ``lse``. Raises ValueError when
    ``lse`` is not finite (no finite maximum)."""
    if not np.isfinite(lse):
        raise ValueError(f"logits row has no finite maximum (its log-sum-exp is {lse})")
    x, ids = _values(vals), np.asarray(ids, dtype=np.int64)
    order = np.lexsort((ids, -x))  # the row's order: largest first, equal values by lower id
    alts = [(int(ids[j]), float(x[j]) - lse) for j in order[: max(n, 0)] if np.isfinite(x[j])]
    return _wire(tok, float(_values(np.float32(value))) - lse, alts, text)


def _wire(tok: int, logprob: float, alts: list[tuple[int, float]], text: Callable[[int], str]) -> dict:
    """The wire's entry of ``tok`` (module docstring): its logprob and the (id, logprob) alternatives."""
    top_ = [[i, lp, text(i)] for i, lp in alts]
    return {"token_id": int(tok), "text": text(tok), "logprob": logprob, "top": top_}
