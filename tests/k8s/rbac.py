"""Authentication and RBAC authorization for the emulator (opt-in: ``KubeEmulator(auth=...)``).

Pure: no I/O, no emulator state. The emulator hands ``Authenticator.identify`` a request's
``Authorization`` header and ``authorize`` the request's attributes with the RBAC objects
it stores; it answers 401 or 403 from the result, as the API server's authenticator and
RBAC authorizer would.

- Bearer tokens only. ``Authenticator`` knows static tokens (e.g. the tests' admin, in the
  ``system:masters`` group, which RBAC never asks about, as in Kubernetes) and signs
  service-account tokens (``service_account_token``: HMAC of namespace and name, so only
  tokens this authenticator made are accepted; the test node puts them in pods as the
  kubelet puts a TokenRequest's token). A service account is
  ``system:serviceaccount:<ns>:<name>`` in the groups ``system:serviceaccounts``,
  ``system:serviceaccounts:<ns>`` and ``system:authenticated``.
- RBAC as in Kubernetes: ClusterRoleBindings grant their ClusterRole's rules everywhere;
  RoleBindings grant their Role's or ClusterRole's rules in their own namespace only (never
  cluster-scoped resources, nor lists across namespaces). A rule matches when its
  apiGroups, resources (``res``, ``res/sub``, ``*``, ``*/sub``) and verbs (``*`` allowed)
  match and its resourceNames, when given, name the object (never a create, list, watch or
  deletecollection). Subjects: User, Group, ServiceAccount. Aggregated ClusterRoles and
  nonResourceURLs rules are not evaluated: non-resource paths (discovery, /version,
  /healthz) are open to every authenticated user, as ``system:discovery`` and
  ``system:public-info-viewer`` make them on a cluster.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

Obj = Mapping[str, Any]
MASTERS = "system:masters"
AUTHENTICATED = "system:authenticated"
SA_PREFIX = "system:serviceaccount:"
_SA_TOKEN_PREFIX = "sa."


@dataclass(frozen=True)
class Identity:
    user: str
    groups: frozenset[str] = frozenset()

    @staticmethod
    def service_account(namespace: str, name: str) -> Identity:
        return Identity(
            f"{SA_PREFIX}{namespace}:{name}",
            frozenset(
                {"system:serviceaccounts", f"system:serviceaccounts:{namespace}", AUTHENTICATED}
            ),
        )

    @property
    def account(self) -> tuple[str, str] | None:
        """(namespace, name) of a service account, else None."""
        if not self.user.startswith(SA_PREFIX):
            return None
        namespace, _, name = self.user[len(SA_PREFIX) :].partition(":")
        return namespace, name


@dataclass(frozen=True)
class Attributes:
    """What RBAC is asked about one request (``namespace`` None: cluster-wide)."""

    verb: str
    group: str
    resource: str
    subresource: str | None = None
    namespace: str | None = None
    name: str | None = None

    def describe(self, user: str) -> str:
        """The API server's words for a refusal."""
        what = f"{self.resource}/{self.subresource}" if self.subresource else self.resource
        named = f' "{self.name}"' if self.name else ""
        where = (
            f' in the namespace "{self.namespace}"' if self.namespace else " at the cluster scope"
        )
        return (
            f'{what}{named} is forbidden: User "{user}" cannot {self.verb} resource "{what}" '
            f'in API group "{self.group}"{where}'
        )


@dataclass
class Authenticator:
    """Bearer tokens to identities (see the module docstring)."""

    tokens: dict[str, Identity] = field(default_factory=dict)
    key: bytes = field(default_factory=lambda: secrets.token_bytes(32))

    def admin_token(self, user: str = "admin") -> str:
        """A new token of a user in ``system:masters`` (allowed everything)."""
        token = secrets.token_urlsafe(24)
        self.tokens[token] = Identity(user, frozenset({MASTERS, AUTHENTICATED}))
        return token

    def service_account_token(self, namespace: str, name: str) -> str:
        payload = f"{namespace}:{name}"
        mac = hmac.new(self.key, payload.encode(), hashlib.sha256).hexdigest()
        return f"{_SA_TOKEN_PREFIX}{payload}.{mac}"

    def identify(self, authorization: str | None) -> Identity | None:
        """The identity of an ``Authorization`` header; None when it proves nobody."""
        scheme, _, token = (authorization or "").strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:  # schemes are case-insensitive (RFC 7235)
            return None
        if token in self.tokens:
            return self.tokens[token]
        if token.startswith(_SA_TOKEN_PREFIX):
            payload, _, mac = token[len(_SA_TOKEN_PREFIX) :].rpartition(".")
            namespace, _, name = payload.partition(":")
            if (
                namespace
                and name
                and hmac.compare_digest(
                    mac, self.service_account_token(namespace, name).rpartition(".")[2]
                )
            ):
                return Identity.service_account(namespace, name)
        return None


def _binds(binding: Obj, who: Identity) -> bool:
    where = (binding.get("metadata") or {}).get("namespace")
    for subject in binding.get("subjects") or ():
        kind, name = subject.get("kind"), subject.get("name")
        if kind == "User" and name == who.user:
            return True
        if kind == "Group" and name in who.groups:
            return True
        if kind == "ServiceAccount" and who.account == (subject.get("namespace") or where, name):
            return True
    return False


def rule_allows(rule: Obj, request: Attributes) -> bool:
    if not any(g in ("*", request.group) for g in rule.get("apiGroups") or ()):
        return False
    if not any(v in ("*", request.verb) for v in rule.get("verbs") or ()):
        return False
    wanted = request.resource + (f"/{request.subresource}" if request.subresource else "")
    star = f"*/{request.subresource}" if request.subresource else "*"
    if not any(r in ("*", wanted, star) for r in rule.get("resources") or ()):
        return False
    names = rule.get("resourceNames") or ()
    return not names or (request.name is not None and request.name in names)


def authorize(who: Identity, request: Attributes, objects: Iterable[Obj]) -> bool:
    """Whether RBAC (``objects``: the stored Roles, ClusterRoles and their bindings) lets
    ``who`` make ``request``."""
    if MASTERS in who.groups:
        return True
    objects = list(objects)
    roles = {
        (o["kind"], (o.get("metadata") or {}).get("namespace"), o["metadata"]["name"]): o
        for o in objects
        if o.get("kind") in ("Role", "ClusterRole")
    }
    for binding in objects:
        kind = binding.get("kind")
        if kind not in ("RoleBinding", "ClusterRoleBinding") or not _binds(binding, who):
            continue
        where = (binding.get("metadata") or {}).get("namespace")
        if kind == "RoleBinding" and (request.namespace is None or request.namespace != where):
            continue
        ref = binding.get("roleRef") or {}
        role = roles.get(
            (ref.get("kind"), where if ref.get("kind") == "Role" else None, ref.get("name"))
        )
        if role is not None and any(rule_allows(r, request) for r in role.get("rules") or ()):
            return True
    return False
