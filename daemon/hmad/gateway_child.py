"""The HTTP gateway as hmad's supervised child process (config section ``http``): one service gives the
socket and, when ``http.enabled`` is true, the HTTP APIs of ``hmad-openai`` (daemon/hmad_openai).

hmad (``supervised`` around its serve loop)      the child: python -m hmad.gateway_child → hmad-openai
───────────────────────────────────────────      ──────────────────────────────────────────────────────
socket bound, the model loading                  not yet started
``serving()`` turns true (the model loaded)      started: --socket <socket.path> --host --port … from
                                                 ``http``; in a session of its own (a terminal's Ctrl-C
                                                 reaches hmad only), SIGTERM if hmad dies without
                                                 stopping it (PR_SET_PDEATHSIG)
the child exits by itself                        logged, started again after 1, 2, 4 … MAX_DELAY_S
                                                 seconds; a run of STABLE_S starts the delays over.
                                                 hmad serves its socket all the while
SIGTERM / SIGINT to hmad                         SIGTERM to the child at once, from the signal handler,
                                                 before hmad's drain begins (the child's streams end as
                                                 hmad's drain ends their requests)
the serve loop ends (any reason)                 SIGTERM if not sent yet; waited for STOP_WAIT_S, then
                                                 SIGKILL. Nothing the child does ends hmad.

Not started, with one error line saying why, when the ``openai`` extra is not installed or when this process
may not open a socket of the address's family (a unit with RestrictAddressFamilies=AF_UNIX).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hmad.config import Config

log = logging.getLogger("hmad.gateway")

POLL_S = 0.2  # how often the supervisor looks at the child (and, before it starts, at the load)
FIRST_DELAY_S = 1.0
MAX_DELAY_S = 30.0
STABLE_S = 30.0  # a child that ran this long counts as healthy: its next restart waits FIRST_DELAY_S
STOP_WAIT_S = 15.0  # hmad-openai gives running streams 10 s on SIGTERM (cli.GRACEFUL_SHUTDOWN_S), then exits
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# systemd's hand-over variables are hmad's alone (NotifyAccess=main; a child never speaks for the service)
HMAD_ONLY_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID")
PR_SET_PDEATHSIG = 1


def gateway_argv(cfg: Config) -> list[str]:
    """The child's command line: hmad-openai's flags from ``http``, hmad's socket and log level."""
    http = cfg.http
    argv = [sys.executable, "-m", "hmad.gateway_child", str(os.getpid())]
    argv += ["--socket", cfg.socket.path, "--host", http.host, "--port", str(http.port)]
    argv += ["--log-level", cfg.log_level]
    if http.api_key_file:
        argv += ["--api-key-file", http.api_key_file]
    for name in http.allowed_hosts:
        argv += ["--allowed-host", name]
    for origin in http.cors_origins:
        argv += ["--cors-origin", origin]
    return argv


@contextlib.contextmanager
def supervised(cfg: Config, serving: Callable[[], bool]) -> Iterator[GatewayChild | None]:
    """Run the gateway child while the block runs, if ``http.enabled``; ``serving()`` says when the model is
    loaded and the socket serves (the child starts then). Yields the GatewayChild, or None."""
    reason = _cannot_serve(cfg) if cfg.http.enabled else None
    if not cfg.http.enabled or reason:
        if reason:
            log.error("http.enabled is true, but %s: the HTTP API is not served", reason)
        yield None
        return
    child = GatewayChild(gateway_argv(cfg), serving, f"http://{_shown(cfg.http.host)}:{cfg.http.port}/v1")
    child.start()
    try:
        yield child
    finally:
        child.close()


def _cannot_serve(cfg: Config) -> str | None:
    """Why the child could not serve at all (restarting would not help), or None."""
    from hmad_openai.__main__ import INSTALL_HINT, missing_extra

    missing = missing_extra()
    if missing:
        return f"{missing} is not installed ({INSTALL_HINT})"
    try:
        family = socket.getaddrinfo(cfg.http.host, cfg.http.port, type=socket.SOCK_STREAM)[0][0]
        socket.socket(family, socket.SOCK_STREAM).close()
    except OSError as e:  # EAFNOSUPPORT / EPERM under RestrictAddressFamilies=AF_UNIX
        return f"this process may not listen on {cfg.http.host} ({e.strerror or e}; see systemd/README.md)"
    return None


def _shown(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class GatewayChild:
    """The supervisor: a thread that starts the child, restarts it with backoff, and stops it."""

    def __init__(self, argv: list[str], serving: Callable[[], bool], url: str):
        self.argv, self.serving, self.url = argv, serving, url
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.starts = 0  # how many times the child was started (a restart counts)
        self._stop = threading.Event()
        self._previous: dict[int, Any] = {}  # the stop signals' handlers before ours
        self._thread = threading.Thread(target=self._supervise, name="hmad-gateway", daemon=True)

    def start(self) -> None:
        self._chain_signals()
        self._thread.start()

    def stop(self) -> None:
        """SIGTERM the child and start no other; returns at once (it runs in a signal handler)."""
        self._stop.set()
        proc = self.proc
        if proc is not None:
            proc.send_signal(signal.SIGTERM)  # a no-op once it has been reaped

    def close(self) -> None:
        """Stop the child and wait for it (SIGKILL after STOP_WAIT_S); hmad's handlers back in place."""
        self._restore_signals()
        self.stop()
        self._thread.join(STOP_WAIT_S + 5)

    # -- the supervisor thread (the child's parent: PR_SET_PDEATHSIG follows this thread) ---------------
    def _supervise(self) -> None:
        delay, next_start = FIRST_DELAY_S, 0.0
        try:
            while not self._stop.wait(POLL_S):
                if self.proc is None:
                    if time.monotonic() >= next_start and self.serving():
                        self._spawn()
                elif self.proc.poll() is not None:
                    up = time.monotonic() - self.started
                    delay = FIRST_DELAY_S if up >= STABLE_S else delay
                    log.warning(
                        "HTTP gateway (pid %d) exited (%s) after %.1f s: starting it again in %g s",
                        self.proc.pid,
                        _status(self.proc.returncode),
                        up,
                        delay,
                    )
                    self.proc, next_start = None, time.monotonic() + delay
                    delay = min(2 * delay, MAX_DELAY_S)
        except Exception:  # noqa: BLE001 - never hmad's end: the HTTP API goes, the socket stays
            log.exception("the HTTP gateway's supervisor failed: the HTTP API is no longer served")
        finally:
            self._end_child()

    def _spawn(self) -> None:
        env = {k: v for k, v in os.environ.items() if k not in HMAD_ONLY_ENV}
        try:
            self.proc = subprocess.Popen(self.argv, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError as e:  # EAGAIN, ENOMEM: tried again at the next poll
            log.error("cannot start the HTTP gateway: %s", e)
            return
        self.started, self.starts = time.monotonic(), self.starts + 1
        if self._stop.is_set():  # a stop signal came while it was being started
            self.proc.send_signal(signal.SIGTERM)
        log.info("HTTP gateway started (pid %d): %s", self.proc.pid, self.url)

    def _end_child(self) -> None:
        proc = self.proc
        if proc is None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            log.warning(
                "HTTP gateway (pid %d) still runs %.0f s after SIGTERM: killed", proc.pid, STOP_WAIT_S
            )
            proc.kill()
            code = proc.wait()
        log.info("HTTP gateway (pid %d) stopped (%s)", proc.pid, _status(code))

    # -- hmad's stop signals reach the child first ------------------------------------------------------
    def _chain_signals(self) -> None:
        for sig in STOP_SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._on_stop_signal)
            except ValueError:  # not the main thread: the child stops when the block ends
                return

    def _restore_signals(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _on_stop_signal(self, signum: int, frame: Any) -> None:
        self.stop()
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL:  # nobody else handles it: what it would have done
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


def _status(code: int | None) -> str:
    if code is not None and code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"status {code}"


# -- the child -------------------------------------------------------------------------------------------


def _die_with(parent: int) -> None:
    """SIGTERM this process when the hmad thread that started it ends, however hmad ends (a crash, SIGKILL),
    so that no gateway outlives its hmad holding the port."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # hmad ended before the line above
        sys.exit(0)


if __name__ == "__main__":  # python -m hmad.gateway_child HMAD_PID [hmad-openai flags]
    _die_with(int(sys.argv[1]))
    from hmad_openai.__main__ import main

    sys.exit(main(sys.argv[2:]))
