"""Which sequences speculate, their drafts, the verification of a step's rows, and the KV rollback.

A step (engine/scheduler.py) asks ``propose`` for the drafts of the running sequences; a decoding sequence
with drafts d_1..d_k feeds ``[last token, d_1, .., d_k]`` and gets a logits row for each of the k + 1
positions (engine/planning.py, ``StepPlanner.plan``'s ``drafts``). ``take`` (whole rows) or ``take_ids``
(the device's argmax of each row: a step of greedy requests without adjustments) then walks a sequence's
rows in order: row j's token is taken exactly as a step without speculation takes one (engine/tokens.py: the
grammar mask, the sampler with every setting of the request, stop strings, limits), and the walk goes on
to row j + 1 only while that token is d_(j+1) and the request is not finished. So:

- greedy: the longest prefix of drafts that equals the target's argmax, plus the target's next token;
- sampled: row j's token is drawn from the target's p (the request's sampling applied); keeping d_(j+1)
  when the draw is d_(j+1) is the standard rejection rule for a draft distribution q one-hot on d_(j+1)
  (accept with probability min(1, p(d)/q(d)) = p(d); else draw from max(0, p - q), renormalized: p
  without d), and all k accepted, the last row's draw is the bonus token. Each emitted token uses one
  uniform of the request's generator, as without speculation, so a seed gives the same tokens either way
  whenever the logits are the same (engine.deterministic).

The positions of the rejected drafts go back (``KVCacheManager.rollback``); the scheduler commits to the
prefix cache only the positions kept (``Request.n_cached`` after ``take``).

Not speculated (module ``eligible``): requests asking for logprobs (their logprobs come from the device's
candidates without speculation; full rows here could differ in the last bits), requests with
``speculate`` false, and every request while more than ``max_batch`` sequences run. A request whose
remaining max_tokens leave no room (k <= max_tokens left - 1) is not drafted for past its end.

k adapts per sequence: it starts at ``k_max``, halves when a step accepts none of its drafts and doubles
(up to ``k_max``) when a step accepts them all.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hmad.engine.kvcache import KVCacheManager
from hmad.engine.request import Event, Request, State
from hmad.engine.speculation.config import SpeculationConfig
from hmad.engine.speculation.lookup import Drafter, LookupDrafter


@dataclass
class SpeculationStats:
    steps: int = 0  # verifications of a sequence's drafts
    drafted: int = 0  # draft tokens checked
    accepted: int = 0  # of which kept
    rolled_back: int = 0  # KV positions given back (the drafts not kept)


class Speculator:
    """The drafts of each step and their verification (module docstring)."""

    def __init__(
        self,
        cfg: SpeculationConfig,
        kv: KVCacheManager,
        step_tokens: int,
        max_chunk: int,
        drafter: Drafter | None = None,
    ):
        self.cfg, self.kv, self.step_tokens = cfg, kv, step_tokens
        self.k_max = max(0, min(cfg.k_max, max_chunk - 1, step_tokens - 1))
        # mode draft: engine/speculation/draft_model.py's drafter, attached once its model is loaded
        lookup = LookupDrafter(cfg.ngram_min, cfg.ngram_max) if cfg.mode == "lookup" else None
        self.drafter = drafter or lookup
        self.k: dict[int, int] = {}  # request id -> its current k
        self.stats = SpeculationStats()

    def eligible(self, r: Request) -> bool:
        """Whether ``r`` may speculate (module docstring, "Not speculated"), the batch aside."""
        on = self.cfg.on and self.drafter is not None and self.k_max > 0
        return on and r.speculate and r.params.logprobs is None

    def active(self, running: list[Request]) -> bool:
        """Whether a step of ``running`` may speculate (then the scheduler does not pipeline it)."""
        return len(running) <= self.cfg.max_batch and any(self.eligible(r) for r in running)

    def propose(self, running: list[Request]) -> dict[int, list[int]]:
        """Request id -> its drafts for this step, for the decoding sequences that have some."""
        if not self.active(running):
            return {}
        self.k = {r.id: self.k.get(r.id, self.k_max) for r in running if self.eligible(r)}
        budget = self.step_tokens - len(running)  # every decoding sequence keeps its one token
        if hasattr(self.drafter, "propose_batch"):  # a draft model: k tokens each, drafted all at once
            return self._propose_batch(running, budget)
        drafts = {}
        for r in running:
            if r.state is not State.DECODE or r.id not in self.k:
                continue
            k = min(self.k[r.id], r.params.max_tokens - len(r.output_ids) - 1, budget)
            d = self.drafter.propose(r, k)[:k] if k > 0 else []
            if d:
                drafts[r.id] = d
                budget -= len(d)
        return drafts

    def _propose_batch(self, running: list[Request], budget: int) -> dict[int, list[int]]:
        wanted = []
        for r in running:
            if r.state is State.DECODE and r.id in self.k:
                k = max(0, min(self.k[r.id], r.params.max_tokens - len(r.output_ids) - 1, budget))
                wanted.append((r, k))
                budget -= k
        return {i: d for i, d in self.drafter.propose_batch(wanted).items() if d}

    def release(self, request_id: int) -> None:
        """The request ended (the scheduler released it): what the drafter holds for it goes too."""
        self.k.pop(request_id, None)
        if hasattr(self.drafter, "release"):
            self.drafter.release(request_id)

    def close(self) -> None:
        """A draft model's backend closed (the target's unload)."""
        if hasattr(self.drafter, "close"):
            self.drafter.close()

    def take(
        self, tokens, reqs: list[Request], logits: np.ndarray, drafts: dict[int, list[int]]
    ) -> list[Event]:
        """Each request's token(s) from its ``r.step_rows`` logits rows (S_out, V), in order: a drafted
        request's verified (``_verify``), the others' as ``tokens.sample`` takes them."""
        return self._walk(reqs, logits, drafts, lambda r, rows: tokens.sample([r], rows), "logit rows")

    def take_ids(
        self, tokens, reqs: list[Request], ids: np.ndarray, drafts: dict[int, list[int]]
    ) -> list[Event]:
        """As :meth:`take`, from the device's pick of each row (S_out,): greedy requests without
        adjustments (the scheduler's choice), whose rows then never come whole to the host."""
        return self._walk(reqs, ids, drafts, lambda r, rows: tokens.take_ids([r], rows), "picked rows")

    def _walk(self, reqs: list[Request], rows: np.ndarray, drafts: dict[int, list[int]], take, what: str):
        """``take(r, its rows)`` for each request over its ``r.step_rows`` of ``rows`` (logits rows or
        picked ids), a drafted request's one row at a time through ``_verify``."""
        events, at = [], 0
        for r in reqs:
            mine, at = rows[at : at + r.step_rows], at + r.step_rows
            d = drafts.get(r.id)
            one = lambda j, r=r, mine=mine: take(r, mine[j : j + 1])  # noqa: E731
            events += self._verify(one, r, len(mine), d) if d else take(r, mine)
        if at != len(rows):
            raise ValueError(f"{len(rows)} {what} for {at} wanted")
        return events

    def _verify(self, take, r: Request, n_rows: int, drafts: list[int]) -> list[Event]:
        """``r``'s tokens from its ``n_rows`` = k + 1 rows of a step that fed it its last token and
        ``drafts``: ``take(j)`` takes row j's token as without speculation, and the next row is read while
        it is the draft there."""
        drafts = drafts[: n_rows - 1]
        n0 = r.n_cached - n_rows  # the position of its last token, the step's first
        events, m = [], 0
        r.step_rows = 1
        for j in range(n_rows):
            before = len(r.output_ids)
            events += take(j)
            hit = j < len(drafts) and len(r.output_ids) > before and r.output_ids[-1] == drafts[j]
            m += hit
            if not hit or r.state is State.FINISHED:
                break
        self._roll_back(r, n0 + 1 + m)
        st = self.stats
        st.steps, st.drafted, st.accepted = st.steps + 1, st.drafted + len(drafts), st.accepted + m
        st.rolled_back += len(drafts) - m
        k = self.k.get(r.id, self.k_max)
        self.k[r.id] = max(1, k // 2) if m == 0 else min(self.k_max, 2 * k) if m == len(drafts) else k
        return events

    def _roll_back(self, r: Request, n: int) -> None:
        """``r`` keeps positions < ``n``: the rest (its rejected drafts') go back to the KV cache."""
        if r.state is not State.FINISHED:  # (a finished one gives all its blocks back at release)
            self.kv.rollback(r.id, n)
        r.n_cached = n

    def status(self, running: list[Request]) -> dict:
        st = self.stats
        ks = [self.k[r.id] for r in running if r.id in self.k]
        return {
            "mode": self.cfg.mode,
            "k_max": self.k_max,
            "max_batch": self.cfg.max_batch,
            "steps": st.steps,
            "drafted": st.drafted,
            "accepted": st.accepted,
            "rolled_back": st.rolled_back,
            "acceptance_rate": round(st.accepted / st.drafted, 4) if st.drafted else 0.0,
            "mean_k": round(sum(ks) / len(ks), 3) if ks else 0.0,  # of the running sequences that may
            "mean_drafts": round(st.drafted / st.steps, 3) if st.steps else 0.0,  # per verification
            **({"draft": self.drafter.describe()} if hasattr(self.drafter, "describe") else {}),
        }
