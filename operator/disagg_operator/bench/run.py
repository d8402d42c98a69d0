"""`disagg bench operator`: how fast the operator turns pipelines into their children, and how
much memory it needs, against a real API server (a cluster, kind, or any API server).

    disagg bench operator [--kubeconfig PATH] [--samples 20] [--pipelines 100] [--json]
                          [--namespace NS] [--external-operator] [--file PIPELINE.yaml]
                          [--timeout 120] [--operator-log PATH] [--check]

In order (what it creates is removed at the end, also after a failure or ^C):

1. CRD: created from `crd.crd()` when the API server lacks it, and awaited until
   Established; deleted at the end only if the bench created it.
2. Namespace: a fresh `disagg-bench-<run>` (deleted at the end), or `--namespace NS`, which
   must exist and is kept (only the bench's pipelines are deleted there).
3. Operator: `python -m disagg_runtime.cli operator --standalone --namespace NS` as a child
   process with `KUBECONFIG`, until its /healthz answers, then one warm-up pipeline (not
   measured). `--external-operator` starts none and measures whichever operator watches NS
   (e.g. the Helm release); there is no RSS then.
4. Latency: `--samples` times in a row, one pipeline (by default the spec of
   examples/text-to-video.yaml: 3 roles, 8 children) is created. One sample is the time
   from just before the create request until the last child the planner says it should
   have has been seen (p50, p90, max). Before the next sample the bench also waits for its
   status (`observedGeneration`).
5. Burst: `--pipelines` pipelines are created concurrently. `reconciled_s` is the time from
   the first create request until every one of them is reconciled: all planned children
   seen and `status.observedGeneration == metadata.generation`.
6. Memory: the operator's VmRSS after start-up and after the burst, and VmHWM (the peak
   resident set) at the end, from /proc/PID/status. Also the ERROR lines in its log (it
   runs with --log-level=warning; `--operator-log PATH` keeps the log).

The bench observes through watches (a list, then a watch from the list's resourceVersion),
so it puts no polling load on the API server or the operator; "seen" is when the watch event
reaches the bench. The pipelines carry the label `disagg.dev/bench-run=<run>`.

Targets (issue 4): p50 <= 1 s, 100 pipelines within 60 s, operator RSS < 200 MiB. On a cluster
where an operator already watches the namespace (a cluster-wide Helm release), both reconcile
the bench's pipelines; measure that one with `--external-operator`, or scale it down.

Credentials: the kubeconfig's current context with a token, token file, client certificate,
basic auth or an exec plugin (e.g. cloud CLIs); the operator child reads the same file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import math
import os
import pathlib
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, TextIO

import aiohttp
import kopf
import yaml

from disagg_core import spec
from disagg_core.spec.fields import SpecError
from disagg_operator import apply, crd, names, planner
from disagg_operator.bench import kubeconfig

Json = dict[str, Any]
Key = tuple[str, str]  # (kind, name) of a child
Handler = Callable[[str, Json, float], None]  # (event type, object, when seen)

TARGET_P50_S: Final = 1.0
TARGET_BURST_S: Final = 60.0
TARGET_RSS_MIB: Final = 200.0
LABEL_RUN: Final = f"{names.GROUP}/bench-run"
CRD_PATH: Final = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{names.CRD_NAME}"
NAMESPACES_PATH: Final = "/api/v1/namespaces"
MIB: Final = 1024 * 1024
WATCH_SECONDS: Final = 300  # the server ends a watch after this; the bench resumes it
STOP_GRACE: Final = 20.0  # seconds the operator gets to stop on SIGTERM
RETRY: Final = 0.2  # seconds between tries while the API server catches up (a new CRD)

# The spec of examples/text-to-video.yaml (the package does not ship examples/; the bench's
# integration test keeps the two equal).
TEXT_TO_VIDEO_SPEC: Final = """
image: ghcr.io/disagg/runtime:0.1.0
transport: {relay: auto, poolSize: 256Mi, minBlock: 1Mi, poolDevice: cpu, requestTimeoutSeconds: 60}
roles:
  - name: encoder
    handler: disagg_runtime.demo:encode_text
    replicas: 1
    concurrency: 4
    resources: {requests: {cpu: "1", memory: 2Gi}, limits: {memory: 4Gi}}
  - name: denoiser
    handler: disagg_runtime.demo:denoise
    replicas: 2
    concurrency: 2
    transport: {poolSize: 512Mi}
    autoscaling:
      minReplicas: 1
      maxReplicas: 4
      targetPoolOccupancy: 0.6
      scaleUpStabilizationSeconds: 0
      scaleDownStabilizationSeconds: 120
      tolerance: 0.1
    resources: {requests: {cpu: "2", memory: 4Gi}, limits: {memory: 8Gi}}
  - name: decoder
    handler: disagg_runtime.demo:decode_video
    replicas: 1
    concurrency: 4
    resources: {requests: {cpu: "1", memory: 2Gi}, limits: {memory: 4Gi}}
edges:
  - from: encoder
    to: denoiser
    tensorRefs: [{path: text_embedding, to: decoder}]
  - {from: denoiser, to: decoder}
ratioLocks:
  - {leader: denoiser, follower: decoder, leaderShare: 4, followerShare: 1, tolerance: 0.5}
"""


def text_to_video_spec() -> Json:
    """A fresh copy of the default pipeline's spec."""
    return dict(yaml.safe_load(TEXT_TO_VIDEO_SPEC))


class BenchError(Exception):
    """The bench could not measure (no API server, the operator died, a timeout, ...)."""


class WaitTimeout(BenchError):
    """Something the bench waited for did not happen in time."""


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    kubeconfig: str  # a path, or several joined by os.pathsep (as in KUBECONFIG)
    samples: int = 20
    pipelines: int = 100
    namespace: str | None = None  # None: a fresh namespace, deleted at the end
    external_operator: bool = False
    spec: Json = field(default_factory=text_to_video_spec)
    timeout: float = 120.0  # seconds for any one wait
    operator_log: str | None = None
    python: str = sys.executable


# ---------------------------------------------------------------------------- pure parts


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks; None without values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def pipeline_doc(name: str, namespace: str, run: str, pipeline_spec: Mapping[str, Any]) -> Json:
    return {
        "apiVersion": names.PIPELINE_API_VERSION,
        "kind": names.PIPELINE_KIND,
        "metadata": {"name": name, "namespace": namespace, "labels": {LABEL_RUN: run}},
        "spec": copy.deepcopy(dict(pipeline_spec)),
    }


def expected_children(doc: Mapping[str, Any], namespace: str) -> frozenset[Key]:
    """(kind, name) of every object the operator plans for `doc` (raises SpecError)."""
    pipeline = spec.parse_pipeline(copy.deepcopy(dict(doc)))
    objects = planner.plan(pipeline, namespace=namespace)
    return frozenset((o["kind"], o["metadata"]["name"]) for o in objects)


def child_kinds(expected: Iterable[Key]) -> list[tuple[str, str]]:
    """(apiVersion, kind) to watch: the planner's kinds that the plan uses."""
    used = {kind for kind, _ in expected}
    return [(version, kind) for version, kind in planner.child_kinds() if kind in used]


def targets_met(result: Mapping[str, Any]) -> dict[str, bool | None]:
    """Each target: met, missed, or None when not measured."""
    p50 = (result.get("latency") or {}).get("p50_s")
    burst = result.get("burst") or {}
    rss = (result.get("operator") or {}).get("rss_peak_mib")
    reconciled = burst.get("reconciled_s") if burst.get("complete") else None
    return {
        "latency_p50": None if p50 is None else p50 <= TARGET_P50_S,
        "burst_reconciled": (
            None if not burst.get("pipelines") else (reconciled or math.inf) <= TARGET_BURST_S
        ),
        "rss_peak": None if rss is None else rss < TARGET_RSS_MIB,
    }


def format_table(result: Mapping[str, Any]) -> str:
    """The human-readable report."""
    latency = result.get("latency") or {}
    burst = result.get("burst") or {}
    operator = result.get("operator") or {}
    met = result.get("met") or {}
    cleanup = result.get("cleanup") or {}

    def secs(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f} s"

    def mib(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f} MiB"

    def verdict(key: str) -> str:
        return {True: "ok", False: "MISSED", None: ""}[met.get(key)]

    n = burst.get("pipelines", 0)
    rows = [
        ("metric", "value", "target", ""),
        (
            f"one pipeline, children present p50 (n={latency.get('samples', 0)})",
            secs(latency.get("p50_s")),
            f"<= {TARGET_P50_S:g} s",
            verdict("latency_p50"),
        ),
        ("one pipeline, children present p90", secs(latency.get("p90_s")), "", ""),
        ("one pipeline, children present max", secs(latency.get("max_s")), "", ""),
        (f"{n} pipelines at once, all children present", secs(burst.get("children_s")), "", ""),
        (
            f"{n} pipelines at once, all reconciled",
            secs(burst.get("reconciled_s")),
            f"<= {TARGET_BURST_S:g} s",
            verdict("burst_reconciled"),
        ),
        ("operator RSS after start-up", mib(operator.get("rss_idle_mib")), "", ""),
        ("operator RSS after the burst", mib(operator.get("rss_after_burst_mib")), "", ""),
        (
            "operator peak RSS (VmHWM)",
            mib(operator.get("rss_peak_mib")),
            f"< {TARGET_RSS_MIB:g} MiB",
            verdict("rss_peak"),
        ),
        ("operator ERROR lines logged", str(operator.get("errors_logged", "-")), "", ""),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = [
        f"disagg bench operator: {result.get('server')} (Kubernetes "
        f"{result.get('kubernetes_version')}), namespace {result.get('namespace')}",
        f"pipeline: {result.get('roles')} roles, {result.get('children_per_pipeline')} children"
        + ("" if operator.get("managed") else "; operator: external (not measured)"),
        "",
    ]
    lines += [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]
    if burst.get("pipelines") and not burst.get("complete"):
        lines.append(f"burst incomplete: {burst.get('reconciled')}/{n} reconciled in time")
    lines.append(
        "cleanup: "
        + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in cleanup.items() if v is not None)
    )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- credentials


def load_connection(path: str) -> kopf.ConnectionInfo:
    """`kubeconfig.load_connection`, its errors as BenchError."""
    try:
        return kubeconfig.load_connection(path)
    except kubeconfig.KubeconfigError as error:
        raise BenchError(str(error)) from error


# ---------------------------------------------------------------------------- observing


class Observer:
    """Watches the pipelines of one run and the children in one namespace; records when
    each child was first seen and when each pipeline's status caught up with its spec."""

    def __init__(self, connection: kopf.ConnectionInfo, namespace: str, run: str) -> None:
        self.connection = connection
        self.namespace = namespace
        self.run = run
        self.children: dict[Key, float] = {}  # first seen (monotonic), while present
        self.owners: dict[Key, str] = {}  # the child's disagg.dev/pipeline label
        self.pipelines: set[str] = set()
        self.reconciled: dict[str, float] = {}  # status.observedGeneration >= generation
        self._changed = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None
        self.failure: BaseException | None = None

    async def start(self, kinds: Sequence[tuple[str, str]], timeout: float) -> None:
        """Start the watches; returns once each has listed what exists."""
        info = self.connection
        self._session = session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=info.as_ssl_context()),
            headers={"User-Agent": "disagg-bench", **info.as_http_headers()},
            proxy=info.proxy_url,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
            read_bufsize=1 << 22,
        )
        pipelines = apply.collection_path(
            names.PIPELINE_API_VERSION, names.PIPELINE_KIND, self.namespace
        )
        streams: list[tuple[str, str, Handler]] = [
            (pipelines, f"{LABEL_RUN}={self.run}", self._pipeline_event)
        ]
        for version, kind in kinds:
            path = apply.collection_path(version, kind, self.namespace)
            streams.append((path, names.LABEL_PIPELINE, self._child_event(kind)))
        listed = [asyncio.Event() for _ in streams]
        for (path, selector, handle), ready in zip(streams, listed, strict=True):
            task = asyncio.create_task(self._follow(session, path, selector, handle, ready))
            self._tasks.append(task)
        await self.until(lambda: all(r.is_set() for r in listed), timeout, "the watches to start")

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def until(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.failure is not None:
                raise BenchError(f"watching failed: {self.failure}") from self.failure
            left = deadline - time.monotonic()
            if left <= 0:
                raise WaitTimeout(f"timed out after {timeout:g} s waiting for {what}")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=min(left, 1.0))

    def done_at(self, name: str, expected: Iterable[Key]) -> float | None:
        """When `name` was complete: every child seen and its status caught up."""
        children = self.children_at(expected)
        status = self.reconciled.get(name)
        return None if children is None or status is None else max(children, status)

    def children_at(self, expected: Iterable[Key]) -> float | None:
        """When the last of `expected` was first seen (None: one is missing)."""
        seen = [self.children.get(key) for key in expected]
        return None if None in seen else max(s for s in seen if s is not None)

    def left_of(self, pipelines: Iterable[str]) -> tuple[int, int]:
        """(pipelines, children) of these pipelines that still exist."""
        wanted = set(pipelines)
        kids = sum(1 for owner in self.owners.values() if owner in wanted)
        return len(self.pipelines & wanted), kids

    # ------------------------------------------------------------------ streams

    def _pipeline_event(self, type_: str, obj: Json, now: float) -> None:
        meta = obj.get("metadata") or {}
        name = str(meta.get("name"))
        if type_ == "DELETED":
            self.pipelines.discard(name)
            self.reconciled.pop(name, None)
            return
        self.pipelines.add(name)
        observed = (obj.get("status") or {}).get("observedGeneration")
        generation = meta.get("generation")
        if observed is not None and generation is not None and observed >= generation:
            self.reconciled.setdefault(name, now)

    def _child_event(self, kind: str) -> Handler:
        def handle(type_: str, obj: Json, now: float) -> None:
            meta = obj.get("metadata") or {}
            key = (kind, str(meta.get("name")))
            if type_ == "DELETED":
                self.children.pop(key, None)
                self.owners.pop(key, None)
                return
            self.children.setdefault(key, now)
            self.owners[key] = str((meta.get("labels") or {}).get(names.LABEL_PIPELINE))

        return handle

    async def _follow(
        self,
        session: aiohttp.ClientSession,
        path: str,
        selector: str,
        handle: Handler,
        listed: asyncio.Event,
    ) -> None:
        """List, then watch from the list's resourceVersion; again after a 410 Gone."""
        server = self.connection.server.rstrip("/")
        version: str | None = None
        try:
            while True:
                if version is None:
                    page = await _get_json(session, server + path, {"labelSelector": selector})
                    now = time.monotonic()
                    for item in page.get("items") or []:
                        handle("ADDED", item, now)
                    version = str((page.get("metadata") or {}).get("resourceVersion") or "")
                    listed.set()
                    self._bump()
                version = await self._watch(session, server + path, selector, version, handle)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            self.failure = error
            self._bump()

    async def _watch(
        self,
        session: aiohttp.ClientSession,
        url: str,
        selector: str,
        version: str,
        handle: Handler,
    ) -> str | None:
        """One watch request; returns where to resume (None: list again)."""
        params = {
            "watch": "true",
            "labelSelector": selector,
            "resourceVersion": version,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_SECONDS),
        }
        try:
            async with session.get(url, params=params) as response:
                if response.status == 410:
                    return None
                if response.status >= 400:
                    text = await response.text()
                    raise BenchError(f"watch {url}: {response.status} {text[:300]}")
                async for line in response.content:
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    type_, obj = event.get("type"), event.get("object") or {}
                    if type_ == "ERROR":
                        if obj.get("code") == 410:
                            return None
                        raise BenchError(f"watch {url}: {obj.get('message')}")
                    version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                    if type_ != "BOOKMARK":
                        handle(str(type_), obj, time.monotonic())
                        self._bump()
        except (aiohttp.ClientError, TimeoutError):
            await asyncio.sleep(RETRY)  # the stream broke: resume where it was
        return version

    def _bump(self) -> None:
        self._changed.set()


async def _get_json(session: aiohttp.ClientSession, url: str, params: Mapping[str, str]) -> Json:
    async with session.get(url, params=params) as response:
        text = await response.text()
        if response.status >= 400:
            raise BenchError(f"GET {url}: {response.status} {text[:300]}")
        return dict(json.loads(text))


# ---------------------------------------------------------------------------- the operator


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def memory_mib(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM of a process in MiB (empty where /proc does not tell)."""
    found: dict[str, float] = {}
    with contextlib.suppress(OSError):
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                found[key] = int(value.split()[0]) * 1024 / MIB  # kB
    return found


class OperatorProcess:
    """`disagg operator` for one namespace, as a child process."""

    def __init__(self, config: BenchConfig, namespace: str) -> None:
        self.port = free_port()
        self.argv = [
            config.python,
            "-m",
            "disagg_runtime.cli",
            "operator",
            "--standalone",
            f"--namespace={namespace}",
            f"--liveness-port={self.port}",
            "--metrics-port=0",
            "--log-level=warning",
        ]
        self.env = {**os.environ, "KUBECONFIG": config.kubeconfig}
        for variable in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
            self.env.pop(variable, None)  # the kubeconfig, not an in-cluster account
        if config.operator_log:
            self.log_path = pathlib.Path(config.operator_log)
        else:
            fd, name = tempfile.mkstemp(prefix="disagg-bench-operator-", suffix=".log")
            os.close(fd)
            self.log_path = pathlib.Path(name)
        self.keep_log = config.operator_log is not None
        self._log: TextIO | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.errors_logged = 0  # ERROR lines in its log (known after stop)

    def start(self) -> None:
        self._log = self.log_path.open("w")
        # its own session: a ^C at the terminal reaches the bench, which deletes its pipelines
        # while the operator still runs, then stops it
        self.process = subprocess.Popen(
            self.argv, env=self.env, stdout=self._log, stderr=self._log, start_new_session=True
        )

    async def healthy(self, timeout: float) -> None:
        """Until /healthz answers 200 (BenchError if the process ends or time runs out)."""
        url = f"http://127.0.0.1:{self.port}/healthz"
        deadline = time.monotonic() + timeout
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while True:
                self.check()
                with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                    async with session.get(url) as response:
                        if response.status == 200:
                            return
                if time.monotonic() > deadline:
                    raise BenchError(f"the operator was not healthy within {timeout:g} s")
                await asyncio.sleep(RETRY)

    def check(self) -> None:
        if self.process is not None and self.process.poll() is not None:
            raise BenchError(
                f"the operator exited with {self.process.returncode}:\n{self.log_tail()}"
            )

    def memory(self) -> dict[str, float]:
        return {} if self.process is None else memory_mib(self.process.pid)

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text().splitlines()[-lines:])
        return ""

    async def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after STOP_GRACE; the exit status."""
        process = self.process
        code: int | None = None
        if process is not None:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    await asyncio.to_thread(process.wait, STOP_GRACE)
                except subprocess.TimeoutExpired:
                    process.kill()
                    await asyncio.to_thread(process.wait)
            code = process.returncode
        if self._log is not None:
            self._log.close()
        with contextlib.suppress(OSError):
            text = self.log_path.read_text(errors="replace")
            self.errors_logged = sum(" ERROR " in line for line in text.splitlines())
        if not self.keep_log:
            self.log_path.unlink(missing_ok=True)
        return code


# ---------------------------------------------------------------------------- the run


class Bench:
    """One run: set up, measure, clean up (see the module docstring)."""

    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self.run_id = secrets.token_hex(3)
        self.connection = load_connection(config.kubeconfig)
        self.api = apply.Api(self.connection)
        self.namespace = config.namespace or f"disagg-bench-{self.run_id}"
        self.created_namespace = False
        self.created_crd = False
        self.created: list[str] = []  # pipeline names
        self.observer: Observer | None = None
        self.operator: OperatorProcess | None = None
        self.result: Json = {"server": self.connection.server, "namespace": self.namespace}

    async def measure(self) -> Json:
        """Run everything; the result dict (cleanup included), or BenchError after cleanup."""
        try:
            await self._measure()
        finally:
            await self._cleanup()
        self.result["met"] = targets_met(self.result)
        return self.result

    async def _measure(self) -> None:
        config = self.config
        version = await self._api(self.api.request("GET", "/version"), "reach the API server")
        self.result["kubernetes_version"] = version.get("gitVersion")
        expected = expected_children(self._doc("probe"), self.namespace)
        self.result["roles"] = len(config.spec.get("roles") or [])
        self.result["children_per_pipeline"] = len(expected)
        await self._ensure_crd()
        await self._ensure_namespace()
        self.observer = Observer(self.connection, self.namespace, self.run_id)
        await self.observer.start(child_kinds(expected), config.timeout)
        operator: Json = {"managed": not config.external_operator}
        self.result["operator"] = operator
        if not config.external_operator:
            self.operator = OperatorProcess(config, self.namespace)
            started = time.monotonic()
            self.operator.start()
            await self.operator.healthy(config.timeout)
            operator["startup_s"] = time.monotonic() - started
        await self._one(f"bench-{self.run_id}-warm", "the warm-up pipeline")
        operator["rss_idle_mib"] = self._memory().get("VmRSS")
        values = [
            await self._one(f"bench-{self.run_id}-l{i}", f"latency sample {i}")
            for i in range(config.samples)
        ]
        self.result["latency"] = {
            "samples": len(values),
            "p50_s": percentile(values, 50),
            "p90_s": percentile(values, 90),
            "max_s": max(values, default=None),
            "values_s": values,
        }
        self.result["burst"] = await self._burst(config.pipelines)
        operator["rss_after_burst_mib"] = self._memory().get("VmRSS")

    async def _one(self, name: str, what: str) -> float:
        """Create one pipeline; seconds until its children are present (then waits for its
        status as well)."""
        observer = self.observer
        assert observer is not None
        doc = self._doc(name)
        expected = expected_children(doc, self.namespace)
        started = time.monotonic()
        await self._create(doc)
        await observer.until(
            lambda: self._alive() and observer.done_at(name, expected) is not None,
            self.config.timeout,
            f"{what} ({name}) to be reconciled",
        )
        present = observer.children_at(expected)
        assert present is not None
        return present - started

    async def _burst(self, count: int) -> Json:
        observer = self.observer
        assert observer is not None
        docs = [self._doc(f"bench-{self.run_id}-{i}") for i in range(count)]
        expected = {d["metadata"]["name"]: expected_children(d, self.namespace) for d in docs}
        started = time.monotonic()
        await asyncio.gather(*(self._create(doc) for doc in docs))
        created = time.monotonic() - started

        def finished() -> list[float]:
            return [t for n, e in expected.items() if (t := observer.done_at(n, e)) is not None]

        timed_out = False
        try:
            await observer.until(
                lambda: self._alive() and len(finished()) == count,
                self.config.timeout,
                f"{count} pipelines",
            )
        except WaitTimeout:
            timed_out = True
        done = [t - started for t in finished()]
        present = [observer.children_at(e) for e in expected.values()]
        complete = not timed_out and len(done) == count
        return {
            "pipelines": count,
            "created_s": created,
            "children_s": (
                max(t for t in present if t is not None) - started
                if present and None not in present
                else None
            ),
            "reconciled_s": max(done) if complete and done else None,
            "reconciled": len(done),
            "per_pipeline_p50_s": percentile(done, 50),
            "per_pipeline_p90_s": percentile(done, 90),
            "complete": complete,
        }

    # ------------------------------------------------------------------ set-up

    async def _ensure_crd(self) -> None:
        existing = await self._get(CRD_PATH)
        if existing is None:
            body = crd.crd()
            collection = CRD_PATH.rsplit("/", 1)[0]
            await self._api(self.api.request("POST", collection, body=body), "create the CRD")
            self.created_crd = True

        async def established() -> bool:
            got = await self._get(CRD_PATH) or {}
            conditions = (got.get("status") or {}).get("conditions") or []
            return any(
                c.get("type") == "Established" and c.get("status") == "True" for c in conditions
            )

        await self._poll(established, "the CRD to be Established")

    async def _ensure_namespace(self) -> None:
        path = f"{NAMESPACES_PATH}/{self.namespace}"
        if self.config.namespace is not None:
            if await self._get(path) is None:
                raise BenchError(f"namespace {self.namespace} does not exist")
            return
        body = {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": self.namespace, "labels": {LABEL_RUN: self.run_id}},
        }
        await self._api(self.api.request("POST", NAMESPACES_PATH, body=body), "create namespace")
        self.created_namespace = True

    # ------------------------------------------------------------------ clean-up

    async def _cleanup(self) -> None:
        """Delete what the run created; record what is left in result["cleanup"]."""
        report: Json = {}
        self.result["cleanup"] = report
        try:
            await self._delete_pipelines(report)
        finally:
            if self.operator is not None:
                # VmHWM just before the operator stops: the peak of the whole run
                peak = self.operator.memory().get("VmHWM")
                self.result.setdefault("operator", {})["rss_peak_mib"] = peak
                report["operator_exit"] = await self.operator.stop()
                self.result["operator"]["errors_logged"] = self.operator.errors_logged
            if self.observer is not None:
                await self.observer.close()
            with contextlib.suppress(BenchError):
                if self.created_namespace:
                    path = f"{NAMESPACES_PATH}/{self.namespace}"
                    report["namespace_deleted"] = await self._delete_and_wait(path)
                if self.created_crd:
                    report["crd_deleted"] = await self._delete_and_wait(CRD_PATH)
            await self.api.close()

    async def _delete_pipelines(self, report: Json) -> None:
        if not self.created:
            report["pipelines_left"] = report["children_left"] = 0
            return
        path = apply.collection_path(
            names.PIPELINE_API_VERSION, names.PIPELINE_KIND, self.namespace
        )
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"}
        params = {"labelSelector": f"{LABEL_RUN}={self.run_id}"}
        await self._api(self.api.request("DELETE", path, params=params, body=body), "delete")
        observer = self.observer
        if observer is None or observer.failure is not None:
            return
        with contextlib.suppress(BenchError):
            await observer.until(
                lambda: observer.left_of(self.created) == (0, 0),
                self.config.timeout,
                "the pipelines and their children to be deleted",
            )
        report["pipelines_left"], report["children_left"] = observer.left_of(self.created)

    async def _delete_and_wait(self, path: str) -> bool:
        """Delete the object at `path`; whether it was gone before the timeout."""
        with contextlib.suppress(apply.ApiError):
            await self.api.request("DELETE", path)

        async def gone() -> bool:
            return await self._get(path) is None

        try:
            await self._poll(gone, f"{path} to be deleted")
        except BenchError:
            return False
        return True

    # ------------------------------------------------------------------ helpers

    def _doc(self, name: str) -> Json:
        return pipeline_doc(name, self.namespace, self.run_id, self.config.spec)

    async def _create(self, doc: Json) -> None:
        """Create a pipeline; retried while the API server does not serve the CRD yet."""
        name = doc["metadata"]["name"]
        path = apply.collection_path(
            names.PIPELINE_API_VERSION, names.PIPELINE_KIND, self.namespace
        )
        deadline = time.monotonic() + self.config.timeout
        while True:
            try:
                await self.api.request("POST", path, body=doc)
            except apply.ApiError as error:
                waiting = error.status in (404, 429) or error.status >= 500
                if waiting and time.monotonic() < deadline:
                    await asyncio.sleep(RETRY)
                    continue
                raise BenchError(f"cannot create pipeline {name}: {error}") from error
            self.created.append(name)
            return

    async def _get(self, path: str) -> Json | None:
        try:
            return await self.api.request("GET", path)
        except apply.ApiError as error:
            if error.status == 404:
                return None
            raise BenchError(str(error)) from error

    async def _api(self, request: Awaitable[Json], what: str) -> Json:
        try:
            return await request
        except apply.ApiError as error:
            raise BenchError(f"cannot {what}: {error}") from error

    async def _poll(self, check: Callable[[], Awaitable[bool]], what: str) -> None:
        deadline = time.monotonic() + self.config.timeout
        while not await check():
            if time.monotonic() > deadline:
                raise BenchError(f"timed out after {self.config.timeout:g} s waiting for {what}")
            await asyncio.sleep(RETRY)

    def _memory(self) -> dict[str, float]:
        return {} if self.operator is None else self.operator.memory()

    def _alive(self) -> bool:
        """True, or BenchError when the operator process has ended."""
        if self.operator is not None:
            self.operator.check()
        return True


async def run(config: BenchConfig) -> Json:
    """Measure (see the module docstring); the result as a JSON-ready dict."""
    return await Bench(config).measure()


# ---------------------------------------------------------------------------- command line


def default_kubeconfig() -> str | None:
    """$KUBECONFIG, else ~/.kube/config if it exists."""
    if os.environ.get("KUBECONFIG"):
        return os.environ["KUBECONFIG"]
    home = pathlib.Path("~/.kube/config").expanduser()
    return str(home) if home.exists() else None


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """BenchConfig from `disagg bench operator` arguments (BenchError when they are wrong)."""
    config_path = args.kubeconfig or default_kubeconfig()
    if not config_path:
        raise BenchError("no kubeconfig: pass --kubeconfig PATH or set KUBECONFIG")
    if args.samples < 0 or args.pipelines < 0 or args.timeout <= 0:
        raise BenchError("--samples and --pipelines must be >= 0, --timeout > 0")
    pipeline_spec = text_to_video_spec()
    if args.file:
        try:
            doc = yaml.safe_load(pathlib.Path(args.file).read_text())
        except (OSError, yaml.YAMLError) as error:
            raise BenchError(f"cannot read {args.file}: {error}") from error
        if not isinstance(doc, dict) or not isinstance(doc.get("spec"), dict):
            raise BenchError(f"{args.file}: not a DisaggregatedPipeline")
        pipeline_spec = doc["spec"]
    try:
        expected_children(pipeline_doc("probe", "default", "probe", pipeline_spec), "default")
    except SpecError as error:
        raise BenchError(f"invalid pipeline: {error}") from error
    return BenchConfig(
        kubeconfig=config_path,
        samples=args.samples,
        pipelines=args.pipelines,
        namespace=args.namespace,
        external_operator=args.external_operator,
        spec=pipeline_spec,
        timeout=args.timeout,
        operator_log=args.operator_log,
    )


def run_cli(args: argparse.Namespace) -> int:
    """`disagg bench operator`: 0 when measured (with --check: and every target met), 1 when
    the run failed or the burst did not finish, 2 for bad arguments."""
    try:
        config = config_from_args(args)
    except BenchError as error:
        print(f"disagg bench operator: {error}", file=sys.stderr)
        return 2
    try:
        result = asyncio.run(run(config))
    except BenchError as error:
        print(f"disagg bench operator: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("disagg bench operator: interrupted (cleaned up)", file=sys.stderr)
        return 130
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    if result.get("burst", {}).get("pipelines") and not result["burst"].get("complete"):
        return 1
    if args.check and False in result["met"].values():
        return 1
    return 0
