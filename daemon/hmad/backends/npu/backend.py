"""The npu backend: the numpy CPU backend with the configured ops offloaded to the Ryzen AI NPU.

- matmuls of at least ``min_rows`` rows run on ``gemm_int8`` (weights quantized in their file) or
  ``gemm_bf16`` (float weights), or on the other GEMM when only one is enabled; weights are prepared for the
  NPU once, at load; smaller matmuls (decode steps) stay on the CPU, cheaper than a padded 256-row tile;
- prefill attention (a sequence adding more than one token in a step) runs on ``attention_prefill``;
  decode attention stays on the CPU (one query row would be padded to a 256-row tile);
- each op is checked against the CPU on its first use and moves to the CPU for good, with the reason in
  ``hmactl status``, when the NPU errs, times out or disagrees (routing.py).

The NPU is opened once per process and its hardware contexts are held for the daemon's life (xrt.py,
context.py). Not one line of this has run on NPU hardware: it is tested against tests/fake_pyxrt.py.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import numpy as np

from hmad.backends.cpu import CpuBackend, CpuWeight
from hmad.backends.npu import ops
from hmad.backends.npu.context import KernelContext
from hmad.backends.npu.errors import NpuContextError, NpuError
from hmad.backends.npu.host import prepare_weight
from hmad.backends.npu.kernels import CATALOGUE, KERNELS_FOR_OP, find_kernels
from hmad.backends.npu.routing import NPU_OPS, Route, Router
from hmad.backends.npu.xrt import NpuDevice, open_device
from hmad.core.tensors import PLAIN_TYPES

log = logging.getLogger("hmad.npu")


class NpuOffload:
    """The NPU side of the backend: device, one context per kernel, the op routes and their reasons."""

    def __init__(self, enabled: str | bool, ops: tuple[str, ...], xclbin_dir: str | None, timeout_s: float,
                 idle_s: float):  # fmt: skip
        self.wanted = tuple(ops)
        self.dev: NpuDevice | None = None
        self.contexts: dict[str, KernelContext] = {}
        self.reason = ""  # why the NPU is not used at all ("" when it is)
        self.kernel_dir = ""
        routes = {op: Route(op, False, "not in npu.ops") for op in NPU_OPS}
        self.router = Router(routes, idle_s)
        if enabled is False or not self.wanted:
            self._off("npu.enabled is false" if enabled is False else "npu.ops is empty")
            return
        try:
            self._start(xclbin_dir, timeout_s, enabled is True)
        except NpuError as e:
            if enabled is True:
                raise
            self._off(str(e))

    def _off(self, reason: str) -> None:
        self.reason = reason
        log.info("NPU not used: %s", reason)
        for op in self.wanted:
            self.router.routes[op] = Route(op, False, reason)

    def _start(self, xclbin_dir: str | None, timeout_s: float, required: bool) -> None:
        self.dev = open_device()
        names = sorted({k for op in self.wanted for k in KERNELS_FOR_OP[op]})
        files = find_kernels(self.dev.family, xclbin_dir, names)
        refused = {}
        for name in names:
            try:
                self.contexts[name] = self._context(files[name], timeout_s)
            except NpuContextError as e:
                if required:
                    raise
                refused[name] = str(e)
        for op in self.wanted:
            missing = [refused[k] for k in KERNELS_FOR_OP[op] if k in refused]
            self.router.routes[op] = Route(op, not missing, missing[0] if missing else "")
        self.kernel_dir = os.path.dirname(next(iter(files.values())).xclbin)

    def _context(self, files, timeout_s: float) -> KernelContext:
        """One context per xclbin per process: a second backend in the process reuses the first's."""
        ctx = self.dev.contexts.get(files.xclbin)
        if ctx is None:
            ctx = self.dev.contexts[files.xclbin] = KernelContext(self.dev, files, timeout_s=timeout_s)
        return ctx

    def gemm_kernel(self, qtype) -> str | None:
        """The GEMM op a weight of file type ``qtype`` uses: int8 for quantized files, bf16 for float ones
        (or whichever of the two is on the NPU); None when neither is."""
        order = ("gemm_bf16", "gemm_int8") if qtype in PLAIN_TYPES else ("gemm_int8", "gemm_bf16")
        return next((op for op in order if self.router.routes[op].on_npu), None)

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"used": any(r.on_npu for r in self.router.routes.values())}
        if self.reason:
            out["reason"] = self.reason
        if self.dev is not None:
            fake = "" if self.dev.xrt_module == "pyxrt" else " (a stand-in, not the NPU)"
            out["device"] = f"{self.dev.name} ({self.dev.family}) at {self.dev.node}"
            out["xrt"] = self.dev.xrt_module + fake
        if self.contexts:
            out["kernels"] = self.kernel_dir
            out["runs"] = sum(c.runs for c in self.contexts.values())
        out["ops"] = {op: r.describe() for op, r in self.router.routes.items()}
        return out


class NpuBackend(CpuBackend):
    """CpuBackend + NPU offload of ``ops`` (config section npu; the cpu section's options as well)."""

    name = "npu"

    def __init__(
        self,
        enabled: str | bool = "auto",
        ops: tuple[str, ...] = NPU_OPS,
        xclbin_dir: str | None = None,
        min_rows: int = 32,
        timeout_s: float = 5.0,
        idle_s: float = 5.0,
        numerics: str = "ggml",
        weight_cache_bytes: int = 16 << 30,
        kv_dtype: str = "float32",
        deterministic: bool | str = "auto",
    ):
        if deterministic is True:  # its offloaded GEMMs take steps of min_rows rows and more, not the rest
            raise ValueError(
                "engine.deterministic: the npu backend is not batch-invariant (steps of npu.min_rows rows "
                "and more run on the NPU); use the cpu backend for it, or leave it auto or false"
            )
        super().__init__(weight_cache_bytes=weight_cache_bytes, kv_dtype=kv_dtype, numerics=numerics)
        self.offload = NpuOffload(enabled, tuple(ops), xclbin_dir, timeout_s, idle_s)
        self.npu_weight_bytes = 0
        self.min_rows = min_rows
        dev = self.offload.dev
        if dev is not None and self.offload.contexts:
            self.device = f"{self.device} + NPU {dev.name} ({dev.family}) through {dev.xrt_module}"

    # -- residency -------------------------------------------------------------------------------------
    def load_weights(self, tensors, progress=None, background=False) -> dict[str, CpuWeight]:
        out = super().load_weights(tensors, progress)
        prepared = 0
        for w in out.values():
            kernel = self.offload.gemm_kernel(w.tensor.qtype) if len(w.shape) == 2 else None
            if kernel is not None:
                _, tk, tn = CATALOGUE[kernel].gemm_tile()
                w.npu = prepare_weight(kernel, w.f32 if w.f32 is not None else w.tensor.dequantize(), tn, tk)
                self.npu_weight_bytes += w.npu.nbytes
                prepared += 1
        if prepared and progress:
            progress(f"{prepared} weights prepared for the NPU ({self.npu_weight_bytes >> 20} MiB)")
        return out

    def describe(self) -> dict:
        d = super().describe()
        d["memory"]["host RAM: NPU weight copies"] = self.npu_weight_bytes
        d["memory"]["host RAM: NPU buffer objects"] = sum(c.bo_bytes for c in self.offload.contexts.values())
        return d

    def npu_status(self) -> dict[str, Any]:
        """Which ops run where, or why the NPU is not used (``hmactl status`` shows it under npu)."""
        return self.offload.status()

    # -- ops ---------------------------------------------------------------------------------------------
    def matmul(self, x, w: CpuWeight):
        g = w.npu
        if g is None or x.shape[0] < self.min_rows:
            return super().matmul(x, w)
        ctx = self.offload.contexts[g.kernel]
        return self.offload.router.call(
            g.kernel,
            ("matmul", tuple(w.shape)),
            [ctx],
            lambda: ops.gemm(ctx, np.asarray(x, np.float32), g),
            lambda: CpuBackend.matmul(self, x, w),
        )

    def attend(self, q, keys, vals, pos0: int, kpos, window: int | None, scale: float, visible=None):
        route = self.offload.router.routes["attention_prefill"]
        if q.shape[0] < 2 or not route.on_npu or visible is not None:  # (image rows: the host's mask)
            return super().attend(q, keys, vals, pos0, kpos, window, scale, visible)
        gemm, softmax = (self.offload.contexts[k] for k in KERNELS_FOR_OP["attention_prefill"])
        return self.offload.router.call(
            "attention_prefill",
            ("attention", "local" if window else "global", q.shape[1:], keys.shape[1]),
            [gemm, softmax],
            lambda: ops.attention_prefill(gemm, softmax, q, keys, vals, pos0, kpos, window, scale),
            lambda: CpuBackend.attend(self, q, keys, vals, pos0, kpos, window, scale),
        )
