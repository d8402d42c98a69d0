"""The receiver's slot ledger without sockets: reservations, grants, leases, aborts, expiry."""

from __future__ import annotations

from disagg_runtime.memory.allocator import BuddyAllocator
from disagg_runtime.relay.credit import CREDIT_LEASE_S, CREDIT_MAX
from disagg_runtime.relay.ledger import (
    MAX_PENDING_PER_PEER,
    Denial,
    Message,
    PendingBounds,
    SlotLedger,
)

MiB = 1 << 20
A, B = b"a" * 16, b"b" * 16


class Slots:
    """A real buddy allocator, counting what is live."""

    def __init__(self, size: int = 4 * MiB) -> None:
        self.allocator = BuddyAllocator(size, MiB)
        self.live: set[int] = set()

    def allocate(self, nbytes: int) -> int | None:
        offset = self.allocator.allocate(max(nbytes, 1))
        if offset is not None:
            self.live.add(offset)
        return offset

    def free(self, offset: int) -> None:
        self.live.remove(offset)  # a double free fails the test
        self.allocator.free(offset)


def ledger(slots: Slots, lease_s: float = 10.0) -> SlotLedger:
    return SlotLedger(slots, lease_s=lease_s, inline_budget=MiB)


def reserve(
    ledger: SlotLedger, ident: bytes, xid: int, rid: str, nbytes: int, now: float = 0.0
) -> Denial | None:
    return ledger.reserve(ident, xid, rid, nbytes, max_allocation=4 * MiB, wait_s=5.0, now=now)


def ready(_: object) -> bool:
    return True


def test_grants_in_arrival_order_and_a_large_head_is_not_overtaken() -> None:
    slots = Slots()
    book = ledger(slots)
    assert reserve(book, A, 1, "r1", 3 * MiB) is None
    assert reserve(book, B, 1, "r2", 2 * MiB) is None  # cannot fit beside r1
    assert reserve(book, A, 2, "r3", MiB) is None  # would fit, but waits behind r2
    (first,) = book.grant_pending(0.0, ready)
    assert (first.ident, first.xid, first.rid) == (A, 1, "r1")
    assert book.grant_pending(0.0, ready) == []
    grant = book.take_grant(A, 1)
    assert grant is not None and grant.offset is not None
    book.free(grant.offset)
    granted = book.grant_pending(0.0, ready)
    assert [g.rid for g in granted] == ["r2", "r3"]


def test_a_sender_not_ready_holds_the_line() -> None:
    book = ledger(Slots())
    reserve(book, A, 1, "r", MiB)
    assert book.grant_pending(0.0, lambda r: False) == []
    assert book.pending_count == 1


def test_refusals_name_the_reason() -> None:
    book = ledger(Slots())
    denial = book.reserve(A, 1, "r", 5 * MiB, max_allocation=4 * MiB, wait_s=1.0, now=0.0)
    assert denial is not None and "can never fit" in denial.reason and not denial.counted
    assert reserve(book, A, 1, "r", MiB) is None
    again = reserve(book, A, 1, "r", MiB)
    assert again is not None and "already in use" in again.reason and again.counted
    book.abort_delivered("gone", now=0.0)
    late = reserve(book, A, 2, "gone", MiB)
    assert late is not None and "aborted" in late.reason


def test_pending_reservations_per_sender_are_bounded() -> None:
    book = ledger(Slots(MiB))
    for xid in range(MAX_PENDING_PER_PEER):
        assert reserve(book, A, xid, f"r{xid}", MiB) is None
    denial = reserve(book, A, 999, "x", MiB)
    assert denial is not None and denial.counted
    assert reserve(book, B, 0, "y", MiB) is None  # another sender is not held back


def test_a_reservations_wait_is_clamped_to_the_lease() -> None:
    """A sender asking to wait an hour (or a day) waits at most a lease (issue 30 item 9)."""
    book = ledger(Slots(MiB), lease_s=2.0)
    book.reserve(A, 1, "big", MiB, max_allocation=MiB, wait_s=1.0, now=0.0)
    book.grant_pending(0.0, ready)  # the pool is full from here on
    book.reserve(B, 1, "waits", MiB, max_allocation=MiB, wait_s=86_400.0, now=0.0)
    assert book.next_deadline() == 2.0
    (denial,) = book.expire(2.0).denied
    assert (denial.ident, denial.xid, denial.timeout) == (B, 1, True)


def test_pending_reservations_are_bounded_per_sender_and_in_all_by_bytes_and_count() -> None:
    bounds = PendingBounds(per_peer=8, per_peer_bytes=4 * MiB, total=12, total_bytes=6 * MiB)
    book = SlotLedger(Slots(MiB), lease_s=10.0, inline_budget=MiB, bounds=bounds)
    hold = book.slots.allocate(MiB)  # nothing is granted: everything waits
    assert hold is not None
    for xid in range(4):
        assert reserve(book, A, xid, f"a{xid}", MiB) is None
    mine = reserve(book, A, 9, "a9", 1)  # A's bytes are used up: A misbehaves
    assert mine is not None and mine.counted and not mine.overloaded and "4194304 B" in mine.reason
    assert reserve(book, B, 0, "b0", MiB) is None and reserve(book, B, 1, "b1", MiB) is None
    full = reserve(book, B, 2, "b2", MiB)  # 6 MiB wait in all: anyone is told overloaded
    assert full is not None and full.overloaded and full.timeout and not full.counted
    assert "overloaded" in full.reason and book.pending_bytes == 6 * MiB
    book.cancel(A, 0)  # room again, in bytes
    assert reserve(book, B, 2, "b2", MiB) is None
    # in count too: 3 at most in all here, however small
    book = SlotLedger(Slots(MiB), lease_s=10.0, inline_budget=MiB, bounds=PendingBounds(total=3))
    book.slots.allocate(MiB)
    for n, who in enumerate((A, B, b"c" * 16)):
        assert reserve(book, who, n, "small", 1) is None
    crowded = reserve(book, b"d" * 16, 0, "d", 1)
    assert crowded is not None and crowded.overloaded and book.pending_count == 3


def test_a_senders_pending_reservations_are_dropped_when_it_leaves() -> None:
    book = ledger(Slots(MiB))
    hold = book.slots.allocate(MiB)
    assert hold is not None
    for xid in range(3):
        reserve(book, A, xid, "r", MiB)
    reserve(book, B, 0, "r", MiB)
    assert book.pending_senders() == {A, B}
    denials = book.drop_pending(A, "its lane closed")
    assert sorted(d.xid for d in denials) == [0, 1, 2] and all(d.ident == A for d in denials)
    assert book.pending_count == 1 and book.pending_bytes == MiB
    assert book.drop_pending(B) == [] and book.pending_count == 0 and book.pending_bytes == 0


def test_a_lease_not_committed_in_time_frees_the_slot() -> None:
    slots = Slots()
    book = ledger(slots, lease_s=2.0)
    reserve(book, A, 1, "r", MiB)
    assert len(book.grant_pending(0.0, ready)) == 1
    assert book.next_deadline() == 2.0
    assert book.expire(1.9).lapsed == []
    expired = book.expire(2.0)
    assert [g.rid for g in expired.lapsed] == ["r"] and not slots.live
    assert book.take_grant(A, 1) is None  # a late commit finds nothing


def test_a_reservation_waiting_too_long_is_denied_as_a_timeout() -> None:
    slots = Slots(MiB)
    book = ledger(slots)
    reserve(book, A, 1, "big", MiB)
    book.grant_pending(0.0, ready)
    reserve(book, B, 1, "waits", MiB, now=0.0)  # wait_s 5
    assert book.expire(4.0).denied == []
    (denial,) = book.expire(5.0).denied
    assert (denial.ident, denial.xid, denial.timeout) == (B, 1, True)
    assert book.pending_count == 0


def test_abort_frees_grants_denies_pending_and_releases_delivered() -> None:
    slots = Slots(2 * MiB)
    book = ledger(slots)
    reserve(book, A, 1, "r", MiB)
    reserve(book, A, 2, "r", MiB)
    reserve(book, B, 1, "r", MiB)  # no room: pending
    reserve(book, B, 2, "other", MiB)
    assert [(g.ident, g.xid) for g in book.grant_pending(0.0, ready)] == [(A, 1), (A, 2)]
    taken = book.take_grant(A, 1)
    assert taken is not None and taken.offset is not None
    msg = Message("r", None, MiB, taken.offset, 0.0)
    assert book.admit(msg)
    denied = book.abort_reservations("r")
    book.abort_delivered("r", now=0.0)
    assert [(d.ident, d.xid) for d in denied] == [(B, 1)]
    assert msg.released and not slots.live
    msg.release()  # a second release is harmless
    assert [g.rid for g in book.grant_pending(0.0, ready)] == ["other"]


def test_a_message_of_an_aborted_request_is_not_admitted() -> None:
    slots = Slots()
    book = ledger(slots)
    book.abort_delivered("r", now=0.0)
    slot = slots.allocate(MiB)
    assert slot is not None
    assert not book.admit(Message("r", None, MiB, slot, 0.0))
    assert not slots.live
    book.expire(book.lease_s)  # the abort is forgotten after a lease
    slot = slots.allocate(MiB)
    assert slot is not None and book.admit(Message("r", None, MiB, slot, 0.0))


def test_cancel_and_forget() -> None:
    slots = Slots(MiB)
    book = ledger(slots)
    reserve(book, A, 1, "r", MiB)
    reserve(book, A, 2, "r2", MiB)
    book.grant_pending(0.0, ready)
    book.cancel(A, 1)  # the grant's slot is free again
    assert not slots.live
    book.forget(A)  # and its pending one is gone
    assert book.pending_count == 0 and book.grant_pending(0.0, ready) == []


def test_the_inline_budget_always_admits_one_frame() -> None:
    book = SlotLedger(Slots(), lease_s=1.0, inline_budget=100)
    assert book.take_inline(500)  # an empty budget takes any one frame
    assert not book.take_inline(1)
    book.give_inline(500)
    assert book.take_inline(60) and book.take_inline(40) and not book.take_inline(1)
    msg = Message("r", None, 40, None, 0.0, charge=40)
    assert book.admit(msg)
    msg.release()
    assert book.inline_used == 60


def test_a_spare_is_granted_ahead_only_with_room_to_spare_and_lapses_quickly() -> None:
    slots = Slots(4 * MiB)
    book = ledger(slots, lease_s=10.0)
    spare = book.grant_spare(A, 7, MiB, now=0.0)
    assert spare is not None and spare.offset in slots.live
    assert spare.deadline == CREDIT_LEASE_S  # a short lease, not the grant's 10 s
    assert book.grant_spare(A, 8, MiB, now=0.0) is None  # one live spare per sender
    assert book.grant_spare(B, 1, CREDIT_MAX + 1, now=0.0) is None  # too large to hold ahead
    assert book.grant_spare(B, 1, 2 * MiB, now=0.0) is None  # would take the last 2 MiB
    assert book.grant_spare(B, 1, MiB, now=0.0) is not None  # leaves 1 MiB beside it
    # committed like any grant; its request id comes with the commit
    taken = book.take_grant(A, 7)
    assert taken is not None and taken.spare and taken.offset == spare.offset
    assert book.take_grant(A, 7) is None  # spent once
    book.free(spare.offset)
    # nobody may wait behind a spare: none is granted while a reservation is pending
    assert reserve(book, A, 9, "big", 4 * MiB) is None
    assert book.grant_spare(A, 10, MiB, now=0.0) is None
    book.cancel(A, 9)
    expired = book.expire(CREDIT_LEASE_S)  # B's spare nobody committed
    assert [g.ident for g in expired.lapsed] == [B] and expired.lapsed[0].spare
    assert slots.live == set()
