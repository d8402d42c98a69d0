"""Shared by tests/integration/test_operator_*.py: the real operator (kopf) running in the
test's event loop against the Kubernetes API emulator, and small waiting helpers.

The tests act as the workload controllers the emulator lacks (`mark_ready`)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import pathlib
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any, TypeVar

import yaml

from disagg_core import spec
from disagg_operator import names
from disagg_operator.app import main
from disagg_operator.plan import planner
from disagg_operator.reconcile.metrics import Metrics
from tests.k8s.server import EmulatorThread
from tests.support import REPO

EXAMPLE = REPO / "examples" / "text-to-video.yaml"
CRD = REPO / "crds" / "disagg.dev_disaggregatedpipelines.yaml"
RBAC_FILE = pathlib.Path(__file__).with_name("operator_rbac_observed.json")
RBAC_RECORD_ENV = "DISAGG_RECORD_OPERATOR_RBAC"
WAIT = 10.0  # upper bound for anything the operator should do "soon"
NS = "default"
PIPELINES = "disagg.dev/v1alpha1/disaggregatedpipelines"
STS = "apps/v1/statefulsets"
DEPLOY = "apps/v1/deployments"
CHILD_REFS = (
    "v1/configmaps",
    "v1/services",
    STS,
    "apps/v1/deployments",
    "resource.k8s.io/v1/resourceclaimtemplates",
)
T = TypeVar("T")
Obj = dict[str, Any]
# kopf's ClusterKopfPeering, as kopf documents it, plus a status subresource: the emulator
# keeps `status` only through one.
PEERING_CRD: Obj = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "clusterkopfpeerings.kopf.dev"},
    "spec": {
        "scope": "Cluster",
        "group": "kopf.dev",
        "names": {
            "kind": "ClusterKopfPeering",
            "plural": "clusterkopfpeerings",
            "singular": "clusterkopfpeering",
        },
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                    }
                },
            }
        ],
    },
}


def peering(name: str) -> Obj:
    return {"apiVersion": "kopf.dev/v1", "kind": "ClusterKopfPeering", "metadata": {"name": name}}


def example() -> Obj:
    doc = yaml.safe_load(EXAMPLE.read_text())
    assert isinstance(doc, dict)
    return doc


def pipeline_doc(name: str, roles: list[Obj], edges: list[Obj] | None = None) -> Obj:
    """A small pipeline; roles as {"name": ..., ...} (a handler is filled in)."""
    return {
        "apiVersion": names.PIPELINE_API_VERSION,
        "kind": names.PIPELINE_KIND,
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "image": "ghcr.io/disagg/runtime:0.1.0",
            "roles": [{"handler": "disagg_runtime.demo:encode_text", **r} for r in roles],
            "edges": edges or [],
        },
    }


def engine_pipeline_doc(
    name: str,
    engine: Obj,
    *,
    model: str,
    prefill: Obj | None = None,
    decode: Obj | None = None,
    edge: Obj | None = None,
) -> Obj:
    """A vLLM prefill -> decode pipeline over a kv edge behind the OpenAI gateway serving
    `model`: `engine` is both roles' engine (kind vllm), `prefill` and `decode` add to their
    role (an `engine` there to the shared one), `edge` to the kv edge."""

    def role(role: str, extra: Obj | None) -> Obj:
        extra = copy.deepcopy(extra or {})
        own = {"kind": "vllm", **copy.deepcopy(engine), **extra.pop("engine", {})}
        return {"name": role, "engine": own, **extra}

    return {
        "apiVersion": names.PIPELINE_API_VERSION,
        "kind": names.PIPELINE_KIND,
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "image": "ghcr.io/disagg/runtime-vllm:0.1.0",
            "roles": [role("prefill", prefill), role("decode", decode)],
            "edges": [{"from": "prefill", "to": "decode", "kind": "kv", **(edge or {})}],
            "gateway": {"api": "openai", "model": model},
        },
    }


@contextlib.asynccontextmanager
async def running_operator(
    k8s: EmulatorThread,
    *,
    progress_deadline: float = 600.0,
    metrics: Metrics | None = None,
    events: list[tuple[str, str, str]] | None = None,
    namespaces: tuple[str, ...] = (),
    peering: str | None = None,
    priority: int = 0,
) -> AsyncIterator[main.Operator]:
    """The operator until the block ends (then cancelled): all namespaces unless given,
    standalone unless a peering name is given."""
    config = main.OperatorConfig(
        namespaces=namespaces,
        liveness_port=0,
        metrics_port=0,
        peering=peering,
        standalone=peering is None,
        priority=priority,
        connection=k8s.connection_info(),
        progress_deadline=progress_deadline,
    )
    operator = main.build(config, metrics=metrics)
    if events is not None:
        post = operator.reconciler.post_event

        def recording(body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
            events.append((type_, reason, message))
            post(body, type_, reason, message)

        operator.reconciler.post_event = recording
    async with run(operator):
        yield operator


@contextlib.asynccontextmanager
async def run(operator: main.Operator) -> AsyncIterator[main.Operator]:
    """`operator` running in this event loop until the block ends (then cancelled)."""
    task = asyncio.create_task(operator.run(), name="kopf-operator")
    try:
        yield operator
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(task, timeout=WAIT)


async def until(
    k8s: EmulatorThread, predicate: Callable[[], T], message: str, timeout: float = WAIT
) -> T:
    """Poll `predicate` (which may call the blocking k8s helpers) without blocking the loop."""
    return await asyncio.to_thread(k8s.wait_for, predicate, timeout, 0.02, message)


async def call(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """A blocking emulator helper, run off the loop (the operator keeps running)."""
    return await asyncio.to_thread(fn, *args, **kwargs)


def children(k8s: EmulatorThread, pipeline: str, namespace: str = NS) -> dict[str, Obj]:
    """Every child of `pipeline` by "Kind/name"."""
    found: dict[str, Obj] = {}
    for ref in CHILD_REFS:
        for obj in k8s.list(ref, namespace, f"{names.LABEL_PIPELINE}={pipeline}"):
            found[f"{obj['kind']}/{obj['metadata']['name']}"] = obj
    return found


GUARDS = {"Secret": "v1/secrets", "NetworkPolicy": "networking.k8s.io/v1/networkpolicies"}


def planned_children(doc: Obj, namespace: str = NS) -> int:
    """How many of `doc`'s planned children `children` finds (the kinds of CHILD_REFS)."""
    kinds = {"ConfigMap", "Service", "StatefulSet", "Deployment", "ResourceClaimTemplate"}
    objects = planner.plan(spec.parse_pipeline(copy.deepcopy(doc)), namespace=namespace)
    return sum(o["kind"] in kinds for o in objects)


def guards(k8s: EmulatorThread, pipeline: str, kind: str, namespace: str = NS) -> list[Obj]:
    """The pipeline's peer key Secrets or NetworkPolicies (not in `children`, whose counts
    the older tests rely on)."""
    return list(k8s.list(GUARDS[kind], namespace, f"{names.LABEL_PIPELINE}={pipeline}"))


def versions(objs: Mapping[str, Obj]) -> dict[str, str]:
    return {key: obj["metadata"]["resourceVersion"] for key, obj in objs.items()}


def pipeline_status(k8s: EmulatorThread, name: str, namespace: str = NS) -> Obj:
    obj = k8s.get(PIPELINES, name, namespace)
    return dict((obj or {}).get("status") or {})


def condition(status: Mapping[str, Any], kind: str) -> Obj:
    return next((dict(c) for c in status.get("conditions") or [] if c["type"] == kind), {})


def mark_ready(k8s: EmulatorThread, pipeline: str, namespace: str = NS) -> None:
    """Play the StatefulSet controller: every replica of every StatefulSet ready."""
    for sts in k8s.list(STS, namespace, f"{names.LABEL_PIPELINE}={pipeline}"):
        replicas = sts["spec"]["replicas"]
        k8s.patch_status(
            STS,
            sts["metadata"]["name"],
            {
                "observedGeneration": sts["metadata"]["generation"],
                "replicas": replicas,
                "readyReplicas": replicas,
                "updatedReplicas": replicas,
                "availableReplicas": replicas,
            },
            namespace,
        )


def event_reasons(k8s: EmulatorThread, name: str, namespace: str = NS) -> list[tuple[str, str]]:
    """(type, reason) of the Events about the pipeline `name`."""
    return [
        (e.get("type", ""), e.get("reason", ""))
        for e in k8s.list("v1/events", namespace)
        if (e.get("involvedObject") or {}).get("name") == name
        and (e.get("involvedObject") or {}).get("kind") == names.PIPELINE_KIND
    ]


def events_of(k8s: EmulatorThread, name: str, namespace: str = NS) -> list[Obj]:
    return [
        e
        for e in k8s.list("v1/events", namespace)
        if (e.get("involvedObject") or {}).get("name") == name
    ]


# ---------------------------------------------------------------------------- RBAC record

Rule = tuple[str, str, str]  # (apiGroup, resource[/subresource], verb)


def observed_rbac(k8s: EmulatorThread) -> set[Rule]:
    return {(g or "", r or "", v) for g, r, v in k8s.rbac_calls()}


def recorded_rbac() -> set[Rule]:
    data = json.loads(RBAC_FILE.read_text())
    return {(r["apiGroup"], r["resource"], r["verb"]) for r in data["rules"]}


def write_rbac(rules: set[Rule]) -> None:
    """operator_rbac_observed.json: what the operator called, sorted, for the Helm chart's
    ClusterRole test to compare with."""
    doc = {
        "description": (
            "Authorizations (apiGroup, resource[/subresource], verb) of the API calls the "
            "operator made in tests/integration/test_operator_rbac.py against the emulator: "
            "each call's verb, and create for a server-side apply that created its object. "
            "Regenerate with "
            f"{RBAC_RECORD_ENV}=1 pytest tests/integration/test_operator_rbac.py"
        ),
        "rules": [
            {"apiGroup": g, "resource": r, "verb": v} for g, r, v in sorted(copy.copy(rules))
        ],
    }
    RBAC_FILE.write_text(json.dumps(doc, indent=2) + "\n")
