"""One loaded kernel: its hardware context, kernel handle, instruction BO and data BOs, made once and reused.

Argument layout of every run (IRON designs, as mlir-aie's ``python/utils/xrt.py`` and test.py call them)::

    run = kernel(OPCODE, instr_bo, n_instr_words, bo_0, bo_1, ...)
      instr_bo: xrt.bo(device, 4 * n_words, bo.flags.cacheable, kernel.group_id(1)), synced once at load
      bo_i:     xrt.bo(device, nbytes_i, bo.flags.host_only, kernel.group_id(3 + i))

Inputs are written into the mapped BO and synced TO_DEVICE before the run; outputs are synced FROM_DEVICE
after it and read from the mapping. Each context holds ``n_sets`` sets of data BOs so that the host can
fill set b+1 (and accumulate the result of b-1) while run b is on the NPU (see ops.tiled_gemm), plus one set
for warm-up runs.

Known Phoenix timings (not measured here): a run costs ~45 us for an empty kernel (mlir-aie issue #2381) to
~110-150 us for a small one (mlir-aie issue #2944); after ~10 s idle the first run can take ~120-136 ms
(issue #2944: five runs 10 s apart took 119 us, then 136 ms, 135 ms, 136 ms, 121 ms). routing.py routes
around that. The driver itself aborts a run after 16 s (ERT_CMD_STATE_ABORT; amd/xdna-driver PR #51).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from hmad.backends.npu.errors import NpuContextError, NpuRunError, NpuTimeout
from hmad.backends.npu.kernels import Arg, KernelFiles, read_insts
from hmad.backends.npu.xrt import NpuDevice, check

log = logging.getLogger("hmad.npu")

OPCODE = 3  # the opcode IRON host code passes first: "run this instruction stream"
INSTR_GROUP = 1  # kernel.group_id(1): the instruction BO
FIRST_DATA_GROUP = 3  # kernel.group_id(3), (4), ...: the data BOs, in argument order
DONE_STATES = ("COMPLETED", "ERROR", "ABORT", "TIMEOUT", "NORESPONSE", "SKERROR", "SKCRASHED")


class BufferSet:
    """The data BOs of one run, one per kernel argument, each with a numpy view of its mapping."""

    def __init__(self, dev: NpuDevice, kernel: Any, args: tuple[Arg, ...]):
        xrt = dev.xrt
        self.args = args
        self.bos, self.views = [], []
        for i, arg in enumerate(args):
            group = check(f"kernel.group_id({FIRST_DATA_GROUP + i})", kernel.group_id, FIRST_DATA_GROUP + i)
            bo = check(
                f"bo({arg.name}, {arg.nbytes} B)", xrt.bo, dev.handle, arg.nbytes, xrt.bo.host_only, group
            )
            mapped = np.frombuffer(check(f"bo({arg.name}).map", bo.map), dtype=np.uint8)
            self.bos.append(bo)
            self.views.append(mapped.view(arg.dtype).reshape(arg.shape))

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.args)


@dataclass
class Pending:
    """A started run: its handle, the buffer set it uses, and when it started."""

    run: Any
    bufs: BufferSet
    started: float


class KernelContext:
    """A kernel ready to run: created once per xclbin, for the daemon's life (``NpuDevice.contexts``)."""

    def __init__(self, dev: NpuDevice, files: KernelFiles, n_sets: int = 2, timeout_s: float = 5.0):
        self.dev, self.files, self.spec = dev, files, files.spec
        self.timeout_ms = max(1, int(timeout_s * 1000))
        self.broken: str | None = None  # set after a timeout: a run may still own the BOs
        self.warming: Pending | None = None  # a warm-up run after idle (see is_cold)
        self.runs = 0
        self.last_run = time.monotonic()
        self.kernel = self._load()
        self.instr_bo, self.n_instr = self._instructions()
        self.sets = [BufferSet(dev, self.kernel, self.spec.args) for _ in range(n_sets)]
        self.warm_set = BufferSet(dev, self.kernel, self.spec.args)

    def _load(self) -> Any:
        xrt, dev, f = self.dev.xrt, self.dev.handle, self.files
        xclbin = check(f"xclbin({f.xclbin})", xrt.xclbin, f.xclbin, error=NpuContextError)
        check("device.register_xclbin", dev.register_xclbin, xclbin, error=NpuContextError)
        uuid = check("xclbin.get_uuid", xclbin.get_uuid, error=NpuContextError)
        # The rationed resource (npu1: 6 system-wide): held for the daemon's life, never re-created per call.
        self.hw_context = check(
            f"hw_context for {self.spec.name} (npu1 allows 6 system-wide; other processes may hold them)",
            xrt.hw_context,
            dev,
            uuid,
            error=NpuContextError,
        )
        return check(
            f"kernel({f.kernel_name})", xrt.kernel, self.hw_context, f.kernel_name, error=NpuContextError
        )

    def _instructions(self) -> tuple[Any, int]:
        xrt = self.dev.xrt
        insts = read_insts(self.files.insts)
        group = check("kernel.group_id(1)", self.kernel.group_id, INSTR_GROUP)
        bo = check("instruction bo", xrt.bo, self.dev.handle, insts.nbytes, xrt.bo.cacheable, group)
        check("instruction bo.write", bo.write, insts.view(np.uint8), 0)
        check("instruction bo.sync", bo.sync, xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE)
        return bo, int(insts.size)

    @property
    def bo_bytes(self) -> int:
        return sum(s.nbytes for s in (*self.sets, self.warm_set)) + 4 * self.n_instr

    # -- runs ----------------------------------------------------------------------------------------
    def submit(self, bufs: BufferSet) -> Pending:
        """Sync ``bufs``' inputs to the device and start a run on them (returns at once)."""
        if self.broken:
            raise NpuRunError(f"{self.spec.name}: not used again after {self.broken}")
        to_dev = self.dev.xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE
        for arg, bo in zip(bufs.args, bufs.bos, strict=True):
            if not arg.out:
                check(f"{self.spec.name}: bo({arg.name}).sync(to device)", bo.sync, to_dev)
        run = check(f"{self.spec.name}: start", self.kernel, OPCODE, self.instr_bo, self.n_instr, *bufs.bos)
        self.runs += 1
        self.last_run = time.monotonic()
        return Pending(run, bufs, self.last_run)

    def wait(self, p: Pending) -> list[np.ndarray]:
        """Wait for a run (``timeout_s``), sync its outputs from the device; views of the output BOs."""
        state = check(f"{self.spec.name}: wait", p.run.wait, self.timeout_ms)
        self.last_run = time.monotonic()
        self._check_state(state)
        from_dev = self.dev.xrt.xclBOSyncDirection.XCL_BO_SYNC_BO_FROM_DEVICE
        outs = []
        for arg, bo, view in zip(p.bufs.args, p.bufs.bos, p.bufs.views, strict=True):
            if arg.out:
                check(f"{self.spec.name}: bo({arg.name}).sync(from device)", bo.sync, from_dev)
                outs.append(view)
        return outs

    def done(self, p: Pending) -> bool:
        """Whether a run has finished (without waiting)."""
        return _state_name(check(f"{self.spec.name}: state", p.run.state)) in DONE_STATES

    def _check_state(self, state: Any) -> None:
        name = _state_name(state)
        if name == "COMPLETED":
            return
        if name == "TIMEOUT":
            # pyxrt has no run.abort(): the run may still be going and still own these BOs.
            self.broken = f"a run timed out after {self.timeout_ms} ms"
            raise NpuTimeout(f"{self.spec.name}: no completion within {self.timeout_ms} ms")
        raise NpuRunError(f"{self.spec.name}: run ended in state {name}")

    def is_cold(self, idle_s: float) -> bool:
        """Route around the slow first run after idle: True while a warm-up run is on the NPU.

        After ``idle_s`` without a run, starts a warm-up run on its own buffer set (never waited for on the
        engine thread) and answers True; once that run has finished, False again. ``idle_s`` <= 0: never.
        Raises the warm-up run's error, if it failed."""
        if self.warming is not None:
            if not self.done(self.warming):
                return True
            p, self.warming = self.warming, None
            self.wait(p)
            return False
        if idle_s > 0 and time.monotonic() - self.last_run > idle_s:
            log.info(
                "NPU: %s idle for %.1f s: warming it up; the CPU takes its work meanwhile",
                self.spec.name,
                time.monotonic() - self.last_run,
            )
            self.warming = self.submit(self.warm_set)
            return True
        return False

    def run(self, bufs: BufferSet) -> list[np.ndarray]:
        """Submit and wait: one synchronous run."""
        return self.wait(self.submit(bufs))


def _state_name(state: Any) -> str:
    """``ert_cmd_state.ERT_CMD_STATE_COMPLETED`` -> ``COMPLETED``."""
    name = getattr(state, "name", None) or str(state).rpartition(".")[2]
    return name.removeprefix("ERT_CMD_STATE_")
