"""The engine thread: the one thread that owns the model, the device and the scheduler.

The server thread talks to it through two queues: commands in (submit, cancel), event batches out. After
publishing a batch the engine calls ``wake()`` (the server's inproc socket), so the socket loop never polls
the engine and never blocks on compute. ``last_progress`` is the heartbeat the service turns into
``WATCHDOG=1``: it moves at every step and every idle wait, and stops if a step hangs.

Failures: a request the scheduler cannot take (an exception from ``submit``) gets its own ``error`` event;
a waiting request that gives its place in the full queue to another connection's (engine/admission.py)
gets ``busy``; a failed step fails only its requests (engine/scheduler.py). An exception that leaves
``step()`` (the backend raised ``BackendUnusable``, or the scheduler's bookkeeping broke) is the engine's
end: every request it holds gets ``error`` (internal), ``failed`` is set, and the service answers the
rest and exits 1.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

from hmad.engine.metrics import Metrics, RateWindow
from hmad.engine.request import Event, Request
from hmad.engine.scheduler import QueueFull, RequestInvalid, RequestRejected, Scheduler

log = logging.getLogger("hmad.engine")

IDLE_WAIT_S = 0.25


class EngineThread:
    """Runs ``Scheduler.step()`` whenever there is work; thread-safe ``submit``/``cancel``/``snapshot``."""

    def __init__(self, scheduler: Scheduler, wake: Callable[[], None], metrics: Metrics | None = None):
        self.scheduler = scheduler
        self.wake = wake
        self.metrics = metrics or Metrics()  # step timings and batch sizes go here
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.events: queue.SimpleQueue[list[Event]] = queue.SimpleQueue()
        self.last_progress = time.monotonic()
        self.snapshot: dict = scheduler.status()
        self.failed = False  # set when a step raised: the service then stops (exit 1) so systemd restarts it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hmad-engine", daemon=True)
        self._tok_rate = RateWindow(10.0)  # tokens_per_s: generated tokens over the last 10 s

    # -- called from other threads ---------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def submit(self, req: Request) -> None:
        self.commands.put(("submit", req))

    def cancel(self, request_id: int) -> None:
        self.commands.put(("cancel", request_id))

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self.commands.put(("noop", None))
        self._thread.join(timeout)

    # -- the thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.turn()
        except Exception as e:  # the engine must never die silently: fail every request, then stop
            log.exception("engine failure: no further steps")
            self.failed = True
            self._fail_all("internal", f"engine failure ({type(e).__name__}: {e}); see the daemon log")

    def turn(self) -> None:
        """One turn of the engine loop: take the commands (waiting for one while idle), step if there is
        work, refresh the snapshot, publish the events (bench/bench_host_step.py times these turns)."""
        self._drain_commands(block=not self.scheduler.has_work())
        events = self._step() if self.scheduler.has_work() else []
        self._update_snapshot()  # before the events go out: a status after a reply includes its step
        self._publish(events)

    def _step(self) -> list[Event]:
        """One scheduler step, timed into the metrics when it ran a forward pass."""
        steps, t0 = self.scheduler.steps, time.perf_counter()
        events = self.scheduler.step()
        if self.scheduler.steps > steps:
            self.metrics.step_done(self.scheduler.recent_batches[-1], time.perf_counter() - t0)
        return events

    def _drain_commands(self, block: bool) -> None:
        events: list[Event] = []
        try:
            cmd = self.commands.get(timeout=IDLE_WAIT_S) if block else self.commands.get_nowait()
            while True:
                events += self._apply(*cmd)
                cmd = self.commands.get_nowait()
        except queue.Empty:
            pass
        self.last_progress = time.monotonic()
        self._publish(events)

    def _apply(self, kind: str, arg) -> list[Event]:
        if kind == "submit":
            try:
                return self.scheduler.submit(arg)  # busy events of requests it displaced (a full queue)
            except QueueFull as e:
                return [Event("error", arg.id, error_code="busy", text=str(e))]
            except RequestRejected as e:
                return [Event("error", arg.id, error_code="prompt_too_long", text=str(e))]
            except RequestInvalid as e:
                return [Event("error", arg.id, error_code="bad_request", text=str(e))]
            except Exception as e:  # this request alone: e.g. its sampler or stop strings could not be built
                log.exception("request %d could not be queued", arg.id)
                text = f"could not queue the request: {type(e).__name__}: {e}"
                return [Event("error", arg.id, error_code="internal", text=text)]
        elif kind == "cancel":
            self.scheduler.cancel(arg)
        return []

    def _publish(self, events: list[Event]) -> None:
        if events:
            self.events.put(events)
            self.wake()

    def _fail_all(self, code: str, message: str) -> None:
        reqs = [*self.scheduler.waiting, *self.scheduler.running]
        self._publish([Event("error", r.id, error_code=code, text=message) for r in reqs])

    def _update_snapshot(self) -> None:
        now = time.monotonic()
        self.last_progress = now
        rate = self._tok_rate.add(now, self.scheduler.tokens_out)
        self.snapshot = {
            **self.scheduler.status(),
            "tokens_per_s": round(rate, 2),
            "tokens_generated": self.scheduler.tokens_out,
        }
