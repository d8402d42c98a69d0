"""Rules for engine roles and `kv` edges (spec/engines.py), across roles and edges.

An engine runs no handler, so it takes no payload edge; a `kv` edge joins two engines and
makes its source the KV producer (prefill) and its target the consumer (decode). The KV
connector moves blocks over shm or tcp only, and the gateway routes OpenAI requests to
engines, so a pipeline with engines serves `api: openai`.
"""

from __future__ import annotations

from disagg_core.spec import model as m
from disagg_core.spec.fields import Collector

KV_RELAYS = ("auto", "shm", "tcp")  # what the KV connector's sender speaks


def check(pipeline: m.Pipeline, roles: dict[str, int], out: Collector) -> None:
    """Record every problem of the pipeline's engine roles and kv edges in `out`."""
    engines = {r.name for r in pipeline.roles if r.engine is not None}
    for j, edge in enumerate(pipeline.edges):
        if edge.source in roles and edge.target in roles:
            _check_edge(pipeline, j, edge, engines, out)
    if not engines:
        return
    _check_roles(pipeline, roles, engines, out)
    gateway = pipeline.gateway
    if gateway.enabled and gateway.api != "openai" and not out.flawed("spec.gateway.api"):
        out.add(
            "spec.gateway.api",
            f"engine roles ({', '.join(sorted(engines))}) serve the OpenAI API: set api: openai",
        )


def _check_edge(
    pipeline: m.Pipeline, j: int, edge: m.Edge, engines: set[str], out: Collector
) -> None:
    path = f"spec.edges[{j}]"
    if edge.kind == "payload":
        ends = [name for name in (edge.source, edge.target) if name in engines]
        if ends and not out.flawed(f"{path}.kind"):
            out.add(
                f"{path}.kind",
                f"role {ends[0]!r} runs an engine, which takes only kv edges (kind: kv)",
            )
        return
    handlers = [name for name in (edge.source, edge.target) if name not in engines]
    if handlers:
        out.add(
            f"{path}.kind",
            f"a kv edge joins two engine roles; {handlers[0]!r} runs a handler",
        )
    if edge.tensor_refs:
        out.add(f"{path}.tensorRefs", "a kv edge carries KV blocks, not tensor references")
    relay = pipeline.relay_for(edge)
    if relay not in KV_RELAYS:
        where = f"{path}.relay" if edge.relay is not None else "spec.transport.relay"
        out.add(where, f"a kv edge moves blocks over {', '.join(KV_RELAYS)}; got {relay!r}")


def _check_roles(
    pipeline: m.Pipeline, roles: dict[str, int], engines: set[str], out: Collector
) -> None:
    for name in sorted(engines, key=roles.__getitem__):
        path = f"spec.roles[{roles[name]}]"
        sends = [e.target for e in pipeline.edges if e.kind == "kv" and e.source == name]
        takes = [e.source for e in pipeline.edges if e.kind == "kv" and e.target == name]
        if sends and takes:
            out.add(
                f"{path}.engine",
                f"role {name!r} both sends KV (to {sends[0]!r}) and receives it (from "
                f"{takes[0]!r}); an engine is either prefill or decode",
            )
        if len(sends) > 1:
            out.add(
                f"{path}.engine",
                f"role {name!r} sends KV to {len(sends)} roles ({', '.join(sends)}); a prefill "
                "role has one decode role (give it more replicas instead)",
            )
    entries = [n for n in sorted(engines, key=roles.__getitem__) if not _receives_kv(pipeline, n)]
    if len(entries) > 1:
        out.add(
            f"spec.roles[{roles[entries[1]]}].engine",
            f"the gateway routes to one engine role or one prefill/decode pair; "
            f"{', '.join(entries)} all take requests (join them with kv edges, or use replicas)",
        )
    handlers = [r.name for r in pipeline.roles if r.engine is None and r.name and r.handler]
    if handlers:
        first = min(handlers, key=roles.__getitem__)
        out.add(
            f"spec.roles[{roles[first]}].handler",
            f"this pipeline runs engine roles ({', '.join(sorted(engines))}); handler roles "
            "beside them are not supported yet",
        )


def _receives_kv(pipeline: m.Pipeline, name: str) -> bool:
    return any(e.kind == "kv" and e.target == name for e in pipeline.edges)
