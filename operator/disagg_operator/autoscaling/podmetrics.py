"""Reading the role containers' /metrics for the autoscaler.

The series are the runtime's (see `disagg_runtime.role.metrics`, the contract table):
`disagg_pool_occupancy` (0..1) and `disagg_queue_depth`. Plain HTTP GETs to pod IPs, at most
`concurrency` in flight for the whole operator (one `Scraper`; the others wait their turn
before their clock starts), each bounded by a short total timeout of its own and a body size
limit; no connection is kept (a pod is scraped once per interval, and ten thousand idle
connections would cost more than they save), so a round costs time and memory linear in the
pods. Any failure (refused, timed out, not 200, unparsable, no occupancy series) reads as
None, never as an exception: the algorithm treats a missing sample conservatively.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Final

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from disagg_core import autoscale
from disagg_operator.autoscaling.scaling import Reading

DEFAULT_TIMEOUT: Final = 2.0  # seconds per scrape, connect included
MAX_BODY: Final = 4 * 2**20  # a role's exposition is a few KiB
CONCURRENCY: Final = 128  # scrapes in flight at once


def parse(text: str) -> Reading | None:
    """The occupancy and queue depth in an exposition text; None without an occupancy."""
    wanted = (autoscale.OCCUPANCY_METRIC, autoscale.QUEUE_DEPTH_METRIC)
    values: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in wanted:
                    values[sample.name] = float(sample.value)
    except (ValueError, TypeError, IndexError):
        return None
    occupancy, queue_depth = autoscale.signals(values)
    return None if occupancy is None else Reading(occupancy, queue_depth)


class Scraper:
    """Concurrent scrapes over one aiohttp session (made on first use, in the running loop)."""

    def __init__(self, timeout: float = DEFAULT_TIMEOUT, concurrency: int = CONCURRENCY) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._concurrency = max(1, concurrency)
        self._slots: asyncio.Semaphore | None = None
        self._session: aiohttp.ClientSession | None = None

    async def read_all(self, urls: Iterable[str]) -> dict[str, Reading | None]:
        unique = list(dict.fromkeys(urls))
        if not unique:
            return {}
        results = await asyncio.gather(*(self.read(url) for url in unique))
        return dict(zip(unique, results, strict=True))

    async def read(self, url: str) -> Reading | None:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._concurrency)
        async with self._slots:  # the timeout starts once it is this scrape's turn
            return await self._read(url)

    async def _read(self, url: str) -> Reading | None:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._concurrency, force_close=True),
                timeout=self._timeout,
                trust_env=False,  # pod IPs: never through a proxy
            )
        try:
            async with self._session.get(url, allow_redirects=False) as response:
                if response.status != 200:
                    return None
                body = await response.content.read(MAX_BODY + 1)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return None
        if len(body) > MAX_BODY:
            return None
        return parse(body.decode("utf-8", errors="replace"))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
