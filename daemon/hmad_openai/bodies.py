"""What the Ollama, Anthropic and Responses APIs share in reading a request: strict pydantic bodies, a parse
that names the first bad field in the wire's words under the body's own name for it, the sampling fields'
types (``hmaclient.sampling``: one table of bounds for every API), hmad's messages (leading system
turns joined into the one hmad takes), and hmad's own ``speculate`` field (every API, OpenAI's too).

Errors are OpenAIError (the gateway's one error carrier); ``app`` renders them in the shape of the API the
path belongs to.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from hmaclient import sampling
from hmad.engine.sampling_schema import field_type
from hmad_openai.errors import OpenAIError, bad_request


class Body(BaseModel):
    """A request body: strict JSON types; fields it does not name are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)


def sampling_type(name: str) -> Any:
    """The pydantic type of hmad's sampling field ``name``, absent or null allowed (the daemon's default)."""
    return field_type(sampling.BY_NAME[name]) | None


def parse(model: type[BaseModel], body: bytes, renames: Mapping[str, str] | None = None) -> Any:
    """A request body -> ``model``, or a 400 naming the first bad field. ``renames``: the body's names of
    hmad's sampling fields (``max_output_tokens`` -> ``max_tokens``), so a value out of range is told in the
    wire's words under the body's name ("max_output_tokens must be an integer from 1 to 1000000, got 0")."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        err = e.errors()[0]
        if err["type"] == "json_invalid":
            raise bad_request(f"the body is not valid JSON: {err['msg']}") from None
        if err["type"] == "model_type" and not err["loc"]:
            raise bad_request("the body must be a JSON object") from None
        loc = ".".join(str(x) for x in err["loc"] if not _is_type_tag(x))
        if err["type"] == "missing":
            raise bad_request(f"{loc} is required", loc) from None
        wire = (renames or {}).get(loc, loc)
        if wire in sampling.BY_NAME:
            text = sampling.problem(wire, err.get("input")) or f"{wire}: {err['msg']}"
            raise OpenAIError(400, text.replace(wire, loc, 1), param=loc) from None
        raise OpenAIError(400, f"{loc}: {err['msg']}", param=loc or None) from None


def _is_type_tag(x: Any) -> bool:
    """pydantic's names of union members in an error's location (``str``, ``list[...]``), not fields."""
    return isinstance(x, str) and x.startswith(("list[", "str", "dict[", "int", "float", "bool", "function-"))


def checked(body_name: str, hmad_name: str, value: Any) -> Any:
    """``value`` for hmad's sampling field ``hmad_name`` as it is sent (an integral float becomes an int for
    an int field), or a 400 in the wire's words under ``body_name``."""
    f = sampling.BY_NAME[hmad_name]
    if f.kind == "int" and isinstance(value, float) and value.is_integer():
        value = int(value)
    wrong = sampling.problem(hmad_name, value)
    if wrong:
        raise bad_request(wrong.replace(hmad_name, body_name, 1), body_name)
    return value


def speculate(value: Any, name: str = "speculate") -> dict[str, Any]:
    """A body's ``name`` (hmad's own field, no API's: ``speculate``, Ollama's ``options.speculate``) ->
    hmaclient's ``speculate`` (false: never decoded speculatively, docs/speculation.md): {} when absent or
    null (the daemon's default), ``{"speculate": value}`` for a bool, else a 400 naming ``name``. Bodies
    declare the field ``Any`` so that every API refuses a wrong value in these words."""
    if value is None:
        return {}
    if not isinstance(value, bool):
        shown = json.dumps(value)
        shown = shown if len(shown) <= 40 else shown[:37] + "..."
        raise bad_request(f"{name} must be true or false, got {shown}", name)
    return {"speculate": value}


def hmad_messages(turns: list[tuple[str, Any] | dict[str, Any]]) -> list[dict[str, Any]]:
    """Turns -> hmad's messages: a (role, content) turn becomes {role, content} (content a str, or a user's
    list of text and image parts: ``images.parts``), a map (a turn with tool fields) stays as it is; the
    leading system turns (text) are joined into one (hmad takes one system message, first)."""
    out: list[dict[str, Any]] = []
    for turn in turns:
        if isinstance(turn, dict):
            out.append(turn)
            continue
        role, text = turn
        if role == "system" and out and all(o["role"] == "system" for o in out):
            out[0]["content"] += "\n\n" + text
        else:
            out.append({"role": role, "content": text})
    return out
