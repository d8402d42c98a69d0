"""The receiving end over a CUDA pool: what `Ingress(endpoint, pool)` makes for `cuda` pools.

On top of `Ingress` (same protocol, same flow control, leases and occupancy):

- hello from a cuda-ipc sender: the welcome carries the pool's CUDA IPC export, made once
  per peer (`cuda_ipc.export_pool`); the peer maps it once.
- commit with an `event`: the sender's copy into the slot may still be running. The grant
  is held out of the lease clock while the I/O thread polls the event (a short spin, then
  once per loop turn); only a completed copy is validated, delivered and acked. A copy not
  complete within the lease is nacked and its slot quarantined until the event completes
  (it may still be written), never handed to someone else while a write may land in it.
- tcp chunks: `recv_into` a pinned bounce buffer, then one synchronous host-to-device copy
  on the ingress's own stream (device memory has no host buffer to receive into).
- release: the releasing thread's current stream is synchronized before the slot is freed,
  so kernels still reading it finish before another sender may write it. Handlers that
  read payloads on side streams synchronize those before returning (the usual rule for
  handing tensors back).
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import zmq

from disagg_runtime import codec
from disagg_runtime.pool import Pool, PoolError, new_stream
from disagg_runtime.relay import cuda_ipc
from disagg_runtime.relay import protocol as proto
from disagg_runtime.relay.ingress import Ingress, Message, _Reservation

log = logging.getLogger(__name__)
SPIN_S = 0.005  # covers a device-to-device copy of several GiB before deferring
MAX_BOUNCE = 64 << 20  # the largest tcp chunk landed through the bounce buffer
MAX_EXPORTS = 1024  # peers (sender sockets) the pool is exported to over the ingress's life
MAX_EVENTS = 256  # opened peer events kept (one per recent sender)


@dataclass
class _Arrival:
    """A cuda-ipc commit whose copy is still running on the sender's stream."""

    ident: bytes
    xid: int
    msg: dict[str, Any]
    grant: _Reservation
    event: torch.cuda.Event
    deadline: float


@dataclass
class _Quarantined:
    """A slot that a peer's copy may still write: freed once `event` completes (or, when
    the event is unknown, at `until`)."""

    slot: int
    event: torch.cuda.Event | None
    until: float


def pinned_buffer(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def _state(event: torch.cuda.Event) -> bool | None:
    """True: done; False: pending; None: CUDA cannot tell (the peer's context died)."""
    try:
        return bool(cast(Any, event).query())
    except RuntimeError:
        return None


class CudaIngress(Ingress):
    """An `Ingress` over a `cuda` pool (see the module docstring)."""

    def __init__(
        self,
        endpoint: str,
        pool: Pool,
        *,
        lease_s: float = 30.0,
        context: zmq.Context[Any] | None = None,
        lane_port: int = 0,
        on_message: Callable[[Message], None] | None = None,
        key: bytes,
        inline_budget: int | None = None,
    ) -> None:
        if pool.backing.device != "cuda":
            raise PoolError(f"CudaIngress needs a cuda pool, not {pool.backing.device}")
        self._gpu = pool.backing.tensor.device
        self._stream = new_stream(self._gpu)
        self._exports: dict[bytes, dict[str, Any]] = {}
        self._events: collections.OrderedDict[bytes, tuple[bytes, torch.cuda.Event]] = (
            collections.OrderedDict()
        )
        self._arrivals: list[_Arrival] = []
        self._quarantine: list[_Quarantined] = []
        self._bounce: torch.Tensor | None = None
        self._bounce_view: memoryview | None = None
        super().__init__(
            endpoint,
            pool,
            lease_s=lease_s,
            context=context,
            lane_port=lane_port,
            on_message=on_message,
            key=key,
            inline_budget=inline_budget,
        )

    # ---- application side ---------------------------------------------------------------
    def _release(self, msg: Message) -> None:
        if msg.slot is not None and not msg.released:
            torch.cuda.current_stream(self._gpu).synchronize()  # work reading the slot ends
        super()._release(msg)

    # ---- handshake ------------------------------------------------------------------------
    def _welcome_extra(self, ident: bytes, msg: dict[str, Any]) -> dict[str, Any]:
        if msg.get("relay") != "cuda-ipc":
            return {}
        export = self._exports.get(ident)
        if export is None:
            if len(self._exports) >= MAX_EXPORTS:
                return {"cuda_unavailable": f"the pool was exported to {MAX_EXPORTS} peers"}
            try:
                export = cuda_ipc.export_pool(self.pool.backing).to_json()
            except Exception as exc:  # the I/O thread must outlive whatever CUDA says
                log.warning("ingress %s cannot export its CUDA pool: %s", self.endpoint, exc)
                return {"cuda_unavailable": f"the receiver cannot export its CUDA pool: {exc}"}
            self._exports[ident] = export
        return {"cuda": export}

    # ---- commits ----------------------------------------------------------------------------
    def _on_commit(self, ident: bytes, msg: dict[str, Any]) -> None:
        if msg.get("chunk") is not None:
            if "event" in msg:
                raise proto.ProtocolError("commit: a cuda-ipc commit carries no chunks")
            self._ensure_bounce(proto.nonneg_int(msg, "chunk"))
            super()._on_commit(ident, msg)
            return
        if "event" not in msg:
            super()._on_commit(ident, msg)
            return
        xid = proto.nonneg_int(msg, "xid")
        grant = self._granted.get((ident, xid))
        if grant is None or grant.offset is None:
            raise proto.ProtocolError(f"commit for xid {xid} without a live grant (lease expired?)")
        del self._granted[(ident, xid)]  # off the lease clock while the copy runs
        try:
            event = self._open_event(ident, cuda_ipc.parse_event_handle(msg.get("event")))
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

    def _later(self) -> float:
        return time.monotonic() + self.lease_s

    def _open_event(self, ident: bytes, handle: bytes) -> torch.cuda.Event:
        cached = self._events.get(ident)
        if cached is not None and cached[0] == handle:
            self._events.move_to_end(ident)
            return cached[1]
        try:
            event = torch.cuda.Event.from_ipc_handle(self._gpu, handle)  # type: ignore[no-untyped-call]
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
            self._reject(arrival, str(error))
            return
        self._granted[(arrival.ident, arrival.xid)] = arrival.grant
        if not deferred:
            super()._on_commit(arrival.ident, arrival.msg)
            return
        try:
            super()._on_commit(arrival.ident, arrival.msg)
        except (proto.ProtocolError, codec.CodecError) as exc:
            self._reject(arrival, str(exc))

    def _reject(self, arrival: _Arrival, reason: str) -> None:
        self._rejected += 1
        log.warning("ingress %s rejected a commit: %s", self.endpoint, reason)
        self._reply(arrival.ident, "nack", xid=arrival.xid, reason=reason)

    # ---- tcp chunks into device memory -----------------------------------------------------
    def _ensure_bounce(self, chunk: int) -> None:
        if chunk > MAX_BOUNCE:
            raise proto.ProtocolError(f"chunk size {chunk} over {MAX_BOUNCE} for a CUDA pool")
        if self._bounce is not None and self._bounce.numel() >= chunk:
            return
        try:
            bounce = pinned_buffer(max(chunk, 1 << 20))
        except RuntimeError as exc:
            raise proto.ProtocolError(f"no pinned memory for a {chunk} B chunk: {exc}") from None
        self._bounce, self._bounce_view = bounce, bounce.numpy().data

    def _chunk_buffer(self, offset: int, length: int) -> memoryview:
        assert self._bounce_view is not None  # made when the commit announced its chunks
        return self._bounce_view[:length]

    def _chunk_landed(self, offset: int, length: int) -> str | None:
        assert self._bounce is not None
        dst = self.pool.backing.tensor[offset : offset + length]
        try:
            with torch.cuda.stream(self._stream):
                dst.copy_(self._bounce[:length], non_blocking=True)
            self._stream.synchronize()  # the bounce buffer takes the next chunk
        except RuntimeError as exc:
            return f"copy to the GPU failed: {exc}"
        return None

    # ---- the loop's timers ----------------------------------------------------------------
    def _poll_ms(self) -> int:
        return 1 if self._arrivals or self._quarantine else super()._poll_ms()

    def _expire(self, now: float) -> None:
        for arrival in list(self._arrivals):
            state = _state(arrival.event)
            if state is False and arrival.deadline > now:
                continue
            self._arrivals.remove(arrival)
            if state is False:  # still copying after a whole lease
                assert arrival.grant.offset is not None
                self._quarantine.append(_Quarantined(arrival.grant.offset, arrival.event, 0.0))
                self._reject(arrival, "the sender's copy did not complete within the lease")
            else:
                self._land(arrival, failed=state is None, deferred=True)
        for entry in list(self._quarantine):
            released = _state(entry.event) is not False if entry.event else entry.until <= now
            if released:
                self._quarantine.remove(entry)
                self.pool.free(entry.slot)
        super()._expire(now)
