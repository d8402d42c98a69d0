"""The allow-lists of `podpolicy`: what a podTemplate overlay may set, after the Pod Security
Standard "restricted" (kubernetes.io/docs/concepts/security/pod-security-standards).

An allow-list, not a deny-list: a value the standard does not list (a new volume type, a
seccomp profile type spelled differently, an unknown sysctl) is refused, so a field the
policy has not heard of cannot weaken a pod. Each check returns `Problem`s with the field
path of the offending value; `podpolicy` decides whether they are refusals or warnings.

Pure: the checks read plain mappings (the template as the user wrote it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final

from disagg_core.spec.fields import Problem, child

# Volume sources "restricted" allows (hostPath, nfs, gitRepo, iscsi, ... are refused).
VOLUME_TYPES: Final = frozenset(
    {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
)
# Baseline's safe sysctls (namespaced, isolated from other pods), up to Kubernetes 1.29.
SAFE_SYSCTLS: Final = frozenset(
    {
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
    }
)
SELINUX_TYPES: Final = frozenset(
    {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
)
PROFILE_TYPES: Final = frozenset({"RuntimeDefault", "Localhost"})  # seccomp and AppArmor
CAPABILITIES_ADD: Final = frozenset({"NET_BIND_SERVICE"})
PROC_MOUNTS: Final = frozenset({"Default"})
# The deprecated annotations that set seccomp and AppArmor profiles, and their safe values.
SECCOMP_ANNOTATIONS: Final = (
    "seccomp.security.alpha.kubernetes.io/pod",
    "container.seccomp.security.alpha.kubernetes.io/",
)
APPARMOR_ANNOTATION: Final = "container.apparmor.security.beta.kubernetes.io/"
SECCOMP_VALUES: Final = ("runtime/default", "docker/default")
APPARMOR_VALUES: Final = ("runtime/default",)
LOCALHOST: Final = "localhost/"
OwnSecret = Callable[[object], bool]  # whether a Secret name is the pipeline's own
# Keys whose removal (`null`) undoes the planner's hardening.
HARDENING_KEYS: Final = (
    "runAsNonRoot",
    "allowPrivilegeEscalation",
    "capabilities",
    "seccompProfile",
)


def profile_annotations(metadata: Any, path: str) -> list[Problem]:
    """seccomp and AppArmor profiles set through the (deprecated) pod annotations."""
    notes = metadata.get("annotations") if isinstance(metadata, Mapping) else None
    if not isinstance(notes, Mapping):
        return []
    found: list[Problem] = []
    allowed: tuple[str, ...]
    for key, value in notes.items():
        if key.startswith(SECCOMP_ANNOTATIONS):
            allowed = SECCOMP_VALUES
        elif key.startswith(APPARMOR_ANNOTATION):
            allowed = APPARMOR_VALUES
        else:
            continue
        if not (value in allowed or (isinstance(value, str) and value.startswith(LOCALHOST))):
            where = child(child(path, "annotations"), key)
            found.append(Problem(where, f"profile {_shown(value)} is not allowed"))
    return found


def volumes(spec: Mapping[str, Any], path: str, own: OwnSecret) -> list[Problem]:
    """Volume types outside restricted's list, Secrets that are not the pipeline's own, and
    projected service-account tokens."""
    listed = spec.get("volumes")
    found: list[Problem] = []
    for k, volume in enumerate(listed if isinstance(listed, list) else ()):
        if not isinstance(volume, Mapping):
            continue
        where = f"{child(path, 'volumes')}[{k}]"
        for kind, source in volume.items():
            if kind != "name" and source is not None and kind not in VOLUME_TYPES:
                found.append(Problem(child(where, kind), "volume type not allowed (restricted)"))
        found += _secret_name(volume.get("secret"), "secretName", child(where, "secret"), own)
        csi = volume.get("csi")
        if isinstance(csi, Mapping):
            ref, at = (
                csi.get("nodePublishSecretRef"),
                child(child(where, "csi"), "nodePublishSecretRef"),
            )
            found += _secret_name(ref, "name", at, own)
        found += _projected(volume.get("projected"), child(where, "projected"), own)
    return found


def _projected(projected: Any, path: str, own: OwnSecret) -> Iterator[Problem]:
    sources = projected.get("sources") if isinstance(projected, Mapping) else None
    for j, source in enumerate(sources if isinstance(sources, list) else ()):
        if not isinstance(source, Mapping):
            continue
        where = f"{child(path, 'sources')}[{j}]"
        if source.get("serviceAccountToken") is not None:
            yield Problem(child(where, "serviceAccountToken"), "mounts a service-account token")
        yield from _secret_name(source.get("secret"), "name", child(where, "secret"), own)


def container_refs(container: Mapping[str, Any], path: str, own: OwnSecret) -> list[Problem]:
    """hostPorts, and Secrets read into variables, of one container."""
    found: list[Problem] = []
    ports = container.get("ports")
    for j, port in enumerate(ports if isinstance(ports, list) else ()):
        if isinstance(port, Mapping) and port.get("hostPort") not in (None, 0):
            where = child(f"{child(path, 'ports')}[{j}]", "hostPort")
            found.append(Problem(where, "binds a port of the node"))
    env = container.get("env")
    for j, var in enumerate(env if isinstance(env, list) else ()):
        source = var.get("valueFrom") if isinstance(var, Mapping) else None
        if isinstance(source, Mapping):
            where = child(child(f"{child(path, 'env')}[{j}]", "valueFrom"), "secretKeyRef")
            found += _secret_name(source.get("secretKeyRef"), "name", where, own)
    env_from = container.get("envFrom")
    for j, entry in enumerate(env_from if isinstance(env_from, list) else ()):
        if isinstance(entry, Mapping):
            where = child(f"{child(path, 'envFrom')}[{j}]", "secretRef")
            found += _secret_name(entry.get("secretRef"), "name", where, own)
    return found


def _secret_name(ref: Any, key: str, path: str, own: OwnSecret) -> Iterator[Problem]:
    if isinstance(ref, Mapping) and key in ref and not own(ref[key]):
        yield Problem(child(path, key), f"Secret {_shown(ref[key])} is not the pipeline's own")


def service_account(spec: Mapping[str, Any], path: str) -> list[Problem]:
    """A service account other than the namespace's default, or its token mounted."""
    found = [
        Problem(child(path, key), "runs the pod as a chosen service account")
        for key in ("serviceAccountName", "serviceAccount")
        if spec.get(key) not in (None, "")
    ]
    if "automountServiceAccountToken" in spec and spec["automountServiceAccountToken"] is not False:
        where = child(path, "automountServiceAccountToken")
        found.append(Problem(where, "mounts a service-account token (the operator sets false)"))
    return found


def sysctls(context: Mapping[str, Any], path: str) -> list[Problem]:
    listed = context.get("sysctls")
    found: list[Problem] = []
    for k, entry in enumerate(listed if isinstance(listed, list) else ()):
        name = entry.get("name") if isinstance(entry, Mapping) else entry
        if name not in SAFE_SYSCTLS:
            where = child(f"{child(path, 'sysctls')}[{k}]", "name")
            found.append(Problem(where, f"sysctl {_shown(name)} is not in the safe set"))
    return found


def security_context(owner: Mapping[str, Any], path: str, whose: str) -> list[Problem]:
    """The weakening settings of a pod's or container's `securityContext`."""
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
    if context.get("procMount") not in (None, *PROC_MOUNTS):
        add("procMount", "unmasks /proc (only Default is allowed)")
    for key in ("seccompProfile", "appArmorProfile"):
        profile = context.get(key)
        if isinstance(profile, Mapping) and profile.get("type") not in PROFILE_TYPES:
            where = child(child(path, key), "type")
            found.append(Problem(where, "only RuntimeDefault or Localhost profiles are allowed"))
    found += _selinux(context.get("seLinuxOptions"), child(path, "seLinuxOptions"))
    windows = context.get("windowsOptions")
    if isinstance(windows, Mapping) and windows.get("hostProcess") is True:
        add("windowsOptions", "hostProcess runs on the node")
    found += _capabilities(context.get("capabilities"), child(path, "capabilities"))
    found += sysctls(context, path)
    return found


def _selinux(options: Any, path: str) -> Iterator[Problem]:
    if not isinstance(options, Mapping):
        return
    if options.get("type", "") not in SELINUX_TYPES:
        yield Problem(child(path, "type"), f"SELinux type {_shown(options['type'])} is not allowed")
    for key in ("user", "role"):
        if options.get(key) not in (None, ""):
            yield Problem(child(path, key), f"a custom SELinux {key} is not allowed")


def _capabilities(capabilities: Any, path: str) -> Iterator[Problem]:
    if not isinstance(capabilities, Mapping):
        return
    added = capabilities.get("add")
    extra = [c for c in added if c not in CAPABILITIES_ADD] if isinstance(added, list) else added
    if extra:
        yield Problem(child(path, "add"), f"adds capabilities {_shown(extra)}")
    if "drop" in capabilities:
        dropped = capabilities["drop"]
        if not (isinstance(dropped, list) and "ALL" in dropped):
            yield Problem(
                child(path, "drop"), "must keep ALL (the operator drops every capability)"
            )


def _shown(value: Any, limit: int = 80) -> str:
    """A value as echoed in a problem: repr, cut to `limit` characters."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
