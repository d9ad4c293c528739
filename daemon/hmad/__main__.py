"""`hmad`: the command line.

    hmad [--config FILE] [--model M] [--backend B] [--socket PATH] [--set KEY=VALUE]... [--foreground]
    hmad generate [--model default] [--backend cpu] [--max-tokens N] [--temperature T] ...
                  [--json-schema FILE_OR_JSON] [--image PATH]... [--mmproj FILE] [--json] PROMPT
    hmad install-default-model [--assemble [PATH]] [--clean]
    hmad pull REPO[:QUANT]
    hmad models [--json]
    hmad rm NAME

With no subcommand hmad runs the service in the foreground (systemd runs it so too). ``generate`` runs
offline (no daemon): it loads the model, streams the continuation to stdout and, with ``--json``, prints
one JSON object on the last line. ``--json-schema`` constrains the continuation to JSON satisfying the
schema (a file, or the schema's JSON text itself). ``--image`` (repeatable) asks about images: the prompt
then goes through the chat template as one user turn, the images before its text, as ``hmactl query
--image`` sends it (a model with a vision tower: an HF checkpoint with one, or ``--mmproj``, llama.cpp's
projector GGUF beside a GGUF model). Its sampling flags are hmactl query's
(hmaclient.sampling); one not given takes its default, the daemon's built-in one (``--help`` lists them).

``pull``, ``models`` and ``rm`` work on this user's model store (hmad.store; docs/models.md): ``pull``
fetches a GGUF, and its projector, from Hugging Face (``REPO[:QUANT]``, e.g.
``ggml-org/gemma-3-4b-it-GGUF:Q4_K_M``); ``models`` lists what is on disk (``--json``: one JSON array);
``rm`` deletes a pulled model. ``--model hf:REPO[:QUANT]`` pulls on first use.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from hmaclient import sampling
from hmaclient.args import json_schema_arg
from hmad.core.errors import HmadError

SUBCOMMANDS = ("generate", "install-default-model", "pull", "models", "rm")


def build_service_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="hmad",
        description="Resident Gemma 3 inference daemon. Subcommands: "
        + ", ".join(SUBCOMMANDS)
        + " (hmad SUBCOMMAND --help).",
    )
    ap.add_argument("--config", help="YAML config (default: $HMAD_CONFIG, else /etc/hmad/hmad.yaml)")
    ap.add_argument("--model", help="overrides config 'model'")
    ap.add_argument("--backend", choices=["auto", "cpu", "vulkan", "npu"], help="overrides config 'backend'")
    ap.add_argument("--socket", help="overrides config 'socket.path'")
    ap.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any config key, e.g. --set engine.max_seqs=32",
    )
    ap.add_argument("--foreground", action="store_true", help="accepted for clarity; hmad never forks")
    return ap


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hmad", description="Resident Gemma 3 inference daemon")
    ap.add_argument("--log-level", default="warning")
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate offline, without the daemon")
    g.add_argument("--model", default="default", help="'default', a .gguf file or an HF checkpoint dir")
    g.add_argument("--backend", default="cpu", choices=["cpu", "vulkan", "npu", "auto"])
    g.add_argument("--json", action="store_true", help="print one JSON object on the last line")
    g.add_argument(
        "--json-schema",
        type=json_schema_arg,
        metavar="FILE_OR_JSON",
        help="constrain the output to JSON satisfying this JSON Schema (a file, or the JSON text)",
    )
    g.add_argument(
        "--image",
        action="append",
        default=[],
        metavar="PATH",
        help="an image to ask about (repeatable; the prompt then goes through the chat template)",
    )
    g.add_argument(
        "--mmproj", metavar="FILE", help="llama.cpp's projector GGUF: the GGUF model's vision tower"
    )
    g.add_argument("prompt", help="prompt text, or - to read stdin")
    sampling.add_flags(g)  # hmaclient.sampling's fields, as hmactl query has them
    d = sub.add_parser("install-default-model", help="verify the embedded default model's parts")
    d.add_argument(
        "--assemble",
        nargs="?",
        const="",
        metavar="PATH",
        help="also write it as one GGUF file (default: in the cache) for tools that need one, e.g. llama.cpp",
    )
    d.add_argument("--clean", action="store_true", help="remove the one-file copy from the cache")
    p = sub.add_parser("pull", help="fetch a GGUF model (and its projector) from Hugging Face")
    p.add_argument("ref", metavar="REPO[:QUANT]", help="e.g. ggml-org/gemma-3-4b-it-GGUF:Q4_K_M")
    m = sub.add_parser("models", help="list the models on disk")
    m.add_argument("--json", action="store_true", help="print one JSON array")
    r = sub.add_parser("rm", help="remove a pulled model")
    r.add_argument("name", metavar="NAME", help="as hmad models lists it (owner/repo:QUANT)")
    return ap


def cmd_pull(args: argparse.Namespace) -> int:
    from hmad.store.catalog import human_size
    from hmad.store.hub import pull

    res = pull(args.ref)
    state = "already in the store" if res.already_present else "pulled"
    print(f"{res.name}: {state}, {human_size(res.size_bytes)} in {res.folder}")
    print(f"run it: hmad --model {res.name}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from hmad.store.catalog import human_size, list_models

    models = list_models()
    if args.json:
        print(json.dumps([asdict(e) for e in models], indent=1))
        return 0
    rows = [("NAME", "ARCH", "QUANT", "SIZE", "CONTEXT", "TEMPLATE", "VISION")]
    for e in models:
        rows.append(
            (
                e.name,
                e.architecture or "?",
                e.quantization or "?",
                human_size(e.size_bytes),
                str(e.context_length or "?"),
                "yes" if e.chat_template else "no",
                "yes" if e.vision else "no",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    for e in models:
        if e.problem:
            print(f"{e.name}: {e.problem}", file=sys.stderr)
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from hmad.store.catalog import human_size, remove_model

    gone = remove_model(args.name)
    print(f"removed {gone.name} ({human_size(gone.freed_bytes)})")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from hmad.composition import load_model
    from hmad.engine.generate import generate
    from hmad.engine.sampling import SamplingParams

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    # The flags given over the fields' defaults (the daemon's built-in ones); generate() validates them.
    params = SamplingParams(**{**sampling.DEFAULTS, "stop": [], **sampling.from_args(args)})
    if args.json_schema is not None:
        from hmad.engine.structured import compile_schema

        try:
            compile_schema(args.json_schema)  # before the model loads: a bad schema is a usage error
        except ValueError as e:
            print(f"hmad: {e}", file=sys.stderr)
            return 2
    try:
        images = [Path(p).read_bytes() for p in args.image]
    except OSError as e:
        print(f"hmad: cannot read image: {e}", file=sys.stderr)
        return 2
    model = load_model(args.model, backend=args.backend, mmproj=args.mmproj)
    prompts: list = [prompt]
    spans = None
    if images:
        try:
            prepared = _prepared_with_images(model, prompt, images, params)
        except ValueError as e:  # a bad image, a model without a vision tower, a prompt too long
            print(f"hmad: {e}", file=sys.stderr)
            return 1
        prompts, spans, params = [prepared.ids], [prepared.images], prepared.params

    def stream(ev):
        if ev.kind == "token" and ev.text:
            sys.stdout.write(ev.text)
            sys.stdout.flush()

    res = generate(model, prompts, params, on_event=stream, json_schemas=args.json_schema, images=spans)[0]
    sys.stdout.write("\n")
    if args.json:
        out = {
            "text": res.text,
            "token_ids": res.token_ids,
            "prompt_token_ids": res.prompt_token_ids,
            "finish_reason": res.finish_reason,
            "model": model.path,
            "backend": model.backend.name,
            "load_s": round(model.load_seconds, 3),
            **res.stats,
        }
        print(json.dumps(out, ensure_ascii=False))
    return 0


def _prepared_with_images(model, prompt: str, images: list[bytes], params):
    """The prompt as the daemon prepares a request with images (hmad.preparation): one user turn of the chat
    template, the images first."""
    from hmaclient import protocol as P
    from hmad.preparation import prepare

    msg = {"type": "generate", "prompt": prompt, "images": images}
    req = P.GenerateRequest(id=None, v=P.required_version(msg), prompt=prompt, images=images)
    return prepare(req, params, model, model.config.context_length)


def run_service(argv: list[str]) -> int:
    from hmad.config import ConfigError, load_config, parse_override
    from hmad.service import Service

    args = build_service_parser().parse_args(argv)
    try:
        overrides = dict(parse_override(s) for s in args.set)
        for key, value in (
            ("model", args.model),
            ("backend", args.backend),
            ("socket.path", args.socket),
            ("log_level", args.log_level),
        ):
            if value is not None:
                overrides[key] = value
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"hmad: config error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    service = Service(cfg)
    try:
        code = service.run()
    except HmadError as e:
        logging.getLogger("hmad").error("%s", e)
        return 1
    if service.abandoned_load:  # its thread may hold the interpreter: no finalization to wait on it
        logging.shutdown()
        os._exit(code)
    return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not any(a in SUBCOMMANDS for a in argv[:3]):
        return run_service(argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "generate":
            return cmd_generate(args)
        if args.command == "install-default-model":
            from hmad.model.default import install_command

            print("\n".join(install_command(args.assemble, args.clean)))
            return 0
        return {"pull": cmd_pull, "models": cmd_models, "rm": cmd_rm}[args.command](args)
    except (HmadError, ValueError) as e:
        print(f"hmad: error: {e}", file=sys.stderr)
        return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
