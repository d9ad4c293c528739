"""OpenAI response objects: chat completions, text completions, their stream chunks, usage, models.

``Reply`` holds what every object of one answer shares (id, created, model, kind); its methods build the
whole answer (stream=false) and each stream chunk. Tool calls (finish_reason ``tool_calls``) go out as
``message.tool_calls`` with content null, or streamed as one ``tool_calls`` delta holding every call whole
(index, id, type, function name and arguments), as llama-server sends a call it parsed. Server-sent
events are ``data: <json>\\n\\n`` lines, ending with ``data: [DONE]``.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from hmaclient.results import Result

DONE_EVENT = "data: [DONE]\n\n"


def sse(obj: dict[str, Any]) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage(r: Result) -> dict[str, Any]:
    """OpenAI's usage from hmad's counts; ``prompt_tokens_details.cached_tokens`` where hmad's ``done``
    reports prefix-cache hits (``cached_tokens``)."""
    out: dict[str, Any] = {
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.generated_tokens,
        "total_tokens": r.prompt_tokens + r.generated_tokens,
    }
    if isinstance(r.extra.get("cached_tokens"), int):
        out["prompt_tokens_details"] = {"cached_tokens": r.extra["cached_tokens"]}
    return out


def tool_calls(calls: list[dict[str, str]]) -> list[dict[str, Any]]:
    """hmad's calls ({id, name, arguments}) in OpenAI's shape."""
    return [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in calls
    ]


def model_object(name: str, created: int) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": created, "owned_by": "hmad"}


@dataclass
class Reply:
    """One answer's shared fields. ``chat``: a chat completion, else a text completion."""

    model: str
    chat: bool
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.id = self.id or ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex

    def whole(self, r: Result) -> dict[str, Any]:
        """The answer of a stream=false request (tool calls: ``message.tool_calls``, content null)."""
        if self.chat:
            message = {"role": "assistant", "content": r.text, "refusal": None}
            if r.tool_calls:
                message.update(content=None, tool_calls=tool_calls(r.tool_calls))
            choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": r.finish_reason}
        else:
            choice = {"index": 0, "text": r.text, "logprobs": None, "finish_reason": r.finish_reason}
        body = self._head("chat.completion" if self.chat else "text_completion")
        return {**body, "choices": [choice], "usage": usage(r)}

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False) -> dict[str, Any]:
        """A stream chunk: a piece of text, the role announcement (chat's first chunk) or the finish."""
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return {**self._chunk_head(), "choices": [choice]}

    def tool_calls_chunk(self, r: Result) -> dict[str, Any]:
        """The chunk carrying every call of the answer, each whole (index, id, type, name, arguments)."""
        delta = {"tool_calls": [{"index": i, **c} for i, c in enumerate(tool_calls(r.tool_calls))]}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        return {**self._chunk_head(), "choices": [choice]}

    def usage_chunk(self, r: Result) -> dict[str, Any]:
        """The last chunk when stream_options.include_usage is set: no choices, the usage."""
        return {**self._chunk_head(), "choices": [], "usage": usage(r)}

    def _chunk_head(self) -> dict[str, Any]:
        return self._head("chat.completion.chunk" if self.chat else "text_completion")

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}
