"""Reading the role containers' /metrics for the autoscaler.

The series are the runtime's (see `disagg_runtime.role.metrics`, the contract table):
`disagg_pool_occupancy` (0..1) and `disagg_queue_depth`; an engine container's (vLLM, on its
HTTP port) are `vllm:kv_cache_usage_perc` (0..1; the highest of its engine cores') and
`vllm:num_requests_waiting` (their sum), which take the same two places (`autoscale`).
Plain HTTP GETs to pod IPs, at most `concurrency` in flight for the whole operator (one
`Scraper`; the others wait their turn before their clock starts), each bounded by a short
total timeout of its own and a body size limit; no connection is kept (a pod is scraped once
per interval, and ten thousand idle connections would cost more than they save), so a round
costs time and memory linear in the pods. Any failure (refused, timed out, not 200,
unparsable, no occupancy series) reads as None, never as an exception: the algorithm treats
a missing sample conservatively.
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


_RUNTIME = (autoscale.OCCUPANCY_METRIC, autoscale.QUEUE_DEPTH_METRIC)
_ENGINE = (*autoscale.ENGINE_KV_METRICS, autoscale.ENGINE_WAITING_METRIC)


def parse(text: str) -> Reading | None:
    """The occupancy and queue depth in an exposition text (a role's, or an engine's KV
    cache usage and waiting requests); None without an occupancy."""
    values: dict[str, float] = {}
    engine: dict[str, list[float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in _RUNTIME:
                    values[sample.name] = float(sample.value)
                elif sample.name in _ENGINE:  # one series per engine core (data parallel)
                    engine.setdefault(sample.name, []).append(float(sample.value))
    except (ValueError, TypeError, IndexError):
        return None
    if autoscale.OCCUPANCY_METRIC not in values:
        values = _engine_values(engine)
    occupancy, queue_depth = autoscale.signals(values)
    return None if occupancy is None else Reading(occupancy, queue_depth)


def _engine_values(engine: dict[str, list[float]]) -> dict[str, float]:
    """An engine's series as the runtime's: the fullest core's KV cache, all waiting."""
    values: dict[str, float] = {}
    usage = next((engine[name] for name in autoscale.ENGINE_KV_METRICS if engine.get(name)), None)
    if usage:
        values[autoscale.OCCUPANCY_METRIC] = max(usage)
    waiting = engine.get(autoscale.ENGINE_WAITING_METRIC)
    if waiting:
        values[autoscale.QUEUE_DEPTH_METRIC] = sum(waiting)
    return values


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
