#!/usr/bin/env python3
"""Vulkan memory bandwidth: the ceilings every decode/prefill bandwidth figure is reported against.

For each variant (shaders/copy.comp and shaders/read.comp: vec4 loads, UNROLL in flight) and workgroup size,
records ``--iters`` passes over ``--mib`` MiB into one command buffer with a timestamp after each and reports
GB/s = bytes moved / median GPU time per pass: 2 x the size for a copy (read + write), 1 x for a read (what a
decode step does with its weights). A GPU idles at low clocks and a submit of a few milliseconds does not
raise them, so the buffer is first submitted for ``--warm-s`` seconds untimed, then for ``--seconds`` timed,
with the clocks sampled meanwhile (bench/gpu_clocks.py); the first submit's figure is kept as ``cold_GBps``.
Also: the empty submit + fence round trip, and host writes into mapped memory through a numpy view.
``--memory host`` puts the source in the host-visible pool (dGPU system heap / APU GTT) to measure that path.
``--fill zero`` copies zeros instead of random bytes: GPUs that compress memory traffic (NVIDIA since
Ampere) move zeros faster than data, so the ceiling for weights is the random one (the default).

    python3 bench/bench_vulkan_copy.py --mib 1024 --iters 20 --out result.json
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
from hmad.backends.vulkan.push import CopyPush  # noqa: E402
from hmad.backends.vulkan.recorder import CommandRecorder  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_clocks import ClockLog, describe, max_clocks  # noqa: E402


def copy_ranges(src, dst, max_range: int) -> list[tuple[tuple, tuple, int]]:
    """Pair up bind ranges of src and dst (a copy bigger than maxStorageBufferRange is several dispatches)."""
    return [
        ((src, so, n), (dst, do, n), n)
        for (so, n), (do, _) in zip(src.ranges(max_range), dst.ranges(max_range), strict=True)
    ]


def pass_times(rec, iters: int, pieces: int) -> np.ndarray:
    """GPU nanoseconds of each of the ``iters`` passes of the last submit of ``rec``."""
    t = rec.gpu_times()
    return np.array([ns for _, ns in t["commands"]]).reshape(iters, pieces).sum(axis=1)


def bench_variant(dev, name, block, src, dst, iters, warm_s: float = 0.0, seconds: float = 0.0) -> dict:
    """GB/s of one variant: ``cold`` is the first submit of the variant (the clocks as the GPU had them);
    then submits run for ``warm_s`` seconds untimed (clocks up), then for ``seconds`` timed, their passes'
    median reported with the clocks sampled meanwhile (at least one timed submit either way)."""
    k = Kernel(dev, name, block_size=block)
    unroll = int(name.rsplit("_x", 1)[1]) if "_x" in name else 1
    moved = src.nbytes * (1 if name.startswith("read") else 2)  # read.comp: read only; copy: read + write
    max_x = dev.limits["maxComputeWorkGroupCount"][0]
    rec = CommandRecorder(dev, timestamps=True, max_commands=iters * 64).begin()
    pieces = copy_ranges(src, dst, dev.limits["maxStorageBufferRange"] // 4096 * 4096)
    for _ in range(iters):
        for a, b, n in pieces:
            groups = min(max_x, -(-(n // 16) // (block * unroll)))
            rec.dispatch(k, [a, b], CopyPush(n // 16), groups, "copy")
    rec.end()
    rec.submit()
    cold = pass_times(rec, iters, len(pieces))
    t_end = time.perf_counter() + warm_s
    while time.perf_counter() < t_end:
        rec.submit()
    per, host_s = [], []
    with ClockLog(f"vulkan {name}") as clk:
        t_end = time.perf_counter() + seconds
        while not per or time.perf_counter() < t_end:
            host_s.append(rec.submit())
            per.append(pass_times(rec, iters, len(pieces)))
    rec.close()
    k.close()
    per = np.concatenate(per)
    med = float(np.median(per))
    return {
        "variant": name,
        "block": block,
        "median_ms": med / 1e6,
        "GBps": moved / med,
        "best_GBps": moved / float(per.min()),
        "cold_GBps": moved / float(np.median(cold)),
        "host_GBps": moved * iters / (float(np.median(host_s)) * 1e9),
        "passes": int(per.size),
        "clocks": clk.summary,
    }


VARIANTS = tuple(f"{kind}_vec4{u}" for kind in ("copy", "read") for u in ("", "_x4", "_x8"))


def source_bytes(nbytes: int, fill: str) -> np.ndarray:
    """What the source holds: random bytes (incompressible, like weights) or zeros."""
    if fill == "zero":
        return np.zeros(nbytes, np.uint8)
    return np.random.default_rng(0).integers(0, 255, nbytes, np.uint8)


def fill_buffer(dev, buf, data: np.ndarray) -> float:
    """Upload ``data`` into ``buf`` through a staging buffer; returns the host's mapped-write GB/s."""
    staging = create_buffer(dev, buf.nbytes, "upload", "staging")
    t0 = time.perf_counter()
    staging.host[:] = data
    gbps = buf.nbytes / (time.perf_counter() - t0) / 1e9
    rec = CommandRecorder(dev).begin()
    rec.copy(staging, buf)
    rec.end()
    rec.submit()
    rec.close()
    staging.arena.close()
    return gbps


def ceilings(runs: list[dict]) -> dict:
    """The best copy (read + write) and read-only GB/s of bench_variant results."""
    best = {
        k: max((r["GBps"] for r in runs if r["variant"].startswith(k)), default=0.0) for k in ("copy", "read")
    }
    return {"ceiling_GBps": best["copy"], "read_ceiling_GBps": best["read"]}


def submit_round_trip(dev, n=200) -> float:
    rec = CommandRecorder(dev).begin().end()
    rec.submit()
    t0 = time.perf_counter()
    for _ in range(n):
        rec.submit()
    rec.close()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default=None, help="index or name substring (default: best GPU)")
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--blocks", default="256")
    ap.add_argument(
        "--memory", choices=["device", "host"], default="device", help="pool of the source buffer"
    )
    ap.add_argument("--fill", choices=["random", "zero"], default="random", help="what the source holds")
    ap.add_argument("--warm-s", type=float, default=3.0, help="untimed submits first, clocks up (0: none)")
    ap.add_argument("--seconds", type=float, default=1.0, help="timed submits for this long (0: one)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = Device(args.device)
    nbytes = args.mib << 20
    src = create_buffer(dev, nbytes, args.memory, "src")
    dst = create_buffer(dev, nbytes, "device", "dst")
    res = {"device": dev.describe(), "mib": args.mib, "memory": args.memory, "fill": args.fill, "runs": []}
    res.update(date=time.strftime("%F"), warm_s=args.warm_s, seconds=args.seconds, **max_clocks())
    host_arr = source_bytes(nbytes, args.fill)
    res["host_write_mapped_GBps"] = fill_buffer(dev, src, host_arr)
    res["submit_round_trip_us"] = submit_round_trip(dev)
    for name in args.variants.split(","):
        for block in map(int, args.blocks.split(",")):
            r = bench_variant(dev, name, block, src, dst, args.iters, args.warm_s, args.seconds)
            res["runs"].append(r)
            print(
                f"{name:14s} block {block:4d}: {r['GBps']:8.1f} GB/s (best {r['best_GBps']:.1f}, "
                f"first submit {r['cold_GBps']:.1f}), {describe(r['clocks'])}",
                flush=True,
            )
    check = create_buffer(dev, nbytes, "readback", "check")
    rec = CommandRecorder(dev).begin()
    rec.copy(dst, check)
    rec.end()
    rec.submit()
    rec.close()
    res["last_copy_correct"] = bool(np.array_equal(check.host, host_arr))
    res.update(ceilings(res["runs"]))
    print(
        f"{res['device']['name']}, {args.fill} bytes: copy ceiling {res['ceiling_GBps']:.1f} GB/s (read + "
        f"write), read-only {res['read_ceiling_GBps']:.1f} GB/s; submit round trip "
        f"{res['submit_round_trip_us']:.0f} us; mapped host writes {res['host_write_mapped_GBps']:.1f} GB/s; "
        f"correct={res['last_copy_correct']}"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    for b in (src, dst, check):
        b.arena.close()
    dev.close()
    return 0 if res["last_copy_correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
