"""Log-probabilities of generated tokens: what a request with ``logprobs`` gets back for each token.

A token's logprob is ``log_softmax`` of the logits row it was drawn from, over the whole vocabulary, as the
sampler sees the row before its temperature: after the grammar's mask, the additive adjustments
(logit_bias, presence and frequency penalties) and the repetition penalty, before temperature, top-k,
top-p and min-p (engine/sampling.py, steps 0-1). That is the model's distribution, as OpenAI and vLLM
report it, not the sampler's truncated one: a temperature-0.5 or top-k draw reports the same values as a
greedy one from the same row.

Numerics: float64 throughout, ``x - max - log(sum(exp(x - max)))`` (max-subtracted log-sum-exp); tokens
the row holds at -inf (a grammar's mask) have logprob -inf and never appear among the alternatives.

The wire form of one token (docs/protocol.md, "Logprobs"): ``{"token_id", "text", "logprob", "top"}``,
``top`` the ``n`` most likely tokens of the row as ``[id, logprob, text]``, most likely first, equal
values by lower id; ``text`` is the token's own bytes as UTF-8 (a byte that is part of a character:
U+FFFD).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

MAX_TOP = 20  # OpenAI's top_logprobs limit; the wire's bound is hmaclient.sampling.MAX_LOGPROBS


def log_softmax(row: np.ndarray) -> np.ndarray:
    """``row`` (V,) -> its log-softmax (V,) float64, max-subtracted; -inf entries stay -inf."""
    x = np.asarray(row, dtype=np.float64)
    m = x.max()
    if not np.isfinite(m):  # all -inf (nothing allowed) or a +inf: no distribution to report
        raise ValueError(f"logits row has no finite maximum ({m})")
    shifted = x - m
    return shifted - np.log(np.exp(shifted).sum())


def top(lp: np.ndarray, n: int) -> list[tuple[int, float]]:
    """The ``n`` largest finite entries of ``lp`` (V,) as (id, logprob), largest first, ties by lower id."""
    n = min(n, lp.size)
    if n <= 0:
        return []
    if n < lp.size:  # every entry at least the n-th largest, so equal values at the edge go by id
        edge = lp[np.argpartition(-lp, n - 1)[n - 1]]
        ids = np.flatnonzero(lp >= edge)
    else:
        ids = np.arange(lp.size)
    ids = ids[np.lexsort((ids, -lp[ids]))][:n]
    return [(int(i), float(lp[i])) for i in ids if np.isfinite(lp[i])]


def entry(row: np.ndarray, tok: int, n: int, text: Callable[[int], str]) -> dict:
    """The wire's entry of token ``tok`` drawn from ``row`` (V,) with ``n`` alternatives (module
    docstring); ``text(id)`` gives a token's text."""
    lp = log_softmax(row)
    alts = [[i, v, text(i)] for i, v in top(lp, n)]
    return {"token_id": int(tok), "text": text(tok), "logprob": float(lp[tok]), "top": alts}
