"""Heavy per-request work off the socket loop: worker threads that run jobs and wake the loop.

The socket loop must answer ``ping`` and ``cancel`` and forward tokens while a request's prompt is being
tokenized (seconds for a prompt of megabytes), its images decoded and preprocessed (tens of milliseconds
each, seconds for a large one), its JSON schema compiled, or the tokenizer's vocabulary index built for the
first constrained request. The loop hands such work here as a job; WORKERS threads take the jobs in turn,
so one request's large images or prompt do not hold the ones behind it (Pillow, numpy and the tokenizer's
and llguidance's native code release the GIL; what is built once per tokenizer is built under a lock:
hmad.engine.structured). Each puts a job's result (or the exception it raised) on ``done``, then pokes the
loop through its own PUSH socket on the loop's inproc wake address (a zmq socket is used by one thread
only). Results come in the order jobs finish.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

log = logging.getLogger("hmad.intake")

#: worker threads: jobs at once (a job is one request's preparation)
WORKERS = max(1, min(4, os.cpu_count() or 1))


class Intake:
    """``workers`` threads; ``submit(key, fn)``, then ``results()`` in the loop after a wake-up."""

    def __init__(self, ctx: zmq.Context, wake_addr: str, workers: int = WORKERS):
        self._ctx, self._wake_addr = ctx, wake_addr
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self.pending = 0  # jobs submitted and not yet collected
        self._threads = [
            threading.Thread(target=self._run, name=f"hmad-intake-{i}", daemon=True) for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    def submit(self, key: Any, fn: Callable[[], Any]) -> None:
        self.pending += 1
        self._jobs.put((key, fn))

    def results(self) -> list[tuple[Any, Any, BaseException | None]]:
        """Every finished job as (key, result, exception); never blocks."""
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                self.pending -= len(out)
                return out

    def close(self, timeout: float = 2.0) -> None:
        for _ in self._threads:
            self._jobs.put((None, None))
        end = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))

    def _run(self) -> None:
        push = self._ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, 0)
        push.connect(self._wake_addr)
        try:
            while True:
                key, fn = self._jobs.get()
                if fn is None:
                    return
                try:
                    self._done.put((key, fn(), None))
                except BaseException as e:  # noqa: BLE001 - handed to the loop, which answers the request
                    self._done.put((key, None, e))
                fn = None  # its closure may hold a model that is being unloaded (hmad/switching.py)
                with contextlib.suppress(zmq.Again):
                    push.send(b"", zmq.NOBLOCK)
        finally:
            push.close()
