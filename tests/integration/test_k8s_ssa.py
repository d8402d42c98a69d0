"""Server-side apply with field ownership, as on a real API server: managedFields, the
removal of fields a manager stopped applying, 409 conflicts with the server's message,
force, and the create authorization of an apply that creates."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.k8s.rbac import Authenticator
from tests.k8s.server import EmulatorThread
from tests.k8s.tls import ServerTls

CM = "/api/v1/namespaces/default/configmaps"
APPLY = "application/apply-patch+yaml"


def _send(
    k8s: EmulatorThread,
    method: str,
    path: str,
    body: Any,
    content_type: str = APPLY,
    token: str | None = None,
) -> tuple[int, Any]:
    headers = {"Content-Type": content_type}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(
        k8s.url + path, data=json.dumps(body).encode(), method=method, headers=headers
    )
    context = k8s.tls.client_context() if k8s.tls is not None else None
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def cm(name: str = "c", **data: str) -> dict[str, Any]:
    doc: dict[str, Any] = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}}
    if data:
        doc["data"] = data
    return doc


def apply(k8s: EmulatorThread, manager: str, body: Any, *, force: bool = False, **kw: Any):
    name = body["metadata"]["name"]
    query = f"?fieldManager={manager}" + ("&force=true" if force else "")
    return _send(k8s, "PATCH", f"{CM}/{name}{query}", body, **kw)


def owners(obj: dict[str, Any]) -> dict[str, set[str]]:
    """manager -> the data keys it owns (managers that own none left out)."""
    found = {
        e["manager"]: {k[2:] for k in e["fieldsV1"].get("f:data", {}) if k != "."}
        for e in obj["metadata"].get("managedFields", [])
    }
    return {manager: keys for manager, keys in found.items() if keys}


def test_a_field_a_manager_stops_applying_is_removed(k8s: EmulatorThread) -> None:
    """The issue's probe: the real server ends with {"other": "x"}."""
    assert apply(k8s, "a", cm(k="a"))[0] == 201
    assert apply(k8s, "b", cm(other="x"))[0] == 200
    assert apply(k8s, "a", cm(k="b"))[0] == 200
    code, obj = apply(k8s, "a", cm())
    assert code == 200 and obj["data"] == {"other": "x"}
    assert owners(obj) == {"b": {"other"}}


def test_managed_fields_record_each_manager(k8s: EmulatorThread) -> None:
    code, obj = apply(k8s, "a", cm(k="v"))
    assert code == 201
    (entry,) = obj["metadata"]["managedFields"]
    assert entry["manager"] == "a" and entry["operation"] == "Apply"
    assert entry["apiVersion"] == "v1" and entry["fieldsType"] == "FieldsV1"
    assert entry["fieldsV1"] == {"f:data": {".": {}, "f:k": {}}}
    code, obj = _send(
        k8s,
        "PATCH",
        f"{CM}/c?fieldManager=editor",
        {"data": {"e": "1"}},
        "application/merge-patch+json",
    )
    assert owners(obj) == {"a": {"k"}, "editor": {"e"}}
    assert [e["operation"] for e in obj["metadata"]["managedFields"]] == ["Apply", "Update"]
    rv = obj["metadata"]["resourceVersion"]
    code, again = apply(k8s, "a", cm(k="v"))  # the same apply: a no-op
    assert again["metadata"]["resourceVersion"] == rv


def test_conflicts_with_another_manager_unless_forced(k8s: EmulatorThread) -> None:
    apply(k8s, "a", cm(k="a"))
    code, status = apply(k8s, "b", cm(k="b"))
    assert (code, status["reason"]) == (409, "Conflict")
    assert status["message"] == 'Apply failed with 1 conflict: conflict with "a": .data.k'
    assert status["details"]["causes"] == [
        {"reason": "FieldManagerConflict", "message": 'conflict with "a"', "field": ".data.k"}
    ]
    assert apply(k8s, "b", cm(k="a"))[0] == 200  # the same value: shared, no conflict
    code, obj = apply(k8s, "b", cm(k="b"), force=True)
    assert code == 200 and obj["data"] == {"k": "b"}
    assert owners(obj) == {"b": {"k"}}  # a lost the field


def test_a_conflict_with_an_update_names_its_api_version_and_time(k8s: EmulatorThread) -> None:
    _send(k8s, "POST", f"{CM}?fieldManager=kubectl-edit", cm(k="a", j="a"), "application/json")
    code, status = apply(k8s, "a", cm(k="b", j="b"))
    assert code == 409
    lines = status["message"].split("\n")
    assert lines[0].startswith(
        'Apply failed with 2 conflicts: conflicts with "kubectl-edit" using v1 at '
    )
    assert lines[1:] == ["- .data.j", "- .data.k"] or lines[1:] == ["- .data.k", "- .data.j"]


def test_custom_resources_merge_map_lists_by_key(k8s: EmulatorThread, disagg_crd: Any) -> None:
    """spec.roles is a map list (by name): each manager owns its items' fields."""
    k8s.apply_file(disagg_crd)
    path = "/apis/disagg.dev/v1alpha1/namespaces/default/disaggregatedpipelines/p"

    def doc(*roles: dict[str, Any]) -> dict[str, Any]:
        return {
            "apiVersion": "disagg.dev/v1alpha1",
            "kind": "DisaggregatedPipeline",
            "metadata": {"name": "p"},
            "spec": {"image": "img:1", "roles": list(roles)},
        }

    handler = "disagg_runtime.demo:encode_text"
    assert (
        _send(k8s, "PATCH", f"{path}?fieldManager=a", doc({"name": "x", "handler": handler}))[0]
        == 201
    )
    code, obj = _send(
        k8s,
        "PATCH",
        f"{path}?fieldManager=b",
        {
            **doc({"name": "y", "handler": handler}),
            "spec": {"roles": [{"name": "y", "handler": handler}]},
        },
    )
    assert code == 200, obj
    assert [r["name"] for r in obj["spec"]["roles"]] == ["x", "y"], obj
    code, obj = _send(k8s, "PATCH", f"{path}?fieldManager=b", {**doc(), "spec": {}})
    assert code == 200, obj
    assert [r["name"] for r in obj["spec"]["roles"]] == ["x"]  # b's item is gone


@pytest.fixture
def secure() -> Iterator[EmulatorThread]:
    k8s = EmulatorThread(tls=ServerTls(), auth=Authenticator()).start()
    yield k8s
    k8s.stop()


def test_an_apply_that_creates_needs_create(secure: EmulatorThread) -> None:
    assert secure.emulator.auth is not None
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": "patcher", "namespace": "default"},
        "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "patch"]}],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": "patcher", "namespace": "default"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "patcher"},
        "subjects": [{"kind": "ServiceAccount", "name": "op", "namespace": "default"}],
    }
    secure.create(role)
    secure.create(binding)
    token = secure.emulator.auth.service_account_token("default", "op")
    code, status = apply(secure, "op", cm(k="v"), token=token)
    assert (code, status["reason"]) == (403, "Forbidden")
    assert status["message"] == (
        'configmaps "c" is forbidden: User "system:serviceaccount:default:op" cannot create '
        'resource "configmaps" in API group "" in the namespace "default"'
    )
    secure.create(cm(k="v"))  # it exists: patch is enough
    assert apply(secure, "op", cm(k="w"), token=token, force=True)[0] == 200
    assert ("", "configmaps", "create") not in {
        a
        for c in secure.calls
        if c.user and c.user.endswith(":op") and c.code == 200
        for a in c.authorizations
    }
