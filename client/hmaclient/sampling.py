"""The sampling fields of a ``generate``: one definition of each (name, type, bounds, default, help).

Everyone reads this table, so a bound or a default is written once: the wire check
(``hmaclient.protocol``), the flags of ``hmactl query`` and ``hmad generate`` (:func:`add_flags`), the
daemon's engine (``hmad.engine.sampling.SamplingParams``, validated there with pydantic), its YAML config's
``sampling:`` section and the OpenAI gateway's ranges. Standard library only: the client distribution
needs nothing but pyzmq and msgpack.

Two values per field, each stated once:

- ``default``: what a request that leaves the field out gets (the daemon's built-in ``sampling:`` config,
  which a YAML file may change; what ``hmad generate`` uses without flags);
- ``off``: a bare sampler's value (the engine's ``SamplingParams()``): the knob does nothing. max_tokens
  has no off (its default), and repeat_last_n keeps its window (the penalty is off at 1).

Types are strict: an ``int`` field takes ints only, a ``real`` field ints or floats (finite); bools are
neither. ``None`` (nil, null, absent) means "the default"; for ``seed`` the default itself is None: fresh
entropy per request.

``logit_bias`` (kind "bias") is a map of token id -> bias, OpenAI's: at most :data:`MAX_LOGIT_BIAS_ENTRIES`
entries, each id an int or its decimal string (JSON and msgpack maps of the wire have string keys: send
``{"1234": -100}``), each bias a number in [-100, 100]; kept as ``{int: float}``. The engine adds it, with
``presence_penalty`` and ``frequency_penalty`` (OpenAI's, over the tokens generated so far in the request,
not the prompt's), to the logits before anything else samples them: ``logit[j] += bias[j] -
presence_penalty * (count[j] > 0) - frequency_penalty * count[j]``. An id outside the model's vocabulary is
refused by the daemon, which knows it.

``logprobs`` is not a sampling field (it changes no token, and has no default in the daemon's config): an
int from 0 to :data:`MAX_LOGPROBS`, how many most likely alternatives each generated token reports with its
own logprob (0: its own only); absent or nil: none. ``prompt_logprobs`` likewise for each prompt token
(given the tokens before it). :func:`logprobs_problem` is their check.
"""

from __future__ import annotations

import argparse
import math
import types
from dataclasses import dataclass, replace
from typing import Any

MAX_TOKENS_LIMIT = 1_000_000  # max_tokens and repeat_last_n
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0
MAX_TOP_K = 2**31 - 1
MAX_SEED = 2**64 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_PENALTY = 2.0  # presence_penalty, frequency_penalty: OpenAI's range
MAX_LOGIT_BIAS = 100.0  # a logit_bias entry's bias: OpenAI's range
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit
MAX_TOKEN_ID = 2**31 - 1  # a logit_bias id on the wire (the daemon checks it against its vocabulary)
MAX_LOGPROBS = 20  # alternatives per token: OpenAI's top_logprobs limit
NO_BIAS = types.MappingProxyType({})  # logit_bias's default and off: no entry (read-only: shared)


@dataclass(frozen=True)
class SamplingField:
    """One field. ``kind``: "int", "real" (stored as float), "strings" (a list of str, stop) or "bias" (a
    map of token id -> number, logit_bias).

    int / real: ``lo`` <= value <= ``hi`` (``lo_open``: lo < value). strings: at most ``hi`` strings of 1 to
    ``MAX_STOP_CHARS`` characters. bias: at most ``MAX_LOGIT_BIAS_ENTRIES`` entries, each id an int in [0,
    ``MAX_TOKEN_ID``] or its decimal string, each value a number in [``lo``, ``hi``]. ``nullable``: None is
    a value of its own (seed: fresh entropy).
    """

    name: str
    kind: str
    lo: float
    hi: float
    default: Any
    off: Any
    help: str
    lo_open: bool = False
    nullable: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


# Gemma 3's recommended sampling is the default: temperature 1.0, top_k 64, top_p 0.95, min_p 0.
# max_tokens: 512, the daemon's default since its config existed (the answers its clients already get).
FIELDS: tuple[SamplingField, ...] = (
    SamplingField("max_tokens", "int", 1, MAX_TOKENS_LIMIT, 512, 512, "most tokens to generate"),
    SamplingField("temperature", "real", 0.0, MAX_TEMPERATURE, 1.0, 1.0, "0 = greedy"),
    SamplingField("top_k", "int", 0, MAX_TOP_K, 64, 0, "keep the k most likely tokens (0 = off)"),
    SamplingField("top_p", "real", 0.0, 1.0, 0.95, 1.0, "nucleus: the smallest set of this mass (1 = off)",
                  lo_open=True),
    SamplingField("min_p", "real", 0.0, 1.0, 0.0, 0.0, "drop tokens under min_p x the top one's (0 = off)"),
    SamplingField("repetition_penalty", "real", 0.0, MAX_REPETITION_PENALTY, 1.0, 1.0,
                  "divide repeated tokens' logits by this (1 = off)", lo_open=True),
    SamplingField("repeat_last_n", "int", 0, MAX_TOKENS_LIMIT, 64, 64,
                  "tokens the penalty looks back over (0 = off)"),
    SamplingField("seed", "int", 0, MAX_SEED, None, None, "random seed: the same seed gives the same answer",
                  nullable=True),
    SamplingField("stop", "strings", 1, MAX_STOP_STRINGS, (), (),
                  "stop before this string, which is never sent (repeatable)"),
    SamplingField("presence_penalty", "real", -MAX_PENALTY, MAX_PENALTY, 0.0, 0.0,
                  "subtracted from the logit of each token generated so far (0 = off)"),
    SamplingField("frequency_penalty", "real", -MAX_PENALTY, MAX_PENALTY, 0.0, 0.0,
                  "subtracted from each token's logit once per time it was generated so far (0 = off)"),
    SamplingField("logit_bias", "bias", -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS, NO_BIAS, NO_BIAS,
                  "added to each given token's logit before sampling (OpenAI's)"),
)  # fmt: skip
BY_NAME: dict[str, SamplingField] = {f.name: f for f in FIELDS}
NAMES: tuple[str, ...] = tuple(BY_NAME)
DEFAULTS: dict[str, Any] = {f.name: f.default for f in FIELDS}
OFF: dict[str, Any] = {f.name: f.off for f in FIELDS}

# hmactl's max_tokens when --max-tokens is not given (query, chat): on a CPU an answer this long takes
# seconds (README's CPU-only figures), and a base model, which rarely stops by itself, is cut there; on a
# GPU or an NPU the daemon's default.
CPU_MAX_TOKENS = 64
CLIENT_HELP = {"max_tokens": f"most tokens to generate ({CPU_MAX_TOKENS} when the model runs on a CPU)"}


def client_max_tokens(on_cpu: bool) -> int | None:
    """hmactl's max_tokens when its flag is not given: :data:`CPU_MAX_TOKENS` for a model that runs on a
    CPU, else None (the field left out: the daemon's default)."""
    return CPU_MAX_TOKENS if on_cpu else None


def bound(x: float) -> str:
    """A bound as people read it: 2^64-1 rather than its 20 digits, 0.95 rather than 0.9500."""
    if isinstance(x, int) and x >= 2**31 - 1 and (x + 1) & x == 0:
        return f"2^{(x + 1).bit_length() - 1}-1"
    return f"{x:g}" if isinstance(x, float) else str(x)


def describe_range(kind: str, lo: float | None, hi: float | None, lo_open: bool = False) -> str:
    """What an int or real field allows, as error messages say it: "an integer from 1 to 1024", "a number
    in (0, 1]", "a number >= 0". The config's messages use it too."""
    if kind == "int":
        if hi is None:
            return f"an integer >= {bound(lo)}" if lo is not None else "an integer"
        return f"an integer from {bound(lo)} to {bound(hi)}"
    if lo is not None and hi is not None:
        return f"a number in {'(' if lo_open else '['}{bound(lo)}, {bound(hi)}]"
    if lo is not None:
        return f"a number {'>' if lo_open else '>='} {bound(lo)}"
    return "a number"


def describe(f: SamplingField) -> str:
    """What field ``f`` allows ("an integer from 0 to 2^64-1, or null (fresh entropy)")."""
    if f.kind == "strings":
        return f"a list of at most {f.hi} strings of 1 to {MAX_STOP_CHARS} characters"
    if f.kind == "bias":
        values = f"numbers in [{bound(f.lo)}, {bound(f.hi)}]"
        return f"a map of at most {MAX_LOGIT_BIAS_ENTRIES} token ids (decimal strings) to {values}"
    text = describe_range(f.kind, f.lo, f.hi, f.lo_open)
    return text + ", or null (fresh entropy)" if f.nullable else text


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def allows(f: SamplingField, v: Any) -> bool:
    """Whether ``v`` is a value of ``f`` (None only when the field is nullable)."""
    if v is None:
        return f.nullable
    if f.kind == "strings":
        return (
            isinstance(v, list | tuple)
            and len(v) <= f.hi
            and all(isinstance(s, str) and 1 <= len(s) <= MAX_STOP_CHARS for s in v)
        )
    if f.kind == "bias":
        return _bias_problem(f, v) is None
    return _in_range(f, v)


def _in_range(f: SamplingField, v: Any) -> bool:
    real = _is_int(v) or (isinstance(v, float) and math.isfinite(v))
    return (_is_int(v) if f.kind == "int" else real) and (f.lo < v if f.lo_open else f.lo <= v) and v <= f.hi


def token_id(key: Any) -> int | None:
    """A logit_bias key as a token id: an int in [0, MAX_TOKEN_ID] or its decimal string ("1234", no sign,
    spaces or leading zeros); None when it is neither."""
    if _is_int(key):
        return key if 0 <= key <= MAX_TOKEN_ID else None
    if not isinstance(key, str) or not key.isascii() or not key.isdigit() or len(key) > 10:
        return None
    if len(key) > 1 and key[0] == "0":
        return None
    n = int(key)
    return n if n <= MAX_TOKEN_ID else None


def _bias_problem(f: SamplingField, v: Any) -> str | None:
    """What is wrong with a logit_bias map (None: nothing), in the words of :func:`problem`."""
    if not isinstance(v, dict | types.MappingProxyType):
        return f"{f.name} must be {describe(f)}, got {_show(v)}"
    if len(v) > MAX_LOGIT_BIAS_ENTRIES:
        return f"{f.name} has {len(v)} entries, over the limit of {MAX_LOGIT_BIAS_ENTRIES}"
    seen: set[int] = set()
    for key, bias in v.items():
        tok = token_id(key)
        if tok is None:
            ids = f"token ids (integers from 0 to {bound(MAX_TOKEN_ID)})"
            return f"{f.name} keys must be {ids}, got {_show(key)}"
        if tok in seen:
            return f"{f.name} gives token {tok} twice"
        seen.add(tok)
        if not _in_range(f, bias):
            return f"{f.name}[{_show(key)}] must be {describe_range('real', f.lo, f.hi)}, got {_show(bias)}"
    return None


def problem(name: str, v: Any) -> str | None:
    """None when ``v`` is a value of field ``name``, else "<name> must be <what>, got <v>" (the wire's and
    the engine's message; the gateway reads the field from its first word)."""
    f = BY_NAME[name]
    if allows(f, v):
        return None
    if f.kind == "bias" and v is not None:
        return _bias_problem(f, v)
    return f"{name} must be {describe(f)}, got {_show(v)}"


def logprobs_problem(name: str, v: Any) -> str | None:
    """None when ``v`` is a value of the count field ``name`` (logprobs: None or an int from 0 to
    :data:`MAX_LOGPROBS`), else the wire's message."""
    if v is None or (_is_int(v) and 0 <= v <= MAX_LOGPROBS):
        return None
    return f"{name} must be {describe_range('int', 0, MAX_LOGPROBS)}, or null (none), got {_show(v)}"


def _show(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:77] + "..."


def stored(name: str, v: Any) -> Any:
    """A checked value as it is kept: reals as float, stop as a list, logit_bias as {int id: float}."""
    kind = BY_NAME[name].kind
    if v is None:
        return None
    if kind == "bias":
        return {token_id(k): float(b) for k, b in v.items()}
    return float(v) if kind == "real" else list(v) if kind == "strings" else v


def to_wire(name: str, v: Any) -> Any:
    """A value as a request frame carries it: a logit_bias map with its int ids as decimal strings (the
    daemon unpacks maps with string keys only); anything else, and a map that is not valid, unchanged."""
    if v is None or name not in BY_NAME or BY_NAME[name].kind != "bias" or problem(name, v):
        return v
    return {str(token_id(k)): b for k, b in v.items()}


def table(indent: int = 4) -> str:
    """The fields as the protocol's docstring lists them: name, what it allows, default, help."""
    rows = []
    for f in FIELDS:
        shown = _shown_default(f)
        rows.append(f"{' ' * indent}{f.name:<19} {describe(f)}; default {shown}: {f.help}")
    return "\n".join(rows)


def _shown_default(f: SamplingField) -> str:
    if f.default is None:
        return "fresh entropy"
    return "none" if f.kind in ("strings", "bias") and not f.default else bound(f.default)


def add_flags(
    parser: argparse.ArgumentParser,
    names: tuple[str, ...] = NAMES,
    helps: dict[str, str] | None = None,
) -> None:
    """One ``--flag`` per field (``--max-tokens``, ...), defaulting to None: "not given", which means the
    field's default (the daemon's, or :data:`DEFAULTS` offline). The help shows the field's help (or
    ``helps[name]``: a CLI's own rule, :data:`CLIENT_HELP`), range and default; a value out of range is a
    usage error (exit 2) naming the field, as the wire would."""
    for name in names:
        f = BY_NAME[name]
        f = replace(f, help=(helps or {}).get(name, f.help))
        shown = _shown_default(f)
        if f.kind == "strings":
            text = f"{f.help}: at most {f.hi}, of 1 to {MAX_STOP_CHARS} characters"
            parser.add_argument(f.flag, action="append", type=_flag_type(f), metavar="STR", help=text)
        elif f.kind == "bias":
            bias = describe_range("real", f.lo, f.hi)
            text = f"{f.help}: ID=BIAS, repeatable, at most {MAX_LOGIT_BIAS_ENTRIES}; BIAS {bias}"
            parser.add_argument(f.flag, action="append", type=_flag_type(f), metavar="ID=BIAS", help=text)
        else:
            allowed = describe_range(f.kind, f.lo, f.hi, f.lo_open)  # a flag is never null
            text = f"{f.help}; {allowed} (default: {shown})"
            parser.add_argument(f.flag, type=_flag_type(f), metavar="N", help=text)


def _flag_type(f: SamplingField) -> Any:
    """argparse's ``type`` for field ``f``: the text -> the value, or ArgumentTypeError with the wire's
    message (for stop: one string; the count is checked with the request)."""

    def parse(text: str) -> Any:
        if f.kind == "strings":
            ok = 1 <= len(text) <= MAX_STOP_CHARS
            if not ok:
                raise argparse.ArgumentTypeError(f"a stop string has 1 to {MAX_STOP_CHARS} characters")
            return text
        if f.kind == "bias":
            return _bias_flag(f, text)
        try:
            value = int(text) if f.kind == "int" else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{f.name} must be {describe(f)}, got {text!r}") from None
        wrong = problem(f.name, value)
        if wrong:
            raise argparse.ArgumentTypeError(wrong)
        return value

    parse.__name__ = f.name  # argparse names the type in some messages
    return parse


def from_args(args: argparse.Namespace, names: tuple[str, ...] = NAMES) -> dict[str, Any]:
    """The fields given on a command line built by :func:`add_flags` (flags not given left out); logit_bias
    as the wire's map (decimal-string ids; a later ``ID=`` of the same id wins)."""
    out = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    for n in out:
        if BY_NAME[n].kind == "bias":
            out[n] = dict(out[n])
    return out


def _bias_flag(f: SamplingField, text: str) -> tuple[str, float]:
    """``ID=BIAS`` -> (the id as the wire's decimal string, the bias), or ArgumentTypeError."""
    key, sep, value = text.partition("=")
    tok = token_id(key.strip())
    try:
        bias = float(value)
    except ValueError:
        bias = math.nan
    if not sep or tok is None or not _in_range(f, bias):
        raise argparse.ArgumentTypeError(
            f"{f.name} takes ID=BIAS, a token id and {describe_range('real', f.lo, f.hi)}, got {text!r}"
        )
    return str(tok), bias
