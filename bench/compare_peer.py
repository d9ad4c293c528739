#!/usr/bin/env python3
"""hmad beside llama-server on the same file, from one device call's JSON: each figure paired with its like.

    python3 bench/compare_peer.py --hmad hmad.json --peer peer.json [--memory memory.json] [--copy copy.json]
                                  [--weights-bytes N] [--json table.json]

``hmad.json`` is bench_daemon.py's (through the daemon and hmaclient), ``peer.json`` bench_peer.py's
(llama-server's HTTP API), both measured in the same state (idle, each shape warmed once). Each row names
its kind:
- ``prefill``: prompt tokens per second of one prompt on the idle server, as each server reports it
  (llama-server's ``prompt_per_second``; hmad's prompt tokens / ``ttft_s``, which also holds tokenization
  and the first token's sampling, so it favours llama-server slightly);
- ``decode``: the requests' own decode rates summed over the N concurrent streams (llama-server's
  ``predicted_per_second``, hmad's ``tokens_per_s``): what each server decodes, prefill and HTTP/IPC left out;
- ``wall``: generated tokens / wall time of the N requests, prefill and transport included, and the time
  to first token at the client (median): what a user waits for;
- ``ready``: process start to serving.
With ``--memory`` (bench_memory_limit.py: the memory's own bandwidth, no kernel of ours), ``--copy``
(bench_vulkan_copy.py: the warm Vulkan read ceiling) and the bytes a one-token step reads, the 1-stream
decode is also given as weight traffic over both. The GPU's clocks of every section are printed with it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_clocks import describe  # noqa: E402


def row(figure: str, kind: str, ours: float, theirs: float, higher_is_better: bool = True) -> dict:
    ratio = ours / theirs if higher_is_better else theirs / ours
    return {"figure": figure, "kind": kind, "hmad": ours, "llama_server": theirs, "ratio": ratio}


def sections(hmad: dict, peer: dict) -> list[tuple[str, dict, dict]]:
    """(name, hmad's, llama-server's) for every timed section both runs measured: the prefill, then each
    streams level in order."""
    d = hmad["daemon"]
    out = [("prefill", d["prefill"], peer["prefill"])] if "prefill" in d and "prefill" in peer else []
    for n, r in sorted(d["levels"].items(), key=lambda kv: int(kv[0])):
        if f"streams_{n}" in peer:
            out.append((f"{n} streams", r, peer[f"streams_{n}"]))
    return out


def rows(hmad: dict, peer: dict) -> list[dict]:
    """The like-for-like pairs both runs measured: prefill, decode per level, then the wall figures."""
    both = sections(hmad, peer)
    levels = [(name, ours, theirs) for name, ours, theirs in both if name != "prefill"]
    out = [
        row(f"prefill {theirs['tokens']}", "prefill", ours["tok_s"], theirs["tok_s"])
        for name, ours, theirs in both
        if name == "prefill"
    ]
    for name, ours, theirs in levels:
        if "decode_tok_s" in ours and "decode_tok_s" in theirs:
            out.append(row(name, "decode", ours["decode_tok_s"], theirs["decode_tok_s"]))
    for name, ours, theirs in levels:
        out.append(row(f"{name}: generated / wall", "wall", ours["wall_tok_s"], theirs["wall_tok_s"]))
        if "ttft_s" in ours and "ttft_s" in theirs:
            median = (ours["ttft_s"]["median"], theirs["ttft_s"]["median"])
            out.append(row(f"{name}: TTFT median (s)", "wall", *median, higher_is_better=False))
    out.append(row("ready (s)", "wall", hmad["daemon"]["ready_s"], peer["ready_s"], higher_is_better=False))
    return out


def clocks(hmad: dict, peer: dict) -> list[str]:
    """One line per timed section: its GPU clocks on each side."""
    return [
        f"{name}: hmad {describe(ours.get('clocks'))}; llama-server {describe(theirs.get('clocks'))}"
        for name, ours, theirs in sections(hmad, peer)
    ]


def bandwidth(decode_1: float, weights_bytes: int, memory: dict | None, copy: dict | None) -> list[str]:
    """The 1-stream decode's weight traffic over the memory's bandwidth and the warm Vulkan read ceiling."""
    gb_s = decode_1 * weights_bytes / 1e9
    lines = [f"1 stream decodes {decode_1:,.1f} tok/s: weights read at {gb_s:,.0f} GB/s"]
    # an NVIDIA copy moves each byte twice (read + write): the memory's traffic limit is that sum
    if memory and memory.get("available"):
        m = memory["runs"][0]
        lines.append(
            f"  {gb_s / m['GBps_read_plus_write']:.1%} of the memory's bandwidth: cudaMemcpy "
            f"{m['GBps_read_plus_write']:,.0f} GB/s (read + write, {m['fill']} bytes), "
            f"{describe(m['clocks'])}"
        )
    if copy and copy.get("read_ceiling_GBps"):
        best = max((r for r in copy["runs"] if r["variant"].startswith("read")), key=lambda r: r["GBps"])
        lines.append(
            f"  {gb_s / best['GBps']:.1%} of the warm Vulkan read ceiling: {best['variant']} "
            f"{best['GBps']:,.0f} GB/s (first submit {best.get('cold_GBps', 0):,.0f}), "
            f"{describe(best.get('clocks'))}"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hmad", required=True, type=Path)
    ap.add_argument("--peer", required=True, type=Path)
    ap.add_argument("--memory", type=Path, help="bench_memory_limit.py's JSON: the memory's own bandwidth")
    ap.add_argument("--copy", type=Path, help="bench_vulkan_copy.py's JSON: the warm Vulkan read ceiling")
    ap.add_argument("--weights-bytes", type=int, default=0, help="bytes a one-token step reads (the file)")
    ap.add_argument("--json", type=Path, help="write the table and the lines here")
    a = ap.parse_args()
    hmad, peer = json.loads(a.hmad.read_text()), json.loads(a.peer.read_text())
    memory = json.loads(a.memory.read_text()) if a.memory else None
    copy = json.loads(a.copy.read_text()) if a.copy else None
    table = rows(hmad, peer)
    flags = " ".join(peer.get("flags", []))
    print(f"{hmad['model']} on {hmad.get('device')}, {hmad['date']}; llama-server {flags}")
    print("| figure | kind | hmad | llama-server | hmad's advantage |\n|---|---|---|---|---|")
    for r in table:
        ours, theirs = f"{r['hmad']:,.4g}", f"{r['llama_server']:,.4g}"
        print(f"| {r['figure']} | {r['kind']} | {ours} | {theirs} | {r['ratio']:.2f}x |")
    lens = sorted({r["prompt_tokens_mean"] for r in hmad["daemon"]["levels"].values()})
    notes = [
        f"prompts: hmad {', '.join(f'{x:g}' for x in lens)} tokens, llama-server {peer.get('prompt_len')}"
    ]
    if "ub_sweep" in peer:
        notes.append(f"llama-server -ub sweep (prefill tok/s): {peer['ub_sweep']['prefill_tok_s']}")
    notes += clocks(hmad, peer)
    notes.append("hmad's advantage: hmad / llama-server for rates, llama-server / hmad for times")
    one = next((r for r in table if r["figure"] == "1 streams" and r["kind"] == "decode"), None)
    if one and a.weights_bytes:
        notes += bandwidth(one["hmad"], a.weights_bytes, memory, copy)
        notes += ["llama-server: " + bandwidth(one["llama_server"], a.weights_bytes, None, None)[0]]
    print("\n".join(notes))
    if a.json:
        a.json.write_text(
            json.dumps(
                {
                    "model": hmad["model"],
                    "device": hmad.get("device"),
                    "date": hmad["date"],
                    "rows": table,
                    "notes": notes,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
