"""What every API of the gateway shares: its settings, its state (one hmaclient connection), reading a
request body within its limits, and cancelling work when the HTTP client leaves.

The API modules (``openai_api`` and the others ``app.build_app`` mounts) import from here, never from each
other.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter
from starlette.requests import ClientDisconnect, Request
from starlette.types import Receive

from hmaclient import protocol as P
from hmaclient.client import AsyncClient
from hmad_openai.errors import OpenAIError
from hmad_openai.guards import require_json

# hmad takes requests in frames of hmaclient.protocol.MAX_FRAME_BYTES (images included); base64 makes an
# image a third bigger in a JSON body
MAX_BODY_BYTES = P.MAX_FRAME_BYTES * 3 // 2


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


def gateway_of(request: Request) -> Gateway:
    """The app's Gateway."""
    return request.app.state.gateway


async def read_body(request: Request) -> bytes:
    """The JSON body (415 for another Content-Type from a web page: ``guards.require_json``; 413 past
    MAX_BODY_BYTES; ClientGone if the client left or was cut off by the body deadline)."""
    require_json(request.headers.get("content-type"), request.headers.get("origin"))
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


async def started(gw: Gateway) -> int:
    """When hmad started serving (the models' ``created``)."""
    info = await gw.client.status()
    return int(time.time() - float(info.get("uptime_s", 0.0)))


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
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
