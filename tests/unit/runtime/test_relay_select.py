"""`auto` across nodes: nixl towards peers whose pods, like ours, request an RDMA device,
when this process has nixl; tcp otherwise, with the reason logged."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from disagg_core import placement, spec
from disagg_core.contract import ContractError, render_env
from disagg_runtime.relay.backends import nixl
from disagg_runtime.relay.select import relay_kind
from tests.relay_rig import NIXL_MISSING, a_to_b_config


@pytest.mark.skipif(NIXL_MISSING is not None, reason=f"no nixl: {NIXL_MISSING}")
def test_auto_is_nixl_to_rdma_peers_where_nixl_is_here() -> None:
    assert relay_kind(a_to_b_config(rdma_peers=frozenset({"b"})), "b", "auto") == "nixl"
    assert relay_kind(a_to_b_config(), "b", "auto") == "tcp"
    assert (
        relay_kind(a_to_b_config(rdma_peers=frozenset({"b"}), node_local=True), "b", "auto")
        == "shm"
    )
    assert relay_kind(a_to_b_config(), "b", "nixl") == "nixl"  # asked for: no RDMA needed


def test_without_nixl_auto_falls_back_to_tcp_and_an_explicit_nixl_fails_at_start(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(nixl, "unavailable_reason", lambda: "nixl is not installed")
    caplog.set_level(logging.INFO, logger="disagg_runtime.relay.select")
    assert relay_kind(a_to_b_config(rdma_peers=frozenset({"b"})), "b", "auto") == "tcp"
    assert "nixl relay is not possible (nixl is not installed); using tcp" in caplog.text
    with pytest.raises(ContractError, match=r"edge a->b: relay nixl needs the nixl package"):
        relay_kind(a_to_b_config(), "b", "nixl")


def _pipeline(resources: dict[str, dict[str, Any]]) -> spec.Pipeline:
    roles = []
    for name in ("a", "b", "c"):
        role: dict[str, Any] = {"name": name, "handler": "m:f"}
        if name in resources:
            role["resources"] = resources[name]
        roles.append(role)
    return spec.parse_pipeline(
        {
            "apiVersion": "disagg.dev/v1alpha1",
            "kind": "DisaggregatedPipeline",
            "metadata": {"name": "p"},
            "spec": {
                "image": "img",
                "roles": roles,
                "edges": [{"from": "a", "to": "b"}, {"from": "a", "to": "c"}],
            },
        }
    )


def test_rdma_peers_are_targets_whose_pods_request_rdma_as_ours_does() -> None:
    hca = {"limits": {"rdma/hca_shared_devices_a": "1"}}
    both = _pipeline({"a": hca, "b": {"requests": {"rdma/rdma_shared_device_a": "1"}}})
    assert placement.rdma_peers(both, "a") == frozenset({"b"})  # c has none
    assert placement.rdma_peers(_pipeline({"b": hca, "c": hca}), "a") == frozenset()  # a has none
    config = placement.role_config(
        both, "a", placement.Placement(namespace="ns", addresses={"b": ("b:1",), "c": ("c:1",)})
    )
    assert config.rdma_peers == frozenset({"b"})
    assert render_env(config)["DISAGG_RDMA_PEERS"] == "b"
