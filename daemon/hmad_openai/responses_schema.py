"""OpenAI Responses API request bodies (stateless) and their translation into hmad's ``generate``.

    instructions                          -> the system message (before any system/developer input)
    input: a str                          -> one user message
    input: items
        messages {role system|developer|user|assistant, content a str or input_text/output_text parts}
                                          -> messages (leading system/developer joined)
        a user message's input_image parts {image_url: a data:image/...;base64 URI, detail?}
                                          -> its content as hmad's parts, text and images in order
        function_call {call_id, name, arguments}
                                          -> an assistant turn's tool_calls (consecutive calls: one turn)
        function_call_output {call_id, output}
                                          -> a tool turn
        reasoning                          ignored (the model does not reason)
    max_output_tokens                     -> max_tokens
    temperature, top_p (and hmad's top_k, min_p, repetition_penalty, repeat_last_n, seed)  -> the same
    text.format json_object | json_schema -> json_schema {"type": "object"} | its schema
    tools (type function: name, description, parameters), tool_choice auto|none|required|{type function,
    name}, parallel_tool_calls           -> tools, tool_choice, parallel_tool_calls
    include message.output_text.logprobs, top_logprobs (0..20; either asks for them)
                                          -> logprobs: the output_text's ``logprobs`` (and each text delta
                                          event's), {token, logprob, bytes, top_logprobs} a token
    speculate (a bool; hmad's own)        -> speculate (absent: the daemon's default)

Refused with a 400: previous_response_id and conversation (the gateway keeps no state: send the whole
conversation as input), background, stored prompts (prompt), input_image by file_id (the gateway keeps
no files) or by a remote URL (it fetches nothing: send a data: URI), images in other than user messages,
file inputs, other tool types (web_search, file_search, ...).
Ignored: store, metadata, user, reasoning, truncation, service_tier, safety_identifier, prompt_cache_key,
include (other values), stream_options.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from hmad_openai import images
from hmad_openai.bodies import Body, hmad_messages, sampling_type, speculate
from hmad_openai.errors import bad_request

RENAMES = {"max_output_tokens": "max_tokens"}
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "repeat_last_n", "seed")
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text", "text")
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class ResponsesBody(Body):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: sampling_type("max_tokens") = None  # type: ignore[valid-type]
    temperature: sampling_type("temperature") = None  # type: ignore[valid-type]
    top_p: sampling_type("top_p") = None  # type: ignore[valid-type]
    top_k: sampling_type("top_k") = None  # type: ignore[valid-type]
    min_p: sampling_type("min_p") = None  # type: ignore[valid-type]
    repetition_penalty: sampling_type("repetition_penalty") = None  # type: ignore[valid-type]
    repeat_last_n: sampling_type("repeat_last_n") = None  # type: ignore[valid-type]
    seed: sampling_type("seed") = None  # type: ignore[valid-type]
    stream: bool | None = False
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None
    prompt: Any = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    include: list[str] | None = Field(default=None)
    speculate: Any = None  # bodies.speculate checks it

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ()) or bool(self.top_logprobs)

    def params(self) -> dict[str, Any]:
        """hmaclient ``generate`` keyword arguments, messages and tools included."""
        self._refuse_state()
        out: dict[str, Any] = {"messages": self.hmad_messages()}
        if self.max_output_tokens is not None:
            out["max_tokens"] = self.max_output_tokens
        out |= {k: getattr(self, k) for k in _SAMPLING if getattr(self, k) is not None}
        schema = self._json_schema()
        if schema is not None:
            out["json_schema"] = schema
        if self.tools:
            out["tools"] = [_tool(i, t) for i, t in enumerate(self.tools)]
        if self.tool_choice is not None:
            out["tool_choice"] = _choice(self.tool_choice)
        if self.parallel_tool_calls is not None:
            out["parallel_tool_calls"] = self.parallel_tool_calls
        if self.wants_logprobs:
            out["logprobs"] = self.top_logprobs or 0
        return out | speculate(self.speculate)

    def _refuse_state(self) -> None:
        stateless = "the gateway keeps no responses: send the whole conversation as input"
        if self.previous_response_id:
            raise bad_request(f"previous_response_id is not supported ({stateless})", "previous_response_id")
        if self.conversation is not None:
            raise bad_request(f"conversation is not supported ({stateless})", "conversation")
        if self.background:
            raise bad_request("background responses are not supported", "background")
        if self.prompt is not None:
            raise bad_request(
                "stored prompts (prompt) are not supported; send instructions and input", "prompt"
            )

    def _json_schema(self) -> dict[str, Any] | None:
        fmt = (self.text or {}).get("format")
        if fmt is None or fmt.get("type") == "text":
            return None
        if fmt.get("type") == "json_object":
            return {"type": "object"}
        if fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
            return fmt["schema"]
        raise bad_request(
            "text.format must be text, json_object, or json_schema with a schema", "text.format"
        )

    def hmad_messages(self) -> list[dict[str, Any]]:
        turns: list[Any] = [("system", self.instructions)] if self.instructions else []
        if isinstance(self.input, str):
            return hmad_messages([*turns, ("user", self.input)])
        for i, item in enumerate(self.input):
            turn = _turn(i, item)
            calls = turn.get("tool_calls") if isinstance(turn, dict) else None
            last = turns[-1] if turns else None
            if calls and isinstance(last, dict) and last.get("tool_calls") and not last["content"]:
                last["tool_calls"] += calls  # parallel calls: one assistant turn
            elif turn is not None:
                turns.append(turn)
        return hmad_messages(turns)


def _turn(i: int, item: dict[str, Any]) -> Any:
    """One input item -> a (role, text) turn, a tool map, or None (ignored)."""
    kind = item.get("type", "message")
    if kind == "message":
        role = _ROLES.get(item.get("role"))
        if role is None:
            raise bad_request(
                f"input[{i}].role must be system, developer, user or assistant", f"input[{i}].role"
            )
        return (role, _content(i, item.get("content"), role))
    if kind == "function_call":
        call = {"id": item.get("call_id"), "name": item.get("name"), "arguments": item.get("arguments")}
        return {"role": "assistant", "content": "", "tool_calls": [call]}
    if kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else _content(i, output, "tool")
        return {"role": "tool", "tool_call_id": item.get("call_id"), "content": text}
    if kind == "reasoning":
        return None
    raise bad_request(f"input[{i}]: items of type {kind!r} are not supported", f"input[{i}].type")


def _content(i: int, content: Any, role: str) -> str | list[dict[str, Any]]:
    """An item's content: a str (text parts joined by newlines), or hmad's parts when it holds images."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"input[{i}].content must be a string or a list of parts", f"input[{i}].content")
    items: list[tuple[str, Any]] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            items.append(("text", part["text"]))
        elif kind == "input_image":
            items.append(("image", _image(part, role, f"input[{i}].content[{j}]", f"input[{i}].content")))
        else:
            msg = f"input[{i}].content[{j}]: only text and input_image parts are supported, got {kind!r}"
            raise bad_request(msg, f"input[{i}].content")
    return images.parts(items)


def _image(part: dict[str, Any], role: str, where: str, param: str) -> bytes:
    images.only_user(role, where, param)
    if part.get("file_id") is not None:
        msg = f"{where}: file_id is not supported (the gateway keeps no files): send image_url as a data: URI"
        raise bad_request(msg, param)
    return images.from_url(part.get("image_url"), f"{where}.image_url", param)


def _tool(i: int, t: dict[str, Any]) -> dict[str, Any]:
    if t.get("type") != "function":
        raise bad_request(
            f"tools[{i}]: tools of type {t.get('type')!r} are not supported; functions are", "tools"
        )
    return {k: t[k] for k in ("name", "description", "parameters") if t.get(k) is not None}


def _choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"name": choice["name"]}
    raise bad_request("tool_choice must be auto, none, required or {type: function, name}", "tool_choice")
