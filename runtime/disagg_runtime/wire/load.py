"""What a receiver says of itself, and what a sender knows of it: `Load` and `View`.

A `Load` rides on the relay's welcome, every grant and ack, and the periodic `load`
message (relay/protocol.py); a sender keeps the last one per receiver with its age and
the requests it sent there since (`View`). Here, below the relay, because the relay
carries and checks these reports; what a sender does with them (which replica gets a
request) is routing's (routing/dispatch.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_COUNT = 1 << 31  # bounds on what a report may say (a malformed one is refused)
MAX_BYTES = 1 << 50
MAX_SERVICE_S = 86400.0


class LoadError(ValueError):
    """A load report is malformed."""


@dataclass(frozen=True)
class Load:
    """What a receiver says of itself: requests waiting for a worker, requests being
    handled, how many it handles at once, its receive pool's free and total bytes, its
    recent seconds per request (0: none handled yet), and whether it is draining (then it
    wants no new requests)."""

    queued: int
    active: int
    workers: int
    free_bytes: int
    pool_bytes: int
    service_s: float = 0.0
    draining: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "queued": self.queued,
            "active": self.active,
            "workers": self.workers,
            "free_bytes": self.free_bytes,
            "pool_bytes": self.pool_bytes,
            "service_s": round(self.service_s, 6),
            "draining": self.draining,
        }

    @classmethod
    def from_json(cls, obj: object) -> Load:
        """Validated: an object of bounded non-negative integers (workers at least 1, free
        bytes at most the pool's) and a boolean; other keys are ignored (later additions)."""
        if not isinstance(obj, dict):
            raise LoadError(f"load must be an object, not {type(obj).__name__}")

        def count(name: str, lo: int, hi: int) -> int:
            value = obj.get(name)
            if type(value) is not int or not lo <= value <= hi:
                raise LoadError(f"load.{name} must be an integer in [{lo}, {hi}], got {value!r}")
            return value

        draining = obj.get("draining", False)
        if type(draining) is not bool:
            raise LoadError(f"load.draining must be a boolean, got {draining!r}")
        service = obj.get("service_s", 0.0)
        if type(service) not in (int, float) or not 0 <= service <= MAX_SERVICE_S:
            raise LoadError(f"load.service_s must be seconds in [0, {MAX_SERVICE_S:g}]")
        pool = count("pool_bytes", 0, MAX_BYTES)
        return cls(
            queued=count("queued", 0, MAX_COUNT),
            active=count("active", 0, MAX_COUNT),
            workers=count("workers", 1, MAX_COUNT),
            free_bytes=count("free_bytes", 0, pool),
            pool_bytes=pool,
            service_s=float(service),
            draining=draining,
        )

    @property
    def occupancy(self) -> float:
        return 1.0 - self.free_bytes / self.pool_bytes if self.pool_bytes else 0.0


@dataclass(frozen=True)
class View:
    """What one sender knows of one replica now: its last `load`, how old that is, and how
    many requests this sender sent it since."""

    load: Load
    age_s: float
    sent_since: int = 0
