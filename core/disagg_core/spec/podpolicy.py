"""Policy on pods: which `podTemplate` settings weaken a pod's isolation.

The operator renders every role and gateway pod hardened (non-root uid 65532, no privilege
escalation, all capabilities dropped, seccomp RuntimeDefault, no service-account token; see
the planner). A `podTemplate` (each role's and the gateway's: `templates` lists every one the
CRD has) is merged in last, so it could undo all of that; anyone allowed to create a pipeline
would then get privileged pods from the operator's service account. So a podTemplate is held
to the Pod Security Standard "restricted" as an allow-list (`podrules`): no host namespaces,
hostPath or other volume types outside restricted's list, hostPort, unsafe sysctls, custom
SELinux types, profiles other than RuntimeDefault/Localhost (fields or annotations),
privilege, added capabilities (but NET_BIND_SERVICE), root, a chosen service account or a
mounted token, Secrets that are not the pipeline's own (names `<pipeline>-...`), and no
`null` that removes the hardening,

unless the pipeline carries the annotation `disagg.dev/allow-privileged: "true"` (an explicit
opt-in, e.g. for a GPU profiler). With it, the same findings become warnings: the operator
renders the pods and posts a Warning Event listing them. A writable root filesystem
(`readOnlyRootFilesystem: false`) is allowed: it grants no privilege.

Pure: the checks read the pipeline model only.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, Final

from disagg_core.spec import podrules
from disagg_core.spec.fields import Problem, child
from disagg_core.spec.model import ANNOTATION_ALLOW_PRIVILEGED, Pipeline

OPT_IN: Final = "true"
HOST_NAMESPACES: Final = ("hostPID", "hostNetwork", "hostIPC")
CONTAINER_LISTS: Final = ("containers", "initContainers", "ephemeralContainers")


def allowed(pipeline: Pipeline) -> bool:
    """Whether the pipeline opted in to weaker pods."""
    return pipeline.annotations.get(ANNOTATION_ALLOW_PRIVILEGED) == OPT_IN


def annotation_problems(pipeline: Pipeline) -> list[Problem]:
    value = pipeline.annotations.get(ANNOTATION_ALLOW_PRIVILEGED)
    if value is None or value in (OPT_IN, "false"):
        return []
    path = child("metadata.annotations", ANNOTATION_ALLOW_PRIVILEGED)
    return [Problem(path, f'must be "true" or "false", got {value!r}')]


def own_secret(pipeline: Pipeline, name: object) -> bool:
    """Whether a Secret name is the pipeline's own: `<pipeline>-...` (its peer key, its
    gateway token), the names the operator and the docs give them."""
    return isinstance(name, str) and name.startswith(f"{pipeline.name}-")


def templates(pipeline: Pipeline) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(field path, podTemplate) for every podTemplate the pipeline sets."""
    for i, role in enumerate(pipeline.roles):
        if role.pod_template is not None:
            yield f"spec.roles[{i}].podTemplate", role.pod_template
    if pipeline.gateway.pod_template is not None:
        yield "spec.gateway.podTemplate", pipeline.gateway.pod_template


def findings(pipeline: Pipeline) -> list[Problem]:
    """Every weakening setting of every podTemplate, and a gateway token Secret that is not
    the pipeline's own, with its field path."""

    def own(name: object) -> bool:
        return own_secret(pipeline, name)

    result: list[Problem] = []
    for path, template in templates(pipeline):
        result += template_findings(template, path, own)
    for i, role in enumerate(pipeline.roles):  # a role's own `env` may read Secrets too
        env = [{"name": var.name, "valueFrom": var.value_from} for var in role.env]
        result += podrules.container_refs({"env": env}, f"spec.roles[{i}]", own)
    auth = pipeline.gateway.auth
    if auth is not None and not own_secret(pipeline, auth.name):
        where = "spec.gateway.auth.secretRef.name"
        result.append(
            Problem(where, f"the Secret must be the pipeline's own ({pipeline.name}-...)")
        )
    return result


def template_findings(
    template: Mapping[str, Any], path: str, own: podrules.OwnSecret = lambda name: False
) -> list[Problem]:
    """The weakening settings of one PodTemplateSpec overlay (see the module docstring);
    `own` says which Secret names it may mount or read."""
    found = podrules.profile_annotations(template.get("metadata"), child(path, "metadata"))
    if "spec" in template and template["spec"] is None:
        found.append(Problem(child(path, "spec"), "null removes the whole hardened pod spec"))
    spec = template.get("spec")
    if not isinstance(spec, Mapping):
        return found
    path = child(path, "spec")
    for key in HOST_NAMESPACES:
        if spec.get(key) is True:
            found.append(Problem(child(path, key), "shares the node's namespace with the pod"))
    found += podrules.service_account(spec, path)
    found += podrules.security_context(spec, path, "the pod's")
    found += podrules.volumes(spec, path, own)
    for kind in CONTAINER_LISTS:
        containers = spec.get(kind)
        for k, container in enumerate(containers if isinstance(containers, list) else ()):
            if isinstance(container, Mapping):
                where = f"{child(path, kind)}[{k}]"
                found += podrules.security_context(container, where, "the container's")
                found += podrules.container_refs(container, where, own)
    return found
