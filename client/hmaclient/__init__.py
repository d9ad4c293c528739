"""hmaclient: the client library of hmad (wire format in ``hmaclient.protocol``)."""

from hmaclient.client import (
    AsyncClient,
    AsyncStream,
    Client,
    ConnectionLost,
    DaemonUnreachable,
    HmadTimeout,
    HmaError,
    Piece,
    RequestCancelled,
    RequestError,
    Result,
    UnsafeSocket,
)
from hmaclient.protocol import PROTOCOL_VERSION, ProtocolError, default_socket_path

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
