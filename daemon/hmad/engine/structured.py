"""Structured output: a JSON Schema becomes a token mask at every step, through llguidance.

    compile_schema(schema) -> grammar   the server, at the protocol edge: ValueError naming the problem
    Vocabulary.of(tokenizer)            llguidance's index of every token's bytes, built once per tokenizer
    JsonConstraint(grammar, vocab)      one per request: mask(logits), accept(token), complete, stopped

llguidance (Microsoft's Rust grammar engine, also behind llama.cpp's ``--grammar`` with ``%llguidance``,
vLLM and SGLang) compiles the schema to a grammar, and computes each step's mask by walking a trie of the
vocabulary's token bytes with an Earley parser: tens of microseconds for a JSON schema on Gemma 3's 262k
tokens. It needs no torch; its numpy helpers fill a packed bitmask (one bit per token).

The text the matcher sees is what the stream decoder emits: each token's ``token_bytes`` (``<0xXX>`` byte
tokens give their byte, U+2581 a space). Control tokens are marked special (prefix 0xFF, llguidance's
convention), so a JSON grammar never allows them; the tokenizer's end-of-turn ids are the grammar's EOS,
allowed only where the JSON is complete.

Whitespace between JSON tokens is bounded as llama.cpp's json-schema-to-grammar bounds it (one space, or
one or two newlines and up to 20 spaces or tabs of indent), so a model cannot spend its tokens on blank
space: compact and pretty-printed JSON both pass. A schema's own ``x-guidance`` map (llguidance's JSON
options) is honoured: ``{"whitespace_flexible": false}`` there asks for compact JSON only.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Any

import numpy as np

from hmad.model.tokenizer import Tokenizer

try:
    import llguidance
    import llguidance.numpy as llg_numpy
except ImportError:  # an install without it serves everything but json_schema
    llguidance = None
    llg_numpy = None

log = logging.getLogger("hmad.structured")

# llama.cpp's json-schema-to-grammar: space ::= | " " | "\n"{1,2} [ \t]{0,20}
WHITESPACE = r"(?:[ ]|\n{1,2}[ \t]{0,20})?"
_COMPILE_OPTIONS = {"whitespace_pattern": WHITESPACE}
_SPECIAL_PREFIX = b"\xff"  # llguidance: a token whose bytes start with 0xFF is a special token


class StructuredUnavailable(ValueError):
    """The llguidance package cannot be imported: requests with a json_schema are refused."""


def available() -> bool:
    return llguidance is not None


def compile_schema(schema: dict[str, Any]) -> str:
    """A JSON Schema (a dict) -> the llguidance grammar (str) that the engine's matcher runs.

    Raises ValueError naming the problem: a schema the library cannot compile (unknown type or format, bad
    regex, unsatisfiable bounds, unsupported keyword, dangling $ref) or StructuredUnavailable. Checks the
    grammar without a tokenizer, so it costs about a millisecond and never touches the vocabulary.
    """
    if llguidance is None:
        raise StructuredUnavailable(
            "json_schema needs the Python package llguidance, which this hmad cannot import "
            "(pip install llguidance)"
        )
    if not isinstance(schema, dict):
        raise ValueError(f"json_schema must be a map (a JSON Schema object), got {type(schema).__name__}")
    own = schema.get("x-guidance")
    own_space = isinstance(own, dict) and ("whitespace_flexible" in own or "whitespace_pattern" in own)
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults=None if own_space else _COMPILE_OPTIONS
        )
    except ValueError as e:
        raise ValueError(f"json_schema: {e}") from None
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(f"json_schema cannot be used: {'; '.join(messages)}")
    return grammar


def check_schema(grammar: str, tokenizer: Tokenizer) -> None:
    """Raise ValueError if ``grammar`` cannot run on ``tokenizer``'s vocabulary: a matcher is made and its
    first mask computed here, at submission (a self-referencing ``$ref``, a pattern whose lexer explodes),
    so such a schema is a ``bad_request``, never a failure in the middle of the request. The first call
    for a tokenizer builds its vocabulary index (seconds: the server calls this off its socket loop)."""
    try:
        JsonConstraint(grammar, Vocabulary.of(tokenizer)).allowed()
    except (RuntimeError, ValueError) as e:
        why = str(e).removeprefix("json_schema cannot be used: ").splitlines()[0]
        raise ValueError(f"json_schema cannot be used: {why}") from None


class PerTokenizer:
    """What is built once per tokenizer, on first use (``Sub.of(tokenizer)``, under a lock), and dropped
    with the tokenizer; each subclass keeps its own cache."""

    _cache: weakref.WeakKeyDictionary
    _lock: threading.Lock

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._cache, cls._lock = weakref.WeakKeyDictionary(), threading.Lock()

    @classmethod
    def of(cls, tokenizer: Tokenizer):
        """The tokenizer's instance, built on first use."""
        with cls._lock:
            made = cls._cache.get(tokenizer)
            if made is None:
                made = cls._cache[tokenizer] = cls(tokenizer)
            return made


class Vocabulary(PerTokenizer):
    """llguidance's view of one tokenizer: every token's bytes, the special ids, EOS = end-of-turn ids.

    Building it indexes all token bytes (about 2 s for Gemma 3's 262,144 tokens on one core), so it is
    made once per tokenizer, on the first constrained request, and shared by every later one.
    """

    def __init__(self, tokenizer: Tokenizer):
        if llguidance is None:
            raise StructuredUnavailable("structured output needs the Python package llguidance")
        t0 = time.perf_counter()
        self.size = tokenizer.vocab_size
        self.eos_ids = sorted(tokenizer.eot_ids)
        wrapper = llguidance.TokenizerWrapper(_Pieces(tokenizer))
        self.ll = llguidance.LLTokenizer(wrapper, n_vocab=self.size, eos_token=self.eos_ids)
        log.info("structured output: indexed %d tokens in %.2f s", self.size, time.perf_counter() - t0)


class _Pieces:
    """What ``llguidance.TokenizerWrapper`` reads: token bytes, BOS/EOS, special ids, and an encoder."""

    def __init__(self, tokenizer: Tokenizer):
        self._tok = tokenizer
        self.eos_token_id = tokenizer.eos_id if tokenizer.eos_id is not None else min(tokenizer.eot_ids)
        self.bos_token_id = tokenizer.bos_id
        self.special_token_ids = [i for i in range(tokenizer.vocab_size) if tokenizer.is_special(i)]
        special = set(self.special_token_ids)
        self.tokens = [
            _SPECIAL_PREFIX + _special_text(tokenizer, i) if i in special else tokenizer.token_bytes(i)
            for i in range(tokenizer.vocab_size)
        ]

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tok.encode(text, add_bos=False, parse_special=False)


def _special_text(tokenizer: Tokenizer, token_id: int) -> bytes:
    """A special token's name (``<end_of_turn>``): its bytes when specials are rendered, else its id."""
    return tokenizer.token_bytes(token_id, special=True) or f"<[{token_id}]>".encode()


class JsonConstraint:
    """One request's grammar state: which tokens may come next, and whether the JSON is complete.

    Per step the engine calls ``mask(logits)`` (disallowed tokens -> -inf, before any sampling step),
    samples, then ``accept(token)``. End-of-turn tokens are allowed only once the JSON is complete;
    ``stopped`` says nothing but end-of-turn could follow, so the engine ends the answer there.
    """

    def __init__(self, grammar: str, vocab: Vocabulary):
        self.vocab = vocab
        self.matcher = llguidance.LLMatcher(vocab.ll, grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"json_schema cannot be used: {self.matcher.get_error()}")
        self._bits = llg_numpy.allocate_token_bitmask(1, vocab.size)  # (1, ceil(V / 32)) int32
        self.mask_s, self.masks = 0.0, 0  # time spent computing masks, and how many (bench, logs)

    def allowed(self) -> np.ndarray:
        """Bool (V,): the tokens the grammar allows next. Raises RuntimeError if the matcher failed."""
        t0 = time.perf_counter()
        llg_numpy.fill_next_token_bitmask(self.matcher, self._bits, 0)
        if self.matcher.is_error():
            raise RuntimeError(f"structured output: {self.matcher.get_error()}")
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")  # (32 * ceil(V / 32),)
        self.mask_s += time.perf_counter() - t0
        self.masks += 1
        return bits[: self.vocab.size].view(bool)

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of ``logits`` (V,) with every token the grammar does not allow set to -inf."""
        return np.where(self.allowed(), logits, np.float32(-np.inf)).astype(np.float32, copy=False)

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token (which ``mask`` allowed)."""
        if not self.matcher.consume_token(int(token_id)):
            raise RuntimeError(f"structured output: token {token_id} refused: {self.matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """The text so far is a whole JSON value that satisfies the schema."""
        return self.matcher.is_accepting()

    @property
    def stopped(self) -> bool:
        """Nothing may follow but end-of-turn: the answer is complete and should end now."""
        return self.matcher.is_stopped()
