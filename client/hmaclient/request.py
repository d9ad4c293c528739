"""Requests of the hmad wire protocol (its spec: ``hmaclient.protocol``): the typed requests, the check
that turns a request map into one (the daemon runs it on every frame, the client before sending), and the
builders a client sends.

The sampling fields' types, ranges and defaults are ``hmaclient.sampling``'s; this module only applies them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from hmaclient import sampling, tools
from hmaclient.framing import (
    _ID_RULE,
    BAD_REQUEST,
    IMAGE_SIGNATURES,
    MAX_FRAME_BYTES,
    MAX_IMAGES,
    MAX_MESSAGES,
    MAX_PARTS,
    MAX_PROMPT_CHARS,
    MAX_REQUEST_ITEMS,
    MODEL_REQUESTS,
    ROLES,
    TOO_LARGE,
    UNKNOWN_TYPE,
    Id,
    ProtocolError,
    _check_version,
    _kind,
    _message,
    _valid_id,
    image_format,
    required_version,
)


@dataclass
class GenerateRequest:
    """A validated ``generate``. Sampling fields left None mean "the daemon's default".

    ``v`` (every request has it): the version the message came in, which its replies carry.
    """

    id: Id = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None  # content a str, or a list of text and image parts
    images: list[bytes] | None = None  # with prompt: encoded images, in the one user turn before its text
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
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None  # alternatives per generated token (hmaclient.sampling.MAX_LOGPROBS)
    prompt_logprobs: int | None = None  # alternatives per prompt token
    json_schema: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, str] = "auto"
    parallel_tool_calls: bool = True
    model: str | None = None  # since version 5: the model to answer with (the daemon may switch to it)
    speculate: bool = True  # since version 5: false: no speculative decoding for this request
    v: int = field(default=1, compare=False)

    @property
    def calls_tools(self) -> bool:
        """Whether the answer may be a tool call: tools given and tool_choice not "none"."""
        return bool(self.tools) and self.tool_choice != "none"

    def sampling(self) -> dict[str, Any]:
        """The sampling fields the client gave, and logprobs, as ``SamplingParams`` keyword arguments (None
        left out)."""
        return {
            k: getattr(self, k) for k in (*SAMPLING_FIELDS, *COUNT_FIELDS) if getattr(self, k) is not None
        }


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


@dataclass
class ModelRequest:
    """Since version 5: ``models``, ``load``, ``unload``, ``remove`` or ``pull`` (``kind``); ``model`` the
    model named (load, remove, pull), else None."""

    kind: str
    id: Id = None
    model: str | None = None
    v: int = field(default=5, compare=False)


Request = GenerateRequest | CancelRequest | StatusRequest | PingRequest | MetricsRequest | ModelRequest

MAX_MODEL_CHARS = 4096  # a model's name or path
_NAMED = ("load", "remove", "pull")  # the model requests that name a model


SAMPLING_FIELDS = sampling.NAMES  # the sampling fields of a generate, stop included
COUNT_FIELDS = (
    "logprobs",
    "prompt_logprobs",
)  # what a generate reports besides its tokens (hmaclient.sampling.MAX_LOGPROBS)
_ENVELOPE = ("v", "type", "id")
_TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
_FIELDS = {
    "generate": frozenset(
        {
            *_ENVELOPE,
            "prompt",
            "messages",
            "images",
            "raw",
            "stream",
            "json_schema",
            *_TOOL_FIELDS,
            *SAMPLING_FIELDS,
            *COUNT_FIELDS,
            "model",
            "speculate",
        }
    ),
    "cancel": frozenset(_ENVELOPE),
    "status": frozenset(_ENVELOPE),
    "ping": frozenset(_ENVELOPE),
    "metrics": frozenset(_ENVELOPE),
    **{t: frozenset({*_ENVELOPE, "model"} if t in _NAMED else _ENVELOPE) for t in MODEL_REQUESTS},
}


def parse_request(frame: bytes, max_size: int = MAX_FRAME_BYTES) -> Request:
    """One frame from a client -> a validated request. Raises ProtocolError (with ``id`` when known, and
    ``v`` the version to answer in)."""
    msg, mid = _message(frame, max_size, MAX_REQUEST_ITEMS)
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
    if mtype in MODEL_REQUESTS:
        return _model_request(msg, mid)
    return {"status": StatusRequest, "ping": PingRequest, "metrics": MetricsRequest}[mtype](mid, v)


def _generate(msg: dict[str, Any], mid: Id) -> GenerateRequest:
    def fail(text: str, code: str = BAD_REQUEST) -> ProtocolError:
        return ProtocolError(code, text, mid)

    where = _bin_outside_images(msg)
    if where:
        raise fail(f"{where} is msgpack bin; bin is allowed only as an image's bytes (send text as str)")
    req = GenerateRequest(id=mid, v=msg["v"])
    for name in ("raw", "stream", "parallel_tool_calls", "speculate"):
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
        req.messages, problem, code = _check_messages(messages)
        if problem:
            raise fail(problem, code)
    _images_field(req, msg.get("images"), fail)
    for name in SAMPLING_FIELDS:
        value = msg.get(name)
        if value is not None:  # nil: the daemon's default
            problem = sampling.problem(name, value)
            if problem:
                raise fail(problem)
            setattr(req, name, sampling.stored(name, value))
    for name in COUNT_FIELDS:
        problem = sampling.logprobs_problem(name, msg.get(name))
        if problem:
            raise fail(problem)
        setattr(req, name, msg.get(name))
    if msg.get("json_schema") is not None:
        if not isinstance(msg["json_schema"], dict):
            raise fail(f"json_schema must be a map (a JSON Schema object), got {_kind(msg['json_schema'])}")
        req.json_schema = msg["json_schema"]
    _tool_fields(req, msg, fail)
    if msg.get("model") is not None:
        problem = _model_name(msg["model"], "model")
        if problem:
            raise fail(problem)
        req.model = msg["model"]
    return req


def _model_name(value: Any, where: str) -> str | None:
    """The problem with a model's name or path, or None."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_MODEL_CHARS or "\x00" in value:
        return f"{where} must be a model's name or path: a str of 1..{MAX_MODEL_CHARS} characters"
    return None


def _model_request(msg: dict[str, Any], mid: Id) -> ModelRequest:
    kind = msg["type"]
    if kind in _NAMED:
        problem = _model_name(msg.get("model"), f"{kind}.model")
        if problem:
            raise ProtocolError(BAD_REQUEST, problem, mid)
    return ModelRequest(kind, mid, msg.get("model"), msg["v"])


def _images_field(req: GenerateRequest, images: Any, fail: Any) -> None:
    """``images``: with a prompt and the chat template only; the request's images <= MAX_IMAGES in all."""
    if images is not None:
        if req.prompt is None:
            raise fail("images go with 'prompt'; with 'messages' send image parts in a user message")
        if req.raw:
            raise fail("images need the chat template: send them with raw=false")
        if not isinstance(images, list) or not images:
            raise fail(f"images must be a non-empty list of bin, got {_kind(images)}")
        for j, image in enumerate(images):
            problem = _image_problem(f"images[{j}]", image)
            if problem:
                raise fail(problem)
        req.images = images
    n = len(req.images or ()) + sum(_count_images(m) for m in req.messages or ())
    if n > MAX_IMAGES:
        raise fail(f"{n} images is over the limit of {MAX_IMAGES}", TOO_LARGE)


def _image_problem(where: str, image: Any) -> str | None:
    if not isinstance(image, bytes):
        return f"{where} must be bin (an encoded image file), got {_kind(image)}"
    if image_format(image) is None:
        kinds = "/".join(k.upper() for k in IMAGE_SIGNATURES)
        return f"{where} is not an image file of a known format ({kinds}), {len(image)} bytes"
    return None


def _count_images(m: dict[str, Any]) -> int:
    content = m.get("content")
    return sum(p["type"] == "image" for p in content) if isinstance(content, list) else 0


_PART_PATH = re.compile(r"messages\[\d+\]\.content\[\d+\]")


def _bin_outside_images(msg: dict[str, Any]) -> str | None:
    """Where the first bin of a generate is that is not an image's bytes (a dotted path), or None."""
    stack: list[tuple[str, Any]] = [(k, v) for k, v in msg.items() if k != "images"]
    while stack:
        where, node = stack.pop()
        if type(node) is bytes:
            return where
        if type(node) is dict:
            image_part = node.get("type") == "image" and _PART_PATH.fullmatch(where) is not None
            stack.extend((f"{where}.{k}", v) for k, v in node.items() if not (image_part and k == "image"))
        elif type(node) is list:
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(node))
    return None


def _tool_fields(req: GenerateRequest, msg: dict[str, Any], fail: Any) -> None:
    """tools, tool_choice (hmaclient.tools has their checks and normal forms)."""
    if msg.get("tools") is not None:
        req.tools, problem = tools.check_tools(msg["tools"])
        if problem:
            raise fail(problem)
    req.tool_choice, problem = tools.check_choice(msg.get("tool_choice"), req.tools)
    if problem:
        raise fail(problem)
    if req.calls_tools and req.prompt is not None and req.raw:
        raise fail("tools need the chat template: give 'messages' or a prompt with raw=false")
    if req.calls_tools and req.json_schema is not None:
        raise fail("give json_schema or tools (with tool_choice other than 'none'), not both")
    size = len(json.dumps(req.tools)) if req.tools else 0
    if size > MAX_PROMPT_CHARS:
        raise fail(f"tools of {size} characters of JSON are over the limit of {MAX_PROMPT_CHARS}", TOO_LARGE)


def _check_messages(messages: Any) -> tuple[list[dict[str, Any]], str | None, str]:
    """(the messages in their normal form, None, _) or ([], the problem, its code)."""
    if not isinstance(messages, list) or not messages:
        return [], f"messages must be a non-empty list, got {_kind(messages)}", BAD_REQUEST
    if len(messages) > MAX_MESSAGES:
        return [], f"{len(messages)} messages is over the limit of {MAX_MESSAGES}", TOO_LARGE
    out = []
    for i, m in enumerate(messages):
        m, problem = tools.check_message(i, m) if tools.has_tool_fields(m) else _plain_message(i, m)
        if problem:
            return [], problem, BAD_REQUEST
        if m["role"] == "system" and i != 0:
            return [], "a 'system' message may only come first", BAD_REQUEST
        out.append(m)
    total = sum(tools.text_size(m) for m in out)
    if total > MAX_PROMPT_CHARS:
        return [], f"messages of {total} characters are over the limit of {MAX_PROMPT_CHARS}", TOO_LARGE
    return out, None, BAD_REQUEST


def _plain_message(i: int, m: Any) -> tuple[dict[str, Any], str | None]:
    if not isinstance(m, dict) or set(m) != {"role", "content"}:
        return {}, f"messages[{i}] must be a map with exactly 'role' and 'content'"
    if not isinstance(m["role"], str) or m["role"] not in ROLES:
        return {}, f"messages[{i}].role must be one of {sorted(ROLES)}, got {m['role']!r:.64}"
    if isinstance(m["content"], list):
        parts, problem = _parts(f"messages[{i}].content", m["content"], m["role"])
        return {"role": m["role"], "content": parts}, problem
    if not isinstance(m["content"], str):
        return {}, f"messages[{i}].content must be a str or a list of parts, got {_kind(m['content'])}"
    return {"role": m["role"], "content": m["content"]}, None


def _parts(where: str, parts: list[Any], role: str) -> tuple[list[dict[str, Any]], str | None]:
    """A content that is a list -> its parts in their normal form ({type: text, text} | {type: image,
    image}), or the problem. Only a user message holds images."""
    if not 0 < len(parts) <= MAX_PARTS:
        return [], f"{where} must be a str or a list of 1..{MAX_PARTS} parts, got {len(parts)} parts"
    for j, p in enumerate(parts):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == "text" and set(p) == {"type", "text"}:
            if not isinstance(p["text"], str):
                return [], f"{where}[{j}].text must be a str, got {_kind(p['text'])}"
        elif kind == "image" and set(p) == {"type", "image"}:
            if role != "user":
                return [], f"{where}[{j}]: only a user message may hold images, not one of role {role!r}"
            problem = _image_problem(f"{where}[{j}].image", p["image"])
            if problem:
                return [], problem
        else:
            return [], f"{where}[{j}] must be {{type: 'text', text: str}} or {{type: 'image', image: bin}}"
    return [{"type": p["type"], p["type"]: p[p["type"]]} for p in parts], None


# Request builders (the client's side). Each returns the message map, validated as the daemon will.


def generate_request(
    id: Id, prompt: str | None = None, messages: list[dict[str, Any]] | None = None, **fields: Any
) -> dict[str, Any]:
    """A ``generate`` map; ``fields`` are images (a list of bytes: encoded image files), raw, stream,
    json_schema, tools, tool_choice, parallel_tool_calls, model, speculate and the sampling fields. None
    values are left out; ``v`` is the lowest version that has every field used (messages with a list
    content need 4)."""
    msg = {"type": "generate", "id": id, "prompt": prompt, "messages": messages, **fields}
    msg = {k: sampling.to_wire(k, v) for k, v in msg.items() if v is not None}
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


def model_request(kind: str, id: Id = None, model: str | None = None) -> dict[str, Any]:
    """A ``models``, ``load``, ``unload``, ``remove`` or ``pull`` map (version 5); ``model`` for the three
    that name one."""
    msg: dict[str, Any] = {"type": kind}
    if model is not None:
        msg["model"] = model
    msg = _stamped(msg, id)
    validate_request(msg, id)
    return msg


def _stamped(msg: dict[str, Any], id: Id) -> dict[str, Any]:
    """With ``id`` (when given) and ``v``: the lowest version the message needs."""
    if id is not None:
        msg["id"] = id
    return {"v": required_version(msg), **msg}
