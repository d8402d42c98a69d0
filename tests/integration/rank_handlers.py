"""Handlers for the multi-rank tests (imported by name by the role processes)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist


class Reduce:
    """Every rank contributes `x * (rank + 1)`; the all-reduced sum comes back, so the
    output shows that every rank got the same inputs and took part."""

    def setup(self, ctx: Any) -> None:
        self.group, self.rank, self.world = ctx.group, ctx.rank, ctx.world_size

    def __call__(self, payload: dict[str, Any]) -> Any:
        time.sleep(float(payload.get("sleep", 0.0)))
        x = payload["x"].to(torch.float64) * (self.rank + 1)
        dist.all_reduce(x, group=self.group)
        out = {"x": x, "world": self.world, "rank": self.rank}
        if payload.get("steps"):
            return self._stream(out, int(payload["steps"]))
        return out

    def _stream(self, out: dict[str, Any], steps: int) -> Iterator[dict[str, Any]]:
        for step in range(steps):
            total = torch.tensor([float(step + self.rank)])
            dist.all_reduce(total, group=self.group)
            yield {"step": step, "total": float(total)}
