"""Pipeline documents whose roles run the handlers of `tests.integration.pipeline_handlers`,
for the tests that start role processes or runtimes themselves."""

from __future__ import annotations

import itertools
from typing import Any


def pipeline_doc(
    name: str,
    roles: list[tuple[str, str]],
    edges: list[dict[str, Any]] | None = None,
    *,
    relay: str = "auto",
    timeout: float = 10.0,
    concurrency: int = 4,
) -> dict[str, Any]:
    """A DisaggregatedPipeline; roles are (name, handler in pipeline_handlers), edges a
    linear chain through them unless given."""
    if edges is None:
        edges = [{"from": a, "to": b} for (a, _), (b, _) in itertools.pairwise(roles)]
    return {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggregatedPipeline",
        "metadata": {"name": name},
        "spec": {
            "image": "disagg-test:0",
            "transport": {
                "relay": relay,
                "poolSize": "8Mi",
                "minBlock": "64Ki",
                "requestTimeoutSeconds": timeout,
            },
            "roles": [
                {"name": n, "handler": f"pipeline_handlers:{h}", "concurrency": concurrency}
                for n, h in roles
            ],
            "edges": edges,
        },
    }
