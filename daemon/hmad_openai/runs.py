"""One generation for an API module, answered whole or streamed: the part every API's chat path shares.

A streamed answer is sent only once hmad has accepted the request, so a refusal (busy, a bad field, hmad
away) is still an HTTP error in the API's own shape; after that, the API's event generator turns pieces
into its events and any failure into its own error event. Leaving the generator (the client went away,
Starlette cancels it) cancels the generation in hmad.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse

from hmaclient.results import Result
from hmaclient.stream import AsyncStream
from hmad_openai.errors import OpenAIError
from hmad_openai.gateway import Gateway, gateway_of, unless_disconnected

SSE = "text/event-stream"
NDJSON = "application/x-ndjson"
_NO_BUFFERING = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def whole(request: Request, inputs: dict[str, Any], params: dict[str, Any]) -> Result:
    """The finished answer (cancelled in hmad if the HTTP client leaves first)."""
    gw: Gateway = gateway_of(request)
    return await unless_disconnected(request, gw.client.generate(**inputs, **params))


async def streamed(
    request: Request,
    inputs: dict[str, Any],
    params: dict[str, Any],
    events: Callable[[AsyncStream], AsyncIterator[str]],
    media_type: str,
) -> StreamingResponse:
    """Start the generation, wait until hmad accepts it, then stream ``events(stream)``."""
    gw: Gateway = gateway_of(request)
    stream = gw.client.stream(**inputs, **params)
    await unless_disconnected(request, stream.start())
    return StreamingResponse(_closing(stream, events(stream)), media_type=media_type, headers=_NO_BUFFERING)


async def _closing(stream: AsyncStream, body: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        async for chunk in body:
            yield chunk
    finally:
        await stream.aclose()


def finished(stream: AsyncStream) -> Result:
    """The stream's result once its pieces are read; a generation hmad cancelled (it is shutting down) is
    an error."""
    result = stream.result
    if result is None or result.finish_reason == "cancelled":
        raise OpenAIError(503, "hmad cancelled the request (it is shutting down)", "service_unavailable")
    return result


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse_event(name: str, obj: dict[str, Any]) -> str:
    """A server-sent event with its ``event:`` name (as Anthropic's and the Responses API's streams)."""
    return f"event: {name}\ndata: {dumps(obj)}\n\n"


def may_call(params: dict[str, Any]) -> bool:
    """Whether the answer to a generate with ``params`` may be tool calls (tools given, choice not none)."""
    return bool(params.get("tools")) and params.get("tool_choice") != "none"


_SPACE = " \t\r\n"  # what may come before a call (hmad.engine.tool_calls.SPACE)


class CallWatch:
    """A streamed answer's text, held back where it may be a tool call: with tools callable, an answer is a
    call exactly when its first non-space character is ``{`` or ``[`` (hmad.engine.tool_calls), and the
    calls then come whole in the result; any other answer streams as text."""

    def __init__(self, may_call: bool):
        self.held, self.mode = "", "watch" if may_call else "text"

    def feed(self, text: str) -> str:
        """The text to send now."""
        if self.mode == "text":
            return text
        self.held += text
        if self.mode == "watch" and self.held.strip(_SPACE):
            self.mode = "call" if self.held.lstrip(_SPACE)[0] in "{[" else "text"
            if self.mode == "text":
                out, self.held = self.held, ""
                return out
        return ""

    def rest(self, result: Result) -> str:
        """The text still held once the answer is finished: none when it was calls."""
        out, self.held = ("" if result.tool_calls else self.held), ""
        return out
