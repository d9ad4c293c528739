"""Anthropic's Messages API: ``POST /v1/messages`` (:data:`ROUTES`, mounted by ``app.build_app``), answered
whole or streamed as Anthropic's server-sent events:

    message_start (usage.input_tokens 0: hmad counts the prompt by the end), then per content block
    content_block_start, content_block_delta (text_delta | input_json_delta), content_block_stop (a ping
    after the first block's start), then message_delta (stop_reason, stop_sequence, usage with
    output_tokens and input_tokens) and message_stop. An error after the start is an ``error`` event.

What each request field becomes is ``anthropic_schema``'s docstring. ``stop_reason``: "max_tokens" when
max_tokens (or the context) ran out, "tool_use" when the answer is tool calls (tool_use blocks, their input
the call's arguments), "stop_sequence" (with ``stop_sequence`` the string) when a stop string ended it
(hmad's ``done`` names it), else "end_turn". Usage: ``input_tokens`` the prompt tokens hmad computed,
``cache_read_input_tokens`` those its prefix cache gave (their sum is the prompt), ``output_tokens`` the
generated ones. The key may come as ``x-api-key`` (``app``). Errors are
``{"type": "error", "error": {"type", "message"}}`` with the HTTP status.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hmaclient.results import Result
from hmaclient.stream import AsyncStream
from hmad_openai import runs
from hmad_openai.anthropic_schema import MessagesBody
from hmad_openai.bodies import parse
from hmad_openai.errors import OpenAIError, from_exception
from hmad_openai.gateway import gateway_of, read_body

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def error_body(err: OpenAIError) -> dict[str, Any]:
    kind = _ERROR_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def error_response(err: OpenAIError) -> Response:
    """Anthropic's error shape."""
    return JSONResponse(error_body(err), status_code=err.status)


async def messages(request: Request) -> Response:
    body = parse(MessagesBody, await read_body(request))
    params, gw = body.params(), gateway_of(request)
    other = await gw.model_for(body.model)  # a model on hmad's disk other than the served one
    if other is not None:
        params["model"] = other
    reply = _Reply(body.model if other else await gw.model_name())
    if body.stream:
        return await runs.streamed(request, {}, params, reply.events_of(runs.may_call(params)), runs.SSE)
    result = await runs.whole(request, {}, params)
    return JSONResponse({**reply.head(), "content": _blocks(result), **reply.tail(result)})


def _blocks(r: Result) -> list[dict[str, Any]]:
    if r.tool_calls:
        return [_tool_use(c) for c in r.tool_calls]
    return [{"type": "text", "text": r.text}]


def _tool_use(call: dict[str, str]) -> dict[str, Any]:
    arguments = json.loads(call["arguments"])
    return {"type": "tool_use", "id": call["id"], "name": call["name"], "input": arguments}


def _usage(r: Result) -> dict[str, int]:
    cached = r.extra.get("cached_tokens") if isinstance(r.extra.get("cached_tokens"), int) else 0
    return {
        "input_tokens": r.prompt_tokens - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": r.generated_tokens,
    }


class _Reply:
    """One answer's shared fields and its stream of events."""

    def __init__(self, model: str):
        self.model, self.id = model, "msg_" + uuid.uuid4().hex

    def head(self) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model}

    def tail(self, r: Result) -> dict[str, Any]:
        stop = r.extra.get("stop_sequence") if isinstance(r.extra.get("stop_sequence"), str) else None
        reason = _STOP_REASONS.get(r.finish_reason) or ("stop_sequence" if stop else "end_turn")
        return {"stop_reason": reason, "stop_sequence": stop, "usage": _usage(r)}

    def events_of(self, may_call: bool):
        def events(stream: AsyncStream) -> AsyncIterator[str]:
            return self._events(stream, runs.CallWatch(may_call))

        return events

    async def _events(self, stream: AsyncStream, watch: runs.CallWatch) -> AsyncIterator[str]:
        usage = {"input_tokens": 0, "output_tokens": 0}
        start = {**self.head(), "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}
        yield runs.sse_event("message_start", {"type": "message_start", "message": start})
        blocks = _Blocks()
        try:
            async for p in stream:
                for event in blocks.text(watch.feed(p.text)):
                    yield event
            result = runs.finished(stream)
            for event in blocks.text(watch.rest(result)):
                yield event
            for event in blocks.finish(result):
                yield event
            tail = self.tail(result)
            delta = {"stop_reason": tail["stop_reason"], "stop_sequence": tail["stop_sequence"]}
            end = {"type": "message_delta", "delta": delta, "usage": tail["usage"]}
            yield runs.sse_event("message_delta", end)
            yield runs.sse_event("message_stop", {"type": "message_stop"})
        except Exception as e:  # noqa: BLE001 - every failure becomes the stream's error event
            yield runs.sse_event("error", error_body(from_exception(e)))


class _Blocks:
    """The content block events of a streamed answer: a text block opened at its first text, tool_use blocks
    at the end, an empty text block when there is nothing else."""

    def __init__(self):
        self.index, self.open = 0, False

    def text(self, text: str) -> list[str]:
        if not text:
            return []
        events = [] if self.open else self.text_start()
        return [*events, _delta(self.index, {"type": "text_delta", "text": text})]

    def text_start(self) -> list[str]:
        self.open = True
        return self._start({"type": "text", "text": ""})

    def finish(self, r: Result) -> list[str]:
        events = self.text_start() if not self.open and not r.tool_calls else []  # an empty answer's block
        events += self._stop() if self.open else []
        for call in r.tool_calls:
            events += self._start({**_tool_use(call), "input": {}})
            partial = {"type": "input_json_delta", "partial_json": call["arguments"]}
            events.append(_delta(self.index, partial))
            events += self._stop()
        return events

    def _start(self, block: dict[str, Any]) -> list[str]:
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        events = [runs.sse_event("content_block_start", start)]
        return events + [runs.sse_event("ping", {"type": "ping"})] if self.index == 0 else events

    def _stop(self) -> list[str]:
        event = runs.sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index})
        self.index, self.open = self.index + 1, False
        return [event]


def _delta(index: int, delta: dict[str, Any]) -> str:
    event = {"type": "content_block_delta", "index": index, "delta": delta}
    return runs.sse_event("content_block_delta", event)


ROUTES = [Route("/v1/messages", messages, methods=["POST"])]
