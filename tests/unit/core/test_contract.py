"""The env/topology contract: what the operator and `disagg up` render is what roles parse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from disagg_core import contract
from disagg_core.contract import ContractError, Peer, RoleConfig, Topology
from disagg_core.spec import load_pipeline_file, parse_pipeline
from disagg_runtime.local.supervisor import plan_local
from tests.support import EXAMPLES


@pytest.fixture
def t2v():
    return load_pipeline_file(EXAMPLES / "text-to-video.yaml")


def test_topology_from_pipeline_marks_entries_exits_and_refs(t2v):
    topo = Topology.from_pipeline(t2v)
    assert topo.entry_roles == ("encoder",)
    assert topo.exit_roles == ("decoder",)
    assert topo.roles["decoder"].upstream == ("denoiser",)
    [ref] = topo.roles["encoder"].refs_out
    assert (ref.source, ref.path, ref.target) == ("encoder", "text_embedding", "decoder")
    assert topo.roles["decoder"].refs_in == (ref,)
    assert topo.roles["denoiser"].refs_in == ()


def test_topology_json_round_trip(t2v):
    topo = Topology.from_pipeline(t2v, namespace="ml")
    again = Topology.from_json(json.loads(json.dumps(topo.to_json())))
    assert again == topo
    assert again.namespace == "ml"


def _fan(idempotent: dict[str, bool]) -> Topology:
    """ingest -> (left, right) -> fuse -> out, `ingest` also feeds `out` a tensor ref."""
    roles = [
        {
            "name": n,
            "handler": "m:f",
            **({"idempotent": v} if (v := idempotent.get(n)) is not None else {}),
        }
        for n in ("ingest", "left", "right", "fuse", "out")
    ]
    edges = [
        {"from": "ingest", "to": "left"},
        {"from": "ingest", "to": "right", "tensorRefs": [{"path": "x", "to": "out"}]},
        {"from": "left", "to": "fuse"},
        {"from": "right", "to": "fuse"},
        {"from": "fuse", "to": "out"},
    ]
    doc = {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggregatedPipeline",
        "metadata": {"name": "fan"},
        "spec": {"image": "i", "roles": roles, "edges": edges},
    }
    return Topology.from_pipeline(parse_pipeline(doc))


def test_roles_a_handed_back_request_may_have_run_at():
    topo = _fan({})
    assert topo.not_idempotent == frozenset() and topo.resend_unsafe() == {}
    assert topo.ran_before("ingest") == frozenset()  # the only entry: nothing ran before
    # the other branch may have run it; fuse (behind left and right) and out not
    assert topo.ran_before("left") == {"ingest", "right"}
    assert topo.ran_before("fuse") == {"ingest", "left", "right"}
    # out is reached through fuse, and by ingest's tensor ref: everything may have run
    assert topo.ran_before("out") == {"ingest", "left", "right", "fuse"}
    assert topo.ran_before("nope") == set(topo.roles)


def test_a_role_not_idempotent_is_in_the_topology_and_its_json():
    topo = _fan({"right": False, "left": True})
    assert topo.not_idempotent == {"right"}
    # handed back at left: right may have run it; at right itself or ingest: it did not
    assert topo.resend_unsafe() == {"left": {"right"}, "fuse": {"right"}, "out": {"right"}}
    doc = topo.to_json()
    assert [r.get("idempotent") for r in doc["roles"]] == [None, None, False, None, None]
    assert Topology.from_json(json.loads(json.dumps(doc))) == topo
    doc["roles"][0]["idempotent"] = "no"
    with pytest.raises(ContractError, match="idempotent is not a boolean"):
        Topology.from_json(doc)


@pytest.mark.parametrize(
    "bad",
    [None, [], {"version": 2}, {"version": 1, "pipeline": "p", "namespace": "", "roles": [{}]}],
)
def test_malformed_topology_is_a_contract_error(bad):
    with pytest.raises(ContractError, match="topology"):
        Topology.from_json(bad)


def test_render_then_parse_is_identity_for_every_local_replica(t2v, tmp_path):
    path = str(tmp_path / "topology.json")
    configs = plan_local(t2v, iter(range(20000, 20100)), path)
    contract.write_topology(configs[0].topology, path)
    assert [c.role for c in configs] == ["encoder", "denoiser", "denoiser", "decoder"]
    for config in configs:
        parsed = contract.parse_env(contract.render_env(config))
        assert parsed == config


def test_encoder_is_told_about_the_ref_target_too(t2v, tmp_path):
    configs = plan_local(t2v, iter(range(20000, 20100)), str(tmp_path / "t.json"))
    encoder = configs[0]
    assert {p.role for p in encoder.downstream} == {"denoiser", "decoder"}
    assert len(encoder.peer("denoiser").addresses) == 2  # both replicas


def _env(tmp_path: Path, t2v, **overrides: str) -> dict[str, str]:
    path = str(tmp_path / "topology.json")
    contract.write_topology(Topology.from_pipeline(t2v), path)
    env = {
        "DISAGG_PIPELINE": "text-to-video",
        "DISAGG_ROLE": "denoiser",
        "DISAGG_HANDLER": "m:f",
        "DISAGG_DOWNSTREAM": "decoder=text-to-video-decoder.ml.svc.cluster.local:7400",
        "DISAGG_TOPOLOGY_FILE": path,
    }
    env.update(overrides)
    return {k: v for k, v in env.items() if v != "<unset>"}


def test_defaults_and_replica_from_pod_name(tmp_path, t2v):
    env = _env(tmp_path, t2v, DISAGG_POD_NAME="text-to-video-denoiser-3")
    config = contract.parse_env(env)
    assert config.replica == 3
    assert config.ingress_port == contract.DEFAULT_INGRESS_PORT
    assert config.metrics_port == contract.DEFAULT_METRICS_PORT
    assert config.pool.size == 256 * 2**20
    assert config.peer("decoder").addresses == ("text-to-video-decoder.ml.svc.cluster.local:7400",)
    assert config.peer("decoder").relay == "auto"


def test_quantities_and_relays_parse(tmp_path, t2v):
    env = _env(
        tmp_path,
        t2v,
        DISAGG_POOL_SIZE="512Mi",
        DISAGG_POOL_MIN_BLOCK="2Mi",
        DISAGG_DOWNSTREAM="decoder=10.0.0.1:7400|10.0.0.2:7400@tcp",
        DISAGG_SAME_GPU_PEERS="decoder",
    )
    config = contract.parse_env(env)
    assert (config.pool.size, config.pool.min_block) == (512 * 2**20, 2 * 2**20)
    assert config.peer("decoder") == Peer("decoder", ("10.0.0.1:7400", "10.0.0.2:7400"), "tcp")
    assert config.same_gpu_peers == frozenset({"decoder"})


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"DISAGG_ROLE": "<unset>"}, "DISAGG_ROLE is required"),
        ({"DISAGG_ROLE": "nope"}, "not a role"),
        ({"DISAGG_HANDLER": "<unset>"}, "DISAGG_HANDLER is required"),
        ({"DISAGG_INGRESS_PORT": "x"}, "not an integer"),
        ({"DISAGG_POOL_DEVICE": "tpu"}, "POOL_DEVICE"),
        ({"DISAGG_POOL_SIZE": "lots"}, "DISAGG_POOL_SIZE=.lots."),
        ({"DISAGG_DOWNSTREAM": ""}, "lacks addresses for \\['decoder'\\]"),
        ({"DISAGG_DOWNSTREAM": "decoder"}, "not role=host:port"),
        ({"DISAGG_DOWNSTREAM": "decoder=host"}, "not host:port"),
        ({"DISAGG_DOWNSTREAM": "decoder=h:1@carrier-pigeon"}, "unknown relay"),
        ({"DISAGG_TOPOLOGY_FILE": "/nonexistent/t.json"}, "cannot read topology"),
        ({"DISAGG_HANDLER_ARGS": "{model"}, "HANDLER_ARGS is not JSON"),
        ({"DISAGG_HANDLER_ARGS": "[1]"}, "HANDLER_ARGS must be a JSON object"),
        ({"DISAGG_MAX_BATCH_SIZE": "0"}, "MAX_BATCH_SIZE='0' must be at least 1"),
        ({"DISAGG_MAX_BATCH_WAIT_MS": "soon"}, "MAX_BATCH_WAIT_MS='soon' is not a number"),
    ],
)
def test_bad_environment_names_the_variable(tmp_path, t2v, override, message):
    with pytest.raises(ContractError, match=message):
        contract.parse_env(_env(tmp_path, t2v, **override))


def test_role_config_is_frozen(tmp_path, t2v):
    config = contract.parse_env(_env(tmp_path, t2v))
    assert isinstance(config, RoleConfig)
    with pytest.raises(AttributeError):
        config.role = "x"  # type: ignore[misc]


def test_handler_args_and_batching_reach_the_role(tmp_path):
    doc = yaml.safe_load((EXAMPLES / "hf-llm.yaml").read_text())
    doc["spec"]["roles"][0]["handlerArgs"]["nested"] = {"layers": [0, 1], "on": True}
    pipeline = parse_pipeline(doc)
    configs = plan_local(pipeline, iter(range(20000, 20100)), str(tmp_path / "t.json"))
    contract.write_topology(configs[0].topology, str(tmp_path / "t.json"))
    prefill, decode = configs[0], configs[1]
    env = contract.render_env(prefill)
    assert json.loads(env["DISAGG_HANDLER_ARGS"])["nested"] == {"layers": [0, 1], "on": True}
    assert (env["DISAGG_MAX_BATCH_SIZE"], env["DISAGG_MAX_BATCH_WAIT_MS"]) == ("8", "5")
    again = contract.parse_env(env)
    assert again.handler_args == prefill.handler_args
    assert (again.max_batch_size, again.max_batch_wait_ms) == (8, 5.0)
    plain = contract.parse_env(contract.render_env(decode))
    assert plain.max_batch_size == 1 and "DISAGG_MAX_BATCH_SIZE" not in contract.render_env(decode)
