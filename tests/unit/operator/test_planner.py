"""The planner: names, placement, the env contract round trip, pod templates, GPU modes,
podTemplate merging, labels, owners and idempotence."""

from __future__ import annotations

import copy
import json
import pathlib
from typing import Any

import pytest

from disagg_core import contract, spec
from disagg_core.spec.model import Pipeline
from disagg_operator import names
from disagg_operator.plan import merge, planner
from disagg_operator.plan import model as plan_model
from tests.support import EXAMPLES

NS = "ml"
Obj = dict[str, Any]


def _pipeline(doc: Obj) -> Pipeline:
    return spec.parse_pipeline(doc)


def _by_kind(objects: list[Obj]) -> dict[str, dict[str, Obj]]:
    result: dict[str, dict[str, Obj]] = {}
    for obj in objects:
        result.setdefault(obj["kind"], {})[obj["metadata"]["name"]] = obj
    return result


def _containers(sts: Obj) -> dict[str, Obj]:
    return {c["name"]: c for c in sts["spec"]["template"]["spec"]["containers"]}


def _env(container: Obj) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container["env"] if "value" in e}


@pytest.fixture
def examples(example_files: list[pathlib.Path], load_yaml: Any) -> dict[str, Pipeline]:
    return {path.stem: _pipeline(load_yaml(path)) for path in example_files}


def test_names_kinds_and_order(examples: dict[str, Pipeline]) -> None:
    objects = planner.plan(examples["fan-out"], namespace=NS)
    assert [(o["kind"], o["metadata"]["name"]) for o in objects] == [
        ("ConfigMap", "fan-out-topology"),
        ("ResourceClaimTemplate", "fan-out-encoders-gpu"),
        ("Service", "fan-out-ingest"),
        ("Service", "fan-out-vision"),
        ("Service", "fan-out-audio"),
        ("Service", "fan-out-fuse"),
        ("NetworkPolicy", "fan-out-network"),
        ("StatefulSet", "fan-out-ingest"),
        ("StatefulSet", "fan-out-encoders"),
        ("StatefulSet", "fan-out-fuse"),
        ("Service", "fan-out"),  # the gateway's
        ("NetworkPolicy", "fan-out-gateway-network"),
        ("Deployment", "fan-out-gateway"),
    ]
    assert all(o["metadata"]["namespace"] == NS for o in objects)
    kinds = {(api, kind) for api, kind in planner.child_kinds()}
    assert {(o["apiVersion"], o["kind"]) for o in objects} <= kinds


def test_one_statefulset_and_service_per_role(examples: dict[str, Pipeline]) -> None:
    pipeline = examples["text-to-video"]
    found = _by_kind(planner.plan(pipeline, namespace=NS))
    roles = ["encoder", "denoiser", "decoder"]
    assert sorted(found["StatefulSet"]) == sorted(f"text-to-video-{r}" for r in roles)
    gateway = ["text-to-video"]
    assert sorted(found["Service"]) == sorted([*(f"text-to-video-{r}" for r in roles), *gateway])
    assert "ResourceClaimTemplate" not in found
    for role in roles:
        sts = found["StatefulSet"][f"text-to-video-{role}"]
        assert sts["spec"]["replicas"] == pipeline.role(role).replicas
        assert sts["spec"]["podManagementPolicy"] == "Parallel"
        assert sts["spec"]["serviceName"] == f"text-to-video-{role}"
        selector = {names.LABEL_PIPELINE: "text-to-video", names.LABEL_ROLE: role}
        assert sts["spec"]["selector"]["matchLabels"] == selector
        labels = sts["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items()
        service = found["Service"][f"text-to-video-{role}"]
        assert service["spec"]["clusterIP"] == "None"
        assert service["spec"]["selector"] == selector
        assert [(p["name"], p["port"]) for p in service["spec"]["ports"]] == [
            ("ingress", 7400),
            ("lane", 7500),
            ("metrics", 9400),
        ]


def test_topology_config_map(examples: dict[str, Pipeline]) -> None:
    pipeline = examples["text-to-video"]
    config_map = _by_kind(planner.plan(pipeline, namespace=NS))["ConfigMap"]
    data = config_map["text-to-video-topology"]["data"]["topology.json"]
    topology = contract.Topology.from_json(json.loads(data))
    assert topology == contract.Topology.from_pipeline(pipeline, namespace=NS)


def _configs_from_pods(pipeline: Pipeline, options: plan_model.PlanOptions | None = None) -> None:
    """Every container's env parses back (contract.parse_env, topology from the ConfigMap)
    into the planner's RoleConfig, with the replica taken from the pod name."""
    found = _by_kind(planner.plan(pipeline, namespace=NS, options=options))
    (config_map,) = found["ConfigMap"].values()
    topology = contract.Topology.from_json(json.loads(config_map["data"]["topology.json"]))
    seen = set()
    for sts_name, sts in found["StatefulSet"].items():
        for name, container in _containers(sts).items():
            env = _env(container)
            assert "DISAGG_REPLICA" not in env
            (pod_name,) = [e for e in container["env"] if e["name"] == "DISAGG_POD_NAME"]
            assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
            env["DISAGG_POD_NAME"] = f"{sts_name}-3"
            parsed = contract.parse_env(env, topology)
            expected = plan_model.role_config(pipeline, name, namespace=NS, options=options)
            assert parsed == _with(expected, replica=3, pod_name=f"{sts_name}-3")
            seen.add(name)
    assert seen == set(pipeline.role_names)


def _with(config: contract.RoleConfig, **changes: Any) -> contract.RoleConfig:
    import dataclasses

    return dataclasses.replace(config, **changes)


def test_env_round_trips_through_the_contract(examples: dict[str, Pipeline], full_doc: Obj) -> None:
    # engine roles run vLLM, not `disagg role`: the role env contract is not theirs (the
    # operator's rendering of engine roles is issue 32's operator part)
    handlers = [p for p in examples.values() if not p.engine_roles]
    for pipeline in [*handlers, _pipeline(full_doc)]:
        _configs_from_pods(pipeline)


def test_downstream_addresses_lone_roles(examples: dict[str, Pipeline]) -> None:
    found = _by_kind(planner.plan(examples["text-to-video"], namespace=NS))
    encoder = _env(_containers(found["StatefulSet"]["text-to-video-encoder"])["encoder"])
    assert encoder["DISAGG_DOWNSTREAM"] == (
        "denoiser=text-to-video-denoiser.ml.svc.cluster.local:7400,"
        "decoder=text-to-video-decoder.ml.svc.cluster.local:7400"
    )
    assert encoder["DISAGG_SAME_GPU_PEERS"] == ""
    assert encoder["DISAGG_NAMESPACE"] == NS
    assert encoder["DISAGG_POOL_SIZE"] == str(256 * 2**20)
    denoiser = _env(_containers(found["StatefulSet"]["text-to-video-denoiser"])["denoiser"])
    assert denoiser["DISAGG_POOL_SIZE"] == str(512 * 2**20)
    assert denoiser["DISAGG_CONCURRENCY"] == "2"
    assert denoiser["DISAGG_REQUEST_TIMEOUT"] == "60"
    decoder = _env(_containers(found["StatefulSet"]["text-to-video-decoder"])["decoder"])
    assert decoder["DISAGG_DOWNSTREAM"] == ""


def test_colocated_roles_share_a_pod(examples: dict[str, Pipeline]) -> None:
    found = _by_kind(planner.plan(examples["fan-out"], namespace=NS))
    sts = found["StatefulSet"]["fan-out-encoders"]
    pod = sts["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["vision", "audio"]
    assert pod["shareProcessNamespace"] is True
    assert pod["resourceClaims"] == [
        {"name": "gpu", "resourceClaimTemplateName": "fan-out-encoders-gpu"}
    ]
    for container in pod["containers"]:
        assert container["resources"]["claims"] == [{"name": "gpu"}]
    vision, audio = (_env(c) for c in pod["containers"])
    ports = ("DISAGG_INGRESS_PORT", "DISAGG_LANE_PORT", "DISAGG_METRICS_PORT")
    assert tuple(vision[p] for p in ports) == ("7400", "7500", "9400")
    assert tuple(audio[p] for p in ports) == ("7401", "7501", "9401")
    assert vision["DISAGG_SAME_GPU_PEERS"] == "audio"
    assert audio["DISAGG_SAME_GPU_PEERS"] == "vision"
    assert vision["DISAGG_DOWNSTREAM"] == "fuse=fan-out-fuse.ml.svc.cluster.local:7400"
    ingest = _env(_containers(found["StatefulSet"]["fan-out-ingest"])["ingest"])
    assert ingest["DISAGG_DOWNSTREAM"] == (
        "vision=fan-out-vision.ml.svc.cluster.local:7400,"
        "audio=fan-out-audio.ml.svc.cluster.local:7401"
    )
    group_labels = {names.LABEL_ROLE: "encoders", names.LABEL_GROUP: "encoders"}
    assert group_labels.items() <= sts["metadata"]["labels"].items()
    for role, port in (("vision", 7400), ("audio", 7401)):
        service = found["Service"][f"fan-out-{role}"]
        assert service["spec"]["selector"] == {
            names.LABEL_PIPELINE: "fan-out",
            names.LABEL_ROLE: "encoders",
        }
        assert service["metadata"]["labels"][names.LABEL_ROLE] == role
        assert service["metadata"]["labels"][names.LABEL_GROUP] == "encoders"
        assert service["spec"]["ports"][0] == {
            "name": "ingress",
            "port": port,
            "targetPort": port,
            "protocol": "TCP",
        }
    claim = found["ResourceClaimTemplate"]["fan-out-encoders-gpu"]
    assert claim["apiVersion"] == "resource.k8s.io/v1"
    (request,) = claim["spec"]["spec"]["devices"]["requests"]
    assert request == {
        "name": "gpu",
        "exactly": {
            "deviceClassName": "gpu.nvidia.com",
            "allocationMode": "ExactCount",
            "count": 1,
        },
    }
    annotations = sts["spec"]["template"]["metadata"]["annotations"]
    assert annotations["kubectl.kubernetes.io/default-container"] == "vision"


def test_peers_in_the_same_pod_use_loopback(full_doc: Obj) -> None:
    pipeline = _pipeline(full_doc)
    found = _by_kind(planner.plan(pipeline, namespace=NS))
    group = _containers(found["StatefulSet"]["full-diffusion"])
    denoiser, decoder = _env(group["denoiser"]), _env(group["decoder"])
    assert denoiser["DISAGG_DOWNSTREAM"] == "decoder=127.0.0.1:7401@cuda-ipc"
    assert decoder["DISAGG_INGRESS_PORT"] == "7401"
    encoder = _env(_containers(found["StatefulSet"]["full-encoder"])["encoder"])
    # The user's port 7400 pushes the runtime's ingress to 7401.
    assert encoder["DISAGG_INGRESS_PORT"] == "7401"
    assert encoder["DISAGG_DOWNSTREAM"] == (
        "denoiser=full-denoiser.ml.svc.cluster.local:7400@tcp,"
        "decoder=full-decoder.ml.svc.cluster.local:7401"
    )
    assert encoder["DISAGG_POOL_DEVICE"] == "cpu-pinned"
    ports = [(p["name"], p["port"]) for p in found["Service"]["full-encoder"]["spec"]["ports"]]
    assert ports == [
        ("ingress", 7401),
        ("lane", 7500),
        ("metrics", 9400),
        ("debug", 7400),
        ("probe", 5678),
    ]


def test_pod_template_is_hardened(examples: dict[str, Pipeline]) -> None:
    found = _by_kind(planner.plan(examples["llm-prefill-decode"], namespace=NS))
    sts = found["StatefulSet"]["llm-prefill-decode-decode"]
    pod = sts["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["automountServiceAccountToken"] is False
    assert "shareProcessNamespace" not in pod
    (container,) = pod["containers"]
    assert container["image"] == "ghcr.io/disagg/runtime:0.1.0"
    assert container["command"] == ["disagg", "role"]
    assert container["resources"] == {"requests": {"cpu": "1", "memory": "2Gi"}}
    security = container["securityContext"]
    assert security["runAsUser"] == 65532 and security["runAsNonRoot"] is True
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": 9400}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": 9400}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/etc/disagg"]["readOnly"] is True
    assert {"/dev/shm", "/tmp"} <= mounts.keys()
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["topology"]["configMap"]["name"] == "llm-prefill-decode-topology"
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "320Mi"}
    assert volumes["tmp"]["emptyDir"] == {}


def test_shm_size_sums_the_pods_pools(full_doc: Obj) -> None:
    found = _by_kind(planner.plan(_pipeline(full_doc), namespace=NS))
    pod = found["StatefulSet"]["full-diffusion"]["spec"]["template"]["spec"]
    shm = {v["name"]: v for v in pod["volumes"]}["dshm"]["emptyDir"]["sizeLimit"]
    assert shm == "704Mi"  # denoiser 512Mi (pipeline default) + decoder 128Mi + 64Mi


def test_role_overrides_image_command_args_env(full_doc: Obj) -> None:
    found = _by_kind(planner.plan(_pipeline(full_doc), namespace=NS))
    encoder = _containers(found["StatefulSet"]["full-encoder"])["encoder"]
    assert encoder["image"] == "registry.example/encoder:2"
    assert encoder["command"] == ["python", "-m", "disagg_runtime.cli"]
    assert encoder["args"] == ["role", "--verbose", ""]
    names_in_order = [e["name"] for e in encoder["env"]]
    assert names_in_order[-2:] == ["MODEL", "TOKEN"]
    # the contract's DISAGG_*, then spec.monitoring.tracing's OTEL_*, then the role's own
    assert names_in_order[-5:-2] == [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_TRACES_SAMPLER",
        "OTEL_TRACES_SAMPLER_ARG",
    ]
    assert all(n.startswith("DISAGG_") for n in names_in_order[:-5])
    token = encoder["env"][-1]
    assert token == {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "full-s", "key": "k"}}}
    # ranks: 2, and resources are one rank's: the pod asks for twice each
    assert encoder["resources"]["limits"] == {"memory": "4Gi", "nvidia.com/gpu": "2"}
    assert encoder["resources"]["requests"] == {"cpu": "1000m", "memory": "2Gi"}
    env = {e["name"]: e.get("value") for e in encoder["env"]}
    assert (env["DISAGG_RANKS"], env["DISAGG_RANK_PORT"]) == ("2", "29500")
    assert [p["containerPort"] for p in encoder["ports"]] == [7401, 7500, 9400, 7400, 5678]


def test_pod_template_overrides_merge_last(full_doc: Obj) -> None:
    full_doc["spec"]["roles"][0]["podTemplate"]["metadata"]["labels"] = {
        names.LABEL_ROLE: "hijack",
        "extra": "yes",
    }
    full_doc["spec"]["roles"][0]["podTemplate"]["spec"]["containers"] = [
        {
            "name": "encoder",
            "env": [{"name": "DISAGG_ROLE", "value": "x"}, {"name": "MORE", "value": "1"}],
            "securityContext": {"readOnlyRootFilesystem": None},
        },
        {"name": "sidecar", "image": "busybox"},
    ]
    found = _by_kind(planner.plan(_pipeline(full_doc), namespace=NS))
    template = found["StatefulSet"]["full-encoder"]["spec"]["template"]
    assert template["spec"]["nodeSelector"] == {"gpu": "true"}
    assert template["metadata"]["annotations"]["example.com/owner"] == "video"
    assert template["metadata"]["labels"][names.LABEL_ROLE] == "encoder"  # ours win
    assert template["metadata"]["labels"]["extra"] == "yes"
    containers = _containers(found["StatefulSet"]["full-encoder"])
    assert list(containers) == ["encoder", "sidecar"]
    env = _env(containers["encoder"])
    assert env["DISAGG_ROLE"] == "encoder" and env["MORE"] == "1" and env["MODEL"] == "t5"
    assert "readOnlyRootFilesystem" not in containers["encoder"]["securityContext"]
    group = _containers(found["StatefulSet"]["full-diffusion"])
    assert [e["name"] for e in group["denoiser"]["env"]][-1] == "EXTRA"


def test_merge_rules() -> None:
    base = {
        "a": {"b": 1, "c": [1, 2]},
        "containers": [{"name": "x", "image": "i", "env": [{"name": "A", "value": "1"}]}],
        "volumes": [{"name": "v", "emptyDir": {}}],
        "drop": 1,
    }
    overlay = {
        "a": {"c": [3]},
        "containers": [{"name": "x", "env": [{"name": "B", "value": "2"}]}],
        "volumes": [{"name": "w", "emptyDir": {}}],
        "drop": None,
    }
    frozen = copy.deepcopy(base)
    result = merge.deep_merge(base, overlay)
    assert base == frozen
    assert result == {
        "a": {"b": 1, "c": [3]},
        "containers": [
            {
                "name": "x",
                "image": "i",
                "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}],
            }
        ],
        "volumes": [{"name": "v", "emptyDir": {}}, {"name": "w", "emptyDir": {}}],
    }
    assert merge.deep_merge({"tolerations": [{"key": "a"}]}, {"tolerations": []}) == {
        "tolerations": []
    }


@pytest.mark.parametrize("mode", ["dra", "device-plugin", "none"])
def test_gpu_modes(examples: dict[str, Pipeline], mode: str, load_yaml: Any, repo: Any) -> None:
    doc = load_yaml(repo / "examples" / "fan-out.yaml")
    doc["metadata"]["annotations"] = {names.ANNOTATION_GPU_MODE: mode}
    found = _by_kind(planner.plan(_pipeline(doc), namespace=NS))
    pod = found["StatefulSet"]["fan-out-encoders"]["spec"]["template"]["spec"]
    vision, audio = pod["containers"]
    assert ("ResourceClaimTemplate" in found) == (mode == "dra")
    assert ("resourceClaims" in pod) == (mode == "dra")
    if mode == "device-plugin":
        assert vision["resources"] == {"limits": {"nvidia.com/gpu": "1"}}
        assert "resources" not in audio
    if mode == "none":
        assert "resources" not in vision and "resources" not in audio
    lone = found["StatefulSet"]["fan-out-ingest"]["spec"]["template"]["spec"]
    assert "resourceClaims" not in lone and "resources" not in lone["containers"][0]


def test_gpu_device_class_and_default_mode(load_yaml: Any, repo: Any) -> None:
    doc = load_yaml(repo / "examples" / "fan-out.yaml")
    doc["metadata"]["annotations"] = {names.ANNOTATION_GPU_DEVICE_CLASS: "gpu.amd.com"}
    pipeline = _pipeline(doc)
    found = _by_kind(planner.plan(pipeline, namespace=NS))
    claim = found["ResourceClaimTemplate"]["fan-out-encoders-gpu"]
    request = claim["spec"]["spec"]["devices"]["requests"][0]
    assert request["exactly"]["deviceClassName"] == "gpu.amd.com"
    options = plan_model.PlanOptions(gpu_mode="none")
    assert "ResourceClaimTemplate" not in _by_kind(
        planner.plan(pipeline, namespace=NS, options=options)
    )
    beta = plan_model.PlanOptions(dra_api_version="resource.k8s.io/v1beta2")
    found = _by_kind(planner.plan(pipeline, namespace=NS, options=beta))
    assert found["ResourceClaimTemplate"]["fan-out-encoders-gpu"]["apiVersion"] == (
        "resource.k8s.io/v1beta2"
    )


def test_operator_settings_are_checked(full_doc: Obj) -> None:
    full_doc["metadata"]["annotations"] = {
        names.ANNOTATION_GPU_MODE: "magic",
        names.ANNOTATION_GPU_DEVICE_CLASS: "Not A Class",
    }
    full_doc["spec"]["roles"][0]["ports"][1]["name"] = "metrics"
    with pytest.raises(spec.SpecError) as caught:
        planner.plan(_pipeline(full_doc), namespace=NS)
    assert [(p.path, p.reason.split(";")[0]) for p in caught.value.problems] == [
        ('metadata.annotations["disagg.dev/gpu-mode"]', "must be one of dra, device-plugin, none"),
        (
            'metadata.annotations["disagg.dev/gpu-device-class"]',
            "'Not A Class' is not a device class name (a DNS subdomain)",
        ),
        ("spec.roles[0].ports[1].name", "'metrics' is reserved for the runtime's own port"),
    ]


def test_labels_and_owner_references(full_doc: Obj) -> None:
    owner = plan_model.Owner.of(
        {
            "apiVersion": "disagg.dev/v1alpha1",
            "kind": "DisaggregatedPipeline",
            "metadata": {"name": "full", "uid": "1234"},
        }
    )
    objects = planner.plan(_pipeline(full_doc), namespace=NS, owner=owner)
    for obj in objects:
        labels = obj["metadata"]["labels"]
        assert labels[names.LABEL_NAME] == "disagg"
        assert labels[names.LABEL_INSTANCE] == "full"
        assert labels[names.LABEL_MANAGED_BY] == "disagg-operator"
        assert labels[names.LABEL_PIPELINE] == "full"
        assert plan_model.child_selector("full").items() <= labels.items()
        gateway = obj["kind"] == "Deployment" or obj["metadata"]["name"] == "full"
        if obj["kind"] not in ("ConfigMap", "NetworkPolicy") and not gateway:
            assert names.LABEL_ROLE in labels
        assert obj["metadata"]["ownerReferences"] == [
            {
                "apiVersion": "disagg.dev/v1alpha1",
                "kind": "DisaggregatedPipeline",
                "name": "full",
                "uid": "1234",
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    without = planner.plan(_pipeline(full_doc), namespace=NS)
    assert all("ownerReferences" not in o["metadata"] for o in without)


def test_plan_is_deterministic(
    example_files: list[pathlib.Path], load_yaml: Any, full_doc: Obj
) -> None:
    """Two plans of the same document (parsed twice) are equal byte for byte."""
    for doc in [*(load_yaml(path) for path in example_files), full_doc]:
        first = planner.plan(_pipeline(copy.deepcopy(doc)), namespace=NS)
        second = planner.plan(_pipeline(copy.deepcopy(doc)), namespace=NS)
        assert json.dumps(first) == json.dumps(second)


def _changed(before: list[Obj], after: list[Obj]) -> set[tuple[str, str]]:
    old = {(o["kind"], o["metadata"]["name"]): o for o in before}
    new = {(o["kind"], o["metadata"]["name"]): o for o in after}
    assert old.keys() == new.keys()
    return {key for key in old if old[key] != new[key]}


def test_one_role_change_touches_only_its_statefulset(load_yaml: Any, repo: Any) -> None:
    doc = load_yaml(repo / "examples" / "text-to-video.yaml")
    before = planner.plan(_pipeline(doc), namespace=NS)
    image = copy.deepcopy(doc)
    image["spec"]["roles"][1]["image"] = "ghcr.io/disagg/runtime:0.2.0"
    after = planner.plan(_pipeline(image), namespace=NS)
    assert _changed(before, after) == {("StatefulSet", "text-to-video-denoiser")}
    replicas = copy.deepcopy(doc)
    replicas["spec"]["roles"][2]["replicas"] = 5
    after = planner.plan(_pipeline(replicas), namespace=NS)
    assert _changed(before, after) == {("StatefulSet", "text-to-video-decoder")}
    assert _by_kind(after)["StatefulSet"]["text-to-video-decoder"]["spec"]["replicas"] == 5


def _hashes(objects: list[dict[str, Any]]) -> dict[str, str]:
    return {
        o["metadata"]["name"]: o["spec"]["template"]["metadata"]["annotations"][
            names.ANNOTATION_SPEC_HASH
        ]
        for o in objects
        if o["kind"] == "StatefulSet"
    }


def test_graph_change_rolls_only_the_roles_it_touches(load_yaml: Any, repo: Any) -> None:
    """Dropping the encoder's tensor reference to the decoder changes the topology entries of
    those two roles: their pods roll, the denoiser's do not."""
    doc = load_yaml(repo / "examples" / "text-to-video.yaml")
    before = planner.plan(_pipeline(doc), namespace=NS)
    del doc["spec"]["edges"][0]["tensorRefs"]
    after = planner.plan(_pipeline(doc), namespace=NS)
    changed = _changed(before, after)
    assert ("ConfigMap", "text-to-video-topology") in changed
    old, new = _hashes(before), _hashes(after)
    rolled = {name for name in old if old[name] != new[name]}
    assert rolled == {"text-to-video-encoder", "text-to-video-decoder"}
    assert len(set(old.values())) == len(old)  # each unit its own hash


def _gateway_hash(objects: list[Obj]) -> str:
    (deployment,) = _by_kind(objects)["Deployment"].values()
    return str(
        deployment["spec"]["template"]["metadata"]["annotations"][names.ANNOTATION_SPEC_HASH]
    )


def test_the_gateway_rolls_only_when_what_it_reads_changes(load_yaml: Any, repo: Any) -> None:
    """A role added in the middle of the graph changes the entry role's slice of the
    topology (its downstream) but not what the gateway reads (entry and exit roles): the
    gateway's pods stay, and their streams with them. A new exit role, or another count of
    resends, rolls it."""
    doc = load_yaml(repo / "examples" / "text-to-video.yaml")
    before = _gateway_hash(planner.plan(_pipeline(doc), namespace=NS))
    middle = copy.deepcopy(doc)
    middle["spec"]["roles"].append({"name": "upscaler", "handler": "pkg.mod:upscale"})
    middle["spec"]["edges"] = [
        e if e["to"] != "decoder" or e["from"] != "denoiser" else {**e, "to": "upscaler"}
        for e in middle["spec"]["edges"]
    ] + [{"from": "upscaler", "to": "decoder"}]
    assert _gateway_hash(planner.plan(_pipeline(middle), namespace=NS)) == before
    after_exit = copy.deepcopy(doc)
    after_exit["spec"]["roles"].append({"name": "captioner", "handler": "pkg.mod:caption"})
    after_exit["spec"]["edges"].append({"from": "decoder", "to": "captioner"})
    assert _gateway_hash(planner.plan(_pipeline(after_exit), namespace=NS)) != before
    resends = copy.deepcopy(doc)
    resends["spec"]["transport"]["migrationAttempts"] = 0
    assert _gateway_hash(planner.plan(_pipeline(resends), namespace=NS)) != before
    # a role not idempotent changes which requests the gateway may resend
    once = copy.deepcopy(doc)
    once["spec"]["roles"][1]["idempotent"] = False
    assert _gateway_hash(planner.plan(_pipeline(once), namespace=NS)) != before
    explicit = copy.deepcopy(doc)
    explicit["spec"]["roles"][1]["idempotent"] = True  # the default: nothing changes
    assert _gateway_hash(planner.plan(_pipeline(explicit), namespace=NS)) == before


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_one_role_image_change_renders_only_that_roles_objects(
    load_yaml: Any, repo: Any, example: str
) -> None:
    doc = load_yaml(repo / "examples" / example)
    before = planner.plan(_pipeline(doc), namespace=NS)
    for i, role in enumerate(doc["spec"]["roles"]):
        changed_doc = copy.deepcopy(doc)
        changed_doc["spec"]["roles"][i]["image"] = "ghcr.io/disagg/runtime:9.9.9"
        after = planner.plan(_pipeline(changed_doc), namespace=NS)
        unit = next(
            (g["name"] for g in doc["spec"].get("colocation", []) if role["name"] in g["roles"]),
            role["name"],
        )
        assert _changed(before, after) == {("StatefulSet", f"{doc['metadata']['name']}-{unit}")}


def test_replica_overrides_from_the_autoscaler(examples: dict[str, Pipeline]) -> None:
    options = plan_model.PlanOptions(replicas={"denoiser": 4, "encoders": 3})
    found = _by_kind(planner.plan(examples["text-to-video"], namespace=NS, options=options))
    assert found["StatefulSet"]["text-to-video-denoiser"]["spec"]["replicas"] == 4
    assert found["StatefulSet"]["text-to-video-encoder"]["spec"]["replicas"] == 1
    found = _by_kind(planner.plan(examples["fan-out"], namespace=NS, options=options))
    assert found["StatefulSet"]["fan-out-encoders"]["spec"]["replicas"] == 3


def test_plan_shares_no_objects(full_doc: Obj) -> None:
    """Objects must not alias each other or the model (YAML anchors, accidental edits)."""
    pipeline = _pipeline(full_doc)
    objects = planner.plan(pipeline, namespace=NS)
    seen: dict[int, Any] = {}

    def visit(value: Any) -> None:
        if isinstance(value, dict | list):
            assert id(value) not in seen, value
            seen[id(value)] = value
            for item in value.values() if isinstance(value, dict) else value:
                visit(item)

    visit(objects)
    objects[-1]["spec"]["template"]["spec"]["containers"][0]["env"].clear()
    assert planner.plan(pipeline, namespace=NS) != objects


def test_workloads(examples: dict[str, Pipeline]) -> None:
    units = plan_model.workloads(examples["fan-out"])
    assert [(u.unit, u.name, [r.name for r in u.roles]) for u in units] == [
        ("ingest", "fan-out-ingest", ["ingest"]),
        ("encoders", "fan-out-encoders", ["vision", "audio"]),
        ("fuse", "fan-out-fuse", ["fuse"]),
    ]
    assert plan_model.workload_of(examples["fan-out"], "audio").unit == "encoders"


def test_the_lane_port_name_is_reserved_too(full_doc: Obj) -> None:
    full_doc["spec"]["roles"][0]["ports"][0]["name"] = "lane"
    with pytest.raises(spec.SpecError) as caught:
        planner.plan(_pipeline(full_doc), namespace=NS)
    assert [(p.path, p.reason) for p in caught.value.problems] == [
        ("spec.roles[0].ports[0].name", "'lane' is reserved for the runtime's own port")
    ]


def test_handler_args_batching_and_startup_allowance_reach_the_container(full_doc: Obj) -> None:
    found = _by_kind(planner.plan(_pipeline(full_doc), namespace=NS))
    containers = _containers(found["StatefulSet"]["full-encoder"])
    env = {e["name"]: e.get("value") for e in containers["encoder"]["env"]}
    assert json.loads(env["DISAGG_HANDLER_ARGS"]) == {
        "model": "/models/t5",
        "dtype": "bfloat16",
        "layers": [0, 1],
        "opts": {"cache": True},
    }
    assert (env["DISAGG_MAX_BATCH_SIZE"], env["DISAGG_MAX_BATCH_WAIT_MS"]) == ("8", "2.5")
    startup = containers["encoder"]["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] == 900  # startupSeconds
    denoiser = _containers(found["StatefulSet"]["full-diffusion"])["denoiser"]
    denoiser_env = {e["name"] for e in denoiser["env"]}
    assert "DISAGG_HANDLER_ARGS" not in denoiser_env and "DISAGG_MAX_BATCH_SIZE" not in denoiser_env
    assert denoiser["startupProbe"]["failureThreshold"] == 120  # the default 600 s


def test_the_gateway_deployment_and_service(full_doc: Obj) -> None:
    """spec.gateway -> Deployment P-gateway (hardened, the gateway's contract, probes, token
    Secret) and ClusterIP Service P with port http; labels the NetworkPolicy admits."""
    pipeline = _pipeline(full_doc)
    found = _by_kind(planner.plan(pipeline, namespace=NS))
    deployment, service = found["Deployment"]["full-gateway"], found["Service"]["full"]
    selector = {names.LABEL_PIPELINE: "full", names.LABEL_COMPONENT: "gateway"}
    assert deployment["spec"]["selector"]["matchLabels"] == selector
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    assert names.LABEL_ROLE not in pod["metadata"]["labels"]  # the autoscaler skips it
    assert pod["metadata"]["annotations"]["example.com/team"] == "ml"  # podTemplate merged
    spec = pod["spec"]
    assert spec["automountServiceAccountToken"] is False and spec["securityContext"]["runAsNonRoot"]
    (container,) = spec["containers"]
    assert container["command"] == ["disagg", "gateway"]
    assert container["image"] == pipeline.image
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["resources"]["limits"] == {"memory": "512Mi"}
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["DISAGG_GATEWAY_PORT"] == "8081" and env["DISAGG_GATEWAY_API"] == "openai"
    assert env["DISAGG_GATEWAY_MODEL"] == "full-model"
    assert env["DISAGG_GATEWAY_TOKEN_FILE"] == "/etc/disagg-gateway/token"
    assert env["DISAGG_POD_IP"] == {"fieldRef": {"apiVersion": "v1", "fieldPath": "status.podIP"}}
    entry = pipeline.entry_roles[0]
    assert env["DISAGG_DOWNSTREAM"].startswith(f"{entry}=full-{entry}.{NS}.svc.cluster.local:")
    config = contract.parse_gateway_env(
        {k: v for k, v in env.items() if isinstance(v, str)},
        topology=contract.Topology.from_pipeline(pipeline, namespace=NS),
    )
    assert (config.port, config.api, config.reply_port) == (8081, "openai", 7400)
    assert env["DISAGG_PEER_KEY_FILE"] == contract.DEFAULT_PEER_KEY_FILE  # a peer of the roles
    key = next(v for v in spec["volumes"] if v["name"] == "peer-key")
    assert key["secret"]["secretName"] == "full-peer-key"
    token = next(v for v in spec["volumes"] if v["name"] == "token")
    assert token["secret"] == {
        "secretName": "full-gateway-token",
        "items": [{"key": "token", "path": "token"}],
    }
    assert service["spec"]["type"] == "ClusterIP" and service["spec"]["selector"] == selector
    assert service["spec"]["ports"] == [
        {"name": "http", "port": 8081, "targetPort": "http", "protocol": "TCP"}
    ]


def test_no_gateway_when_disabled(full_doc: Obj) -> None:
    full_doc["spec"]["gateway"] = {"enabled": False}
    kinds = {o["kind"] for o in planner.plan(_pipeline(full_doc), namespace=NS)}
    assert "Deployment" not in kinds
