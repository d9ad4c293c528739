"""The gateway's ASGI app (Starlette): HTTP APIs in front of one hmad, through hmaclient only. Each API is
a module of routes; this module mounts them and owns what they share: the guards, the authentication, the
error pages (in each API's own shape) and the request counts.

    openai_api      GET /v1/models[/{id}], POST /v1/chat/completions, /v1/completions
    responses_api   POST /v1/responses (OpenAI's Responses API, stateless)
    anthropic_api   POST /v1/messages (Anthropic's Messages API)
    ollama_api      GET|HEAD /, GET /api/version, /api/tags, /api/ps, POST /api/show, /api/chat, /api/generate
    here            GET /metrics (Prometheus text: hmad's metrics ``hmad_*``, the gateway's requests
                    ``hmad_openai_requests_total`` and ``hmad_up``), GET /health (200 when hmad is ready,
                    else 503; no key needed)

Every request must name a loopback address or an ``--allowed-host`` name in its Host header, and a POST
from a web page (with an ``Origin``) must be ``Content-Type: application/json`` (``hmad_openai.guards``);
the server cuts off slow request heads and bodies (``hmad_openai.deadlines``). Errors, unknown paths and
methods (404, 405) included, are JSON in the shape of the API the path belongs to: Ollama's
``{"error": "..."}`` under /api/, Anthropic's ``{"type": "error", "error": {...}}`` under /v1/messages,
OpenAI's elsewhere. With an API key set, every path but /health and / needs it, as ``Authorization: Bearer
<key>`` or ``x-api-key: <key>`` (Anthropic's header), else 401. A client that disconnects has its generation
cancelled in hmad: a stream when the server sees the disconnect, a stream=false request through a watch on
the connection while it waits.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
from collections.abc import Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest
from prometheus_client.registry import CollectorRegistry
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hmaclient import protocol as P
from hmaclient.client import AsyncClient
from hmaclient.errors import HmaError
from hmaclient.prometheus import FamiliesCollector
from hmad_openai import anthropic_api, ollama_api, openai_api, responses_api
from hmad_openai.errors import OpenAIError
from hmad_openai.gateway import ClientGone, Gateway, Settings, gateway_of
from hmad_openai.guards import AllowedHosts
from hmad_openai.openai_api import openai_error

__all__ = ["Settings", "build_app"]

log = logging.getLogger("hmad_openai")

METRICS_TIMEOUT_S = 5.0
ENDPOINTS = (
    "/v1/models",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/",
    "/api/version",
    "/api/tags",
    "/api/ps",
    "/api/show",
    "/api/chat",
    "/api/generate",
    "/metrics",
    "/health",
)
OPEN_PATHS = frozenset({"/health", "/"})  # no key needed: health checks and Ollama's liveness probe
# Error shapes by path prefix (the first that matches); elsewhere OpenAI's.
SHAPES: tuple[tuple[str, Callable[[OpenAIError], Response]], ...] = (
    ("/api/", ollama_api.error_response),
    ("/v1/messages", anthropic_api.error_response),
)


def shaped(path: str, err: OpenAIError) -> Response:
    """``err`` in the shape of the API ``path`` belongs to."""
    for prefix, render in SHAPES:
        if path.startswith(prefix):
            return render(err)
    return err.response()


async def metrics(request: Request) -> Response:
    """hmad's metric families, the gateway's request counts and ``hmad_up`` (0 when hmad did not answer)."""
    gw: Gateway = gateway_of(request)
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
    gw: Gateway = gateway_of(request)
    if not await gw.client.ready(timeout=METRICS_TIMEOUT_S):  # as llama-server's 503 while it loads
        raise OpenAIError(503, "hmad is loading its model", "service_unavailable", P.LOADING)
    return JSONResponse({"status": "ok"})


async def _no_route(request: Request, e: Exception) -> Response:
    """Starlette's 404 (no such path) and 405 (method not allowed) as OpenAI-style JSON errors."""
    assert isinstance(e, HTTPException)
    what = "no such endpoint" if e.status_code == 404 else "method not allowed"
    err = OpenAIError(
        e.status_code, f"{what}: {request.method} {request.url.path}", code=_ROUTE_CODES.get(e.status_code)
    )
    response = shaped(request.url.path, err)
    response.headers.update(e.headers or {})
    return response


_ROUTE_CODES = {404: "not_found", 405: "method_not_allowed"}


async def _on_error(request: Request, e: Exception) -> Response:
    if isinstance(e, ClientGone):
        return Response(status_code=499)  # nobody reads it: the client left (nginx's "client closed")
    err = openai_error(e)
    if err.status >= 500:
        log.warning("%s %s: %s", request.method, request.url.path, err.message)
    return shaped(request.url.path, err)


# -- middleware -------------------------------------------------------------------------------------------


class KeyAuth:
    """401 unless the key comes as ``Authorization: Bearer <key>`` or ``x-api-key: <key>`` (compared in
    constant time); OPEN_PATHS need none."""

    def __init__(self, app: ASGIApp, key: str | None):
        self.app, self.key = app, (key or "").encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self.key and scope["path"] not in OPEN_PATHS:
            headers = Headers(scope=scope)
            scheme, _, token = headers.get("authorization", "").partition(" ")
            token = token.strip() if scheme.lower() == "bearer" else ""
            token = token or headers.get("x-api-key", "").strip()
            if not hmac.compare_digest(token.encode(), self.key):
                missing = "no API key given" if not token else "incorrect API key"
                text = f"{missing}: send Authorization: Bearer <key> (or x-api-key: <key>)"
                response = shaped(scope["path"], OpenAIError(401, text, code="invalid_api_key"))
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
        *openai_api.ROUTES,
        *ollama_api.ROUTES,
        *anthropic_api.ROUTES,
        *responses_api.ROUTES,
        Route("/metrics", metrics, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
    ]
    # Exception itself is left out: Starlette's handler of last resort answers 500 and logs the traceback.
    handled = (OpenAIError, HmaError, P.ProtocolError, ClientGone)
    handlers: dict[Any, Any] = {**dict.fromkeys(handled, _on_error), HTTPException: _no_route}
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)
    app.state.gateway = gw
    app.add_middleware(KeyAuth, key=settings.api_key)
    if settings.cors_origins:  # outside the key check: a browser's preflight carries no Authorization
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "x-api-key", "anthropic-version"],
        )
    app.add_middleware(AllowedHosts, allowed=settings.allowed_hosts)  # before CORS: every request
    app.add_middleware(CountRequests, counter=gw.requests)  # outermost: refusals are counted too
    return app
