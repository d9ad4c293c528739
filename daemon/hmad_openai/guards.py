"""What the gateway refuses before any handler runs, so that a web page cannot use it (with or without a key):

- a ``Host`` that names neither a loopback address (127.0.0.0/8, ::1, ``localhost``; any port) nor a name
  given with ``--allowed-host``: a page on a name the attacker controls that resolves to 127.0.0.1 (DNS
  rebinding) sends its own name as Host. 400, code ``invalid_host``. ``--allowed-host '*'`` takes any.
- from a browser (the request carries an ``Origin`` header, as a browser's POST always does), a body whose
  ``Content-Type`` is not ``application/json``: a page may POST ``text/plain`` or a form to any origin
  without a CORS preflight, while ``application/json`` needs one (which only ``--cors-origin`` origins
  pass). 415, code ``unsupported_media_type``. A request without ``Origin`` comes from no web page (curl,
  SDKs, scripts), so its body is read as JSON whatever its type (``curl URL -d '{...}'`` sends a form's).

Slow clients are cut off by the server's read deadlines (``hmad_openai.deadlines``).
"""

from __future__ import annotations

import ipaddress

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from hmad_openai.errors import OpenAIError

ANY_HOST = "*"
JSON = "application/json"


def host_name(header: str) -> str:
    """The name or address of a Host header, without port, brackets or a final dot, in lower case."""
    value = header.strip().lower()
    if value.startswith("["):  # [::1]:8080
        return value[1:].partition("]")[0]
    name, colon, port = value.rpartition(":")
    if colon and (port.isdigit() or not port) and ":" not in name:
        value = name
    return value.rstrip(".")


def is_loopback(name: str) -> bool:
    if name == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # ::ffff:127.0.0.1
    return ip.is_loopback or bool(mapped and mapped.is_loopback)


def host_allowed(header: str | None, allowed: frozenset[str]) -> bool:
    """Whether a request's Host header (None: there was none) is one the gateway answers."""
    if ANY_HOST in allowed:
        return True
    if not header:
        return False
    name = host_name(header)
    return is_loopback(name) or name in allowed


class AllowedHosts:
    """400 ``invalid_host`` unless the Host header passes ``host_allowed``."""

    def __init__(self, app: ASGIApp, allowed: tuple[str, ...] = ()):
        self.app = app
        self.allowed = frozenset(n if n == ANY_HOST else host_name(n) for n in allowed)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = Headers(scope=scope).get("host")
            if not host_allowed(host, self.allowed):
                shown = "no Host header" if not host else f"the Host {host!r}"
                message = (
                    f"{shown} is not allowed: this gateway answers loopback names (localhost, 127.0.0.1,"
                    " [::1]) and the names given with --allowed-host"
                )
                await OpenAIError(400, message, code="invalid_host").response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def require_json(content_type: str | None, origin: str | None) -> None:
    """Raise a 415 OpenAIError when a request from a web page (``origin``: its Origin header, None when it
    has none) does not send its body as application/json (parameters such as charset allowed)."""
    if origin is None:
        return
    media = (content_type or "").partition(";")[0].strip().lower()
    if media != JSON:
        got = f"got {content_type!r}" if content_type else "got none"
        raise OpenAIError(
            415,
            f"the request body must be sent as Content-Type: {JSON} ({got})",
            code="unsupported_media_type",
        )
