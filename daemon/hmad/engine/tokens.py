"""Taking each request's next token, and ending requests: the one place a request's events are made.

A step's output reaches a request here in one of three forms: a logits row (the host samples it, adding the
request's logit_bias and presence/frequency penalties itself), a row of on-device top-k candidates and the
row's log-sum-exp (the host draws from them), or an id the device picked (greedy); the device adds those
adjustments before the last two (engine/planning.py). Each token then goes through ``TokenTaker.accept``: end
of turn, the stream decoder, stop strings, the grammar, and the limits (max_tokens, the context). Every
request ends through ``finish``, ``fail`` or ``cancelled`` below, each setting it FINISHED and making its one
terminal event (done | error | cancelled); the scheduler never emits one for a request that is FINISHED
already, so each accepted request gets exactly one.

Failures: an exception while sampling, decoding or stop-matching one request's token ends that request
alone with an ``error`` event (code internal); the token events it produced before raising are dropped
(``TokenTaker.guarded``).

Logprobs: the logprobs of a request's token are of the row the sampler drew from (engine/logprobs.py): from
the row itself (``_sample_one``), or from the device's candidates and the row's log-sum-exp
(``sample_candidates``; engine/planning.py, ``needs_row``, says which); they ride on the token event that
carries the token's id (``with_logprobs``). A request with ``prompt_logprobs`` gets every row of its
prefill chunks (``Request.step_rows`` rows each, in either form): each row but the token's gives the logprob
of the prompt token after it (``prompt_entries``; from the device's candidates, the row's log-sum-exp and
its logit of that token, gathered on the device: ``StepBatch.targets``), collected on
``Request.prompt_logprobs`` for its ``done``.

Structured output: a request with a grammar (``Request.constraint``) needs its whole logits row, so a step
holding one reads the full rows back (``model.forward``) rather than the on-device argmax or top-k. Its
mask sets every token the grammar forbids to -inf before the sampler runs; end-of-turn is allowed only once
the JSON is complete, and the answer ends ("stop") as soon as the grammar allows nothing more. Running out
of max_tokens first ends it with "length" and ``schema_complete: false`` in its stats.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable

import numpy as np

from hmad.engine import logprobs
from hmad.engine.draw_rows import DRAW_ROWS_MIN, draw_rows
from hmad.engine.request import Event, Request, State

log = logging.getLogger("hmad.engine")


def ended(r: Request, reason: str) -> None:
    """Mark ``r`` FINISHED with ``reason`` (its terminal event is the caller's to make)."""
    r.state, r.finish_reason, r.t_done = State.FINISHED, reason, time.perf_counter()


def finish(r: Request, reason: str, events: list[Event]) -> list[Event]:
    """End ``r`` normally (``stop`` or ``length``): its last token events, then ``done`` (with the prompt's
    logprobs, when asked for)."""
    ended(r, reason)
    done = Event("done", r.id, finish_reason=reason, stats=r.stats(), prompt_logprobs=r.prompt_logprobs)
    return [*events, done]


def fail(r: Request, message: str, code: str = "internal") -> list[Event]:
    """End one request with an ``error`` (``internal`` unless said otherwise); the others go on."""
    ended(r, "error")
    return [Event("error", r.id, text=message, error_code=code)]


def cancelled(r: Request) -> Event:
    """End a cancelled request: its ``cancelled`` event."""
    ended(r, "cancelled")
    return Event("cancelled", r.id, stats=r.stats())


def with_logprobs(events: list[Event], entry: dict) -> list[Event]:
    """``events`` of one token, its logprobs ``entry`` on the token event that carries its id (none does
    when the token ends the turn, or a stop string cut it with no text before)."""
    for ev in events:
        if ev.kind == "token" and ev.token_ids:
            ev.logprobs = [entry]
    return events


def draws(r: Request) -> bool:
    """Whether ``r`` takes a token from its last row of this step: its prompt is cached (the step's
    ``n_cached``), not a prefill chunk of its prompt logprobs' before the last."""
    return r.n_cached >= len(r.prompt_ids)


class TokenTaker:
    """Turns a step's output into each request's token and events (module docstring)."""

    def __init__(self, eot: set[int], context: int):
        self.eot, self.context = eot, context
        self.tokens_out = 0  # tokens generated since start (status)
        self.recent_mask_s: collections.deque[float] = collections.deque(maxlen=256)  # per masked token

    # -- the three forms of a step's output -------------------------------------------------------------
    def sample(self, reqs: list[Request], logits: np.ndarray) -> list[Event]:
        """Host sampling from each request's logits rows (S_out, V): ``r.step_rows`` each, in order; the
        last is its token's when its prompt is cached by this step, the others its prompt logprobs'."""
        events, at = [], 0
        for r in reqs:
            rows, at = logits[at : at + r.step_rows], at + r.step_rows
            events += self.guarded(r, lambda r=r, rows=rows: self._take_rows(r, rows))
        if at != len(logits):
            raise ValueError(f"{len(logits)} logit rows for {at} wanted")
        return events

    def _take_rows(self, r: Request, rows: np.ndarray) -> list[Event]:
        """``r``'s rows of a step: prompt logprobs for each row that predicts a prompt token, then its
        token from the row of the prompt's last position (when this step computed it)."""
        n = r.params.prompt_logprobs
        self.prompt_entries(r, len(rows), lambda j, tok: logprobs.entry(rows[j], tok, n, r.token_text))
        return self._sample_one(r, rows[-1]) if draws(r) else []

    @staticmethod
    def prompt_entries(r: Request, n_rows: int, entry_of: Callable[[int, int], dict]) -> None:
        """``r``'s prompt logprobs from its ``n_rows`` rows of a step (they end at position ``r.n_cached``
        - 1): row ``j``, at position ``pos``, gives ``entry_of(j, prompt_ids[pos + 1])`` (the prompt's last
        position predicts no prompt token; planning.prompt_targets names the same tokens)."""
        n_prompt, first = len(r.prompt_ids), r.n_cached - n_rows  # the rows' first position
        if r.prompt_logprobs is None or first >= n_prompt - 1:
            return
        for pos in range(first, min(r.n_cached, n_prompt - 1)):
            r.prompt_logprobs.append(entry_of(pos - first, r.prompt_ids[pos + 1]))

    def _sample_one(self, r: Request, row: np.ndarray) -> list[Event]:
        if r.constraint is not None:  # structured output: the tokens its grammar forbids go to -inf
            t0 = time.perf_counter()
            row = r.constraint.mask(row)
            self.recent_mask_s.append(time.perf_counter() - t0)
        row = r.sampler.prepare(row, r.prompt_ids + r.output_ids, r.output_ids)  # adjusted here (sampling.py)
        tok = r.sampler.pick(row)
        if r.params.logprobs is None:
            return self.take(r, tok)
        return with_logprobs(self.take(r, tok), logprobs.entry(row, tok, r.params.logprobs, r.token_text))

    def sample_candidates(
        self,
        reqs: list[Request],
        ids: np.ndarray,
        vals: np.ndarray,
        lse: np.ndarray,
        targets: np.ndarray | None = None,
    ) -> list[Event]:
        """From each request's ``r.step_rows`` rows of on-device candidates (S_out, M), in order: its prompt
        logprobs (``prompt_entries``) from them, the rows' log-sum-exps (S_out,) and their ``targets``'
        logits (S_out,), then the host's draw from its last row's candidates, with its logprobs, when its
        prompt is cached by this step."""
        spans = np.cumsum([0] + [r.step_rows for r in reqs])
        if spans[-1] != len(ids):
            raise ValueError(f"{len(ids)} candidate rows for {spans[-1]} wanted")
        drawing = [(r, b - 1) for r, b in zip(reqs, spans[1:], strict=True) if draws(r)]
        last = [j for _, j in drawing]
        drawn = dict(
            zip(last, self.drawn_together([r for r, _ in drawing], ids[last], vals[last]), strict=True)
        )
        events = []
        for r, a, b in zip(reqs, spans[:-1], spans[1:], strict=True):
            rows = (ids[a:b], vals[a:b], lse[a:b], None if targets is None else targets[a:b])
            events += self.guarded(
                r, lambda r=r, rows=rows, b=b: self._take_candidates(r, *rows, drawn.get(b - 1))
            )
        return events

    def _take_candidates(
        self, r: Request, ids: np.ndarray, vals: np.ndarray, lse: np.ndarray, targets, tok: int | None
    ) -> list[Event]:
        """``r``'s rows of candidates of a step: its prompt logprobs, then its token from the last row
        (``tok``: drawn already) when this step cached its prompt."""
        n = r.params.prompt_logprobs
        self.prompt_entries(
            r,
            len(ids),
            lambda j, t: logprobs.entry_from_target(
                ids[j], vals[j], float(lse[j]), t, targets[j], n, r.token_text
            ),
        )
        return self._take_candidate(r, ids[-1], vals[-1], lse[-1], tok) if draws(r) else []

    def _take_candidate(
        self, r: Request, ids: np.ndarray, vals: np.ndarray, lse: np.float32, tok: int | None
    ) -> list[Event]:
        """``r``'s token drawn from its candidates (``tok``: drawn already), with its logprobs entry."""
        tok = self.draw(r, ids, vals, tok)
        if r.params.logprobs is None:
            return self.take(r, tok)
        entry = logprobs.entry_from_candidates(ids, vals, float(lse), tok, r.params.logprobs, r.token_text)
        return with_logprobs(self.take(r, tok), entry)

    def take_ids(self, reqs: list[Request], ids: np.ndarray, dropped: set[int] = frozenset()) -> list[Event]:
        """The device's picks (S_out,), one per request."""
        events = []
        for r, tok in zip(reqs, ids.tolist(), strict=True):
            # a pipelined step's row of a request that ended, or whose row is redone, meanwhile
            if r.state is State.FINISHED or r.id in dropped:
                continue
            events += self.guarded(r, lambda r=r, tok=tok: self.take(r, int(tok)))
        return events

    @staticmethod
    def draw(r: Request, ids: np.ndarray, vals: np.ndarray, tok: int | None = None) -> int:
        """The host's draw from ``r``'s candidates (``tok``: made already, by ``drawn_together``)."""
        return r.sampler.sample_candidates(ids, vals, r.prompt_ids + r.output_ids) if tok is None else tok

    @staticmethod
    def drawn_together(reqs: list[Request], ids: np.ndarray, vals: np.ndarray) -> list[int | None]:
        """The host's draws from rows of candidates (S, M) that ``draw_rows`` takes at once, None for the
        others (and for all when there are too few rows for it to pay, or it fails): the same tokens."""
        if len(reqs) < DRAW_ROWS_MIN:
            return [None] * len(reqs)
        try:
            return draw_rows([r.sampler for r in reqs], ids, vals)
        except Exception:
            log.exception("drawing %d rows together failed; drawing them one by one", len(reqs))
            return [None] * len(reqs)

    def guarded(self, r: Request, work: Callable[[], list[Event]]) -> list[Event]:
        """``work()``'s events; if it raises (sampler, decoder, stop matcher), only ``r`` ends, with an error
        (the token events it produced before raising are dropped with it)."""
        try:
            return work()
        except Exception as e:
            log.exception("request %d failed while taking its token", r.id)
            return fail(r, f"taking the next token failed: {type(e).__name__}: {e}")

    # -- one token -------------------------------------------------------------------------------------
    def take(self, r: Request, tok: int) -> list[Event]:
        """``r``'s prompt is cached: ``tok`` is its next token."""
        r.state = State.DECODE
        return self.accept(r, tok)

    def accept(self, r: Request, tok: int) -> list[Event]:
        """``tok`` through end of turn, decoder, stop strings, grammar and limits: its events."""
        now = time.perf_counter()
        r.t_first = r.t_first or now
        if tok in self.eot:
            return finish(r, "stop", self._flush(r, [], ""))
        r.output_ids.append(tok)
        self.tokens_out += 1
        if r.constraint is not None:
            r.constraint.accept(tok)
        text, hit = r.stops.feed(r.decoder.feed(tok))
        if hit:
            return finish(r, "stop", [Event("token", r.id, text, [tok])] if text else [])
        if r.constraint is not None and r.constraint.stopped:  # the JSON is whole: nothing may follow
            return finish(r, "stop", self._flush(r, [tok], text))
        if len(r.output_ids) >= r.params.max_tokens or len(r.prompt_ids) + len(r.output_ids) >= self.context:
            return finish(r, "length", self._flush(r, [tok], text))
        return [Event("token", r.id, text, [tok])]

    @staticmethod
    def _flush(r: Request, ids: list[int], text: str) -> list[Event]:
        """The last token event: ``text`` plus whatever the decoder and stop matcher still hold."""
        held, hit = r.stops.feed(r.decoder.flush())
        text += held + ("" if hit else r.stops.flush())
        return [Event("token", r.id, text, ids)] if text or ids else []
