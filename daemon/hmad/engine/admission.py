"""Which waiting request is admitted next: owners in turn, each owner's requests in order.

The waiting requests are kept per owner (``Request.owner``: the server's connection id; every request
with owner None counts as one owner). Owners form a ring in order of arrival; the next request is the
oldest of the owner at the ring's head, and admitting it moves that owner to the back (an owner with
nothing left waiting leaves the ring; its next request joins it at the back).

Bound: a request whose owner has nothing else waiting is admitted within the first ``n + 1`` admissions
after it arrives, where ``n`` is the number of other owners waiting then (each is served at most once
ahead of it), however many requests any of them has queued. The scheduler admits whenever a sequence
slot is free and the next request's KV blocks fit, and a request that does not fit yet holds its turn
(those behind it wait rather than starve it), so in steps the wait is that of ``n + 1`` sequences
finishing: each ends within its prompt's prefill plus ``max_tokens`` steps. A full queue does not break
the bound: a request whose owner has fewer waiting than another owner by more than one takes the place of
that owner's newest waiting request (``make_room_for``; the scheduler ends that one ``busy``), so one owner
cannot keep the others out by filling the queue. Once admitted, its prefill
shares each step's token budget with the at most ``max_seqs - 1`` sequences admitted before it (decode
tokens first, then prefill chunks in order of admission), so its first token follows within the steps
their prompts take, however many requests wait. With one owner this is FIFO.

Turns are per owner (connection), not per tenant (user): a user with several connections has several.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterator

from hmad.engine.request import Request


class FairQueue:
    """The waiting requests, served owner by owner in turn (module docstring)."""

    def __init__(self):
        # owner -> its waiting requests, oldest first; dict order is the ring (head first)
        self._ring: dict[bytes | None, collections.deque[Request]] = {}
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def __bool__(self) -> bool:
        return self._n > 0

    def __iter__(self) -> Iterator[Request]:
        """Every waiting request (owner by owner, in ring order)."""
        for q in self._ring.values():
            yield from q

    def append(self, req: Request) -> None:
        """Queue ``req`` behind its owner's others (a new owner joins the ring at the back)."""
        self._ring.setdefault(req.owner, collections.deque()).append(req)
        self._n += 1

    def peek(self) -> Request:
        """The request whose turn it is; raises IndexError when none waits."""
        if not self._ring:
            raise IndexError("no request waiting")
        return self._ring[next(iter(self._ring))][0]

    def pop(self) -> Request:
        """Take the request ``peek`` gives, and move its owner to the back of the ring."""
        owner = next(iter(self._ring))
        q = self._ring.pop(owner)
        req = q.popleft()
        if q:
            self._ring[owner] = q
        self._n -= 1
        return req

    def remove_if(self, drop: Callable[[Request], bool]) -> None:
        """Drop every request ``drop`` says to; owners keep their places in the ring."""
        for owner in list(self._ring):
            q = self._ring[owner]
            kept = collections.deque(r for r in q if not drop(r))
            self._n -= len(q) - len(kept)
            if kept:
                self._ring[owner] = kept
            else:
                del self._ring[owner]

    def can_make_room_for(self, owner: bytes | None) -> bool:
        """Whether, the queue being full, another owner gives up a place to one of ``owner``'s requests:
        the owner with the most waiting, if it has more than one more than ``owner`` (so a place never
        goes back and forth)."""
        return self._yielder(owner) is not None

    def make_room_for(self, owner: bytes | None) -> Request:
        """Take out the newest request of the owner that gives up a place (``can_make_room_for``); that
        owner keeps at least one waiting, and its place in the ring."""
        req = self._yielder(owner).pop()
        self._n -= 1
        return req

    def _yielder(self, owner: bytes | None) -> collections.deque[Request] | None:
        most = max(self._ring.values(), key=len, default=())
        return most if len(most) > len(self._ring.get(owner, ())) + 1 else None

    def owners(self) -> int:
        """Owners with a request waiting."""
        return len(self._ring)
