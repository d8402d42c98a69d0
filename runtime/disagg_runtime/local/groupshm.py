"""The /dev/shm files a process group maps, and their removal once the group is gone.

A vLLM server's engine core and workers create POSIX shared memory of their own (Python's
`SharedMemory`, `psm_*`, ~160-240 MiB each on CPU; multiprocessing semaphores, `sem.*`).
They rely on multiprocessing's resource tracker to unlink it, but the tracker is in the
server's process group, which a stop or a death ends with SIGKILL: measured here, every
`disagg up` of examples/vllm-pd.yaml left ~0.8 GiB in /dev/shm (host RAM) behind. So the
launcher reads what the group maps while it still lives (`mapped_by_group`), and after the
SIGKILL unlinks those files that no live process maps (`unlink_unmapped`). disagg's own
pools are reclaimed by their prefix (memory/pool.py) and are left out here.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable

SHM = "/dev/shm/"
DELETED = " (deleted)"


def shm_paths(maps: str, skip_prefix: str = "") -> set[str]:
    """The /dev/shm files in one /proc/PID/maps text (pure): mapped, not yet unlinked,
    not starting with `skip_prefix` (a name under /dev/shm)."""
    found: set[str] = set()
    for line in maps.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6:
            continue
        path = parts[5]
        if not path.startswith(SHM) or path.endswith(DELETED):
            continue
        name = path[len(SHM) :]
        if "/" in name or not name or (skip_prefix and name.startswith(skip_prefix)):
            continue
        found.add(path)
    return found


def _live_group(pid: str) -> int | None:
    """The process group of `pid`, None once it is a zombie (it maps nothing) or gone."""
    with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{pid}/stat") as f:
        state, _ppid, pgrp = f.read().rpartition(")")[2].split()[:3]
        return None if state in ("Z", "X") else int(pgrp)
    return None


def _maps(pid: str) -> str:
    with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as f:
        return f.read()
    return ""


def _pids() -> list[str]:
    return [p for p in os.listdir("/proc") if p.isdigit()]


def mapped_by_group(pgid: int, skip_prefix: str = "") -> set[str]:
    """The /dev/shm files the live processes of group `pgid` map now."""
    found: set[str] = set()
    for pid in _pids():
        if _live_group(pid) == pgid:
            found |= shm_paths(_maps(pid), skip_prefix)
    return found


def wait_gone(pgid: int, timeout: float) -> bool:
    """Wait until no process of group `pgid` is alive (a zombie maps nothing); False if
    one still is after `timeout` seconds (what it maps is then kept)."""
    deadline = time.monotonic() + timeout
    while any(_live_group(pid) == pgid for pid in _pids()):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def unlink_unmapped(paths: Iterable[str]) -> list[str]:
    """Unlink those of `paths` that still exist and that no live process maps (a file a
    process outside the dead group still uses is kept); returns what was removed."""
    wanted = {p for p in paths if os.path.exists(p)}
    if not wanted:
        return []
    for pid in _pids():
        wanted -= shm_paths(_maps(pid))
        if not wanted:
            return []
    removed = []
    for path in sorted(wanted):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
            removed.append(path)
    return removed
