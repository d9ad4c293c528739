"""Start a real `hmad` process on a real ipc:// socket in a temp dir, for daemon and client tests."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import zmq

from hmaclient import protocol as P


class Daemon:
    """A running hmad (``python -m hmad``) with its socket, log file and exit status."""

    def __init__(
        self,
        model: str | Path,
        tmp: Path,
        *sets: str,
        backend: str = "cpu",
        env: dict[str, str] | None = None,
        nofile: tuple[int, int] | None = None,
    ):
        """``sets``: ``--set KEY=VALUE`` overrides; ``env``: extra environment variables (e.g. the test-only
        HMAD_TEST_FAULT of hmad/faults.py); ``nofile``: the (soft, hard) open-file limit of the process."""
        self.socket = str(tmp / "run" / "hmad.sock")
        self.log_path = tmp / "hmad.log"
        cmd = [
            sys.executable,
            "-m",
            "hmad",
            "--model",
            str(model),
            "--backend",
            backend,
            "--socket",
            self.socket,
            "--log-level",
            "info",
        ]
        for s in sets:
            cmd += ["--set", s]
        env = {**os.environ, "HMAD_CONFIG": str(tmp / "none.yaml"), **(env or {})}
        (tmp / "none.yaml").write_text("{}\n")
        self.log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        limit = None if nofile is None else (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, nofile))
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, preexec_fn=limit
        )

    def wait_ready(self, timeout: float = 120.0) -> Daemon:
        """Until the daemon answers a ping with state ready, its model loaded (raises with its log if it
        exits or takes too long)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"hmad exited with {self.proc.returncode}:\n{self.log_text()}")
            if os.path.exists(self.socket) and self.ping(0.5):
                return self
            time.sleep(0.1)
        raise TimeoutError(f"hmad not ready in {timeout} s:\n{self.log_text()}")

    def _ask(self, request: dict, timeout: float) -> bytes | None:
        """One request on a connection of its own: the reply's frame, None if none came in ``timeout``."""
        with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as s:
            s.setsockopt(zmq.LINGER, 0)
            s.connect(P.endpoint(self.socket))
            s.send(P.pack(request))
            return s.recv() if s.poll(int(timeout * 1000)) else None

    def ping(self, timeout: float = 2.0) -> bool:
        frame = self._ask(P.ping_request("harness"), timeout)
        if frame is None:
            return False
        reply = P.parse_reply(frame)
        return isinstance(reply, P.Pong) and reply.state == "ready"

    def status(self, timeout: float = 5.0) -> dict:
        """One ``status`` reply's map, on a connection of its own."""
        frame = self._ask(P.status_request("harness"), timeout)
        if frame is None:
            raise TimeoutError(f"no status reply in {timeout} s")
        return P.unpack(frame, max_size=P.MAX_REPLY_BYTES)["status"]

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise RuntimeError("no VmRSS")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.log.close()
        return code

    def log_text(self) -> str:
        if not self.log.closed:  # after stop() the log is closed and complete
            self.log.flush()
        return self.log_path.read_text()


def run_in_threads(fn, arg_tuples) -> None:
    """``fn(*args)`` for each of ``arg_tuples``, each in a thread of its own, all started at once; after
    every thread ended, the first exception one of them raised is raised here."""
    errors: list[BaseException] = []

    def guarded(*args) -> None:
        try:
            fn(*args)
        except BaseException as e:  # re-raised in the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=a) for a in arg_tuples]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
