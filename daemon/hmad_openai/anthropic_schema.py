"""Anthropic Messages request bodies and their translation into hmad's ``generate``.

    system (a str or text blocks)          -> the system message (blocks joined by newlines)
    messages (user/assistant; content a str or blocks):
        text blocks                        -> content (joined by newlines)
        user image blocks (source {type: base64, media_type, data})
                                           -> the content as hmad's parts, text and images in order
        assistant tool_use blocks          -> the assistant turn's tool_calls {id, name, arguments: input}
        user tool_result blocks            -> tool turns {tool_call_id, content} (before the user's text)
        thinking, redacted_thinking        ignored (the model does not think)
    max_tokens (required)                  -> max_tokens
    temperature, top_p, top_k              -> the same (hmad's ranges: temperature up to 100)
    stop_sequences                         -> stop
    output_config.format json_schema       -> json_schema (output_config.effort ignored)
    tools (custom: name, description, input_schema) -> tools {name, description, parameters}
    tool_choice auto | any | tool | none   -> auto | required | {name} | none;
        disable_parallel_tool_use          -> parallel_tool_calls false
    speculate (a bool; hmad's own)         -> speculate (absent: the daemon's default)

Refused with a 400: images by URL (source type url: the gateway fetches nothing; send base64) or file,
images in assistant turns or tool results, document blocks, server tools (web search, code execution,
...), thinking enabled, a last assistant message (prefill: hmad's answer starts a turn of its own).
Ignored: metadata, service_tier, cache_control, citations, anthropic-version and anthropic-beta headers.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from hmaclient import sampling
from hmad.engine.sampling_schema import field_type
from hmad_openai import images
from hmad_openai.bodies import Body, hmad_messages, sampling_type, speculate
from hmad_openai.errors import bad_request

_SKIPPED = ("thinking", "redacted_thinking")


class Message(Body):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesBody(Body):
    model: str = Field(min_length=1)
    messages: list[Message] = Field(min_length=1)
    max_tokens: field_type(sampling.BY_NAME["max_tokens"])  # type: ignore[valid-type]
    system: str | list[dict[str, Any]] | None = None
    temperature: sampling_type("temperature") = None  # type: ignore[valid-type]
    top_p: sampling_type("top_p") = None  # type: ignore[valid-type]
    top_k: sampling_type("top_k") = None  # type: ignore[valid-type]
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    speculate: Any = None  # bodies.speculate checks it

    def params(self) -> dict[str, Any]:
        """hmaclient ``generate`` keyword arguments, messages and tools included."""
        if self.thinking and self.thinking.get("type") != "disabled":
            raise bad_request("thinking is not supported (the model does not think)", "thinking")
        out: dict[str, Any] = {"max_tokens": self.max_tokens, "messages": self.hmad_messages()}
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        if self.stop_sequences:
            out["stop"] = self.stop_sequences
        if self.tools:
            out["tools"] = [_tool(i, t) for i, t in enumerate(self.tools)]
        out.update(_choice(self.tool_choice))
        out.update(speculate(self.speculate))
        fmt = (self.output_config or {}).get("format")
        if fmt is not None:
            if (
                not isinstance(fmt, dict)
                or fmt.get("type") != "json_schema"
                or not isinstance(fmt.get("schema"), dict)
            ):
                raise bad_request(
                    "output_config.format must be {type: json_schema, schema: {...}}", "output_config"
                )
            out["json_schema"] = fmt["schema"]
        return out

    def hmad_messages(self) -> list[dict[str, Any]]:
        if self.messages[-1].role == "assistant":
            msg = "a last assistant message (prefill) is not supported: hmad's answer is a turn of its own"
            raise bad_request(msg, "messages")
        turns: list[Any] = [("system", _text(self.system, "system"))] if self.system else []
        for i, m in enumerate(self.messages):
            turns += _turns(i, m)
        return hmad_messages(turns)


def _turns(i: int, m: Message) -> list[Any]:
    """One Anthropic message -> hmad turns: (role, text) tuples, or tool maps."""
    if isinstance(m.content, str):
        return [(m.role, m.content)]
    items: list[tuple[str, Any]] = []  # ("text", str) | ("image", bytes), in order
    calls, results = [], []
    for j, block in enumerate(m.content):
        kind, where = block.get("type"), f"messages[{i}].content[{j}]"
        if kind == "text" and isinstance(block.get("text"), str):
            items.append(("text", block["text"]))
        elif kind == "image":
            images.only_user(m.role, where)
            items.append(("image", _image(block.get("source"), where)))
        elif kind == "tool_use" and m.role == "assistant":
            calls.append({"id": block.get("id"), "name": block.get("name"), "arguments": block.get("input")})
        elif kind == "tool_result" and m.role == "user":
            content = _text(block.get("content") or "", where + ".content")
            results.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": content})
        elif kind in _SKIPPED:
            continue
        elif kind == "document":
            raise bad_request(f"{where}: document blocks are not supported (send their text)", where)
        else:
            raise bad_request(f"{where}: a {m.role} message cannot hold a block of type {kind!r}", where)
    if calls:
        return [{"role": "assistant", "content": images.parts(items), "tool_calls": calls}]
    return [*results, (m.role, images.parts(items))] if items or not results else results


def _image(source: Any, where: str) -> bytes:
    """An image block's source: base64 only (a URL is not fetched, a file id not kept)."""
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        return images.from_base64(source.get("data"), f"{where}.source.data", source.get("media_type"))
    if kind == "url":
        raise bad_request(
            f"{where}.source: {images.REMOTE.replace('a data: URI', 'source type base64')}", where
        )
    msg = f"{where}: image blocks need a source {{type: base64, media_type, data}}, got source type {kind!r}"
    raise bad_request(msg, where)


def _text(content: str | list[Any], where: str) -> str:
    """A str, or text blocks joined by newlines."""
    if isinstance(content, str):
        return content
    texts = []
    for j, block in enumerate(content):
        is_text = isinstance(block, dict) and block.get("type") == "text"
        if not is_text or not isinstance(block.get("text"), str):
            raise bad_request(f"{where}[{j}]: only text blocks are supported here", where)
        texts.append(block["text"])
    return "\n".join(texts)


def _tool(i: int, t: dict[str, Any]) -> dict[str, Any]:
    if t.get("type") not in (None, "custom"):
        msg = f"tools[{i}]: server tools ({t.get('type')!r}) are not supported; custom tools are"
        raise bad_request(msg, "tools")
    schema = t.get("input_schema", {"type": "object", "properties": {}})
    return {"name": t.get("name"), "description": t.get("description", ""), "parameters": schema}


def _choice(choice: dict[str, Any] | None) -> dict[str, Any]:
    if not choice:
        return {}
    kind = choice.get("type")
    named = {"name": choice.get("name")} if kind == "tool" else None
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or named
    if mapped is None:
        raise bad_request(f"tool_choice type must be auto, any, tool or none, got {kind!r}", "tool_choice")
    out: dict[str, Any] = {"tool_choice": mapped}
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out
