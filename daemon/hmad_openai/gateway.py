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
from hmaclient.errors import RequestError
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


NAME_TTL_S = 5.0  # how long the served model's name is taken as known
MODELS_TTL_S = 10.0  # how long hmad's list of models on disk is taken as known


def model_key(name: str) -> str:
    """A model's name as requests may spell it: case, an ``hf:`` / ``hf.co/`` prefix and Ollama's
    ``:latest`` aside."""
    key = name.strip().lower()
    for prefix in ("hf:", "hf.co/", "huggingface.co/"):
        key = key.removeprefix(prefix)
    return key.removesuffix(":latest")


class ClientGone(Exception):
    """The HTTP client disconnected while its request waited."""


class Gateway:
    """The app's state: one hmaclient connection (made at start-up), the model name, request counts."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.client: AsyncClient | None = None
        self._model_name = settings.model_name
        self._named_at = 0.0
        self._models: list[dict[str, Any]] = []  # hmad's models on disk, as its ``models`` request lists them
        self._models_at = -MODELS_TTL_S
        self._served_spec: str | None = None
        self.requests = Counter(
            "hmad_openai_requests",
            "HTTP requests to the gateway by endpoint and status",
            ["endpoint", "status"],
            registry=None,
        )

    async def model_name(self, refresh: bool = False) -> str:
        """``--model-name``, else hmad's model name (asked again when ``refresh``, or after NAME_TTL_S: hmad
        may have switched models since)."""
        if self.settings.model_name:
            return self.settings.model_name
        if self._model_name is None or refresh or time.monotonic() - self._named_at > NAME_TTL_S:
            info = await self.client.status()
            self._model_name = info.get("model_name") or os.path.basename(str(info.get("model", "hmad")))
            self._named_at = time.monotonic()
        return self._model_name

    async def model_for(self, asked: str | None) -> str | None:
        """The model to ask hmad for (a generate's ``model``) when a request's ``model`` names one on hmad's
        disk other than the one it serves (hmad then switches, if its config allows: docs/models.md); None
        for the served model and for any other name (served by the loaded model, as before)."""
        if not asked or asked == self.settings.model_name:
            return None
        want = model_key(asked)
        if want in (model_key(await self.model_name()), model_key(self._served_spec or "")):
            return None
        for entry in await self._disk_models(want):
            if model_key(entry.get("name", "")) == want:
                if entry.get("loaded"):
                    return None
                self._model_name = None  # hmad switches: its name is asked again
                return entry["name"]
        return None

    async def _disk_models(self, want: str) -> list[dict[str, Any]]:
        """hmad's models on disk (its ``models`` request), kept MODELS_TTL_S; asked again for a name not
        among them (a model pulled since). An hmad before protocol version 5: none."""
        now = time.monotonic()
        known = any(model_key(e.get("name", "")) == want for e in self._models)
        if now - self._models_at > MODELS_TTL_S or (not known and now - self._models_at > 1.0):
            try:
                got = await self.client.model_request("models")
            except RequestError:  # an older hmad (unknown_type) or a refusal: nothing to switch to
                got = {}
            self._models, self._models_at = got.get("models", []), now
            self._served_spec = got.get("loaded")
        return self._models


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
