"""The envelope and the frames of the hmad wire protocol (its spec: ``hmaclient.protocol``).

Owns the version numbers, every limit, the error codes and ``ProtocolError``; ``pack`` / ``unpack`` (one
msgpack map per frame, every limit enforced before a field is looked at); the envelope every message has
(``v``, ``type``, ``id``) and which version a message needs (``ADDED_IN``).
"""

from __future__ import annotations

import re
from typing import Any

import msgpack

from hmaclient import sampling

PROTOCOL_VERSION = 5  # the newest version this module speaks
SUPPORTED_VERSIONS = frozenset({1, 2, 3, 4, 5})

# a request frame: room for images (encoded files) besides a whole prompt; what the daemon may hold for
# the requests in flight follows from it (docs/protocol.md, "Limits")
MAX_FRAME_BYTES = 32 * 1024 * 1024
MAX_REPLY_BYTES = 64 * 1024 * 1024  # a reply frame (done with stream=false carries a whole answer)
MAX_PROMPT_CHARS = 1024 * 1024  # prompt, or the sum of the messages' contents, in characters
MAX_MESSAGES = 1024
MAX_PARTS = 64  # parts of one message's content, when it is a list
MAX_IMAGES = 16  # images in one generate, all messages and ``images`` together (the daemon may take fewer)
# what an image holds: an encoded file of one of these formats, told by its first bytes
IMAGE_SIGNATURES = {
    "png": (b"\x89PNG\r\n\x1a\n",),
    "jpeg": (b"\xff\xd8\xff",),
    "gif": (b"GIF87a", b"GIF89a"),
    "webp": (b"RIFF",),  # and "WEBP" at byte 8
    "bmp": (b"BM",),
}
MAX_STOP_STRINGS = sampling.MAX_STOP_STRINGS  # the sampling fields' own limits live in hmaclient.sampling
MAX_STOP_CHARS = sampling.MAX_STOP_CHARS
MAX_TOKENS_LIMIT = sampling.MAX_TOKENS_LIMIT
MAX_TEMPERATURE = sampling.MAX_TEMPERATURE
MAX_REPETITION_PENALTY = sampling.MAX_REPETITION_PENALTY
MAX_ID_CHARS = 128
MAX_DEPTH = 32  # a json_schema nests (properties -> schema -> items -> ...)
MAX_ARRAY_LEN = 4 * 1024 * 1024  # token_ids of a long answer; requests are bounded by their frame anyway
MAX_MAP_LEN = 1024
MAX_CONTAINERS = 4096  # arrays + maps in one message (MAX_MESSAGES + 2 for a request of str contents)
# array items + map entries in one request: its unpack's work is bounded by these, not by its bytes (the
# frame limit grew for images, which are single bin objects)
MAX_REQUEST_ITEMS = 1024 * 1024

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
UNSUPPORTED = "unsupported"  # the loaded model cannot do what the request asks (images without vision)
INTERNAL = "internal"
# since version 5 (models named by requests; a client of an older version never names one)
MODEL_NOT_FOUND = "model_not_found"  # neither a model of the daemon's store nor a file it can read
SWITCH_REFUSED = "switch_refused"  # another model than the loaded one, and the config forbids switching
MODEL_IN_USE = "model_in_use"  # remove of the loaded model
NO_MODEL = "no_model"  # no model is loaded (its load failed) and none is loading
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
        UNSUPPORTED,
        INTERNAL,
        MODEL_NOT_FOUND,
        SWITCH_REFUSED,
        MODEL_IN_USE,
        NO_MODEL,
    }
)

FINISH_REASONS = frozenset({"stop", "length", "tool_calls"})
ROLES = frozenset({"system", "user", "model", "assistant", "tool"})
MODEL_REQUESTS = ("models", "load", "unload", "remove", "pull")  # version 5: the models on disk and loaded
REQUEST_TYPES = frozenset({"generate", "cancel", "status", "ping", "metrics", *MODEL_REQUESTS})

# Not a field: a generate whose messages hold a content that is a list of parts (ADDED_IN has it).
CONTENT_PARTS = "messages[].content as a list of parts"
# What each version added: (request type, field) -> version, with field None for a whole request type.
# A message whose v is older than an entry it uses is refused, naming the field and the version.
ADDED_IN: dict[tuple[str, str | None], int] = {
    ("generate", "json_schema"): 2,
    ("generate", "images"): 4,
    ("generate", CONTENT_PARTS): 4,
    ("metrics", None): 2,
    ("generate", "model"): 5,
    ("generate", "speculate"): 5,
    **{(t, None): 5 for t in MODEL_REQUESTS},
    **{
        ("generate", field): 3
        for field in (
            *("tools", "tool_choice", "parallel_tool_calls"),
            *("logprobs", "prompt_logprobs"),
            *("presence_penalty", "frequency_penalty", "logit_bias"),
        )
    },
}
REPLY_TYPES = frozenset(
    {"accepted", "token", "done", "error", "cancelled", "status", "pong", "metrics", "result"}
)
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
        from hmaclient.reply import error  # replies build on this module

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


def unpack(frame: bytes, max_size: int = MAX_FRAME_BYTES, max_items: int | None = None) -> Any:
    """One frame -> one msgpack object, within every limit listed in the module docstring; ``max_items``
    (requests: MAX_REQUEST_ITEMS) bounds the array items and map entries of the whole object.

    Raises ProtocolError (``too_large`` for a limit, ``bad_request`` for anything malformed); never
    allocates more than a small multiple of ``len(frame)``.
    """
    n = len(frame)
    if n > max_size:
        raise ProtocolError(TOO_LARGE, f"frame of {n} bytes is over the limit of {max_size}")
    count = _ContainerCount(max_items)
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
            max_array_len=min(MAX_ARRAY_LEN if max_items is None else max_items, n),
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
    """msgpack hook called as each array or map is completed: stops the unpack past MAX_CONTAINERS, or
    past ``max_items`` array items and map entries in all.

    Bounds the work a frame can cause (a frame of tiny arrays, or of arrays of tiny scalars, costs its
    unpack far more per byte than a string does).
    """

    def __init__(self, max_items: int | None = None) -> None:
        self.n, self.items, self.max_items = 0, 0, max_items

    def __call__(self, container: Any) -> Any:
        self.n += 1
        if self.n > MAX_CONTAINERS:
            raise ProtocolError(TOO_LARGE, f"more than {MAX_CONTAINERS} arrays and maps in one message")
        self.items += len(container)
        if self.max_items is not None and self.items > self.max_items:
            raise ProtocolError(TOO_LARGE, f"more than {self.max_items} array items and map entries in all")
        return container


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ProtocolError(BAD_REQUEST, f"msgpack ext type {code} is not allowed")


# msgpack decodes to exactly these types (never subclasses), so ``type(x) in`` is exact and fast.
_SCALARS = frozenset({str, int, float, bool, type(None), bytes})


def _check_tree(obj: Any) -> None:
    """Iteratively: nesting <= MAX_DEPTH, map keys are str, only plain msgpack types (no Timestamp).

    ``set(map(type, ...))`` runs in C: a frame of MAX_REQUEST_ITEMS small scalars is checked in milliseconds.
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


def _message(frame: bytes, max_size: int, max_items: int | None = None) -> tuple[dict[str, Any], Id]:
    """unpack + the envelope: a map with a supported ``v`` and a str ``type``; returns it and its valid id."""
    msg = unpack(frame, max_size, max_items)
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
    return max([ADDED_IN.get((mtype, None), 1), *(ADDED_IN.get((mtype, k), 1) for k in _uses(msg))])


def _uses(msg: dict[str, Any]) -> list[str]:
    """The fields a message carries, and CONTENT_PARTS when a generate's message content is a list."""
    messages = msg.get("messages") if msg.get("type") == "generate" else None
    parts = isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list) for m in messages
    )
    return [*msg, CONTENT_PARTS] if parts else list(msg)


def image_format(data: Any) -> str | None:
    """The format of an image's encoded bytes (a key of IMAGE_SIGNATURES), told by its first bytes; None
    when ``data`` is not bytes of one of them."""
    if not isinstance(data, bytes):
        return None
    for name, heads in IMAGE_SIGNATURES.items():
        if data.startswith(heads) and (name != "webp" or data[8:12] == b"WEBP"):
            return name
    return None


def _check_version(msg: dict[str, Any], mid: Id) -> None:
    """Refuse a type or field newer than the message's own ``v``, naming it and the version it needs."""
    v, mtype = msg["v"], msg["type"]
    need = ADDED_IN.get((mtype, None), 1)
    if need > v:
        raise ProtocolError(
            BAD_REQUEST, f"request type {mtype!r} needs protocol version {need}, not {v}", mid
        )
    for k in _uses(msg):
        need = ADDED_IN.get((mtype, k), 1)
        if need > v:
            what = k if k == CONTENT_PARTS else f"field {k!r} of {mtype}"
            raise ProtocolError(BAD_REQUEST, f"{what} needs protocol version {need}, not {v}", mid)


_ID_RULE = f"id must be a str of 1..{MAX_ID_CHARS} characters or an int in [-2^63, 2^64)"


def _valid_id(v: Any) -> bool:
    if isinstance(v, str):
        return 1 <= len(v) <= MAX_ID_CHARS
    return isinstance(v, int) and not isinstance(v, bool) and _INT64_MIN <= v <= _UINT64_MAX


def _kind(v: Any) -> str:
    return "nil" if v is None else type(v).__name__
