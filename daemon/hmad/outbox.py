"""Replies waiting for peers whose pipes are full, bounded in bytes over all peers together.

The socket loop sends with NOBLOCK: a peer whose ZMQ pipe is full (SNDHWM frames it has not read) gets
its further replies queued here, in order, so it never stalls the others. All queues together hold at
most ``cap`` bytes: past it, ``over_share`` names every peer holding more than its share (the cap over the
peers with replies queued), and the largest at least; the server drops them and cancels their requests.
"""

from __future__ import annotations

import collections

import zmq


class Outboxes:
    """Per-peer queues of packed replies on one ROUTER socket."""

    def __init__(self, sock: zmq.Socket, cap: int):
        self.sock, self.cap = sock, cap
        self.boxes: dict[bytes, collections.deque] = {}
        self.bytes: collections.Counter = collections.Counter()  # bytes queued per peer
        self.total = 0  # all queues together

    def __contains__(self, peer: bytes) -> bool:
        return peer in self.boxes

    def pending(self) -> bool:
        return bool(self.boxes)

    def send(self, peer: bytes, frame: bytes) -> bool:
        """Queue ``frame`` for ``peer`` and send what its pipe takes; False if the peer is gone."""
        self.boxes.setdefault(peer, collections.deque()).append(frame)
        self.bytes[peer] += len(frame)
        self.total += len(frame)
        return self.flush(peer)

    def flush(self, peer: bytes) -> bool:
        """Send ``peer``'s queue until its pipe is full; False if the peer is gone (its queue dropped)."""
        box = self.boxes[peer]
        while box:
            try:
                self.sock.send_multipart([peer, box[0]], zmq.NOBLOCK)
            except zmq.Again:
                return True  # its pipe is full: keep the rest for later, serve the others
            except zmq.ZMQError as e:
                if e.errno != zmq.EHOSTUNREACH:
                    raise
                self.drop(peer)
                return False
            n = len(box.popleft())
            self.total -= n
            self.bytes[peer] -= n
        del self.boxes[peer], self.bytes[peer]
        return True

    def flush_all(self) -> list[bytes]:
        """Flush every queue; the peers found gone."""
        return [peer for peer in list(self.boxes) if not self.flush(peer)]

    def over_share(self) -> list[bytes]:
        """The peers to drop when the queues hold more than ``cap`` bytes (none while under it)."""
        if self.total <= self.cap:
            return []
        share = self.cap / max(1, len(self.bytes))
        largest = max(self.bytes, key=self.bytes.__getitem__)
        return [p for p, n in self.bytes.items() if n > share or p == largest]

    def drop(self, peer: bytes) -> None:
        self.boxes.pop(peer, None)
        self.total -= self.bytes.pop(peer, 0)
