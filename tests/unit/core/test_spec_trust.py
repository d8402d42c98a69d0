"""The spec's part of trust between roles: the policy on pods (each weakening podTemplate
setting refused with its field path, unless the pipeline opts in), maxima, YAML alias bombs
and cycles, and spec.networkPolicy."""

from __future__ import annotations

import io
import pathlib
import time
from typing import Any

import pytest

from disagg_core import spec
from disagg_core.spec import model, podpolicy

ROLE = "spec.roles[0]"
OPT_IN = {model.ANNOTATION_ALLOW_PRIVILEGED: "true"}


def doc(pod_template: dict[str, Any] | None = None, **meta: Any) -> dict[str, Any]:
    role: dict[str, Any] = {"name": "enc", "handler": "pkg.mod:fn"}
    if pod_template is not None:
        role["podTemplate"] = pod_template
    return {
        "apiVersion": model.API_VERSION,
        "kind": model.KIND,
        "metadata": {"name": "p", **meta},
        "spec": {"image": "img:1", "roles": [role]},
    }


def problems(document: dict[str, Any]) -> list[str]:
    try:
        spec.parse_pipeline(document)
    except spec.SpecError as error:
        return [str(problem) for problem in error.problems]
    return []


def container(security: Any) -> dict[str, Any]:
    return {"spec": {"containers": [{"name": "enc", "securityContext": security}]}}


def pod_security(security: Any) -> dict[str, Any]:
    return {"spec": {"securityContext": security}}


C = f"{ROLE}.podTemplate.spec.containers[0].securityContext"
P = f"{ROLE}.podTemplate.spec.securityContext"
WEAKENING = [
    ("host pid", {"spec": {"hostPID": True}}, f"{ROLE}.podTemplate.spec.hostPID"),
    ("host network", {"spec": {"hostNetwork": True}}, f"{ROLE}.podTemplate.spec.hostNetwork"),
    ("host ipc", {"spec": {"hostIPC": True}}, f"{ROLE}.podTemplate.spec.hostIPC"),
    (
        "host path",
        {"spec": {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]}},
        f"{ROLE}.podTemplate.spec.volumes[0].hostPath",
    ),
    ("privileged", container({"privileged": True}), f"{C}.privileged"),
    (
        "added capabilities",
        container({"capabilities": {"add": ["SYS_ADMIN"]}}),
        f"{C}.capabilities.add",
    ),
    (
        "drop less than ALL",
        container({"capabilities": {"drop": ["NET_RAW"]}}),
        f"{C}.capabilities.drop",
    ),
    ("capabilities removed", container({"capabilities": None}), f"{C}.capabilities"),
    ("escalation", container({"allowPrivilegeEscalation": True}), f"{C}.allowPrivilegeEscalation"),
    (
        "escalation removed",
        container({"allowPrivilegeEscalation": None}),
        f"{C}.allowPrivilegeEscalation",
    ),
    ("root user", container({"runAsUser": 0}), f"{C}.runAsUser"),
    ("root allowed", container({"runAsNonRoot": False}), f"{C}.runAsNonRoot"),
    ("container hardening removed", container(None), C),
    (
        "seccomp off",
        container({"seccompProfile": {"type": "Unconfined"}}),
        f"{C}.seccompProfile.type",
    ),
    (
        "apparmor off",
        container({"appArmorProfile": {"type": "Unconfined"}}),
        f"{C}.appArmorProfile.type",
    ),
    ("proc unmasked", container({"procMount": "Unmasked"}), f"{C}.procMount"),
    (
        "windows host process",
        container({"windowsOptions": {"hostProcess": True}}),
        f"{C}.windowsOptions",
    ),
    ("pod hardening removed", pod_security(None), P),
    ("pod root user", pod_security({"runAsUser": 0}), f"{P}.runAsUser"),
    ("pod non-root removed", pod_security({"runAsNonRoot": None}), f"{P}.runAsNonRoot"),
    ("pod seccomp removed", pod_security({"seccompProfile": None}), f"{P}.seccompProfile"),
    (
        "privileged sidecar",
        {"spec": {"initContainers": [{"name": "x", "securityContext": {"privileged": True}}]}},
        f"{ROLE}.podTemplate.spec.initContainers[0].securityContext.privileged",
    ),
    ("whole spec removed", {"spec": None}, f"{ROLE}.podTemplate.spec"),
]


@pytest.mark.parametrize(
    ("template", "path"), [w[1:] for w in WEAKENING], ids=[w[0] for w in WEAKENING]
)
def test_each_weakening_setting_is_refused_with_its_path(template: Any, path: str) -> None:
    found = problems(doc(template))
    assert len(found) == 1, found
    assert found[0].startswith(f"{path}: ")
    assert model.ANNOTATION_ALLOW_PRIVILEGED in found[0]  # says how to opt in


@pytest.mark.parametrize(
    ("template", "path"), [w[1:] for w in WEAKENING], ids=[w[0] for w in WEAKENING]
)
def test_the_opt_in_accepts_them_and_still_lists_them(template: Any, path: str) -> None:
    pipeline = spec.parse_pipeline(doc(template, annotations=OPT_IN))
    assert [p.path for p in podpolicy.findings(pipeline)] == [path]
    assert podpolicy.allowed(pipeline)


def test_harmless_pod_templates_pass() -> None:
    template = {
        "metadata": {"annotations": {"a": "b"}},
        "spec": {
            "hostNetwork": False,
            "securityContext": {"runAsUser": 1000, "runAsNonRoot": True},
            "volumes": [{"name": "cache", "emptyDir": {}}],
            "containers": [
                {
                    "name": "enc",
                    "securityContext": {
                        "readOnlyRootFilesystem": False,  # no privilege
                        "capabilities": {"drop": ["ALL"], "add": []},
                        "seccompProfile": {"type": "RuntimeDefault"},
                    },
                }
            ],
        },
    }
    assert problems(doc(template)) == []
    assert podpolicy.findings(spec.parse_pipeline(doc(template))) == []


def test_the_opt_in_must_say_true_or_false() -> None:
    found = problems(
        doc({"spec": {"hostPID": True}}, annotations={"disagg.dev/allow-privileged": "yes"})
    )
    assert found[0].startswith('metadata.annotations["disagg.dev/allow-privileged"]: ')
    assert len(found) == 2  # and hostPID is still refused
    assert problems(doc(None, annotations={"disagg.dev/allow-privileged": "false"})) == []
    false = doc({"spec": {"hostPID": True}}, annotations={"disagg.dev/allow-privileged": "false"})
    assert len(problems(false)) == 1


MAXIMA = [
    ("replicas", ("roles", 0, "replicas"), model.MAX_REPLICAS + 1, f"{ROLE}.replicas"),
    ("concurrency", ("roles", 0, "concurrency"), model.MAX_CONCURRENCY + 1, f"{ROLE}.concurrency"),
    ("pool size", ("transport", "poolSize"), "1Ei", "spec.transport.poolSize"),
    (
        "timeout",
        ("transport", "requestTimeoutSeconds"),
        2e6,
        "spec.transport.requestTimeoutSeconds",
    ),
]


@pytest.mark.parametrize(
    ("where", "value", "path"), [m[1:] for m in MAXIMA], ids=[m[0] for m in MAXIMA]
)
def test_maxima(where: tuple[Any, ...], value: Any, path: str) -> None:
    document = doc()
    target: Any = document["spec"]
    for step in where[:-1]:
        target = target.setdefault(step, {}) if isinstance(step, str) else target[step]
    target[where[-1]] = value
    found = problems(document)
    assert len(found) == 1 and found[0].startswith(f"{path}: must be "), found


def test_the_maxima_themselves_are_accepted() -> None:
    document = doc()
    document["spec"]["transport"] = {
        "poolSize": model.MAX_POOL_SIZE,
        "requestTimeoutSeconds": model.MAX_REQUEST_TIMEOUT_SECONDS,
    }
    role = document["spec"]["roles"][0]
    role.update(replicas=model.MAX_REPLICAS, concurrency=model.MAX_CONCURRENCY)
    assert problems(document) == []


def test_a_role_pool_of_an_exabyte_is_refused() -> None:
    document = doc()
    document["spec"]["roles"][0]["transport"] = {"poolSize": "1Ei"}
    assert problems(document)[0].startswith(f"{ROLE}.transport.poolSize: must be at most 1Ti")


BOMB = """\
apiVersion: disagg.dev/v1alpha1
kind: DisaggregatedPipeline
metadata: {name: bomb}
spec:
  image: img:1
  roles:
    - name: enc
      handler: pkg.mod:fn
      podTemplate:
        metadata:
          annotations:
            a0: &a0 [x, x, x, x, x, x, x, x, x, x]
            a1: &a1 [*a0, *a0, *a0, *a0, *a0, *a0, *a0, *a0, *a0, *a0]
            a2: &a2 [*a1, *a1, *a1, *a1, *a1, *a1, *a1, *a1, *a1, *a1]
            a3: &a3 [*a2, *a2, *a2, *a2, *a2, *a2, *a2, *a2, *a2, *a2]
            a4: &a4 [*a3, *a3, *a3, *a3, *a3, *a3, *a3, *a3, *a3, *a3]
            a5: &a5 [*a4, *a4, *a4, *a4, *a4, *a4, *a4, *a4, *a4, *a4]
            a6: &a6 [*a5, *a5, *a5, *a5, *a5, *a5, *a5, *a5, *a5, *a5]
            a7: &a7 [*a6, *a6, *a6, *a6, *a6, *a6, *a6, *a6, *a6, *a6]
            a8: &a8 [*a7, *a7, *a7, *a7, *a7, *a7, *a7, *a7, *a7, *a7]
"""


def test_an_anchor_bomb_fails_fast_with_a_clear_error(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    started = time.monotonic()
    out = io.StringIO()
    assert spec.validate_cli([str(path)], out=out) == 1
    assert time.monotonic() - started < 5  # a billion nodes never built
    assert "YAML alias error" in out.getvalue()
    assert f"more than {spec.MAX_ALIAS_EXPANSION} nodes" in out.getvalue()


def test_a_self_referring_alias_is_refused() -> None:
    with pytest.raises(spec.SpecError, match="a cycle"):
        spec.load_pipeline_text("a: &x [1, *x]\n")


def test_a_few_anchors_still_work() -> None:
    shared = """\
apiVersion: disagg.dev/v1alpha1
kind: DisaggregatedPipeline
metadata: {name: p}
spec:
  image: img:1
  roles:
    - name: a
      handler: pkg.mod:fn
      env: &env [{name: MODEL, value: small}, {name: MODE, value: fast}]
    - name: b
      handler: pkg.mod:fn
      env: *env
  edges: [{from: a, to: b}]
"""
    pipeline = spec.load_pipeline_text(shared)
    assert pipeline.role("a").env == pipeline.role("b").env


def test_network_policy_defaults_and_options() -> None:
    assert spec.parse_pipeline(doc()).network_policy == model.NetworkPolicy()
    document = doc()
    peer = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mon"}}}
    document["spec"]["networkPolicy"] = {"enabled": False, "metricsFrom": [peer]}
    policy = spec.parse_pipeline(document).network_policy
    assert (policy.enabled, policy.metrics_from, policy.clients) == (False, (peer,), ())


@pytest.mark.parametrize(
    ("value", "path"),
    [
        ({"enabled": "no"}, "spec.networkPolicy.enabled"),
        ({"clients": [{}]}, "spec.networkPolicy.clients[0]"),
        ({"clients": [{"ipBlock": {}}]}, "spec.networkPolicy.clients[0].ipBlock.cidr"),
        ({"metricsFrom": "all"}, "spec.networkPolicy.metricsFrom"),
        ({"clients": [{"podSelector": {"matchLabels": {"a": 1}}}]}, "podSelector.matchLabels"),
        ({"open": True}, "spec.networkPolicy.open"),
    ],
)
def test_network_policy_problems(value: Any, path: str) -> None:
    document = doc()
    document["spec"]["networkPolicy"] = value
    found = problems(document)
    assert any(path in problem.split(": ")[0] for problem in found), found
