"""`roles[].ranks` / `nodes` through a real API server's admission (the emulator held to
it, tests/k8s) and the real kubectl: the CRD takes them with their defaults and bounds, and
the operator's objects for a role of two ranks are admitted without warnings."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from disagg_core import spec
from disagg_operator.plan import planner, render
from tests.integration.test_k8s_admission import pipeline, with_crd
from tests.k8s.fixtures import Kubectl
from tests.k8s.server import EmulatorThread

__all__ = ["with_crd"]


def test_ranks_and_nodes_default_to_one_and_are_bounded(
    with_crd: Kubectl, k8s: EmulatorThread
) -> None:
    doc = pipeline()
    doc["spec"]["roles"][1]["ranks"] = 4
    with_crd("apply", "--server-side", "-f", "-", input=yaml.safe_dump(doc))
    stored = k8s.get("disaggregatedpipelines", "x", "default")
    assert stored is not None
    first, second = stored["spec"]["roles"]
    assert (first["ranks"], first["nodes"], second["ranks"], second["nodes"]) == (1, 1, 4, 1)
    for key, value, refusal in (
        ("ranks", 0, "should be greater than or equal to 1"),
        ("nodes", 65, "should be less than or equal to 64"),
    ):
        bad = pipeline("bad")
        bad["spec"]["roles"][0][key] = value
        result = with_crd("create", "-f", "-", input=yaml.safe_dump(bad), check=False)
        assert result.returncode != 0
        assert f"spec.roles[0].{key}" in result.stderr and refusal in result.stderr, result.stderr


def test_a_role_of_two_ranks_renders_admitted_objects(
    kubectl: Kubectl, k8s: EmulatorThread
) -> None:
    doc: dict[str, Any] = pipeline("tp")
    doc["spec"]["roles"][1].update(
        ranks=2, resources={"requests": {"cpu": "500m"}, "limits": {"nvidia.com/gpu": 1}}
    )
    objects = planner.plan(spec.parse_pipeline(doc), namespace="default")
    [sts] = [o for o in objects if o["kind"] == "StatefulSet" and o["metadata"]["name"] == "tp-b"]
    [container] = sts["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert {k: v for k, v in env.items() if "RANK" in k or k == "DISAGG_LEADER"} == {
        "DISAGG_RANKS": "2",
        "DISAGG_NODE_RANK": "0",
        "DISAGG_LEADER": "127.0.0.1",
        "DISAGG_RANK_PORT": "29500",
    }
    assert container["resources"] == {
        "requests": {"cpu": "1000m"},
        "limits": {"nvidia.com/gpu": "2"},  # one GPU per rank
    }
    result = kubectl("apply", "--server-side", "-f", "-", input=render.dump_all(objects))
    assert "Warning" not in result.stderr, result.stderr
    assert k8s.call(lambda: list(k8s.emulator.warnings)) == []


def test_groups_of_pods_render_admitted_objects(kubectl: Kubectl, k8s: EmulatorThread) -> None:
    """nodes: 2 (two ranks each) and replicas 2: the leaders' and the workers' StatefulSets,
    the members' headless Service and their NetworkPolicy pass the API server's admission."""
    doc: dict[str, Any] = pipeline("mn")
    doc["spec"]["roles"][1].update(nodes=2, ranks=2, replicas=2)
    objects = planner.plan(spec.parse_pipeline(doc), namespace="default")
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert {("StatefulSet", "mn-b"), ("StatefulSet", "mn-b-w1")} <= kinds
    assert {("Service", "mn-b-ranks"), ("NetworkPolicy", "mn-b-ranks")} <= kinds
    result = kubectl("apply", "--server-side", "-f", "-", input=render.dump_all(objects))
    assert "Warning" not in result.stderr, result.stderr
    assert k8s.call(lambda: list(k8s.emulator.warnings)) == []
    for name in ("mn-b", "mn-b-w1"):
        stored = k8s.get("statefulsets", name, "default")
        assert stored is not None and stored["spec"]["replicas"] == 2  # groups


@pytest.mark.parametrize("role", ["a-role-whose-name-is-long-enough-to-matter-" + "x" * 7])
def test_a_group_whose_worker_names_do_not_fit_is_refused(role: str) -> None:
    doc = pipeline()
    doc["spec"]["roles"][1]["nodes"] = 2
    doc["spec"]["roles"][1]["name"] = role
    for edge in doc["spec"].get("edges", []):
        for key in ("from", "to"):
            if edge.get(key) == "b":
                edge[key] = role
    problems = planner.check(spec.parse_pipeline(doc))
    assert [p.path for p in problems] == ["spec.roles[1].name"]
    assert "longer than 52" in problems[0].reason


def test_nodes_cannot_change_on_a_live_role_but_everything_around_it_can(
    with_crd: Kubectl, k8s: EmulatorThread
) -> None:
    """The CRD's transition rule (oldSelf): a role's nodes is fixed once it exists, named in
    the refusal; roles are matched by name (a list-type map), so reordering them, changing
    ranks or replicas, or adding a role of groups under a new name is accepted."""
    doc = pipeline("live")
    doc["spec"]["roles"][1].update(nodes=2, ranks=2)
    with_crd("apply", "--server-side", "-f", "-", input=yaml.safe_dump(doc))

    def apply(change: Any) -> Any:
        edited = pipeline("live")
        edited["spec"]["roles"][1].update(nodes=2, ranks=2)
        change(edited)
        return with_crd(
            "apply", "--server-side", "-f", "-", input=yaml.safe_dump(edited), check=False
        )

    def stored_nodes() -> list[tuple[str, int]]:
        obj = k8s.get("disaggregatedpipelines", "live", "default") or {}
        return [(r["name"], r["nodes"]) for r in obj["spec"]["roles"]]

    for what, change in (
        ("1 -> 2", lambda d: d["spec"]["roles"][0].update(nodes=2)),
        ("2 -> 1", lambda d: d["spec"]["roles"][1].update(nodes=1)),
        ("2 -> 3", lambda d: d["spec"]["roles"][1].update(nodes=3)),
        ("2 -> unset (1)", lambda d: d["spec"]["roles"][1].pop("nodes")),
    ):
        result = apply(change)
        assert result.returncode != 0, what
        index = 0 if what == "1 -> 2" else 1
        assert f"spec.roles[{index}].nodes" in result.stderr, (what, result.stderr)
        assert "nodes cannot change on a live role" in result.stderr, (what, result.stderr)
        assert stored_nodes() == [("a", 1), ("b", 2)], what

    def reorder(d: Any) -> None:
        d["spec"]["roles"].reverse()
        d["spec"]["roles"][0].update(ranks=4, replicas=3)

    def add_renamed(d: Any) -> None:
        d["spec"]["roles"].append({"name": "b2", "handler": "disagg_runtime.demo:encode_text"})
        d["spec"]["roles"][2]["nodes"] = 4
        d["spec"]["edges"].append({"from": "a", "to": "b2"})

    for change in (reorder, add_renamed):
        result = apply(change)
        assert result.returncode == 0, result.stderr
    assert stored_nodes() == [("a", 1), ("b", 2), ("b2", 4)]
