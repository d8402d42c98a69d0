"""A replica of several ranks (issue 33): real `disagg role` processes under LocalPipeline,
rank 0 feeding every request to rank 1 (gloo), a rank killed mid-request."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from disagg_runtime.client import Client, RequestFailed, RequestTimeout
from disagg_runtime.role import ranks
from tests.integration.test_up import PIPELINES, local_pipeline, process_of, segments
from tests.support import wait_for


def child_ranks(parent: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rpartition(")")[2].split()[1]) == parent:
                found.append(int(entry))
    return found


@pytest.mark.parametrize(
    ("file", "mib"), [("ranks.yaml", 0), ("ranks.yaml", 16), ("ranks-nodes.yaml", 16)]
)
def test_every_rank_gets_the_inputs_and_takes_part(
    monkeypatch: pytest.MonkeyPatch, file: str, mib: int
):
    """ranks: 2 in one pod (16 MiB through the shared pool), and nodes: 2 (broadcast)."""
    with local_pipeline(file, monkeypatch) as (local, client):
        n = max(1, mib * 2**20 // 8)
        x = torch.arange(n, dtype=torch.float64)
        for _ in range(3):
            out = client.submit({"x": x})
            assert (out["world"], out["rank"]) == (2, 0)
            assert torch.equal(out["x"], x * 3)  # rank 0's x*1 + rank 1's x*2
        chunks = list(client.stream({"x": x[:4], "steps": 3}))
        assert [c["total"] for c in chunks[:3]] == [1.0, 3.0, 5.0]  # step + rank, summed
        [pid] = child_ranks(process_of(local, "tp").proc.pid)
        raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        env = dict(item.decode().partition("=")[::2] for item in raw if item)
        if file == "ranks.yaml":
            assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == ("1", "1", "2")
        else:  # the second rank set's first process: rank 1 of 2, local rank 0 of its "pod"
            assert env["DISAGG_NODE_RANK"] == "1" and "RANK" not in env


def test_a_killed_rank_fails_in_flight_requests_and_the_replica_restarts(
    monkeypatch: pytest.MonkeyPatch,
):
    with local_pipeline("ranks.yaml", monkeypatch) as (local, client):
        leader = process_of(local, "tp")
        [child] = child_ranks(leader.proc.pid)
        x = torch.ones(1024, dtype=torch.float64)
        assert torch.equal(client.submit({"x": x})["x"], x * 3)
        pending = client.submit_async({"x": x, "sleep": 1.0})
        time.sleep(0.3)  # both ranks are in the handler now
        os.kill(child, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(RequestFailed) as failed:
            pending.result(timeout=20)
        assert time.monotonic() - started < 15  # the pipeline's request timeout
        assert "rank 1" in str(failed.value) and "restarts" in str(failed.value)
        code = wait_for(lambda: leader.proc.poll(), 20, message="rank 0 to exit")
        assert code == ranks.RANK_LOST_EXIT
        assert not segments(f"{local.pipeline.name}-tp-"), "the replica left its pool behind"
        wait_for(lambda: local.deaths, 5, message="the launcher to see the death")
        local.scale("tp", 1, ready_timeout=60)  # what the supervisor or the kubelet does
        assert torch.equal(wait_for(lambda: answer(client, x), 40, message="an answer")["x"], x * 3)


def test_a_handler_that_writes_its_inputs_gets_private_copies_on_every_rank(
    monkeypatch: pytest.MonkeyPatch,
):
    """writes_inputs = True: 16 MiB in rank 0's pool, written in place on both ranks, and
    neither rank sees the other's write (rank 0 waits until rank 1 copied)."""
    with local_pipeline("ranks-inplace.yaml", monkeypatch) as (_, client):
        x = torch.arange(2 * 2**20, dtype=torch.float64)  # 16 MiB: through the pool
        for _ in range(3):
            assert torch.equal(client.submit({"x": x.clone()})["x"], x * 5)


def test_without_the_flag_a_write_on_rank_1_takes_the_replica_down_naming_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    """The same handler unflagged: rank 1's write hits the read-only mapping (SIGSEGV), the
    request fails naming rank 1, the replica restarts (what docs/troubleshooting.md says)."""
    doc = (PIPELINES / "ranks-inplace.yaml").read_text()
    file = tmp_path / "unflagged.yaml"
    file.write_text(doc.replace("ScaleInPlace", "ScaleInPlaceUnflagged"))
    with local_pipeline(str(file), monkeypatch) as (local, client):
        x = torch.arange(2 * 2**20, dtype=torch.float64)
        with pytest.raises(RequestFailed) as failed:
            client.submit({"x": x}, timeout=20)
        assert "rank 1" in str(failed.value) and f"code {-signal.SIGSEGV}" in str(failed.value)
        code = wait_for(lambda: process_of(local, "tp").proc.poll(), 20, message="rank 0 exits")
        assert code == ranks.RANK_LOST_EXIT


def answer(client: Client, x: torch.Tensor) -> Any:
    """The reply, or None while the client still learns the new replica's address."""
    try:
        return client.submit({"x": x}, timeout=5)
    except (RequestFailed, RequestTimeout):
        return None


def test_the_rank_feed_bench_measures_every_mode() -> None:
    from disagg_runtime.bench import ranks as bench

    rows = bench.measure_feed([4096, 2**20], repeats=3)
    assert sorted((r.size, r.mode) for r in rows) == sorted(
        (size, mode) for size in (4096, 2**20) for mode in bench.FEED_MODES
    )
    assert all(0 < r.median_us <= r.p90_us for r in rows)
    assert not segments("bench-ranks"), "the bench left its pool behind"


def test_the_feed_carries_trees_through_the_pool_and_refuses_foreign_notices() -> None:
    """Rank 0 -> rank 1 in two real processes: a tensor in rank 0's shared pool travels as an
    offset (read through rank 1's read-only mapping), one elsewhere as bytes, scalars in the
    tree; a notice of an unknown kind is a FeedError, not garbage."""
    import multiprocessing

    from disagg_runtime.local.ports import free_ports
    from disagg_runtime.memory.pool import shm_name
    from tests.integration import rank_handlers

    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    port, name = next(free_ports()), shm_name("itest-feed", "r")
    procs = [
        ctx.Process(target=rank_handlers.feed_peer, args=(rank, port, name, out)) for rank in (0, 1)
    ]
    for proc in procs:
        proc.start()
    got = {item[0]: item[1:] for item in (out.get(timeout=60) for _ in range(5))}
    for proc in procs:
        proc.join(30)
    assert [proc.exitcode for proc in procs] == [0, 0]
    assert got["mode"] == ("shm", "shm")
    assert got["a"][0] == [float(i) for i in range(16)]
    assert got["b"] == (True, [[1.0, 1.0]] * 3, [7, "s"])
    assert got["c"] == (None, True)
    assert "notice kind 99" in got["bad"][0]
    assert not segments("itest-feed")
