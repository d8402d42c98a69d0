"""One derivation of a role's contract: the operator's planner and `disagg up` give every role
the same RoleConfig apart from where it runs (addresses, ports, replica, bind host, files)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import yaml

from disagg_core import placement, spec
from disagg_core.contract import Peer, RoleConfig
from disagg_core.spec.model import Pipeline
from disagg_operator.plan import model as plan_model
from disagg_runtime.local.supervisor import plan_local
from tests.support import REPO

PIPELINE_FILES = sorted(
    [
        *REPO.glob("examples/*.yaml"),
        *REPO.glob("manifests/samples/**/*.yaml"),
        *REPO.glob("tests/**/*.yaml"),
    ]
)


def _pipelines() -> list[tuple[str, Pipeline]]:
    found = []
    for path in PIPELINE_FILES:
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if not isinstance(doc, dict) or doc.get("kind") != "DisaggregatedPipeline":
                continue
            try:
                pipeline = spec.parse_pipeline(doc)
            except spec.SpecError:
                continue  # deliberately invalid documents
            found.append((f"{path.relative_to(REPO)}#{i}", pipeline))
    return found


PIPELINES = _pipelines()


def _where_it_runs_removed(config: RoleConfig) -> RoleConfig:
    """`config` with every placement-specific value blanked out."""
    return dataclasses.replace(
        config,
        namespace="",
        replica=0,
        topology=dataclasses.replace(config.topology, namespace=""),
        downstream=tuple(Peer(p.role, (), p.relay) for p in config.downstream),
        node_local=False,
        bind_host="",
        ingress_port=0,
        lane_port=0,
        metrics_port=0,
        topology_file="",
        peers_file="",
        peer_key_file="",  # a mounted Secret in pods, a per-run file locally
    )


def test_the_pipelines_of_the_repository_are_found():
    names = {name.split("#")[0] for name, _ in PIPELINES}
    assert "examples/text-to-video.yaml" in names
    assert "tests/unit/operator/full-pipeline.yaml" in names
    assert len(PIPELINES) >= 10


@pytest.mark.parametrize(("name", "pipeline"), PIPELINES, ids=[n for n, _ in PIPELINES])
def test_pods_and_local_processes_get_the_same_contract(name, pipeline):
    local = plan_local(pipeline, itertools.count(30000), "/tmp/topology.json")
    for role in pipeline.roles:
        in_pod = _where_it_runs_removed(plan_model.role_config(pipeline, role.name, namespace="ns"))
        replicas = [c for c in local if c.role == role.name]
        assert replicas, role.name
        for config in replicas:
            assert _where_it_runs_removed(config) == in_pod, (name, role.name)


def test_edge_relays_reach_both_derivations():
    """The bug this module fixed: `disagg up` dropped each edge's relay (everything ran `auto`)."""
    pipeline = dict(PIPELINES)["tests/unit/operator/full-pipeline.yaml#0"]
    wanted = {(edge.source, edge.target): pipeline.relay_for(edge) for edge in pipeline.edges}
    assert set(wanted.values()) >= {"tcp", "cuda-ipc"}
    for config in plan_local(pipeline, itertools.count(30000), "/tmp/t.json"):
        for peer in config.downstream:
            if (config.role, peer.role) in wanted:
                assert peer.relay == wanted[config.role, peer.role]


def test_targets_are_edges_then_reference_only_targets():
    doc = {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggregatedPipeline",
        "metadata": {"name": "p"},
        "spec": {
            "image": "img",
            "roles": [{"name": n, "handler": "m:f"} for n in ("a", "b", "c")],
            "edges": [
                {"from": "a", "to": "b", "relay": "tcp", "tensorRefs": [{"path": "x", "to": "c"}]},
                {"from": "b", "to": "c"},
            ],
        },
    }
    pipeline = spec.parse_pipeline(doc)
    assert placement.targets(pipeline, "a") == ("b", "c")
    assert placement.relays(pipeline, "a") == {"b": "tcp", "c": "auto"}
    assert placement.targets(pipeline, "c") == ()
