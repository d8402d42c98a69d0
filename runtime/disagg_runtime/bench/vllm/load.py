"""The bench's client: streamed /v1/completions at a fixed concurrency, every chunk timed.

Closed loop: `concurrency` workers each send their next request when the last one ended,
so at most `concurrency` are in flight and the engine batches them. Requests go through
one httpx.AsyncClient (no connection limit below the concurrency); each is greedy
(temperature 0, seed 0) with the same max_tokens, and asks for usage in the stream.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

import httpx

from disagg_runtime.bench.vllm.stats import Timing


def body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "seed": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def record_event(timing: Timing, data: str, at: float) -> None:
    """One SSE `data:` into the request's record: a chunk with a choice is a token's
    arrival (its text appended); the usage chunk gives the completion tokens."""
    if data.strip() == "[DONE]":
        return
    obj = json.loads(data)
    if "error" in obj:
        raise RuntimeError(f"stream error: {obj['error']}")
    choices = obj.get("choices") or []
    if choices:
        timing.arrivals.append(at)
        timing.text += choices[0].get("text") or ""
    usage = obj.get("usage")
    if isinstance(usage, dict) and usage.get("completion_tokens"):
        timing.tokens = int(usage["completion_tokens"])


async def one(
    client: httpx.AsyncClient, url: str, model: str, prompts: Sequence[str], i: int, max_tokens: int
) -> Timing:
    timing = Timing(prompt=i, sent=time.perf_counter())
    async with client.stream(
        "POST", url + "/completions", json=body(model, prompts[i], max_tokens)
    ) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data:"):
                record_event(timing, line[5:].strip(), time.perf_counter())
    timing.done = time.perf_counter()
    if not timing.arrivals:
        raise RuntimeError(f"{url}: the request for prompt {i} streamed no token")
    return timing


async def drive(
    url: str,
    model: str,
    prompts: Sequence[str],
    *,
    requests: int,
    concurrency: int,
    max_tokens: int,
    timeout_s: float = 300.0,
) -> tuple[list[Timing], float]:
    """`requests` requests (prompt i % len(prompts)), `concurrency` in flight: their
    records and the wall time from the first send to the last answer."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i % len(prompts))
    out: list[Timing] = []
    limits = httpx.Limits(
        max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8
    )
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10), limits=limits) as c:

        async def worker() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                out.append(await one(c, url, model, prompts, i, max_tokens))

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - started
    return out, wall
