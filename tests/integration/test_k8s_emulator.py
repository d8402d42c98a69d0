"""The Kubernetes API emulator (tests/k8s) keeps the promises operator tests rely on.

Each test talks to a running emulator over real HTTP on loopback, through aiohttp or the
official ``kubernetes`` client, and checks one behaviour the emulator adds to kmock.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import re
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
import yaml

from tests.k8s.widget import WIDGET_CRD
from tests.support import REPO

REAL_CRD = REPO / "crds" / "disagg.dev_disaggregatedpipelines.yaml"
MERGE = {"Content-Type": "application/merge-patch+json"}
JSONPATCH = {"Content-Type": "application/json-patch+json"}
STRATEGIC = {"Content-Type": "application/strategic-merge-patch+json"}
APPLY = {"Content-Type": "application/apply-patch+yaml"}
CM_URL = "/api/v1/namespaces/default/configmaps"
STS_URL = "/apis/apps/v1/namespaces/default/statefulsets"
WIDGETS_URL = "/apis/example.dev/v1/namespaces/default/widgets"


def configmap(name: str, labels: dict[str, str] | None = None, **data: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "default"}
    if labels:
        meta["labels"] = labels
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}


def widget(name: str, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "example.dev/v1",
        "kind": "Widget",
        "metadata": {"name": name, "namespace": "default"},
        "spec": spec,
    }


def statefulset(name: str, image: str = "busybox:1") -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": name, "namespace": "default", "labels": {"app": name}},
        "spec": {
            "replicas": 1,
            "serviceName": name,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "containers": [
                        {
                            "name": "main",
                            "image": image,
                            "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
                            "ports": [{"containerPort": 8080, "name": "http"}],
                        },
                        {"name": "sidecar", "image": "sidecar:1"},
                    ]
                },
            },
        },
    }


def owner_ref(obj: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": obj["apiVersion"],
        "kind": obj["kind"],
        "name": obj["metadata"]["name"],
        "uid": obj["metadata"]["uid"],
        "controller": True,
    }


@asynccontextmanager
async def session(k8s) -> AsyncIterator[aiohttp.ClientSession]:
    timeout = aiohttp.ClientTimeout(total=15)
    async with aiohttp.ClientSession(base_url=k8s.url, timeout=timeout) as s:
        yield s


async def call(
    s: aiohttp.ClientSession,
    method: str,
    url: str,
    body: Any = None,
    *,
    expect: int | None = None,
    headers: dict[str, str] | None = None,
) -> dict[str, Any]:
    data = None if body is None else json.dumps(body)
    hdrs = {"Content-Type": "application/json", **(headers or {})}
    async with s.request(method, url, data=data, headers=hdrs) as response:
        payload = await response.json()
        if expect is not None:
            assert response.status == expect, (response.status, payload)
        return dict(payload)


async def watch_events(
    s: aiohttp.ClientSession,
    url: str,
    params: dict[str, str],
    until: Any,
    timeout: float = 5.0,
) -> list[dict[str, Any]]:
    """Read watch events until ``until(events)`` holds (or the stream ends)."""
    events: list[dict[str, Any]] = []
    async with asyncio.timeout(timeout):
        async with s.get(url, params={"watch": "true", **params}) as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("application/json")
            async for line in response.content:
                if line.strip():
                    events.append(json.loads(line))
                    if until(events):
                        break
    return events


def install_widgets(k8s) -> None:
    k8s.create(WIDGET_CRD)


# ------------------------------------------------------------------------------------------
# metadata stamping


@pytest.mark.asyncio
async def test_create_stamps_uid_resource_version_generation_and_timestamp(k8s):
    """generation only for kinds with spec semantics: a StatefulSet has one, a ConfigMap not
    (as on a real API server)."""
    async with session(k8s) as s:
        created = await call(s, "POST", CM_URL, configmap("a", k="v"), expect=201)
        meta = created["metadata"]
        assert re.fullmatch(r"[0-9a-f-]{36}", meta["uid"])
        assert int(meta["resourceVersion"]) > 0
        assert "generation" not in meta
        sts = await call(s, "POST", STS_URL, statefulset("gen"), expect=201)
        assert sts["metadata"]["generation"] == 1
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", meta["creationTimestamp"])

        fetched = await call(s, "GET", f"{CM_URL}/a", expect=200)
        assert fetched == created

        other = await call(s, "POST", CM_URL, configmap("b"), expect=201)
        assert other["metadata"]["uid"] != meta["uid"]
        assert int(other["metadata"]["resourceVersion"]) > int(meta["resourceVersion"])


@pytest.mark.asyncio
async def test_generation_moves_with_spec_only_and_no_op_writes_change_nothing(k8s):
    install_widgets(k8s)
    async with session(k8s) as s:
        w = await call(s, "POST", WIDGETS_URL, widget("w", color="red"), expect=201)
        rv0 = int(w["metadata"]["resourceVersion"])

        w = await call(s, "PATCH", f"{WIDGETS_URL}/w", {"spec": {"color": "blue"}}, headers=MERGE)
        assert w["metadata"]["generation"] == 2
        rv1 = int(w["metadata"]["resourceVersion"])
        assert rv1 > rv0

        labels = {"metadata": {"labels": {"x": "y"}, "annotations": {"a": "b"}}}
        w = await call(s, "PATCH", f"{WIDGETS_URL}/w", labels, headers=MERGE)
        assert w["metadata"]["generation"] == 2
        rv2 = int(w["metadata"]["resourceVersion"])
        assert rv2 > rv1

        status = {"status": {"phase": "Ready"}}
        w = await call(s, "PATCH", f"{WIDGETS_URL}/w/status", status, headers=MERGE)
        assert w["metadata"]["generation"] == 2
        assert w["status"] == {"phase": "Ready"}

        # The same patch again: nothing changes, not even the resourceVersion.
        again = await call(s, "PATCH", f"{WIDGETS_URL}/w/status", status, headers=MERGE)
        assert again["metadata"]["resourceVersion"] == w["metadata"]["resourceVersion"]


# ------------------------------------------------------------------------------------------
# optimistic concurrency and patches


@pytest.mark.asyncio
async def test_stale_resource_version_is_a_409_conflict(k8s):
    async with session(k8s) as s:
        v1 = await call(s, "POST", CM_URL, configmap("c", k="1"), expect=201)
        v2 = copy.deepcopy(v1)
        v2["data"]["k"] = "2"
        v2 = await call(s, "PUT", f"{CM_URL}/c", v2, expect=200)
        assert v2["data"] == {"k": "2"}

        stale = copy.deepcopy(v1)
        stale["data"]["k"] = "3"
        error = await call(s, "PUT", f"{CM_URL}/c", stale, expect=409)
        assert error["kind"] == "Status"
        assert error["reason"] == "Conflict"
        assert "the object has been modified" in error["message"]

        stale_patch = {
            "metadata": {"resourceVersion": v1["metadata"]["resourceVersion"]},
            "data": {"k": "4"},
        }
        await call(s, "PATCH", f"{CM_URL}/c", stale_patch, headers=MERGE, expect=409)
        await call(s, "PATCH", f"{CM_URL}/c", stale_patch, headers=STRATEGIC, expect=409)

        current = {
            "metadata": {"resourceVersion": v2["metadata"]["resourceVersion"]},
            "data": {"k": "5"},
        }
        await call(s, "PATCH", f"{CM_URL}/c", current, headers=MERGE, expect=200)

        # Without a resourceVersion in the body, an update is unconditional.
        unconditional = configmap("c", k="6")
        done = await call(s, "PUT", f"{CM_URL}/c", unconditional, expect=200)
        assert done["data"] == {"k": "6"}
        assert done["metadata"]["uid"] == v1["metadata"]["uid"]


@pytest.mark.asyncio
async def test_failed_json_patch_test_is_a_422_and_changes_nothing(k8s):
    async with session(k8s) as s:
        cm = await call(s, "POST", CM_URL, configmap("j", k="v"), expect=201)
        failing = [
            {"op": "test", "path": "/data/k", "value": "other"},
            {"op": "replace", "path": "/data/k", "value": "new"},
        ]
        error = await call(s, "PATCH", f"{CM_URL}/j", failing, headers=JSONPATCH, expect=422)
        assert error["reason"] == "Invalid"
        unchanged = await call(s, "GET", f"{CM_URL}/j")
        assert unchanged == cm

        passing = [
            {
                "op": "test",
                "path": "/metadata/resourceVersion",
                "value": cm["metadata"]["resourceVersion"],
            },
            {"op": "replace", "path": "/data/k", "value": "new"},
            {"op": "add", "path": "/metadata/labels", "value": {"l": "1"}},
        ]
        patched = await call(s, "PATCH", f"{CM_URL}/j", passing, headers=JSONPATCH, expect=200)
        assert patched["data"] == {"k": "new"}
        assert patched["metadata"]["labels"] == {"l": "1"}


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "meta",
    [
        {"name": "Upper"},
        {"name": "a" * 254},
        {"name": "ok", "labels": {"disagg.dev/pipeline": "x" * 64}},
        {"name": "ok", "labels": {"bad key": "v"}},
        {"name": "ok", "annotations": {"-bad/": "v"}},
        {"name": "ok", "ownerReferences": [{"apiVersion": "v1", "kind": "ConfigMap", "name": "o"}]},
        {"generateName": ""},
    ],
)
async def test_invalid_metadata_is_a_422(k8s, meta):
    body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta}
    async with session(k8s) as s:
        error = await call(s, "POST", CM_URL, body, expect=422)
        assert error["reason"] == "Invalid"
        service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "9-not-dns-1035"}}
        await call(s, "POST", "/api/v1/namespaces/default/services", service, expect=422)


@pytest.mark.asyncio
async def test_merge_strategic_and_json_patches(k8s):
    async with session(k8s) as s:
        await call(s, "POST", STS_URL, statefulset("web"), expect=201)
        strategic = {
            "spec": {
                "template": {
                    "spec": {
                        "containers": [
                            {
                                "name": "main",
                                "image": "busybox:2",
                                "env": [{"name": "B", "value": "20"}],
                            },
                            {"name": "sidecar", "$patch": "delete"},
                        ]
                    }
                }
            }
        }
        sts = await call(s, "PATCH", f"{STS_URL}/web", strategic, headers=STRATEGIC, expect=200)
        containers = sts["spec"]["template"]["spec"]["containers"]
        assert [c["name"] for c in containers] == ["main"]
        assert containers[0]["image"] == "busybox:2"
        assert containers[0]["env"] == [{"name": "A", "value": "1"}, {"name": "B", "value": "20"}]
        assert containers[0]["ports"] == [{"containerPort": 8080, "name": "http"}]
        assert sts["metadata"]["generation"] == 2

        # A JSON merge patch replaces lists wholesale and deletes keys with null.
        merge = {"spec": {"template": {"spec": {"containers": [{"name": "x", "image": "x:1"}]}}}}
        sts = await call(s, "PATCH", f"{STS_URL}/web", merge, headers=MERGE, expect=200)
        assert sts["spec"]["template"]["spec"]["containers"] == [{"name": "x", "image": "x:1"}]
        sts = await call(
            s, "PATCH", f"{STS_URL}/web", {"spec": {"serviceName": None}}, headers=MERGE
        )
        assert "serviceName" not in sts["spec"]

        ops = [{"op": "replace", "path": "/spec/replicas", "value": 4}]
        sts = await call(s, "PATCH", f"{STS_URL}/web", ops, headers=JSONPATCH, expect=200)
        assert sts["spec"]["replicas"] == 4


# ------------------------------------------------------------------------------------------
# server-side apply


@pytest.mark.asyncio
async def test_server_side_apply_creates_then_merges(k8s):
    async with session(k8s) as s:
        body = yaml.safe_dump(statefulset("ssa"))
        url = f"{STS_URL}/ssa?fieldManager=tests&force=true"
        async with s.patch(url, data=body, headers=APPLY) as response:
            assert response.status == 201
            created = await response.json()
        assert created["metadata"]["generation"] == 1
        assert created["metadata"]["uid"]

        changed = statefulset("ssa", image="busybox:9")
        changed["spec"]["replicas"] = 3
        async with s.patch(url, data=yaml.safe_dump(changed), headers=APPLY) as response:
            assert response.status == 200
            applied = await response.json()
        assert applied["metadata"]["uid"] == created["metadata"]["uid"]
        assert applied["metadata"]["generation"] == 2
        assert applied["spec"]["replicas"] == 3
        assert applied["spec"]["template"]["spec"]["containers"][0]["image"] == "busybox:9"

        # Applying a status through the status subresource of an existing object.
        status = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "ssa"}}
        status["status"] = {"replicas": 3, "readyReplicas": 3}
        async with s.patch(
            f"{STS_URL}/ssa/status?fieldManager=tests", data=json.dumps(status), headers=APPLY
        ) as response:
            assert response.status == 200
            assert (await response.json())["status"]["readyReplicas"] == 3


# ------------------------------------------------------------------------------------------
# watch


@pytest.mark.asyncio
async def test_watch_sends_a_snapshot_then_every_later_event(k8s):
    for n in range(3):
        k8s.create(configmap(f"pre-{n}"))
    stop = threading.Event()
    written: list[str] = []

    def writer() -> None:  # keeps writing while the watch starts: nothing may fall in between
        n = 0
        while not stop.is_set() and n < 400:
            k8s.create(configmap(f"live-{n}"))
            written.append(f"live-{n}")
            n += 1
        k8s.create(configmap("last"))

    thread = threading.Thread(target=writer)
    async with session(k8s) as s:
        thread.start()
        await asyncio.sleep(0.01)
        events = await watch_events(
            s,
            CM_URL,
            {},
            until=lambda evs: evs[-1]["object"]["metadata"]["name"] == "last",
            timeout=15,
        )
        stop.set()
        thread.join(10)
    names = [e["object"]["metadata"]["name"] for e in events]
    assert all(e["type"] == "ADDED" for e in events)
    assert len(names) == len(set(names)), "an object arrived twice"
    assert set(names) == {f"pre-{n}" for n in range(3)} | set(written) | {"last"}, "one was lost"


@pytest.mark.asyncio
async def test_watch_honours_resource_version_and_reports_modifications_and_deletions(k8s):
    k8s.create(configmap("old"))
    async with session(k8s) as s:
        listing = await call(s, "GET", CM_URL, expect=200)
        since = listing["metadata"]["resourceVersion"]
        k8s.create(configmap("new"))
        k8s.patch("configmaps", "old", {"data": {"x": "1"}}, "default")
        k8s.delete("configmaps", "new", "default")
        events = await watch_events(
            s, CM_URL, {"resourceVersion": since}, until=lambda evs: len(evs) == 3
        )
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("ADDED", "new"),
        ("MODIFIED", "old"),
        ("DELETED", "new"),
    ]
    versions = [int(e["object"]["metadata"]["resourceVersion"]) for e in events]
    assert versions == sorted(versions) and versions[0] > int(since)


@pytest.mark.asyncio
async def test_watch_initial_events_end_bookmark_and_periodic_bookmarks(k8s):
    k8s.create(configmap("one"))
    k8s.call(setattr, k8s.emulator, "bookmark_interval", 0.2)
    params = {
        "sendInitialEvents": "true",
        "allowWatchBookmarks": "true",
        "resourceVersionMatch": "NotOlderThan",
    }
    async with session(k8s) as s:
        events = await watch_events(
            s,
            CM_URL,
            params,
            until=lambda evs: sum(e["type"] == "BOOKMARK" for e in evs) >= 2,
        )
    assert events[0]["type"] == "ADDED"
    assert events[0]["object"]["metadata"]["name"] == "one"
    end = events[1]
    assert end["type"] == "BOOKMARK"
    assert end["object"]["kind"] == "ConfigMap"
    assert end["object"]["metadata"]["annotations"] == {"k8s.io/initial-events-end": "true"}
    assert int(end["object"]["metadata"]["resourceVersion"]) >= int(
        events[0]["object"]["metadata"]["resourceVersion"]
    )
    periodic = events[2]
    assert periodic["type"] == "BOOKMARK"
    assert "annotations" not in periodic["object"]["metadata"]


@pytest.mark.asyncio
async def test_watch_selectors_and_timeout(k8s):
    k8s.create(configmap("a", labels={"tier": "web"}))
    k8s.create(configmap("b", labels={"tier": "db"}))
    async with session(k8s) as s:
        started = time.monotonic()
        events = await watch_events(
            s, CM_URL, {"labelSelector": "tier=web", "timeoutSeconds": "1"}, until=lambda _: False
        )
        assert 0.8 < time.monotonic() - started < 4, "timeoutSeconds ends the stream"
        assert [e["object"]["metadata"]["name"] for e in events] == ["a"]

        listing = await call(s, "GET", CM_URL)
        rv = listing["metadata"]["resourceVersion"]
        k8s.patch("configmaps", "b", {"metadata": {"labels": {"tier": "web"}}}, "default")
        k8s.patch("configmaps", "a", {"metadata": {"labels": {"tier": "db"}}}, "default")
        moves = await watch_events(
            s,
            CM_URL,
            {"labelSelector": "tier=web", "resourceVersion": rv},
            until=lambda e: len(e) == 2,
        )
        assert [(e["type"], e["object"]["metadata"]["name"]) for e in moves] == [
            ("ADDED", "b"),
            ("DELETED", "a"),
        ]
        named = await watch_events(
            s,
            CM_URL,
            {"fieldSelector": "metadata.name=b", "timeoutSeconds": "1"},
            until=lambda _: False,
        )
        assert [e["object"]["metadata"]["name"] for e in named] == ["b"]


@pytest.mark.asyncio
async def test_watch_with_a_too_old_resource_version_is_410_gone(k8s):
    k8s.call(setattr, k8s.emulator, "event_log_limit", 4)
    for n in range(10):
        k8s.create(configmap(f"x{n}"))
    async with session(k8s) as s:
        events = await watch_events(s, CM_URL, {"resourceVersion": "1"}, until=lambda e: True)
    assert events[0]["type"] == "ERROR"
    assert events[0]["object"]["code"] == 410


# ------------------------------------------------------------------------------------------
# lists and discovery


@pytest.mark.asyncio
async def test_list_has_kind_api_version_resource_version_and_pages(k8s):
    for n in range(5):
        k8s.create(configmap(f"p{n}"))
    async with session(k8s) as s:
        listing = await call(s, "GET", CM_URL, expect=200)
        assert listing["kind"] == "ConfigMapList"
        assert listing["apiVersion"] == "v1"
        assert listing["metadata"]["resourceVersion"] == str(k8s.emulator.resource_version)
        assert [i["metadata"]["name"] for i in listing["items"]] == [f"p{n}" for n in range(5)]

        sts = await call(s, "GET", "/apis/apps/v1/statefulsets", expect=200)
        assert (sts["kind"], sts["apiVersion"], sts["items"]) == ("StatefulSetList", "apps/v1", [])

        first = await call(s, "GET", f"{CM_URL}?limit=2")
        assert len(first["items"]) == 2 and first["metadata"]["remainingItemCount"] == 3
        names = [i["metadata"]["name"] for i in first["items"]]
        token = first["metadata"]["continue"]
        while token:
            async with s.get(CM_URL, params={"limit": "2", "continue": token}) as response:
                page = await response.json()
            names += [i["metadata"]["name"] for i in page["items"]]
            token = page["metadata"].get("continue")
        assert names == [f"p{n}" for n in range(5)]


@pytest.mark.asyncio
async def test_discovery_of_core_builtin_groups_and_crds(k8s):
    async with session(k8s) as s:
        api = await call(s, "GET", "/api", expect=200)
        assert api["versions"] == ["v1"]
        core = await call(s, "GET", "/api/v1", expect=200)
        assert core["groupVersion"] == "v1"
        pods = next(r for r in core["resources"] if r["name"] == "pods")
        assert pods["namespaced"] and pods["kind"] == "Pod" and "watch" in pods["verbs"]
        assert any(r["name"] == "pods/status" for r in core["resources"])

        groups = await call(s, "GET", "/apis", expect=200)
        served = {g["preferredVersion"]["groupVersion"] for g in groups["groups"]}
        assert {
            "apps/v1",
            "resource.k8s.io/v1",
            "apiextensions.k8s.io/v1",
            "coordination.k8s.io/v1",
            "events.k8s.io/v1",
            "policy/v1",
            "networking.k8s.io/v1",
            "rbac.authorization.k8s.io/v1",
        } <= served
        apps = await call(s, "GET", "/apis/apps/v1", expect=200)
        names = {r["name"] for r in apps["resources"]}
        assert {"statefulsets", "statefulsets/status", "deployments"} <= names
        await call(s, "GET", "/apis/example.dev/v1", expect=404)

        install_widgets(k8s)
        group = await call(s, "GET", "/apis/example.dev", expect=200)
        assert group["preferredVersion"] == {"groupVersion": "example.dev/v1", "version": "v1"}
        listing = await call(s, "GET", "/apis/example.dev/v1", expect=200)
        entries = {r["name"]: r for r in listing["resources"]}
        assert entries["widgets"]["kind"] == "Widget"
        assert entries["widgets"]["shortNames"] == ["wg"]
        assert entries["widgets"]["categories"] == ["all"]
        assert "widgets/status" in entries

        k8s.delete("customresourcedefinitions", "widgets.example.dev")
        await call(s, "GET", "/apis/example.dev/v1", expect=404)
        await call(s, "GET", WIDGETS_URL, expect=404)


@pytest.mark.asyncio
@pytest.mark.parametrize("source", ["inline", "crds/"])
async def test_a_crd_registers_its_resource_and_is_established(k8s, source):
    if source == "crds/" and not REAL_CRD.exists():
        pytest.skip("crds/ has no DisaggregatedPipeline CRD yet")
    crd = yaml.safe_load(REAL_CRD.read_text()) if source == "crds/" else copy.deepcopy(WIDGET_CRD)
    spec = crd["spec"]
    names = spec["names"]
    group, plural, kind = spec["group"], names["plural"], names["kind"]
    version = next(v for v in spec["versions"] if v.get("storage"))
    async with session(k8s) as s:
        created = await call(
            s, "POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd, expect=201
        )
        conditions = {c["type"]: c["status"] for c in created["status"]["conditions"]}
        assert conditions == {"NamesAccepted": "True", "Established": "True"}
        assert created["status"]["acceptedNames"]["kind"] == kind
        assert created["status"]["storedVersions"] == [version["name"]]

        listing = await call(s, "GET", f"/apis/{group}/{version['name']}", expect=200)
        entries = {r["name"]: r for r in listing["resources"]}
        assert entries[plural]["kind"] == kind
        assert entries[plural]["namespaced"] == (spec["scope"] == "Namespaced")
        assert entries[plural].get("shortNames", []) == names.get("shortNames", [])
        assert entries[plural].get("categories", []) == names.get("categories", [])
        has_status = "status" in (version.get("subresources") or {})
        assert (f"{plural}/status" in entries) == has_status
        url = f"/apis/{group}/{version['name']}/namespaces/default/{plural}"
        empty = await call(s, "GET", url, expect=200)
        assert empty["kind"] == f"{kind}List" and empty["items"] == []

        wrong = copy.deepcopy(crd)
        wrong["metadata"]["name"] = f"others.{group}"
        crds = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
        error = await call(s, "POST", crds, wrong, expect=422)
        assert "spec.names.plural" in error["message"]


@pytest.mark.asyncio
async def test_custom_objects_get_their_schema_defaults(k8s):
    install_widgets(k8s)
    async with session(k8s) as s:
        w = await call(s, "POST", WIDGETS_URL, widget("d", color="red"), expect=201)
        assert w["spec"] == {"color": "red", "size": 1}
        w = await call(s, "PUT", f"{WIDGETS_URL}/d", {**w, "spec": {}}, expect=200)
        assert w["spec"] == {"size": 1}


# ------------------------------------------------------------------------------------------
# status subresource


@pytest.mark.asyncio
async def test_status_and_spec_are_split_by_the_status_subresource(k8s):
    install_widgets(k8s)
    async with session(k8s) as s:
        body = widget("s", color="red")
        body["status"] = {"phase": "Forged"}
        created = await call(s, "POST", WIDGETS_URL, body, expect=201)
        assert "status" not in created, "status is ignored on create"

        patch = {"spec": {"color": "green"}, "status": {"phase": "Sneaky"}}
        w = await call(s, "PATCH", f"{WIDGETS_URL}/s", patch, headers=MERGE, expect=200)
        assert w["spec"]["color"] == "green" and "status" not in w

        status_patch = {"spec": {"color": "ignored"}, "status": {"phase": "Ready"}}
        w = await call(s, "PATCH", f"{WIDGETS_URL}/s/status", status_patch, headers=MERGE)
        assert w["spec"]["color"] == "green" and w["status"] == {"phase": "Ready"}
        assert w["metadata"]["generation"] == 2

        w["status"]["phase"] = "Done"
        w["spec"]["color"] = "ignored-too"
        w = await call(s, "PUT", f"{WIDGETS_URL}/s/status", w, expect=200)
        assert w["status"] == {"phase": "Done"} and w["spec"]["color"] == "green"

        w["status"] = {"phase": "Overwritten?"}
        w = await call(s, "PUT", f"{WIDGETS_URL}/s", w, expect=200)
        assert w["status"] == {"phase": "Done"}

        # Without a status subresource, status is an ordinary part of the object.
        cm = configmap("plain")
        cm["status"] = {"kept": True}
        created = await call(s, "POST", CM_URL, cm, expect=201)
        assert created["status"] == {"kept": True}
        await call(s, "GET", f"{CM_URL}/plain/status", expect=404)


@pytest.mark.asyncio
async def test_scale_subresource_and_json_only_bodies(k8s):
    async with session(k8s) as s:
        await call(s, "POST", STS_URL, statefulset("sc"), expect=201)
        scale = await call(s, "GET", f"{STS_URL}/sc/scale", expect=200)
        assert scale["kind"] == "Scale" and scale["apiVersion"] == "autoscaling/v1"
        assert scale["spec"] == {"replicas": 1}
        assert scale["status"] == {"replicas": 0, "selector": "app=sc"}

        scale = await call(
            s, "PATCH", f"{STS_URL}/sc/scale", {"spec": {"replicas": 3}}, headers=MERGE
        )
        assert scale["spec"]["replicas"] == 3
        sts = await call(s, "GET", f"{STS_URL}/sc")
        assert sts["spec"]["replicas"] == 3 and sts["metadata"]["generation"] == 2

        stale = {**scale, "metadata": {**scale["metadata"], "resourceVersion": "1"}}
        await call(s, "PUT", f"{STS_URL}/sc/scale", stale, expect=409)
        await call(s, "PUT", f"{STS_URL}/sc/scale", {**scale, "spec": {"replicas": -1}}, expect=422)

        protobuf = {
            "Content-Type": "application/vnd.kubernetes.protobuf",
            "Accept": "application/vnd.kubernetes.protobuf,application/json",
        }
        async with s.post(CM_URL, data=b"\x00k8s", headers=protobuf) as response:
            assert response.status == 400  # no k8s envelope
        async with s.post(CM_URL, data=_configmap_protobuf("pb", k="v"), headers=protobuf) as r:
            assert r.status == 201 and r.content_type == "application/json"
            assert (await r.json())["data"] == {"k": "v"}


def _pb(number: int, value: bytes) -> bytes:
    """One length-delimited protobuf field (lengths under 128)."""
    return bytes([number << 3 | 2, len(value)]) + value


def _configmap_protobuf(name: str, **data: str) -> bytes:
    """A ConfigMap as client-go's protobuf serializer sends it (runtime.Unknown envelope)."""
    entries = b"".join(_pb(2, _pb(1, k.encode()) + _pb(2, v.encode())) for k, v in data.items())
    raw = _pb(1, _pb(1, name.encode())) + entries
    type_meta = _pb(1, b"v1") + _pb(2, b"ConfigMap")
    return b"k8s\x00" + _pb(1, type_meta) + _pb(2, raw)


# ------------------------------------------------------------------------------------------
# deletion


def _tree(k8s) -> tuple[dict[str, Any], ...]:
    root = k8s.create(configmap("root"))
    child = configmap("child")
    child["metadata"]["ownerReferences"] = [owner_ref(root)]
    child = k8s.create(child)
    grandchild = configmap("grandchild")
    grandchild["metadata"]["ownerReferences"] = [owner_ref(child)]
    grandchild = k8s.create(grandchild)
    return root, child, grandchild


def _names(k8s) -> set[str]:
    return {o["metadata"]["name"] for o in k8s.list("configmaps", "default")}


@pytest.mark.asyncio
@pytest.mark.parametrize("policy", ["Background", "Foreground"])
async def test_delete_cascades_through_owner_references(k8s, policy):
    _tree(k8s)
    other_owner = k8s.create(configmap("other-owner"))
    shared = configmap("shared")
    root = k8s.get("configmaps", "root", "default")
    shared["metadata"]["ownerReferences"] = [
        owner_ref(root),
        {**owner_ref(other_owner), "controller": False},
    ]
    k8s.create(shared)
    async with session(k8s) as s:
        options = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": policy}
        await call(s, "DELETE", f"{CM_URL}/root", options, expect=200)
    assert _names(k8s) == {"other-owner", "shared"}
    left = k8s.get("configmaps", "shared", "default")
    assert [r["name"] for r in left["metadata"]["ownerReferences"]] == ["other-owner"]


def test_a_dependent_created_after_its_owner_was_deleted_is_collected(k8s):
    """A controller acting on a stale cache (its StatefulSet already deleted) creates a pod
    owned by it: the garbage collector removes it, as it removes any dependent whose owners
    are all gone. A dependent with one owner still alive stays."""
    root, _, _ = _tree(k8s)
    alive = k8s.create(configmap("alive"))
    k8s.delete("configmaps", "root", "default")
    assert _names(k8s) == {"alive"}
    late = configmap("late")
    late["metadata"]["ownerReferences"] = [owner_ref(root)]
    assert k8s.create(late)["metadata"]["uid"]  # created (201), then collected
    both = configmap("both")
    both["metadata"]["ownerReferences"] = [
        owner_ref(root),
        {**owner_ref(alive), "controller": False},
    ]
    k8s.create(both)
    assert _names(k8s) == {"alive", "both"}


@pytest.mark.asyncio
async def test_orphan_deletion_keeps_dependents_and_finalizers_hold_objects(k8s):
    _tree(k8s)
    async with session(k8s) as s:
        await call(s, "DELETE", f"{CM_URL}/root?propagationPolicy=Orphan", expect=200)
        assert _names(k8s) == {"child", "grandchild"}
        assert "ownerReferences" not in k8s.get("configmaps", "child", "default")["metadata"]

        held = configmap("held")
        held["metadata"]["finalizers"] = ["example.dev/hold"]
        await call(s, "POST", CM_URL, held, expect=201)
        async with s.delete(f"{CM_URL}/held") as response:
            assert response.status == 202
        marked = await call(s, "GET", f"{CM_URL}/held", expect=200)
        assert marked["metadata"]["deletionTimestamp"]
        remove = {"metadata": {"finalizers": None}}
        await call(s, "PATCH", f"{CM_URL}/held", remove, headers=MERGE, expect=200)
        await call(s, "GET", f"{CM_URL}/held", expect=404)
        await call(s, "DELETE", f"{CM_URL}/held", expect=404)


@pytest.mark.asyncio
async def test_delete_collection_and_namespace_contents(k8s):
    async with session(k8s) as s:
        ns = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "team"}}
        await call(s, "POST", "/api/v1/namespaces", ns, expect=201)
        for n in range(3):
            body = configmap(f"t{n}", labels={"drop": "yes" if n else "no"})
            body["metadata"]["namespace"] = "team"
            await call(s, "POST", "/api/v1/namespaces/team/configmaps", body, expect=201)
        missing = configmap("nowhere")
        missing["metadata"]["namespace"] = "absent"
        await call(s, "POST", "/api/v1/namespaces/absent/configmaps", missing, expect=404)

        await call(s, "DELETE", "/api/v1/namespaces/team/configmaps?labelSelector=drop%3Dyes")
        assert [o["metadata"]["name"] for o in k8s.list("configmaps", "team")] == ["t0"]
        await call(s, "DELETE", "/api/v1/namespaces/team", expect=200)
        assert k8s.list("configmaps", "team") == []
        await call(s, "GET", "/api/v1/namespaces/team", expect=404)


# ------------------------------------------------------------------------------------------
# selectors and events


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("app=web", {"a", "b"}),
        ("app==web", {"a", "b"}),
        ("app!=web", {"c", "d"}),
        ("tier in (front,back)", {"a", "c"}),
        ("tier notin (front)", {"b", "c", "d"}),
        ("tier", {"a", "c"}),
        ("!tier", {"b", "d"}),
        ("app=web,tier=front", {"a"}),
        ("app in (web,db),!tier", {"b"}),
    ],
)
async def test_label_selectors(k8s, selector, expected):
    k8s.create(configmap("a", labels={"app": "web", "tier": "front"}))
    k8s.create(configmap("b", labels={"app": "web"}))
    k8s.create(configmap("c", labels={"app": "db", "tier": "back"}))
    k8s.create(configmap("d"))
    async with session(k8s) as s, s.get(CM_URL, params={"labelSelector": selector}) as response:
        assert response.status == 200
        listing = await response.json()
    assert {i["metadata"]["name"] for i in listing["items"]} == expected


@pytest.mark.asyncio
async def test_field_selectors_and_bad_selectors(k8s):
    k8s.create(configmap("a"))
    k8s.create(configmap("b"))
    async with session(k8s) as s:
        for selector, expected in [
            ("metadata.name=a", {"a"}),
            ("metadata.name!=a", {"b"}),
            ("metadata.namespace=default", {"a", "b"}),
            ("metadata.namespace=other", set()),
        ]:
            async with s.get(CM_URL, params={"fieldSelector": selector}) as response:
                names = {i["metadata"]["name"] for i in (await response.json())["items"]}
            assert names == expected, selector
        async with s.get(
            "/api/v1/namespaces", params={"fieldSelector": "metadata.name=default"}
        ) as response:
            assert [i["metadata"]["name"] for i in (await response.json())["items"]] == ["default"]
        async with s.get(CM_URL, params={"labelSelector": "a in (b"}) as response:
            assert response.status == 400


@pytest.mark.asyncio
async def test_core_and_events_k8s_io_events_are_one_storage(k8s):
    regarding = {"apiVersion": "v1", "kind": "ConfigMap", "name": "a", "namespace": "default"}
    core_event = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": "a.1", "namespace": "default"},
        "involvedObject": regarding,
        "reason": "Created",
        "message": "made it",
        "type": "Normal",
        "source": {"component": "disagg-operator"},
    }
    new_event = {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {"name": "a.2", "namespace": "default"},
        "regarding": regarding,
        "reason": "Scaled",
        "note": "scaled it",
        "type": "Warning",
        "action": "Scale",
        "reportingController": "disagg.dev/operator",
        "reportingInstance": "op-1",
        "eventTime": "2026-01-01T00:00:00.000000Z",
    }
    async with session(k8s) as s:
        await call(s, "POST", "/api/v1/namespaces/default/events", core_event, expect=201)
        await call(
            s, "POST", "/apis/events.k8s.io/v1/namespaces/default/events", new_event, expect=201
        )
        core = await call(s, "GET", "/api/v1/namespaces/default/events", expect=200)
        assert core["kind"] == "EventList"
        by_name = {e["metadata"]["name"]: e for e in core["items"]}
        assert by_name["a.1"]["message"] == "made it"
        assert by_name["a.2"]["message"] == "scaled it"
        assert by_name["a.2"]["involvedObject"]["name"] == "a"
        modern = await call(s, "GET", "/apis/events.k8s.io/v1/namespaces/default/events")
        by_name = {e["metadata"]["name"]: e for e in modern["items"]}
        assert by_name["a.1"]["note"] == "made it"
        assert by_name["a.1"]["regarding"]["kind"] == "ConfigMap"
        assert by_name["a.1"]["reportingController"] == "disagg-operator"
        assert all(e["apiVersion"] == "events.k8s.io/v1" for e in modern["items"])
        selected = await call(
            s,
            "GET",
            "/api/v1/namespaces/default/events?fieldSelector=involvedObject.name%3Da,reason%3DScaled",
        )
        assert [e["metadata"]["name"] for e in selected["items"]] == ["a.2"]


# ------------------------------------------------------------------------------------------
# recorded calls, clients, kmock reactions


@pytest.mark.asyncio
async def test_every_request_is_recorded_with_its_rbac_verb(k8s):
    install_widgets(k8s)
    k8s.clear_calls()
    async with session(k8s) as s:
        await call(s, "GET", "/apis/apps/v1")
        await call(s, "POST", WIDGETS_URL, widget("r"), expect=201)
        await call(s, "GET", f"{WIDGETS_URL}/r")
        await call(s, "GET", "/apis/example.dev/v1/widgets")
        await watch_events(s, WIDGETS_URL, {"timeoutSeconds": "1"}, until=lambda e: True)
        await call(s, "PUT", f"{WIDGETS_URL}/r", widget("r"))
        await call(s, "PATCH", f"{WIDGETS_URL}/r/status", {"status": {}}, headers=MERGE)
        await call(s, "DELETE", f"{WIDGETS_URL}/r")
        await call(s, "DELETE", WIDGETS_URL)
        await call(s, "GET", "/apis/example.dev/v1/namespaces/default/gadgets", expect=404)
    calls = k8s.calls
    assert [(c.verb, c.group, c.rbac_resource, c.namespace, c.name) for c in calls] == [
        ("get", None, None, None, None),
        ("create", "example.dev", "widgets", "default", None),
        ("get", "example.dev", "widgets", "default", "r"),
        ("list", "example.dev", "widgets", None, None),
        ("watch", "example.dev", "widgets", "default", None),
        ("update", "example.dev", "widgets", "default", "r"),
        ("patch", "example.dev", "widgets/status", "default", "r"),
        ("delete", "example.dev", "widgets", "default", "r"),
        ("deletecollection", "example.dev", "widgets", "default", None),
        ("list", "example.dev", "gadgets", "default", None),
    ]
    assert calls[0].path == "/apis/apps/v1"
    assert [c.code for c in calls] == [200, 201, 200, 200, 200, 200, 200, 200, 200, 404]
    assert ("example.dev", "widgets/status", "patch") in k8s.rbac_calls()


def test_the_official_kubernetes_client_works_against_it(k8s, k8s_client):
    import kubernetes

    core: Any = kubernetes.client.CoreV1Api(k8s_client)
    apps: Any = kubernetes.client.AppsV1Api(k8s_client)
    created = core.create_namespaced_config_map("default", configmap("py", k="v"))
    assert created.metadata.uid and created.metadata.resource_version
    listing = core.list_namespaced_config_map("default", label_selector="")
    assert "py" in [i.metadata.name for i in listing.items]
    assert listing.metadata.resource_version == str(k8s.emulator.resource_version)

    apps.create_namespaced_stateful_set("default", statefulset("web"))
    patched = apps.patch_namespaced_stateful_set_status(
        "web", "default", {"status": {"replicas": 1, "readyReplicas": 1}}
    )
    assert patched.status.ready_replicas == 1
    with pytest.raises(kubernetes.client.ApiException) as conflict:
        core.create_namespaced_config_map("default", configmap("py"))
    assert conflict.value.status == 409

    watcher = kubernetes.watch.Watch()
    seen = []
    k8s.create(configmap("py2"))
    for event in watcher.stream(
        core.list_namespaced_config_map,
        "default",
        resource_version=created.metadata.resource_version,
        timeout_seconds=2,
    ):
        seen.append((event["type"], event["object"].metadata.name))
        if event["object"].metadata.name == "py2":
            watcher.stop()
    assert seen == [("ADDED", "py2")]


def test_kmock_reactions_still_override_the_emulated_api(k8s):
    import urllib.error
    import urllib.request

    def inject() -> None:
        k8s.emulator["get /version"] << {"major": "9", "minor": "99"}
        k8s.emulator[f"get {CM_URL}/broken"] << 503

    k8s.call(inject)
    with urllib.request.urlopen(f"{k8s.url}/version", timeout=5) as response:
        assert json.loads(response.read())["minor"] == "99"
    with pytest.raises(urllib.error.HTTPError) as failure:
        urllib.request.urlopen(f"{k8s.url}{CM_URL}/broken", timeout=5)
    assert failure.value.code == 503
    assert [c.code for c in k8s.calls][-2:] == [200, 503]


@pytest.mark.asyncio
async def test_a_kopf_operator_runs_against_it(k8s):
    """The point of the exercise: real kopf, in this loop, against the emulator."""
    import kopf

    install_widgets(k8s)
    registry = kopf.OperatorRegistry()
    deleted: list[str] = []

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> Any:
        return k8s.connection_info()

    @kopf.on.startup(registry=registry)
    def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
        settings.persistence.finalizer = "example.dev/finalizer"
        settings.watching.server_timeout = 10

    @kopf.on.create("example.dev", "v1", "widgets", registry=registry)
    def create(body: Any, name: str, namespace: str | None, patch: Any, **_: Any) -> None:
        child = configmap(f"{name}-child", color=body["spec"].get("color", ""))
        kopf.adopt(child, owner=body)
        k8s.create(child)
        patch.status["phase"] = "Ready"
        kopf.info(body, reason="Created", message="created the child")

    @kopf.on.delete("example.dev", "v1", "widgets", registry=registry)
    def delete(name: str, **_: Any) -> None:
        deleted.append(name)

    operator = asyncio.create_task(
        kopf.operator(registry=registry, standalone=True, clusterwide=True)
    )
    try:
        await asyncio.to_thread(k8s.create, widget("k", color="red"))

        def reconciled() -> bool:
            w = k8s.get("widgets", "k", "default")
            return bool(w and (w.get("status") or {}).get("phase") == "Ready")

        await asyncio.to_thread(k8s.wait_for, reconciled, 10, message="the widget is Ready")
        w = k8s.get("widgets", "k", "default")
        assert w is not None and w["metadata"]["finalizers"] == ["example.dev/finalizer"]
        child = k8s.get("configmaps", "k-child", "default")
        assert child is not None and child["metadata"]["ownerReferences"][0]["name"] == "k"
        reasons = [e["reason"] for e in k8s.list("events", "default")]
        assert "Created" in reasons

        await asyncio.to_thread(k8s.delete, "widgets", "k", "default")
        await asyncio.to_thread(
            k8s.wait_for, lambda: k8s.get("widgets", "k", "default") is None, 10
        )
        assert deleted == ["k"]
        assert k8s.get("configmaps", "k-child", "default") is None, "garbage-collected"
    finally:
        operator.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await operator
    verbs = k8s.rbac_calls()
    assert ("example.dev", "widgets", "watch") in verbs
    assert ("example.dev", "widgets/status", "patch") in verbs
    assert ("", "events", "create") in verbs
