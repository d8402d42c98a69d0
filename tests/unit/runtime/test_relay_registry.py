"""The relay kinds core declares and the backends the runtime registers are the same."""

from __future__ import annotations

import subprocess
import sys
from typing import get_args

import pytest

from disagg_core import relays
from disagg_core.spec import model
from disagg_runtime.relay import KINDS, RelayError, connect, registry


def test_core_and_runtime_list_the_same_kinds() -> None:
    assert set(registry.kinds()) == set(relays.CONCRETE) == set(KINDS)
    assert model.RELAYS == get_args(relays.RelayKind) == (relays.AUTO, *relays.CONCRETE)
    for kind in registry.kinds():
        backend = registry.backend(kind)
        assert backend.kind == kind and backend.info.name == kind


def test_unknown_kinds_are_errors_naming_the_known_ones() -> None:
    assert registry.find("carrier-pigeon") is None
    with pytest.raises(RelayError, match=r"unknown relay 'carrier-pigeon'; expected one of shm"):
        connect("carrier-pigeon", "tcp://127.0.0.1:1", key=b"k" * 32)
    with pytest.raises(RelayError, match="not declared"):
        registry.register("carrier-pigeon", "somewhere")


def test_backends_are_imported_on_first_use_only() -> None:
    code = (
        "import sys\n"
        "import disagg_runtime.relay as r\n"
        "assert 'disagg_runtime.relay.backends.cuda_ipc' not in sys.modules, 'eager'\n"
        "assert 'disagg_runtime.relay.backends.cuda_ipc.land' not in sys.modules, 'eager'\n"
        "assert 'disagg_runtime.relay.backends.nixl' not in sys.modules, 'eager'\n"
        "assert 'nixl' not in sys.modules, 'eager'\n"
        "r.registry.backend('cuda-ipc')\n"
        "assert 'disagg_runtime.relay.backends.cuda_ipc' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
