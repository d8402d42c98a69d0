"""The gateway's bearer token follows its file as Kubernetes updates a mounted Secret
(new files in a fresh directory, then an atomic swap of the `..data` symlink)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from disagg_core.contract import ContractError
from disagg_runtime.gateway import token as token_mod
from disagg_runtime.gateway.token import BearerToken
from tests.support import SecretVolume


@pytest.fixture
def no_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(token_mod, "CHECK_S", 0.0)  # check the file on every use


def test_a_rotated_secret_is_read_again(tmp_path: Path, no_wait: None) -> None:
    volume = SecretVolume(tmp_path)
    volume.write("first\n")
    token = BearerToken.from_file(volume.path)
    assert token.current() == "first"
    volume.write("second")
    assert token.current() == "second"


def test_a_missing_or_empty_file_keeps_the_last_good_token(tmp_path: Path, no_wait: None) -> None:
    volume = SecretVolume(tmp_path)
    volume.write("first")
    token = BearerToken.from_file(volume.path)
    volume.write("  \n")
    assert token.current() == "first"
    os.unlink(tmp_path / "..data")
    assert token.current() == "first"
    volume.write("third")
    assert token.current() == "third"


def test_checks_are_rate_limited(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(token_mod, "CHECK_S", 3600.0)
    volume = SecretVolume(tmp_path)
    volume.write("first")
    token = BearerToken.from_file(volume.path)
    volume.write("second")
    assert token.current() == "first"  # within CHECK_S of the last read


def test_an_unreadable_file_stops_the_start(tmp_path: Path) -> None:
    with pytest.raises(ContractError, match="cannot read"):
        BearerToken.from_file(str(tmp_path / "absent"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ContractError, match="empty"):
        BearerToken.from_file(str(tmp_path / "empty"))


def test_a_fixed_token_never_reads() -> None:
    assert BearerToken("abc").current() == "abc" and BearerToken().current() == ""
