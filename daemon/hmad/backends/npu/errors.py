"""Named NPU errors: every XRT failure the runtime sees becomes one of these (see ``xrt.check``).

Each carries a short ``reason`` for status (``hmactl status`` shows it where an op fell back to the CPU).
"""

from __future__ import annotations

from hmad.core.errors import HmadError


class NpuError(HmadError):
    """Base class. ``reason``: one line for status and logs."""

    kind = "npu error"

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(f"{self.kind}: {reason}")


class NpuUnavailable(NpuError):
    """No NPU here: no /dev/accel node, no usable pyxrt, or the device would not open."""

    kind = "NPU unavailable"


class NpuKernelsMissing(NpuError):
    """The NPU is present but the kernels (xclbin + instruction stream) for it are not installed."""

    kind = "NPU kernels missing"


class NpuContextError(NpuError):
    """A hardware context could not be created (npu1 allows only a few system-wide; or the xclbin was
    refused)."""

    kind = "NPU context refused"


class NpuRunError(NpuError):
    """A kernel run failed: XRT raised, or the run ended in a state other than COMPLETED."""

    kind = "NPU run failed"


class NpuTimeout(NpuRunError):
    """``run.wait(timeout)`` gave up; pyxrt cannot abort a run, so the context is not used again."""

    kind = "NPU run timed out"


class NpuMismatch(NpuError):
    """An op's first NPU result disagreed with the CPU reference."""

    kind = "NPU output mismatch"


class NpuUnsupportedShape(NpuError):
    """A call the kernels do not cover (e.g. more keys than the softmax kernel's row): that call runs on the
    CPU; the op stays on the NPU."""

    kind = "shape not covered by the NPU kernels"
