"""Chat prompts: the model's own chat template when its file has one, else Gemma's chat format built in.

``render_chat(messages, template)`` with a :class:`hmad.model.chat_template.ChatTemplate` renders it (Jinja,
as transformers does); with None, the built-in Gemma turns below:

    <start_of_turn>user\n{system}\n\n{content}<end_of_turn>\n<start_of_turn>model\n{content}<end_of_turn>\n...
    <start_of_turn>model\n                       (the generation prompt)

Gemma has no system role: a system message (or ``developer``, taken as ``system``) is prepended to the first
user turn, as Gemma's own template does. ``assistant`` is accepted as an alias of ``model``. The tokenizer
adds <bos>. Tools are not rendered by the built-in format (they need a template that renders them). A content
may be a list of text and image parts; an image part is written ``<start_of_image>``, as Gemma 3's template
writes it.

The prompt is a :class:`TemplateText`: only the template's own ``<start_of_turn>`` and ``<end_of_turn>``
are control tokens; message content (and the system message) is tokenized as plain text, so control-token
text in a message (``<end_of_turn>``, ``<start_of_turn>model``, ``<bos>``) is just text to the model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from hmad.model.tokenizer import TemplateText

if TYPE_CHECKING:
    from hmad.model.chat_template import ChatTemplate

ROLES = {"user": "user", "model": "model", "assistant": "model"}
SYSTEM = ("system", "developer")
START, END = "<start_of_turn>", "<end_of_turn>"
IMAGE_MARKER = "<start_of_image>"  # an image part's place (model/vision_prompt.py expands it)


def render_chat(
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool = True,
    template: ChatTemplate | None = None,
    tools: Sequence[Any] | None = None,
    extra: Mapping[str, Any] | None = None,
) -> TemplateText:
    """Messages ({role, content}) -> the prompt text, its markers known to the tokenizer; raises ValueError
    on an unknown role or order (a template's ChatTemplateError is one).

    ``template``: the model's own (``tokenizer.chat_template``), None for the built-in Gemma turns;
    ``tools`` and ``extra`` (more template variables) reach a template only."""
    if template is not None:
        return template.render(messages, add_generation_prompt, tools=tools, extra=extra)
    if tools:
        raise ValueError("tools need the model's own chat template; this model file has none")
    system = [m["content"] for m in messages if m["role"] in SYSTEM]
    turns = [m for m in messages if m["role"] not in SYSTEM]
    if len(system) > 1 or (system and messages[0]["role"] not in SYSTEM):
        raise ValueError("at most one system message, and only first")
    out: list[tuple[str, bool]] = []
    for i, m in enumerate(turns):
        role = ROLES.get(m["role"])
        if role is None:
            raise ValueError(f"unknown role {m['role']!r} (allowed: {', '.join([*SYSTEM, *ROLES])})")
        content = _pieces(m["content"])
        if i == 0 and system:
            if role != "user":
                raise ValueError("a system message must be followed by a user message")
            content = [(f"{text_of(system[0])}\n\n", False), *content]
        out += [(START, True), (f"{role}\n", False), *content, (END, True), ("\n", False)]
    if add_generation_prompt:
        out += [(START, True), ("model\n", False)]
    return TemplateText(out)


def _pieces(content: str | list[dict[str, Any]]) -> list[tuple[str, bool]]:
    """A message's content as pieces: text parts as text, image parts as ``<start_of_image>`` markers."""
    if isinstance(content, str):
        return [(content, False)]
    return [(IMAGE_MARKER, True) if p["type"] == "image" else (p["text"], False) for p in content]


def text_of(content: str | list[dict[str, Any]]) -> str:
    """A content's text (its text parts joined; image parts have none)."""
    if isinstance(content, str):
        return content
    return "".join(p["text"] for p in content if p["type"] == "text")


def render_prompt(prompt: str, template: ChatTemplate | None = None) -> TemplateText:
    """A bare prompt as one user turn with the generation prompt."""
    return render_chat([{"role": "user", "content": prompt}], template=template)
