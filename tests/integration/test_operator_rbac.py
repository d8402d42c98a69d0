"""The API calls the operator makes, as RBAC rules (apiGroup, resource, verb), kept in
operator_rbac_observed.json for the Helm chart's ClusterRole test to compare with.

The scenario below exercises every path: create (with a colocation group, so a
ResourceClaimTemplate; every pipeline's peer key Secret and NetworkPolicy; a peer key Secret
that already exists), status
refreshes, edits that prune (the group dissolved, a role removed, the NetworkPolicy turned
off), a re-created child, an invalid spec, a conflict, deletion, with cluster-wide
kopf peering (`--peering`: clusterkopfpeerings; kopf patches its status, which the emulator
keeps only through a status subresource, hence `clusterkopfpeerings/status` here while kopf's
own CRD has none; a namespaced operator uses kopfpeerings in its namespaces instead, and
namespaces list/watch when given globs).

With DISAGG_RECORD_OPERATOR_RBAC=1 the file is rewritten from what was observed; otherwise
the calls must be a subset of the file (so it stays honest: a new call fails here until the
file, and the chart, learn it)."""

from __future__ import annotations

import base64
import os
from typing import Any

import pytest
import yaml

from disagg_operator.app import handlers
from tests.integration import operator_support as s
from tests.k8s.server import EmulatorThread
from tests.support import REPO

pytestmark = pytest.mark.asyncio
ESSENTIAL = {
    ("disagg.dev", "disaggregatedpipelines", "list"),
    ("disagg.dev", "disaggregatedpipelines", "watch"),
    ("disagg.dev", "disaggregatedpipelines", "get"),
    ("disagg.dev", "disaggregatedpipelines", "patch"),
    ("disagg.dev", "disaggregatedpipelines/status", "patch"),
    ("apps", "statefulsets", "watch"),
    ("apps", "statefulsets", "patch"),
    ("apps", "statefulsets", "delete"),
    ("", "services", "patch"),
    ("", "configmaps", "patch"),
    ("resource.k8s.io", "resourceclaimtemplates", "patch"),
    ("resource.k8s.io", "resourceclaimtemplates", "delete"),
    ("", "events", "create"),
    ("", "secrets", "get"),
    ("", "secrets", "create"),
    ("", "secrets", "watch"),
    ("networking.k8s.io", "networkpolicies", "patch"),
    ("networking.k8s.io", "networkpolicies", "delete"),
    ("networking.k8s.io", "networkpolicies", "watch"),
    ("kopf.dev", "clusterkopfpeerings", "watch"),
    # a server-side apply that creates is authorized as create too
    ("apps", "statefulsets", "create"),
    ("", "services", "create"),
    ("", "configmaps", "create"),
    ("networking.k8s.io", "networkpolicies", "create"),
}


async def test_the_operator_rbac_is_recorded(
    k8s: EmulatorThread, disagg_crd: Any, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(handlers, "CONFLICT_RETRY", 0.3)
    k8s.apply_file(disagg_crd)
    k8s.apply(s.PEERING_CRD)
    k8s.create(s.peering("disagg"))
    fan_out = yaml.safe_load((REPO / "examples" / "fan-out.yaml").read_text())
    name = fan_out["metadata"]["name"]
    async with s.running_operator(k8s, peering="disagg"):
        await s.call(k8s.create, fan_out, s.NS)
        await s.until(k8s, lambda: s.pipeline_status(k8s, name).get("phase"), "a status")
        kinds = {key.split("/")[0] for key in s.children(k8s, name)}
        assert "ResourceClaimTemplate" in kinds
        await s.call(s.mark_ready, k8s, name)
        await s.until(k8s, lambda: s.pipeline_status(k8s, name).get("phase") == "Ready", "Ready")
        ungroup = [{"op": "remove", "path": "/spec/colocation"}]
        await s.call(k8s.patch, s.PIPELINES, name, ungroup, s.NS, patch_type="json")
        await s.until(
            k8s,
            lambda: "ResourceClaimTemplate" not in {k.split("/")[0] for k in s.children(k8s, name)},
            "the group's claim template pruned",
        )
        assert f"StatefulSet/{name}-vision" in s.children(k8s, name)

        two = s.pipeline_doc("two", [{"name": "a"}, {"name": "b"}], [{"from": "a", "to": "b"}])
        await s.call(k8s.create, two, s.NS)
        await s.until(k8s, lambda: len(s.children(k8s, "two")) == 7, "two's children")
        await s.call(k8s.delete, s.STS, "two-a", s.NS)
        await s.until(k8s, lambda: k8s.get(s.STS, "two-a", s.NS), "two-a back")
        shrink = [
            {"op": "replace", "path": "/spec/roles", "value": two["spec"]["roles"][:1]},
            {"op": "replace", "path": "/spec/edges", "value": []},
        ]
        await s.call(k8s.patch, s.PIPELINES, "two", shrink, s.NS, patch_type="json")
        await s.until(k8s, lambda: len(s.children(k8s, "two")) == 5, "b pruned")
        no_policy = [{"op": "add", "path": "/spec/networkPolicy", "value": {"enabled": False}}]
        await s.call(k8s.patch, s.PIPELINES, "two", no_policy, s.NS, patch_type="json")
        await s.until(k8s, lambda: not s.guards(k8s, "two", "NetworkPolicy"), "policy pruned")

        # a cycle: only the operator's validator sees it (the API server's rules do not)
        cycle = [{"from": "a", "to": "b"}, {"from": "b", "to": "c"}, {"from": "c", "to": "b"}]
        bad = s.pipeline_doc("bad", [{"name": n} for n in "abc"], cycle)
        await s.call(k8s.create, bad, s.NS)
        await s.until(k8s, lambda: s.pipeline_status(k8s, "bad").get("phase") == "Invalid", "bad")

        taken = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "held-topology"}}
        await s.call(k8s.create, taken, s.NS)
        # a peer key Secret made by hand (unlabelled: not in the watch cache): the operator's
        # create finds the name taken and reads it
        key = base64.b64encode(b"k" * 64).decode()
        by_hand = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "held-peer-key"}}
        await s.call(k8s.create, {**by_hand, "data": {"key": key}}, s.NS)
        await s.call(k8s.create, s.pipeline_doc("held", [{"name": "a"}]), s.NS)
        await s.until(
            k8s, lambda: s.pipeline_status(k8s, "held").get("phase") == "Degraded", "conflict"
        )
        await s.call(k8s.delete, "v1/configmaps", "held-topology", s.NS)
        await s.until(k8s, lambda: len(s.children(k8s, "held")) == 5, "conflict resolved")

        for pipeline in (name, "two", "bad", "held"):
            await s.call(k8s.delete, s.PIPELINES, pipeline, s.NS)
        await s.until(k8s, lambda: not k8s.list(s.STS, s.NS), "everything deleted")
    observed = s.observed_rbac(k8s)
    assert observed >= ESSENTIAL, ESSENTIAL - observed
    if os.environ.get(s.RBAC_RECORD_ENV):
        s.write_rbac(observed | s.recorded_rbac())  # calls on timing (pods list) stay
    recorded = s.recorded_rbac()
    assert observed <= recorded, f"calls missing from {s.RBAC_FILE.name}: {observed - recorded}"
