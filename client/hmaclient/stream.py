"""``AsyncStream``: one generation's pieces as they arrive, and its ``Result`` once the terminal reply came.

``AsyncClient.stream()`` makes one; the client's reader routes the request's replies to it. Leaving it
early (``break``, ``aclose()``, an exception, a timeout) sends ``cancel`` for its request.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from hmaclient import protocol as P
from hmaclient.errors import RequestError
from hmaclient.reply import Logprob
from hmaclient.results import Piece, Result

if TYPE_CHECKING:
    from hmaclient.client import AsyncClient, _Pending

log = logging.getLogger("hmaclient")


class AsyncStream:
    """The pieces of one generation as they arrive; ``.result`` once the terminal reply has come.

    Async iterator and async context manager; ``aclose()`` (also on context exit, or when the object is
    dropped unfinished) cancels the request.
    """

    def __init__(
        self,
        client: AsyncClient,
        msg: dict[str, Any],
        timeout: float | None = None,
        deadline: float | None = None,
    ):
        self._client, self._msg = client, msg
        self.id: P.Id = msg["id"]
        self.rid: int | None = None
        self.result: Result | None = None
        self._timeout, self._deadline = timeout, deadline
        self._pending: _Pending | None = None
        self._finished = False
        self._text: list[str] = []
        self._ids: list[int] = []
        self._logprobs: list[Logprob] | None = None  # the streamed tokens' (when asked for)
        self._held: list[Piece] = []  # pieces read by start() before the iteration asked for them

    def __aiter__(self) -> AsyncStream:
        return self

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def __anext__(self) -> Piece:
        if self._held:
            return self._held.pop(0)
        if self._finished:
            raise StopAsyncIteration
        try:
            if self._pending is None:
                await self._start()
            while True:
                reply = await self._client._next_reply(self._pending, self._wait_time())
                piece = self._take(reply)
                if piece is not None:
                    return piece
                if self._finished:
                    raise StopAsyncIteration
        except BaseException:
            self._abandon()
            raise

    async def start(self) -> int | None:
        """Send the request and wait until the daemon accepts it; returns its ``rid``.

        Raises RequestError when the daemon refuses it (busy, prompt_too_long, bad_request, ...), so a caller
        can answer a refusal before it starts passing pieces on. Iterating afterwards gives every piece.
        """
        try:
            if self._pending is None:
                await self._start()
            while self.rid is None and not self._finished:
                piece = self._take(await self._client._next_reply(self._pending, self._wait_time()))
                if piece is not None:
                    self._held.append(piece)
        except BaseException:
            self._abandon()
            raise
        return self.rid

    async def aclose(self) -> None:
        """Stop: cancel the request if it is still running (the daemon then answers ``cancelled``)."""
        self._abandon()

    def __del__(self) -> None:
        if self._pending is not None and not self._finished:
            client = self._client
            with contextlib.suppress(RuntimeError):  # the loop is already closed: nothing to cancel through
                client._loop.call_soon_threadsafe(self._abandon)

    async def _start(self) -> None:
        await self._client.connect()
        self._pending = self._client._register(self.id, generation=True)
        await self._client._send(self._msg)

    def _wait_time(self) -> float | None:
        if self._deadline is None:
            return self._timeout
        left = max(0.0, self._deadline - time.monotonic())
        return left if self._timeout is None else min(left, self._timeout)

    def _take(self, reply: P.Reply) -> Piece | None:
        """Apply one reply; a Piece for a token, None otherwise (``_finished`` set on a terminal one)."""
        if isinstance(reply, P.Accepted):
            self.rid = reply.rid
        elif isinstance(reply, P.Token):
            self._text.append(reply.text)
            self._ids += reply.token_ids
            if reply.logprobs is not None:
                self._logprobs = (self._logprobs or []) + reply.logprobs
            return Piece(reply.text, list(reply.token_ids), reply.logprobs)
        elif isinstance(reply, P.Done):
            self._finish(self._done_result(reply))
        elif isinstance(reply, P.Cancelled):
            self._finish(self._result("cancelled", generated_tokens=reply.generated_tokens))
        elif isinstance(reply, P.Error):
            self._finish(None)
            raise RequestError(reply.code, reply.message, self.id)
        else:
            log.warning("ignored a %s reply to generation %r", type(reply).__name__, self.id)
        return None

    def _done_result(self, d: P.Done) -> Result:
        return self._result(
            d.finish_reason,
            text=d.text,
            token_ids=d.token_ids,
            prompt_tokens=d.prompt_tokens,
            generated_tokens=d.generated_tokens,
            ttft_s=float(d.ttft_s),
            tokens_per_s=float(d.tokens_per_s),
            total_s=float(d.total_s),
            extra=d.extra,
            tool_calls=d.tool_calls,
            logprobs=d.logprobs,
            prompt_logprobs=d.prompt_logprobs,
        )

    def _result(
        self, reason: str, text: str | None = None, token_ids: Any = None, logprobs: Any = None, **kw: Any
    ) -> Result:
        text = "".join(self._text) if text is None else text
        ids = list(self._ids) if token_ids is None else list(token_ids)
        logprobs = self._logprobs if logprobs is None else logprobs
        return Result(text, ids, reason, id=self.id, rid=self.rid, logprobs=logprobs, **kw)

    def _finish(self, result: Result | None) -> None:
        self.result, self._finished = result, True
        self._client._unregister(self._pending)

    def _abandon(self) -> None:
        """Leave the request: cancel it if it was sent and has not ended."""
        if self._pending is not None and not self._finished:
            self._finished = True
            self._pending.abandoned = True  # the reader drops its replies and frees the id after the last
            self._client._cancel_nowait(self.id)
        self._finished = True
