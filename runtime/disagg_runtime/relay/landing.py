"""How payloads land in the receiver's pool: the parts of the ingress that differ by relay
kind, apart from its I/O loop (relay/ingress/). Protocols only: each relay kind's landing
is its backend's (relay/backends/), which the ingress never imports.

A `Landing` is one relay kind's receiving side, made (lazily, see relay/registry.py) the
first time a sender of that kind says hello: extra welcome fields, commits it takes over
(a cuda-ipc copy still running on the sender's stream; a tcp commit whose bytes follow
as chunk messages, which the ingress then hands it, `take`), its own timers.

A landing talks to the ingress through `Host`, so a landing can claim a grant, read the
frames of a message it was handed, finish, nack or free what it took over, and never
needs the socket.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from disagg_runtime.memory.intake import Memory
from disagg_runtime.memory.pool import Pool
from disagg_runtime.relay.ledger import Reservation, SlotLedger
from disagg_runtime.wire.manifest import Manifest


class Host(Protocol):
    """What a landing may use of its ingress (all on the I/O thread)."""

    @property
    def endpoint(self) -> str: ...

    @property
    def pool(self) -> Pool: ...

    @property
    def ledger(self) -> SlotLedger: ...

    @property
    def memory(self) -> Memory: ...  # how bytes land in the pool (a CUDA pool's: bounced)

    @property
    def lease_s(self) -> float: ...

    def commit(self, ident: bytes, msg: dict[str, Any]) -> None:
        """The plain commit path (the bytes are in the slot): validate and deliver, or raise."""

    def claim(self, ident: bytes, xid: int, msg: dict[str, Any]) -> tuple[Reservation, int]:
        """A commit takes its grant: the grant and its slot, now the landing's to `finish`
        or free; ProtocolError (the slot freed) when it cannot."""

    def finish(
        self,
        ident: bytes,
        xid: int,
        rid: str,
        slot: int,
        manifest: Manifest,
        meta: dict[str, Any] | None,
    ) -> None:
        """The payload is in `slot`, laid out as `manifest`: deliver it and ack the commit."""

    def reject(self, ident: bytes, xid: int, reason: str) -> None:
        """Count and nack a commit the landing gave up on."""

    def expect_frames(self, ident: bytes, landing: Landing | None) -> None:
        """Hand every next message of `ident` to `landing.take` (None: no longer)."""

    def read_into(self, buffer: Any) -> int:
        """Receive the next frame of the message being handed over into `buffer`: its
        length (a longer frame is cut short)."""

    def more_frames(self) -> bool:
        """Whether the message being handed over has more frames (they are dropped)."""

    def call(self, fn: Callable[[], None]) -> None:
        """Run `fn` on the I/O thread soon (callable from any thread: a landing's own
        threads end their transfers so)."""

    def verify(self, given: object, label: str, *parts: str) -> bool:
        """Whether `given` is the peer key's mac over `label` and `parts` (relay/auth.py):
        a landing's own connections prove the key without holding it."""


class Landing:
    """One relay kind's receiving side; the defaults change nothing (as for shm, which has
    no landing)."""

    kind: str = ""
    binary_commits: bool = False  # its commits may be binary: they carry no field of its own

    def welcome(self, ident: bytes, hello: dict[str, Any]) -> dict[str, Any]:
        """Extra welcome fields for a sender of this kind."""
        return {}

    def commit(self, ident: bytes, msg: dict[str, Any]) -> bool:
        """Take over a commit (True: it is answered later, or has been); False: plain."""
        return False

    def take(self, ident: bytes) -> None:
        """The next message of `ident`, which this landing expects (Host `expect_frames`):
        read its frames through the host."""
        raise NotImplementedError(f"the {self.kind} landing expects no frames")

    def due(self) -> float | None:
        """The earliest deadline `expire` acts on, if any."""
        return None

    def busy(self) -> bool:
        """Work in progress the loop must poll for soon (it then wakes every millisecond)."""
        return False

    def expire(self, now: float) -> None:
        """Timers: deferred commits and whatever the landing keeps."""

    def forget(self, ident: bytes) -> None:
        """`ident` is no longer a peer."""

    def close(self) -> None:
        """The ingress is closing."""
