#!/usr/bin/env python3
"""What one dispatch costs inside a recorded command buffer: dependent (a barrier before each) vs independent.

A decode step of a small model is hundreds of tiny dispatches, so their fixed cost bounds tokens/s. This
records ``--n`` dispatches of ``add_f32`` over ``--elems`` floats into one command buffer in three ways:
``chain`` (each reads the previous one's output: the recorder puts a barrier before each), ``independent``
(each writes its own output: no barriers), ``single`` (one dispatch: the submit + fence round trip). Each is
submitted ``--reps`` times; reported per dispatch: (median host time of submit + wait - single) / n.

    python3 bench/bench_vulkan_dispatch.py --out result.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))

from hmad.backends.vulkan.device import Device  # noqa: E402
from hmad.backends.vulkan.memory import create_buffer  # noqa: E402
from hmad.backends.vulkan.pipelines import Kernel  # noqa: E402
from hmad.backends.vulkan.push import AddPush  # noqa: E402
from hmad.backends.vulkan.recorder import CommandRecorder  # noqa: E402


def timed(rec: CommandRecorder, reps: int) -> float:
    rec.submit()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        rec.submit()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def record(dev, k, bufs, n: int, elems: int, chain: bool) -> CommandRecorder:
    rec = CommandRecorder(dev, max_commands=n + 1).begin()
    for i in range(n):
        if chain:  # out_i = out_{i-1} + a: every dispatch depends on the one before
            src, dst = bufs[i % 2], bufs[(i + 1) % 2]
        else:  # out_i = a + a, each into its own buffer
            src, dst = bufs[0], bufs[2 + i]
        rec.dispatch(k, [src, bufs[0], dst], AddPush(elems), max(1, -(-elems // 256)))
    return rec.end()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--elems", type=int, default=640)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = Device()
    k = Kernel(dev, "add_f32")
    bufs = [create_buffer(dev, 4 * args.elems, "device") for _ in range(args.n + 2)]
    res = {"device": dev.name, "n": args.n, "elems": args.elems}
    single = record(dev, k, bufs, 1, args.elems, False)
    res["single_submit_us"] = 1e6 * timed(single, args.reps)
    for mode in ("chain", "independent"):
        rec = record(dev, k, bufs, args.n, args.elems, mode == "chain")
        t = timed(rec, args.reps)
        res[mode] = {
            "barriers": rec.barriers,
            "us_per_dispatch": 1e6 * (t - res["single_submit_us"] / 1e6) / args.n,
        }
        rec.close()
        print(f"{mode:12s}: {res[mode]['us_per_dispatch']:.2f} us/dispatch ({rec.barriers} barriers)")
    print(f"submit + fence round trip (one dispatch): {res['single_submit_us']:.1f} us")
    single.close()
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    for b in bufs:
        b.arena.close()
    k.close()
    dev.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
