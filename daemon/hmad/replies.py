"""What goes back to peers: the engine's events turned into reply frames, sent through the outboxes.

Runs on the socket loop. A ``token`` event of a streaming request is sent at once; a non-streaming one's
text and ids are kept on its route for the ``done`` reply. A terminal event (done | error | cancelled)
closes the request's route with its one terminal reply; events of a request whose route is closed (its
peer is gone, or it ended) are dropped, so nothing follows the terminal reply. An exception while
turning one event into a reply ends that request alone with an ``internal`` error.

A peer found gone while sending (EHOSTUNREACH), or one over its share of ``max_reply_bytes``
(hmad/outbox.py), has its routes closed and its requests cancelled in the engine.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import queue
import time
from collections.abc import Callable

import zmq

from hmaclient import protocol as P
from hmad.engine.metrics import Metrics
from hmad.engine.request import Event
from hmad.outbox import Outboxes
from hmad.peers import Peers
from hmad.routes import Route, Routes

log = logging.getLogger("hmad.server")


class Replies:
    """Sends replies on the ROUTER socket and ends routes; ``cancel(rid)`` tells the engine to drop one."""

    def __init__(
        self,
        sock: zmq.Socket,
        routes: Routes,
        peers: Peers,
        metrics: Metrics,
        counters: collections.Counter,
        cancel: Callable[[int], None],
        max_reply_bytes: int,
    ):
        self.outboxes = Outboxes(sock, max_reply_bytes)
        self.routes, self.peers, self.metrics, self.counters = routes, peers, metrics, counters
        self.cancel = cancel
        self.forward_s, self.events_forwarded = 0.0, 0  # time the loop spends per reply (pack + send)
        self.logprobs: dict[int, list[dict]] = {}  # rid -> a non-streaming request's logprobs so far

    def us_per_reply(self) -> float:
        return round(1e6 * self.forward_s / max(1, self.events_forwarded), 2)

    # -- sending ---------------------------------------------------------------------------------------
    def send(self, peer: bytes, msg: dict) -> None:
        if not self.outboxes.send(peer, P.pack(msg)):
            self.peer_gone(peer)
        for over in self.outboxes.over_share():
            log.warning(
                "peer %s is not reading (%d bytes of replies queued, over its share of "
                "server.max_reply_bytes): dropping it and cancelling its requests",
                over.hex(),
                self.outboxes.bytes[over],
            )
            self.counters["dropped_slow_peer"] += 1
            self.peer_gone(over)
            self.peers.drop(over)

    def end(self, rid: int, reply: dict | None) -> None:
        """Close ``rid``'s route, sending ``reply`` (its terminal one) if given."""
        route = self.routes.pop(rid)
        self.logprobs.pop(rid, None)
        if reply is not None:
            self.send(route.peer, reply)

    def flush(self) -> None:
        """Send what the outboxes hold and the peers' pipes take."""
        for peer in self.outboxes.flush_all():
            self.peer_gone(peer)

    def peer_gone(self, peer: bytes) -> None:
        """The peer disconnected: cancel its requests (their terminal replies cannot be delivered)."""
        self.outboxes.drop(peer)
        if not self.routes.has_peer(peer):
            return
        for rid in self.routes.of_peer(peer):
            route = self.routes.pop(rid)
            self.logprobs.pop(rid, None)
            if not route.preparing:  # (a preparing one finds no route when it is prepared)
                self.cancel(rid)
            self.counters["peer_gone"] += 1
            self.metrics.request_ended("cancelled", "disconnect")

    # -- engine events -> replies ----------------------------------------------------------------------
    def forward_events(self, events: queue.SimpleQueue) -> None:
        """Every batch of events the engine has published, as replies."""
        while True:
            try:
                batch = events.get_nowait()
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
                reply = P.token(route.client_id, ev.text, ev.token_ids, v=route.v, logprobs=ev.logprobs)
                self.send(route.peer, reply)
            else:
                route.text.append(ev.text)
                route.token_ids += ev.token_ids
                if ev.logprobs is not None:
                    self.logprobs.setdefault(ev.request_id, []).extend(ev.logprobs)
            return
        if ev.kind == "done" and ev.finish_reason == "stop" and ev.stats.get("tool_calls"):
            ev.finish_reason = "tool_calls"  # the answer is the calls (engine.tool_calls)
        reason = {"done": ev.finish_reason, "cancelled": "cancel"}.get(ev.kind, ev.error_code or P.INTERNAL)
        self.metrics.request_ended(ev.kind, reason, ev.stats)
        self.end(ev.request_id, self._terminal(route, ev, self.logprobs.get(ev.request_id)))

    def _event_failed(self, ev: Event, e: Exception) -> None:
        log.exception("reply to request %d (%s event) failed", ev.request_id, ev.kind)
        self.counters["internal"] += 1
        route = self.routes.get(ev.request_id)
        if route is None:
            return
        if not ev.terminal:  # (a terminal one was counted before its reply failed)
            self.cancel(ev.request_id)  # its later events find no route and are dropped
            self.metrics.request_ended("error", P.INTERNAL)
        with contextlib.suppress(Exception):
            reply = P.error(route.client_id, P.INTERNAL, f"{type(e).__name__}: {e}", v=route.v)
            self.end(ev.request_id, reply)

    @staticmethod
    def _terminal(route: Route, ev: Event, logprobs: list[dict] | None = None) -> dict:
        """The terminal reply; a non-streaming done carries the text, ids and ``logprobs`` gathered."""
        v = route.v
        if ev.kind == "done":
            extra = {} if route.stream else {"text": "".join(route.text), "token_ids": route.token_ids}
            if logprobs is not None and not route.stream:
                extra["logprobs"] = logprobs
            if ev.prompt_logprobs is not None:  # streamed or not: only done has them
                extra["prompt_logprobs"] = ev.prompt_logprobs
            return P.done(route.client_id, ev.finish_reason, **ev.stats, **extra, v=v)
        if ev.kind == "cancelled":
            return P.cancelled(route.client_id, ev.stats.get("generated_tokens", 0), v=v)
        code = ev.error_code if ev.error_code in P.ERROR_CODES else P.INTERNAL
        return P.error(route.client_id, code, ev.text, v=v)
