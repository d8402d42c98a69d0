"""The metric catalog, the dashboard and rules builders (pure), and the report's numbers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from disagg_runtime.observe import catalog, dashboard, generate, panels, report, rules
from disagg_runtime.role import metrics as role_metrics

REPO = Path(__file__).resolve().parents[3]
SERIES = re.compile(r"\b(disagg_[a-z_]+?)(?:_bucket|_sum|_count)?\b(?=[{\[)])")


@pytest.fixture(scope="module")
def cat() -> catalog.Catalog:
    return catalog.catalog()


def test_the_tables_agree_with_the_registered_families(cat: catalog.Catalog) -> None:
    documented = catalog.table(role_metrics.__doc__ or "")
    assert documented["disagg_requests_total"] == "counter"
    assert documented["disagg_edge_seconds"] == "histogram"
    assert cat.types["disagg_gateway_first_chunk_seconds"] == "histogram"
    assert cat.types["disagg_operator_pipelines_managed"] == "gauge"


def test_a_renamed_metric_is_a_problem_not_a_dead_panel(cat: catalog.Catalog) -> None:
    code = dict(cat.types)
    code["disagg_queue_depth_renamed"] = code.pop("disagg_queue_depth")
    problems = catalog.check({"disagg_queue_depth": "gauge"}, code)
    assert "disagg_queue_depth: documented as gauge, registered as None" in problems
    assert "disagg_queue_depth_renamed: registered but not documented" in problems
    with pytest.raises(KeyError, match="disagg_queue_depth"):
        catalog.Catalog(code).gauge("disagg_queue_depth")
    with pytest.raises(KeyError, match="counter"):
        cat.counter("disagg_queue_depth")  # the right name with the wrong type


def test_every_panel_names_only_exported_series(cat: catalog.Catalog) -> None:
    queries = dashboard.queries(dashboard.dashboard(cat))
    assert len(queries) >= 30
    for title, expr in queries:
        names = set(SERIES.findall(expr))
        assert names, (title, expr)
        for name in names:
            assert name in cat.types, (title, name)


def test_the_dashboard_covers_the_issue_s_list(cat: catalog.Catalog) -> None:
    titles = [p.title for _, row in panels.rows(cat) for p in row]
    for words in (
        "Requests/s",
        "Request latency",
        "first chunk",
        "reason",
        "Queue depth",
        "Queue wait",
        "Pool occupancy",
        "Inline budget",
        "Edge bytes/s",
        "by relay",
        "Replicas",
        "Peer refusals",
        "Reconcile",
        "Rollout progress",
    ):
        assert any(words in t for t in titles), words
    model = dashboard.dashboard(cat)
    ids = [p["id"] for p in model["panels"]]
    assert len(ids) == len(set(ids))
    assert [v["name"] for v in model["templating"]["list"]] == [
        "datasource",
        "namespace",
        "pipeline",
        "role",
    ]


def test_instantiate_sets_every_variable_to_all() -> None:
    expr = 'rate(x{namespace=~"$namespace",pipeline=~"$pipeline",role=~"$role"}[$__rate_interval])'
    assert dashboard.instantiate(expr, "9s") == (
        'rate(x{namespace=~".*",pipeline=~".*",role=~".*"}[9s])'
    )


def test_rules_are_recording_then_alerting_and_parameterised(cat: catalog.Catalog) -> None:
    group = rules.rules(cat, pending="0s", window="15s", pool_full=0.5)["groups"][0]
    alerts = {r["alert"]: r for r in group["rules"] if "alert" in r}
    assert set(alerts) == {
        "DisaggPoolFull",
        "DisaggNoReadyReplica",
        "DisaggPeerRefusalsRising",
        "DisaggGateway5xx",
        "DisaggRolloutStalled",
    }
    assert all(a["for"] == "0s" for a in alerts.values())
    assert alerts["DisaggPoolFull"]["expr"] == "disagg:pool_occupancy:max >= 0.5"
    assert 'up{disagg_component="role"}' in alerts["DisaggNoReadyReplica"]["expr"]
    records = [r["record"] for r in group["rules"] if "record" in r]
    assert "disagg:peer_rejected:rate15s" in records
    first_alert = next(i for i, r in enumerate(group["rules"]) if "alert" in r)
    assert all("record" in r for r in group["rules"][:first_alert])


def test_the_checked_in_files_are_what_generate_makes() -> None:
    assert generate.stale(REPO) == {}
    model = json.loads((REPO / generate.DASHBOARD).read_text())
    assert model["uid"] == dashboard.UID


def test_the_report_numbers() -> None:
    samples = [
        {
            "disagg_handler_seconds_sum": 1.0,
            "disagg_request_seconds_sum": 3.0,
            "disagg_request_seconds_count": 10.0,
        },
        {
            "disagg_handler_seconds_sum": 1.0,
            "disagg_request_seconds_sum": 1.0,
            "disagg_request_seconds_count": 10.0,
        },
    ]
    computing, other = report.split(samples)
    assert computing == pytest.approx(0.1) and other == pytest.approx(0.1)
    assert report.split([]) == (0.0, 0.0)
    assert report.throughput([0.1, 0.5, 1.2, 2.9], 3.0) == ([0.0, 1.0, 2.0], [2, 1, 1])
    summary = {
        "pipeline": "p",
        "elapsed_s": 10.0,
        "roles": {"a": {"replicas": 2}},
        "scale_events": [{"role": "a", "from": 1, "to": 2, "time_s": 4.0, "reason": "x"}],
    }
    data = report.ReportData.of(summary, latencies_s=[], completed_at_s=[], role_samples={})
    assert data.replicas["a"] == [(0.0, 1), (4.0, 2), (10.0, 2)]


def test_the_report_draws_four_charts(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    data = report.ReportData.of(
        {"pipeline": "p", "elapsed_s": 2.0, "roles": {"a": {"replicas": 1}}},
        latencies_s=[0.01, 0.02, 0.03],
        completed_at_s=[0.1, 1.1, 1.5],
        role_samples={
            "a": [
                {
                    "disagg_handler_seconds_sum": 0.01,
                    "disagg_request_seconds_sum": 0.03,
                    "disagg_request_seconds_count": 3.0,
                }
            ]
        },
    )
    page = tmp_path / "r.html"
    report.write(str(page), data)
    text = page.read_text()
    for key, _ in report.CHARTS:
        assert f'<img id="{key}"' in text
    assert text.count("data:image/png;base64,") == 4
    image = tmp_path / "r.png"
    report.write(str(image), data)
    assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_docs_describe_every_panel_and_rule(cat: catalog.Catalog) -> None:
    doc = (REPO / "docs" / "observability.md").read_text()
    for _, row in panels.rows(cat):
        for panel in row:
            assert f"**{panel.title}**" in doc, panel.title
    for rule in rules.rules(cat)["groups"][0]["rules"]:
        name = rule.get("alert") or rule["record"]
        assert name in doc, name
