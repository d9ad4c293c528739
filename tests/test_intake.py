"""hmad.intake.Intake: jobs run on several worker threads, so a slow one does not hold the ones behind it;
every job's result or exception comes back once, with a wake-up of the loop; close() ends every worker."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from hmad.intake import Intake


@pytest.fixture
def loop():
    """(intake with 2 workers, the loop's PULL wake socket)."""
    ctx = zmq.Context()
    addr = f"inproc://test-intake-{time.monotonic_ns()}"
    wake = ctx.socket(zmq.PULL)
    wake.bind(addr)
    intake = Intake(ctx, addr, workers=2)
    yield intake, wake
    intake.close()
    wake.close(0)
    ctx.term()


def collect(intake: Intake, wake, want: int, timeout: float = 10.0) -> dict:
    """Results by key once ``want`` have come, each after a wake-up (as the loop reads them)."""
    got, end = {}, time.monotonic() + timeout
    while len(got) < want:
        assert wake.poll(max(1, int(1e3 * (end - time.monotonic())))), f"no wake-up; have {got}"
        wake.recv()
        for key, result, exc in intake.results():
            assert key not in got, f"{key} came back twice"
            got[key] = (result, exc)
    return got


def test_a_slow_job_does_not_hold_the_next(loop):
    intake, wake = loop
    release = threading.Event()
    intake.submit("slow", lambda: release.wait(10) and "slow done")
    intake.submit("fast", lambda: "fast done")
    first = collect(intake, wake, 1)
    assert first == {"fast": ("fast done", None)}  # while the slow one still waits
    assert intake.pending == 1
    release.set()
    assert collect(intake, wake, 1) == {"slow": ("slow done", None)}
    assert intake.pending == 0


def test_every_job_answers_once_exceptions_included(loop):
    intake, wake = loop

    def boom():
        raise ValueError("bad image 3")

    for i in range(20):
        intake.submit(i, boom if i % 7 == 3 else (lambda i=i: i * i))
    got = collect(intake, wake, 20)
    assert sorted(got) == list(range(20))
    for i, (result, exc) in got.items():
        if i % 7 == 3:
            assert isinstance(exc, ValueError) and result is None
        else:
            assert (result, exc) == (i * i, None)


def test_close_ends_every_worker():
    ctx = zmq.Context()
    intake = Intake(ctx, "inproc://test-intake-close", workers=3)
    threads = list(intake._threads)
    assert len(threads) == 3 and all(t.is_alive() for t in threads)
    intake.close()
    assert not any(t.is_alive() for t in threads)
    ctx.term()
