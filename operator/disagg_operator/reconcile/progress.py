"""Work in flight and when it last moved: what the liveness probe (`app.liveness`) reads to
tell a stuck operator from an idle one. The reconciler enters it for each piece of work."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

Clock = Callable[[], float]


@dataclass
class Progress:
    """Work in flight (reconciles and refreshes) and when it last moved: when the first
    piece of work began after idling, or when the last one ended."""

    clock: Clock = time.monotonic
    pending: int = 0
    since: float = field(default=0.0)

    def __post_init__(self) -> None:
        self.since = self.clock()

    @contextlib.contextmanager
    def working(self) -> Iterator[None]:
        if self.pending == 0:
            self.since = self.clock()
        self.pending += 1
        try:
            yield
        finally:
            self.pending -= 1
            self.since = self.clock()

    def stalled_for(self, now: float) -> float:
        """Seconds work has waited without any of it ending (0 when idle)."""
        return 0.0 if self.pending == 0 else max(0.0, now - self.since)
