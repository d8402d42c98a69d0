"""`disagg bench pipeline --trace`: what tracing costs, in throughput, side by side.

One run, one local pipeline (`pipeline.chain`: three `disagg role` processes, each with
OpenTelemetry's SDK exporting over OTLP/HTTP to an in-process receiver, otlp_sink.py, as
a collector would take them), one client. Each round runs every mode once (`--requests`
requests each), in an order shuffled per round (seeded), and each mode's rate is taken
against the same round's `off`: on a shared machine the rate drifts by tens of percent
within a minute, and a ratio of neighbours cancels the drift that whole-mode medians keep.
Spans leave every 100 ms (OTEL_BSP_SCHEDULE_DELAY; the SDK's default is 5 s) and a traced
mode's round ends when the receiver holds all of its spans, so no round pays for the
export of an earlier one.

- off: requests carry no traceparent. Each role's tracer is configured, so this is the
  cost of an untraced request where tracing is on: one check per message (a role with no
  OTEL_* set has the same check against the no-op tracer).
- unsampled: each request carries a caller's traceparent that says "not sampled": every
  role checks it, passes it on, and records nothing.
- default: each request starts a root span under the default sampler (tracing/config.py:
  parent-based, 1 % of new traces); the sampled ones are recorded by every role.
- all: every root span sampled (OTEL_TRACES_SAMPLER=always_on at the root), so every role
  records its span and its queue, handler and send children for every request.

Reported: requests/s of each (median over rounds), each one's overhead as the median over
rounds of 1 - mode/off, and the spans the receiver took (a check that it really traced).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch

from disagg_runtime.bench.otlp_sink import OtlpSink
from disagg_runtime.bench.pipeline import chain
from disagg_runtime.bench.sizes import format_size
from disagg_runtime.client import Client
from disagg_runtime.local.supervisor import LocalPipeline
from disagg_runtime.tracing import Tracer, TracingUnavailable, open_tracer

ROLES = 3
WARMUP = 20
MODES = ("off", "unsampled", "default", "all")
SPANS_PER_REQUEST = 1 + ROLES * 4  # the root; each role's span, queue, handler, send
DRAIN_S = 30.0
UNSAMPLED = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"  # a caller's "no"


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _round(
    client: Client, payload: Any, requests: int, concurrency: int, mode: Tracer | str | None
) -> float:
    """Requests/s of `requests` requests, `concurrency` in flight; each under a root span
    of the tracer `mode`, or with the traceparent `mode` as it is, or untraced (None)."""
    slots = threading.Semaphore(concurrency)
    failures: list[BaseException] = []
    started = time.perf_counter()
    futures = []
    for i in range(requests):
        slots.acquire()
        span = (
            mode.start("request", kind="client", attrs={"i": i})
            if mode and not isinstance(mode, str)
            else None
        )
        trace = span.traceparent if span else mode if isinstance(mode, str) else ""
        future = client.submit_async(payload, trace=trace)

        def done(f: Any, span: Any = span) -> None:
            if f.exception() is not None:
                failures.append(f.exception())
            if span is not None:
                span.end()
            slots.release()

        future.add_done_callback(done)
        futures.append(future)
    for future in futures:
        with contextlib.suppress(Exception):
            future.result(timeout=60)
    elapsed = time.perf_counter() - started
    if failures:
        raise RuntimeError(f"{len(failures)} requests failed: {failures[0]}")
    return requests / elapsed


def _drained(sink: OtlpSink, spans: int) -> None:
    """Until the receiver holds `spans` spans (at most DRAIN_S: a lost batch does not hang)."""
    deadline = time.monotonic() + DRAIN_S
    while sink.count < spans and time.monotonic() < deadline:
        time.sleep(0.02)


def run(size: int, requests: int, concurrency: int, rounds: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    pool = 8 * (1 << max(20, (size + 4096 - 1).bit_length()))
    payload = {"x": torch.ones(size, dtype=torch.uint8)}
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    with OtlpSink(keep=0) as sink:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": sink.endpoint,
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_BSP_SCHEDULE_DELAY": "100",
        }
        with _environ(env):
            modes: dict[str, Tracer | str | None] = {"off": None, "unsampled": UNSAMPLED}
            modes["default"] = open_tracer("bench-chain/client", strict=True)
            with _environ({"OTEL_TRACES_SAMPLER": "always_on"}):  # the SDK reads it here
                modes["all"] = open_tracer("bench-chain/client", strict=True)
            with LocalPipeline(chain(ROLES, pool)) as local:
                local.wait_ready()
                client = local.client(timeout=60)
                try:
                    _round(client, payload, WARMUP, concurrency, modes["all"])
                    expected = WARMUP * SPANS_PER_REQUEST  # at least (default adds ~1 %)
                    _drained(sink, expected)
                    order = random.Random(0)
                    for _ in range(rounds):
                        for mode in order.sample(MODES, len(MODES)):
                            rate = _round(client, payload, requests, concurrency, modes[mode])
                            rates[mode].append(rate)
                            if mode == "all":  # its spans out before the next round
                                expected += requests * SPANS_PER_REQUEST
                                _drained(sink, expected)
                finally:
                    client.close()
            for tracer in modes.values():
                if tracer is not None and not isinstance(tracer, str):
                    tracer.shutdown()
        spans = sink.count  # the roles flushed theirs as they stopped
    rps = {mode: statistics.median(rates[mode]) for mode in MODES}
    cost = {
        mode: statistics.median(
            1 - on / off for on, off in zip(rates[mode], rates["off"], strict=True)
        )
        for mode in MODES[1:]
    }
    every = (rounds * requests + WARMUP) * SPANS_PER_REQUEST
    return {
        "size_bytes": size,
        "roles": ROLES,
        "requests_per_round": requests,
        "concurrency": concurrency,
        "rounds": rounds,
        **{f"{mode}_rps": round(rps[mode], 1) for mode in MODES},
        **{f"{mode}_overhead_pct": round(100 * cost[mode], 2) for mode in MODES[1:]},
        "rounds_rps": {mode: [round(x, 1) for x in rates[mode]] for mode in MODES},
        "spans_received": spans,  # all mode and warm-up: `every`; default: ~1 % more
        "spans_all_mode": every,
    }


def run_cli(args: argparse.Namespace, size: int) -> int:
    try:
        result = run(size, args.requests, args.concurrency, args.rounds)
    except TracingUnavailable as exc:
        print(f"disagg bench pipeline --trace: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"{format_size(size)} through {ROLES} roles, {args.concurrency} in flight, "
            f"{args.rounds} x {args.requests} requests per mode: untraced "
            f"{result['off_rps']:.1f} req/s; a caller's unsampled traceparent "
            f"{result['unsampled_rps']:.1f} req/s ({result['unsampled_overhead_pct']:+.2f} % "
            f"cost); default sampling {result['default_rps']:.1f} "
            f"req/s ({result['default_overhead_pct']:+.2f} % cost); every request traced "
            f"{result['all_rps']:.1f} req/s ({result['all_overhead_pct']:+.2f} % cost); "
            f"{result['spans_received']} spans exported"
        )
    return 0
