"""kopf handlers: thin wrappers that hand every decision to `reconcile.Reconciler`.

`register(registry, reconciler)` adds, for DisaggregatedPipelines (disagg.dev/v1alpha1):

- `reconcile` on create, update and resume: the whole pipeline is reconciled (plan, apply,
  prune, status). kopf runs update for any change of the spec, labels or annotations (the
  GPU-mode annotations matter to the planner); status-only writes (ours) trigger nothing.
  Which children actually changed comes from the apply results (resourceVersions), not from
  kopf's diff: only those get Events. Children held by someone else make the handler fail
  temporarily, so kopf retries after `CONFLICT_RETRY` seconds; API errors likewise.
- `forget` on the pipeline's DELETED event: drops its in-memory state.
- `workload_changed` on every event of a StatefulSet (the roles) or a Deployment (the
  gateway) with our labels (also filtered server side) whose controller is a pipeline:
  requests a (coalesced) refresh of that pipeline's status, so `status.gateway` follows
  the gateway's readiness as `status.roles` follows the roles'; a deleted one is re-created
  by a full reconcile (unless the pipeline is gone).
- indexes (`cache`): the pipelines by (namespace, name), and the StatefulSets, the
  Deployments, the peer key Secrets and the pods by (namespace, pipeline label), one watch
  per kind, filtered server side by our labels
  (`configure`). kopf fills them before any handler runs; every handler binds them to the
  reconciler's `Cache` (kopf hands indexes only to handlers). The index functions and
  `forget` are coroutines although they never wait: kopf runs a plain function in its
  thread pool, a thread hop per event (a tenth of the CPU at a thousand pipelines).
- `guard_deleted` on the DELETED event of a peer key Secret or a NetworkPolicy with our
  labels (filtered server side too, so the operator never lists anyone else's Secrets):
  a full reconcile of the pipeline that controlled it, which makes a new key (a rotation)
  or puts the policy back.

No finalizer, no delete handler: every child carries a controller ownerReference to the
pipeline, so the garbage collector deletes them with it, and nothing else (no external
resource, no cache other than in-memory state) needs cleanup. A finalizer would only add a
way to block deletion while the operator is down. (A kopf timer or daemon would make kopf
add its finalizer `FINALIZER`, see `configure`; that is why the autoscaler is one
operator-wide task instead, `scaling_loop`: `reconcile` starts it, cleanup stops it.)

kopf's own bookkeeping lives in annotations with the prefix `operator.disagg.dev` (not in
`status.kopf`: the CRD's structural status schema would prune it, and kopf would then
re-run handlers forever). The prefix differs from `disagg.dev`, because kopf leaves every
annotation under its own prefix out of the diff, and `disagg.dev/gpu-mode` must count.

Resume after a restart: kopf lists the pipelines and runs `reconcile` for each; the planner
is deterministic and every child has a fixed name, so applies only confirm what exists (no
duplicates, no new resourceVersions), and the status, unchanged, is not written.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, Final, cast

import kopf

from disagg_operator import names
from disagg_operator.app import scaling_loop
from disagg_operator.k8s import client as kube
from disagg_operator.plan import model, planner
from disagg_operator.reconcile import apply, cache, reconcile, restarts

ANNOTATION_PREFIX: Final = f"operator.{names.GROUP}"
FINALIZER: Final = f"{ANNOTATION_PREFIX}/finalizer"
CONFLICT_RETRY: Final = 30.0  # seconds before a pipeline with a conflicting child is retried
API_RETRY: Final = 5.0  # ... after a retryable API error
API_RETRY_SLOW: Final = 30.0  # ... after another API error (e.g. 403: RBAC being fixed)
# Seconds kopf waits for the watch to bring back its own patch of a pipeline (its progress
# annotations) before it acts on an older version. kopf's 5 s is less than a busy API server's
# watch lag at a thousand pipelines: it then ran `reconcile` again for pipelines it had just
# handled (5 % more reconciles in the burst, and a minute of them after it).
CONSISTENCY_TIMEOUT: Final = 60.0
# Seconds kopf keeps an object's worker task after its last event, waiting for another (5 s by
# default). An idle worker holds that event's whole body: at a thousand pipelines created at
# once, a few hundred StatefulSet, Secret and NetworkPolicy bodies at any moment, for nothing
# (an object's next event, usually seconds later, just starts a new worker).
WORKER_IDLE_TIMEOUT: Final = 1.0
STATEFULSET_SELECTOR: Final = f"{names.LABEL_MANAGED_BY}={names.MANAGER},{names.LABEL_PIPELINE}"
CHILD_SELECTOR: Final = STATEFULSET_SELECTOR
POD_SELECTOR: Final = f"{names.LABEL_PIPELINE},{names.LABEL_ROLE}"
PIPELINE: Final = (names.GROUP, names.VERSION, names.PLURAL)
GUARDED: Final = (("", "secrets"), ("networking.k8s.io", "networkpolicies"))  # (group, plural)
WORKLOAD_PLURALS: Final = tuple(kube.PLURALS[kind] for kind in sorted(cache.WORKLOAD_KINDS))


def resource_of(api_version: str, kind: str) -> tuple[str, str, str]:
    """(group, version, plural) of a kind the operator writes or reads."""
    group, _, version = api_version.rpartition("/")
    return group, version, kube.PLURALS[kind]


class ProgressStorage(kopf.AnnotationsProgressStorage):
    """kopf's progress annotations, with a `clear` that copies only what it removes.

    kopf clears the progress annotations from an object's essence (its spec, labels and
    annotations) twice per event of a pipeline, through a deep copy of the essence: a
    twentieth of the operator's CPU at a thousand pipelines. The essence is only read
    afterwards (diffed and serialized), so copying the containers that change (the top level,
    `metadata`, its annotations) is enough; the spec is shared."""

    def clear(self, *, essence: kopf.BodyEssence) -> kopf.BodyEssence:
        copied: dict[str, Any] = dict(essence)
        if isinstance(copied.get("metadata"), Mapping):
            meta = copied["metadata"] = dict(copied["metadata"])
            if isinstance(meta.get("annotations"), Mapping):
                meta["annotations"] = dict(meta["annotations"])
        cleared = cast(kopf.BodyEssence, copied)
        annotations = copied.get("metadata", {}).get("annotations", {})
        prefix = f"{self.prefix}/" if self.prefix else None
        keys = {key for key in annotations if prefix and key.startswith(prefix)}
        self.remove_annotations(cleared, keys)
        self.remove_empty_stanzas(cleared)
        return cleared


def configure(settings: kopf.OperatorSettings, options: model.PlanOptions | None = None) -> None:
    """Operator settings the handlers rely on (see the module docstring)."""
    progress = ProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.progress_storage = progress
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX
    )
    settings.persistence.finalizer = FINALIZER
    settings.persistence.consistency_timeout = CONSISTENCY_TIMEOUT
    settings.queueing.idle_timeout = WORKER_IDLE_TIMEOUT
    settings.posting.reporting_component = names.MANAGER
    for plural in WORKLOAD_PLURALS:
        settings.watching.label_selectors["apps", plural] = STATEFULSET_SELECTOR
    for group, plural in GUARDED:
        settings.watching.label_selectors[group, plural] = STATEFULSET_SELECTOR
    for api_version, kind in planner.child_kinds(options):
        if kind in cache.CACHED_KINDS:
            group, _, plural = resource_of(api_version, kind)
            settings.watching.label_selectors[group, plural] = CHILD_SELECTOR
    settings.watching.label_selectors["", "pods"] = POD_SELECTOR


def watched_resources(options: model.PlanOptions | None = None) -> tuple[str, ...]:
    """The plurals of every resource the handlers and indexes watch (for `liveness`)."""
    cached = [
        resource_of(api_version, kind)[2]
        for api_version, kind in planner.child_kinds(options)
        if kind in cache.CACHED_KINDS
    ]
    guarded = [plural for _, plural in GUARDED]
    return tuple(dict.fromkeys([PIPELINE[2], "statefulsets", *cached, *guarded, "pods"]))


def login(connection: kopf.ConnectionInfo | None, **kwargs: Any) -> kopf.ConnectionInfo | None:
    """`connection` if given, else what kopf's stock logins find (the `kubernetes` client's
    in-cluster or kubeconfig setup, else a service account, else a kubeconfig)."""
    if connection is not None:
        return connection
    for method in (
        kopf.login_via_client,
        kopf.login_with_service_account,
        kopf.login_with_kubeconfig,
    ):
        info = method(**kwargs)
        if info is not None:
            return info
    return None


def register(
    registry: kopf.OperatorRegistry,
    reconciler: reconcile.Reconciler,
    *,
    connection: kopf.ConnectionInfo | None = None,
    scaler: scaling_loop.ScalingLoop | None = None,
) -> kopf.OperatorRegistry:
    """Add the operator's handlers to `registry` (returned); `scaler`: the autoscaling loop
    to start with the first reconcile (None: no autoscaling)."""

    def pipeline_gone(namespace: str, name: str) -> bool:
        """Known (from the watch cache) to be deleted or being deleted."""
        known = reconciler.cache.pipeline((namespace, name))
        return reconciler.cache.bound and (
            known is None or bool((known.get("metadata") or {}).get("deletionTimestamp"))
        )

    def bind(indexes: Mapping[str, Any]) -> None:
        if not reconciler.cache.bound:
            reconciler.cache.bind({n: indexes[n] for n in index_names if n in indexes})

    index_names = [cache.PIPELINE_INDEX]

    @kopf.index(*PIPELINE, registry=registry, id=cache.PIPELINE_INDEX)
    async def pipelines_by_name(
        name: str, namespace: str | None, body: kopf.Body, **_: Any
    ) -> dict[cache.Key, dict[str, Any]]:
        return {} if namespace is None else {(namespace, name): cache.pipeline_entry(body)}

    cached = [k for k in planner.child_kinds(reconciler.options) if k[1] in cache.CACHED_KINDS]
    for api_version, kind in [*cached, ("v1", cache.SECRET_KIND), ("v1", cache.POD_KIND)]:
        index_names.append(cache.index_name(kind))
        _register_index(registry, api_version, kind)

    @kopf.on.login(registry=registry)
    def authenticate(**kwargs: Any) -> kopf.ConnectionInfo | None:
        info = login(connection, **kwargs)
        if info is not None:
            reconciler.api.use(info)  # the same credentials for our own requests
        return info

    @kopf.on.cleanup(registry=registry)
    async def close(**_: Any) -> None:
        if scaler is not None:
            await scaler.stop()
        await reconciler.close()

    @kopf.on.resume(*PIPELINE, registry=registry, id="reconcile")
    @kopf.on.create(*PIPELINE, registry=registry, id="reconcile")
    @kopf.on.update(*PIPELINE, registry=registry, id="reconcile")
    async def reconcile_pipeline(
        name: str,
        namespace: str | None,
        reason: str,
        diff: kopf.Diff,
        logger: kopf.Logger,
        **kwargs: Any,
    ) -> None:
        if namespace is None:  # the resource is namespaced: never
            return
        bind(kwargs)
        if scaler is not None:
            scaler.ensure_started()  # here, so that it runs in kopf's context
        try:
            outcome = await reconciler.reconcile(namespace, name)
        except kube.ApiError as error:
            delay = API_RETRY if error.retryable else API_RETRY_SLOW
            delay *= random.uniform(0.5, 1.5)  # pipelines failing together retry apart
            raise kopf.TemporaryError(str(error), delay=delay) from error
        if outcome is None:
            return
        changed = sorted({".".join(map(str, item.field)) for item in diff}) or "-"
        logger.info("%s (changed: %s): phase %s", reason, changed, outcome.phase)
        if outcome.conflicts:
            message = "; ".join(str(c) for c in outcome.conflicts)
            raise kopf.TemporaryError(message, delay=CONFLICT_RETRY)

    @kopf.on.event(*PIPELINE, registry=registry)
    async def forget(type: str | None, name: str, namespace: str | None, **_: Any) -> None:
        if type == "DELETED" and namespace is not None:
            reconciler.forget(namespace, name)

    async def workload_changed(
        type: str | None, body: kopf.Body, namespace: str | None, **kwargs: Any
    ) -> None:
        pipeline = owning_pipeline(body)
        if pipeline is None or namespace is None:
            return
        bind(kwargs)
        if type != "DELETED":
            reconciler.request_refresh(namespace, pipeline)
            return
        if pipeline_gone(namespace, pipeline):
            return  # deleted with its pipeline (garbage collection): nothing to put back
        try:
            await reconciler.child_deleted(namespace, pipeline)
        except kube.ApiError as error:
            # kopf does not retry event handlers: a later event or the resume will
            kopf_logger = kwargs.get("logger")
            if kopf_logger is not None:
                kopf_logger.warning("re-creating the children failed: %s", error)

    for plural in WORKLOAD_PLURALS:
        kopf.on.event(
            "apps",
            "v1",
            plural,
            registry=registry,
            id=f"workload-{plural}",
            labels={names.LABEL_MANAGED_BY: names.MANAGER, names.LABEL_PIPELINE: kopf.PRESENT},
        )(workload_changed)

    async def guard_deleted(
        type: str | None, body: kopf.Body, namespace: str | None, **_: Any
    ) -> None:
        pipeline = owning_pipeline(body)
        if type != "DELETED" or pipeline is None or namespace is None:
            return
        if not pipeline_gone(namespace, pipeline):  # not garbage collection
            await reconciler.child_deleted(namespace, pipeline)

    for group, plural in GUARDED:
        kopf.on.event(
            group,
            "v1",
            plural,
            registry=registry,
            id=f"guard-{plural}",
            labels={names.LABEL_MANAGED_BY: names.MANAGER, names.LABEL_PIPELINE: kopf.PRESENT},
        )(guard_deleted)

    @kopf.on.event(
        "",
        "v1",
        "pods",
        registry=registry,
        id="group-member",
        labels={names.LABEL_PIPELINE: kopf.PRESENT, names.LABEL_NODE_RANK: kopf.PRESENT},
    )
    async def group_member_changed(body: kopf.Body, namespace: str | None, **kwargs: Any) -> None:
        """A member of a role's group (roles[].nodes) changed: restart its group if one
        member failed or was replaced (`restarts`)."""
        pipeline = (body.get("metadata", {}).get("labels") or {}).get(names.LABEL_PIPELINE)
        if namespace is None or pipeline is None or pipeline_gone(namespace, pipeline):
            return
        bind(kwargs)
        try:
            gone = [body] if kwargs.get("type") == "DELETED" else []
            await restarts.restart_groups(reconciler, namespace, pipeline, gone)
        except kube.ApiError as error:  # kopf does not retry event handlers: the next will
            kopf_logger = kwargs.get("logger")
            if kopf_logger is not None:
                kopf_logger.warning("restarting a group failed: %s", error)

    return registry


def _register_index(registry: kopf.OperatorRegistry, api_version: str, kind: str) -> None:
    """An index of one kind by (namespace, pipeline label), with slim entries."""
    group, version, plural = resource_of(api_version, kind)
    labels: dict[str, Any] = {names.LABEL_PIPELINE: kopf.PRESENT}
    if kind == cache.POD_KIND:
        labels[names.LABEL_ROLE] = kopf.PRESENT
    else:
        labels[names.LABEL_MANAGED_BY] = names.MANAGER

    async def by_pipeline(body: kopf.Body, **_: Any) -> dict[cache.Key, dict[str, Any]]:
        key = cache.index_key(body)
        return {} if key is None else {key: cache.slim(body, api_version, kind, digested=digested)}

    resource = (group, version, plural) if group else (version, plural)
    # the kinds an apply compares against the cache (`Reconciler._existing_children`)
    digested = kind in cache.CACHED_KINDS and kind not in cache.WORKLOAD_KINDS
    kopf.index(*resource, registry=registry, id=cache.index_name(kind), labels=labels)(by_pipeline)


def owning_pipeline(obj: Mapping[str, Any]) -> str | None:
    """The name of the pipeline that controls `obj`, if one does."""
    controller = apply.controller_of(obj)
    if controller is None:
        return None
    group = str(controller.get("apiVersion", "")).split("/")[0]
    if controller.get("kind") != names.PIPELINE_KIND or group != names.GROUP:
        return None
    name = controller.get("name")
    return str(name) if name else None
