"""Load reports between real ingresses and senders (dispatch.py, relay/protocol.py): the
welcome, grants and acks carry the receiver's load, inline-only senders hear it from the
periodic `load` message, and a malformed report is refused, never trusted."""

from __future__ import annotations

from typing import Any

import pytest

from disagg_runtime.relay import Ingress, RelayError
from disagg_runtime.routing.dispatch import Load
from tests.relay_rig import KINDS, WAIT, Rig, large_payload, small_payload
from tests.support import wait_for


class Knob:
    """A load callback whose answer the test sets."""

    def __init__(self) -> None:
        self.load = Load(queued=0, active=0, workers=2, free_bytes=100, pool_bytes=100)
        self.calls = 0

    def __call__(self) -> Load:
        self.calls += 1
        return self.load


def _bad(ingress: Ingress, report: Any) -> None:
    ingress._load_field = lambda: {"load": report}  # type: ignore[method-assign]


@pytest.mark.parametrize("kind", KINDS)
def test_the_welcome_and_each_ack_carry_the_receivers_load(rig: Rig, kind: str) -> None:
    knob = Knob()
    ingress = rig.ingress(kind, load=knob)
    sender = rig.sender(kind, ingress)
    view = sender.view()
    assert view is not None and view.load == knob.load and view.sent_since == 0
    knob.load = Load(queued=5, active=2, workers=2, free_bytes=10, pool_bytes=100, service_s=0.3)
    sender.send(large_payload(), request_id="staged")  # reserve, grant, commit, ack
    view = sender.view()
    assert view is not None and view.load == knob.load and view.sent_since == 0
    with ingress.recv(timeout=WAIT):
        pass


@pytest.mark.parametrize("kind", KINDS)
def test_inline_senders_hear_the_load_from_the_periodic_report(rig: Rig, kind: str) -> None:
    knob = Knob()
    ingress = rig.ingress(kind, load=knob)
    sender = rig.sender(kind, ingress)
    sender.send(small_payload(), request_id="inline")  # no reply: the sender is active now
    knob.load = Load(queued=7, active=1, workers=2, free_bytes=50, pool_bytes=100)

    def heard() -> bool:
        view = sender.view()
        return view is not None and view.load.queued == 7

    wait_for(heard, WAIT)
    with ingress.recv(timeout=WAIT):
        pass


def test_without_a_role_the_ingress_reports_its_own_queue_and_pool(rig: Rig) -> None:
    ingress = rig.ingress("tcp")
    sender = rig.sender("tcp", ingress)
    sender.send(large_payload(), request_id="held")  # queued for recv, its slot held
    view = sender.view()
    assert view is not None
    assert view.load.queued == 1 and view.load.workers == 1
    assert 0 < view.load.free_bytes < view.load.pool_bytes == ingress.pool.allocator.capacity
    with ingress.recv(timeout=WAIT):
        pass


@pytest.mark.parametrize(
    "report",
    [{"queued": -1}, "busy", {**Knob().load.to_json(), "free_bytes": 1 << 40}],
)
def test_a_malformed_load_in_the_welcome_refuses_the_receiver(rig: Rig, report: Any) -> None:
    ingress = rig.ingress("tcp")
    _bad(ingress, report)
    with pytest.raises(RelayError, match=r"bad welcome.*load"):
        rig.sender("tcp", ingress)


@pytest.mark.parametrize("kind", KINDS)
def test_a_malformed_load_on_a_reply_fails_that_transfer(rig: Rig, kind: str) -> None:
    ingress = rig.ingress(kind)
    sender = rig.sender(kind, ingress)
    _bad(ingress, {"queued": "many"})
    with pytest.raises(RelayError, match=r"bad reply.*load"):
        sender.send(large_payload(), request_id="staged")


def test_a_malformed_periodic_load_is_dropped_and_forgets_the_last(rig: Rig) -> None:
    ingress = rig.ingress("tcp")
    sender = rig.sender("tcp", ingress)
    assert sender.view() is not None
    _bad(ingress, {"queued": 1.5})
    sender.send(small_payload(), request_id="inline")
    wait_for(lambda: sender.view() is None, WAIT)
    with ingress.recv(timeout=WAIT):
        pass


def test_a_failing_load_callback_leaves_the_relay_working(rig: Rig) -> None:
    def broken() -> Load:
        raise RuntimeError("no account")

    ingress = rig.ingress("tcp", load=broken)
    sender = rig.sender("tcp", ingress)
    assert sender.view() is None  # nothing reported: this replica is unknown
    sender.send(large_payload(), request_id="staged")
    with ingress.recv(timeout=WAIT) as msg:
        assert msg.request_id == "staged"
