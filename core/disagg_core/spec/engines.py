"""Engine roles: a role that runs an inference engine (vLLM) instead of a Python handler.

An engine keeps its own continuous batching and paged KV cache; disagg starts it, wires its
KV connector from the pipeline's `kv` edges and routes OpenAI requests to it. The engine
kind, model and arguments are data here; turning them into a command line is the
business of `disagg_core.contract.engine`, shared by the operator and `disagg up`.

A `kv` edge joins two engine roles: its source is the KV producer (prefill), its target
the consumer (decode), which listens for the KV blocks on `kv_port`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, Literal, get_args

EngineKind = Literal["vllm"]
ENGINE_KINDS: tuple[EngineKind, ...] = get_args(EngineKind)
EdgeKind = Literal["payload", "kv"]
EDGE_KINDS: tuple[EdgeKind, ...] = get_args(EdgeKind)
KvRole = Literal["kv_producer", "kv_consumer"]
EngineArg = str | int | float | bool

DEFAULT_ENGINE_PORT: Final = 8000  # the engine's HTTP port: OpenAI API, /health, /metrics
DEFAULT_KV_PORT: Final = 7600  # a consumer's KV ingress (the connector's `listen`)
MAX_ENGINE_ARGS: Final = 64
MAX_ENGINE_ARG_LENGTH: Final = 4096
MAX_ENGINE_ARG_NAME_LENGTH: Final = 64
ENGINE_ARG_NAME: Final = re.compile(r"[a-z][a-zA-Z0-9]*")  # camelCase: maxModelLen
# Arguments disagg sets itself, from the role and the pipeline: refused in `args`.
RESERVED_ENGINE_ARGS: Final = frozenset(
    {
        "model",  # engine.model
        "host",
        "port",  # engine.port
        "tensorParallelSize",  # roles[].ranks
        "kvTransferConfig",  # the pipeline's kv edges
        "servedModelName",  # spec.gateway.model
    }
)


@dataclass(frozen=True, kw_only=True)
class Engine:
    """`roles[].engine`: run `kind` serving `model` (a directory or a model name the engine
    resolves), with `args` (camelCase engine arguments, e.g. `maxModelLen: 512` for vLLM's
    `--max-model-len 512`; true is a flag, false its `--no-` form). `port` is the engine's
    HTTP port; `kv_port` the KV ingress a decode (consumer) engine listens on."""

    kind: EngineKind
    model: str
    args: Mapping[str, EngineArg] = field(default_factory=dict)
    port: int = DEFAULT_ENGINE_PORT
    kv_port: int = DEFAULT_KV_PORT
