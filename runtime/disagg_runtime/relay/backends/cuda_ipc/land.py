"""The receiving side of `cuda-ipc` (device pool memory itself: memory/intake.py).

`CudaIpcLanding` (senders that said hello as cuda-ipc):
- the welcome carries the pool's CUDA IPC export, made once per peer
  (`handles.export_pool`); the peer maps it once. A host pool says why it cannot.
- commit with an `event`: the sender's copy into the slot may still be running. The grant
  is held out of the lease clock while the I/O thread polls the event (a short spin, then
  once per loop turn); only a completed copy is validated, delivered and acked. A copy not
  complete within the lease is nacked and its slot quarantined until the event completes
  (it may still be written), never handed to someone else while a write may land in it.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import Any, cast

import torch

from disagg_runtime.relay import protocol as proto
from disagg_runtime.relay.backends.cuda_ipc import handles
from disagg_runtime.relay.landing import Host, Landing
from disagg_runtime.relay.ledger import Reservation
from disagg_runtime.wire import codec

log = logging.getLogger(__name__)
SPIN_S = 0.005  # covers a device-to-device copy of several GiB before deferring
MAX_EXPORTS = 1024  # peers (sender sockets) the pool is exported to over the ingress's life
MAX_EVENTS = 256  # opened peer events kept (one per recent sender)


@dataclass
class _Arrival:
    """A cuda-ipc commit whose copy is still running on the sender's stream."""

    ident: bytes
    xid: int
    msg: dict[str, Any]
    grant: Reservation
    event: torch.cuda.Event
    deadline: float


@dataclass
class _Quarantined:
    """A slot that a peer's copy may still write: freed once `event` completes (or, when
    the event is unknown, at `until`)."""

    slot: int
    event: torch.cuda.Event | None
    until: float


def _state(event: torch.cuda.Event) -> bool | None:
    """True: done; False: pending; None: CUDA cannot tell (the peer's context died)."""
    try:
        return bool(cast(Any, event).query())
    except RuntimeError:
        return None


class CudaIpcLanding(Landing):
    """The receiving side of cuda-ipc (see the module docstring)."""

    kind = "cuda-ipc"

    def __init__(self, host: Host) -> None:
        self.host = host
        self._exports: dict[bytes, dict[str, Any]] = {}
        self._events: collections.OrderedDict[bytes, tuple[bytes, torch.cuda.Event]] = (
            collections.OrderedDict()
        )
        self._arrivals: list[_Arrival] = []
        self._quarantine: list[_Quarantined] = []

    @property
    def _on_gpu(self) -> bool:
        return self.host.pool.backing.device == "cuda"

    # ---- handshake ------------------------------------------------------------------------
    def welcome(self, ident: bytes, hello: dict[str, Any]) -> dict[str, Any]:
        pool = self.host.pool
        if not self._on_gpu:
            device = pool.backing.device
            return {
                "cuda_unavailable": f"the receive pool at {self.host.endpoint} is {device} memory"
            }
        export = self._exports.get(ident)
        if export is None:
            if len(self._exports) >= MAX_EXPORTS:
                return {"cuda_unavailable": f"the pool was exported to {MAX_EXPORTS} peers"}
            try:
                export = handles.export_pool(pool.backing).to_json()
            except Exception as exc:  # the I/O thread must outlive whatever CUDA says
                log.warning("ingress %s cannot export its CUDA pool: %s", self.host.endpoint, exc)
                return {"cuda_unavailable": f"the receiver cannot export its CUDA pool: {exc}"}
            self._exports[ident] = export
        return {"cuda": export}

    # ---- commits ----------------------------------------------------------------------------
    def commit(self, ident: bytes, msg: dict[str, Any]) -> bool:
        if not self._on_gpu:
            return False  # nothing was exported: whatever landed is in host memory
        if "event" not in msg:
            return False
        if msg.get("chunk") is not None:
            raise proto.ProtocolError("commit: a cuda-ipc commit carries no chunks")
        ledger = self.host.ledger
        xid = proto.nonneg_int(msg, "xid")
        grant = ledger.take_grant(ident, xid)  # off the lease clock while the copy runs
        if grant is None:
            raise proto.ProtocolError(f"commit for xid {xid} without a live grant (lease expired?)")
        assert grant.offset is not None  # taken grants have slots
        try:
            event = self._open_event(ident, handles.parse_event_handle(msg.get("event")))
        except proto.ProtocolError:
            # the peer may have queued a copy into the slot: keep it from others for a lease
            self._quarantine.append(_Quarantined(grant.offset, None, self._later()))
            raise
        arrival = _Arrival(ident, xid, msg, grant, event, self._later())
        spin_until = time.perf_counter() + SPIN_S
        while (state := _state(event)) is False and time.perf_counter() < spin_until:
            pass
        if state is False:
            self._arrivals.append(arrival)
        else:
            self._land(arrival, failed=state is None)
        return True

    def _later(self) -> float:
        return time.monotonic() + self.host.ledger.lease_s

    def _open_event(self, ident: bytes, handle: bytes) -> torch.cuda.Event:
        cached = self._events.get(ident)
        if cached is not None and cached[0] == handle:
            self._events.move_to_end(ident)
            return cached[1]
        gpu = self.host.pool.backing.tensor.device
        try:
            event = torch.cuda.Event.from_ipc_handle(gpu, handle)  # type: ignore[no-untyped-call]
        except RuntimeError as exc:
            raise proto.ProtocolError(f"commit: cannot open the CUDA event: {exc}") from None
        event = cast(torch.cuda.Event, event)
        self._events[ident] = (handle, event)
        while len(self._events) > MAX_EVENTS:
            self._events.popitem(last=False)
        return event

    def _land(self, arrival: _Arrival, *, failed: bool, deferred: bool = False) -> None:
        """The copy is done (or failed): validate and deliver as any commit, or nack."""
        assert arrival.grant.offset is not None  # arrivals are made from live grants
        if failed:
            self._quarantine.append(_Quarantined(arrival.grant.offset, None, self._later()))
            error = proto.ProtocolError("the sender's copy failed (its CUDA context is gone?)")
            if not deferred:
                raise error
            self.host.reject(arrival.ident, arrival.xid, str(error))
            return
        self.host.ledger.put_back(arrival.grant)
        if not deferred:
            self.host.commit(arrival.ident, arrival.msg)
            return
        try:
            self.host.commit(arrival.ident, arrival.msg)
        except (proto.ProtocolError, codec.CodecError) as exc:
            self.host.reject(arrival.ident, arrival.xid, str(exc))

    # ---- timers -------------------------------------------------------------------------------
    def busy(self) -> bool:
        return bool(self._arrivals or self._quarantine)

    def expire(self, now: float) -> None:
        for arrival in list(self._arrivals):
            state = _state(arrival.event)
            if state is False and arrival.deadline > now:
                continue
            self._arrivals.remove(arrival)
            if state is False:  # still copying after a whole lease
                assert arrival.grant.offset is not None
                self._quarantine.append(_Quarantined(arrival.grant.offset, arrival.event, 0.0))
                reason = "the sender's copy did not complete within the lease"
                self.host.reject(arrival.ident, arrival.xid, reason)
            else:
                self._land(arrival, failed=state is None, deferred=True)
        for entry in list(self._quarantine):
            released = _state(entry.event) is not False if entry.event else entry.until <= now
            if released:
                self._quarantine.remove(entry)
                self.host.ledger.free(entry.slot)
