#!/usr/bin/env python3
"""The engine's host work per step, by phase, beside the device's submit + wait: one greedy stream at a time.

    python3 bench/bench_host_step.py --model M.gguf [--prompt 128] [--gen 128] [--reps 2] [--pipeline on,off]

Runs the daemon's engine loop in-process on the Vulkan backend (EngineThread.turn: drain, step, snapshot
and publish, with the scheduler and backend the daemon builds) and times each phase by wrapping the methods
that run it: the wrappers only read the clock (the work is the real one). ``submit.wait`` is the backend's
fence wait; everything else is host work. With engine.pipeline off the device waits for that host work between
steps; on, the next step is on the device while it runs, so the step time is about the larger of the two.
Printed per step (microseconds, means over the run's steps), per repetition, per pipeline setting.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("daemon", "client")]

from hmad.composition import load_model  # noqa: E402
from hmad.engine import batch as batchmod  # noqa: E402
from hmad.engine.request import Request  # noqa: E402
from hmad.engine.sampling import SamplingParams  # noqa: E402
from hmad.engine.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from hmad.engine.worker import EngineThread  # noqa: E402

# (object attribute holding it, method, label)
PHASES = [
    ("scheduler", "_retire_cancelled", None),
    ("scheduler", "_admit", None),
    ("scheduler", "_plan", None),
    ("scheduler", "_take_ids", None),
    ("scheduler", "_release_finished", None),
    ("scheduler", "status", None),
    ("kv", "prepare", "kv.prepare"),
    ("kv", "commit", "kv.commit"),
    ("kv", "usage", "kv.usage"),
    ("backend", "run", "backend.run (metadata pack)"),
    ("submit", "launch", "backend.submit.launch (metadata copy, submit)"),
    ("submit", "wait", "backend.submit.wait (fence wait)"),
    ("engine", "_update_snapshot", "engine snapshot"),
    ("engine", "_publish", "engine publish"),
    ("engine", "_drain_commands", "engine drain"),
]


def timed(acc: dict, label: str, f):
    def w(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[label] += time.perf_counter() - t

    return w


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--pipeline", default="on,off", help="engine.pipeline settings to run, in turn")
    a = ap.parse_args()
    model = load_model(a.model, "vulkan")
    acc: dict[str, float] = collections.defaultdict(float)
    for owner, name, label in [p for p in PHASES if p[0] in ("backend", "submit")]:  # once, for every run
        obj = model.backend.submit if owner == "submit" else model.backend
        setattr(obj, name, timed(acc, label, getattr(obj, name)))
    batchmod.StepBatch.build = timed(acc, "StepBatch.build", batchmod.StepBatch.build)
    for mode in a.pipeline.split(","):
        cfg = SchedulerConfig(max_seqs=32, kv_tokens=32768, pipeline=mode == "on")
        print(f"engine.pipeline {mode}")
        run(model, Scheduler(model, cfg), acc, a)
    model.backend.close()


def run(model, sched: Scheduler, acc: dict, a) -> None:
    """``a.reps`` one-stream generations through the engine loop, each phase timed."""
    sched.prepare()
    eng = EngineThread(sched, lambda: None)
    owners = {"scheduler": sched, "kv": sched.kv, "engine": eng}
    for owner, name, label in PHASES:
        if owner in owners:
            obj = owners[owner]
            setattr(obj, name, timed(acc, label or name, getattr(obj, name)))
    greedy = SamplingParams(temperature=0.0, max_tokens=a.gen, stop=[])
    for rep in range(a.reps):
        acc.clear()
        prompt = [2] + [300 + (7 * j + rep) % 90 for j in range(a.prompt - 1)]
        sched.submit(Request(rep, prompt, greedy))
        t0, steps = time.perf_counter(), 0
        while sched.has_work():  # the engine thread's loop, in this thread
            eng.turn()
            steps += 1
        wall = time.perf_counter() - t0
        wait = acc["backend.submit.wait (fence wait)"]
        per = 1e6 / steps
        print(f"rep {rep}: {steps} steps, {wall * per:.0f} us a step, host work {(wall - wait) * per:.0f}")
        for label, s in sorted(acc.items(), key=lambda kv: -kv[1]):
            print(f"   {label:38s} {s / steps * 1e6:8.1f} us/step")


if __name__ == "__main__":
    main()
