"""The controller manager's part of the node: StatefulSet, Deployment and endpoints
controllers, reconciling from informer caches and writing through the API.

StatefulSet: pods `<sts>-<ordinal>` (ordinals 0..replicas-1; spec.replicas absent = 1) with
the template's labels plus `controller-revision-hash` = `<sts>-<sha256(template)[:10]>`,
`statefulset.kubernetes.io/pod-name`, `apps.kubernetes.io/pod-index`, hostname = pod name,
subdomain = serviceName, one controller ownerReference. `podManagementPolicy: Parallel`
creates and deletes at once; OrderedReady creates ordinal n only when 0..n-1 are Ready and
deletes the highest ordinal first, one at a time. `updateStrategy` RollingUpdate replaces
the highest-ordinal pod of an old revision whose ordinal is >= `partition`, one at a time,
while every other pod is Ready; OnDelete never replaces. Status: replicas, readyReplicas,
availableReplicas, currentReplicas, updatedReplicas, currentRevision, updateRevision,
observedGeneration.

Deployment (enough for an operator or a gateway; no ReplicaSet objects): pods
`<deploy>-<hash>-<n>` labelled `pod-template-hash`; pods of an old template are deleted once
`replicas` pods of the new one are Ready (surge, then drop). Status: replicas,
readyReplicas, availableReplicas, updatedReplicas, observedGeneration, condition Available.

Endpoints: for each Service with a selector, the matching pods with an IP; Ready ones (all,
with publishNotReadyAddresses) as addresses, with hostname when the pod's subdomain is the
Service. Written as core/v1 Endpoints and as one discovery.k8s.io/v1 EndpointSlice
`<svc>-node` (label kubernetes.io/service-name); the cluster DNS answers from the slices.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from .api import Api, ApiError, Obj
from .informer import Informer, Key

log = logging.getLogger(__name__)
REVISION_LABEL = "controller-revision-hash"
POD_NAME_LABEL = "statefulset.kubernetes.io/pod-name"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"
TEMPLATE_HASH_LABEL = "pod-template-hash"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
SLICE_SUFFIX = "-node"


def template_hash(template: Obj) -> str:
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def pod_ready(pod: Obj) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def owned_by(pod: Obj, owner: Obj) -> bool:
    uid = owner["metadata"].get("uid")
    return any(r.get("uid") == uid for r in pod["metadata"].get("ownerReferences") or [])


def matches(labels: dict[str, str], selector: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def owner_ref(owner: Obj, kind: str) -> Obj:
    return {
        "apiVersion": "apps/v1",
        "kind": kind,
        "name": owner["metadata"]["name"],
        "uid": owner["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def new_pod(owner: Obj, kind: str, name: str, labels: dict[str, str]) -> Obj:
    template = copy.deepcopy(owner["spec"].get("template") or {})
    meta = template.get("metadata") or {}
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": owner["metadata"]["namespace"],
            "labels": {**(meta.get("labels") or {}), **labels},
            "annotations": dict(meta.get("annotations") or {}),
            "ownerReferences": [owner_ref(owner, kind)],
        },
        "spec": template.get("spec") or {},
    }


class WorkQueue:
    """Dirty keys, reconciled one at a time by `run` (a key queued while it is being
    reconciled is reconciled again)."""

    def __init__(self, reconcile: Callable[[Key], Awaitable[None]]) -> None:
        self.reconcile = reconcile
        self.dirty: set[Key] = set()
        self.wake = asyncio.Event()

    def add(self, key: Key) -> None:
        self.dirty.add(key)
        self.wake.set()

    async def run(self, resync: Callable[[], list[Key]], period: float = 2.0) -> None:
        while True:
            try:
                await asyncio.wait_for(self.wake.wait(), period)
            except TimeoutError:
                self.dirty.update(resync())
            self.wake.clear()
            keys, self.dirty = self.dirty, set()
            for key in sorted(keys):
                try:
                    await self.reconcile(key)
                except ApiError as exc:
                    log.debug("reconcile %s: %s (retrying)", key, exc)
                    self.dirty.add(key)
                except Exception:
                    log.exception("reconcile %s failed", key)
                    self.dirty.add(key)
            if self.dirty:
                await asyncio.sleep(0.05)
                self.wake.set()


class Controllers:
    def __init__(self, api: Api, informers: dict[str, Informer]) -> None:
        self.api = api
        self.inf = informers
        self.statefulsets = WorkQueue(self.reconcile_statefulset)
        self.deployments = WorkQueue(self.reconcile_deployment)
        self.services = WorkQueue(self.reconcile_service)
        informers["statefulsets"].handlers.append(self.statefulsets.add)
        informers["deployments"].handlers.append(self.deployments.add)
        informers["services"].handlers.append(self.services.add)
        informers["pods"].handlers.append(self._pod_changed)

    def _pod_changed(self, key: Key) -> None:
        ns = key[0]
        # a deleted pod is gone from the cache: requeue every owner and service of its
        # namespace (cheap at test scale)
        for sts in self.inf["statefulsets"].items(ns):
            self.statefulsets.add((ns, sts["metadata"]["name"]))
        for deploy in self.inf["deployments"].items(ns):
            self.deployments.add((ns, deploy["metadata"]["name"]))
        for svc in self.inf["services"].items(ns):
            self.services.add((ns, svc["metadata"]["name"]))

    def tasks(self) -> list[Awaitable[None]]:
        def keys(resource: str) -> Callable[[], list[Key]]:
            return lambda: list(self.inf[resource].cache)

        return [
            self.statefulsets.run(keys("statefulsets")),
            self.deployments.run(keys("deployments")),
            self.services.run(keys("services")),
        ]

    def _pods_of(self, owner: Obj) -> list[Obj]:
        ns = owner["metadata"]["namespace"]
        return [p for p in self.inf["pods"].items(ns) if owned_by(p, owner)]

    async def _create_pod(self, pod: Obj) -> None:
        try:
            await self.api.create("pods", pod["metadata"]["namespace"], pod)
        except ApiError as exc:
            if exc.status != 409:
                raise

    # ------------------------------------------------------------------ StatefulSet

    async def reconcile_statefulset(self, key: Key) -> None:
        sts = self.inf["statefulsets"].get(*key)
        if sts is None or sts["metadata"].get("deletionTimestamp"):
            return
        ns, name = key
        spec = sts["spec"]
        replicas = int(spec.get("replicas", 1))
        revision = f"{name}-{template_hash(spec.get('template') or {})}"
        parallel = spec.get("podManagementPolicy") == "Parallel"
        strategy = spec.get("updateStrategy") or {}
        partition = int((strategy.get("rollingUpdate") or {}).get("partition", 0))
        pods: dict[int, Obj] = {}
        for pod in self._pods_of(sts):
            suffix = pod["metadata"]["name"].rsplit("-", 1)[-1]
            if suffix.isdigit():
                pods[int(suffix)] = pod
        # create missing ordinals
        for i in range(replicas):
            if i in pods:
                continue
            if not parallel and not all(i2 in pods and pod_ready(pods[i2]) for i2 in range(i)):
                break
            pod = new_pod(
                sts,
                "StatefulSet",
                f"{name}-{i}",
                {REVISION_LABEL: revision, POD_NAME_LABEL: f"{name}-{i}", POD_INDEX_LABEL: str(i)},
            )
            pod["spec"]["hostname"] = f"{name}-{i}"
            if spec.get("serviceName"):
                pod["spec"]["subdomain"] = spec["serviceName"]
            await self._create_pod(pod)
        # delete surplus ordinals
        surplus = sorted((i for i in pods if i >= replicas), reverse=True)
        for i in surplus if parallel else surplus[:1]:
            await self.api.delete("pods", ns, pods[i]["metadata"]["name"])
        # rolling update: one old pod at a time, highest ordinal first, while all are Ready
        kept = {i: p for i, p in pods.items() if i < replicas}
        if strategy.get("type", "RollingUpdate") == "RollingUpdate":
            old = [
                i
                for i, p in kept.items()
                if i >= partition and p["metadata"]["labels"].get(REVISION_LABEL) != revision
            ]
            if old and len(kept) == replicas and all(pod_ready(p) for p in kept.values()):
                await self.api.delete("pods", ns, kept[max(old)]["metadata"]["name"])
        updated = [  # a pod being deleted counts as neither revision (as in Kubernetes)
            p
            for p in kept.values()
            if p["metadata"]["labels"].get(REVISION_LABEL) == revision
            and not p["metadata"].get("deletionTimestamp")
        ]
        ready = sum(pod_ready(p) for p in kept.values())
        current = (sts.get("status") or {}).get("currentRevision") or revision
        if len(updated) == replicas == len(kept):
            current = revision
        status = {
            "observedGeneration": sts["metadata"].get("generation", 1),
            "replicas": len(kept),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "currentReplicas": len(kept) - len(updated) if current != revision else len(kept),
            "updatedReplicas": len(updated),
            "currentRevision": current,
            "updateRevision": revision,
        }
        if any((sts.get("status") or {}).get(k) != v for k, v in status.items()):
            await self.api.patch_status("statefulsets", ns, name, status)

    # ------------------------------------------------------------------ Deployment

    async def reconcile_deployment(self, key: Key) -> None:
        deploy = self.inf["deployments"].get(*key)
        if deploy is None or deploy["metadata"].get("deletionTimestamp"):
            return
        ns, name = key
        replicas = int(deploy["spec"].get("replicas", 1))
        digest = template_hash(deploy["spec"].get("template") or {})
        # a ReplicaSet replaces a pod being deleted at once (unlike a StatefulSet's ordinal)
        pods = [p for p in self._pods_of(deploy) if not p["metadata"].get("deletionTimestamp")]
        new = [p for p in pods if p["metadata"]["labels"].get(TEMPLATE_HASH_LABEL) == digest]
        old = [p for p in pods if p not in new]
        names = {p["metadata"]["name"] for p in pods}
        n = 0
        for _ in range(replicas - len(new)):
            while f"{name}-{digest}-{n}" in names:
                n += 1
            names.add(f"{name}-{digest}-{n}")
            await self._create_pod(
                new_pod(deploy, "Deployment", f"{name}-{digest}-{n}", {TEMPLATE_HASH_LABEL: digest})
            )
        for pod in sorted(new, key=lambda p: p["metadata"]["name"])[replicas:]:
            await self.api.delete("pods", ns, pod["metadata"]["name"])
        ready_new = sum(pod_ready(p) for p in new)
        if old and ready_new >= replicas:
            for pod in old:
                await self.api.delete("pods", ns, pod["metadata"]["name"])
        ready = sum(pod_ready(p) for p in pods)
        status = {
            "observedGeneration": deploy["metadata"].get("generation", 1),
            "replicas": len(pods),
            "readyReplicas": ready,
            "availableReplicas": ready,
            "updatedReplicas": len(new),
            "conditions": [
                {
                    "type": "Available",
                    "status": "True" if ready_new >= replicas else "False",
                    "reason": "MinimumReplicasAvailable",
                }
            ],
        }
        if any((deploy.get("status") or {}).get(k) != v for k, v in status.items()):
            await self.api.patch_status("deployments", ns, name, status)

    # ------------------------------------------------------------------ endpoints

    async def reconcile_service(self, key: Key) -> None:
        svc = self.inf["services"].get(*key)
        if svc is None:
            return  # the Endpoints/EndpointSlice go with it (ownerReference / GC)
        ns = key[0]
        spec = svc.get("spec") or {}
        selector = dict(spec.get("selector") or {})
        if not selector:
            return
        publish_all = bool(spec.get("publishNotReadyAddresses"))
        pods = [
            p
            for p in self.inf["pods"].items(ns)
            if matches(p["metadata"].get("labels") or {}, selector)
            and (p.get("status") or {}).get("podIP")
            and not p["metadata"].get("deletionTimestamp")
        ]
        pods.sort(key=lambda p: p["metadata"]["name"])
        ports = [
            {
                k: v
                for k, v in (
                    ("name", p.get("name")),
                    ("port", _target(p)),
                    ("protocol", p.get("protocol", "TCP")),
                )
                if v is not None
            }
            for p in spec.get("ports") or []
        ]
        await self._write_endpoints(svc, pods, ports, publish_all)
        await self._write_slice(svc, pods, ports, publish_all)

    async def _write_endpoints(
        self, svc: Obj, pods: list[Obj], ports: list[Obj], publish_all: bool
    ) -> None:
        ns, name = svc["metadata"]["namespace"], svc["metadata"]["name"]
        ready: list[Obj] = []
        not_ready: list[Obj] = []
        for pod in pods:
            address = _address(pod, name)
            (ready if publish_all or pod_ready(pod) else not_ready).append(address)
        subset: Obj = {"ports": ports}
        if ready:
            subset["addresses"] = ready
        if not_ready:
            subset["notReadyAddresses"] = not_ready
        body = {
            "apiVersion": "v1",
            "kind": "Endpoints",
            "metadata": {
                "name": name,
                "namespace": ns,
                "labels": {SERVICE_NAME_LABEL: name},
                "ownerReferences": [_service_ref(svc)],
            },
            "subsets": [subset] if ready or not_ready else [],
        }
        current = self.inf["endpoints"].get(ns, name)
        if current is None or current.get("subsets", []) != body["subsets"]:
            await self.api.apply("endpoints", ns, name, body)

    async def _write_slice(
        self, svc: Obj, pods: list[Obj], ports: list[Obj], publish_all: bool
    ) -> None:
        ns, name = svc["metadata"]["namespace"], svc["metadata"]["name"]
        endpoints = []
        for pod in pods:
            ready = pod_ready(pod)
            entry: Obj = {
                "addresses": [pod["status"]["podIP"]],
                "conditions": {
                    "ready": ready or publish_all,
                    "serving": ready,
                    "terminating": False,
                },
                "targetRef": _address(pod, name)["targetRef"],
            }
            if pod["spec"].get("subdomain") == name and pod["spec"].get("hostname"):
                entry["hostname"] = pod["spec"]["hostname"]
            endpoints.append(entry)
        body = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": name + SLICE_SUFFIX,
                "namespace": ns,
                "labels": {SERVICE_NAME_LABEL: name},
                "ownerReferences": [_service_ref(svc)],
            },
            "addressType": "IPv4",
            "endpoints": endpoints,
            "ports": ports,
        }
        current = self.inf["endpointslices"].get(ns, name + SLICE_SUFFIX)
        if (
            current is None
            or current.get("endpoints") != endpoints
            or current.get("ports") != ports
        ):
            await self.api.apply("endpointslices", ns, name + SLICE_SUFFIX, body)


def _target(port: Obj) -> Any:
    target = port.get("targetPort", port.get("port"))
    return target if isinstance(target, int) else port.get("port")


def _address(pod: Obj, service: str) -> Obj:
    address: Obj = {
        "ip": pod["status"]["podIP"],
        "targetRef": {
            "kind": "Pod",
            "namespace": pod["metadata"]["namespace"],
            "name": pod["metadata"]["name"],
            "uid": pod["metadata"]["uid"],
        },
    }
    if pod["spec"].get("subdomain") == service and pod["spec"].get("hostname"):
        address["hostname"] = pod["spec"]["hostname"]
    return address


def _service_ref(svc: Obj) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "name": svc["metadata"]["name"],
        "uid": svc["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


async def run_all(controllers: Controllers) -> None:
    await asyncio.gather(*controllers.tasks())
