"""Fake NPU kernel installs and the environment that points hmad's NPU runtime at tests/fake_pyxrt.py."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hmad.backends.npu.kernels import CATALOGUE, manifest_entry, write_manifest

TESTS_DIR = Path(__file__).resolve().parent


def write_fake_kernels(root: Path, family: str = "npu1", names: list[str] | None = None) -> Path:
    """``root/<family>/``: a fake xclbin (JSON naming the kernel), an instruction stream and the manifest
    for each kernel in ``names`` (default: the whole catalogue). Returns ``root`` (the npu.xclbin_dir)."""
    d = Path(root) / family
    d.mkdir(parents=True, exist_ok=True)
    entries = {}
    for name in names or list(CATALOGUE):
        (d / f"{name}.xclbin").write_text(json.dumps({"fake_xclbin": name}))
        np.arange(1, 97, dtype=np.uint32).tofile(d / f"{name}.insts.bin")
        entries[name] = manifest_entry(CATALOGUE[name], f"{name}.xclbin", f"{name}.insts.bin")
    write_manifest(d, family, entries)
    return Path(root)


@dataclass
class FakeNpu:
    """What a test gets from the ``fake_npu`` fixture: the fake's record, the kernel dir, the accel dir."""

    kernels: Path
    accel: Path

    @property
    def state(self):
        import fake_pyxrt

        return fake_pyxrt.STATE

    def fail(self, **failures):
        """Reset the fake with these failure modes and forget the process's device (so the next open
        sees them)."""
        import fake_pyxrt

        from hmad.backends.npu.xrt import forget_device

        forget_device()
        return fake_pyxrt.reset(**failures)

    def env(self, **failures) -> dict[str, str]:
        """Environment for a daemon subprocess that should run on the fake (``failures`` as HMAD_FAKE_XRT)."""
        path = os.pathsep.join(filter(None, [str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]))
        fail = ",".join(f"{k}={v}" for k, v in failures.items())
        return {"HMAD_PYXRT": "fake_pyxrt", "HMAD_ACCEL_DIR": str(self.accel), "PYTHONPATH": path,
                "HMAD_FAKE_XRT": fail}  # fmt: skip
