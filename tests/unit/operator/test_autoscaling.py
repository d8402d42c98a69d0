"""The operator's autoscaling: units, policies and locks from a pipeline; pods into samples;
resuming counts from the status; status and Event records; the external-scaling mode of the
planner; scraping real metrics endpoints; one loop step against fakes (decisions, windows,
failures); and the HPA/KEDA samples. (The operator staying free of torch is an import-linter
contract: `make lint`.)"""

from __future__ import annotations

import asyncio
import copy
import datetime
import pathlib
import socket
import time
from collections.abc import Iterator
from typing import Any

import kubernetes_validate
import pytest
import yaml

from disagg_core import autoscale, spec
from disagg_core.autoscale import Decision, Policy, RatioLock, Sample
from disagg_operator import names
from disagg_operator.app.scaling_loop import ScalingLoop
from disagg_operator.autoscaling import podmetrics
from disagg_operator.autoscaling import scaling as autoscaling
from disagg_operator.k8s import client as kube
from disagg_operator.plan import model, planner
from disagg_operator.reconcile import apply, reconcile, tracked
from disagg_runtime.role.health import HealthServer
from disagg_runtime.role.metrics import RoleMetrics, RoleSample

NOW = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)
Obj = dict[str, Any]


def doc(**annotations: str) -> Obj:
    """a -> b; a autoscales (1..4, target 0.5, down window 10 s); b follows a at 2:1."""
    return {
        "apiVersion": names.PIPELINE_API_VERSION,
        "kind": names.PIPELINE_KIND,
        "metadata": {
            "name": "p",
            "namespace": "ns",
            "uid": "uid-1",
            "annotations": dict(annotations),
        },
        "spec": {
            "image": "img:1",
            "roles": [
                {
                    "name": "a",
                    "handler": "m:f",
                    "replicas": 2,
                    "autoscaling": {
                        "minReplicas": 1,
                        "maxReplicas": 4,
                        "targetPoolOccupancy": 0.5,
                        "tolerance": 0.1,
                        "scaleDownStabilizationSeconds": 10,
                    },
                },
                {"name": "b", "handler": "m:f"},
            ],
            "edges": [{"from": "a", "to": "b"}],
            "ratioLocks": [{"leader": "a", "follower": "b", "leaderShare": 2, "followerShare": 1}],
        },
    }


def plan_of(body: Obj) -> autoscaling.ScalingPlan:
    return autoscaling.scaling_plan(spec.parse_pipeline(body))


def pod(
    name: str,
    unit: str,
    *,
    ready: bool = True,
    ip: str | None = "10.0.0.1",
    containers: list[Obj] | None = None,
    **meta: Any,
) -> Obj:
    status: Obj = {"phase": "Running"}
    if ip is not None:
        status["podIP"] = ip
    status["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
    return {
        "metadata": {"name": name, "labels": {names.LABEL_ROLE: unit}, **meta},
        "spec": {"containers": containers or [container(unit, 9400)]},
        "status": status,
    }


def container(name: str, port: int) -> Obj:
    return {"name": name, "ports": [{"name": "metrics", "containerPort": port}]}


# ---------------------------------------------------------------------------- plans


def test_plan_of_the_example(load_yaml: Any, repo: pathlib.Path) -> None:
    plan = plan_of(load_yaml(repo / "examples" / "text-to-video.yaml"))
    assert set(plan.policies) == {"denoiser"}
    assert plan.policies["denoiser"] == Policy(
        min_replicas=1,
        max_replicas=4,
        target_occupancy=0.6,
        tolerance=0.1,
        scale_up_window_s=0,
        scale_down_window_s=120,
    )
    assert plan.locks == (RatioLock("denoiser", "decoder", 4, 1, 0.5),)
    assert plan.managed == {"denoiser", "decoder"}
    assert plan.spec_replicas == {"encoder": 1, "denoiser": 2, "decoder": 1}
    assert plan.current({"denoiser": 3}) == {"encoder": 1, "denoiser": 3, "decoder": 1}


def test_a_colocation_group_is_one_unit(full_doc: Obj) -> None:
    plan = plan_of(full_doc)
    assert set(plan.policies) == {"diffusion"}
    assert plan.roles["diffusion"] == ("denoiser", "decoder")
    assert plan.locks == (RatioLock("diffusion", "encoder", 4, 1, 0.25),)
    assert plan.managed == {"diffusion", "encoder"}


def test_external_units_are_not_autoscaled(full_doc: Obj) -> None:
    full_doc["metadata"]["annotations"][names.ANNOTATION_EXTERNAL_SCALING] = "decoder"
    plan = plan_of(full_doc)  # a member stands for its group
    assert plan.policies == {} and plan.locks == () and plan.managed == frozenset()
    assert "diffusion" not in plan.roles
    external = plan_of(doc(**{names.ANNOTATION_EXTERNAL_SCALING: "b"}))
    assert set(external.policies) == {"a"} and external.locks == ()
    assert external.managed == {"a"}


def test_chained_locks_manage_every_follower() -> None:
    body = doc()
    body["spec"]["roles"].append({"name": "c", "handler": "m:f"})
    body["spec"]["edges"].append({"from": "b", "to": "c"})
    body["spec"]["ratioLocks"].append({"leader": "b", "follower": "c"})
    assert plan_of(body).managed == {"a", "b", "c"}


# ---------------------------------------------------------------------------- planner


def statefulsets(body: Obj) -> dict[str, Obj]:
    objects = planner.plan(spec.parse_pipeline(body), namespace="ns")
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == "StatefulSet"}


def test_the_planner_leaves_replicas_of_external_units_out(full_doc: Obj) -> None:
    sts = statefulsets(doc(**{names.ANNOTATION_EXTERNAL_SCALING: " a , "}))
    assert "replicas" not in sts["p-a"]["spec"]
    assert sts["p-b"]["spec"]["replicas"] == 1
    assert list(sts["p-b"]["spec"]) == [
        "serviceName",
        "replicas",
        "podManagementPolicy",
        "updateStrategy",
        "selector",
        "template",
    ]
    full_doc["metadata"]["annotations"][names.ANNOTATION_EXTERNAL_SCALING] = "diffusion"
    sts = statefulsets(full_doc)
    assert "replicas" not in sts["full-diffusion"]["spec"]
    assert sts["full-encoder"]["spec"]["replicas"] == 2


def test_unknown_external_names_are_problems() -> None:
    pipeline = spec.parse_pipeline(doc(**{names.ANNOTATION_EXTERNAL_SCALING: "a,zz,yy"}))
    (problem,) = planner.check(pipeline)
    assert problem.path == 'metadata.annotations["disagg.dev/external-scaling"]'
    assert "zz, yy" in problem.reason


# ---------------------------------------------------------------------------- resume


def test_resume_prefers_memory_then_status_then_the_spec() -> None:
    body = doc()
    assert autoscaling.resumed_replicas(body, {}) == {}
    body["status"] = {autoscaling.STATUS_REPLICAS: {"a": 3, "b": 2, "gone": 5}}
    assert autoscaling.resumed_replicas(body, {}) == {"a": 3, "b": 2}
    assert autoscaling.resumed_replicas(body, {"a": 4}) == {"a": 4, "b": 2}
    body["status"] = {autoscaling.STATUS_REPLICAS: {"a": True, "b": -1}}
    assert autoscaling.resumed_replicas(body, {}) == {}, "not counts"


def test_resume_drops_units_no_longer_autoscaled() -> None:
    body = doc()
    del body["spec"]["roles"][0]["autoscaling"]
    assert autoscaling.resumed_replicas(body, {"a": 3, "b": 2}) == {}
    external = doc(**{names.ANNOTATION_EXTERNAL_SCALING: "a"})
    assert autoscaling.resumed_replicas(external, {"a": 3, "b": 2}) == {}


def test_resume_keeps_memory_for_an_invalid_spec() -> None:
    body = doc()
    body["spec"]["edges"] = [{"from": "a", "to": "nowhere"}]
    assert autoscaling.resumed_replicas(body, {"a": 3}) == {"a": 3}


# ---------------------------------------------------------------------------- pods


def test_metrics_port_from_the_named_port_then_env_then_default() -> None:
    assert autoscaling.metrics_port(container("a", 9555)) == 9555
    env = {"name": "a", "env": [{"name": "DISAGG_METRICS_PORT", "value": "9777"}]}
    assert autoscaling.metrics_port(env) == 9777
    assert autoscaling.metrics_port({"name": "a"}) == 9400
    unnamed = {"name": "a", "ports": [{"containerPort": 1234}]}
    assert autoscaling.metrics_port(unnamed) == 9400
    second = {"name": "b", "ports": [{"name": "metrics-1", "containerPort": 9401}]}
    assert autoscaling.metrics_port(second) == 9401  # the 2nd container of a colocation pod


def test_pods_that_count_and_how() -> None:
    plan = plan_of(doc())
    pods = [
        pod("p-a-1", "a", ip="10.0.0.2"),
        pod("p-a-0", "a", containers=[container("a", 9401), container("sidecar", 80)]),
        pod("p-a-2", "a", ready=False),
        pod("p-a-3", "a", ip=None),
        pod("p-a-4", "a", deletionTimestamp="2026-01-01T00:00:00Z"),
        {**pod("p-a-5", "a"), "status": {"phase": "Failed"}},
        pod("p-x-0", "x"),
        pod("p-b-0", "b", ip="fd00::1"),
    ]
    views = autoscaling.pod_views(pods, plan)
    assert [v.name for v in views["a"]] == ["p-a-0", "p-a-1", "p-a-2", "p-a-3"]
    first, second, not_ready, no_ip = views["a"]
    assert first.urls == ("http://10.0.0.1:9401/metrics",), "the sidecar is not scraped"
    assert second.urls == ("http://10.0.0.2:9400/metrics",)
    assert not_ready.urls == () and no_ip.urls == ()
    assert views["b"][0].urls == ("http://[fd00::1]:9400/metrics",)


def test_pod_samples() -> None:
    plan = autoscaling.ScalingPlan({}, (), {"g": ("x", "y")}, {"g": 1})
    two = pod("p-g-0", "g", containers=[container("x", 9400), container("y", 9401)])
    (view,) = autoscaling.pod_views([two], plan)["g"]
    x, y = view.urls
    readings = {x: autoscaling.Reading(0.2, 1), y: autoscaling.Reading(0.7, 2)}
    assert autoscaling.pod_sample(view, readings, 5.0) == Sample(
        "p-g-0", 0.7, queue_depth=3, ready=True, at=5.0
    )
    assert autoscaling.pod_sample(view, {x: readings[x], y: None}, 5.0) == Sample(
        "p-g-0", None, at=5.0
    ), "one failed scrape: no occupancy"
    (waiting,) = autoscaling.pod_views([pod("p-g-1", "g", ready=False)], plan)["g"]
    assert autoscaling.pod_sample(waiting, readings, 5.0) == Sample(
        "p-g-1", None, ready=False, at=5.0
    )


def test_observed_is_the_mean_of_fresh_ready_samples() -> None:
    samples = [
        Sample("a", 0.2, at=10.0),
        Sample("b", 0.6, at=10.0),
        Sample("c", None, at=10.0),
        Sample("d", 0.9, ready=False, at=10.0),
        Sample("e", 1.0, at=-100.0),
    ]
    assert autoscaling.observed(samples, 10.0, 30.0) == pytest.approx(0.4)
    assert autoscaling.observed([], 10.0, 30.0) is None


# ---------------------------------------------------------------------------- records


def test_records_events_and_status_patches() -> None:
    up = Decision("a", 1, 3, "pool occupancy 0.90 vs target 0.50: scale up", 0.0)
    down = Decision("a", 3, 2, "x" * 2000, 0.0)
    record = autoscaling.decision_record(up, NOW, 0.91234)
    assert record == {
        "time": "2026-01-02T03:04:05Z",
        "role": "a",
        "fromReplicas": 1,
        "toReplicas": 3,
        "occupancy": 0.9123,
        "signal": "occupancy",
        "reason": up.reason,
    }
    assert "occupancy" not in autoscaling.decision_record(down, NOW, None)
    assert len(autoscaling.decision_record(down, NOW, None)["reason"]) == autoscaling.MAX_REASON
    assert autoscaling.decision_event(up) == (
        "Normal",
        "ScaledUp",
        f"a: 1 -> 3 replicas on occupancy ({up.reason})",
    )
    assert autoscaling.decision_event(down)[1] == "ScaledDown"

    old = [{"role": "a", "n": i} for i in range(9)]
    previous = {"scaleDecisions": old, "autoscaledReplicas": {"a": 1, "gone": 2}}
    patch = autoscaling.status_patch(previous, [record, record], {"a": 3})
    assert patch["scaleDecisions"] == [*old[1:], record, record]
    assert patch["autoscaledReplicas"] == {"gone": None, "a": 3}
    assert autoscaling.status_patch({"autoscaledReplicas": {"a": 3}}, [], {"a": 3}) == {}
    assert autoscaling.status_patch(None, [], {}) == {}


def test_scaling_state_is_kept_while_policies_hold() -> None:
    plan = plan_of(doc())
    state = autoscaling.scaling_state(None, plan)
    assert autoscaling.scaling_state(state, plan) is state, "kept"
    changed = autoscaling.scaling_state(state, plan_of(doc(**{"x": "y"})))
    assert changed is state, "annotations are not policies"
    other = doc()
    other["spec"]["roles"][0]["autoscaling"]["maxReplicas"] = 5
    assert autoscaling.scaling_state(state, plan_of(other)) is not state
    down = Decision("a", 3, 1, "", 0.0)
    up = Decision("a", 1, 3, "", 0.0)
    same = Decision("a", 2, 2, "", 0.0)
    assert autoscaling.to_apply([down, up, same]) == [down, up]


# ---------------------------------------------------------------------------- scraping


def role_metrics(occupancy_used: int, queued: int) -> RoleMetrics:
    sample = RoleSample(occupancy_used, 1000, 3, 1, queued)
    return RoleMetrics(pipeline="p", role="a", replica=0, sample=lambda: sample)


def test_parse_reads_the_runtime_exposition() -> None:
    text = role_metrics(250, 4).render().decode()
    assert podmetrics.parse(text) == autoscaling.Reading(0.25, 4)
    assert podmetrics.parse("") is None
    assert podmetrics.parse("disagg_queue_depth 3\n") is None, "no occupancy"
    assert podmetrics.parse("disagg_pool_occupancy{ 1\n") is None
    assert podmetrics.parse("disagg_pool_occupancy NaN\n") is None
    assert podmetrics.parse("disagg_pool_occupancy 7\ndisagg_queue_depth -2\n") == (
        autoscaling.Reading(1.0, 0)
    )


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        yield server.getsockname()[1]


@pytest.mark.asyncio
async def test_scraper_reads_concurrently_and_fails_soft(silent_port: int) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    servers = [
        HealthServer(role_metrics(500, 2), host="127.0.0.1", live=lambda: True, ready=lambda: True)
        for _ in range(2)
    ]
    for server in servers:
        server.start()
    scraper = podmetrics.Scraper(timeout=0.5)
    try:
        urls = [f"http://127.0.0.1:{server.port}/metrics" for server in servers]
        bad = [
            f"http://127.0.0.1:{closed}/metrics",
            f"http://127.0.0.1:{silent_port}/metrics",
            f"http://127.0.0.1:{servers[0].port}/nothing",
        ]
        started = time.monotonic()
        readings = await scraper.read_all([*urls, *bad, urls[0]])
        assert time.monotonic() - started < 2.0, "concurrent, bounded by the timeout"
        assert readings == {
            urls[0]: autoscaling.Reading(0.5, 2),
            urls[1]: autoscaling.Reading(0.5, 2),
            **dict.fromkeys(bad),
        }
        assert await scraper.read_all([]) == {}
    finally:
        await scraper.close()
        for server in servers:
            server.close()


# ---------------------------------------------------------------------------- the loop


class FakeApi:
    """What the loop needs of kube.Api: status patches (merged into the pipeline)."""

    def __init__(self, body: Obj) -> None:
        self.body = body
        self.patches: list[Obj] = []

    async def patch_status(self, ref: kube.ObjectRef, status: Obj, *, uid: str) -> Obj:
        assert (ref.name, uid) == (self.body["metadata"]["name"], self.body["metadata"]["uid"])
        self.patches.append(copy.deepcopy(status))
        current = self.body.setdefault("status", {})
        for key, value in status.items():
            if isinstance(value, dict):
                merged = {**(current.get(key) or {}), **value}
                current[key] = {k: v for k, v in merged.items() if v is not None}
            else:
                current[key] = value
        return self.body

    async def close(self) -> None:
        pass


class FakeScraper:
    def __init__(self) -> None:
        self.occupancy: float | None = 0.0

    async def read_all(self, urls: Any) -> dict[str, autoscaling.Reading | None]:
        value = self.occupancy
        reading = None if value is None else autoscaling.Reading(value, 0)
        return dict.fromkeys(urls, reading)

    async def close(self) -> None:
        pass


class Harness:
    def __init__(self, monkeypatch: pytest.MonkeyPatch, body: Obj) -> None:
        self.api = FakeApi(body)
        self.pods: list[Obj] = []
        self.events: list[tuple[str, str, str]] = []
        self.reconciled: list[dict[str, int]] = []
        self.fail_reconcile = False
        self.clock = 1000.0
        self.reconciler = reconcile.Reconciler(
            api=self.api,  # type: ignore[arg-type]
            post_event=lambda _, *event: self.events.append(event),
            clock=lambda: NOW,
        )
        self.reconciler.states[("ns", "p")] = self.state = tracked.PipelineState()
        self.scraper = FakeScraper()
        self.loop = ScalingLoop(self.reconciler, interval=0.05, monotonic=lambda: self.clock)
        self.loop._scraper = self.scraper  # type: ignore[assignment]

        async def get_pipeline(api: Any, namespace: str, name: str) -> Obj | None:
            return copy.deepcopy(self.api.body)

        async def pipeline_pods(api: Any, namespace: str, pipeline: str) -> list[Obj]:
            return copy.deepcopy(self.pods)

        async def fake_reconcile(namespace: str, name: str) -> reconcile.Outcome:
            if self.fail_reconcile:
                raise kube.ApiError(500, "InternalError", "boom")
            self.reconciled.append(dict(self.state.replicas))
            return reconcile.Outcome(phase=names.PHASE_READY)

        monkeypatch.setattr(apply, "get_pipeline", get_pipeline)
        monkeypatch.setattr(apply, "pipeline_pods", pipeline_pods)
        monkeypatch.setattr(self.reconciler, "reconcile", fake_reconcile)

    def ready_pods(self, unit: str, count: int) -> None:
        self.pods = [p for p in self.pods if p["metadata"]["labels"][names.LABEL_ROLE] != unit]
        self.pods += [pod(f"p-{unit}-{i}", unit, ip=f"10.0.0.{i + 1}") for i in range(count)]

    async def step(self, at: float) -> list[Decision]:
        self.clock = at
        return await self.loop.step("ns", "p")


@pytest.mark.asyncio
async def test_a_step_scales_up_records_and_posts(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch, doc())
    h.ready_pods("a", 2)
    h.scraper.occupancy = 0.9
    changed = await h.step(1000.0)
    assert [(d.role, d.current, d.desired) for d in changed] == [("a", 2, 4), ("b", 1, 2)]
    assert h.reconciled == [{"a": 4, "b": 2}]
    status = h.api.body["status"]
    assert status["autoscaledReplicas"] == {"a": 4, "b": 2}
    up, follow = status["scaleDecisions"]
    assert up["occupancy"] == 0.9 and up["time"] == "2026-01-02T03:04:05Z"
    assert follow["reason"].startswith("ratio lock a:b")
    assert [reason for _, reason, _ in h.events] == ["ScaledUp", "ScaledUp"]

    # new pods not ready yet: counted, so no further step up, and no scale-down either
    h.pods += [pod(f"p-a-{i}", "a", ready=False) for i in (2, 3)]
    assert await h.step(1001.0) == []
    assert len(h.reconciled) == 1 and len(h.api.patches) == 1


@pytest.mark.asyncio
async def test_scale_down_waits_for_the_window(monkeypatch: pytest.MonkeyPatch) -> None:
    body = doc()
    body["status"] = {"autoscaledReplicas": {"a": 4, "b": 2}}
    h = Harness(monkeypatch, body)
    h.state.replicas = autoscaling.resumed_replicas(body, {})  # what a reconcile does
    h.ready_pods("a", 4)
    h.scraper.occupancy = 0.0
    assert await h.step(1000.0) == [], "a fresh autoscaler waits"
    assert await h.step(1009.0) == []
    h.scraper.occupancy = None  # a failed scrape never scales down, and restarts the window
    assert await h.step(1011.0) == []
    h.scraper.occupancy = 0.0
    assert await h.step(1015.0) == []
    changed = await h.step(1022.0)
    assert [(d.role, d.current, d.desired) for d in changed] == [("a", 4, 1), ("b", 2, 1)]
    assert [reason for _, reason, _ in h.events] == ["ScaledDown", "ScaledDown"]
    assert h.api.body["status"]["autoscaledReplicas"] == {"a": 1, "b": 1}


@pytest.mark.asyncio
async def test_a_failed_reconcile_leaves_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch, doc())
    h.ready_pods("a", 2)
    h.scraper.occupancy = 1.0
    h.fail_reconcile = True
    with pytest.raises(kube.ApiError):
        await h.step(1000.0)
    assert h.state.replicas == {} and h.events == [] and h.api.patches == []
    assert (await h.loop.tick()) == {("ns", "p"): []}, "a tick logs and goes on"
    h.fail_reconcile = False
    assert [d.desired for d in await h.step(1001.0)] == [4, 2]


@pytest.mark.asyncio
async def test_pipelines_without_policies_forget_old_counts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    body = doc(**{names.ANNOTATION_EXTERNAL_SCALING: "a"})
    body["status"] = {"autoscaledReplicas": {"a": 4, "b": 2}}
    h = Harness(monkeypatch, body)
    h.state.scaling = autoscaling.scaling_state(None, plan_of(doc()))
    assert await h.step(1000.0) == []
    assert h.api.patches == [{"autoscaledReplicas": {"a": None, "b": None}}]
    assert h.state.scaling is None
    assert await h.step(1001.0) == [] and len(h.api.patches) == 1, "written once"


@pytest.mark.asyncio
async def test_the_loop_task_starts_once_and_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch, doc())
    ticks: list[float] = []
    real_tick = h.loop.tick

    async def counting() -> dict[reconcile.Key, list[Decision]]:
        ticks.append(time.monotonic())
        return await real_tick()

    monkeypatch.setattr(h.loop, "tick", counting)
    h.loop.monotonic = time.monotonic
    h.loop.ensure_started()
    h.loop.ensure_started()
    assert h.loop.running
    await asyncio.sleep(0.3)
    await h.loop.stop()
    assert not h.loop.running
    assert 2 <= len(ticks) <= 8
    off = ScalingLoop(h.reconciler, interval=0)
    off.ensure_started()
    assert not off.running


# ---------------------------------------------------------------------------- samples


def test_hpa_sample(repo: pathlib.Path, load_yaml: Any) -> None:
    hpa = load_yaml(repo / "manifests" / "samples" / "external-scaling" / "hpa-denoiser.yaml")
    kubernetes_validate.validate(hpa, kubernetes_validate.utils.latest_version(), strict=True)
    pipeline = spec.parse_pipeline(load_yaml(repo / "examples" / "text-to-video.yaml"))
    target = model.workload_of(pipeline, "denoiser").name
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": target,
    }
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == autoscale.OCCUPANCY_METRIC
    policy = pipeline.role("denoiser").autoscaling
    assert policy is not None
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (
        policy.min_replicas,
        policy.max_replicas,
    )
    text = (repo / "manifests" / "samples" / "external-scaling" / "hpa-denoiser.yaml").read_text()
    assert f"{names.ANNOTATION_EXTERNAL_SCALING}=denoiser" in text


def test_keda_sample(repo: pathlib.Path) -> None:
    path = repo / "manifests" / "samples" / "external-scaling" / "keda-denoiser.yaml"
    scaled = yaml.safe_load(path.read_text())
    assert (scaled["apiVersion"], scaled["kind"]) == ("keda.sh/v1alpha1", "ScaledObject")
    assert scaled["spec"]["scaleTargetRef"]["name"] == "text-to-video-denoiser"
    assert scaled["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert autoscale.OCCUPANCY_METRIC in trigger["metadata"]["query"]
    assert float(trigger["metadata"]["threshold"]) == 0.6
    assert f"{names.ANNOTATION_EXTERNAL_SCALING}=denoiser" in path.read_text()
