"""The CRD's bounds, enforced by the spec (issue 30, item 13): every `maxItems`/`maxLength`
of the CRD's spec is found by walking its schema, and a document one over it is refused at
that field path; free-form mappings too deep are refused with a path, not a RecursionError;
a document far over the bounds fails fast."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from disagg_core import spec
from disagg_core.spec import limits, model
from disagg_operator.gen import crd


def bounds(node: Any, path: str = "spec") -> Iterator[tuple[str, str, int, Any]]:
    """(generic path, maxItems | maxLength, limit, the node) for every bound under spec."""
    if not isinstance(node, dict):
        return
    for key in ("maxItems", "maxLength"):
        if key in node:
            yield path, key, node[key], node
    for name, child in node.get("properties", {}).items():
        yield from bounds(child, f"{path}.{name}")
    if "items" in node:
        yield from bounds(node["items"], f"{path}[]")


SPEC = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
BOUNDS = list(bounds(SPEC))


def base() -> dict[str, Any]:
    return {
        "apiVersion": model.API_VERSION,
        "kind": model.KIND,
        "metadata": {"name": "p"},
        "spec": {"image": "img:1", "roles": [{"name": "enc", "handler": "pkg.mod:fn"}]},
    }


def filler(node: Any) -> Any:
    kind = node.get("type")
    return {"object": {}, "array": [], "string": "a"}.get(kind, 1)


def put(document: dict[str, Any], path: str, value: Any) -> str:
    """Set `value` at a generic path (`[]`: the first item, made if missing); the concrete
    path back."""
    parts = path.split(".")
    node: Any = document
    concrete = []
    for i, part in enumerate(parts):
        name, depth = part.split("[")[0], part.count("[]")
        last = i == len(parts) - 1
        if last and not depth:
            node[name] = value
            concrete.append(name)
            break
        if depth:
            node = node.setdefault(name, [])
            text = name
            for level in range(depth):
                if last and level == depth - 1:
                    node[:] = node[:1] or [None]
                    node[0] = value
                    break
                if not node:
                    node.append([] if level < depth - 1 else {})
                node = node[0]
                text += "[0]"
            concrete.append(text + ("[0]" if last else ""))
            if last:
                break
        else:
            node = node.setdefault(name, {})
            concrete.append(name)
    return ".".join(concrete)


def problem_paths(document: dict[str, Any]) -> list[str]:
    try:
        spec.parse_pipeline(document)
    except spec.SpecError as error:
        return [problem.path for problem in error.problems]
    return []


def test_the_walk_finds_the_bounds() -> None:
    assert ("spec.roles", "maxItems", limits.MAX_ROLES) in [b[:3] for b in BOUNDS]
    assert len(BOUNDS) > 20


@pytest.mark.parametrize(
    ("path", "key", "limit", "node"), BOUNDS, ids=[f"{b[0]}:{b[1]}" for b in BOUNDS]
)
def test_one_over_each_crd_bound_is_refused_at_its_path(
    path: str, key: str, limit: int, node: Any
) -> None:
    document = base()
    if key == "maxItems":
        value: Any = [filler(node["items"]) for _ in range(limit + 1)]
    else:
        value = "a" * (limit + 1)
    at = put(document, path, value)
    found = problem_paths(document)
    assert at in found, (at, found[:5])


def test_the_crd_reads_its_numbers_from_the_spec_limits() -> None:
    generic = {path: limit for path, key, limit, _ in BOUNDS if key == "maxItems"}
    for path, limit in limits.MAX_ITEMS.items():
        assert generic[path] == limit
    lengths = {path: limit for path, key, limit, _ in BOUNDS if key == "maxLength"}
    for path, limit in limits.MAX_LENGTH.items():
        assert lengths[path] == limit


def test_three_thousand_roles_fail_fast() -> None:
    document = base()
    document["spec"]["roles"] = [{"name": f"r{i}", "handler": "m:f"} for i in range(3000)]
    started = time.monotonic()
    found = problem_paths(document)
    assert found[0] == "spec.roles" and time.monotonic() - started < 2


@pytest.mark.parametrize("where", ["roles", "gateway"])
def test_a_deep_pod_template_is_refused_with_a_path(where: str) -> None:
    deep: Any = {}
    top = deep
    for _ in range(5000):
        deep["a"] = {}
        deep = deep["a"]
    document = base()
    if where == "roles":
        document["spec"]["roles"][0]["podTemplate"] = top
        prefix = "spec.roles[0].podTemplate"
    else:
        document["spec"]["gateway"] = {"podTemplate": top}
        prefix = "spec.gateway.podTemplate"
    found = problem_paths(document)
    assert len(found) == 1 and found[0].startswith(prefix + ".a.a.a"), found[:1]
    assert len(found[0]) < 1000


def test_deep_handler_args_are_refused_too() -> None:
    deep: Any = 1
    for _ in range(limits.MAX_FREE_DEPTH + 1):
        deep = [deep]
    document = base()
    document["spec"]["roles"][0]["handlerArgs"] = {"x": deep}
    assert problem_paths(document)[0].startswith("spec.roles[0].handlerArgs.x[0][0]")


def test_a_plan_derives_the_topology_and_units_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rendering was cubic in the roles (200 roles 7 s, 400 roles 39 s on main): the
    topology and the units were rebuilt per role. Now once per pipeline."""
    from disagg_core.contract import topology
    from disagg_operator.plan import model as plan_model
    from disagg_operator.plan import planner

    built = {"topology": 0, "units": 0}
    build, units = topology.Topology._build, plan_model._workloads

    def counting_build(pipeline: Any, namespace: Any) -> Any:
        built["topology"] += 1
        return build(pipeline, namespace)

    def counting_units(pipeline: Any, options: Any) -> Any:
        built["units"] += 1
        return units(pipeline, options)

    monkeypatch.setattr(topology.Topology, "_build", staticmethod(counting_build))
    monkeypatch.setattr(plan_model, "_workloads", counting_units)
    document = base()
    n = limits.MAX_ROLES
    document["spec"]["roles"] = [{"name": f"r{i}", "handler": "m:f"} for i in range(n)]
    document["spec"]["edges"] = [{"from": f"r{i}", "to": f"r{i + 1}"} for i in range(n - 1)]
    objects = planner.plan(spec.parse_pipeline(document), namespace="default")
    assert len(objects) > n
    assert built["topology"] <= 3 and built["units"] <= 2, built
