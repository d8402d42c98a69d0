"""Prometheus metrics and health endpoints of one role process (torch-free).

Every role process exports the series below on ``GET /metrics`` of its metrics port
(``health.HealthServer``). This table is part of the operator <-> runtime contract: the operator's
autoscaler scrapes ``disagg_pool_occupancy`` and ``disagg_queue_depth``, the local launcher
reads the request and edge counters for its summary. Rename nothing without changing both.

Every series carries the constant labels ``pipeline``, ``role`` and ``replica`` (the replica
index as a decimal string); the table lists only the labels beyond those.

==================================  =========  =====================  ==========================
name                                type       extra labels           meaning
==================================  =========  =====================  ==========================
``disagg_pool_bytes_used``          gauge      -                      payload bytes in the
                                                                      receive pool
``disagg_pool_bytes_total``         gauge      -                      receive-pool capacity
``disagg_pool_occupancy``           gauge      -                      used / total, 0..1 (0 when
                                                                      total is 0), or the inline
                                                                      budget's, if fuller: the
                                                                      scaling signal
``disagg_pool_fragmentation_bytes`` gauge      -                      block bytes beyond the
                                                                      payloads (the buddy
                                                                      allocator's rounding)
``disagg_pool_free_slots``          gauge      -                      typical requests that still
                                                                      fit the receive pool now
``disagg_inflight_requests``        gauge      -                      requests being handled
``disagg_queue_depth``              gauge      -                      received, waiting for a
                                                                      worker: scaling signal
``disagg_ingress_lanes``            gauge      -                      senders connected through
                                                                      the lane
``disagg_inline_bytes_used``        gauge      -                      inline payload bytes held
                                                                      (received, not released)
``disagg_inline_bytes_budget``      gauge      -                      the most inline bytes held
                                                                      at once (then lanes stall)
``disagg_peer_rejected_total``      counter    -                      connections and messages
                                                                      refused for want of the
                                                                      peer key (relay/auth.py)
``disagg_ingress_overloaded_total`` counter    -                      payloads and reservations
                                                                      answered `overloaded` (no
                                                                      room to queue them now)
``disagg_requests_total``           counter    ``outcome``            finished requests;
                                                                      outcome is done|failed
``disagg_request_failures_total``   counter    ``reason``             failed requests by reason:
                                                                      handler|timeout|aborted|
                                                                      transport|overloaded|other
``disagg_requests_handed_on_total`` counter    ``reason``             requests given back to their
                                                                      first sender, to be moved to
                                                                      a live replica: handed_back
                                                                      (this role drained) | lost
                                                                      (a replica it sent them to
                                                                      died, maybe holding them)
``disagg_request_seconds``          histogram  -                      receive-to-done latency of
                                                                      requests that completed
``disagg_handler_seconds``          histogram  -                      time inside the user handler
``disagg_queue_wait_seconds``       histogram  -                      received -> taken by a
                                                                      worker, per message
``disagg_handler_calls_total``      counter    -                      calls into the handler (one
                                                                      per batch when batching)
``disagg_handler_batch_size``       histogram  -                      requests per handler call
``disagg_role_setup_seconds``       gauge      -                      how long the handler's
                                                                      setup took (model loading)
``disagg_edge_bytes_total``         counter    ``edge``,              payload bytes per edge;
                                               ``direction``          direction is in|out
``disagg_edge_messages_total``      counter    ``edge``, ``relay``    messages sent per edge and
                                                                      the relay (shm|tcp|cuda-ipc)
                                                                      that carried them
``disagg_edge_seconds``             histogram  ``edge``               send time per edge
                                                                      (buckets 100 us .. 10 s)
==================================  =========  =====================  ==========================

Histograms expose ``_bucket{le=...}``, ``_sum`` and ``_count`` as usual. The client
library's ``*_created`` timestamp series are not exported (they would reach Prometheus as
extra gauges). ``disagg_requests_total`` has both outcomes and
``disagg_request_failures_total`` every reason from the start (value 0), so rates exist
before the first request. ``edge`` is the edge name from the spec (bounded by the spec,
so the label's cardinality is too).

The gauges are not stored: a custom collector calls the role's ``sample()`` at scrape time,
so a scrape never sees a stale value. If ``sample()`` raises, the scrape still succeeds without
those gauges (the error is logged once per run of failures).

Each :class:`RoleMetrics` has its own ``CollectorRegistry`` (never the global one), so several
roles can live in one process (tests, the local launcher).

The HTTP side (``/metrics``, ``/healthz``, ``/readyz``; ``scrape`` and ``fetch``): health.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Final, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest

from disagg_core.autoscale import OCCUPANCY_METRIC, QUEUE_DEPTH_METRIC
from disagg_runtime.routing.migration import MIGRATE_REASONS

logger = logging.getLogger(__name__)

CONST_LABELS: Final = ("pipeline", "role", "replica")
OUTCOMES: Final = ("done", "failed")
FAILURE_REASONS: Final = ("handler", "timeout", "aborted", "transport", "overloaded", "other")
HANDED_ON_REASONS: Final = MIGRATE_REASONS  # the error reasons a client moves a request on

# 100 us .. 10 s, roughly 1-2.5-5 per decade: a 64 MiB hop over shm is a few ms, over tcp tens.
EDGE_BUCKETS: Final = (
    0.0001, 0.00025, 0.0005,
    0.001, 0.0025, 0.005,
    0.01, 0.025, 0.05,
    0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
MAX_CACHED_SERIES: Final = 256  # per labelled metric (see `_Children`)
BATCH_BUCKETS: Final = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Requests and handlers: 1 ms .. 2 min (a video denoise step may take tens of seconds).
LATENCY_BUCKETS: Final = (
    0.001, 0.0025, 0.005,
    0.01, 0.025, 0.05,
    0.1, 0.25, 0.5,
    1.0, 2.5, 5.0,
    10.0, 30.0, 60.0, 120.0,
)  # fmt: skip


@dataclass(frozen=True)
class RoleSample:
    """The live state of a role, read at scrape time."""

    pool_used_bytes: int
    pool_total_bytes: int
    pool_free_slots: int  # how many more typical requests fit the receive pool now
    inflight: int  # requests being handled
    queue_depth: int  # received, waiting for a worker
    lanes: int = 0  # senders connected through the ingress's lane (the rest use ZMQ only)
    pool_fragmentation_bytes: int = 0  # block bytes beyond the payloads (allocator rounding)
    inline_used_bytes: int = 0  # inline payloads held: they count against their own budget
    inline_budget_bytes: int = 0
    peer_rejected: int = 0  # refused for want of the peer key, since start (a counter)
    overloaded: int = 0  # answered `overloaded` by the ingress, since start (a counter)


def occupancy(used: int, total: int) -> float:
    """``used / total`` clamped to 0..1; 0 for an empty (or absent) pool."""
    if total <= 0:
        return 0.0
    return min(1.0, max(0.0, used / total))


class _SampleCollector:
    """Yields the role's gauges from one call of ``sample()`` per scrape."""

    _GAUGES: Final = (
        ("disagg_pool_bytes_used", "Receive-pool bytes in use."),
        ("disagg_pool_bytes_total", "Receive-pool capacity in bytes."),
        (OCCUPANCY_METRIC, "Receive-pool occupancy, used/total, 0..1."),
        ("disagg_pool_free_slots", "Typical requests that still fit the receive pool."),
        ("disagg_inflight_requests", "Requests being handled."),
        (QUEUE_DEPTH_METRIC, "Requests received and waiting for a worker."),
        ("disagg_ingress_lanes", "Senders connected through the lane; others use ZMQ only."),
        (
            "disagg_pool_fragmentation_bytes",
            "Receive-pool bytes held beyond the payloads by the allocator's rounding.",
        ),
        ("disagg_inline_bytes_used", "Inline payload bytes held (received, not released)."),
        ("disagg_inline_bytes_budget", "The most inline payload bytes held at once."),
    )
    _COUNTERS: Final = (
        (
            "disagg_peer_rejected",
            "Connections and messages refused for want of the pipeline's peer key.",
        ),
        (
            "disagg_ingress_overloaded",
            "Payloads and reservations the ingress answered overloaded (no room to queue).",
        ),
    )

    def __init__(self, label_values: list[str], sample: Callable[[], RoleSample]) -> None:
        self._label_values = label_values
        self._sample = sample
        self._failing = False

    def describe(self) -> Iterable[Metric]:
        # Declares the names (duplicate checks) without calling sample() at registration.
        gauges = [GaugeMetricFamily(name, doc, labels=CONST_LABELS) for name, doc in self._GAUGES]
        counters = [CounterMetricFamily(n, "", labels=CONST_LABELS) for n, _ in self._COUNTERS]
        return [*gauges, *counters]

    def collect(self) -> Iterator[Metric]:
        try:
            s = self._sample()
            values = (
                float(s.pool_used_bytes),
                float(s.pool_total_bytes),
                max(
                    occupancy(s.pool_used_bytes, s.pool_total_bytes),
                    occupancy(s.inline_used_bytes, s.inline_budget_bytes),
                ),
                float(s.pool_free_slots),
                float(s.inflight),
                float(s.queue_depth),
                float(s.lanes),
                float(s.pool_fragmentation_bytes),
                float(s.inline_used_bytes),
                float(s.inline_budget_bytes),
            )
        except Exception:
            if not self._failing:
                self._failing = True
                logger.exception("metrics sample() failed; scraping without the role gauges")
            return
        if self._failing:
            self._failing = False
            logger.info("metrics sample() recovered")
        for (name, doc), value in zip(self._GAUGES, values, strict=True):
            family = GaugeMetricFamily(name, doc, labels=CONST_LABELS)
            family.add_metric(self._label_values, value)
            yield family
        counts = (float(s.peer_rejected), float(s.overloaded))
        for (name, doc), count in zip(self._COUNTERS, counts, strict=True):
            counter = CounterMetricFamily(name, doc, labels=CONST_LABELS)
            counter.add_metric(self._label_values, count)
            yield counter


M = TypeVar("M", Counter, Histogram)


class _Children(Generic[M]):
    """A labelled metric's series by their labels beyond the constant ones, resolved once:
    `labels()` costs a role ~4 us per call (checks, string conversion, a lock; three times
    that on a cold cache), several times per message. Holds at most `limit` series (edge
    names come from the spec, the sender's part of a received edge from the network);
    beyond that, series are looked up on every call, as before."""

    def __init__(self, const: list[str], metric: M, limit: int = MAX_CACHED_SERIES) -> None:
        self.metric: M = metric
        self._const = const
        self._limit = limit
        self._series: dict[tuple[str, ...], M] = {}

    def get(self, *extra: str) -> M:
        series = self._series.get(extra)
        if series is None:
            series = self.metric.labels(*self._const, *extra)
            if len(self._series) < self._limit:
                self._series[extra] = series
        return series


class RoleMetrics:
    """Counters and histograms of one role, plus gauges read from ``sample()`` at scrape.

    All methods are thread-safe (``prometheus_client`` metrics lock internally).
    """

    def __init__(
        self, *, pipeline: str, role: str, replica: int, sample: Callable[[], RoleSample]
    ) -> None:
        self.registry = CollectorRegistry()
        self._const = [pipeline, role, str(replica)]
        self.registry.register(_SampleCollector(self._const, sample))
        reg = self.registry
        self._requests = Counter(
            "disagg_requests",
            "Finished requests by outcome.",
            [*CONST_LABELS, "outcome"],
            registry=reg,
        )
        self._failures = Counter(
            "disagg_request_failures",
            "Failed requests by reason.",
            [*CONST_LABELS, "reason"],
            registry=reg,
        )
        self._handed_on = Counter(
            "disagg_requests_handed_on",
            "Requests given back to their first sender, to be moved to a live replica.",
            [*CONST_LABELS, "reason"],
            registry=reg,
        )
        self._request_seconds = Histogram(
            "disagg_request_seconds",
            "Latency of completed requests in this role, seconds.",
            CONST_LABELS,
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self._handler_seconds = Histogram(
            "disagg_handler_seconds",
            "Time inside the user handler, seconds.",
            CONST_LABELS,
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self._queue_wait = Histogram(
            "disagg_queue_wait_seconds",
            "Seconds a received message waited for a worker.",
            CONST_LABELS,
            buckets=EDGE_BUCKETS,
            registry=reg,
        )
        self._handler_calls = Counter(
            "disagg_handler_calls", "Calls into the handler.", CONST_LABELS, registry=reg
        )
        self._batch_size = Histogram(
            "disagg_handler_batch_size",
            "Requests per handler call.",
            CONST_LABELS,
            buckets=BATCH_BUCKETS,
            registry=reg,
        )
        self._setup_seconds = Gauge(
            "disagg_role_setup_seconds",
            "Seconds the handler's setup took (model loading).",
            CONST_LABELS,
            registry=reg,
        )
        self._edge_bytes = _Children(
            self._const,
            Counter(
                "disagg_edge_bytes",
                "Payload bytes per edge and direction.",
                [*CONST_LABELS, "edge", "direction"],
                registry=reg,
            ),
        )
        self._edge_messages = _Children(
            self._const,
            Counter(
                "disagg_edge_messages",
                "Messages sent per edge and the relay that carried them.",
                [*CONST_LABELS, "edge", "relay"],
                registry=reg,
            ),
        )
        self._edge_seconds = _Children(
            self._const,
            Histogram(
                "disagg_edge_seconds",
                "Send time per edge, seconds.",
                [*CONST_LABELS, "edge"],
                buckets=EDGE_BUCKETS,
                registry=reg,
            ),
        )
        for outcome in OUTCOMES:  # present from the first scrape, so rate() works at once
            self._requests.labels(*self._const, outcome)
        for reason in FAILURE_REASONS:
            self._failures.labels(*self._const, reason)
        for reason in HANDED_ON_REASONS:
            self._handed_on.labels(*self._const, reason)
        self._setup_seconds.labels(*self._const)
        # the series every request touches, resolved once (see `_Children`)
        self._done = self._requests.labels(*self._const, "done")
        self._done_seconds = self._request_seconds.labels(*self._const)
        self._handler = self._handler_seconds.labels(*self._const)
        self._waited = self._queue_wait.labels(*self._const)
        self._calls = self._handler_calls.labels(*self._const)
        self._batch = self._batch_size.labels(*self._const)

    def request_done(self, seconds: float) -> None:
        self._done.inc()
        self._done_seconds.observe(seconds)

    def request_failed(self, reason: str) -> None:
        """Count a failed request; a reason outside :data:`FAILURE_REASONS` counts as other."""
        self._requests.labels(*self._const, "failed").inc()
        label = reason if reason in FAILURE_REASONS else "other"
        self._failures.labels(*self._const, label).inc()

    def handed_on(self, reason: str) -> None:
        """Count a request given back to its first sender (one of HANDED_ON_REASONS)."""
        self._handed_on.labels(*self._const, reason).inc()

    def edge_sent(self, edge: str, relay: str, nbytes: int, seconds: float) -> None:
        """Count one message of ``nbytes`` sent on ``edge`` by ``relay``; negative sizes raise
        ``ValueError`` (a bug)."""
        self._edge_bytes.get(edge, "out").inc(nbytes)
        self._edge_messages.get(edge, relay).inc()
        self._edge_seconds.get(edge).observe(seconds)

    def edge_received(self, edge: str, nbytes: int) -> None:
        self._edge_bytes.get(edge, "in").inc(nbytes)

    def handler_seconds(self, seconds: float) -> None:
        self._handler.observe(seconds)

    def queue_wait(self, seconds: float) -> None:
        self._waited.observe(max(0.0, seconds))

    def handler_call(self, requests: int) -> None:
        """One call into the handler carrying `requests` requests (a batch, or 1)."""
        self._calls.inc()
        self._batch.observe(requests)

    def setup_seconds(self, seconds: float) -> None:
        self._setup_seconds.labels(*self._const).set(seconds)

    def render(self) -> bytes:
        """The registry in the Prometheus text exposition format, without ``*_created``."""
        data: bytes = generate_latest(_WithoutCreated(self.registry))
        return data


class _WithoutCreated:
    """A view of a registry that drops the ``*_created`` samples (per-registry, unlike
    ``prometheus_client.disable_created_metrics()``, which is process-wide)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self._registry.collect():  # fresh Metric objects on every collect
            created = metric.name + "_created"
            metric.samples = [s for s in metric.samples if s.name != created]
            yield metric
