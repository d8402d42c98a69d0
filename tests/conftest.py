"""Suite-wide guards: nothing we create may outlive the tests in /dev/shm.

Segment names end in `-<pid>-<n>` (pool.shm_name). A segment is leaked when the process
that made it is gone (or is this test process, which closes its pools): live segments of
other processes on the machine (another test run, a running `disagg up`) are not ours to
judge or remove. Gone means both: the owner's flock on the segment is free (pool.py,
"Ownership") and its pid is dead here, ours, or 1 (a role run as PID 1 of its own PID
namespace, as test_restart.py does: the host's pid 1 never owns a pool)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
from collections.abc import Iterator

import pytest

from tests.relay_rig import Rig

pytest_plugins = ["tests.k8s.fixtures"]  # the Kubernetes API emulator (tests/k8s/)

SHM_DIR = "/dev/shm"
SHM_PREFIX = "disagg-"


def _our_segments() -> set[str]:
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX)}
    except FileNotFoundError:
        return set()


def _locked(name: str) -> bool:
    """Whether a live process holds the owner's flock on the segment."""
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # drops our probe's lock
    return False


def _owner_alive(name: str) -> bool:
    if _locked(name):
        return True
    match = re.search(r"-(\d+)-\d+$", name)
    if match is None:
        return False
    pid = int(match.group(1))
    if pid in (os.getpid(), 1):
        return False  # this process must have closed its own pools by now
    return os.path.exists(f"/proc/{pid}")


@pytest.fixture(scope="session", autouse=True)
def no_shm_leaks() -> Iterator[None]:
    before = _our_segments()
    yield
    leaked = {n for n in _our_segments() - before if not _owner_alive(n)}
    for name in leaked:  # clean up so one failure does not cascade into later runs
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name))
    assert not leaked, f"shared-memory segments leaked by the suite: {sorted(leaked)}"


@pytest.fixture
def rig() -> Iterator[Rig]:
    """Relay test rig (tests/relay_rig.py): everything it made is closed after the test."""
    r = Rig()
    try:
        yield r
    finally:
        r.close()
