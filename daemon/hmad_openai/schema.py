"""OpenAI request bodies (pydantic, strict JSON types) and their translation into hmad's ``generate``.

What maps where:

    messages (system/developer/user/assistant; content a str or a list of text parts)
                                        -> messages (leading system/developer messages joined into one)
    a user message's image_url parts ({type: image_url, image_url: {url: a data:image/...;base64 URI,
    detail?}})                          -> its content as hmad's parts, text and images in order
                                           (``images``; detail is ignored: hmad sizes every image alike)
    prompt (a str, or a list of one str) -> prompt with raw=true (completions send the text as it is)
    max_tokens | max_completion_tokens  -> max_tokens (absent: the daemon's default, sampling.max_tokens)
    temperature, top_p, seed            -> the same (absent: the daemon's defaults)
    stop (a str or a list of str)       -> stop
    response_format json_object         -> json_schema {"type": "object"}
    response_format json_schema         -> json_schema <its schema>
    top_k, min_p, repetition_penalty, repeat_last_n (hmad's, as llama-server takes them) -> the same
    presence_penalty, frequency_penalty, logit_bias ({"<token id>": bias}) -> the same (hmad's own: OpenAI's)
    speculate (a bool; hmad's own, as llama-server and vLLM take extra fields) -> the same (absent: the
                                           daemon's default; false: no speculative decoding for it)
    tools ({type: function, function: {name, description, parameters}}), tool_choice ("auto", "none",
    "required", {type: function, function: {name}}), parallel_tool_calls -> the same (hmaclient.tools
    checks them); assistant messages' tool_calls (content null) and role "tool" messages (tool_call_id,
    name) -> hmad's tool turns
    n (1 to MAX_CHOICES)                -> that many generations of the same prompt (``choice_params``)
    chat logprobs true (+ top_logprobs N, 0..MAX_LOGPROBS; absent: 0) -> logprobs N
    completions logprobs N              -> logprobs N; with echo true also prompt_logprobs N
    completions echo true               -> the prompt's text (and tokens' logprobs) first in the answer;
                                           max_tokens 0 with echo asks hmad for 1 token and drops it

Refused with a 400 that says why (rather than silently ignored, since they change the answer): n out of
range, top_logprobs out of range or without logprobs, the legacy functions / function_call (send tools /
tool_choice), echo with stream, best_of > 1, suffix, token id prompts, content parts other than text and
image_url (input_audio, file), images in other than user messages, remote image URLs (http(s)://: the
gateway fetches nothing; send a data: URI), a data: URI that is not base64 of an image. Fields
this module does not name (user, metadata, store, ...) are ignored.
The sampling fields' types and ranges are hmad's own (hmaclient.sampling, as pydantic types from
hmad.engine.sampling_schema): one out of range is a 400 naming it in the wire's words ("top_p must be a
number in (0, 1], got 1.5").
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, create_model, model_validator

from hmaclient import sampling
from hmad.engine.sampling_schema import field_type
from hmad_openai import images
from hmad_openai.bodies import speculate
from hmad_openai.errors import OpenAIError, bad_request

# OpenAI's names that are hmad's sampling fields (stop, a str or a list, is translated by hand)
_SAMPLING = tuple(name for name in sampling.NAMES if name != "stop")
# Choices per request (n): each is a generation of its own in hmad, counted against its in-flight limits.
MAX_CHOICES = 16


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)


class StreamOptions(_Body):
    include_usage: bool = False


class JsonSchemaSpec(_Body):
    name: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


# The sampling fields with hmad's types and ranges; absent or null: the daemon's default.
_SamplingBody = create_model(
    "_SamplingBody",
    __base__=_Body,
    **{name: (field_type(sampling.BY_NAME[name]) | None, None) for name in _SAMPLING},
)

_MaxTokens = field_type(sampling.BY_NAME["max_tokens"])  # max_completion_tokens is max_tokens


class _Common(_SamplingBody):
    model: str | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    response_format: ResponseFormat | None = None
    speculate: Any = None  # bodies.speculate checks it

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def params(self) -> dict[str, Any]:
        """hmaclient ``generate`` keyword arguments (None values left out), after refusing what hmad cannot
        do."""
        self._refuse_unsupported()
        out = {k: sampling.to_wire(k, getattr(self, k)) for k in _SAMPLING if getattr(self, k) is not None}
        if self.stop is not None:
            out["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        schema = self._json_schema()
        if schema is not None:
            out["json_schema"] = schema
        return out | speculate(self.speculate)

    @property
    def choices(self) -> int:
        """How many choices the answer has (n; absent: 1)."""
        return 1 if self.n is None else self.n

    def choice_params(self, params: dict[str, Any]) -> list[dict[str, Any]]:
        """``params`` for each choice: with a seed, choice i draws with seed + i (mod 2^64), so choices
        differ and each repeats; without, each has fresh entropy."""
        seed = params.get("seed")
        if seed is None:
            return [params] * self.choices
        return [{**params, "seed": (seed + i) % (sampling.MAX_SEED + 1)} for i in range(self.choices)]

    def _refuse_unsupported(self) -> None:
        if not 1 <= self.choices <= MAX_CHOICES:
            msg = f"n must be an integer from 1 to {MAX_CHOICES} (choices per request), got {self.n}"
            raise bad_request(msg, "n")

    def _json_schema(self) -> dict[str, Any] | None:
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return {"type": "object"}
        if fmt.json_schema is None or not fmt.json_schema.schema_:
            raise bad_request("response_format json_schema needs json_schema.schema", "response_format")
        return fmt.json_schema.schema_


class Message(_Body):
    role: str
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def hmad_message(self, i: int) -> dict[str, Any]:
        """hmad's message: roles system/user/assistant/tool, content as text, tool fields as they came
        (the wire's check names any problem in them)."""
        role = "system" if self.role == "developer" else self.role
        if role not in ("system", "user", "assistant", "tool"):
            roles = "system, developer, user, assistant, tool"
            msg = f"messages[{i}].role {self.role!r} is not supported ({roles})"
            raise bad_request(msg, f"messages[{i}].role")
        if role == "assistant" and self.tool_calls:
            text = "" if self.content is None else _content(self.content, i, role)
            return {"role": role, "content": text, "tool_calls": self.tool_calls}
        out: dict[str, Any] = {"role": role, "content": _content(self.content, i, role)}
        if role == "tool":
            if not self.tool_call_id:
                msg = f"messages[{i}].tool_call_id is required in a tool message (the call it answers)"
                raise bad_request(msg, f"messages[{i}].tool_call_id")
            out["tool_call_id"] = self.tool_call_id
            if self.name is not None:
                out["name"] = self.name
        return out


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: _MaxTokens | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None

    @property
    def calls_tools(self) -> bool:
        """Whether the answer may be tool calls (tools given, tool_choice not "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def must_call(self) -> bool:
        """Whether the answer is surely tool calls (tool_choice "required" or a named function)."""
        return bool(self.tools) and self.tool_choice not in (None, "auto", "none")

    def params(self) -> dict[str, Any]:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        top = _count("top_logprobs", self.top_logprobs)
        if top is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        if self.functions or self.function_call:
            msg = "functions and function_call are OpenAI's deprecated form: send tools and tool_choice"
            raise bad_request(msg, "functions" if self.functions else "function_call")
        out = super().params()
        if self.logprobs:
            out["logprobs"] = top or 0
        for name in ("tools", "tool_choice", "parallel_tool_calls"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    def hmad_messages(self) -> list[dict[str, Any]]:
        """hmad's messages (``Message.hmad_message``); leading system turns joined."""
        out: list[dict[str, Any]] = []
        for i, m in enumerate(self.messages):
            message = m.hmad_message(i)
            if message["role"] == "system" and out and all(o["role"] == "system" for o in out):
                out[0]["content"] += "\n\n" + message["content"]
            else:
                out.append(message)
        return out


class CompletionRequest(_Common):
    prompt: Any = None
    echo: bool | None = None
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    _drop: bool = PrivateAttr(False)

    @model_validator(mode="wrap")
    @classmethod
    def _echo_alone(cls, data: Any, handler: Any) -> Any:
        """``max_tokens: 0`` with ``echo: true`` (the answer is the prompt alone, as lm-evaluation-harness
        asks for a prompt's logprobs): hmad generates at least one token, so ask for 1 and drop it."""
        drop = isinstance(data, dict) and data.get("echo") is True and _is_zero(data.get("max_tokens"))
        req = handler({**data, "max_tokens": 1} if drop else data)
        req._drop = drop
        return req

    @property
    def drops_answer(self) -> bool:
        """Whether the generated token is left out of the answer (echo with max_tokens 0)."""
        return self._drop

    def params(self) -> dict[str, Any]:
        n = _count("logprobs", self.logprobs)
        if self.echo and self.stream:
            raise bad_request("echo is not supported with stream: true", "echo")
        if self.best_of not in (None, 1):
            raise bad_request(f"best_of must be 1, got {self.best_of}", "best_of")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        out = super().params()
        if n is not None:
            out["logprobs"] = n
            if self.echo:
                out["prompt_logprobs"] = n
        return out

    def text(self) -> str:
        """The prompt: a str, or a list holding one str."""
        p = self.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            return p[0]
        if isinstance(p, str):
            return p
        if isinstance(p, list) and p and all(isinstance(x, int | list) for x in p):
            raise bad_request("token id prompts are not supported; send the prompt as text", "prompt")
        raise bad_request("prompt must be a string or a list of one string", "prompt")


def _is_zero(v: Any) -> bool:
    return type(v) is int and v == 0


def _count(name: str, v: int | None) -> int | None:
    """A logprobs count (alternatives per token, 0..MAX_LOGPROBS), or a 400 in the wire's words."""
    problem = sampling.logprobs_problem(name, v)
    if problem:
        raise bad_request(problem, name)
    return v


def _content(content: str | list[dict[str, Any]] | None, i: int, role: str) -> str | list[dict[str, Any]]:
    """A message's content: a str (text parts joined by newlines), or hmad's parts when it holds images."""
    if content is None:
        raise bad_request(f"messages[{i}].content is required", f"messages[{i}].content")
    if isinstance(content, str):
        return content
    items: list[tuple[str, Any]] = []
    for j, part in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        if part.get("type") == "text" and isinstance(part.get("text"), str):
            items.append(("text", part["text"]))
        elif part.get("type") == "image_url":
            images.only_user(role, where, f"messages[{i}].content")
            image_url = part.get("image_url")
            url = image_url.get("url") if isinstance(image_url, dict) else image_url
            items.append(("image", images.from_url(url, f"{where}.image_url.url", f"messages[{i}].content")))
        else:
            kind = part.get("type")
            msg = f"{where}: only text and image_url parts are supported, got type {kind!r}"
            raise bad_request(msg, f"messages[{i}].content")
    return images.parts(items)


def parse(model: type[_Body], body: bytes) -> Any:
    """A request body -> the model, or an OpenAIError (400) naming the first bad field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"] if not str(x).startswith(("list[", "str", "dict[", "int")))
        if err["type"] == "json_invalid":
            raise bad_request(f"the body is not valid JSON: {err['msg']}") from None
        if err["type"] == "model_type":
            raise bad_request("the body must be a JSON object") from None
        field = "max_tokens" if loc == "max_completion_tokens" else loc
        if field in sampling.BY_NAME:  # the wire's words, with the name the body used
            text = sampling.problem(field, err["input"]) or f"{field}: {err['msg']}"
            raise OpenAIError(400, text.replace(field, loc, 1), param=loc) from None
        raise OpenAIError(400, f"{loc}: {err['msg']}", param=loc or None) from None
