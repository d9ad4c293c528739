"""Tool calling on the wire (its spec: ``hmaclient.protocol``): the checks of a generate's ``tools``,
``tool_choice`` and ``parallel_tool_calls`` and of the tool fields of its messages, each turning what a
client sent into the one normal form the daemon uses.

Normal forms (what ``GenerateRequest`` holds after the check):

    tool         {name, description, parameters}   (OpenAI's {type: "function", function: {...}} taken too)
    tool_choice  "auto" | "none" | "required" | {"name": str}   (OpenAI's {type, function: {name}} too)
    tool call    {id, name, arguments}   arguments a map (a JSON object's text is parsed)
    messages     {role, content} plus: assistant ``tool_calls`` (content may be "" or nil then);
                 ``role: "tool"`` with ``tool_call_id`` and optional ``name``

Each check returns a problem (one line, naming the field) or None; the caller raises it.
"""

from __future__ import annotations

import json
import re
from typing import Any

MAX_TOOLS = 128  # tools in one request (their JSON also counts toward the prompt's character limit)
MAX_TOOL_CALLS = 64  # calls in one assistant message
MAX_TOOL_ID_CHARS = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # OpenAI's rule, plus dots
CHOICES = ("auto", "none", "required")
MESSAGE_KEYS = {
    "assistant": {"role", "content", "tool_calls"},
    "model": {"role", "content", "tool_calls"},
    "tool": {"role", "content", "tool_call_id", "name"},
}
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def _kind(x: Any) -> str:
    return type(x).__name__ if x is not None else "nil"


def check_tools(tools: Any) -> tuple[list[dict[str, Any]] | None, str | None]:
    """``tools`` -> (the normal form, None) or (None, the problem)."""
    if not isinstance(tools, list):
        return None, f"tools must be a list of maps, got {_kind(tools)}"
    if len(tools) > MAX_TOOLS:
        return None, f"{len(tools)} tools is over the limit of {MAX_TOOLS}"
    out, names = [], set()
    for i, t in enumerate(tools):
        if isinstance(t, dict) and t.get("type") == "function" and set(t) <= {"type", "function"}:
            t = t.get("function")
        if not isinstance(t, dict) or not set(t) <= {"name", "description", "parameters", "strict"}:
            return None, f"tools[{i}] must be a map of name, description, parameters"
        name, params = t.get("name"), t.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            return None, f"tools[{i}].name must be 1..64 of A-Z a-z 0-9 _ . -, got {name!r:.80}"
        if name in names:
            return None, f"tools[{i}].name {name!r} is given twice"
        if not isinstance(t.get("description", ""), str):
            return None, f"tools[{i}].description must be a str, got {_kind(t['description'])}"
        if not isinstance(params, dict):
            return None, f"tools[{i}].parameters must be a map (a JSON Schema), got {_kind(params)}"
        names.add(name)
        out.append({"name": name, "description": t.get("description", ""), "parameters": params})
    return out, None


def check_choice(choice: Any, tools: list[dict[str, Any]] | None) -> tuple[Any, str | None]:
    """``tool_choice`` -> (the normal form, None) or (None, the problem); nil is "auto"."""
    if choice is None:
        choice = "auto"
    if (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
    ):
        choice = choice["function"]
    if isinstance(choice, dict) and set(choice) == {"name"} and isinstance(choice["name"], str):
        if not any(t["name"] == choice["name"] for t in tools or ()):
            return None, f"tool_choice names {choice['name']!r:.80}, which is not among the tools"
        return {"name": choice["name"]}, None
    if choice not in CHOICES:
        return None, f"tool_choice must be one of {list(CHOICES)} or {{name: str}}, got {choice!r:.80}"
    if choice == "required" and not tools:
        return None, "tool_choice 'required' needs tools"
    return choice, None


def check_message(i: int, m: dict[str, Any]) -> tuple[dict[str, Any] | None, str | None]:
    """A message with tool fields (an assistant's ``tool_calls``, a ``tool`` result) -> its normal form."""
    role = m.get("role")
    keys = MESSAGE_KEYS.get(role) if isinstance(role, str) else None
    if keys is None or not set(m) <= keys or "content" not in m and role == "tool":
        return None, f"messages[{i}] has fields {sorted(map(str, m))} its role {role!r:.32} does not take"
    content = m.get("content")
    if role == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(content, str):
            return None, f"messages[{i}].content (a tool result) must be a str, got {_kind(content)}"
        if not isinstance(call_id, str) or not 0 < len(call_id) <= MAX_TOOL_ID_CHARS:
            return None, f"messages[{i}].tool_call_id must be a str of 1..{MAX_TOOL_ID_CHARS} characters"
        if m.get("name") is not None and not (isinstance(m["name"], str) and TOOL_NAME.fullmatch(m["name"])):
            return None, f"messages[{i}].name must be a tool's name, got {m['name']!r:.80}"
        return {k: m[k] for k in ("role", "content", "tool_call_id", "name") if m.get(k) is not None}, None
    if content is not None and not isinstance(content, str):
        return None, f"messages[{i}].content must be a str or nil, got {_kind(content)}"
    calls, problem = check_calls(m.get("tool_calls"), f"messages[{i}].tool_calls")
    if problem:
        return None, problem
    return {"role": role, "content": content or "", "tool_calls": calls}, None


def check_calls(calls: Any, where: str) -> tuple[list[dict[str, Any]] | None, str | None]:
    if not isinstance(calls, list) or not 0 < len(calls) <= MAX_TOOL_CALLS:
        return None, f"{where} must be a list of 1..{MAX_TOOL_CALLS} calls, got {_kind(calls)}"
    out = []
    for j, c in enumerate(calls):
        if (
            isinstance(c, dict)
            and isinstance(c.get("function"), dict)
            and set(c) <= {"id", "type", "function"}
        ):
            c = {"id": c.get("id"), **c["function"]}
        if not isinstance(c, dict) or set(c) != {"id", "name", "arguments"}:
            return None, f"{where}[{j}] must be a map of exactly id, name, arguments"
        if not isinstance(c["id"], str) or not 0 < len(c["id"]) <= MAX_TOOL_ID_CHARS:
            return None, f"{where}[{j}].id must be a str of 1..{MAX_TOOL_ID_CHARS} characters"
        if not isinstance(c["name"], str) or not TOOL_NAME.fullmatch(c["name"]):
            return None, f"{where}[{j}].name must be a tool's name, got {c['name']!r:.80}"
        args = c["arguments"]
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError as e:
                return None, f"{where}[{j}].arguments is not JSON: {e}"
        if not isinstance(args, dict):
            return None, f"{where}[{j}].arguments must be a JSON object, got {_kind(args)}"
        out.append({"id": c["id"], "name": c["name"], "arguments": args})
    return out, None


def has_tool_fields(m: Any) -> bool:
    """Whether a message uses the tool fields (so ``check_message`` is the check that applies)."""
    return isinstance(m, dict) and (m.get("role") == "tool" or "tool_calls" in m)


def text_size(m: dict[str, Any]) -> int:
    """Characters a normal-form message adds to the prompt (content, a list's text parts, and its calls'
    arguments)."""
    content, calls = m["content"], m.get("tool_calls") or ()
    text = len(content) if isinstance(content, str) else sum(len(p.get("text", "")) for p in content)
    return text + sum(len(json.dumps(c["arguments"])) for c in calls)
