"""GPU tests: every test here is marked `gpu` and skipped where CUDA is not available.

`tests/gpu/run_gpu_checks.sh` runs them on a GPU machine with `--confcutdir=tests/gpu`
(the suite-wide conftest pulls in the Kubernetes emulator, whose packages a bare GPU
image lacks), so the /dev/shm guard of tests/conftest.py is repeated here.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
SHM_DIR = "/dev/shm"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if HERE in Path(str(item.path)).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)


def _ours() -> set[str]:
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith("disagg-gputest")}
    except FileNotFoundError:
        return set()


@pytest.fixture(scope="session", autouse=True)
def no_gpu_test_shm_leaks() -> Iterator[None]:
    before = _ours()
    yield
    leaked = _ours() - before
    for name in leaked:
        os.unlink(os.path.join(SHM_DIR, name))
    assert not leaked, f"shared-memory segments leaked by the GPU tests: {sorted(leaked)}"
