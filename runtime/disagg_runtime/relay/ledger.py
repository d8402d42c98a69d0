"""The receiver's slot ledger: who holds which pool slot, until when. No sockets.

Every slot has an owner and a deadline:

    reserve ──> pending (arrival order; waits at most wait_s, clamped to a lease, for
                room; bounded per sender and in all, by count and bytes) ──> granted (a lease)
    ack of a commit that asks ──> a credit: granted ahead, for the sender's next payload
                                  (relay/credit.py: its own bounds and short lease)
    granted ──commit──> taken by a landing (the I/O side's; ends in deliver, nack or free)
    delivered ──release()──> free;   abort(rid) frees all a request holds, now and later

The ledger answers with what to tell senders (denials, grants) instead of telling them,
so the I/O loop (relay/ingress/) stays a loop and this stays testable without sockets.
Pending reservations and grants are touched by the I/O thread only; delivered messages
and the inline budget are shared with the application's threads under `lock`.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from disagg_runtime.relay.credit import Credit, CreditBounds, CreditLedger

MAX_WAIT_S = 3600.0
MAX_PENDING_PER_PEER = 64  # a sender has one transfer at a time; leave room for abandoned ones
MAX_PENDING = 4096  # waiting at one ingress, all senders together (one each for MAX_PEERS)
PENDING_POOLS_PER_PEER = 4  # a sender's waiting bytes: at most this many pools' worth
PENDING_POOLS = 64  # everyone's together

Key = tuple[bytes, int]  # (sender identity, its transfer id)


class Slots(Protocol):
    """The memory the ledger hands out (a `Pool`)."""

    def allocate(self, nbytes: int) -> int | None: ...

    def free(self, offset: int) -> None: ...


@dataclass(eq=False)
class Message:
    """One received payload. Tensors view the pool slot until `release()` (or abort)."""

    request_id: str
    payload: Any
    nbytes: int
    slot: int | None
    received_at: float
    meta: dict[str, Any] | None = None  # the sender's routing metadata, unread by relays
    charge: int = 0  # inline bytes held against the ingress's inline budget until release
    _release: Callable[[Message], None] | None = field(default=None, repr=False)
    released: bool = False

    def release(self) -> None:
        if self._release is not None:
            self._release(self)

    def __enter__(self) -> Message:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass
class Reservation:
    """A sender's request for `nbytes`: pending until `offset` is set (then a grant)."""

    ident: bytes
    xid: int
    rid: str
    nbytes: int
    deadline: float
    offset: int | None = None
    lane_sent: int = 0  # inline frames the sender had written to its lane before this
    spare: bool = False  # a credit (granted ahead with an ack), spent or lapsed

    @classmethod
    def of_credit(cls, credit: Credit) -> Reservation:
        """A credit as the grant its commit takes (its request id comes with the commit)."""
        return cls(
            credit.ident, credit.xid, "", credit.nbytes, credit.deadline, credit.offset, spare=True
        )


@dataclass(frozen=True)
class PendingBounds:
    """How much may wait for room at once, per sender and in all, by count and by bytes
    (None: not by bytes). Beyond a sender's own bound it is refused as misbehaving; beyond
    the total, told `overloaded` (no room now: it may retry, or try another replica)."""

    per_peer: int = MAX_PENDING_PER_PEER
    per_peer_bytes: int | None = None
    total: int = MAX_PENDING
    total_bytes: int | None = None

    @classmethod
    def for_pool(cls, capacity: int) -> PendingBounds:
        """The bounds of an ingress over a pool of `capacity` bytes."""
        return cls(
            per_peer_bytes=PENDING_POOLS_PER_PEER * capacity, total_bytes=PENDING_POOLS * capacity
        )


@dataclass(frozen=True)
class Denial:
    """A reservation the ledger refuses or gives up on: answer its sender with `deny`."""

    ident: bytes
    xid: int
    reason: str
    timeout: bool = False  # no room in time (the sender may retry), not a refusal
    counted: bool = False  # a misbehaving sender's request: counts as rejected
    overloaded: bool = False  # too much waits here already (with `timeout`: retryable)


@dataclass(frozen=True)
class Expired:
    """What one `expire` call ended."""

    denied: list[Denial]
    lapsed: list[Reservation]  # grants not committed within their lease (slots freed)


class SlotLedger:
    """Reservations, grants and delivered messages over `slots` (see the module doc)."""

    def __init__(
        self,
        slots: Slots,
        *,
        lease_s: float,
        inline_budget: int,
        where: str = "the pool",
        bounds: PendingBounds | None = None,
        capacity: int | None = None,
        credit: CreditBounds | None = None,
    ) -> None:
        """`capacity`: the pool's bytes, which bound the credit held ahead (None: only the
        per-sender bounds, as in tests over a toy allocator)."""
        self.slots = slots
        self.where = where  # names the pool in denials
        self.lease_s = lease_s
        self.bounds = bounds or PendingBounds()
        self.inline_budget = inline_budget
        self.lock = threading.Lock()
        self.inline_used = 0  # under lock: released on the application's threads
        # pending reservations in arrival order (O(1) head, removal by key), their deadlines
        # in a heap (stale entries skipped), counted per sender and indexed by request
        self._pending: collections.OrderedDict[Key, Reservation] = collections.OrderedDict()
        self._deadlines: list[tuple[float, int, Key]] = []
        self._seq = itertools.count()
        self._pending_of: collections.Counter[bytes] = collections.Counter()
        self._pending_bytes_of: collections.Counter[bytes] = collections.Counter()
        self.pending_bytes = 0
        self._pending_rid: dict[str, set[Key]] = {}
        self._granted: dict[Key, Reservation] = {}
        credit = credit or CreditBounds(lease_s=min(CreditBounds().lease_s, lease_s))
        self.credits = CreditLedger(slots, capacity=capacity or 1 << 62, bounds=credit)
        self._live: dict[str, list[Message]] = collections.defaultdict(list)
        self._aborted: dict[str, float] = {}
        self.delivered = 0

    # ---- reservations and grants (I/O thread) -------------------------------------------------
    @property
    def pending_count(self) -> int:
        return len(self._pending)

    def reserve(
        self,
        ident: bytes,
        xid: int,
        rid: str,
        nbytes: int,
        *,
        max_allocation: int,
        wait_s: float,
        now: float,
        lane_sent: int = 0,
    ) -> Denial | None:
        """Queue a reservation, waiting at most `wait_s` (clamped to a lease), or say why not."""
        if nbytes > max_allocation:
            reason = (
                f"payload of {nbytes} B can never fit: largest block of {self.where} is "
                f"{max_allocation} B"
            )
            return Denial(ident, xid, reason)
        key = (ident, xid)
        if key in self._granted or key in self._pending or key in self.credits:
            return Denial(ident, xid, f"reservation xid {xid} is already in use", counted=True)
        denial = self._over_bounds(ident, xid, nbytes)
        if denial is not None:
            return denial
        if rid in self._aborted:
            return Denial(ident, xid, f"request {rid} was aborted")
        deadline = now + min(wait_s, self.lease_s, MAX_WAIT_S)
        self._pending[key] = Reservation(ident, xid, rid, nbytes, deadline, lane_sent=lane_sent)
        self._pending_of[ident] += 1
        self._pending_bytes_of[ident] += nbytes
        self.pending_bytes += nbytes
        self._pending_rid.setdefault(rid, set()).add(key)
        heapq.heappush(self._deadlines, (deadline, next(self._seq), key))
        if len(self._deadlines) > 2 * len(self._pending) + 64:  # mostly stale: rebuild
            self._deadlines = [(r.deadline, next(self._seq), k) for k, r in self._pending.items()]
            heapq.heapify(self._deadlines)
        return None

    def _over_bounds(self, ident: bytes, xid: int, nbytes: int) -> Denial | None:
        """Why one more reservation of `nbytes` from `ident` may not wait (PendingBounds)."""
        bounds = self.bounds
        mine, my_bytes = self._pending_of[ident], self._pending_bytes_of[ident]
        if mine >= bounds.per_peer or (
            bounds.per_peer_bytes is not None and my_bytes + nbytes > bounds.per_peer_bytes
        ):
            reason = (
                f"this sender has {mine} reservations ({my_bytes} B) waiting already "
                f"(at most {bounds.per_peer}, {bounds.per_peer_bytes} B)"
            )
            return Denial(ident, xid, reason, counted=True)
        if len(self._pending) >= bounds.total or (
            bounds.total_bytes is not None and self.pending_bytes + nbytes > bounds.total_bytes
        ):
            reason = (
                f"overloaded: {len(self._pending)} reservations ({self.pending_bytes} B) wait "
                f"for room in {self.where} already; retry later or elsewhere"
            )
            return Denial(ident, xid, reason, timeout=True, overloaded=True)
        return None

    def _unpend(self, key: Key) -> Reservation | None:
        """Take a reservation out of the pending ones (its heap entry goes stale)."""
        r = self._pending.pop(key, None)
        if r is None:
            return None
        self._pending_of[r.ident] -= 1
        self._pending_bytes_of[r.ident] -= r.nbytes
        self.pending_bytes -= r.nbytes
        if not self._pending_of[r.ident]:
            del self._pending_of[r.ident]
            del self._pending_bytes_of[r.ident]
        keys = self._pending_rid.get(r.rid)
        if keys is not None:
            keys.discard(key)
            if not keys:
                del self._pending_rid[r.rid]
        return r

    def grant_pending(self, now: float, ready: Callable[[Reservation], bool]) -> list[Reservation]:
        """Grant pending reservations in arrival order while the pool has room: a large head
        is not overtaken by small ones, nor one whose sender's earlier frames (`ready`
        False) are still on their way."""
        granted: list[Reservation] = []
        while self._pending:
            head = next(iter(self._pending.values()))
            if not ready(head):
                break
            offset = self.slots.allocate(head.nbytes)
            if offset is None:
                break
            self._unpend((head.ident, head.xid))
            head.offset = offset
            head.deadline = now + self.lease_s
            self._granted[(head.ident, head.xid)] = head
            granted.append(head)
        return granted

    def grant_spare(self, ident: bytes, xid: int, nbytes: int, now: float) -> Credit | None:
        """A credit: a slot for a sender's next payload, granted ahead (with the ack of this
        one) within relay/credit.py's bounds, and never while a reservation waits."""
        if (ident, xid) in self._granted:
            return None
        return self.credits.grant(ident, xid, nbytes, now, waiting=bool(self._pending))

    def cancel(self, ident: bytes, xid: int) -> None:
        """The sender gave up on this reservation (granted or not): its slot is free."""
        grant = self._granted.pop((ident, xid), None)
        if grant is not None and grant.offset is not None:
            self.slots.free(grant.offset)
        elif grant is None and self.credits.give_back(ident, xid):
            return
        self._unpend((ident, xid))

    def take_grant(self, ident: bytes, xid: int) -> Reservation | None:
        """A commit: the grant leaves the lease clock; its slot is now the caller's (to
        deliver, or to `free`); a credit is spent so. None when there is no live grant
        (lease expired?)."""
        grant = self._granted.pop((ident, xid), None)
        if grant is None:
            credit = self.credits.spend(ident, xid)
            return None if credit is None else Reservation.of_credit(credit)
        if grant.offset is None:
            return None
        return grant

    def put_back(self, grant: Reservation) -> None:
        """A taken grant goes back on the lease clock (where it was)."""
        self._granted[(grant.ident, grant.xid)] = grant

    def abort_reservations(self, rid: str) -> list[Denial]:
        """Free the grants of `rid`; the pending ones are denied."""
        for key, grant in list(self._granted.items()):
            if grant.rid == rid:
                del self._granted[key]
                if grant.offset is not None:
                    self.slots.free(grant.offset)
        denied = []
        for key in list(self._pending_rid.get(rid, ())):
            r = self._unpend(key)
            if r is not None:
                denied.append(Denial(r.ident, r.xid, f"request {rid} was aborted"))
        return denied

    def forget(self, ident: bytes) -> None:
        """`ident` is gone: its pending reservations go (its grants and credits lapse with
        their lease: a sender may still be writing one)."""
        self.drop_pending(ident)

    def drop_pending(self, ident: bytes, reason: str = "") -> list[Denial]:
        """Take out `ident`'s pending reservations (its connection went): with a `reason`,
        the denials to send it, in case it is still there to read them."""
        dropped = [self._unpend(k) for k in [k for k in self._pending if k[0] == ident]]
        return [Denial(r.ident, r.xid, reason) for r in dropped if r is not None and reason]

    def pending_senders(self) -> set[bytes]:
        """The senders with reservations waiting (the ingress checks they are still there)."""
        return set(self._pending_of)

    def expire(self, now: float) -> Expired:
        """Free grants past their lease, deny reservations that waited too long, forget
        aborts older than a lease."""
        lapsed = []
        for key, grant in list(self._granted.items()):
            if grant.deadline <= now:
                del self._granted[key]
                if grant.offset is not None:
                    self.slots.free(grant.offset)
                lapsed.append(grant)
        lapsed += [Reservation.of_credit(c) for c in self.credits.expire(now)]
        denied = []
        while self._deadlines and self._deadlines[0][0] <= now:
            key = heapq.heappop(self._deadlines)[2]
            r = self._pending.get(key)
            if r is None or r.deadline > now:
                continue  # stale: no longer pending (or pending again, later)
            self._unpend(key)
            reason = "no room in the receive pool in time"
            denied.append(Denial(r.ident, r.xid, reason, timeout=True))
        with self.lock:
            for rid, until in list(self._aborted.items()):
                if until <= now:
                    del self._aborted[rid]
        return Expired(denied, lapsed)

    def next_deadline(self) -> float | None:
        """The earliest grant lease or pending wait that `expire` will act on."""
        deadlines = [g.deadline for g in self._granted.values()]
        credit = self.credits.next_deadline()
        if credit is not None:
            deadlines.append(credit)
        while self._deadlines and self._deadlines[0][2] not in self._pending:
            heapq.heappop(self._deadlines)  # stale: granted, cancelled or aborted
        if self._deadlines:
            deadlines.append(self._deadlines[0][0])
        return min(deadlines) if deadlines else None

    def free(self, slot: int) -> None:
        """Give back a slot taken with `take_grant` that was not delivered."""
        self.slots.free(slot)

    # ---- delivered messages (any thread) ------------------------------------------------------
    def admit(self, msg: Message, release: Callable[[Message], None] | None = None) -> bool:
        """Make `msg` one of its request's live messages, released through `release` (which
        ends in `self.release`); False (slot freed) if its request was aborted."""
        msg._release = release or self._release
        with self.lock:
            if msg.request_id in self._aborted:
                self._free(msg)
                return False
            self._live[msg.request_id].append(msg)
            self.delivered += 1
        return True

    def release(self, msg: Message) -> bool:
        """Free what `msg` holds; False if it was released already."""
        with self.lock:
            if msg.released:
                return False
            msg.released = True
            live = self._live.get(msg.request_id)
            if live is not None:
                live.remove(msg)
                if not live:
                    del self._live[msg.request_id]
            self._free(msg)
        return True

    def _release(self, msg: Message) -> None:
        self.release(msg)

    def abort_delivered(self, rid: str, now: float) -> None:
        """Free the delivered messages of `rid`, and its late arrivals for a lease."""
        with self.lock:
            self._aborted[rid] = now + self.lease_s
            for msg in self._live.pop(rid, []):
                msg.released = True
                self._free(msg)

    def _free(self, msg: Message) -> None:
        if msg.slot is not None:
            self.slots.free(msg.slot)
        self.inline_used -= msg.charge
        msg.charge = 0

    def take_inline(self, nbytes: int) -> bool:
        """Hold `nbytes` of the inline budget; False when they do not fit now (one frame
        always fits an empty budget, so no sender is starved for good)."""
        with self.lock:
            if self.inline_used and self.inline_used + nbytes > self.inline_budget:
                return False
            self.inline_used += nbytes
            return True

    def give_inline(self, nbytes: int) -> None:
        with self.lock:
            self.inline_used -= nbytes
