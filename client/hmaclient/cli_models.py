"""`hmactl`'s model commands: what the daemon has on disk and loaded, and changing it without a restart.

    hmactl models [--json]          the daemon's store and its embedded model; which one is loaded
    hmactl pull REPO[:QUANT]        the daemon pulls it into its store; a progress bar until it is there
    hmactl load MODEL [--no-wait]   a pulled model's name, hf:REPO[:QUANT], or a file the daemon may read;
                                    progress drawn until it serves (or the load failed)
    hmactl unload [--no-wait]       free the model's memory; the next request loads it again
    hmactl rm NAME                  remove a pulled model (not the loaded one)

These ask the daemon (protocol version 5's model requests), so they act on its store (the service's
/var/lib/hmad/models), not on the user's; ``hmad pull/models/rm`` act on a store without a daemon.
``register(sub)`` adds the commands to hmactl's parser; ``run(client, args)`` runs one (None: not one of
these). Progress is drawn on stderr: one line redrawn on a terminal, a line per phase otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from hmaclient.client import Client

COMMANDS = ("models", "pull", "load", "unload", "rm")
POLL_S = 0.2
BAR = 24  # characters of the progress bar


def register(sub: Any) -> None:
    """The model commands, on hmactl's subparsers."""
    m = sub.add_parser("models", help="the models on the daemon's disk, and which one is loaded")
    m.add_argument("--json", action="store_true", help="print the daemon's list as one JSON object")
    p = sub.add_parser("pull", help="the daemon pulls a GGUF model (and its projector) from Hugging Face")
    p.add_argument("ref", metavar="REPO[:QUANT]", help="e.g. ggml-org/gemma-3-4b-it-GGUF:Q4_K_M")
    ld = sub.add_parser("load", help="switch the daemon to another model, without a restart")
    ld.add_argument("model", metavar="MODEL", help="a pulled model's name, hf:REPO[:QUANT], or a GGUF file")
    ld.add_argument("--no-wait", action="store_true", help="return once the switch has begun")
    u = sub.add_parser("unload", help="free the model's memory; the next request loads it again")
    u.add_argument("--no-wait", action="store_true", help="return once the unload has begun")
    r = sub.add_parser("rm", help="remove a pulled model from the daemon's store (not the loaded one)")
    r.add_argument("name", metavar="NAME", help="as hmactl models lists it (owner/repo:QUANT)")


def run(client: Client, args: argparse.Namespace) -> int | None:
    """Run a model command; its exit status (None when ``args.command`` is not one)."""
    if args.command not in COMMANDS:
        return None
    return {"models": _models, "pull": _pull, "load": _load, "unload": _unload, "rm": _rm}[args.command](
        client, args
    )


# -- the commands ------------------------------------------------------------------------------------------
def _models(client: Client, args: argparse.Namespace) -> int:
    got = client.model_request("models")
    if args.json:
        print(json.dumps(got, indent=1))
        return 0
    rows = [("NAME", "ARCH", "QUANT", "SIZE", "CONTEXT", "TEMPLATE", "VISION", "LOADED")]
    for e in got["models"]:
        yes = ("no", "yes")
        rows.append(
            (
                e["name"],
                e.get("architecture") or "?",
                e.get("quantization") or "?",
                human_size(e.get("size_bytes") or 0),
                str(e.get("context_length") or "?"),
                yes[bool(e.get("chat_template"))],
                yes[bool(e.get("vision"))],
                "*" if e.get("loaded") else "",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
    if got.get("loaded") and not any(e.get("loaded") for e in got["models"]):
        print(f"loaded: {got['loaded']}")
    elif not got.get("loaded"):
        print(f"no model loaded ({got.get('state')})")
    for e in got["models"]:
        if e.get("problem"):
            print(f"{e['name']}: {e['problem']}", file=sys.stderr)
    return 0


def _rm(client: Client, args: argparse.Namespace) -> int:
    got = client.model_request("remove", args.name)
    print(f"removed {got['name']} ({human_size(got['freed_bytes'])} freed)")
    return 0


def _pull(client: Client, args: argparse.Namespace) -> int:
    got = client.model_request("pull", args.ref)
    pid, draw = got["pull_id"], Progress()
    if got.get("joined"):
        print(f"joining the pull of {args.ref} already running", file=sys.stderr)
    while got["state"] == "pulling":
        draw(got.get("phase", ""), got.get("done_bytes"), got.get("total_bytes"))
        time.sleep(POLL_S)
        got = client.status().get("pulls", {}).get(pid, got)
    draw.end()
    if got["state"] == "failed":
        print(f"hmactl: pull of {args.ref} failed: {got.get('error')}", file=sys.stderr)
        return 1
    state = "already in the store" if got.get("already_present") else "pulled"
    print(f"{got.get('name', args.ref)}: {state}, {human_size(got.get('size_bytes') or 0)}")
    print(f"load it: hmactl load {got.get('name', args.ref)}")
    return 0


def _load(client: Client, args: argparse.Namespace) -> int:
    model = os.path.abspath(args.model) if os.path.exists(args.model) else args.model  # the daemon's cwd
    got = client.model_request("load", model)
    if got.get("unchanged"):
        print(f"{args.model} is already loaded")
        return 0
    if args.no_wait:
        print(f"switching to {args.model} (hmactl status shows the progress)")
        return 0
    info = wait_switch(client, got["switch_id"])
    if info.get("error"):
        print(f"hmactl: {info['error']}", file=sys.stderr)
        now = f"serving {info['model']} again" if info["state"] == "ready" else "no model is loaded"
        print(f"hmactl: {now}", file=sys.stderr)
        return 1
    print(f"serving {info['model']}")
    return 0


def _unload(client: Client, args: argparse.Namespace) -> int:
    got = client.model_request("unload")
    if not got.get("unchanged") and not args.no_wait:
        wait_switch(client, got["switch_id"])
    print("unloaded: the next request loads the model again")
    return 0


# -- waiting and drawing -----------------------------------------------------------------------------------
def wait_switch(client: Client, switch_id: int) -> dict[str, Any]:
    """Poll status until switch ``switch_id`` (or a later one) has ended, drawing its phases; the status's
    ``switch`` map then."""
    draw = Progress()
    while True:
        st = client.status()
        info = st.get("switch", {})
        if info.get("id", 0) >= switch_id and info.get("state") in ("ready", "idle", "failed"):
            draw.end()
            return info
        draw.status(st)
        time.sleep(POLL_S)


class Progress:
    """A progress line on stderr: redrawn in place on a terminal, else one line per new phase."""

    def __init__(self):
        self.tty = sys.stderr.isatty()
        self.last = ""

    def status(self, st: dict[str, Any]) -> None:
        """A daemon's status while it loads, drains or unloads: its phase and bytes."""
        phase = st.get("phase") or st.get("state") or ""
        self(phase, st.get("uploaded_bytes"), st.get("total_bytes"))

    def __call__(self, phase: str, done: int | None = None, total: int | None = None) -> None:
        line = phase
        if done is not None and total:
            frac = min(1.0, done / total)
            bar = "#" * int(frac * BAR) + "-" * (BAR - int(frac * BAR))
            line = f"{phase}  [{bar}] {frac:4.0%}  {human_size(done)} / {human_size(total)}"
        if self.tty:
            sys.stderr.write("\r\x1b[K" + line[:200])
            sys.stderr.flush()
        elif phase != self.last:
            print(line, file=sys.stderr)
        self.last = phase

    def end(self) -> None:
        if self.tty and self.last:
            sys.stderr.write("\n")


def human_size(n: float) -> str:
    """Bytes for people: GB from 0.1 GB up, else MB (as ``hmad models`` writes them)."""
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
