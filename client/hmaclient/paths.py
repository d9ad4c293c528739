"""Where the daemon listens: the one socket-path rule, for the daemon and its clients alike."""

from __future__ import annotations

import os
from collections.abc import Mapping

MAX_IPC_PATH_BYTES = 107  # sockaddr_un.sun_path holds 108 bytes with the terminating NUL
SYSTEM_SOCKET_DIR = "/run/hmad"  # the system service's RuntimeDirectory (systemd/hmad.service)


def default_socket_path(
    env: Mapping[str, str] = os.environ, euid: int | None = None, system_dir: str = SYSTEM_SOCKET_DIR
) -> str:
    """Where hmad listens when no one says: the same answer for the daemon (it binds there) and a client.

    1. ``$HMAD_SOCKET``, when set;
    2. ``system_dir``/hmad.sock, for root (who makes the directory) or when ``system_dir`` is a directory this
       user may enter: the system service's (systemd's ``RuntimeDirectory=hmad``, group hmad may enter);
    3. ``$XDG_RUNTIME_DIR``/hmad/hmad.sock, when that is an absolute path (the user's own daemon);
    4. ``$TMPDIR`` (absolute, else /tmp) /hmad-<euid>/hmad.sock. Anyone can create a name under /tmp first:
       the daemon makes this directory 0700 and refuses one it does not own, and clients refuse a socket
       whose directory another user owns (``hmaclient.safepath``).

    A user who may enter /run/hmad and runs a daemon of their own gives it (and its clients) a path.
    """
    if env.get("HMAD_SOCKET"):
        return env["HMAD_SOCKET"]
    euid = os.geteuid() if euid is None else euid
    if euid == 0 or (os.path.isdir(system_dir) and os.access(system_dir, os.X_OK)):
        return os.path.join(system_dir, "hmad.sock")
    xdg = env.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(xdg):
        return os.path.join(xdg, "hmad", "hmad.sock")
    tmp = env.get("TMPDIR", "")
    return os.path.join(tmp if os.path.isabs(tmp) else "/tmp", f"hmad-{euid}", "hmad.sock")


def endpoint(path: str) -> str:
    """The ZeroMQ address of a socket path: ``ipc://`` + path (which must fit a Unix socket address)."""
    if len(os.fsencode(path)) > MAX_IPC_PATH_BYTES:
        raise ValueError(f"socket path is over {MAX_IPC_PATH_BYTES} bytes (a Unix socket limit): {path}")
    return "ipc://" + path
