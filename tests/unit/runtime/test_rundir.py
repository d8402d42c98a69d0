"""Run directories of `disagg up` (local/rundir.py): the record, the supervisor's lock, and
cleaning up after a run whose supervisor is gone, with real processes and real segments.

A supervisor's death is what the kernel does to it: its lock file descriptor closes. Here
that is `RunDir.close` skipped and the descriptor closed by hand (`kill`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from disagg_runtime.local.rundir import (
    KEEP_LOGS,
    KEPT,
    LOCK,
    RECORD,
    RunDir,
    open_run,
    reclaim_stale_runs,
    runs_root,
    start_time,
)
from disagg_runtime.memory.pool import SHM_DIR, MiB, reclaim_stale, shm_prefix


def kill(run: RunDir) -> None:
    """The supervisor dies: the kernel closes its descriptors, its lock goes."""
    assert run._lock_fd is not None
    os.close(run._lock_fd)
    run._lock_fd = None


def segment(name: str, size: int = MiB) -> str:
    """A segment nobody holds (what a killed owner leaves)."""
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, size)
    os.close(fd)
    return path


@pytest.fixture
def root(tmp_path: Path) -> str:
    path = tmp_path / "runs"
    path.mkdir(mode=0o700)
    return str(path)


@pytest.fixture
def orphan() -> Iterator[subprocess.Popen[bytes]]:
    """A process in its own session, as `disagg up` starts its roles."""
    proc = subprocess.Popen(["sleep", "600"], start_new_session=True)
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def test_a_run_directory_records_processes_and_goes_when_the_run_ends(
    root: str, orphan: subprocess.Popen[bytes]
) -> None:
    run = RunDir.create("my pipe/1", root)
    assert Path(run.path).parent == Path(root) and run.id.startswith("my_pipe_1-")
    run.add_process(orphan.pid, "a/0", "disagg-p-a-0-123-")
    run.add_segments("disagg-p-client-9-")
    run.add_segments("disagg-p-client-9-")
    record = json.loads(Path(run.file(RECORD)).read_text())
    assert record["supervisor"] == os.getpid()
    entry = {"pid": orphan.pid, "start": start_time(orphan.pid), "label": "a/0"}
    assert record["processes"] == [{**entry, "segments": "disagg-p-a-0-123-"}]
    assert record["segments"] == ["disagg-p-client-9-"]
    run.close()
    assert not os.path.exists(run.path)


def test_a_kept_run_directory_is_no_run_any_more(root: str) -> None:
    run = RunDir.create("p", root)
    Path(run.file("a-0.log")).write_text("the log worth keeping")
    run.close(keep=True)
    assert sorted(os.listdir(run.path)) == ["a-0.log", KEPT]
    assert not reclaim_stale_runs(root)
    assert os.path.exists(run.file("a-0.log"))


def test_a_failed_start_keeps_its_logs_not_its_key_and_old_ones_go(
    root: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 30, item 18: a run whose role died keeps its logs (and says where), not the
    pipeline's peer key; later runs keep only the newest KEEP_LOGS such folders."""
    kept = []
    for i in range(KEEP_LOGS + 2):
        run = RunDir.create("p", root)
        Path(run.file("peer-key")).write_bytes(b"k" * 32)
        Path(run.file("a-0.log")).write_text("why the role died")
        with caplog.at_level("WARNING"):
            run.close(keep=True, secrets=("peer-key",))
        assert run.path in caplog.text
        assert not os.path.exists(run.file("peer-key"))
        os.utime(run.file(KEPT), (1000.0 + i, 1000.0 + i))
        kept.append(os.path.basename(run.path))
    fresh = open_run("p", root)
    left = sorted(set(os.listdir(root)) - {fresh.id})
    assert left == sorted(kept[-KEEP_LOGS:])
    fresh.close()


def test_a_live_supervisors_run_is_left_alone(root: str, orphan: subprocess.Popen[bytes]) -> None:
    run = RunDir.create("p", root)
    run.add_process(orphan.pid, "a/0", "disagg-p-a-0-1-")
    try:
        assert not reclaim_stale_runs(root)  # the lock is held (by this very process)
        assert orphan.poll() is None
        assert os.path.exists(run.file(RECORD))
    finally:
        run.close()


def test_a_dead_supervisors_run_is_cleaned_up(
    root: str, orphan: subprocess.Popen[bytes], caplog: pytest.LogCaptureFixture
) -> None:
    run = RunDir.create("p", root)
    role_pools = f"{shm_prefix('rundirtest', 'a-0')}{orphan.pid}-"
    client_pools = f"{shm_prefix('rundirtest', 'client')}{os.getpid()}-"
    run.add_process(orphan.pid, "a/0", role_pools)
    run.add_segments(client_pools)
    paths = [segment(f"{role_pools}0"), segment(f"{client_pools}0", 4 * MiB)]
    try:
        kill(run)
        with caplog.at_level("WARNING", logger="disagg_runtime.local.rundir"):
            fresh = open_run("p", root)
        fresh.close()
        assert orphan.wait(timeout=10) == -signal.SIGKILL
        assert not any(os.path.exists(p) for p in paths)
        assert not os.path.exists(run.path)
        (line,) = [r.getMessage() for r in caplog.records]
        assert line == (
            f"disagg up: cleaned up after 1 killed run(s) ({run.id}): stopped 1 role "
            f"process(es) (a/0 (pid {orphan.pid})), removed 2 shared-memory segment(s) "
            "(5.0 MiB)"
        )
    finally:
        reclaim_stale(role_pools, why=None)
        reclaim_stale(client_pools, why=None)


def test_a_recycled_pid_is_not_killed(root: str, orphan: subprocess.Popen[bytes]) -> None:
    """The recorded pid now belongs to another process (another start time)."""
    run = RunDir.create("p", root)
    run.add_process(orphan.pid, "a/0", "disagg-p-a-0-1-")
    record = json.loads(Path(run.file(RECORD)).read_text())
    record["processes"][0]["start"] -= 1
    Path(run.file(RECORD)).write_text(json.dumps(record))
    kill(run)
    done = reclaim_stale_runs(root)
    assert done.runs == [run.id] and done.killed == []
    time.sleep(0.2)
    assert orphan.poll() is None


def test_a_run_killed_before_its_record_is_just_removed(root: str) -> None:
    path = Path(root) / "p-abc"
    path.mkdir()
    (path / LOCK).touch()
    assert reclaim_stale_runs(root).runs == ["p-abc"]
    assert not path.exists()


def test_the_root_must_be_private(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert runs_root() == str(tmp_path / "disagg-runs")
    assert os.stat(tmp_path / "disagg-runs").st_mode & 0o777 == 0o700
    os.chmod(tmp_path / "disagg-runs", 0o777)
    with pytest.raises(RuntimeError, match="open to other users"):
        runs_root()
    os.rmdir(tmp_path / "disagg-runs")
    os.symlink(tmp_path, tmp_path / "disagg-runs")
    with pytest.raises(RuntimeError, match="not a directory owned by this user"):
        runs_root()
