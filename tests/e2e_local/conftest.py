"""Fixtures of the e2e_local scenarios (see README.md here).

- `local_cluster` (module scope): `LocalCluster`, the emulator (HTTPS, RBAC enforced) + the
  test node + the operator as the Helm chart's pod (in-cluster configuration); skipped,
  saying why, where pod sandboxes cannot be made (not root, no
  `ip`, no network namespaces). At its end every pod is terminated and the node's network
  removed; anything left fails the module.
- `figures(line)`: record a scenario's line of figures (printed in the terminal summary).
- the session sweep (autouse): before the first test, what earlier runs left (test nodes
  of dead processes, shared-memory pools of dead processes) is removed and named in the
  summary; after the last test, whatever any test node of this run
  left (network namespaces, interfaces, processes in them, files) is removed and reported
  as a failure, even when a test failed half-way.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
from collections.abc import Callable, Iterator

import pytest

from disagg_runtime.memory.pool import SHM_DIR, SHM_PREFIX
from tests.e2e_local.local_cluster import LocalCluster
from tests.k8s.node import node as node_module
from tests.k8s.node.network import can_create_namespaces

FIGURES: list[str] = []  # one line per scenario, printed at the end of the run


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if FIGURES:
        terminalreporter.section("e2e_local figures")
        for line in FIGURES:
            terminalreporter.write_line(line)


def sweep_before() -> list[str]:
    """What an earlier run (the rest of the suite, a run killed half-way) left that would
    weigh on these scenarios: test nodes of dead processes (their pods' processes still
    running, holding CPU and memory) and shared-memory pools of dead processes (RAM)."""
    found = node_module.sweep_stale()
    with contextlib.suppress(OSError):
        for name in os.listdir(SHM_DIR):
            m = re.search(r"-(\d+)-\d+$", name)
            if name.startswith(SHM_PREFIX) and m and not os.path.exists(f"/proc/{m.group(1)}"):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(SHM_DIR, name))
                    found.append(f"{SHM_DIR}/{name}")
    return found


@pytest.fixture(scope="session", autouse=True)
def sweep_test_nodes() -> Iterator[None]:
    before = sweep_before()
    if before:
        FIGURES.append(f"swept before the run (left by an earlier one): {before[:10]}")
    yield
    left: list[str] = []
    for tag in node_module.Node.created:
        left += node_module.sweep(tag)
    assert not left, f"test nodes left these behind (now removed): {left}"


@pytest.fixture
def figures() -> Callable[[str], None]:
    return FIGURES.append


@pytest.fixture(scope="module")
def local_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    reason = can_create_namespaces()
    if reason is not None:
        pytest.skip(reason)
    workdir: pathlib.Path = tmp_path_factory.mktemp("local-cluster")
    cluster = LocalCluster(workdir, operator_pod=True)
    left: list[str] = []
    try:
        yield cluster
    finally:
        left = cluster.close()
    assert not left, f"the node left these behind: {left}"
