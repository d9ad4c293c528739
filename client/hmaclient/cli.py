"""`hmactl`: ask a running hmad.

    hmactl [--socket PATH] [--timeout S] status [--json]
    hmactl [--socket PATH] [--timeout S] ping [--wait S]
    hmactl [--socket PATH] [--timeout S] metrics [--json | --prometheus]
    hmactl [--socket PATH] [--timeout S] query [--max-tokens N] [--temperature T] [--top-k K] [--top-p P]
           [--min-p P] [--repetition-penalty R] [--repeat-last-n N] [--seed S] [--stop STR]...
           [--raw | --chat-template] [--json-schema FILE_OR_JSON] [--logprobs N] [--prompt-logprobs N]
           [--image PATH]... [--no-speculate] [--json] PROMPT|-
    hmactl [--socket PATH] [--timeout S] chat [--system TEXT] [--raw | --chat-template] [sampling flags]
    hmactl [--socket PATH] [--timeout S] models [--json] | pull REPO[:QUANT] | load MODEL | unload | rm NAME

``query`` streams the answer to stdout as it arrives (``-`` reads the prompt from stdin; ``--raw`` skips the
chat template); with ``--json`` it prints one JSON object at the end instead. ``--image PATH`` (repeatable)
sends an image file (PNG, JPEG, WebP, GIF, BMP) in the prompt's user turn, before its text, in the order
given (not with ``--raw``: images need the chat template; a model without vision answers
``unsupported``). Its sampling flags are hmaclient.sampling's fields (``hmactl query --help`` shows each
one's range and default); one not given takes the daemon's default. ``--json-schema`` makes the answer
one JSON value satisfying that JSON Schema (a file holding it, or its JSON text; ``'{"type":
"object"}'`` is any JSON object). ``--logprobs N`` / ``--prompt-logprobs N`` (0..20) ask for each generated /
prompt token's logprob and its N most likely alternatives: printed after the answer, one token a line
(logprob, the token's text as a JSON string, then the alternatives), or with ``--json`` as lists of
{token_id, text, logprob, top: [[id, logprob, text]]} (the prompt's first item null). Ctrl-C cancels the
request. An answer to ``--json-schema`` that is not a whole JSON value (max_tokens ran out, or a stop string
cut it) exits 1, saying so on stderr after the answer. ``--no-speculate`` asks the daemon not to decode this
answer speculatively (``generate.speculate`` false; the answer is the same, docs/speculation.md);
``--speculate``, the default, leaves it to the daemon's ``speculation:`` config.
``chat`` is a conversation with streamed answers, line editing and history, and /commands: hmaclient.chat.
``models``, ``pull``, ``load``, ``unload``, ``rm``: the daemon's models (hmaclient.cli_models);
``ping --wait`` draws a load's progress while it waits.

Defaults that fit the model (query and chat), from the daemon's status: a model without a chat template
(``chat_template: false``, a base model) is prompted raw, and hmactl says so in one line on stderr;
``--chat-template`` sends it through the built-in Gemma turns anyway, ``--raw`` skips a template the model
has, and ``--image`` takes the template. Without ``--max-tokens``, a model that runs on a CPU (the cpu
backend, or Vulkan on llvmpipe) answers at most sampling.CPU_MAX_TOKENS tokens; elsewhere the daemon's
default holds.
``metrics`` prints the daemon's counters and histograms (requests by outcome, tokens, time to first token,
batch sizes, KV blocks, memory); ``--prometheus`` as Prometheus text (needs prometheus_client: the
``prometheus`` extra, ``pip install 'hmaclient[prometheus]'``), ``--json`` as the families the daemon sent.

Exit codes: 0 ok, 1 the request failed (error reply, timeout, a JSON answer left unfinished; in chat, a
message failed, without a terminal), 2 usage, 3 hmad unreachable (no daemon at the socket, or a socket
another user could own: refused, see hmaclient.safepath), 130 interrupted.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Generator
from typing import Any, TextIO

from hmaclient import chat, cli_models, sampling
from hmaclient.args import json_schema_arg
from hmaclient.client import Client, read_images
from hmaclient.errors import DaemonUnreachable, HmadTimeout, HmaError, RequestError
from hmaclient.protocol import Logprob, ProtocolError, default_socket_path, generate_request
from hmaclient.results import Piece, Result

EXIT_OK, EXIT_REQUEST, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hmactl", description="Talk to a running hmad daemon.")
    ap.add_argument("--socket", metavar="PATH", help=f"hmad's socket (default: {default_socket_path()})")
    ap.add_argument("--timeout", type=float, metavar="S", help="give up after S seconds (default: no limit)")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    st = sub.add_parser("status", help="what the daemon is doing: model, memory, requests, speed")
    st.add_argument("--json", action="store_true", help="print the status map as JSON")
    pg = sub.add_parser("ping", help="check that hmad answers")
    pg.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="S",
        help="keep trying for up to S seconds (e.g. while hmad loads its model)",
    )
    m = sub.add_parser("metrics", help="counters and histograms: requests, tokens, latency, batches, KV")
    shown = m.add_mutually_exclusive_group()
    shown.add_argument("--json", action="store_true", help="print the metric families as JSON")
    shown.add_argument("--prometheus", action="store_true", help="print them in Prometheus' text format")
    q = sub.add_parser("query", help="generate an answer, streamed to stdout")
    sampling.add_flags(q, helps=sampling.CLIENT_HELP)  # --max-tokens, ...: the fields
    _template_flags(q)
    q.add_argument(
        "--json-schema",
        type=json_schema_arg,
        metavar="FILE_OR_JSON",
        help="answer with JSON satisfying this JSON Schema: a file, or the schema's JSON text",
    )
    for flag, what in (("--logprobs", "generated"), ("--prompt-logprobs", "prompt")):
        q.add_argument(
            flag,
            type=_count_arg(flag[2:].replace("-", "_")),
            metavar="N",
            help=f"show each {what} token's logprob and its N most likely alternatives "
            f"(N from 0 to {sampling.MAX_LOGPROBS})",
        )
    q.add_argument(
        "--image",
        action="append",
        dest="images",
        metavar="PATH",
        help="an image file (PNG, JPEG, WebP, GIF, BMP) shown before the prompt's text; repeat for more "
        "(not with --raw)",
    )
    q.add_argument(
        "--speculate",
        action=argparse.BooleanOptionalAction,
        help="--no-speculate: no speculative decoding for this query (default: as the daemon's config says)",
    )
    q.add_argument("--json", action="store_true", help="print one JSON object at the end, no streaming")
    q.add_argument("prompt", metavar="PROMPT|-", help="the prompt, or - to read it from stdin")
    c = sub.add_parser("chat", help="a conversation in the terminal, answers streamed (/help inside)")
    sampling.add_flags(c, helps=sampling.CLIENT_HELP)
    _template_flags(c)
    c.add_argument("--system", metavar="TEXT", help="the system prompt (/system changes it)")
    cli_models.register(sub)
    return ap


def _template_flags(parser: argparse.ArgumentParser) -> None:
    """--raw | --chat-template: override the choice the model's status makes (the module docstring)."""
    how = parser.add_mutually_exclusive_group()
    how.add_argument(
        "--raw",
        action="store_true",
        help="no chat template: the model continues the text (a base model's default)",
    )
    how.add_argument(
        "--chat-template",
        action="store_true",
        help="the chat template even for a model without one (the built-in Gemma turns)",
    )


def _count_arg(name: str) -> Any:
    """The argparse type of count field ``name`` (alternatives per token, 0..MAX_LOGPROBS)."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        problem = sampling.logprobs_problem(name, n)
        if problem:
            raise argparse.ArgumentTypeError(problem)
        return n

    return parse


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 on a usage error
    if args.command == "query" and args.images and args.raw:
        parser.error("--image needs the chat template: leave out --raw")
    try:
        client = Client(args.socket, timeout=args.timeout)
    except ValueError as e:  # e.g. a socket path too long for a Unix socket
        return _fail(f"error: {e}", EXIT_USAGE)
    try:
        if args.command == "status":
            return _status(client, args.json, sys.stdout)
        if args.command == "metrics":
            return _metrics(client, args, sys.stdout)
        if args.command == "ping":
            client, ready = _ping(client, args)
            if not ready:
                return _fail(f"hmad at {client.path} is still loading its model", EXIT_UNREACHABLE)
            print(f"hmad is running at {client.path}")
            return EXIT_OK
        if args.command == "chat":
            return _chat(client, args)
        ran = cli_models.run(client, args)
        if ran is not None:
            return ran
        return _query(client, args, sys.stdout)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED  # the request was cancelled on the way out (Client.close below)
    except ProtocolError as e:
        return _fail(f"error: {e.message}", EXIT_USAGE)
    except DaemonUnreachable as e:
        return _fail(str(e), EXIT_UNREACHABLE)
    except RequestError as e:
        return _fail(f"error: {e.code}: {e.message}", EXIT_REQUEST)
    except (HmadTimeout, HmaError) as e:
        return _fail(f"error: {e}", EXIT_REQUEST)
    except BrokenPipeError:
        with contextlib.suppress(OSError):  # stdout's reader left: say nothing more
            sys.stdout = open("/dev/null", "w")  # noqa: SIM115 - keeps the interpreter's final flush quiet
        return EXIT_REQUEST
    finally:
        with contextlib.suppress(KeyboardInterrupt):
            client.close()


def _ping(client: Client, args: argparse.Namespace) -> tuple[Client, bool]:
    """Ping until the daemon is ready (its model loaded), retrying with a fresh client while it is
    unreachable, until ``--wait`` seconds have passed; returns the client that got the last answer (the
    caller closes it) and whether the daemon was ready."""
    deadline, draw = time.monotonic() + args.wait, cli_models.Progress()
    while True:
        try:
            ready = client.ready()
            if ready or time.monotonic() >= deadline:
                draw.end()
                return client, ready
            info = client.status()
            if info.get("state") == "failed":  # no model, and none loading: waiting would not help
                draw.end()
                raise RequestError("no_model", info.get("error") or "no model is loaded: hmactl load MODEL")
            draw.status(info)  # the load's phase and bytes
        except DaemonUnreachable:
            if time.monotonic() >= deadline:
                raise
        client.close()
        time.sleep(0.25)
        client = Client(args.socket, timeout=args.timeout)


def _fail(message: str, code: int) -> int:
    print(f"hmactl: {message}", file=sys.stderr)
    return code


# -- defaults that fit the model ------------------------------------------------------------------------

RAW_NOTE = {
    "query": "the prompt is sent raw, for it to continue",
    "chat": "the conversation is sent as plain text (User: / Assistant: lines), for it to continue",
}


def _fit(client: Client, args: argparse.Namespace, images: bool = False) -> tuple[bool, int | None, dict]:
    """(raw, max_tokens, the status read) for this model (:func:`fit`); the base-model note goes to stderr.
    Status is read only when a flag leaves something open, and always for chat (its model's name goes into
    /save)."""
    decided = args.raw or args.chat_template or images
    ask = args.command == "chat" or not decided or args.max_tokens is None
    info = client.status() if ask else {}
    raw, max_tokens, note = fit(info, args, images)
    if note:
        print(f"hmactl: {note}", file=sys.stderr)
    return raw, max_tokens, info


def fit(info: dict[str, Any], args: argparse.Namespace, images: bool = False) -> tuple[bool, int | None, str]:
    """(raw, max_tokens, a note for stderr or "") given the daemon's status map and the flags (the module
    docstring has the rule). A status without ``chat_template`` (a daemon still loading, or an older one)
    leaves the chat template on."""
    decided = args.raw or args.chat_template or images
    raw = args.raw or (not decided and info.get("chat_template") is False)
    note = ""
    if raw and not args.raw:
        name = info.get("model_name") or info.get("model")
        note = (
            f"{name} has no chat template (a base model): {RAW_NOTE[args.command]}; "
            "--chat-template uses the built-in Gemma turns"
        )
    on_cpu = info.get("backend") == "cpu" or "llvmpipe" in str(info.get("device", "")).lower()
    max_tokens = args.max_tokens if args.max_tokens is not None else sampling.client_max_tokens(on_cpu)
    return raw, max_tokens, note


def _check(prompt: str, params: dict[str, Any]) -> None:
    """Raise the ProtocolError (a usage error, exit 2) a request with these fields would get, before
    anything connects: the wire's checks, and the image files read."""
    generate_request(0, prompt, **{**params, "images": read_images(params.get("images"), "images")})


# -- chat -------------------------------------------------------------------------------------------------


def _chat(client: Client, args: argparse.Namespace) -> int:
    _check("", sampling.from_args(args))
    raw, max_tokens, info = _fit(client, args)
    params = {**sampling.from_args(args), "max_tokens": max_tokens}
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    session = chat.Chat(
        client,
        chat.Conversation(raw, system=args.system or None),
        params,
        model=info.get("model_name") or info.get("model") or "",
        out=sys.stdout,
        err=sys.stderr,
        interactive=interactive,
    )
    if not interactive:
        return session.run(chat.pipe_lines(sys.stdin))
    return session.run(chat.session_lines(chat.terminal_session(chat.history_path())))


# -- query ------------------------------------------------------------------------------------------------


def _query(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    params: dict[str, Any] = {
        **sampling.from_args(args),  # the flags given; the daemon's defaults for the rest
        "raw": True if args.raw else None,
        "json_schema": args.json_schema,
        "logprobs": args.logprobs,
        "prompt_logprobs": args.prompt_logprobs,
        "images": args.images,  # paths: the client reads them
        "speculate": args.speculate,  # None (no flag): not sent, the daemon's default
    }
    _check(prompt, params)
    raw, max_tokens, _ = _fit(client, args, images=bool(args.images))
    params.update(max_tokens=max_tokens, raw=True if raw else None)
    if args.json:
        r = client.generate(prompt, **params)
        obj = {
            "text": r.text,
            "token_ids": r.token_ids,
            "prompt_tokens": r.prompt_tokens,
            "cached_tokens": r.extra.get("cached_tokens", 0),
            "generated_tokens": r.generated_tokens,
            "finish_reason": r.finish_reason,
            "timings": r.timings,
            **({"schema_complete": r.extra["schema_complete"]} if "schema_complete" in r.extra else {}),
        }
        for name in ("logprobs", "prompt_logprobs"):
            entries = getattr(r, name)
            if entries is not None:
                obj[name] = [None if e is None else dataclasses.asdict(e) for e in entries]
        print(json.dumps(obj, ensure_ascii=False), file=out)
        out.flush()
        return _schema_check(r)
    with contextlib.closing(client.stream(prompt, **params)) as pieces:
        result, logprobs = _write_answer(pieces, out)
    if args.prompt_logprobs is not None and result is not None:
        out.write("\n".join(["prompt logprobs:", *format_logprobs(result.prompt_logprobs or [])]) + "\n")
    if args.logprobs is not None:
        out.write("\n".join(["logprobs:", *format_logprobs(logprobs)]) + "\n")
    out.flush()
    return _schema_check(result)


def _schema_check(result: Result | None) -> int:
    """EXIT_REQUEST, said on stderr, when the answer to a json_schema is not a whole JSON value."""
    if result is None or result.extra.get("schema_complete", True):
        return EXIT_OK
    why = (
        f"max_tokens ran out after {result.generated_tokens} tokens (--max-tokens N for more)"
        if result.finish_reason == "length"
        else f"it ended ({result.finish_reason}) before it was finished"
    )
    return _fail(f"error: the answer is not a whole JSON value for the schema: {why}", EXIT_REQUEST)


def _write_answer(pieces: Generator[Piece, None, Result | None], out: TextIO) -> tuple[Result | None, list]:
    """Write the answer's pieces as they come, ending with a newline; the result (None if cancelled) and
    the generated tokens' logprobs."""
    last, logprobs = "", []
    while True:
        try:
            piece = next(pieces)
        except StopIteration as end:
            result = end.value
            break
        logprobs += piece.logprobs or []
        if piece.text:
            out.write(piece.text)
            out.flush()
            last = piece.text
    if last and not last.endswith("\n"):
        out.write("\n")
    return result, logprobs


def format_logprobs(entries: list[Logprob | None]) -> list[str]:
    """One line a token: its logprob, its text as a JSON string, then its alternatives (text logprob,
    most likely first); a prompt's first token (None: nothing comes before it) as a dash."""
    lines = []
    for e in entries:
        if e is None:
            lines.append(f"  {'-':>9}  (the first token: no logprob)")
            continue
        top = ", ".join(f"{_shown(t)} {lp:.4f}" for _id, lp, t in e.top)
        lines.append(f"  {e.logprob:9.4f}  {_shown(e.text)}" + (f"  top: {top}" if e.top else ""))
    return lines


def _shown(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


# -- metrics ----------------------------------------------------------------------------------------------


def _metrics(client: Client, args: argparse.Namespace, out: TextIO) -> int:
    if args.prometheus:
        try:
            from hmaclient.prometheus import exposition
        except ImportError:
            return _fail(
                "error: --prometheus needs prometheus_client (pip install 'hmaclient[prometheus]')",
                EXIT_USAGE,
            )
        out.write(exposition(client.metrics()))
        return EXIT_OK
    families = client.metrics()
    if args.json:
        print(json.dumps(families, indent=2, ensure_ascii=False), file=out)
    else:
        print(f"hmad at {client.path}", file=out)
        print("\n".join(format_metrics(families)), file=out)
    return EXIT_OK


def format_metrics(families: list[dict[str, Any]]) -> list[str]:
    """The families as aligned lines: one per unlabelled metric, labelled samples indented below their name,
    histograms as count, mean and bucket quantiles; values formatted by the unit their name ends in."""
    lines: list[str] = []
    width = max((len(f["name"]) for f in families), default=0) + 2
    for fam in families:
        name, samples = fam["name"], fam["samples"]
        label = name.replace("_", " ")
        if len(samples) == 1 and not samples[0].get("labels"):
            lines.append(f"  {label:<{width}}{_metric_value(name, fam['type'], samples[0])}")
            continue
        lines.append(f"  {label}")
        tags = [" ".join(f"{k}={v}" for k, v in s.get("labels", {}).items()) for s in samples]
        inner = max([width - 2, *(len(t) + 2 for t in tags)])
        lines += [
            f"    {t:<{inner}}{_metric_value(name, fam['type'], s)}"
            for t, s in zip(tags, samples, strict=True)
        ]
    return lines


def _metric_value(name: str, kind: str, sample: dict[str, Any]) -> str:
    if kind != "histogram":
        return _unit_value(name, sample["value"])
    n = sample["count"]
    if not n:
        return "none yet"
    parts = [f"{n} observed", f"mean {_unit_value(name, sample['sum'] / n)}"]
    for q in (0.5, 0.9, 0.99):
        parts.append(f"p{round(q * 100)} {_quantile_bound(name, sample, q)}")
    return ", ".join(parts)


def _quantile_bound(name: str, sample: dict[str, Any], q: float) -> str:
    """The smallest bucket bound that holds at least a fraction q of the observations."""
    for bound, cumulative in zip(sample["bounds"], sample["buckets"], strict=True):
        if cumulative >= q * sample["count"]:
            return "<= " + _unit_value(name, bound)
    return "> " + _unit_value(name, sample["bounds"][-1]) if sample["bounds"] else "-"


def _unit_value(name: str, value: Any) -> str:
    if name.endswith("_seconds") and isinstance(value, int | float):
        return f"{value * 1e3:.3g} ms" if value < 1 else human_seconds(value)
    if name.endswith("_bytes") and isinstance(value, int | float):
        return human_bytes(value)
    if name.endswith("_per_second"):
        return format_value("tokens_per_s", value)
    return format_value("", value)


# -- status -----------------------------------------------------------------------------------------------


def _status(client: Client, as_json: bool, out: TextIO) -> int:
    info = client.status()
    if as_json:
        print(json.dumps(info, indent=2, ensure_ascii=False, default=repr), file=out)
    else:
        print(f"hmad at {client.path}", file=out)
        print("\n".join(format_status(info)), file=out)
    return EXIT_OK


def format_status(info: dict[str, Any], indent: int = 2, sizes: bool = False) -> list[str]:
    """The status map as aligned ``label  value`` lines; nested maps indented under their key.

    Whatever keys the daemon sends are shown; ``*_bytes`` keys (and every int under a ``memory`` or
    ``heap`` key) print as sizes, ``*_per_s`` as rates and ``*_s`` as durations.
    """
    lines: list[str] = []
    pad = " " * indent
    width = max((len(_label(k)) for k in info), default=0)
    for key, value in info.items():
        inner = sizes or any(word in str(key).lower() for word in ("memory", "heap"))
        if isinstance(value, dict) and value:
            lines.append(f"{pad}{_label(key)}:")
            lines += format_status(value, indent + 2, inner)
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            lines.append(f"{pad}{_label(key)}:")
            for item in value:
                sub = format_status(item, indent + 4, inner)
                lines += [f"{pad}  - {sub[0].lstrip()}", *sub[1:]] if sub else [f"{pad}  -"]
        else:
            shown = format_value(str(key) + ("_bytes" if inner else ""), value)
            lines.append(f"{pad}{_label(key):<{width}}  {shown}")
    return lines


def _label(key: Any) -> str:
    """``uptime_s`` -> ``uptime``, ``tokens_per_s`` -> ``tokens/s``, ``used_bytes`` -> ``used``."""
    k = str(key).replace("_per_s", "/s")
    return k.removesuffix("_bytes").removesuffix("_s").replace("_", " ")


def format_value(key: str, value: Any) -> str:
    """One status value, formatted by what its key says it is."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ", ".join(format_value("", v) for v in value) or "-"
    if isinstance(value, dict):
        return "{}"
    if not isinstance(value, int | float):
        return str(value)
    if key.endswith("bytes") and isinstance(value, int):
        return human_bytes(value)
    if key.endswith("_per_s"):
        unit = "tok/s" if "token" in key else "/s"
        return f"{value:.1f} {unit}"
    if key.endswith("_s"):
        return human_seconds(value)
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_seconds(s: float) -> str:
    if s < 60:
        return f"{s:.3g} s"
    s = int(s)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return (f"{d}d " if d else "") + f"{h}h {m:02d}m {s:02d}s"


if __name__ == "__main__":
    sys.exit(main())
