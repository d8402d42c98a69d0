"""spec.monitoring.tracing: checked, accepted by the CRD's schema, and rendered as the OTEL_*
env of every role container and the gateway (a role's own env winning)."""

from __future__ import annotations

import copy
import pathlib
from typing import Any

import pytest
import yaml

from disagg_core import contract, spec
from disagg_operator.plan import planner
from tests.support import EXAMPLES

NS = "ml"
ENDPOINT = "http://otel-collector.observability:4318"


def doc(tracing: Any, **spec_extra: Any) -> dict[str, Any]:
    d = copy.deepcopy(yaml.safe_load((pathlib.Path(EXAMPLES) / "fan-out.yaml").read_text()))
    d["spec"]["monitoring"] = {"tracing": tracing}
    d["spec"].update(spec_extra)
    assert isinstance(d, dict)
    return d


def containers_env(objects: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for obj in objects:
        if obj["kind"] in ("StatefulSet", "Deployment"):
            for c in obj["spec"]["template"]["spec"]["containers"]:
                out[f"{obj['kind']}/{c['name']}"] = {e["name"]: e.get("value") for e in c["env"]}
    return out


def test_every_container_gets_the_otel_env(crd_checker: Any) -> None:
    d = doc({"endpoint": ENDPOINT, "sampleRatio": 0.25})
    assert crd_checker.errors(d) == []  # the CRD's schema takes it as the model does
    for bad in ({"endpoint": "otel:4318"}, {"endpoint": ENDPOINT, "sampleRatio": 2}, {}):
        assert crd_checker.errors(doc(bad)), bad
    defaulted = crd_checker.defaulted(doc({"endpoint": ENDPOINT}))
    assert defaulted["spec"]["monitoring"]["tracing"]["sampleRatio"] == 0.01
    pipeline = spec.parse_pipeline(d)
    assert pipeline.monitoring.tracing == spec.model.Tracing(endpoint=ENDPOINT, sample_ratio=0.25)
    expected = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": ENDPOINT,
        "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
        "OTEL_TRACES_SAMPLER_ARG": "0.25",
    }
    assert contract.tracing_env(pipeline) == expected
    envs = containers_env(planner.plan(pipeline, namespace=NS))
    assert any(k.startswith("Deployment/") for k in envs)  # the gateway
    assert len(envs) == len(pipeline.roles) + 1
    for name, env in envs.items():
        assert {k: env.get(k) for k in expected} == expected, name


def test_the_default_ratio_and_none_without_tracing() -> None:
    pipeline = spec.parse_pipeline(doc({"endpoint": ENDPOINT}))
    assert contract.tracing_env(pipeline)["OTEL_TRACES_SAMPLER_ARG"] == "0.01"
    plain = spec.parse_pipeline(doc(None) | {"spec": {**doc(None)["spec"], "monitoring": {}}})
    assert contract.tracing_env(plain) == {}
    for env in containers_env(planner.plan(plain, namespace=NS)).values():
        assert not any(k.startswith("OTEL_") for k in env)


def test_a_roles_own_otel_env_wins() -> None:
    d = doc({"endpoint": ENDPOINT})
    role = d["spec"]["roles"][0]
    role["env"] = [{"name": "OTEL_TRACES_SAMPLER_ARG", "value": "1.0"}]
    pipeline = spec.parse_pipeline(d)
    env = containers_env(planner.plan(pipeline, namespace=NS))
    mine = next(v for k, v in env.items() if k.endswith("/" + role["name"]))
    assert mine["OTEL_TRACES_SAMPLER_ARG"] == "1.0"
    assert mine["OTEL_EXPORTER_OTLP_ENDPOINT"] == ENDPOINT
    (container,) = [
        c
        for o in planner.plan(pipeline, namespace=NS)
        if o["kind"] == "StatefulSet"
        for c in o["spec"]["template"]["spec"]["containers"]
        if c["name"] == role["name"]
    ]
    names = [e["name"] for e in container["env"]]
    assert len(names) == len(set(names))  # no name twice


@pytest.mark.parametrize(
    ("tracing", "path", "reason"),
    [
        ({}, "spec.monitoring.tracing.endpoint", "required"),
        ({"endpoint": "otel:4318"}, "spec.monitoring.tracing.endpoint", "http:// or https://"),
        ({"endpoint": ""}, "spec.monitoring.tracing.endpoint", "must not be empty"),
        ({"endpoint": "http://" + "a" * 3000}, "spec.monitoring.tracing.endpoint", "at most"),
        ({"endpoint": ENDPOINT, "sampleRatio": 2}, "spec.monitoring.tracing.sampleRatio", "0..1"),
        ({"endpoint": ENDPOINT, "sampleRatio": "all"}, "spec.monitoring.tracing.sampleRatio", ""),
        ({"endpoint": ENDPOINT, "sample": 1}, "spec.monitoring.tracing.sample", "unknown"),
        ("yes", "spec.monitoring.tracing", "mapping"),
    ],
)
def test_bad_tracing_is_refused_naming_the_field(tracing: Any, path: str, reason: str) -> None:
    with pytest.raises(spec.SpecError) as info:
        spec.parse_pipeline(doc(tracing))
    problems = {p.path: p.reason for p in info.value.problems}
    assert path in problems, problems
    assert reason.lower() in problems[path].lower(), problems[path]
