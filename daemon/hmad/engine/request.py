"""A generation request's state machine and the events it produces.

    WAITING --admitted (KV reserved)--> PREFILL --prompt cached--> DECODE --stop/length/cancel--> FINISHED

Every request that was accepted ends with exactly one terminal event: done, error or cancelled.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from hmad.engine import images
from hmad.engine.images import ImageSpan
from hmad.engine.sampling import Sampler, SamplingParams
from hmad.engine.stopping import StopMatcher
from hmad.engine.structured import JsonConstraint, Vocabulary
from hmad.engine.tool_calls import ToolCallConstraint, ToolGrammar
from hmad.model.tokenizer import StreamDecoder, Tokenizer


class State(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


TERMINAL_KINDS = ("done", "error", "cancelled")


@dataclass
class Event:
    """What the engine tells the server about one request.

    kind: ``token`` (text piece + token ids), or a terminal ``done`` / ``error`` / ``cancelled``.
    """

    kind: str
    request_id: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    stats: dict[str, Any] = field(default_factory=dict)
    error_code: str = ""
    logprobs: list[dict] | None = None  # one entry per token id (engine/logprobs.py), when asked for
    prompt_logprobs: list[dict | None] | None = None  # (done) one per prompt token, the first None

    @property
    def terminal(self) -> bool:
        return self.kind in TERMINAL_KINDS


@dataclass
class Request:
    """One generation: prompt ids in, streamed text and ids out.

    ``grammar``: an llguidance grammar (from ``structured.compile_schema``) the output must follow, a
    ``ToolGrammar`` (the answer may be a tool call: ``engine.tool_calls``), or None.
    ``owner``: who queued it (the server passes the connection's routing id); admission serves owners in
    turn, and every request with ``owner`` None counts as one owner.
    ``tenant``: whose prefix cache it may use (the server passes the peer's uid); a request reuses,
    and learns of, only KV blocks computed for its own tenant. None (unknown or local) is a tenant of its own.
    ``images``: its images' soft-token spans in the prompt, in order (engine/images.py).
    """

    id: int
    prompt_ids: list[int]
    params: SamplingParams
    tag: Any = None  # opaque to the engine: the server's routing info
    grammar: str | ToolGrammar | None = None
    owner: bytes | None = None
    tenant: int | str | None = None
    speculate: bool = True  # may it speculate when the daemon's config does (engine/speculation)
    state: State = State.WAITING
    n_cached: int = 0  # positions already in the KV cache
    n_reused: int = 0  # of the prompt's, those found in the prefix cache at admission
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str = ""
    t_arrival: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    t_done: float | None = None
    sampler: Sampler | None = None
    stops: StopMatcher | None = None
    decoder: StreamDecoder | None = None
    grammar_state: JsonConstraint | ToolCallConstraint | None = None  # the grammar's state (``start``)
    tokenizer: Tokenizer | None = None  # (``start``) for the text of its logprobs' tokens
    step_rows: int = 1  # its logit rows in the step being taken (all of a prefill chunk's: prompt logprobs)
    prompt_logprobs: list[dict | None] | None = None  # one per prompt token, the first None (``start``)
    images: list[ImageSpan] = field(default_factory=list)
    keyed_prompt: list[int] | None = field(default=None, repr=False)  # (``cache_ids``, made once)

    def start(self, tokenizer: Tokenizer) -> None:
        """Make the per-request state. Raises ValueError if the grammar cannot run on this tokenizer."""
        self.sampler = Sampler(self.params)
        self.tokenizer = tokenizer
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
            # every prompt position computed (none found in the prefix cache, whose rows are gone): a tenant
            # of its own, whose blocks no other request reuses
            self.tenant = f"prompt_logprobs:{self.id}"
        self.stops = StopMatcher(list(self.params.stop or []))
        self.decoder = StreamDecoder(tokenizer)
        if isinstance(self.grammar, ToolGrammar):
            self.grammar_state = ToolCallConstraint(self.grammar, tokenizer)
        elif self.grammar is not None:
            self.grammar_state = JsonConstraint(self.grammar, Vocabulary.of(tokenizer))

    @property
    def constraint(self) -> JsonConstraint | ToolCallConstraint | None:
        """What masks and checks this request's tokens: its grammar's state, or None when it has no grammar
        or its tool-call grammar found the answer is text (then its steps may take the device's picks)."""
        m = self.grammar_state
        return None if isinstance(m, ToolCallConstraint) and m.phase == "text" else m

    def token_text(self, token_id: int) -> str:
        """A token's own text (control tokens as written, a lone byte of a character U+FFFD)."""
        return self.tokenizer.token_bytes(token_id, special=True).decode("utf-8", errors="replace")

    @property
    def n_positions(self) -> int:
        """Positions the sequence may occupy at most: prompt + every new token."""
        return len(self.prompt_ids) + self.params.max_tokens

    def next_input(self, max_chunk: int) -> list[int]:
        """Token ids to feed this step: the next prompt chunk, or the last sampled token."""
        if self.state is State.PREFILL:
            return self.prompt_ids[self.n_cached : self.n_cached + max_chunk]
        return [self.output_ids[-1]]

    def cache_ids(self, a: int, b: int) -> list[int]:
        """The ids positions [a, b) are keyed by in the prefix cache: ``token_ids``, but an image's soft
        tokens stand for their image (engine/images.py, ``key_ids``)."""
        if not self.images:
            return self.token_ids(a, b)
        if self.keyed_prompt is None:
            self.keyed_prompt = images.key_ids(self.prompt_ids, self.images)
        keyed, n = self.keyed_prompt, len(self.keyed_prompt)
        return keyed[a:b] if b <= n else (keyed[a:] if a < n else []) + self.output_ids[max(0, a - n) : b - n]

    def token_ids(self, a: int, b: int) -> list[int]:
        """Token ids of positions [a, b) of the sequence (prompt, then generated)."""
        n = len(self.prompt_ids)
        if b <= n:
            return self.prompt_ids[a:b]
        return (self.prompt_ids[a:] if a < n else []) + self.output_ids[max(0, a - n) : b - n]

    def stats(self) -> dict[str, Any]:
        end = self.t_done or time.perf_counter()
        first = self.t_first or end
        n = len(self.output_ids)
        decode_s = end - first
        stats = {
            "prompt_tokens": len(self.prompt_ids),
            "cached_tokens": self.n_reused,
            "generated_tokens": n,
            "ttft_s": round(first - self.t_arrival, 6),
            "total_s": round(end - self.t_arrival, 6),
            "tokens_per_s": round((n - 1) / decode_s, 3) if n > 1 and decode_s > 0 else 0.0,
        }
        cut = bool(self.stops and self.stops.hit)  # a stop string cut the text short
        if cut:
            stats["stop_sequence"] = self.stops.matched  # which one (Anthropic's stop_sequence)
        if isinstance(self.grammar_state, ToolCallConstraint):  # the answer is these calls
            calls = None if cut else self.grammar_state.calls()
            if calls:
                stats["tool_calls"] = calls
        elif self.grammar_state is not None:  # the text is the whole JSON value
            stats["schema_complete"] = self.grammar_state.complete and not cut
        return stats
