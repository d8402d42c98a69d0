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


class ScaleInPlace:
    """Writes its input in place (`x *= rank + 2`) and all-reduces it: 5x with private
    inputs (2x on rank 0, 3x on rank 1); a rank that saw rank 0's write would add 6x."""

    writes_inputs = True

    def setup(self, ctx: Any) -> None:
        self.group, self.rank = ctx.group, ctx.rank

    def __call__(self, payload: dict[str, Any]) -> Any:
        x = payload["x"]
        x.mul_(self.rank + 2)
        total = x.to(torch.float64, copy=True)
        dist.all_reduce(total, group=self.group)
        return {"x": total}


class ScaleInPlaceUnflagged(ScaleInPlace):
    writes_inputs = False  # rank 1's write then hits the read-only mapping of rank 0's pool


def feed_peer(rank: int, port: int, pool_name: str | None, out: Any) -> None:
    """One end of test_ranks' feed round trip: rank 0 sends, rank 1 reports what it got."""
    import datetime
    import os

    from disagg_runtime.memory.pool import Pool
    from disagg_runtime.role import rankfeed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    try:
        feed = rankfeed.Feed(dist.group.WORLD, rank=rank)
        if rank == 0:
            pool = Pool.create(2**20, device="shm", min_block=2**16, name=pool_name)
            try:
                feed.use_pool(pool)
                feed.hello()
                in_pool = pool.backing.tensor[4096 : 4096 + 64].view(torch.float32)
                in_pool.copy_(torch.arange(16, dtype=torch.float32))
                elsewhere = torch.ones(3, 2, dtype=torch.bfloat16)
                feed.send(rankfeed.CALL, {"a": in_pool, "b": [elsewhere, 7, "s"], "c": None})
                dist.barrier()
                bad = torch.tensor([99, 10, 0, 0], dtype=torch.int64)  # not a kind of ours
                dist.broadcast(bad, 0)
                dist.barrier()
            finally:
                pool.close()
        else:
            hello = feed.receive()
            notice = feed.receive()
            got = notice.payload
            out.put(("mode", hello.payload["mode"], feed.mode))
            out.put(("a", got["a"].tolist()))
            out.put(("b", got["b"][0].dtype == torch.bfloat16, got["b"][0].tolist(), got["b"][1:]))
            out.put(("c", got["c"], notice.kind == rankfeed.CALL))
            dist.barrier()
            try:
                feed.receive()
                out.put(("bad", "accepted"))
            except rankfeed.FeedError as exc:
                out.put(("bad", str(exc)))
            dist.barrier()
            feed.close()
    finally:
        dist.destroy_process_group()
