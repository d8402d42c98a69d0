"""Run directories: every file of one `disagg up` run in one place, written down so that
the next run cleans up after one that was SIGKILLed.

Where: `$XDG_RUNTIME_DIR/disagg-runs/<run-id>/` (per user, mode 0700, a tmpfs emptied at
logout and reboot: the same lifetime as the pids and segments it names), else
`/tmp/disagg-runs-<uid>/<run-id>/`, created 0700 and refused unless it is this user's and
private (nobody else may plant a record there that makes us kill or unlink).

What: `run.json` (the record), `supervisor.lock`, and the run's own files (topology, peers
file, role logs, metric dumps, the run's key). The record names the supervisor's pid,
every role process by pid and start time (so a recycled pid is never killed) and the
shared-memory prefixes their pools' names start with (the client's pool too).

Liveness: the supervisor holds an flock on `supervisor.lock` while it lives; the kernel
drops it when the process dies, however it dies. `reclaim_stale_runs` takes that lock
(which also keeps two cleaners apart), stops the role processes the record names that are
still running (their process groups, SIGKILL), unlinks their segments whose owner is gone
and removes the directory. A run stopped cleanly removes its directory itself; one that
keeps role logs (a role died) drops its record and lock, so it is not a run any more.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from disagg_runtime.memory.pool import MiB, reclaim_stale

RECORD = "run.json"
LOCK = "supervisor.lock"
KEPT = "kept-logs"  # marks a run directory kept for its logs (no record, no lock)
KEEP_LOGS = 5  # kept run directories left by `open_run`: the newest; older ones go
log = logging.getLogger(__name__)


def runs_root() -> str:
    """This user's folder of run directories (created private on first use)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR", "")
    if runtime and os.path.isdir(runtime):
        root = os.path.join(runtime, "disagg-runs")
    else:
        root = os.path.join(tempfile.gettempdir(), f"disagg-runs-{os.getuid()}")
    with contextlib.suppress(FileExistsError):
        os.mkdir(root, 0o700)
    st = os.lstat(root)
    if not os.path.isdir(root) or os.path.islink(root) or st.st_uid != os.getuid():
        raise RuntimeError(f"run directory root {root} is not a directory owned by this user")
    if st.st_mode & 0o077:
        mode = f"0o{st.st_mode & 0o777:o}"
        raise RuntimeError(f"run directory root {root} is open to other users (mode {mode})")
    return root


def start_time(pid: int) -> int | None:
    """When `pid` started (clock ticks since boot), None once it is gone: reaped, or a
    zombie whose other threads have exited too (until then they may still hold its files,
    and so the locks on its pools)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        if fields[0] in ("Z", "X") and os.listdir(f"/proc/{pid}/task") == [str(pid)]:
            return None
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(fields[19])


def _boot_id() -> str:
    with contextlib.suppress(OSError), open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()
    return ""


@dataclass
class RunDir:
    """One run's directory, owned (locked) by this process until `close`."""

    path: str
    record: dict[str, Any] = field(default_factory=dict)
    _lock_fd: int | None = None

    @classmethod
    def create(cls, pipeline: str, root: str | None = None) -> RunDir:
        """A fresh run directory for `pipeline` under `root` (default `runs_root()`)."""
        root = root or runs_root()
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", pipeline)[:40]
        path = tempfile.mkdtemp(prefix=f"{safe}-", dir=root)
        fd = os.open(os.path.join(path, LOCK), os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        run = cls(path, _lock_fd=fd)
        run.record = {
            "pipeline": pipeline,
            "supervisor": os.getpid(),
            "boot": _boot_id(),
            "processes": [],
            "segments": [],
        }
        run._save()
        return run

    @property
    def id(self) -> str:
        return os.path.basename(self.path)

    def file(self, name: str) -> str:
        """Path of a per-run file."""
        return os.path.join(self.path, name)

    def add_process(self, pid: int, label: str, segments: str) -> None:
        """Record a child: pid, start time, and the prefix of its pools' names."""
        entry = {"pid": pid, "start": start_time(pid), "label": label, "segments": segments}
        self.record["processes"].append(entry)
        self._save()

    def add_segments(self, prefix: str) -> None:
        """Record a prefix of shared-memory names this process creates (its client pool)."""
        if prefix not in self.record["segments"]:
            self.record["segments"].append(prefix)
            self._save()

    def _save(self) -> None:
        tmp = self.file(RECORD + ".tmp")
        with open(tmp, "w") as f:
            json.dump(self.record, f)
        os.replace(tmp, self.file(RECORD))  # a reader sees the old record or the new one

    def close(self, *, keep: bool = False, secrets: tuple[str, ...] = ()) -> None:
        """The run is over: remove the directory, or (`keep`) only its record, its lock and
        its `secrets` (the run's peer key: the logs are what is worth keeping), mark it
        KEPT and say where it is; `open_run` removes all but the newest KEEP_LOGS."""
        if keep:
            for name in (RECORD, LOCK, *secrets):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.file(name))
            with open(self.file(KEPT), "w") as f:
                f.write("a role died: its log is here; `disagg up` removes old ones\n")
            log.warning(
                "disagg up: a role died; the run's logs are kept in %s (remove it when done; "
                "later runs keep the newest %d such folders)",
                self.path,
                KEEP_LOGS,
            )
        else:
            shutil.rmtree(self.path, ignore_errors=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


@dataclass
class Reclaimed:
    """What `reclaim_stale_runs` cleaned up."""

    runs: list[str] = field(default_factory=list)
    killed: list[str] = field(default_factory=list)
    segments: list[str] = field(default_factory=list)
    nbytes: int = 0
    left: list[str] = field(default_factory=list)  # still alive after SIGKILL (D state?)

    def __bool__(self) -> bool:
        return bool(self.runs)

    def summary(self) -> str:
        text = (
            f"cleaned up after {len(self.runs)} killed run(s) ({', '.join(self.runs)}): "
            f"stopped {len(self.killed)} role process(es)"
            + (f" ({', '.join(self.killed)})" if self.killed else "")
            + f", removed {len(self.segments)} shared-memory segment(s) "
            f"({self.nbytes / MiB:.1f} MiB)"
        )
        return text + (f"; still running: {', '.join(self.left)}" if self.left else "")


def reclaim_stale_runs(root: str | None = None, *, wait_s: float = 5.0) -> Reclaimed:
    """Clean up every run under `root` whose supervisor is gone (see the module doc)."""
    root = root or runs_root()
    done = Reclaimed()
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        try:
            fd = os.open(os.path.join(path, LOCK), os.O_RDWR | os.O_NOFOLLOW)
        except (FileNotFoundError, NotADirectoryError):
            continue  # not a run (kept logs) or one being created this instant
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its supervisor is alive
            _reclaim(path, done, wait_s)
        finally:
            os.close(fd)
    return done


def _reclaim(path: str, done: Reclaimed, wait_s: float) -> None:
    try:
        with open(os.path.join(path, RECORD)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        record = {}  # killed before its first record was written: nothing was started
    same_boot = record.get("boot") == _boot_id()
    prefixes = [str(p) for p in record.get("segments", [])]
    victims = []
    for proc in record.get("processes", []):
        prefixes.append(str(proc["segments"]))
        pid, label = int(proc["pid"]), f"{proc['label']} (pid {proc['pid']})"
        if same_boot and proc["start"] is not None and start_time(pid) == proc["start"]:
            with contextlib.suppress(ProcessLookupError):
                if os.getpgid(pid) == pid:  # its own group (start_new_session): its children too
                    os.killpg(pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
            victims.append((pid, proc["start"], label))
            done.killed.append(label)
    deadline = time.monotonic() + wait_s
    while any(start_time(p) == s for p, s, _ in victims) and time.monotonic() < deadline:
        time.sleep(0.05)
    done.left += [label for p, s, label in victims if start_time(p) == s]
    for prefix in prefixes:
        removed = reclaim_stale(prefix, why=None)
        done.segments += removed
        done.nbytes += sum(removed.values())
    done.runs.append(os.path.basename(path))
    shutil.rmtree(path, ignore_errors=True)


def prune_kept(root: str, keep: int = KEEP_LOGS) -> list[str]:
    """Remove the run directories kept for their logs, all but the newest `keep`."""
    kept = []
    for name in os.listdir(root):
        marker = os.path.join(root, name, KEPT)
        with contextlib.suppress(OSError):
            kept.append((os.lstat(marker).st_mtime, name))
    gone = [name for _, name in sorted(kept, reverse=True)[keep:]]
    for name in gone:
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    return gone


def log_tail(path: str, lines: int) -> str:
    """The last `lines` lines of a process's log in the run directory ("" if unreadable)."""
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        return "".join(f.readlines()[-lines:])
    return ""


def open_run(pipeline: str, root: str | None = None) -> RunDir:
    """Clean up after runs whose supervisor was killed (one log line) and old kept logs,
    then start a run."""
    root = root or runs_root()
    reclaimed = reclaim_stale_runs(root)
    if reclaimed:
        log.warning("disagg up: %s", reclaimed.summary())
    gone = prune_kept(root)
    if gone:
        log.info("disagg up: removed %d old kept run folder(s): %s", len(gone), ", ".join(gone))
    return RunDir.create(pipeline, root)
