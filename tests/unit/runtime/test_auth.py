"""The peer key and the MACs of the relay handshake (relay/auth.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from disagg_runtime.relay import auth


def test_the_key_file_is_read_without_surrounding_whitespace(tmp_path: Path) -> None:
    key = auth.new_key()
    path = tmp_path / "key"
    path.write_bytes(b"\n  " + key + b"\n")
    assert auth.read_key(str(path)) == key
    assert auth.key_from_env({auth.KEY_ENV: str(path)}) == key


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "cannot read"), (b"", "at least 32 bytes"), (b"x" * 31 + b"\n", "not 31")],
)
def test_bad_key_files_are_refused_naming_the_variable(
    tmp_path: Path, content: bytes | None, message: str
) -> None:
    path = tmp_path / "key"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(auth.PeerKeyError, match=message) as info:
        auth.read_key(str(path))
    assert auth.KEY_ENV in str(info.value)


def test_no_key_is_no_default() -> None:
    with pytest.raises(auth.PeerKeyError, match="is required"):
        auth.key_from_env({})


def test_macs_depend_on_key_label_and_every_part() -> None:
    key, other = auth.new_key(), auth.new_key()
    mac = auth.mac(key, "sender", "n1", "n2")
    assert auth.verify(key, mac, "sender", "n1", "n2")
    assert not auth.verify(other, mac, "sender", "n1", "n2")
    assert not auth.verify(key, mac, "welcome", "n1", "n2")
    assert not auth.verify(key, mac, "sender", "n2", "n1")
    assert not auth.verify(key, mac, "sender", "n1\0n2")  # parts cannot be regrouped
    assert not auth.verify(key, None, "sender", "n1", "n2")
    assert auth.body({"b": 1, "a": [1.5], "mac": "x"}) == '{"a":[1.5],"b":1}'


def test_refusals_are_counted_and_logged_at_a_bounded_rate(
    caplog: pytest.LogCaptureFixture,
) -> None:
    refusals = auth.Refusals(logging.getLogger("test.refusals"), "ingress x", every_s=3600)
    with caplog.at_level(logging.WARNING, logger="test.refusals"):
        for _ in range(1000):
            refusals.refuse("bad mac")
    assert refusals.count == 1000
    assert len(caplog.records) == 1
