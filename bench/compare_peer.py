#!/usr/bin/env python3
"""hmad beside llama-server on the same file, from one device call's JSON: the table issue 17 asks for.

    python3 bench/compare_peer.py --hmad hmad.json --peer peer.json [--copy copy.json] [--weights-bytes N]

``hmad.json`` is bench_daemon.py's (through the daemon and hmaclient, ``--levels 1,8,32``), ``peer.json``
bench_peer.py's (llama-server's HTTP API, ``--streams 1,8,32``); both count generated tokens over the
wall time of N concurrent requests, prefill included. The prompts' lengths are printed beside the table:
they should match (device_serving.sh gives both 128 tokens: bench_daemon.py ``--prompt-tokens``,
bench_peer.py ``--prompt-len``; before 2026-11-26's last session hmad's were ~290 tokens of text).
With ``--copy`` (bench_vulkan_copy.py) and the weights' bytes, the one-stream figure is also given as
weight bytes read per second over the read-only and the copy ceilings (a lower bound: the prompt's
prefill is inside the wall time).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def rows(hmad: dict, peer: dict) -> list[tuple[str, float, float]]:
    """(what, hmad tok/s, llama-server tok/s) for the prefill and every streams level both measured."""
    d = hmad["daemon"]
    out = [("prefill", d["prefill"]["tok_s"], peer["prefill"]["tok_s"])] if "prefill" in d else []
    for n, r in sorted(d["levels"].items(), key=lambda kv: int(kv[0])):
        if f"streams_{n}" in peer:
            out.append((f"{n} streams", r["tok_s"], peer[f"streams_{n}"]["tok_s"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hmad", required=True, type=Path)
    ap.add_argument("--peer", required=True, type=Path)
    ap.add_argument("--copy", type=Path, help="bench_vulkan_copy.py's JSON: the copy ceiling")
    ap.add_argument("--weights-bytes", type=int, default=0, help="bytes a one-token step reads (the file)")
    a = ap.parse_args()
    hmad, peer = json.loads(a.hmad.read_text()), json.loads(a.peer.read_text())
    print(f"{hmad['model']} on {hmad.get('device')}, {hmad['date']}")
    print("| | hmad | llama-server | ratio |\n|---|---|---|---|")
    table = rows(hmad, peer)
    for what, ours, theirs in table:
        print(f"| {what} | {ours:,.1f} tok/s | {theirs:,.1f} | {ours / theirs:.2f}x |")
    print(f"| ready | {hmad['daemon']['ready_s']:.2f} s | {peer['ready_s']:.2f} s | |")
    ours_len = sorted({r["prompt_tokens_mean"] for r in hmad["daemon"]["levels"].values()})
    print(
        f"prompts: hmad {', '.join(f'{x:g}' for x in ours_len)} tokens, llama-server {peer.get('prompt_len')}"
    )
    levels = {w: (o, t) for w, o, t in table}
    if "1 streams" in levels and "8 streams" in levels:
        (o1, t1), (o8, t8) = levels["1 streams"], levels["8 streams"]
        print(f"8 streams / 1 stream: hmad {o8 / o1:.2f}x, llama-server {t8 / t1:.2f}x")
    if a.copy and a.weights_bytes and "1 streams" in levels:
        copy = json.loads(a.copy.read_text())
        gb_s = levels["1 streams"][0] * a.weights_bytes / 1e9
        for what, key in (("read-only", "read_ceiling_GBps"), ("copy", "ceiling_GBps")):
            if copy.get(key):
                print(f"1 stream: weights at {gb_s:,.0f} GB/s, {gb_s / copy[key]:.1%} of the {what} ceiling")


if __name__ == "__main__":
    main()
