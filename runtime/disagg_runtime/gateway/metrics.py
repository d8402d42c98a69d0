"""Prometheus series of the gateway (`GET /metrics`), every one labelled `pipeline`:

==========================================  =========  ===============  ========================
name                                        type       extra labels     meaning
==========================================  =========  ===============  ========================
``disagg_gateway_requests_total``           counter    route, code      answered HTTP requests
``disagg_gateway_request_seconds``          histogram  route            time to the last byte
``disagg_gateway_first_chunk_seconds``      histogram  route            time to the first chunk
                                                                        of a streamed answer
``disagg_gateway_inflight_requests``        gauge      -                requests being served
``disagg_gateway_bytes_total``              counter    direction        body bytes, in|out
==========================================  =========  ===============  ========================

`route` is the route's pattern (`/v1/infer`), never the raw path, so its cardinality is
bounded; unknown paths count as `other`.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest

from disagg_runtime.role.metrics import LATENCY_BUCKETS

# a gateway hop is sub-millisecond: start lower than the roles' buckets
GATEWAY_BUCKETS: Final = (0.0002, 0.0005, *LATENCY_BUCKETS)


class GatewayMetrics:
    def __init__(self, pipeline: str) -> None:
        self.registry = CollectorRegistry()
        reg, p = self.registry, pipeline
        self._requests = Counter(
            "disagg_gateway_requests",
            "HTTP requests answered.",
            ["pipeline", "route", "code"],
            registry=reg,
        )
        self._seconds = Histogram(
            "disagg_gateway_request_seconds",
            "Request time to the last byte, seconds.",
            ["pipeline", "route"],
            buckets=GATEWAY_BUCKETS,
            registry=reg,
        )
        self._first = Histogram(
            "disagg_gateway_first_chunk_seconds",
            "Time to the first chunk of a stream, seconds.",
            ["pipeline", "route"],
            buckets=GATEWAY_BUCKETS,
            registry=reg,
        )
        self._inflight = Gauge(
            "disagg_gateway_inflight_requests",
            "Requests being served.",
            ["pipeline"],
            registry=reg,
        )
        self._bytes = Counter(
            "disagg_gateway_bytes",
            "Body bytes by direction.",
            ["pipeline", "direction"],
            registry=reg,
        )
        self._pipeline = p
        self.inflight = self._inflight.labels(p)
        self.bytes_in = self._bytes.labels(p, "in")
        self.bytes_out = self._bytes.labels(p, "out")

    def answered(self, route: str, code: int, seconds: float) -> None:
        self._requests.labels(self._pipeline, route, str(code)).inc()
        self._seconds.labels(self._pipeline, route).observe(seconds)

    def first_chunk(self, route: str, seconds: float) -> None:
        self._first.labels(self._pipeline, route).observe(seconds)

    def render(self) -> bytes:
        data: bytes = generate_latest(self.registry)
        return data
