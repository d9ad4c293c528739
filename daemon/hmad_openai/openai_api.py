"""OpenAI's API: ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/models``, streamed as server-sent
events or answered whole (:data:`ROUTES`, mounted by ``app.build_app``).

An answer of n choices is n generations of the same prompt in hmad, sent together: their prompts share KV
blocks through hmad's prefix cache where it has one. The first to fail (or the client leaving) cancels the
others; a stream interleaves the choices' chunks as their pieces come.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Iterable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from hmaclient import protocol as P
from hmaclient.errors import RequestError
from hmaclient.results import Piece
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
    prompt = req.text()
    echo = {"echo": prompt if req.echo else None, "drop": req.drops_answer}
    return await _generation(request, req, req.params(), chat=False, prompt=prompt, raw=True, reply=echo)


async def _generation(
    request: Request,
    req: ChatRequest | CompletionRequest,
    params: dict[str, Any],
    chat: bool,
    reply: dict[str, Any] | None = None,
    **inputs: Any,
) -> Response:
    """The answer of either endpoint, one generation per choice: ``inputs`` are what hmaclient takes besides
    ``params`` (chat: the messages; completions: the raw prompt), ``reply`` more of ``R.Reply``'s fields
    (completions' echo). Streamed as SSE or answered whole; a refusal is an HTTP error, a client gone
    before the answer cancels the generations."""
    gw: Gateway = gateway_of(request)
    other = await gw.model_for(req.model)  # a model on hmad's disk other than the served one
    if other is not None:
        params = {**params, "model": other}
    reply = R.Reply(req.model if other else await gw.model_name(), chat=chat, **(reply or {}))
    each = req.choice_params(params)
    if req.stream:
        streams = [gw.client.stream(**inputs, **p) for p in each]
        held = [CallText(chat and req.calls_tools, chat and req.must_call) for _ in each]
        return await _streamed(request, reply, streams, req.include_usage, held)
    results = await unless_disconnected(request, _all(gw.client.generate(**inputs, **p) for p in each))
    return JSONResponse(reply.whole(results))


async def _all(works: Iterable[Awaitable[Any]]) -> list[Any]:
    """Every work's result, in order. The first failure cancels the others (and so their generations in
    hmad) and is raised; so does a cancellation of the caller."""
    tasks = [asyncio.ensure_future(w) for w in works]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


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
    request: Request, reply: R.Reply, streams: list[AsyncStream], include_usage: bool, held: list[CallText]
) -> Response:
    """Wait until hmad accepts every choice's request (a refusal is an HTTP error, and cancels the others),
    then stream their pieces as SSE."""
    try:
        await unless_disconnected(request, _all(s.start() for s in streams))
    except BaseException:
        for s in streams:
            await s.aclose()
        raise
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    events = _events(reply, streams, include_usage, held)
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
    reply: R.Reply, streams: list[AsyncStream], include_usage: bool, held: list[CallText]
) -> AsyncIterator[str]:
    """The SSE body: each choice's chunks under its index, as its pieces come, and its finish when its
    generation ends. Starlette cancels it when the client disconnects; leaving the streams cancels the
    generations. An error after the start goes out as an ``error`` event (the OpenAI client raises it)."""
    results: list[Any] = [None] * len(streams)
    marks = [R.StreamedLogprobs(reply.chat) for _ in streams]
    merged = _merged(streams)
    try:
        if reply.chat:
            for i in range(len(streams)):
                yield R.sse(reply.chunk(None, role=True, index=i))
        async for i, piece in merged:
            if piece is not None:
                marks[i].add(piece)
                text = held[i].feed(piece.text)
                if text:
                    yield R.sse(reply.chunk(text, index=i, logprobs=marks[i].take(text)))
                continue
            results[i] = result = streams[i].result
            if result.finish_reason == "cancelled":
                raise OpenAIError(
                    503, "hmad cancelled the request (it is shutting down)", "service_unavailable"
                )
            if result.tool_calls:
                yield R.sse(reply.tool_calls_chunk(result, i))
            elif held[i].held:
                text = held[i].rest()
                yield R.sse(reply.chunk(text, index=i, logprobs=marks[i].take(text)))
            yield R.sse(reply.chunk(None, result.finish_reason, index=i, logprobs=marks[i].left()))
        if include_usage:
            yield R.sse(reply.usage_chunk(results))
    except Exception as e:  # noqa: BLE001 - every failure becomes the stream's error event
        yield R.sse(openai_error(e).body())
    finally:
        for s in streams:  # first: closing the merge awaits, which a cancelled body may not finish
            await s.aclose()
        await merged.aclose()
    yield R.DONE_EVENT


async def _merged(streams: list[AsyncStream]) -> AsyncIterator[tuple[int, Piece | None]]:
    """(i, piece) as the streams' pieces come; (i, None) once stream i has ended. A stream's failure is
    raised here; leaving early cancels the readers (and so the generations)."""
    queue: asyncio.Queue[tuple[int, Piece | None, BaseException | None]] = asyncio.Queue()

    async def read(i: int, stream: AsyncStream) -> None:
        try:
            async for piece in stream:
                queue.put_nowait((i, piece, None))
            queue.put_nowait((i, None, None))
        except Exception as e:  # noqa: BLE001 - handed to the merged iteration
            queue.put_nowait((i, None, e))

    readers = [asyncio.ensure_future(read(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, piece, error = await queue.get()
            if error is not None:
                raise error
            left -= piece is None
            yield i, piece
    finally:
        for r in readers:
            r.cancel()
        await asyncio.gather(*readers, return_exceptions=True)


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
