"""`disagg up`: a DisaggregatedPipeline as local processes, with the contract pods get.

Every replica of every role is its own `disagg role` process on 127.0.0.1, given the same
`DISAGG_*` environment and topology file the operator renders (peers are explicit
addresses instead of Service names; `DISAGG_NODE_LOCAL=1`, so auto relays use shared
memory). The launcher watches its children: a role that dies fails the requests in
flight at once, and whatever way the run ends (done, Ctrl-C, a crash) every child is
stopped and no shared-memory segment of theirs is left behind. A launcher that cannot
clean up (SIGKILLed) leaves a run directory that says what it started: the next one
cleans up after it (local/rundir.py). Each run has its own random peer key
(relay/auth.py), in a 0600 file of the run directory that every role and the client read.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import IO, Any

from disagg_core import placement
from disagg_core.contract import (
    DEFAULT_RANK_PORT,
    ENV,
    Peer,
    RoleConfig,
    render_env,
    write_topology,
)
from disagg_core.spec import Pipeline
from disagg_runtime.client import Client
from disagg_runtime.local.ports import HOST, free_ports
from disagg_runtime.local.restarts import Restarts
from disagg_runtime.local.rundir import RunDir, log_tail, open_run
from disagg_runtime.memory.pool import SHM_DIR, SHM_PREFIX, reclaim_stale, shm_prefix
from disagg_runtime.relay import auth
from disagg_runtime.role.health import fetch, scrape
from disagg_runtime.routing import migration
from disagg_runtime.routing.peers import FILE_RESOLVE_EVERY, write_peers_file

log = logging.getLogger(__name__)
_PR_SET_PDEATHSIG = 1


def plan_local(
    pipeline: Pipeline,
    ports: Iterator[int],
    topology_file: str,
    replicas: dict[str, int] | None = None,
    peers_file: str = "",
) -> list[RoleConfig]:
    """One RoleConfig per replica: ports assigned, peers as explicit loopback addresses."""
    counts = {r.name: (replicas or {}).get(r.name, r.replicas) for r in pipeline.roles}
    assigned = {
        name: [(next(ports), next(ports)) for _ in range(max(1, n))] for name, n in counts.items()
    }
    addresses = {name: tuple(f"{HOST}:{p}" for p, _ in pairs) for name, pairs in assigned.items()}
    return [
        placement.role_config(
            pipeline,
            role.name,
            placement.Placement(
                namespace="",
                addresses=addresses,
                replica=index,
                ingress_port=ingress,
                lane_port=0,  # any free port: the ingress tells its senders which
                metrics_port=metrics,
                bind_host=HOST,
                node_local=True,
                topology_file=topology_file,
                peers_file=peers_file,
                rank_port=next(ports) if role.world_size > 1 else DEFAULT_RANK_PORT,
            ),
        )
        for role in pipeline.roles
        for index, (ingress, metrics) in enumerate(assigned[role.name])
    ]


def _die_with_parent(parent: int) -> None:
    """preexec: SIGTERM the child if the launcher itself is killed (Linux), also when it
    died before the prctl (the child was already orphaned)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


@dataclass
class RoleProcess:
    config: RoleConfig
    proc: subprocess.Popen[bytes]
    log_path: str
    ready: bool = True  # listed in the peers file
    stopping: bool = False
    started_at: float = field(default_factory=time.monotonic)

    @property
    def label(self) -> str:
        return f"{self.config.role}/{self.config.replica}"

    def log_tail(self, lines: int = 15) -> str:
        return log_tail(self.log_path, lines)


@dataclass
class LocalPipeline:
    """Start, watch and stop the role processes of one pipeline."""

    pipeline: Pipeline
    grace_s: float = 10.0
    dispatch: str = "load"  # DISAGG_DISPATCH of every role, and the client's
    on_death: Callable[[RoleProcess, int], None] | None = None
    processes: list[RoleProcess] = field(default_factory=list)
    deaths: list[str] = field(default_factory=list)
    restart: bool = False  # start a role process that died again (restarts.py), not fail
    restarts: Restarts = field(default_factory=Restarts)

    def __post_init__(self) -> None:
        self.run: RunDir = open_run(self.pipeline.name)  # every per-run file goes in here
        self._stop = threading.Event()
        self._monitor: threading.Thread | None = None
        self._ports = free_ports()
        self._scale_lock = threading.Lock()
        self.topology_file = os.path.join(self.workdir, "topology.json")
        self.peers_file = os.path.join(self.workdir, "peers.json")
        self.key = auth.new_key()  # this run's peer key: fresh every time, in the private run dir
        self.key_file = os.path.join(self.workdir, "peer-key")
        with open(os.open(self.key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(self.key)

    @property
    def workdir(self) -> str:
        """The run directory (topology, peers file, role logs, the run's record)."""
        return self.run.path

    def start(self) -> None:
        configs = plan_local(
            self.pipeline, self._ports, self.topology_file, peers_file=self.peers_file
        )
        write_topology(configs[0].topology, self.topology_file)
        for config in configs:
            self.processes.append(self._spawn(config))
        self._publish()
        self._monitor = threading.Thread(target=self._watch, name="disagg-up-watch", daemon=True)
        self._monitor.start()

    def live(self, role: str) -> list[RoleProcess]:
        """Replicas of `role` that are serving (not being stopped)."""
        return [rp for rp in self.processes if rp.config.role == role and not rp.stopping]

    def _publish(self) -> None:
        """Tell every role (and the client) which replicas to send to."""
        roles: dict[str, list[str]] = {r.name: [] for r in self.pipeline.roles}
        for rp in self.processes:
            if not rp.stopping and rp.ready:
                roles[rp.config.role].append(f"{HOST}:{rp.config.ingress_port}")
        write_peers_file(self.peers_file, roles)

    def scale(self, role: str, replicas: int, *, ready_timeout: float | None = None) -> None:
        """Start or stop replicas of `role` while requests flow. New replicas join the peers
        file once ready; leaving ones are taken out of it first, then drained by SIGTERM."""
        with self._scale_lock:
            current = self.live(role)
            if replicas > len(current):
                template = current[0].config if current else self._template(role)
                used = {rp.config.replica for rp in self.processes if rp.config.role == role}
                index = max(used, default=-1) + 1
                added = []
                for i in range(index, index + replicas - len(current)):
                    config = dataclasses.replace(
                        template,
                        replica=i,
                        ingress_port=next(self._ports),
                        metrics_port=next(self._ports),
                        rank_port=next(self._ports),
                    )
                    added.append(self._spawn(config, ready=False))
                self.processes.extend(added)
                self._wait(added, ready_timeout)
                for rp in added:
                    rp.ready = True
                self._publish()
            elif replicas < len(current):
                self._retire(sorted(current, key=lambda rp: rp.config.replica)[replicas:])

    def retire(self, leaving: list[RoleProcess]) -> None:
        """Stop these replicas while requests flow (a rollout replaces them one by one)."""
        with self._scale_lock:
            self._retire(leaving)

    def _retire(self, leaving: list[RoleProcess]) -> None:
        """Out of the peers file first (no new work), then drained by SIGTERM: what they
        cannot finish they hand back (routing/migration.py)."""
        for rp in leaving:
            rp.stopping = True
        self._publish()
        time.sleep(4 * FILE_RESOLVE_EVERY)  # senders re-read the file before we go
        self._terminate(leaving)

    def _template(self, role: str) -> RoleConfig:
        for rp in self.processes:
            if rp.config.role == role:
                return rp.config
        raise KeyError(f"no replica of role {role!r} was ever started")

    def _spawn(self, config: RoleConfig, *, ready: bool = True) -> RoleProcess:
        role = self.pipeline.role(config.role)
        config = dataclasses.replace(
            config,
            metrics_dump=os.path.join(self.workdir, f"{config.role}-{config.replica}.prom"),
            peer_key_file=self.key_file,
            dispatch=self.dispatch,
        )
        contract = {var.name for var in ENV}  # only ours: an inherited one is not rendered
        env = {k: v for k, v in os.environ.items() if k not in contract}
        env.update({e.name: e.value for e in role.env if e.value_from is None})
        env.update(render_env(config))
        env["PYTHONUNBUFFERED"] = "1"
        log_path = os.path.join(self.workdir, f"{config.role}-{config.replica}.log")
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "disagg_runtime.cli", "role"],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C reaches the launcher, which drains them
                preexec_fn=functools.partial(_die_with_parent, os.getpid()),
            )
        pools = shm_prefix(self.pipeline.name, f"{config.role}-{config.replica}")
        self.run.add_process(proc.pid, f"{config.role}/{config.replica}", f"{pools}{proc.pid}-")
        return RoleProcess(config, proc, log_path, ready=ready)

    def wait_ready(self, timeout: float | None = None) -> float:
        """Seconds until every replica answers /readyz; raises if one dies or time runs out."""
        return self._wait(list(self.processes), timeout)

    def _startup_limit(self, rp: RoleProcess, timeout: float | None) -> float:
        """`timeout` when given, else the role's startupSeconds: the time its startup probe
        allows a pod, so a slow model load gets the same grace locally as on a cluster."""
        if timeout is not None:
            return timeout
        return float(self.pipeline.role(rp.config.role).startup_seconds)

    def _wait(self, processes: list[RoleProcess], timeout: float | None) -> float:
        started = time.monotonic()
        limits = {id(rp): self._startup_limit(rp, timeout) for rp in processes}
        waiting = list(processes)
        while waiting:
            for rp in list(waiting):
                if rp.proc.poll() is not None:
                    raise RuntimeError(
                        f"role {rp.label} exited with code {rp.proc.returncode} while starting:\n"
                        + rp.log_tail()
                    )
                with contextlib.suppress(OSError):
                    status, _ = fetch(f"http://{HOST}:{rp.config.metrics_port}/readyz", 0.5)
                    if status == 200:
                        waiting.remove(rp)
            elapsed = time.monotonic() - started
            late = [rp for rp in waiting if elapsed > limits[id(rp)]]
            if late:
                names = ", ".join(f"{rp.label} ({limits[id(rp)]:.0f} s)" for rp in late)
                hint = "" if timeout is not None else " (the role's startupSeconds)"
                raise TimeoutError(f"roles not ready in time{hint}: {names}")
            if waiting:
                time.sleep(0.05)
        return time.monotonic() - started

    def client(self, timeout: float | None = None) -> Client:
        configs = [rp.config for rp in self.processes]
        topology = configs[0].topology
        self.run.add_segments(f"{shm_prefix(self.pipeline.name, 'client')}{os.getpid()}-")
        entries = [
            Peer(name, tuple(f"{HOST}:{c.ingress_port}" for c in configs if c.role == name))
            for name in topology.entry_roles
        ]
        return Client(
            entries,
            topology.exit_roles,
            pipeline=self.pipeline.name,
            entry_relay="shm",
            reply_relay="shm",
            timeout=timeout or self.pipeline.transport.request_timeout_seconds,
            peers_file=self.peers_file,
            key=self.key,
            dispatch=self.dispatch,
            hashed_roles=[r for r in topology.entry_roles if topology.roles[r].joins],
            migrate=migration.Policy.of(topology),
        )

    def metrics(self) -> dict[str, dict[str, float]]:
        """Every replica's samples, {"role/replica": samples}: scraped from live ones, read
        from the final dump of those that were scaled away."""
        out = {}
        for rp in self.processes:
            with contextlib.suppress(OSError, ValueError):
                if rp.proc.poll() is None:
                    status, body = fetch(f"http://{HOST}:{rp.config.metrics_port}/metrics", 2.0)
                    if status == 200:
                        out[rp.label] = scrape(body)
                elif rp.config.metrics_dump:
                    with open(rp.config.metrics_dump) as f:
                        out[rp.label] = scrape(f.read())
        return out

    def _watch(self) -> None:
        while not self._stop.wait(0.1):
            for rp in list(self.processes):
                code = rp.proc.poll()
                if code is not None and not rp.stopping:
                    rp.stopping = True  # report once
                    if self.restart:
                        self._down(rp, code)
                    else:
                        self.deaths.append(
                            f"{rp.label} (pid {rp.proc.pid}) exited with code {code}"
                        )
                    if self.on_death is not None:
                        self.on_death(rp, code)
            if self.restart:
                self._restart_due()

    # ---- restarts (restarts.py) ----------------------------------------------------------------
    def _down(self, rp: RoleProcess, code: int) -> None:
        """A replica died: out of the peers file at once, its pool freed, restart planned."""
        now = time.monotonic()
        rp.ready = False
        self._publish()
        remove_segments_of(rp.proc.pid)
        delay = self.restarts.died(rp.label, code, now=now, ran_s=now - rp.started_at)
        log.warning("role %s exited with code %d; restarting in %.1f s", rp.label, code, delay)

    def _restart_due(self) -> None:
        """Start the replicas whose back-off is over; list those that answer /readyz."""
        due = set(self.restarts.due(time.monotonic()))
        with self._scale_lock:
            for i, rp in enumerate(self.processes):
                if rp.label in due and rp.stopping and rp.proc.poll() is not None:
                    self.processes[i] = self._spawn(rp.config, ready=False)
            joining = [rp for rp in self.processes if not rp.ready and not rp.stopping]
            for rp in joining:
                with contextlib.suppress(OSError):
                    status, _ = fetch(f"http://{HOST}:{rp.config.metrics_port}/readyz", 0.2)
                    rp.ready = status == 200
            if any(rp.ready for rp in joining):
                self._publish()

    def degraded(self) -> str:
        """Why the pipeline cannot serve in full now ("" when it can): roles none of whose
        replicas is up (their restart is pending), else replicas down."""
        down = self.restarts.down()
        roles = [
            r.name for r in self.pipeline.roles if not any(rp.ready for rp in self.live(r.name))
        ]
        if roles:
            return f"no live replica of role {', '.join(roles)} (restarting: {', '.join(down)})"
        return ""

    def stop(self) -> None:
        """SIGTERM every child (they drain), SIGKILL after the grace period, clean /dev/shm.
        The work folder (topology, peers file, role logs) goes too, unless a role died:
        then its log is worth keeping (`workdir` says where)."""
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(timeout=2)
        self._terminate(self.processes)
        self.run.close(keep=bool(self.deaths), secrets=(os.path.basename(self.key_file),))

    def _terminate(self, processes: list[RoleProcess]) -> None:
        for rp in processes:
            rp.stopping = True
            if rp.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    rp.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for rp in processes:
            try:
                rp.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rp.proc.kill()
                rp.proc.wait(timeout=5)
            remove_segments_of(rp.proc.pid)

    def __enter__(self) -> LocalPipeline:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def remove_segments_of(pid: int) -> list[str]:
    """Unlink shared-memory pools a dead process left (names end in -<pid>-<n>); a live
    owner's (same pid in another PID namespace) stay."""
    prefixes = {
        name[: m.start() + 1] + f"{pid}-"
        for name in os.listdir(SHM_DIR)
        if name.startswith(SHM_PREFIX) and (m := re.search(rf"-{pid}-\d+$", name))
    }
    return [n for prefix in sorted(prefixes) for n in reclaim_stale(prefix, why=None)]


def dump_json(obj: Any, out: IO[str]) -> None:
    json.dump(obj, out, indent=2, sort_keys=True)
    out.write("\n")
