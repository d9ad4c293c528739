"""The socket loop: a ZMQ ROUTER on ipc://, validating requests and streaming the engine's events back.

One thread runs this loop; it never computes. It polls two sockets: the ROUTER (clients) and an inproc
PULL the engine thread pokes after it publishes events. Per request it keeps the routing (peer identity,
client id, stream flag) and, for non-streaming requests, the text so far.

Guarantees:
- a malformed frame gets one ``error`` reply (or, if it cannot even be attributed, is dropped) and the loop
  carries on;
- nothing one request does ends the loop: an exception while handling it (tokenizer, chat template,
  parameters, status) becomes that request's one ``error`` reply (``bad_request`` for text the vocabulary
  cannot encode, else ``internal`` naming the exception), logged once with its traceback; so does an
  exception while turning one engine event into a reply;
- every accepted request gets exactly one terminal reply (done, error or cancelled) and nothing after it;
- a peer that has gone (ROUTER_MANDATORY raises EHOSTUNREACH) has its requests cancelled; the engine frees
  their slots and KV blocks at its next step;
- a slow peer's replies queue in its own outbox so it never stalls the others; all outboxes together hold
  at most ``max_reply_bytes``: past it, every peer over its share (the cap over the peers with replies
  queued) is disconnected from the loop's side and its requests cancelled;
- a peer whose connection ends (closed, killed, or silent past the heartbeat timeout: hmad/peers.py) has
  its requests cancelled at once, whatever they are doing (waiting, prefilling, generating unstreamed);
- connections past ``max_connections`` (or ``max_connections_per_uid`` of one user) are closed;
  requests past ``max_in_flight_per_connection`` (one connection) or ``max_in_flight_per_uid`` (every
  connection of one user) are refused ``busy``;
- tokenizing, rendering and schema checks run on the intake thread (hmad/intake.py), never on the loop:
  a generate is answered ``accepted`` (or its refusal) once that work is done;
- while the model loads (no engine attached yet) the socket already answers: ``status`` shows the load's
  progress, ``ping`` says ``state: loading``, a ``generate`` gets ``error`` code ``loading``.
- every reply carries the protocol version of the request it answers (a version-1 client never sees 2).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import time
from dataclasses import dataclass, field

import zmq

from hmaclient import protocol as P
from hmad.core.errors import UnencodableText
from hmad.engine.metrics import Metrics
from hmad.engine.request import Event, Request
from hmad.engine.sampling import SamplingParams
from hmad.engine.structured import check_schema, compile_schema
from hmad.engine.worker import EngineThread
from hmad.intake import Intake
from hmad.model.chat import render_chat, render_prompt
from hmad.outbox import Outboxes
from hmad.peers import Peers

log = logging.getLogger("hmad.server")

POLL_MS = 50
BACKLOG = 32  # connections the kernel holds before hmad accepts them
SNDHWM = 1000  # frames in one peer's zmq pipe; the rest wait in its outbox (counted in max_reply_bytes)
FLUSH_AFTER_DRAIN_S = 1.0  # after the drain's deadline, replies still unsent this long are dropped


@dataclass
class Route:
    """Where a request's replies go, and what a non-streaming request has produced so far."""

    peer: bytes
    client_id: object
    stream: bool
    v: int  # the request's protocol version, which every reply to it carries
    uid: int | None = None  # the peer's user (SO_PEERCRED), None if unknown
    preparing: bool = False  # on the intake thread, not yet accepted
    cancel_asked: bool = False  # cancelled while preparing: answered ``cancelled`` once prepared
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


class PromptTooLong(ValueError):
    """The prompt cannot fit the context (answered ``prompt_too_long``)."""


class Server:
    """Serves one model: owns the ROUTER socket, the routes and the drain state."""

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        engine: EngineThread,
        model,
        defaults: SamplingParams,
        max_in_flight: int,
        heartbeat_ivl_s: float = 1.0,
        heartbeat_timeout_s: float = 5.0,
        max_frame_bytes: int = P.MAX_FRAME_BYTES,
        status_extra=None,
        loading_status=None,
        max_connections: int = 1024,
        max_connections_per_uid: int | None = None,
        max_per_connection: int = 1 << 20,
        max_per_uid: int = 1 << 20,
        max_reply_bytes: int = 256 << 20,
    ):
        self.engine, self.model, self.defaults = engine, model, defaults
        self.loading_status = loading_status or (lambda: {})  # what status shows while engine is None
        self.max_in_flight = max_in_flight
        self.max_per_connection, self.max_per_uid = max_per_connection, max_per_uid
        self.max_reply_bytes = max_reply_bytes
        self.max_frame_bytes = max_frame_bytes
        self.status_extra = status_extra or (lambda: {})
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self.sock.setsockopt(zmq.SNDHWM, SNDHWM)
        self.sock.setsockopt(zmq.LINGER, 0)  # at close, what a peer has not read is dropped
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_ivl_s * 1000))
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_timeout_s * 1000))
        self.sock.setsockopt(zmq.HEARTBEAT_TTL, int(heartbeat_timeout_s * 1000))
        self.sock.setsockopt(zmq.BACKLOG, BACKLOG)
        # before bind: every connection is seen
        self.peers = Peers(self.sock, max_connections, max_connections_per_uid)
        self.sock.bind(endpoint)
        self.wake_pull = ctx.socket(zmq.PULL)
        self.wake_pull.bind(f"inproc://hmad-wake-{id(self)}")
        self._wake_push = ctx.socket(zmq.PUSH)
        self._wake_push.connect(f"inproc://hmad-wake-{id(self)}")
        self.intake = Intake(ctx, f"inproc://hmad-wake-{id(self)}")
        self.routes: dict[int, Route] = {}
        self.by_client: dict[tuple[bytes, object], int] = {}
        self.per_peer: collections.Counter = collections.Counter()  # routes of each peer
        self.per_uid: collections.Counter = collections.Counter()  # routes of each known uid
        self.outboxes = Outboxes(self.sock, max_reply_bytes)
        self.next_rid = 1
        self.draining, self.drain_cancelled = False, False
        self.drain_deadline = 0.0
        self.started = time.time()
        self.counters = collections.Counter()
        self.metrics = Metrics()  # the engine thread writes its step timings here too
        self.forward_s, self.events_forwarded = 0.0, 0  # time the loop spends per reply (pack + send)

    # -- engine side -----------------------------------------------------------------------------------
    def attach(self, engine: EngineThread, model) -> None:
        """The model is loaded: serve generations from now on."""
        self.model, self.engine = model, engine

    def wake(self) -> None:
        """Called by the engine thread after publishing events (zmq sockets are not thread-safe: the PUSH
        is used from the engine thread only)."""
        with contextlib.suppress(zmq.Again):  # wake-ups already pending: one is enough
            self._wake_push.send(b"", zmq.NOBLOCK)

    # -- the loop --------------------------------------------------------------------------------------
    def serve(self, tick=lambda: False) -> None:
        """Run until drained (after ``begin_drain``) or until ``tick()``, called every loop, returns True."""
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.wake_pull, zmq.POLLIN)
        poller.register(self.peers.monitor, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(POLL_MS))
            if tick():  # after the poll: a signal that interrupted it is seen before any new request
                break
            if self.wake_pull in ready:
                self._drain_wake()
            self._connections()
            self._prepared()
            self._forward_events()
            if self.sock in ready:
                self._read_requests()
            self._flush_outboxes()
            if self.draining and self._drained():
                break

    def _drain_wake(self) -> None:
        try:
            while True:
                self.wake_pull.recv(zmq.NOBLOCK)
        except zmq.Again:
            pass

    def _connections(self) -> None:
        """Connections accepted and ended since the last turn: the ended ones' requests are cancelled."""
        for peer in self.peers.on_monitor():
            if peer in self.per_peer or peer in self.outboxes:
                log.info("peer %s disconnected: cancelling its requests", peer.hex())
                self._peer_gone(peer)

    def _read_requests(self, budget: int = 256) -> None:
        for _ in range(budget):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            peer = frames[0].bytes
            conn = self.peers.note(peer, frames[-1])
            if conn is None:  # its connection's events may still be on their way: read them, look again
                self._connections()
                conn = self.peers.note(peer, frames[-1])
            if len(frames) != 2:  # a DEALER's message is one frame
                self.counters["bad_envelope"] += 1
                msg = f"a request is one frame; this message had {len(frames) - 1}"
                self._send(peer, P.error(None, P.BAD_REQUEST, msg))
                continue
            self._handle(peer, frames[1].bytes, None if conn is None else conn.uid)

    def _handle(self, peer: bytes, frame: bytes, uid: int | None = None) -> None:
        try:
            req = P.parse_request(frame, max_size=self.max_frame_bytes)
        except P.ProtocolError as e:
            self.counters["bad_request"] += 1
            self.metrics.request_refused(e.code)
            self._send(peer, e.reply())
            return
        handler = {
            P.GenerateRequest: self._generate,
            P.CancelRequest: self._cancel,
            P.StatusRequest: self._status,
            P.PingRequest: self._ping,
            P.MetricsRequest: self._metrics,
        }[type(req)]
        first_rid = self.next_rid
        try:
            if handler == self._generate:
                handler(peer, req, uid)
            else:
                handler(peer, req)
        except Exception as e:  # a bug or a failure of this request alone: its error, never the loop's end
            self._request_failed(peer, req, e, first_rid)

    def _request_failed(self, peer: bytes, req, e: Exception, first_rid: int) -> None:
        """Answer a request whose handler raised with one ``internal`` error (after ``accepted``, if it got
        that far: its route ends and the engine drops it); log the traceback once."""
        log.exception("%s %r from peer %s failed", type(req).__name__, req.id, peer.hex())
        self.counters["internal"] += 1
        msg = f"hmad failed on this request: {type(e).__name__}: {e}"
        reply = P.error(req.id, P.INTERNAL, msg, v=req.v)
        started = [rid for rid in range(first_rid, self.next_rid) if rid in self.routes]
        try:
            for rid in started:
                if not self.routes[rid].preparing:
                    self.engine.cancel(rid)
                self.metrics.request_ended("error", P.INTERNAL)
                self._end(rid, reply)
            if not started:
                if isinstance(req, P.GenerateRequest):
                    self.metrics.request_refused(P.INTERNAL)
                self._send(peer, reply)
        except Exception:  # the reply itself cannot be sent (e.g. the socket is closing)
            log.exception("could not answer %s %r with an error", type(req).__name__, req.id)

    # -- request types ---------------------------------------------------------------------------------
    def _generate(self, peer: bytes, req, uid: int | None = None) -> None:
        key = (peer, req.id)
        if self.draining:
            return self._refuse(peer, req, P.SHUTTING_DOWN, "hmad is shutting down")
        if self.engine is None:
            msg = f"hmad is loading its model ({self.loading_status().get('phase', '')}); retry when ready"
            return self._refuse(peer, req, P.LOADING, msg)
        if req.id is not None and key in self.by_client:
            return self._refuse(peer, req, P.BAD_REQUEST, f"request id {req.id!r} is already active")
        busy = self._over_limit(peer, uid)
        if busy:
            return self._refuse(peer, req, P.BUSY, busy)
        rid = self.next_rid
        self.next_rid += 1
        self._add_route(rid, Route(peer, req.id, req.stream, req.v, uid, preparing=True))
        self.intake.submit(rid, lambda: self._prepare(req))  # accepted (or refused) once prepared

    def _over_limit(self, peer: bytes, uid: int | None) -> str | None:
        """Why a new request of this peer would be one too many in flight, or None."""
        if len(self.routes) >= self.max_in_flight:
            return f"{len(self.routes)} requests in flight; retry later"
        if self.per_peer[peer] >= self.max_per_connection:
            return (
                f"this connection has {self.per_peer[peer]} requests in flight "
                f"(server.max_in_flight_per_connection); retry when one ends"
            )
        if uid is not None and self.per_uid[uid] >= self.max_per_uid:
            return (
                f"user {uid} has {self.per_uid[uid]} requests in flight (server.max_in_flight_per_uid); "
                f"retry when one ends"
            )
        return None

    def _prepared(self) -> None:
        """Requests the intake thread has prepared: accepted and queued in the engine, or refused."""
        for rid, prepared, exc in self.intake.results():
            route = self.routes.get(rid)
            if route is None:  # its peer went away meanwhile
                continue
            route.preparing = False
            try:
                self._admit(rid, route, prepared, exc)
            except Exception as e:  # noqa: BLE001 - that request's error, never the loop's end
                log.exception("request %d could not be admitted", rid)
                self.metrics.request_refused(P.INTERNAL)
                self._end(rid, P.error(route.client_id, P.INTERNAL, f"{type(e).__name__}: {e}", v=route.v))

    def _admit(self, rid: int, route: Route, prepared, exc: BaseException | None) -> None:
        refusal = self._refusal(exc) if exc is not None else None
        if refusal is None and route.cancel_asked:
            refusal = "cancelled"
        if refusal is None and self.draining:
            refusal = (P.SHUTTING_DOWN, "hmad is shutting down")
        if refusal == "cancelled":
            self.metrics.request_ended("cancelled", "cancel")
            return self._end(rid, P.cancelled(route.client_id, 0, v=route.v))
        if refusal is not None:
            self.metrics.request_refused(refusal[0])
            return self._end(rid, P.error(route.client_id, *refusal, v=route.v))
        ids, params, grammar = prepared
        conn = self.peers.by_peer.get(route.peer)
        log.info(
            "request %d (id %r, %d prompt tokens) from uid %s pid %s",
            rid,
            route.client_id,
            len(ids),
            route.uid,
            None if conn is None else conn.pid,
        )
        self._send(route.peer, P.accepted(route.client_id, rid, v=route.v))
        request = Request(rid, ids, params, tag=(route.peer, route.client_id), grammar=grammar)
        request.owner, request.tenant = route.peer, route.uid
        self.engine.submit(request)

    def _refusal(self, e: BaseException) -> tuple[str, str]:
        """The (code, message) a request whose preparation raised ``e`` is refused with."""
        if isinstance(e, PromptTooLong):
            return P.PROMPT_TOO_LONG, str(e)
        if isinstance(e, UnencodableText):
            self.counters["unencodable"] += 1
            return P.BAD_REQUEST, str(e)
        if isinstance(e, ValueError):  # the chat template's, SamplingParams' or the schema's checks
            return P.BAD_REQUEST, str(e)
        log.error("preparing a request failed", exc_info=e)
        self.counters["internal"] += 1
        return P.INTERNAL, f"hmad failed on this request: {type(e).__name__}: {e}"

    def _prepare(self, req) -> tuple[list[int], SamplingParams, str | None]:
        """Prompt ids, sampling parameters and the json_schema's grammar; raises PromptTooLong,
        UnencodableText or ValueError (naming the problem)."""
        params = SamplingParams(**{**vars(self.defaults), **req.sampling()})
        params.validate()
        grammar = None if req.json_schema is None else compile_schema(req.json_schema)
        if grammar is not None:  # against this model's vocabulary: fails here, not mid-request
            check_schema(grammar, self.model.tokenizer)
        if req.messages is not None:
            text = render_chat(req.messages)
        else:
            text = req.prompt if req.raw else render_prompt(req.prompt)
        tok, context = self.model.tokenizer, self.engine.scheduler.context
        if tok.max_token_chars and len(text) > tok.max_token_chars * context:  # surely too long: skip
            raise PromptTooLong(  # tokenizing it (seconds for a MAX_PROMPT_CHARS prompt)
                f"the prompt of {len(text)} characters is at least {-(-len(text) // tok.max_token_chars)} "
                f"tokens; the context holds {context}"
            )
        ids = tok.encode(text)
        if len(ids) >= context:
            raise PromptTooLong(f"the prompt is {len(ids)} tokens; the context holds {context}")
        return ids, params, grammar

    def _refuse(self, peer: bytes, req, code: str, message: str) -> None:
        """Answer a request with ``error`` before accepting it (a refused generate is counted)."""
        if isinstance(req, P.GenerateRequest):
            self.metrics.request_refused(code)
        self._send(peer, P.error(req.id, code, message, v=req.v))

    def _cancel(self, peer: bytes, req) -> None:
        rid = self.by_client.get((peer, req.id))
        if rid is None:  # (while loading there are no routes: every cancel lands here)
            return self._refuse(peer, req, P.NOT_FOUND, f"no active request with id {req.id!r}")
        if self.routes[rid].preparing:
            self.routes[rid].cancel_asked = True
            return
        self.engine.cancel(rid)

    def _status(self, peer: bytes, req) -> None:
        self._send(peer, P.status(req.id, self.status(), v=req.v))

    def _ping(self, peer: bytes, req) -> None:
        self._send(peer, P.pong(req.id, time.time(), "loading" if self.engine is None else "ready", v=req.v))

    def _metrics(self, peer: bytes, req) -> None:
        """The counters, and what the engine and the backend report once they are there (the engine is
        attached after the server is made)."""
        server = {
            "in_flight": len(self.routes),
            "uptime_s": round(time.time() - self.started, 3),
            **self.connection_status(),
        }
        snapshot, memory = {}, {}
        if self.engine is not None and self.model is not None:
            backend = self.model.backend
            server["info"] = {
                "model": self.model.config.name or self.model.path,
                "backend": backend.name,
                "device": str(backend.device),
            }
            snapshot, memory = dict(self.engine.snapshot), backend.describe().get("memory", {})
        self._send(peer, P.metrics(req.id, self.metrics.families(snapshot, server, memory), v=req.v))

    def status(self) -> dict:
        if self.engine is None:
            return {
                "state": "loading",
                **self.loading_status(),
                "uptime_s": round(time.time() - self.started, 1),
                "draining": self.draining,
                **self.connection_status(),
            }
        snap = dict(self.engine.snapshot)
        return {
            "state": "ready",
            "model": self.model.path,
            "model_name": self.model.config.name,
            "backend": self.model.backend.name,
            "device": self.model.backend.device,
            "deterministic": bool(getattr(self.model.backend, "deterministic", False)),
            "memory": self.model.backend.describe().get("memory", {}),
            "context_length": self.engine.scheduler.context,
            "running": snap.get("running", 0),
            "queued": snap.get("queued", 0),
            "in_flight": len(self.routes),
            "recent_batch_sizes": snap.get("recent_batch_sizes", []),
            "step_ms": snap.get("step_ms", 0.0),
            "forward_ms": snap.get("forward_ms", 0.0),  # of step_ms: the forward pass; the rest is host work
            "json_mask_ms": snap.get("json_mask_ms", 0.0),
            "steps": snap.get("steps", 0),
            "pipelined_steps": snap.get("pipelined_steps", 0),  # of steps: engine.pipeline's
            "draws_corrected": snap.get("draws_corrected", 0),  # device draws the host's replaced
            "server_us_per_reply": round(1e6 * self.forward_s / max(1, self.events_forwarded), 2),
            "tokens_per_s": snap.get("tokens_per_s", 0.0),
            "tokens_generated": snap.get("tokens_generated", 0),
            "kv": snap.get("kv", {}),
            "uptime_s": round(time.time() - self.started, 1),
            "draining": self.draining,
            **self.connection_status(),
            **self.status_extra(),
        }

    def connection_status(self) -> dict:
        """Connections served and refused, replies queued for peers (status and metrics)."""
        return {
            "connections": len(self.peers),
            "max_connections": self.peers.max_connections,
            "connections_refused": self.peers.refused,
            "queued_reply_bytes": self.outboxes.total,
        }

    # -- engine events -> replies ----------------------------------------------------------------------
    def _forward_events(self) -> None:
        while self.engine is not None:
            try:
                batch = self.engine.events.get_nowait()
            except queue.Empty:
                return
            t0 = time.perf_counter()
            for ev in batch:
                try:
                    self._forward(ev)
                except Exception as e:  # one reply that cannot be built or sent: that request's error
                    self._event_failed(ev, e)
            self.forward_s += time.perf_counter() - t0
            self.events_forwarded += len(batch)

    def _forward(self, ev: Event) -> None:
        route = self.routes.get(ev.request_id)
        if route is None:
            return  # its peer is gone or it already ended
        if ev.kind == "token":
            if route.stream:
                self._send(route.peer, P.token(route.client_id, ev.text, ev.token_ids, v=route.v))
            else:
                route.text.append(ev.text)
                route.token_ids += ev.token_ids
            return
        reason = {"done": ev.finish_reason, "cancelled": "cancel"}.get(ev.kind, ev.error_code or P.INTERNAL)
        self.metrics.request_ended(ev.kind, reason, ev.stats)
        self._end(ev.request_id, self._terminal(route, ev))

    def _event_failed(self, ev: Event, e: Exception) -> None:
        log.exception("reply to request %d (%s event) failed", ev.request_id, ev.kind)
        self.counters["internal"] += 1
        route = self.routes.get(ev.request_id)
        if route is None:
            return
        if not ev.terminal:  # (a terminal one was counted before its reply failed)
            self.engine.cancel(ev.request_id)  # its later events find no route and are dropped
            self.metrics.request_ended("error", P.INTERNAL)
        with contextlib.suppress(Exception):
            reply = P.error(route.client_id, P.INTERNAL, f"{type(e).__name__}: {e}", v=route.v)
            self._end(ev.request_id, reply)

    @staticmethod
    def _terminal(route: Route, ev: Event) -> dict:
        v = route.v
        if ev.kind == "done":
            extra = {} if route.stream else {"text": "".join(route.text), "token_ids": route.token_ids}
            return P.done(route.client_id, ev.finish_reason, **ev.stats, **extra, v=v)
        if ev.kind == "cancelled":
            return P.cancelled(route.client_id, ev.stats.get("generated_tokens", 0), v=v)
        code = ev.error_code if ev.error_code in P.ERROR_CODES else P.INTERNAL
        return P.error(route.client_id, code, ev.text, v=v)

    def _add_route(self, rid: int, route: Route) -> None:
        self.routes[rid] = route
        if route.client_id is not None:  # id-less requests cannot be cancelled by id
            self.by_client[(route.peer, route.client_id)] = rid
        self.per_peer[route.peer] += 1
        if route.uid is not None:
            self.per_uid[route.uid] += 1

    def _pop_route(self, rid: int) -> Route:
        route = self.routes.pop(rid)
        if self.by_client.get((route.peer, route.client_id)) == rid:
            del self.by_client[(route.peer, route.client_id)]
        for counter, key in ((self.per_peer, route.peer), (self.per_uid, route.uid)):
            if key is not None:
                counter[key] -= 1
                if counter[key] <= 0:
                    del counter[key]
        return route

    def _end(self, rid: int, reply: dict | None) -> None:
        route = self._pop_route(rid)
        if reply is not None:
            self._send(route.peer, reply)

    # -- sending -----------------------------------------------------------------------------------------
    def _send(self, peer: bytes, msg: dict) -> None:
        if not self.outboxes.send(peer, P.pack(msg)):
            self._peer_gone(peer)
        for over in self.outboxes.over_share():
            log.warning(
                "peer %s is not reading (%d bytes of replies queued, over its share of "
                "server.max_reply_bytes): dropping it and cancelling its requests",
                over.hex(),
                self.outboxes.bytes[over],
            )
            self.counters["dropped_slow_peer"] += 1
            self._peer_gone(over)
            self.peers.drop(over)

    def _flush_outboxes(self) -> None:
        for peer in self.outboxes.flush_all():
            self._peer_gone(peer)

    def _peer_gone(self, peer: bytes) -> None:
        """The peer disconnected: cancel its requests (their terminal replies cannot be delivered)."""
        self.outboxes.drop(peer)
        if peer not in self.per_peer:
            return
        for rid in [rid for rid, r in self.routes.items() if r.peer == peer]:
            route = self._pop_route(rid)
            if not route.preparing:  # (a preparing one finds no route when it is prepared)
                self.engine.cancel(rid)
            self.counters["peer_gone"] += 1
            self.metrics.request_ended("cancelled", "disconnect")

    # -- draining ----------------------------------------------------------------------------------------
    def begin_drain(self, grace_s: float) -> None:
        """Stop accepting work; requests still running after ``grace_s`` are cancelled."""
        if not self.draining:
            self.draining, self.drain_cancelled = True, False
            self.drain_deadline = time.monotonic() + grace_s

    def _drained(self) -> bool:
        # the engine failed: nothing will answer what it had not taken yet, so answer it here
        if self.engine is not None and self.engine.failed:
            for rid in list(self.routes):
                route = self.routes[rid]
                msg = "engine failure; see the daemon log"
                self.metrics.request_ended("error", P.INTERNAL)
                self._end(rid, P.error(route.client_id, P.INTERNAL, msg, v=route.v))
        now = time.monotonic()
        if self.routes and now >= self.drain_deadline and not self.drain_cancelled:
            for rid, route in self.routes.items():
                if route.preparing:
                    route.cancel_asked = True
                else:
                    self.engine.cancel(rid)
            self.drain_cancelled = True  # cancel once; the engine answers each at its next step
        if now < self.drain_deadline + FLUSH_AFTER_DRAIN_S:
            return not self.routes and not self.outboxes.pending()
        for rid in list(self.routes):  # the engine did not answer in time: answer here
            route = self.routes[rid]
            self.metrics.request_ended("cancelled", "shutdown")
            self._end(rid, P.cancelled(route.client_id, 0, v=route.v))
        return True  # what peers have not read is dropped (LINGER 0): none of them can hold shutdown

    def close(self) -> None:
        self.intake.close()
        self.peers.close()
        self.sock.close(linger=0)
        self.wake_pull.close()
        self._wake_push.close()
