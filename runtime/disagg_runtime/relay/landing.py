"""How payloads land in the receiver's pool: the parts of the ingress that differ by relay
kind or by pool memory, apart from its I/O loop (relay/ingress/).

- A `Landing` is one relay kind's receiving side, made (lazily, see relay/registry.py)
  the first time a sender of that kind says hello: extra welcome fields, commits it takes
  over (a cuda-ipc copy still running on the sender's stream), its own timers.
- `Chunked` follows one tcp transfer: where each of its next chunk messages goes.

A landing talks to the ingress through `Host`, so a landing can finish, nack or free what it
took over, and never needs the socket.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from disagg_runtime.memory.pool import Pool
from disagg_runtime.relay import protocol as proto
from disagg_runtime.relay.ledger import Reservation, SlotLedger
from disagg_runtime.wire.manifest import Manifest

MIN_CHUNK = 4096  # smaller chunks only cost per-message overhead


class Host(Protocol):
    """What a landing may use of its ingress (all on the I/O thread)."""

    @property
    def endpoint(self) -> str: ...

    @property
    def pool(self) -> Pool: ...

    @property
    def ledger(self) -> SlotLedger: ...

    def commit(self, ident: bytes, msg: dict[str, Any]) -> None:
        """The plain commit path: validate, land (tcp chunks) and deliver, or raise."""

    def reject(self, ident: bytes, xid: int, reason: str) -> None:
        """Count and nack a commit the landing gave up on."""


class Landing:
    """One relay kind's receiving side; the defaults are what shm and tcp need."""

    kind: str = ""

    def welcome(self, ident: bytes, hello: dict[str, Any]) -> dict[str, Any]:
        """Extra welcome fields for a sender of this kind."""
        return {}

    def commit(self, ident: bytes, msg: dict[str, Any]) -> bool:
        """Take over a commit (True: it is answered later, or has been); False: plain."""
        return False

    def busy(self) -> bool:
        """Work in progress the loop must poll for soon (it then wakes every millisecond)."""
        return False

    def expire(self, now: float) -> None:
        """Timers: deferred commits and whatever the landing keeps."""

    def forget(self, ident: bytes) -> None:
        """`ident` is no longer a peer."""

    def close(self) -> None:
        """The ingress is closing."""


@dataclass
class Chunked:
    """A tcp transfer in progress: where each of the sender's next chunk messages goes."""

    grant: Reservation
    xid: int
    manifest: Manifest
    meta: dict[str, Any] | None
    targets: Iterator[tuple[int, int]]
    remaining: int
    deadline: float
    done: int = 0
    error: str | None = None


def chunk_count(manifest: Manifest, chunk: int) -> int:
    if chunk < MIN_CHUNK:
        raise proto.ProtocolError(f"chunk size {chunk} is below the minimum {MIN_CHUNK}")
    if chunk > proto.MAX_FRAME_BYTES:
        raise proto.ProtocolError(f"chunk size {chunk} is over {proto.MAX_FRAME_BYTES} B")
    return sum(-(-meta.nbytes // chunk) for meta in manifest.tensors)


def chunk_targets(slot: int, manifest: Manifest, chunk: int) -> Iterator[tuple[int, int]]:
    """(pool offset, length) of every chunk, in the order the sender sends them (lazily:
    a large slot in small chunks must not build a huge list on the I/O thread)."""
    for meta, offset in zip(manifest.tensors, manifest.offsets, strict=True):
        for start in range(0, meta.nbytes, chunk):
            yield slot + offset + start, min(chunk, meta.nbytes - start)
