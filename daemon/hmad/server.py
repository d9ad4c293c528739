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
  progress, ``ping`` says ``state: loading``, a ``generate`` gets ``error`` code ``loading``; once serving,
  hmad/switching.py admits each generate (``models.admit``): now, once another model is loaded, or refused.
- every reply carries the protocol version of the request it answers (a version-1 client never sees 2).

Who does what (all on the loop's thread but the intake): this module reads requests and dispatches them;
hmad/routes.py keeps the requests in flight and their limits; hmad/preparation.py prepares a generate (on
the intake thread, hmad/intake.py); hmad/replies.py turns engine events into replies and sends them
(hmad/outbox.py); hmad/status.py answers ``status`` and ``metrics``; hmad/peers.py tracks connections.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time

import zmq

from hmaclient import protocol as P
from hmad.engine.metrics import Metrics
from hmad.engine.request import Request
from hmad.engine.sampling import SamplingParams
from hmad.engine.worker import EngineThread
from hmad.intake import Intake
from hmad.model.images import ImageLimits
from hmad.peers import Peers
from hmad.preparation import prepare, refusal
from hmad.replies import Replies
from hmad.routes import Route, Routes
from hmad.status import metric_families, status

log = logging.getLogger("hmad.server")

POLL_MS = 50
BACKLOG = 32  # connections the kernel holds before hmad accepts them
SNDHWM = 1000  # frames in one peer's zmq pipe; the rest wait in its outbox (counted in max_reply_bytes)
DISCARD_PER_REQUEST = 16  # frames of dropped peers read (and discarded) per request handled, per turn
FLUSH_AFTER_DRAIN_S = 1.0  # after the drain's deadline, replies still unsent this long are dropped


class Server:
    """Serves one model: owns the ROUTER socket, the loop over it, request dispatch and the drain state."""

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
        image_limits: ImageLimits | None = None,
    ):
        self.engine, self.model, self.defaults = engine, model, defaults
        self.image_limits = image_limits or ImageLimits()
        self.loading_status = loading_status or (lambda: {})  # what status shows while engine is None
        self.max_frame_bytes = max_frame_bytes
        self.status_extra = status_extra or (lambda: {})
        self.sock = self._router(ctx, heartbeat_ivl_s, heartbeat_timeout_s)
        # before bind: every connection is seen
        self.peers = Peers(self.sock, max_connections, max_connections_per_uid)
        self.sock.bind(endpoint)
        self.wake_pull = ctx.socket(zmq.PULL)
        self.wake_pull.bind(f"inproc://hmad-wake-{id(self)}")
        self._wake_push = ctx.socket(zmq.PUSH)
        self._wake_push.connect(f"inproc://hmad-wake-{id(self)}")
        self.intake = Intake(ctx, f"inproc://hmad-wake-{id(self)}")
        self.routes = Routes(max_in_flight, max_per_connection, max_per_uid)
        self.counters = collections.Counter()
        self.metrics = Metrics()  # the engine thread writes its step timings here too
        self.replies = Replies(
            self.sock,
            self.routes,
            self.peers,
            self.metrics,
            self.counters,
            self._cancel_in_engine,
            max_reply_bytes,
        )
        self.draining, self.drain_cancelled = False, False
        self.drain_deadline = 0.0
        self.started = time.time()
        self.models = None  # once serving: the switcher (hmad/switching.py), whose admit/park gate generates
        self.model_routes = None  # once serving: the model requests (hmad/model_routes.py)

    def _router(self, ctx: zmq.Context, heartbeat_ivl_s: float, heartbeat_timeout_s: float) -> zmq.Socket:
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)
        sock.setsockopt(zmq.SNDHWM, SNDHWM)
        sock.setsockopt(zmq.LINGER, 0)  # at close, what a peer has not read is dropped
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_ivl_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_timeout_s * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TTL, int(heartbeat_timeout_s * 1000))
        sock.setsockopt(zmq.BACKLOG, BACKLOG)
        return sock

    # -- engine side -----------------------------------------------------------------------------------
    def attach(self, engine: EngineThread, model) -> None:
        """The model is loaded: serve generations from now on."""
        self.model, self.engine = model, engine

    def wake(self) -> None:
        """Called by the engine thread after publishing events (zmq sockets are not thread-safe: the PUSH
        is used from the engine thread only)."""
        with contextlib.suppress(zmq.Again):  # wake-ups already pending: one is enough
            self._wake_push.send(b"", zmq.NOBLOCK)

    def _cancel_in_engine(self, rid: int) -> None:
        self.engine.cancel(rid)

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
            if self.engine is not None:
                self.replies.forward_events(self.engine.events)
            if self.sock in ready or self.peers.to_end():
                self._read_requests()
            self.replies.flush()
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
            if self.routes.has_peer(peer) or peer in self.replies.outboxes:
                log.info("peer %s disconnected: cancelling its requests", peer.hex())
                self.replies.peer_gone(peer)

    def _read_requests(self, budget: int = 256) -> None:
        handled, heard = 0, set()  # heard: dropped peers read from this turn
        for _ in range(budget * DISCARD_PER_REQUEST):
            if handled == budget:
                return
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self.peers.end_quiet(heard)
                return
            peer = frames[0].bytes
            if peer in self.peers.dropped:  # read at once and discarded: see peers.py
                heard.add(peer)
                continue
            handled += 1
            conn = self.peers.note(peer, frames[-1])
            if conn is None:  # its connection's events may still be on their way: read them, look again
                self._connections()
                conn = self.peers.note(peer, frames[-1])
            if len(frames) != 2:  # a DEALER's message is one frame
                self.counters["bad_envelope"] += 1
                msg = f"a request is one frame; this message had {len(frames) - 1}"
                self.replies.send(peer, P.error(None, P.BAD_REQUEST, msg))
                continue
            self._handle(peer, frames[1].bytes, None if conn is None else conn.uid)

    def _handle(self, peer: bytes, frame: bytes, uid: int | None = None) -> None:
        try:
            req = P.parse_request(frame, max_size=self.max_frame_bytes)
        except P.ProtocolError as e:
            self.counters["bad_request"] += 1
            self.metrics.request_refused(e.code)
            self.replies.send(peer, e.reply())
            return
        handler = {
            P.GenerateRequest: self._generate,
            P.CancelRequest: self._cancel,
            P.StatusRequest: self._status,
            P.PingRequest: self._ping,
            P.MetricsRequest: self._metrics,
            P.ModelRequest: self._model_request,
        }[type(req)]
        first_rid = self.routes.next_rid
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
        started = self.routes.since(first_rid)
        try:
            for rid in started:
                if not self.routes[rid].preparing:
                    self.engine.cancel(rid)
                self.metrics.request_ended("error", P.INTERNAL)
                self.replies.end(rid, reply)
            if not started:
                if isinstance(req, P.GenerateRequest):
                    self.metrics.request_refused(P.INTERNAL)
                self.replies.send(peer, reply)
        except Exception:  # the reply itself cannot be sent (e.g. the socket is closing)
            log.exception("could not answer %s %r with an error", type(req).__name__, req.id)

    # -- generate: taken, prepared on the intake thread, then accepted (or refused) -----------------------
    def _generate(self, peer: bytes, req, uid: int | None = None) -> None:
        if self.draining:
            return self._refuse(peer, req, P.SHUTTING_DOWN, "hmad is shutting down")
        if self.models is None:  # the first load
            msg = f"hmad is loading its model ({self.loading_status().get('phase', '')}); retry when ready"
            return self._refuse(peer, req, P.LOADING, msg)
        if req.id is not None and self.routes.rid_of(peer, req.id) is not None:
            return self._refuse(peer, req, P.BAD_REQUEST, f"request id {req.id!r} is already active")
        busy = self.routes.over_limit(peer, uid)
        if busy:
            return self._refuse(peer, req, P.BUSY, busy)
        why = self.models.admit(req)  # None: now; PARK: once the model is loaded; else refused
        if isinstance(why, tuple):
            return self._refuse(peer, req, *why)
        rid = self.routes.add(Route(peer, req.id, req.stream, req.v, uid, preparing=True))
        if why is None:
            self.prepare_request(rid, req)
        else:
            self.models.park(rid, req)

    def prepare_request(self, rid: int, req) -> None:
        """``rid``'s generate on the intake thread for the model served now: accepted (or refused) once
        prepared."""
        model, context, limits = self.model, self.engine.scheduler.context, self.image_limits
        self.intake.submit(rid, lambda: prepare(req, self.defaults, model, context, limits))

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
                reply = P.error(route.client_id, P.INTERNAL, f"{type(e).__name__}: {e}", v=route.v)
                self.replies.end(rid, reply)

    def _admit(self, rid: int, route: Route, prepared, exc: BaseException | None) -> None:
        why = refusal(exc, self.counters) if exc is not None else None
        if why is None and route.cancel_asked:
            why = "cancelled"
        if why is None and self.draining:
            why = (P.SHUTTING_DOWN, "hmad is shutting down")
        if why == "cancelled":
            self.metrics.request_ended("cancelled", "cancel")
            return self.replies.end(rid, P.cancelled(route.client_id, 0, v=route.v))
        if why is not None:
            self.metrics.request_refused(why[0])
            return self.replies.end(rid, P.error(route.client_id, *why, v=route.v))
        ids = prepared.ids
        conn = self.peers.by_peer.get(route.peer)
        log.info(
            "request %d (id %r, %d prompt tokens) from uid %s pid %s",
            rid,
            route.client_id,
            len(ids),
            route.uid,
            None if conn is None else conn.pid,
        )
        self.replies.send(route.peer, P.accepted(route.client_id, rid, v=route.v))
        request = Request(
            rid, ids, prepared.params, tag=(route.peer, route.client_id), grammar=prepared.grammar
        )
        request.images, request.speculate = prepared.images, prepared.speculate
        request.owner, request.tenant = route.peer, route.uid
        self.engine.submit(request)

    def _refuse(self, peer: bytes, req, code: str, message: str) -> None:
        """Answer a request with ``error`` before accepting it (a refused generate is counted)."""
        if isinstance(req, P.GenerateRequest):
            self.metrics.request_refused(code)
        self.replies.send(peer, P.error(req.id, code, message, v=req.v))

    # -- the other request types -----------------------------------------------------------------------
    def _cancel(self, peer: bytes, req) -> None:
        rid = self.routes.rid_of(peer, req.id)
        if rid is None:  # (while loading there are no routes: every cancel lands here)
            return self._refuse(peer, req, P.NOT_FOUND, f"no active request with id {req.id!r}")
        if self.routes[rid].preparing:
            self.routes[rid].cancel_asked = True
            return
        self.engine.cancel(rid)

    def _status(self, peer: bytes, req) -> None:
        self.replies.send(peer, P.status(req.id, self.status(), v=req.v))

    def _ping(self, peer: bytes, req) -> None:
        state = self.models.ping_state() if self.models is not None else "loading"
        self.replies.send(peer, P.pong(req.id, time.time(), state, v=req.v))

    def _model_request(self, peer: bytes, req) -> None:
        if self.model_routes is None:
            return self._refuse(peer, req, P.LOADING, "hmad is loading its model; retry when ready")
        self.model_routes.handle(peer, req)

    def _metrics(self, peer: bytes, req) -> None:
        self.replies.send(peer, P.metrics(req.id, metric_families(self), v=req.v))

    def status(self) -> dict:
        """The ``status`` reply's fields (hmad/status.py)."""
        return status(self)

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
                self.replies.end(rid, P.error(route.client_id, P.INTERNAL, msg, v=route.v))
        now = time.monotonic()
        if self.routes and now >= self.drain_deadline and not self.drain_cancelled:
            for rid, route in self.routes.items():
                if route.preparing:
                    route.cancel_asked = True
                else:
                    self.engine.cancel(rid)
            self.drain_cancelled = True  # cancel once; the engine answers each at its next step
        if now < self.drain_deadline + FLUSH_AFTER_DRAIN_S:
            return not self.routes and not self.replies.outboxes.pending()
        for rid in list(self.routes):  # the engine did not answer in time: answer here
            route = self.routes[rid]
            self.metrics.request_ended("cancelled", "shutdown")
            self.replies.end(rid, P.cancelled(route.client_id, 0, v=route.v))
        return True  # what peers have not read is dropped (LINGER 0): none of them can hold shutdown

    def close(self) -> None:
        self.intake.close()
        self.peers.close()
        self.sock.close(linger=0)
        self.wake_pull.close()
        self._wake_push.close()
