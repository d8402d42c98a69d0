"""A role restarted in place, as in its pod: PID 1 of its own PID namespace (the image's
entrypoint), the same /dev/shm (an emptyDir outlives the container), SIGKILLed (an OOM
kill) and started again. Its pool's name is the same in every incarnation (pid 1), so the
second one meets the first one's segment: it must reclaim it and serve, and a second
live owner of the name must be refused, not robbed. In a pod that shares one PID namespace
(colocated roles) the restarted role has another pid, so another name: it must free the
dead incarnation's pool all the same, or each restart leaks a pool into the pod's memory.

The PID 1 tests need `unshare --pid --fork --mount-proc` (root, or user namespaces):
skipped with the reason when the machine refuses it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from disagg_core.contract import Peer, RoleConfig, render_env, write_topology
from disagg_core.spec import load_pipeline_file
from disagg_runtime.client import Client
from disagg_runtime.local.ports import free_ports
from disagg_runtime.local.rundir import start_time
from disagg_runtime.local.supervisor import plan_local
from disagg_runtime.memory.pool import SHM_DIR, reclaim_stale, shm_prefix
from disagg_runtime.role.health import fetch
from tests.relay_rig import KEY, write_key
from tests.support import wait_until

HERE = Path(__file__).resolve().parent
PIPELINE = load_pipeline_file(HERE / "pipelines" / "restart.yaml")
PREFIX = shm_prefix(PIPELINE.name, "solo-0")  # then <pid>-<n>: 1-0 for PID 1
NAME = f"{PREFIX}1-0"
WAIT = 60.0


def _unshare_refused() -> str | None:
    try:
        done = subprocess.run(
            ["unshare", "--pid", "--fork", "--mount-proc", "true"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unshare cannot run here: {exc}"
    if done.returncode != 0:
        return f"unshare --pid --mount-proc is not permitted here: {done.stderr.strip()}"
    return None


needs_unshare = pytest.mark.skipif(bool(_unshare_refused()), reason=str(_unshare_refused()))


def gone(pid: int) -> bool:
    return start_time(pid) is None


@dataclass
class Incarnation:
    """One `disagg role` run as PID 1 of a fresh PID and mount namespace."""

    proc: subprocess.Popen[bytes]  # the `unshare` process; the role is its only child
    config: RoleConfig
    log: Path
    namespaced: bool = True

    @property
    def role_pid(self) -> int:
        """The role's pid as seen from here (it is 1 inside its namespace)."""
        if not self.namespaced:
            return self.proc.pid
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text()
        return int(children.split()[0])

    def ready(self) -> bool:
        with contextlib.suppress(OSError):
            return fetch(f"http://127.0.0.1:{self.config.metrics_port}/readyz", 1.0)[0] == 200
        return False

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def start_role(tmp_path: Path) -> Iterator[Callable[..., Incarnation]]:
    """Start incarnations of role solo/0 (each on fresh ports, as PID 1 of a namespace
    unless `namespaced=False`); all gone afterwards."""
    topology_file = str(tmp_path / "topology.json")
    ports = free_ports()
    base = replace(
        plan_local(PIPELINE, ports, topology_file)[0], peer_key_file=write_key(str(tmp_path))
    )
    write_topology(base.topology, topology_file)
    started: list[Incarnation] = []

    def start(namespaced: bool = True) -> Incarnation:
        config = replace(base, ingress_port=next(ports), metrics_port=next(ports))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
        env.update(render_env(config))
        env["PYTHONUNBUFFERED"] = "1"
        log = tmp_path / f"role-{len(started)}.log"
        role = [sys.executable, "-m", "disagg_runtime.cli", "role"]
        unshare = ["unshare", "--pid", "--fork", "--mount-proc"] if namespaced else []
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [*unshare, *role],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        incarnation = Incarnation(proc, config, log, namespaced)
        started.append(incarnation)
        return incarnation

    yield start
    for inc in started:
        if inc.proc.poll() is None:
            pid = None
            with contextlib.suppress(OSError, IndexError, ValueError):
                pid = inc.role_pid
                os.kill(pid, signal.SIGKILL)
            inc.proc.kill()
            inc.proc.wait(timeout=30)
            if pid is not None:  # gone (or a zombie): its lock on the pool is released
                wait_until(functools.partial(gone, pid), timeout=WAIT, what=f"role pid {pid} gone")
    # pid 1 is always alive to the suite's leak check: leave nothing behind here
    reclaim_stale(PREFIX, why=None)
    assert not [n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX)]


def serve_one(config: RoleConfig) -> None:
    """One request through the role, its pool attached by name (shm both ways)."""
    client = Client(
        [Peer("solo", (f"127.0.0.1:{config.ingress_port}",))],
        ["solo"],
        pipeline=PIPELINE.name,
        entry_relay="shm",
        reply_relay="shm",
        pool_size=4 << 20,
        timeout=20,
        key=KEY,
    )
    try:
        out = client.submit({"x": torch.ones(64 * 1024), "factor": 3.0})
    finally:
        client.close()
    assert torch.equal(out["x"], torch.full((64 * 1024,), 3.0))


def segment_inode() -> int | None:
    with contextlib.suppress(FileNotFoundError):
        return os.stat(os.path.join(SHM_DIR, NAME)).st_ino
    return None


@needs_unshare
def test_role_as_pid_1_sigkilled_and_restarted_reclaims_its_pool_and_serves(
    start_role: Callable[..., Incarnation],
) -> None:
    first = start_role()
    wait_until(first.ready, timeout=WAIT, what=f"first incarnation ready:\n{first.output()}")
    stale = segment_inode()
    assert stale is not None, f"the role as PID 1 names its pool {NAME}"
    serve_one(first.config)

    os.kill(first.role_pid, signal.SIGKILL)  # an OOM kill: no drain, nothing unlinked
    first.proc.wait(timeout=30)
    assert segment_inode() == stale, "SIGKILL leaves the segment in /dev/shm"

    second = start_role()
    wait_until(
        lambda: second.ready() or second.proc.poll() is not None,
        timeout=WAIT,
        what=f"second incarnation ready:\n{second.output()}",
    )
    assert second.proc.poll() is None, f"the restarted role died:\n{second.output()}"
    assert "FileExistsError" not in second.output()
    assert f"reclaimed shared-memory pool {NAME}" in second.output()
    assert segment_inode() not in (None, stale)  # a fresh segment under the same name
    serve_one(second.config)

    os.kill(second.role_pid, signal.SIGTERM)  # a clean stop drains and unlinks
    assert second.proc.wait(timeout=60) == 0, second.output()
    assert segment_inode() is None


@needs_unshare
def test_live_owner_of_the_name_is_not_robbed(start_role: Callable[..., Incarnation]) -> None:
    """Two live PID 1s with the same pool name (same pipeline, role, replica) on one
    /dev/shm: the second refuses to start, naming the owner; the first keeps serving."""
    owner = start_role()
    wait_until(owner.ready, timeout=WAIT, what=f"owner ready:\n{owner.output()}")
    inode = segment_inode()

    intruder = start_role()
    assert intruder.proc.wait(timeout=WAIT) == 2, intruder.output()
    out = intruder.output()
    assert "cannot start role" in out and NAME in out and "owner is alive" in out, out
    assert "pid 1 in its own PID namespace" in out, out  # all it can see of the owner
    assert segment_inode() == inode
    assert owner.ready()
    serve_one(owner.config)


def test_restart_with_another_pid_frees_the_dead_incarnations_pool(
    start_role: Callable[..., Incarnation],
) -> None:
    """Colocated roles share the pod's PID namespace: a restarted role has a new pid and a
    new name, and the old pool (whose owner is dead) would stay in the pod's memory."""
    # another pid's name, no lock held: what a dead incarnation leaves (the pid named is
    # this test's, so that other test runs on the machine leave the segment alone)
    stale = os.path.join(SHM_DIR, f"{PREFIX}{os.getpid()}-0")
    fd = os.open(stale, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 8 << 20)
    os.close(fd)
    try:
        role = start_role(namespaced=False)
        wait_until(
            lambda: role.ready() or role.proc.poll() is not None, timeout=WAIT, what="role ready"
        )
        assert role.proc.poll() is None, role.output()
        assert not os.path.exists(stale)
        assert f"reclaimed shared-memory pool {os.path.basename(stale)}" in role.output()
        serve_one(role.config)
        role.proc.send_signal(signal.SIGTERM)
        assert role.proc.wait(timeout=60) == 0, role.output()
        assert not reclaim_stale(PREFIX, why=None)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(stale)
