"""Engine roles through the real operator and the real kubectl against the API emulator: a
vLLM prefill/decode pipeline applied with kubectl is reconciled into StatefulSets running
the vLLM server wired to the KV connector, with the engines' ports, /health probes, the
peer key, the NetworkPolicy and the gateway; every object is admitted without a warning,
and the pipeline goes Ready once its engines are."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
import yaml

from disagg_core import spec
from disagg_operator.plan import planner, render
from tests.integration import operator_support as s
from tests.k8s.fixtures import Kubectl
from tests.k8s.server import EmulatorThread

Obj = dict[str, Any]
NAME = "pd"
POLICIES = "networking.k8s.io/v1/networkpolicies"
DOC: Obj = {
    "apiVersion": "disagg.dev/v1alpha1",
    "kind": "DisaggregatedPipeline",
    "metadata": {"name": NAME, "namespace": s.NS},
    "spec": {
        "image": "ghcr.io/disagg/runtime-vllm:0.1.0",
        "roles": [
            {
                "name": "prefill",
                "engine": {
                    "kind": "vllm",
                    "model": "/models/tiny",
                    "args": {"maxModelLen": 512, "enforceEager": True, "dtype": "float32"},
                },
                "resources": {"requests": {"cpu": "1", "memory": "3Gi"}},
                "startupSeconds": 300,
            },
            {
                "name": "decode",
                "replicas": 2,
                "ranks": 2,
                "engine": {"kind": "vllm", "model": "/models/tiny", "kvPort": 7601},
                "resources": {"limits": {"nvidia.com/gpu": 1}},
                "autoscaling": {"minReplicas": 1, "maxReplicas": 3},
            },
        ],
        "edges": [{"from": "prefill", "to": "decode", "kind": "kv", "relay": "tcp"}],
        "gateway": {"api": "openai", "model": "tiny"},
    },
}


def _doc() -> Obj:
    return copy.deepcopy(DOC)


def test_rendered_engine_objects_are_admitted_without_warnings(
    kubectl: Kubectl, k8s: EmulatorThread
) -> None:
    objects = planner.plan(spec.parse_pipeline(_doc()), namespace=s.NS)
    kinds = sorted({o["kind"] for o in objects})
    assert kinds == ["ConfigMap", "Deployment", "NetworkPolicy", "Service", "StatefulSet"]
    result = kubectl("apply", "--server-side", "-f", "-", input=render.dump_all(objects))
    assert "Warning" not in result.stderr, result.stderr
    assert k8s.call(lambda: list(k8s.emulator.warnings)) == []
    stored = k8s.get(s.STS, "pd-decode", s.NS)
    assert stored is not None
    [container] = stored["spec"]["template"]["spec"]["containers"]
    assert container["startupProbe"]["httpGet"] == {"path": "/health", "port": 8000}
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "2"}


def _kv_extra(sts: Obj) -> Obj:
    argv = sts["spec"]["template"]["spec"]["containers"][0]["command"]
    config: Obj = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    return dict(config["kv_connector_extra_config"])


@pytest.mark.asyncio
async def test_the_operator_runs_an_engine_pipeline(k8s: EmulatorThread, kubectl: Kubectl) -> None:
    await s.call(kubectl, "apply", "-f", str(s.CRD))
    async with s.running_operator(k8s):
        out = await s.call(kubectl, "apply", "-f", "-", input=yaml.safe_dump(_doc()))
        assert f"disaggregatedpipeline.disagg.dev/{NAME} created" in out.stdout
        assert "Warning" not in out.stderr, out.stderr
        await s.until(k8s, lambda: len(k8s.list(s.STS, s.NS)) == 2, "the engines' StatefulSets")
        await s.until(k8s, lambda: k8s.list(s.DEPLOY, s.NS), "the gateway")
        assert k8s.call(lambda: list(k8s.emulator.warnings)) == []

        prefill = k8s.get(s.STS, "pd-prefill", s.NS)
        decode = k8s.get(s.STS, "pd-decode", s.NS)
        assert prefill is not None and decode is not None
        assert decode["spec"]["replicas"] == 2
        dns = "pd-decode.default.svc.cluster.local"
        assert _kv_extra(prefill)["decodes"] == [
            f"tcp://pd-decode-{i}.{dns}:7601" for i in range(3)
        ], "every decode replica the autoscaler may start"
        assert _kv_extra(decode)["listen"] == "tcp://0.0.0.0:7601"
        template = decode["spec"]["template"]
        secret = next(v for v in template["spec"]["volumes"] if v["name"] == "peer-key")
        assert secret["secret"]["secretName"] == "pd-peer-key"
        keys = s.guards(k8s, NAME, "Secret")
        assert [k["metadata"]["name"] for k in keys] == ["pd-peer-key"]
        assert "disagg.dev/peer-key-hash" in template["metadata"]["annotations"]
        [policy] = [
            p for p in s.guards(k8s, NAME, "NetworkPolicy") if p["metadata"]["name"] == "pd-network"
        ]
        kv_rules = [
            r for r in policy["spec"]["ingress"] if {"protocol": "TCP", "port": 7601} in r["ports"]
        ]
        assert len(kv_rules) == 1 and len(kv_rules[0]["from"]) == 1
        services = {o["metadata"]["name"]: o for o in k8s.list("v1/services", s.NS)}
        assert [p["name"] for p in services["pd-decode"]["spec"]["ports"]] == ["engine", "kv"]

        await s.call(s.mark_ready, k8s, NAME)
        await s.until(k8s, lambda: s.pipeline_status(k8s, NAME).get("phase") == "Ready", "Ready")
        table = (await s.call(kubectl, "get", "dpipe")).stdout.splitlines()
        assert table[1].split()[:3] == [NAME, "2/2", "Ready"]
