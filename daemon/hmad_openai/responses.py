"""OpenAI response objects: chat completions, text completions, their stream chunks, usage, models.

``Reply`` holds what every object of one answer shares (id, created, model, kind); its methods build the
whole answer (stream=false) and each stream chunk. An answer of n choices (``n``) holds one hmad result per
choice, ``index`` 0..n-1; each stream chunk carries one choice's index. Tool calls (finish_reason
``tool_calls``) go out as ``message.tool_calls`` with content null, or streamed as one ``tool_calls``
delta holding every call whole (index, id, type, function name and arguments), as llama-server sends a
call it parsed. Logprobs (hmaclient's ``Logprob``s) go out in each API's shape: chat's ``{"content": [{token,
logprob, bytes, top_logprobs}]}``, completions' ``{tokens, token_logprobs, top_logprobs, text_offset}``;
an echoed prompt's (completions' ``echo``) come first, its first token's logprob null. Server-sent events
are ``data: <json>\\n\\n`` lines, ending with ``data: [DONE]``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from hmaclient.reply import Logprob
from hmaclient.results import Piece, Result

DONE_EVENT = "data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage(results: Sequence[Result]) -> dict[str, Any]:
    """OpenAI's usage from hmad's counts of each choice's generation: the prompt counted once, the completion
    tokens summed; ``prompt_tokens_details.cached_tokens`` where hmad's ``done`` reports prefix-cache hits
    (``cached_tokens``): the fewest of any choice (the prompt as the choice that computed most of it)."""
    prompt = results[0].prompt_tokens
    completion = sum(r.generated_tokens for r in results)
    out: dict[str, Any] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    cached = [r.extra.get("cached_tokens") for r in results]
    if all(isinstance(c, int) for c in cached):
        out["prompt_tokens_details"] = {"cached_tokens": min(cached)}
    return out


def tool_calls(calls: list[dict[str, str]]) -> list[dict[str, Any]]:
    """hmad's calls ({id, name, arguments}) in OpenAI's shape."""
    return [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in calls
    ]


# A logprob JSON can carry (-inf, which only a masked token has, is not JSON): vLLM's floor
_FLOOR = -9999.0


def _value(logprob: float) -> float:
    return max(logprob, _FLOOR)


def _token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": _value(logprob), "bytes": list(text.encode())}


def chat_logprobs(entries: Sequence[Logprob]) -> dict[str, Any]:
    """Chat's ``logprobs``: per token its text, logprob, UTF-8 bytes and top alternatives."""
    content = [
        {**_token(e.text, e.logprob), "top_logprobs": [_token(text, lp) for _id, lp, text in e.top]}
        for e in entries
    ]
    return {"content": content}


def completion_logprobs(entries: Sequence[Logprob | None], offset: int = 0) -> dict[str, Any]:
    """Completions' ``logprobs``: parallel lists; ``text_offset`` each token's start in the answer's text
    from ``offset``, by the tokens' own texts. An entry None (a prompt's first token) has a null logprob
    and top; its text is unknown, so empty."""
    out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        text = "" if e is None else e.text
        out["tokens"].append(text)
        out["token_logprobs"].append(None if e is None else _value(e.logprob))
        out["top_logprobs"].append(None if e is None else {t: _value(lp) for _id, lp, t in e.top})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def model_object(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "hmad"}


@dataclass
class Reply:
    """One answer's shared fields. ``chat``: a chat completion, else a text completion."""

    model: str
    chat: bool
    echo: str | None = None  # completions' echo: the prompt, first in each choice's text
    drop: bool = False  # completions' echo with max_tokens 0: the generated token is not in the answer
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex

    def whole(self, results: Sequence[Result]) -> dict[str, Any]:
        """The answer of a stream=false request, one choice per result (tool calls: ``message.tool_calls``,
        content null)."""
        body = self._head("chat.completion" if self.chat else "text_completion")
        choices = [self._choice(i, r) for i, r in enumerate(results)]
        return {**body, "choices": choices, "usage": usage(results)}

    def _choice(self, index: int, r: Result) -> dict[str, Any]:
        if not self.chat:
            return self._text_choice(index, r)
        message = {"role": "assistant", "content": r.text, "refusal": None}
        if r.tool_calls:
            message.update(content=None, tool_calls=tool_calls(r.tool_calls))
        logprobs = None if r.logprobs is None else chat_logprobs(r.logprobs)
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": r.finish_reason}

    def _text_choice(self, index: int, r: Result) -> dict[str, Any]:
        """A completion's choice: the echoed prompt first (its tokens' logprobs too, when asked)."""
        text = "" if self.drop else r.text
        entries: list[Logprob | None] | None = None
        if r.logprobs is not None:
            entries = [] if self.drop else list(r.logprobs)
            if self.echo is not None:
                entries = list(r.prompt_logprobs or []) + entries
        if self.echo is not None:
            text = self.echo + text
        logprobs = None if entries is None else completion_logprobs(entries)
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": r.finish_reason}

    def chunk(
        self,
        text: str | None,
        finish_reason: str | None = None,
        role: bool = False,
        index: int = 0,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """A stream chunk of choice ``index``: a piece of text (with its tokens' ``logprobs`` in the API's
        shape, when asked), the role announcement (chat's first chunk of each choice) or the finish."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            text = text or ""
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self._chunk_head(), "choices": [choice]}

    def tool_calls_chunk(self, r: Result, index: int = 0) -> dict[str, Any]:
        """The chunk carrying every call of choice ``index``, each whole (index, id, type, name,
        arguments)."""
        delta = {"tool_calls": [{"index": i, **c} for i, c in enumerate(tool_calls(r.tool_calls))]}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        return {**self._chunk_head(), "choices": [choice]}

    def usage_chunk(self, results: Sequence[Result]) -> dict[str, Any]:
        """The last chunk when stream_options.include_usage is set: no choices, the usage of all."""
        return {**self._chunk_head(), "choices": [], "usage": usage(results)}

    def _chunk_head(self) -> dict[str, Any]:
        return self._head("chat.completion.chunk" if self.chat else "text_completion")

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}


class StreamedLogprobs:
    """A streamed answer's logprobs not yet sent: a chunk carries those of the tokens its text came from
    (text held back as a possible tool call carries them when it goes out). Completions' ``text_offset``
    counts from the start of the choice's text. The Responses and Ollama streams take chat's shape."""

    def __init__(self, chat: bool):
        self.chat, self.pending, self.offset, self.asked = chat, [], 0, False

    def add(self, piece: Piece) -> None:
        if piece.logprobs is not None:
            self.asked = True
            self.pending.extend(piece.logprobs)

    def take(self, text: str) -> dict[str, Any] | None:
        """The logprobs for a chunk of ``text`` (None when the request asked for none)."""
        if not self.asked:
            return None
        entries, self.pending = self.pending, []
        if self.chat:
            return chat_logprobs(entries)
        out = completion_logprobs(entries, self.offset)
        self.offset += len(text)
        return out

    def left(self) -> dict[str, Any] | None:
        """The logprobs of tokens no chunk's text carried (a last byte of a character, say), for the
        finish chunk; None when there are none."""
        return self.take("") if self.pending else None
