"""The credit ledger without sockets: grant, spend, give back, expire, and its bounds."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from disagg_runtime.memory.allocator import BuddyAllocator
from disagg_runtime.relay.credit import CreditBounds, CreditLedger
from disagg_runtime.relay.ledger import PendingBounds, SlotLedger

MiB = 1 << 20
A, B, C = b"a" * 16, b"b" * 16, b"c" * 16


class Slots:
    """A real buddy allocator, counting what is live (a double free fails the test)."""

    def __init__(self, size: int = 8 * MiB) -> None:
        self.allocator = BuddyAllocator(size, MiB)
        self.live: set[int] = set()

    def allocate(self, nbytes: int) -> int | None:
        offset = self.allocator.allocate(max(nbytes, 1))
        if offset is not None:
            self.live.add(offset)
        return offset

    def free(self, offset: int) -> None:
        self.live.remove(offset)
        self.allocator.free(offset)


def test_a_credit_is_spent_once_and_its_slot_is_then_the_callers() -> None:
    slots = Slots()
    book = CreditLedger(slots, capacity=8 * MiB)
    credit = book.grant(A, 1, MiB, now=0.0)
    assert credit is not None and credit.offset in slots.live and (A, 1) in book
    assert book.held_bytes == MiB and book.held_by(A) == 1
    assert book.spend(B, 1) is None  # another sender's xid: not this credit
    assert book.spend(A, 1) == credit
    assert book.spend(A, 1) is None  # spent already
    assert credit.offset in slots.live  # the caller delivers or frees it, not the ledger
    assert book.held_bytes == 0 and book.held_by(A) == 0 and len(book) == 0
    assert (book.granted, book.spent) == (1, 1)


def test_a_credit_given_back_or_expired_frees_its_slot() -> None:
    slots = Slots()
    book = CreditLedger(slots, capacity=8 * MiB, bounds=CreditBounds(per_peer=2, lease_s=1.0))
    one = book.grant(A, 1, MiB, now=0.0)
    two = book.grant(A, 2, MiB, now=0.5)
    assert one is not None and two is not None
    assert book.next_deadline() == 1.0
    assert book.give_back(A, 1) and not book.give_back(A, 1)
    assert book.expire(1.4) == []  # two's lease runs to 1.5
    assert book.expire(1.5) == [two]
    assert slots.live == set() and book.held_bytes == 0 and book.next_deadline() is None
    assert book.spend(A, 2) is None  # expired: its commit finds no credit
    assert book.expired == 1


def test_credit_is_bounded_per_sender_per_credit_and_in_all() -> None:
    slots = Slots(8 * MiB)
    book = CreditLedger(slots, capacity=8 * MiB)  # half the pool at most: 4 MiB
    assert book.grant(A, 1, 0, now=0.0) is None  # nothing to hold
    assert book.grant(A, 1, 16 * MiB + 1, now=0.0) is None  # over CREDIT_MAX
    assert book.grant(A, 1, 2 * MiB, now=0.0) is not None
    assert book.grant(A, 2, MiB, now=0.0) is None  # one per sender (CREDITS_PER_PEER)
    assert book.grant(A, 1, MiB, now=0.0) is None  # an xid already held
    assert book.grant(B, 1, 2 * MiB, now=0.0) is not None  # 4 MiB held: the budget
    assert book.grant(C, 1, MiB, now=0.0) is None  # over the budget, though the pool has room
    assert book.grant(C, 1, MiB, now=0.0, waiting=True) is None
    assert book.held_bytes == 4 * MiB <= book.budget


def test_credit_never_takes_the_pools_last_room() -> None:
    slots = Slots(4 * MiB)
    book = CreditLedger(slots, capacity=4 * MiB, bounds=CreditBounds(share=1.0))
    held = slots.allocate(2 * MiB)  # a delivered message
    assert book.grant(A, 1, 2 * MiB, now=0.0) is None  # would leave no room beside it
    assert book.grant(A, 1, MiB, now=0.0) is not None  # 1 MiB stays free
    assert held is not None and len(slots.live) == 2


def test_nobody_waits_behind_credit_in_the_slot_ledger() -> None:
    slots = Slots(4 * MiB)
    book = SlotLedger(slots, lease_s=10.0, inline_budget=MiB, capacity=4 * MiB)
    assert book.reserve(A, 1, "r", 4 * MiB, max_allocation=4 * MiB, wait_s=5, now=0.0) is None
    assert book.grant_spare(B, 1, MiB, now=0.0) is None  # A waits for the whole pool
    book.cancel(A, 1)
    credit = book.grant_spare(B, 1, MiB, now=0.0)
    assert credit is not None
    # the credit's xid is taken: a reservation under it is refused as misbehaving
    denial = book.reserve(B, 1, "r", MiB, max_allocation=4 * MiB, wait_s=5, now=0.0)
    assert denial is not None and denial.counted
    book.cancel(B, 1)  # a cancelled credit frees its slot
    assert slots.live == set()
    assert book.next_deadline() is None


def test_an_aborted_request_leaves_credit_alone_and_expiry_reports_it() -> None:
    slots = Slots(4 * MiB)
    book = SlotLedger(
        slots, lease_s=10.0, inline_budget=MiB, bounds=PendingBounds(), capacity=4 * MiB
    )
    credit = book.grant_spare(A, 3, MiB, now=0.0)
    assert credit is not None
    assert book.abort_reservations("r") == []  # a credit belongs to no request yet
    assert book.next_deadline() == credit.deadline
    lapsed = book.expire(credit.deadline).lapsed
    assert [(g.ident, g.xid, g.spare) for g in lapsed] == [(A, 3, True)]
    assert slots.live == set()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["grant", "spend", "back", "expire"]),
            st.sampled_from([A, B, C]),
            st.integers(1, 4),
            st.integers(1, 4 * MiB),
        ),
        max_size=40,
    )
)
def test_whatever_happens_the_books_balance(ops: list[tuple[str, bytes, int, int]]) -> None:
    """Held credit stays within its bounds, and every slot is either held as credit,
    spent (the caller's), or free again: none is lost or freed twice."""
    slots = Slots(16 * MiB)
    book = CreditLedger(slots, capacity=16 * MiB, bounds=CreditBounds(per_peer=2, lease_s=1.0))
    spent: set[int] = set()
    now = 0.0
    for op, ident, xid, nbytes in ops:
        now += 0.3
        if op == "grant":
            book.grant(ident, xid, nbytes, now)
        elif op == "spend":
            credit = book.spend(ident, xid)
            if credit is not None:
                spent.add(credit.offset)
        elif op == "back":
            book.give_back(ident, xid)
        else:
            book.expire(now)
        assert book.held_bytes <= book.budget
        assert all(book.held_by(i) <= 2 for i in (A, B, C))
        assert book.held_bytes == sum(c.nbytes for c in book._held.values())
        assert slots.live == spent | {c.offset for c in book._held.values()}
    book.expire(now + 10.0)
    assert slots.live == spent and len(book) == 0
