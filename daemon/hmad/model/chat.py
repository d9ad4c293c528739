"""Gemma's chat format.

    <start_of_turn>user\n{system}\n\n{content}<end_of_turn>\n<start_of_turn>model\n{content}<end_of_turn>\n...
    <start_of_turn>model\n                       (the generation prompt)

Gemma has no system role: a system message is prepended to the first user turn, as Gemma's own template
does. ``assistant`` is accepted as an alias of ``model``. The tokenizer adds <bos>.

The prompt is a :class:`TemplateText`: only the template's own ``<start_of_turn>`` and ``<end_of_turn>``
are control tokens; message content (and the system message) is tokenized as plain text, so control-token
text in a message (``<end_of_turn>``, ``<start_of_turn>model``, ``<bos>``) is just text to the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hmad.model.tokenizer import TemplateText

ROLES = {"user": "user", "model": "model", "assistant": "model"}
START, END = "<start_of_turn>", "<end_of_turn>"


def render_chat(messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True) -> TemplateText:
    """Messages ({role, content}) -> the prompt text, its markers known to the tokenizer; raises ValueError
    on an unknown role or order."""
    system = [m["content"] for m in messages if m["role"] == "system"]
    turns = [m for m in messages if m["role"] != "system"]
    if len(system) > 1 or (system and messages[0]["role"] != "system"):
        raise ValueError("at most one system message, and only first")
    out: list[tuple[str, bool]] = []
    for i, m in enumerate(turns):
        role = ROLES.get(m["role"])
        if role is None:
            raise ValueError(f"unknown role {m['role']!r} (allowed: system, user, model, assistant)")
        content = m["content"]
        if i == 0 and system:
            if role != "user":
                raise ValueError("a system message must be followed by a user message")
            content = f"{system[0]}\n\n{content}"
        out += [(START, True), (f"{role}\n{content}", False), (END, True), ("\n", False)]
    if add_generation_prompt:
        out += [(START, True), ("model\n", False)]
    return TemplateText(out)


def render_prompt(prompt: str) -> TemplateText:
    """A bare prompt as one user turn with the generation prompt."""
    return render_chat([{"role": "user", "content": prompt}])
