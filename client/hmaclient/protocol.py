"""The hmad wire protocol, version 1: every message, every field, every limit. This module is the spec.

Transport
=========
ZeroMQ over a Unix socket (``ipc://PATH``). The daemon binds a ROUTER, each client connects one DEALER.
A message is **one frame** holding **one msgpack map** (the ROUTER adds and strips the peer's identity
frame; neither side ever sees or sends more frames). Strings are msgpack ``str`` (UTF-8); no ``bin`` and no
``ext`` types (timestamps included) appear anywhere. Every message has

    v     int   protocol version, PROTOCOL_VERSION (1)
    type  str   the message type, below

Requests are **strict**: a field not listed for its type is refused, naming the field. Replies are
**lenient**: clients ignore fields they do not know, so the daemon may add fields without a new version.

Ids
---
A client names each request with ``id`` (str of 1..128 characters, or an int in [-2^63, 2^64)); every reply
to it carries the same ``id``. Ids are scoped to one connection: the daemon keys requests by
(peer identity, id), so two clients may use the same ids. A client must not reuse the id of a request still
in flight on its connection (a ``generate`` doing so is refused with ``bad_request``; the first goes on).
Requests without an ``id`` get replies with ``id: nil``; such a generation cannot be cancelled by id.

Requests (client -> daemon)
===========================
``generate``  start a generation
    id                  str | int           optional (see Ids)
    prompt              str                 exactly one of prompt / messages; <= MAX_PROMPT_CHARS characters
    messages            list of maps        1..MAX_MESSAGES of {role: "system"|"user"|"model"|"assistant",
                                            content: str}; exactly these two keys; "assistant" = "model";
                                            at most one "system", and only first (Gemma's template);
                                            total content <= MAX_PROMPT_CHARS characters
    raw                 bool                default false. With ``prompt``: false wraps the prompt in the chat
                                            template as one user turn (plus the generation prompt); true sends
                                            the text to the tokenizer as is. Must be false with ``messages``.
    max_tokens          int                 1..MAX_TOKENS_LIMIT; default: the daemon's
    temperature         float | int         0..100; 0 = greedy; default: the daemon's
    top_k               int                 >= 0 (0 = off)
    top_p               float | int         (0, 1] (1 = off)
    min_p               float | int         [0, 1] (0 = off)
    repetition_penalty  float | int         > 0, <= 100 (1 = off)
    repeat_last_n       int                 0..MAX_TOKENS_LIMIT: tokens the penalty looks back over (0 = off)
    seed                int | nil           0..2^64-1; nil or absent = fresh entropy
    stop                list of str         <= MAX_STOP_STRINGS strings of 1..MAX_STOP_CHARS characters;
                                            generation ends before the first occurrence, which is never sent
    stream              bool                default true: ``token`` messages as text is produced.
                                            false: no ``token`` messages; ``done`` carries text and token_ids
    An absent sampling field (or nil) means "the daemon's default" (its config, else SamplingParams').
    Floats must be finite; bools are not numbers.

``cancel``    stop a generation of this connection
    id                  str | int           required: the id the ``generate`` carried
    The answer is that generation's terminal reply: ``cancelled`` (or ``done``/``error`` if it ended first).
    Only when no generation with that id is in flight on this connection does the daemon answer
    ``error`` {id, code: not_found}; a client drops replies for ids it no longer tracks, since a cancel
    racing a finished request gets exactly that.

``status``    what the daemon is doing              id optional, echoed
``ping``      liveness                              id optional, echoed

Replies (daemon -> client)
==========================
``accepted``   {id, rid}: the generation is queued; rid (int) is the daemon's own request number (logs).
``token``      {id, text, token_ids}: the next piece of the answer. text (str) may be "" (a token that
               completes no character yet); token_ids (list of int) are the ids this piece covers
               (the ids of a stop string's tokens are included though its text is never sent).
               Concatenating every piece's text and token_ids gives what ``done`` would carry with
               stream=false.
``done``       {id, finish_reason, prompt_tokens, generated_tokens, ttft_s, tokens_per_s, total_s,
               and with stream=false: text, token_ids}
               finish_reason: "stop" (end of turn / EOS, or a stop string) | "length" (max_tokens, or the
               context is full). prompt_tokens, generated_tokens: int. ttft_s (arrival -> first token),
               total_s (arrival -> end): float seconds; tokens_per_s: float decode rate (0 if < 2 tokens).
``error``      {id, code, message}: code is one of ERROR_CODES (stable strings), message is for people.
``cancelled``  {id, generated_tokens}
``status``     {id, status: map}: what the daemon reports, free-form but nested at most MAX_DEPTH - 2 deep,
               with keys such as model, backend, device, deterministic (bool: batch-invariant numerics,
               engine.deterministic), memory (per heap), context, running, queued,
               batch_sizes, tokens_per_s, kv_cache, uptime_s. Keys ending in ``_bytes`` are byte counts and
               ``_s`` seconds (``hmactl status`` formats them so).
``pong``       {id, time}: the daemon's wall clock, float seconds since the epoch.

Order: a ``generate`` gets either one ``error`` (refused: nothing else follows), or ``accepted`` then any
number of ``token`` then **exactly one** terminal reply: ``done`` | ``error`` | ``cancelled``. An ``error``
may follow ``accepted`` (e.g. prompt_too_long is known only once the prompt is tokenized).
``status`` and ``ping`` get one reply each. A frame the daemon cannot parse gets ``error`` with the
request's id when it could be read, else ``id: nil``.

Error codes
===========
    bad_request           malformed msgpack, not a map, wrong type or range of a field, unknown or missing
                          field, duplicate id in flight
    unsupported_version   ``v`` is an int other than PROTOCOL_VERSION
    unknown_type          ``type`` names no request
    too_large             frame over MAX_FRAME_BYTES, or an array / map / nesting depth / container count /
                          prompt / message count over its limit
    busy                  the daemon's queue is full; try again later
    prompt_too_long       the tokenized prompt (+1) does not fit the model's context
    shutting_down         the daemon is draining for shutdown and takes no new work
    not_found             ``cancel`` of an id not in flight on this connection
    internal              a bug or device failure in the daemon; the message says what

Limits (enforced in ``unpack`` before any field is looked at)
=============================================================
    frame            <= MAX_FRAME_BYTES (the daemon sets ZMQ_MAXMSGSIZE to it; replies <= MAX_REPLY_BYTES)
    arrays           <= MAX_ARRAY_LEN items; maps <= MAX_MAP_LEN entries (else too_large)
    declared sizes   a str/bin/array/map header declaring more than the rest of the frame can hold is
                     refused at once as bad_request (truncated), allocating nothing: limits passed to
                     msgpack are min(protocol limit, what len(frame) could hold)
    nesting          <= MAX_DEPTH containers deep (the top-level map is depth 1)
    containers       <= MAX_CONTAINERS arrays and maps in all (too_large)
    map keys         str only
    exactly one msgpack object per frame: trailing bytes are refused

Socket path
===========
``default_socket_path()``: ``$HMAD_SOCKET``; else ``/run/hmad/hmad.sock`` when /run/hmad is a directory this
user may enter (the systemd service's RuntimeDirectory); else ``$XDG_RUNTIME_DIR/hmad/hmad.sock``; else
``<tempdir>/hmad-<uid>/hmad.sock``. ``endpoint(path)`` gives the ZeroMQ address.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import Any

import msgpack

PROTOCOL_VERSION = 1

MAX_FRAME_BYTES = 4 * 1024 * 1024  # a request frame
MAX_REPLY_BYTES = 64 * 1024 * 1024  # a reply frame (done with stream=false carries a whole answer)
MAX_PROMPT_CHARS = 1024 * 1024  # prompt, or the sum of the messages' contents, in characters
MAX_MESSAGES = 1024
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_ID_CHARS = 128
MAX_TOKENS_LIMIT = 1_000_000
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0
MAX_DEPTH = 8
MAX_ARRAY_LEN = 4 * 1024 * 1024  # token_ids of a long answer; requests are bounded by their frame anyway
MAX_MAP_LEN = 1024
MAX_CONTAINERS = 4096  # arrays + maps in one message (a request has at most MAX_MESSAGES + 2)
MAX_IPC_PATH_BYTES = 107  # sockaddr_un.sun_path holds 108 bytes with the terminating NUL

# Error codes (stable strings).
BAD_REQUEST = "bad_request"
UNSUPPORTED_VERSION = "unsupported_version"
UNKNOWN_TYPE = "unknown_type"
TOO_LARGE = "too_large"
BUSY = "busy"
PROMPT_TOO_LONG = "prompt_too_long"
SHUTTING_DOWN = "shutting_down"
NOT_FOUND = "not_found"
INTERNAL = "internal"
ERROR_CODES = frozenset(
    {
        BAD_REQUEST,
        UNSUPPORTED_VERSION,
        UNKNOWN_TYPE,
        TOO_LARGE,
        BUSY,
        PROMPT_TOO_LONG,
        SHUTTING_DOWN,
        NOT_FOUND,
        INTERNAL,
    }
)

FINISH_REASONS = frozenset({"stop", "length"})
ROLES = frozenset({"system", "user", "model", "assistant"})
REQUEST_TYPES = frozenset({"generate", "cancel", "status", "ping"})
REPLY_TYPES = frozenset({"accepted", "token", "done", "error", "cancelled", "status", "pong"})
TERMINAL_TYPES = frozenset({"done", "error", "cancelled"})

Id = str | int | None

_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1


class ProtocolError(ValueError):
    """A frame or message breaks the protocol: ``code`` in ERROR_CODES; ``id`` the request's when known.

    The daemon answers with ``error(e.id, e.code, e.message)``, i.e. ``e.reply()``.
    """

    def __init__(self, code: str, message: str, id: Id = None):
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.id = code, message, id

    def reply(self) -> dict[str, Any]:
        return error(self.id, self.code, self.message)


# ---------------------------------------------------------------------------------------------------------
# Frames


def pack(msg: dict[str, Any]) -> bytes:
    """One message -> one frame. Adds ``v`` when missing; the caller's dict is not modified."""
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise TypeError(f"a message is a dict with a str 'type', got {msg!r:.80}")
    if "v" not in msg:
        msg = {"v": PROTOCOL_VERSION, **msg}
    return msgpack.packb(msg, use_bin_type=True)


def unpack(frame: bytes, max_size: int = MAX_FRAME_BYTES) -> Any:
    """One frame -> one msgpack object, within every limit listed in the module docstring.

    Raises ProtocolError (``too_large`` for a limit, ``bad_request`` for anything malformed); never
    allocates more than a small multiple of ``len(frame)``.
    """
    n = len(frame)
    if n > max_size:
        raise ProtocolError(TOO_LARGE, f"frame of {n} bytes is over the limit of {max_size}")
    count = _ContainerCount()
    try:
        obj = msgpack.unpackb(
            frame,
            raw=False,
            strict_map_key=True,
            ext_hook=_refuse_ext,
            object_hook=count,
            list_hook=count,
            max_str_len=n,
            max_bin_len=n,
            max_array_len=min(MAX_ARRAY_LEN, n),
            max_map_len=min(MAX_MAP_LEN, n // 2),
            max_ext_len=n,
        )
    except ProtocolError:
        raise
    except msgpack.ExtraData:
        raise ProtocolError(
            BAD_REQUEST, "trailing bytes after the message: one msgpack object per frame"
        ) from None
    except msgpack.StackError:
        raise ProtocolError(TOO_LARGE, f"nesting deeper than {MAX_DEPTH}") from None
    except (ValueError, TypeError, OverflowError, UnicodeDecodeError) as e:
        raise _unpack_error(e, n) from None
    if type(obj) not in _SCALARS:
        _check_tree(obj)
    return obj


def _unpack_error(e: Exception, n: int) -> ProtocolError:
    """A declared length over a protocol limit is too_large; one the frame cannot even hold is malformed."""
    over = re.match(r"(\d+) exceeds max_(\w+)_len", str(e))
    if over and int(over.group(1)) <= (n // 2 if over.group(2) == "map" else n):  # the protocol's limit bit
        return ProtocolError(TOO_LARGE, f"{over.group(2)} of {over.group(1)} items is over the limit")
    if over:
        return ProtocolError(
            BAD_REQUEST,
            f"invalid msgpack: a {over.group(2)} header declares "
            f"{over.group(1)} items in a frame of {n} bytes",
        )
    return ProtocolError(BAD_REQUEST, f"invalid msgpack: {e}")


class _ContainerCount:
    """msgpack hook called as each array or map is completed: stops the unpack past MAX_CONTAINERS.

    Bounds the work a frame can cause (a 4 MiB frame could otherwise hold ~2M tiny arrays).
    """

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, container: Any) -> Any:
        self.n += 1
        if self.n > MAX_CONTAINERS:
            raise ProtocolError(TOO_LARGE, f"more than {MAX_CONTAINERS} arrays and maps in one message")
        return container


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(BAD_REQUEST, f"msgpack ext type {code} is not allowed")


# msgpack decodes to exactly these types (never subclasses), so ``type(x) in`` is exact and fast.
_SCALARS = frozenset({str, int, float, bool, type(None), bytes})


def _check_tree(obj: Any) -> None:
    """Iteratively: nesting <= MAX_DEPTH, map keys are str, only plain msgpack types (no Timestamp).

    ``set(map(type, ...))`` runs in C: a 4 MiB frame of small scalars is checked in milliseconds.
    """
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if type(node) is dict:
            if set(map(type, node)) - {str}:
                bad = next(k for k in node if type(k) is not str)
                raise ProtocolError(BAD_REQUEST, f"map keys must be str, got {type(bad).__name__}")
            children = node.values()
        elif type(node) is list:
            children = node
        else:  # msgpack.Timestamp: decoded without ext_hook
            raise ProtocolError(BAD_REQUEST, f"msgpack type {type(node).__name__} is not allowed")
        if depth > MAX_DEPTH:
            raise ProtocolError(TOO_LARGE, f"nesting deeper than {MAX_DEPTH}")
        if not set(map(type, children)) <= _SCALARS:
            stack.extend((c, depth + 1) for c in children if type(c) not in _SCALARS)


def _message(frame: bytes, max_size: int) -> tuple[dict[str, Any], Id]:
    """unpack + the envelope: a map with the right ``v`` and a str ``type``; returns it and its valid id."""
    msg = unpack(frame, max_size)
    if not isinstance(msg, dict):
        raise ProtocolError(BAD_REQUEST, f"a message is a msgpack map, got {_kind(msg)}")
    mid = msg.get("id")
    mid = mid if _valid_id(mid) else None
    v = msg.get("v")
    if "v" not in msg or not isinstance(v, int) or isinstance(v, bool):
        raise ProtocolError(BAD_REQUEST, "field 'v' (protocol version, int) is missing or not an int", mid)
    if v != PROTOCOL_VERSION:
        raise ProtocolError(
            UNSUPPORTED_VERSION,
            f"protocol version {v} is not supported (this side speaks {PROTOCOL_VERSION})",
            mid,
        )
    if not isinstance(msg.get("type"), str):
        raise ProtocolError(BAD_REQUEST, "field 'type' (str) is missing or not a str", mid)
    return msg, mid


# ---------------------------------------------------------------------------------------------------------
# Requests


@dataclass
class GenerateRequest:
    """A validated ``generate``. Sampling fields left None mean "the daemon's default"."""

    id: Id = None
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    raw: bool = False
    stream: bool = True
    max_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    repeat_last_n: int | None = None
    seed: int | None = None
    stop: list[str] | None = None

    def sampling(self) -> dict[str, Any]:
        """The sampling fields the client gave, as ``SamplingParams`` keyword arguments (None left out)."""
        return {k: getattr(self, k) for k in SAMPLING_FIELDS if getattr(self, k) is not None}


@dataclass
class CancelRequest:
    id: Id


@dataclass
class StatusRequest:
    id: Id = None


@dataclass
class PingRequest:
    id: Id = None


Request = GenerateRequest | CancelRequest | StatusRequest | PingRequest


def _real(lo: float, hi: float, lo_open: bool = False):
    def check(name: str, v: Any) -> str | None:
        if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
            return f"{name} must be a finite number, got {_kind(v)}"
        if not ((lo < v) if lo_open else (lo <= v)) or v > hi:
            return f"{name} must be in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v!r}"
        return None

    return check


def _int(lo: int, hi: int):
    def check(name: str, v: Any) -> str | None:
        if not isinstance(v, int) or isinstance(v, bool):
            return f"{name} must be an int, got {_kind(v)}"
        if not lo <= v <= hi:
            return f"{name} must be in [{lo}, {hi}], got {v!r}"
        return None

    return check


# name -> check(name, value) -> error text or None. None values are "not given" and skip the check.
_SAMPLING_CHECKS = {
    "max_tokens": _int(1, MAX_TOKENS_LIMIT),
    "temperature": _real(0.0, MAX_TEMPERATURE),
    "top_k": _int(0, 2**31 - 1),
    "top_p": _real(0.0, 1.0, lo_open=True),
    "min_p": _real(0.0, 1.0),
    "repetition_penalty": _real(0.0, MAX_REPETITION_PENALTY, lo_open=True),
    "repeat_last_n": _int(0, MAX_TOKENS_LIMIT),
    "seed": _int(0, _UINT64_MAX),
}
_REAL_FIELDS = frozenset({"temperature", "top_p", "min_p", "repetition_penalty"})
SAMPLING_FIELDS = (*_SAMPLING_CHECKS, "stop")
_ENVELOPE = ("v", "type", "id")
_FIELDS = {
    "generate": frozenset({*_ENVELOPE, "prompt", "messages", "raw", "stream", *SAMPLING_FIELDS}),
    "cancel": frozenset(_ENVELOPE),
    "status": frozenset(_ENVELOPE),
    "ping": frozenset(_ENVELOPE),
}


def parse_request(frame: bytes, max_size: int = MAX_FRAME_BYTES) -> Request:
    """One frame from a client -> a validated request. Raises ProtocolError (with ``id`` when known)."""
    msg, mid = _message(frame, max_size)
    return validate_request(msg, mid)


def validate_request(msg: dict[str, Any], mid: Id = None) -> Request:
    """Check an unpacked request map against the schema (the client runs this before sending, too)."""
    mtype = msg["type"]
    if mtype not in _FIELDS:
        raise ProtocolError(
            UNKNOWN_TYPE, f"unknown request type {mtype!r:.64} (known: {sorted(_FIELDS)})", mid
        )
    unknown = [k for k in msg if k not in _FIELDS[mtype]]
    if unknown:
        names = ", ".join(repr(k[:64]) for k in unknown[:8])
        raise ProtocolError(BAD_REQUEST, f"unknown field(s) in {mtype}: {names}", mid)
    if msg.get("id") is not None and not _valid_id(msg["id"]):
        raise ProtocolError(BAD_REQUEST, _ID_RULE + f", got {_kind(msg['id'])}")
    if mtype == "generate":
        return _generate(msg, mid)
    if mtype == "cancel":
        if msg.get("id") is None:
            raise ProtocolError(BAD_REQUEST, "cancel needs the 'id' of the generation to cancel")
        return CancelRequest(mid)
    return StatusRequest(mid) if mtype == "status" else PingRequest(mid)


def _generate(msg: dict[str, Any], mid: Id) -> GenerateRequest:
    def fail(text: str, code: str = BAD_REQUEST) -> ProtocolError:
        return ProtocolError(code, text, mid)

    req = GenerateRequest(id=mid)
    for name in ("raw", "stream"):
        if msg.get(name) is not None:
            if not isinstance(msg[name], bool):
                raise fail(f"{name} must be a bool, got {_kind(msg[name])}")
            setattr(req, name, msg[name])
    prompt, messages = msg.get("prompt"), msg.get("messages")
    if (prompt is None) == (messages is None):
        raise fail("give exactly one of 'prompt' (str) and 'messages' (list)")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise fail(f"prompt must be a str, got {_kind(prompt)}")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise fail(
                f"prompt of {len(prompt)} characters is over the limit of {MAX_PROMPT_CHARS}", TOO_LARGE
            )
        req.prompt = prompt
    else:
        if req.raw:
            raise fail("raw=true applies to 'prompt' only; 'messages' always use the chat template")
        problem, code = _check_messages(messages)
        if problem:
            raise fail(problem, code)
        req.messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    for name, check in _SAMPLING_CHECKS.items():
        value = msg.get(name)
        if value is not None:
            problem = check(name, value)
            if problem:
                raise fail(problem)
            setattr(req, name, float(value) if name in _REAL_FIELDS else value)
    if msg.get("stop") is not None:
        problem = _check_stop(msg["stop"])
        if problem:
            raise fail(problem)
        req.stop = list(msg["stop"])
    return req


def _check_messages(messages: Any) -> tuple[str | None, str]:
    if not isinstance(messages, list) or not messages:
        return f"messages must be a non-empty list, got {_kind(messages)}", BAD_REQUEST
    if len(messages) > MAX_MESSAGES:
        return f"{len(messages)} messages is over the limit of {MAX_MESSAGES}", TOO_LARGE
    total = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) != {"role", "content"}:
            return f"messages[{i}] must be a map with exactly 'role' and 'content'", BAD_REQUEST
        if not isinstance(m["role"], str) or m["role"] not in ROLES:
            return f"messages[{i}].role must be one of {sorted(ROLES)}, got {m['role']!r:.64}", BAD_REQUEST
        if not isinstance(m["content"], str):
            return f"messages[{i}].content must be a str, got {_kind(m['content'])}", BAD_REQUEST
        if m["role"] == "system" and i != 0:
            return "a 'system' message may only come first", BAD_REQUEST
        total += len(m["content"])
    if total > MAX_PROMPT_CHARS:
        return f"messages of {total} characters are over the limit of {MAX_PROMPT_CHARS}", TOO_LARGE
    return None, BAD_REQUEST


def _check_stop(stop: Any) -> str | None:
    if not isinstance(stop, list):
        return f"stop must be a list of str, got {_kind(stop)}"
    if len(stop) > MAX_STOP_STRINGS:
        return f"stop has {len(stop)} strings, over the limit of {MAX_STOP_STRINGS}"
    for i, s in enumerate(stop):
        if not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_CHARS:
            return f"stop[{i}] must be a str of 1..{MAX_STOP_CHARS} characters"
    return None


_ID_RULE = f"id must be a str of 1..{MAX_ID_CHARS} characters or an int in [-2^63, 2^64)"


def _valid_id(v: Any) -> bool:
    if isinstance(v, str):
        return 1 <= len(v) <= MAX_ID_CHARS
    return isinstance(v, int) and not isinstance(v, bool) and _INT64_MIN <= v <= _UINT64_MAX


def _kind(v: Any) -> str:
    return "nil" if v is None else type(v).__name__


# Request builders (the client's side). Each returns the message map, validated as the daemon will.


def generate_request(
    id: Id, prompt: str | None = None, messages: list[dict[str, str]] | None = None, **fields: Any
) -> dict[str, Any]:
    """A ``generate`` map; ``fields`` are raw, stream and the sampling fields. None values are left out."""
    msg = {
        "v": PROTOCOL_VERSION,
        "type": "generate",
        "id": id,
        "prompt": prompt,
        "messages": messages,
        **fields,
    }
    msg = {k: v for k, v in msg.items() if v is not None}
    validate_request(msg, id)
    return msg


def cancel_request(id: Id) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "type": "cancel", "id": id}


def status_request(id: Id = None) -> dict[str, Any]:
    return _with_id({"v": PROTOCOL_VERSION, "type": "status"}, id)


def ping_request(id: Id = None) -> dict[str, Any]:
    return _with_id({"v": PROTOCOL_VERSION, "type": "ping"}, id)


def _with_id(msg: dict[str, Any], id: Id) -> dict[str, Any]:
    if id is not None:
        msg["id"] = id
    return msg


# ---------------------------------------------------------------------------------------------------------
# Replies: builders (the daemon's side)


def accepted(id: Id, rid: int) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "type": "accepted", "id": id, "rid": rid}


def token(id: Id, text: str, token_ids: list[int]) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "type": "token", "id": id, "text": text, "token_ids": list(token_ids)}


def done(
    id: Id,
    finish_reason: str,
    prompt_tokens: int,
    generated_tokens: int,
    ttft_s: float,
    tokens_per_s: float,
    total_s: float,
    text: str | None = None,
    token_ids: list[int] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """``text`` and ``token_ids`` only with stream=false. ``extra`` fields (e.g. seed) go out as they are."""
    msg = {
        "v": PROTOCOL_VERSION,
        "type": "done",
        "id": id,
        "finish_reason": finish_reason,
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated_tokens,
        "ttft_s": float(ttft_s),
        "tokens_per_s": float(tokens_per_s),
        "total_s": float(total_s),
        **extra,
    }
    if text is not None:
        msg["text"] = text
    if token_ids is not None:
        msg["token_ids"] = list(token_ids)
    return msg


def error(id: Id, code: str, message: str) -> dict[str, Any]:
    if code not in ERROR_CODES:
        raise ValueError(f"unknown error code {code!r}")
    return {"v": PROTOCOL_VERSION, "type": "error", "id": id, "code": code, "message": message}


def cancelled(id: Id, generated_tokens: int) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "type": "cancelled", "id": id, "generated_tokens": generated_tokens}


def status(id: Id, info: dict[str, Any]) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "type": "status", "id": id, "status": info}


def pong(id: Id, time: float) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "type": "pong", "id": id, "time": float(time)}


# ---------------------------------------------------------------------------------------------------------
# Replies: parsed (the client's side)


@dataclass
class Accepted:
    id: Id
    rid: int


@dataclass
class Token:
    id: Id
    text: str
    token_ids: list[int]


@dataclass
class Done:
    id: Id
    finish_reason: str
    prompt_tokens: int
    generated_tokens: int
    ttft_s: float
    tokens_per_s: float
    total_s: float
    text: str | None = None
    token_ids: list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # fields this version does not know


@dataclass
class Error:
    id: Id
    code: str
    message: str


@dataclass
class Cancelled:
    id: Id
    generated_tokens: int


@dataclass
class Status:
    id: Id
    info: dict[str, Any]


@dataclass
class Pong:
    id: Id
    time: float


Reply = Accepted | Token | Done | Error | Cancelled | Status | Pong

_NUM = (int, float)
# type -> (class, {field: accepted types}) for the required fields; optional ones are handled below.
_REPLY_SCHEMA: dict[str, tuple[type, dict[str, tuple[type, ...] | type]]] = {
    "accepted": (Accepted, {"rid": int}),
    "token": (Token, {"text": str, "token_ids": list}),
    "done": (
        Done,
        {
            "finish_reason": str,
            "prompt_tokens": int,
            "generated_tokens": int,
            "ttft_s": _NUM,
            "tokens_per_s": _NUM,
            "total_s": _NUM,
        },
    ),
    "error": (Error, {"code": str, "message": str}),
    "cancelled": (Cancelled, {"generated_tokens": int}),
    "status": (Status, {"status": dict}),
    "pong": (Pong, {"time": _NUM}),
}


def parse_reply(frame: bytes, max_size: int = MAX_REPLY_BYTES) -> Reply:
    """One frame from the daemon -> a reply dataclass. Unknown fields are ignored (``Done.extra`` keeps them).

    Unknown error codes are passed through as they are (a newer daemon may add codes).
    """
    msg, mid = _message(frame, max_size)
    mtype = msg["type"]
    if mtype not in _REPLY_SCHEMA:
        raise ProtocolError(UNKNOWN_TYPE, f"unknown reply type {mtype!r:.64}", mid)
    cls, required = _REPLY_SCHEMA[mtype]
    for name, types in required.items():
        if not isinstance(msg.get(name), types) or isinstance(msg.get(name), bool):
            raise ProtocolError(
                BAD_REQUEST, f"{mtype} reply: field {name!r} missing or of the wrong type", mid
            )
    values = {name: msg[name] for name in required}
    if mtype == "status":
        return Status(mid, msg["status"])
    if mtype == "done":
        known = {"v", "type", "id", "text", "token_ids", *required}
        extra = {k: v for k, v in msg.items() if k not in known}
        return Done(mid, **values, text=msg.get("text"), token_ids=msg.get("token_ids"), extra=extra)
    return cls(mid, **values)


# ---------------------------------------------------------------------------------------------------------
# Where the daemon listens


def default_socket_path() -> str:
    """``$HMAD_SOCKET``, else /run/hmad/hmad.sock if /run/hmad is enterable, else the user's runtime dir."""
    env = os.environ.get("HMAD_SOCKET")
    if env:
        return env
    if os.path.isdir("/run/hmad") and os.access("/run/hmad", os.X_OK):
        return "/run/hmad/hmad.sock"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "hmad", "hmad.sock")
    return os.path.join(tempfile.gettempdir(), f"hmad-{os.getuid()}", "hmad.sock")


def endpoint(path: str) -> str:
    """The ZeroMQ address of a socket path: ``ipc://`` + path (which must fit a Unix socket address)."""
    if len(os.fsencode(path)) > MAX_IPC_PATH_BYTES:
        raise ValueError(f"socket path is over {MAX_IPC_PATH_BYTES} bytes (a Unix socket limit): {path}")
    return "ipc://" + path
