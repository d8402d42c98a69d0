"""Handlers for test_gpu_ranks.py (imported by name by the role processes)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


class NcclReduce:
    """Each rank puts `x * (rank + 1)` on its own GPU and all-reduces it over NCCL."""

    def setup(self, ctx: Any) -> None:
        self.group, self.rank, self.device = ctx.group, ctx.rank, torch.cuda.current_device()
        self.backend = dist.get_backend(self.group)

    def __call__(self, payload: dict[str, Any]) -> dict[str, Any]:
        x = payload["x"].to(f"cuda:{self.device}") * (self.rank + 1)
        dist.all_reduce(x, group=self.group)
        return {"x": x.cpu(), "backend": self.backend, "device": self.device}
