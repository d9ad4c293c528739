"""hmaclient: the client library of hmad (wire format in ``hmaclient.protocol``)."""

from hmaclient.client import AsyncClient, Client
from hmaclient.errors import (
    ConnectionLost,
    DaemonUnreachable,
    HmadTimeout,
    HmaError,
    RequestCancelled,
    RequestError,
    UnsafeSocket,
)
from hmaclient.protocol import PROTOCOL_VERSION, ProtocolError, default_socket_path
from hmaclient.results import Piece, Result
from hmaclient.stream import AsyncStream

__all__ = [
    "PROTOCOL_VERSION",
    "AsyncClient",
    "AsyncStream",
    "Client",
    "ConnectionLost",
    "DaemonUnreachable",
    "HmaError",
    "HmadTimeout",
    "Piece",
    "ProtocolError",
    "RequestCancelled",
    "RequestError",
    "Result",
    "UnsafeSocket",
    "default_socket_path",
]
