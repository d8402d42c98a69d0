"""Fixtures of the e2e_local scenarios (see README.md here).

- `local_cluster` (module scope): `LocalCluster`, the emulator (HTTPS, RBAC enforced) + the
  test node + the operator as the Helm chart's pod (in-cluster configuration); skipped,
  saying why, where pod sandboxes cannot be made (not root, no
  `ip`, no network namespaces). At its end every pod is terminated and the node's network
  removed; anything left fails the module.
- `figures(line)`: record a scenario's line of figures (printed in the terminal summary).
- the session sweep (autouse): after the last test, whatever any test node of this run
  left (network namespaces, interfaces, processes in them, files) is removed and reported
  as a failure, even when a test failed half-way.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Iterator

import pytest

from tests.e2e_local.local_cluster import LocalCluster
from tests.k8s.node import node as node_module
from tests.k8s.node.network import can_create_namespaces

FIGURES: list[str] = []  # one line per scenario, printed at the end of the run


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if FIGURES:
        terminalreporter.section("e2e_local figures")
        for line in FIGURES:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session", autouse=True)
def sweep_test_nodes() -> Iterator[None]:
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
