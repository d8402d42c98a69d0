"""Admission as a real API server does it, through the real kubectl: the CRD's schema and CEL
rules refuse the ten invalid pipelines of issue 36 with the server's field paths, the CRD
itself is held to the API server's rules for CRD schemas, fieldValidation decides what
happens to unknown fields, and Endpoints refuse loopback addresses."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
import yaml

from disagg_operator.gen import crd
from tests.k8s.fixtures import Kubectl
from tests.k8s.server import EmulatorThread

Obj = dict[str, Any]
PIPELINES = "/apis/disagg.dev/v1alpha1/namespaces/default/disaggregatedpipelines"


def pipeline(name: str = "x", **spec: Any) -> Obj:
    return {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggregatedPipeline",
        "metadata": {"name": name},
        "spec": {
            "image": "ghcr.io/disagg/runtime:0.1.0",
            "roles": [
                {"name": "a", "handler": "disagg_runtime.demo:encode_text"},
                {"name": "b", "handler": "disagg_runtime.demo:encode_text"},
            ],
            "edges": [{"from": "a", "to": "b"}],
            **spec,
        },
    }


def _edit(change: Callable[[Obj], None], name: str = "x") -> Obj:
    doc = pipeline(name)
    change(doc)
    return doc


def _set(path: str, value: Any) -> Callable[[Obj], None]:
    def change(doc: Obj) -> None:
        target: Any = doc
        *parents, last = path.split(".")
        for part in parents:
            target = target[int(part)] if part.isdigit() else target[part]
        target[last] = value

    return change


# the ten pipelines a real API server (v1.36) refused and the emulator stored (issue 36);
# each with what the server's refusal names
INVALID: list[tuple[str, Obj, str]] = [
    (
        "a name over 40 characters",
        pipeline("p" * 41),
        "metadata.name: Too long: may not be more than 40 bytes",
    ),
    (
        "pipeline and role names over 51",
        _edit(_set("spec.roles.1.name", "r" * 40), name="p" * 20),
        'spec.roles: Invalid value: "object": <pipeline>-<role> must fit in 52 characters',
    ),
    (
        "a self-loop edge",
        _edit(_set("spec.edges", [{"from": "a", "to": "b"}, {"from": "b", "to": "b"}])),
        'spec.edges[1]: Invalid value: "object": an edge from a role to itself (a self-loop)',
    ),
    (
        "an edge to an unknown role",
        _edit(_set("spec.edges", [{"from": "a", "to": "nowhere"}])),
        'spec.edges: Invalid value: "object": every edge\'s from and to must name a role',
    ),
    (
        "no image anywhere",
        _edit(lambda d: d["spec"].pop("image")),
        'spec.image: Invalid value: "object": spec.image is required unless every role sets image',
    ),
    (
        "an OpenAI gateway without a model",
        _edit(_set("spec.gateway", {"api": "openai"})),
        'spec.gateway.model: Invalid value: "object": model is required with api: openai',
    ),
    (
        "minReplicas above maxReplicas",
        _edit(_set("spec.roles.0.autoscaling", {"minReplicas": 5, "maxReplicas": 2})),
        'spec.roles[0].autoscaling.minReplicas: Invalid value: "object": minReplicas must not '
        "be greater than maxReplicas",
    ),
    (
        "an env name with the reserved DISAGG_ prefix",
        _edit(_set("spec.roles.0.env", [{"name": "DISAGG_X", "value": "1"}])),
        'spec.roles[0].env[0].name: Invalid value: "object": the DISAGG_ prefix is reserved',
    ),
    (
        "an unknown field",
        _edit(_set("spec.bogusField", 1)),
        ".spec.bogusField: field not declared in schema",
    ),
    (
        "a string replicas",
        _edit(_set("spec.roles.0.replicas", "two")),
        '.spec.roles[name="a"].replicas: expected numeric (int or float), got string',
    ),
]


@pytest.fixture
def with_crd(k8s: EmulatorThread, kubectl: Kubectl, disagg_crd: Any) -> Kubectl:
    kubectl("apply", "--server-side", "-f", str(disagg_crd))
    return kubectl


@pytest.mark.parametrize(("doc", "refusal"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_the_ten_invalid_pipelines_are_refused_with_the_servers_field_paths(
    with_crd: Kubectl, k8s: EmulatorThread, doc: Obj, refusal: str
) -> None:
    text = yaml.safe_dump(doc)
    for args in (("apply", "--server-side"), ("create",)):
        result = with_crd(*args, "-f", "-", input=text, check=False)
        if refusal.startswith("."):  # structured-merge-diff's typed conversion: apply only
            if args[0] == "apply":
                assert "failed to create typed patch object" in result.stderr, result.stderr
                assert refusal in result.stderr, result.stderr
            else:
                assert result.returncode != 0, result.stdout
            continue
        assert result.returncode != 0, result.stdout
        name = doc["metadata"]["name"]
        assert f'The DisaggregatedPipeline "{name}" is invalid:' in result.stderr, result.stderr
        assert refusal in result.stderr, result.stderr
    assert k8s.list("disaggregatedpipelines", "default") == []


def test_a_valid_pipeline_is_stored_with_its_defaults(with_crd: Kubectl, k8s: EmulatorThread):
    with_crd("apply", "--server-side", "-f", "-", input=yaml.safe_dump(pipeline()))
    stored = k8s.get("disaggregatedpipelines", "x", "default")
    assert stored is not None
    assert stored["spec"]["transport"]["relay"] == "auto"  # a schema default
    assert stored["spec"]["transport"]["requestTimeoutSeconds"] > 0  # inside the default {}
    assert stored["metadata"]["generation"] == 1


def _request(k8s: EmulatorThread, method: str, path: str, body: Any = None, **headers: str):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        k8s.url + path,
        data=data,
        method=method,
        headers={"Content-Type": "application/json", **headers},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read()), response.headers
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), error.headers


def test_field_validation_strict_warn_ignore(k8s: EmulatorThread, disagg_crd: Any) -> None:
    k8s.apply_file(disagg_crd)
    doc = _edit(_set("spec.bogusField", 1))
    code, body, _ = _request(k8s, "POST", f"{PIPELINES}?fieldValidation=Strict", doc)
    assert (code, body["reason"]) == (400, "BadRequest")
    assert body["message"] == 'strict decoding error: unknown field "spec.bogusField"'
    for validation, warned in (("Warn", True), ("", True), ("Ignore", False)):
        doc["metadata"]["name"] = f"v{validation.lower()}"
        query = f"?fieldValidation={validation}" if validation else ""
        code, body, headers = _request(k8s, "POST", PIPELINES + query, doc)
        assert code == 201 and "bogusField" not in body["spec"]  # pruned
        warnings = headers.get_all("Warning") or []
        assert (warnings == ['299 - "unknown field \\"spec.bogusField\\""']) == warned, warnings


def test_a_schema_error_is_a_422_with_causes(k8s: EmulatorThread, disagg_crd: Any) -> None:
    k8s.apply_file(disagg_crd)
    doc = _edit(_set("spec.roles.0.replicas", "two"))
    code, body, _ = _request(k8s, "POST", PIPELINES, doc)
    assert (code, body["reason"]) == (422, "Invalid")
    assert body["message"].startswith('DisaggregatedPipeline.disagg.dev "x" is invalid: [')
    assert body["details"]["causes"][0] == {
        "reason": "FieldValueTypeInvalid",
        "message": 'Invalid value: "string": spec.roles[0].replicas in body must be of type '
        'integer: "string"',
        "field": "spec.roles[0].replicas",
    }
    # a type error keeps the CEL rules from running, as on the server
    assert body["details"]["causes"][-1]["message"].startswith(
        'Invalid value: "null": some validation rules were not checked'
    )


def test_a_crd_the_api_server_refuses_is_refused(kubectl: Kubectl, k8s: EmulatorThread) -> None:
    doc = crd.crd()
    metadata = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["metadata"]
    metadata["description"] = "Standard object metadata."
    result = kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump(doc), check=False)
    assert result.returncode != 0
    assert (
        "spec.validation.openAPIV3Schema.properties[metadata]: Forbidden: must not specify "
        "anything other than name and generateName, but metadata is implicitly specified"
    ) in result.stderr, result.stderr
    assert k8s.list("customresourcedefinitions") == []


def test_loopback_addresses_are_refused_in_endpoints(k8s: EmulatorThread) -> None:
    endpoints = {
        "apiVersion": "v1",
        "kind": "Endpoints",
        "metadata": {"name": "e"},
        "subsets": [{"addresses": [{"ip": "10.0.0.1"}, {"ip": "127.0.0.1"}]}],
    }
    code, body, _ = _request(k8s, "POST", "/api/v1/namespaces/default/endpoints", endpoints)
    assert code == 422
    assert body["message"] == (
        'Endpoints "e" is invalid: subsets[0].addresses[1].ip: Invalid value: "127.0.0.1": may '
        "not be in the loopback range (127.0.0.0/8, ::1/128)"
    )
    slice_ = {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": "s"},
        "addressType": "IPv6",
        "endpoints": [{"addresses": ["::1"]}],
    }
    path = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices"
    code, body, _ = _request(k8s, "POST", path, slice_)
    assert code == 422 and "endpoints[0].addresses[0]" in body["message"]
    endpoints["subsets"] = [{"addresses": [{"ip": "10.200.0.7"}]}]  # a private range is fine
    assert _request(k8s, "POST", "/api/v1/namespaces/default/endpoints", endpoints)[0] == 201


def test_openapi_documents_for_the_served_kinds(k8s: EmulatorThread, disagg_crd: Any) -> None:
    k8s.apply_file(disagg_crd)
    code, root, _ = _request(k8s, "GET", "/openapi/v3")
    assert code == 200 and {"api/v1", "apis/apps/v1", "apis/disagg.dev/v1alpha1"} <= set(
        root["paths"]
    )
    url = root["paths"]["apis/disagg.dev/v1alpha1"]["serverRelativeURL"]
    code, doc, _ = _request(k8s, "GET", url)
    schema = doc["components"]["schemas"]["dev.disagg.v1alpha1.DisaggregatedPipeline"]
    assert schema["properties"]["spec"]["required"] == ["roles"]
    patch = doc["paths"][f"{PIPELINES.replace('default', '{namespace}')}/{{name}}"]["patch"]
    assert "fieldValidation" in {p["name"] for p in patch["parameters"]}
    code, v2, _ = _request(k8s, "GET", "/openapi/v2")
    assert code == 200 and "dev.disagg.v1alpha1.DisaggregatedPipeline" in v2["definitions"]


def test_kubectl_generators_work(kubectl: Kubectl, k8s: EmulatorThread) -> None:
    """kubectl create namespace/configmap send protobuf bodies; JSON answers them."""
    kubectl("create", "namespace", "made")
    kubectl("create", "configmap", "cm", "--from-literal=k=v", "-n", "made")
    made = k8s.get("v1/configmaps", "cm", "made")
    assert made is not None and made["data"] == {"k": "v"}
    assert "generation" not in made["metadata"]
    assert k8s.get("v1/namespaces", "made") is not None


def test_a_port_name_used_twice_in_a_pod_is_warned(k8s: EmulatorThread) -> None:
    ports = [{"name": "metrics", "containerPort": 9400}]
    sts = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "w"},
        "spec": {
            "selector": {"matchLabels": {"a": "w"}},
            "template": {
                "metadata": {"labels": {"a": "w"}},
                "spec": {
                    "containers": [
                        {"name": "one", "image": "i", "ports": ports},
                        {"name": "two", "image": "i", "ports": ports},
                    ]
                },
            },
        },
    }
    code, _, headers = _request(k8s, "POST", "/apis/apps/v1/namespaces/default/statefulsets", sts)
    assert code == 201
    assert headers.get_all("Warning") == [
        '299 - "spec.template.spec.containers[1].ports[0]: duplicate port name \\"metrics\\" '
        "with spec.template.spec.containers[0].ports[0], services and probes that select "
        'ports by name will use spec.template.spec.containers[0].ports[0]"'
    ]
    k8s.call(k8s.emulator.warnings.clear)  # else the fixture fails the test, as it should


@pytest.mark.parametrize("sample", ["fan-out", "llm-prefill-decode", "text-to-video"])
def test_every_rendered_object_of_the_samples_is_admitted_without_warnings(
    kubectl: Kubectl, k8s: EmulatorThread, sample: str
) -> None:
    """The operator's objects for each sample (fan-out: a colocation pod of two roles), applied
    server-side as the operator does: accepted, and no warning (unique port names)."""
    from disagg_core import spec
    from disagg_operator.plan import planner, render
    from tests.support import REPO

    pipeline = spec.load_pipeline_file(str(REPO / "manifests" / "samples" / f"{sample}.yaml"))
    objects = planner.plan(pipeline, namespace="default")
    result = kubectl("apply", "--server-side", "-f", "-", input=render.dump_all(objects))
    assert "Warning" not in result.stderr, result.stderr
    assert k8s.call(lambda: list(k8s.emulator.warnings)) == []


def test_rollout_fields_take_the_int_or_percent_form(with_crd: Kubectl, k8s: EmulatorThread):
    """maxSkew "25%" (as a Deployment's maxUnavailable) is accepted; a fraction is not an
    int-or-string, and "0%" is no step."""
    ok = _edit(_set("spec.rollout", {"maxSkew": "25%", "maxUnavailable": 2, "partition": "10%"}))
    with_crd("apply", "--server-side", "-f", "-", input=yaml.safe_dump(ok))
    for rollout, refusal in (
        ({"maxSkew": 0.25}, ".spec.rollout.maxSkew: expected"),
        ({"maxUnavailable": "0%"}, 'spec.rollout.maxUnavailable: Invalid value: "0%"'),
    ):
        bad = _edit(_set("spec.rollout", rollout), name="bad")
        result = with_crd("create", "-f", "-", input=yaml.safe_dump(bad), check=False)
        assert result.returncode != 0
        assert refusal.lstrip(".").split(":")[0] in result.stderr, result.stderr
