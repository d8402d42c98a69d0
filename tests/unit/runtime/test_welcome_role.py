"""The welcome's `role` field (relay/protocol.py): validated like every field a peer sends."""

from __future__ import annotations

from typing import Any

import pytest

from disagg_runtime.relay import protocol as proto


def welcome(**fields: Any) -> dict[str, Any]:
    return {"op": "welcome", **fields}


def test_a_welcome_without_a_role_names_none() -> None:
    assert proto.role(welcome()) is None


@pytest.mark.parametrize("name", ["decode", "vae-decoder", "a", "r2d2", "x" * 63])
def test_role_names_are_dns_labels(name: str) -> None:
    assert proto.role(welcome(role=name)) == name


@pytest.mark.parametrize(
    "bad", ["", "Decode", "-a", "a-", "a.b", "x" * 64, "a b", 7, None, ["decode"], {"r": 1}]
)
def test_anything_else_is_refused_naming_the_field(bad: object) -> None:
    with pytest.raises(proto.ProtocolError, match="'role'"):
        proto.role(welcome(role=bad))
