"""Command-line flags of `disagg operator` (see `main`) and `disagg bench operator` (see
`bench.run`). They live with the operator, and apart from its kopf-loading modules, so that the
`disagg` CLI can build its parser without importing kopf or any other part of the operator."""

from __future__ import annotations

import argparse


def add_operator_arguments(op: argparse.ArgumentParser) -> None:
    """`disagg operator`: scope, endpoints, peering, planning options and logging."""
    scope = op.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace", action="append", metavar="NS", help="watch NS (repeatable; globs work)"
    )
    scope.add_argument(
        "--all-namespaces", action="store_true", help="watch every namespace (the default)"
    )
    op.add_argument("--liveness-port", type=int, default=8080, help="/healthz port (0: off)")
    op.add_argument(
        "--liveness-stall",
        type=float,
        default=300.0,
        help="seconds a watch may stay silent, or work wait, before /healthz fails",
    )
    op.add_argument("--metrics-port", type=int, default=9090, help="/metrics port (0: off)")
    peering = op.add_mutually_exclusive_group()
    peering.add_argument("--peering", metavar="NAME", help="kopf peering object for HA")
    peering.add_argument("--standalone", action="store_true", help="no peering")
    op.add_argument("--priority", type=int, default=0, help="peering priority (default 0)")
    op.add_argument("--cluster-domain", default="cluster.local", help="for peer DNS names")
    op.add_argument(
        "--gpu-mode",
        choices=("dra", "device-plugin", "none"),
        default="dra",
        help="GPU of colocation groups (pipelines may override by annotation)",
    )
    op.add_argument(
        "--dra-api-version",
        choices=("resource.k8s.io/v1", "resource.k8s.io/v1beta2"),
        default="resource.k8s.io/v1",
        help="API of the ResourceClaimTemplates (gpu mode dra)",
    )
    op.add_argument(
        "--progress-deadline", type=float, default=600.0, help="seconds before Degraded"
    )
    op.add_argument(
        "--autoscale-interval",
        type=float,
        default=15.0,
        help="seconds between autoscaling decisions (0 turns autoscaling off)",
    )
    op.add_argument(
        "--metrics-namespace",
        action="append",
        metavar="NS",
        help="pods of NS may scrape every role's metrics port (repeatable; the chart passes "
        "the operator's own namespace, whose autoscaler scrapes them)",
    )
    op.add_argument(
        "--pod-monitors",
        action="store_true",
        help="a PodMonitor per pipeline unless its spec.monitoring.podMonitor is false (where "
        "the cluster serves PodMonitors: the Prometheus Operator's CRDs)",
    )
    op.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")


def add_bench_arguments(op: argparse.ArgumentParser) -> None:
    """`disagg bench operator`: the API server, the workload's size and the report."""
    op.add_argument(
        "--kubeconfig", metavar="PATH", help="cluster or API server (default: $KUBECONFIG)"
    )
    op.add_argument("--samples", type=int, default=20, help="one-pipeline samples (default 20)")
    op.add_argument(
        "--pipelines", type=int, default=100, help="pipelines created at once (default 100)"
    )
    op.add_argument("--namespace", help="an existing namespace (default: a new one, deleted)")
    op.add_argument(
        "--external-operator",
        action="store_true",
        help="start no operator: measure the one already watching the namespace",
    )
    op.add_argument("--file", help="pipeline YAML (default: the text-to-video example)")
    op.add_argument("--timeout", type=float, default=120.0, help="seconds per wait (120)")
    op.add_argument(
        "--steady", type=float, default=30.0, help="seconds of steady state measured (30)"
    )
    op.add_argument(
        "--cleanup-timeout", type=float, default=600.0, help="seconds the clean-up may take"
    )
    op.add_argument("--operator-log", metavar="PATH", help="keep the operator's log here")
    op.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    op.add_argument("--json", action="store_true", help="print JSON")
