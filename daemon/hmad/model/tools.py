"""Tools in the prompt, as Gemma 3's function-calling guidance writes them: plain turns any chat template
renders (Gemma 3's own template knows no tools, so hmad writes them into the messages).

``fold_tools(messages, tools, choice)`` -> messages of only ``{role, content}``:

- the preamble (when the answer may be a call: tools given, choice not "none"): the instruction and the
  call form, then the function definitions as JSON, joined before the system message (or made the system
  message), which the template puts into the first user turn::

      You have access to functions. If you decide to invoke any of the function(s), you MUST put it in the
      format of
      {"name": function name, "parameters": dictionary of argument name and its value}
      You SHOULD NOT include any other text in the response if you call a function
      [
      {"name": ..., "description": ..., "parameters": {...}},
      ...
      ]

  then ``required`` adds "You MUST call one of the functions.", a named choice "You MUST call the
  function N." (Lists of calls go unmentioned, as in the guide: a model that wants several calls may open
  a JSON list, which the grammar takes when parallel calls are allowed; small models asked for lists tend
  to repeat one call.)
- an assistant turn's ``tool_calls``: its content, then the calls in that same form (one object, or a
  list for several), so the model reads its past calls as it writes new ones;
- ``tool`` results: a user turn of ``tool_output`` blocks, one per result, each a JSON object
  {"name", "tool_call_id", "content"} (name: the message's, else that of the call it answers);
- then consecutive turns of one role joined (blank line between), as Gemma's turns must alternate.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

PREAMBLE = (
    "You have access to functions. If you decide to invoke any of the function(s), you MUST put it in the "
    'format of\n{"name": function name, "parameters": dictionary of argument name and its value}\n'
)
NO_OTHER_TEXT = "You SHOULD NOT include any other text in the response if you call a function\n"


def preamble(tools: Sequence[dict[str, Any]], choice: Any) -> str:
    """The instruction, the function definitions (a JSON list, one per line), then what tool_choice asks
    (last, so requests that differ only in it share the prompt's cached prefix)."""
    text = PREAMBLE + NO_OTHER_TEXT
    text += "[\n" + ",\n".join(json.dumps(t, ensure_ascii=False) for t in tools) + "\n]"
    if choice == "required":
        text += "\nYou MUST call one of the functions."
    elif isinstance(choice, dict):
        text += f"\nYou MUST call the function {choice['name']}."
    return text


def call_text(calls: Sequence[dict[str, Any]]) -> str:
    """Calls ({name, arguments}) in the call form the model writes."""
    forms = [{"name": c["name"], "parameters": c["arguments"]} for c in calls]
    return json.dumps(forms[0] if len(forms) == 1 else forms, ensure_ascii=False)


def fold_tools(
    messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None, choice: Any
) -> list[dict[str, str]]:
    """The messages as plain turns (module docstring); unchanged in content when nothing is about tools."""
    names = {c["id"]: c["name"] for m in messages for c in m.get("tool_calls") or ()}
    out: list[dict[str, str]] = []
    for m in messages:
        role, content = m["role"], m["content"]
        if m.get("tool_calls"):
            content = "\n".join(t for t in (content, call_text(m["tool_calls"])) if t)
        elif role == "tool":
            result = {
                "name": m.get("name") or names.get(m["tool_call_id"]),
                "tool_call_id": m["tool_call_id"],
            }
            content = f"```tool_output\n{json.dumps({**result, 'content': content}, ensure_ascii=False)}\n```"
            role = "user"
        out.append({"role": role, "content": content})
    if tools and choice != "none":
        text = preamble(tools, choice)
        if out[0]["role"] in ("system", "developer"):
            out[0] = {"role": out[0]["role"], "content": f"{text}\n\n{out[0]['content']}"}
        else:
            out.insert(0, {"role": "system", "content": text})
    return _joined(out)


def _joined(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """Consecutive turns of one role (``assistant`` and ``model`` are one) as one turn."""
    out: list[dict[str, str]] = []
    for m in messages:
        if out and _same(out[-1]["role"], m["role"]) and m["role"] not in ("system", "developer"):
            out[-1] = {"role": out[-1]["role"], "content": _join(out[-1]["content"], m["content"])}
        else:
            out.append(m)
    return out


def _join(a: str | list[dict], b: str | list[dict]) -> str | list[dict]:
    """Two turns' contents, a blank line between; lists of parts (images) stay lists."""
    if isinstance(a, str) and isinstance(b, str):
        return f"{a}\n\n{b}"
    return [*_parts(a), {"type": "text", "text": "\n\n"}, *_parts(b)]


def _parts(content: str | list[dict]) -> list[dict]:
    return content if isinstance(content, list) else [{"type": "text", "text": content}]


def _same(a: str, b: str) -> bool:
    model = ("assistant", "model")
    return a == b or (a in model and b in model)
