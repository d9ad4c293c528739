"""Who is connected: the ROUTER's connections, counted and capped, each with its peer's credentials.

A ZMQ socket monitor reports every accepted connection (with its file descriptor) and every disconnection
(a peer that closed, died, or stopped answering heartbeats within ``heartbeat_timeout_s``). Every message
names the descriptor it came in on (``SRCFD``) and its peer's credentials (``Peer-Address``, which libzmq
fills from SO_PEERCRED on a Unix socket as ``host:uid:gid:pid``), so the server learns which routing id
each connection carries and, when the connection goes, which requests to cancel.

Past ``max_connections``, or past ``max_per_uid`` connections of one user, a new connection is shut
down once the loop has seen it accepted and read the socket empty (``end_quiet``, below); its client sees
the connection end, and a ZMQ client reconnects later; those already served carry on. (Unbinding to stop
accepting is no way out: libzmq closes every connection a listener accepted with it.) libzmq aborts the
process when ``accept`` fails with EMFILE, so the cap is kept at half the descriptors the open-file limit
leaves (``connection_cap``; the other half absorbs a burst accepted before the loop shuts it down), and
the soft limit is raised to the hard one at start (``raise_nofile_limit``).

No connection is shut down while its messages may fill its pipe into the socket. libzmq 4.3 stops reading
a connection whose pipe holds RCVHWM messages until the socket reads them; if the connection ends in that
state (``stream_engine_base_t::in_event_internal`` sets ``_io_error``) and a heartbeat falls due before the
socket has read the pipe down, the heartbeat timer calls ``out_event``, which asserts ``!_io_error`` and
aborts the process. So a dropped peer's messages are read and discarded unhandled, and its connection is
shut down only when the socket is read empty and the peer was quiet since (``drop``, ``end_quiet``); a
connection refused over the cap waits for the socket read empty too. A peer that ends its own connection
with its pipe full can still trip that assertion: only the loop's prompt reading narrows the window.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import resource
import socket
import struct
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import parse_monitor_message

log = logging.getLogger("hmad.peers")

# descriptors kept free for everything but connections (model files, device nodes, the log, threads'
# eventfds); see docs/protocol.md, "Limits"
FD_RESERVE = 64


def raise_nofile_limit() -> int:
    """Raise the soft open-file limit to the hard one; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def connection_cap(configured: int, soft_limit: int, open_now: int) -> int:
    """The most connections served at once: ``configured``, or fewer if they would take more than half
    the descriptors left after ``open_now`` and FD_RESERVE (at least 1). The other half is the margin for
    a burst that libzmq accepts before the loop shuts it down."""
    room = (soft_limit - open_now - FD_RESERVE) // 2
    return max(1, min(configured, room))


def open_descriptors() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return 0


@dataclass
class Conn:
    """One accepted connection: its descriptor, its peer's credentials (None if unknown), its routing id
    once it has sent a message."""

    fd: int
    uid: int | None = None
    pid: int | None = None
    peer: bytes | None = None


def peer_credentials(fd: int) -> tuple[int, int] | None:
    """(uid, pid) of the process at the other end of Unix socket ``fd`` (SO_PEERCRED), None if not one."""
    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return None
    try:
        pid, uid, _gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        return uid, pid
    except OSError:
        return None
    finally:
        s.detach()  # the descriptor is libzmq's: never close it here


def shut_down(fd: int) -> None:
    """End connection ``fd`` from our side; libzmq sees the end and closes (and reports) it."""
    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        s.detach()


def parse_peer_address(value: str | None) -> tuple[int, int] | None:
    """(uid, pid) from libzmq's ``Peer-Address`` of a Unix socket (``host:uid:gid:pid``)."""
    if not value:
        return None
    parts = value.rsplit(":", 3)
    try:
        return int(parts[1]), int(parts[3])
    except (IndexError, ValueError):
        return None


class Peers:
    """The connections of one ROUTER: ``monitor`` is polled by the socket loop, ``on_monitor`` returns
    the routing ids of connections that have gone."""

    def __init__(self, sock: zmq.Socket, max_connections: int, max_per_uid: int | None = None):
        self.max_connections = max_connections
        self.max_per_uid = max_per_uid or max_connections
        self.per_uid: collections.Counter = collections.Counter()  # connections of each known uid
        addr = f"inproc://hmad-monitor-{id(self)}"
        sock.monitor(addr, zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.monitor = sock.context.socket(zmq.PAIR)
        self.monitor.setsockopt(zmq.RCVHWM, 0)  # no event is ever dropped: every connection is counted
        self.monitor.connect(addr)
        self.conns: dict[int, Conn] = {}  # fd -> connection
        self.by_peer: dict[bytes, Conn] = {}
        self.refused = 0  # connections shut down for being over the cap
        self.dropped: dict[bytes, Conn] = {}  # connections to end (``drop``), until libzmq reports them ended
        self.ending: set[bytes] = set()  # those of them shut down already
        self.refusing: set[int] = set()  # descriptors of connections over the cap, to shut down when quiet

    def __len__(self) -> int:
        return len(self.conns)

    def on_monitor(self) -> list[bytes]:
        """Handle every pending monitor event; the routing ids of connections that ended."""
        gone = []
        while True:
            try:
                msg = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return gone
            fd = msg["value"]
            if msg["event"] == zmq.EVENT_ACCEPTED:
                self._accepted(fd)
            else:
                self.refusing.discard(fd)
                conn = self.conns.pop(fd, None)
                if conn is not None and conn.uid is not None:
                    self.per_uid[conn.uid] -= 1
                if conn is not None and conn.peer is not None:
                    self.by_peer.pop(conn.peer, None)
                    self.dropped.pop(conn.peer, None)
                    self.ending.discard(conn.peer)
                    gone.append(conn.peer)

    def _accepted(self, fd: int) -> None:
        uid, pid = peer_credentials(fd) or (None, None)
        if len(self.conns) >= self.max_connections:
            why = f"{len(self)} connections open (server.max_connections)"
        elif uid is not None and self.per_uid[uid] >= self.max_per_uid:
            why = f"user {uid} has {self.per_uid[uid]} connections open (server.max_connections_per_uid)"
        else:
            self.conns[fd] = Conn(fd, uid, pid)
            if uid is not None:
                self.per_uid[uid] += 1
            return
        self.refused += 1
        if self.refused == 1 or self.refused % 1000 == 0:
            log.warning("%s: refusing new connections", why)
        self.refusing.add(fd)  # shut down by ``end_quiet``

    def note(self, peer: bytes, frame: zmq.Frame) -> Conn | None:
        """The connection a message came in on, learning its routing id; None if it is not one served
        (shut down for being over the cap, or already gone)."""
        conn = self.by_peer.get(peer)
        if conn is not None:
            return conn
        with contextlib.suppress(zmq.ZMQError):
            conn = self.conns.get(frame.get(zmq.SRCFD))
        if conn is None or conn.peer is not None:  # not seen yet, or the record of an earlier connection
            return None  # whose descriptor this one reuses (its events still on their way)
        if conn.uid is None:
            with contextlib.suppress(zmq.ZMQError):
                creds = parse_peer_address(frame.get("Peer-Address"))
                if creds is not None:
                    conn.uid, conn.pid = creds
                    self.per_uid[conn.uid] += 1
        conn.peer = peer
        self.by_peer[peer] = conn
        return conn

    def drop(self, peer: bytes) -> None:
        """End ``peer``'s connection from our side (its requests are the server's to cancel). From now
        on the socket loop reads and discards what ``peer`` sends, unhandled, and calls ``end_quiet`` when
        the socket has nothing left to read: the connection is shut down once ``peer`` is quiet."""
        conn = self.by_peer.get(peer)
        if conn is not None:
            self.dropped[peer] = conn

    def end_quiet(self, heard: set[bytes]) -> None:
        """Shut down the dropped connections not in ``heard`` (the peers read from since the socket was
        last found empty). Shutting down a connection whose messages fill its inbound pipe would let
        libzmq abort the process (module docstring): with the socket read empty and the peer quiet, its
        pipe is empty and libzmq reads it to the end."""
        for peer, conn in self.dropped.items():
            if peer not in heard and peer not in self.ending:
                self.ending.add(peer)
                shut_down(conn.fd)
        for fd in self.refusing:  # (what they sent is handled like any peer's: read empty, they are quiet)
            shut_down(fd)
        self.refusing.clear()

    def to_end(self) -> bool:
        """Whether connections wait for ``end_quiet``."""
        return bool(self.refusing) or len(self.ending) < len(self.dropped)

    def close(self) -> None:
        self.monitor.close(linger=0)
