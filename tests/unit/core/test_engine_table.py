"""The gateway's engine table (contract/engine_table.py): its JSON in the topology file,
and the refusals, naming what is missing, of a gateway that cannot route to engines."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

from disagg_core import contract, spec
from disagg_core.contract import ContractError, EngineEndpoint, EngineRoute, EngineTable
from tests.unit.core.test_spec_engines import doc

DECODE = "pd-decode.ns.svc.cluster.local"
TABLE = EngineTable(
    EngineRoute("prefill", "decode", "tcp"),
    {
        "prefill": (EngineEndpoint("prefill/0", "http://p-0:8000"),),
        "decode": tuple(
            EngineEndpoint(f"decode/{i}", f"http://d-{i}.{DECODE}:8000", f"tcp://d-{i}:7601")
            for i in range(3)
        ),
    },
)
ENV = {
    "DISAGG_PIPELINE": "pd",
    "DISAGG_NAMESPACE": "ns",
    "DISAGG_DOWNSTREAM": "prefill=pd-prefill.ns.svc:8000",
    "DISAGG_GATEWAY_API": "openai",
    "DISAGG_GATEWAY_MODEL": "tiny",
}


def _topology(table: EngineTable | None = TABLE) -> contract.Topology:
    topo = contract.Topology.from_pipeline(spec.parse_pipeline(doc()), namespace="ns")
    return dataclasses.replace(topo, engines=table)


def test_the_table_round_trips_through_the_topology_file() -> None:
    document = _topology().to_json()
    assert document["engines"]["replicas"]["decode"][2] == {
        "url": f"http://d-2.{DECODE}:8000",
        "kv": "tcp://d-2:7601",
    }
    assert [r["engine"] for r in document["roles"]] == [True, True]
    back = contract.Topology.from_json(copy.deepcopy(document))
    assert back.engines == TABLE and back.engine_roles == ("prefill", "decode")
    assert "engines" not in _topology().to_json(only=("decode",)), "a role's slice: no table"


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda e: e["replicas"].pop("decode"), "engines.replicas.decode lists no replica"),
        (lambda e: e["replicas"]["decode"][1].pop("kv"), "engines.replicas.decode[1].kv"),
        (lambda e: e["replicas"]["prefill"][0].update(url="p-0:80"), "prefill[0].url"),
        (lambda e: e.pop("entry"), "engines.entry"),
        (lambda e: e.update(relay="nixl"), "engines.relay"),
        (lambda e: e.pop("replicas"), "engines.replicas is missing"),
    ],
)
def test_a_table_that_lacks_what_the_gateway_needs_is_refused(edit: Any, named: str) -> None:
    document = _topology().to_json()
    edit(document["engines"])
    with pytest.raises(ContractError, match=named.replace("[", r"\[").replace("]", r"\]")):
        contract.Topology.from_json(document)


def test_the_gateway_env_with_engines() -> None:
    config = contract.parse_gateway_env(ENV, topology=_topology())
    assert config.topology.engines == TABLE
    no_downstream = {k: v for k, v in ENV.items() if k != "DISAGG_DOWNSTREAM"}
    assert contract.parse_gateway_env(no_downstream, topology=_topology()).entries == ()


def test_a_gateway_in_front_of_engines_without_the_table_refuses_to_start() -> None:
    with pytest.raises(ContractError, match=r"engine roles \['prefill', 'decode'\].*no `engines`"):
        contract.parse_gateway_env(ENV, topology=_topology(None))
    native = ENV | {"DISAGG_GATEWAY_API": "native"}
    with pytest.raises(ContractError, match="only the OpenAI API"):
        contract.parse_gateway_env(native, topology=_topology())


def test_replica_endpoint_is_one_derivation() -> None:
    pipeline = spec.parse_pipeline(doc())
    decode = contract.replica_endpoint(pipeline, "decode", 2, host="h", port=1, kv_port=2)
    assert decode == EngineEndpoint("decode/2", "http://h:1", "tcp://h:2")
    prefill = contract.replica_endpoint(pipeline, "prefill", 0, host="h", port=1, kv_port=2)
    assert prefill.kv_endpoint == ""
