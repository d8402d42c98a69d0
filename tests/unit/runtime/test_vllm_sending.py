"""The prefill engine's sending thread with a real decode ingress (no vLLM): it asks the
allow-list again at send time, so an endpoint taken out of `decodes_file` after the
scheduler allowed the request is refused then, with nothing sent and the blocks freed."""

from __future__ import annotations

import pathlib
import time

import torch

from disagg_runtime.engines.vllm.layout import KvLayout
from disagg_runtime.engines.vllm.params import SendTo
from disagg_runtime.engines.vllm.peers import DecodePeers
from disagg_runtime.engines.vllm.receiving import Loads
from disagg_runtime.engines.vllm.sending import Send, Sends
from disagg_runtime.relay import auth

LAYOUT = KvLayout("float32", 32, (2, 32, 128), ("l0",), "cpu:auto")


def _finished(sends: Sends, req_id: str, deadline_s: float = 20.0) -> None:
    deadline = time.monotonic() + deadline_s
    done: set[str] = set()
    while req_id not in done:
        assert time.monotonic() < deadline, f"send {req_id} never returned"
        done |= sends.finished()
        time.sleep(0.01)


def test_an_endpoint_removed_from_decodes_file_is_refused_at_send_time(
    tmp_path: pathlib.Path,
) -> None:
    key = auth.new_key()
    loads = Loads(
        {"l0": torch.zeros(16, 2, 32, 128)},
        LAYOUT,
        endpoint="tcp://127.0.0.1:0",
        key=key,
        pool_bytes=4 << 20,
        lease_s=60.0,  # an arrival stays (unclaimed) for the whole test
        pipeline="unit-vllm-send",
    )
    decodes = tmp_path / "decodes"
    decodes.write_text(f"# the decode replicas\n{loads.endpoint}\n")
    peers = DecodePeers.from_config({"decodes_file": str(decodes)})
    sends = Sends({"l0": torch.ones(16, 2, 32, 128)}, LAYOUT, key=key, lease_s=5.0, peers=peers)
    try:
        first = Send("r1", SendTo("t-1", loads.endpoint, "tcp"), (1, 2), 40)
        assert peers.check(first.order.decode).ok  # what the scheduler saw
        sends.start(first)
        _finished(sends, "r1")
        assert sends.stats.failed == 0 and sends.stats.bytes > 0
        deadline = time.monotonic() + 10
        while loads.waiting["arrived"] < 1:  # it landed (nobody claims it here)
            assert time.monotonic() < deadline, loads.waiting
            time.sleep(0.01)

        second = Send("r2", SendTo("t-2", loads.endpoint, "tcp"), (3,), 20)
        assert peers.check(second.order.decode).ok  # scheduled while still listed
        decodes.write_text("# scaled away\n")  # then the replica left the file
        sends.start(second)
        _finished(sends, "r2")
        assert sends.stats.refused == 1 and sends.stats.failed == 1
        assert sends.stats.last["transfer"] == "t-2" and sends.stats.last["bytes"] == 0
        time.sleep(0.3)
        assert set(loads._arrived) == {"t-1"}  # t-2 never reached the ingress
        assert sends.stats.requests == 2
    finally:
        sends.close()
        loads.close()


def test_without_peers_the_sending_thread_trusts_the_scheduler(tmp_path: pathlib.Path) -> None:
    """No allow-list given (the scheduler's check alone): a send to an ingress that is not
    there fails as a send, not as a refusal."""
    sends = Sends({"l0": torch.ones(4, 2, 32, 128)}, LAYOUT, key=auth.new_key(), lease_s=0.5)
    try:
        sends.start(Send("r1", SendTo("t-1", "tcp://127.0.0.1:9", "tcp"), (0,), 10))
        _finished(sends, "r1")
        assert sends.stats.failed == 1 and sends.stats.refused == 0
    finally:
        sends.close()
