"""Fixtures the operator's integration tests share (the emulator itself: tests/k8s/fixtures)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration import operator_support as s
from tests.k8s.server import EmulatorThread


@pytest.fixture
def k8s_crd(k8s: EmulatorThread, disagg_crd: Path) -> Iterator[EmulatorThread]:
    """The emulator with the CRD; afterwards the operator's calls must be in the recorded
    RBAC (operator_rbac_observed.json), so a test that needs a new verb records it."""
    k8s.apply_file(disagg_crd)
    yield k8s
    missing = s.observed_rbac(k8s) - s.recorded_rbac()
    assert not missing, f"calls missing from {s.RBAC_FILE.name}: {missing}"
