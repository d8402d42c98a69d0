"""Credits: pool slots a receiver grants a sender ahead of its next payload. No sockets.

A sender in a stream of medium payloads asks, in each commit, for a slot for its next one
(`next {xid, nbytes}`); the ack grants it (`spare {xid, offset, lease_s}`), and the next
payload that fits is written straight there and committed under that xid: no reservation
round trip, as NIXL's one-sided writes after a handshake done once. The reservation
handshake comes back only when credit runs out (none held, too small, or past its lease).

    grant ──> held (a short lease) ──spend (its commit)──> the landing's slot
                                   ──give_back (cancel)──> free
                                   ──expire (its lease ran out unused)──> free

Bounds, so that credit never costs another sender its room:
  - only to an authenticated peer (the ingress grants in the ack of its own commit);
  - none while any reservation waits (nobody queues behind a credit);
  - at most `per_peer` held by one sender, each at most `max_bytes`;
  - all senders' together at most `share` of the pool, and never its last room (room for
    one more of the same size stays free beside it);
  - a short lease (`lease_s`): a sender that died holding credit, or had nothing more to
    send, holds its slot no longer than that.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Protocol

CREDIT_MAX = 16 << 20  # the largest slot granted ahead
CREDIT_LEASE_S = 1.0  # a credit nobody committed is freed this soon
CREDIT_SHARE = 0.5  # at most this part of the pool is held as credit, all senders together
CREDITS_PER_PEER = 1  # a sender has one transfer at a time: one slot ahead serves it


class Slots(Protocol):
    """The memory credits are cut from (a `Pool`)."""

    def allocate(self, nbytes: int) -> int | None: ...

    def free(self, offset: int) -> None: ...


@dataclass(frozen=True)
class CreditBounds:
    """What the receiver grants ahead (see the module docstring)."""

    per_peer: int = CREDITS_PER_PEER
    max_bytes: int = CREDIT_MAX
    share: float = CREDIT_SHARE
    lease_s: float = CREDIT_LEASE_S


@dataclass(frozen=True)
class Credit:
    """Slot `offset` of `nbytes`, granted ahead to sender `ident` under its `xid`, until
    `deadline`."""

    ident: bytes
    xid: int
    nbytes: int
    offset: int
    deadline: float


class CreditLedger:
    """The credits one receiver has out, over `slots` of `capacity` bytes."""

    def __init__(self, slots: Slots, *, capacity: int, bounds: CreditBounds | None = None):
        self.slots = slots
        self.bounds = bounds or CreditBounds()
        self.budget = int(capacity * self.bounds.share)  # bytes held ahead, all senders
        self.held_bytes = 0
        self._held: dict[tuple[bytes, int], Credit] = {}
        self._of: collections.Counter[bytes] = collections.Counter()
        self.granted = 0  # counts, for stats and tests
        self.spent = 0
        self.expired = 0

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, key: tuple[bytes, int]) -> bool:
        return key in self._held

    def held_by(self, ident: bytes) -> int:
        return self._of[ident]

    def grant(
        self, ident: bytes, xid: int, nbytes: int, now: float, *, waiting: bool = False
    ) -> Credit | None:
        """A slot of `nbytes` for `ident`'s next payload under `xid`, or None when the
        bounds say no (`waiting`: a reservation waits for room here)."""
        bounds = self.bounds
        key = (ident, xid)
        if waiting or key in self._held or not 0 < nbytes <= bounds.max_bytes:
            return None
        if self._of[ident] >= bounds.per_peer or self.held_bytes + nbytes > self.budget:
            return None
        offset = self.slots.allocate(nbytes)
        if offset is None:
            return None
        headroom = self.slots.allocate(nbytes)  # never the last room
        if headroom is None:
            self.slots.free(offset)
            return None
        self.slots.free(headroom)
        credit = Credit(ident, xid, nbytes, offset, now + bounds.lease_s)
        self._held[key] = credit
        self._of[ident] += 1
        self.held_bytes += nbytes
        self.granted += 1
        return credit

    def _take(self, ident: bytes, xid: int) -> Credit | None:
        credit = self._held.pop((ident, xid), None)
        if credit is None:
            return None
        self._of[ident] -= 1
        if not self._of[ident]:
            del self._of[ident]
        self.held_bytes -= credit.nbytes
        return credit

    def spend(self, ident: bytes, xid: int) -> Credit | None:
        """A commit under a credit: its slot is now the caller's (to deliver or free).
        None when `ident` holds no such credit (never granted, spent, or expired)."""
        credit = self._take(ident, xid)
        if credit is not None:
            self.spent += 1
        return credit

    def give_back(self, ident: bytes, xid: int) -> bool:
        """The sender returns a credit unused (cancel): its slot is free; whether it held it."""
        credit = self._take(ident, xid)
        if credit is None:
            return False
        self.slots.free(credit.offset)
        return True

    def expire(self, now: float) -> list[Credit]:
        """Free the credits past their lease."""
        lapsed = [c for c in self._held.values() if c.deadline <= now]
        for credit in lapsed:
            self._take(credit.ident, credit.xid)
            self.slots.free(credit.offset)
        self.expired += len(lapsed)
        return lapsed

    def next_deadline(self) -> float | None:
        return min((c.deadline for c in self._held.values()), default=None)
