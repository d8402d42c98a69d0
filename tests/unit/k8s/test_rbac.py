"""The emulator's authentication and RBAC evaluation (tests/k8s/rbac.py), without a server."""

from __future__ import annotations

from typing import Any

import pytest

from tests.k8s.rbac import Attributes, Authenticator, Identity, authorize, rule_allows

SA = Identity.service_account("ops", "op")


def role(
    kind: str, name: str, rules: list[dict[str, Any]], ns: str | None = None
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, **({"namespace": ns} if ns else {})}
    return {"kind": kind, "metadata": meta, "rules": rules}


def binding(kind: str, name: str, ref: tuple[str, str], subjects: list[Any], ns: str | None = None):
    meta: dict[str, Any] = {"name": name, **({"namespace": ns} if ns else {})}
    roleref = {"apiGroup": "rbac.authorization.k8s.io", "kind": ref[0], "name": ref[1]}
    return {"kind": kind, "metadata": meta, "roleRef": roleref, "subjects": subjects}


SUBJECT = {"kind": "ServiceAccount", "name": "op", "namespace": "ops"}
STS = {"apiGroups": ["apps"], "resources": ["statefulsets"], "verbs": ["get", "list", "patch"]}


def test_tokens_identify_admins_and_service_accounts_and_nobody_else():
    auth = Authenticator()
    admin = auth.admin_token()
    token = auth.service_account_token("ops", "op")
    assert auth.identify(f"Bearer {admin}") == Identity(
        "admin", frozenset({"system:masters", "system:authenticated"})
    )
    assert auth.identify(f"Bearer {token}") == SA
    assert auth.identify(f"bearer {token}") == SA  # the kubernetes client's spelling
    assert SA.account == ("ops", "op") and "system:serviceaccounts:ops" in SA.groups
    forged = token.replace("ops:op", "ops:admin")
    other = Authenticator().service_account_token("ops", "op")  # another cluster's key
    for header in (None, "", f"Basic {admin}", f"Bearer {forged}", f"Bearer {other}", "Bearer x"):
        assert auth.identify(header) is None, header


def test_a_cluster_role_binding_grants_everywhere_a_role_binding_in_its_namespace():
    objects = [
        role("ClusterRole", "sts", [STS]),
        binding("RoleBinding", "b", ("ClusterRole", "sts"), [SUBJECT], ns="ml"),
    ]
    get = Attributes("get", "apps", "statefulsets", namespace="ml", name="x")
    assert authorize(SA, get, objects)
    assert not authorize(SA, Attributes("get", "apps", "statefulsets", namespace="dev"), objects)
    assert not authorize(SA, Attributes("list", "apps", "statefulsets"), objects)  # all namespaces
    objects.append(binding("ClusterRoleBinding", "c", ("ClusterRole", "sts"), [SUBJECT]))
    assert authorize(SA, Attributes("list", "apps", "statefulsets"), objects)
    assert not authorize(SA, Attributes("delete", "apps", "statefulsets", "", "ml", "x"), objects)


def test_roles_bind_in_their_own_namespace_only():
    objects = [
        role("Role", "r", [STS], ns="ml"),
        binding("RoleBinding", "b", ("Role", "r"), [SUBJECT], ns="dev"),  # no Role r in dev
    ]
    assert not authorize(SA, Attributes("get", "apps", "statefulsets", namespace="dev"), objects)
    objects.append(binding("RoleBinding", "b", ("Role", "r"), [SUBJECT], ns="ml"))
    assert authorize(SA, Attributes("get", "apps", "statefulsets", namespace="ml"), objects)


@pytest.mark.parametrize(
    ("subject", "bound"),
    [
        ({"kind": "ServiceAccount", "name": "op", "namespace": "other"}, False),
        ({"kind": "ServiceAccount", "name": "op"}, True),  # the binding's namespace
        ({"kind": "User", "name": "system:serviceaccount:ops:op"}, True),
        ({"kind": "Group", "name": "system:serviceaccounts:ops"}, True),
        ({"kind": "Group", "name": "system:serviceaccounts:dev"}, False),
    ],
)
def test_subjects(subject: dict[str, str], bound: bool):
    objects = [
        role("Role", "r", [STS], ns="ops"),
        binding("RoleBinding", "b", ("Role", "r"), [subject], ns="ops"),
    ]
    assert (
        authorize(SA, Attributes("get", "apps", "statefulsets", namespace="ops"), objects) is bound
    )


@pytest.mark.parametrize(
    ("rule", "request_", "allowed"),
    [
        (
            {"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]},
            ("get", "", "pods", "status"),
            True,
        ),
        (
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]},
            ("get", "", "pods", "status"),
            False,
        ),
        (
            {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["patch"]},
            ("patch", "", "pods", "status"),
            True,
        ),
        (
            {"apiGroups": [""], "resources": ["*/status"], "verbs": ["patch"]},
            ("patch", "", "pods", "status"),
            True,
        ),
        (
            {"apiGroups": [""], "resources": ["*/scale"], "verbs": ["patch"]},
            ("patch", "", "pods", "status"),
            False,
        ),
        (
            {"apiGroups": ["apps"], "resources": ["pods"], "verbs": ["get"]},
            ("get", "", "pods", None),
            False,
        ),
    ],
)
def test_rule_matching(rule: dict[str, Any], request_: tuple[Any, ...], allowed: bool):
    verb, group, resource, sub = request_
    assert rule_allows(rule, Attributes(verb, group, resource, sub, "ns", "x")) is allowed


def test_resource_names_limit_named_requests_and_never_match_lists_or_creates():
    rule = {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["*"], "resourceNames": ["a"]}
    assert rule_allows(rule, Attributes("get", "", "configmaps", None, "ns", "a"))
    assert not rule_allows(rule, Attributes("get", "", "configmaps", None, "ns", "b"))
    assert not rule_allows(rule, Attributes("list", "", "configmaps", None, "ns"))
    assert not rule_allows(rule, Attributes("create", "", "configmaps", None, "ns"))


def test_masters_need_no_rbac_and_forbidden_says_who_and_what():
    admin = Identity("admin", frozenset({"system:masters"}))
    request = Attributes("delete", "apps", "statefulsets", None, "ml", "web")
    assert authorize(admin, request, [])
    assert not authorize(SA, request, [])
    assert request.describe(SA.user) == (
        'statefulsets "web" is forbidden: User "system:serviceaccount:ops:op" cannot delete '
        'resource "statefulsets" in API group "apps" in the namespace "ml"'
    )
