"""`disagg bench operator`: how fast the operator turns pipelines into their children, and how
much memory it needs, against a real API server (a cluster, kind, or any API server).

    disagg bench operator [--kubeconfig PATH] [--samples 20] [--pipelines 100] [--json]
                          [--namespace NS] [--external-operator] [--file PIPELINE.yaml]
                          [--timeout 120] [--steady 30] [--cleanup-timeout 600]
                          [--operator-log PATH] [--check]

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
7. API cost (`measure`): the operator's request counters before and after the burst
   (requests per pipeline) and over `--steady` seconds after it (requests per minute, with
   nothing changing); CPU of the operator and of the API server over the burst, as a share
   of one core (the server's where its /metrics tells: the project's emulator does).

When a phase fails, what was measured so far is still reported (with `error` and
`failed_phase`), after the clean-up, and the exit status is 1. The clean-up (`cleanup`)
waits up to `--cleanup-timeout` seconds, printing progress to stderr.

The bench observes through watches (a list, then a watch from the list's resourceVersion),
so it puts no polling load on the API server or the operator; "seen" is when the watch event
reaches the bench. The pipelines carry the label `disagg.dev/bench-run=<run>`.

Targets (issues 4 and 20): p50 <= 1 s, a burst within 60 s, operator RSS < 200 MiB for up
to 100 pipelines and < 250 MiB beyond. On a cluster
where an operator already watches the namespace (a cluster-wide Helm release), both reconcile
the bench's pipelines; measure that one with `--external-operator`, or scale it down.

Credentials: the kubeconfig's current context with a token, token file, client certificate,
basic auth or an exec plugin (e.g. cloud CLIs); the operator child reads the same file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import secrets
import sys
import time
from collections.abc import Awaitable, Callable

import kopf
import yaml

from disagg_core.spec import SpecError
from disagg_operator import names
from disagg_operator.bench import cleanup, kubeconfig
from disagg_operator.bench import measure as metering
from disagg_operator.bench.config import RETRY, BenchConfig, BenchError, WaitTimeout
from disagg_operator.bench.measure import percentile
from disagg_operator.bench.observe import Observer
from disagg_operator.bench.process import OperatorProcess
from disagg_operator.bench.report import format_table, targets_met
from disagg_operator.bench.workload import (
    LABEL_RUN,
    Json,
    child_kinds,
    expected_children,
    pipeline_doc,
    text_to_video_spec,
)
from disagg_operator.gen import crd
from disagg_operator.k8s import client as kube

__all__ = [
    "LABEL_RUN",
    "BenchConfig",
    "BenchError",
    "child_kinds",
    "expected_children",
    "format_table",
    "load_connection",
    "percentile",
    "pipeline_doc",
    "run",
    "run_cli",
    "targets_met",
    "text_to_video_spec",
]
USER_AGENT = "disagg-bench"


def load_connection(path: str) -> kopf.ConnectionInfo:
    """`kubeconfig.load_connection`, its errors as BenchError."""
    try:
        return kubeconfig.load_connection(path)
    except kubeconfig.KubeconfigError as error:
        raise BenchError(str(error)) from error


class Bench:
    """One run: set up, measure, clean up (see the module docstring)."""

    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self.run_id = secrets.token_hex(3)
        self.connection = load_connection(config.kubeconfig)
        self.api = kube.Api(self.connection, user_agent=USER_AGENT)
        self.namespace = config.namespace or f"disagg-bench-{self.run_id}"
        self.created_namespace = False
        self.created_crd = False
        self.created: list[str] = []  # pipeline names
        self.observer: Observer | None = None
        self.operator: OperatorProcess | None = None
        self.phase = "set-up"
        self.result: Json = {"server": self.connection.server, "namespace": self.namespace}

    async def measure(self) -> Json:
        """Run everything; the result dict (clean-up included). A phase that fails ends the
        measuring: the result then holds `error` and `failed_phase`, and what came before."""
        try:
            await self._measure()
        except BenchError as error:
            self.result["error"] = str(error)
            self.result["failed_phase"] = self.phase
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
            self.phase = "operator start"
            self.operator = OperatorProcess(config, self.namespace)
            started = time.monotonic()
            self.operator.start()
            await self.operator.healthy(config.timeout)
            operator["startup_s"] = time.monotonic() - started
        self.phase = "warm-up"
        await self._one(f"bench-{self.run_id}-warm", "the warm-up pipeline")
        operator["rss_idle_mib"] = self._memory().get("VmRSS")
        self.phase = "latency"
        values: list[float] = []
        self.result["latency"] = latency = {"samples": 0, "values_s": values}
        for i in range(config.samples):
            values.append(await self._one(f"bench-{self.run_id}-l{i}", f"latency sample {i}"))
            latency.update(
                samples=len(values),
                p50_s=percentile(values, 50),
                p90_s=percentile(values, 90),
                max_s=max(values),
            )
        self.phase = "burst"
        await self._burst(config.pipelines)
        operator["rss_after_burst_mib"] = self._memory().get("VmRSS")
        if config.steady > 0 and self.operator is not None:
            self.phase = "steady state"
            before = metering.api_counts(await self.operator.metrics())
            started = time.monotonic()
            await asyncio.sleep(config.steady)
            self._alive()
            after = metering.api_counts(await self.operator.metrics())
            pipelines = len(self.created)
            seconds = time.monotonic() - started
            steady = metering.cost(before, after, pipelines=pipelines, seconds=seconds)
            self.result.setdefault("api", {})["steady"] = steady

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

    async def _burst(self, count: int) -> None:
        """`count` pipelines at once; fills result["burst"] as it goes (partial results)."""
        observer = self.observer
        assert observer is not None
        docs = [self._doc(f"bench-{self.run_id}-{i}") for i in range(count)]
        expected = {d["metadata"]["name"]: expected_children(d, self.namespace) for d in docs}
        burst: Json = {"pipelines": count, "complete": False, "reconciled": 0}
        self.result["burst"] = burst
        counts_before = await self._operator_counts()
        cpu_before = await self._cpu_mark()
        started = time.monotonic()

        def finished() -> list[float]:
            return [t for n, e in expected.items() if (t := observer.done_at(n, e)) is not None]

        def summarize() -> None:
            done = [t - started for t in finished()]
            present = [observer.children_at(e) for e in expected.values()]
            complete = len(done) == count
            burst.update(
                children_s=(
                    max(t for t in present if t is not None) - started
                    if present and None not in present
                    else None
                ),
                reconciled_s=max(done) if complete and done else None,
                reconciled=len(done),
                per_pipeline_p50_s=percentile(done, 50),
                per_pipeline_p90_s=percentile(done, 90),
                complete=complete,
            )

        try:
            await asyncio.gather(*(self._create(doc) for doc in docs))
            burst["created_s"] = time.monotonic() - started
            await observer.until(
                lambda: self._alive() and len(finished()) == count,
                self.config.timeout,
                f"{count} pipelines",
                progress=lambda: cleanup.progress(f"burst: {len(finished())}/{count} reconciled"),
            )
        except WaitTimeout:
            pass  # reported as incomplete
        finally:
            summarize()
            seconds = time.monotonic() - started
            burst["cpu"] = (await self._cpu_mark()).since(cpu_before)
            counts_after = await self._operator_counts()
            self.result.setdefault("api", {})["burst"] = metering.cost(
                counts_before, counts_after, pipelines=count, seconds=seconds
            )

    async def _operator_counts(self) -> metering.Counts | None:
        return None if self.operator is None else metering.api_counts(await self.operator.metrics())

    async def _cpu_mark(self) -> metering.CpuMark:
        server = metering.server_cpu(await metering.read_server_metrics(self.api))
        operator = None if self.operator is None else self.operator.cpu_seconds()
        return metering.CpuMark.now(operator, server)

    # ------------------------------------------------------------------ set-up

    async def _ensure_crd(self) -> None:
        existing = await self._get(cleanup.CRD_PATH)
        if existing is None:
            body = crd.crd()
            collection = cleanup.CRD_PATH.rsplit("/", 1)[0]
            await self._api(self.api.request("POST", collection, body=body), "create the CRD")
            self.created_crd = True

        async def established() -> bool:
            got = await self._get(cleanup.CRD_PATH) or {}
            conditions = (got.get("status") or {}).get("conditions") or []
            return any(
                c.get("type") == "Established" and c.get("status") == "True" for c in conditions
            )

        await self._poll(established, "the CRD to be Established")

    async def _ensure_namespace(self) -> None:
        path = f"{cleanup.NAMESPACES_PATH}/{self.namespace}"
        if self.config.namespace is not None:
            if await self._get(path) is None:
                raise BenchError(f"namespace {self.namespace} does not exist")
            return
        body = {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": self.namespace, "labels": {LABEL_RUN: self.run_id}},
        }
        await self._api(
            self.api.request("POST", cleanup.NAMESPACES_PATH, body=body), "create namespace"
        )
        self.created_namespace = True

    # ------------------------------------------------------------------ clean-up

    async def _cleanup(self) -> None:
        """Delete what the run created; record what is left in result["cleanup"]."""
        report: Json = {}
        self.result["cleanup"] = report
        timeout = self.config.cleanup_timeout
        try:
            await cleanup.delete_pipelines(
                self.api,
                self.observer,
                namespace=self.namespace,
                run=self.run_id,
                created=self.created,
                timeout=timeout,
                report=report,
            )
        except BenchError as error:
            report["error"] = str(error)
        finally:
            if self.operator is not None:
                # VmHWM just before the operator stops: the peak of the whole run
                peak = self.operator.memory().get("VmHWM")
                self.result.setdefault("operator", {})["rss_peak_mib"] = peak
                report["operator_exit"] = await self.operator.stop()
                self.result["operator"]["errors_logged"] = self.operator.errors_logged
            if self.observer is not None:
                await self.observer.close()
            if self.created_namespace:
                path = f"{cleanup.NAMESPACES_PATH}/{self.namespace}"
                report["namespace_deleted"] = await cleanup.delete_and_wait(self.api, path, timeout)
            if self.created_crd:
                report["crd_deleted"] = await cleanup.delete_and_wait(
                    self.api, cleanup.CRD_PATH, timeout
                )
            await self.api.close()

    # ------------------------------------------------------------------ helpers

    def _doc(self, name: str) -> Json:
        return pipeline_doc(name, self.namespace, self.run_id, self.config.spec)

    async def _create(self, doc: Json) -> None:
        """Create a pipeline; retried while the API server does not serve the CRD yet."""
        name = doc["metadata"]["name"]
        path = kube.collection_path(names.PIPELINE_API_VERSION, names.PIPELINE_KIND, self.namespace)
        deadline = time.monotonic() + self.config.timeout
        while True:
            try:
                await self.api.request("POST", path, body=doc)
            except kube.ApiError as error:
                if error.status == 409 and error.reason == "AlreadyExists":
                    break  # a retried create whose first try went through
                waiting = error.status in (0, 404, 429) or error.status >= 500
                if waiting and time.monotonic() < deadline:
                    await asyncio.sleep(RETRY)
                    continue
                raise BenchError(f"cannot create pipeline {name}: {error}") from error
            break
        self.created.append(name)

    async def _get(self, path: str) -> Json | None:
        try:
            return await self.api.request("GET", path)
        except kube.ApiError as error:
            if error.status == 404:
                return None
            raise BenchError(str(error)) from error

    async def _api(self, request: Awaitable[Json], what: str) -> Json:
        try:
            return await request
        except kube.ApiError as error:
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
    if getattr(args, "steady", 0) < 0 or getattr(args, "cleanup_timeout", 1) <= 0:
        raise BenchError("--steady must be >= 0, --cleanup-timeout > 0")
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
        steady=getattr(args, "steady", 30.0),
        cleanup_timeout=getattr(args, "cleanup_timeout", 600.0),
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
    if result.get("error"):
        print(
            f"disagg bench operator: {result.get('failed_phase')}: {result['error']}",
            file=sys.stderr,
        )
        return 1
    if result.get("burst", {}).get("pipelines") and not result["burst"].get("complete"):
        return 1
    if args.check and False in result["met"].values():
        return 1
    return 0
