"""Read deadlines for the gateway's HTTP connections: uvicorn's h11 protocol, cut off when a client is slow.

uvicorn closes a connection that stays idle after a response (``timeout_keep_alive``), but any byte resets
that, and nothing bounds how long a request's head or body may take: a client that sends its headers a
byte at a time holds a connection (and its memory) for as long as it likes. Here each request has two
deadlines, as nginx's ``client_header_timeout`` and ``client_body_timeout`` give:

- the head (request line and headers) must be complete within ``header_timeout`` of the connection's start
  or of the previous response's end;
- the body must then be complete within ``body_timeout``.

Past either, the connection is closed: a handler waiting for the body sees the client leave. The response
(a stream may run for minutes) has no deadline.

    uvicorn.Config(app, http=with_deadlines(header_timeout=10, body_timeout=30))
"""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("hmad_openai")


class DeadlineH11Protocol(H11Protocol):
    """H11Protocol with the head and body deadlines (class attributes, set by ``with_deadlines``)."""

    header_timeout: float = 10.0
    body_timeout: float = 30.0

    _phase: str | None = None  # "head", "body" or None (nothing being read under a deadline)
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        self._arm(None, 0.0)
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()

    def _track(self) -> None:
        """Arm the deadline of what the client is sending now (on a change of phase only)."""
        state = self.conn.their_state
        if state is h11.IDLE:
            self._arm("head", self.header_timeout)
        elif state is h11.SEND_BODY:
            self._arm("body", self.body_timeout)
        else:
            self._arm(None, 0.0)

    def _arm(self, phase: str | None, seconds: float) -> None:
        if phase == self._phase:
            return
        if self._deadline is not None:
            self._deadline.cancel()
        self._phase, self._deadline = phase, None
        if phase is not None and not self.transport.is_closing():
            self._deadline = self.loop.call_later(seconds, self._expired, phase, seconds)

    def _expired(self, phase: str, seconds: float) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
            log.info("closed the connection of %s: its request %s took over %g s", client, phase, seconds)
            self.transport.close()


def with_deadlines(header_timeout: float, body_timeout: float) -> type[DeadlineH11Protocol]:
    """A protocol class for ``uvicorn.Config(http=...)`` with these deadlines (seconds)."""
    attrs = {"header_timeout": header_timeout, "body_timeout": body_timeout}
    return type("DeadlineH11Protocol", (DeadlineH11Protocol,), attrs)
