"""A replica of two ranks on two GPUs (issue 33): real `disagg role` processes under
`LocalPipeline`, backend NCCL, one GPU per local rank; inputs fed by rank 0 (shm notice),
the handler's all-reduce on the GPUs. Skipped with fewer than two GPUs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs two CUDA devices (a replica of 2 ranks, one GPU each)",
)


def test_two_ranks_reduce_over_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    from disagg_core import spec
    from disagg_runtime.local.supervisor import LocalPipeline

    path = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)
    doc = {
        "apiVersion": "disagg.dev/v1alpha1",
        "kind": "DisaggregatedPipeline",
        "metadata": {"name": "disagg-gputest-ranks"},
        "spec": {
            "image": "local",
            "transport": {"poolSize": "96Mi", "minBlock": "64Ki", "requestTimeoutSeconds": 60},
            "roles": [{"name": "tp", "handler": "rank_gpu_handlers:NcclReduce", "ranks": 2}],
        },
    }
    with LocalPipeline(spec.parse_pipeline(doc), grace_s=5.0) as local:
        local.wait_ready(timeout=180)
        client = local.client(timeout=60)
        try:
            x = torch.arange(4 * 2**20, dtype=torch.float32)  # 16 MiB: through the pool
            out = client.submit({"x": x})
        finally:
            client.close()
    assert (out["backend"], out["device"]) == ("nccl", 0)
    assert torch.equal(out["x"], x * 3)
