"""Revision pairing rules (disagg_core.compat), the spec fields that set them and the
contract variables that carry them to a role."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from disagg_core import compat, contract, placement
from disagg_core.compat import Compat, compatible
from disagg_core.spec import SpecError, parse_pipeline

V1, V2 = Compat("v1"), Compat("v2")
AUTO = Compat(compat.default_token("m:h", "img:1"))


@pytest.mark.parametrize(
    ("a", "b", "ok"),
    [
        (V1, V1, True),
        (V1, V2, False),
        (Compat("v2", frozenset({"v1"})), V1, True),  # a declared list works either way round
        (V1, Compat("v2", frozenset({"v1"})), True),
        (Compat("v3", frozenset({"v1"})), V2, False),
        (AUTO, V2, True),  # a role that declares nothing pairs with anything
        (V2, AUTO, True),
        (None, V2, True),  # a peer that advertises nothing (a client, an older runtime)
        (V2, None, True),
    ],
)
def test_the_pairing_rule(a: Compat | None, b: Compat | None, ok: bool) -> None:
    assert compatible(a, b) is ok


def test_the_default_token_names_handler_and_image() -> None:
    token = compat.default_token("m:h", "img:1")
    assert token.startswith(compat.AUTO_PREFIX) and not Compat(token).declared
    assert token == compat.default_token("m:h", "img:1")
    assert token != compat.default_token("m:h", "img:2")
    assert token != compat.default_token("m:g", "img:1")


def test_wire_form_round_trips() -> None:
    c = Compat("kv-2", frozenset({"kv-1", "kv.0"}))
    assert Compat.from_wire(c.to_wire()) == c
    assert Compat.from_wire(AUTO.to_wire()) == AUTO


@pytest.mark.parametrize(
    ("obj", "names"),
    [
        ("v1", "must be an object"),
        ({"token": 3}, "compat.token"),
        ({"token": "bad token"}, "compat.token"),
        ({"token": "auto:xyz"}, "compat.token"),  # auto tokens are hex
        ({"token": "v1", "accepts": "v0"}, "compat.accepts"),
        ({"token": "v1", "accepts": ["ok", "-no"]}, "compat.accepts[1]"),
        ({"token": "v1", "accepts": ["a"] * 33}, "compat.accepts"),
        ({"token": "v1", "extra": 1}, "unknown fields"),
    ],
)
def test_malformed_wire_objects_are_refused_naming_the_field(obj: object, names: str) -> None:
    with pytest.raises(compat.CompatError, match=names.replace("[", r"\[").replace("]", r"\]")):
        Compat.from_wire(obj)


def _doc() -> dict[str, Any]:
    return {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggregatedPipeline",
        "metadata": {"name": "pd"},
        "spec": {
            "image": "img:1",
            "roles": [
                {"name": "prefill", "handler": "m:p", "compat": "kv-2"},
                {"name": "decode", "handler": "m:d", "compat": "kv-2"},
            ],
            "edges": [{"from": "prefill", "to": "decode"}],
        },
    }


def _errors(doc: dict[str, Any]) -> str:
    with pytest.raises(SpecError) as info:
        parse_pipeline(doc)
    return str(info.value)


def test_spec_fields_parse_and_reach_the_contract() -> None:
    doc = _doc()
    doc["spec"]["roles"][1]["compatibleWith"] = ["kv-1"]
    pipeline = parse_pipeline(doc)
    assert pipeline.role("decode").compat == "kv-2"
    assert pipeline.role("decode").compatible_with == ("kv-1",)
    where = placement.Placement(namespace="ns", addresses={"decode": ("d:1",)})
    config = placement.role_config(pipeline, "decode", where)
    env = contract.render_env(config)
    assert env["DISAGG_COMPAT"] == "kv-2" and env["DISAGG_COMPATIBLE_WITH"] == "kv-1"
    back = contract.parse_env(env, topology=config.topology)
    assert (back.compat, back.compatible_with) == ("kv-2", frozenset({"kv-1"}))


def test_a_role_without_a_token_gets_the_auto_one_of_its_handler_and_image() -> None:
    doc = _doc()
    del doc["spec"]["roles"][0]["compat"]
    pipeline = parse_pipeline(doc)
    where = placement.Placement(namespace="ns", addresses={"decode": ("d:1",)})
    config = placement.role_config(pipeline, "prefill", where)
    assert config.compat == compat.default_token("m:p", "img:1")
    assert contract.parse_env(contract.render_env(config), config.topology).compat == config.compat


def test_bad_tokens_are_spec_errors_naming_the_field() -> None:
    doc = _doc()
    doc["spec"]["roles"][0]["compat"] = "auto:abc"
    doc["spec"]["roles"][1]["compatibleWith"] = ["ok", 5]
    errors = _errors(doc)
    assert "spec.roles[0].compat" in errors and "spec.roles[1].compatibleWith[1]" in errors


def test_neighbours_whose_declared_tokens_never_pair_are_refused() -> None:
    doc = _doc()
    doc["spec"]["roles"][1]["compat"] = "kv-3"
    assert "spec.roles[1].compat" in _errors(doc)
    paired = copy.deepcopy(doc)
    paired["spec"]["roles"][1]["compatibleWith"] = ["kv-2"]
    parse_pipeline(paired)


def test_malformed_contract_variables_are_refused() -> None:
    pipeline = parse_pipeline(_doc())
    where = placement.Placement(namespace="ns", addresses={"decode": ("d:1",)})
    env = contract.render_env(placement.role_config(pipeline, "prefill", where))
    for name, bad in (("DISAGG_COMPAT", "no spaces"), ("DISAGG_COMPATIBLE_WITH", "a,-b")):
        with pytest.raises(contract.ContractError, match=name):
            contract.parse_env({**env, name: bad}, topology=parse_topology(pipeline))


def parse_topology(pipeline: Any) -> contract.Topology:
    return contract.Topology.from_pipeline(pipeline)
