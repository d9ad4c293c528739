"""Drafters, and prompt lookup: drafts from the sequence's own tokens, no model.

A ``Drafter`` proposes up to k tokens to follow a sequence (its prompt, then its output so far); the
verification (engine/speculation/speculator.py) treats a proposal as certain (the draft distribution q
is one-hot on it), so a drafter needs only ``propose``. A draft model (a later phase) is one more
``Drafter``.

Prompt lookup (llama.cpp's ``lookup``/``--lookup-ngram-min``, vLLM's ``ngram`` proposer with
``prompt_lookup_min``/``prompt_lookup_max``): for n from ``ngram_max`` down to ``ngram_min``, find the last
earlier place where the sequence's last n tokens occur; the up to k tokens after that occurrence are the
draft. The longest suffix with a match wins; among its matches, the earliest (the one with the most tokens
after it: in a run that repeats, the latest match overlaps the suffix and leaves one).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from hmad.engine.request import Request


class Drafter(Protocol):
    def propose(self, r: Request, k: int) -> list[int]:
        """Up to ``k`` tokens expected to follow ``r``'s prompt + output (none: nothing to propose)."""
        ...


class LookupDrafter:
    """Prompt lookup (module docstring)."""

    def __init__(self, ngram_min: int = 1, ngram_max: int = 3):
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def propose(self, r: Request, k: int) -> list[int]:
        return lookup(r.prompt_ids + r.output_ids, k, self.ngram_min, self.ngram_max)


def lookup(tokens: list[int], k: int, ngram_min: int, ngram_max: int) -> list[int]:
    """The up to ``k`` tokens after the first occurrence of the longest suffix of ``tokens`` of
    ``ngram_min`` .. ``ngram_max`` tokens that occurs earlier; [] when none does."""
    if k <= 0 or len(tokens) < ngram_min + 1:
        return []
    seq = np.asarray(tokens, np.int64)
    for n in range(min(ngram_max, len(seq) - 1), ngram_min - 1, -1):
        # (L - n, n): every window that ends before the last token, so that a token follows it
        windows = np.lib.stride_tricks.sliding_window_view(seq[:-1], n)
        hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return seq[start : start + k].tolist()
    return []
