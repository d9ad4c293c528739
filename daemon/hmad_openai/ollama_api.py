"""Ollama's API (:data:`ROUTES`, mounted by ``app.build_app``), for the clients and apps that speak it:

    GET|HEAD /                  "Ollama is running" (what clients probe first)
    GET  /api/version           {"version": hmad's version}
    GET  /api/tags, /api/ps     the one model hmad serves, named as Ollama names models (:func:`ollama_name`)
    POST /api/show              its details, model_info (architecture, context length), capabilities
    POST /api/chat              messages (and tools) -> hmad's chat template; NDJSON pieces unless
                                "stream": false; tool calls come as message.tool_calls
    POST /api/generate          a prompt (raw: no template); the same streaming

What each request field becomes is ``ollama_schema``'s docstring. hmad serves one model at a time:
/api/chat and /api/generate switch hmad to the model ``model`` names when it is one of hmad's models on
disk (Gateway.model_for; as the OpenAI routes do), and answer any other name with the loaded model;
/api/show answers 404 for another name than the loaded one's. An empty ``messages`` or ``prompt``
answers at once with ``done_reason`` "load" (Ollama's way to load a model). Durations are nanoseconds:
prompt_eval_duration is hmad's time to the first token (queueing included), eval_duration the rest of the
generation, total_duration the gateway's time on the request, load_duration 0. Errors are
``{"error": "..."}`` with the HTTP status; an error after a stream started is one last line of that shape
(the ollama client raises it).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

import hmad
from hmaclient.results import Result
from hmaclient.stream import AsyncStream
from hmad_openai import responses as R
from hmad_openai import runs
from hmad_openai.bodies import parse
from hmad_openai.errors import OpenAIError, from_exception
from hmad_openai.gateway import Gateway, gateway_of, read_body
from hmad_openai.ollama_schema import ChatBody, GenerateBody, ShowBody

FAMILY = "gemma3"  # hmad serves Gemma 3
# hmad keeps its model loaded for ever; Ollama shows a model kept "forever" (keep_alive -1) so.
FOREVER = "2318-01-01T00:00:00Z"


def ollama_name(name: str) -> str:
    """``name`` as Ollama writes model names, ``model:tag``, lower case, no spaces: "Gemma 3 270m" ->
    "gemma-3-270m:latest" (what a user types after ``ollama run``, and what apps send back)."""
    model, _, tag = name.partition(":")
    slug = re.sub(r"[^a-z0-9._-]+", "-", model.lower()).strip("-") or "hmad"
    return f"{slug}:{re.sub(r'[^a-z0-9._-]+', '-', tag.lower()).strip('-') or 'latest'}"


def error_response(err: OpenAIError) -> Response:
    """Ollama's error shape."""
    return JSONResponse({"error": err.message}, status_code=err.status)


async def root(request: Request) -> Response:
    return PlainTextResponse("Ollama is running")


async def version(request: Request) -> Response:
    return JSONResponse({"version": hmad.__version__})


async def chat(request: Request) -> Response:
    body = parse(ChatBody, await read_body(request))
    messages = body.hmad_messages()
    if not messages:
        return await _loaded(request, body)
    return await _generation(request, body, {"messages": messages}, chat=True)


async def generate(request: Request) -> Response:
    body = parse(GenerateBody, await read_body(request))
    inputs = body.inputs()
    if not body.prompt and not body.system and not body.images:
        return await _loaded(request, body)
    return await _generation(request, body, inputs, chat=False)


async def _generation(request: Request, body: ChatBody | GenerateBody, inputs: dict, chat: bool) -> Response:
    t0, params = time.monotonic(), body.params()
    other = await gateway_of(request).model_for(body.model)  # on hmad's disk, not the served one
    if other is not None:
        params["model"] = other
    name = body.model if other else await _reply_model(request)
    reply = _Reply(name, chat, t0, runs.may_call(params))
    if body.streams:
        return await runs.streamed(request, inputs, params, reply.lines, runs.NDJSON)
    return JSONResponse(reply.final(await runs.whole(request, inputs, params), whole=True))


async def _loaded(request: Request, body: ChatBody | GenerateBody) -> Response:
    """The answer to a request that only loads the model (its fields checked all the same)."""
    body.params()
    reply = _Reply(await _reply_model(request), isinstance(body, ChatBody), time.monotonic())
    return JSONResponse({**reply.piece(""), "done": True, "done_reason": "load"})


async def _reply_model(request: Request) -> str:
    """The ``model`` of an answer: the served model's Ollama name without its ``:latest``, as /api/tags lists
    it (hmad answers with its one model whatever the request names)."""
    return ollama_name(await gateway_of(request).model_name()).removesuffix(":latest")


class _Reply:
    """The objects of one answer: pieces (``done`` false) and the final one with the counts."""

    def __init__(self, model: str, chat: bool, t0: float, may_call: bool = False):
        self.model, self.chat, self.t0, self.may_call = model, chat, t0, may_call

    def piece(
        self, text: str, calls: list[dict[str, str]] | None = None, logprobs: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """One object of the answer: ``text`` (and ``calls``), with its tokens' ``logprobs`` (chat's
        ``{"content": [...]}`` from ``StreamedLogprobs``) where asked for."""
        out: dict[str, Any] = {"model": self.model, "created_at": _now()}
        if self.chat:
            out["message"] = {"role": "assistant", "content": text}
            if calls:
                out["message"]["tool_calls"] = [_tool_call(j, c) for j, c in enumerate(calls)]
        else:
            out["response"] = text
        if logprobs is not None:
            out["logprobs"] = logprobs["content"]
        out["done"] = False
        return out

    def final(self, r: Result, whole: bool) -> dict[str, Any]:
        """The last object: the counts (and, answered whole, the answer). Tool calls end as "stop", as
        Ollama's do."""
        text = "" if r.tool_calls or not whole else r.text
        logprobs = R.chat_logprobs(r.logprobs) if whole and r.logprobs is not None else None
        out = self.piece(text, r.tool_calls if whole else None, logprobs)
        reason = "stop" if r.finish_reason == "tool_calls" else r.finish_reason
        out.update(done=True, done_reason=reason, **self._counts(r))
        return out

    def _counts(self, r: Result) -> dict[str, int]:
        return {
            "total_duration": _ns(time.monotonic() - self.t0),
            "load_duration": 0,
            "prompt_eval_count": r.prompt_tokens,
            "prompt_eval_duration": _ns(r.ttft_s),
            "eval_count": r.generated_tokens,
            "eval_duration": _ns(max(0.0, r.total_s - r.ttft_s)),
        }

    async def lines(self, stream: AsyncStream) -> AsyncIterator[str]:
        """The NDJSON body: a line per piece of text, then the final counts (or an error line)."""
        watch, marks = runs.CallWatch(self.may_call), R.StreamedLogprobs(chat=True)
        try:
            async for p in stream:
                marks.add(p)
                text = watch.feed(p.text)
                if text:
                    yield runs.dumps(self.piece(text, logprobs=marks.take(text))) + "\n"
            result = runs.finished(stream)
            text = watch.rest(result)
            if text or result.tool_calls or marks.pending:
                yield runs.dumps(self.piece(text, result.tool_calls, marks.take(text))) + "\n"
            yield runs.dumps(self.final(result, whole=False)) + "\n"
        except Exception as e:  # noqa: BLE001 - every failure becomes the stream's error line
            yield runs.dumps({"error": from_exception(e).message}) + "\n"


# -- the model ------------------------------------------------------------------------------------------


async def tags(request: Request) -> Response:
    entry = await _model_entry(gateway_of(request))
    return JSONResponse({"models": [entry]})


async def ps(request: Request) -> Response:
    gw = gateway_of(request)
    info = await gw.client.status()
    memory = {k: v for k, v in (info.get("memory") or {}).items() if isinstance(v, int | float)}
    entry = await _model_entry(gw, info)
    del entry["modified_at"]
    entry.update(
        size=int(sum(memory.values())),
        size_vram=int(sum(v for k, v in memory.items() if "device-local" in k)),  # hmad's status' heap names
        expires_at=FOREVER,
        context_length=info.get("context_length"),
    )
    return JSONResponse({"models": [entry]})


async def show(request: Request) -> Response:
    body = parse(ShowBody, await read_body(request))
    gw = gateway_of(request)
    info = await gw.client.status()
    entry = await _model_entry(gw, info)
    asked = body.model or body.name or ""
    if asked not in (entry["name"], entry["name"].removesuffix(":latest"), await gw.model_name()):
        raise OpenAIError(404, f"model '{asked}' not found", code="model_not_found")
    context = info.get("context_length")
    return JSONResponse(
        {
            "license": "",
            "modelfile": f"# served by hmad\nFROM {info.get('model', '')}\n",
            "parameters": "",
            "template": "",
            "details": entry["details"],
            "model_info": {"general.architecture": FAMILY, f"{FAMILY}.context_length": context},
            "capabilities": ["completion", "tools"],
            "modified_at": entry["modified_at"],
        }
    )


async def _model_entry(gw: Gateway, info: dict[str, Any] | None = None) -> dict[str, Any]:
    """The served model as /api/tags lists it. ``digest`` identifies the served file by its path and name
    (not a hash of its bytes, which the gateway may not read); ``size`` is the file's, where readable."""
    info = info if info is not None else await gw.client.status()
    name = await gw.model_name(refresh=True)
    tagged = ollama_name(name)
    path = str(info.get("model", ""))
    try:
        size = os.path.getsize(path)
    except OSError:
        size = 0
    started = time.time() - float(info.get("uptime_s", 0.0))
    return {
        "name": tagged,
        "model": tagged,
        "modified_at": datetime.fromtimestamp(started, UTC).isoformat().replace("+00:00", "Z"),
        "size": size,
        "digest": hashlib.sha256(f"{path}\0{name}".encode()).hexdigest(),
        "details": {
            "parent_model": "",
            "format": "gguf" if path.endswith(".gguf") else "safetensors",
            "family": FAMILY,
            "families": [FAMILY],
            "parameter_size": "",
            "quantization_level": "",
        },
    }


def _tool_call(index: int, call: dict[str, str]) -> dict[str, Any]:
    function = {"index": index, "name": call["name"], "arguments": json.loads(call["arguments"])}
    return {"id": call["id"], "function": function}


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


ROUTES = [
    Route("/", root, methods=["GET", "HEAD"]),
    Route("/api/version", version, methods=["GET", "HEAD"]),
    Route("/api/tags", tags, methods=["GET", "HEAD"]),
    Route("/api/ps", ps, methods=["GET"]),
    Route("/api/show", show, methods=["POST"]),
    Route("/api/chat", chat, methods=["POST"]),
    Route("/api/generate", generate, methods=["POST"]),
]
