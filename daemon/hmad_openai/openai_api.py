"""OpenAI's API: ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models``, streamed as server-sent
events or answered whole (:data:`ROUTES`, mounted by ``app.build_app``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from hmaclient import protocol as P
from hmaclient.errors import RequestError
from hmaclient.stream import AsyncStream
from hmad_openai import responses as R
from hmad_openai.errors import OpenAIError, bad_request, from_exception
from hmad_openai.gateway import Gateway, gateway_of, read_body, started, unless_disconnected
from hmad_openai.schema import ChatRequest, CompletionRequest, parse


async def chat_completions(request: Request) -> Response:
    req = parse(ChatRequest, await read_body(request))
    return await _generation(request, req, req.params(), chat=True, messages=req.hmad_messages())


async def completions(request: Request) -> Response:
    req = parse(CompletionRequest, await read_body(request))
    return await _generation(request, req, req.params(), chat=False, prompt=req.text(), raw=True)


async def _generation(
    request: Request, req: ChatRequest | CompletionRequest, params: dict[str, Any], chat: bool, **inputs: Any
) -> Response:
    """One generation for either endpoint: ``inputs`` are what hmaclient takes besides ``params`` (chat:
    the messages; completions: the raw prompt). Streamed as SSE or answered whole; a refusal is an HTTP
    error, a client gone before the answer cancels the generation."""
    gw: Gateway = gateway_of(request)
    reply = R.Reply(await gw.model_name(), chat=chat)
    if req.stream:
        stream = gw.client.stream(**inputs, **params)
        held = CallText(chat and req.calls_tools, chat and req.must_call)
        return await _streamed(request, reply, stream, req.include_usage, held)
    result = await unless_disconnected(request, gw.client.generate(**inputs, **params))
    return JSONResponse(reply.whole(result))


async def list_models(request: Request) -> Response:
    gw: Gateway = gateway_of(request)
    name = await gw.model_name(refresh=True)
    return JSONResponse({"object": "list", "data": [R.model_object(name, await started(gw))]})


async def get_model(request: Request) -> Response:
    gw: Gateway = gateway_of(request)
    name = await gw.model_name(refresh=True)
    if request.path_params["model"] != name:
        raise OpenAIError(
            404,
            f"the model {request.path_params['model']!r} does not exist (hmad serves {name!r})",
            code="model_not_found",
            param="model",
        )
    return JSONResponse(R.model_object(name, await started(gw)))


async def _streamed(
    request: Request, reply: R.Reply, stream: AsyncStream, include_usage: bool, held: CallText
) -> Response:
    """Wait until hmad accepts the request (a refusal is an HTTP error), then stream its pieces as SSE."""
    await unless_disconnected(request, stream.start())
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    events = _events(reply, stream, include_usage, held)
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


class CallText:
    """The streamed text of an answer that may be tool calls, held back while it is (or may be) a call.

    hmad's rule (engine.tool_calls): with tools, an answer is a call exactly when its first non-space
    character is ``{`` or ``[`` (always, with tool_choice required or a named function). Leading whitespace
    waits for that character; a call's text is never sent as content, unless no call came of it (cut by
    max_tokens), when it goes out as content at the end."""

    def __init__(self, tools: bool, forced: bool):
        self.tools, self.held = tools, []
        self.state = "call" if forced else "open" if tools else "text"

    def feed(self, text: str) -> str:
        """The content to send now for this piece."""
        if self.state == "text":
            return text
        self.held.append(text)
        if self.state == "open":
            head = "".join(self.held).lstrip()
            if head:
                self.state = "call" if head[0] in "{[" else "text"
                if self.state == "text":
                    return self.rest()
        return ""

    def rest(self) -> str:
        text, self.held = "".join(self.held), []
        return text


async def _events(
    reply: R.Reply, stream: AsyncStream, include_usage: bool, held: CallText
) -> AsyncIterator[str]:
    """The SSE body. Starlette cancels it when the client disconnects; leaving the stream cancels the
    generation. An error after the start goes out as an ``error`` event (the OpenAI client raises it)."""
    try:
        if reply.chat:
            yield R.sse(reply.chunk(None, role=True))
        async for piece in stream:
            text = held.feed(piece.text)
            if text:
                yield R.sse(reply.chunk(text))
        result = stream.result
        if result.finish_reason == "cancelled":
            raise OpenAIError(503, "hmad cancelled the request (it is shutting down)", "service_unavailable")
        if result.tool_calls:
            yield R.sse(reply.tool_calls_chunk(result))
        elif held.held:
            yield R.sse(reply.chunk(held.rest()))
        yield R.sse(reply.chunk(None, result.finish_reason))
        if include_usage:
            yield R.sse(reply.usage_chunk(result))
    except Exception as e:  # noqa: BLE001 - every failure becomes the stream's error event
        yield R.sse(openai_error(e).body())
    finally:
        await stream.aclose()
    yield R.DONE_EVENT


def openai_error(e: Exception) -> OpenAIError:
    err = from_exception(e)
    if (
        "json_schema" in err.message
        and "tools" not in err.message
        and isinstance(e, P.ProtocolError | RequestError)
    ):
        msg = f"response_format needs hmad's structured output (generate's json_schema): {err.message}"
        return bad_request(msg, "response_format", err.code)
    return err


ROUTES = [
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model:path}", get_model, methods=["GET"]),
]
