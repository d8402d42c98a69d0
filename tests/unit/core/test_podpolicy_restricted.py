"""The pod policy as an allow-list after Pod Security "restricted", for every podTemplate the
CRD has (found by walking the CRD's schema, so a podTemplate added later is covered or this
fails), and the gateway's token Secret (issue 30, items 1 and 3)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest

from disagg_core import spec
from disagg_core.spec import model, podpolicy
from disagg_operator.gen import crd

OPT_IN = {model.ANNOTATION_ALLOW_PRIVILEGED: "true"}


def schema_paths(node: Any, path: str = "") -> Iterator[str]:
    """The field path (list items as `[*]`) of every `podTemplate` in a schema."""
    if not isinstance(node, dict):
        return
    for name, child in node.get("properties", {}).items():
        here = f"{path}.{name}" if path else name
        if name == "podTemplate":
            yield here
        yield from schema_paths(child, here)
    if "items" in node:
        yield from schema_paths(node["items"], f"{path}[*]")


def crd_pod_templates() -> list[str]:
    root = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return sorted(schema_paths(root))


def base() -> dict[str, Any]:
    return {
        "apiVersion": model.API_VERSION,
        "kind": model.KIND,
        "metadata": {"name": "p"},
        "spec": {"image": "img:1", "roles": [{"name": "enc", "handler": "pkg.mod:fn"}]},
    }


def put(document: dict[str, Any], path: str, template: Any) -> str:
    """Set `template` at a CRD path (`[*]` = the first item); the concrete path back."""
    node: Any = document
    parts = path.split(".")
    concrete = []
    for part in parts[:-1]:
        name, star = part.removesuffix("[*]"), part.endswith("[*]")
        node = node.setdefault(name, [{}] if star else {})
        if star:
            node = node[0]
        concrete.append(f"{name}[0]" if star else name)
    node[parts[-1]] = copy.deepcopy(template)
    return ".".join([*concrete, parts[-1]])


def problems(document: dict[str, Any]) -> list[str]:
    try:
        spec.parse_pipeline(document)
    except spec.SpecError as error:
        return [str(problem) for problem in error.problems]
    return []


def test_the_crd_has_the_pod_templates_this_file_knows() -> None:
    assert crd_pod_templates() == ["spec.gateway.podTemplate", "spec.roles[*].podTemplate"]


def c(**security: Any) -> dict[str, Any]:
    return {"spec": {"containers": [{"name": "x", "securityContext": security}]}}


def p(**security: Any) -> dict[str, Any]:
    return {"spec": {"securityContext": security}}


CS = ".spec.containers[0].securityContext"
PS = ".spec.securityContext"
# (what, template, path under the podTemplate)
HOSTILE: list[tuple[str, dict[str, Any], str]] = [
    ("hostNetwork", {"spec": {"hostNetwork": True}}, ".spec.hostNetwork"),
    ("hostPID", {"spec": {"hostPID": True}}, ".spec.hostPID"),
    ("privileged", c(privileged=True), f"{CS}.privileged"),
    ("root", c(runAsUser=0), f"{CS}.runAsUser"),
    (
        "hostPath /",
        {"spec": {"volumes": [{"name": "r", "hostPath": {"path": "/"}}]}},
        ".spec.volumes[0].hostPath",
    ),
    ("nfs", {"spec": {"volumes": [{"name": "n", "nfs": {"server": "x"}}]}}, ".spec.volumes[0].nfs"),
    ("gitRepo", {"spec": {"volumes": [{"name": "g", "gitRepo": {}}]}}, ".spec.volumes[0].gitRepo"),
    ("iscsi", {"spec": {"volumes": [{"name": "i", "iscsi": {}}]}}, ".spec.volumes[0].iscsi"),
    ("an unknown type", {"spec": {"volumes": [{"name": "u", "zz": {}}]}}, ".spec.volumes[0].zz"),
    (
        "another Secret",
        {"spec": {"volumes": [{"name": "s", "secret": {"secretName": "db-password"}}]}},
        ".spec.volumes[0].secret.secretName",
    ),
    (
        "a Secret projected",
        {
            "spec": {
                "volumes": [{"name": "s", "projected": {"sources": [{"secret": {"name": "x"}}]}}]
            }
        },
        ".spec.volumes[0].projected.sources[0].secret.name",
    ),
    (
        "a projected token",
        {
            "spec": {
                "volumes": [
                    {
                        "name": "t",
                        "projected": {"sources": [{"serviceAccountToken": {"path": "t"}}]},
                    }
                ]
            }
        },
        ".spec.volumes[0].projected.sources[0].serviceAccountToken",
    ),
    (
        "a csi Secret",
        {
            "spec": {
                "volumes": [
                    {"name": "s", "csi": {"driver": "d", "nodePublishSecretRef": {"name": "x"}}}
                ]
            }
        },
        ".spec.volumes[0].csi.nodePublishSecretRef.name",
    ),
    (
        "a Secret in a variable",
        {
            "spec": {
                "containers": [
                    {
                        "name": "x",
                        "env": [
                            {"name": "A", "valueFrom": {"secretKeyRef": {"name": "x", "key": "k"}}}
                        ],
                    }
                ]
            }
        },
        ".spec.containers[0].env[0].valueFrom.secretKeyRef.name",
    ),
    (
        "a Secret as variables",
        {"spec": {"initContainers": [{"name": "x", "envFrom": [{"secretRef": {"name": "x"}}]}]}},
        ".spec.initContainers[0].envFrom[0].secretRef.name",
    ),
    (
        "hostPort",
        {"spec": {"containers": [{"name": "x", "ports": [{"containerPort": 80, "hostPort": 80}]}]}},
        ".spec.containers[0].ports[0].hostPort",
    ),
    ("serviceAccountName", {"spec": {"serviceAccountName": "admin"}}, ".spec.serviceAccountName"),
    ("serviceAccount", {"spec": {"serviceAccount": "admin"}}, ".spec.serviceAccount"),
    (
        "token mounted",
        {"spec": {"automountServiceAccountToken": True}},
        ".spec.automountServiceAccountToken",
    ),
    (
        "token default back",
        {"spec": {"automountServiceAccountToken": None}},
        ".spec.automountServiceAccountToken",
    ),
    (
        "unsafe sysctl",
        p(sysctls=[{"name": "kernel.msgmax", "value": "1"}]),
        f"{PS}.sysctls[0].name",
    ),
    ("spc_t", c(seLinuxOptions={"type": "spc_t"}), f"{CS}.seLinuxOptions.type"),
    ("pod spc_t", p(seLinuxOptions={"type": "spc_t"}), f"{PS}.seLinuxOptions.type"),
    ("SELinux user", c(seLinuxOptions={"user": "system_u"}), f"{CS}.seLinuxOptions.user"),
    ("seccomp Unconfined", p(seccompProfile={"type": "Unconfined"}), f"{PS}.seccompProfile.type"),
    ("seccomp spelled", c(seccompProfile={"type": "unconfined"}), f"{CS}.seccompProfile.type"),
    ("apparmor", c(appArmorProfile={"type": "Unconfined"}), f"{CS}.appArmorProfile.type"),
    ("procMount", c(procMount="Unmasked"), f"{CS}.procMount"),
    ("capability", c(capabilities={"add": ["SYS_ADMIN"]}), f"{CS}.capabilities.add"),
    (
        "seccomp annotation",
        {"metadata": {"annotations": {"seccomp.security.alpha.kubernetes.io/pod": "unconfined"}}},
        '.metadata.annotations["seccomp.security.alpha.kubernetes.io/pod"]',
    ),
    (
        "container seccomp annotation",
        {
            "metadata": {
                "annotations": {"container.seccomp.security.alpha.kubernetes.io/x": "unconfined"}
            }
        },
        '.metadata.annotations["container.seccomp.security.alpha.kubernetes.io/x"]',
    ),
    (
        "apparmor annotation",
        {
            "metadata": {
                "annotations": {"container.apparmor.security.beta.kubernetes.io/x": "unconfined"}
            }
        },
        '.metadata.annotations["container.apparmor.security.beta.kubernetes.io/x"]',
    ),
]


@pytest.mark.parametrize("where", crd_pod_templates())
@pytest.mark.parametrize(
    ("template", "under"), [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE]
)
def test_every_crd_pod_template_refuses_each_setting_with_its_path(
    where: str, template: dict[str, Any], under: str
) -> None:
    document = base()
    at = put(document, where, template)
    found = problems(document)
    assert len(found) == 1, found
    path, _, reason = found[0].partition(": ")
    assert path == f"{at}{under}", found
    assert model.ANNOTATION_ALLOW_PRIVILEGED in reason
    opted = base()
    opted["metadata"]["annotations"] = OPT_IN
    put(opted, where, template)
    assert len(podpolicy.findings(spec.parse_pipeline(opted))) == 1  # a warning, then


SAFE: list[dict[str, Any]] = [
    {"spec": {"volumes": [{"name": k, k: {}} for k in ("emptyDir", "configMap", "projected")]}},
    {"spec": {"volumes": [{"name": "key", "secret": {"secretName": "p-peer-key"}}]}},
    {
        "spec": {
            "volumes": [{"name": "t", "projected": {"sources": [{"configMap": {"name": "c"}}]}}]
        }
    },
    {"spec": {"automountServiceAccountToken": False, "serviceAccountName": ""}},
    p(sysctls=[{"name": "net.ipv4.ip_local_port_range", "value": "1024 65535"}]),
    c(seLinuxOptions={"type": "container_t", "level": "s0:c1,c2"}),
    c(seccompProfile={"type": "Localhost", "localhostProfile": "x.json"}),
    c(appArmorProfile={"type": "RuntimeDefault"}),
    c(capabilities={"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}),
    c(procMount="Default"),
    {
        "metadata": {
            "annotations": {"container.apparmor.security.beta.kubernetes.io/x": "localhost/p"}
        }
    },
    {"spec": {"containers": [{"name": "x", "ports": [{"containerPort": 80, "hostPort": 0}]}]}},
]


@pytest.mark.parametrize("where", crd_pod_templates())
@pytest.mark.parametrize("template", SAFE)
def test_what_restricted_allows_passes(where: str, template: dict[str, Any]) -> None:
    document = base()
    put(document, where, template)
    assert problems(document) == []


def auth(name: str, **annotations: str) -> dict[str, Any]:
    document = base()
    document["metadata"]["annotations"] = annotations
    document["spec"]["gateway"] = {"auth": {"secretRef": {"name": name}}}
    return document


def test_the_gateway_token_must_be_the_pipelines_own_secret() -> None:
    found = problems(auth("cluster-admin-token"))
    assert len(found) == 1 and found[0].startswith("spec.gateway.auth.secretRef.name: ")
    assert problems(auth("p-gateway-token")) == []
    assert problems(auth("cluster-admin-token", **OPT_IN)) == []


def test_validate_warns_of_an_unauthenticated_gateway(tmp_path: Any) -> None:
    """Issue 30, item 15: the unauthenticated default is a visible choice."""
    import io

    import yaml

    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(base()))
    out, err = io.StringIO(), io.StringIO()
    assert spec.validate_cli([str(path)], out=out, err=err) == 0
    assert out.getvalue() == f"{path}: ok\n"
    assert f"{path}: warning: spec.gateway.auth: the gateway is unauthenticated" in err.getvalue()
    path.write_text(yaml.safe_dump(auth("p-token")))
    err = io.StringIO()
    assert spec.validate_cli([str(path)], out=io.StringIO(), err=err) == 0
    assert err.getvalue() == ""


def test_a_roles_own_env_may_not_read_another_secret() -> None:
    document = base()
    ref = {"secretKeyRef": {"name": "db-password", "key": "k"}}
    document["spec"]["roles"][0]["env"] = [{"name": "A", "valueFrom": ref}]
    found = problems(document)
    assert len(found) == 1
    assert found[0].startswith("spec.roles[0].env[0].valueFrom.secretKeyRef.name: ")
    document["spec"]["roles"][0]["env"][0]["valueFrom"] = {"secretKeyRef": {"name": "p-x"}}
    assert problems(document) == []
