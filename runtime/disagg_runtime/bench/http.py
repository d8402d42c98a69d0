"""`disagg bench pipeline --url URL`: drive a gateway over HTTP, summarize like `disagg up`.

`--requests N` bodies, at most `--concurrency C` in flight (aiohttp client, one keep-alive
connection per slot). The body is `--input FILE.json` (a native or OpenAI body, posted to
URL as given; a URL without a path means /v1/infer) or a 4 KiB float32 tensor. With
`--stream` answers are server-sent events and `ttfc_p50_ms` is the median time to the
first event (an OpenAI body streams only with `"stream": true` in it; `--stream` sets the
native API's `Accept`). The summary has `disagg up --json`'s keys (requests, completed, failed,
p50_ms, p99_ms, throughput_rps, bytes_moved: request plus answer bodies) and ttfc_p50_ms.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from disagg_runtime.gateway.request import target


def default_body() -> bytes:
    data = base64.b64encode(bytes(4096)).decode()
    x = {"dtype": "float32", "shape": [1024], "data": data}
    return json.dumps({"inputs": {"x": x}}).encode()


@dataclass
class Results:
    latencies: list[float] = field(default_factory=list)
    first: list[float] = field(default_factory=list)
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    moved: int = 0


async def _one(
    session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str], out: Results
) -> None:
    started = time.perf_counter()
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            first: float | None = None
            size = 0
            async for chunk in resp.content.iter_any():
                if first is None:
                    first = time.perf_counter() - started
                size += len(chunk)
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}")
    except (aiohttp.ClientError, RuntimeError, TimeoutError) as exc:
        out.failed += 1
        if len(out.errors) < 5:
            out.errors.append(str(exc))
        return
    out.latencies.append(time.perf_counter() - started)
    out.first.append(first if first is not None else out.latencies[-1])
    out.moved += len(body) + size


async def drive(
    url: str, body: bytes, *, requests: int, concurrency: int, stream: bool, token: str | None
) -> tuple[Results, float]:
    headers = {"Content-Type": "application/json"}
    if stream:
        headers["Accept"] = "text/event-stream"
    if token:
        headers["Authorization"] = f"Bearer {token}"
    out = Results()
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    limit = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=limit, timeout=timeout) as session:

        async def worker() -> None:
            while not queue.empty():
                queue.get_nowait()
                await _one(session, url, body, headers, out)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
        elapsed = time.perf_counter() - started
    return out, elapsed


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))] if values else 0.0


def summary(url: str, requests: int, out: Results, elapsed: float) -> dict[str, Any]:
    lat = out.latencies
    return {
        "url": url,
        "requests": requests,
        "completed": len(lat),
        "failed": out.failed,
        "p50_ms": round(1000 * statistics.median(lat), 3) if lat else 0.0,
        "p99_ms": round(1000 * _percentile(lat, 0.99), 3),
        "ttfc_p50_ms": round(1000 * statistics.median(out.first), 3) if out.first else 0.0,
        "throughput_rps": round(len(lat) / elapsed, 3) if elapsed else 0.0,
        "bytes_moved": out.moved,
        "elapsed_s": round(elapsed, 3),
        "errors": out.errors,
    }


def run_cli(args: argparse.Namespace) -> int:
    try:
        url = target(args.url)
        if args.input:
            with open(args.input, "rb") as f:
                body = f.read()
        else:
            body = default_body()
    except (ValueError, OSError) as exc:
        print(f"disagg bench pipeline: {exc}", file=sys.stderr)
        return 2
    out, elapsed = asyncio.run(
        drive(
            url,
            body,
            requests=args.requests,
            concurrency=args.concurrency,
            stream=args.stream,
            token=args.token,
        )
    )
    result = summary(url, args.requests, out, elapsed)
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        print(
            f"{url}: {result['completed']}/{result['requests']} completed, {result['failed']} "
            f"failed in {elapsed:.1f} s ({result['throughput_rps']:.1f} req/s); latency p50 "
            f"{result['p50_ms']:.2f} ms, p99 {result['p99_ms']:.2f} ms, first chunk p50 "
            f"{result['ttfc_p50_ms']:.2f} ms; {result['bytes_moved'] / 2**20:.1f} MiB moved"
        )
        for error in result["errors"]:
            print(f"error: {error}")
    return 0 if result["failed"] == 0 else 1
