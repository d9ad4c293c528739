"""Ollama request bodies and their translation into hmad's ``generate``.

    messages (system/user/assistant, content a str)  -> messages (leading system turns joined)
    a user message's images (base64 strings)          -> its content as hmad's parts: the images, then the
                                                      text
    prompt (+ system; raw)                            -> prompt, or [system, user] messages; raw -> raw
    images (base64 strings; not with raw)             -> images (the user turn's, before the prompt's text)
    format "json" | a JSON Schema                     -> json_schema {"type": "object"} | the schema
    stream (absent or null: true, as Ollama)          -> NDJSON pieces, else one object
    options:
        temperature, top_p, top_k, min_p, seed, stop  -> the same (seed < 0: fresh entropy, as Ollama's -1)
        num_predict                                   -> max_tokens (< 0: until the context is full)
        repeat_penalty, repeat_last_n                 -> repetition_penalty, repeat_last_n (-1: the context)
        presence_penalty, frequency_penalty           -> the same
        speculate (a bool; hmad's own)                -> speculate (absent: the daemon's default)
        typical_p, tfs_z (not 1), mirostat (not 0)     refused: they change the answer and hmad has no such
                                                      sampler
        anything else (num_ctx, num_gpu, num_thread, num_batch, num_keep, use_mmap, penalize_newline, ...)
                                                      ignored, as Ollama ignores an option it does not know:
                                                      they say how to run the model, not what to answer
    tools (type function)                             -> tools (tool_choice auto: Ollama has no choice)
    assistant tool_calls {function: {name, arguments}} -> the turn's tool_calls (ids made up where absent)
    tool messages (content, tool_name)                -> tool turns answering the oldest open call of that
                                                      name (of any name without tool_name)
    logprobs true (+ top_logprobs 0..20)              -> logprobs (top_logprobs alternatives a token): each
                                                      line's ``logprobs`` are its tokens' {token, logprob,
                                                      bytes, top_logprobs}; top_logprobs without logprobs
                                                      is ignored, as Ollama ignores it

Refused with a 400: images in other than user messages or with raw (they need the chat template), think
(the model does not think), suffix, template, context (send the conversation as /api/chat messages),
system with raw. Ignored: keep_alive (hmad's config has its own: models.keep_alive_s). The model's name
switches hmad to that model when it is on hmad's disk (see ``ollama_api``).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from hmaclient import sampling
from hmad_openai import images as _images
from hmad_openai.bodies import Body, checked, hmad_messages, speculate
from hmad_openai.errors import bad_request

# Ollama's option names of hmad's sampling fields.
_OPTIONS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "num_predict": "max_tokens",
    "stop": "stop",
    "repeat_penalty": "repetition_penalty",
    "repeat_last_n": "repeat_last_n",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
}
# Options that change the answer, with the value that leaves them off; hmad refuses any other value.
_OFF = {"typical_p": 1.0, "tfs_z": 1.0, "mirostat": 0}
# Ollama's "no limit" (negative) of these -> the largest value hmad takes (its context bounds it).
_UNBOUNDED = {"num_predict", "repeat_last_n"}


class Message(Body):
    role: str
    content: str | None = None
    images: list[Any] | None = None
    tool_calls: list[Any] | None = None
    tool_name: str | None = None
    thinking: str | None = None


class _Common(Body):
    model: str = Field(min_length=1)
    stream: bool | None = True
    options: dict[str, Any] | None = None
    format: str | dict[str, Any] | None = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    keep_alive: Any = None

    @property
    def streams(self) -> bool:
        return self.stream is not False

    def params(self) -> dict[str, Any]:
        """hmaclient ``generate`` keyword arguments from options and format, after refusing what hmad
        cannot do."""
        if self.think not in (None, False):
            raise bad_request(f'"{self.model}" does not support thinking', "think")
        out = options_params(self.options or {})
        if self.logprobs:
            out["logprobs"] = self.top_logprobs or 0
        if self.format == "json":
            out["json_schema"] = {"type": "object"}
        elif isinstance(self.format, dict):
            out["json_schema"] = self.format
        elif self.format:
            raise bad_request(f'invalid format {self.format!r}: send "json" or a JSON Schema', "format")
        return out


def options_params(options: dict[str, Any]) -> dict[str, Any]:
    """Ollama's ``options`` -> hmad's sampling fields (a value out of hmad's range: a 400 naming the
    option)."""
    out: dict[str, Any] = {}
    for name, value in options.items():
        hmad = _OPTIONS.get(name)
        if value is None:
            continue
        if name == "speculate":
            out |= speculate(value, "options.speculate")
        elif hmad in sampling.BY_NAME:
            out[hmad] = _option(name, hmad, value)
        elif name in _OFF and value != _OFF[name]:
            msg = f"option {name} is not supported (hmad has no such sampler); leave it out"
            raise bad_request(msg, name)
    return out


def _option(name: str, hmad: str, value: Any) -> Any:
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    if name in _UNBOUNDED and is_number and value < 0:
        return sampling.MAX_TOKENS_LIMIT
    if name == "seed" and is_number and value < 0:
        return None
    if name == "stop" and isinstance(value, str):
        value = [value]
    return checked(name, hmad, value)


class ChatBody(_Common):
    messages: list[Message] = Field(default_factory=list)
    tools: list[dict[str, Any]] | None = None

    def params(self) -> dict[str, Any]:
        out = super().params()
        if self.tools:
            out["tools"] = [_tool(i, t) for i, t in enumerate(self.tools)]
        return out

    def hmad_messages(self) -> list[dict[str, Any]]:
        turns: list[Any] = []
        open_calls: list[dict[str, Any]] = []  # calls not yet answered, oldest first
        for i, m in enumerate(self.messages):
            if m.images:
                _images.only_user(m.role, f"messages[{i}].images")
                turns.append(("user", _user_parts(m.images, m.content or "", f"messages[{i}].images")))
            elif m.role == "tool":
                turns.append(_tool_result(i, m, open_calls))
            elif m.role == "assistant" and m.tool_calls:
                calls = [_call(i, j, c) for j, c in enumerate(m.tool_calls)]
                open_calls += calls
                turns.append({"role": "assistant", "content": m.content or "", "tool_calls": calls})
            elif m.role in ("system", "user", "assistant"):
                turns.append((m.role, m.content or ""))
            else:
                msg = f"messages[{i}].role {m.role!r} is not supported (system, user, assistant, tool)"
                raise bad_request(msg, f"messages[{i}].role")
        return hmad_messages(turns)


def _user_parts(images: list[Any], text: str, where: str) -> list[dict[str, Any]]:
    """A user turn's content with images: the images (base64), then the text (if any)."""
    items = [("image", _images.from_base64(x, f"{where}[{j}]")) for j, x in enumerate(images)]
    return _images.parts([*items, ("text", text)] if text else items)


def _tool(i: int, t: dict[str, Any]) -> dict[str, Any]:
    f = t.get("function") if t.get("type", "function") == "function" else None
    if not isinstance(f, dict):
        raise bad_request(f"tools[{i}] must be {{type: function, function: {{name, parameters}}}}", "tools")
    return {k: f[k] for k in ("name", "description", "parameters") if f.get(k) is not None}


def _call(i: int, j: int, c: Any) -> dict[str, Any]:
    """An Ollama tool call ({function: {name, arguments}}, an id where the client kept one) -> hmad's."""
    f = c.get("function") if isinstance(c, dict) else None
    if not isinstance(f, dict):
        where = f"messages[{i}].tool_calls[{j}]"
        raise bad_request(f"{where} must be {{function: {{name, arguments}}}}", where)
    return {"id": c.get("id") or f"call_{i}_{j}", "name": f.get("name"), "arguments": f.get("arguments", {})}


def _tool_result(i: int, m: Message, open_calls: list[dict[str, Any]]) -> dict[str, Any]:
    """A tool message -> hmad's tool turn, answering the oldest open call of its tool_name (any open call
    without one)."""
    match = [c for c in open_calls if m.tool_name in (None, c["name"])]
    if not match:
        raise bad_request(f"messages[{i}]: a tool result with no tool call before it to answer", "messages")
    open_calls.remove(match[0])
    out = {"role": "tool", "tool_call_id": match[0]["id"], "content": m.content or ""}
    return {**out, "name": match[0]["name"]} if match[0]["name"] else out


class GenerateBody(_Common):
    prompt: str | None = None
    system: str | None = None
    raw: bool | None = False
    suffix: str | None = None
    template: str | None = None
    context: list[Any] | None = None
    images: list[Any] | None = None

    def inputs(self) -> dict[str, Any]:
        """hmaclient's prompt or messages for this body."""
        for name in ("suffix", "template", "context"):
            if getattr(self, name):
                why = "send the conversation as /api/chat messages" if name == "context" else "leave it out"
                raise bad_request(f"{name} is not supported by hmad; {why}", name)
        if self.raw:
            if self.system:
                raise bad_request("system has no place in a raw prompt: write it into the prompt", "system")
            if self.images:
                raise bad_request("images need the chat template: leave out raw", "images")
            return {"prompt": self.prompt or "", "raw": True}
        if self.system:
            user = _user_parts(self.images, self.prompt or "", "images") if self.images else self.prompt or ""
            return {"messages": hmad_messages([("system", self.system), ("user", user)])}
        if self.images:
            images = [_images.from_base64(x, f"images[{j}]") for j, x in enumerate(self.images)]
            return {"prompt": self.prompt or "", "images": images}
        return {"prompt": self.prompt or ""}


class ShowBody(Body):
    model: str | None = None
    name: str | None = None  # older clients' name of the field
    verbose: bool | None = None
