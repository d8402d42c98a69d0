"""The planner's engine roles (plan/engines.py): the vLLM server's command and connector
wiring, ports, probes, resources, env, Services, the NetworkPolicy and the gateway."""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import pytest

from disagg_core import contract, spec
from disagg_core.spec import SpecError
from disagg_core.spec.engines import DEFAULT_ENGINE_PORT, DEFAULT_KV_PORT
from disagg_operator.plan import engines, planner, pods
from disagg_operator.plan import model as plan_model
from tests.support import REPO

Obj = dict[str, Any]
NS = "ns"
DECODE_DNS = "pd-decode.ns.svc.cluster.local"


def _plan(doc: Obj, options: plan_model.PlanOptions | None = None) -> dict[str, dict[str, Obj]]:
    result: dict[str, dict[str, Obj]] = {}
    for obj in planner.plan(spec.parse_pipeline(doc), namespace=NS, options=options):
        result.setdefault(obj["kind"], {})[obj["metadata"]["name"]] = obj
    return result


def _container(objects: dict[str, dict[str, Obj]], unit: str, index: int = 0) -> Obj:
    sts = objects["StatefulSet"][f"pd-{unit}"]
    container: Obj = sts["spec"]["template"]["spec"]["containers"][index]
    return container


def _kv_config(container: Obj) -> Obj:
    argv = container["command"]
    config: Obj = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    return config


def test_the_command_is_the_contracts_with_the_kv_edges(engine_doc: Obj) -> None:
    objects = _plan(engine_doc)
    prefill, decode = _container(objects, "prefill"), _container(objects, "decode")
    pipeline = spec.parse_pipeline(engine_doc)
    launch = contract.EngineLaunch(
        name="prefill",
        host="0.0.0.0",
        port=8000,
        key_file=contract.DEFAULT_PEER_KEY_FILE,
        decodes=(f"tcp://pd-decode-0.{DECODE_DNS}:7601",),
    )
    assert prefill["command"] == contract.engine_command(pipeline, "prefill", launch)
    assert prefill["command"][:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    assert "args" not in prefill
    assert _kv_config(prefill)["kv_role"] == "kv_producer"
    consumer = _kv_config(decode)
    assert consumer["kv_role"] == "kv_consumer"
    assert consumer["kv_connector_extra_config"]["listen"] == "tcp://0.0.0.0:7601"
    assert consumer["kv_connector_extra_config"]["key_file"] == "/etc/disagg-peer-key/key"
    argv = decode["command"]
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"  # ranks: 2
    assert "--tensor-parallel-size" not in prefill["command"]


def test_prefill_knows_every_decode_replica_up_to_the_autoscalers_ceiling(
    engine_doc: Obj,
) -> None:
    engine_doc["spec"]["roles"][1]["replicas"] = 2
    endpoints = _kv_config(_container(_plan(engine_doc), "prefill"))["kv_connector_extra_config"]
    assert endpoints["decodes"] == [f"tcp://pd-decode-{i}.{DECODE_DNS}:7601" for i in (0, 1)]
    engine_doc["spec"]["roles"][1]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 4}
    before = _plan(engine_doc)
    config = _kv_config(_container(before, "prefill"))["kv_connector_extra_config"]
    assert len(config["decodes"]) == 4
    # the autoscaler moving decode inside its bounds does not roll the prefill pods
    after = _plan(engine_doc, plan_model.PlanOptions(replicas={"decode": 3}))
    assert after["StatefulSet"]["pd-decode"]["spec"]["replicas"] == 3
    sts = "StatefulSet", "pd-prefill"
    assert after[sts[0]][sts[1]] == before[sts[0]][sts[1]]


def test_colocated_engines_reach_each_other_on_loopback(engine_doc: Obj) -> None:
    engine_doc["spec"]["roles"][0]["engine"]["port"] = 8001
    engine_doc["spec"]["colocation"] = [{"name": "pair", "roles": ["prefill", "decode"]}]
    for role in engine_doc["spec"]["roles"]:
        role.pop("ranks", None)
    objects = _plan(engine_doc, plan_model.PlanOptions(gpu_mode="none"))
    prefill = _container(objects, "pair", 0)
    config = _kv_config(prefill)["kv_connector_extra_config"]
    assert config["decodes"] == ["tcp://127.0.0.1:7601"]
    decode = _container(objects, "pair", 1)
    assert [p["name"] for p in decode["ports"]] == ["engine-1", "kv-1"]


def test_ports_probes_env_resources_and_hardening(engine_doc: Obj) -> None:
    decode_role = engine_doc["spec"]["roles"][1]
    decode_role["resources"] = {"requests": {"nvidia.com/gpu": "1", "memory": "4Gi"}}
    decode_role["startupSeconds"] = 120
    decode_role["env"] = [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}]
    decode_role["podTemplate"] = {
        "spec": {"containers": [{"name": "decode", "env": [{"name": "HOME", "value": "/"}]}]}
    }
    decode = _container(_plan(engine_doc), "decode")
    assert decode["image"] == "registry.example/disagg-vllm:1"
    assert decode["ports"] == [
        {"name": "engine", "containerPort": 8000, "protocol": "TCP"},
        {"name": "kv", "containerPort": 7601, "protocol": "TCP"},
    ]
    health = {"path": "/health", "port": 8000}
    assert decode["startupProbe"]["httpGet"] == health
    assert decode["startupProbe"]["periodSeconds"] * decode["startupProbe"]["failureThreshold"] == (
        120
    )
    assert decode["readinessProbe"]["httpGet"] == health
    assert decode["livenessProbe"]["httpGet"] == health
    # GPUs and memory are per rank: ranks 2 asks for two GPUs (tensor parallel 2)
    assert decode["resources"]["requests"] == {"nvidia.com/gpu": "2", "memory": "8Gi"}
    names = [var["name"] for var in decode["env"]]
    assert names == ["HOME", "DISAGG_POD_NAME", "VLLM_LOGGING_LEVEL"]
    assert decode["env"][0] == {"name": "HOME", "value": "/tmp"}, "a podTemplate cannot move it"
    assert not any(n.startswith("DISAGG_") and n != "DISAGG_POD_NAME" for n in names)
    security = decode["securityContext"]
    assert security["readOnlyRootFilesystem"] and security["runAsNonRoot"]
    mounts = {m["name"]: m["mountPath"] for m in decode["volumeMounts"]}
    assert mounts["peer-key"] == "/etc/disagg-peer-key" and mounts["tmp"] == "/tmp"
    assert mounts["topology"] == "/etc/disagg"


def test_services_expose_the_engines_ports(engine_doc: Obj) -> None:
    services = _plan(engine_doc)["Service"]
    prefill = services["pd-prefill"]["spec"]
    assert prefill["clusterIP"] == "None"
    assert [(p["name"], p["port"]) for p in prefill["ports"]] == [("engine", 8000)]
    decode = services["pd-decode"]["spec"]["ports"]
    assert [(p["name"], p["port"]) for p in decode] == [("engine", 8000), ("kv", 7601)]


def test_the_network_policy_admits_kv_from_prefill_and_http_from_the_gateway(
    engine_doc: Obj,
) -> None:
    options = plan_model.PlanOptions(metrics_namespaces=("disagg-system",))
    policy = _plan(engine_doc, options)["NetworkPolicy"]["pd-network"]
    rules = policy["spec"]["ingress"]
    assert all(rule["ports"] for rule in rules), "a rule without ports admits every port"
    by_port: dict[int, list[Obj]] = {}
    for rule in rules:
        for port in rule["ports"]:
            by_port.setdefault(port["port"], []).extend(rule["from"])
    assert set(by_port) == {8000, 7601}, "no runtime port is open on an engine pod"
    kv = by_port[7601]
    assert len(kv) == 1
    selector = kv[0]["podSelector"]
    assert selector["matchExpressions"] == [
        {"key": "disagg.dev/role", "operator": "In", "values": ["prefill"]}
    ]
    gateway = {"app.kubernetes.io/component": "gateway", "disagg.dev/pipeline": "pd"}
    http = by_port[8000]
    assert any(p.get("podSelector", {}).get("matchLabels") == gateway for p in http)
    assert any("namespaceSelector" in p for p in http), "the autoscaler scrapes /metrics"


def _gateway_pod(objects: dict[str, dict[str, Obj]], name: str) -> tuple[Obj, Obj, set[int]]:
    """The gateway's container, its pod spec and the ports its NetworkPolicy admits."""
    pod: Obj = objects["Deployment"][f"{name}-gateway"]["spec"]["template"]["spec"]
    policy = objects["NetworkPolicy"][f"{name}-gateway-network"]["spec"]["ingress"]
    return pod["containers"][0], pod, {p["port"] for rule in policy for p in rule["ports"]}


@pytest.mark.parametrize("doc", ["engine_doc", "full_doc"])
def test_only_a_gateway_over_handler_roles_has_the_reply_path(
    doc: str, request: pytest.FixtureRequest
) -> None:
    """In front of engines the gateway is no peer: no entry roles to submit to, no reply
    port, pool, pod address or peer key; over handler roles it has them all."""
    document = request.getfixturevalue(doc)
    pipeline = spec.parse_pipeline(document)
    objects = _plan(document)
    container, pod, admitted = _gateway_pod(objects, pipeline.name)
    names = {v["name"] for v in container["env"]}
    mounts = {m["name"] for m in container["volumeMounts"]}
    reply_path = {contract.PREFIX + key for key in contract.REPLY_PATH} & names
    ports = {p["name"] for p in container["ports"]}
    if doc == "engine_doc":
        assert reply_path == set(), "what only gateway.server.client_for reads"
        assert ports == {"http"} and admitted == {pipeline.gateway.port}
        assert pods.PEER_KEY_VOLUME not in mounts | {v["name"] for v in pod["volumes"]}
        assert contract.PREFIX + "GATEWAY_API" in names
    else:
        env = {v["name"]: v.get("value") for v in container["env"]}
        entry = pipeline.entry_roles[0]
        assert env["DISAGG_DOWNSTREAM"].startswith(f"{entry}={pipeline.derived_name(entry)}.")
        assert {"DISAGG_INGRESS_PORT", "DISAGG_PEER_KEY_FILE", "DISAGG_POD_IP"} <= reply_path
        assert ports == {"http", "ingress"} and contract.DEFAULT_INGRESS_PORT in admitted
        assert pods.PEER_KEY_VOLUME in mounts


def _problems(doc: Obj) -> list[str]:
    with pytest.raises(SpecError) as raised:
        planner.plan(spec.parse_pipeline(doc), namespace=NS)
    return [f"{p.path}: {p.reason}" for p in raised.value.problems]


def test_the_planner_refuses_what_it_cannot_render(engine_doc: Obj) -> None:
    doc = copy.deepcopy(engine_doc)
    doc["spec"]["roles"][1]["nodes"] = 2
    assert any(p.startswith("spec.roles[1].nodes") for p in _problems(doc))
    doc = copy.deepcopy(engine_doc)
    doc["spec"]["colocation"] = [{"name": "pair", "roles": ["prefill", "decode"]}]
    for role in doc["spec"]["roles"]:
        role.pop("ranks", None)
    assert any("spec.roles[1].engine.port: 8000 is also a port" in p for p in _problems(doc))
    doc = copy.deepcopy(engine_doc)
    doc["spec"]["roles"][0]["ports"] = [{"name": "kv", "containerPort": 8000}]
    found = _problems(doc)
    assert any(p.startswith("spec.roles[0].ports[0].name") for p in found)
    assert any(p.startswith("spec.roles[0].ports[0].containerPort") for p in found)


def test_handler_pipelines_render_as_before(full_doc: Obj) -> None:
    """No engine: no engine port, the runtime's ports and probes as ever."""
    for obj in planner.plan(spec.parse_pipeline(full_doc), namespace=NS):
        if obj["kind"] != "StatefulSet":
            continue
        for container in obj["spec"]["template"]["spec"]["containers"]:
            assert not any(
                str(p["name"]).split("-")[0] in engines.RESERVED_PORT_NAMES
                for p in container["ports"]
            )
            assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"


def test_the_engine_image_recipe_runs_what_the_planner_renders(engine_doc: Obj) -> None:
    text = (REPO / "docker" / "runtime-vllm.Dockerfile").read_text()
    makefile = (REPO / "Makefile").read_text()
    [pin] = re.findall(r"^VLLM := (\S+)$", makefile, re.MULTILINE)
    assert f"ARG VLLM={pin}" in text, "the image and `make venv-vllm` pin one vLLM"
    [entry] = re.findall(r"^ENTRYPOINT (\[.*\])$", text, re.MULTILINE)
    command = _container(_plan(engine_doc), "decode")["command"]
    assert command[: len(json.loads(entry))] == json.loads(entry)
    assert f"USER {pods.NONROOT_ID}:{pods.NONROOT_ID}" in text
    assert f"EXPOSE {DEFAULT_ENGINE_PORT} {DEFAULT_KV_PORT}" in text
    assert f"ENV HOME={engines.HOME}" in text
    assert not re.findall(r"^COPY ", text, re.MULTILINE), "its build context is empty"


def _topology(objects: dict[str, dict[str, Obj]]) -> contract.Topology:
    text = objects["ConfigMap"]["pd-topology"]["data"]["topology.json"]
    return contract.Topology.from_json(json.loads(text))


def _gateway_env(objects: dict[str, dict[str, Obj]]) -> dict[str, str]:
    container = objects["Deployment"]["pd-gateway"]["spec"]["template"]["spec"]["containers"][0]
    return {v["name"]: v["value"] for v in container["env"] if "value" in v}


def test_the_topology_gives_the_gateway_every_engine_replica_up_to_the_ceiling(
    engine_doc: Obj,
) -> None:
    engine_doc["spec"]["roles"][1]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 3}
    objects = _plan(engine_doc)
    table = _topology(objects).engines
    assert table is not None
    assert table.route == contract.EngineRoute("prefill", "decode", "tcp")
    prefill_dns = "pd-prefill.ns.svc.cluster.local"
    assert [r.url for r in table.replicas["prefill"]] == [f"http://pd-prefill-0.{prefill_dns}:8000"]
    decodes = table.replicas["decode"]
    assert [r.key for r in decodes] == ["decode/0", "decode/1", "decode/2"]
    assert [r.url for r in decodes] == [f"http://pd-decode-{i}.{DECODE_DNS}:8000" for i in range(3)]
    told = _kv_config(_container(objects, "prefill"))["kv_connector_extra_config"]["decodes"]
    assert [r.kv_endpoint for r in decodes] == told, "one derivation: the prefill's allow-list"
    # the gateway's pods see the same file and start an engine gateway from it
    config = contract.parse_gateway_env(_gateway_env(objects), topology=_topology(objects))
    assert config.topology.engines == table and config.api == "openai"
    # scaling decode inside its bounds changes neither the file nor the gateway's pods
    scaled = _plan(engine_doc, plan_model.PlanOptions(replicas={"decode": 3}))
    assert scaled["ConfigMap"] == objects["ConfigMap"]
    assert scaled["Deployment"] == objects["Deployment"]
    # a new ceiling is a new list: the gateway's pods roll to read it
    engine_doc["spec"]["roles"][1]["autoscaling"]["maxReplicas"] = 4
    wider = _plan(engine_doc)
    hash_key = "disagg.dev/spec-hash"
    meta = [o["Deployment"]["pd-gateway"]["spec"]["template"]["metadata"] for o in (objects, wider)]
    assert meta[0]["annotations"][hash_key] != meta[1]["annotations"][hash_key]


def test_colocated_engines_are_paired_in_the_gateways_table(engine_doc: Obj) -> None:
    engine_doc["spec"]["roles"][0]["engine"]["port"] = 8001
    engine_doc["spec"]["colocation"] = [{"name": "pair", "roles": ["prefill", "decode"]}]
    for role in engine_doc["spec"]["roles"]:
        role.pop("ranks", None)
    objects = _plan(engine_doc, plan_model.PlanOptions(gpu_mode="none"))
    table = _topology(objects).engines
    assert table is not None and table.route.paired
    pods_dns = "pd-prefill.ns.svc.cluster.local"  # the governing Service: the first role's
    assert [r.url for r in table.replicas["prefill"]] == [f"http://pd-pair-0.{pods_dns}:8001"]
    assert [(r.url, r.kv_endpoint) for r in table.replicas["decode"]] == [
        (f"http://pd-pair-0.{pods_dns}:8000", "tcp://127.0.0.1:7601")
    ]


def test_handler_pipelines_have_no_engines_section(full_doc: Obj) -> None:
    objects = _plan(full_doc)
    text = next(iter(objects["ConfigMap"].values()))["data"]["topology.json"]
    assert "engines" not in json.loads(text)
    assert '"engine"' not in text
