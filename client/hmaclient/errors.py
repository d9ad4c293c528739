"""The errors the client raises, all ``HmaError``s.

``RequestError`` (the daemon's ``error`` reply: ``.code``, ``.message``), ``RequestCancelled`` (a
``RequestError``: ``generate()``'s request was cancelled), ``HmadTimeout`` (a ``TimeoutError``),
``DaemonUnreachable`` (a ``ConnectionError``: no socket file, or no answer to a ping within
``connect_timeout``), ``UnsafeSocket`` (a ``DaemonUnreachable``: the socket or a directory above it could be
another user's, see ``hmaclient.safepath``; nothing was sent), ``ConnectionLost`` (a ``DaemonUnreachable``:
the daemon went away while a request ran). Bad parameters raise ``protocol.ProtocolError`` (a
``ValueError``) before anything is sent.
"""

from __future__ import annotations

from hmaclient import protocol as P


class HmaError(Exception):
    """Base class of the errors the client raises."""


class RequestError(HmaError):
    """The daemon answered ``error``: ``code`` is a protocol error code, ``message`` says why."""

    def __init__(self, code: str, message: str, id: P.Id = None):
        super().__init__(f"{code}: {message}")
        self.code, self.message, self.id = code, message, id


class RequestCancelled(RequestError):
    """``generate()``'s request was cancelled (by ``cancel(id)`` or by the daemon)."""

    def __init__(self, id: P.Id, generated_tokens: int):
        super().__init__("cancelled", f"request {id!r} was cancelled after {generated_tokens} tokens", id)
        self.generated_tokens = generated_tokens


class HmadTimeout(HmaError, TimeoutError):
    """No answer within the call's ``timeout``; a running generation has been cancelled."""


class DaemonUnreachable(HmaError, ConnectionError):
    """hmad is not running at the socket path (or does not answer)."""

    def __init__(self, path: str, detail: str = ""):
        self.path = path
        super().__init__(
            f"hmad is not running at {path}: start it with `systemctl start hmad` or `hmad --foreground`"
            + (f" ({detail})" if detail else "")
        )


class UnsafeSocket(DaemonUnreachable):
    """The socket, or a directory above it, could be another user's: the client refuses to connect there
    (``hmaclient.safepath`` gives the rule)."""

    def __init__(self, path: str, reason: str):
        self.path, self.reason = path, reason
        ConnectionError.__init__(
            self, f"refusing hmad's socket {path}: {reason}, so another user could answer in hmad's place"
        )


class ConnectionLost(DaemonUnreachable):
    """The connection to hmad dropped while a request was running (daemon stopped or restarted)."""

    def __init__(self, path: str):
        self.path = path
        why = "the daemon stopped or restarted"
        ConnectionError.__init__(self, f"lost the connection to hmad at {path} while the request ran ({why})")
