"""A process group SIGKILLed with its resource tracker leaves its POSIX shared memory
behind (as a vLLM engine's does); local/groupshm.py removes what the group mapped, and
keeps what a process outside the group still maps."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from disagg_runtime.local.groupshm import mapped_by_group, unlink_unmapped, wait_gone

# a leader and its spawned child, each mapping a SharedMemory the leader made: names on stdout
GROUP = textwrap.dedent(
    """
    import multiprocessing as mp, sys, time
    from multiprocessing import shared_memory

    def child(name):
        seg = shared_memory.SharedMemory(name=name)
        time.sleep(600)

    if __name__ == "__main__":
        mp.set_start_method("spawn")
        own = shared_memory.SharedMemory(create=True, size=1 << 20)
        both = shared_memory.SharedMemory(create=True, size=1 << 20)
        p = mp.Process(target=child, args=(both.name,))
        p.start()
        print(own.name, both.name, flush=True)
        time.sleep(600)
    """
)


def _mapped_eventually(pgid: int, names: list[str]) -> set[str]:
    deadline = time.monotonic() + 60
    while True:
        found = mapped_by_group(pgid)
        if all(f"/dev/shm/{n}" in found for n in names) or time.monotonic() > deadline:
            return found
        time.sleep(0.1)


def test_a_killed_groups_shared_memory_is_removed_and_a_live_users_is_kept() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", GROUP], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    outsider = None
    try:
        assert proc.stdout is not None
        own, both = proc.stdout.readline().split()
        found = _mapped_eventually(proc.pid, [own, both])
        assert {f"/dev/shm/{own}", f"/dev/shm/{both}"} <= found, found
        # a process outside the group maps `both` too: it must survive the cleanup
        outsider = subprocess.Popen(
            [sys.executable, "-c", "import sys, time\nfrom multiprocessing import shared_memory"
             "\nseg = shared_memory.SharedMemory(name=sys.argv[1])\nprint('ok', flush=True)"
             "\ntime.sleep(600)", both],
            stdout=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip
        assert outsider.stdout is not None and outsider.stdout.readline().strip() == "ok"
        os.killpg(proc.pid, signal.SIGKILL)  # the resource tracker too: nothing unlinks
        proc.wait(timeout=10)
        assert wait_gone(proc.pid, timeout=10)
        assert os.path.exists(f"/dev/shm/{own}")  # left behind, as an engine's is
        assert unlink_unmapped(found) == [f"/dev/shm/{own}"]
        assert not os.path.exists(f"/dev/shm/{own}")
        assert os.path.exists(f"/dev/shm/{both}")
        os.killpg(outsider.pid, signal.SIGKILL)  # its tracker too: it would unlink `both`
        outsider.wait(timeout=10)
        assert unlink_unmapped(found) == [f"/dev/shm/{both}"]
    finally:
        for p in (proc, outsider):
            if p is not None and p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        for name in locals().get("own", ""), locals().get("both", ""):
            if name and os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")
