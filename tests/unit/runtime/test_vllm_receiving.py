"""The decode engine's worker half with a real ingress and pool (no vLLM): an aborted load
is reported done once, an unclaimed transfer is freed by the lease on its own, and the
pool's segment goes with `close`."""

from __future__ import annotations

import os
import time

import torch

from disagg_runtime import relay as relays
from disagg_runtime.engines.vllm.layout import KvLayout
from disagg_runtime.engines.vllm.params import LoadFrom
from disagg_runtime.engines.vllm.receiving import Load, Loads
from disagg_runtime.relay import auth

LAYOUT = KvLayout("float32", 32, (2, 32, 128), ("l0",), "cpu:auto")


def test_abort_is_reported_done_and_unclaimed_transfers_expire() -> None:
    key = auth.new_key()
    caches = {"l0": torch.zeros(16, 2, 32, 128)}
    loads = Loads(
        caches,
        LAYOUT,
        endpoint="tcp://127.0.0.1:0",
        key=key,
        pool_bytes=4 << 20,
        lease_s=2.0,
        pipeline="unit-vllm",
    )
    segment = loads._pool.name
    try:
        assert segment is not None and os.path.exists(f"/dev/shm/{segment}")
        loads.start(Load("r1", LoadFrom("t-1", 40, "p"), (3, 4), 0))
        loads.abort("r1")
        assert loads.poll() == {"r1"} and loads.poll() == set()  # once
        assert loads.errors() == set()  # no load errors for blocks vLLM reuses
        sender = relays.connect("tcp", loads.endpoint, key=key, timeout=5)
        try:  # kept open until it landed: an inline send returns once queued
            sender.send({"kv": [[torch.ones(2, 2, 32, 128)]]}, request_id="t-1", timeout=5)
            deadline = time.monotonic() + 8
            while not loads.waiting["arrived"] and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            sender.close()
        assert loads.waiting["arrived"] == 1  # landed, nobody claims it
        while loads.waiting["arrived"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert loads.waiting == {"pending": 0, "arrived": 0}  # freed without an engine step
    finally:
        loads.close()
    assert not os.path.exists(f"/dev/shm/{segment}")
