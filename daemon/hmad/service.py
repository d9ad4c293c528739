"""The service's life: lock the socket, load the model (telling systemd), serve, drain on SIGTERM.

systemd (Type=notify)             hmad
─────────────────────             ────
                                  raise the soft open-file limit to the hard one (LimitNOFILE=);
                                  lock <socket>.lock, held open for the process's life (flock), and refuse
                                  if a live daemon answers on the socket even so (a deleted lock file);
                                  bind the socket with its mode and group: status shows the load's progress
STATUS=loading … EXTEND_TIMEOUT   load the model (a thread); extend the start timeout only while the load
                                  reports progress (a stuck load lets TimeoutStartSec= fire); a stop signal
                                  ends the load within LOAD_STOP_S whatever phase it is in;
                                  allocate the KV cache, record every step bucket, index the
                                  vocabulary for structured output (llguidance)
READY=1                           the model is resident and ready: generations are served
WATCHDOG=1 (every WatchdogSec/2)  only while the engine thread makes progress
STOPPING=1                        SIGTERM/SIGINT: refuse new work, let running requests finish within
                                  service.drain_grace_s, cancel the rest, each with its terminal reply;
                                  peers that do not read cannot hold it (their replies are dropped)
                                  exit 0
SIGHUP                            logged; nothing is reloaded (the socket and the limits are fixed for
                                  the process's life: restart to change them); never ends hmad
Once serving, the model changes without a restart (hmactl load / unload, models.keep_alive_s, a request
naming another model): hmad/switching.py, driven from the loop's tick.
"""

from __future__ import annotations

import fcntl
import gc
import grp
import logging
import os
import signal
import socket
import threading
import time

import sdnotify
import zmq

from hmaclient import protocol as P
from hmad import gateway_child
from hmad.backends.npu.status import npu_status
from hmad.config import Config
from hmad.core.errors import HmadError
from hmad.engine.scheduler import Scheduler
from hmad.engine.worker import EngineThread
from hmad.faults import fault_from_env, stall_forever
from hmad.heap import map_large_buffers
from hmad.model_routes import ModelRoutes
from hmad.peers import connection_cap, open_descriptors, raise_nofile_limit
from hmad.server import Server
from hmad.switching import Switcher, load_scheduler

log = logging.getLogger("hmad.service")

EXTEND_EVERY_S = 10.0
EXTEND_BY_US = 30_000_000
LOAD_STOP_S = 3.0  # after a stop signal, how long a load that does not give up by itself is waited for


class ServiceError(HmadError):
    """The service cannot start (socket in use, bad runtime directory …)."""


class LoadCancelled(HmadError):
    """A stop signal came while the model was loading: the load gives up, the service exits 0."""


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
        self.hup = False
        self.abandoned_load = False  # a stuck load left running at exit: the process ends with os._exit
        self.loading = threading.Event()
        self.stopping = False
        self.exit_code = 0
        self.t0 = time.monotonic()
        self.load: dict = {"phase": "starting"}  # what status shows while loading (load_status)
        self.loaded: Scheduler | None = None  # set by the load thread when done
        self.load_error: BaseException | None = None
        self.progress_count = 0  # progress reports of the load (EXTEND_TIMEOUT_USEC follows them)
        self.nofile = 0  # the open-file soft limit in force
        self.fault = None  # TEST-ONLY fault injection (hmad/faults.py), from HMAD_TEST_FAULT
        self.switcher: Switcher | None = None  # once serving: the model's life (hmad/switching.py)

    def run(self) -> int:
        fault = fault_from_env()  # TEST-ONLY (hmad/faults.py); a malformed value refuses to start
        map_large_buffers()  # request-sized buffers go back to the system (hmad/heap.py)
        self.nofile = raise_nofile_limit()
        self._install_signals()  # from the start: a SIGHUP never ends hmad, even while it locks or loads
        lock = self._lock()
        try:
            return self._run_locked(fault)
        finally:
            lock.close()

    def _run_locked(self, fault) -> int:
        """Bind the socket at once (status shows the load's progress), load in a thread, serve once loaded."""
        cfg, self.fault = self.cfg, fault
        ctx = zmq.Context()
        server = Server(
            ctx,
            P.endpoint(self.path),
            None,
            None,
            cfg.sampling_defaults(),
            max_in_flight=cfg.engine.max_seqs + cfg.engine.max_queue,
            heartbeat_ivl_s=cfg.service.heartbeat_ivl_s,
            heartbeat_timeout_s=cfg.service.heartbeat_timeout_s,
            image_limits=cfg.image_limits(),
            max_frame_bytes=cfg.limits.max_frame_bytes,
            loading_status=self.load_status,
            max_connections=self._max_connections(),
            max_connections_per_uid=cfg.server.max_connections_per_uid,
            max_per_connection=cfg.server.max_in_flight_per_connection,
            max_per_uid=cfg.server.max_in_flight_per_uid,
            max_reply_bytes=cfg.server.max_reply_bytes,
        )
        self._socket_permissions()
        loader = threading.Thread(target=self._load, name="hmad-load", daemon=True)
        loader.start()
        try:
            with gateway_child.supervised(cfg, serving=lambda: server.engine is not None):  # http: section
                server.serve(tick=lambda: self._tick(server))
        finally:
            self.stopping = True  # a load still running gives up at its next progress report
            loader.join(LOAD_STOP_S)
            stuck = loader.is_alive() or (self.switcher is not None and not self.switcher.join(LOAD_STOP_S))
            if stuck:  # in one phase (the first load, or a switch's): a daemon thread, abandoned with hmad
                log.warning("the model load did not stop within %.0f s: abandoning it", LOAD_STOP_S)
                self.abandoned_load = True
            if server.engine is not None:
                server.engine.stop()
            server.close()
            ctx.term()
            if os.path.exists(self.path):
                os.unlink(self.path)
        if self.load_error is not None and not isinstance(self.load_error, LoadCancelled):
            raise self.load_error
        log.info("stopped cleanly" if self.exit_code == 0 else "stopped after an engine failure")
        return self.exit_code

    # -- start -----------------------------------------------------------------------------------------
    def _max_connections(self) -> int:
        """server.max_connections, or fewer if the open-file limit could not hold that many."""
        cap = connection_cap(self.cfg.server.max_connections, self.nofile, open_descriptors())
        if cap < self.cfg.server.max_connections:
            log.warning(
                "server.max_connections %d lowered to %d: the open-file limit is %d (raise LimitNOFILE=)",
                self.cfg.server.max_connections,
                cap,
                self.nofile,
            )
        return cap

    def _lock(self):
        """Hold ``<socket>.lock`` (flock on the open file) for the process's life; refuse if another hmad
        holds it, or if one answers on the socket all the same (its lock file was deleted): a daemon never
        unlinks a socket a live daemon serves."""
        self._runtime_dir(os.path.dirname(self.path))
        f = open(self.path + ".lock", "a")  # noqa: SIM115 - held until run() ends
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise ServiceError(f"another hmad is already serving at {self.path}") from None
        if socket_is_served(self.path):
            f.close()
            raise ServiceError(
                f"another hmad is already serving at {self.path} (its lock file {self.path}.lock was removed)"
            )
        if os.path.lexists(self.path):
            os.unlink(self.path)  # a stale socket of a process that is gone: nothing accepts on it
        return f

    @staticmethod
    def _runtime_dir(d: str) -> None:
        if not os.path.isdir(d):
            os.makedirs(d, mode=0o750, exist_ok=True)
            os.chmod(d, 0o750)
        st = os.stat(d)
        if st.st_uid != os.geteuid() and os.geteuid() != 0:
            raise ServiceError(f"runtime directory {d} belongs to uid {st.st_uid}, not to this user")

    def _load(self) -> None:
        """The load thread: the model resident, its scheduler's KV pools, every step bucket made ready
        (recorded on a GPU) so that the first requests after READY run at full speed. The result (or the
        error) is picked up by the serving thread's tick."""
        cfg = self.cfg
        self.notify(f"STATUS=loading {cfg.model}", f"EXTEND_TIMEOUT_USEC={EXTEND_BY_US}")
        self.loading.set()
        threading.Thread(target=self._extend_while_loading, daemon=True).start()
        try:
            if self.fault is not None and self.fault.stalls_load:
                stall_forever()  # TEST-ONLY: a load hung in one phase
            scheduler = load_scheduler(cfg, cfg.model, cfg.mmproj, self._progress, self.fault, self.load)
            model = scheduler.model
            phases = model.info["load_phases_s"]
            phases["ready_s"] = round(time.monotonic() - self.t0, 3)
            self._progress(f"ready: {model.config.name or model.path} on {model.backend.name}")
            self.loaded = scheduler
        except BaseException as e:  # noqa: BLE001 - handed to the serving thread, which raises it
            self.load_error = e
        finally:
            self.loading.clear()

    def load_status(self) -> dict:
        """What ``status`` shows while loading: the model, the phase, bytes uploaded of the total."""
        return {"model": str(self.cfg.model), **self.load, "elapsed_s": round(time.monotonic() - self.t0, 1)}

    def _progress(self, msg: str, done: int | None = None, total: int | None = None) -> None:
        if self.stopping:
            raise LoadCancelled("stopped while loading")
        self.load["phase"] = msg
        self.progress_count += 1
        if total:
            self.load["uploaded_bytes"], self.load["total_bytes"] = done, total
        log.info("%s", msg)
        self.notify(f"STATUS={msg}", f"EXTEND_TIMEOUT_USEC={EXTEND_BY_US}")

    def _extend_while_loading(self) -> None:
        """EXTEND_TIMEOUT_USEC= every EXTEND_EVERY_S, but only after a progress report since the last one:
        a load stuck in one phase stops extending, and systemd's start timeout fires."""
        seen = self.progress_count
        while self.loading.wait(0) and not self.stopping:
            time.sleep(EXTEND_EVERY_S)
            if self.progress_count != seen and self.loading.is_set() and not self.stopping:
                seen = self.progress_count
                self.notify(f"EXTEND_TIMEOUT_USEC={EXTEND_BY_US}")

    def progress_while_serving(self, msg: str) -> None:
        """A switch's load reports progress (hmad/switching.py): it gives up once hmad stops."""
        if self.stopping:
            raise LoadCancelled("stopped while loading")
        log.info("%s", msg)

    # -- serve -----------------------------------------------------------------------------------------
    def start_engine(self, server: Server, scheduler: Scheduler) -> None:
        """The engine thread of a loaded scheduler, attached to the server (at start and after a switch)."""
        model = scheduler.model
        server.status_extra = lambda: {**self._status_extra(model), **self.switcher.status_extra()}
        freeze_loaded_objects()
        engine = EngineThread(scheduler, server.wake, server.metrics)
        server.attach(engine, model)
        engine.start()

    def _start_serving(self, server: Server, scheduler: Scheduler) -> None:
        """Called once by the serving thread when the first load is done: the engine starts, READY=1."""
        model = scheduler.model
        self.switcher = Switcher(self, server, str(self.cfg.model), model.path)
        self.start_engine(server, scheduler)
        self.loaded = None  # the switcher owns the model's life from here
        server.loading_status = self.switcher.loading_status
        server.models, server.model_routes = self.switcher, ModelRoutes(server, self.switcher)
        self.switcher.more = server.model_routes.status
        threading.Thread(target=self._watchdog, args=(server,), daemon=True).start()
        threading.Thread(target=self._status_updates, args=(server,), daemon=True).start()
        self.notify("READY=1", f"STATUS=serving {model.config.name or model.path} on {model.backend.name}")
        log.info("serving %s (%s) at %s", model.path, model.backend.name, self.path)

    def _status_extra(self, model) -> dict:
        extra = {"npu": npu_status(model.backend), "load": model.info["load_phases_s"]}
        if self.fault is not None:
            extra["test_fault"] = self.fault.describe()
        return extra

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

        def on_hup(_signum, _frame):
            self.hup = True

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGHUP, on_hup)

    def _tick(self, server: Server) -> bool:
        """Called by the server loop: start serving once loaded; end the loop if the load failed or a stop
        signal came during it; start the drain once a stop signal arrived or the engine failed."""
        if self.hup:
            self.hup = False
            log.info("SIGHUP: nothing to reload (hmactl load changes the model; restart for the rest)")
        if self.switcher is None:  # the first load
            if self.load_error is not None:
                return True
            if self.loaded is not None:
                self._start_serving(server, self.loaded)
            elif self.stop_signal is not None:
                log.info("%s while loading: stopping", signal.Signals(self.stop_signal).name)
                return True
            return False
        if not self.stopping:
            self.switcher.tick()
        server.model_routes.flush()
        if server.engine is not None and server.engine.failed and not self.stopping:
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
            self.switcher.stop()
        return False

    def _status_updates(self, server: Server) -> None:
        """STATUS= every service.status_every_s while serving (what `systemctl status hmad` shows)."""
        every = self.cfg.service.status_every_s
        while every > 0 and not self.stopping:
            time.sleep(every)
            engine = server.engine
            if engine is None:
                if not self.stopping:
                    self.notify(f"STATUS={self.switcher.state}: {self.switcher.load.get('phase', '')}")
                continue
            snap = engine.snapshot
            if not self.stopping:
                self.notify(
                    f"STATUS=serving: {snap.get('running', 0)} running, {snap.get('queued', 0)} queued, "
                    f"{snap.get('tokens_per_s', 0.0)} tok/s"
                )

    def _watchdog(self, server: Server) -> None:
        """WATCHDOG=1 while the engine makes progress (or while no engine is attached: a switch loads, or
        the model is unloaded; the loop answers)."""
        usec = int(os.environ.get("WATCHDOG_USEC", "0") or 0)
        if not usec or not self.cfg.service.watchdog:
            return
        period = usec / 2e6
        while True:
            time.sleep(period)
            engine = server.engine
            if engine is None or time.monotonic() - engine.last_progress < 2 * period:
                self.notify("WATCHDOG=1")
            else:
                log.warning(
                    "engine made no progress for %.1f s: withholding WATCHDOG=1",
                    time.monotonic() - engine.last_progress,
                )


def socket_is_served(path: str) -> bool:
    """Whether a process accepts connections on Unix socket ``path`` now (a live daemon's socket)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(path)
        return True
    except OSError:  # no file, not a socket, nobody listening (ECONNREFUSED)
        return False
    finally:
        s.close()


def freeze_loaded_objects() -> None:
    """Move every object alive once the model is loaded (the tokenizer's tables, the config, the kernels'
    bookkeeping) out of the garbage collector's reach: they live as long as hmad, and a full collection no
    longer walks them, which shortens the pauses a request's own garbage causes in every thread, the socket
    loop's included (tests/test_hostile_loop.py bounds ping at 100 ms while a 1 MB prompt is tokenized)."""
    gc.collect()
    gc.freeze()
