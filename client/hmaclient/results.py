"""What a generation gives back: ``Piece`` (one streamed piece) and ``Result`` (the finished answer)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hmaclient import protocol as P
from hmaclient.reply import Logprob


@dataclass
class Piece:
    """One streamed piece of an answer."""

    text: str
    token_ids: list[int]
    logprobs: list[Logprob] | None = None  # one per id, when the request asked for logprobs


@dataclass
class Result:
    """A finished generation. ``finish_reason``: "stop", "length", "tool_calls" (the answer is the calls in
    ``tool_calls``: each {id, name, arguments}, arguments a JSON object's text), or (streams only)
    "cancelled". ``logprobs`` (asked for with ``logprobs=N``): each token's
    ``Logprob`` (token_id, text, logprob, top: [(id, logprob, text)] most likely first)."""

    text: str
    token_ids: list[int]
    finish_reason: str
    prompt_tokens: int = 0
    generated_tokens: int = 0
    ttft_s: float = 0.0
    tokens_per_s: float = 0.0
    total_s: float = 0.0
    id: P.Id = None
    rid: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    tool_calls: list[dict[str, str]] = field(default_factory=list)
    logprobs: list[Logprob] | None = None  # one per id of token_ids, when the request asked for logprobs
    prompt_logprobs: list[Logprob | None] | None = None  # one per prompt token (the first None), when asked

    @property
    def timings(self) -> dict[str, float]:
        return {"ttft_s": self.ttft_s, "tokens_per_s": self.tokens_per_s, "total_s": self.total_s}
