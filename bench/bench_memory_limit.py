#!/usr/bin/env python3
"""The GPU memory's own bandwidth, measured without any kernel of hmad's: the limit every decode figure
is compared with.

    python3 bench/bench_memory_limit.py [--mib 2048] [--seconds 2] [--warm-s 3] [--json out.json]

NVIDIA: the CUDA runtime's ``cudaMemcpy`` device to device (``libcudart`` from the PyPI wheel
``nvidia-cuda-runtime-cu12``, called through ctypes; the driver's libcuda is on the machine), timed with
CUDA events. Its figure counts read + write (2 x the size a copy), as memory traffic; a decode step's
traffic is its weights read once. The source holds random bytes (NVIDIA compresses zeros), a copy of
zeros is measured beside it. The timed copies run for ``--seconds``; before them, copies run for
``--warm-s`` seconds so the clocks are up, and the clocks are recorded while the timed ones run
(bench/gpu_clocks.py).

Other GPUs (the Radeon 780M): no vendor-independent way to move memory without a kernel of ours exists in
this bench yet; it reports ``{"available": false}`` and the reason, and the Vulkan read ceiling
(bench_vulkan_copy.py) is the only figure there.
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_clocks import ClockLog, describe, max_clocks  # noqa: E402

D2D, H2D = 3, 1  # cudaMemcpyKind


def load_cudart() -> ctypes.CDLL:
    """libcudart from the nvidia-cuda-runtime-cu12 wheel (on sys.path), else the system's."""
    for base in sys.path:
        for path in glob.glob(f"{base}/nvidia/cuda_runtime/lib/libcudart.so*"):
            return ctypes.CDLL(path)
    return ctypes.CDLL("libcudart.so.12")


class Cuda:
    """The few runtime calls this bench needs; ``check`` turns a status code into an error."""

    def __init__(self):
        self.rt = load_cudart()

    def check(self, status: int, what: str) -> None:
        if status != 0:
            self.rt.cudaGetErrorString.restype = ctypes.c_char_p
            raise RuntimeError(f"{what}: {self.rt.cudaGetErrorString(status).decode()} ({status})")

    def malloc(self, nbytes: int) -> ctypes.c_void_p:
        p = ctypes.c_void_p()
        self.check(self.rt.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(nbytes)), "cudaMalloc")
        return p

    def copy(self, dst, src, nbytes: int, kind: int) -> None:
        self.check(self.rt.cudaMemcpy(dst, src, ctypes.c_size_t(nbytes), kind), "cudaMemcpy")

    def event(self) -> ctypes.c_void_p:
        e = ctypes.c_void_p()
        self.check(self.rt.cudaEventCreate(ctypes.byref(e)), "cudaEventCreate")
        return e

    def elapsed_ms(self, a, b) -> float:
        self.check(self.rt.cudaEventSynchronize(b), "cudaEventSynchronize")
        ms = ctypes.c_float()
        self.check(self.rt.cudaEventElapsedTime(ctypes.byref(ms), a, b), "cudaEventElapsedTime")
        return ms.value

    def device_name(self) -> str:
        buf = ctypes.create_string_buffer(1032)  # cudaDeviceProp starts with char name[256]
        self.check(self.rt.cudaGetDeviceProperties(buf, 0), "cudaGetDeviceProperties")
        return buf.value.decode()


def timed_copies(cu: Cuda, dst, src, nbytes: int, iters: int) -> list[float]:
    """Milliseconds of each of ``iters`` device-to-device copies (CUDA events around each)."""
    times = []
    for _ in range(iters):
        a, b = cu.event(), cu.event()
        cu.rt.cudaEventRecord(a, None)
        cu.rt.cudaMemcpyAsync(dst, src, ctypes.c_size_t(nbytes), D2D, None)
        cu.rt.cudaEventRecord(b, None)
        times.append(cu.elapsed_ms(a, b))
        cu.rt.cudaEventDestroy(a)
        cu.rt.cudaEventDestroy(b)
    return times


def measure(cu: Cuda, nbytes: int, seconds: float, warm_s: float, fill: str) -> dict:
    src, dst = cu.malloc(nbytes), cu.malloc(nbytes)
    host = (
        np.zeros(nbytes, np.uint8)
        if fill == "zero"
        else np.random.default_rng(0).integers(0, 255, nbytes, np.uint8)
    )
    cu.copy(src, host.ctypes.data_as(ctypes.c_void_p), nbytes, H2D)
    t_end = time.perf_counter() + warm_s
    while time.perf_counter() < t_end:  # clocks up before anything is timed
        cu.copy(dst, src, nbytes, D2D)
    ms: list[float] = []
    with ClockLog(f"cudaMemcpy {fill}") as clk:
        t_end = time.perf_counter() + seconds  # long enough for the clock sampler to see it
        while time.perf_counter() < t_end:
            ms += timed_copies(cu, dst, src, nbytes, 10)
    cu.rt.cudaFree(src)
    cu.rt.cudaFree(dst)
    med = statistics.median(ms)
    return {
        "fill": fill,
        "bytes": nbytes,
        "copies": len(ms),
        "median_ms": med,
        "GBps_read_plus_write": 2 * nbytes / (med * 1e6),
        "best_GBps_read_plus_write": 2 * nbytes / (min(ms) * 1e6),
        "clocks": clk.summary,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=2048)
    ap.add_argument("--seconds", type=float, default=2.0, help="how long the timed copies run")
    ap.add_argument("--warm-s", type=float, default=3.0)
    ap.add_argument("--json")
    a = ap.parse_args()
    out: dict = {"date": time.strftime("%F"), "method": "cudaMemcpy device to device", **max_clocks()}
    try:
        cu = Cuda()
        out["device"] = cu.device_name()
    except (OSError, RuntimeError) as e:
        out.update(available=False, reason=f"no CUDA runtime or device: {e}")
        print(json.dumps(out))
        return 0
    out["available"] = True
    out["runs"] = [measure(cu, a.mib << 20, a.seconds, a.warm_s, fill) for fill in ("random", "zero")]
    for r in out["runs"]:
        print(
            f"{out['device']}: cudaMemcpy D2D of {r['fill']} bytes {r['GBps_read_plus_write']:,.0f} GB/s "
            f"(read + write; best {r['best_GBps_read_plus_write']:,.0f}), {describe(r['clocks'])}",
            flush=True,
        )
    out["memory_GBps"] = out["runs"][0]["GBps_read_plus_write"]
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
