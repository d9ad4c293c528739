"""The model's own chat template: Jinja from the model file, rendered as transformers' apply_chat_template.

Where it comes from (read with the tokenizer, so a template that does not compile fails the load, naming the
file): a GGUF's ``tokenizer.chat_template``; beside an HF ``tokenizer.json``, ``chat_template.jinja``, else
``tokenizer_config.json``'s ``chat_template`` (a string, or a list of ``{name, template}``: ``tool_use`` is
taken when the request has tools, else ``default``), else ``chat_template.json``. A model file without one
keeps the built-in Gemma turns (``hmad.model.chat``).

The environment is transformers' (``_compile_jinja_template``): jinja2's ``ImmutableSandboxedEnvironment``
with ``trim_blocks``, ``lstrip_blocks`` and the ``loopcontrols`` extension; ``raise_exception(message)``,
``strftime_now(format)``, a ``tojson`` filter that is ``json.dumps`` (``ensure_ascii`` false unless asked,
``indent``, ``separators``, ``sort_keys``: no HTML escaping), ``namespace`` (no underscore names) and
``dict``; ``{% generation %}`` blocks render their body. Variables: ``messages``, ``tools`` (None without),
``add_generation_prompt``, ``bos_token``, ``eos_token`` (the vocabulary's texts; an HF tokenizer_config's own
if it names them), ``documents`` (None) and the request's extra variables. A ``developer`` message is
passed to a template that never mentions that role as ``system``.

Control tokens stay the template's own: before rendering, every control-token text in the request's strings
(message contents, tools, extra variables) is marked with private characters (U+FDD0, U+FDD2 after its first
character, U+FDD1; those characters are dropped from the request's strings first, as transformers'
``sanitize_control_tokens`` does); after rendering, marked text is plain text to the tokenizer, and only
control-token texts elsewhere (the template's markup, ``bos_token``) become :class:`TemplateText` markers.
A leading BOS the template writes is dropped when the tokenizer adds one (as llama.cpp does), so the prompt
has one BOS. Not kept apart (as in transformers): a control-token text a template assembles from two request
strings with nothing between them (e.g. content parts joined), or from a request string and its own text.
Where a message does hold control-token text, a template that measures it (``length``, slices) counts the
markers too.

Untrusted input: the template is run sandboxed; the template, each rendering and every string a template
builds (``+``, ``*``, ``~``, calls, filters, padding widths) are size-limited, and loop items and calls are
budgeted per rendering (MAX_LOOP_ITEMS, MAX_CALLS), which bounds its time. A rendering that fails
(``raise_exception``, a sandbox refusal, a limit, any error in the template) raises
:class:`ChatTemplateError`, a ValueError: that request's ``bad_request``, naming the template's message.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment

from hmad.core.errors import HmadError
from hmad.model.tokenizer import TemplateText, Tokenizer

# Far above real templates (Gemma 3's is about 1.5 KB, the largest tool-calling ones tens of KB).
MAX_TEMPLATE_CHARS = 256 * 1024
# A rendering: the request's text (at most the wire's prompt limit, 1 Mi characters) plus the template's
# markup and the tools' JSON; also the bound on any one string a template builds.
MAX_RENDER_CHARS = 4 * 1024 * 1024
# Loop items and calls (functions, methods, macros) one rendering may take: about a second of Jinja each
# at most (a loop item costs well under a microsecond, a macro call tens); real templates take thousands
# (a turn per message, a few calls per message or tool field).
MAX_LOOP_ITEMS = 2_000_000
MAX_CALLS = 100_000

# tokenizer_config.json / chat_template.json beside an HF tokenizer (Gemma 3's tokenizer_config is ~1 MB).
MAX_JSON_BYTES = 64 * 1024 * 1024

# A control-token text of the request's is written OPEN t JOIN ext CLOSE (Unicode noncharacters): JOIN keeps
# it apart even where a template's string operations cut both ends off.
OPEN, JOIN, CLOSE = "\ufdd0", "\ufdd2", "\ufdd1"
_MARKER = re.compile(f"([{OPEN}{JOIN}{CLOSE}])")
_NON_ASCII = re.compile(f"[^\x00-\x7f{OPEN}{JOIN}{CLOSE}]")
_HELPERS = ("raise_exception", "strftime_now", "namespace", "dict", "range", "cycler", "joiner", "lipsum")
_VARIABLES = ("messages", "tools", "add_generation_prompt")


class ChatTemplateError(HmadError, ValueError):
    """A chat template that cannot compile (at load: the daemon does not start) or failed to render one
    request (a ValueError: that request's bad_request)."""


class ControlTexts:
    """The control-token texts of a vocabulary, found in text leftmost first, the longest at a position
    (one regex over their trie: Gemma 3 has about 6,000, mostly ``<unusedN>``)."""

    def __init__(self, texts: Sequence[str]):
        pattern = _trie_pattern(sorted({t for t in texts if t})) or "(?!)"  # (?!) matches nothing
        self._re = re.compile(pattern)

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> ControlTexts:
        """The tokenizer's, made once per tokenizer (a fraction of a second for Gemma 3's)."""
        made = _CONTROLS.get(tokenizer)
        if made is None:
            made = _CONTROLS[tokenizer] = cls(tokenizer.control_texts())
        return made

    def spans(self, text: str) -> Iterator[tuple[int, int]]:
        """(start, end) of each control-token text in ``text``, in order, not overlapping."""
        return (m.span() for m in self._re.finditer(text))

    def wrap(self, text: str) -> str:
        """``text`` without marker characters, each control-token text in it marked: OPEN, its first
        character, JOIN, the rest, CLOSE."""
        text = _MARKER.sub("", text)
        out, pos = [], 0
        for start, end in self.spans(text):
            join = JOIN if end - start > 1 else ""
            out += [text[pos:start], OPEN, text[start], join, text[start + 1 : end], CLOSE]
            pos = end
        return "".join(out) + text[pos:]

    def wrap_all(self, value: Any) -> Any:
        """``wrap`` on every string of a request's value: dict keys too (a JSON Schema's property names are
        rendered; a key a template looks up by name holds no control-token text, so it is unchanged)."""
        if isinstance(value, str):
            return self.wrap(value)
        if isinstance(value, Mapping):
            return {self.wrap_all(k): self.wrap_all(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.wrap_all(v) for v in value]
        return value

    def pieces(self, rendered: str) -> list[tuple[str, bool]]:
        """The rendered text as (text, is_control_token), markers dropped: text just after OPEN, just
        before CLOSE or beside JOIN is the request's, plain text (also where a template cut markers off);
        control-token texts elsewhere are the template's, control tokens."""
        parts = _MARKER.split(rendered)  # text, marker, text, marker, ..., text
        out: list[tuple[str, bool]] = []
        for i in range(0, len(parts), 2):
            text = parts[i]
            before, after = parts[i - 1] if i else "", parts[i + 1] if i + 1 < len(parts) else ""
            if before in (OPEN, JOIN) or after in (JOIN, CLOSE):
                out.append((text, False))
                continue
            pos = 0
            for m in self._re.finditer(text):
                out += [(text[pos : m.start()], False), (m.group(), True)]
                pos = m.end()
            out.append((text[pos:], False))
        return [p for p in out if p[0]]


class ChatTemplate:
    """One model's chat template(s), compiled, and the vocabulary facts a rendering needs."""

    def __init__(
        self,
        source: str | Mapping[str, str],
        tokenizer: Tokenizer,
        origin: str,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ):
        """``source``: the template, or named templates; ``origin`` names where it came from (errors say
        it). Raises ChatTemplateError if a template is too long or does not compile."""
        named = {"default": source} if isinstance(source, str) else dict(source)
        self.origin = origin
        self._env = _environment()
        self._templates = {name: self._compile(name, text) for name, text in named.items()}
        self._sources = named
        self._controls = ControlTexts.of(tokenizer)
        self.bos_token = bos_token if bos_token is not None else _text_of(tokenizer, tokenizer.bos_id)
        self.eos_token = eos_token if eos_token is not None else _text_of(tokenizer, tokenizer.eos_id)
        self._adds_bos = tokenizer.bos_id is not None and bool(tokenizer.encode("", add_bos=True))

    def _compile(self, name: str, text: Any) -> jinja2.Template:
        where = f"the chat template in {self.origin}" if name == "default" else f"{name!r} in {self.origin}"
        if not isinstance(text, str):
            raise ChatTemplateError(f"{where} is not a string (got {type(text).__name__})")
        if len(text) > MAX_TEMPLATE_CHARS:
            raise ChatTemplateError(f"{where} has {len(text)} characters; the limit is {MAX_TEMPLATE_CHARS}")
        try:
            return self._env.from_string(text)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"{where} does not compile: line {e.lineno}: {e.message}") from e
        except Exception as e:  # noqa: BLE001 - anything the parser raises is the file's problem
            raise ChatTemplateError(f"{where} does not compile: {type(e).__name__}: {e}") from e

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Any] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> TemplateText:
        """The prompt for ``messages`` (``{role, content, ...}``), its control tokens the template's own.

        Raises ChatTemplateError when the template refuses the request or fails."""
        name = "tool_use" if tools and "tool_use" in self._templates else "default"
        template = self._templates.get(name)
        if template is None:
            have = sorted(self._templates)
            raise ChatTemplateError(f"{self.origin} has no default chat template (it has: {have})")
        clash = sorted(set(extra or {}) & {*_HELPERS, *_VARIABLES})
        if clash:
            raise ChatTemplateError(f"template variables {clash} are set by hmad, not by the request")
        wrap = self._controls.wrap_all
        context = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "documents": None,  # transformers passes it; a request may set it among its extra variables
            **wrap(dict(extra or {})),
            "messages": wrap(self._roles(name, messages)),
            "tools": None if tools is None else wrap(list(tools)),
            "add_generation_prompt": bool(add_generation_prompt),
        }
        rendered = self._run(template, context)
        pieces = self._controls.pieces(rendered)
        if self._adds_bos and pieces and pieces[0] == (self.bos_token, True):
            pieces = pieces[1:]  # the tokenizer adds it (llama.cpp drops a template's leading BOS too)
        return TemplateText(pieces)

    def _roles(self, name: str, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """Messages as plain dicts without None values; ``developer`` as ``system`` where the template
        never names the developer role."""
        knows_developer = "developer" in self._sources[name]
        out = []
        for m in messages:
            if not isinstance(m, Mapping):
                raise ChatTemplateError(f"a message is a map, not {type(m).__name__}")
            m = {k: v for k, v in m.items() if v is not None}
            if m.get("role") == "developer" and not knows_developer:
                m["role"] = "system"
            out.append(m)
        return out

    def _run(self, template: jinja2.Template, context: dict[str, Any]) -> str:
        parts, size = [], 0
        budget = _BUDGET.set([MAX_LOOP_ITEMS, MAX_CALLS])
        try:
            for part in template.generate(**context):
                size += len(part)
                if size > MAX_RENDER_CHARS:
                    raise ChatTemplateError(f"the rendering is over {MAX_RENDER_CHARS} characters")
                parts.append(part)
        except ChatTemplateError as e:
            raise ChatTemplateError(f"the model's chat template ({self.origin}): {e}") from e
        except Exception as e:  # noqa: BLE001 - a template is untrusted code: any failure is this request's
            what = str(e) if isinstance(e, jinja2.TemplateError) else f"{type(e).__name__}: {e}"
            raise ChatTemplateError(f"the model's chat template ({self.origin}) failed: {what}") from e
        finally:
            _BUDGET.reset(budget)
        return "".join(parts)


_CONTROLS: weakref.WeakKeyDictionary[Tokenizer, ControlTexts] = weakref.WeakKeyDictionary()


def _trie_pattern(words: Sequence[str]) -> str:
    """A regex matching any of ``words``, longest first at a position: their trie, each node's optional end
    after its longer continuations."""
    trie: dict[str, dict] = {}
    for word in words:
        node = trie
        for c in word:
            node = node.setdefault(c, {})
        node[""] = {}

    def emit(node: dict[str, dict]) -> str:
        alts = [re.escape(c) + emit(child) for c, child in node.items() if c]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else f"(?:{'|'.join(alts)})"
        if "" in node:  # a word ends here too: try the longer ones first
            body = f"(?:{body})?" if len(alts) == 1 else f"{body}?"
        return body

    return emit(trie)


def _text_of(tokenizer: Tokenizer, token_id: int | None) -> str:
    return "" if token_id is None else tokenizer.decode([token_id], skip_special=False)


# --------------------------------------------------------------------------------------------------
# The sandbox
# --------------------------------------------------------------------------------------------------


class _Generation(jinja2.ext.Extension):
    """transformers' ``{% generation %}...{% endgeneration %}`` (assistant-token masks): the body, as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


class _CodeGenerator(CodeGenerator):
    """Jinja's code generator with every ``~`` concatenation's result checked (``environment.bounded``)
    and every ``for`` loop's items counted (``environment.counted``)."""

    def visit_Concat(self, node, frame):
        self.write("environment.bounded(")
        super().visit_Concat(node, frame)
        self.write(")")

    def visit_For(self, node, frame):
        counted = jinja2.nodes.EnvironmentAttribute("counted").set_lineno(node.lineno)
        node.iter = jinja2.nodes.Call(counted, [node.iter], [], None, None).set_lineno(node.lineno)
        super().visit_For(node, frame)


# The rendering under way: [loop items left, calls left] (``ChatTemplate._run`` sets it)
_BUDGET: contextvars.ContextVar[list[int]] = contextvars.ContextVar("hmad_chat_template_budget")


def _step(kind: int) -> None:
    """One loop item (kind 0) or call (kind 1) of the rendering under way."""
    left = _BUDGET.get(None)
    if left is not None:
        left[kind] -= 1
        if left[kind] < 0:
            what = ("loop items", MAX_LOOP_ITEMS) if kind == 0 else ("calls", MAX_CALLS)
            raise ChatTemplateError(f"the rendering took over {what[1]} {what[0]}")


class _Sandbox(ImmutableSandboxedEnvironment):
    """The sandbox with every value a template builds bounded: ``+``, ``*``, ``**``, ``~``, calls (methods,
    macros) and filters (``_bounded_filter``). One rendering cannot allocate far past MAX_RENDER_CHARS."""

    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset({"+", "*", "**"})

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    _check_size(len(seq) * n)
        if operator == "**" and isinstance(right, int) and abs(right) > 4096:
            raise ChatTemplateError(f"an exponent of {right} is over the template's limits")
        return self.bounded(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's own signature
        _step(1)
        _check_arguments(args, kwargs)
        owner = getattr(__obj, "__self__", None)
        if getattr(__obj, "__name__", None) == "replace" and isinstance(owner, str):
            _check_replace(owner, *args[:2])
        return __self.bounded(super().call(__context, __obj, *args, **kwargs))

    @staticmethod
    def counted(iterable: Any) -> Iterator[Any]:
        for item in iterable:
            _step(0)
            yield item

    @staticmethod
    def bounded(value: Any) -> Any:
        if isinstance(value, (str, list, tuple)):
            _check_size(len(value))
        return value


def _bounded_filter(f: Callable) -> Callable:
    """A filter with its int arguments (widths) and its result checked (jinja's pass_* marks kept)."""

    @functools.wraps(f)
    def bounded(*args, **kwargs):
        _check_arguments(args, kwargs)
        return _Sandbox.bounded(f(*args, **kwargs))

    return bounded


def _check_arguments(args: tuple, kwargs: dict) -> None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and value > MAX_RENDER_CHARS:
            raise ChatTemplateError(f"an argument of {value} is over the template's limits")


def _check_size(n: int) -> None:
    if n > MAX_RENDER_CHARS:
        raise ChatTemplateError(f"a value of {n} characters or items is over the template's limit")


def _check_replace(text: Any, old: Any = None, new: Any = None) -> None:
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
        count = text.count(old) if old else len(text) + 1
        _check_size(len(text) + count * (len(new) - len(old)))


@jinja2.pass_eval_context
def _replace_filter(eval_ctx, s, old, new, count=None):
    _check_replace(str(s), str(old), str(new))
    return jinja2.filters.do_replace(eval_ctx, s, old, new, count)


def _raise_exception(message: Any) -> None:
    raise jinja2.TemplateError(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False
) -> str:
    """transformers' tojson (json.dumps); ``ensure_ascii`` escapes as json does, but never the markers,
    so a wrapped control-token text stays wrapped."""
    text = json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)
    return _NON_ASCII.sub(_json_escape, text) if ensure_ascii else text


def _json_escape(m: re.Match) -> str:
    c = ord(m.group())
    if c < 0x10000:
        return f"\\u{c:04x}"
    c -= 0x10000
    return f"\\u{0xD800 | (c >> 10):04x}\\u{0xDC00 | (c & 0x3FF):04x}"


class _Namespace(jinja2.utils.Namespace):
    """``namespace`` that refuses underscore names (transformers' TemplateNamespace)."""

    def __init__(*args, **kwargs):  # noqa: N805 - jinja's Namespace takes self from args the same way
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")


class _Dict:
    """``dict(...)`` and ``dict.fromkeys`` without the type itself (transformers' TemplateDict)."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _environment() -> jinja2.Environment:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters.update(tojson=_tojson, replace=_replace_filter)
    env.filters = {name: _bounded_filter(f) for name, f in env.filters.items()}
    env.globals.update(
        raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace, dict=_Dict()
    )
    return env


# --------------------------------------------------------------------------------------------------
# Reading one from a model file
# --------------------------------------------------------------------------------------------------


def from_gguf_metadata(meta: Mapping[str, Any], tokenizer: Tokenizer) -> ChatTemplate | None:
    """The GGUF's ``tokenizer.chat_template``, compiled, or None without one."""
    source = meta.get("tokenizer.chat_template")
    if isinstance(source, bytes):
        source = source.decode("utf-8", errors="replace")
    if source is None or source == "":
        return None
    return ChatTemplate(source, tokenizer, "the GGUF's tokenizer.chat_template")


def from_hf_directory(directory: str | Path, tokenizer: Tokenizer) -> ChatTemplate | None:
    """The chat template beside an HF ``tokenizer.json`` (see the module docstring), compiled, or None."""
    directory = Path(directory)
    config = _read_json(directory / "tokenizer_config.json")
    tokens = {k: _token_content(config.get(k)) for k in ("bos_token", "eos_token")}
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        source, origin = _read_text(jinja_file), str(jinja_file)
    elif config.get("chat_template") is not None:
        source, origin = config["chat_template"], f"{directory / 'tokenizer_config.json'}: chat_template"
        if isinstance(source, list):  # [{name, template}]
            source = {str(t.get("name")): t.get("template") for t in source if isinstance(t, dict)}
    elif (directory / "chat_template.json").is_file():
        path = directory / "chat_template.json"
        source, origin = _read_json(path).get("chat_template"), str(path)
    else:
        return None
    if not isinstance(source, (str, dict)):
        raise ChatTemplateError(f"{origin} is not a template (got {type(source).__name__})")
    return ChatTemplate(source, tokenizer, origin, **tokens)


def choose(setting: str, tokenizer: Tokenizer) -> ChatTemplate | None:
    """The template chats are formatted with, by a ``chat_template`` setting: ``auto``, the model file's own
    (None without one: the built-in Gemma turns); ``builtin``, None; else the path of a Jinja file, compiled
    here. Raises ChatTemplateError naming the file."""
    if setting == "auto":
        return tokenizer.chat_template
    if setting == "builtin":
        return None
    path = Path(setting).expanduser()
    try:
        source = _read_text(path)
    except (OSError, UnicodeDecodeError) as e:
        raise ChatTemplateError(f"cannot read the chat template {str(path)!r}: {e}") from e
    return ChatTemplate(source, tokenizer, str(path))


def _read_text(path: Path, limit: int = 4 * MAX_TEMPLATE_CHARS) -> str:
    """The file's text; ``limit`` in bytes (a template's: far past its limit in characters)."""
    if path.stat().st_size > limit:
        raise ChatTemplateError(f"{path} has {path.stat().st_size} bytes; the limit is {limit}")
    return path.read_text(encoding="utf-8")


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON file beside the tokenizer (tokenizer_config.json lists every added token: Gemma 3's ~1 MB)."""
    if not path.is_file():
        return {}
    try:
        value = json.loads(_read_text(path, MAX_JSON_BYTES))
    except (ValueError, UnicodeDecodeError) as e:
        raise ChatTemplateError(f"{path} is not JSON: {e}") from e
    return value if isinstance(value, dict) else {}


def _token_content(value: Any) -> str | None:
    """A tokenizer_config token: a string, or an AddedToken map with ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
