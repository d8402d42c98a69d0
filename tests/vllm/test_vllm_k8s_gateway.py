"""P/D through the gateway the operator renders: the real operator (kopf) reconciles an
engine pipeline against the API emulator; the prefill and decode engines run the rendered
StatefulSets' commands, and `disagg gateway` the rendered Deployment's environment and
topology ConfigMap, on this host with the pods' DNS names mapped to 127.0.0.1 (as the
e2e-local node's pods reach each other). Decode autoscales to 3, one replica runs: the
second listed replica is not listening, the third does not resolve; the gateway skips
both. Greedy answers through the `openai` client equal one engine's (the decode engine
asked directly, without kv_transfer_params). Two engines, ~4 GB.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import subprocess
from typing import Any

import pytest
import yaml

from disagg_runtime.bench.vllm.run import PROMPTS
from tests.integration import operator_support as s
from tests.integration.rendered_gateway import (
    RenderedGateway,
    free_port,
    localize,
    peer_key,
    rendered_env,
)
from tests.k8s.fixtures import Kubectl
from tests.k8s.server import EmulatorThread
from tests.vllm import engines as E
from tests.vllm.test_vllm_pd import MAX_TOKENS, _eventually, _metric

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
NAME = "pd"
MODEL = "tiny-vllm"
DNS = "{role}.default.svc.cluster.local"
ARGS = {  # as tests/vllm/engines.py starts the reference engine
    "dtype": "float32",
    "enforceEager": True,
    "maxModelLen": 512,
    "blockSize": 32,
    "kvCacheMemoryBytes": 64 << 20,
    "enablePrefixCaching": False,
    "maxNumSeqs": 32,
    "seed": 0,
}


def _doc(model: pathlib.Path) -> dict[str, Any]:
    return s.engine_pipeline_doc(
        NAME,
        {"model": str(model), "args": ARGS},
        model=MODEL,
        decode={"autoscaling": {"minReplicas": 1, "maxReplicas": 3}},
    )


def _pod(role: str, i: int) -> str:
    return f"{NAME}-{role}-{i}.{NAME}-{role}.default.svc.cluster.local"


def _engine(
    k8s: EmulatorThread, role: str, places: dict[str, str], key: str, port: int, kv_port: int
) -> tuple[list[str], str]:
    """The rendered engine container's command for this host: its interpreter the vLLM
    env's, its bind addresses local, the peer names mapped, the Secret's key file."""
    sts = k8s.get(s.STS, f"{NAME}-{role}", s.NS)
    assert sts is not None
    [container] = sts["spec"]["template"]["spec"]["containers"]
    argv = list(container["command"])
    assert argv[0] == "python"
    argv[0] = str(E.PYTHON)
    argv[argv.index("--host") + 1] = "127.0.0.1"
    argv[argv.index("--port") + 1] = str(port)
    i = argv.index("--kv-transfer-config")
    config = json.loads(localize(argv[i + 1], places))
    extra = config["kv_connector_extra_config"]
    extra["key_file"] = key
    if "listen" in extra:
        extra["listen"] = f"tcp://127.0.0.1:{kv_port}"
    argv[i + 1] = json.dumps(config)
    env = {v["name"]: v["value"] for v in container["env"] if "value" in v}
    assert env["HOME"] == "/tmp"
    return argv, container["command"][i + 1]


def test_the_operator_rendered_gateway_routes_pd_equal_to_one_engine(
    k8s: EmulatorThread, kubectl: Kubectl, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    E.require_vllm()
    # on a loaded 2-core machine a first run (then three engines) saw the decode engine's
    # core still initializing after 240 s (E.START_S)
    monkeypatch.setattr(E, "START_S", 480.0)
    model = E.tiny_model(tmp_path / "model")

    async def render() -> None:
        await s.call(kubectl, "apply", "-f", str(s.CRD))
        async with s.running_operator(k8s):
            await s.call(kubectl, "apply", "-f", "-", input=yaml.safe_dump(_doc(model)))
            await s.until(k8s, lambda: len(k8s.list(s.STS, s.NS)) == 2, "the StatefulSets")
            await s.until(k8s, lambda: k8s.list(s.DEPLOY, s.NS), "the gateway")
            await s.until(k8s, lambda: k8s.get("v1/secrets", "pd-peer-key", s.NS), "the key")

    asyncio.run(render())
    ports = {name: free_port() for name in ("prefill", "decode", "kv", "closed")}
    places = {
        f"{_pod('prefill', 0)}:8000": f"127.0.0.1:{ports['prefill']}",
        f"{_pod('decode', 0)}:8000": f"127.0.0.1:{ports['decode']}",
        f"{_pod('decode', 0)}:7600": f"127.0.0.1:{ports['kv']}",
        # scaled below the maximum: decode-1 is not listening; decode-2 does not resolve
        f"{_pod('decode', 1)}:8000": f"127.0.0.1:{ports['closed']}",
        f"{_pod('decode', 1)}:7600": f"127.0.0.1:{ports['closed']}",
    }
    key = peer_key(k8s, NAME, s.NS, tmp_path)
    logs = tmp_path / "logs"
    logs.mkdir()
    procs: list[E.Engine] = []
    for role, port in (("decode", ports["decode"]), ("prefill", ports["prefill"])):
        argv, rendered_kv = _engine(k8s, role, places, key, port, ports["kv"])
        if role == "prefill":  # the allow-list the operator wrote: every replica up to 3
            told = json.loads(rendered_kv)["kv_connector_extra_config"]["decodes"]
            assert told == [f"tcp://{_pod('decode', i)}:7600" for i in range(3)]
        log = logs / f"{role}.log"
        environ = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(E.ROOT), "HOME": str(tmp_path)}
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(os.environ) | environ,
                start_new_session=True,
                cwd=E.ROOT,
            )
        procs.append(E.Engine(role, port, proc, log))
    gateway = RenderedGateway(
        rendered_env(k8s, NAME, s.NS, tmp_path / "gateway", places, port=free_port()),
        tmp_path / "gateway",
    )
    try:
        with E.running(*procs):
            ready = gateway.readyz(E.START_S, 200)
            assert ready.status_code == 200, ready.text
            # one engine without disaggregation: the decode engine asked directly (no
            # kv_transfer_params), as test_vllm_pd does: a third engine costs CI minutes
            reference = procs[0]
            import openai

            c = openai.OpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0, timeout=120)
            one = openai.OpenAI(base_url=reference.url, api_key="x", max_retries=0, timeout=120)
            for p in PROMPTS:
                want = one.completions.create(
                    model=MODEL, prompt=p, max_tokens=MAX_TOKENS, temperature=0
                )
                got = c.completions.create(
                    model=MODEL, prompt=p, max_tokens=MAX_TOKENS, temperature=0
                )
                assert got.choices[0].text == want.choices[0].text, p
                assert got.usage is not None and want.usage is not None
                assert got.usage.completion_tokens == want.usage.completion_tokens == MAX_TOKENS
            stream = c.completions.create(
                model=MODEL, prompt=PROMPTS[-1], max_tokens=MAX_TOKENS, temperature=0, stream=True
            )
            streamed = "".join(e.choices[0].text for e in stream if e.choices)
            want = one.completions.create(
                model=MODEL, prompt=PROMPTS[-1], max_tokens=MAX_TOKENS, temperature=0
            )
            assert streamed == want.choices[0].text
            # the KV really moved: the prefill engine's connector counted every hand-off
            prefill = procs[1]
            _eventually(
                lambda: _metric(prefill, "vllm:disagg_kv_send_seconds_count") >= len(PROMPTS) + 1,
                60,
                "the prefill connector's sends in its /metrics",
            )
            assert _metric(prefill, "vllm:disagg_kv_send_failures_total") == 0
    finally:
        code = gateway.stop()
        for e in procs:
            e.stop()
    assert code == 0, gateway.tail()
