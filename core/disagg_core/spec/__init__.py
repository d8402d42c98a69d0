"""DisaggregatedPipeline documents: load, validate, and hand out the frozen model.

This is the one entry point for everyone who reads a pipeline: `disagg validate`, the local
launcher, the role process and the operator (which receives the same document from the API
server). It is pure and torch-free so that the operator and `disagg validate` start fast.
Validation reports every problem at once, each with a field path (`spec.edges[2].to`):

- `fields`: typed readers that collect problems (`Problem`, `SpecError`);
- `parse` (with `parse_roles`, `parse_graph`, `parse_service`, `parse_common`): document ->
  model, one object at a time (types, formats, per-object rules);
- `checks`: rules across objects (unique names, the role graph, colocation groups);
- `model`: the dataclasses and graph queries (`Pipeline.downstream`, `pool_for`, ...).

A role's `replicas` may lie outside its autoscaling [minReplicas, maxReplicas]: it is the
starting point and the autoscaler clamps it. See `model` for the name-length constants.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Final, TextIO

import yaml

from disagg_core import relays
from disagg_core.spec import checks, expand, parse
from disagg_core.spec.engines import EdgeKind, Engine, EngineArg, EngineKind, KvRole
from disagg_core.spec.fields import ROOT, Collector, Problem, SpecError, child
from disagg_core.spec.model import (
    ALL_PODS,
    ANNOTATION_ALLOW_PRIVILEGED,
    API_VERSION,
    DEFAULT_CONCURRENCY,
    DEFAULT_MIGRATION_ATTEMPTS,
    DEFAULT_MIN_BLOCK,
    DEFAULT_POOL_DEVICE,
    DEFAULT_POOL_SIZE,
    DEFAULT_REQUEST_TIMEOUT_SECONDS,
    KIND,
    MAX_DERIVED_NAME_LENGTH,
    MAX_PIPELINE_NAME_LENGTH,
    NO_PODS,
    ONE_POD,
    POOL_DEVICES,
    RELAYS,
    Autoscaling,
    ColocationGroup,
    Edge,
    EnvSetting,
    IntOrPercent,
    PathStep,
    Pipeline,
    PoolDevice,
    PoolOverride,
    PoolSettings,
    Port,
    RatioLockSpec,
    RelayKind,
    Resources,
    Role,
    TensorRef,
    Transport,
    parse_payload_path,
)
from disagg_core.spec.parse_graph import MAX_ROLLOUT_STEP_DEADLINE_SECONDS
from disagg_core.spec.parse_roles import MAX_TARGET_QUEUE
from disagg_core.spec.podpolicy import findings as pod_policy_findings

__all__ = [
    "ALL_PODS",
    "ANNOTATION_ALLOW_PRIVILEGED",
    "API_VERSION",
    "DEFAULT_CONCURRENCY",
    "DEFAULT_MIGRATION_ATTEMPTS",
    "DEFAULT_MIN_BLOCK",
    "DEFAULT_POOL_DEVICE",
    "DEFAULT_POOL_SIZE",
    "DEFAULT_REQUEST_TIMEOUT_SECONDS",
    "KIND",
    "MAX_DERIVED_NAME_LENGTH",
    "MAX_FILE_BYTES",
    "MAX_PIPELINE_NAME_LENGTH",
    "MAX_ROLLOUT_STEP_DEADLINE_SECONDS",
    "MAX_TARGET_QUEUE",
    "NO_PODS",
    "ONE_POD",
    "POOL_DEVICES",
    "RELAYS",
    "ROOT",
    "Autoscaling",
    "Collector",
    "ColocationGroup",
    "Edge",
    "EdgeKind",
    "Engine",
    "EngineArg",
    "EngineKind",
    "EnvSetting",
    "IntOrPercent",
    "KvRole",
    "PathStep",
    "Pipeline",
    "PoolDevice",
    "PoolOverride",
    "PoolSettings",
    "Port",
    "Problem",
    "RatioLockSpec",
    "RelayKind",
    "Resources",
    "Role",
    "SpecError",
    "TensorRef",
    "Transport",
    "child",
    "load_pipeline_file",
    "load_pipeline_text",
    "parse_payload_path",
    "parse_pipeline",
    "pod_policy_findings",
    "validate_cli",
]

MAX_FILE_BYTES = 4 * 2**20  # far above any real pipeline; Kubernetes objects stop at ~1.5 MiB
# YAML nodes that aliases (`*name`) may add beyond those written: a few anchors for repeated
# env lists fit; an "anchor bomb" (aliases of aliases, a billion nodes) stops here, before
# anything walks the expanded tree.
MAX_ALIAS_EXPANSION = 10_000


def parse_pipeline(doc: object) -> Pipeline:
    """The validated pipeline of a parsed document (a dict as from YAML or the API server).

    Raises SpecError listing every problem found. `status` and server-set metadata are ignored.
    """
    pipeline, out = parse.parse_document(doc)
    checks.check(pipeline, out)
    if out.problems:
        raise SpecError(out.problems)
    return pipeline


def load_pipeline_text(
    text: str, source: str = "<text>", *, environ: Mapping[str, str] | None = None
) -> Pipeline:
    """Parse and validate YAML text holding exactly one pipeline document; with `environ`,
    its strings' `${NAME}` and `${NAME:-default}` are expanded first (`expand`)."""
    try:
        docs = [doc for doc in yaml.load_all(text, Loader=_StrictLoader) if doc is not None]
    except yaml.YAMLError as error:
        raise SpecError([Problem("", _yaml_reason(error))], source=source) from None
    if len(docs) != 1:
        reason = "the file is empty" if not docs else f"the file holds {len(docs)} YAML documents"
        raise SpecError([Problem("", f"{reason}; expected exactly one {KIND}")], source=source)
    doc = docs[0]
    if environ is not None:
        out = Collector()
        doc = expand.expand(doc, environ, out)
        if out.problems:
            raise SpecError(out.problems, source=source)
    try:
        return parse_pipeline(doc)
    except SpecError as error:
        raise SpecError(error.problems, source=source) from None


def load_pipeline_file(
    path: str | os.PathLike[str], *, environ: Mapping[str, str] | None = None
) -> Pipeline:
    """Read, parse and validate a pipeline file; every failure, unreadable files included, is
    a SpecError, so callers print one kind of error. `environ`: as `load_pipeline_text`."""
    source = os.fspath(path)
    try:
        with open(source, "rb") as file:
            data = file.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise SpecError([Problem("", f"larger than {MAX_FILE_BYTES} bytes")], source=source)
        text = data.decode("utf-8")
    except OSError as error:
        reason = f"cannot read the file: {error.strerror or error}"
        raise SpecError([Problem("", reason)], source=source) from None
    except UnicodeDecodeError as error:
        raise SpecError([Problem("", f"not UTF-8 text: {error}")], source=source) from None
    return load_pipeline_text(text, source, environ=environ)


def validate_cli(
    files: Sequence[str],
    *,
    out: TextIO,
    err: TextIO | None = None,
    environ: Mapping[str, str] | None = None,
) -> int:
    """`disagg validate`: `FILE: ok` per valid file, `FILE: <path>: <reason>` per problem
    (`${NAME:-default}` from `environ`: the caller's environment, as `disagg up` reads it).

    Returns the exit status: 0 when every file is valid, else 1.
    """
    status = 0
    for name in files:
        try:
            pipeline = load_pipeline_file(name, environ=os.environ if environ is None else environ)
        except SpecError as error:
            status = 1
            for problem in error.problems:
                print(f"{name}: {problem.path or ROOT}: {problem.reason}", file=out)
        else:
            print(f"{name}: ok", file=out)
            for path, note in relay_notes(pipeline):
                print(f"{name}: note: {path}: {note}", file=out)
            for problem in warnings(pipeline):  # (on stderr: stdout stays the verdicts)
                print(f"{name}: warning: {problem.path}: {problem.reason}", file=err or sys.stderr)
    return status


UNAUTHENTICATED: Final = (
    "the gateway is unauthenticated: any pod of the namespace (and spec.networkPolicy."
    "clients; anyone, where NetworkPolicies are not enforced) can send it requests; set "
    "spec.gateway.auth.secretRef, or spec.gateway.enabled: false"
)


def warnings(pipeline: Pipeline) -> list[Problem]:
    """Valid choices worth a second look (`disagg validate` prints them; the operator puts
    them in the status): today, a gateway without a token."""
    gateway = pipeline.gateway
    if gateway.enabled and gateway.auth is None:
        return [Problem("spec.gateway.auth", UNAUTHENTICATED)]
    return []


def relay_notes(pipeline: Pipeline) -> list[tuple[str, str]]:
    """(field path, note) for each relay the pipeline names whose package is missing here."""
    notes = []
    written = [("spec.transport.relay", pipeline.transport.relay)]
    written += [
        (f"spec.edges[{i}].relay", e.relay) for i, e in enumerate(pipeline.edges) if e.relay
    ]
    for path, kind in written:
        missing = relays.missing_here(kind)
        if missing is not None:
            notes.append((path, missing))
    return notes


class _AliasError(yaml.composer.ComposerError):
    """Aliases that expand too far, or into themselves."""


def _check_expansion(root: yaml.Node) -> None:
    """Raise a ComposerError when aliases make the document's tree much larger than its text
    (or cyclic). Node sizes are memoized, so this costs one pass over the written nodes."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    written = 0

    def size(node: yaml.Node) -> int:
        nonlocal written
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise _AliasError(
                None, None, "an alias refers to a node that contains it (a cycle)", node.start_mark
            )
        open_nodes.add(key)
        written += 1
        total = 1
        if isinstance(node, yaml.SequenceNode):
            total += sum(size(item) for item in node.value)
        elif isinstance(node, yaml.MappingNode):
            total += sum(size(k) + size(v) for k, v in node.value)
        open_nodes.discard(key)
        sizes[key] = total
        if total - written > MAX_ALIAS_EXPANSION:
            raise _AliasError(
                None,
                None,
                f"aliases expand this document by more than {MAX_ALIAS_EXPANSION} nodes "
                "(an anchor bomb?)",
                node.start_mark,
            )
        return total

    size(root)


def _yaml_reason(error: yaml.YAMLError) -> str:
    mark = getattr(error, "problem_mark", None)
    problem = getattr(error, "problem", None) or str(error)
    what = "YAML alias error" if isinstance(error, _AliasError) else "YAML syntax error"
    if mark is None:
        return f"{what}: {problem}"
    return f"{what} at line {mark.line + 1}, column {mark.column + 1}: {problem}"


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key repeated in one mapping (PyYAML keeps the last one
    silently, so a second `replicas:` would quietly win), and documents whose aliases expand
    to more than MAX_ALIAS_EXPANSION extra nodes, or refer to themselves. Merge keys (`<<`)
    may still be overridden, as YAML intends."""

    def compose_document(self) -> yaml.Node | None:
        node = super().compose_document()
        if node is not None:
            _check_expansion(node)
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        seen: set[tuple[str, str]] = set()
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
                continue
            key = (key_node.tag, key_node.value)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key_node.value!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep)
