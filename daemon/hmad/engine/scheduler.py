"""The step scheduler: continuous batching over a paged KV cache.

Each ``step()``:
  1. retire   - drop cancelled requests, free their KV blocks;
  2. admit    - move waiting requests to running while a sequence slot and their KV budget are free,
                owners in turn, each owner's in order (engine/admission.py, which states the wait's bound);
                a prompt starting with blocks its tenant cached (engine/kvcache.py) skips their prefill;
  3. plan     - one decode token for every decoding sequence (and its drafts, when it speculates:
                engine/speculation), then prefill chunks of the others while the step's token budget
                lasts; each takes the KV blocks its positions need (engine/planning.py);
  4. forward  - one batched forward pass, logits only for rows that produce a token;
  5. commit   - blocks the step filled are registered in the prefix cache;
  6. sample   - per request: [json mask] -> sampler -> stream decoder -> stop strings -> limits; events out
                (engine/tokens.py, which makes every request's events, its one terminal event included);
                a speculating sequence's rows one by one while they give its drafts, the positions of
                the rest rolled back before the commit (engine/speculation/speculator.py);
  7. release  - finished requests give their blocks back (full ones stay cached until evicted).
Requests join and leave between steps; nothing a request does changes another's tokens.

Failures: an exception while sampling, decoding or stop-matching one request's token ends that request
alone with an ``error`` event (code internal). An exception from the forward pass (step 4, or building
its batch) ends every request of that step with an ``error`` event and frees their blocks; none is
retried (the step may have half-written their KV blocks); requests waiting, or running outside the step,
go on. A backend that raises ``BackendUnusable`` can run no further step: that propagates, and the engine
thread fails everything (engine/worker.py). So does an exception while retiring, admitting or planning
(bookkeeping), as the scheduler's state can no longer be trusted.

Pipelining (``SchedulerConfig.pipeline``, on by default; backends that are ``pipelined``): while every
running request's token can be picked on the device, ``step()`` launches step n + 1 *before* it reads step
n's token ids, and the host's work on step n (sampling, decoding, stop strings, events, the next plan) runs
while the device computes step n + 1. Step n + 1 is planned as if every sequence of step n goes on: a row
that produced a token in step n decodes in step n + 1, its input token taken on the device from step n's
ids (``StepBatch.feed``); a sequence whose token in step n ends it by length is left out. One that step n
ends otherwise (end of turn, a stop string) or that is cancelled meanwhile computes one row too many in step
n + 1: the row is dropped, its KV blocks are freed, nothing is committed from it. A step that needs host
logits (a grammar, a repetition penalty, top-k off) waits for the step in flight first; so does every
step while a request that may speculate runs within ``speculation.max_batch`` (engine/speculation: its
drafts come from the tokens of the step in flight; its rows come whole to the host, or only their argmax
when every request of the step is greedy without adjustments). The device runs the
steps in submission order, so KV blocks freed on the host while a step is in flight are only rewritten by
later steps.

Which tokens the device picks: greedy requests' (temperature 0, no repetition penalty, no grammar, no
logprobs) by its argmax; with ``sample_on_device`` also sampling requests with top_k within the backend's
``topk_max``, no repetition penalty, no grammar and no logprobs: their step (``launch_sampled``) draws each
row's token on the device from its top-k candidates with the uniform the request's sampler will use for that
token (``Sampler.upcoming``: one draw ahead while its step n is in flight). The host then draws the token
itself from the same candidates and uniform (``Sampler.sample_candidates``, as a step run alone would; a
step's rows at once where there are a few, engine/draw_rows.py, to the same tokens), and its token is the
request's: where the device's differs (a rounding edge: float32 there, float64 here), the row that the
device's token fed in step n + 1 is dropped and its position computed again in the next step
(``draws_corrected`` counts them). So a request gets the same tokens pipelined or not, alone or in any mix.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from hmad.core.batch import StepBatch
from hmad.core.errors import BackendUnusable, HmadError
from hmad.engine.admission import FairQueue
from hmad.engine.images import ImageEncoder
from hmad.engine.kvcache import KVCacheManager, KVLayout
from hmad.engine.planning import Part, StepPlanner, device_sampling, greedy_ok
from hmad.engine.request import Event, Request, State
from hmad.engine.speculation import SpeculationConfig, Speculator
from hmad.engine.tokens import TokenTaker, cancelled, fail

log = logging.getLogger("hmad.engine")


class QueueFull(HmadError):
    """The waiting queue is at its configured length and no other owner gives up a place
    (engine/admission.py): the caller should answer ``busy``."""


class RequestRejected(HmadError):
    """A request that can never run (prompt too long for the context or the KV cache)."""


class RequestInvalid(HmadError):
    """A request whose own settings cannot run (its json_schema's grammar fails on this vocabulary)."""


@dataclass
class SchedulerConfig:
    max_seqs: int = 16  # sequences decoded together
    step_tokens: int = 512  # token budget of one step (decode tokens + prefill chunks)
    max_chunk: int = 512  # longest prefill chunk of one sequence in one step
    kv_tokens: int = 32768  # cached positions over all sequences
    block_size: int = 16
    max_queue: int = 256
    context_length: int = 0  # 0: the model's
    prefix_cache: bool = True  # reuse the KV blocks of earlier prompts' shared prefixes
    pipeline: bool = True  # launch the next greedy step before reading this one's ids (module docstring)
    # drafts checked in one step per sequence (engine/speculation; the config's speculation: section)
    speculation: SpeculationConfig = field(default_factory=SpeculationConfig)


@dataclass
class Flight:
    """A launched step whose ids are not read yet (Pipelining)."""

    parts: list[Part]
    wanting: list[Request]  # in logit-row order
    launched: Any  # the backend's handle
    t0: float
    sampled: bool = False  # drawn on the device (launch_sampled): the host checks each token
    dropped: set[int] = field(default_factory=set)  # requests whose row here is dropped (a corrected draw)

    @cached_property
    def rows(self) -> dict[int, int]:
        """Request id -> its row of the step's ids."""
        return {r.id: i for i, r in enumerate(self.wanting)}

    def feeds(self) -> dict[int, int]:
        """``rows`` of the requests whose token from here feeds the next step (not ``dropped``)."""
        return {k: v for k, v in self.rows.items() if k not in self.dropped}


class Scheduler:
    """Owns the running set, the waiting queue and the KV block tables; drives ``model.forward``. What goes
    into a step is ``planner``'s (engine/planning.py); what its tokens do, ``tokens``' (engine/tokens.py)."""

    def __init__(self, model, cfg: SchedulerConfig | None = None):
        self.model, self.cfg = model, cfg or SchedulerConfig()
        mc = model.config
        self.context = min(self.cfg.context_length or mc.context_length, mc.context_length)
        self.layout = KVLayout.plan(
            mc, self.cfg.kv_tokens, self.cfg.max_seqs, self.cfg.max_chunk, self.cfg.block_size
        )
        model.backend.alloc_kv(self.layout)
        self.kv = KVCacheManager(self.layout, prefix_cache=self.cfg.prefix_cache)
        self.planner = StepPlanner(model, self.kv, self.cfg.step_tokens, self.cfg.max_chunk, self.context)
        self.tokens = TokenTaker(set(model.tokenizer.eot_ids), self.context)
        c = self.cfg
        self.speculator = Speculator(c.speculation, self.kv, c.step_tokens, c.max_chunk)
        self.images = ImageEncoder(lambda px: model.encode_images(px))
        self.waiting = FairQueue()
        self.running: list[Request] = []
        self._cancelled: set[int] = set()
        self.recent_batches: collections.deque[int] = collections.deque(maxlen=32)
        self.recent_step_s: collections.deque[float] = collections.deque(maxlen=32)
        self.recent_forward_s: collections.deque[float] = collections.deque(maxlen=32)
        self.steps = 0
        self.flight: Flight | None = None  # the step launched and not yet collected (Pipelining)
        self.pipelined_steps = 0
        self.draws_corrected = 0  # device-drawn tokens the host's draw replaced (Pipelining)
        self._t_collected = 0.0

    @property
    def tokens_out(self) -> int:
        """Tokens generated since start."""
        return self.tokens.tokens_out

    # -- requests in -----------------------------------------------------------------------------------
    def submit(self, req: Request) -> list[Event]:
        """Queue a request; raises RequestRejected (never fits) or QueueFull (try later). Returns the
        ``busy`` events of the requests it displaced from a full queue (engine/admission.py)."""
        req.params.max_tokens = max(1, min(req.params.max_tokens, self.context - len(req.prompt_ids)))
        if not req.prompt_ids:
            raise RequestRejected("empty prompt")
        if len(req.prompt_ids) >= self.context:
            raise RequestRejected(
                f"prompt of {len(req.prompt_ids)} tokens does not fit the context of {self.context}"
            )
        if not self.kv.fits_ever(req.n_positions):
            raise RequestRejected(
                f"prompt + max_tokens ({req.n_positions} positions) exceeds the KV cache "
                f"({self.cfg.kv_tokens} positions)"
            )
        full = len(self.waiting) >= self.cfg.max_queue
        if full and not self.waiting.can_make_room_for(req.owner):
            raise QueueFull(f"{len(self.waiting)} requests waiting")
        try:
            req.start(self.model.tokenizer)
        except ValueError as e:
            raise RequestInvalid(str(e)) from None
        if req.images:
            problem = self.planner.image_problem(req)
            if problem:
                raise RequestInvalid(problem)
            if not self.images.fits_waiting(req.images, self.waiting):
                raise QueueFull(self.images.waiting_message())
        events = self._make_room(req) if full else []
        self.waiting.append(req)
        return events

    def _make_room(self, req: Request) -> list[Event]:
        """Another owner's newest waiting request leaves the full queue to ``req`` (engine/admission.py):
        it ends ``busy``, as if the queue had been full when it came."""
        r = self.waiting.make_room_for(req.owner)
        msg = f"{self.cfg.max_queue} requests waiting; this one gave its place to another connection's"
        return fail(r, msg, "busy")

    def cancel(self, request_id: int) -> None:
        """Cancel at the next step boundary (a cancelled event is emitted then)."""
        self._cancelled.add(request_id)

    def prepare(self) -> None:
        """Have the backend make ready every step shape this configuration can produce (the daemon calls
        this before READY: a GPU backend records its buckets then, not on first use)."""
        self.model.backend.prepare(self.model.net, self.cfg.step_tokens, self.cfg.max_seqs)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._cancelled or self.flight)

    # -- the step --------------------------------------------------------------------------------------
    def step(self) -> list[Event]:
        events = self._retire_cancelled()
        self._admit()
        events += self._encode_admitted()
        if self.flight is not None:
            return events + self._step_pipelined()
        drafts = self.speculator.propose(self.running)
        parts = self.planner.plan(self.running, {}, drafts)
        if parts and not drafts and self._pipelining():
            events += self._launch(parts, None)
            if self.flight is not None:
                return events + self._step_pipelined()
        elif parts:
            t0 = time.perf_counter()
            self.steps += 1
            try:
                events += self._forward_and_sample(parts, drafts)
            except BackendUnusable:
                raise
            except Exception as e:  # the step's KV may be half written: nothing of it goes into the cache
                events += self._fail_step([r for r, *_ in parts], e)
            else:
                self._commit(parts)
            self.recent_batches.append(len(parts))
            self.recent_step_s.append(time.perf_counter() - t0)
        self._release_finished()
        return events

    def _retire_cancelled(self) -> list[Event]:
        if not self._cancelled:
            return []
        events = [cancelled(r) for r in (*self.waiting, *self.running) if r.id in self._cancelled]
        self.waiting.remove_if(lambda r: r.state is State.FINISHED)
        self._cancelled.clear()
        self._release_finished()
        return events

    def _admit(self) -> None:
        """Waiting requests join the running set while a slot is free and their KV fits, in turn
        (engine/admission.py)."""
        while self.waiting and len(self.running) < self.cfg.max_seqs:
            req = self.waiting.peek()
            reused = self.kv.admit(req.id, req.n_positions, req.cache_ids(0, len(req.prompt_ids)), req.tenant)
            if reused is None:
                break  # it keeps its turn: later requests wait behind it rather than starve it
            self.waiting.pop()
            req.n_cached = req.n_reused = reused
            req.state = State.PREFILL
            self.running.append(req)

    def _encode_admitted(self) -> list[Event]:
        """The images of requests just admitted go through the vision tower (engine/images.py: each file
        once, cached by digest), before any chunk of theirs is planned; a failure ends that request alone."""
        events = []
        for r in self.running:
            if r.state is State.PREFILL and any(s.features is None for s in r.images):
                try:
                    self.images.encode(r.images)
                except Exception as e:  # noqa: BLE001 - this request's images, not the engine's end
                    log.exception("request %d: its images could not be encoded", r.id)
                    events += fail(r, f"encoding its images failed: {type(e).__name__}: {e}")
        self._release_finished()
        return events

    def _forward_and_sample(self, parts: list[Part], drafts: dict[int, list[int]]) -> list[Event]:
        batch = StepBatch.build([(s, toks, want) for _, s, toks, want in parts], self.layout.block_size)
        wanting = [r for r, _, _, want in parts if want]
        if drafts:  # verified from each row's pick (engine/speculation/speculator.py)
            if self.planner.greedy_on_device(wanting) and not any(r.params.adjusts for r in wanting):
                ids = self._forward(self.model.forward_argmax, batch)  # (S_out,): a token a logits row
                return self.speculator.take_ids(self.tokens, wanting, ids, drafts)
            return self.speculator.take(
                self.tokens, wanting, self._forward(self.model.forward, batch), drafts
            )  # whole rows (S_out, V) to the host
        if self.planner.greedy_on_device(wanting):
            return self.tokens.take_ids(wanting, self._forward(self.model.forward_argmax, batch))  # (S_out,)
        if self.planner.topk_on_device(wanting):
            return self.tokens.sample_candidates(
                wanting, *self._forward(self.model.forward_topk, batch)
            )  # (S_out, M) ids and values, (S_out,) log-sum-exps and targets' logits (prompt logprobs)
        return self.tokens.sample(wanting, self._forward(self.model.forward, batch))  # logits (S_out, V)

    def _forward(self, fn, batch: StepBatch):
        """``fn(batch)``, timed: the forward pass (device work and its wait) apart from the host work."""
        t0 = time.perf_counter()
        out = fn(batch)
        self.recent_forward_s.append(time.perf_counter() - t0)
        return out

    def _fail_step(self, reqs: list[Request], e: Exception) -> list[Event]:
        """Step ``self.steps`` raised: every request in it ends with an error, those that had finished while
        it was being sampled too (the step's events are lost with the exception)."""
        log.exception("step %d failed; failing its %d request(s): %s", self.steps, len(reqs), e)
        msg = f"the forward pass of step {self.steps} failed: {type(e).__name__}: {e}"
        return [ev for r in reqs for ev in fail(r, msg)]

    def _commit(self, parts: list[Part]) -> None:
        """Register in the prefix cache the blocks each part's step filled (its slice's positions are
        written, those of drafts not kept aside: ``r.n_cached``)."""
        for r, s, _, _ in parts:
            self.kv.commit(r.id, min(s.end_pos, r.n_cached), r.cache_ids)

    def _release_finished(self) -> None:
        for r in self.running:
            if r.state is State.FINISHED:
                self.kv.release(r.id)
                self.speculator.release(r.id)
        self.running = [r for r in self.running if r.state is not State.FINISHED]

    # -- pipelining (module docstring) ------------------------------------------------------------------
    _device_sampling = staticmethod(device_sampling)  # each row's draw for the device (tests skew it here)

    def _pipelining(self) -> bool:
        """Whether the next step may be launched before the one in flight is read."""
        return self.planner.can_pipeline(self.running, self.cfg.pipeline) and not self.speculator.active(
            self.running
        )

    def _step_pipelined(self) -> list[Event]:
        """Launch the next step (if it can go ahead unread), then collect the one in flight."""
        flight, self.flight = self.flight, None
        events = []
        if self._pipelining():
            parts = self.planner.plan(self.running, flight.feeds())
            if parts:
                events += self._launch(parts, flight)
        events += self._collect(flight)
        self._release_finished()
        return events

    def _launch(self, parts: list[Part], prev: Flight | None) -> list[Event]:
        """Start a step whose tokens the device picks; its rows fed from ``prev``'s ids where ``prev``
        produced their token."""
        rows = prev.feeds() if prev else {}
        feed = [rows.get(r.id, -1) for r, *_ in parts] if rows else None
        wanting = [r for r, _, _, want in parts if want]
        sampled = not all(greedy_ok(r) for r in wanting)
        self.steps += 1
        self.recent_batches.append(len(parts))
        try:
            sampling = self._device_sampling(wanting, rows) if sampled else None
            batch = StepBatch.build(
                [(s, t, w) for _, s, t, w in parts], self.layout.block_size, feed, sampling
            )
            launched = (self.model.launch_sampled if sampled else self.model.launch_argmax)(batch)
        except BackendUnusable:
            raise
        except Exception as e:  # as a failed step: its requests end (those in flight too: skipped there)
            return self._fail_step([r for r, *_ in parts], e)
        self.flight = Flight(parts, wanting, launched, time.perf_counter(), sampled)
        self.pipelined_steps += bool(prev)
        return []

    def _collect(self, f: Flight) -> list[Event]:
        """Read a launched step's ids and take them; requests cancelled or failed since it was launched are
        skipped (no token, no commit: their blocks are freed already)."""
        live = [p for p in f.parts if p[0].state is not State.FINISHED]
        t0 = time.perf_counter()
        try:
            ids = self.model.backend.collect(f.launched)
            cands = self.model.backend.candidates(f.launched) if f.sampled else None
        except BackendUnusable:
            raise
        except Exception as e:
            return self._fail_step([r for r, *_ in live], e)
        now = time.perf_counter()
        self.recent_forward_s.append(now - t0)  # the wait for the device
        if cands:
            events = self._take_drawn(f, ids, *cands)
        else:
            events = self.tokens.take_ids(f.wanting, ids, f.dropped)
        self._commit([p for p in live if p[0].id not in f.dropped])
        self.recent_step_s.append(now - max(f.t0, self._t_collected))  # collect to collect while busy
        self._t_collected = time.perf_counter()
        return events

    def _take_drawn(self, f: Flight, ids: np.ndarray, cids: np.ndarray, cvals: np.ndarray) -> list[Event]:
        """A ``sampled`` flight's tokens: the host's own draw from each row's candidates (module docstring,
        "Which tokens the device picks"); where it differs from the device's, the row the device's token fed
        in the step launched since is dropped, and that position is computed again."""
        live = [i for i, r in enumerate(f.wanting) if r.state is not State.FINISHED and r.id not in f.dropped]
        drawn = self.tokens.drawn_together([f.wanting[i] for i in live], cids[live], cvals[live])
        events = []
        for i, tok in zip(live, drawn, strict=True):
            r = f.wanting[i]
            events += self.tokens.guarded(
                r, lambda r=r, i=i, tok=tok: self._take_checked(r, cids[i], cvals[i], int(ids[i]), tok)
            )
        return events

    def _take_checked(
        self, r: Request, ids: np.ndarray, vals: np.ndarray, device_tok: int, tok: int | None
    ) -> list[Event]:
        """The host's draw from ``r``'s candidates, against ``device_tok``, the token the device drew from
        them and fed on (redone where it differs: ``_redo_fed_row``)."""
        tok = self.tokens.draw(r, ids, vals, tok)
        if tok != device_tok:
            self._redo_fed_row(r)
        return self.tokens.take(r, tok)

    def _redo_fed_row(self, r: Request) -> None:
        """The device fed ``r`` a token the host did not draw: drop its row in the step in flight (if it has
        one) and give its position back to the next plan (whose window blocks the plan kept held)."""
        self.draws_corrected += 1
        if self.flight is not None and r.id in self.flight.rows:
            if not self.kv.can_rewrite(r.id, r.n_cached - 1):
                raise RuntimeError(
                    f"position {r.n_cached - 1} cannot be computed again: its window is released"
                )
            self.flight.dropped.add(r.id)
            r.n_cached -= 1

    # -- status ----------------------------------------------------------------------------------------
    def status(self) -> dict:
        mask_s = self.tokens.recent_mask_s
        return {
            "running": len(self.running),
            "queued": len(self.waiting),
            "recent_batch_sizes": list(self.recent_batches),
            "step_ms": round(1e3 * sum(self.recent_step_s) / max(1, len(self.recent_step_s)), 3),
            # of which the forward pass (submit and wait on a GPU; pipelined: the wait for the step launched
            # a step earlier); the rest is host work: batch, sampling, detokenization, stop strings, events
            # (pipelined: beside the next step on the device)
            "forward_ms": round(1e3 * sum(self.recent_forward_s) / max(1, len(self.recent_forward_s)), 3),
            "steps": self.steps,
            # of which launched before the step ahead of them was read (engine.pipeline)
            "pipelined_steps": self.pipelined_steps,
            # of the tokens drawn on the device in pipelined steps, those the host's own draw replaced
            "draws_corrected": self.draws_corrected,
            # drafts checked and kept (engine/speculation)
            "speculation": self.speculator.status(self.running),
            "json_mask_ms": round(1e3 * sum(mask_s) / max(1, len(mask_s)), 4),
            "kv": self.kv.usage(),
            # images run through the vision tower, and the encoded images kept by digest (engine/images.py)
            "images": {
                "encoded": self.images.encoded,
                "encode_ms": self.images.last_ms,
                **self.images.cache.usage(),
            },
        }
