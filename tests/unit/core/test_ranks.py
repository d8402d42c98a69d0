"""`roles[].ranks` / `roles[].nodes` in the spec, the CRD and the contract (issue 33)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml

from disagg_core import contract, placement, quantity, spec
from disagg_core.contract import ContractError
from disagg_core.spec import limits
from disagg_operator.gen import crd_roles
from tests.support import EXAMPLES


def _doc(**role: Any) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((EXAMPLES / "hf-llm.yaml").read_text())
    doc["spec"]["roles"][1].update(role)
    return doc


def test_defaults_are_one_rank_one_node() -> None:
    decode = spec.parse_pipeline(_doc()).roles[1]
    assert (decode.ranks, decode.nodes, decode.world_size) == (1, 1, 1)
    decode = spec.parse_pipeline(_doc(ranks=4, nodes=2)).roles[1]
    assert (decode.ranks, decode.nodes, decode.world_size) == (4, 2, 8)


@pytest.mark.parametrize(
    ("role", "where", "reason"),
    [
        ({"ranks": 0}, "ranks", "at least 1"),
        ({"ranks": limits.MAX_RANKS + 1}, "ranks", f"at most {limits.MAX_RANKS}"),
        ({"nodes": 0}, "nodes", "at least 1"),
        ({"nodes": limits.MAX_NODES + 1}, "nodes", f"at most {limits.MAX_NODES}"),
        ({"ranks": "2"}, "ranks", "integer"),
        ({"nodes": True}, "nodes", "integer"),
    ],
)
def test_bad_ranks_and_nodes_name_the_field(role: dict[str, Any], where: str, reason: str) -> None:
    with pytest.raises(spec.SpecError) as caught:
        spec.parse_pipeline(_doc(**role))
    [problem] = caught.value.problems
    assert problem.path == f"spec.roles[1].{where}"
    assert reason in problem.reason, problem.reason


@pytest.mark.parametrize("key", ["ranks", "nodes"])
def test_a_colocated_role_cannot_have_ranks_or_nodes(key: str) -> None:
    doc = _doc(**{key: 2})
    doc["spec"]["colocation"] = [{"roles": ["prefill", "decode"]}]
    with pytest.raises(spec.SpecError) as caught:
        spec.parse_pipeline(doc)
    [problem] = caught.value.problems
    assert problem.path == f"spec.roles[1].{key}" and "colocation group" in problem.reason


def test_the_crd_carries_the_bounds_and_defaults() -> None:
    role = crd_roles.role_schema()["properties"]
    for key, most in (("ranks", limits.MAX_RANKS), ("nodes", limits.MAX_NODES)):
        assert role[key]["minimum"] == 1 and role[key]["maximum"] == most
        assert role[key]["default"] == 1 and role[key]["type"] == "integer"


def _config(**role: Any) -> contract.RoleConfig:
    pipeline = spec.parse_pipeline(_doc(**role))
    where = placement.Placement(namespace="ml", addresses={}, rank_port=29511, node_rank=1)
    return placement.role_config(pipeline, "decode", where)


def test_rank_env_is_rendered_only_for_several_ranks(tmp_path: Any) -> None:
    lone = contract.render_env(_config())
    assert not contract.role.RANK_KEYS & lone.keys()
    env = contract.render_env(_config(ranks=2, nodes=2))
    assert {k: env[k] for k in contract.role.RANK_KEYS} == {
        "DISAGG_RANKS": "2",
        "DISAGG_NODES": "2",
        "DISAGG_NODE_RANK": "1",
        "DISAGG_LEADER": "127.0.0.1",
        "DISAGG_RANK_PORT": "29511",
    }
    config = _config(ranks=2, nodes=2)
    path = tmp_path / "topology.json"
    contract.write_topology(config.topology, str(path))
    parsed = contract.parse_env({**env, "DISAGG_TOPOLOGY_FILE": str(path)})
    assert (parsed.ranks, parsed.nodes, parsed.node_rank, parsed.rank_port) == (2, 2, 1, 29511)


def test_each_rank_gets_the_torch_distributed_variables() -> None:
    config = _config(ranks=2, nodes=2)
    ranks = contract.pod_ranks(config)
    assert [r.env() for r in ranks] == [
        {
            "RANK": str(2 + local),
            "WORLD_SIZE": "4",
            "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "29511",
        }
        for local in (0, 1)
    ]
    assert not any(r.leader for r in ranks)  # node 1: rank 0 is on the leader pod
    assert contract.rank_of(config, {}) == ranks[0]
    assert contract.rank_of(config, ranks[1].env()) == ranks[1]
    with pytest.raises(ContractError, match=r"LOCAL_RANK=2 is not in 0\.\.1"):
        contract.rank_of(config, {"LOCAL_RANK": "2"})
    with pytest.raises(ContractError, match="RANK='0', but"):
        contract.rank_of(config, {**ranks[1].env(), "RANK": "0"})


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"DISAGG_RANKS": "0"}, "DISAGG_RANKS=0 must be at least 1"),
        ({"DISAGG_NODE_RANK": "2"}, r"DISAGG_NODE_RANK=2 is not in 0\.\.1"),
        ({"DISAGG_RANK_PORT": "70000"}, "DISAGG_RANK_PORT=70000 is not a port"),
        ({"DISAGG_NODES": "x"}, "DISAGG_NODES='x' is not an integer"),
    ],
)
def test_bad_rank_variables_are_named(
    tmp_path: Any, override: dict[str, str], message: str
) -> None:
    config = _config(ranks=2, nodes=2)
    path = tmp_path / "topology.json"
    contract.write_topology(config.topology, str(path))
    env = {**contract.render_env(config), "DISAGG_TOPOLOGY_FILE": str(path), **override}
    with pytest.raises(ContractError, match=message):
        contract.parse_env(copy.deepcopy(env))


@pytest.mark.parametrize(
    ("value", "factor", "scaled"),
    [
        ("1", 4, "4"),
        ("500m", 2, "1000m"),
        ("1.5Gi", 2, "3Gi"),
        ("0.25", 3, "0.75"),
        ("1e3", 2, "2e3"),
        ("16Gi", 1, "16Gi"),
    ],
)
def test_per_rank_quantities_scale_in_their_own_unit(value: str, factor: int, scaled: str) -> None:
    assert quantity.scale_quantity(value, factor) == scaled
    assert quantity.parse_quantity(scaled) == quantity.parse_quantity(value) * factor
