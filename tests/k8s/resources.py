"""The resource types the emulator serves: a fixed set of built-ins, plus CRDs once created."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# (group, plural) of the built-ins whose strategies set and bump metadata.generation
GENERATION_KINDS = frozenset(
    {
        ("apps", "deployments"),
        ("apps", "statefulsets"),
        ("apps", "daemonsets"),
        ("apps", "replicasets"),
        ("batch", "jobs"),
        ("batch", "cronjobs"),
        ("", "pods"),
        ("networking.k8s.io", "networkpolicies"),
        ("networking.k8s.io", "ingresses"),
        ("policy", "poddisruptionbudgets"),
        ("autoscaling", "horizontalpodautoscalers"),
        ("apiextensions.k8s.io", "customresourcedefinitions"),
        ("resource.k8s.io", "deviceclasses"),
        ("discovery.k8s.io", "endpointslices"),
    }
)
ALL_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")
SUBRESOURCE_VERBS = ("get", "patch", "update")


@dataclass(frozen=True)
class ResourceType:
    """One served group/version/plural, with what discovery says about it."""

    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool = True
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    subresources: frozenset[str] = frozenset()
    # Where the objects live: (group, plural). Several views may share one storage
    # (core/v1 and events.k8s.io/v1 Events; every served version of a CRD).
    storage: tuple[str, str] | None = None
    schema: Mapping[str, Any] | None = field(default=None, compare=False, hash=False)
    printer_columns: tuple[Mapping[str, Any], ...] = field(default=(), compare=False, hash=False)
    from_crd: bool = False
    # The scale subresource: (specReplicasPath, statusReplicasPath, labelSelectorPath or None
    # for "from spec.selector.matchLabels").
    scale: tuple[str, str, str | None] | None = None

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def singular(self) -> str:
        return self.kind.lower()

    @property
    def storage_key(self) -> tuple[str, str]:
        return self.storage or (self.group, self.plural)

    @property
    def has_generation(self) -> bool:
        """Whether its objects carry metadata.generation (kinds with spec semantics; not
        ConfigMaps, Secrets, Services, Namespaces, ... on a real server)."""
        return self.from_crd or self.storage_key in GENERATION_KINDS

    @property
    def has_status(self) -> bool:
        return "status" in self.subresources

    @property
    def qualified(self) -> str:
        """``pods``, ``statefulsets.apps`` - as kubectl and error messages name it."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def discovery(self) -> list[dict[str, Any]]:
        """Its entries in an APIResourceList (the resource and its subresources)."""
        entries: list[dict[str, Any]] = [
            {
                "name": self.plural,
                "singularName": self.singular,
                "namespaced": self.namespaced,
                "kind": self.kind,
                "verbs": list(ALL_VERBS),
                **({"shortNames": list(self.short_names)} if self.short_names else {}),
                **({"categories": list(self.categories)} if self.categories else {}),
            }
        ]
        for sub in sorted(self.subresources):
            entries.append(
                {
                    "name": f"{self.plural}/{sub}",
                    "singularName": "",
                    "namespaced": self.namespaced,
                    "kind": self.kind if sub == "status" else "Scale",
                    **({"group": "autoscaling", "version": "v1"} if sub == "scale" else {}),
                    "verbs": list(SUBRESOURCE_VERBS),
                }
            )
        return entries


def _r(
    group: str,
    version: str,
    plural: str,
    kind: str,
    *,
    namespaced: bool = True,
    short: tuple[str, ...] = (),
    status: bool = False,
    scale: bool = False,
    all_category: bool = False,
    storage: tuple[str, str] | None = None,
) -> ResourceType:
    return ResourceType(
        group=group,
        version=version,
        plural=plural,
        kind=kind,
        namespaced=namespaced,
        short_names=short,
        categories=("all",) if all_category else (),
        subresources=frozenset({"status"} if status else ())
        | frozenset({"scale"} if scale else ()),
        scale=(".spec.replicas", ".status.replicas", None) if scale else None,
        storage=storage,
    )


BUILTIN: tuple[ResourceType, ...] = (
    # core/v1
    _r("", "v1", "namespaces", "Namespace", namespaced=False, short=("ns",), status=True),
    _r("", "v1", "nodes", "Node", namespaced=False, short=("no",), status=True),
    _r("", "v1", "pods", "Pod", short=("po",), status=True, all_category=True),
    _r("", "v1", "services", "Service", short=("svc",), status=True, all_category=True),
    _r("", "v1", "endpoints", "Endpoints", short=("ep",)),
    _r("", "v1", "configmaps", "ConfigMap", short=("cm",)),
    _r("", "v1", "secrets", "Secret"),
    _r("", "v1", "serviceaccounts", "ServiceAccount", short=("sa",)),
    _r("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim", short=("pvc",), status=True),
    _r("", "v1", "events", "Event", short=("ev",)),
    # apps/v1
    *(
        _r("apps", "v1", plural, kind, short=(short,), status=True, scale=scale, all_category=True)
        for plural, kind, short, scale in (
            ("deployments", "Deployment", "deploy", True),
            ("statefulsets", "StatefulSet", "sts", True),
            ("daemonsets", "DaemonSet", "ds", False),
            ("replicasets", "ReplicaSet", "rs", True),
        )
    ),
    # resource.k8s.io/v1 (DRA)
    _r("resource.k8s.io", "v1", "resourceclaims", "ResourceClaim", status=True),
    _r("resource.k8s.io", "v1", "resourceclaimtemplates", "ResourceClaimTemplate"),
    _r("resource.k8s.io", "v1", "deviceclasses", "DeviceClass", namespaced=False),
    _r("resource.k8s.io", "v1", "resourceslices", "ResourceSlice", namespaced=False),
    # apiextensions.k8s.io/v1
    _r(
        "apiextensions.k8s.io",
        "v1",
        "customresourcedefinitions",
        "CustomResourceDefinition",
        namespaced=False,
        short=("crd", "crds"),
        status=True,
    ),
    # coordination.k8s.io/v1
    _r("coordination.k8s.io", "v1", "leases", "Lease"),
    # events.k8s.io/v1: a second view of the core/v1 Events (same storage, converted fields)
    _r("events.k8s.io", "v1", "events", "Event", short=("ev",), storage=("", "events")),
    # autoscaling/v2 (an HPA instead of the operator's autoscaler: manifests/samples)
    _r(
        "autoscaling",
        "v2",
        "horizontalpodautoscalers",
        "HorizontalPodAutoscaler",
        short=("hpa",),
        status=True,
        all_category=True,
    ),
    # policy/v1
    _r("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", short=("pdb",), status=True),
    # discovery.k8s.io/v1 (written by the test node's endpoints controller)
    _r("discovery.k8s.io", "v1", "endpointslices", "EndpointSlice"),
    # networking.k8s.io/v1
    _r("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", short=("netpol",)),
    _r("networking.k8s.io", "v1", "ingresses", "Ingress", short=("ing",), status=True),
    # rbac.authorization.k8s.io/v1
    _r("rbac.authorization.k8s.io", "v1", "roles", "Role"),
    _r("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding"),
    _r("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", namespaced=False),
    _r(
        "rbac.authorization.k8s.io",
        "v1",
        "clusterrolebindings",
        "ClusterRoleBinding",
        namespaced=False,
    ),
)

INITIAL_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")


def crd_resource_types(crd: Mapping[str, Any]) -> list[ResourceType]:
    """The served versions of a CustomResourceDefinition, as resource types."""
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    group = spec["group"]
    result = []
    for version in spec.get("versions") or []:
        if not version.get("served", True):
            continue
        declared = version.get("subresources") or {}
        subresources = set(declared) & {"status", "scale"}
        scale = declared.get("scale")
        result.append(
            ResourceType(
                group=group,
                version=version["name"],
                plural=names["plural"],
                kind=names["kind"],
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                short_names=tuple(names.get("shortNames") or ()),
                categories=tuple(names.get("categories") or ()),
                subresources=frozenset(subresources),
                scale=(
                    scale["specReplicasPath"],
                    scale["statusReplicasPath"],
                    scale.get("labelSelectorPath"),
                )
                if scale
                else None,
                schema=(version.get("schema") or {}).get("openAPIV3Schema"),
                printer_columns=tuple(version.get("additionalPrinterColumns") or ()),
                from_crd=True,
            )
        )
    return result
