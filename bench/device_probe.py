#!/usr/bin/env python3
"""What the Vulkan device offers the shaders: name, driver, heaps, capabilities, cooperative-matrix shapes.

python3 bench/device_probe.py [--out probe.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "daemon"))

from hmad.backends.vulkan.device import Device  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with Device() as dev:
        d = dev.describe()
        d["subgroup"] = dev.info.subgroup
        d["coopmat_shapes"] = dev.info.coopmat_shapes
        d["extensions"] = sorted(e for e in dev.info.extensions if "cooperative" in e or "dot" in e)
    print(json.dumps({k: d[k] for k in ("name", "driver", "capabilities", "subgroup", "limits")}, indent=1))
    for s in d["coopmat_shapes"]:
        print("coopmat", s)
    if args.out:
        Path(args.out).write_text(json.dumps(d, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
