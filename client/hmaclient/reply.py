"""Replies of the hmad wire protocol (its spec: ``hmaclient.protocol``): the builders the daemon answers
with, and the typed replies a client parses them into (leniently: unknown fields are ignored).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hmaclient.framing import (
    BAD_REQUEST,
    ERROR_CODES,
    MAX_REPLY_BYTES,
    METRIC_TYPES,
    PROTOCOL_VERSION,
    UNKNOWN_TYPE,
    Id,
    ProtocolError,
    _message,
)

# Every builder takes ``v``: the version of the request it answers (see Versions).


def accepted(id: Id, rid: int, *, v: int = PROTOCOL_VERSION) -> dict[str, Any]:
    return {"v": v, "type": "accepted", "id": id, "rid": rid}


def token(
    id: Id, text: str, token_ids: list[int], *, v: int = PROTOCOL_VERSION, logprobs: list | None = None
) -> dict[str, Any]:
    """``logprobs``: one entry per id of ``token_ids`` (the request asked for them: docs/protocol.md)."""
    msg = {"v": v, "type": "token", "id": id, "text": text, "token_ids": list(token_ids)}
    if logprobs is not None:
        msg["logprobs"] = logprobs
    return msg


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
    """``text`` and ``token_ids`` only with stream=false (and ``logprobs``, when asked for, in ``extra``).
    ``extra`` fields (e.g. schema_complete) go out as they are."""
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


def result(id: Id, values: dict[str, Any], *, v: int = PROTOCOL_VERSION) -> dict[str, Any]:
    """The answer to a model request (version 5): ``values`` as docs/protocol.md lists them per request."""
    return {"v": v, "type": "result", "id": id, "result": values}


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
    logprobs: list[Logprob] | None = None  # one per id, when the request asked for logprobs


@dataclass
class Logprob:
    """A generated token's logprob and its ``top`` alternatives, each (id, logprob, text), most likely
    first (docs/protocol.md, "Logprobs")."""

    token_id: int
    text: str
    logprob: float
    top: list[tuple[int, float, str]] = field(default_factory=list)


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
    tool_calls: list[dict[str, str]] = field(default_factory=list)  # [{id, name, arguments (JSON text)}]
    logprobs: list[Logprob] | None = None  # stream=false, when asked for: one per id of token_ids
    prompt_logprobs: list[Logprob | None] | None = None  # when asked for: one per prompt token, first None


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


@dataclass
class Result:
    id: Id
    values: dict[str, Any]


Reply = Accepted | Token | Done | Error | Cancelled | Status | Pong | Metrics | Result

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
    "result": (Result, {"result": dict}),
}


def parse_reply(frame: bytes, max_size: int = MAX_REPLY_BYTES) -> Reply:
    """One frame from the daemon -> a reply dataclass. Unknown fields are ignored (``Done.extra`` keeps them).

    Unknown error codes are passed through as they are (a newer daemon may add codes). A reply that breaks
    the protocol raises ProtocolError (with the reply's id when it could be read, naming the bad field), and
    nothing else: a client routes it to the request it concerns.
    """
    msg, mid = _message(frame, max_size)
    try:
        return _reply(msg, mid)
    except ProtocolError:
        raise
    except Exception as e:  # noqa: BLE001 - a check this module lacks: still the reply's fault, named
        raise ProtocolError(BAD_REQUEST, f"{msg.get('type')} reply: malformed ({e!r:.200})", mid) from e


def _reply(msg: dict[str, Any], mid: Id) -> Reply:
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
    if mtype == "result":
        return Result(mid, msg["result"])
    if mtype == "metrics":
        return Metrics(mid, [f for f in msg["metrics"] if _is_family(f)])
    if mtype == "done":
        return _done(msg, mid, values)
    if mtype == "token":
        _check_ids(msg["token_ids"], "token", mid)
        return Token(mid, **values, logprobs=_logprobs(msg.get("logprobs"), mid))
    return cls(mid, **values)


def _done(msg: dict[str, Any], mid: Id, values: dict[str, Any]) -> Done:
    known = {"v", "type", "id", "text", "token_ids", "tool_calls", "logprobs", "prompt_logprobs", *values}
    if msg.get("text") is not None and not isinstance(msg["text"], str):
        raise ProtocolError(BAD_REQUEST, "done reply: field 'text' must be a str", mid)
    if msg.get("token_ids") is not None:
        _check_ids(msg["token_ids"], "done", mid)
    prompt = msg.get("prompt_logprobs")
    if prompt is not None:  # the first prompt token has no entry (nil)
        if not isinstance(prompt, list) or (prompt and prompt[0] is not None):
            raise ProtocolError(BAD_REQUEST, "done reply: prompt_logprobs must be a list, nil first", mid)
        prompt = [None, *(_logprobs(prompt[1:], mid) or [])] if prompt else []
    return Done(
        mid,
        **values,
        text=msg.get("text"),
        token_ids=msg.get("token_ids"),
        extra={k: v for k, v in msg.items() if k not in known},
        tool_calls=_tool_calls(msg.get("tool_calls"), mid),
        logprobs=_logprobs(msg.get("logprobs"), mid),
        prompt_logprobs=prompt,
    )


def _check_ids(ids: Any, mtype: str, mid: Id) -> None:
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ProtocolError(BAD_REQUEST, f"{mtype} reply: field 'token_ids' must be a list of int", mid)


def _logprobs(entries: Any, mid: Id) -> list[Logprob] | None:
    """A reply's logprobs: absent is None; each {token_id, text, logprob, top: [[id, logprob, text]]}."""
    if entries is None:
        return None
    try:
        return [
            Logprob(
                int(e["token_id"]),
                str(e["text"]),
                float(e["logprob"]),
                [(int(i), float(lp), str(t)) for i, lp, t in e["top"]],
            )
            for e in entries
        ]
    except (TypeError, KeyError, ValueError):
        raise ProtocolError(
            BAD_REQUEST,
            "logprobs must be a list of {token_id, text, logprob, top: [[id, logprob, text]]}",
            mid,
        ) from None


def _tool_calls(calls: Any, mid: Id) -> list[dict[str, str]]:
    """A done reply's tool_calls: absent is none; each {id, name, arguments} of str."""
    if calls is None:
        return []
    ok = isinstance(calls, list) and all(
        isinstance(c, dict) and all(isinstance(c.get(k), str) for k in ("id", "name", "arguments"))
        for c in calls
    )
    if not ok:
        raise ProtocolError(
            BAD_REQUEST, "done reply: tool_calls must be a list of {id, name, arguments}", mid
        )
    return [{k: c[k] for k in ("id", "name", "arguments")} for c in calls]


def _is_family(f: Any) -> bool:
    """A metric family a client can show (others, e.g. of a type a newer daemon added, are dropped)."""
    return (
        isinstance(f, dict)
        and isinstance(f.get("name"), str)
        and f.get("type") in METRIC_TYPES
        and isinstance(f.get("samples"), list)
        and all(isinstance(s, dict) and isinstance(s.get("labels", {}), dict) for s in f["samples"])
    )
