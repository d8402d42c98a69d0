"""roles[].nodes > 1: the planner's group objects and env, the status and rollout counting
whole groups, and the pure group-restart decision (reconcile/regroup.py)."""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from disagg_core import contract, spec
from disagg_operator import names
from disagg_operator.autoscaling import scaling
from disagg_operator.plan import groups, planner
from disagg_operator.plan import model as plan_model
from disagg_operator.reconcile import regroup, status
from disagg_operator.rollout import state as rollout_state

Obj = dict[str, Any]
NS = "ml"
T0 = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


def _doc(nodes: int = 2, replicas: int = 2, **role: Any) -> Obj:
    return {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggregatedPipeline",
        "metadata": {"name": "mn"},
        "spec": {
            "image": "ghcr.io/disagg/runtime:0.1.0",
            "roles": [
                {"name": "enc", "handler": "disagg_runtime.demo:encode_text"},
                {
                    "name": "llm",
                    "handler": "disagg_runtime.demo:encode_text",
                    "nodes": nodes,
                    "ranks": 2,
                    "replicas": replicas,
                    **role,
                },
            ],
            "edges": [{"from": "enc", "to": "llm"}],
        },
    }


def _plan(doc: Obj, **options: Any) -> dict[tuple[str, str], Obj]:
    pipeline = spec.parse_pipeline(doc)
    objects = planner.plan(pipeline, namespace=NS, options=plan_model.PlanOptions(**options))
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def _env(sts: Obj) -> dict[str, Any]:
    [container] = sts["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_a_group_is_a_leader_and_a_worker_per_node_rank_with_equal_ordinals() -> None:
    found = _plan(_doc(nodes=3, replicas=2))
    sts = {name: o for (kind, name), o in found.items() if kind == "StatefulSet"}
    assert sorted(sts) == ["mn-enc", "mn-llm", "mn-llm-w1", "mn-llm-w2"]
    for rank, name in enumerate(["mn-llm", "mn-llm-w1", "mn-llm-w2"]):
        spec_ = sts[name]["spec"]
        assert spec_["replicas"] == 2  # groups, in every member's StatefulSet
        assert spec_["serviceName"] == "mn-llm-ranks"
        assert spec_["podManagementPolicy"] == "Parallel"
        selector = spec_["selector"]["matchLabels"]
        assert selector[names.LABEL_NODE_RANK] == str(rank)
        assert spec_["template"]["metadata"]["labels"][names.LABEL_NODE_RANK] == str(rank)
        env = _env(sts[name])
        assert env["DISAGG_NODES"] == "3" and env["DISAGG_NODE_RANK"] == str(rank)
        assert env["DISAGG_RANKS"] == "2"
        assert env["DISAGG_LEADER"] == (
            "mn-llm-$(DISAGG_GROUP_INDEX).mn-llm-ranks.ml.svc.cluster.local"
        )
        index = env["DISAGG_GROUP_INDEX"]["fieldRef"]["fieldPath"]
        assert index == "metadata.labels['apps.kubernetes.io/pod-index']"
        order = list(env)
        assert order.index("DISAGG_GROUP_INDEX") < order.index("DISAGG_LEADER")  # $() order
    # a lone role is as before: no node-rank label, its own Service governs it
    assert names.LABEL_NODE_RANK not in sts["mn-enc"]["spec"]["selector"]["matchLabels"]
    assert sts["mn-enc"]["spec"]["serviceName"] == "mn-enc"
    assert "DISAGG_NODES" not in _env(sts["mn-enc"])


def test_the_leader_env_parses_as_the_runtime_reads_it() -> None:
    found = _plan(_doc())
    env = _env(found["StatefulSet", "mn-llm-w1"])
    leader = env["DISAGG_LEADER"].replace("$(DISAGG_GROUP_INDEX)", "1")  # the kubelet's part
    plain = {k: v for k, v in env.items() if isinstance(v, str)}
    topology = plan_model.topology(spec.parse_pipeline(_doc()), NS)
    config = contract.parse_env(
        {**plain, "DISAGG_LEADER": leader, "DISAGG_POD_NAME": "mn-llm-w1-1"}, topology
    )
    assert (config.nodes, config.node_rank, config.replica) == (2, 1, 1)
    [rank0, rank1] = contract.pod_ranks(config)
    assert (rank0.rank, rank1.rank, rank0.world_size) == (2, 3, 4)
    assert rank0.master_addr == "mn-llm-1.mn-llm-ranks.ml.svc.cluster.local"


def test_peers_see_only_leaders_and_members_reach_each_other() -> None:
    found = _plan(_doc())
    role_service = found["Service", "mn-llm"]["spec"]
    assert role_service["selector"][names.LABEL_NODE_RANK] == "0"  # one address per group
    assert role_service["publishNotReadyAddresses"] is False
    ranks = found["Service", "mn-llm-ranks"]["spec"]
    assert ranks["clusterIP"] == "None" and ranks["publishNotReadyAddresses"] is True
    assert names.LABEL_NODE_RANK not in ranks["selector"]  # every member
    assert [p["port"] for p in ranks["ports"]] == [contract.DEFAULT_RANK_PORT]
    policy = found["NetworkPolicy", "mn-llm-ranks"]["spec"]
    members = {"matchLabels": {names.LABEL_PIPELINE: "mn", names.LABEL_ROLE: "llm"}}
    assert policy["podSelector"] == members
    assert policy["ingress"] == [{"from": [{"podSelector": members}]}]  # every port
    assert ("NetworkPolicy", "mn-enc-ranks") not in found
    off = _doc()
    off["spec"]["networkPolicy"] = {"enabled": False}
    assert ("NetworkPolicy", "mn-llm-ranks") not in _plan(off)


def test_scaling_and_partitions_apply_to_every_member() -> None:
    found = _plan(_doc(), replicas={"llm": 3}, partitions={"llm": 1})
    for name in ("mn-llm", "mn-llm-w1"):
        spec_ = found["StatefulSet", name]["spec"]
        assert spec_["replicas"] == 3
        assert spec_["updateStrategy"]["rollingUpdate"]["partition"] == 1


def test_names_that_do_not_fit_and_external_scaling_are_refused() -> None:
    long = _doc(nodes=12)
    long["metadata"]["name"] = "p" * 40
    long["spec"]["roles"][1]["name"] = "r" * 8  # P-R = 49, P-R-w11 = 53
    long["spec"]["edges"] = [{"from": "enc", "to": "r" * 8}]
    problems = planner.check(spec.parse_pipeline(long))
    assert [p.path for p in problems] == ["spec.roles[1].name"]
    assert "w11" in problems[0].reason and "52" in problems[0].reason
    hpa = _doc()
    hpa["metadata"]["annotations"] = {names.ANNOTATION_EXTERNAL_SCALING: "llm"}
    [problem] = planner.check(spec.parse_pipeline(hpa))
    assert problem.path == f'metadata.annotations["{names.ANNOTATION_EXTERNAL_SCALING}"]'
    assert "without their workers" in problem.reason


@pytest.mark.parametrize(("nodes", "ranks"), [(2, 1), (1, 2)])
def test_a_role_port_on_the_rank_port_is_refused_naming_the_field(nodes: int, ranks: int) -> None:
    ports = [
        {"name": "debug", "containerPort": 8000},
        {"name": "rdzv", "containerPort": contract.DEFAULT_RANK_PORT},
        {"name": "stats", "containerPort": contract.DEFAULT_RANK_PORT, "protocol": "UDP"},
    ]
    doc = _doc(nodes=nodes, ranks=ranks, ports=ports)
    [problem] = planner.check(spec.parse_pipeline(doc))
    assert problem.path == "spec.roles[1].ports[1].containerPort"
    assert "29500 is the rendezvous port" in problem.reason and "DISAGG_RANK_PORT" in problem.reason
    with pytest.raises(spec.SpecError, match=r"roles\[1\]\.ports\[1\]\.containerPort"):
        planner.plan(spec.parse_pipeline(doc), namespace=NS)
    one = _doc(nodes=1, ranks=1, ports=ports)  # one process: the port is the role's own
    assert planner.check(spec.parse_pipeline(one)) == []


def _sts(name: str, desired: int, ready: int, updated: int | None = None) -> Obj:
    return {
        "metadata": {"name": name, "labels": {names.LABEL_ROLE: "llm"}},
        "spec": {"replicas": desired},
        "status": {
            "replicas": desired,
            "readyReplicas": ready,
            "updatedReplicas": desired if updated is None else updated,
        },
    }


def test_status_counts_a_group_ready_only_as_far_as_every_member() -> None:
    pipeline = spec.parse_pipeline(_doc())
    observed = [_sts("mn-enc", 1, 1), _sts("mn-llm", 2, 2), _sts("mn-llm-w1", 2, 1)]
    built = status.build_status(pipeline, observed, generation=1, now=T0)
    llm = next(r for r in built["roles"] if r["name"] == "llm")
    assert (llm["desired"], llm["ready"]) == (2, 1)
    assert built["readyRoles"] == "1/2"
    missing = status.build_status(pipeline, observed[:2], generation=1, now=T0)
    assert next(r for r in missing["roles"] if r["name"] == "llm")["ready"] == 0


def test_a_rollout_counts_a_group_updated_when_every_member_is() -> None:
    planned = [
        {
            "kind": "StatefulSet",
            "metadata": {
                "name": name,
                "labels": {names.LABEL_ROLE: "llm"},
                "annotations": {names.ANNOTATION_TEMPLATE_HASH: "h"},
            },
            "spec": {"replicas": 2},
        }
        for name in ("mn-llm", "mn-llm-w1")
    ]
    live = [
        {**_sts("mn-llm", 2, 2, updated=2), **{"metadata": planned[0]["metadata"]}},
        {**_sts("mn-llm-w1", 2, 2, updated=1), **{"metadata": planned[1]["metadata"]}},
    ]
    units = rollout_state.observe(planned, live)
    assert list(units) == ["llm"] and units["llm"].updated == 1


# ------------------------------------------------------------------ group restart


def _pod(
    name: str,
    group: int,
    rank: int,
    created_s: float = 0.0,
    restarts: int = 0,
    deleting: bool = False,
    role: str = "llm",
) -> Obj:
    meta: Obj = {
        "name": name,
        "labels": {
            names.LABEL_ROLE: role,
            names.LABEL_NODE_RANK: str(rank),
            groups.POD_INDEX_LABEL: str(group),
        },
        "creationTimestamp": (T0 + datetime.timedelta(seconds=created_s)).strftime(
            "%Y-%m-%dT%H:%M:%SZ"
        ),
    }
    if deleting:
        meta["deletionTimestamp"] = meta["creationTimestamp"]
    return {"metadata": meta, "status": {"containerStatuses": [{"restartCount": restarts}]}}


def _group(g: int, leader_s: float = 0.0, worker_s: float = 0.0, **worker: Any) -> list[Obj]:
    return [
        _pod(f"mn-llm-{g}", g, 0, leader_s),
        _pod(f"mn-llm-w1-{g}", g, 1, worker_s, **worker),
    ]


LATER = T0 + datetime.timedelta(seconds=600)
SHAPE = {"llm": regroup.Shape(nodes=2, groups=2)}


def test_healthy_groups_are_left_alone() -> None:
    pods = _group(0) + _group(1, 2.0, 3.0)
    assert regroup.decide(pods, SHAPE, LATER) == regroup.Decision((), None)


@pytest.mark.parametrize(
    "change",
    [
        {"worker_s": 200.0},  # the worker was deleted and recreated alone
        {"leader_s": 200.0},  # the leader was
        {"restarts": 1},  # the worker's container restarted in place
    ],
)
def test_a_member_that_failed_or_was_replaced_restarts_its_whole_group(change: Obj) -> None:
    pods = _group(0) + _group(1, **change)
    decision = regroup.decide(pods, SHAPE, LATER)
    assert decision == regroup.Decision(("mn-llm-1", "mn-llm-w1-1"), None)


def test_a_deleted_member_takes_its_generation_of_the_group_along() -> None:
    leader, worker = _group(1)
    # the worker's deletion seen (the watch's DELETED event): the leader goes too
    assert regroup.decide([leader], SHAPE, LATER, gone=[worker]).delete == ("mn-llm-1",)
    # or its deletion begun (deletionTimestamp): likewise, the worker itself is left
    worker["metadata"]["deletionTimestamp"] = "2026-01-01T00:10:00Z"
    assert regroup.decide([leader, worker], SHAPE, LATER).delete == ("mn-llm-1",)
    # the leader's own deletion seen after the worker was recreated: nothing more
    fresh = _pod("mn-llm-w1-1", 1, 1, 300.0)
    assert regroup.decide([fresh], SHAPE, LATER, gone=[leader]).delete == ()
    # a scale-down (groups past the desired count) is the controllers' own
    shrunk = {"llm": regroup.Shape(nodes=2, groups=1)}
    assert regroup.decide([leader], shrunk, LATER, gone=[worker]).delete == ()


def test_restarts_wait_for_missing_members_and_a_settled_group() -> None:
    nodes = SHAPE
    assert regroup.decide(_group(1)[:1], nodes, LATER).delete == ()  # the controller's turn
    young = _group(1, worker_s=595.0)
    decision = regroup.decide(young, nodes, LATER)
    assert decision.delete == () and decision.recheck_s == pytest.approx(5.0)
    # roles that are not groups, pods without our labels: never touched
    other = [_pod("mn-enc-0", 0, 0, restarts=3, role="enc"), {"metadata": {"name": "x"}}]
    assert regroup.decide(other, nodes, LATER).delete == ()


def test_a_fresh_group_after_a_restart_is_whole() -> None:
    """The restart converges: members recreated together are within SPREAD_S."""
    pods = _group(1, leader_s=300.0, worker_s=301.0)
    assert regroup.decide(pods, SHAPE, LATER).delete == ()


def test_workers_serve_no_probes_nor_runtime_ports_and_the_autoscaler_skips_them() -> None:
    doc = _doc()
    doc["spec"]["roles"][1]["ports"] = [{"name": "debug", "containerPort": 5678}]
    found = _plan(doc)
    [leader] = found["StatefulSet", "mn-llm"]["spec"]["template"]["spec"]["containers"]
    [worker] = found["StatefulSet", "mn-llm-w1"]["spec"]["template"]["spec"]["containers"]
    assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(leader)
    assert not {"startupProbe", "readinessProbe", "livenessProbe"} & set(worker)
    assert [p["name"] for p in leader["ports"]] == ["ingress", "lane", "metrics", "debug"]
    assert [p["name"] for p in worker["ports"]] == ["debug"]
    # the autoscaler counts leaders only (a group's metrics are its leader's)
    pipeline = spec.parse_pipeline(_doc())
    plan = scaling.scaling_plan(pipeline)
    ready = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    pods = [
        {
            "metadata": {"name": n, "labels": {names.LABEL_ROLE: "llm", names.LABEL_NODE_RANK: r}},
            "spec": {"containers": [c]},
            "status": ready,
        }
        for n, r, c in (("mn-llm-0", "0", leader), ("mn-llm-w1-0", "1", worker))
    ]
    views = scaling.pod_views(pods, plan)
    assert [v.name for v in views.get("llm", [])] == ["mn-llm-0"]
