"""Group restarts, the I/O around `regroup.decide`: on an event of a group member's pod,
read the pipeline's pods (the watch cache, else a list), delete what the decision names
(with the pod's uid as a precondition: never a member recreated meanwhile), say so in an
Event, and decide again when a group still has to settle."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Final

from disagg_core.spec import SpecError
from disagg_operator.k8s import client as kube
from disagg_operator.plan import model
from disagg_operator.reconcile import apply, regroup
from disagg_operator.reconcile.reconcile import Reconciler
from disagg_operator.reconcile.tracked import PipelineState

log = logging.getLogger(__name__)
EVENT_GROUP_RESTARTED: Final = "GroupRestarted"
_PENDING: set[asyncio.Task[Any]] = set()  # the rechecks in flight (a task needs a reference)


async def restart_groups(
    reconciler: Reconciler,
    namespace: str,
    name: str,
    gone: Sequence[Mapping[str, Any]] = (),
) -> tuple[str, ...]:
    """Delete the pods of the pipeline's groups that must restart (`gone`: a member pod
    whose deletion was just seen); the deleted pods' names."""
    key = (namespace, name)
    body = reconciler.cache.pipeline(key) or await apply.get_pipeline(reconciler.api, *key)
    if body is None:
        return ()
    state = reconciler.states.setdefault(key, PipelineState())
    parsed = state.validated(body, reconciler.options)
    if isinstance(parsed, SpecError):
        return ()
    options = state.options(reconciler.options)
    shapes = {
        unit.unit: regroup.Shape(unit.roles[0].nodes, unit.replicas)
        for unit in model.workloads(parsed, options)
        if unit.roles[0].nodes > 1
    }
    if not shapes:
        return ()
    pods = reconciler.cache.pods(key)
    if pods is None:
        pods = await apply.pipeline_pods(reconciler.api, namespace, name)
    decision = regroup.decide(pods, shapes, reconciler.clock(), gone)
    uids = {p["metadata"]["name"]: p["metadata"].get("uid") for p in pods}
    deleted = []
    for pod in decision.delete:
        ref = kube.ObjectRef("v1", "Pod", namespace, pod)
        try:
            if await reconciler.api.delete(ref, uid=uids.get(pod)):
                deleted.append(pod)
        except kube.ApiError as error:  # 409: recreated meanwhile, the next event decides
            log.warning("deleting %s of a group to restart failed: %s", pod, error)
    if deleted:
        message = f"restarted as a group (a member failed or was replaced): {', '.join(deleted)}"
        reconciler.post_event(body, "Normal", EVENT_GROUP_RESTARTED, message)
    if decision.recheck_s is not None:
        asyncio.get_running_loop().call_later(decision.recheck_s, _recheck, reconciler, *key)
    return tuple(deleted)


def _recheck(reconciler: Reconciler, namespace: str, name: str) -> None:
    task = asyncio.create_task(_logged(reconciler, namespace, name))
    _PENDING.add(task)
    task.add_done_callback(_PENDING.discard)


async def _logged(reconciler: Reconciler, namespace: str, name: str) -> None:
    try:
        await restart_groups(reconciler, namespace, name)
    except Exception:  # the next event of a member decides again
        log.exception("group restart check of %s/%s failed", namespace, name)
