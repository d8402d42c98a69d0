"""A /dev/shm smaller than a pool (issue 30, item 5): start-up fails with the sizes named,
instead of a SIGBUS at the first write to a page the tmpfs never had. A real small tmpfs,
mounted in a private mount namespace (`unshare --mount`, needs root), is the /dev/shm of a
child process that creates the pool and writes every page."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent(
    """
    import sys
    from disagg_runtime.memory import pool
    pool.SHM_DIR = sys.argv[1]
    try:
        backing = pool.create_backing("shm", int(sys.argv[2]), name="disagg-test-reserve")
    except pool.PoolError as exc:
        print(exc)
        sys.exit(2)
    backing.tensor.fill_(1)  # every page: a SIGBUS here if the tmpfs has too few
    print("written", int(backing.tensor.sum()))
    backing.close()
    """
)
MiB = 1 << 20


def run_in_small_tmpfs(size_mib: int, pool_mib: int) -> subprocess.CompletedProcess[str]:
    script = (
        'set -e; d=$(mktemp -d); mount -t tmpfs -o size="$1" tmpfs "$d"; '
        'trap \'umount "$d"; rmdir "$d"\' EXIT; "$2" -c "$3" "$d" "$4"'
    )
    return subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            script,
            "sh",
            f"{size_mib}m",
            sys.executable,
            CHILD,
            str(pool_mib * MiB),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def can_mount() -> None:
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1)")
    probe = subprocess.run(
        ["unshare", "--mount", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a mount namespace here: {probe.stderr.strip()}")


def test_a_pool_larger_than_the_tmpfs_fails_at_creation_naming_the_sizes(can_mount: None) -> None:
    done = run_in_small_tmpfs(size_mib=4, pool_mib=8)
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert "8.0 MiB" in done.stdout and "4.0 MiB free" in done.stdout, done.stdout


def test_a_pool_that_fits_is_written_whole(can_mount: None) -> None:
    done = run_in_small_tmpfs(size_mib=8, pool_mib=4)
    assert done.returncode == 0, (done.stdout, done.stderr)
    assert f"written {4 * MiB}" in done.stdout
