"""The requests in flight on the socket loop: where each one's replies go, and the in-flight limits.

A request gets a route (and its request id, ``rid``) when the loop takes it, before its preparation on
the intake thread; the route ends with its one terminal reply (or with its peer). The table counts routes
per connection and per user, which ``over_limit`` holds against ``max_in_flight`` (every request),
``max_in_flight_per_connection`` and ``max_in_flight_per_uid``.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class Route:
    """Where a request's replies go, and what a non-streaming request has produced so far."""

    peer: bytes
    client_id: object
    stream: bool
    v: int  # the request's protocol version, which every reply to it carries
    uid: int | None = None  # the peer's user (SO_PEERCRED), None if unknown
    preparing: bool = False  # on the intake thread, not yet accepted
    cancel_asked: bool = False  # cancelled while preparing: answered ``cancelled`` once prepared
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


class Routes:
    """rid -> Route, with lookups by (peer, client id) and counts per peer and per user."""

    def __init__(self, max_in_flight: int, max_per_connection: int, max_per_uid: int):
        self.max_in_flight = max_in_flight
        self.max_per_connection, self.max_per_uid = max_per_connection, max_per_uid
        self._table: dict[int, Route] = {}
        self._by_client: dict[tuple[bytes, object], int] = {}
        self._per_peer: collections.Counter = collections.Counter()  # routes of each peer
        self._per_uid: collections.Counter = collections.Counter()  # routes of each known uid
        self.next_rid = 1  # the rid the next request gets

    def __len__(self) -> int:
        return len(self._table)

    def __contains__(self, rid: int) -> bool:
        return rid in self._table

    def __getitem__(self, rid: int) -> Route:
        return self._table[rid]

    def __iter__(self) -> Iterator[int]:
        return iter(self._table)

    def get(self, rid: int) -> Route | None:
        return self._table.get(rid)

    def items(self):
        return self._table.items()

    def rid_of(self, peer: bytes, client_id: object) -> int | None:
        """The rid of this peer's active request with this id, None if none."""
        return self._by_client.get((peer, client_id))

    def has_peer(self, peer: bytes) -> bool:
        return peer in self._per_peer

    def of_peer(self, peer: bytes) -> list[int]:
        """The rids of every route of ``peer``."""
        return [rid for rid, r in self._table.items() if r.peer == peer]

    def since(self, first_rid: int) -> list[int]:
        """The rids given from ``first_rid`` on whose routes are still open."""
        return [rid for rid in range(first_rid, self.next_rid) if rid in self._table]

    def over_limit(self, peer: bytes, uid: int | None) -> str | None:
        """Why a new request of this peer would be one too many in flight, or None."""
        if len(self._table) >= self.max_in_flight:
            return f"{len(self._table)} requests in flight; retry later"
        if self._per_peer[peer] >= self.max_per_connection:
            return (
                f"this connection has {self._per_peer[peer]} requests in flight "
                f"(server.max_in_flight_per_connection); retry when one ends"
            )
        if uid is not None and self._per_uid[uid] >= self.max_per_uid:
            return (
                f"user {uid} has {self._per_uid[uid]} requests in flight (server.max_in_flight_per_uid); "
                f"retry when one ends"
            )
        return None

    def add(self, route: Route) -> int:
        """Open a route for a new request; its rid."""
        rid = self.next_rid
        self.next_rid += 1
        self._table[rid] = route
        if route.client_id is not None:  # id-less requests cannot be cancelled by id
            self._by_client[(route.peer, route.client_id)] = rid
        self._per_peer[route.peer] += 1
        if route.uid is not None:
            self._per_uid[route.uid] += 1
        return rid

    def pop(self, rid: int) -> Route:
        """Close ``rid``'s route (its request has had its last reply, or its peer is gone)."""
        route = self._table.pop(rid)
        if self._by_client.get((route.peer, route.client_id)) == rid:
            del self._by_client[(route.peer, route.client_id)]
        for counter, key in ((self._per_peer, route.peer), (self._per_uid, route.uid)):
            if key is not None:
                counter[key] -= 1
                if counter[key] <= 0:
                    del counter[key]
        return route
