"""Policy on pods: which `podTemplate` settings weaken a role pod's isolation.

The operator renders every role pod hardened (non-root uid 65532, no privilege escalation,
all capabilities dropped, seccomp RuntimeDefault; see the planner). A role's `podTemplate`
is merged in last, so it could undo all of that; anyone allowed to create a pipeline would
then get privileged pods from the operator's service account. So a podTemplate may not:

- share the node's namespaces: `hostPID`, `hostNetwork`, `hostIPC` true;
- mount node paths: a `hostPath` volume;
- run privileged, add capabilities, allow privilege escalation, run as root (`runAsUser: 0`,
  `runAsNonRoot: false`), turn seccomp or AppArmor off (`Unconfined`), unmask /proc, or run
  as a Windows host process, in the pod's or any container's `securityContext`;
- remove the hardening with `null` (the merge's "delete this key"): a whole
  `securityContext`, or `runAsNonRoot`, `allowPrivilegeEscalation`, `capabilities`, its
  `drop`, `seccompProfile`; nor drop less than `ALL`.

unless the pipeline carries the annotation `disagg.dev/allow-privileged: "true"` (an explicit
opt-in, e.g. for a GPU profiler). With it, the same findings become warnings: the operator
renders the pods and posts a Warning Event listing them. A writable root filesystem
(`readOnlyRootFilesystem: false`) is allowed: it grants no privilege.

Pure: the checks read the pipeline model only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from disagg_core.spec.fields import Problem, child
from disagg_core.spec.model import ANNOTATION_ALLOW_PRIVILEGED, Pipeline

OPT_IN: Final = "true"
HOST_NAMESPACES: Final = ("hostPID", "hostNetwork", "hostIPC")
CONTAINER_LISTS: Final = ("containers", "initContainers", "ephemeralContainers")
# Keys whose removal (`null`) undoes the planner's hardening.
HARDENING_KEYS: Final = (
    "runAsNonRoot",
    "allowPrivilegeEscalation",
    "capabilities",
    "seccompProfile",
)


def allowed(pipeline: Pipeline) -> bool:
    """Whether the pipeline opted in to weaker pods."""
    return pipeline.annotations.get(ANNOTATION_ALLOW_PRIVILEGED) == OPT_IN


def annotation_problems(pipeline: Pipeline) -> list[Problem]:
    value = pipeline.annotations.get(ANNOTATION_ALLOW_PRIVILEGED)
    if value is None or value in (OPT_IN, "false"):
        return []
    path = child("metadata.annotations", ANNOTATION_ALLOW_PRIVILEGED)
    return [Problem(path, f'must be "true" or "false", got {value!r}')]


def findings(pipeline: Pipeline) -> list[Problem]:
    """Every weakening setting of every role's podTemplate, with its field path."""
    result: list[Problem] = []
    for i, role in enumerate(pipeline.roles):
        if role.pod_template is not None:
            result += template_findings(role.pod_template, f"spec.roles[{i}].podTemplate")
    return result


def template_findings(template: Mapping[str, Any], path: str) -> list[Problem]:
    """The weakening settings of one PodTemplateSpec overlay (see the module docstring)."""
    found: list[Problem] = []
    if "spec" in template and template["spec"] is None:
        found.append(Problem(child(path, "spec"), "null removes the whole hardened pod spec"))
    spec = template.get("spec")
    if not isinstance(spec, Mapping):
        return found
    path = child(path, "spec")
    for key in HOST_NAMESPACES:
        if spec.get(key) is True:
            found.append(Problem(child(path, key), "shares the node's namespace with the pod"))
    found += _security(spec, path, "the pod's")
    volumes = spec.get("volumes")
    for k, volume in enumerate(volumes if isinstance(volumes, list) else ()):
        if isinstance(volume, Mapping) and volume.get("hostPath") is not None:
            where = child(f"{child(path, 'volumes')}[{k}]", "hostPath")
            found.append(Problem(where, "mounts a path of the node"))
    for kind in CONTAINER_LISTS:
        containers = spec.get(kind)
        for k, container in enumerate(containers if isinstance(containers, list) else ()):
            if isinstance(container, Mapping):
                found += _security(container, f"{child(path, kind)}[{k}]", "the container's")
    return found


def _security(owner: Mapping[str, Any], path: str, whose: str) -> list[Problem]:
    if "securityContext" not in owner:
        return []
    path = child(path, "securityContext")
    context = owner["securityContext"]
    if context is None:
        return [Problem(path, f"null removes {whose} hardening (non-root, seccomp, ...)")]
    if not isinstance(context, Mapping):
        return []
    found: list[Problem] = []

    def add(key: str, reason: str) -> None:
        found.append(Problem(child(path, key), reason))

    for key in HARDENING_KEYS:
        if key in context and context[key] is None:
            add(key, "null removes the hardening the operator sets")
    if context.get("privileged") is True:
        add("privileged", "a privileged container has every device and capability of the node")
    if context.get("allowPrivilegeEscalation") is True:
        add("allowPrivilegeEscalation", "lets processes gain privileges (setuid, file caps)")
    if context.get("runAsUser") == 0:
        add("runAsUser", "runs as root")
    if context.get("runAsNonRoot") is False:
        add("runAsNonRoot", "allows running as root")
    if context.get("procMount") == "Unmasked":
        add("procMount", "unmasks /proc")
    for key in ("seccompProfile", "appArmorProfile"):
        profile = context.get(key)
        if isinstance(profile, Mapping) and profile.get("type") == "Unconfined":
            add(key, "turns the profile off (Unconfined)")
    windows = context.get("windowsOptions")
    if isinstance(windows, Mapping) and windows.get("hostProcess") is True:
        add("windowsOptions", "hostProcess runs on the node")
    capabilities = context.get("capabilities")
    if isinstance(capabilities, Mapping):
        added = capabilities.get("add")
        if added:
            add("capabilities", f"adds capabilities {added!r}")
        if "drop" in capabilities:
            dropped = capabilities["drop"]
            if not (isinstance(dropped, list) and "ALL" in dropped):
                where = child(child(path, "capabilities"), "drop")
                found.append(Problem(where, "must keep ALL (the operator drops every capability)"))
    return found
