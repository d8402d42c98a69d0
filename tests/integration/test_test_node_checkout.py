"""The test node's host-venv fallback does not depend on where the checkout lives: with the
checkout and its virtual environment under /tmp, a pod's emptyDir at /tmp hid both, and
every container failed (`nsexec container: [Errno 2] No such file or directory`). Runs the
node's StatefulSet test from a copy of the tests under /tmp, with a virtual environment
there (its site-packages lead to this one's). Needs root (skipped otherwise, saying why)."""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.k8s.node import can_create_namespaces

REPO = Path(__file__).resolve().parents[2]
TEST = "tests/integration/test_test_node.py::test_statefulset_pods_endpoints_dns_volumes"


@pytest.mark.timeout(300)
def test_node_tests_pass_from_a_checkout_under_tmp() -> None:
    reason = can_create_namespaces()
    if reason is not None:
        pytest.skip(reason)
    clone = Path(tempfile.mkdtemp(prefix="disagg-clone-", dir="/tmp"))
    try:
        shutil.copy(REPO / "pyproject.toml", clone)
        shutil.copytree(
            REPO / "tests", clone / "tests", ignore=shutil.ignore_patterns("__pycache__")
        )
        venv = clone / ".venv"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
        ours = next(p for p in site.getsitepackages() if p.startswith(sys.prefix))
        (Path(next(venv.glob("lib/python3*/site-packages"))) / "here.pth").write_text(
            f"import site; site.addsitedir({ours!r})\n"
        )
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        run = subprocess.run(
            [venv / "bin" / "python", "-m", "pytest", "-p", "no:cacheprovider", "-q", TEST],
            cwd=clone,
            env=env,
            capture_output=True,
            text=True,
            timeout=280,
        )
        assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
        assert "1 passed" in run.stdout
    finally:
        shutil.rmtree(clone, ignore_errors=True)
