"""`disagg operator`: run the reconciler (kopf) with its liveness endpoint and metrics.

    disagg operator [--namespace NS ... | --all-namespaces] [--liveness-port 8080]
                    [--liveness-stall 300]
                    [--metrics-port 9090] [--peering NAME | --standalone] [--priority N]
                    [--cluster-domain D] [--gpu-mode M] [--dra-api-version V]
                    [--progress-deadline S] [--metrics-namespace NS ...] [--log-level L]

- Scope: the namespaces given (kopf globs like `team-*` work), else the whole cluster.
- Liveness: kopf's probe endpoint at http://0.0.0.0:PORT/healthz (0 turns it off); it
  answers 500 once a watch has been silent, or reconciles have waited without one ending,
  for `--liveness-stall` seconds (default 300; see `liveness`).
- Metrics: Prometheus text at http://0.0.0.0:PORT/metrics (0 turns it off); see `metrics`.
- High availability: run several replicas with `--peering NAME` (the KopfPeering or
  ClusterKopfPeering object NAME must exist; peering is then mandatory); the one with the
  highest `--priority` works, the others wait. `--standalone` turns peering off. With
  neither, kopf uses the peering object `default` if it exists and runs alone otherwise.
- Credentials: in-cluster service account or the kubeconfig (see `handlers.login`).
- NetworkPolicies: the pods of each `--metrics-namespace` may reach every role's metrics
  port (the chart passes the operator's own namespace: the autoscaler scrapes from there).
- Autoscaling: every `autoscale_interval` seconds (default 15; 0 turns it off), the roles
  with `autoscaling` are scaled on their pool occupancy (see `scaling_loop`).

The flags are in `flags` (kept apart from kopf: the `disagg` CLI builds its parser from them
for every command); `run_cli` takes the parsed namespace. This process never imports torch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import kopf

from disagg_operator.app import handlers, kopfcost, liveness, scaling_loop
from disagg_operator.autoscaling import podmetrics
from disagg_operator.k8s import client as kube
from disagg_operator.plan import model
from disagg_operator.reconcile import events, reconcile, status
from disagg_operator.reconcile.metrics import Metrics

DEFAULT_LIVENESS_PORT: Final = 8080
DEFAULT_METRICS_PORT: Final = 9090


@dataclass(frozen=True, kw_only=True)
class OperatorConfig:
    namespaces: tuple[str, ...] = ()  # empty: the whole cluster
    liveness_port: int = DEFAULT_LIVENESS_PORT  # 0: no liveness endpoint
    liveness_stall: float = liveness.DEFAULT_STALL_AFTER  # seconds stuck before /healthz fails
    metrics_port: int = DEFAULT_METRICS_PORT  # 0: no metrics endpoint
    peering: str | None = None
    standalone: bool = False
    priority: int = 0
    options: model.PlanOptions = field(default_factory=model.PlanOptions)
    progress_deadline: float = status.DEFAULT_PROGRESS_DEADLINE
    autoscale_interval: float = scaling_loop.DEFAULT_INTERVAL  # seconds; <= 0: off
    scrape_timeout: float = podmetrics.DEFAULT_TIMEOUT  # seconds per /metrics scrape
    connection: kopf.ConnectionInfo | None = None  # None: kopf's stock logins

    @property
    def clusterwide(self) -> bool:
        return not self.namespaces

    def kopf_arguments(self) -> dict[str, Any]:
        """Keyword arguments of `kopf.operator` (besides registry and settings)."""
        liveness = f"http://0.0.0.0:{self.liveness_port}/healthz" if self.liveness_port else None
        return {
            "clusterwide": self.clusterwide,
            "namespaces": self.namespaces,
            "standalone": True if self.standalone else None,
            "peering_name": self.peering,
            "priority": self.priority,
            "liveness_endpoint": liveness,
        }


@dataclass
class Operator:
    """Everything one operator run needs, built from a config (see `build`)."""

    config: OperatorConfig
    registry: kopf.OperatorRegistry
    settings: kopf.OperatorSettings
    reconciler: reconcile.Reconciler
    scaler: scaling_loop.ScalingLoop

    async def run(self, **extra: Any) -> None:
        """Run kopf in this event loop until cancelled (`extra`: e.g. stop_flag)."""
        try:
            await kopf.operator(
                registry=self.registry,
                settings=self.settings,
                **self.config.kopf_arguments(),
                **extra,
            )
        finally:
            await self.scaler.stop()  # also when cancelled before kopf's cleanup ran


def build(
    config: OperatorConfig,
    *,
    metrics: Metrics | None = None,
    post_event: events.PostEvent | None = None,
) -> Operator:
    """A registry with the handlers, configured settings and the reconciler behind them."""
    metrics = metrics or Metrics()
    kopfcost.observe(metrics.api_request("kopf"))
    reconciler = reconcile.Reconciler(
        api=kube.Api(config.connection, record=metrics.api_request("operator")),
        options=config.options,
        metrics=metrics,
        post_event=post_event or events.kopf_event,
        progress_deadline=config.progress_deadline,
    )
    scaler = scaling_loop.ScalingLoop(
        reconciler, interval=config.autoscale_interval, scrape_timeout=config.scrape_timeout
    )
    registry = handlers.register(
        kopf.OperatorRegistry(), reconciler, connection=config.connection, scaler=scaler
    )
    if config.liveness_port:
        liveness.register(
            registry,
            reconciler.progress,
            watched=handlers.watched_resources(config.options),
            stall_after=config.liveness_stall,
        )
    settings = kopf.OperatorSettings()
    handlers.configure(settings, config.options)
    return Operator(
        config=config, registry=registry, settings=settings, reconciler=reconciler, scaler=scaler
    )


def config_from_args(args: argparse.Namespace) -> OperatorConfig:
    namespaces: Sequence[str] = () if args.all_namespaces else (args.namespace or ())
    options = model.PlanOptions(
        cluster_domain=args.cluster_domain,
        gpu_mode=args.gpu_mode,
        dra_api_version=args.dra_api_version,
        metrics_namespaces=tuple(getattr(args, "metrics_namespace", None) or ()),
        pod_monitor_default=bool(getattr(args, "pod_monitors", False)),
    )
    return OperatorConfig(
        namespaces=tuple(namespaces),
        liveness_port=args.liveness_port,
        liveness_stall=float(getattr(args, "liveness_stall", None) or liveness.DEFAULT_STALL_AFTER),
        metrics_port=args.metrics_port,
        peering=args.peering,
        standalone=args.standalone,
        priority=args.priority,
        options=options,
        progress_deadline=args.progress_deadline,
        autoscale_interval=_autoscale_interval(args),
    )


def _autoscale_interval(args: argparse.Namespace) -> float:
    """`--autoscale-interval`; namespaces built by hand (tests) may lack it."""
    value = getattr(args, "autoscale_interval", None)
    return scaling_loop.DEFAULT_INTERVAL if value is None else float(value)


class RetriesAreWarnings(logging.Filter):
    """kopf logs every failed try of a request it will retry, and every handler failure it
    will retry, at ERROR; under a slow or throttling API server that is a storm of errors
    for what is routine. Those become WARNINGs; an escalated failure stays an ERROR.

    Also a WARNING: asyncio's report that kopf's watch generator (`infinite_watch`) raised
    while being garbage-collected. kopf 1.45 does not close its watch streams when a watcher
    stops (at shutdown), so asyncio closes them later and logs kopf's own RuntimeError from
    that; nothing is lost (the operator is stopping)."""

    RETRIED = ("; will retry:", "failed temporarily")
    KOPF_GC = "closing of asynchronous generator <async_generator object infinite_watch"

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage() if record.levelno == logging.ERROR else ""
        if any(marker in message for marker in self.RETRIED) or self.KOPF_GC in message:
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def run_cli(args: argparse.Namespace) -> int:
    """`disagg operator`: runs until SIGINT/SIGTERM; returns the exit status."""
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(RetriesAreWarnings())
    config = config_from_args(args)
    operator = build(config)
    stop_metrics: Callable[[], None] | None = None
    if config.metrics_port:
        stop_metrics = operator.reconciler.metrics.serve(config.metrics_port)
    try:
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(operator.run())
    finally:
        if stop_metrics is not None:
            stop_metrics()
    return 0
