"""The hmad wire protocol, version 2: every message, every field, every limit. This module is the spec.

Transport
=========
ZeroMQ over a Unix socket (``ipc://PATH``). The daemon binds a ROUTER, each client connects one DEALER.
A message is **one frame** holding **one msgpack map** (the ROUTER adds and strips the peer's identity
frame; neither side ever sees or sends more frames). Strings are msgpack ``str`` (UTF-8); no ``bin`` and no
``ext`` types (timestamps included) appear anywhere. Every message has

    v     int   protocol version: the rules this message follows, one of SUPPORTED_VERSIONS (1, 2)
    type  str   the message type, below

Requests are **strict**: a field not listed for its type is refused, naming the field. Replies are
**lenient**: clients ignore fields they do not know, so the daemon may add fields without a new version.

Versions
--------
Version 2 adds ``generate.json_schema`` (structured output). ``ADDED_IN`` lists every request type and
field newer than version 1 with the version that brought it. The daemon serves messages of every
supported version: a message of version v may use only what version v had (an older ``v`` using a newer
field or type is refused with ``bad_request`` naming the field and the version it needs), and every reply
to it carries the same ``v`` (a reply to a frame whose ``v`` could not be read or is not supported carries
1, which every client reads). So a version-1 client keeps working unchanged. Clients stamp the lowest
version their message needs (``required_version``; hmaclient does), so a newer client also keeps working
with an older daemon for everything the older one knows.

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
    json_schema         map                 since version 2. A JSON Schema the answer must satisfy: sampling
                                            is constrained so the text is one JSON value that parses and
                                            validates (``{"type": "object"}``: any JSON object). A schema the
                                            daemon cannot compile is refused (bad_request naming the
                                            problem), as is any json_schema when the daemon lacks its
                                            grammar library. See ``done.schema_complete``.
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
``metrics``   cumulative counters and histograms    id optional, echoed. Since version 2.

Replies (daemon -> client)
==========================
``accepted``   {id, rid}: the generation is queued; rid (int) is the daemon's own request number (logs).
``token``      {id, text, token_ids}: the next piece of the answer. text (str) may be "" (a token that
               completes no character yet); token_ids (list of int) are the ids this piece covers
               (the ids of a stop string's tokens are included though its text is never sent).
               Concatenating every piece's text and token_ids gives what ``done`` would carry with
               stream=false.
``done``       {id, finish_reason, prompt_tokens, generated_tokens, ttft_s, tokens_per_s, total_s,
               cached_tokens, and with stream=false: text, token_ids}
               finish_reason: "stop" (end of turn / EOS, or a stop string, or with json_schema: the JSON
               value is complete) | "length" (max_tokens, or the context is full). prompt_tokens,
               generated_tokens: int. ttft_s (arrival -> first token), total_s (arrival -> end): float
               seconds; tokens_per_s: float decode rate (0 if < 2 tokens).
               cached_tokens: int, the prompt tokens whose KV came from the prefix cache (not computed;
               absent from daemons before it, so clients read it as optional: Done.extra).
               With json_schema also schema_complete (bool): true when the text is a whole JSON value
               that satisfies the schema; false when max_tokens (or the context) ran out first
               (finish_reason "length": the text is a valid but unfinished prefix) or a stop string cut it.
``error``      {id, code, message}: code is one of ERROR_CODES (stable strings), message is for people.
``cancelled``  {id, generated_tokens}
``status``     {id, status: map}: what the daemon reports, free-form but nested at most MAX_DEPTH - 2 deep,
               with keys such as model, backend, device, deterministic (bool: batch-invariant numerics,
               engine.deterministic), memory (per heap), context, running, queued,
               batch_sizes, tokens_per_s, kv_cache, uptime_s. Keys ending in ``_bytes`` are byte counts and
               ``_s`` seconds (``hmactl status`` formats them so).
``pong``       {id, time, state}: the daemon's wall clock, float seconds since the epoch; state "ready"
               (generations are served) or "loading" (the socket answers while the model loads: status
               shows the progress, a ``generate`` gets ``error`` code ``loading``). A reply without state
               comes from a daemon that answers only once ready.
``metrics``    {id, metrics: list of families} (since version 2): what Prometheus calls metric families,
               counted since the daemon started. A family is
                   {name: str, type: "counter" | "gauge" | "histogram", help: str, samples: list}
               name is snake_case, without a prefix or a ``_total`` suffix, its unit last (``_seconds``,
               ``_bytes``). A sample of a counter or gauge is {labels: map of str -> str, value: number};
               one of a histogram is {labels, bounds: list of number (ascending upper bounds),
               buckets: list of int (buckets[i] = observations <= bounds[i], cumulative), count: int (all
               observations), sum: number}. Which families exist is the daemon's to say (docs/protocol.md
               lists them); clients show what comes.

Order: a ``generate`` gets either one ``error`` (refused: nothing else follows), or ``accepted`` then any
number of ``token`` then **exactly one** terminal reply: ``done`` | ``error`` | ``cancelled``. An ``error``
may follow ``accepted`` (e.g. prompt_too_long is known only once the prompt is tokenized).
``status``, ``ping`` and ``metrics`` get one reply each. A frame the daemon cannot parse gets ``error``
with the request's id when it could be read, else ``id: nil``.

Error codes
===========
    bad_request           malformed msgpack, not a map, wrong type or range of a field, unknown or missing
                          field, duplicate id in flight, text the model's vocabulary cannot encode (a GGUF
                          without byte-fallback tokens; the message names the character)
    unsupported_version   ``v`` is an int not in SUPPORTED_VERSIONS
    unknown_type          ``type`` names no request
    too_large             frame over MAX_FRAME_BYTES, or an array / map / nesting depth / container count /
                          prompt / message count over its limit
    busy                  the daemon's queue is full; try again later
    prompt_too_long       the tokenized prompt (+1) does not fit the model's context
    shutting_down         the daemon is draining for shutdown and takes no new work
    not_found             ``cancel`` of an id not in flight on this connection
    internal              a bug or device failure in the daemon; the message says what. Only the requests
                          it concerns get it (one failed step: that step's); the daemon serves on unless
                          its device is lost, when it answers everyone and exits 1

Limits (enforced in ``unpack`` before any field is looked at)
=============================================================
    frame            <= MAX_FRAME_BYTES (the daemon sets ZMQ_MAXMSGSIZE to it; replies <= MAX_REPLY_BYTES)
    arrays           <= MAX_ARRAY_LEN items; maps <= MAX_MAP_LEN entries (else too_large)
    declared sizes   a str/bin/array/map header declaring more than the rest of the frame can hold is
                     refused at once as bad_request (truncated), allocating nothing: limits passed to
                     msgpack are min(protocol limit, what len(frame) could hold)
    nesting          <= MAX_DEPTH containers deep (the top-level map is depth 1; 8 before version 2)
    containers       <= MAX_CONTAINERS arrays and maps in all (too_large)
    map keys         str only
    exactly one msgpack object per frame: trailing bytes are refused

Socket path
===========
``default_socket_path()`` is the one rule, for the daemon and its clients alike: ``$HMAD_SOCKET``; else
``/run/hmad/hmad.sock`` for root or when /run/hmad is a directory this user may enter (the systemd service's
RuntimeDirectory); else ``$XDG_RUNTIME_DIR/hmad/hmad.sock``; else ``$TMPDIR`` (or /tmp)
``/hmad-<uid>/hmad.sock``. ``endpoint(path)`` gives the ZeroMQ address. Before connecting, clients check who
owns the socket and the directories above it (``hmaclient.safepath``).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

PROTOCOL_VERSION = 2  # the newest version this module speaks
SUPPORTED_VERSIONS = frozenset({1, 2})

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
MAX_DEPTH = 32  # a json_schema nests (properties -> schema -> items -> ...)
MAX_ARRAY_LEN = 4 * 1024 * 1024  # token_ids of a long answer; requests are bounded by their frame anyway
MAX_MAP_LEN = 1024
MAX_CONTAINERS = 4096  # arrays + maps in one message (a request has at most MAX_MESSAGES + 2)
MAX_IPC_PATH_BYTES = 107  # sockaddr_un.sun_path holds 108 bytes with the terminating NUL
SYSTEM_SOCKET_DIR = "/run/hmad"  # the system service's RuntimeDirectory (systemd/hmad.service)

# Error codes (stable strings).
BAD_REQUEST = "bad_request"
UNSUPPORTED_VERSION = "unsupported_version"
UNKNOWN_TYPE = "unknown_type"
TOO_LARGE = "too_large"
BUSY = "busy"
PROMPT_TOO_LONG = "prompt_too_long"
SHUTTING_DOWN = "shutting_down"
LOADING = "loading"  # the model is still loading (retry later; ``ping`` says when it is ready)
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
        LOADING,
        NOT_FOUND,
        INTERNAL,
    }
)

FINISH_REASONS = frozenset({"stop", "length"})
ROLES = frozenset({"system", "user", "model", "assistant"})
REQUEST_TYPES = frozenset({"generate", "cancel", "status", "ping", "metrics"})

# What each version added: (request type, field) -> version, with field None for a whole request type.
# A message whose v is older than an entry it uses is refused, naming the field and the version.
ADDED_IN: dict[tuple[str, str | None], int] = {
    ("generate", "json_schema"): 2,
    ("metrics", None): 2,
}
REPLY_TYPES = frozenset({"accepted", "token", "done", "error", "cancelled", "status", "pong", "metrics"})
METRIC_TYPES = frozenset({"counter", "gauge", "histogram"})
TERMINAL_TYPES = frozenset({"done", "error", "cancelled"})

Id = str | int | None

_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1


class ProtocolError(ValueError):
    """A frame or message breaks the protocol: ``code`` in ERROR_CODES; ``id`` the request's when known;
    ``v`` the version to answer in (the message's when it is a supported one, else 1).

    The daemon answers with ``error(e.id, e.code, e.message, v=e.v)``, i.e. ``e.reply()``.
    """

    def __init__(self, code: str, message: str, id: Id = None, v: int = 1):
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.id, self.v = code, message, id, v

    def reply(self) -> dict[str, Any]:
        return error(self.id, self.code, self.message, v=self.v)


# ---------------------------------------------------------------------------------------------------------
# Frames


def pack(msg: dict[str, Any]) -> bytes:
    """One message -> one frame. Adds ``v`` when missing (the lowest version the message needs); the
    caller's dict is not modified."""
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise TypeError(f"a message is a dict with a str 'type', got {msg!r:.80}")
    if "v" not in msg:
        msg = {"v": required_version(msg), **msg}
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
    """unpack + the envelope: a map with a supported ``v`` and a str ``type``; returns it and its valid id."""
    msg = unpack(frame, max_size)
    if not isinstance(msg, dict):
        raise ProtocolError(BAD_REQUEST, f"a message is a msgpack map, got {_kind(msg)}")
    mid = msg.get("id")
    mid = mid if _valid_id(mid) else None
    v = msg.get("v")
    if "v" not in msg or not isinstance(v, int) or isinstance(v, bool):
        raise ProtocolError(BAD_REQUEST, "field 'v' (protocol version, int) is missing or not an int", mid)
    if v not in SUPPORTED_VERSIONS:
        speaks = ", ".join(map(str, sorted(SUPPORTED_VERSIONS)))
        raise ProtocolError(
            UNSUPPORTED_VERSION, f"protocol version {v} is not supported (this side speaks {speaks})", mid
        )
    if not isinstance(msg.get("type"), str):
        raise ProtocolError(BAD_REQUEST, "field 'type' (str) is missing or not a str", mid, v)
    return msg, mid


def required_version(msg: dict[str, Any]) -> int:
    """The lowest protocol version that has the message's type and every field it carries, nil or not
    (see ADDED_IN)."""
    mtype = msg.get("type")
    return max([ADDED_IN.get((mtype, None), 1), *(ADDED_IN.get((mtype, k), 1) for k in msg)])


def _check_version(msg: dict[str, Any], mid: Id) -> None:
    """Refuse a type or field newer than the message's own ``v``, naming it and the version it needs."""
    v, mtype = msg["v"], msg["type"]
    need = ADDED_IN.get((mtype, None), 1)
    if need > v:
        raise ProtocolError(
            BAD_REQUEST, f"request type {mtype!r} needs protocol version {need}, not {v}", mid
        )
    for k in msg:
        need = ADDED_IN.get((mtype, k), 1)
        if need > v:
            raise ProtocolError(
                BAD_REQUEST, f"field {k!r} of {mtype} needs protocol version {need}, not {v}", mid
            )


# ---------------------------------------------------------------------------------------------------------
# Requests


@dataclass
class GenerateRequest:
    """A validated ``generate``. Sampling fields left None mean "the daemon's default".

    ``v`` (every request has it): the version the message came in, which its replies carry.
    """

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
    json_schema: dict[str, Any] | None = None
    v: int = field(default=1, compare=False)

    def sampling(self) -> dict[str, Any]:
        """The sampling fields the client gave, as ``SamplingParams`` keyword arguments (None left out)."""
        return {k: getattr(self, k) for k in SAMPLING_FIELDS if getattr(self, k) is not None}


@dataclass
class CancelRequest:
    id: Id
    v: int = field(default=1, compare=False)


@dataclass
class StatusRequest:
    id: Id = None
    v: int = field(default=1, compare=False)


@dataclass
class PingRequest:
    id: Id = None
    v: int = field(default=1, compare=False)


@dataclass
class MetricsRequest:
    id: Id = None
    v: int = field(default=2, compare=False)


Request = GenerateRequest | CancelRequest | StatusRequest | PingRequest | MetricsRequest


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
    "generate": frozenset(
        {*_ENVELOPE, "prompt", "messages", "raw", "stream", "json_schema", *SAMPLING_FIELDS}
    ),
    "cancel": frozenset(_ENVELOPE),
    "status": frozenset(_ENVELOPE),
    "ping": frozenset(_ENVELOPE),
    "metrics": frozenset(_ENVELOPE),
}


def parse_request(frame: bytes, max_size: int = MAX_FRAME_BYTES) -> Request:
    """One frame from a client -> a validated request. Raises ProtocolError (with ``id`` when known, and
    ``v`` the version to answer in)."""
    msg, mid = _message(frame, max_size)
    try:
        return validate_request(msg, mid)
    except ProtocolError as e:
        e.v = msg["v"]  # _message checked it is a supported version
        raise


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
    _check_version(msg, mid)
    if msg.get("id") is not None and not _valid_id(msg["id"]):
        raise ProtocolError(BAD_REQUEST, _ID_RULE + f", got {_kind(msg['id'])}")
    v = msg["v"]
    if mtype == "generate":
        return _generate(msg, mid)
    if mtype == "cancel":
        if msg.get("id") is None:
            raise ProtocolError(BAD_REQUEST, "cancel needs the 'id' of the generation to cancel")
        return CancelRequest(mid, v)
    return {"status": StatusRequest, "ping": PingRequest, "metrics": MetricsRequest}[mtype](mid, v)


def _generate(msg: dict[str, Any], mid: Id) -> GenerateRequest:
    def fail(text: str, code: str = BAD_REQUEST) -> ProtocolError:
        return ProtocolError(code, text, mid)

    req = GenerateRequest(id=mid, v=msg["v"])
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
    if msg.get("json_schema") is not None:
        if not isinstance(msg["json_schema"], dict):
            raise fail(f"json_schema must be a map (a JSON Schema object), got {_kind(msg['json_schema'])}")
        req.json_schema = msg["json_schema"]
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
    """A ``generate`` map; ``fields`` are raw, stream, json_schema and the sampling fields. None values are
    left out; ``v`` is the lowest version that has every field used."""
    msg = {"type": "generate", "id": id, "prompt": prompt, "messages": messages, **fields}
    msg = {k: v for k, v in msg.items() if v is not None}
    msg = {"v": required_version(msg), **msg}
    validate_request(msg, id)
    return msg


def cancel_request(id: Id) -> dict[str, Any]:
    return _stamped({"type": "cancel", "id": id}, id)


def status_request(id: Id = None) -> dict[str, Any]:
    return _stamped({"type": "status"}, id)


def ping_request(id: Id = None) -> dict[str, Any]:
    return _stamped({"type": "ping"}, id)


def metrics_request(id: Id = None) -> dict[str, Any]:
    return _stamped({"type": "metrics"}, id)


def _stamped(msg: dict[str, Any], id: Id) -> dict[str, Any]:
    """With ``id`` (when given) and ``v``: the lowest version the message needs."""
    if id is not None:
        msg["id"] = id
    return {"v": required_version(msg), **msg}


# ---------------------------------------------------------------------------------------------------------
# Replies: builders (the daemon's side)


# Every builder takes ``v``: the version of the request it answers (see Versions).


def accepted(id: Id, rid: int, *, v: int = PROTOCOL_VERSION) -> dict[str, Any]:
    return {"v": v, "type": "accepted", "id": id, "rid": rid}


def token(id: Id, text: str, token_ids: list[int], *, v: int = PROTOCOL_VERSION) -> dict[str, Any]:
    return {"v": v, "type": "token", "id": id, "text": text, "token_ids": list(token_ids)}


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
    *,
    v: int = PROTOCOL_VERSION,
    **extra: Any,
) -> dict[str, Any]:
    """``text`` and ``token_ids`` only with stream=false. ``extra`` fields (e.g. schema_complete) go out as
    they are."""
    msg = {
        "v": v,
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


def error(id: Id, code: str, message: str, *, v: int = PROTOCOL_VERSION) -> dict[str, Any]:
    if code not in ERROR_CODES:
        raise ValueError(f"unknown error code {code!r}")
    return {"v": v, "type": "error", "id": id, "code": code, "message": message}


def cancelled(id: Id, generated_tokens: int, *, v: int = PROTOCOL_VERSION) -> dict[str, Any]:
    return {"v": v, "type": "cancelled", "id": id, "generated_tokens": generated_tokens}


def status(id: Id, info: dict[str, Any], *, v: int = PROTOCOL_VERSION) -> dict[str, Any]:
    return {"v": v, "type": "status", "id": id, "status": info}


def pong(id: Id, time: float, state: str = "ready", *, v: int = PROTOCOL_VERSION) -> dict[str, Any]:
    return {"v": v, "type": "pong", "id": id, "time": float(time), "state": state}


def metrics(id: Id, families: list[dict[str, Any]], *, v: int = PROTOCOL_VERSION) -> dict[str, Any]:
    """``families`` as the module docstring describes them (hmad.engine.metrics builds them)."""
    return {"v": v, "type": "metrics", "id": id, "metrics": families}


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
    state: str = "ready"  # "loading" while the daemon loads its model


@dataclass
class Metrics:
    id: Id
    families: list[dict[str, Any]]


Reply = Accepted | Token | Done | Error | Cancelled | Status | Pong | Metrics

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
    "metrics": (Metrics, {"metrics": list}),
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
    if mtype == "pong":
        state = msg.get("state")
        return Pong(mid, values["time"], state if isinstance(state, str) else "ready")
    if mtype == "metrics":
        return Metrics(mid, [f for f in msg["metrics"] if _is_family(f)])
    if mtype == "done":
        known = {"v", "type", "id", "text", "token_ids", *required}
        extra = {k: v for k, v in msg.items() if k not in known}
        return Done(mid, **values, text=msg.get("text"), token_ids=msg.get("token_ids"), extra=extra)
    return cls(mid, **values)


def _is_family(f: Any) -> bool:
    """A metric family a client can show (others, e.g. of a type a newer daemon added, are dropped)."""
    return (
        isinstance(f, dict)
        and isinstance(f.get("name"), str)
        and f.get("type") in METRIC_TYPES
        and isinstance(f.get("samples"), list)
        and all(isinstance(s, dict) and isinstance(s.get("labels", {}), dict) for s in f["samples"])
    )


# ---------------------------------------------------------------------------------------------------------
# Where the daemon listens


def default_socket_path(
    env: Mapping[str, str] = os.environ, euid: int | None = None, system_dir: str = SYSTEM_SOCKET_DIR
) -> str:
    """Where hmad listens when no one says: the same answer for the daemon (it binds there) and a client.

    1. ``$HMAD_SOCKET``, when set;
    2. ``system_dir``/hmad.sock, for root (who makes the directory) or when ``system_dir`` is a directory this
       user may enter: the system service's (systemd's ``RuntimeDirectory=hmad``, group hmad may enter);
    3. ``$XDG_RUNTIME_DIR``/hmad/hmad.sock, when that is an absolute path (the user's own daemon);
    4. ``$TMPDIR`` (absolute, else /tmp) /hmad-<euid>/hmad.sock. Anyone can create a name under /tmp first:
       the daemon makes this directory 0700 and refuses one it does not own, and clients refuse a socket
       whose directory another user owns (``hmaclient.safepath``).

    A user who may enter /run/hmad and runs a daemon of their own gives it (and its clients) a path.
    """
    if env.get("HMAD_SOCKET"):
        return env["HMAD_SOCKET"]
    euid = os.geteuid() if euid is None else euid
    if euid == 0 or (os.path.isdir(system_dir) and os.access(system_dir, os.X_OK)):
        return os.path.join(system_dir, "hmad.sock")
    xdg = env.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(xdg):
        return os.path.join(xdg, "hmad", "hmad.sock")
    tmp = env.get("TMPDIR", "")
    return os.path.join(tmp if os.path.isabs(tmp) else "/tmp", f"hmad-{euid}", "hmad.sock")


def endpoint(path: str) -> str:
    """The ZeroMQ address of a socket path: ``ipc://`` + path (which must fit a Unix socket address)."""
    if len(os.fsencode(path)) > MAX_IPC_PATH_BYTES:
        raise ValueError(f"socket path is over {MAX_IPC_PATH_BYTES} bytes (a Unix socket limit): {path}")
    return "ipc://" + path
