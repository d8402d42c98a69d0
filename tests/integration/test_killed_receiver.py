"""A receiver killed (kill -9) while its sender waits for its reply (a grant: its pool is
full) sends nothing more: the sender finds the connection lost (PeerLost, so a role sends
the request to another replica, and the relay reads `gone`, so what else went on it is
reported lost). Before, the control lane's EOF raised a plain RelayError: the request
failed, and the relay was dropped without its loss noted, so the requests it had carried
were never reported and waited for their deadline (1 of 500 timed out at 30 s in the e2e
kill scenario, test_rollout)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from disagg_runtime.memory.pool import MiB
from disagg_runtime.relay import PeerLost, connect
from tests.relay_rig import KEY, WAIT, write_key
from tests.support import REPO

TIMEOUT_S = 30.0  # the send's own bound, as a request's deadline


@pytest.fixture
def keyfile() -> Iterator[str]:
    with tempfile.TemporaryDirectory() as folder:
        yield write_key(folder)


@pytest.mark.parametrize("kind", ["tcp"])
def test_a_sender_waiting_for_a_killed_receiver_finds_it_lost_at_once(
    keyfile: str, kind: str
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.held_receiver", keyfile, str(4 * MiB)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    relay = None
    try:
        endpoint = proc.stdout.readline().strip()
        relay = connect(kind, endpoint, key=KEY, timeout=WAIT)
        big = {"x": torch.ones(3 * MiB, dtype=torch.uint8)}
        relay.send(big, request_id="first", timeout=WAIT)  # held: the pool is nearly full
        assert proc.stdout.readline().strip() == "got first"
        outcome: list[BaseException | None] = []

        def second() -> None:
            assert relay is not None
            try:
                relay.send(big, request_id="second", timeout=TIMEOUT_S)
                outcome.append(None)
            except BaseException as exc:  # what the send raised, checked below
                outcome.append(exc)

        waiter = threading.Thread(target=second)
        waiter.start()
        time.sleep(1.0)  # it waits for a grant that cannot come while "first" is held
        assert not outcome, outcome
        started = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=WAIT)
        waiter.join(timeout=TIMEOUT_S + WAIT)
        took = time.monotonic() - started
        assert len(outcome) == 1 and isinstance(outcome[0], PeerLost), outcome
        assert took < 5.0, f"the send found its receiver lost after {took:.1f} s"
        assert relay.gone()
    finally:
        if relay is not None:
            relay.close()
        proc.kill()
        proc.wait(timeout=WAIT)
