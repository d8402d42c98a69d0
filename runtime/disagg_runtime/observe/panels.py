"""The dashboard's panels, row by row, each a title, a description (Grafana shows it on
hover; docs/observability.md says the same), a unit and its PromQL targets (pure).

Every series is named through `Catalog` (`catalog.py`), so a metric renamed in the runtime
fails here. Selectors use the dashboard's variables: roles' series by namespace, pipeline
and role; the gateway's by namespace and pipeline; the operator's per-pipeline series by
pipeline_namespace (a scrape gives `namespace` the operator's own).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from disagg_runtime.observe.catalog import Catalog

QUANTILES: Final = (0.5, 0.9, 0.99)
_ROLE: Final = 'namespace=~"$namespace",pipeline=~"$pipeline",role=~"$role"'
_PIPELINE: Final = 'namespace=~"$namespace",pipeline=~"$pipeline"'
_OPERATOR: Final = 'pipeline_namespace=~"$namespace",pipeline=~"$pipeline",role=~"$role"'
PIPELINE_SELECTOR: Final = _PIPELINE


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    unit: str
    targets: tuple[tuple[str, str], ...]  # (PromQL, legend)


def _rate(series: str, labels: str, by: str) -> str:
    return f"sum by ({by}) (rate({series}{{{labels}}}[$__rate_interval]))"


def _quantiles(histogram: str, labels: str, by: str) -> tuple[tuple[str, str], ...]:
    legend = " ".join("{{" + k.strip() + "}}" for k in by.split(","))
    return tuple(
        (
            f"histogram_quantile({q}, sum by ({by}, le) "
            f"(rate({histogram}_bucket{{{labels}}}[$__rate_interval])))",
            f"p{round(q * 100)} {legend}",
        )
        for q in QUANTILES
    )


def _mean(histogram: str, labels: str, by: str) -> str:
    return (
        f"sum by ({by}) (rate({histogram}_sum{{{labels}}}[$__rate_interval])) / "
        f"sum by ({by}) (rate({histogram}_count{{{labels}}}[$__rate_interval]))"
    )


def _requests(c: Catalog) -> list[Panel]:
    request, handler = c.histogram("disagg_request_seconds"), c.histogram("disagg_handler_seconds")
    return [
        Panel(
            "Requests/s by role and outcome",
            "Finished requests per second in each role (done, failed).",
            "reqps",
            (
                (
                    _rate(c.counter("disagg_requests_total"), _ROLE, "pipeline, role, outcome"),
                    "{{role}} {{outcome}}",
                ),
            ),
        ),
        Panel(
            "Request latency quantiles",
            "Receive-to-done time of completed requests in each role.",
            "s",
            _quantiles(request, _ROLE, "pipeline, role"),
        ),
        Panel(
            "Handler time quantiles",
            "Time inside the user handler, per call.",
            "s",
            _quantiles(handler, _ROLE, "pipeline, role"),
        ),
        Panel(
            "Failures/s by reason",
            "Failed requests per second by reason (handler, timeout, aborted, transport, "
            "overloaded, other); every reason is present from the start at 0.",
            "reqps",
            (
                (
                    _rate(
                        c.counter("disagg_request_failures_total"), _ROLE, "pipeline, role, reason"
                    ),
                    "{{role}} {{reason}}",
                ),
            ),
        ),
        Panel(
            "Handler batch size (mean)",
            "Requests per handler call: 1 without batching.",
            "short",
            (
                (
                    _mean(c.histogram("disagg_handler_batch_size"), _ROLE, "pipeline, role"),
                    "{{role}}",
                ),
            ),
        ),
        Panel(
            "Replicas scraped",
            "Role processes answering scrapes: the autoscaler's decisions show as steps.",
            "short",
            (
                (
                    f"count by (pipeline, role) "
                    f"({c.gauge('disagg_role_setup_seconds')}{{{_ROLE}}})",
                    "{{role}}",
                ),
            ),
        ),
    ]


def _queues(c: Catalog) -> list[Panel]:
    return [
        Panel(
            "Queue depth and in-flight",
            "Requests received and waiting for a worker (the scaling signal), and those "
            "being handled.",
            "short",
            (
                (
                    f"sum by (pipeline, role) ({c.gauge('disagg_queue_depth')}{{{_ROLE}}})",
                    "queued {{role}}",
                ),
                (
                    f"sum by (pipeline, role) ({c.gauge('disagg_inflight_requests')}{{{_ROLE}}})",
                    "in flight {{role}}",
                ),
            ),
        ),
        Panel(
            "Queue wait quantiles",
            "How long received messages waited for a worker, measured per message as a "
            "worker takes it (disagg_queue_wait_seconds): a role short of workers shows here "
            "before its pool fills.",
            "s",
            _quantiles(c.histogram("disagg_queue_wait_seconds"), _ROLE, "pipeline, role"),
        ),
        Panel(
            "Pool occupancy",
            "Receive-pool occupancy 0..1 (or the inline budget's, if fuller), the highest "
            "replica per role: the autoscaler's signal.",
            "percentunit",
            (
                (
                    f"max by (pipeline, role) ({c.gauge('disagg_pool_occupancy')}{{{_ROLE}}})",
                    "{{role}}",
                ),
            ),
        ),
        Panel(
            "Pool bytes",
            "Receive-pool bytes in use, capacity and allocator rounding, summed over replicas.",
            "bytes",
            tuple(
                (f"sum by (pipeline, role) ({c.gauge(name)}{{{_ROLE}}})", f"{legend} {{{{role}}}}")
                for name, legend in (
                    ("disagg_pool_bytes_used", "used"),
                    ("disagg_pool_bytes_total", "total"),
                    ("disagg_pool_fragmentation_bytes", "rounding"),
                )
            ),
        ),
        Panel(
            "Inline budget",
            "Inline payload bytes held, and the budget beyond which lanes stall.",
            "bytes",
            (
                (
                    f"sum by (pipeline, role) ({c.gauge('disagg_inline_bytes_used')}{{{_ROLE}}})",
                    "used {{role}}",
                ),
                (
                    f"sum by (pipeline, role) ({c.gauge('disagg_inline_bytes_budget')}{{{_ROLE}}})",
                    "budget {{role}}",
                ),
            ),
        ),
        Panel(
            "Free slots and lanes",
            "Typical requests that still fit the receive pool, and senders on the lane.",
            "short",
            (
                (
                    f"sum by (pipeline, role) ({c.gauge('disagg_pool_free_slots')}{{{_ROLE}}})",
                    "free slots {{role}}",
                ),
                (
                    f"sum by (pipeline, role) ({c.gauge('disagg_ingress_lanes')}{{{_ROLE}}})",
                    "lanes {{role}}",
                ),
            ),
        ),
        Panel(
            "Peer refusals/s",
            "Connections and messages refused for want of the pipeline's peer key.",
            "short",
            (
                (
                    _rate(c.counter("disagg_peer_rejected_total"), _ROLE, "pipeline, role"),
                    "{{role}}",
                ),
            ),
        ),
    ]


def _edges(c: Catalog) -> list[Panel]:
    return [
        Panel(
            "Edge bytes/s",
            "Payload bytes per second on each edge, out of the sender and into the receiver.",
            "Bps",
            (
                (
                    _rate(c.counter("disagg_edge_bytes_total"), _ROLE, "pipeline, edge, direction"),
                    "{{edge}} {{direction}}",
                ),
            ),
        ),
        Panel(
            "Edge messages/s by relay",
            "Messages per second on each edge and the relay (shm, tcp, cuda-ipc, nixl) that "
            "carried them.",
            "short",
            (
                (
                    _rate(c.counter("disagg_edge_messages_total"), _ROLE, "pipeline, edge, relay"),
                    "{{edge}} {{relay}}",
                ),
            ),
        ),
        Panel(
            "Edge send time quantiles",
            "Time to send one message per edge.",
            "s",
            _quantiles(c.histogram("disagg_edge_seconds"), _ROLE, "pipeline, edge"),
        ),
    ]


def _gateway(c: Catalog) -> list[Panel]:
    return [
        Panel(
            "Gateway requests/s by code",
            "HTTP answers per second by route and status code.",
            "reqps",
            (
                (
                    _rate(
                        c.counter("disagg_gateway_requests_total"),
                        _PIPELINE,
                        "pipeline, route, code",
                    ),
                    "{{route}} {{code}}",
                ),
            ),
        ),
        Panel(
            "Gateway latency quantiles",
            "Time to the last byte of an answer.",
            "s",
            _quantiles(c.histogram("disagg_gateway_request_seconds"), _PIPELINE, "pipeline, route"),
        ),
        Panel(
            "Time to first chunk quantiles",
            "Time to the first chunk of a streamed answer (server-sent events).",
            "s",
            _quantiles(
                c.histogram("disagg_gateway_first_chunk_seconds"), _PIPELINE, "pipeline, route"
            ),
        ),
        Panel(
            "Gateway in-flight and bytes/s",
            "Requests being served, and request/answer body bytes per second.",
            "short",
            (
                (
                    f"sum by (pipeline) ({c.gauge('disagg_gateway_inflight_requests')}"
                    f"{{{_PIPELINE}}})",
                    "in flight",
                ),
                (
                    _rate(
                        c.counter("disagg_gateway_bytes_total"), _PIPELINE, "pipeline, direction"
                    ),
                    "bytes {{direction}}",
                ),
            ),
        ),
    ]


def _operator(c: Catalog) -> list[Panel]:
    duration = c.histogram("disagg_operator_reconcile_duration_seconds")
    decisions = c.counter("disagg_operator_scale_decisions_total")
    autoscaled = c.gauge("disagg_operator_autoscaled_replicas")
    replicas = c.gauge("disagg_operator_role_replicas")

    def share(state: str) -> str:
        return (
            f'max by (pipeline, role) ({replicas}{{{_OPERATOR},state="{state}"}}) / '
            f'max by (pipeline, role) ({replicas}{{{_OPERATOR},state="desired"}})'
        )

    return [
        Panel(
            "Scale decisions",
            "The operator's autoscaler decisions that changed a role's replicas, by direction "
            "(per rate interval).",
            "short",
            (
                (
                    f"sum by (pipeline, role, direction) "
                    f"(increase({decisions}{{{_OPERATOR}}}[$__rate_interval]))",
                    "{{role}} {{direction}}",
                ),
            ),
        ),
        Panel(
            "Autoscaled replicas",
            "Replicas the operator's autoscaler last decided per role.",
            "short",
            ((f"max by (pipeline, role) ({autoscaled}{{{_OPERATOR}}})", "{{role}}"),),
        ),
        Panel(
            "Rollout progress",
            "Per role, the share of its pods at the latest revision (updated / desired) and "
            "the share ready, as its workload last reported them to the operator: a rollout "
            "climbs to 1 step by step; one that stalls stays below it.",
            "percentunit",
            ((share("updated"), "updated {{role}}"), (share("ready"), "ready {{role}}")),
        ),
        Panel(
            "Reconciles/s and duration p99",
            "Reconciles per second by kind (spec, status), and their 99th percentile.",
            "short",
            (
                (f"sum by (kind) (rate({duration}_count[$__rate_interval]))", "{{kind}}/s"),
                (
                    f"histogram_quantile(0.99, sum by (kind, le) "
                    f"(rate({duration}_bucket[$__rate_interval])))",
                    "p99 {{kind}} (s)",
                ),
            ),
        ),
        Panel(
            "Reconcile errors/s by reason",
            "Failed reconciles (or conflicts with another owner) by reason.",
            "short",
            (
                (
                    f"sum by (kind, reason) "
                    f"(rate({c.counter('disagg_operator_reconcile_errors_total')}[$__rate_interval]))",
                    "{{kind}} {{reason}}",
                ),
            ),
        ),
        Panel(
            "Pipelines managed",
            "DisaggregatedPipelines the operator tracks.",
            "short",
            ((f"sum({c.gauge('disagg_operator_pipelines_managed')})", "pipelines"),),
        ),
        Panel(
            "API requests/s",
            "Requests to the Kubernetes API by client, verb and outcome.",
            "reqps",
            (
                (
                    f"sum by (client, verb, outcome) "
                    f"(rate({c.counter('disagg_operator_api_requests_total')}[$__rate_interval]))",
                    "{{client}} {{verb}} {{outcome}}",
                ),
            ),
        ),
    ]


def rows(c: Catalog) -> list[tuple[str, list[Panel]]]:
    """The dashboard's rows and their panels, in order."""
    return [
        ("Requests", _requests(c)),
        ("Queues and pools", _queues(c)),
        ("Edges", _edges(c)),
        ("Gateway", _gateway(c)),
        ("Operator", _operator(c)),
    ]
