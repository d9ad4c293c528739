#!/usr/bin/env python3
"""Where hmad's load time goes, in-process: load_model under cProfile, then the scheduler's KV pools and the
recording of every step bucket the configuration can reach.

    python3 bench/bench_load.py --gguf MODEL.gguf [--backend vulkan] [--max-seqs 32] [--json out.json]

Prints the phases with their seconds, the top functions by cumulative and by own time, and the time to
record each (tokens, logit rows) bucket.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "daemon")]

from hmad.composition import load_model  # noqa: E402
from hmad.engine.scheduler import Scheduler, SchedulerConfig  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--backend", default="vulkan")
    ap.add_argument("--max-seqs", type=int, default=32)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--json")
    a = ap.parse_args()
    marks: list[tuple[float, str]] = []
    t0 = time.perf_counter()
    prof = cProfile.Profile()
    prof.enable()
    model = load_model(a.gguf, a.backend, progress=lambda m, *_: marks.append((time.perf_counter() - t0, m)))
    prof.disable()
    out: dict = {"gguf": a.gguf, "load_s": time.perf_counter() - t0, "marks": marks}
    for t, m in marks:
        print(f"{t:8.2f} s  {m}")
    for key in ("cumulative", "tottime"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(a.top)
        out[f"profile_{key}"] = s.getvalue()
        print(s.getvalue())
    t1 = time.perf_counter()
    sched = Scheduler(model, SchedulerConfig(max_seqs=a.max_seqs))
    out["scheduler_s"] = time.perf_counter() - t1
    print(f"scheduler (KV pools): {out['scheduler_s']:.2f} s")
    t1 = time.perf_counter()
    sched.prepare()
    out["prepare_s"] = time.perf_counter() - t1
    graphs = len(getattr(model.backend, "graphs", {}))
    print(f"prepare (every reachable bucket made ready): {out['prepare_s']:.2f} s, {graphs} graphs")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
