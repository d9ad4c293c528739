"""The gateway's ASGI app (Starlette): OpenAI's HTTP API in front of one hmad, through hmaclient only.

    GET  /v1/models, /v1/models/{id}   the served model (its name from ``--model-name``, else hmad's status)
    POST /v1/chat/completions          messages -> hmad's chat template; streamed as server-sent events
    POST /v1/completions               a raw prompt (no template)
    GET  /metrics                      Prometheus text: hmad's metrics (``hmad_*``), the gateway's requests
                                       (``hmad_openai_requests_total``) and ``hmad_up``
    GET  /health                       200 when hmad is ready, else 503 (loading, unreachable; no key needed)

Every request must name a loopback address or an ``--allowed-host`` name in its Host header, and a POST
must be ``Content-Type: application/json`` (``hmad_openai.guards``); the server cuts off slow request heads
and bodies (``hmad_openai.deadlines``). Unknown paths and methods get OpenAI-style JSON errors (404, 405).
With an API key set, every path but /health needs ``Authorization: Bearer <key>`` (else 401). A client that
disconnects has its generation cancelled in hmad: a stream when the server sees the disconnect, a
stream=false request through a watch on the connection while it waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest
from prometheus_client.registry import CollectorRegistry
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hmaclient import protocol as P
from hmaclient.client import AsyncClient
from hmaclient.errors import HmaError, RequestError
from hmaclient.prometheus import FamiliesCollector
from hmaclient.stream import AsyncStream
from hmad_openai import responses as R
from hmad_openai.errors import OpenAIError, bad_request, from_exception
from hmad_openai.guards import AllowedHosts, require_json
from hmad_openai.schema import ChatRequest, CompletionRequest, parse

log = logging.getLogger("hmad_openai")

MAX_BODY_BYTES = (
    8 * 1024 * 1024
)  # hmad takes prompts up to 1 Mi characters (<= 4 MiB of UTF-8) in 4 MiB frames
METRICS_TIMEOUT_S = 5.0
ENDPOINTS = ("/v1/models", "/v1/chat/completions", "/v1/completions", "/metrics", "/health")


@dataclass
class Settings:
    """What ``hmad-openai`` is told: hmad's socket (None: hmaclient's default), the bearer token (None: no
    authentication), the model name to report (None: hmad's), the web origins whose pages may call the API
    (CORS; none by default, "*" for any), the Host names answered besides the loopback ones ("*" for any)."""

    socket: str | None = None
    api_key: str | None = None
    model_name: str | None = None
    cors_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()


class ClientGone(Exception):
    """The HTTP client disconnected while its request waited."""


class Gateway:
    """The app's state: one hmaclient connection (made at start-up), the model name, request counts."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.client: AsyncClient | None = None
        self._model_name = settings.model_name
        self.requests = Counter(
            "hmad_openai_requests",
            "HTTP requests to the gateway by endpoint and status",
            ["endpoint", "status"],
            registry=None,
        )

    async def model_name(self, refresh: bool = False) -> str:
        """``--model-name``, else hmad's model name (asked once, again when ``refresh``)."""
        if self.settings.model_name:
            return self.settings.model_name
        if self._model_name is None or refresh:
            info = await self.client.status()
            self._model_name = info.get("model_name") or os.path.basename(str(info.get("model", "hmad")))
        return self._model_name


# -- handlers ---------------------------------------------------------------------------------------------


async def chat_completions(request: Request) -> Response:
    req = parse(ChatRequest, await _body(request))
    return await _generation(request, req, req.params(), chat=True, messages=req.hmad_messages())


async def completions(request: Request) -> Response:
    req = parse(CompletionRequest, await _body(request))
    return await _generation(request, req, req.params(), chat=False, prompt=req.text(), raw=True)


async def _generation(
    request: Request, req: ChatRequest | CompletionRequest, params: dict[str, Any], chat: bool, **inputs: Any
) -> Response:
    """One generation for either endpoint: ``inputs`` are what hmaclient takes besides ``params`` (chat:
    the messages; completions: the raw prompt). Streamed as SSE or answered whole; a refusal is an HTTP
    error, a client gone before the answer cancels the generation."""
    gw: Gateway = request.app.state.gateway
    reply = R.Reply(await gw.model_name(), chat=chat)
    if req.stream:
        stream = gw.client.stream(**inputs, **params)
        return await _streamed(request, reply, stream, req.include_usage)
    result = await _unless_disconnected(request, gw.client.generate(**inputs, **params))
    return JSONResponse(reply.whole(result))


async def list_models(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    name = await gw.model_name(refresh=True)
    return JSONResponse({"object": "list", "data": [R.model_object(name, await _started(gw))]})


async def get_model(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    name = await gw.model_name(refresh=True)
    if request.path_params["model"] != name:
        raise OpenAIError(
            404,
            f"the model {request.path_params['model']!r} does not exist (hmad serves {name!r})",
            code="model_not_found",
            param="model",
        )
    return JSONResponse(R.model_object(name, await _started(gw)))


async def metrics(request: Request) -> Response:
    """hmad's metric families, the gateway's request counts and ``hmad_up`` (0 when hmad did not answer)."""
    gw: Gateway = request.app.state.gateway
    try:
        families, up = await gw.client.metrics(timeout=METRICS_TIMEOUT_S), 1
    except (HmaError, OSError) as e:
        log.warning("/metrics: no metrics from hmad: %s", e)
        families, up = [], 0
    families.append(
        {
            "name": "up",
            "type": "gauge",
            "help": "1 when hmad answered the metrics request",
            "samples": [{"labels": {}, "value": up}],
        }
    )
    registry = CollectorRegistry(auto_describe=False)
    registry.register(gw.requests)
    registry.register(FamiliesCollector(families))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


async def health(request: Request) -> Response:
    gw: Gateway = request.app.state.gateway
    if not await gw.client.ready(timeout=METRICS_TIMEOUT_S):  # as llama-server's 503 while it loads
        raise OpenAIError(503, "hmad is loading its model", "service_unavailable", P.LOADING)
    return JSONResponse({"status": "ok"})


# -- pieces -----------------------------------------------------------------------------------------------


async def _body(request: Request) -> bytes:
    """The JSON body (415 for another Content-Type, 413 past MAX_BODY_BYTES; ClientGone if the client left
    or was cut off by the body deadline)."""
    require_json(request.headers.get("content-type"))
    chunks, n = [], 0
    try:
        async for chunk in request.stream():
            n += len(chunk)
            if n > MAX_BODY_BYTES:
                raise OpenAIError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone from None
    return b"".join(chunks)


async def _started(gw: Gateway) -> int:
    """When hmad started serving (the models' ``created``)."""
    info = await gw.client.status()
    return int(time.time() - float(info.get("uptime_s", 0.0)))


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """``work``'s result; if the HTTP client disconnects first, cancel it (hmaclient then cancels the
    generation in hmad) and raise ClientGone."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request.receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watch.cancel()
    if not task.done() or task.cancelled():
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise ClientGone
    return task.result()


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _streamed(request: Request, reply: R.Reply, stream: AsyncStream, include_usage: bool) -> Response:
    """Wait until hmad accepts the request (a refusal is an HTTP error), then stream its pieces as SSE."""
    await _unless_disconnected(request, stream.start())
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    events = _events(reply, stream, include_usage)
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


async def _events(reply: R.Reply, stream: AsyncStream, include_usage: bool) -> AsyncIterator[str]:
    """The SSE body. Starlette cancels it when the client disconnects; leaving the stream cancels the
    generation. An error after the start goes out as an ``error`` event (the OpenAI client raises it)."""
    try:
        if reply.chat:
            yield R.sse(reply.chunk(None, role=True))
        async for piece in stream:
            if piece.text:
                yield R.sse(reply.chunk(piece.text))
        result = stream.result
        if result.finish_reason == "cancelled":
            raise OpenAIError(503, "hmad cancelled the request (it is shutting down)", "service_unavailable")
        yield R.sse(reply.chunk(None, result.finish_reason))
        if include_usage:
            yield R.sse(reply.usage_chunk(result))
    except Exception as e:  # noqa: BLE001 - every failure becomes the stream's error event
        yield R.sse(_error(e).body())
    finally:
        await stream.aclose()
    yield R.DONE_EVENT


def _error(e: Exception) -> OpenAIError:
    err = from_exception(e)
    if "json_schema" in err.message and isinstance(e, P.ProtocolError | RequestError):
        msg = f"response_format needs hmad's structured output (generate's json_schema): {err.message}"
        return bad_request(msg, "response_format", err.code)
    return err


async def _no_route(request: Request, e: Exception) -> Response:
    """Starlette's 404 (no such path) and 405 (method not allowed) as OpenAI-style JSON errors."""
    assert isinstance(e, HTTPException)
    what = "no such endpoint" if e.status_code == 404 else "method not allowed"
    err = OpenAIError(
        e.status_code, f"{what}: {request.method} {request.url.path}", code=_ROUTE_CODES.get(e.status_code)
    )
    response = err.response()
    response.headers.update(e.headers or {})
    return response


_ROUTE_CODES = {404: "not_found", 405: "method_not_allowed"}


async def _on_error(request: Request, e: Exception) -> Response:
    if isinstance(e, ClientGone):
        return Response(status_code=499)  # nobody reads it: the client left (nginx's "client closed")
    err = _error(e)
    if err.status >= 500:
        log.warning("%s %s: %s", request.method, request.url.path, err.message)
    return err.response()


# -- middleware -------------------------------------------------------------------------------------------


class BearerAuth:
    """401 unless ``Authorization: Bearer <key>`` (compared in constant time); /health is open."""

    def __init__(self, app: ASGIApp, key: str | None):
        self.app, self.key = app, (key or "").encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.key and scope["path"] != "/health":
            scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.key):
                missing = "no API key given" if not token else "incorrect API key"
                err = OpenAIError(401, f"{missing}: send Authorization: Bearer <key>", code="invalid_api_key")
                response = err.response()
                response.headers["WWW-Authenticate"] = "Bearer"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class CountRequests:
    """Counts every HTTP request by endpoint (known paths only) and response status."""

    def __init__(self, app: ASGIApp, counter: Counter):
        self.app, self.counter = app, counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = "/v1/models" if path.startswith("/v1/models") else path if path in ENDPOINTS else "other"

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.counter.labels(endpoint, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)


def build_app(settings: Settings) -> Starlette:
    """The ASGI app; its hmaclient connects to hmad lazily (hmad may start after the gateway)."""
    gw = Gateway(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        gw.client = AsyncClient(settings.socket)
        try:
            yield
        finally:
            await gw.client.close()

    routes = [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", get_model, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    # Exception itself is left out: Starlette's handler of last resort answers 500 and logs the traceback.
    handled = (OpenAIError, HmaError, P.ProtocolError, ClientGone)
    handlers: dict[Any, Any] = {**dict.fromkeys(handled, _on_error), HTTPException: _no_route}
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)
    app.state.gateway = gw
    app.add_middleware(BearerAuth, key=settings.api_key)
    if settings.cors_origins:  # outside the key check: a browser's preflight carries no Authorization
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
    app.add_middleware(AllowedHosts, allowed=settings.allowed_hosts)  # before CORS: every request
    app.add_middleware(CountRequests, counter=gw.requests)  # outermost: refusals are counted too
    return app
