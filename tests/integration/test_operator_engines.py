"""Engine roles through the real operator and the real kubectl against the API emulator: a
vLLM prefill/decode pipeline applied with kubectl is reconciled into StatefulSets running
the vLLM server wired to the KV connector, with the engines' ports, /health probes, the
peer key, the NetworkPolicy and the gateway; every object is admitted without a warning,
and the pipeline goes Ready once its engines are."""

from __future__ import annotations

import copy
import json
import logging
import pathlib
from typing import Any

import httpx
import pytest
import yaml

from disagg_core import spec
from disagg_operator.plan import planner, render
from disagg_runtime.gateway import server
from tests.integration import operator_support as s
from tests.integration.rendered_gateway import RenderedGateway, free_port, rendered_env
from tests.k8s.fixtures import Kubectl
from tests.k8s.server import EmulatorThread

Obj = dict[str, Any]
NAME = "pd"
POLICIES = "networking.k8s.io/v1/networkpolicies"
DOC: Obj = s.engine_pipeline_doc(
    NAME,
    {"model": "/models/tiny"},
    model="tiny",
    prefill={
        "engine": {"args": {"maxModelLen": 512, "enforceEager": True, "dtype": "float32"}},
        "resources": {"requests": {"cpu": "1", "memory": "3Gi"}},
        "startupSeconds": 300,
    },
    decode={
        "replicas": 2,
        "ranks": 2,
        "engine": {"kvPort": 7601},
        "resources": {"limits": {"nvidia.com/gpu": 1}},
        "autoscaling": {"minReplicas": 1, "maxReplicas": 3},
    },
    edge={"relay": "tcp"},
)


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


@pytest.mark.asyncio
async def test_the_rendered_gateway_refuses_what_it_lacks_and_waits_for_engines(
    k8s: EmulatorThread,
    kubectl: Kubectl,
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`disagg gateway` from the operator's rendering (no engines running): a topology
    without the `engines` section is refused at start, naming it; with it, the gateway
    serves and its /readyz says which engine role has no replica answering (none resolves
    here), so its pod is not Ready and a request is a 503, not a hang."""
    await s.call(kubectl, "apply", "-f", str(s.CRD))
    async with s.running_operator(k8s):
        await s.call(kubectl, "apply", "-f", "-", input=yaml.safe_dump(_doc()))
        await s.until(k8s, lambda: k8s.list(s.DEPLOY, s.NS), "the gateway")
        await s.until(k8s, lambda: k8s.get("v1/secrets", "pd-peer-key", s.NS), "the peer key")
    env = rendered_env(k8s, NAME, s.NS, tmp_path, {}, port=free_port())
    gateway = RenderedGateway(env, tmp_path)
    try:
        # the same configuration lacking the table: `disagg gateway` (cli -> server.main)
        # refuses at start, naming it (here in-process: a second start would import again)
        lacking = rendered_env(
            k8s, NAME, s.NS, tmp_path / "lacking", {}, port=0, edit_topology=_drop_engines
        )
        for name, value in lacking.items():
            monkeypatch.setenv(name, value)
        with caplog.at_level(logging.ERROR):
            assert server.main() == 2
        assert "no `engines` section" in caplog.text and "'decode'" in caplog.text

        answer = await s.call(gateway.readyz, 90.0, 503)
        assert answer.status_code == 503
        assert "none of its" in answer.text and "replicas answers" in answer.text, answer.text
        r = await s.call(
            httpx.post,
            gateway.url + "/v1/completions",
            json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
            timeout=30,
        )
        assert r.status_code == 503 and "no ready replica" in r.json()["error"]["message"]
    finally:
        assert gateway.stop() == 0, gateway.tail()


def _drop_engines(topology: Obj) -> None:
    del topology["engines"]
