"""Fault injection: a slow or failing API server, for testing clients' retries and backoff.

``Faults`` decides, per resource request, how long to hold it and whether to fail it:

- latency: every request waits a uniform random time in ``latency`` (seconds) before it is
  served (a watch: before its stream starts);
- errors: a share ``error_rate`` of the requests that are not watches fail instead of being
  served, with one of ``errors``, picked uniformly: 429 TooManyRequests (with
  ``Retry-After`` in the Status details, as the API server's priority and fairness sends it),
  500 InternalError, or 504 Timeout after a further ``stall`` seconds (the API server's own
  request timeout, seen from the client);
- scope: only requests whose User-Agent starts with one of ``user_agents`` (empty: all), so a
  test can slow down the operator and not itself.

Non-resource requests (discovery, /version, /healthz, /metrics) are never delayed or failed.
Decisions come from ``rng`` (seeded for reproducible runs); ``injected`` counts what was done.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from dataclasses import dataclass, field

import kmock

from .errors import api_error

ERRORS = (429, 500, 504)


@dataclass
class Faults:
    latency: tuple[float, float] = (0.0, 0.0)
    error_rate: float = 0.0
    errors: tuple[int, ...] = ERRORS
    stall: float = 1.0
    retry_after: int = 1  # seconds, in a 429's details
    user_agents: tuple[str, ...] = ()
    rng: random.Random = field(default_factory=lambda: random.Random(0))
    injected: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        low, high = self.latency
        if not 0 <= low <= high:
            raise ValueError(f"latency must be 0 <= low <= high, not {self.latency}")
        if not 0 <= self.error_rate <= 1:
            raise ValueError(f"error_rate must be within 0..1, not {self.error_rate}")
        unknown = set(self.errors) - set(ERRORS)
        if unknown or not self.errors:
            raise ValueError(f"errors must be some of {ERRORS}, not {self.errors}")

    def applies(self, user_agent: str) -> bool:
        return not self.user_agents or user_agent.startswith(self.user_agents)

    async def before(self, *, user_agent: str, watch: bool) -> kmock.KubernetesError | None:
        """Hold the request; the error to answer with instead of serving it, if any."""
        if not self.applies(user_agent):
            return None
        low, high = self.latency
        if high > 0:
            self.injected["delayed"] += 1
            await asyncio.sleep(self.rng.uniform(low, high))
        if watch or self.rng.random() >= self.error_rate:
            return None
        code = self.rng.choice(self.errors)
        self.injected[str(code)] += 1
        if code == 429:
            return api_error(
                429,
                "TooManyRequests",
                "the server has received too many requests and has asked us to try again later",
                retryAfterSeconds=self.retry_after,
            )
        if code == 500:
            return api_error(500, "InternalError", "an error on the server (injected) occurred")
        await asyncio.sleep(self.stall)
        return api_error(
            504, "Timeout", "the server was unable to return a response in the time allotted"
        )

    @classmethod
    def parse(cls, latency: str = "", error_rate: float = 0.0, **options: object) -> Faults:
        """From command-line forms: latency ``0.2`` or ``0.1:0.3`` (seconds)."""
        low, _, high = latency.partition(":") if latency else ("0", "", "0")
        bounds = (float(low), float(high or low))
        return cls(latency=bounds, error_rate=error_rate, **options)  # type: ignore[arg-type]
