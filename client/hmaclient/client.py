"""Talk to hmad: ``AsyncClient`` (asyncio), and ``Client``, its blocking wrapper.

    async with AsyncClient() as c:                       with Client() as c:
        r = await c.generate("Why is the sky blue?")          r = c.generate("Why is the sky blue?")
        async for piece in c.stream("Tell a story"):          for piece in c.stream("Tell a story"):
            print(piece.text, end="")                             print(piece.text, end="")

One client owns one ZeroMQ DEALER socket (the wire format is in ``hmaclient.protocol``). A background task
reads every reply and hands it to the queue of the request whose ``id`` it carries; ids are numbered by
the client unless the caller gives one. Leaving a stream early (``break``, ``aclose()``/``close()``, an
exception, a timeout) sends ``cancel`` for its request; so does ``close()`` for every request still
running.

A stream is an ``AsyncStream`` (``hmaclient.stream``); answers are ``Piece``s and ``Result``s
(``hmaclient.results``). Errors are the ``HmaError``s of ``hmaclient.errors``, which says when each is
raised; bad parameters raise ``protocol.ProtocolError`` (a ``ValueError``) before anything is sent, and a
reply that breaks the protocol raises one (naming the bad field) in the call it answers, at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Coroutine, Generator
from typing import Any, TypeVar

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from hmaclient import protocol as P
from hmaclient import safepath
from hmaclient.errors import (
    ConnectionLost,
    DaemonUnreachable,
    HmadTimeout,
    RequestCancelled,
    RequestError,
    UnsafeSocket,
)
from hmaclient.results import Piece, Result
from hmaclient.stream import AsyncStream

log = logging.getLogger("hmaclient")

T = TypeVar("T")
_DEFAULT: Any = object()  # "use the client's default timeout"
_LOST = object()  # queue sentinel: the connection to the daemon dropped
_CLOSED = object()  # queue sentinel: the client was closed

HEARTBEAT_IVL_MS = 2000  # ZMTP PING every 2 s ...
HEARTBEAT_TIMEOUT_MS = 6000  # ... and the connection is dropped when nothing comes back for 6 s;
HEARTBEAT_TTL_MS = 6000  # the daemon drops us when it hears nothing for 6 s.
LINGER_MS = 1000  # on close: time to deliver the last cancels
LOST_GRACE_S = 0.2  # after a disconnect, replies already received still get read before requests fail
STATUS_TIMEOUT_S = 10.0  # default for status() and ping() when the client has no timeout


class _Pending:
    """One request in flight: the replies the reader routed to it."""

    __slots__ = ("id", "queue", "generation", "abandoned")

    def __init__(self, id: P.Id, generation: bool):
        self.id, self.generation = id, generation
        self.abandoned = False  # left before its terminal reply: the id stays taken until that reply
        self.queue: asyncio.Queue[Any] = asyncio.Queue()


class AsyncClient:
    """An asyncio client of hmad. Use it from one event loop; ``close()`` it (or ``async with``).

    ``timeout`` is the default per-call timeout in seconds (None: wait as long as it takes);
    ``connect_timeout`` bounds the ping that checks the daemon is there before the first request.
    """

    def __init__(
        self, socket_path: str | None = None, *, timeout: float | None = None, connect_timeout: float = 3.0
    ):
        self.path = socket_path or P.default_socket_path()
        self._endpoint = P.endpoint(self.path)
        self.timeout, self.connect_timeout = timeout, connect_timeout
        self._ids = itertools.count(1)
        self._pending: dict[P.Id, _Pending] = {}
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reachable = False
        self._closed = False
        self._connect_lock: asyncio.Lock | None = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- public API ----------------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        timeout: float | None = _DEFAULT,
        id: P.Id = None,
        **params: Any,
    ) -> Result:
        """Generate a whole answer (sent with stream=false). ``timeout`` bounds the whole call.

        ``params``: raw, max_tokens, temperature, top_k, top_p, min_p, repetition_penalty, repeat_last_n,
        seed, stop (a str or a list of str), json_schema (a dict: a JSON Schema the answer must satisfy;
        the result's ``extra["schema_complete"]`` then says whether the JSON was finished within
        max_tokens), tools (a list of {name, description, parameters}), tool_choice ("auto", "none",
        "required" or {"name": ...}) and parallel_tool_calls (the result's ``tool_calls`` then holds the
        calls, each {id, name, arguments: JSON text}, with finish_reason "tool_calls"; messages may carry
        an assistant's ``tool_calls`` and ``role: "tool"`` results) and logprobs (an int 0..20: the result's
        ``logprobs`` then holds each token's ``Logprob`` with that many alternatives; streamed, each
        ``Piece`` has its tokens') and prompt_logprobs (likewise for each prompt token, in the result's
        ``prompt_logprobs``, the first None). Raises RequestCancelled if the request is cancelled.
        """
        timeout = self.timeout if timeout is _DEFAULT else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        stream = self._stream(prompt, messages, id, params, stream=False, deadline=deadline)
        async with stream:
            async for _ in stream:
                pass
        result = stream.result
        assert result is not None
        if result.finish_reason == "cancelled":
            raise RequestCancelled(result.id, result.generated_tokens)
        return result

    def stream(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, str]] | None = None,
        timeout: float | None = _DEFAULT,
        id: P.Id = None,
        **params: Any,
    ) -> AsyncStream:
        """An async iterator of ``Piece``s, ending after the terminal reply (then ``.result`` is set).

        ``params`` as for :meth:`generate`. Nothing is sent until the first ``__anext__``. ``timeout``
        bounds each wait for the next reply.
        Leaving early (``break``, ``aclose()``, ``async with`` exit) cancels the request.
        """
        timeout = self.timeout if timeout is _DEFAULT else timeout
        return self._stream(prompt, messages, id, params, stream=True, timeout=timeout)

    async def cancel(self, id: P.Id) -> None:
        """Ask the daemon to cancel request ``id``; its stream or ``generate()`` then ends as cancelled."""
        await self.connect()
        await self._send(P.cancel_request(id))

    async def status(self, timeout: float | None = _DEFAULT) -> dict[str, Any]:
        """The daemon's status map (model, backend, memory, requests, ...)."""
        reply = await self._call(P.status_request, P.Status, timeout)
        return reply.info

    async def ping(self, timeout: float | None = _DEFAULT) -> float:
        """Round trip to the daemon; returns the daemon's wall clock (seconds since the epoch)."""
        reply = await self._call(P.ping_request, P.Pong, timeout)
        return reply.time

    async def ready(self, timeout: float | None = _DEFAULT) -> bool:
        """Whether the daemon serves generations now (False while it is still loading its model)."""
        reply = await self._call(P.ping_request, P.Pong, timeout)
        return reply.state == "ready"

    async def metrics(self, timeout: float | None = _DEFAULT) -> list[dict[str, Any]]:
        """The daemon's metric families (counters, gauges, histograms; ``hmaclient.protocol``, "metrics").

        A daemon older than protocol version 2 answers ``unknown_type`` (a RequestError)."""
        reply = await self._call(P.metrics_request, P.Metrics, timeout)
        return reply.families

    async def model_request(
        self, kind: str, model: str | None = None, timeout: float | None = _DEFAULT
    ) -> dict[str, Any]:
        """A model request (protocol version 5): ``models``, ``load``, ``unload``, ``remove`` or ``pull``
        (``model`` names the model of the last three); the ``result`` reply's values (docs/protocol.md,
        "Models"). A refusal raises RequestError with its code (e.g. model_not_found, model_in_use)."""
        reply = await self._call(lambda i: P.model_request(kind, i, model), P.Result, timeout)
        return reply.values

    async def connect(self) -> None:
        """Check the socket path is safe, open the socket and check the daemon answers (once; again after a
        lost connection). Raises UnsafeSocket, DaemonUnreachable."""
        if self._closed:
            raise RuntimeError("this hmaclient is closed")
        if self._sock is None:
            self._check_path()
            self._open()
        if self._reachable:
            return
        async with self._connect_lock:
            if self._reachable:
                return
            self._check_path()
            try:
                await self._roundtrip(P.ping_request, P.Pong, self.connect_timeout)
            except HmadTimeout:
                detail = f"no answer to ping within {self.connect_timeout:g} s"
                raise DaemonUnreachable(self.path, detail) from None
            self._reachable = True

    async def close(self) -> None:
        """Cancel the generations still running, stop the reader and close the socket."""
        if self._closed:
            return
        self._closed = True
        for p in list(self._pending.values()):
            if p.generation and not p.abandoned:  # abandoned ones were cancelled already
                self._cancel_nowait(p.id)
            p.queue.put_nowait(_CLOSED)
        self._pending.clear()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
            self._monitor.close(linger=0)
            self._sock.close(linger=LINGER_MS)

    # -- socket and reader -----------------------------------------------------------------------------

    def _check_path(self) -> None:
        reason = safepath.unsafe_reason(self.path)
        if reason is not None:
            raise UnsafeSocket(self.path, reason)
        try:
            os.stat(self.path)
        except PermissionError:
            raise DaemonUnreachable(
                self.path, "permission denied: is this user in the socket's group?"
            ) from None
        except OSError:
            raise DaemonUnreachable(self.path, "no socket file there") from None

    def _open(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._connect_lock = asyncio.Lock()
        sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TTL_MS)
        sock.setsockopt(zmq.MAXMSGSIZE, P.MAX_REPLY_BYTES)
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sock.connect(self._endpoint)
        self._sock = sock
        self._tasks = [
            asyncio.create_task(self._read_replies(), name="hmaclient-reader"),
            asyncio.create_task(self._watch_connection(), name="hmaclient-monitor"),
        ]

    async def _read_replies(self) -> None:
        """Route every reply to its request's queue; drop those of requests no one waits for."""
        while True:
            frames = await self._sock.recv_multipart()
            if len(frames) != 1:
                log.warning("dropped a reply of %d frames (the protocol sends one)", len(frames))
                continue
            try:
                reply = P.parse_reply(frames[0])
            except P.ProtocolError as e:
                self._route_malformed(e)
                continue
            pending = self._pending.get(reply.id)
            if pending is None:
                log.debug("dropped a %s reply for id %r (not waited for)", type(reply).__name__, reply.id)
            elif pending.abandoned:  # a left stream: drop its replies; its id is free after the last one
                if isinstance(reply, P.Done | P.Error | P.Cancelled):
                    del self._pending[reply.id]
            else:
                pending.queue.put_nowait(reply)

    def _route_malformed(self, e: P.ProtocolError) -> None:
        """A reply that breaks the protocol: the request it names (if one waits) fails with the error at once
        and its id is freed (its replies, if more come, are dropped; a stream left on the error cancels
        it); one naming no such request is dropped."""
        pending = self._pending.get(e.id) if isinstance(e.id, int | str) else None
        if pending is None:
            log.warning("dropped a malformed reply: %s", e)
            return
        log.warning("a malformed reply to request %r: %s", e.id, e)
        del self._pending[e.id]
        if not pending.abandoned:
            pending.queue.put_nowait(P.ProtocolError(e.code, f"malformed reply from hmad: {e.message}", e.id))

    async def _watch_connection(self) -> None:
        """On a disconnect, fail the requests in flight (after replies already received are read)."""
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._reachable = False
                stranded = list(self._pending.values())
                self._loop.call_later(LOST_GRACE_S, self._fail_lost, stranded)

    def _fail_lost(self, stranded: list[_Pending]) -> None:
        for p in stranded:
            if self._pending.get(p.id) is p:
                if p.abandoned:
                    del self._pending[p.id]
                else:
                    p.queue.put_nowait(_LOST)

    # -- requests ---------------------------------------------------------------------------------------

    def _stream(
        self, prompt: str | None, messages: Any, id: P.Id, params: dict[str, Any], **kw: Any
    ) -> AsyncStream:
        if isinstance(params.get("stop"), str):
            params = {**params, "stop": [params["stop"]]}
        if params.get("images") is not None:
            params = {**params, "images": read_images(params["images"], "images")}
        if messages is not None:
            messages = [_read_parts(i, m) for i, m in enumerate(messages)]
        rid = next(self._ids) if id is None else id
        msg = P.generate_request(rid, prompt, messages, stream=kw.pop("stream"), **params)
        return AsyncStream(self, msg, **kw)

    def _register(self, id: P.Id, generation: bool) -> _Pending:
        if id in self._pending:
            state = "still being cancelled" if self._pending[id].abandoned else "already in flight"
            raise ValueError(f"request id {id!r} is {state} on this client")
        p = self._pending[id] = _Pending(id, generation)
        return p

    def _unregister(self, p: _Pending) -> None:
        if self._pending.get(p.id) is p:
            del self._pending[p.id]

    async def _send(self, msg: dict[str, Any]) -> None:
        frame = P.pack(msg)
        if len(frame) > P.MAX_FRAME_BYTES:
            raise P.ProtocolError(P.TOO_LARGE, f"request of {len(frame)} bytes is over {P.MAX_FRAME_BYTES}")
        await self._sock.send(frame)

    def _cancel_nowait(self, id: P.Id) -> None:
        """Send ``cancel`` without waiting (from cleanup code, even inside a cancelled task)."""
        if self._sock is None or self._sock.closed:
            return
        try:
            fut = self._sock.send(P.pack(P.cancel_request(id)), flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:
            log.warning("could not send cancel for %r: %s", id, e)
            return
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieve, never raise

    async def _next_reply(self, p: _Pending, timeout: float | None) -> P.Reply:
        try:
            async with asyncio.timeout(timeout):
                reply = await p.queue.get()
        except TimeoutError:
            raise HmadTimeout(f"no reply from hmad within {timeout:.3g} s (request {p.id!r})") from None
        if reply is _LOST:
            raise ConnectionLost(self.path)
        if reply is _CLOSED:
            raise RuntimeError("this hmaclient was closed while the request ran")
        if isinstance(reply, P.ProtocolError):  # the daemon's reply to it broke the protocol
            raise reply
        return reply

    async def _call(self, build: Any, expect: type[T], timeout: float | None) -> T:
        if timeout is _DEFAULT:
            timeout = self.timeout if self.timeout is not None else STATUS_TIMEOUT_S
        await self.connect()
        return await self._roundtrip(build, expect, timeout)

    async def _roundtrip(self, build: Any, expect: type[T], timeout: float | None) -> T:
        """One request, one reply (status, ping)."""
        p = self._register(next(self._ids), generation=False)
        try:
            await self._send(build(p.id))
            reply = await self._next_reply(p, timeout)
        finally:
            self._unregister(p)
        if isinstance(reply, P.Error):
            raise RequestError(reply.code, reply.message, reply.id)
        if not isinstance(reply, expect):
            raise P.ProtocolError(P.BAD_REQUEST, f"expected a {expect.__name__} reply, got {reply!r:.200}")
        return reply


class Client:
    """The blocking client: an AsyncClient driven on a private event loop thread.

    Calls may come from several threads (each runs as a task on the private loop), and from inside a
    running event loop (e.g. Jupyter), where ``asyncio.run`` would fail.
    Same methods as AsyncClient; ``stream()`` returns a plain iterator whose early ``break`` or
    ``close()`` cancels the request. Ctrl-C during a call cancels that call's request.
    """

    def __init__(
        self, socket_path: str | None = None, *, timeout: float | None = None, connect_timeout: float = 3.0
    ):
        self._async = AsyncClient(socket_path, timeout=timeout, connect_timeout=connect_timeout)
        self.path = self._async.path
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="hmaclient-loop", daemon=True)
        self._thread.start()
        self._closed = False

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(self, prompt: str | None = None, **kw: Any) -> Result:
        return self._run(self._async.generate(prompt, **kw))

    def stream(self, prompt: str | None = None, **kw: Any) -> Generator[Piece, None, Result | None]:
        """A generator of Pieces; building the request (and any ProtocolError) happens at this call. Its
        return value (``StopIteration.value``, or ``yield from``'s) is the finished Result (tool_calls)."""
        astream = self._async.stream(prompt, **kw)
        return self._iterate(astream)

    def cancel(self, id: P.Id) -> None:
        self._run(self._async.cancel(id))

    def status(self, timeout: float | None = _DEFAULT) -> dict[str, Any]:
        return self._run(self._async.status(timeout))

    def ping(self, timeout: float | None = _DEFAULT) -> float:
        return self._run(self._async.ping(timeout))

    def ready(self, timeout: float | None = _DEFAULT) -> bool:
        return self._run(self._async.ready(timeout))

    def metrics(self, timeout: float | None = _DEFAULT) -> list[dict[str, Any]]:
        return self._run(self._async.metrics(timeout))

    def model_request(
        self, kind: str, model: str | None = None, timeout: float | None = _DEFAULT
    ) -> dict[str, Any]:
        return self._run(self._async.model_request(kind, model, timeout))

    def connect(self) -> None:
        self._run(self._async.connect())

    def close(self) -> None:
        """Cancel running generations, close the socket and stop the loop thread."""
        if self._closed:
            return
        self._closed = True
        try:
            self._run(_close_and_settle(self._async))
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def _iterate(self, astream: AsyncStream) -> Generator[Piece, None, Result | None]:
        try:
            while True:
                piece = self._run(_next_or_none(astream))
                if piece is None:
                    return astream.result
                yield piece
        finally:
            if not self._closed:
                self._run(astream.aclose())

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed and self._loop.is_closed():
            coro.close()
            raise RuntimeError("this hmaclient is closed")
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result()
        except BaseException:
            fut.cancel()  # KeyboardInterrupt and friends: the task's cleanup cancels its request
            raise


def read_images(images: Any, where: str) -> Any:
    """A list of images (bytes, or paths read here) -> their bytes; anything else is left to the wire's
    check to name."""
    if not isinstance(images, list | tuple):
        return images
    return [image_bytes(x, f"{where}[{j}]") for j, x in enumerate(images)]


def image_bytes(image: Any, where: str) -> Any:
    """An image: bytes as they are; a path (str or os.PathLike) -> the file's bytes, or a ProtocolError
    naming ``where`` and the file when it is missing, unreadable, over the request limit or no image."""
    if isinstance(image, bytearray | memoryview):
        return bytes(image)
    if not isinstance(image, str | os.PathLike):
        return image  # bytes, or something the wire's check refuses by name
    path = os.fspath(image)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > P.MAX_FRAME_BYTES:
                msg = f"{where}: {path!r} is {size} bytes, over a request's limit of {P.MAX_FRAME_BYTES}"
                raise P.ProtocolError(P.TOO_LARGE, msg)
            data = f.read(P.MAX_FRAME_BYTES + 1)
    except OSError as e:
        raise P.ProtocolError(P.BAD_REQUEST, f"{where}: cannot read image {path!r}: {e.strerror}") from None
    if P.image_format(data) is None:
        kinds = "/".join(k.upper() for k in P.IMAGE_SIGNATURES)
        raise P.ProtocolError(P.BAD_REQUEST, f"{where}: {path!r} is not an image file ({kinds})")
    return data


def _read_parts(i: int, m: Any) -> Any:
    """A message whose content is a list of parts, with each image part's path read (a copy)."""
    if not isinstance(m, dict) or not isinstance(m.get("content"), list):
        return m
    parts = [
        {**p, "image": image_bytes(p["image"], f"messages[{i}].content[{j}].image")}
        if isinstance(p, dict) and p.get("type") == "image" and "image" in p
        else p
        for j, p in enumerate(m["content"])
    ]
    return {**m, "content": parts}


async def _close_and_settle(client: AsyncClient) -> None:
    """Close ``client``, then cancel every other task still on this loop and wait for them, as
    ``asyncio.run`` does at its end. A Ctrl-C can land between two bytecodes of ``Client._run`` (after
    its task was scheduled, before it could be cancelled); such an orphan must end before the loop closes."""
    await client.close()
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in others:
        task.cancel()
    await asyncio.gather(*others, return_exceptions=True)


async def _next_or_none(astream: AsyncIterator[Piece]) -> Piece | None:
    try:
        return await astream.__anext__()
    except StopAsyncIteration:
        return None
