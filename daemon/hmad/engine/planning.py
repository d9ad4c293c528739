"""Step planning: which sequences and chunks go into a step, and where its tokens are picked.

``StepPlanner.plan`` gives one decode token to every decoding sequence first, then prefill chunks (at most
``max_chunk`` tokens each) to the others in order of admission, while the step's ``step_tokens`` budget
lasts; each part takes the KV blocks its positions need (``KVCacheManager.prepare``). A chunk never ends
inside an image's soft tokens, which see each other (engine/images.py). A pipelined plan
(engine/scheduler.py, "Pipelining") also decodes the sequences the step in flight gives a token, their
input fed on the device, except those that token ends by length.

Where the tokens are picked (engine/scheduler.py, "Which tokens the device picks"): by the device's argmax
when every request of the step is greedy without logprobs (``greedy_ok``); from the device's top-k
candidates when every request needs at most ``topk_max`` of them (``candidates_needed``); else from full
logits rows on the host, as for every step holding a request that ``needs_row``: a grammar, or logprobs the
candidates cannot give. A request's logprobs come from its candidates and its row's log-sum-exp, both
reduced on the device (engine/logprobs.py), when it has no repetition penalty (the device's sum is of the
row before it) and wants at most ``topk_max`` candidates, its alternatives too. So do its prompt's
(``prompt_logprobs``, every row of its prefill chunks: ``prompt_rows``), each prompt token's logit gathered
on the device from the row before it too (``SeqSlice.targets``: ``prompt_targets``), since it is seldom
among the candidates.

A request's additive adjustments (logit_bias, presence and frequency penalties: engine/sampling.py, step 0)
ride on its part's slice (``SeqSlice.bias``) into the step, where the device adds them before its argmax
or top-k; a step whose adjustments outnumber what the backend's tails take (``bias_max``) reads full rows
instead, and the host adds them. Presence and frequency penalties depend on the tokens generated so far,
which a pipelined step does not know yet: a request with either is never pipelined (a logit_bias alone is).
"""

from __future__ import annotations

import numpy as np

from hmad.core.batch import SAMPLE_DTYPE, SeqSlice
from hmad.engine import images
from hmad.engine.kvcache import KVCacheManager
from hmad.engine.request import Request, State

Part = tuple[Request, SeqSlice, list[int], bool]  # request, its slice, its input ids, wants logits
# Prompt tokens a step prefills of a request with prompt logprobs, each position's row wanted: on the
# device's top-k path a row of candidates each, but whole rows where a step reads them (a backend without
# top-k, a grammar or repetition penalty in the step): 64 rows of Gemma 3's 262,144 logits are 64 MiB a step
# (docs/protocol.md, "Logprobs").
PROMPT_ROWS_MAX = 64


def greedy_ok(r: Request) -> bool:
    """Whether the device's argmax is ``r``'s token (greedy, no repetition penalty, no grammar, no logprobs:
    those come from the top-k path; the additive adjustments the device adds first, where it can:
    ``StepPlanner._bias_fits``)."""
    p = r.params
    return p.temperature == 0 and p.repetition_penalty == 1.0 and p.logprobs is None and not needs_row(r)


def needs_row(r: Request, topk_max: int = 0) -> bool:
    """Whether ``r``'s rows must come whole to the host: a grammar masks them, or it wants logprobs (of its
    tokens, or of its prompt's while it prefills: ``prompt_rows``) that a backend's ``topk_max`` candidates,
    the row's log-sum-exp and its target's logit cannot give (``candidates_needed``; engine/logprobs.py)."""
    if r.constraint is not None:
        return True
    if r.params.logprobs is None and not prompt_rows(r):
        return False
    n = candidates_needed(r)
    return n is None or n > topk_max


def candidates_needed(r: Request) -> int | None:
    """How many of its row's best logits ``r``'s token needs (its sampler's count: engine/sampling.py,
    "Candidates"), its logprobs' alternatives too, and its prompt's while it prefills (``prompt_rows``);
    None: the whole row (top-k off, a penalty < 1, or logprobs with a repetition penalty, which the
    device's log-sum-exp is not of)."""
    p = r.params
    n = r.sampler.candidates_needed(r.prompt_ids + r.output_ids)
    counts = [c for c in (p.logprobs, p.prompt_logprobs if prompt_rows(r) else None) if c is not None]
    if not counts or n is None:
        return n
    return None if p.repetition_penalty != 1.0 else max(n, *counts, 1)


def prompt_rows(r: Request) -> bool:
    """Whether ``r``'s prefill reads every position's row (its prompt logprobs), not only the last one's."""
    return r.params.prompt_logprobs is not None and r.state is State.PREFILL


def prompt_targets(r: Request, pos0: int, n: int) -> np.ndarray:
    """The prompt token each of ``r``'s rows at positions ``pos0 .. pos0 + n - 1`` predicts (row ``pos``:
    ``prompt_ids[pos + 1]``, its prompt logprob's token: TokenTaker.prompt_entries), -1 past the prompt's
    last (its row draws the first generated token) (n,) int32."""
    pos = np.arange(pos0 + 1, pos0 + n + 1)
    ids = np.asarray(r.prompt_ids, np.int32)
    return np.where(pos < len(ids), ids[np.minimum(pos, len(ids) - 1)], -1).astype(np.int32)


def device_sampling(wanting: list[Request], fed: dict[int, int]) -> np.ndarray:
    """Each logit row's sampling for the device; a request fed from the step in flight has that step's
    draw still to make on the host, so its row takes the uniform after it."""
    out = np.zeros(len(wanting), SAMPLE_DTYPE)
    for i, r in enumerate(wanting):
        p = r.params
        if p.temperature > 0:
            u = r.sampler.upcoming(1 if r.id in fed else 0)
            out[i] = (p.temperature, p.top_k, p.top_p, p.min_p, u)
    return out


class StepPlanner:
    """Plans each step over the running set, within the token budget (module docstring)."""

    def __init__(self, model, kv: KVCacheManager, step_tokens: int, max_chunk: int, context: int):
        self.model, self.kv = model, kv
        self.step_tokens, self.max_chunk, self.context = step_tokens, max_chunk, context

    def plan(
        self, running: list[Request], fed: dict[int, int], drafts: dict[int, list[int]] | None = None
    ) -> list[Part]:
        """(request, slice, input ids, wants logits) for this step, decode first, within the budget. The
        sequences in ``fed`` (request id -> its row in the step in flight) decode the token that step gives
        them (the id is a placeholder 0: the device feeds it), except those that token ends by length. A
        decoding sequence in ``drafts`` (request id -> draft tokens: engine/speculation) feeds its drafts
        after its last token, a logits row for each position (``SeqSlice.all_rows``)."""
        budget = self.step_tokens
        parts = []
        order = sorted(running, key=lambda r: r.state is not State.DECODE and r.id not in fed)
        for r in order:
            if budget <= 0:
                break
            if r.id in fed and not self._goes_on(r):
                continue
            chunk = min(self.max_chunk, budget, PROMPT_ROWS_MAX if prompt_rows(r) else budget)
            toks = [0] if r.id in fed else r.next_input(chunk)
            drafted = bool(drafts) and r.id in drafts and r.state is State.DECODE and r.id not in fed
            if drafted:
                toks = toks + drafts[r.id][: chunk - 1]
            if r.images and r.state is State.PREFILL:  # never ending inside an image (engine/images.py)
                toks = toks[: images.chunk_end(r.images, r.n_cached, len(toks))]
                if not toks:
                    continue  # its image does not fit this step's budget: the next step's
            # a fed row of a sampling request may be computed again a position back (_redo_fed_row)
            keep = int(r.id in fed and not greedy_ok(r))
            tables = self.kv.prepare(r.id, r.n_cached, len(toks), keep_back=keep)
            s = SeqSlice(r.id, 0, len(toks), r.n_cached, tables.global_table, tables.local_table)
            done_prompt = (
                r.id in fed or r.state is State.DECODE or r.n_cached + len(toks) == len(r.prompt_ids)
            )
            if done_prompt and r.params.adjusts:
                s.bias = r.sampler.adjustments(r.output_ids)
            if r.images and r.state is State.PREFILL:
                s.visible = images.visible(r.images, r.n_cached, len(toks))
                s.embeds = images.embeds(r.images, r.n_cached, len(toks))
            s.all_rows = r.id not in fed and prompt_rows(r)
            if s.all_rows:
                s.targets = prompt_targets(r, r.n_cached, len(toks))
            s.all_rows = s.all_rows or drafted
            r.step_rows = len(toks) if s.all_rows else 1  # its logit rows (TokenTaker.sample)
            parts.append((r, s, toks, done_prompt or s.all_rows))
            budget -= len(toks)
        for r, _, toks, _ in parts:
            r.n_cached += len(toks)
        return parts

    def image_problem(self, r: Request) -> str | None:
        """Why ``r``'s images can never be prefilled here (a chunk holds a whole image), or None."""
        big = max((s.n for s in r.images), default=0)
        room = min(self.max_chunk, self.step_tokens)
        if r.params.prompt_logprobs is not None:
            room = min(room, PROMPT_ROWS_MAX)
        if big <= room:
            return None
        why = "engine.max_chunk / engine.step_tokens"
        if room == PROMPT_ROWS_MAX:
            why = "prompt_logprobs' chunks"
        return f"an image's {big} soft tokens go into one step, and this daemon's hold {room} ({why})"

    def _goes_on(self, r: Request) -> bool:
        """Whether the token the step in flight gives ``r`` leaves room for another (max_tokens, context)."""
        n = len(r.output_ids) + 1
        return n < r.params.max_tokens and len(r.prompt_ids) + n < self.context

    # -- where the tokens are picked -------------------------------------------------------------------
    def can_pipeline(self, running: list[Request], enabled: bool) -> bool:
        """Whether the next step may be launched before the one in flight is read."""
        return (
            enabled
            and getattr(self.model.backend, "pipelined", False)
            and bool(running)
            and all(self._on_device(r) for r in running)
            and self._bias_fits(running)
        )

    def _bias_fits(self, reqs: list[Request]) -> bool:
        """Whether the device can add every request's adjustments in one step (``bias_max``); an id outside
        the vocabulary goes to the host, whose sampler fails that request alone, naming it."""
        ids = [r.sampler.adjustments(r.output_ids)[0] for r in reqs if r.params.adjusts]
        if not ids:
            return True
        vocab = self.model.config.vocab_size
        n = sum(len(i) for i in ids)
        return n <= getattr(self.model.backend, "bias_max", 0) and all(i[-1] < vocab for i in ids if i.size)

    def _on_device(self, r: Request) -> bool:
        """Whether the device can pick ``r``'s tokens in a pipelined step (never with logprobs: the sample
        tail reads back no log-sum-exp)."""
        if r.params.counts_matter:  # its next step's deltas count the token the step in flight gives it
            return False
        if r.params.logprobs is not None:
            return False
        if greedy_ok(r):
            return True
        be, p = self.model.backend, r.params
        return (
            self.max_chunk > 1  # the local ring has room to redo a position (KVCacheManager.prepare)
            and getattr(be, "sample_on_device", False)
            and not needs_row(r)
            and p.repetition_penalty == 1.0
            and 0 < p.top_k <= getattr(be, "topk_max", 0)
        )

    def greedy_on_device(self, reqs: list[Request]) -> bool:
        """Whether the backend can pick every token of this step itself (all greedy, no penalty)."""
        return (
            bool(reqs)
            and getattr(self.model.backend, "greedy_on_device", False)
            and all(greedy_ok(r) for r in reqs)
            and self._bias_fits(reqs)
        )

    def topk_on_device(self, reqs: list[Request]) -> bool:
        """Whether every token of this step (and its logprobs) can be taken from the backend's on-device
        top-k candidates and row log-sum-exps (no request ``needs_row``; each needs at most that many
        candidates: ``candidates_needed``)."""
        m = getattr(self.model.backend, "topk_max", 0)
        if not (reqs and m) or any(needs_row(r, m) for r in reqs) or not self._bias_fits(reqs):
            return False
        needs = [candidates_needed(r) for r in reqs]
        return all(n is not None and n <= m for n in needs)
