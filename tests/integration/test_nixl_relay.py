"""The nixl relay between processes: concurrent senders, a sender killed between its WRITE
and its commit, a receiver killed under its sender, a receiver without nixl. (In-process
round trips, aborts, leases and flow control run in test_relays.py over every relay.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from disagg_runtime.memory.pool import MiB
from disagg_runtime.relay import Ingress, RelayError, connect
from tests.relay_rig import KEY, NIXL_MISSING, WAIT, Rig, write_key
from tests.support import REPO, wait_for

pytestmark = pytest.mark.skipif(NIXL_MISSING is not None, reason=f"no nixl: {NIXL_MISSING}")
PEER = [sys.executable, "-m", "tests.integration.nixl_peer"]


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    yield r
    r.close()


@pytest.fixture
def keyfile() -> Iterator[str]:
    with tempfile.TemporaryDirectory() as folder:
        yield write_key(folder)


def peer(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*PEER, *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # UCX reports vanished peers on stderr
        text=True,
        env=env,
    )


def line(proc: subprocess.Popen[str]) -> str:
    """The peer's next line of its own (NIXL logs to stdout too, with NIXL_LOG_LEVEL)."""
    assert proc.stdout is not None
    while True:
        text = proc.stdout.readline().strip()
        assert text, f"peer exited with {proc.wait(timeout=WAIT)}"
        if " NIXL " not in text:
            return text


def test_concurrent_sender_processes_share_one_pool(rig: Rig, keyfile: str) -> None:
    """Three processes push 4 MiB payloads into a 16 MiB pool at once: flow control holds
    them back, and every payload arrives whole, once."""
    ingress = rig.ingress("nixl", size=16 * MiB)
    senders = [
        peer("send", ingress.endpoint, keyfile, f"s{n}", "6", str(4 * MiB)) for n in range(3)
    ]
    seen = set()
    try:
        for _ in range(18):
            with ingress.recv(timeout=60) as msg:
                x = msg.payload["x"]
                index = int(msg.request_id.split("-")[1])
                assert x.numel() == 4 * MiB and bool((x == index).all()), msg.request_id
                seen.add(msg.request_id)
        for proc in senders:
            assert proc.wait(timeout=60) == 0
    finally:
        for proc in senders:
            proc.kill()
    assert seen == {f"s{n}-{i}" for n in range(3) for i in range(6)}
    assert ingress.pool.stats().used == 0


def test_a_sender_killed_after_its_write_frees_the_slot_at_its_lease(
    rig: Rig, keyfile: str
) -> None:
    ingress = rig.ingress("nixl", size=16 * MiB, lease_s=2.0)
    proc = peer("hang", ingress.endpoint, keyfile, str(8 * MiB))
    try:
        assert line(proc) == "written DONE"  # the WRITE landed; no commit will follow
        assert ingress.pool.stats().used == 8 * MiB
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=WAIT)
    finally:
        proc.kill()
    wait_for(lambda: ingress.pool.stats().used == 0, timeout=WAIT)
    assert ingress.stats().delivered == 0  # an uncommitted write is never delivered
    sender = rig.sender("nixl", ingress)  # and the ingress serves the next sender
    sender.send({"x": torch.full((8 * MiB,), 7, dtype=torch.uint8)}, request_id="next")
    with ingress.recv(timeout=WAIT) as msg:
        assert msg.request_id == "next" and bool((msg.payload["x"] == 7).all())


def test_a_receiver_killed_under_its_sender_fails_the_send_in_time(keyfile: str) -> None:
    proc = peer("receive", keyfile)
    relay = None
    try:
        endpoint = line(proc)
        relay = connect("nixl", endpoint, key=KEY, timeout=5.0)
        relay.send({"x": torch.ones(4 * MiB, dtype=torch.uint8)}, request_id="first")
        assert line(proc) == "got first"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=WAIT)
        with pytest.raises(RelayError):  # RelayTimeout is one: no hang past the timeout
            relay.send({"x": torch.ones(4 * MiB, dtype=torch.uint8)}, request_id="second")
    finally:
        if relay is not None:
            relay.close()
        proc.kill()


def test_a_receiver_without_nixl_says_so_in_its_welcome(tmp_path: Path, keyfile: str) -> None:
    """The receiver's process cannot import nixl: the sender's error names why."""
    fake = tmp_path / "nixl"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('nixl hidden by the test')\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = peer("receive", keyfile, env=env)
    try:
        endpoint = line(proc)
        with pytest.raises(RelayError, match=r"takes no nixl transfers: .*nixl hidden by the test"):
            connect("nixl", endpoint, key=KEY, timeout=WAIT)
    finally:
        proc.kill()


def test_writes_outside_the_registered_pool_are_refused_by_nixl(rig: Rig) -> None:
    """The one-sided WRITE is bounded by what the receiver registered, whatever a sender
    asks for: NIXL finds no registration that covers it (when the far list is prepared)."""
    from disagg_runtime.relay.backends import nixl
    from disagg_runtime.relay.backends.nixl_cache import SendCache

    ingress: Ingress = rig.ingress("nixl", size=4 * MiB)
    rig.sender("nixl", ingress)  # the pool is registered at the first nixl hello
    agent = nixl.process_agent()
    cache = SendCache(agent)
    src = torch.ones(MiB, dtype=torch.uint8)
    end = ingress.pool.backing.tensor.data_ptr() + 4 * MiB
    try:
        with pytest.raises(Exception, match="NOT_FOUND"):
            cache.prepare(
                [src],
                [(src.data_ptr(), MiB, 0)],
                "DRAM",
                [(end - MiB // 2, MiB, 0)],
                "DRAM",
                agent.name,
            )
    finally:
        cache.close()
