"""Role metrics and health endpoints: a real HealthServer on loopback, scraped over HTTP."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from disagg_runtime.role.health import HealthServer, fetch, scrape
from disagg_runtime.role.metrics import (
    EDGE_BUCKETS,
    FAILURE_REASONS,
    RoleMetrics,
    RoleSample,
    occupancy,
)

GAUGES = (
    "disagg_pool_bytes_used",
    "disagg_pool_bytes_total",
    "disagg_pool_occupancy",
    "disagg_pool_free_slots",
    "disagg_inflight_requests",
    "disagg_queue_depth",
    "disagg_ingress_lanes",
    "disagg_pool_fragmentation_bytes",
)
COUNTERS_AND_HISTOGRAMS = (
    "disagg_requests_total",
    "disagg_request_failures_total",
    "disagg_request_seconds_bucket",
    "disagg_request_seconds_sum",
    "disagg_request_seconds_count",
    "disagg_handler_seconds_count",
    "disagg_edge_bytes_total",
    "disagg_edge_messages_total",
    "disagg_edge_seconds_bucket",
    "disagg_edge_seconds_count",
    "disagg_peer_rejected_total",
    "disagg_ingress_overloaded_total",
)
CONST = ('pipeline="t2v"', 'replica="3"', 'role="denoiser"')


@dataclass
class FakeRole:
    """A role whose live state the test changes between scrapes."""

    sample: RoleSample = field(default_factory=lambda: RoleSample(0, 0, 0, 0, 0))
    live: bool = True
    ready: bool = False
    fail: bool = False

    def read(self) -> RoleSample:
        if self.fail:
            raise RuntimeError("pool gone")
        return self.sample


@pytest.fixture
def role() -> FakeRole:
    return FakeRole()


@pytest.fixture
def metrics(role: FakeRole) -> RoleMetrics:
    return RoleMetrics(pipeline="t2v", role="denoiser", replica=3, sample=role.read)


@pytest.fixture
def server(metrics: RoleMetrics, role: FakeRole) -> Iterator[HealthServer]:
    srv = HealthServer(
        metrics, host="127.0.0.1", port=0, live=lambda: role.live, ready=lambda: role.ready
    )
    srv.start()
    yield srv
    srv.close()


def url(server: HealthServer, path: str) -> str:
    return f"http://127.0.0.1:{server.port}{path}"


def get_metrics(server: HealthServer) -> dict[str, float]:
    status, body = fetch(url(server, "/metrics"))
    assert status == 200
    return scrape(body)


# -- exposition ------------------------------------------------------------------------------


def test_metrics_endpoint_has_every_name_with_const_labels(server, metrics, role):
    role.sample = RoleSample(1, 2, 3, 4, 5, 6)
    metrics.edge_sent("encoder->denoiser", "shm", 10, 0.001)
    status, body = fetch(url(server, "/metrics"))
    assert status == 200
    for name in GAUGES + COUNTERS_AND_HISTOGRAMS:
        lines = [ln for ln in body.splitlines() if ln.startswith(name + "{")]
        assert lines, name
        for label in CONST:
            assert all(label in ln for ln in lines), (label, lines)


def test_no_created_series(metrics):
    assert "_created" not in metrics.render().decode()


def test_gauges_follow_the_sample_function(server, role):
    role.sample = RoleSample(
        pool_used_bytes=256, pool_total_bytes=1024, pool_free_slots=7, inflight=2, queue_depth=9
    )
    first = get_metrics(server)
    assert first["disagg_pool_bytes_used"] == 256
    assert first["disagg_pool_bytes_total"] == 1024
    assert first["disagg_pool_occupancy"] == 0.25
    assert first["disagg_pool_free_slots"] == 7
    assert first["disagg_inflight_requests"] == 2
    assert first["disagg_queue_depth"] == 9

    role.sample = RoleSample(768, 1024, 1, 4, 0)
    second = get_metrics(server)
    assert second["disagg_pool_bytes_used"] == 768
    assert second["disagg_pool_occupancy"] == 0.75
    assert second["disagg_pool_free_slots"] == 1
    assert second["disagg_inflight_requests"] == 4
    assert second["disagg_queue_depth"] == 0


def test_the_ingress_counters_follow_the_sample_function(server, role):
    role.sample = RoleSample(0, 1, 0, 0, 0, peer_rejected=3, overloaded=5)
    got = get_metrics(server)
    assert got["disagg_peer_rejected_total"] == 3
    assert got["disagg_ingress_overloaded_total"] == 5


@pytest.mark.parametrize(
    ("used", "total", "expected"),
    [(0, 0, 0.0), (5, 0, 0.0), (0, 10, 0.0), (5, 10, 0.5), (10, 10, 1.0), (11, 10, 1.0)],
)
def test_occupancy(used, total, expected, metrics, role):
    assert occupancy(used, total) == expected
    role.sample = RoleSample(used, total, 0, 0, 0)
    assert scrape(metrics.render().decode())["disagg_pool_occupancy"] == expected


def test_sample_is_called_once_per_scrape_and_not_at_registration():
    calls = []

    def sample() -> RoleSample:
        calls.append(1)
        return RoleSample(1, 2, 0, 0, 0)

    m = RoleMetrics(pipeline="p", role="r", replica=0, sample=sample)
    assert calls == []
    m.render()
    assert len(calls) == 1


# -- counters and histograms -----------------------------------------------------------------


def test_requests_start_at_zero(metrics):
    values = scrape(metrics.render().decode())
    assert values['disagg_requests_total{outcome="done"}'] == 0
    assert values['disagg_requests_total{outcome="failed"}'] == 0
    for reason in FAILURE_REASONS:
        assert values[f'disagg_request_failures_total{{reason="{reason}"}}'] == 0
    assert values["disagg_request_seconds_count"] == 0


def test_request_counters_and_latency(server, metrics):
    metrics.request_done(0.02)
    metrics.request_done(3.0)
    metrics.request_failed("timeout")
    metrics.request_failed("handler")
    metrics.request_failed("handler")
    metrics.request_failed("cosmic rays")  # unknown reasons collapse into "other"
    values = get_metrics(server)
    assert values['disagg_requests_total{outcome="done"}'] == 2
    assert values['disagg_requests_total{outcome="failed"}'] == 4
    assert values['disagg_request_failures_total{reason="timeout"}'] == 1
    assert values['disagg_request_failures_total{reason="handler"}'] == 2
    assert values['disagg_request_failures_total{reason="other"}'] == 1
    assert values['disagg_request_failures_total{reason="aborted"}'] == 0
    assert not any("cosmic" in key for key in values)
    assert values["disagg_request_seconds_count"] == 2
    assert values["disagg_request_seconds_sum"] == pytest.approx(3.02)
    assert values['disagg_request_seconds_bucket{le="0.025"}'] == 1
    assert values['disagg_request_seconds_bucket{le="+Inf"}'] == 2


def test_handler_seconds(metrics):
    metrics.handler_seconds(0.5)
    metrics.handler_seconds(0.25)
    values = scrape(metrics.render().decode())
    assert values["disagg_handler_seconds_count"] == 2
    assert values["disagg_handler_seconds_sum"] == 0.75


def test_edge_bytes_and_seconds(server, metrics):
    metrics.edge_sent("denoiser->decoder", "tcp", 64 << 20, 0.006)
    metrics.edge_sent("denoiser->decoder", "tcp", 1 << 20, 0.00005)
    metrics.edge_received("encoder->denoiser", 1000)
    metrics.edge_received("encoder->denoiser", 24)
    values = get_metrics(server)
    out = 'disagg_edge_bytes_total{direction="out",edge="denoiser->decoder"}'
    inn = 'disagg_edge_bytes_total{direction="in",edge="encoder->denoiser"}'
    assert values[out] == (64 << 20) + (1 << 20)
    assert values[inn] == 1024
    hist = 'disagg_edge_seconds_{}{{edge="denoiser->decoder"{}}}'
    assert values[hist.format("count", "")] == 2
    assert values[hist.format("bucket", ',le="0.0001"')] == 1
    assert values[hist.format("bucket", ',le="0.01"')] == 2
    assert values[hist.format("bucket", ',le="10.0"')] == 2
    assert 'disagg_edge_seconds_count{edge="encoder->denoiser"}' not in values  # only sends timed


def test_edge_series_past_the_cache_limit_are_still_counted(metrics, monkeypatch):
    monkeypatch.setattr(metrics._edge_bytes, "_limit", 2)  # the first two edges are kept
    for i in range(5):
        for _ in range(3):
            metrics.edge_received(f"s{i}->denoiser", 10)
    values = scrape(metrics.render().decode())
    for i in range(5):
        assert values[f'disagg_edge_bytes_total{{direction="in",edge="s{i}->denoiser"}}'] == 30
    assert len(metrics._edge_bytes._series) == 2


def test_edge_buckets_span_100us_to_10s():
    assert EDGE_BUCKETS[0] == 0.0001
    assert EDGE_BUCKETS[-1] == 10.0
    assert list(EDGE_BUCKETS) == sorted(EDGE_BUCKETS)


def test_negative_bytes_are_a_bug(metrics):
    with pytest.raises(ValueError):
        metrics.edge_received("a->b", -1)


def test_concurrent_updates_are_all_counted(metrics):
    def work() -> None:
        for _ in range(500):
            metrics.request_done(0.001)
            metrics.edge_received("a->b", 2)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    values = scrape(metrics.render().decode())
    assert values['disagg_requests_total{outcome="done"}'] == 2000
    assert values['disagg_edge_bytes_total{direction="in",edge="a->b"}'] == 4000


# -- health ----------------------------------------------------------------------------------


def test_healthz_and_readyz_follow_the_callables(server, role):
    role.live, role.ready = True, False
    assert fetch(url(server, "/healthz"))[0] == 200
    assert fetch(url(server, "/readyz"))[0] == 503
    role.ready = True
    assert fetch(url(server, "/readyz")) == (200, "ready\n")
    role.live = False
    assert fetch(url(server, "/healthz"))[0] == 503
    role.live = True
    assert fetch(url(server, "/healthz?verbose=1"))[0] == 200


def test_probe_that_raises_is_503(metrics):
    def broken() -> bool:
        raise RuntimeError("wedged")

    srv = HealthServer(metrics, host="127.0.0.1", live=broken, ready=broken)
    with srv:
        status, body = fetch(url(srv, "/healthz"))
        assert status == 503
        assert "wedged" in body
        assert fetch(url(srv, "/readyz"))[0] == 503


def test_unknown_path_is_404(server):
    assert fetch(url(server, "/"))[0] == 404
    assert fetch(url(server, "/metricsx"))[0] == 404


def test_metrics_content_type(server):
    import urllib.request

    with urllib.request.urlopen(url(server, "/metrics"), timeout=2) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain; version=")


def test_failing_sample_still_serves_metrics(server, metrics, role, caplog):
    metrics.request_done(0.1)
    role.fail = True
    with caplog.at_level(logging.WARNING, logger="disagg_runtime.role.metrics"):
        for _ in range(3):
            values = get_metrics(server)
            assert values['disagg_requests_total{outcome="done"}'] == 1
            assert not any(name in values for name in GAUGES)
    assert sum("sample() failed" in r.getMessage() for r in caplog.records) == 1  # logged once
    role.fail = False
    role.sample = RoleSample(1, 4, 0, 0, 0)
    assert get_metrics(server)["disagg_pool_occupancy"] == 0.25


# -- isolation and lifecycle -----------------------------------------------------------------


def test_two_roles_in_one_process_do_not_clash():
    a = RoleMetrics(pipeline="p", role="enc", replica=0, sample=lambda: RoleSample(1, 10, 0, 0, 0))
    b = RoleMetrics(pipeline="p", role="dec", replica=1, sample=lambda: RoleSample(9, 10, 0, 0, 0))
    a.request_done(0.1)
    ta, tb = a.render().decode(), b.render().decode()
    assert 'role="enc"' in ta and 'role="dec"' not in ta
    assert 'role="dec"' in tb and 'role="enc"' not in tb
    assert scrape(ta)['disagg_requests_total{outcome="done"}'] == 1
    assert scrape(tb)['disagg_requests_total{outcome="done"}'] == 0
    assert scrape(ta)["disagg_pool_occupancy"] == 0.1
    assert scrape(tb)["disagg_pool_occupancy"] == 0.9


def test_nothing_lands_in_the_global_registry(metrics):
    from prometheus_client import REGISTRY

    metrics.request_done(0.1)
    assert not any(m.name.startswith("disagg_") for m in REGISTRY.collect())


def test_close_is_idempotent_and_frees_the_port(metrics, role):
    srv = HealthServer(metrics, host="127.0.0.1", live=lambda: True, ready=lambda: True)
    srv.close()  # before start: a no-op
    srv2 = HealthServer(metrics, host="127.0.0.1", live=lambda: True, ready=lambda: True)
    srv2.start()
    port = srv2.port
    assert port != 0
    assert fetch(url(srv2, "/healthz"))[0] == 200
    srv2.close()
    srv2.close()
    with pytest.raises(OSError):
        fetch(f"http://127.0.0.1:{port}/healthz", timeout=1.0)
    # the port is free again: a new server binds it
    srv3 = HealthServer(metrics, host="127.0.0.1", port=port, live=lambda: True, ready=lambda: True)
    srv3.start()
    try:
        assert srv3.port == port
        assert fetch(url(srv3, "/healthz"))[0] == 200
    finally:
        srv3.close()
    with pytest.raises(RuntimeError):
        srv3.start()


def test_fetch_raises_oserror_without_a_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connection refused
        with pytest.raises(OSError):
            fetch(f"http://127.0.0.1:{port}/metrics", timeout=1.0)


# -- scrape ----------------------------------------------------------------------------------


def test_scrape_parses_render_output(metrics, role):
    role.sample = RoleSample(3, 12, 2, 1, 4)
    metrics.request_done(0.01)
    metrics.edge_sent("a->b", "shm", 5, 0.001)
    values = scrape(metrics.render().decode())
    assert values["disagg_pool_occupancy"] == 0.25
    assert values["disagg_queue_depth"] == 4
    assert values['disagg_edge_bytes_total{direction="out",edge="a->b"}'] == 5
    assert all(isinstance(v, float) for v in values.values())
    assert not any(label in key for key in values for label in ("pipeline=", "role=", "replica="))


def test_scrape_keeps_extra_labels_sorted_and_escaped():
    text = (
        "# TYPE x counter\n"
        'x_total{role="r",zeta="1",alpha="q\\"uote",pipeline="p",replica="0"} 2\n'
        "# TYPE y gauge\n"
        "y 1.5\n"
    )
    assert scrape(text) == {'x_total{alpha="q\\"uote",zeta="1"}': 2.0, "y": 1.5}


def test_scrape_rejects_garbage():
    with pytest.raises(ValueError):
        scrape("this is { not prometheus\n")


def test_the_docstring_table_names_every_registered_family_and_its_type(
    metrics: RoleMetrics,
) -> None:
    """The module docstring's table is the operator <-> runtime contract: it lists exactly
    the families a role registers, each with its type."""
    import re

    from disagg_runtime.role import metrics as module

    doc = module.__doc__ or ""
    table = dict(re.findall(r"^``(disagg_[a-z_]+)``\s+(gauge|counter|histogram)\b", doc, re.M))
    registered = {
        family.name + ("_total" if family.type == "counter" else ""): family.type
        for family in metrics.registry.collect()
    }
    assert table == registered
