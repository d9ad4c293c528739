"""A FAKE of pyxrt, XRT's Python binding: a stand-in for tests, not the NPU.

It implements exactly the subset hmad's NPU runtime uses (``device``, ``xclbin``, ``hw_context``, ``kernel``,
``bo`` with ``map``/``write``/``read``/``sync``, ``run.wait``/``state``, ``bo.flags``, ``xclBOSyncDirection``,
``ert_cmd_state``, ``xrt_info_device``), with the signatures of XRT's pybind11 module, and:

- executes each kernel by its numpy reference (the contracts in hmad/backends/npu/kernels.py), reading the
  inputs from the BOs' *device* copies and writing outputs there: a missing ``sync(TO_DEVICE)`` feeds the
  kernel stale data and a missing ``sync(FROM_DEVICE)`` leaves the host reading stale results, as on the
  real NPU;
- records what happens (``STATE``): device opens, registered xclbins, contexts, BO allocations, syncs, runs,
  and any misuse of the API (wrong flags or group ids, a BO refilled while its run is in flight...);
- fails on request, in each way the runtime must survive (``reset(...)`` or ``$HMAD_FAKE_XRT``, e.g.
  ``HMAD_FAKE_XRT=run_error_at=5,device_name=RyzenAI-npu1``):
  ``no_device`` (device(0) raises this many times; -1 = always), ``context_limit`` (contexts allowed before
  creation raises as amdxdna's CREATE_HWCTX does), ``run_error_at`` / ``timeout_at`` / ``wrong_output_at``
  (from the Nth run on, 1-based: the run ends in ERROR / wait returns TIMEOUT / outputs are corrupted).

A fake xclbin is a JSON file ``{"fake_xclbin": "<kernel name>"}`` (tests/npu_fixtures.py writes them).
Execution is lazy: a run computes when it is first waited on or polled, so the host must not touch a run's
buffers before it completes (the fake records that as misuse).
"""

from __future__ import annotations

import enum
import itertools
import json
import os
import uuid as _uuid
from dataclasses import dataclass, field

import numpy as np

from hmad.backends.npu.kernels import CATALOGUE

IS_FAKE = True
ENV = "HMAD_FAKE_XRT"


# -- enums, as pyxrt names them -------------------------------------------------------------------------
class xclBOSyncDirection(enum.Enum):  # noqa: N801 - pyxrt's name
    XCL_BO_SYNC_BO_TO_DEVICE = 0
    XCL_BO_SYNC_BO_FROM_DEVICE = 1
    XCL_BO_SYNC_BO_GMIO_TO_AIE = 2
    XCL_BO_SYNC_BO_AIE_TO_GMIO = 3


class ert_cmd_state(enum.Enum):  # noqa: N801
    ERT_CMD_STATE_NEW = 1
    ERT_CMD_STATE_QUEUED = 2
    ERT_CMD_STATE_COMPLETED = 4
    ERT_CMD_STATE_ERROR = 5
    ERT_CMD_STATE_ABORT = 6
    ERT_CMD_STATE_SUBMITTED = 7
    ERT_CMD_STATE_TIMEOUT = 8
    ERT_CMD_STATE_NORESPONSE = 9


class xrt_info_device(enum.Enum):  # noqa: N801
    bdf = 0
    name = 5


class _Flags(enum.Enum):
    normal = 0
    cacheable = 1 << 24
    device_only = 1 << 25
    host_only = 1 << 29
    p2p = 1 << 30
    svm = 1 << 27


# -- what happened ----------------------------------------------------------------------------------------
@dataclass
class State:
    device_name: str = "RyzenAI-npu1"
    no_device: int = 0
    context_limit: int = -1
    run_error_at: int = 0
    timeout_at: int = 0
    wrong_output_at: int = 0
    device_opens: int = 0
    open_attempts: int = 0
    registered: list = field(default_factory=list)  # xclbin paths
    contexts: list = field(default_factory=list)  # kernel names, in creation order
    bos: list = field(default_factory=list)  # every bo(): (size, flags, group)
    syncs: list = field(default_factory=list)  # (bo id, direction name)
    runs: list = field(default_factory=list)  # (kernel name, run number)
    events: list = field(default_factory=list)  # ("start"|"done", run number) in order
    misuse: list = field(default_factory=list)  # API misuse the runtime must never commit


STATE = State()
_ids = itertools.count(1)


def reset(**failures) -> State:
    """A fresh record; ``failures`` (and ``$HMAD_FAKE_XRT``, overridden by them) set the failure modes."""
    global STATE
    STATE = State(**{**_env_failures(), **failures})
    return STATE


def _env_failures() -> dict:
    out: dict = {}
    for item in filter(None, os.environ.get(ENV, "").split(",")):
        key, _, value = item.partition("=")
        out[key.strip()] = value if key.strip() == "device_name" else int(value)
    return out


# -- the API ----------------------------------------------------------------------------------------------
class device:  # noqa: N801
    def __init__(self, index: int = 0):
        STATE.open_attempts += 1
        if STATE.no_device < 0 or STATE.no_device >= STATE.open_attempts:
            raise RuntimeError(f"No such device with index '{index}'")
        STATE.device_opens += 1
        self.index = index

    def get_info(self, key: xrt_info_device) -> str:
        if key is xrt_info_device.name:
            return STATE.device_name
        return "0000:c5:00.1"

    def register_xclbin(self, xb: xclbin) -> None:
        STATE.registered.append(xb.path)


class uuid:  # noqa: N801
    def __init__(self, text: str):
        self.text = text

    def to_string(self) -> str:
        return self.text


class xclbin:  # noqa: N801
    def __init__(self, path: str):
        with open(path) as f:
            doc = json.load(f)  # a real xclbin is binary: a JSON one is certainly a fake's
        self.path, self.kernel_name = path, doc["fake_xclbin"]
        self._uuid = uuid(str(_uuid.uuid5(_uuid.NAMESPACE_URL, path)))

    def get_uuid(self) -> uuid:
        return self._uuid

    def get_kernels(self) -> list:
        return [_XclbinKernel("MLIR_AIE")]


@dataclass
class _XclbinKernel:
    _name: str

    def get_name(self) -> str:
        return self._name


class hw_context:  # noqa: N801
    def __init__(self, dev: device, xclbin_uuid: uuid):
        if 0 <= STATE.context_limit <= len(STATE.contexts):
            raise RuntimeError("DRM_IOCTL_AMDXDNA_CREATE_HWCTX IOCTL failed (err=-22): Invalid argument")
        self.dev, self.uuid = dev, xclbin_uuid
        self.kernel_name = _kernel_of_uuid(xclbin_uuid)
        STATE.contexts.append(self.kernel_name)


def _kernel_of_uuid(u: uuid) -> str:
    for path in STATE.registered:
        xb = xclbin(path)
        if xb.get_uuid().text == u.text:
            return xb.kernel_name
    raise RuntimeError("xclbin not registered with the device")


class bo:  # noqa: N801
    flags = _Flags
    normal, cacheable, device_only = _Flags.normal, _Flags.cacheable, _Flags.device_only
    host_only, p2p, svm = _Flags.host_only, _Flags.p2p, _Flags.svm

    def __init__(self, dev: device, size: int, flags: _Flags, group: int):
        if not isinstance(dev, device):
            raise TypeError("bo(): first argument must be a device")
        self.id, self.nbytes, self.flags_, self.group = next(_ids), int(size), flags, group
        self.host = np.zeros(self.nbytes, np.uint8)
        self.device = np.zeros(self.nbytes, np.uint8)
        self.in_flight: _Run | None = None
        STATE.bos.append((self.nbytes, flags, group))

    def map(self) -> memoryview:
        return memoryview(self.host)

    def write(self, data, seek: int) -> None:
        raw = np.frombuffer(memoryview(data).cast("B"), np.uint8)
        self.host[seek : seek + raw.size] = raw

    def read(self, size: int, skip: int) -> np.ndarray:
        return self.host[skip : skip + size].view(np.int8).copy()  # pyxrt returns a char array

    def sync(self, direction: xclBOSyncDirection, size: int | None = None, offset: int = 0) -> None:
        if self.in_flight is not None and not self.in_flight.finished:
            STATE.misuse.append(f"bo {self.id} synced while run {self.in_flight.number} is in flight")
        n = self.nbytes if size is None else size
        STATE.syncs.append((self.id, direction.name))
        if direction is xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE:
            self.device[offset : offset + n] = self.host[offset : offset + n]
        else:
            self.host[offset : offset + n] = self.device[offset : offset + n]

    def size(self) -> int:
        return self.nbytes


class kernel:  # noqa: N801
    GROUP_BASE = 100

    def __init__(self, ctx: hw_context, name: str):
        if name != "MLIR_AIE":
            raise RuntimeError(f"No such kernel '{name}'")
        self.ctx, self.name = ctx, ctx.kernel_name

    def group_id(self, argno: int) -> int:
        return self.GROUP_BASE + argno

    def __call__(self, *args) -> _Run:
        return _Run(self, args)


class _Run:
    def __init__(self, k: kernel, args: tuple):
        self.kernel, self.args = k, args
        self.number = len(STATE.runs) + 1
        self.finished, self.result = False, None
        STATE.runs.append((k.name, self.number))
        STATE.events.append(("start", self.number))
        self._check_call(args)
        for b in args[3:]:
            if isinstance(b, bo):
                b.in_flight = self

    def _check_call(self, args: tuple) -> None:
        opcode, instr, n = args[:3]
        if opcode != 3:
            STATE.misuse.append(f"run {self.number}: opcode {opcode}, IRON designs take 3")
        if (
            not isinstance(instr, bo)
            or instr.flags_ is not _Flags.cacheable
            or instr.group != kernel.GROUP_BASE + 1
        ):
            STATE.misuse.append(f"run {self.number}: instruction bo not cacheable on group_id(1)")
        elif instr.device[: 4 * n].view(np.uint32).size != n or not instr.device.any():
            STATE.misuse.append(f"run {self.number}: instruction stream not synced to the device")
        for i, b in enumerate(args[3:]):
            if b.flags_ is not _Flags.host_only or b.group != kernel.GROUP_BASE + 3 + i:
                STATE.misuse.append(f"run {self.number}: data bo {i} not host_only on group_id({3 + i})")

    def _finish(self) -> ert_cmd_state:
        if not self.finished:
            self.finished = True
            STATE.events.append(("done", self.number))
            self.result = self._execute()
        return self.result

    def _execute(self) -> ert_cmd_state:
        n = self.number
        if STATE.timeout_at and n >= STATE.timeout_at:
            return ert_cmd_state.ERT_CMD_STATE_TIMEOUT
        if STATE.run_error_at and n >= STATE.run_error_at:
            return ert_cmd_state.ERT_CMD_STATE_ERROR
        spec = CATALOGUE[self.kernel.name]
        views = [
            b.device.view(a.dtype).reshape(a.shape) for a, b in zip(spec.args, self.args[3:], strict=True)
        ]
        REFERENCE[spec.op](*views)
        if STATE.wrong_output_at and n >= STATE.wrong_output_at:
            for a, v in zip(spec.args, views, strict=True):
                if a.out:
                    v[...] = (v // 2 + 3) if v.dtype.kind in "iu" else v * 1.5 + 1
        return ert_cmd_state.ERT_CMD_STATE_COMPLETED

    def wait(self, timeout_ms: int = 0) -> ert_cmd_state:
        return self._finish()

    def state(self) -> ert_cmd_state:
        return self._finish()


# -- the kernels' numpy references (written from the contracts, independently of hmad's host code) --------
def _bf16_to_f32(u: np.ndarray) -> np.ndarray:
    return (u.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(x: np.ndarray) -> np.ndarray:
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _gemm(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> None:
    rows = np.flatnonzero(a.any(axis=1))  # padding rows are zero: skip them (same result, faster)
    c[...] = 0
    if a.dtype == np.int8:  # float32 is exact here: |partial sums| <= 256 * 127 * 127 < 2**24
        assert a.shape[1] <= 1024
        c[rows] = (a[rows].astype(np.float32) @ b.astype(np.float32).T).astype(np.int32)
    else:
        c[rows] = _bf16_to_f32(a[rows]) @ _bf16_to_f32(b).T


def _softmax(s: np.ndarray, lim: np.ndarray, p: np.ndarray) -> None:
    p[...] = 0
    for r in range(s.shape[0]):
        lo, hi = int(lim[r, 0]), int(lim[r, 1])
        if hi > lo:
            e = np.exp(s[r, lo:hi] - s[r, lo:hi].max())
            p[r, lo:hi] = _f32_to_bf16(e / e.sum())


REFERENCE = {"gemm": _gemm, "softmax": _softmax}
reset()
