"""`disagg up` for engine roles: every replica a vLLM server on 127.0.0.1, supervised.

Each replica is `python -m vllm.entrypoints.openai.api_server` (contract/engine.py builds
its argv) run by the vLLM env's interpreter (`engine_python`), in its own process group
(its engine core and workers are children: a stop reaches them all), its log in the run
directory (local/rundir.py: a launcher that was SIGKILLed is cleaned up after by the next
one). A decode replica's KV connector listens on a port of its own; every prefill replica
is told the decode replicas' endpoints (`decodes`) and the run's peer key file. Ready is
the engine's /health answering 200. With `restart` (`--serve`), a replica that dies is
started again after restarts.py's back-off, on the same ports (so the prefill replicas'
`decodes` stay right), and is routed to again once healthy.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import pathlib
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from disagg_core.contract import ENV, EngineEndpoint, EngineLaunch, engine_command, replica_endpoint
from disagg_core.spec import Pipeline
from disagg_runtime.gateway.engines import EngineReplica
from disagg_runtime.local.groupshm import mapped_by_group, unlink_unmapped, wait_gone
from disagg_runtime.local.ports import HOST, free_ports
from disagg_runtime.local.restarts import Restarts
from disagg_runtime.local.rundir import RunDir, log_tail, open_run
from disagg_runtime.local.supervisor import _die_with_parent
from disagg_runtime.memory.pool import SHM_PREFIX, reclaim_stale, shm_prefix
from disagg_runtime.relay import auth
from disagg_runtime.role.health import fetch

log = logging.getLogger(__name__)
PYTHON_ENV = "DISAGG_VLLM_PYTHON"  # the vLLM env's interpreter (make venv-vllm)
VENV = ".venv-vllm"
SOURCE_ROOT = pathlib.Path(__file__).resolve().parents[3]  # an editable install's checkout


def engine_python(explicit: str = "") -> str:
    """The interpreter that runs engines: `explicit`, else $DISAGG_VLLM_PYTHON, else
    .venv-vllm/bin/python here or in disagg's checkout; a clear error when none exists."""
    given = explicit or os.environ.get(PYTHON_ENV, "")
    candidates = (
        [given]
        if given
        else [
            os.path.join(os.getcwd(), VENV, "bin", "python"),
            str(SOURCE_ROOT / VENV / "bin" / "python"),
        ]
    )
    for path in candidates:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    where = given or " or ".join(candidates)
    raise RuntimeError(
        f"no vLLM interpreter at {where}: run `make venv-vllm`, or set {PYTHON_ENV} "
        "(or --engine-python) to a python that imports vllm"
    )


def plan_engines(
    pipeline: Pipeline, ports: Iterator[int], key_file: str, host: str = HOST
) -> list[tuple[str, int, EngineLaunch, EngineEndpoint]]:
    """(role, replica, launch, endpoint) of every engine replica: ports assigned, each
    replica's endpoint (what the gateway routes to: contract.replica_endpoint, as on
    Kubernetes), the decode replicas' KV endpoints handed to the prefill replicas that send
    to them (pure)."""
    planned: dict[str, list[tuple[EngineLaunch, EngineEndpoint]]] = {}
    consumers_first = sorted(
        pipeline.engine_roles, key=lambda name: pipeline.kv_role(name) != "kv_consumer"
    )
    for name in consumers_first:
        role = pipeline.role(name)
        decodes = tuple(
            endpoint.kv_endpoint
            for target in pipeline.kv_targets(name)
            for _, endpoint in planned[target]
        )
        planned[name] = []
        for index in range(max(1, role.replicas)):
            port, kv_port = next(ports), next(ports)  # kv_port unused by a prefill replica
            endpoint = replica_endpoint(
                pipeline, name, index, host=host, port=port, kv_port=kv_port
            )
            launch = EngineLaunch(
                name=f"{name}-{index}",
                host=host,
                port=port,
                key_file=key_file,
                kv_listen=endpoint.kv_endpoint,  # here the bound address is the reached one
                decodes=decodes,
            )
            planned[name].append((launch, endpoint))
    return [
        (name, index, launch, endpoint)
        for name in pipeline.engine_roles
        for index, (launch, endpoint) in enumerate(planned[name])
    ]


@dataclass
class EngineProcess:
    role: str
    replica: int
    launch: EngineLaunch
    endpoint: EngineEndpoint  # what the gateway routes to
    argv: list[str]
    log_path: str
    proc: subprocess.Popen[bytes] | None = None
    ready: bool = False
    stopping: bool = False
    started_at: float = field(default_factory=time.monotonic)
    shm: set[str] = field(default_factory=set)  # /dev/shm files its group was seen to map

    @property
    def label(self) -> str:
        return f"{self.role}/{self.replica}"

    @property
    def url(self) -> str:
        return f"http://{self.launch.host}:{self.launch.port}"

    def as_replica(self) -> EngineReplica:
        return self.endpoint

    def log_tail(self, lines: int = 30) -> str:
        return log_tail(self.log_path, lines)


@dataclass
class LocalEngines:
    """Start, watch and stop the engine replicas of one pipeline."""

    pipeline: Pipeline
    python: str
    grace_s: float = 30.0
    restart: bool = False
    on_death: Callable[[EngineProcess, int], None] | None = None
    processes: list[EngineProcess] = field(default_factory=list)
    deaths: list[str] = field(default_factory=list)
    restarts: Restarts = field(default_factory=Restarts)

    def __post_init__(self) -> None:
        self.run: RunDir = open_run(self.pipeline.name)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._monitor: threading.Thread | None = None
        self.key_file = os.path.join(self.run.path, "peer-key")
        with open(os.open(self.key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(auth.new_key())

    @property
    def workdir(self) -> str:
        return self.run.path

    def start(self) -> None:
        self._ports = free_ports()  # claimed while this launcher lives (local/ports.py)
        plan = plan_engines(self.pipeline, self._ports, self.key_file)
        for role, index, launch, endpoint in plan:
            argv = engine_command(self.pipeline, role, launch, python=self.python)
            log_path = os.path.join(self.workdir, f"{role}-{index}.log")
            process = EngineProcess(role, index, launch, endpoint, argv, log_path)
            self._spawn(process)
            self.processes.append(process)
        self._monitor = threading.Thread(target=self._watch, name="disagg-engines", daemon=True)
        self._monitor.start()

    def _spawn(self, process: EngineProcess) -> None:
        role = self.pipeline.role(process.role)
        contract = {var.name for var in ENV}
        env = {k: v for k, v in os.environ.items() if k not in contract}
        env.update({e.name: e.value for e in role.env if e.value_from is None})
        env["PYTHONUNBUFFERED"] = "1"
        with open(process.log_path, "ab") as out:
            process.proc = subprocess.Popen(
                process.argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group: the engine's children stop with it
                preexec_fn=functools.partial(_die_with_parent, os.getpid()),
            )
        process.ready = False
        process.stopping = False
        process.started_at = time.monotonic()
        segments = shm_prefix(self.pipeline.name, process.launch.name)
        self.run.add_process(process.proc.pid, process.label, segments)

    def replicas(self, role: str) -> list[EngineReplica]:
        """The role's replicas that are healthy now (what the gateway routes to)."""
        return [
            p.as_replica() for p in self.processes if p.role == role and p.ready and not p.stopping
        ]

    def wait_ready(self, timeout: float | None = None) -> float:
        """Seconds until every replica's /health answers 200 (each within its role's
        startupSeconds, or `timeout`); raises if one exits or is late."""
        started = time.monotonic()
        waiting = list(self.processes)
        roles = self.pipeline.engine_roles
        limit = timeout or max(self.pipeline.role(r).startup_seconds for r in roles)
        while waiting:
            for p in list(waiting):
                assert p.proc is not None
                if p.proc.poll() is not None:
                    raise RuntimeError(
                        f"engine {p.label} exited with code {p.proc.returncode} while "
                        f"starting (log {p.log_path}):\n{p.log_tail()}"
                    )
                if self._healthy(p):
                    p.ready = True
                    waiting.remove(p)
            if waiting and time.monotonic() - started > limit:
                names = ", ".join(p.label for p in waiting)
                raise TimeoutError(f"engines not ready in {limit:.0f} s: {names}")
            if waiting:
                time.sleep(0.25)
        return time.monotonic() - started

    def _healthy(self, p: EngineProcess) -> bool:
        with contextlib.suppress(OSError):
            status, _ = fetch(p.url + "/health", 1.0)
            return status == 200
        return False

    def degraded(self) -> str:
        """Why the engines cannot serve in full ("" when they can)."""
        roles = [r for r in self.pipeline.engine_roles if not self.replicas(r)]
        if roles:
            down = ", ".join(self.restarts.down()) or "starting"
            return f"no ready replica of engine role {', '.join(roles)} (restarting: {down})"
        return ""

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            with self._lock:
                for p in self.processes:
                    assert p.proc is not None
                    code = p.proc.poll()
                    if code is not None and not p.stopping:
                        self._died(p, code)
                    elif self.restart and not p.stopping and not p.ready and code is None:
                        p.ready = self._healthy(p)  # a restarted replica joins once healthy
                if self.restart:
                    due = set(self.restarts.due(time.monotonic()))
                    for p in self.processes:
                        if p.label in due and p.stopping and not self._stop.is_set():
                            self._spawn(p)

    def _died(self, p: EngineProcess, code: int) -> None:
        assert p.proc is not None
        p.stopping, p.ready = True, False
        self._end(p)  # what the server left (engine core, workers)
        if self.restart:
            now = time.monotonic()
            delay = self.restarts.died(p.label, code, now=now, ran_s=now - p.started_at)
            log.warning("engine %s exited with code %d; restarting in %.1f s", p.label, code, delay)
        else:
            self.deaths.append(f"{p.label} (pid {p.proc.pid}) exited with code {code}")
        if self.on_death is not None:
            self.on_death(p, code)

    def _end(self, p: EngineProcess) -> None:
        """SIGKILL the replica's group, then free its shared memory: its pool (by prefix)
        and what the engine's own processes mapped (local/groupshm.py: their resource
        tracker dies with them)."""
        assert p.proc is not None
        p.shm |= mapped_by_group(p.proc.pid, skip_prefix=SHM_PREFIX)
        _kill_group(p.proc.pid, signal.SIGKILL)
        if wait_gone(p.proc.pid, timeout=5.0):
            removed = unlink_unmapped(p.shm)
            if removed:
                log.info("engine %s: removed %d /dev/shm files it left", p.label, len(removed))
        p.shm = set()
        with contextlib.suppress(OSError, ValueError):
            reclaim_stale(shm_prefix(self.pipeline.name, p.launch.name), why=None)

    def stop(self) -> None:
        """SIGTERM every engine's group, SIGKILL after the grace period, free their shared
        memory, close the run directory (kept, for its logs, if an engine died)."""
        self._stop.set()
        if self._monitor is not None:
            self._monitor.join(timeout=2)
        with self._lock:
            live = [p for p in self.processes if p.proc is not None]
            for p in live:
                p.stopping = True
                assert p.proc is not None
                p.shm |= mapped_by_group(p.proc.pid, skip_prefix=SHM_PREFIX)
                _kill_group(p.proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + self.grace_s
            for p in live:
                assert p.proc is not None
                try:
                    p.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.proc.kill()
                    p.proc.wait(timeout=5)
                self._end(p)  # children that outlived the server
        self.run.close(keep=bool(self.deaths), secrets=(os.path.basename(self.key_file),))

    def __enter__(self) -> LocalEngines:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _kill_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
