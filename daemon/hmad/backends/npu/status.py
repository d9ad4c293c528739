"""What status says about the NPU for any backend, and the probe ``backend: auto`` uses.

Light to import (the service imports it whatever the backend): XRT is touched only inside ``probe``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

VULKAN_GRAPH_REASON = (
    "NPU offload is not used with the Vulkan graph backend: that backend records the whole forward pass into "
    "one command buffer per batch bucket and replays it with one submit per step, and an NPU op cannot run "
    "inside that recorded graph (each NPU run is a separate XRT submission whose result the host waits for); "
    "backend: npu offloads to the NPU"
)

_last_probe: str | None = None  # why backend auto did not pick the NPU, when it probed


def vulkan_npu_status() -> dict[str, Any]:
    """The npu entry of status for the Vulkan backend (callable from the Vulkan path)."""
    return {"used": False, "reason": VULKAN_GRAPH_REASON}


def npu_status(backend: Any) -> dict[str, Any]:
    """The npu entry of ``hmactl status`` for ``backend``: which ops run where, or why the NPU is unused."""
    if hasattr(backend, "npu_status"):
        return backend.npu_status()
    if backend.name == "vulkan":
        return vulkan_npu_status()
    reason = f"backend {backend.name}: NPU offload runs with backend npu (or auto on a machine without a GPU)"
    if _last_probe:
        reason += f"; backend auto found no usable NPU: {_last_probe}"
    return {"used": False, "reason": reason}


def probe(npu: Mapping[str, Any] | None = None) -> tuple[bool, str]:
    """Can the npu backend use the NPU with these options (config section npu)? (ok, reason if not).

    Opens the device (the process's one open: the backend reuses it) and looks for the kernels the
    configured ops need; creates no hardware context."""
    global _last_probe
    from hmad.backends.npu.errors import NpuError
    from hmad.backends.npu.kernels import KERNELS_FOR_OP, find_kernels
    from hmad.backends.npu.routing import NPU_OPS
    from hmad.backends.npu.xrt import open_device

    npu = npu or {}
    ops = tuple(npu.get("ops", NPU_OPS))
    if npu.get("enabled", "auto") is False or not ops:
        _last_probe = "npu.enabled is false" if ops else "npu.ops is empty"
        return False, _last_probe
    try:
        dev = open_device()
        find_kernels(dev.family, npu.get("xclbin_dir"), sorted({k for op in ops for k in KERNELS_FOR_OP[op]}))
    except NpuError as e:
        _last_probe = str(e)
        return False, _last_probe
    _last_probe = None
    return True, ""
