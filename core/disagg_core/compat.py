"""Revision pairing: which replicas of two neighbouring roles may exchange a request.

A role's compat token names the revision of its payload contract (what it sends and what
it reads). The user sets it with `roles[].compat` and bumps it when that contract changes
(a new KV-cache layout, say), giving the roles on both sides of the change the same new
token; `roles[].compatibleWith` lists other tokens a revision still interoperates with.

Every replica advertises its token and list in the authenticated relay welcome, and a
sender routes a request only to replicas it is compatible with:

    compatible(a, b)  iff  either side declared no token (an `auto:` one)
                           or a.token == b.token
                           or a.token in b.accepts or b.token in a.accepts

So during a rollout that bumps the token of prefill and decode together, old prefill
replicas send only to old decoders and new ones only to new decoders.

Without `roles[].compat` a role's token is `auto:` + a hash of its handler and image: it
names the revision (status, logs) but pairs with anything. Pairing on it would need every
sender to be told its receivers' images, so that changing one role's image restarted its
neighbours too; a declared token changes only when the user says the contract did.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

AUTO_PREFIX: Final = "auto:"
TOKEN_PATTERN: Final = r"[A-Za-z0-9]([-A-Za-z0-9._]{0,61}[A-Za-z0-9])?"
MAX_ACCEPTS: Final = 32
_TOKEN = re.compile(TOKEN_PATTERN)
_AUTO = re.compile(re.escape(AUTO_PREFIX) + r"[0-9a-f]{1,64}")


class CompatError(ValueError):
    """A compat token or an advertised compat object is malformed."""


def check_token(token: object, where: str) -> str:
    """`token` if it is a valid user token (letters, digits, `-._`; at most 63 characters)."""
    if not isinstance(token, str) or not _TOKEN.fullmatch(token):
        raise CompatError(
            f"{where}: {token!r} is not a compat token (1-63 letters, digits, '-', '.', '_', "
            "starting and ending with a letter or digit)"
        )
    return token


def default_token(handler: str, image: str | None) -> str:
    """The token of a role that declares none: names its revision, pairs with anything."""
    digest = hashlib.sha256(f"{handler}\0{image or ''}".encode()).hexdigest()
    return AUTO_PREFIX + digest[:16]


@dataclass(frozen=True)
class Compat:
    """One replica's compat token and the other tokens it declares it interoperates with."""

    token: str
    accepts: frozenset[str] = frozenset()

    @property
    def declared(self) -> bool:
        return not self.token.startswith(AUTO_PREFIX)

    def to_wire(self) -> dict[str, Any]:
        return {"token": self.token, "accepts": sorted(self.accepts)}

    @classmethod
    def from_wire(cls, obj: object, where: str = "compat") -> Compat:
        """Parse an advertised compat object; CompatError naming the bad field."""
        if not isinstance(obj, Mapping):
            raise CompatError(f"{where} must be an object, got {type(obj).__name__}")
        unknown = set(obj) - {"token", "accepts"}
        if unknown:
            raise CompatError(f"{where} has unknown fields {sorted(unknown)}")
        token = obj.get("token")
        if not (isinstance(token, str) and _AUTO.fullmatch(token)):
            check_token(token, f"{where}.token")
        accepts = obj.get("accepts", [])
        if not isinstance(accepts, list) or len(accepts) > MAX_ACCEPTS:
            raise CompatError(f"{where}.accepts must be a list of at most {MAX_ACCEPTS} tokens")
        return cls(
            str(token),
            frozenset(check_token(t, f"{where}.accepts[{i}]") for i, t in enumerate(accepts)),
        )


def compatible(a: Compat | None, b: Compat | None) -> bool:
    """May replicas advertising `a` and `b` exchange requests (the rule in the module doc)?
    None (a peer that advertised nothing: a client, an older runtime) pairs with anything."""
    if a is None or b is None or not a.declared or not b.declared:
        return True
    return a.token == b.token or a.token in b.accepts or b.token in a.accepts
