"""Prometheus metrics of the operator, in a registry of their own (so that several operators
in one test process do not collide), served by `serve(port)`:

    disagg_operator_reconcile_duration_seconds{kind}   histogram; kind = spec | status
    disagg_operator_reconcile_errors_total{kind,reason} counter; reason = the API error's
                                                          reason, Conflict (a child held by
                                                          another owner) or Exception
    disagg_operator_pipelines_managed                   gauge; pipelines this operator tracks
    disagg_operator_api_requests_total{client,verb,resource,outcome}
                                                        counter; every request to the API server:
                                                        client = operator (its own client, each
                                                        try) | kopf (kopf's requests: watches,
                                                        its annotations, Events; each call),
                                                        verb and resource as RBAC names them,
                                                        outcome = the HTTP status or "error"
                                                        (no response)
    disagg_operator_scale_decisions_total{pipeline_namespace,pipeline,role,direction,signal}
                                                        counter; the autoscaler's decisions
                                                        that changed a unit's replicas:
                                                        direction = up | down, signal = what
                                                        drove it (occupancy, queue, ...)
    disagg_operator_autoscaled_replicas{pipeline_namespace,pipeline,role}
                                                        gauge; the replicas last decided
    disagg_operator_role_replicas{pipeline_namespace,pipeline,role,state}
                                                        gauge; a role's pods as its workload
                                                        last reported them: state = desired |
                                                        ready | updated (at the latest
                                                        revision): updated / desired is the
                                                        rollout's progress
    disagg_operator_rollout_phase{pipeline_namespace,pipeline,phase}
                                                        gauge; 1 for the pipeline's rollout
                                                        phase now, 0 for the others: phase =
                                                        Complete | Rolling | Paused | Stalled

(`pipeline_namespace`, not `namespace`: a scrape gives `namespace` the operator's own.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

import prometheus_client

PREFIX: Final = "disagg_operator_"
REPLICA_STATES: Final = ("desired", "ready", "updated")
ROLLOUT_PHASES: Final = ("Complete", "Rolling", "Paused", "Stalled")  # rollout_state.phase
BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self, registry: prometheus_client.CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else prometheus_client.CollectorRegistry()
        self.duration = prometheus_client.Histogram(
            PREFIX + "reconcile_duration_seconds",
            "Time to reconcile one pipeline: spec (plan, apply, prune, status) or status only.",
            ["kind"],
            buckets=BUCKETS,
            registry=self.registry,
        )
        self.errors = prometheus_client.Counter(
            PREFIX + "reconcile_errors",
            "Reconciles that failed or left a conflict, by reason.",
            ["kind", "reason"],
            registry=self.registry,
        )
        self.pipelines = prometheus_client.Gauge(
            PREFIX + "pipelines_managed",
            "DisaggregatedPipelines this operator currently tracks.",
            registry=self.registry,
        )

        self.api_requests = prometheus_client.Counter(
            PREFIX + "api_requests",
            "Requests to the Kubernetes API, by client, verb, resource and outcome.",
            ["client", "verb", "resource", "outcome"],
            registry=self.registry,
        )

        self.scale_decisions = prometheus_client.Counter(
            PREFIX + "scale_decisions",
            "Autoscaler decisions that changed a unit's replicas, by direction and signal.",
            ["pipeline_namespace", "pipeline", "role", "direction", "signal"],
            registry=self.registry,
        )
        self.autoscaled = prometheus_client.Gauge(
            PREFIX + "autoscaled_replicas",
            "Replicas the autoscaler last decided for a unit.",
            ["pipeline_namespace", "pipeline", "role"],
            registry=self.registry,
        )
        self.role_replicas = prometheus_client.Gauge(
            PREFIX + "role_replicas",
            "A role's pods as its workload reports them: desired, ready, updated (at the "
            "latest revision).",
            ["pipeline_namespace", "pipeline", "role", "state"],
            registry=self.registry,
        )
        self.rollout_phase = prometheus_client.Gauge(
            PREFIX + "rollout_phase",
            "1 for the pipeline's rollout phase now (Complete, Rolling, Paused, Stalled).",
            ["pipeline_namespace", "pipeline", "phase"],
            registry=self.registry,
        )
        self._roles: dict[tuple[str, str], set[str]] = {}  # series to drop with the pipeline

    def scaled(
        self, namespace: str, pipeline: str, role: str, current: int, desired: int, signal: str
    ) -> None:
        """One decision that changed `role`'s replicas from `current` to `desired`."""
        direction = "up" if desired > current else "down"
        self.scale_decisions.labels(namespace, pipeline, role, direction, signal).inc()
        self.autoscaled.labels(namespace, pipeline, role).set(desired)

    def observed(
        self, namespace: str, pipeline: str, roles: Iterable[Mapping[str, Any]], phase: str
    ) -> None:
        """The pipeline's status as just built: `status.roles` entries, `rollout.phase`."""
        seen = self._roles.setdefault((namespace, pipeline), set())
        for role in roles:
            seen.add(str(role["name"]))
            for state in REPLICA_STATES:
                series = self.role_replicas.labels(namespace, pipeline, role["name"], state)
                series.set(int(role.get(state) or 0))
        for name in ROLLOUT_PHASES:
            self.rollout_phase.labels(namespace, pipeline, name).set(float(name == phase))

    def forget(self, namespace: str, pipeline: str) -> None:
        """The pipeline is gone: its series go too (else they would report it forever)."""
        for role in self._roles.pop((namespace, pipeline), set()):
            for state in REPLICA_STATES:
                with contextlib.suppress(KeyError):
                    self.role_replicas.remove(namespace, pipeline, role, state)
        for name in ROLLOUT_PHASES:
            with contextlib.suppress(KeyError):
                self.rollout_phase.remove(namespace, pipeline, name)

    def api_request(self, client: str) -> Callable[[str, str, str], None]:
        """A recorder of one client's requests: (verb, resource, outcome)."""

        def record(verb: str, resource: str, outcome: str) -> None:
            self.api_requests.labels(
                client=client, verb=verb, resource=resource, outcome=outcome
            ).inc()

        return record

    def count_pipelines(self, count: Callable[[], float]) -> None:
        self.pipelines.set_function(count)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """One sample's value (tests, diagnostics)."""
        return self.registry.get_sample_value(name, labels or {})

    def serve(self, port: int, address: str = "0.0.0.0") -> Callable[[], None]:
        """Serve /metrics on `port` from a daemon thread; returns a function that stops it."""
        server, thread = prometheus_client.start_http_server(
            port, addr=address, registry=self.registry
        )

        def stop() -> None:
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)

        return stop
