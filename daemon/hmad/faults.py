"""TEST-ONLY fault injection: make the backend's forward pass raise at a chosen step, or a load hang.

    HMAD_TEST_FAULT=forward:N            the N-th forward pass since start (1-based) raises InjectedFault:
                                         a recoverable error (that step's requests get ``error``, the
                                         daemon serves on)
    HMAD_TEST_FAULT=forward:N:unusable   it raises InjectedDeviceLoss, a BackendUnusable (every request is
                                         answered ``error``, the daemon exits 1)
    HMAD_TEST_FAULT=load:stall           the model load blocks in one phase for good, reporting no progress
                                         (as a hung disk or driver would): a stop signal must still end
                                         the process within seconds

It exists for tests/test_daemon_faults.py, which starts hmad with the variable set. Without the variable
nothing is installed. With it, the service logs a warning at start and ``status`` shows ``test_fault``; a
value that does not parse refuses to start (so a typo cannot silently test nothing). Never set it in
production.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from dataclasses import dataclass

from hmad.core.errors import BackendUnusable, HmadError

log = logging.getLogger("hmad.faults")

ENV = "HMAD_TEST_FAULT"
_SPEC = re.compile(r"forward:([1-9][0-9]*)(:unusable)?|load:stall")


class InjectedFault(RuntimeError):
    """The recoverable fault HMAD_TEST_FAULT=forward:N raises."""


class InjectedDeviceLoss(BackendUnusable):
    """The unrecoverable fault HMAD_TEST_FAULT=forward:N:unusable raises."""


class FaultSpecError(HmadError):
    """HMAD_TEST_FAULT is set but does not parse."""


@dataclass(frozen=True)
class ForwardFault:
    step: int  # 1-based count of forward passes; 0: the load stalls instead (``load:stall``)
    unusable: bool

    @property
    def stalls_load(self) -> bool:
        return self.step == 0

    def describe(self) -> str:
        if self.stalls_load:
            return "load:stall"
        return f"forward:{self.step}" + (":unusable" if self.unusable else "")


def stall_forever() -> None:
    """The ``load:stall`` fault: block the calling thread for good, reporting nothing."""
    log.warning("TEST-ONLY fault injection: the model load stalls (%s=load:stall)", ENV)
    threading.Event().wait()


def fault_from_env(environ=os.environ) -> ForwardFault | None:
    """The fault HMAD_TEST_FAULT asks for, None when it is unset or empty; raises FaultSpecError."""
    spec = environ.get(ENV, "")
    if not spec:
        return None
    m = _SPEC.fullmatch(spec)
    if m is None:
        raise FaultSpecError(f"{ENV}={spec!r}: expected forward:N, forward:N:unusable (N >= 1) or load:stall")
    if spec == "load:stall":
        return ForwardFault(0, False)
    return ForwardFault(int(m.group(1)), bool(m.group(2)))


def install(backend, fault: ForwardFault) -> None:
    """Wrap ``backend.run`` (one call per step) so that call number ``fault.step`` raises."""
    log.warning("TEST-ONLY fault injection active (%s=%s)", ENV, fault.describe())
    run, calls = backend.run, 0

    def run_with_fault(net, batch):
        nonlocal calls
        calls += 1
        if calls == fault.step:
            kind = InjectedDeviceLoss if fault.unusable else InjectedFault
            raise kind(f"{ENV}: fault injected into forward pass {calls}")
        return run(net, batch)

    backend.run = run_with_fault
