"""XRT access: the one module that imports pyxrt, finds the NPU and opens it, once per process.

Two seams, both logged loudly when used, never taken silently:

- ``HMAD_PYXRT``: the module imported instead of ``pyxrt`` (the tests use ``fake_pyxrt``, an XRT stand-in
  that runs each kernel with its numpy reference);
- ``HMAD_ACCEL_DIR``: where the accel nodes live (default ``/dev/accel``).

Known behaviour of the Phoenix NPU (npu1) that shapes this runtime (none of it measured here: no NPU has run
this code):

- the device handle is cheap, hardware contexts are not: ~35 ms each and rationed system-wide (npu1: 6,
  npu2: 16 per mlir-aie PR #3526 and the amdxdna driver's ``hwctx_limit``; amd/Triton-XDNA PR #113 measured
  35 ms per ``hw_context`` and saw ``DRM_IOCTL_AMDXDNA_CREATE_HWCTX IOCTL failed (err=-22)`` past the limit).
  So: one device and one context per xclbin for the process's life (``NpuDevice.contexts``);
- opening the device can fail transiently (``No such device with index '0'`` in mlir-aie's CI, fixed there by
  retrying with backoff: mlir-aie PRs #2814, #2848), so ``open_device`` retries before giving up.
"""

from __future__ import annotations

import glob
import importlib
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, TypeVar

from hmad.backends.npu.errors import NpuError, NpuRunError, NpuUnavailable

log = logging.getLogger("hmad.npu")

PYXRT_ENV = "HMAD_PYXRT"
ACCEL_DIR_ENV = "HMAD_ACCEL_DIR"
DEFAULT_ACCEL_DIR = "/dev/accel"
#: where XRT's installer puts pyxrt (its setup.sh adds it to PYTHONPATH; a systemd service never sources that)
XRT_PYTHON_DIR = "/opt/xilinx/xrt/python"
OPEN_RETRIES_S = (0.1, 0.3, 1.0)  # backoff between attempts to open the device

#: device names (``xrt_info_device.name``; the amdxdna driver's vbnv) -> NPU family of the kernels to load.
#: npu1: Phoenix / Hawk Point (XDNA, AIE2, 4 usable columns); npu2: Strix, Strix Halo, Krackan (XDNA2, AIE2P).
FAMILY_BY_NAME_PART = {
    "npu1": "npu1",
    "phoenix": "npu1",
    "hawk": "npu1",
    "npu4": "npu2",
    "npu5": "npu2",
    "npu6": "npu2",
    "strix": "npu2",
    "krackan": "npu2",
    "kraken": "npu2",
}

T = TypeVar("T")


def accel_nodes(accel_dir: str | None = None) -> list[str]:
    """The accel device nodes (``/dev/accel/accel*``), sorted; [] when there are none."""
    d = accel_dir or os.environ.get(ACCEL_DIR_ENV) or DEFAULT_ACCEL_DIR
    return sorted(glob.glob(os.path.join(d, "accel*")))


def import_xrt(name: str | None = None) -> ModuleType:
    """``pyxrt``, or the module named by ``name`` / ``$HMAD_PYXRT``; NpuUnavailable if it will not import."""
    name = name or os.environ.get(PYXRT_ENV) or "pyxrt"
    if name != "pyxrt":
        log.warning("NPU: using XRT module %r instead of pyxrt (from %s): not the real NPU", name, PYXRT_ENV)
    try:
        return importlib.import_module(name)
    except ImportError as e:
        problem = str(e)
    if name == "pyxrt" and os.path.isdir(XRT_PYTHON_DIR) and XRT_PYTHON_DIR not in sys.path:
        sys.path.append(XRT_PYTHON_DIR)
        try:
            return importlib.import_module(name)
        except ImportError as e:
            problem = str(e)
    raise NpuUnavailable(f"cannot import {name} ({problem}); install XRT with its Python binding")


def npu_family(device_name: str) -> str | None:
    """``RyzenAI-npu1`` -> ``npu1``; ``NPU Strix`` -> ``npu2``; None for a name we do not know."""
    low = device_name.lower()
    for part, family in FAMILY_BY_NAME_PART.items():
        if part in low:
            return family
    return None


def check(what: str, fn: Callable[..., T], *args: Any, error: type[NpuError] = NpuRunError) -> T:
    """Call an XRT function; any exception it raises becomes ``error`` naming ``what``."""
    try:
        return fn(*args)
    except NpuError:
        raise
    except Exception as e:  # pyxrt raises RuntimeError (and TypeError/ValueError on bad arguments)
        raise error(f"{what}: {type(e).__name__}: {e}") from e


@dataclass
class NpuDevice:
    """The opened NPU: the pyxrt module, the device handle, what it is, and its contexts (one per xclbin)."""

    xrt: ModuleType
    handle: Any
    name: str
    family: str
    node: str
    contexts: dict[str, Any] = field(default_factory=dict)  # xclbin path -> KernelContext
    opened_at: float = field(default_factory=time.monotonic)

    @property
    def xrt_module(self) -> str:
        return self.xrt.__name__


_lock = threading.Lock()
_device: NpuDevice | None = None


def open_device(xrt_module: str | None = None, accel_dir: str | None = None) -> NpuDevice:
    """The process's NPU, opened on the first call and returned as is afterwards (never opened twice).

    Raises NpuUnavailable (no accel node, node not accessible, no pyxrt, device will not open, unknown
    device) with a reason for status.
    """
    global _device
    with _lock:
        if _device is None:
            _device = _open(xrt_module, accel_dir)
        return _device


def forget_device() -> None:
    """Drop the process's device and its contexts (tests; a daemon keeps its device for life)."""
    global _device
    with _lock:
        _device = None


def _open(xrt_module: str | None, accel_dir: str | None) -> NpuDevice:
    nodes = accel_nodes(accel_dir)
    if not nodes:
        where = accel_dir or os.environ.get(ACCEL_DIR_ENV) or DEFAULT_ACCEL_DIR
        raise NpuUnavailable(f"no accel device node in {where} (no NPU, or the amdxdna driver is not loaded)")
    if not os.access(nodes[0], os.R_OK | os.W_OK):
        raise NpuUnavailable(
            f"{nodes[0]} is not readable and writable by this user (add it to group render; "
            "see the udev rule in systemd/README.md)"
        )
    xrt = import_xrt(xrt_module)
    handle = _open_with_retries(xrt)
    name = str(
        check("device.get_info(name)", handle.get_info, xrt.xrt_info_device.name, error=NpuUnavailable)
    )
    family = npu_family(name)
    if family is None:
        raise NpuUnavailable(
            f"unknown NPU {name!r} (hmad has kernels for npu1 Phoenix/Hawk Point, npu2 Strix)"
        )
    log.info("NPU: opened %s (%s) at %s through %s", name, family, nodes[0], xrt.__name__)
    return NpuDevice(xrt, handle, name, family, nodes[0])


def _open_with_retries(xrt: ModuleType) -> Any:
    for attempt, pause in enumerate((*OPEN_RETRIES_S, None)):
        try:
            return xrt.device(0)
        except Exception as e:  # transient "No such device with index '0'" (see the module docstring)
            if pause is None:
                raise NpuUnavailable(f"xrt.device(0) failed {attempt + 1} times: {e}") from e
            log.info("NPU: xrt.device(0) failed (%s); retrying in %.1f s", e, pause)
            time.sleep(pause)
    raise AssertionError("unreachable")
