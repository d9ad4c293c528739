#!/usr/bin/env python3
"""One forward step of the embedded Gemma 3 270M on the Vulkan backend, kernel by kernel, on a slow device.

The large-step path of a GPU without cooperative matrices (Intel and older AMD iGPUs, Mesa lavapipe on the
CPU) in one table: per step size (``--tokens``, default 1, 16, 256 tokens of one sequence from position 0),
the wall time of one step (recorded once, then replayed ``--reps`` times) and the GPU time of each kernel
kind, from a timestamp after every command. With ``--numpy`` the numpy backend's wall time per step too.
``--decode`` adds decode steps: per row count, that many sequences of one token each at position
DECODE_POS, each wanting its logits row (what a decode batch runs).

    .venv/bin/python bench/bench_lavapipe_step.py --tokens 1,16,256 [--decode 1,6] [--numpy] [--out r.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "daemon")]

from hmad.backends.vulkan.graph import bucket  # noqa: E402
from hmad.composition import load_model  # noqa: E402
from hmad.core.batch import SeqSlice, StepBatch  # noqa: E402
from hmad.engine.kvcache import KVCacheManager, KVLayout  # noqa: E402


def one_sequence(kv: KVCacheManager, layout: KVLayout, n_tok: int) -> StepBatch:
    """A prefill step of ``n_tok`` tokens of sequence 0 from position 0 (its logits row the last)."""
    t = kv.tables(0)
    tokens = [2] + [(7 * i) % 5000 + 100 for i in range(1, n_tok)]
    return StepBatch.build([(SeqSlice(0, 0, 0, 0, t.global_table, t.local_table), tokens, True)], 16)


DECODE_POS = 100  # the decode rows' position (their keys: 0..DECODE_POS)


def decode_rows(kv: KVCacheManager, rows: int) -> StepBatch:
    """A decode step: sequences 1..rows (their blocks reserved), one token each at DECODE_POS + i, each
    wanting its logits row."""
    parts = []
    for s in range(1, rows + 1):
        t = kv.tables(s)
        parts.append((SeqSlice(s, 0, 0, DECODE_POS + s, t.global_table, t.local_table), [100 + 7 * s], True))
    return StepBatch.build(parts, 16)


def time_step(model, batch: StepBatch, reps: int) -> tuple[float, float]:
    """(seconds of the first call, median seconds of the next ``reps``)."""
    t0 = time.perf_counter()
    model.forward_argmax(batch)
    first = time.perf_counter() - t0
    walls = []
    for _ in range(reps):
        t0 = time.perf_counter()
        model.forward_argmax(batch)
        walls.append(time.perf_counter() - t0)
    return first, float(np.median(walls)) if walls else first


def kernel_table(rec) -> list[tuple[str, int, float]]:
    """(kernel, dispatches, GPU ms) of the last replay of ``rec``, slowest first."""
    times = rec.gpu_times()
    ms, count = collections.Counter(), collections.Counter()
    for label, ns in times["commands"]:
        ms[label] += ns / 1e6
        count[label] += 1
    return [(k, count[k], v) for k, v in ms.most_common()]


def bench(path, backend, sizes, reps, top, options=None, decode=()):
    """{step name: its times (and kernels)} of the prefill ``sizes`` and the ``decode`` row counts."""
    opts = {"timestamps": True, **(options or {})} if backend == "vulkan" else {}
    model = load_model(path, backend, **opts)
    be, out = model.backend, {}
    rows = max(decode, default=0)
    longest = max(max(sizes, default=0), DECODE_POS + 2 * rows + 2)
    layout = KVLayout.plan(model.config, (rows + 1) * (longest + 64), rows + 1, longest)
    be.alloc_kv(layout)
    kv = KVCacheManager(layout)
    kv.reserve(0, max(sizes, default=1) + 16)
    for s in range(1, rows + 1):
        kv.reserve(s, DECODE_POS + rows + 1)
    steps = [(n, f"{n} tokens", one_sequence(kv, layout, n)) for n in sizes]
    steps += [(r, f"decode {r}", decode_rows(kv, r)) for r in decode]
    for n, name, batch in steps:
        first, wall = time_step(model, batch, reps)
        row: dict = {"first_s": first, "wall_s": wall}
        if backend == "vulkan":
            row["bucket"] = bucket(n)
            row["kernels"] = kernel_table(list(be.graphs.values())[-1].rec)  # the graph just replayed
            row["gpu_s"] = sum(ms for _, _, ms in row["kernels"]) / 1e3
        out[name] = row
        print(f"{backend} {name}: first call {first:.2f} s, step {wall:.3f} s", flush=True)
        for name, k, ms in row.get("kernels", [])[:top]:
            print(f"    {name:<44} {k:5d} x  {ms:10.1f} ms  ({ms / 1e3 / row['gpu_s']:.0%})", flush=True)
    if backend == "vulkan":
        out["device"] = be.device
        be.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", help="a GGUF path, or 'default' (the embedded 270M)")
    ap.add_argument("--tokens", default="1,16,256", help="step sizes, comma-separated ('' for none)")
    ap.add_argument("--decode", default="", help="decode steps: row counts, comma-separated")
    ap.add_argument("--reps", type=int, default=1, help="timed replays after the recording step")
    ap.add_argument("--top", type=int, default=12, help="kernels shown per step size")
    ap.add_argument("--numpy", action="store_true", help="the numpy backend's step times too")
    ap.add_argument("--out", help="write the results here as JSON")
    ap.add_argument("--option", action="append", default=[], help="a Vulkan option, NAME=VALUE (repeatable)")
    args = ap.parse_args()
    sizes = [int(s) for s in args.tokens.split(",") if s]
    decode = [int(s) for s in args.decode.split(",") if s]
    options = dict(_option(o) for o in args.option)
    res = {"vulkan": bench(args.model, "vulkan", sizes, args.reps, args.top, options, decode)}
    if args.numpy:
        res["numpy"] = bench(args.model, "cpu", sizes, args.reps, args.top, decode=decode)
    head = f"\n{'step':>10} {'bucket':>6} {'vulkan step s':>14} {'gpu s':>8}"
    print(head + (" numpy s" if args.numpy else ""))
    for name, v in res["vulkan"].items():
        if name == "device":
            continue
        line = f"{name:>10} {v['bucket']:>6} {v['wall_s']:>14.3f} {v['gpu_s']:>8.3f}"
        print(line + (f" {res['numpy'][name]['wall_s']:>7.3f}" if args.numpy else ""))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    return 0


def _option(text: str) -> tuple[str, object]:
    """``NAME=VALUE`` -> (name, value as an int, a bool or the string)."""
    name, _, value = text.partition("=")
    if value.lstrip("-").isdigit():
        return name, int(value)
    return name, {"true": True, "false": False}.get(value, value)


if __name__ == "__main__":
    raise SystemExit(main())
