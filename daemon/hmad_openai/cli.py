"""``hmad-openai``: serve OpenAI's, Anthropic's and Ollama's HTTP APIs for the hmad at ``--socket``, on
127.0.0.1:8080 by default (``docs/gateway.md``).

    hmad-openai [--socket PATH] [--host ADDR] [--port N] [--api-key KEY | --api-key-file PATH]
                [--model-name NAME] [--cors-origin ORIGIN]... [--allowed-host NAME]...
                [--header-timeout S] [--body-timeout S] [--log-level LEVEL]

The API key (bearer token) comes from ``--api-key-file`` (its first line), else ``--api-key``, else
``$HMAD_OPENAI_API_KEY``; without one, the API is open to whoever can reach the address (the default
address is the loopback, reachable from this machine only). ``--port 0`` takes a free port; the log line
``hmad-openai: serving http://HOST:PORT/v1`` says which.

Requests must name a loopback address (127.0.0.0/8, [::1], localhost) in their Host header, or a name given
with ``--allowed-host`` (repeatable; ``*`` for any), or the ``--host`` address itself when it is not a
wildcard; reaching the gateway by a LAN address or a host name needs that name. A request head must arrive
within ``--header-timeout`` seconds and its body within ``--body-timeout`` seconds, else the connection is
closed (``hmad_openai.deadlines``).
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

import uvicorn

from hmaclient.protocol import default_socket_path
from hmad_openai.app import Settings, build_app
from hmad_openai.deadlines import with_deadlines

log = logging.getLogger("hmad_openai")

API_KEY_ENV = "HMAD_OPENAI_API_KEY"
GRACEFUL_SHUTDOWN_S = 10.0  # on SIGTERM, streams still running after this are cancelled (and so in hmad)
HEADER_TIMEOUT_S = 10.0  # a request line and headers arrive at once from any real client
BODY_TIMEOUT_S = 60.0  # the largest body (MAX_BODY_BYTES: images in base64) at a slow link's pace


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="hmad-openai", description="HTTP gateway to hmad: the OpenAI, Anthropic and Ollama APIs."
    )
    ap.add_argument("--socket", metavar="PATH", help=f"hmad's socket (default: {default_socket_path()})")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    ap.add_argument("--port", type=tcp_port, default=8080, help="TCP port (default: 8080; 0: any free port)")
    key = ap.add_mutually_exclusive_group()
    key.add_argument("--api-key", metavar="KEY", help=f"bearer token clients must send (or ${API_KEY_ENV})")
    key.add_argument("--api-key-file", metavar="PATH", help="read the bearer token from this file")
    ap.add_argument("--model-name", metavar="NAME", help="model id to report (default: hmad's model name)")
    ap.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let web pages from ORIGIN (e.g. http://localhost:3000; * for any) call the API (repeatable)",
    )
    ap.add_argument(
        "--allowed-host",
        action="append",
        default=[],
        metavar="NAME",
        help="answer requests whose Host is NAME too, besides loopback names (repeatable; * for any)",
    )
    ap.add_argument(
        "--header-timeout",
        type=seconds,
        default=HEADER_TIMEOUT_S,
        metavar="S",
        help=f"close a connection whose request head takes over S seconds (default: {HEADER_TIMEOUT_S:g})",
    )
    ap.add_argument(
        "--body-timeout",
        type=seconds,
        default=BODY_TIMEOUT_S,
        metavar="S",
        help=f"close a connection whose request body takes over S seconds (default: {BODY_TIMEOUT_S:g})",
    )
    ap.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return ap


def tcp_port(text: str) -> int:
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is 0..65535, got {port}")
    return port


def seconds(text: str) -> float:
    value = float(text)
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"a timeout is over 0 and at most 3600 seconds, got {text}")
    return value


def allowed_hosts(args: argparse.Namespace) -> tuple[str, ...]:
    """``--allowed-host`` names, and the ``--host`` address unless it is a wildcard (0.0.0.0, ::)."""
    listen = [] if args.host in ("0.0.0.0", "::", "") else [args.host]
    return tuple(args.allowed_host) + tuple(listen)


def api_key(args: argparse.Namespace) -> str | None:
    if args.api_key_file:
        with open(args.api_key_file) as f:
            key = f.readline().strip()
        if not key:
            raise ValueError(f"{args.api_key_file} holds no API key")
        return key
    return args.api_key or os.environ.get(API_KEY_ENV) or None


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (IPv4 or IPv6, as the address resolves)."""
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    return socket.create_server(addr[:2], family=family)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        settings = Settings(
            args.socket, api_key(args), args.model_name, tuple(args.cors_origin), allowed_hosts(args)
        )
        sock = listen(args.host, args.port)
    except (OSError, ValueError) as e:
        print(f"hmad-openai: {e}", file=sys.stderr)
        return 2
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    log.info(
        "hmad-openai: serving http://%s:%d/v1 for hmad at %s%s",
        shown,
        port,
        settings.socket or default_socket_path(),
        "" if settings.api_key else " (no API key)",
    )
    config = uvicorn.Config(
        build_app(settings),
        log_level=args.log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        server_header=False,
        http=with_deadlines(args.header_timeout, args.body_timeout),
    )
    uvicorn.Server(config).run(sockets=[sock])
    return 0
