#!/usr/bin/env python3
"""Two versions of hmad's engine steps side by side, from alternated bench_vulkan_model.py runs of one call.

    python3 bench/compare_ab.py --a old_1.json old_2.json --b new_1.json new_2.json [--names before,after]

Each file is one ``bench_vulkan_model.py --engine none`` run; the runs of a version are alternated with the
other's on the same GPU (bench/device_ab.sh), so clocks and thermal state are shared. Per model and step
(prefill 512, decode at 1/8/16/32 sequences) it prints every run's tokens/s, the medians and b / a.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def steps(paths: list[Path]) -> dict[tuple[str, str], list[float]]:
    """(model, step) -> tokens/s of each run."""
    out: dict[tuple[str, str], list[float]] = {}
    for p in paths:
        for model, m in json.loads(p.read_text())["models"].items():
            for step, r in m.get("steps", {}).items():
                out.setdefault((model, step), []).append(r["tok_s"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", nargs="+", type=Path, required=True)
    ap.add_argument("--b", nargs="+", type=Path, required=True)
    ap.add_argument("--names", default="a,b")
    a = ap.parse_args()
    na, nb = a.names.split(",")
    sa, sb = steps(a.a), steps(a.b)
    print(f"| model | step | {na} tok/s (runs) | {nb} tok/s (runs) | {nb} / {na} |\n|---|---|---|---|---|")
    for key in sorted(sa.keys() & sb.keys()):
        ma, mb = statistics.median(sa[key]), statistics.median(sb[key])
        runs_a = ", ".join(f"{x:,.0f}" for x in sa[key])
        runs_b = ", ".join(f"{x:,.0f}" for x in sb[key])
        print(f"| {key[0]} | {key[1]} | {ma:,.1f} ({runs_a}) | {mb:,.1f} ({runs_b}) | {mb / ma:.3f} |")


if __name__ == "__main__":
    main()
