"""The engine role's command line and KV connector configuration (contract/engine.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from disagg_core import contract, spec
from disagg_core.contract.engine import cli_name, engine_args
from tests.unit.core.test_spec_engines import doc


def pd() -> spec.Pipeline:
    return spec.parse_pipeline(doc())


def kv_of(argv: list[str]) -> dict[str, Any]:
    return dict(json.loads(argv[argv.index("--kv-transfer-config") + 1]))


def test_prefill_command_sends_only_to_the_decode_replicas() -> None:
    launch = contract.EngineLaunch(
        name="prefill-0",
        host="127.0.0.1",
        port=9001,
        key_file="/run/key",
        decodes=("tcp://127.0.0.1:7001", "tcp://127.0.0.1:7002"),
    )
    argv = contract.engine_command(pd(), "prefill", launch, python="/venv/bin/python")
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert argv[argv.index("--model") + 1] == "/models/tiny"
    assert argv[argv.index("--served-model-name") + 1] == "tiny"  # spec.gateway.model
    assert argv[argv.index("--port") + 1] == "9001"
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert "--tensor-parallel-size" not in argv  # ranks: 1
    assert argv[argv.index("--max-model-len") + 1] == "512"
    assert "--enforce-eager" in argv and argv[argv.index("--dtype") + 1] == "float32"
    assert kv_of(argv) == {
        "kv_connector": "DisaggConnector",
        "kv_connector_module_path": "disagg_runtime.engines.vllm.connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {
            "key_file": "/run/key",
            "pipeline": "pd",
            "decodes": ["tcp://127.0.0.1:7001", "tcp://127.0.0.1:7002"],
        },
    }


def test_decode_command_listens_and_ranks_become_tensor_parallel() -> None:
    launch = contract.EngineLaunch(
        name="decode-1", host="0.0.0.0", port=8000, key_file="/k", kv_listen="tcp://0.0.0.0:7700"
    )
    argv = contract.engine_command(pd(), "decode", launch)
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    extra = kv_of(argv)["kv_connector_extra_config"]
    assert kv_of(argv)["kv_role"] == "kv_consumer"
    assert extra == {
        "key_file": "/k",
        "pipeline": "pd",
        "listen": "tcp://0.0.0.0:7700",
        "role": "decode-1",
    }
    with pytest.raises(ValueError, match="kv_listen"):
        contract.engine_command(
            pd(), "decode", launch.__class__(name="d", host="h", port=1, key_file="k")
        )


def test_a_lone_engine_runs_no_connector_and_uses_its_model_name() -> None:
    document = doc(edges=[], gateway={"api": "openai", "model": "m"})
    del document["spec"]["roles"][1]
    argv = contract.engine_command(
        spec.parse_pipeline(document),
        "prefill",
        contract.EngineLaunch(name="p", host="h", port=1, key_file="k"),
    )
    assert "--kv-transfer-config" not in argv


def test_a_handler_role_has_no_engine_command() -> None:
    document = doc()
    document["spec"] = {"roles": [{"name": "a", "handler": "p.m:f"}], "image": "i"}
    with pytest.raises(ValueError, match="runs a handler"):
        contract.engine_command(
            spec.parse_pipeline(document),
            "a",
            contract.EngineLaunch(name="a", host="h", port=1, key_file="k"),
        )


def test_engine_args_and_names() -> None:
    assert cli_name("maxModelLen") == "max-model-len"
    assert cli_name("kvCacheMemoryBytes") == "kv-cache-memory-bytes"
    assert cli_name("dtype") == "dtype"
    assert engine_args({"enablePrefixCaching": False, "seed": 0, "gpuMemoryUtilization": 0.5}) == [
        "--no-enable-prefix-caching",
        "--seed",
        "0",
        "--gpu-memory-utilization",
        "0.5",
    ]
