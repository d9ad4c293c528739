"""The socket loop: a ZMQ ROUTER on ipc://, validating requests and streaming the engine's events back.

One thread runs this loop; it never computes. It polls two sockets: the ROUTER (clients) and an inproc
PULL the engine thread pokes after it publishes events. Per request it keeps the routing (peer identity,
client id, stream flag) and, for non-streaming requests, the text so far.

Guarantees:
- a malformed frame gets one ``error`` reply (or, if it cannot even be attributed, is dropped) and the loop
  carries on;
- every accepted request gets exactly one terminal reply (done, error or cancelled) and nothing after it;
- a peer that has gone (ROUTER_MANDATORY raises EHOSTUNREACH) has its requests cancelled; the engine frees
  their slots and KV blocks at its next step;
- a slow peer's replies queue in its own outbox (bounded) so it never stalls the others; a peer whose
  outbox overflows has its requests cancelled.
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
from hmad.engine.request import Event, Request
from hmad.engine.sampling import SamplingParams
from hmad.engine.worker import EngineThread
from hmad.model.chat import render_chat, render_prompt

log = logging.getLogger("hmad.server")

OUTBOX_LIMIT = 65536  # frames queued for one peer before its requests are cancelled
POLL_MS = 50


@dataclass
class Route:
    """Where a request's replies go, and what a non-streaming request has produced so far."""

    peer: bytes
    client_id: object
    stream: bool
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


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
    ):
        self.engine, self.model, self.defaults = engine, model, defaults
        self.max_in_flight = max_in_flight
        self.max_frame_bytes = max_frame_bytes
        self.status_extra = status_extra or (lambda: {})
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        self.sock.setsockopt(zmq.SNDHWM, 10000)
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, int(heartbeat_ivl_s * 1000))
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(heartbeat_timeout_s * 1000))
        self.sock.setsockopt(zmq.HEARTBEAT_TTL, int(heartbeat_timeout_s * 1000))
        self.sock.bind(endpoint)
        self.wake_pull = ctx.socket(zmq.PULL)
        self.wake_pull.bind(f"inproc://hmad-wake-{id(self)}")
        self._wake_push = ctx.socket(zmq.PUSH)
        self._wake_push.connect(f"inproc://hmad-wake-{id(self)}")
        self.routes: dict[int, Route] = {}
        self.by_client: dict[tuple[bytes, object], int] = {}
        self.outbox: dict[bytes, collections.deque] = collections.defaultdict(collections.deque)
        self.next_rid = 1
        self.draining = False
        self.drain_deadline = 0.0
        self.started = time.time()
        self.counters = collections.Counter()
        self.forward_s, self.events_forwarded = 0.0, 0  # time the loop spends per reply (pack + send)

    # -- engine side -----------------------------------------------------------------------------------
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
        while True:
            ready = dict(poller.poll(POLL_MS))
            if tick():  # after the poll: a signal that interrupted it is seen before any new request
                break
            if self.wake_pull in ready:
                self._drain_wake()
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

    def _read_requests(self, budget: int = 256) -> None:
        for _ in range(budget):
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            if len(frames) != 2:
                self.counters["bad_envelope"] += 1
                continue  # a DEALER sends exactly one frame; anything else cannot be answered sanely
            self._handle(frames[0], frames[1])

    def _handle(self, peer: bytes, frame: bytes) -> None:
        try:
            req = P.parse_request(frame, max_size=self.max_frame_bytes)
        except P.ProtocolError as e:
            self.counters["bad_request"] += 1
            self._send(peer, P.error(e.id, e.code, e.message))
            return
        handler = {
            P.GenerateRequest: self._generate,
            P.CancelRequest: self._cancel,
            P.StatusRequest: self._status,
            P.PingRequest: self._ping,
        }[type(req)]
        handler(peer, req)

    # -- request types ---------------------------------------------------------------------------------
    def _generate(self, peer: bytes, req) -> None:
        key = (peer, req.id)
        if self.draining:
            return self._send(peer, P.error(req.id, P.SHUTTING_DOWN, "hmad is shutting down"))
        if req.id is not None and key in self.by_client:
            msg = f"request id {req.id!r} is already active"
            return self._send(peer, P.error(req.id, P.BAD_REQUEST, msg))
        if len(self.routes) >= self.max_in_flight:
            msg = f"{len(self.routes)} requests in flight; retry later"
            return self._send(peer, P.error(req.id, P.BUSY, msg))
        try:
            ids, params = self._prepare(req)
        except ValueError as e:
            return self._send(peer, P.error(req.id, P.BAD_REQUEST, str(e)))
        context = self.engine.scheduler.context
        if len(ids) >= context:
            msg = f"the prompt is {len(ids)} tokens; the context holds {context}"
            return self._send(peer, P.error(req.id, P.PROMPT_TOO_LONG, msg))
        rid = self.next_rid
        self.next_rid += 1
        self.routes[rid] = Route(peer, req.id, req.stream)
        if req.id is not None:  # id-less requests cannot be cancelled by id
            self.by_client[key] = rid
        self._send(peer, P.accepted(req.id, rid))
        self.engine.submit(Request(rid, ids, params, tag=key))

    def _prepare(self, req) -> tuple[list[int], SamplingParams]:
        if req.messages is not None:
            text = render_chat(req.messages)
        else:
            text = req.prompt if req.raw else render_prompt(req.prompt)
        ids = self.model.tokenizer.encode(text)
        params = SamplingParams(**{**vars(self.defaults), **req.sampling()})
        params.validate()
        return ids, params

    def _cancel(self, peer: bytes, req) -> None:
        rid = self.by_client.get((peer, req.id))
        if rid is None:
            return self._send(peer, P.error(req.id, P.NOT_FOUND, f"no active request with id {req.id!r}"))
        self.engine.cancel(rid)

    def _status(self, peer: bytes, req) -> None:
        self._send(peer, P.status(req.id, self.status()))

    def _ping(self, peer: bytes, req) -> None:
        self._send(peer, P.pong(req.id, time.time()))

    def status(self) -> dict:
        snap = dict(self.engine.snapshot)
        return {
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
            "server_us_per_reply": round(1e6 * self.forward_s / max(1, self.events_forwarded), 2),
            "tokens_per_s": snap.get("tokens_per_s", 0.0),
            "tokens_generated": snap.get("tokens_generated", 0),
            "kv": snap.get("kv", {}),
            "uptime_s": round(time.time() - self.started, 1),
            "draining": self.draining,
            **self.status_extra(),
        }

    # -- engine events -> replies ----------------------------------------------------------------------
    def _forward_events(self) -> None:
        while True:
            try:
                batch = self.engine.events.get_nowait()
            except queue.Empty:
                return
            t0 = time.perf_counter()
            for ev in batch:
                self._forward(ev)
            self.forward_s += time.perf_counter() - t0
            self.events_forwarded += len(batch)

    def _forward(self, ev: Event) -> None:
        route = self.routes.get(ev.request_id)
        if route is None:
            return  # its peer is gone or it already ended
        if ev.kind == "token":
            if route.stream:
                self._send(route.peer, P.token(route.client_id, ev.text, ev.token_ids))
            else:
                route.text.append(ev.text)
                route.token_ids += ev.token_ids
            return
        self._end(ev.request_id, self._terminal(route, ev))

    @staticmethod
    def _terminal(route: Route, ev: Event) -> dict:
        if ev.kind == "done":
            extra = {} if route.stream else {"text": "".join(route.text), "token_ids": route.token_ids}
            return P.done(route.client_id, ev.finish_reason, **ev.stats, **extra)
        if ev.kind == "cancelled":
            return P.cancelled(route.client_id, ev.stats.get("generated_tokens", 0))
        return P.error(route.client_id, ev.error_code or P.INTERNAL, ev.text)

    def _end(self, rid: int, reply: dict | None) -> None:
        route = self.routes.pop(rid)
        self.by_client.pop((route.peer, route.client_id), None)
        if reply is not None:
            self._send(route.peer, reply)

    # -- sending -----------------------------------------------------------------------------------------
    def _send(self, peer: bytes, msg: dict) -> None:
        box = self.outbox[peer]
        box.append(P.pack(msg))
        if len(box) > OUTBOX_LIMIT:
            log.warning("peer %s is not reading; cancelling its requests", peer.hex())
            self._peer_gone(peer)
            return
        self._flush(peer)

    def _flush_outboxes(self) -> None:
        for peer in [p for p, box in self.outbox.items() if box]:
            self._flush(peer)

    def _flush(self, peer: bytes) -> None:
        box = self.outbox[peer]
        while box:
            try:
                self.sock.send_multipart([peer, box[0]], zmq.NOBLOCK)
            except zmq.Again:
                return  # its pipe is full: keep the rest for later, serve the others
            except zmq.ZMQError as e:
                if e.errno != zmq.EHOSTUNREACH:
                    raise
                self._peer_gone(peer)
                return
            box.popleft()
        del self.outbox[peer]

    def _peer_gone(self, peer: bytes) -> None:
        """The peer disconnected: cancel its requests (their terminal replies cannot be delivered)."""
        self.outbox.pop(peer, None)
        for rid in [rid for rid, r in self.routes.items() if r.peer == peer]:
            self.engine.cancel(rid)
            route = self.routes.pop(rid)
            self.by_client.pop((peer, route.client_id), None)
            self.counters["peer_gone"] += 1

    # -- draining ----------------------------------------------------------------------------------------
    def begin_drain(self, grace_s: float) -> None:
        """Stop accepting work; requests still running after ``grace_s`` are cancelled."""
        if not self.draining:
            self.draining = True
            self.drain_deadline = time.monotonic() + grace_s

    def _drained(self) -> bool:
        if self.engine.failed:  # nothing will answer what the engine had not taken yet: answer it here
            for rid in list(self.routes):
                route = self.routes[rid]
                self._end(rid, P.error(route.client_id, P.INTERNAL, "engine failure; see the daemon log"))
        if self.routes and time.monotonic() >= self.drain_deadline:
            for rid in list(self.routes):
                self.engine.cancel(rid)
            self.drain_deadline = float("inf")  # cancel once; wait for the cancelled replies
        return not self.routes and not any(self.outbox.values())

    def close(self) -> None:
        self.sock.close()
        self.wake_pull.close()
        self._wake_push.close()
