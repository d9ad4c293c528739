"""Heavy per-request work off the socket loop: a worker thread that runs jobs and wakes the loop.

The socket loop must answer ``ping`` and ``cancel`` and forward tokens while a request's prompt is being
tokenized (seconds for a prompt of megabytes), its JSON schema compiled, or the tokenizer's vocabulary
index built for the first constrained request. The loop hands such work here as a job; the worker runs
the jobs in turn and puts each result (or the exception it raised) on ``done``, then pokes the loop
through its own PUSH socket on the loop's inproc wake address (a zmq socket is used by one thread only).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

import zmq

log = logging.getLogger("hmad.intake")


class Intake:
    """One worker thread; ``submit(key, fn)``, then ``results()`` in the loop after a wake-up."""

    def __init__(self, ctx: zmq.Context, wake_addr: str):
        self._ctx, self._wake_addr = ctx, wake_addr
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self.pending = 0  # jobs submitted and not yet collected
        self._thread = threading.Thread(target=self._run, name="hmad-intake", daemon=True)
        self._thread.start()

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
        self._jobs.put((None, None))
        self._thread.join(timeout)

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
