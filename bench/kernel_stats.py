#!/usr/bin/env python3
"""The driver's compile statistics of kernels (VK_KHR_pipeline_executable_properties): register count and
whatever else the driver reports (NVIDIA: registers, code size, ...), to tell a register-bound or spilling
kernel from a latency-bound one without a profiler. Kernels matching any of the given substrings (all when
none); prints one line per kernel and writes JSON with ``--out``.

    python3 bench/kernel_stats.py mul_mat_vec_q4_k mul_mm_coopmat_q4_k --out stats.json   # device machine
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))

from hmad.backends.vulkan.device import Device  # noqa: E402
from hmad.backends.vulkan.pipelines import Kernel  # noqa: E402
from hmad.backends.vulkan.registry import KERNELS  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("match", nargs="*", help="substrings of kernel names")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = Device(pipeline_stats=True)
    if not dev.pipeline_stats:
        print(f"{dev.name}: no VK_KHR_pipeline_executable_properties")
        return 1
    res = {"device": dev.name, "kernels": {}}
    for name in sorted(KERNELS):
        if args.match and not any(m in name for m in args.match):
            continue
        k = Kernel(dev, name)
        st = res["kernels"][name] = k.statistics()
        k.close()
        print(f"{name:34s} " + "  ".join(f"{n}={v}" for n, v in st.items()), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    dev.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
