"""The `nixl` relay: one-sided writes into the receiver's pool through NIXL (Dynamo's, vLLM's
and SGLang's transfer library), over UCX: RDMA where the hardware has it, shared memory
(CMA) or TCP where it does not. Optional: `pip install 'disagg[nixl]'`; nothing here
imports `nixl` until a nixl relay or landing is made (relay/registry.py).

    sender (NixlSender)                            receiver (NixlLanding)
                                                   registers its whole pool once (DRAM, or
                                                   VRAM for a cuda pool), at the first nixl hello
    hello {relay: "nixl"}                  -->
                                           <--     welcome {..., nixl: {agent: METADATA,
                                                     name, addr, size, dev, mem}}   (under the mac)
    load METADATA once (add_remote_agent)
    reserve {rid, xid, nbytes}             -->
                                           <--     grant {xid, offset, lease_s}
    one WRITE of every tensor to its place in the slot (its registration and NIXL's
    prepared descriptor lists made once and reused: relay/backends/nixl_cache.py), wait
    for DONE (by the lease's half-way mark)
    commit {rid, xid, offset, manifest}    -->     (the bytes are in the slot: UCX completes a
                                                    WRITE once it is remotely complete)
                                           <--     ack {xid[, spare]}
    in a stream, a commit asks for credit (`next`) and the ack may grant the next slot
    ahead (relay/credit.py): the next WRITE goes there with no reservation first

Completion is the existing commit, on the same ordered channel as everything else, so no
notification can be lost, and flow control is the ledger's (relay/ledger.py): every
transfer ends in an ack, a nack, or a lease that expires and frees the slot. A failed
WRITE (the receiver went away: NIXL_ERR_REMOTE_DISCONNECT) cancels its grant and raises;
a WRITE still running at the lease's half-way mark is released (UCX cancels it) and the
slot is left to its lease. A sender that dies mid-transfer holds nothing for longer than
a lease. NIXL refuses writes outside the registered pool (NIXL_ERR_NOT_FOUND), and the
receiver's metadata only travels in the authenticated welcome.

One NIXL agent per process (`process_agent`) serves every nixl sender and landing in it;
a sender in the same process as its receiver writes through the agent's loopback.
"""

from __future__ import annotations

import base64
import binascii
import logging
from dataclasses import dataclass
from typing import Any

import torch

from disagg_runtime.memory.layout import host_tensor
from disagg_runtime.relay import protocol as proto
from disagg_runtime.relay.backends.nixl_agent import (
    NEEDS,
    UCX,
    Agent,
    process_agent,
    unavailable_reason,
)
from disagg_runtime.relay.backends.nixl_cache import SendCache
from disagg_runtime.relay.errors import RelayError, RelayTimeout
from disagg_runtime.relay.landing import Host, Landing
from disagg_runtime.relay.registry import Backend
from disagg_runtime.relay.sender import Sender, Transfer
from disagg_runtime.wire.manifest import Manifest

log = logging.getLogger(__name__)
__all__ = ["BACKEND", "NEEDS", "UCX", "Agent", "NixlLanding", "NixlSender", "Offer"]
__all__ += ["process_agent", "unavailable_reason"]
MAX_METADATA_BYTES = 1 << 20  # an agent's metadata is about 500 B over UCX here
MEMS = ("DRAM", "VRAM")


def _mem(tensor: torch.Tensor) -> str:
    return "VRAM" if tensor.is_cuda else "DRAM"


def _device(tensor: torch.Tensor) -> int:
    return (tensor.device.index or 0) if tensor.is_cuda else 0


@dataclass(frozen=True)
class Offer:
    """The receiver's registered pool, as its welcome describes it."""

    metadata: bytes
    name: str
    addr: int
    size: int
    dev: int
    mem: str

    def to_json(self) -> dict[str, Any]:
        return {
            "agent": base64.b64encode(self.metadata).decode(),
            "name": self.name,
            "addr": self.addr,
            "size": self.size,
            "dev": self.dev,
            "mem": self.mem,
        }

    @classmethod
    def from_json(cls, obj: Any) -> Offer:
        if not isinstance(obj, dict):
            raise proto.ProtocolError("nixl offer: not an object")
        encoded = proto.field(obj, "agent", str)
        if len(encoded) > 2 * MAX_METADATA_BYTES:
            raise proto.ProtocolError("nixl offer: metadata too large")
        try:
            metadata = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise proto.ProtocolError("nixl offer: metadata is not base64") from None
        name = proto.field(obj, "name", str)
        if not 0 < len(name) <= 256:
            raise proto.ProtocolError("nixl offer: bad agent name")
        mem = proto.field(obj, "mem", str)
        if mem not in MEMS:
            raise proto.ProtocolError(f"nixl offer: mem must be one of {', '.join(MEMS)}")
        return cls(
            metadata,
            name,
            proto.nonneg_int(obj, "addr"),
            proto.nonneg_int(obj, "size"),
            proto.nonneg_int(obj, "dev"),
            mem,
        )


class NixlLanding(Landing):
    """The receiving side: registers the pool at the first nixl hello and offers it in the
    welcome; commits are plain (the bytes are in the slot when the sender commits)."""

    kind = "nixl"
    binary_commits = True  # a nixl commit carries no field of its own

    def __init__(self, host: Host) -> None:
        self.host = host
        self._agent: Agent | None = None
        self._registered: Any = None
        self._offer: dict[str, Any] | None = None
        self._error: str | None = None
        tensor = host.pool.backing.tensor
        try:
            agent = process_agent()
            self._registered = agent.register([tensor])
            self._agent = agent
            agent.hold_progress()
            offer = Offer(
                agent.metadata(),
                agent.name,
                tensor.data_ptr(),
                tensor.numel(),
                _device(tensor),
                _mem(tensor),
            )
            self._offer = offer.to_json()
        except RelayError as exc:
            self._error = str(exc)
        except Exception as exc:  # NIXL's own errors: the I/O thread must go on
            self._error = f"cannot register the pool with NIXL: {type(exc).__name__}: {exc}"
        if self._error is not None:
            log.warning("ingress %s: no nixl transfers: %s", host.endpoint, self._error)

    def welcome(self, ident: bytes, hello: dict[str, Any]) -> dict[str, Any]:
        if self._offer is None:
            return {"nixl_unavailable": f"the receiver at {self.host.endpoint}: {self._error}"}
        return {"nixl": self._offer}

    def close(self) -> None:
        if self._agent is not None and self._registered is not None:
            self._agent.release_progress()
            try:
                self._agent.deregister(self._registered)
            except Exception as exc:
                log.debug("nixl: deregistering the pool: %s", exc)
            self._registered = None


class NixlSender(Sender):
    """Writes the payload's tensors straight into the granted slot (see the module doc)."""

    kind = "nixl"
    control_on_lane = True  # the data never crosses the socket: control only, as shm
    commit_on_lane = True  # so credit (a slot granted ahead) keeps its place in line
    binary_commit = True  # no backend fields: binary on the lane (~25 us of JSON less)

    def __init__(self, endpoint: str, **kwargs: Any) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise RelayError(f"relay nixl to {endpoint} needs {NEEDS}: {reason}")
        self._agent = process_agent()
        self._offer: Offer | None = None
        self._remote: str | None = None
        self._cache = SendCache(self._agent)  # this connection's: a reconnect starts afresh
        super().__init__(endpoint, **kwargs)

    def _on_welcome(self, welcome: dict[str, Any]) -> None:
        if "nixl" not in welcome:
            reason = welcome.get("nixl_unavailable") or "it offers no NIXL memory"
            raise RelayError(f"receiver at {self.endpoint} takes no nixl transfers: {reason}")
        try:
            offer = Offer.from_json(welcome["nixl"])
            if offer.size < proto.nonneg_int(welcome, "pool_size"):
                raise proto.ProtocolError("nixl offer: smaller than the welcome's pool_size")
        except proto.ProtocolError as exc:
            raise RelayError(f"bad nixl welcome from {self.endpoint}: {exc}") from None
        try:
            self._remote = self._agent.add_remote(offer.metadata, offer.name)
        except Exception as exc:
            raise RelayError(f"cannot load the NIXL metadata of {self.endpoint}: {exc}") from None
        self._offer = offer

    def _transfer(self, transfer: Transfer) -> None:
        commit, xid, offset = transfer.commit, transfer.xid, transfer.offset
        manifest, tensors, write_by = transfer.manifest, transfer.tensors, transfer.write_by
        offer, remote = self._offer, self._remote
        assert offer is not None and remote is not None  # set by the handshake
        self._check_grant(xid, offset, manifest.nbytes, offer.size)
        self._check_lease(xid, write_by)
        sources = _sources(manifest, tensors)
        if sources:
            mem = _mem(sources[0][1])
            local = [(t.data_ptr(), t.numel() * t.element_size(), _device(t)) for _, t in sources]
            base = offer.addr + offset
            far = [
                (base + at, length, offer.dev)
                for (at, _), (_, length, _) in zip(sources, local, strict=True)
            ]
            self._write([t for _, t in sources], local, mem, far, xid, write_by)
        self._control(commit)

    def _write(
        self,
        tensors: list[torch.Tensor],
        local: list[tuple[int, int, int]],
        mem: str,
        far: list[tuple[int, int, int]],
        xid: int,
        write_by: float,
    ) -> None:
        assert self._offer is not None and self._remote is not None
        try:
            lists = self._cache.prepare(tensors, local, mem, far, self._offer.mem, self._remote)
        except Exception as exc:  # NIXL's own errors (NIXL_ERR_NOT_FOUND: outside the pool)
            self._control(proto.pack("cancel", xid=xid))
            raise RelayError(f"nixl relay to {self.endpoint}: cannot prepare: {exc}") from None
        try:
            state = self._agent.write_prepped(*lists, len(local), write_by)
        except Exception as exc:  # NIXL_ERR_REMOTE_DISCONNECT and kin: nothing was written
            state = f"ERR: {type(exc).__name__}: {exc}"
        if state is None:  # still running: released (cancelled); the lease frees the slot
            raise RelayTimeout(f"nixl write to {self.endpoint} did not finish within the lease")
        if state != "DONE":
            self._control(proto.pack("cancel", xid=xid))
            raise RelayError(f"nixl write to {self.endpoint} failed: {state}")

    def _on_close(self) -> None:
        self._cache.close()  # its far lists name the remote: released before it goes
        if self._remote is not None:
            self._agent.drop_remote(self._remote)
            self._remote = None


def _sources(manifest: Manifest, tensors: list[torch.Tensor]) -> list[tuple[int, torch.Tensor]]:
    """(offset in the slot, contiguous tensor) of every non-empty tensor, all on one kind
    of memory: GPU tensors stay on the GPU (NIXL writes VRAM) unless the payload mixes
    host and GPU tensors, then all go from host memory."""
    pairs = [
        (offset, t)
        for meta, offset, t in zip(manifest.tensors, manifest.offsets, tensors, strict=True)
        if meta.nbytes
    ]
    on_gpu = {t.is_cuda for _, t in pairs}
    if len(on_gpu) > 1:
        return [(offset, host_tensor(t)) for offset, t in pairs]
    return [(offset, _flat(t)) for offset, t in pairs]


def _flat(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bytes as one contiguous tensor on its device (conj/neg views resolved)."""
    if t.is_contiguous() and not (t.is_conj() or t.is_neg()):
        return t.detach()
    return t.detach().resolve_conj().resolve_neg().contiguous()


def _landing(host: Host) -> Landing:
    return NixlLanding(host)


BACKEND = Backend(
    "nixl",
    sender=NixlSender,
    landing=_landing,
    unavailable=lambda: unavailable_reason(),  # late-bound: looked up at each check
    needs=NEEDS,
)
