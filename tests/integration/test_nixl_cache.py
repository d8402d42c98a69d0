"""The nixl sender's cache of registrations and prepared descriptor lists
(relay/backends/nixl_cache.py), through real NIXL in one process (loopback): reused while
the memory is the same, never for memory freed and reused, per sender (a reconnect starts
afresh), and a slot another sender holds now is never written through a list made for it
earlier."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from disagg_runtime.memory.pool import MiB
from tests.relay_rig import NIXL_MISSING, WAIT, Rig

pytestmark = pytest.mark.skipif(NIXL_MISSING is not None, reason=f"no nixl: {NIXL_MISSING}")


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    yield r
    r.close()


def _cache(sender: object) -> object:
    return sender._cache  # type: ignore[attr-defined]


def test_a_stream_from_one_tensor_registers_once_and_reads_it_fresh(rig: Rig) -> None:
    ingress = rig.ingress("nixl", size=8 * MiB)
    sender = rig.sender("nixl", ingress)
    x = torch.empty(MiB, dtype=torch.uint8)
    for i in range(6):
        x.fill_(i)  # the same memory, new bytes: each WRITE reads them anew
        sender.send({"x": x}, request_id=f"r{i}")
        with ingress.recv(timeout=WAIT) as msg:
            assert msg.request_id == f"r{i}" and bool((msg.payload["x"] == i).all())
    cache = _cache(sender)
    assert cache.registered == 1  # type: ignore[attr-defined]
    assert cache.prepared <= 3  # type: ignore[attr-defined]  # the slots credit alternates


def test_memory_freed_and_reused_at_the_same_address_is_registered_afresh(rig: Rig) -> None:
    """Two storages over one buffer, one after the other: the second has the first one's
    address and size, and still gets its own registration (the first one's is gone)."""
    ingress = rig.ingress("nixl", size=8 * MiB)
    sender = rig.sender("nixl", ingress)
    buf = bytearray(MiB)
    first = torch.frombuffer(buf, dtype=torch.uint8)
    first.fill_(1)
    address = first.data_ptr()
    sender.send({"x": first}, request_id="first")
    with ingress.recv(timeout=WAIT) as msg:
        assert bool((msg.payload["x"] == 1).all())
    cache = _cache(sender)
    assert len(cache) == 1  # type: ignore[arg-type]
    del first, msg  # the storage dies; its registration is dropped at the next transfer
    second = torch.frombuffer(buf, dtype=torch.uint8)
    assert second.data_ptr() == address
    second.fill_(2)
    sender.send({"x": second}, request_id="second")
    with ingress.recv(timeout=WAIT) as msg:
        assert bool((msg.payload["x"] == 2).all())
    assert cache.registered == 2 and len(cache) == 1  # type: ignore[attr-defined,arg-type]


def test_a_dead_tensors_registration_goes_before_the_next_transfer(rig: Rig) -> None:
    ingress = rig.ingress("nixl", size=8 * MiB)
    sender = rig.sender("nixl", ingress)
    cache = _cache(sender)
    for i in range(4):  # a fresh tensor each time (as a handler making new outputs)
        sender.send({"x": torch.full((MiB,), i, dtype=torch.uint8)}, request_id=f"r{i}")
        with ingress.recv(timeout=WAIT) as msg:
            assert bool((msg.payload["x"] == i).all())
        assert len(cache) == 1  # type: ignore[arg-type]  # the ones before are gone
    assert cache.registered == 4  # type: ignore[attr-defined]


def test_a_reconnected_sender_starts_afresh_and_a_closed_one_holds_nothing(rig: Rig) -> None:
    ingress = rig.ingress("nixl", size=8 * MiB)
    x = torch.full((MiB,), 3, dtype=torch.uint8)
    first = rig.sender("nixl", ingress)
    first.send({"x": x}, request_id="a")
    ingress.recv(timeout=WAIT).release()
    cache = _cache(first)
    first.close()
    assert len(cache) == 0 and not cache._lists  # type: ignore[arg-type,attr-defined]
    second = rig.sender("nixl", ingress)
    assert _cache(second) is not cache and len(_cache(second)) == 0  # type: ignore[arg-type]
    second.send({"x": x}, request_id="b")
    with ingress.recv(timeout=WAIT) as msg:
        assert msg.request_id == "b" and bool((msg.payload["x"] == 3).all())


def test_a_slot_held_by_another_sender_is_never_written_through_an_old_list(rig: Rig) -> None:
    """Sender A's lists name the slots it wrote before; once A's message is released, B's
    payload takes such a slot and is held; A's next payloads go where their own grants say,
    and B's bytes stay as B wrote them."""
    ingress = rig.ingress("nixl", size=8 * MiB)
    a, b = rig.sender("nixl", ingress), rig.sender("nixl", ingress)
    xa = torch.full((MiB,), 1, dtype=torch.uint8)
    for i in range(3):  # A has lists for the slots it streamed through
        a.send({"x": xa}, request_id=f"a{i}")
        ingress.recv(timeout=WAIT).release()
    held = []
    for i in range(2):
        b.send({"x": torch.full((MiB,), 9, dtype=torch.uint8)}, request_id=f"b{i}")
        held.append(ingress.recv(timeout=WAIT))
    for i in range(4):
        a.send({"x": xa}, request_id=f"a-again{i}")
        with ingress.recv(timeout=WAIT) as msg:
            assert bool((msg.payload["x"] == 1).all())
        assert all(bool((m.payload["x"] == 9).all()) for m in held)
    for m in held:
        m.release()
