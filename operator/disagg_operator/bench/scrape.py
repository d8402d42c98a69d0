"""One autoscaler scraping round at scale: `podmetrics.Scraper.read_all` over N emulated role
endpoints, timed.

    python -m disagg_operator.bench.scrape [--endpoints 10000] [--slow 100] [--json]

The endpoints are cheap stubs: one aiohttp server (its own thread and event loop) on one
port of 0.0.0.0, reached through N distinct loopback addresses (127.x.y.z), so every
endpoint is a separate host to the scraper, as pod IPs are: a connection each, no sharing.
Each answers a runtime-like exposition (occupancy and queue depth). `--slow` of them never
answer within the scrape timeout (they hold the request for 30 s), to show that one hung
pod costs one timeout in its slot, not the round's. Reported: the round's wall time, the
scraper's CPU time (its thread only), readings got, and wall time per 1,000 endpoints (the
cost should grow linearly with N: compare two N).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
from typing import Any

import aiohttp.web

from disagg_operator.autoscaling import podmetrics

EXPOSITION = (
    "# TYPE disagg_pool_occupancy gauge\ndisagg_pool_occupancy 0.42\n"
    "# TYPE disagg_queue_depth gauge\ndisagg_queue_depth 3\n"
)
HANG_S = 30.0


def address(index: int) -> str:
    """The index-th loopback address, from 127.0.1.0 on (127.0.0.x left alone)."""
    n = index + 256
    return f"127.{(n >> 16) & 255}.{(n >> 8) & 255}.{n & 255}"


class Stubs:
    """The stub endpoints' server, in a thread; `slow`: hosts that hang."""

    def __init__(self, slow: set[str]) -> None:
        self.slow = slow
        self.port = 0
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)

    async def _handle(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        if request.host.split(":")[0] in self.slow:
            await asyncio.sleep(HANG_S)
        return aiohttp.web.Response(text=EXPOSITION)

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        app = aiohttp.web.Application()
        app.router.add_get("/metrics", self._handle)
        runner = aiohttp.web.AppRunner(app, access_log=None, handler_cancellation=True)
        await runner.setup()
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("0.0.0.0", 0))
        sock.listen(4096)
        self.port = sock.getsockname()[1]
        await aiohttp.web.SockSite(runner, sock, backlog=4096).start()
        self._ready.set()
        await self._stop.wait()
        await runner.cleanup()

    def __enter__(self) -> Stubs:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *_: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


async def one_round(
    endpoints: int,
    *,
    slow: int = 0,
    timeout: float = podmetrics.DEFAULT_TIMEOUT,
    concurrency: int = podmetrics.CONCURRENCY,
) -> dict[str, Any]:
    """Scrape `endpoints` stubs once (see the module docstring); the measurements."""
    hosts = [address(i) for i in range(endpoints)]
    with Stubs(set(hosts[:slow])) as stubs:
        urls = [f"http://{host}:{stubs.port}/metrics" for host in hosts]
        scraper = podmetrics.Scraper(timeout, concurrency)
        try:
            cpu, started = time.thread_time(), time.monotonic()
            readings = await scraper.read_all(urls)
            wall, cpu = time.monotonic() - started, time.thread_time() - cpu
        finally:
            await scraper.close()
    got = sum(1 for r in readings.values() if r is not None)
    return {
        "endpoints": endpoints,
        "slow": slow,
        "concurrency": concurrency,
        "timeout_s": timeout,
        "wall_s": wall,
        "scraper_cpu_s": cpu,
        "readings": got,
        "wall_s_per_1000": wall * 1000 / endpoints if endpoints else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m disagg_operator.bench.scrape")
    parser.add_argument("--endpoints", type=int, default=10_000)
    parser.add_argument("--slow", type=int, default=0, help="endpoints that never answer")
    parser.add_argument("--concurrency", type=int, default=podmetrics.CONCURRENCY)
    parser.add_argument("--timeout", type=float, default=podmetrics.DEFAULT_TIMEOUT)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(
        one_round(
            args.endpoints, slow=args.slow, timeout=args.timeout, concurrency=args.concurrency
        )
    )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"{result['endpoints']} endpoints ({result['slow']} hung): one round "
            f"{result['wall_s']:.2f} s wall, {result['scraper_cpu_s']:.2f} s scraper CPU, "
            f"{result['readings']} readings, {result['wall_s_per_1000']:.3f} s per 1,000"
        )


if __name__ == "__main__":
    main()
