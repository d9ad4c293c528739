"""OpenAI's Responses API, stateless: ``POST /v1/responses`` (:data:`ROUTES`, mounted by ``app.build_app``),
answered whole or streamed as its server-sent events, each with a ``sequence_number``:

    response.created, response.in_progress, then per output item: response.output_item.added,
    (a message) response.content_part.added, response.output_text.delta..., response.output_text.done,
    response.content_part.done | (a function call) response.function_call_arguments.delta,
    response.function_call_arguments.done; response.output_item.done; last response.completed (or
    response.incomplete when max_output_tokens ran out). An error after the start is an ``error`` event.

What each request field becomes is ``responses_schema``'s docstring. The output is one message (an
output_text part), or function_call items when the answer is tool calls. ``status`` "incomplete" with
``incomplete_details.reason`` "max_output_tokens" when max_output_tokens (or the context) ran out. Nothing is
stored: ``store`` reads false, ``previous_response_id`` is refused. Errors are OpenAI's shape.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from hmaclient.results import Result
from hmaclient.stream import AsyncStream
from hmad_openai import responses as R
from hmad_openai import runs
from hmad_openai.bodies import parse
from hmad_openai.errors import from_exception
from hmad_openai.gateway import gateway_of, read_body
from hmad_openai.responses_schema import RENAMES, ResponsesBody


async def responses(request: Request) -> Response:
    body = parse(ResponsesBody, await read_body(request), RENAMES)
    params, gw = body.params(), gateway_of(request)
    other = await gw.model_for(body.model)  # a model on hmad's disk other than the served one
    if other is not None:
        params["model"] = other
    reply = _Reply(body.model if other else await gw.model_name(), body)
    if body.stream:
        return await runs.streamed(request, {}, params, reply.events_of(runs.may_call(params)), runs.SSE)
    return JSONResponse(reply.response(await runs.whole(request, {}, params)))


def _usage(r: Result) -> dict[str, Any]:
    cached = r.extra.get("cached_tokens") if isinstance(r.extra.get("cached_tokens"), int) else 0
    return {
        "input_tokens": r.prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": r.generated_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": r.prompt_tokens + r.generated_tokens,
    }


class _Reply:
    """One response: its shared fields, its output items, and its stream of events."""

    def __init__(self, model: str, body: ResponsesBody):
        self.model, self.body = model, body
        self.id, self.created = "resp_" + uuid.uuid4().hex, int(time.time())
        self.message_id = "msg_" + uuid.uuid4().hex
        self.seq = 0

    def response(self, r: Result | None, output: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The response object: in progress (``r`` None) or finished."""
        status = "in_progress" if r is None else "incomplete" if r.finish_reason == "length" else "completed"
        b = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "model": self.model,
            "output": output if output is not None else (self.items(r) if r else []),
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None},
            "store": False,
            "temperature": b.temperature,
            "text": {"format": (b.text or {}).get("format") or {"type": "text"}},
            "tool_choice": b.tool_choice if b.tool_choice is not None else "auto",
            "tools": b.tools or [],
            "top_p": b.top_p,
            "truncation": "disabled",
            "usage": _usage(r) if r else None,
            "user": None,
            "metadata": {},
        }

    def items(self, r: Result) -> list[dict[str, Any]]:
        if r.tool_calls:
            return [self.call_item(c) for c in r.tool_calls]
        logprobs = R.chat_logprobs(r.logprobs)["content"] if r.logprobs is not None else []
        status = "incomplete" if r.finish_reason == "length" else "completed"
        return [self.message_item(r.text, status, logprobs)]

    def message_item(self, text: str | None, status: str, logprobs: list | None = None) -> dict[str, Any]:
        content = [] if text is None else [_text_part(text, logprobs or [])]
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    @staticmethod
    def call_item(call: dict[str, str], arguments: str | None = None) -> dict[str, Any]:
        return {
            "type": "function_call",
            "id": "fc_" + call["id"],
            "call_id": call["id"],
            "name": call["name"],
            "arguments": call["arguments"] if arguments is None else arguments,
            "status": "completed" if arguments is None else "in_progress",
        }

    def event(self, kind: str, **fields: Any) -> str:
        out = runs.sse_event(kind, {"type": kind, "sequence_number": self.seq, **fields})
        self.seq += 1
        return out

    def events_of(self, may_call: bool):
        def events(stream: AsyncStream) -> AsyncIterator[str]:
            return self._events(stream, runs.CallWatch(may_call))

        return events

    async def _events(self, stream: AsyncStream, watch: runs.CallWatch) -> AsyncIterator[str]:
        yield self.event("response.created", response=self.response(None))
        yield self.event("response.in_progress", response=self.response(None))
        text = _TextItem(self)
        try:
            async for p in stream:
                text.marks.add(p)
                for event in text.delta(watch.feed(p.text)):
                    yield event
            result = runs.finished(stream)
            for event in [
                *text.delta(watch.rest(result)),
                *text.done(result),
                *self._calls(result, text.index),
            ]:
                yield event
            final = self.response(result, text.items + [self.call_item(c) for c in result.tool_calls])
            yield self.event(f"response.{final['status']}", response=final)
        except Exception as e:  # noqa: BLE001 - every failure becomes the stream's error event
            err = from_exception(e)
            yield self.event("error", code=err.code, message=err.message, param=err.param)

    def _calls(self, r: Result, first: int) -> list[str]:
        events = []
        for index, call in enumerate(r.tool_calls, first):
            item = self.call_item(call, arguments="")
            events.append(self.event("response.output_item.added", output_index=index, item=item))
            at = {"item_id": item["id"], "output_index": index}
            events.append(self.event("response.function_call_arguments.delta", **at, delta=call["arguments"]))
            events.append(
                self.event("response.function_call_arguments.done", **at, arguments=call["arguments"])
            )
            events.append(
                self.event("response.output_item.done", output_index=index, item=self.call_item(call))
            )
        return events


class _TextItem:
    """The message item of a streamed response, opened at its first text (or at the end when the answer is
    neither text nor calls)."""

    def __init__(self, reply: _Reply):
        self.reply, self.text, self.open, self.items = reply, "", False, []
        self.marks, self.logprobs = R.StreamedLogprobs(chat=True), []  # to send; sent (the done event's)

    @property
    def index(self) -> int:
        return len(self.items)

    def delta(self, text: str) -> list[str]:
        if not text:
            return []
        events = [] if self.open else self._open()
        self.text += text
        logprobs = self._logprobs(text)
        at = {"item_id": self.reply.message_id, "output_index": 0, "content_index": 0}
        return [*events, self.reply.event("response.output_text.delta", **at, delta=text, logprobs=logprobs)]

    def _logprobs(self, text: str) -> list[dict[str, Any]]:
        """The entries of the tokens ``text`` came from (kept for the done event and the item)."""
        taken = self.marks.take(text)
        entries = taken["content"] if taken else []
        self.logprobs += entries
        return entries

    def _open(self) -> list[str]:
        self.open = True
        r = self.reply
        item = r.message_item(None, "in_progress")
        part = {"item_id": r.message_id, "output_index": 0, "content_index": 0}
        return [
            r.event("response.output_item.added", output_index=0, item=item),
            r.event("response.content_part.added", **part, part=_text_part("")),
        ]

    def done(self, result: Result) -> list[str]:
        if not self.open and result.tool_calls:
            return []
        events = [] if self.open else self._open()
        r, status = self.reply, "incomplete" if result.finish_reason == "length" else "completed"
        at = {"item_id": r.message_id, "output_index": 0, "content_index": 0}
        self._logprobs("")  # a token no delta's text carried (the last byte of a character, say)
        item = r.message_item(self.text, status, self.logprobs)
        self.items = [item]
        return [
            *events,
            r.event("response.output_text.done", **at, text=self.text, logprobs=self.logprobs),
            r.event("response.content_part.done", **at, part=_text_part(self.text, self.logprobs)),
            r.event("response.output_item.done", output_index=0, item=item),
        ]


def _text_part(text: str, logprobs: list | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


ROUTES = [Route("/v1/responses", responses, methods=["POST"])]
