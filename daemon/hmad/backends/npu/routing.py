"""Where each op runs, and why: NPU until it errs or disagrees with the CPU, then the CPU for good.

The first NPU result of each (op, shape) is checked against the CPU result; a relative error above the op's
tolerance, any NPU error, or a run timeout routes the op back to the CPU with the reason logged and shown in
status, and that call is answered from the CPU result, so the request never sees the failure.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import numpy as np

from hmad.backends.npu.context import KernelContext
from hmad.backends.npu.errors import NpuError, NpuUnsupportedShape

log = logging.getLogger("hmad.npu")

#: the ops the NPU can take (config ``npu.ops`` chooses among them)
NPU_OPS = ("attention_prefill", "gemm_int8", "gemm_bf16")

#: first-use check: ||npu - cpu|| / ||cpu|| must not exceed this. int8: per-token/per-row quantization
#: costs ~1% on random data (tests/test_npu_ops.py); bf16 inputs ~0.3%; attention rounds q, k, P, v to bf16.
TOLERANCE = {"gemm_int8": 0.05, "gemm_bf16": 0.02, "attention_prefill": 0.03}


@dataclass
class Route:
    """One op: on the NPU or not (``reason`` says why not), its checked shapes, how often it ran where."""

    op: str
    on_npu: bool
    reason: str = ""
    checked: set = field(default_factory=set)
    npu_calls: int = 0
    cpu_calls: int = 0  # calls of an NPU op served by the CPU (warming up, a shape the kernels lack)

    def describe(self) -> str:
        if not self.on_npu:
            return f"cpu: {self.reason}"
        state = "checked" if self.checked else "not used yet"
        return f"npu ({state}; {self.npu_calls} calls on the NPU, {self.cpu_calls} on the CPU)"


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    """||out - ref|| / ||ref|| (inf when out is not finite or the shapes differ)."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if out.shape != ref.shape or not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


class Router:
    """Runs each op call on the NPU or the CPU, checks first uses, and keeps the reasons."""

    def __init__(self, routes: dict[str, Route], idle_s: float = 0.0):
        self.routes = routes
        self.idle_s = idle_s

    def disable(self, op: str, reason: str) -> None:
        r = self.routes[op]
        if r.on_npu:
            log.warning("NPU: %s moves to the CPU: %s", op, reason)
            r.on_npu, r.reason = False, reason

    def call(
        self,
        op: str,
        key: Hashable,
        contexts: list[KernelContext],
        npu_fn: Callable[[], np.ndarray],
        cpu_fn: Callable[[], np.ndarray],
    ) -> np.ndarray:
        """``npu_fn()`` when ``op`` is on the NPU (checked against ``cpu_fn()`` on the first use of ``key``),
        else ``cpu_fn()``; every NPU failure ends in ``cpu_fn()``."""
        r = self.routes[op]
        if not r.on_npu:
            return cpu_fn()
        try:
            if any([c.is_cold(self.idle_s) for c in contexts]):  # a list: warm every context, not the first
                r.cpu_calls += 1
                return cpu_fn()
            out = npu_fn()
        except NpuUnsupportedShape:
            r.cpu_calls += 1
            return cpu_fn()
        except NpuError as e:
            self.disable(op, str(e))
            return cpu_fn()
        r.npu_calls += 1
        return out if key in r.checked else self._check(r, key, out, cpu_fn())

    def _check(self, r: Route, key: Hashable, out: np.ndarray, ref: np.ndarray) -> np.ndarray:
        err, tol = relative_error(out, ref), TOLERANCE[r.op]
        if err > tol:
            self.disable(
                r.op, f"first-use check of {key}: relative error {err:.3g} > {tol:g} against the CPU"
            )
            return ref
        log.info("NPU: %s %s checked against the CPU (relative error %.3g)", r.op, key, err)
        r.checked.add(key)
        return out
