"""Token sampling: SamplingParams (what a request asks for) and Sampler (one per request).

The pipeline a Sampler runs on one row of logits, in this order:

0. the additive adjustments (OpenAI's ``logit_bias``, ``presence_penalty``, ``frequency_penalty``): one
   float32 add per adjusted token of ``delta[j] = bias[j] - presence * (count[j] > 0) - frequency *
   count[j]``, counts over the tokens generated so far in the request (not the prompt's, as OpenAI),
   each delta computed once in float64 and rounded to float32 (:meth:`Sampler.adjustments`); a device that
   picks or pre-selects tokens adds the same float32 deltas to its logits row first (StepBatch.bias);
1. repetition penalty (CTRL / llama.cpp style) on the tokens among the last ``repeat_last_n``
   of prompt + generated: a positive logit is divided by the penalty, a negative one multiplied;
2. ``temperature == 0``: greedy, return ``argmax`` (ties go to the lowest id); nothing below runs;
3. temperature scaling, ``logits / T``;
4. top-k: keep the k largest (one ``np.partition``, no full sort; equal values at the boundary: the
   lowest ids), taken in id order;
5. top-p (nucleus): keep the smallest most-probable set whose cumulative probability is >= p
   (at least one token), probabilities taken over what top-k kept;
6. min-p: drop tokens whose probability is below ``min_p * max probability``;
7. renormalise and draw one token with the request's own ``np.random.Generator``.

Numerics: softmax is max-shifted float32, ``exp((l - max) / T)``, so no T > 0 overflows and the
top token always has weight 1; sums and cumulative sums run in float64. float32 ``exp`` is ~16x
faster than float64 here, and on V = 262144 that is most of a step's sampling time.
Same seed + same logits give the same tokens; a ``None`` seed draws fresh entropy, and the seed
actually used is kept on ``Sampler.seed`` so a run can be replayed.

Candidates (GPU top-k): :meth:`Sampler.sample_candidates` gives the same token as :meth:`Sampler.sample`
from only the M best logits of the row (values and ids, as shaders/topk.comp returns them), whenever
M >= :meth:`Sampler.candidates_needed`: k (1 when greedy) plus the distinct penalized tokens; the
candidates are of the adjusted logits (the device adds the step 0 deltas before its top-k). A
penalty > 1 only lowers logits, so at least k unpenalized candidates beat every token outside the M; top-k
ties go to the lowest id on both paths, and what follows top-k sees the same (ids, values) in id order.
NaN logits count as -inf when selecting.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pydantic

from hmaclient import sampling as fields  # the one table of the sampling fields
from hmad.engine.sampling_schema import message, sampling_model

# Top-p buckets weights by 1/8 octave; float32 weights below 2^-150 are 0, so 8 * 151 buckets plus
# one for zeros cover them all.
_NUCLEUS_BUCKETS_PER_OCTAVE = 8
_NUCLEUS_LAST_BUCKET = 8 * 151
# The two-level draw splits the weights into blocks of this many entries (256 blocks at V = 262144).
_DRAW_BLOCK = 1024
_F32_MAX = np.float32(np.finfo(np.float32).max)


_CHECK = sampling_model("SamplingCheck", fields.OFF)


@dataclass
class SamplingParams:
    """What a request asks of the sampler. Each field's default is its "off" value from the one table of
    the sampling fields (``hmaclient.sampling``: a bare sampler), max_tokens the table's default; the
    daemon's defaults for requests are its config's ``sampling:`` section."""

    temperature: float = fields.OFF["temperature"]  # 0 => greedy
    top_k: int = fields.OFF["top_k"]  # 0 = off
    top_p: float = fields.OFF["top_p"]  # 1.0 = off
    min_p: float = fields.OFF["min_p"]  # 0 = off
    repetition_penalty: float = fields.OFF["repetition_penalty"]  # 1.0 = off
    repeat_last_n: int = fields.OFF["repeat_last_n"]  # prompt+generated tokens the penalty sees; 0 = off
    seed: int | None = fields.OFF["seed"]  # None => fresh entropy
    max_tokens: int = fields.OFF["max_tokens"]
    stop: list[str] = field(default_factory=list)
    presence_penalty: float = fields.OFF["presence_penalty"]  # 0 = off
    frequency_penalty: float = fields.OFF["frequency_penalty"]  # 0 = off
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> bias; ids as ints once validated
    logprobs: int | None = None  # alternatives each token reports (engine/logprobs.py); None: no logprobs
    prompt_logprobs: int | None = None  # alternatives each prompt token reports; None: none

    def __post_init__(self) -> None:
        if isinstance(self.logit_bias, Mapping) and not isinstance(self.logit_bias, dict):
            self.logit_bias = dict(self.logit_bias)  # the table's read-only default
        # Logits are float32: a positive temperature under its range (< ~1.4e-45, e.g. 1e-300) is 0 there,
        # and dividing by it gave NaN weights. Its limit is greedy, as in llama.cpp (a float temperature).
        if isinstance(self.temperature, float) and self.temperature > 0 and np.float32(self.temperature) == 0:
            self.temperature = 0.0

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """Build and validate from a config section or request; unknown keys raise ValueError naming them.

        ``stop`` may be given as one string or a list of strings.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(repr(k) for k in d if k not in known)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        values = dict(d)
        if isinstance(values.get("stop"), str):
            values["stop"] = [values["stop"]]
        elif "stop" in values and isinstance(values["stop"], Sequence):
            values["stop"] = list(values["stop"])
        params = cls(**values)
        params.validate()
        return params

    def validate(self) -> None:
        """Raise ValueError naming the first field out of range, with what it allows and the value (the
        wire's wording: "top_p must be a number in (0, 1], got 1.5"). The daemon runs it once per request,
        before the request reaches the engine; ``Sampler`` trusts it."""
        counts = ("logprobs", "prompt_logprobs")  # (not sampling fields)
        values = {k: v for k, v in vars(self).items() if k not in counts}
        try:
            _CHECK.model_validate(values)
        except pydantic.ValidationError as e:
            raise ValueError(message(e, values)[1]) from None
        for name in counts:
            wrong = fields.logprobs_problem(name, getattr(self, name))
            if wrong:
                raise ValueError(wrong)
        self.logit_bias = fields.stored("logit_bias", self.logit_bias)  # {int id: float}

    def check_vocab(self, vocab: int) -> None:
        """Raise ValueError when a logit_bias id is outside a vocabulary of ``vocab`` tokens (the wire
        cannot know it: the daemon checks it against its model)."""
        over = [t for t in self.logit_bias if not 0 <= int(t) < vocab]
        if over:
            raise ValueError(
                f"logit_bias token {over[0]} is outside the model's vocabulary of {vocab} tokens"
            )

    @property
    def adjusts(self) -> bool:
        """Whether the additive adjustments (pipeline step 0) change any logit."""
        return bool(self.logit_bias) or self.counts_matter

    @property
    def counts_matter(self) -> bool:
        """Whether the adjustments depend on the tokens generated so far (presence or frequency penalty)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


class Sampler:
    """Picks the next token of one request; owns that request's random generator.

    Not thread-safe; the engine thread calls it once per step for its sequence.
    """

    def __init__(self, params: SamplingParams):
        """``params`` validated (``SamplingParams.validate``, which the daemon and ``generate`` run at the
        edge, once per request)."""
        self.params = params
        # Resolve a None seed to concrete entropy now, so the seed used can be logged and replayed.
        self.seed: int = params.seed if params.seed is not None else int(np.random.SeedSequence().entropy)
        self.rng = np.random.Generator(np.random.PCG64(self.seed))
        self._ahead: collections.deque[float] = collections.deque()  # drawn by upcoming(), not used yet
        self._counted: list[int] | None = None  # the generated list the counts below are of (its owner's)
        self._counts: collections.Counter[int] = collections.Counter()
        self._n_counted = 0
        bias = {int(t): float(b) for t, b in params.logit_bias.items()}
        self._bias_ids = np.array(sorted(bias), dtype=np.int64)
        self._bias = np.array([bias[t] for t in sorted(bias)], dtype=np.float64)

    def upcoming(self, n: int) -> float:
        """The uniform the ``n``-th draw from now (0: the next) will use, drawn from the generator now if it
        was not yet; a pipelined step samples on the device with it before the host's own draw (engine/
        scheduler.py, "Pipelining"), and the host's draw then uses the same value."""
        while len(self._ahead) <= n:
            self._ahead.append(self.rng.random())
        return self._ahead[n]

    def draw_uniform(self) -> float:
        """The uniform of this request's next draw, used up (the one :meth:`upcoming` gave, if it did)."""
        return self._ahead.popleft() if self._ahead else self.rng.random()

    def adjustments(self, generated: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """(token ids int32 ascending, deltas float32): what pipeline step 0 adds to those logits, given the
        tokens generated so far in the request (module docstring); empty when nothing is adjusted. Counted
        incrementally while ``generated`` is the same growing list (a request's ``output_ids``)."""
        p = self.params
        if not p.adjusts:
            return np.empty(0, np.int32), np.empty(0, np.float32)
        ids, delta = self._bias_ids, self._bias
        if p.counts_matter and len(generated):
            counts = self._count(generated)
            seen = np.fromiter(counts.keys(), np.int64, len(counts))
            n = np.fromiter(counts.values(), np.float64, len(counts))
            ids = np.union1d(ids, seen)
            delta = np.zeros(ids.size)
            delta[np.searchsorted(ids, self._bias_ids)] = self._bias
            # the same float64 expression on every path, rounded once to float32 below
            delta[np.searchsorted(ids, seen)] -= p.presence_penalty + p.frequency_penalty * n
        keep = delta != 0.0
        return ids[keep].astype(np.int32), delta[keep].astype(np.float32)

    def _count(self, generated: Sequence[int]) -> collections.Counter[int]:
        """How often each token occurs in ``generated``, counting only what was added since the last call
        where it is the same list grown."""
        if generated is not self._counted or len(generated) < self._n_counted:
            self._counted = generated if isinstance(generated, list) else None
            self._counts, self._n_counted = collections.Counter(), 0
        self._counts.update(int(t) for t in generated[self._n_counted :])
        self._n_counted = len(generated)
        return self._counts

    def adjust(self, logits: np.ndarray, generated: Sequence[int] = ()) -> np.ndarray:
        """``logits`` (V,) plus the step 0 deltas, float32: a copy, or ``logits`` itself when none.
        Raises ValueError for a logit_bias id past the row (the daemon refuses those up front)."""
        ids, delta = self.adjustments(generated)
        if not ids.size:
            return logits
        if ids[-1] >= logits.size:
            raise ValueError(f"logit_bias token {ids[-1]} is outside the vocabulary of {logits.size} tokens")
        out = logits.astype(np.float32, copy=True)
        out[ids] += delta
        return out

    def sample(
        self, logits: np.ndarray, recent_tokens: Sequence[int] = (), generated: Sequence[int] = ()
    ) -> int:
        """Return the next token id for ``logits`` (V,), given the prompt+generated tokens so far
        (``recent_tokens``, for the repetition penalty) and the generated ones (``generated``, for the
        presence and frequency penalties).

        ``recent_tokens`` may be the whole history; only the last ``repeat_last_n`` are looked at.
        The caller's array is never modified.
        """
        return self.pick(self.prepare(logits, recent_tokens, generated))

    def prepare(
        self, logits: np.ndarray, recent_tokens: Sequence[int] = (), generated: Sequence[int] = ()
    ) -> np.ndarray:
        """Steps 0-1 on ``logits`` (V,): the row :meth:`pick` draws from, and the one a token's logprob is
        of (engine/logprobs.py). A copy when anything changed; the caller's array is never modified."""
        logits = np.asarray(logits)
        if logits.ndim != 1 or logits.size == 0:
            raise ValueError(f"logits must be a non-empty 1-D array, got shape {logits.shape}")
        return self._penalize(self.adjust(logits, generated), recent_tokens)

    def pick(self, logits: np.ndarray) -> int:
        """Steps 2-7 on a row :meth:`prepare` made: the token."""
        p = self.params
        if p.temperature == 0:
            return int(np.argmax(logits))
        ids, kept = _top_k(logits, p.top_k)  # ids None => every token, in id order
        return self._draw_from(ids, kept)

    def candidates_needed(self, recent_tokens: Sequence[int] = ()) -> int | None:
        """How many of the best logits :meth:`sample_candidates` needs to pick exactly what
        :meth:`sample` would (None: it needs the whole row: top-k off, or a penalty < 1, which raises
        logits)."""
        p = self.params
        seen = self._penalized(recent_tokens)
        if seen.size and p.repetition_penalty < 1.0:
            return None
        base = 1 if p.temperature == 0 else p.top_k
        return None if base <= 0 else base + int(seen.size)

    def sample_candidates(
        self, ids: np.ndarray, values: np.ndarray, recent_tokens: Sequence[int] = ()
    ) -> int:
        """The token :meth:`sample` would pick from the whole row, given its best logits ``values`` of
        token ``ids`` (at least :meth:`candidates_needed` of them, in any order), the step 0 adjustments
        already added (as the device adds them before its top-k)."""
        p = self.params
        order = np.argsort(ids, kind="stable")
        ids, values = np.asarray(ids)[order], np.asarray(values, dtype=np.float32)[order]
        seen = self._penalized(recent_tokens)
        if seen.size:
            hit = np.isin(ids, seen)
            values = values.copy()
            values[hit] = _penalty(values[hit], p.repetition_penalty)
        if p.temperature == 0:
            return int(ids[np.argmax(values)])
        pos, kept = _top_k(values, p.top_k)
        return self._draw_from(ids if pos is None else ids[pos], kept)

    def _draw_from(self, ids: np.ndarray | None, kept: np.ndarray) -> int:
        """Temperature, top-p, min-p and the draw over the top-k survivors (``ids`` None: every token)."""
        p = self.params
        weights = _softmax_weights(kept, p.temperature)
        if p.top_p < 1.0:
            keep = _nucleus(weights, p.top_p)
            ids, weights = _take(ids, keep), weights[keep]
        if p.min_p > 0.0:
            # Weights are probabilities scaled so the largest is 1: the threshold is min_p itself.
            keep = np.flatnonzero(weights >= p.min_p)
            ids, weights = _take(ids, keep), weights[keep]
        choice = _draw(weights, self.draw_uniform())
        return int(choice if ids is None else ids[choice])

    def _penalized(self, recent_tokens: Sequence[int]) -> np.ndarray:
        """The distinct token ids the repetition penalty applies to (empty when it is off)."""
        p = self.params
        if p.repetition_penalty == 1.0 or p.repeat_last_n == 0 or len(recent_tokens) == 0:
            return np.empty(0, dtype=np.int64)
        window = np.asarray(recent_tokens[-p.repeat_last_n :], dtype=np.int64)
        return np.unique(window)  # each token penalised once, however often it repeats

    def _penalize(self, logits: np.ndarray, recent_tokens: Sequence[int]) -> np.ndarray:
        """Apply the repetition penalty to a copy; return ``logits`` itself when there is nothing to do."""
        p = self.params
        seen = self._penalized(recent_tokens)
        if not seen.size:
            return logits
        out = logits.astype(np.float32, copy=True)
        out[seen] = _penalty(out[seen], p.repetition_penalty)
        return out


def _penalty(vals: np.ndarray, penalty: float) -> np.ndarray:
    """CTRL's penalty: positive logits divided by it, negative ones multiplied. A tiny penalty (> 0, as
    1e-300) would overflow float32 to inf, which no softmax takes: the result is capped at float32's max."""
    with np.errstate(over="ignore"):
        up = np.minimum(vals / np.float32(penalty) if np.float32(penalty) else np.inf, _F32_MAX)
    return np.where(vals > 0, up, vals * np.float32(penalty)).astype(np.float32)


def _top_k(logits: np.ndarray, k: int) -> tuple[np.ndarray | None, np.ndarray]:
    """(ids, their logits) of the k largest, ids ascending, equal values at the boundary taken lowest
    id first (NaN counts as -inf); (None, all logits) when k is off."""
    if k <= 0 or k >= logits.size:
        return None, logits
    neg = -np.where(np.isnan(logits), -np.inf, logits)
    # The k-th smallest of -logits: numpy's introselect with kth near the end degrades ~25x when the
    # rest are tied (a -inf mask, flat logits); with kth near the start it does not.
    thr = np.partition(neg, k - 1)[k - 1]
    above = np.flatnonzero(neg < thr)
    ids = np.concatenate([above, np.flatnonzero(neg == thr)[: k - above.size]])
    ids.sort()
    return ids, logits[ids]


def _softmax_weights(logits: np.ndarray, temperature: float) -> np.ndarray:
    """Unnormalised softmax of ``logits / temperature`` in float32, scaled so the largest weight is 1.

    Shifting before dividing keeps every exponent <= 0 for any T > 0; -inf logits get weight 0.
    """
    x = np.asarray(logits, dtype=np.float32)
    top = x.max()
    if not np.isfinite(top):
        raise ValueError(f"logits have no finite maximum (max is {top})")
    with np.errstate(over="ignore"):  # a tiny temperature: -inf, weight 0, which is its limit
        return np.exp((x - top) / np.float32(temperature))


def _nucleus(weights: np.ndarray, top_p: float) -> np.ndarray:
    """Indices (in no order) of the smallest most-probable set holding probability >= top_p, at least one.

    No full sort: weights (max 1) fall into buckets of 1/8 octave, ``floor(-8 * log2(w))``, heaviest
    first. Every bucket before the one where the cumulative mass reaches top_p is kept whole; only
    that boundary bucket is sorted, to keep its heaviest members until the target is met.
    """
    target = top_p * weights.sum(dtype=np.float64)
    with np.errstate(divide="ignore"):  # w == 0 => -log2 = inf => clipped into the last bucket
        key = np.minimum(np.log2(weights) * np.float32(-_NUCLEUS_BUCKETS_PER_OCTAVE), _NUCLEUS_LAST_BUCKET)
    key = key.astype(np.intp)  # bincount's own index type: no hidden conversion pass
    mass = np.bincount(key, weights=weights.astype(np.float64), minlength=_NUCLEUS_LAST_BUCKET + 1)
    cum = np.cumsum(mass)
    b = min(int(np.searchsorted(cum, target, side="left")), _NUCLEUS_LAST_BUCKET)
    need = target - (cum[b - 1] if b else 0.0)
    upto = np.flatnonzero(key <= b)
    upto_key = key[upto]
    edge = upto[upto_key == b]
    if not edge.size:  # the buckets' float64 sums fell a hair under target (top_p a hair under 1): all
        return upto
    edge_w = weights[edge]
    if edge_w.min() < edge_w.max():  # when all are tied (flat logits) any order will do: no sort
        order = np.argsort(-edge_w)
        edge, edge_w = edge[order], edge_w[order]
    # First position where the bucket's running mass covers what is still needed, inclusive;
    # rounding may leave its total a hair under, in which case the whole bucket is kept.
    cut = int(np.searchsorted(np.cumsum(edge_w, dtype=np.float64), need, side="left")) + 1
    return np.concatenate([upto[upto_key < b], edge[:cut]])


def _draw(weights: np.ndarray, u01: float) -> int:
    """Index drawn with probability proportional to ``weights``, by inverse CDF of one uniform.

    Two levels, so 262k weights cost one vectorised block sum plus two short cumsums rather than a
    full cumulative sum and search: find the block holding ``u``, then the entry inside it.
    """
    n = weights.size
    nblocks = -(-n // _DRAW_BLOCK)
    padded = np.zeros(nblocks * _DRAW_BLOCK, dtype=np.float32)
    padded[:n] = weights
    block_cdf = np.cumsum(padded.reshape(nblocks, _DRAW_BLOCK).sum(axis=1, dtype=np.float64))
    u = u01 * block_cdf[-1]
    # side="right": the pick satisfies cdf[i-1] <= u < cdf[i], so a zero-weight entry is never taken.
    b = _last_positive_at_most(block_cdf, int(np.searchsorted(block_cdf, u, side="right")))
    inner = padded[b * _DRAW_BLOCK : (b + 1) * _DRAW_BLOCK]
    inner_cdf = np.cumsum(inner, dtype=np.float64)
    below = block_cdf[b - 1] if b else 0.0
    i = int(np.searchsorted(inner_cdf, u - below, side="right"))
    return b * _DRAW_BLOCK + _last_positive_at_most(inner_cdf, i)


def _last_positive_at_most(cdf: np.ndarray, i: int) -> int:
    """``i``, or the last index with nonzero width if rounding pushed ``i`` past the end of the mass."""
    if i < cdf.size and cdf[i] > (cdf[i - 1] if i else 0.0):
        return i
    widths = np.diff(cdf, prepend=0.0)
    return int(np.flatnonzero(widths[: min(i, cdf.size - 1) + 1] > 0)[-1])


def _take(ids: np.ndarray | None, keep: np.ndarray) -> np.ndarray:
    """Map kept positions back to token ids (positions are ids when ``ids`` is None)."""
    return keep if ids is None else ids[keep]
