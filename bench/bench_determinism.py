#!/usr/bin/env python3
"""The price of batch invariance (engine.deterministic): the same steps with it off and on, in one process.

Per model: decode steps of 1, 8 and 32 sequences (at position context/2) and one 512-token prefill step,
greedy argmax as the scheduler runs greedy requests; wall time per step, the median over ``--rounds`` x
``--reps`` steps (prefill: a quarter of the reps). Drift on a shared machine hits both modes alike: on the
cpu backend the steps alternate off, on, off, on; on vulkan (every bucket recorded again per mode) the
modes alternate by rounds.
Models: the Gemma 3 shapes of bench_vulkan_model.py (``write_model``: synthetic 270M and 27B files in
``--dir``), or a real file of a shape (``--gguf 270m=PATH``).

    python3 bench/bench_determinism.py --backend cpu --models 270m --gguf 270m=~/.cache/hmad/models/...
    python3 bench/bench_determinism.py --backend vulkan --models 270m,27b --out result.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "daemon"), str(ROOT / "bench")]

from bench_vulkan_model import make_batch, write_model  # noqa: E402

from hmad.composition import load_model  # noqa: E402
from hmad.engine.kvcache import KVCacheManager, KVLayout  # noqa: E402

STEPS = {"decode_1": (1, 1), "decode_8": (8, 1), "decode_32": (32, 1), "prefill_512": (1, 512)}


def set_mode(model, on: bool) -> None:
    be = model.backend
    be.deterministic = on
    if hasattr(be, "recorded"):  # a recording backend records every bucket again
        be.recorded.drop()


def time_steps(model, batch, reps: int, warm: bool = True) -> list[float]:
    """Milliseconds of ``reps`` steps (after one untimed step that records the bucket on vulkan)."""
    if warm:
        model.forward_argmax(batch)
    wall = []
    for _ in range(reps):
        t0 = time.perf_counter()
        model.forward_argmax(batch)
        wall.append(1e3 * (time.perf_counter() - t0))
    return wall


def reps_of(step: str, args) -> int:
    return max(2, args.reps // 4) if step.startswith("prefill") else args.reps


def report(name: str, what: str, times: dict, mode: str) -> None:
    cells = ", ".join(f"{k} {np.median(v[mode]):.2f} ms" for k, v in times.items())
    print(f"  {name} {what}: {cells}", flush=True)


def bench_model(name: str, args) -> dict:
    real = args.gguf.get(name)
    path = Path(real).expanduser() if real else write_model(Path(args.dir) / f"synthetic-{name}.gguf", name)
    model = load_model(path, args.backend, deterministic=False)
    layout = KVLayout.plan(model.config, 32 * args.context, 32, 512)
    model.backend.alloc_kv(layout)
    kv = KVCacheManager(layout)
    for sid in range(32):
        kv.reserve(sid, args.context)
    batches = {
        k: make_batch(kv, layout, s, t, 0 if t > 1 else args.context // 2) for k, (s, t) in STEPS.items()
    }
    times: dict[str, dict[str, list[float]]] = {k: {"off": [], "on": []} for k in STEPS}
    if hasattr(model.backend, "recorded"):  # recordings per mode: whole rounds, off then on
        for r in range(args.rounds):
            for mode in ("off", "on"):
                set_mode(model, mode == "on")
                for k, b in batches.items():
                    times[k][mode] += time_steps(model, b, reps_of(k, args))
                report(name, f"round {r} {mode}", times, mode)
    else:  # the mode is a flag read per op: step by step, off and on alternately
        for k, b in batches.items():
            for _ in range(args.rounds * reps_of(k, args)):
                for mode in ("off", "on"):
                    set_mode(model, mode == "on")
                    times[k][mode] += time_steps(model, b, 1, warm=False)
        set_mode(model, False)
    out = {"file": str(path) if real else "synthetic", "device": model.backend.device, "steps": {}}
    for k, v in times.items():
        off, on = float(np.median(v["off"])), float(np.median(v["on"]))
        out["steps"][k] = {"off_ms": off, "on_ms": on, "cost": on / off - 1}
        print(f"{name} {k}: off {off:.2f} ms, on {on:.2f} ms per step: {on / off - 1:+.1%}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="vulkan", choices=["cpu", "vulkan"])
    ap.add_argument("--models", default="270m,27b")
    ap.add_argument("--gguf", action="append", default=[], help="NAME=PATH: a real file of shape NAME")
    ap.add_argument("--dir", default="/tmp", help="where synthetic models are written")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out")
    args = ap.parse_args()
    args.gguf = dict(g.split("=", 1) for g in args.gguf)
    res = {"date": time.strftime("%Y-%m-%d"), "backend": args.backend, "models": {}}
    for name in args.models.split(","):
        res["models"][name] = bench_model(name, args)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
