"""The operator's watch cache entries and its API cost labels."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

from disagg_operator import names
from disagg_operator.bench import measure, scrape
from disagg_operator.k8s import client as kube
from disagg_operator.reconcile import apply, cache


def statefulset() -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {
            "name": "p-enc",
            "namespace": "ns",
            "uid": "u1",
            "resourceVersion": "7",
            "generation": 2,
            "labels": {names.LABEL_PIPELINE: "p", names.LABEL_MANAGED_BY: names.MANAGER},
            "ownerReferences": [
                {
                    "apiVersion": "disagg.dev/v1alpha1",
                    "kind": "X",
                    "name": "p",
                    "uid": "o",
                    "controller": True,
                }
            ],
            "managedFields": [{"manager": "x"}],
        },
        "spec": {"replicas": 3, "template": {"spec": {"containers": [{"name": "c"}]}}},
        "status": {"readyReplicas": 1},
    }


def test_slim_entries_keep_what_ownership_status_and_pruning_read():
    obj = statefulset()
    entry = cache.slim(obj, "apps/v1", "StatefulSet")
    assert entry["spec"] == {"replicas": 3} and entry["status"] == {"readyReplicas": 1}
    assert (apply.controller_of(entry) or {}).get("uid") == "o"
    assert cache.index_key(obj) == ("ns", "p")
    assert "template" not in str(entry) and "managedFields" not in str(entry)


def test_the_digest_ignores_status_and_server_kept_fields_but_not_content():
    obj = statefulset()
    other = copy.deepcopy(obj)
    other["metadata"]["resourceVersion"] = "99"
    other["status"] = {"readyReplicas": 3}
    other["metadata"]["managedFields"] = []
    assert cache.digest(obj) == cache.digest(other)
    other["spec"]["replicas"] = 4
    assert cache.digest(obj) != cache.digest(other)
    # an apply whose answer has the cached content is not an update, whatever the versions
    entry = cache.slim(obj, "apps/v1", "StatefulSet", digested=True)
    assert "digest" not in cache.slim(obj, "apps/v1", "StatefulSet")  # listed before applies
    assert not apply._changed(
        entry, {**obj, "metadata": {**obj["metadata"], "resourceVersion": "8"}}
    )
    assert apply._changed(entry, other)


def test_request_kinds_are_named_as_rbac_names_them():
    kind = kube.request_kind
    assert kind("GET", "/apis/apps/v1/namespaces/ns/statefulsets") == ("list", "statefulsets")
    assert kind("GET", "/apis/apps/v1/namespaces/ns/statefulsets?watch=true") == (
        "watch",
        "statefulsets",
    )
    assert kind("GET", "/api/v1/namespaces/ns/pods", {"watch": "1"}) == ("watch", "pods")
    assert kind("PATCH", "/apis/disagg.dev/v1alpha1/namespaces/ns/x/p/status") == (
        "patch",
        "x/status",
    )
    assert kind("DELETE", "/api/v1/namespaces/ns/services") == ("deletecollection", "services")
    assert kind("GET", "/api/v1/namespaces/ns") == ("get", "namespaces")
    assert kind("GET", "http://h:1/version") == ("get", "/version")


def sample(client: str, verb: str, resource: str, outcome: str, value: float) -> str:
    labels = f'client="{client}",verb="{verb}",resource="{resource}",outcome="{outcome}"'
    return f"disagg_operator_api_requests_total{{{labels}}} {value}\n"


def test_api_cost_of_a_phase():
    before = measure.api_counts(sample("operator", "get", "x", "200", 5))
    after = measure.api_counts(
        sample("operator", "get", "x", "200", 25)
        + sample("operator", "get", "x", "404", 10)
        + sample("kopf", "patch", "y", "429", 2)
    )
    cost = measure.cost(before, after, pipelines=4, seconds=30)
    assert cost["requests"] == 32 and cost["per_pipeline"] == 8 and cost["per_minute"] == 64
    assert cost["failed"] == 2  # a 404 is an answer; a 429 is not
    assert cost["by_request"] == {"operator get x": 30, "kopf patch y": 2}
    assert measure.cost(None, after, pipelines=1, seconds=1) == {}


def test_a_scraping_round_is_bounded_by_the_per_pod_timeout():
    result = asyncio.run(scrape.one_round(200, slow=3, timeout=0.5, concurrency=16))
    assert result["readings"] == 197
    # three hung pods cost one timeout each in their own slot, not the round's time each
    assert result["wall_s"] < 10


def test_a_cached_pipeline_drops_only_its_managed_fields():
    body = {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggregatedPipeline",
        "metadata": {"name": "p", "generation": 2, "managedFields": [{"manager": "kubectl"}]},
        "spec": {"roles": []},
        "status": {"phase": "Ready"},
    }
    entry = cache.pipeline_entry(body)
    assert "managedFields" not in entry["metadata"] and "managedFields" in body["metadata"]
    assert {**entry, "metadata": body["metadata"]} == body
    assert cache.digest(entry) == cache.digest(body)
