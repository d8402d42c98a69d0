"""A request that moved (request migration gives each attempt a fresh id) and then timed
out is named by the id its caller knows, with its attempts: the caller and the logs of
the roles (which saw only the attempts' ids) can both be searched for it."""

from __future__ import annotations

import time

import pytest

from disagg_core.contract import Peer
from disagg_runtime.client import Client, RequestTimeout
from disagg_runtime.client.pending import Pending
from tests.relay_rig import KEY


def test_a_moved_request_that_times_out_names_its_first_id_and_its_last_attempt() -> None:
    client = Client([Peer("solo", ("127.0.0.1:9",))], ["solo"], key=KEY, timeout=0.5)
    first, last = "a" * 32, "b" * 32
    try:
        # what Moves leaves after two moves: the caller's id kept, the attempt's the key
        pending = Pending(client.exits, time.monotonic() + 0.2, first=first, moved=2)
        client._track(last, pending)
        with pytest.raises(RequestTimeout) as caught:
            pending.future.result(timeout=10)  # failed by the client's own expiry
    finally:
        client.close()
    message = str(caught.value)
    assert message.startswith(f"request {first} timed out"), message
    assert f"it moved 2 times, its last attempt {last}" in message


def test_a_request_that_never_moved_is_named_by_its_id() -> None:
    client = Client([Peer("solo", ("127.0.0.1:9",))], ["solo"], key=KEY, timeout=0.5)
    try:
        pending = Pending(client.exits, time.monotonic() + 0.2, first="c" * 32)
        client._track("c" * 32, pending)
        with pytest.raises(RequestTimeout, match=f"^request {'c' * 32} timed out after 0.5 s$"):
            pending.future.result(timeout=10)
    finally:
        client.close()
