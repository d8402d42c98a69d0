"""Document -> model, field by field: shapes, types, formats and per-object rules.

This module reads the document's top (metadata, spec's sections) and hands each section to
its reader: `parse_roles` (spec.roles[]), `parse_graph` (edges, colocation, ratio locks,
rollout), `parse_service` (transport, gateway, network policy, monitoring), with the readers
they share in `parse_common`. Each reader takes one object of the document, records what
is wrong with it at its path and still returns a model object (with defaults or
placeholders where a field was unusable), so that cross-object checks (`checks`) can run
on the rest and the user sees every problem at once. A role or edge whose name fields are
unusable gets the name "", which later checks skip: its own problem has already been
reported.
"""

from __future__ import annotations

from disagg_core.spec import fields as f
from disagg_core.spec import model as m
from disagg_core.spec import parse_common as common
from disagg_core.spec import parse_graph as graph
from disagg_core.spec import parse_roles as role_reader
from disagg_core.spec import parse_service as service
from disagg_core.spec.fields import Collector

TOP_KEYS = ("apiVersion", "kind", "metadata", "spec", "status")
METADATA_KEYS = (
    "name", "namespace", "labels", "annotations", "uid", "resourceVersion", "generation",
    "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "finalizers",
    "managedFields", "ownerReferences", "generateName", "selfLink",
)  # fmt: skip
SPEC_KEYS = (
    "image", "transport", "roles", "edges", "colocation", "ratioLocks", "networkPolicy",
    "rollout", "gateway", "monitoring",
)  # fmt: skip


def parse_document(doc: object) -> tuple[m.Pipeline, Collector]:
    """The pipeline a document describes and the problems found reading it."""
    out = Collector()
    required = ("apiVersion", "kind", "metadata", "spec")
    top = f.fields(out, doc, "", known=TOP_KEYS, required=required)
    if top is None:
        return m.Pipeline(name=""), out
    _expect(out, top, "apiVersion", m.API_VERSION)
    _expect(out, top, "kind", m.KIND)
    meta = _section(out, top, "metadata", known=METADATA_KEYS, required=("name",))
    name = _pipeline_name(out, meta)
    namespace = common.dns_label(out, meta, "namespace", "metadata", common.DNS_1123_LABEL)
    labels = f.string_map(out, meta, "labels", "metadata")
    annotations = f.string_map(out, meta, "annotations", "metadata")
    spec = _section(out, top, "spec", known=SPEC_KEYS, required=("roles",))
    image = common.image(out, spec, "spec")
    transport = service.transport(out, spec.get("transport", {}), "spec.transport")
    roles = tuple(role_reader.role(out, raw, p) for p, raw in f.items(out, spec, "roles", "spec"))
    if isinstance(spec.get("roles"), list) and not roles:
        out.add("spec.roles", "a pipeline needs at least one role")
    edges = tuple(graph.edge(out, raw, path) for path, raw in f.items(out, spec, "edges", "spec"))
    groups = [graph.group(out, raw, path) for path, raw in f.items(out, spec, "colocation", "spec")]
    locks = [graph.ratio_lock(out, raw, p) for p, raw in f.items(out, spec, "ratioLocks", "spec")]
    network = service.network_policy(out, spec.get("networkPolicy", {}), "spec.networkPolicy")
    rollout = graph.rollout(out, spec.get("rollout", {}), "spec.rollout")
    gateway = service.gateway(out, spec.get("gateway", {}), "spec.gateway")
    monitoring = service.monitoring(out, spec.get("monitoring", {}), "spec.monitoring")
    pipeline = m.Pipeline(
        name=name,
        namespace=namespace,
        labels=labels,
        annotations=annotations,
        image=image,
        transport=transport,
        roles=roles,
        edges=edges,
        colocation=tuple(groups),
        ratio_locks=tuple(lock for lock in locks if lock is not None),
        network_policy=network,
        rollout=rollout,
        gateway=gateway,
        monitoring=monitoring,
    )
    return pipeline, out


def _section(
    out: Collector,
    top: dict[str, object],
    key: str,
    *,
    known: tuple[str, ...],
    required: tuple[str, ...],
) -> dict[str, object]:
    """A top-level mapping; {} when it is missing (already reported) or not a mapping."""
    if key not in top:
        return {}
    return f.fields(out, top[key], key, known=known, required=required) or {}


def _expect(out: Collector, top: dict[str, object], key: str, wanted: str) -> None:
    value = f.text(out, top, key, "")
    if value is not None and value != wanted:
        out.add(key, f"must be {wanted!r}, got {value!r}")


def _pipeline_name(out: Collector, meta: dict[str, object]) -> str:
    name = common.dns_label(out, meta, "name", "metadata", common.DNS_1035_LABEL) or ""
    if len(name) > m.MAX_PIPELINE_NAME_LENGTH and not out.flawed("metadata.name"):
        out.add(
            "metadata.name",
            f"{name!r} has {len(name)} characters; a pipeline name may have at most "
            f"{m.MAX_PIPELINE_NAME_LENGTH} (role and group names are appended to it)",
        )
    return name
