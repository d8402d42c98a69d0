"""`spec.roles[].engine`: the engine a role runs instead of a handler (spec/engines.py)."""

from __future__ import annotations

import math

from disagg_core.spec import engines as e
from disagg_core.spec import fields as f
from disagg_core.spec.fields import Collector, child
from disagg_core.spec.parse_common import or_default

ENGINE_KEYS = ("kind", "model", "args", "port", "kvPort")


def engine(out: Collector, raw: object, path: str) -> e.Engine | None:
    """The engine of a role; None when it is unusable (reported)."""
    g = f.fields(out, raw, path, known=ENGINE_KEYS, required=("kind", "model"))
    if g is None:
        return None
    kind = f.choice(out, g, "kind", path, e.ENGINE_KINDS)
    model = f.text(out, g, "model", path)
    args = _args(out, g, path)
    port = or_default(_port(out, g, "port", path), e.DEFAULT_ENGINE_PORT)
    kv_port = or_default(_port(out, g, "kvPort", path), e.DEFAULT_KV_PORT)
    if port == kv_port:
        out.add(child(path, "kvPort"), f"must differ from the engine's port {port}")
    if kind is None or model is None:
        return None
    return e.Engine(
        kind=kind,
        model=model,
        args=args,
        port=port,
        kv_port=kv_port,
    )


def _port(out: Collector, g: dict[str, object], key: str, path: str) -> int | None:
    number = f.integer(out, g, key, path, minimum=1)
    if number is not None and number > 65535:
        out.add(child(path, key), f"must be in 1..65535, got {number}")
        return None
    return number


def _args(out: Collector, g: dict[str, object], path: str) -> dict[str, e.EngineArg]:
    """`args`: camelCase names to scalars (string, number, true/false), bounded."""
    if "args" not in g:
        return {}
    path = child(path, "args")
    raw = g["args"]
    if not isinstance(raw, dict):
        out.add(path, f"expected a mapping of argument names to values, got {f.kind_of(raw)}")
        return {}
    if len(raw) > e.MAX_ENGINE_ARGS:
        out.add(path, f"at most {e.MAX_ENGINE_ARGS} arguments, got {len(raw)}")
        return {}
    result: dict[str, e.EngineArg] = {}
    for name, value in raw.items():
        where = child(path, str(name))
        reason = _arg_problem(name, value)
        if reason is not None:
            out.add(where, reason)
        elif isinstance(name, str):
            result[name] = value
    return result


def _arg_problem(name: object, value: object) -> str | None:
    if not isinstance(name, str) or not e.ENGINE_ARG_NAME.fullmatch(name):
        return (
            "argument names are camelCase (a lowercase letter, then letters and digits: "
            f"maxModelLen for --max-model-len), got {name!r}"
        )
    if len(name) > e.MAX_ENGINE_ARG_NAME_LENGTH:
        return f"at most {e.MAX_ENGINE_ARG_NAME_LENGTH} characters"
    if name in e.RESERVED_ENGINE_ARGS:
        return f"set by disagg ({_reserved_source(name)}); remove it from args"
    if isinstance(value, float) and not math.isfinite(value):
        return f"expected a finite number, got {value!r}"
    if isinstance(value, str):
        if len(value) > e.MAX_ENGINE_ARG_LENGTH:
            return f"at most {e.MAX_ENGINE_ARG_LENGTH} characters, got {len(value)}"
        if "\0" in value:
            return "must not contain NUL"
        return None
    if not isinstance(value, (bool, int, float)):
        return f"expected a string, number or true/false, got {f.kind_of(value)}"
    return None


def _reserved_source(name: str) -> str:
    return {
        "model": "engine.model",
        "host": "the launcher or the pod",
        "port": "engine.port",
        "tensorParallelSize": "roles[].ranks",
        "kvTransferConfig": "the pipeline's kv edges",
        "servedModelName": "spec.gateway.model",
    }[name]
