"""Gemma's chat format.

    <start_of_turn>user\n{system}\n\n{content}<end_of_turn>\n<start_of_turn>model\n{content}<end_of_turn>\n...
    <start_of_turn>model\n                       (the generation prompt)

Gemma has no system role: a system message is prepended to the first user turn, as Gemma's own template
does. ``assistant`` is accepted as an alias of ``model``. The tokenizer adds <bos>.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

ROLES = {"user": "user", "model": "model", "assistant": "model"}


def render_chat(messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    """Messages ({role, content}) -> the prompt text; raises ValueError on an unknown role or order."""
    system = [m["content"] for m in messages if m["role"] == "system"]
    turns = [m for m in messages if m["role"] != "system"]
    if len(system) > 1 or (system and messages[0]["role"] != "system"):
        raise ValueError("at most one system message, and only first")
    out = []
    for i, m in enumerate(turns):
        role = ROLES.get(m["role"])
        if role is None:
            raise ValueError(f"unknown role {m['role']!r} (allowed: system, user, model, assistant)")
        content = m["content"]
        if i == 0 and system:
            if role != "user":
                raise ValueError("a system message must be followed by a user message")
            content = f"{system[0]}\n\n{content}"
        out.append(f"<start_of_turn>{role}\n{content}<end_of_turn>\n")
    if add_generation_prompt:
        out.append("<start_of_turn>model\n")
    return "".join(out)


def render_prompt(prompt: str) -> str:
    """A bare prompt as one user turn with the generation prompt."""
    return render_chat([{"role": "user", "content": prompt}])
