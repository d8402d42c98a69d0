"""Graceful deletion, as the API server's pod strategy decides it (CheckGracefulDelete):
a pod bound to a node (``spec.nodeName``) and not yet finished is not removed by a DELETE but
marked: ``deletionTimestamp`` (now + the grace period) and ``deletionGracePeriodSeconds``;
it stays, Terminating, until its kubelet confirms with a DELETE of grace period 0. An
unscheduled or finished pod, and every other kind, goes at once (finalizers aside).

Namespaces: a DELETE marks the Namespace Terminating (``status.phase``, ``deletionTimestamp``),
the namespace controller deletes its contents, and the Namespace goes when nothing is left in
it (Terminating pods included); new content is refused meanwhile."""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any, Final

import kmock

from .errors import api_error

JSON = dict[str, Any]
DEFAULT_GRACE: Final = 30


def grace_period(obj: JSON, options: Mapping[str, Any]) -> int:
    """Seconds a DELETE of the pod ``obj`` leaves it Terminating (0: removed now)."""
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    if not spec.get("nodeName") or status.get("phase") in ("Succeeded", "Failed"):
        return 0
    wanted = options.get("gracePeriodSeconds")
    if wanted is None:
        wanted = spec.get("terminationGracePeriodSeconds", DEFAULT_GRACE)
    return max(0, int(wanted))


def deadline(seconds: int) -> str:
    when = datetime.datetime.now(datetime.UTC) + datetime.timedelta(seconds=seconds)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def terminating_namespace(namespace: str) -> kmock.KubernetesError:
    """403 for new content in a Terminating namespace."""
    return api_error(
        403,
        "Forbidden",
        f'namespaces "{namespace}" is forbidden: unable to create new content in namespace '
        f"{namespace} because it is being terminated",
        name=namespace,
        kind="namespaces",
        causes=[
            {
                "reason": "NamespaceTerminating",
                "message": f"namespace {namespace} is being terminated",
                "field": "metadata.namespace",
            }
        ],
    )
