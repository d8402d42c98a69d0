"""Suite-wide guards: nothing we create may outlive the tests in /dev/shm."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

pytest_plugins = ["k8s.fixtures"]  # the Kubernetes API emulator (tests/k8s/)

SHM_DIR = "/dev/shm"
SHM_PREFIX = "disagg-"


def _our_segments() -> set[str]:
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX)}
    except FileNotFoundError:
        return set()


@pytest.fixture(scope="session", autouse=True)
def no_shm_leaks() -> Iterator[None]:
    before = _our_segments()
    yield
    leaked = _our_segments() - before
    for name in leaked:  # clean up so one failure does not cascade into later runs
        os.unlink(os.path.join(SHM_DIR, name))
    assert not leaked, f"shared-memory segments leaked by the suite: {sorted(leaked)}"
