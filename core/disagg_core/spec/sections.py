"""The models of the pipeline-wide sections `spec.rollout`, `spec.networkPolicy` and
`spec.monitoring` (re-exported by `model`, which holds the roles, edges and the graph)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

DEFAULT_ROLLOUT_STEP_DEADLINE_SECONDS = 600


@dataclass(frozen=True)
class IntOrPercent:
    """A field in Kubernetes' int-or-percent form (a Deployment's `maxUnavailable`): a count of
    pods (`2`), or a percentage of a role's pods (`"25%"`)."""

    value: int
    percent: bool = False

    def of(self, total: int, *, round_up: bool = False) -> int:
        """The count for `total` pods: a percentage rounded down (up with `round_up`)."""
        if not self.percent:
            return self.value
        exact = self.value * total
        return -(-exact // 100) if round_up else exact // 100

    def fraction(self, total: int) -> float:
        """The share of `total` pods (a count over total; 1.0 at most)."""
        if self.percent:
            return min(1.0, self.value / 100)
        return min(1.0, self.value / total) if total else 1.0

    def __str__(self) -> str:
        return f"{self.value}%" if self.percent else str(self.value)


NO_PODS: Final = IntOrPercent(0)
ONE_POD: Final = IntOrPercent(1)
ALL_PODS: Final = IntOrPercent(100, percent=True)


@dataclass(frozen=True, kw_only=True)
class Rollout:
    """How a template change rolls across roles (operator/disagg_operator/rollout/steps.py): at most
    `max_unavailable` pods of a role per step; roles bound by a ratio lock or listed together
    in `groups` keep their updated fractions within `max_skew` of each other; `partition`
    pods per role stay on the old revision (each an int-or-percent, as in a Deployment: a
    percentage of maxUnavailable rounds down but to at least 1, of partition up, of maxSkew is
    a share of each role's pods, a count of pods over the role's replicas); `paused` holds;
    a step that is not ready within `step_deadline_seconds` stops the rollout."""

    max_unavailable: IntOrPercent = ONE_POD
    max_skew: IntOrPercent = ALL_PODS
    partition: IntOrPercent = NO_PODS
    paused: bool = False
    step_deadline_seconds: int = DEFAULT_ROLLOUT_STEP_DEADLINE_SECONDS
    groups: tuple[tuple[str, ...], ...] = ()


@dataclass(frozen=True, kw_only=True)
class NetworkPolicy:
    """`spec.networkPolicy`: whether the operator renders the pipeline's NetworkPolicy, and
    which peers (Kubernetes NetworkPolicyPeers, kept as written) it admits besides the
    pipeline's own pods and gateway: `clients` to the role ports, `metrics_from` to the
    metrics ports (else the pipeline's namespace)."""

    enabled: bool = True
    clients: tuple[Mapping[str, Any], ...] = ()
    metrics_from: tuple[Mapping[str, Any], ...] = ()


DEFAULT_TRACE_SAMPLE_RATIO: Final = 0.01


@dataclass(frozen=True, kw_only=True)
class Tracing:
    """`spec.monitoring.tracing`: the OTLP/HTTP endpoint every role and the gateway export
    spans to, and the share of new requests they trace (a caller's sampled traceparent is
    followed whatever the ratio). Rendered as OTEL_* env (contract `tracing_env`)."""

    endpoint: str
    sample_ratio: float = DEFAULT_TRACE_SAMPLE_RATIO


@dataclass(frozen=True, kw_only=True)
class Monitoring:
    """`spec.monitoring`: `pod_monitor` asks the operator for a PodMonitor of the pipeline's
    roles and gateway (None: the operator's default, `--pod-monitors`); made only where the
    Prometheus Operator's CRDs are installed. `tracing`: traces (None: none configured)."""

    pod_monitor: bool | None = None
    tracing: Tracing | None = None
