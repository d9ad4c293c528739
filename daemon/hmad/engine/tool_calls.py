"""Tool calls: the grammar a call is decoded under, the constraint that runs it, and the calls parsed.

    tool_grammar(tools, choice, parallel) -> ToolGrammar   preparation: the grammar (llguidance Lark)
    check_tools(grammar, tokenizer)                        preparation: it runs on this vocabulary
    ToolCallConstraint(grammar, tokenizer)                 one per request (``Request.constraint``)

The call form (hmad.model.tools tells the model so): one JSON object ``{"name": N, "parameters": {...}}``,
or, with parallel calls allowed, a JSON list of them. The grammar is the JSON Schema "one call, or a
list of 1.. calls" where a call is anyOf, per tool, {name: const N, parameters: N's schema}: the name is
one of the tools and the arguments validate against that tool's schema, by construction. An object in
a tool's parameters that says nothing of other keys (no ``additionalProperties``, ``patternProperties``
or ``unevaluatedProperties``) is decoded closed: only its own properties (``closed``), as llama.cpp's
grammars and OpenAI's strict mode read a function's schema; a small model otherwise fills the arguments
with keys copied from the schema. ``"additionalProperties": true`` (or a schema) opens it again.

``required`` or a named tool: the grammar holds from the first token, so the answer is a call. ``auto``
(``ToolGrammar.lazy``): the grammar waits. While the answer is only whitespace, a token is allowed if it
is whitespace, if the grammar allows it (from its start), or if it is text that does not open the call
form: one whose first non-space byte is neither ``{`` nor ``[``. The first token that opens the call
form (``{`` or ``[`` as the answer's first non-space character) hands the rest of the answer to the
grammar; any other text makes it a text answer, unconstrained. So an answer is a call exactly when its
first non-space character is ``{`` or ``[``.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from typing import Any

import numpy as np

from hmad.engine.structured import JsonConstraint, PerTokenizer, Vocabulary, compile_schema, llguidance
from hmad.model.tokenizer import Tokenizer

OPENERS = b"{["  # a call's first byte
CLOSE_COMMA = re.compile(rb"}[ \t\r\n]*,")  # a token that may end a call in a list and go on
SPACE = b" \t\r\n"
MAX_PARALLEL_CALLS = 16  # calls in one answer
MAX_LEADING_SPACE = 2  # whitespace before a call
# Between a call's JSON tokens: at most one space (tighter than json_schema's structured.WHITESPACE: calls are
# written on one line, as the prompt's form shows, and a model cannot spend max_tokens on blank space)
CALL_WHITESPACE = r"[ ]?"


@dataclass(frozen=True)
class ToolGrammar:
    """A request's tool-call grammar (llguidance Lark text); ``lazy``: it starts at the first opener."""

    grammar: str
    lazy: bool


def call_schema(tools: list[dict[str, Any]], choice: Any, parallel: bool) -> dict[str, Any]:
    """The JSON Schema of the answer: one call (or a list of them when ``parallel``), the tools narrowed to
    the named one when ``choice`` names one. Each tool's parameters sit whole in ``$defs`` (as ``tool<i>``),
    their own ``$ref`` pointers (``#/$defs/X``, ``#``) rewritten to point into it, so tools' definitions
    never collide."""
    if isinstance(choice, dict):
        tools = [t for t in tools if t["name"] == choice["name"]]
    defs = {f"tool{i}": _rebased(closed(t["parameters"]), f"#/$defs/tool{i}") for i, t in enumerate(tools)}
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t["name"]}, "parameters": {"$ref": f"#/$defs/tool{i}"}},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for i, t in enumerate(tools)
    ]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = (
        {"anyOf": [one, {"type": "array", "items": one, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS}]}
        if parallel
        else one
    )
    return {**schema, "$defs": defs, "x-guidance": {"whitespace_pattern": CALL_WHITESPACE}}


_DATA_KEYWORDS = ("const", "enum", "default", "examples")  # values, not schemas: no $ref in them is one
# the keywords whose value is a schema, a list of schemas, or a map of names to schemas (JSON Schema 2020-12)
_SUBSCHEMA = ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then", "else",
              "unevaluatedItems", "additionalItems", "unevaluatedProperties")  # fmt: skip
_SUBSCHEMAS = ("prefixItems",)
# the keywords whose subschemas describe the same object as their schema (its keys may come from them)
_COMBINED = ("allOf", "anyOf", "oneOf", "if", "then", "else")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_OPENERS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed(schema: Any) -> Any:
    """``schema`` with ``"additionalProperties": false`` on every object schema that has ``properties``
    and says nothing of other keys (module docstring). Where subschemas add keys to the same object (a
    schema with properties and a combinator, ``$ref`` or conditional beside them; the members of an
    ``allOf``, and the definitions such a ``$ref`` or member points to), neither it nor those subschemas
    are closed; their own nested objects are."""
    return _closed(schema, True, _merged_refs(schema))


def _closed(schema: Any, close: bool, merged: set[str], at: str = "#") -> Any:
    """:func:`closed` of the subschema at pointer ``at`` (``merged``: pointers left open)."""
    if not isinstance(schema, dict):
        return schema
    own = isinstance(schema.get("properties"), dict)
    out = dict(schema)
    for k, v in schema.items():
        if k in _SUBSCHEMA and k not in _COMBINED:
            out[k] = (
                [_closed(x, True, merged) for x in v] if isinstance(v, list) else _closed(v, True, merged)
            )
        elif k in _COMBINED:
            members = v if isinstance(v, list) else [v]
            done = [_closed(x, not own and k != "allOf", merged) for x in members]
            out[k] = done if isinstance(v, list) else done[0]
        elif k in _SCHEMA_MAPS and isinstance(v, dict):
            out[k] = {
                name: _closed(x, k != "dependentSchemas", merged, f"{at}/{k}/{name}") for name, x in v.items()
            }
    opened = any(k in schema for k in (*_OPENERS, *_COMBINED, "$ref", "dependentSchemas")) or at in merged
    if close and own and not opened:
        out["additionalProperties"] = False
    return out


def _merged_refs(schema: Any) -> set[str]:
    """The ``$ref`` pointers of ``schema`` that add keys to another object: beside properties, or an
    ``allOf`` member's."""
    refs: set[str] = set()

    def walk(s: Any, merging: bool) -> None:
        if isinstance(s, list):
            for x in s:
                walk(x, merging)
        elif isinstance(s, dict):
            ref = s.get("$ref")
            if isinstance(ref, str) and (merging or isinstance(s.get("properties"), dict)):
                refs.add(ref)
            for k, v in s.items():
                if k not in _DATA_KEYWORDS:
                    walk(v, k == "allOf")

    walk(schema, False)
    return refs


def _rebased(schema: Any, root: str) -> Any:
    """``schema`` with every local ``$ref`` ("#..." ) pointing under ``root`` instead of the document root."""
    if isinstance(schema, list):
        return [_rebased(s, root) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _DATA_KEYWORDS else _rebased(v, root) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#"):
        out["$ref"] = root + ref[1:]
    return out


def tool_grammar(tools: list[dict[str, Any]], choice: Any, parallel: bool) -> ToolGrammar:
    """The grammar for a request whose answer may be a call; raises ValueError naming a tool whose
    parameters do not compile."""
    if llguidance is None:
        raise ValueError("tools need the Python package llguidance, which this hmad cannot import")
    for t in tools:  # one at a time, so the error names the tool
        try:
            compile_schema(t["parameters"])
        except ValueError as e:
            why = str(e).removeprefix("json_schema cannot be used: ").removeprefix("json_schema: ")
            raise ValueError(f"tool {t['name']!r}: its parameters cannot be used: {why}") from None
    schema = json.dumps(call_schema(tools, choice, parallel))
    lark = f"start: WS call\nWS: /[ \\t\\r\\n]{{0,{MAX_LEADING_SPACE}}}/\ncall: %json {schema}\n"
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise ValueError(f"the tools cannot be used: {'; '.join(messages)}")
    return ToolGrammar(grammar, lazy=choice == "auto")


def check_tools(grammar: ToolGrammar, tokenizer: Tokenizer) -> None:
    """Raise ValueError if the grammar cannot run on ``tokenizer`` (builds the vocabulary index and the
    token classes on first use: seconds, off the socket loop)."""
    try:
        ToolCallConstraint(grammar, tokenizer).mask(np.zeros(tokenizer.vocab_size, np.float32))
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"the tools cannot be used: {str(e).splitlines()[0]}") from None


class TokenClasses(PerTokenizer):
    """Per token of one vocabulary: its bytes, and whether it is ``text`` (its first non-space byte opens
    no call, or it is a special token), ``space`` (only spaces, tabs and newlines) or ``closes`` (its first
    non-space byte is ``]``), and ``close_comma``: it holds a ``}`` and then a ``,`` (it may end a call
    in a list and go on to the next)."""

    def __init__(self, tokenizer: Tokenizer):
        n = tokenizer.vocab_size
        self.bytes = [b"" if tokenizer.is_special(i) else tokenizer.token_bytes(i) for i in range(n)]
        stripped = [b.lstrip(SPACE) for b in self.bytes]
        pairs = list(zip(self.bytes, stripped, strict=True))
        self.space = np.array([bool(b) and not s for b, s in pairs], dtype=bool)
        self.text = np.array([not b or bool(s and s[0] not in OPENERS) for b, s in pairs], dtype=bool)
        self.closes = np.array([s[:1] == b"]" for s in stripped], dtype=bool)
        self.close_comma = np.array([CLOSE_COMMA.search(b) is not None for b in self.bytes], dtype=bool)


class ToolCallConstraint:
    """A request's tool-call state, with ``JsonConstraint``'s interface (``mask``, ``accept``, ``complete``,
    ``stopped``) plus ``calls()``. Phases: ``open`` (lazy, nothing but whitespace yet), ``call`` (the
    grammar holds), ``text`` (a text answer: nothing is masked).

    A list of calls that repeats a call it already holds (same name and arguments: a small model's loop)
    is closed there: from then on, between its elements, only tokens that close the list are allowed where
    the grammar allows one. So that the end of each call is seen before the list goes on, in a list no
    token may hold a ``}`` and then a ``,`` (``}`` and ``,`` come as tokens of their own). ``calls()``
    holds each call once.
    """

    def __init__(self, grammar: ToolGrammar, tokenizer: Tokenizer):
        self.json = JsonConstraint(grammar.grammar, Vocabulary.of(tokenizer))
        self.classes = TokenClasses.of(tokenizer)
        self.phase = "open" if grammar.lazy else "call"
        self.out = bytearray()  # the call's text
        self.elements = ListElements()

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """A copy of ``logits`` (V,) with the tokens this phase forbids at -inf."""
        if self.phase == "text":
            return logits
        allowed = self.json.allowed()
        if self.phase == "open":  # whitespace and text as the model likes; a call only as the grammar does
            allowed = allowed | self.classes.text | self.classes.space
        elif self.elements.is_list:
            allowed = self._in_list(allowed)
        return np.where(allowed, logits, np.float32(-np.inf)).astype(np.float32, copy=False)

    def _in_list(self, allowed: np.ndarray) -> np.ndarray:
        """``allowed`` narrowed in a list of calls (class docstring), never to nothing."""
        if self.elements.repeated and self.elements.between and (allowed & self.classes.closes).any():
            return allowed & self.classes.closes
        split = allowed & ~self.classes.close_comma
        return split if split.any() else allowed

    def accept(self, token_id: int) -> None:
        if self.phase == "open" and self.classes.text[token_id]:
            self.phase = "text"
        if self.phase == "text" or (self.phase == "open" and self.classes.space[token_id]):
            return  # (leading whitespace is not the grammar's: it starts at the first other token)
        self.json.accept(token_id)
        self.out += self.classes.bytes[token_id]
        self.elements.feed(self.out, len(self.classes.bytes[token_id]))
        self.phase = "call"

    @property
    def complete(self) -> bool:
        """The answer so far is a whole call (or list of calls)."""
        return self.phase == "call" and self.json.complete

    @property
    def stopped(self) -> bool:
        return self.phase != "text" and self.json.stopped

    def calls(self) -> list[dict[str, str]] | None:
        """The calls, each {id, name, arguments (JSON text)}, once complete; else None."""
        if not self.complete:
            return None
        value = json.loads(self.out.decode("utf-8"))
        unique: list[dict[str, Any]] = []
        for c in value if isinstance(value, list) else [value]:
            if c not in unique:  # a repeat is the same call again (class docstring)
                unique.append(c)
        return [{"id": _call_id(), "name": c["name"], "arguments": _arguments(c)} for c in unique]


def _call_id() -> str:
    return "call_" + secrets.token_hex(12)


def _arguments(call: dict[str, Any]) -> str:
    return json.dumps(call["parameters"])


class ListElements:
    """The top-level elements of a JSON list, found byte by byte in the call text as it grows (strings and
    nesting skipped); ``repeated``: one element equals an earlier one."""

    def __init__(self):
        self.depth, self.in_string, self.escaped = 0, False, False
        self.is_list: bool | None = None
        self.start = 0
        self.seen: list[Any] = []
        self.repeated = False

    def feed(self, out: bytearray, n: int) -> None:
        """The last ``n`` bytes of ``out`` are new."""
        for i in range(len(out) - n, len(out)):
            b = out[i]
            if self.in_string:
                self.escaped, self.in_string = (False, True) if self.escaped else (b == 0x5C, b != 0x22)
            elif b == 0x22:
                self.in_string = True
            elif b in OPENERS:
                self.is_list = (b == 0x5B) if self.is_list is None else self.is_list
                self.depth += 1
                self.start = i if self.depth == 2 else self.start
            elif b in b"]}":
                self.depth -= 1
                if self.is_list and self.depth == 1:
                    self._element(json.loads(out[self.start : i + 1]))

    @property
    def between(self) -> bool:
        """In a list, between two of its elements (not inside one, nor in a string)."""
        return bool(self.is_list) and self.depth == 1 and not self.in_string

    def _element(self, value: Any) -> None:
        self.repeated = self.repeated or value in self.seen
        self.seen.append(value)
