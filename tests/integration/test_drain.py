"""A replica stopped while a sender streams small (inline) requests at it loses none.

Two replica processes of one role, a client in this process. The client's view of the
replicas lags, as a sender's DNS view does behind a pod's deletion: it lists only replica
0, and keeps sending there while replica 0 drains (the last replica it knows; `not_draining`
keeps it). Replica 0's grace period runs out while requests still stream in, so it closes
amid traffic. Inline payloads get no receipt: before the relay `goodbye`, what was on its
way when the ingress closed (or was taken in while the role shut its workers down) was
lost, and those requests timed out (4 of about 2,500 in each run measured). With it, the
client reads the goodbye, picks afresh (now replica 1), and what crossed the goodbye is
still served."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from disagg_core.contract import Peer, RoleConfig, render_env, write_topology
from disagg_core.spec import load_pipeline_file
from disagg_runtime.client import Client, RequestFailed
from disagg_runtime.local.ports import free_ports
from disagg_runtime.local.supervisor import plan_local
from disagg_runtime.memory.pool import reclaim_stale, shm_prefix
from disagg_runtime.routing import dispatch
from tests.relay_rig import KEY, write_key
from tests.support import wait_for

HERE = Path(__file__).resolve().parent
PIPELINE = load_pipeline_file(HERE / "pipelines" / "restart.yaml")  # one role, `scale`
GRACE_S = 2.0  # replica 0's drain; shorter than the client's re-resolution period
SENDERS = 4
TIMEOUT_S = 10.0


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[list[tuple[RoleConfig, subprocess.Popen[bytes]]]]:
    topology_file = str(tmp_path / "topology.json")
    ports = free_ports()
    base = replace(
        plan_local(PIPELINE, ports, topology_file)[0], peer_key_file=write_key(str(tmp_path))
    )
    write_topology(base.topology, topology_file)
    started: list[tuple[RoleConfig, subprocess.Popen[bytes]]] = []
    for replica in (0, 1):
        config = replace(base, replica=replica, ingress_port=next(ports), metrics_port=next(ports))
        env = {**os.environ, **render_env(config), "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")]))
        with open(tmp_path / f"replica-{replica}.log", "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.integration.drain_role", str(GRACE_S)],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        started.append((config, proc))
    try:
        yield started
    finally:
        for _, proc in started:  # drained and gone, pools freed (a kill would leak them)
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=GRACE_S + 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)


def _listed_client(
    replicas: list[tuple[RoleConfig, subprocess.Popen[bytes]]],
    listed: list[str] | None = None,
    *,
    dispatch: str = "load",
) -> tuple[Client, list[str], list[str]]:
    """A client of the replicas whose lookup answers `listed` (a lagging DNS view the test
    edits in place; all of them by default), with the replicas' endpoints."""
    endpoints = [f"tcp://127.0.0.1:{config.ingress_port}" for config, _ in replicas]
    view = list(endpoints) if listed is None else listed

    def resolver(host: str, port: int) -> list[str]:
        return list(view)

    client = Client(
        [Peer("solo", ("solo.test:7000",))],
        ["solo"],
        pipeline=PIPELINE.name,
        pool_size=8 << 20,
        timeout=TIMEOUT_S,
        key=KEY,
        resolver=resolver,
        dispatch=dispatch,
    )
    return client, view, endpoints


def test_replica_stopped_under_a_stream_of_inline_requests_loses_none(
    replicas: list[tuple[RoleConfig, subprocess.Popen[bytes]]],
) -> None:
    # the client's lagging view: replica 0 only, until it re-resolves
    first = f"tcp://127.0.0.1:{replicas[0][0].ingress_port}"
    client, listed, endpoints = _listed_client(replicas, [first])
    # both replicas serve first (each answers a request sent straight to it)
    for endpoint in [*endpoints, endpoints[0]]:
        listed[:] = [endpoint]
        client.entries[0].endpoints(refresh=True)
        wait_for(lambda: _serves(client), 60, interval=0.2, message=f"{endpoint} serving")

    stop = threading.Event()
    outcomes: list[str] = []  # "ok", or the error

    def send(seed: int) -> None:
        i = 0
        while not stop.is_set():
            x = torch.full((256,), float(seed * 100_000 + i))
            try:
                out = client.submit({"x": x, "factor": 2.0})
                outcomes.append("ok" if torch.equal(out["x"], x * 2) else "wrong result")
            except RequestFailed as exc:
                outcomes.append(f"{type(exc).__name__}: {exc}")
            i += 1

    senders = [threading.Thread(target=send, args=(s,), daemon=True) for s in range(SENDERS)]
    try:
        for thread in senders:
            thread.start()
        time.sleep(0.5)
        before = len(outcomes)
        going = replicas[0][1]
        going.send_signal(signal.SIGTERM)  # drains GRACE_S, then closes while requests stream
        listed[:] = [endpoints[1]]  # its pod is out of DNS; the client has not looked yet
        going.wait(timeout=GRACE_S + 30)
        time.sleep(0.5)  # requests go on (to replica 1)
    finally:
        stop.set()
        for thread in senders:
            thread.join(timeout=TIMEOUT_S + 10)
        with contextlib.suppress(Exception):
            client.close()
    failed = [o for o in outcomes if o != "ok"]
    assert before > 0 and len(outcomes) > before + 100, (before, len(outcomes))
    assert not failed, f"{len(failed)} of {len(outcomes)} requests failed: {failed[:3]}"


def _serves(client: Client) -> bool:
    try:
        out = client.submit({"x": torch.ones(4), "factor": 3.0}, timeout=2.0)
    except RequestFailed:
        return False
    return bool(torch.equal(out["x"], torch.full((4,), 3.0)))


def test_replica_killed_under_a_stream_of_requests_loses_none(
    replicas: list[tuple[RoleConfig, subprocess.Popen[bytes]]],
) -> None:
    """kill -9 of one of two replicas while requests stream at both: the requests it held,
    and the small (inline, receipt-less) ones sent into its connection before the client
    saw that connection die, are moved to the other replica (request migration), not
    lost until their deadline. The client's view still lists the dead replica for a
    second, as DNS does after a pod dies."""
    client, listed, endpoints = _listed_client(replicas)
    for endpoint in endpoints:  # both serve first (each answers a request sent to it)
        listed[:] = [endpoint]
        client.entries[0].endpoints(refresh=True)
        wait_for(lambda: _serves(client), 60, interval=0.2, message=f"{endpoint} serving")
    listed[:] = list(endpoints)
    client.entries[0].endpoints(refresh=True)

    stop = threading.Event()
    outcomes: list[tuple[str, float]] = []  # ("ok" or the error, seconds it took)

    def send(seed: int) -> None:
        i = 0
        while not stop.is_set():
            x = torch.full((256,), float(seed * 100_000 + i))
            began = time.monotonic()
            try:
                out = client.submit({"x": x, "factor": 2.0, "sleep": 0.02})
                ok = "ok" if torch.equal(out["x"], x * 2) else "wrong result"
            except RequestFailed as exc:
                ok = f"{type(exc).__name__}: {exc}"
            outcomes.append((ok, time.monotonic() - began))
            i += 1

    senders = [threading.Thread(target=send, args=(s,), daemon=True) for s in range(SENDERS)]
    killed = replicas[0][1]
    try:
        for thread in senders:
            thread.start()
        time.sleep(0.5)
        before = len(outcomes)
        # killed while something is at it (load dispatch can leave one replica idle a moment)
        port = f":{replicas[0][0].ingress_port}"
        wait_for(
            lambda: any(e.endswith(port) for _, e in client.moves.inflight.replicas()),
            10,
            interval=0.001,
            message="a request in flight at replica 0",
        )
        killed.kill()
        killed.wait(timeout=30)
        time.sleep(1.0)
        listed[:] = [endpoints[1]]  # the dead replica leaves the lookup
        time.sleep(1.0)
    finally:
        stop.set()
        for thread in senders:
            thread.join(timeout=TIMEOUT_S + 10)
        with contextlib.suppress(Exception):
            client.close()
        # a SIGKILLed role cannot free its pool: what its next incarnation would reclaim
        reclaim_stale(shm_prefix(PIPELINE.name, "solo-0"), why="the killed replica's")
    failed = [o for o, _ in outcomes if o != "ok"]
    assert before > 0 and len(outcomes) > before + 50, (before, len(outcomes))
    assert not failed, f"{len(failed)} of {len(outcomes)} requests failed: {failed[:3]}"
    assert client.migrations >= 1  # some were at, or on their way to, the killed replica
    assert max(took for _, took in outcomes) < TIMEOUT_S / 2  # none waited out a deadline


def test_the_first_small_message_into_a_connection_that_died_is_resent_or_fails_clearly(
    replicas: list[tuple[RoleConfig, subprocess.Popen[bytes]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client's relay to replica 0 is open and idle when replica 0 is killed; the next
    small request goes to it at once (its id hashes there), while the lookup still lists
    it. Whether the client sees the connection drop before sending (PeerLost: sent again,
    elsewhere) or the socket takes the payload first (an inline payload has no receipt:
    moved once the dead connection is seen), it is served by replica 1 soon; never lost
    until its deadline."""
    client, listed, endpoints = _listed_client(replicas, dispatch="hash")
    killed = replicas[0][1]
    try:
        for endpoint in endpoints:  # a relay open to each
            listed[:] = [endpoint]
            client.entries[0].endpoints(refresh=True)
            wait_for(lambda: _serves(client), 60, interval=0.2, message=f"{endpoint} serving")
        listed[:] = list(endpoints)
        client.entries[0].endpoints(refresh=True)
        ids = (uuid.UUID(int=n) for n in itertools.count(1))
        first = next(u for u in ids if dispatch.rendezvous(endpoints, u.hex) == endpoints[0])
        later = uuid.uuid4
        monkeypatch.setattr(uuid, "uuid4", lambda: first)  # this request's id hashes to 0
        killed.kill()
        killed.wait(timeout=30)
        began = time.monotonic()
        x = torch.arange(64, dtype=torch.float32)
        future = client.submit_async({"x": x, "factor": 2.0})
        monkeypatch.setattr(uuid, "uuid4", later)
        out = future.result(timeout=TIMEOUT_S + 5)
        assert torch.equal(out["x"], x * 2)
        assert time.monotonic() - began < TIMEOUT_S / 2
    finally:
        with contextlib.suppress(Exception):
            client.close()
        reclaim_stale(shm_prefix(PIPELINE.name, "solo-0"), why="the killed replica's")
