"""A role of groups (roles[].nodes: 2) end to end against the emulator: the real operator
(kopf, in this event loop) plans a leader and a worker StatefulSet per role, and restarts a
group whose member was deleted; the StatefulSet controller is played here (pods
`<sts>-<ordinal>` with the template's labels and the pod-index label, ready at once). What
the API holds is the ground truth."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from disagg_operator import names
from disagg_operator.plan import groups
from tests.integration import operator_support as s
from tests.k8s.server import EmulatorThread

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(120)]
NS = s.NS
NAME = "mn"
PODS = "v1/pods"
MEMBERS = ("mn-llm", "mn-llm-w1")


def doc(replicas: int) -> dict[str, Any]:
    d = s.pipeline_doc(
        NAME,
        [{"name": "enc"}, {"name": "llm", "nodes": 2, "replicas": replicas}],
        [{"from": "enc", "to": "llm"}],
    )
    d["spec"]["gateway"] = {"enabled": False}
    return d


def sync(k8s: EmulatorThread) -> None:
    """Play the StatefulSet controller once: create the missing pods, delete the extra."""
    for sts in k8s.list(s.STS, NS, f"{names.LABEL_PIPELINE}={NAME}"):
        name = sts["metadata"]["name"]
        replicas = sts["spec"].get("replicas", 1)
        want = {f"{name}-{i}": i for i in range(replicas)}
        owned = {
            p["metadata"]["name"]
            for p in k8s.list(PODS, NS, f"{names.LABEL_PIPELINE}={NAME}")
            if p["metadata"]["ownerReferences"][0]["name"] == name
        }
        for gone in sorted(owned - set(want)):
            k8s.delete(PODS, gone, NS)
        for pod_name in sorted(set(want) - owned):
            k8s.create(pod(sts, pod_name, want[pod_name]), NS)
            ready = {"phase": "Running", "podIP": "127.0.0.1"}
            k8s.patch_status(
                PODS, pod_name, {**ready, "conditions": [{"type": "Ready", "status": "True"}]}, NS
            )
        status = {
            "observedGeneration": sts["metadata"]["generation"],
            "replicas": replicas,
            "readyReplicas": replicas,
            "updatedReplicas": replicas,
            "availableReplicas": replicas,
        }
        if {k: (sts.get("status") or {}).get(k) for k in status} != status:
            k8s.patch_status(s.STS, name, status, NS)


def pod(sts: dict[str, Any], name: str, index: int) -> dict[str, Any]:
    template = copy.deepcopy(sts["spec"]["template"])
    owner = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": sts["metadata"]["name"],
        "uid": sts["metadata"]["uid"],
        "controller": True,
    }
    labels = {**template["metadata"]["labels"], groups.POD_INDEX_LABEL: str(index)}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": labels, "ownerReferences": [owner]},
        "spec": {"containers": template["spec"]["containers"]},
    }


def llm_pods(k8s: EmulatorThread) -> dict[str, str]:
    """The role's pods: name -> uid."""
    selector = f"{names.LABEL_PIPELINE}={NAME},{names.LABEL_ROLE}=llm"
    return {p["metadata"]["name"]: p["metadata"]["uid"] for p in k8s.list(PODS, NS, selector)}


async def test_groups_start_restart_and_scale_as_a_unit(k8s_crd: EmulatorThread) -> None:
    k8s = k8s_crd
    events: list[tuple[str, str, str]] = []
    async with s.running_operator(k8s, events=events):
        await s.call(k8s.create, doc(replicas=2), NS)
        await s.until(
            k8s, lambda: all(k8s.get(s.STS, m, NS) for m in MEMBERS), "every member's StatefulSet"
        )
        await s.call(sync, k8s)
        first = await s.call(llm_pods, k8s)
        assert sorted(first) == ["mn-llm-0", "mn-llm-1", "mn-llm-w1-0", "mn-llm-w1-1"]

        def ready() -> bool:
            status = s.pipeline_status(k8s, NAME)
            llm: dict[str, Any] = next(
                (r for r in status.get("roles") or () if r["name"] == "llm"), {}
            )
            return status.get("phase") == "Ready" and llm.get("ready") == 2

        await s.until(k8s, ready, "Ready with 2 groups")

        # a worker deleted: its leader goes too (the group restarts), group 0 is untouched
        await s.call(k8s.delete, PODS, "mn-llm-w1-1", NS)
        await s.until(k8s, lambda: "mn-llm-1" not in llm_pods(k8s), "the leader of group 1 deleted")
        await s.call(sync, k8s)
        after = await s.call(llm_pods, k8s)
        assert sorted(after) == sorted(first)
        assert (
            after["mn-llm-0"] == first["mn-llm-0"] and after["mn-llm-w1-0"] == first["mn-llm-w1-0"]
        )
        assert (
            after["mn-llm-1"] != first["mn-llm-1"] and after["mn-llm-w1-1"] != first["mn-llm-w1-1"]
        )
        assert any(reason == "GroupRestarted" for _, reason, _ in events)
        # the recreated group stays (its members' own deletions are not a new failure)
        await s.call(sync, k8s)
        assert await s.call(llm_pods, k8s) == after

        # scaling counts groups: 2 -> 3 adds a leader and a worker together
        scale = [{"op": "replace", "path": "/spec/roles/1/replicas", "value": 3}]
        await s.call(k8s.patch, s.PIPELINES, NAME, scale, NS, patch_type="json")
        await s.until(
            k8s,
            lambda: all((k8s.get(s.STS, m, NS) or {})["spec"]["replicas"] == 3 for m in MEMBERS),
            "every member's StatefulSet at 3",
        )
        await s.call(sync, k8s)
        grown = await s.call(llm_pods, k8s)
        assert set(grown) - set(after) == {"mn-llm-2", "mn-llm-w1-2"}

        def ready_groups() -> int:
            status = s.pipeline_status(k8s, NAME)
            llm: dict[str, Any] = next(
                (r for r in status.get("roles") or () if r["name"] == "llm"), {}
            )
            return int(llm.get("ready") or 0)

        await s.until(k8s, lambda: ready_groups() == 3, "3 ready groups")
