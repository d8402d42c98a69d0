"""The `shm` relay: roles on one node; the sender writes tensors once into the receiver's
shared pool (reserve -> grant -> copy -> commit -> ack; in a stream of medium payloads
the ack grants the next slot ahead, credit: copy -> commit -> ack, relay/credit.py) and
sends only the manifest.
The receiver needs no landing of its own: the bytes are in its pool at commit.

A caller that produces a payload's bytes itself (the gateway reading an HTTP body off its
socket) can write them there directly, with no copy in between: `reserve` a slot for a
manifest, fill `slot(grant)` (the receiver's pool as mapped here), then `commit` it, or
`cancel` it, which frees it at once (the receiver frees it anyway when its lease ends).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import zmq

from disagg_runtime.memory.layout import write_tensors
from disagg_runtime.memory.pool import Backing, PoolError, attach_backing, check_shm_name
from disagg_runtime.relay.errors import NotAPeer, RelayError, RelayTimeout
from disagg_runtime.relay.registry import Backend
from disagg_runtime.relay.sender import Grant, Sender, Transfer

log = logging.getLogger(__name__)


class ShmSender(Sender):
    """Writes tensors once into the receiver's pre-faulted shared pool; sends the manifest.
    With a lane, the whole handshake runs there: one thread wake-up per message instead of
    three (the data itself never crosses a socket)."""

    kind = "shm"
    control_on_lane = True
    binary_commit = True
    commit_on_lane = True
    credit_below_inline = True  # one copy into the pool instead of two through the lane
    _backing: Backing | None = None
    _pin_tried = False

    def _on_welcome(self, welcome: dict[str, Any]) -> None:
        """Attach the pool the welcome names. A name no pool of ours can have (NUL bytes,
        too long, another pipeline's) refuses this receiver as a peer (NotAPeer: counted
        as a refusal, a transport failure to the caller), before the name is used."""
        name = welcome.get("pool")
        if not isinstance(name, str):
            raise RelayError(
                f"receiver at {self.endpoint} has no shared-memory pool; use the tcp relay"
            )
        try:
            check_shm_name(name)
        except PoolError as exc:
            raise NotAPeer(f"receiver at {self.endpoint}: the welcome's 'pool': {exc}") from None
        if self.pools is not None and not name.startswith(self.pools):
            raise NotAPeer(
                f"receiver at {self.endpoint} offers pool {name[:80]!r}, not one of this "
                f"pipeline's ({self.pools}*)"
            )
        try:
            self._backing = attach_backing(name)
        except PoolError as exc:
            raise RelayError(f"cannot map the receive pool of {self.endpoint}: {exc}") from None

    def _transfer(self, transfer: Transfer) -> None:
        commit, xid, offset = transfer.commit, transfer.xid, transfer.offset
        manifest, tensors, write_by = transfer.manifest, transfer.tensors, transfer.write_by
        assert self._backing is not None  # set by the handshake
        self._check_grant(xid, offset, manifest.nbytes, self._backing.size)
        if not self._pin_tried and any(t.is_cuda for t in tensors):
            self._pin_for_gpu(self._backing)
        self._check_lease(xid, write_by)
        # copies from a GPU run on the copy stream; the receiver reads once it has the commit
        write_tensors(self._backing, offset, manifest, tensors).wait()
        self._control(commit)

    # ---- reserve (Sender.reserve), fill, commit: the caller writes the slot ------------------
    def _check_reserved(self, xid: int, offset: int, nbytes: int) -> None:
        assert self._backing is not None  # set by the handshake
        self._check_grant(xid, offset, nbytes, self._backing.size)

    def slot(self, grant: Grant) -> memoryview:
        """The granted slot's bytes, as this process maps the receiver's pool: the payload's
        tensors go at `grant.manifest`'s offsets in it."""
        assert self._backing is not None  # set by the handshake
        return self._backing.buffer(grant.offset, grant.manifest.nbytes)

    def commit(
        self, grant: Grant, *, meta: Mapping[str, Any] | None = None, timeout: float | None = None
    ) -> None:
        """Hand the filled slot to the receiver; returns once it holds the payload. A grant
        whose lease half ran out is cancelled instead (RelayTimeout)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._lock:
            header = self._grant_commit(grant, meta)
            try:
                self._control(header)
            except zmq.Again:
                raise RelayTimeout(
                    f"receiver at {self.endpoint} is not draining; request {grant.rid} not sent"
                ) from None
            reply = self._await(grant.xid, {"ack", "nack"}, deadline, "acknowledgement")
        if reply["op"] == "nack":
            raise RelayError(
                f"receiver at {self.endpoint} rejected request {grant.rid}: {reply.get('reason')}"
            )

    def _pin_for_gpu(self, backing: Backing) -> None:
        """Page-lock our mapping of the receiver's pool once, so that GPU tensors are copied
        into it by DMA rather than through the driver's pageable bounce buffers."""
        self._pin_tried = True
        try:
            backing.pin()
        except PoolError as exc:
            log.info(
                "%s relay to %s copies from the GPU unpinned: %s", self.kind, self.endpoint, exc
            )

    def _on_close(self) -> None:
        if self._backing is not None:
            self._backing.close()


BACKEND = Backend("shm", sender=ShmSender)
