"""`disagg bench pipeline`: what the role runtime adds per hop, against the bare relay.

Both figures come from one run. The bare relay is `bench transport`'s shm measurement
(payload to another process, tiny reply back). The pipeline is client -> `hop-1`
(identity) -> ... -> `sink` (answers a few bytes) -> client, all real `disagg role`
processes on shared memory; `hops` roles move the full payload, so the per-hop time is
the median end-to-end time divided by the number of full-size hops. Handlers do no
compute, so the difference is envelopes, dispatch, worker hand-off and bookkeeping.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from typing import Any

import torch

from disagg_core.spec import Pipeline, parse_pipeline
from disagg_runtime.bench.sizes import format_size, parse_size
from disagg_runtime.bench.transport import measure_remote
from disagg_runtime.local.supervisor import LocalPipeline


def chain(hops: int, pool_bytes: int) -> Pipeline:
    roles = [
        {"name": f"hop-{i}", "handler": "disagg_runtime.bench.handlers:identity"}
        for i in range(1, hops)
    ] + [{"name": "sink", "handler": "disagg_runtime.bench.handlers:summarize"}]
    edges = [{"from": a["name"], "to": b["name"]} for a, b in itertools.pairwise(roles)]
    return parse_pipeline(
        {
            "apiVersion": "disagg.dev/v1alpha1",
            "kind": "DisaggregatedPipeline",
            "metadata": {"name": "bench-chain"},
            "spec": {
                "image": "local",
                "transport": {"poolSize": pool_bytes, "requestTimeoutSeconds": 60},
                "roles": [{**r, "concurrency": 1} for r in roles],
                "edges": edges,
            },
        }
    )


def run(size: int, hops: int, repeats: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    bare_times, _, _ = measure_remote("shm", size, repeats)
    bare = statistics.median(bare_times)
    pool = 2 * (1 << max(20, (size + 4096 - 1).bit_length()))
    with LocalPipeline(chain(hops, pool)) as local:
        local.wait_ready()
        client = local.client(timeout=60)
        try:
            payload = {"x": torch.ones(size, dtype=torch.uint8)}
            times = []
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                result = client.submit(payload)
                times.append(time.perf_counter() - t0)
                if result != {"nbytes": size}:
                    raise RuntimeError(f"pipeline returned {result!r}")
        finally:
            client.close()
    end_to_end = statistics.median(times[1:])
    per_hop = end_to_end / hops
    return {
        "size_bytes": size,
        "hops": hops,
        "repeats": repeats,
        "bare_relay_ms": round(bare * 1e3, 3),
        "pipeline_ms": round(end_to_end * 1e3, 3),
        "per_hop_ms": round(per_hop * 1e3, 3),
        "per_hop_over_bare": round(per_hop / bare, 3),
    }


def run_cli(args: argparse.Namespace) -> int:
    try:
        size = parse_size(args.size)
    except ValueError as exc:
        print(f"disagg bench pipeline: {exc}", file=sys.stderr)
        return 2
    result = run(size, args.hops, args.repeats)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"{format_size(size)} over {args.hops} full-size hops: "
            f"bare shm relay {result['bare_relay_ms']:.2f} ms, "
            f"pipeline {result['pipeline_ms']:.2f} ms = {result['per_hop_ms']:.2f} ms per hop "
            f"({result['per_hop_over_bare']:.2f}x the bare relay)"
        )
    return 0
