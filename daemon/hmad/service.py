"""The service's life: lock the socket, load the model (telling systemd), serve, drain on SIGTERM.

systemd (Type=notify)             hmad
─────────────────────             ────
                                  lock <socket>.lock (a second hmad on the same socket refuses to start)
STATUS=loading … EXTEND_TIMEOUT   load the model; keep extending the start timeout while it loads
READY=1                           the model is resident, the socket bound with its mode and group
WATCHDOG=1 (every WatchdogSec/2)  only while the engine thread makes progress
STOPPING=1                        SIGTERM/SIGINT: refuse new work, let running requests finish within
                                  service.drain_grace_s, cancel the rest, each with its terminal reply
                                  exit 0
"""

from __future__ import annotations

import fcntl
import grp
import logging
import os
import signal
import threading
import time

import sdnotify
import zmq

from hmaclient import protocol as P
from hmad.backends.npu.status import npu_status
from hmad.config import Config
from hmad.engine.scheduler import Scheduler
from hmad.engine.worker import EngineThread
from hmad.errors import HmadError
from hmad.model.loader import load_model, resolve_backend_name
from hmad.server import Server

log = logging.getLogger("hmad.service")

EXTEND_EVERY_S = 10.0
EXTEND_BY_US = 30_000_000


class ServiceError(HmadError):
    """The service cannot start (socket in use, bad runtime directory …)."""


class Notifier:
    """sd_notify; a no-op outside systemd (no NOTIFY_SOCKET)."""

    def __init__(self):
        self._n = sdnotify.SystemdNotifier() if os.environ.get("NOTIFY_SOCKET") else None

    def __call__(self, *lines: str) -> None:
        if self._n is not None:
            self._n.notify("\n".join(lines))


class Service:
    """One daemon process: ``run()`` returns the exit status."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.notify = Notifier()
        self.path = cfg.socket.path
        self.stop_signal: int | None = None
        self.loading = threading.Event()
        self.stopping = False
        self.exit_code = 0

    def run(self) -> int:
        lock = self._lock()
        try:
            model = self._load()
            return self._serve(model)
        finally:
            lock.close()

    # -- start -----------------------------------------------------------------------------------------
    def _lock(self):
        """Hold ``<socket>.lock`` for the process's life; refuse if another hmad holds it."""
        self._runtime_dir(os.path.dirname(self.path))
        f = open(self.path + ".lock", "a")  # noqa: SIM115 - held until run() ends
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise ServiceError(f"another hmad is already serving at {self.path}") from None
        if os.path.exists(self.path):
            os.unlink(self.path)  # a stale socket of a process that is gone (it no longer holds the lock)
        return f

    @staticmethod
    def _runtime_dir(d: str) -> None:
        if not os.path.isdir(d):
            os.makedirs(d, mode=0o750, exist_ok=True)
            os.chmod(d, 0o750)
        st = os.stat(d)
        if st.st_uid != os.geteuid() and os.geteuid() != 0:
            raise ServiceError(f"runtime directory {d} belongs to uid {st.st_uid}, not to this user")

    def _load(self):
        cfg = self.cfg
        backend = resolve_backend_name(cfg.backend, cfg.backend_options("npu"))  # auto: vulkan, npu or cpu
        self.notify(f"STATUS=loading {cfg.model}", f"EXTEND_TIMEOUT_USEC={EXTEND_BY_US}")
        self.loading.set()
        keepalive = threading.Thread(target=self._extend_while_loading, daemon=True)
        keepalive.start()
        try:
            return load_model(
                cfg.model, backend=backend, progress=self._progress, **cfg.backend_options(backend)
            )
        finally:
            self.loading.clear()

    def _progress(self, msg: str) -> None:
        log.info("%s", msg)
        self.notify(f"STATUS={msg}", f"EXTEND_TIMEOUT_USEC={EXTEND_BY_US}")

    def _extend_while_loading(self) -> None:
        while self.loading.wait(0) and not self.stopping:
            self.notify(f"EXTEND_TIMEOUT_USEC={EXTEND_BY_US}")
            time.sleep(EXTEND_EVERY_S)

    # -- serve -----------------------------------------------------------------------------------------
    def _serve(self, model) -> int:
        cfg = self.cfg
        ctx = zmq.Context()
        scheduler = Scheduler(model, cfg.scheduler_config())
        server = Server(
            ctx,
            P.endpoint(self.path),
            None,
            model,
            cfg.sampling_defaults(),
            max_in_flight=cfg.engine.max_seqs + cfg.engine.max_queue,
            heartbeat_ivl_s=cfg.service.heartbeat_ivl_s,
            heartbeat_timeout_s=cfg.service.heartbeat_timeout_s,
            max_frame_bytes=cfg.limits.max_frame_bytes,
            status_extra=lambda: {"npu": npu_status(model.backend)},
        )
        engine = server.engine = EngineThread(scheduler, server.wake, server.metrics)
        self._socket_permissions()
        engine.start()
        self._install_signals()
        threading.Thread(target=self._watchdog, args=(engine,), daemon=True).start()
        threading.Thread(target=self._status_updates, args=(engine,), daemon=True).start()
        self.notify("READY=1", f"STATUS=serving {model.config.name or model.path} on {model.backend.name}")
        log.info("serving %s (%s) at %s", model.path, model.backend.name, self.path)
        try:
            server.serve(tick=lambda: self._tick(server))
        finally:
            engine.stop()
            server.close()
            ctx.term()
            if os.path.exists(self.path):
                os.unlink(self.path)
        log.info("stopped cleanly" if self.exit_code == 0 else "stopped after an engine failure")
        return self.exit_code

    def _socket_permissions(self) -> None:
        os.chmod(self.path, self.cfg.socket.mode)
        if self.cfg.socket.group:
            try:
                os.chown(self.path, -1, grp.getgrnam(self.cfg.socket.group).gr_gid)
            except KeyError:
                raise ServiceError(f"socket.group: no group named {self.cfg.socket.group!r}") from None

    def _install_signals(self) -> None:
        def on_signal(signum, _frame):
            self.stop_signal = signum

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def _tick(self, server: Server) -> bool:
        """Called by the server loop: start the drain once a stop signal arrived or the engine failed."""
        if server.engine.failed and not self.stopping:
            self.stopping, self.exit_code = True, 1
            self.notify("STOPPING=1", "STATUS=engine failure")
            server.begin_drain(0.0)
        if self.stop_signal is not None and not self.stopping:
            self.stopping = True
            log.info(
                "%s: draining (grace %.1f s)",
                signal.Signals(self.stop_signal).name,
                self.cfg.service.drain_grace_s,
            )
            self.notify("STOPPING=1", "STATUS=draining")
            server.begin_drain(self.cfg.service.drain_grace_s)
        return False

    def _status_updates(self, engine: EngineThread) -> None:
        """STATUS= every service.status_every_s while serving (what `systemctl status hmad` shows)."""
        every = self.cfg.service.status_every_s
        while every > 0 and not self.stopping:
            time.sleep(every)
            snap = engine.snapshot
            if not self.stopping:
                self.notify(
                    f"STATUS=serving: {snap.get('running', 0)} running, {snap.get('queued', 0)} queued, "
                    f"{snap.get('tokens_per_s', 0.0)} tok/s"
                )

    def _watchdog(self, engine: EngineThread) -> None:
        usec = int(os.environ.get("WATCHDOG_USEC", "0") or 0)
        if not usec or not self.cfg.service.watchdog:
            return
        period = usec / 2e6
        while True:
            time.sleep(period)
            if time.monotonic() - engine.last_progress < 2 * period:
                self.notify("WATCHDOG=1")
            else:
                log.warning(
                    "engine made no progress for %.1f s: withholding WATCHDOG=1",
                    time.monotonic() - engine.last_progress,
                )
